"""Certification: every reported value is ||J(X) v|| / ||v|| re-evaluated in float64 at the returned X
(||X||_F <= R checked in float64) and an actual vector v: a Jacobian norm attained at an actual input, hence
a certified lower bound on L(R) whatever the search or the eigensolver did.

v is the top Ritz vector of Lanczos on J^T J (full reorthogonalisation, float64), started from the search's
own vector and stopped once the relative residual ||J^T J y - theta y|| / theta of the top Ritz pair is <= the
stated tolerance (`certify_tol`, or after `certify_steps`); the residual reached is reported. The float64
evaluation of ||J v|| is not enclosed in intervals: the number may exceed the exact ||J(X) v|| by its
rounding error, of order 1e-16 times the depth of the computation (relative).
"""
from __future__ import annotations

import copy
import math

import torch
from torch.func import jacrev

from .balls import unit
from .maps import functional
from .tangents import jtj_of

CERTIFY_METHODS = ("auto", "lanczos", "dense", "subspace")  # "subspace": the former name, now Lanczos


def lanczos_top(jtj, X: torch.Tensor, v0: torch.Tensor, *, tol: float = 1e-6, max_steps: int = 60,
                progress: bool = False):
    """Top Ritz pair of J^T J per sample by Lanczos with full reorthogonalisation, batched over X (S, N, C).

    Started from v0 (the search's own vector); sample s stops at the first step where the relative
    residual rel = beta_k |y_k| / theta = ||J^T J y - theta y|| / theta of its top Ritz pair (theta, y)
    is <= tol, on breakdown (an invariant subspace: rel ~ 0), or after max_steps. Converged samples
    leave the batch, so each sample's result is that of a run on it alone.
    Returns (y (S, N, C) unit Ritz vectors, theta (S,), rel (S,), steps (S,) int)."""
    S, shape = X.shape[0], X.shape[1:]
    n = X[0].numel()
    dev, dt = X.device, X.dtype
    out_y = torch.zeros(S, n, dtype=dt, device=dev)
    out_theta = torch.zeros(S, dtype=dt, device=dev)
    out_rel = torch.full((S,), math.inf, dtype=dt, device=dev)
    out_steps = torch.zeros(S, dtype=torch.long, device=dev)
    idx = torch.arange(S, device=dev)
    q = unit(v0.to(X).reshape(S, n))
    Xa, Q, alphas, betas = X, [q], [], []
    q_prev, b_prev = torch.zeros_like(q), torch.zeros(S, dtype=dt, device=dev)
    max_steps = max(1, min(int(max_steps), n))
    it = range(max_steps)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="certify (Lanczos)", unit="step", leave=False)
    for j in it:
        w = jtj(Xa, q.reshape(-1, *shape))[0].reshape(-1, n)
        a = (q * w).sum(1)
        w = w - a[:, None] * q - b_prev[:, None] * q_prev
        Qm = torch.stack(Q, 1)  # (Sa, j + 1, n)
        for _ in range(2):  # full reorthogonalisation, twice is enough (Kahan)
            w = w - torch.einsum("skn,sk->sn", Qm, torch.einsum("skn,sn->sk", Qm, w))
        b = w.norm(dim=1)
        alphas.append(a)
        T = torch.diag_embed(torch.stack(alphas, 1))
        if betas:
            off = torch.diag_embed(torch.stack(betas, 1), offset=1)
            T = T + off + off.transpose(1, 2)
        evals, evecs = torch.linalg.eigh(T)
        theta, s = evals[:, -1], evecs[:, :, -1]
        rel = b * s[:, -1].abs() / theta.abs().clamp_min(torch.finfo(dt).tiny)
        done = (rel <= tol) | (b <= 64 * torch.finfo(dt).eps * theta.abs()) | torch.tensor(j == max_steps - 1, device=dev)
        if bool(done.any()):
            i = idx[done]
            out_y[i] = torch.einsum("skn,sk->sn", Qm[done], s[done])
            out_theta[i], out_rel[i], out_steps[i] = theta[done], rel[done], j + 1
        keep = ~done
        if not bool(keep.any()):
            break
        idx, Xa = idx[keep], Xa[keep]
        Q = [t[keep] for t in Q]
        alphas = [t[keep] for t in alphas]
        betas = [t[keep] for t in betas] + [b[keep]]
        q_prev, b_prev = q[keep], b[keep]
        q = w[keep] / b[keep][:, None]
        Q.append(q)
    return unit(out_y).reshape(S, *shape), out_theta, out_rel, out_steps


