"""Deflated majorant: a certified upper bound on ||T||_2 that keeps the symbol's phases where the norm lives
(proofs/S2.md, 'Deflated majorant').

The Toeplitz majorant (lipcheck.bounds.majorant) bounds |<Y, T X>| by (2 pi)^-2 int s(w) |y^(w)| |x^(w)| dw with
s >= ||S(w)||, and then, channel by channel, by x_c^T T_N(s) x_c. It drops the phases of S, which costs 5-20 % for
shifted signed kernels on small grids. Its per-channel form deflates: for X whose every channel is orthogonal to
the span of Q (N x k, the top eigenvectors of T_N(s)), sum_c x_c^T T_N(s) x_c <= delta ||X||^2 with delta >=
lambda_max of T_N(s) on span(Q)^perp. So, with U = span(Q) (x) R^C and Pi its orthogonal projector,

    ||Pi^perp T Pi^perp|| <= delta,

and the rest of T is computed exactly on U, where it has k C dimensions: A = Pi T Pi, the leakages Pi^perp T Pi
(Gram GC) and Pi T Pi^perp (Gram GB), all of the form sum_h (k x k) kron (C x C) from K_h Q and P_h. For x = a + b
(a in U, b in U^perp), ||T x||^2 <= ||A a + B b||^2 + (||Cm a|| + delta ||b||)^2 <= ||A a + B b||^2 +
(1 + eps) ||Cm a||^2 + (1 + 1/eps) delta^2 ||b||^2 (any eps > 0), and by a Schur complement on b (B B^T = GB)

    ||T||^2 <= tau  if  tau >= sigma + (1 + 1/eps) delta^2  and  [[tau I - (1 + eps) GC, A^T], [A, I - GB / sigma]]
                        is positive definite (a 2 k C x 2 k C matrix; it says tau I - (1 + eps) GC - sigma A^T (sigma I -
                        GB)^-1 A >= 0 and sigma > lambda_max(GB)).

That is Theorem D3. Its split of the cross term 2 ||Cm a|| delta ||b|| costs first order where the leakage Cm is
large (shifted kernels on a 32 x 32 grid: 15 % at k = 12). Theorem D4 works with M = T^T T instead, whose top
eigenvector is the same on both sides: for b in U^perp, ||T b||^2 <= m22 ||b||^2 with m22 from delta, c (T_N(s_up) <=
delta I + c Q Q^T) and ell2 >= ||Pi T Pi^perp||^2 (Lemma D2), and for x = a + b

    x^T M x <= a^T (M11 + X / g) a + (m22 + g) ||b||^2,   M11 = Pi M Pi,  X = Pi M Pi^perp M Pi,  any g > 0,

so ||T||^2 <= max(lambda_max(M11 + X / g), m22 + g): the coupling enters through X, second order in the part of the
top eigenvector outside U (0.43 % at that 32 x 32 layer, k = 12, docs/exactness.md). X has h^4 Kronecker terms, formed term by
term or through the heads' rank (lipcheck.bounds.gram_heads); where neither fits GRAM_BUDGET Theorem D3 is used. The phases inside U are kept exactly. Every matrix is formed in float64 with an
error bound in spectral norm (`_Approx`), the definiteness checked by a floating-point Cholesky factorisation with
Rump's shift (rounding.cholesky_certifies), and Q's departure from orthonormality is part of the error.
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch

from .. import gaussian, rounding
from . import gram_envelope as ge
from . import gram_heads as gh
from . import gram_lowrank as gl
from . import majorant as mj
from . import spectral as sp
from .approx import _Approx, _deflect, _kron_sum, _mm, _pairwise, _sub, _sym, _up  # noqa: F401  (tests reach them here)
from .deflation_plan import (GRAM_BUDGET, LOWRANK_MAX_K, choose_complement, d3_affordable,  # noqa: F401  (tests
                             default_k, default_k_gram, gram_affordable, planned_k, x_route)  # reach them here)
from .deflation_search import choose_gram_shift, choose_parameters, guided_basis  # noqa: F401  (tests reach it here)


# rounding.verified_lambda_max pads its guess from 1e-12 ||S||_F tenfold per failed Cholesky try: 20 tries reach
# 1e7 ||S||_F >= lambda_max, so a poor guess costs tries, never the certificate
CERTIFY_TRIES = 20


@dataclasses.dataclass
class DeflationBound:
    """upper >= ||T||_2 (certified); estimate: the bound's value before margins (sqrt of the best tau found
    numerically); k: token functions in U; delta: certified lambda_max of T_N(s_up) on span(Q)^perp (p's units);
    eps, sigma: the parameters of Theorem D3 (sigma in p's units squared; NaN where Theorem D4 gave the bound);
    seconds; margin: rounding allowances added (p's units); info: details (info['theorem']: 'D4' or 'D3';
    info['complement'] = sqrt(m22) and info['leakage'] = sqrt(ell2) for D4)."""
    upper: float
    estimate: float
    k: int
    delta: float
    eps: float
    sigma: float
    seconds: float
    margin: float
    info: dict


def envelope_toeplitz(p: sp.SSoGParams, H: int, W: int, *, k: int = 10, time_budget: float | None = None,
                      max_rounds: int | None = None):
    """(T_N(s_up) as stored (N x N), bound on its distance to the exact T_N(s_up), the majorant's result) for a
    certified even envelope s_up >= ||S(w)|| from lipcheck.bounds.majorant, in normalised(p)'s units, refined where
    the (k + 1)-th eigenvector of T_N(s_up) lives: what matters is delta, T_N(s_up) below its top k eigenvalues (the
    top of T is handled exactly on U)."""
    mb = mj.toeplitz_majorant(p, H, W, rtol=1e-2, time_budget=time_budget, max_rounds=max_rounds, target=k)
    cells = mb.info["cells"]
    t, t_err = mj.toeplitz_coefficients(cells["coefficients"], cells["centre"], cells["half_width"], H, W)
    sp._no_nan(t, "envelope Fourier coefficients")
    TN = mj.dense_toeplitz(t, H, W)
    return TN, _up(mj.stored_matrix_error(t_err, H, W, t.dtype)), mb


def eigh_descending(TN: torch.Tensor):
    """(all eigenvalues descending, their eigenvectors as columns) of the symmetric TN: computed once, any k read off
    by `top_eigenvectors`."""
    with sp.single_thread():
        ev, V = torch.linalg.eigh(TN)
    return ev.flip(0), V.flip(1)


def top_eigenvectors(TN: torch.Tensor, k: int, *, eig=None):
    """(eigenvalues descending (k + 1,), Q (N, k) with orthonormal columns up to rounding): the top of T_N(s_up).
    eig: `eigh_descending(TN)` where already computed."""
    ev, V = eigh_descending(TN) if eig is None else eig
    with sp.single_thread():
        Q = torch.linalg.qr(V[:, :k])[0]
    return ev[:k + 1], Q


def orthonormality_defect(Q: torch.Tensor) -> float:
    """eta >= ||Q^T Q - I||_2 (fl(Q^T Q) errs by <= gamma_{N+2} ||Q||_F^2 in norm). Then the exactly orthonormal
    basis Qbar = Q (Q^T Q)^(-1/2) of span(Q) has ||Q - Qbar||_2 <= eta (|sqrt(1 + x) - 1| <= |x|)."""
    N, k = Q.shape
    G = Q.T @ Q - torch.eye(k, dtype=Q.dtype, device=Q.device)
    fq = float(Q.square().sum()) * (1 + rounding.gamma(N * k + 2))
    eta = float(G.square().sum().sqrt()) * (1 + rounding.gamma(k * k + 4)) + rounding.gamma(N + 4) * fq
    if not eta < 0.25:
        raise ValueError(f"deflation basis far from orthonormal (||Q^T Q - I|| <= {eta:.3g}): not certified")
    return _up(eta)


def certify_delta(TN: torch.Tensor, tn_err: float, Q: torch.Tensor, guess: float | None, c: float) -> float:
    """delta >= lambda_max of the exact T_N(s_up) on span(Q)^perp: Cholesky of delta I - fl(T_N - c Q Q^T) (c >= 0),
    since x^T (T_N - c Q Q^T) x = x^T T_N x for x orthogonal to Q. Allowances: the stored T_N (tn_err), fl(c Q Q^T)
    (gamma_{k+2} c ||Q||_F^2) and the subtraction (u ||fl(.)||_F, doubled)."""
    u = rounding.unit_roundoff(TN.dtype)
    N, k = Q.shape
    Y = (c * Q) @ Q.T
    S = TN - Y
    S = (S + S.T) / 2
    fq = float(Q.square().sum()) * (1 + rounding.gamma(N * k + 2))
    extra = tn_err + rounding.gamma(k + 3) * c * fq + 3 * u * float(S.square().sum().sqrt())
    with sp.single_thread():
        lam = None if guess is None else torch.tensor(float(guess), dtype=S.dtype)
        mu = float(rounding.verified_lambda_max(S, lam=lam, tries=CERTIFY_TRIES))
    if not math.isfinite(mu):
        raise ValueError("the deflated envelope's Cholesky certificate failed at every pad: not certified")
    return _up(mu + extra)


def kernel_factors(q: sp.SSoGParams, H: int, W: int) -> list[dict]:
    """Per head, what applying K_h to token functions needs: the axis matrices (alpha folded into G_H), kappa_h =
    sum_m |alpha| (rounded up: ||K_h||_2 <= kappa_h) and rel_h, with ||fl(K_h X) - K_h X||_F <= kappa_h rel_h
    ||X||_F for the exact K_h: taps of gaussian.axis_matrix with relative error e (or <= tiny where flushed, so
    ||G^ - G||_2 <= e + (2n - 1) tiny) and the sums' rounding (gamma_{H+W+M+4})."""
    dt = q.WV.dtype
    M = q.alpha.shape[1]
    tiny = torch.finfo(dt).smallest_normal
    e = sp.tap_error(q)  # (h, M, 2)
    ey = e[..., 0] + (2 * H - 1) * tiny
    ex = e[..., 1] + (2 * W - 1) * tiny
    GH = gaussian.axis_matrix(H, q.mu[..., 0], q.sigma[..., 0]) * q.alpha[..., None, None]  # (h, M, H, H)
    GW = gaussian.axis_matrix(W, q.mu[..., 1], q.sigma[..., 1])
    kappa = q.alpha.abs().sum(1) * (1 + rounding.gamma(M + 2))
    out = []
    for h in range(q.num_heads):
        rel = float((q.alpha[h].abs() * (ey[h] + ex[h] + ey[h] * ex[h])).sum()) / max(float(kappa[h]), tiny) \
            + rounding.gamma(H + W + M + 4) * (1 + float(ey[h].max())) * (1 + float(ex[h].max()))
        out.append(dict(GH=GH[h], GW=GW[h], kappa=float(kappa[h]), rel=rel, H=H, W=W))
    return out


def apply_kernel(f: dict, X: _Approx, *, transpose: bool = False) -> _Approx:
    """K_h X (or K_h^T X) for the token functions in X's columns (N x m, row-major tokens), K_h q = sum_m alpha G_H q
    G_W^T. Error: ||fl(K_h X^) - K_h X^|| <= kappa_h rel_h ||X^||_F (kernel_factors) plus ||K_h|| e_X <= kappa_h e_X."""
    H, W = f["H"], f["W"]
    gh, gw = (f["GH"].transpose(-1, -2), f["GW"].transpose(-1, -2)) if transpose else (f["GH"], f["GW"])
    m = X.val.shape[1]
    Xr = X.val.T.reshape(m, H, W)
    KX = torch.einsum("mab,kbc,mdc->adkm", gh, Xr, gw).sum(-1).reshape(H * W, m)
    return _Approx(KX, _up(f["kappa"] * (f["rel"] * X.fro + X.err)))


def token_blocks(q: sp.SSoGParams, H: int, W: int, Q: torch.Tensor, eta: float, *, factors=None):
    """Per head, as _Approx of exact quantities for the orthonormal Qbar (span(Q)): (L_h = Q^T K_h Q,
    Z_h = (I - Q Q^T) K_h Q, K_h Q) and the same for K_h^T, from `apply_kernel` with Q standing for Qbar (error eta, so
    ||K_h Q - K_h Qbar|| <= kappa_h eta)."""
    Qa = _Approx(Q, eta)
    f = kernel_factors(q, H, W) if factors is None else factors
    out = []
    for h in range(q.num_heads):
        blocks = {}
        for name, tr in (("K", False), ("Kt", True)):
            kq = apply_kernel(f[h], Qa, transpose=tr)
            L = _mm(Qa, kq, tX=True)
            blocks[name] = (L, _sub(kq, _mm(Qa, L)), kq)
        out.append(blocks)
    return out, torch.tensor([x["kappa"] for x in f], dtype=Q.dtype)


def head_projections(q: sp.SSoGParams) -> list[_Approx]:
    """P_h = W_V,h W_O,h formed in the dtype: entrywise error <= gamma_{d+2} |W_V,h| |W_O,h|, in norm <= gamma_{d+2} F_h."""
    P = q.head_projections()
    F = q.head_frobenius()
    return [_Approx(P[h], _up(rounding.gamma(q.head_dim + 2) * float(F[h]))) for h in range(q.num_heads)]


def certify_block(A: _Approx, GC: _Approx, GB: _Approx, delta: float, eps: float, sigma: float):
    """(tau certified with ||T||^2 <= tau, the value before padding) by Theorem D3 (proofs/S2.md) at the chosen
    eps, sigma. With e1 = fl(1 + eps), r = fl(1/sigma) the exact matrix is K of eps' = e1 - 1 (exact) and
    sigma' = 1/r; it is checked in the congruent form D K D, D = diag(I, s I) with s a power of two near
    sqrt(tau) (exact scalings; both diagonal blocks of the scale of tau, as Rump's shift is one scalar):
        [[fl(tau I - e1 GC), s A^T], [s A, s^2 fl(I - r GB)]],
    whose distance to the exact one is <= err = err_TL + s e_A + s^2 err_BR (the parts' errors and two roundings per
    entry of each diagonal block). D K D is positive definite when Cholesky of fl(. - err I) minus Rump's shift
    completes (rounding.cholesky_certifies). tau >= sigma' + (1 + 1/eps') delta^2 rounded up; on failure sigma and
    tau are padded tenfold from four Rump shifts (relative) until it passes."""
    u = rounding.unit_roundoff(torch.float64)
    e1 = 1.0 + eps
    eps_x = e1 - 1.0  # exact (Sterbenz): the eps of the theorem
    c_up = _up((delta * delta + delta * delta / eps_x) * (1 + 4 * u))
    n = A.val.shape[0]
    sq = math.sqrt(n) * (1 + 4 * u)
    j = round(math.log2(_up(sigma + c_up)) / 2)  # s^2 ~ tau: Rump's shift (one scalar) fits both blocks
    s, s2 = math.ldexp(1.0, j), math.ldexp(1.0, 2 * j)
    fro_gc = e1 * GC.fro
    TL = -(e1 * GC.val)
    pad = None
    for _ in range(CERTIFY_TRIES):
        if pad is None:  # the first pad: four Rump shifts (relative); the check itself decides about err
            tau_first = _up(sigma + c_up)
            pad = max(1e-12, 4 * rounding.gamma(2 * n + 1) * (n * tau_first + n * s2) / tau_first)
        sig = sigma * (1 + pad)
        r = 1.0 / sig
        tau0 = _up(_up(1.0 / r) + c_up)  # >= sigma' + (1 + 1/eps') delta^2
        tau = _up(tau0 * (1 + pad))
        BR = -(r * GB.val)
        BR.diagonal().add_(1.0)
        err_tl = e1 * GC.err + 3 * u * (fro_gc + 2 * tau * sq)
        err_br = r * GB.err + 3 * u * (r * GB.fro + 2 * sq)
        err = _up(err_tl + s * A.err + s2 * err_br)
        K = torch.cat([torch.cat([TL, s * A.val.T], 1), torch.cat([s * A.val, s2 * BR], 1)], 0)
        K[:n, :n].diagonal().add_(tau)
        K.neg_()  # exact
        with sp.single_thread():
            ok, _ = rounding.cholesky_certifies(K, torch.tensor(-err, dtype=torch.float64))
        if bool(ok):
            return tau, _up(sigma + c_up)
        pad *= 10
    raise ValueError("the deflated majorant's Cholesky certificate failed at every pad: not certified")


def _gram_kron(Ts: list[_Approx], Cs: list[list[_Approx]]) -> _Approx:
    """sym(sum_{i,j} (T_i^T T_j) kron C[i][j]): the Gram matrix of a map sum_i T_i kron (channel part i) in the
    coordinates (token function, channel), given its channel products C[i][j]; one home for GC, GB, M11 and X."""
    tt = _pairwise(Ts, Ts, tX=True)
    n = len(Ts)
    return _sym(_kron_sum([tt[i][j] for i in range(n) for j in range(n)],
                          [Cs[i][j] for i in range(n) for j in range(n)], transpose_P=False))


def block_matrices(q: sp.SSoGParams, H: int, W: int, Q: torch.Tensor, eta: float):
    """(A, GC, GB) of Theorem D3 as _Approx for U = span(Q) kron R^C (Q's columns orthonormal up to eta), each
    (k C x k C) with rows and columns (token function, channel): A = sum_h L_h kron P_h^T, GC = sum_{h,g}
    (Z_h^T Z_g) kron (P_h P_g^T), GB = the same with the Zt of K_h^T and P_h^T P_g (proofs/S2.md, 'The matrices')."""
    blocks, _ = token_blocks(q, H, W, Q, eta)
    P = head_projections(q)
    hh = range(q.num_heads)
    A = _kron_sum([blocks[h]["K"][0] for h in hh], P, transpose_P=True)  # (Q^T T Q): [(i,c),(j,d)] = L_h[i,j] P_h[d,c]
    GC = _gram_kron([blocks[h]["K"][1] for h in hh], _pairwise(P, P, tY=True))  # P_h P_g^T
    GB = _gram_kron([blocks[h]["Kt"][1] for h in hh], _pairwise(P, P, tX=True))  # P_h^T P_g
    return A, GC, GB


def gram_matrices(q: sp.SSoGParams, H: int, W: int, Q: torch.Tensor, eta: float, *, with_GB: bool = True):
    """(M11, X, GB) of Theorem D4 as _Approx for U = span(Q) kron R^C, each (k C x k C) with rows and columns (token
    function, channel), M = T^T T: M11 = Pi M Pi = sum_{h,g} (Q^T K_h^T K_g Q) kron (P_h P_g^T), X the Gram matrix of
    alpha -> Pi^perp M a = sum_{(h,g),(h',g')} (W_hg^T W_h'g') kron (F_hg F_h'g'^T) with W_hg = (I - Q Q^T) K_h^T K_g Q,
    F_hg = P_g P_h^T, and GB as in `block_matrices` (proofs/S2.md, 'Theorem D4'; None unless with_GB: only Lemma D2
    reads it). X has h^4 terms: formed term by term, or through the heads' rank where `x_route` says so
    (lipcheck.bounds.gram_heads)."""
    f = kernel_factors(q, H, W)
    blocks, _ = token_blocks(q, H, W, Q, eta, factors=f)
    Qa = _Approx(Q, eta)
    P = head_projections(q)
    hh = range(q.num_heads)
    pairs = [(h, g) for h in hh for g in hh]
    KQ = [blocks[h]["K"][2] for h in hh]
    pp = _pairwise(P, P, tY=True)  # P_h P_g^T
    M11 = _gram_kron(KQ, pp)
    GB = _gram_kron([blocks[h]["Kt"][1] for h in hh], _pairwise(P, P, tX=True)) if with_GB else None  # P_h^T P_g
    Wm = [_deflect(Qa, apply_kernel(f[h], KQ[g], transpose=True)) for h, g in pairs]
    if x_route(q.num_heads, Q.shape[1], q.dim) == "heads":
        return M11, gh.coupling_gram(q, Wm), GB
    F = [pp[g][h] for h, g in pairs]  # P_g P_h^T
    X = _gram_kron(Wm, _pairwise(F, F, tY=True))
    return M11, X, GB


def complement_gram_bound(delta: float, c: float, ell2: float) -> float:
    """m22 >= ||T b||^2 / ||b||^2 for b in U^perp (Lemma D2): the root (delta^2 + sqrt(delta^4 + 4 delta c ell2)) / 2,
    evaluated upwards: every operation on non-negative numbers errs by <= u relative plus half the smallest subnormal
    eta (underflow: delta^4 vanishes below delta ~ 1e-77), each covered by a factor (1 + 2u) and an added eta (the
    root increases in every input; a square root of a subnormal is normal, so relative)."""
    if not (delta >= 0 and c >= 0 and ell2 >= 0):
        raise ValueError(f"Lemma D2 needs delta, c, ell2 >= 0 (got {delta}, {c}, {ell2}): not certified")
    u = rounding.unit_roundoff(torch.float64)
    eta = rounding.tiny_subnormal(torch.float64)
    up = 1 + 2 * u

    def mul(a: float, b: float) -> float:
        return a * b * up + eta

    d2 = mul(delta, delta)
    inner = (mul(d2, d2) + mul(mul(mul(4.0, delta), c), ell2)) * up + eta
    return _up(((d2 + math.sqrt(inner) * up) * up / 2) * up + eta)


def lemma_d2(GB: _Approx, delta: float, c: float, eta: float) -> tuple[float, float]:
    """(m22, ell2) of Lemma D2 (proofs/S2.md): ell2 >= lambda_max(GB) (Cholesky-checked, plus GB's error) >=
    ||Pi T Pi^perp||^2 and m22 = complement_gram_bound(delta, c (1 + eta), ell2) >= ||T b||^2 / ||b||^2 on U^perp."""
    if not (delta >= 0 and c >= 0 and eta >= 0):
        raise ValueError(f"Lemma D2 needs delta, c, eta >= 0 (got {delta}, {c}, {eta}): not certified")
    u = rounding.unit_roundoff(torch.float64)
    with sp.single_thread():
        lb = float(rounding.verified_lambda_max(GB.val, tries=CERTIFY_TRIES))
    ell2 = _up(lb + GB.err)
    return complement_gram_bound(delta, _up(c * (1 + eta) * (1 + 2 * u)), ell2), ell2


def certify_d4(M11: _Approx, X: _Approx, m22: float):
    """(tau certified with ||T||^2 <= tau, the value before margins, g) by Theorem D4 (proofs/S2.md) for any m22 >=
    ||T b||^2 / ||b||^2 on U^perp: for r = fl(1/g) (g from choose_gram_shift; g' = 1/r exact) Lambda >=
    lambda_max(M11 + r X) of the exact matrices (the stored fl(M11^ + fl(r X^)) errs by <= e_M11 + r e_X + gamma_2
    (||M11^||_F + r ||X^||_F)) and tau = max(Lambda, m22 + g'), rounded up."""
    if not m22 >= 0:
        raise ValueError(f"Theorem D4 needs m22 >= 0 (got {m22}): not certified")
    g, est = choose_gram_shift(M11.val, X.val, m22)
    r = 1.0 / g
    S = M11.val + r * X.val
    err = _up(M11.err + r * X.err + rounding.gamma(2) * (M11.fro + r * X.fro))
    with sp.single_thread():
        lam = float(rounding.verified_lambda_max(S, lam=torch.tensor(est, dtype=S.dtype), tries=CERTIFY_TRIES))
    if not (math.isfinite(lam) and math.isfinite(m22)):
        raise ValueError("the Gram-deflated bound's Cholesky certificate failed at every pad: not certified")
    tau = max(_up(lam + err), _up(m22 + _up(1.0 / r)))
    if not math.isfinite(tau):
        raise ValueError("Theorem D4's bound came out non-finite: not certified")
    return tau, max(est, m22 + g), g


def certify_gram(M11: _Approx, X: _Approx, GB: _Approx, delta: float, c: float, eta: float):
    """(tau certified with ||T||^2 <= tau, the value before margins, details) by Theorem D4 with m22 from Lemma D2
    (`lemma_d2`, `certify_d4`)."""
    m22, ell2 = lemma_d2(GB, delta, c, eta)
    tau, est, g = certify_d4(M11, X, m22)
    return tau, est, dict(m22=m22, ell2=ell2, g=g)


def deflated_bound(p: sp.SSoGParams, H: int, W: int, *, k: int | None = None, time_budget: float | None = None,
                   max_rounds: int | None = None, envelope=None, complement: str = "auto",
                   envelope_budget: float | None = None, guide: torch.Tensor | None = None,
                   cache: dict | None = None) -> DeflationBound:
    """Certified ||T||_2 <= sqrt(tau) on an H x W grid by deflation (module docstring) with k token functions.

    complement: how ||T b|| is bounded on U^perp. 'gram': the circulant Gram envelope (lipcheck.bounds.gram_envelope,
    Lemma G2), then Theorem D4 (k default `default_k_gram`), or the envelope's own bound where that is smaller.
    'majorant': the Toeplitz majorant's envelope (k default `default_k`) through Lemma D2 and Theorem D4 where its
    h^4 terms fit GRAM_BUDGET, else Theorem D3; or the envelope's own majorant where that is smaller. 'auto':
    `choose_complement` ('majorant' when an envelope is passed). info['upper_from'] names what gave the bound.
    time_budget, max_rounds: the Toeplitz envelope's refinement (any stopping point is certified). By default it runs
    `majorant.planned_rounds` for the channel count and reads no clock, so the result does not depend on the
    machine's speed or load; a time_budget that stops it early is reported by the envelope (cut_short). envelope: (T_N, error, majorant result) from
    `envelope_toeplitz` to reuse across calls. envelope_budget: the circulant Gram envelope's budget for certified norms
    (gram_envelope.ENVELOPE_BUDGET by default). cache: a dict shared by calls on the same layer, grid and
    envelope_budget that differ in k ('gram' only): the envelope is computed once; cache['symbol_norm'], a
    SymbolNorm on normalised(p) with anchors already made, seeds the envelope's norms."""
    sp._check_grid_size(H, W)
    t0 = time.perf_counter()
    q = sp.normalised(p)
    sp.require_finite(q, "deflated majorant")
    if q.WV.dtype != torch.float64:
        raise ValueError("the deflated majorant is certified in float64 only: pass ssog_params(layer) in float64")
    if complement not in ("auto", "gram", "majorant"):
        raise ValueError(f"complement must be 'auto', 'gram' or 'majorant', got {complement!r}")
    N, C = H * W, q.dim
    if complement == "auto":
        complement = "majorant" if envelope is not None else choose_complement(H, W, C, q.num_heads, k)
    if complement == "gram":
        return _gram_deflated(q, H, W, default_k_gram(N, C) if k is None else max(1, min(int(k), N - 1)), t0,
                              envelope_budget=envelope_budget, guide=guide, cache=cache)
    k = default_k(N, C) if k is None else max(1, min(int(k), N - 1))
    TN, tn_err, mb = envelope if envelope is not None else envelope_toeplitz(p, H, W, k=k, time_budget=time_budget,
                                                                             max_rounds=max_rounds)
    ev, Q = top_eigenvectors(TN, k)
    eta = orthonormality_defect(Q)
    # c >= lambda_1 - lambda_{k+1}: T_N(s_up) <= delta I + c Q Q^T on all of R^N (Theorem D4 reads c; D3 only delta)
    c = max(float(ev[0]) - float(ev[k]), 0.0) * (1 + 1e-9)
    delta = certify_delta(TN, tn_err, Q, float(ev[k]), c=c)
    e = q.log2_scale
    if sp._scale_back(delta, e, up=False) >= mb.upper:
        # both theorems' tau exceed delta^2: neither can beat the envelope's own majorant (certified too), which is
        # returned; the k C x k C blocks are not built
        return DeflationBound(upper=mb.upper, estimate=mb.estimate, k=k, delta=sp._scale_back(delta, e, up=True),
                              eps=math.nan, sigma=math.nan, seconds=time.perf_counter() - t0, margin=mb.margin,
                              info=dict(majorant=mb.upper, envelope="majorant", envelope_bound=mb.upper, eta=eta,
                                        envelope_rounds=mb.rounds, kC=k * C,
                                        skipped="delta >= the envelope's majorant: k too small for this grid",
                                        errors=dict(delta_envelope=tn_err)))

    if gram_affordable(q.num_heads, k, C):
        M11, X, GB = gram_matrices(q, H, W, Q, eta)
        tau, tau_est, extra = certify_gram(M11, X, GB, delta, c, eta)
        eps = sigma = math.nan
        theorem, errors = "D4", dict(M11=M11.err, X=X.err, GB=GB.err, delta_envelope=tn_err)
        # in the layer's units as norms (their squares can leave the float range where the layer is scaled far)
        extra = dict(complement=sp._scale_back(math.sqrt(extra["m22"]), e, up=True),
                     leakage=sp._scale_back(math.sqrt(extra["ell2"]), e, up=True))
    else:
        A, GC, GB = block_matrices(q, H, W, Q, eta)
        eps, sigma = choose_parameters(A.val, GC.val, GB.val, delta, GB.err)
        tau, tau_est = certify_block(A, GC, GB, delta, eps, sigma)
        theorem, errors, extra = "D3", dict(GB=GB.err, GC=GC.err, A=A.err, delta_envelope=tn_err), {}
    margin_conv = q.conversion_error * q.magnitude()
    u = rounding.unit_roundoff(torch.float64)
    upper_n = sp._finite(math.sqrt(tau) * (1 + 2 * u) + margin_conv, "deflated majorant bound")
    upper = sp._scale_back(upper_n, e, up=True)
    # both are certified: with a coarse envelope (large delta, large leakage) the deflated bound can land above the
    # envelope's own majorant (measured with Theorem D3: 6.4 % against 3.8 % over ||T|| on a 4 x 4 grid)
    from_majorant = mb.upper < upper
    # estimate and margin describe the bound returned
    estimate = mb.estimate if from_majorant else sp._scale_back(math.sqrt(tau_est), e, up=False)
    margin = mb.margin if from_majorant else sp._scale_back(upper_n - math.sqrt(tau_est), e, up=True)
    return DeflationBound(upper=min(upper, mb.upper), estimate=estimate, k=k,
                          delta=sp._scale_back(delta, e, up=True), eps=eps,
                          sigma=sigma if theorem == "D4" else sp._scale_back(sigma, 2 * e, up=False),
                          seconds=time.perf_counter() - t0, margin=margin,
                          info=dict(majorant=sp._scale_back(mb.upper, 0, up=True), envelope="majorant",
                                    envelope_bound=mb.upper, eta=eta, envelope_rounds=mb.rounds,
                                    errors=errors, kC=k * C, theorem=theorem, deflated=upper,
                                    upper_from="majorant" if from_majorant else theorem, **extra))


def _gram_deflated(q: sp.SSoGParams, H: int, W: int, k: int, t0: float, *,
                   envelope_budget: float | None = None, guide: torch.Tensor | None = None,
                   cache: dict | None = None) -> DeflationBound:
    """Theorem D4 with the complement bounded by the circulant Gram envelope (Lemma G2): Q the top k eigenvectors of
    R_f, m22 >= lambda_max(R_f on span(Q)^perp) (`_gram_complement`: dense up to 32 x 32, low-rank beyond; R_f bounds
    T^T T, so m22 is already squared), M11 and X exactly on U; or the envelope's own tau_R >= lambda_max(R_f) where that is smaller. Needs
    gram_affordable(heads, k, C) (D3 would need GB and GC besides)."""
    d4 = gram_affordable(q.num_heads, k, q.dim)
    if not (d4 or d3_affordable(q.num_heads, k, q.dim)):
        raise ValueError(f"Theorems D4 and D3 with k = {k} exceed GRAM_BUDGET at {q.num_heads} heads, C = {q.dim}: "
                         f"pass a smaller k or complement='majorant'")
    env, tau_R, Q, eta, m22, info = _gram_complement(q, H, W, k, envelope_budget, guide, cache)
    e = q.log2_scale
    u = rounding.unit_roundoff(torch.float64)
    margin_conv = q.conversion_error * q.magnitude()
    info.update(envelope="gram", envelope_bound=None, eta=eta, kC=k * q.dim,
                complement=sp._scale_back(math.sqrt(m22), e, up=True), errors=dict(envelope=env))
    tau, est, upper_from = tau_R, tau_R, "envelope"
    if m22 < tau_R and d4:  # else no tau >= m22 can beat the envelope's own bound: the blocks are not built
        M11, X, _ = gram_matrices(q, H, W, Q, eta, with_GB=False)
        tau_d, est_d, g = certify_d4(M11, X, m22)
        info.update(theorem="D4", g=g, errors=dict(envelope=env, M11=M11.err, X=X.err))
    elif m22 < tau_R:  # Theorem D3 with ||Pi^perp T Pi^perp|| <= ||T Pi^perp|| <= sqrt(m22) (Lemma G2)
        tau_d, est_d, extra = _gram_d3(q, H, W, Q, eta, m22)
        info.update(theorem="D3", **extra)
    if m22 < tau_R:
        info["deflated"] = sp._scale_back(sp._finite(math.sqrt(tau_d) * (1 + 2 * u) + margin_conv,
                                                     "deflated bound"), e, up=True)
        if tau_d < tau_R:
            tau, est, upper_from = tau_d, est_d, info["theorem"]
    else:
        info["skipped"] = "m22 >= the envelope's own bound: k too small for this grid"
    env_upper = sp._scale_back(sp._finite(math.sqrt(tau_R) * (1 + 2 * u) + margin_conv, "circulant Gram bound"),
                               e, up=True)
    info.update(envelope_bound=env_upper, upper_from=upper_from)
    upper_n = sp._finite(math.sqrt(tau) * (1 + 2 * u) + margin_conv, "deflated bound")
    upper = sp._scale_back(upper_n, e, up=True)
    return DeflationBound(upper=upper, estimate=sp._scale_back(math.sqrt(est), e, up=False), k=k,
                          delta=info["complement"], eps=math.nan, sigma=math.nan,
                          seconds=time.perf_counter() - t0,
                          margin=sp._scale_back(upper_n - math.sqrt(est), e, up=True), info=info)


def _gram_d3(q: sp.SSoGParams, H: int, W: int, Q: torch.Tensor, eta: float, m22: float):
    """(tau, estimate, info) by Theorem D3 with delta = sqrt(m22) rounded up: h^2 Kronecker terms where neither of
    Theorem D4's routes to X fits."""
    A, GC, GB = block_matrices(q, H, W, Q, eta)
    # sqrt rounds by at most u relative: _up's factor 1 + 1e-12 covers it
    delta = _up(math.sqrt(m22))
    eps, sigma = choose_parameters(A.val, GC.val, GB.val, delta, GB.err)
    tau, est = certify_block(A, GC, GB, delta, eps, sigma)
    return tau, est, dict(eps=eps, sigma=sigma, errors=dict(A=A.err, GC=GC.err, GB=GB.err))


def _gram_complement(q: sp.SSoGParams, H: int, W: int, k: int, envelope_budget: float | None,
                     guide: torch.Tensor | None = None, cache: dict | None = None):
    """(envelope error, tau_R >= lambda_max(R_f), Q (N x k), eta, m22 >= lambda_max(R_f on span(Q)^perp), info) for
    the circulant Gram envelope (normalised units, squared). Up to 32 x 32 (gram_envelope.dense) R_f is stored: Q from
    its top eigenvectors (`guided_basis`), tau_R and m22 Cholesky-checked on it (with a guide, Q is not R_f's top
    eigenspace: c = 1024 lambda_1 pushes Q's directions far down, so lambda_max(R_f - c Q Q^T) is within about
    lambda_1 / 1000 of lambda_max(R_f on span(Q)^perp); the guess is then the eigensolver's). Beyond, f alone
    (lipcheck.bounds.gram_lowrank): Lanczos with FFT products, m22 by the low-rank split, tau_R by the same split
    without a projector (gram_lowrank.envelope_top; never above max f, R_f being a compression of the circulant with
    eigenvalues f). cache: a dict shared by calls on the same layer, grid and budget with other k (the default's
    retry): what does not depend on k (the envelope, tau_R, R_f's eigendecomposition) is computed once."""
    cache = {} if cache is None else cache
    if ge.dense(H, W):
        if "dense" not in cache:
            env = ge.gram_envelope(q, H, W, budget=envelope_budget, sn=cache.get("symbol_norm"))
            cache["dense"] = (env, ge.certified_top(env), eigh_descending(env.R))
        env, tau_R, eig = cache["dense"]
        ev, Q = top_eigenvectors(env.R, k, eig=eig)
        Q, r = guided_basis(Q, guide, k)
        eta = orthonormality_defect(Q)
        if r:
            m22 = certify_delta(env.R, env.err, Q, None, c=1024 * max(float(ev[0]), 0.0))
        else:
            c = max(float(ev[0]) - float(ev[k]), 0.0) * (1 + 1e-9)
            m22 = certify_delta(env.R, env.err, Q, float(ev[k]), c=c)
        return env.err, tau_R, Q, eta, m22, dict(envelope_seconds=env.seconds, envelope_norms=env.norms,
                                                 guide_profiles=r)
    t0 = time.perf_counter()
    if "lowrank" not in cache:
        f, norms = ge.torus_symbol_norms(q, H, W, budget=envelope_budget, sn=cache.get("symbol_norm"))
        cache["lowrank"] = (f, norms, gl.envelope_top(f, H, W))
    f, norms, (tau_R, top_level, top_columns) = cache["lowrank"]
    ev, Q = gl.top_vectors(f, H, W, k)
    Q, r = guided_basis(Q, guide, k)
    eta = orthonormality_defect(Q)
    d0 = gl.level_for(f, float(ev[0]), float(ev[k - r]))
    m22, columns = gl.complement_bound(f, H, W, Q, eta, d0)
    return 0.0, tau_R, Q, eta, m22, dict(envelope_seconds=time.perf_counter() - t0, envelope_norms=norms,
                                         complement_method="low-rank", split_level=d0, columns=columns,
                                         guide_profiles=r, top_level=top_level, top_columns=top_columns)
