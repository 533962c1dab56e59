"""Parameter search for the deflated majorant's block bound (lipcheck.bounds.deflation, Theorem D3 in proofs/S2.md).

Nothing here is part of a certificate: Theorem D3 holds for every eps > 0 and sigma > lambda_max(GB), and the
Cholesky check in deflation.certify_block decides whether the chosen pair proves the bound. These functions only make
the bound small: eigenvalue estimates (Lanczos, Rayleigh-Ritz on a block Krylov space) and a 2-parameter search.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import spectral as sp
from ..threads import limited


@limited()  # numpy's and scipy's BLAS on torch's thread count
def top_eigenvalue(matvec, n: int, v0) -> tuple[float, "np.ndarray"]:
    """(lambda_max, its eigenvector) of a symmetric operator given by matvec, by Lanczos from v0 (an estimate to
    choose parameters; never part of a bound)."""
    from scipy.sparse.linalg import LinearOperator, eigsh
    if n <= 64:  # eigsh needs n > 1; small operators densely
        M = np.stack([matvec(e) for e in np.eye(n)], 1)
        w, V = np.linalg.eigh((M + M.T) / 2)
        return float(w[-1]), V[:, -1]
    w, V = eigsh(LinearOperator((n, n), matvec=matvec, dtype=np.float64), k=1, which="LA", v0=v0, tol=1e-10)
    return float(w[0]), V[:, 0]


@limited()  # numpy's and scipy's BLAS on torch's thread count
def krylov_basis(apply, n: int, blocks: int, width: int, seed: int):
    """Orthonormal basis (n, <= blocks * width) of a block Krylov space of the symmetric operator `apply` (acting on
    n x width arrays) from a seeded random block: where the top eigenvectors of nearby operators live."""
    X = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, width)))[0]
    basis = [X]
    for _ in range(blocks - 1):
        Y = apply(basis[-1])
        Q = np.concatenate(basis, 1)
        for _ in range(2):  # twice is enough (Kahan)
            Y = Y - Q @ (Q.T @ Y)
        basis.append(np.linalg.qr(Y)[0])
    return np.concatenate(basis, 1)


@limited()  # numpy's and scipy's BLAS on torch's thread count
def choose_parameters(A: torch.Tensor, GC: torch.Tensor, GB: torch.Tensor, delta: float,
                      gb_err: float = 0.0) -> tuple[float, float]:
    """(eps, sigma) for Theorem D3 from eigenvalue estimates (any eps > 0 and sigma > lambda_max(GB) give a valid
    bound; these make it small). For fixed eps the best sigma solves sigma + c = phi(sigma), c = (1 + 1/eps) delta^2,
    phi(sigma) = lambda_max(F), F = (1 + eps) GC + sigma A^T (sigma I - GB)^-1 A, decreasing in sigma: a fixed-point
    iteration (phi's slope is second order in the leakage), bracketed by bisection. With GB = V diag(g) V^T once,
    F is cheap to apply. eps: golden-section search on log eps with phi from the Rayleigh-Ritz values of F on a
    block Krylov space of three reference operators (eps = 0.1, 1, 10: small dense problems), then sigma again at
    that eps with Lanczos on the full k C dimensions. sigma stays above lambda_max(GB) + 4 gb_err (GB's error
    bound) + 1e-9 ||T||^2, so that I - GB / sigma is positive definite with room for its errors."""
    with sp.single_thread():
        g, V = torch.linalg.eigh(GB)
    g, At, Gc = g.numpy(), (V.T @ A).numpy(), GC.numpy()
    n = Gc.shape[0]
    beta = max(float(g[-1]), 0.0)
    state = {"v0": np.ones(n)}
    # ||T||^2 on U (the scale of tau): sigma's floor keeps I - GB / sigma well away from its error (proofs/S2.md)
    scale = top_eigenvalue(lambda x: Gc @ x + At.T @ (At @ x), n, state["v0"])[0]
    floor = (beta + 4 * gb_err) * (1 + 1e-6) + 1e-9 * scale + 1e-300

    def apply(eps, sig, X):
        w = sig / (sig - g)
        return (1 + eps) * (Gc @ X) + At.T @ ((w * (At @ X).T).T)

    def phi_full(eps, sig):
        val, state["v0"] = top_eigenvalue(lambda x: apply(eps, sig, x), n, state["v0"])
        return val

    ref = max(2 * floor, 0.5 * scale)
    Z = np.linalg.qr(np.concatenate([krylov_basis(lambda X, e=e: apply(e, ref, X), n, 8, 4, i)
                                     for i, e in enumerate((0.1, 1.0, 10.0))], 1))[0]
    Gz, Az = Z.T @ Gc @ Z, At @ Z

    def phi_ritz(eps, sig):
        w = sig / (sig - g)
        F = (1 + eps) * Gz + Az.T @ (w[:, None] * Az)
        return float(np.linalg.eigvalsh((F + F.T) / 2)[-1])

    def best_sigma(eps, phi, start=None):
        c = (1 + 1 / eps) * delta * delta
        lo, hi = floor, 2 * floor
        for _ in range(200):  # phi is bounded as sigma grows: some hi has phi(hi) <= hi + c
            if phi(eps, hi) <= hi + c:
                break
            lo, hi = hi, 2 * hi
        sig = start if start is not None and lo < start < hi else hi
        for _ in range(60):
            val = phi(eps, sig)
            if val <= sig + c:
                hi = sig
            else:
                lo = sig
            if hi - lo <= 1e-10 * hi:
                break
            nxt = val - c  # the fixed-point step (it alternates around the root), kept inside the bracket
            sig = nxt if lo < nxt < hi else (lo + hi) / 2
        return hi + c, hi

    cache = {}

    def value(t):  # t = log eps
        if t not in cache:
            cache[t] = best_sigma(math.exp(t), phi_ritz)
        return cache[t][0]

    lo, hi = math.log(0.01), math.log(100.0)
    r = (math.sqrt(5) - 1) / 2
    x1, x2 = hi - r * (hi - lo), lo + r * (hi - lo)
    for _ in range(16):  # the interval shrinks to 0.05 % of log(1e4): eps within 0.5 % of the minimiser
        if value(x1) <= value(x2):
            hi, x2 = x2, x1
            x1 = hi - r * (hi - lo)
        else:
            lo, x1 = x1, x2
            x2 = lo + r * (hi - lo)
    t = min(cache, key=lambda t: cache[t][0])
    eps = math.exp(t)
    return eps, best_sigma(eps, phi_full, start=cache[t][1])[1]


@limited()  # numpy's and scipy's BLAS on torch's thread count
def choose_gram_shift(M11: torch.Tensor, X: torch.Tensor, m22: float, *, tol: float = 1e-12,
                      steps: int = 40) -> tuple[float, float]:
    """(g, lambda_max(M11 + X / g)) for Theorem D4: tau = max(lambda(g), m22 + g), lambda(g) = lambda_max(M11 + X / g)
    (convex and decreasing in g, X >= 0), is smallest where lambda(g) = m22 + g. Newton's method on the convex,
    decreasing h(g) = lambda(g) - m22 - g (h' = -v^T X v / g^2 - 1 at the top eigenvector v) from a g with h(g) >= 0
    increases monotonically to the root. An estimate only: any g > 0 gives a certified bound."""
    A, B = M11.numpy(), X.numpy()
    n = A.shape[0]
    def top(g, v):  # (lambda(g), its eigenvector), warm-started at v
        return top_eigenvalue(lambda x: A @ x + (B @ x) / g, n, v)

    lam0, v = top_eigenvalue(lambda x: A @ x, n, None)
    scale = max(lam0, m22, 1e-300)
    g = max(lam0 - m22, 1e-3 * scale)
    lam, v = top(g, v)
    for _ in range(steps):  # a start left of the root (h >= 0), else lambda(g) <= m22 + g already
        if lam >= m22 + g or g < 1e-12 * scale:
            break
        g /= 10
        lam, v = top(g, v)
    for _ in range(steps):
        h = lam - m22 - g
        if h <= tol * scale:
            break
        g = g + h / (1 + float(v @ (B @ v)) / g ** 2)
        lam, v = top(g, v)
    return g, lam


def guided_basis(Q_env: torch.Tensor, guide: torch.Tensor | None, k: int) -> tuple[torch.Tensor, int]:
    """(Q (N x k) with orthonormal columns up to rounding, r): the leading r <= k / 2 token profiles of guide (left
    singular vectors of its N x C matrix with singular values above 1e-6 of the first, above the float32 rounding
    the guide passes through), then the envelope's top
    eigenvectors Q_env with those projected out. No guide: Q_env itself, r = 0. Any Q is sound; this one puts T's
    top singular vector (nearly) inside U."""
    if guide is None:
        return Q_env, 0
    N = Q_env.shape[0]
    # rounded to float32 first: a Ritz vector can differ in its last bits between two runs (BLAS paths depend on
    # memory alignment), and the bound should not
    G = guide.reshape(N, -1).to(torch.float32).to(Q_env.dtype)
    if not bool(torch.isfinite(G).all()) or float(G.abs().max()) == 0.0:
        return Q_env, 0
    with sp.single_thread():
        U, s, _ = torch.linalg.svd(G / G.abs().max(), full_matrices=False)
        r = min(k // 2, int((s > 1e-6 * s[0]).sum()))
        A = U[:, :r]
        rest = Q_env - A @ (A.T @ Q_env)
        Q = torch.linalg.qr(torch.cat([A, rest[:, :k - r]], 1))[0]
    return Q, r