def certify(tangent, X: torch.Tensor, v0: torch.Tensor | None = None, *, method: str = "auto", steps: int = 60,
            tol: float = 1e-6, f=None, generator: torch.Generator | None = None, progress: bool = False):
    """Certified ||J_f(X)||_2 lower bounds for a batch X (S, N, C) (float64 in, float64 out).

    tangent: the float64 tangent map (X, V) -> (f(X), J V) on batches. Returns (value (S,), v (S, N, C) unit,
    rel (S,), steps (S,)): value = ||J v|| for that actual v, recomputed in float64 after the eigensolver.
    "lanczos" ("auto", "subspace"): v is the top Ritz vector of `lanczos_top` from v0 (random where None),
    rel the relative residual it reached. "dense": v is the top right singular vector of the dense
    Jacobian (jacrev of the single-grid map f + SVD; small grids only), rel 0."""
    if method not in CERTIFY_METHODS:
        raise ValueError(f"unknown certify method {method!r}; choose one of {CERTIFY_METHODS}")
    S, N, C = X.shape
    n = N * C
    if method == "dense":
        if f is None:
            raise ValueError("certify(method='dense') needs the single-grid map f (X (N, C) -> (N, C))")
        vs = []
        for s in range(S):  # one dense Jacobian at a time keeps memory at n^2
            J = jacrev(f)(X[s]).reshape(n, n)  # [out, in]
            vs.append(torch.linalg.svd(J)[2][0].reshape(N, C))
        v = torch.stack(vs)
        rel = torch.zeros(S, dtype=X.dtype, device=X.device)
        nsteps = torch.zeros(S, dtype=torch.long, device=X.device)
    else:
        if v0 is None:
            v0 = torch.randn(X.shape, dtype=torch.float64, generator=generator).to(X)  # CPU generator, any device
        v, _, rel, nsteps = lanczos_top(jtj_of(tangent), X, v0, tol=tol, max_steps=steps, progress=progress)
    v = unit(v)
    value = tangent(X, v, False)[1].flatten(1).norm(dim=1)  # the certified number: ||J v|| at an actual (X, v)
    return value, v, rel, nsteps


def candidates(best: torch.Tensor, kinds: list, certify_top: int) -> list:
    """(radius index, restart index) of each radius's most promising restarts (best (radii, restarts) search
    values): its certify_top best, plus its best witness-started one, to report what the witnesses reach."""
    cand = []
    for r in range(best.shape[0]):
        top = torch.argsort(best[r], descending=True)[:certify_top].tolist()
        wit = [i for i, kd in enumerate(kinds[r]) if kd == "witness"]
        if wit:
            wi = max(wit, key=lambda i: float(best[r, i]))
            top += [wi] if wi not in top else []
        cand += [(r, i) for i in top]
    return cand


def inside_balls(X64: torch.Tensor, radii: list, device) -> torch.Tensor:
    """X64 (S, N, C) moved strictly inside its ball ||X_s||_F <= radii[s] in float64 (the search projected in
    its own dtype), and checked there."""
    Rc = torch.tensor(radii, dtype=torch.float64, device=device).reshape(-1, 1, 1)
    n64 = X64.flatten(1).norm(dim=1).reshape(-1, 1, 1)
    X64 = torch.where(n64 > Rc * (1 - 1e-13), X64 * (Rc * (1 - 1e-12) / n64), X64)
    if not bool((X64.flatten(1).norm(dim=1).reshape(-1, 1, 1) <= Rc).all()):
        raise RuntimeError("internal error: a certified input left its ball ||X||_F <= R")
    return X64


def certify_candidates(tan64, module, grid: tuple[int, int], cand: list, bestX: torch.Tensor, bestv: torch.Tensor,
                       radii: list, options, *, device, progress: bool = False):
    """`certify` at the candidates' inputs and vectors (bestX, bestv (radii, restarts, N, C)), all radii in one
    batch (or one radius at a time when not options.batch_radii: the same numbers).
    Returns (X64, value, v, rel, steps), one row per candidate in `cand`'s order."""
    ri = torch.tensor([c[0] for c in cand], device=device)
    si = torch.tensor([c[1] for c in cand], device=device)
    X64 = inside_balls(bestX[ri, si].to(torch.float64), [radii[r] for r, _ in cand], device)
    f64 = functional(copy.deepcopy(module), *grid, device=device, dtype=torch.float64) \
        if options.certify_method == "dense" else None
    V64 = bestv[ri, si].to(torch.float64)
    kw = dict(method=options.certify_method, steps=options.certify_steps, tol=options.certify_tol, f=f64)
    if options.batch_radii:
        return (X64,) + certify(tan64, X64, V64, progress=progress, **kw)
    parts = [certify(tan64, X64[ri == r], V64[ri == r], **kw) for r in range(len(radii))]
    return (X64,) + tuple(torch.cat([p[i] for p in parts]) for i in range(4))
