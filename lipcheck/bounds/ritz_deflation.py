"""Theorem D4 on a Ritz subspace of T^T T, the complement bounded by the channel-resolved envelope (proofs/S2.md,
'Theorem D5').

The deflated bound (lipcheck.bounds.deflation) deflates U = span(Q) (x) R^C: k token functions times every channel,
and bounds the complement by the scalar envelope R_f (x) I, whose top eigenvalues repeat C times. Where the symbol's
phases or its channels matter (kernels at the sigma floor, twelve heads at C = 768), R_f's (k + 1)-th eigenvalue stays
above ||T||^2 for every k C that fits. Here U is the span of K Ritz vectors of M = T^T T (vectors of R^(N C), no
tensor structure), the complement is bounded by R_F <= d I + A^T A (lipcheck.bounds.channel_envelope, Lemma G4):

    m22 = d + ||P A^T||^2 >= ||T b||^2 / ||b||^2 on U^perp,

and Theorem D4 (its proof reads nothing of U but m22) gives ||T||^2 <= max(lambda_max(M11 + X / g), m22 + g) with
M11 = Qbar^T M Qbar and X the Gram matrix of Pi^perp M Qbar, both K x K, from one certified product M Q
(`gram_blocks`: the fast operator's rounding bound, proofs/S2.md 'Lower bound'). K Ritz vectors span T's top
singular subspace closely, so X is second order in their residuals, and R_F's eigenvalues above ||T||^2 are few
(tens where R_f (x) I has thousands), so m22 falls below ||T||^2 at K of tens to hundreds.
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch

from .. import rounding
from . import spectral as sp
from .approx import _Approx, _deflect, _mm, _Normed, _sym, _up
from .channel_envelope import channel_envelope, check_work, symbol_bounds
from .deflation import certify_d4, orthonormality_defect
from .gram_lowrank import _level_plus_norm2

# the split level of the envelope as a share of the top Ritz value (a tuning choice; any level is sound): m22 lands
# near max(level, lambda_max(R_F on U^perp)), and Theorem D4 needs it clearly below ||T||^2
LEVEL_SHARE = 0.8
# Ritz vectors: block Krylov with restarts, the block EXTRA wider than K, STEPS blocks per cycle, CYCLES cycles
EXTRA = 16
STEPS = 4
CYCLES = 4
# the Ritz space is doubled from K_START while m22 stays above this share of the top Ritz value, up to K_MAX
K_START = 48
K_MAX = 384
M22_SHARE = 0.97
# and stops doubling where m22 is above the top Ritz value and fell by less than 1 - STALL from the K before (C = 768,
# frozen kernels at 8 x 8: 13923, 13904, 13898, 13892 at K = 48 to 384, theta_1 = 11891)
STALL = 0.99
# float64 N C-long vectors held at once: the Krylov blocks (2 STEPS (K + EXTRA)) and the envelope's rows with their
# deflected copy (2 m) each within this many bytes
MEMORY = 4e9
# the envelope's splits, counted as (hot frequencies) C^2 (small eigendecompositions run far below their C^3 rate):
# measured on 2 cores, 3.2e7 units took about 120 s at C = 192 (860 frequencies, 32 x 32), 4.8e7 about 90 s at
# C = 768 (82 frequencies, 8 x 8)
WORK = 6e7


@dataclasses.dataclass
class RitzBound:
    """tau >= ||T||^2 certified (normalised units); est: the value before margins; m22, level, K; top: the top
    Ritz vector (N C,); info."""
    tau: float
    est: float
    m22: float
    level: float
    K: int
    top: torch.Tensor
    info: dict


def apply_M(q: sp.SSoGParams, H: int, W: int, V: torch.Tensor) -> torch.Tensor:
    """fl(T^T fl(T V)) for the columns of V (N C x m), row-major (token, channel)."""
    m = V.shape[1]
    X = V.T.reshape(m, H, W, q.dim)
    return sp.apply_T_adjoint(sp.apply_T(X, q), q).reshape(m, -1).T


def _orth(B: list[torch.Tensor], V: torch.Tensor) -> torch.Tensor:
    for _ in range(2):  # twice is enough (Kahan)
        for b in B:
            V = V - b @ (b.T @ V)
    return torch.linalg.qr(V)[0]


def ritz_vectors(q: sp.SSoGParams, H: int, W: int, K: int, *, start: torch.Tensor | None = None,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(Ritz values descending (K,), vectors (N C x K)) of M = T^T T by block Krylov with restarts (EXTRA, STEPS,
    CYCLES), from `start` (columns kept first) and Gaussian columns of a fixed seed: the same call, the same vectors.
    A guide only: any vectors keep Theorem D4 sound."""
    n = H * W * q.dim
    b = K + EXTRA
    if STEPS * b >= n:  # the Krylov space would be all of R^n: M itself, column by column
        Mn = apply_M(q, H, W, torch.eye(n, dtype=torch.float64, device=q.WV.device))
        with sp.single_thread():
            theta, Y = torch.linalg.eigh((Mn + Mn.T) / 2)
        return theta.flip(0)[:K], Y.flip(1)[:, :K].contiguous()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    V = torch.randn(n, b, generator=gen, dtype=torch.float64).to(q.WV.device)
    if start is not None:
        s = start.reshape(n, -1)[:, :b]
        V[:, :s.shape[1]] = s
    V = torch.linalg.qr(V)[0]
    for _ in range(CYCLES):
        B, P = [V], []
        for i in range(STEPS):
            P.append(apply_M(q, H, W, B[-1]))
            if i < STEPS - 1:
                B.append(_orth(B, P[-1]))
        Bm, Pm = torch.cat(B, 1), torch.cat(P, 1)
        Hm = Bm.T @ Pm
        with sp.single_thread():
            theta, Y = torch.linalg.eigh((Hm + Hm.T) / 2)
        Y = Y.flip(1)[:, :b]
        V = torch.linalg.qr(Bm @ Y)[0]
        del B, P, Bm, Pm
    return theta.flip(0)[:K], V[:, :K]


def gram_blocks(q: sp.SSoGParams, H: int, W: int, Q: torch.Tensor, eta: float, apply_err: float,
                t_up: float) -> tuple[_Approx, _Approx]:
    """(M11, X) of Theorem D4 for U = span(Q) (Qbar its orthonormal basis, ||Q - Qbar|| <= eta), as _Approx.

    Y = fl(T^T fl(T Q)): per column ||fl(T v) - T v|| <= a ||v|| (a = apply_err; the adjoint is the same computation
    with W_O^T, W_V^T and -mu, whose taps carry the same bound), so ||fl(M v) - M v|| <= a (2 t + a) ||v|| (t >=
    ||T||), over the columns <= a (2 t + a) ||Q||_F, and ||M (Q - Qbar)|| <= t^2 eta. Then M11 = sym(Q^T Y) and X =
    sym(Z^T Z), Z = (I - Q Q^T) Y (approx._deflect), with approx's product bounds, reading ||Qbar|| = 1 and
    ||M Qbar|| <= t^2 for the exact matrices."""
    Y = apply_M(q, H, W, Q)
    if not bool(torch.isfinite(Y).all()):
        raise ValueError("M Q came out non-finite: not certified")
    qf = float(Q.square().sum().sqrt()) * (1 + rounding.gamma(Q.numel() + 4))
    Ya = _Normed(Y, _up(apply_err * (2 * t_up + apply_err) * qf + t_up * t_up * eta), bound=_up(t_up * t_up))
    Qa = _Normed(Q, eta, bound=1.0)  # Qbar is orthonormal
    M11 = _sym(_mm(Qa, Ya, tX=True))
    Z = _deflect(Qa, Ya)
    X = _sym(_mm(Z, Z, tX=True))
    return M11, X


def ritz_bound(q: sp.SSoGParams, H: int, W: int, sn: sp.SymbolNorm, *, apply_err: float, t_up: float,
               K: int | None = None, start: torch.Tensor | None = None, max_work: float = WORK,
               lower: float | None = None) -> RitzBound:
    """||T||^2 <= tau (normalised units) by Theorem D4 on K Ritz vectors with the complement of Lemma G4 (module
    docstring). K None: K_START, doubled while m22 > M22_SHARE times the top Ritz value, up to K_MAX. apply_err >=
    ||fl(T v) - T v|| / ||v||, t_up >= ||T||, both certified; sn: a SymbolNorm on q (its anchors are reused);
    max_work: the envelope's budget (channel_envelope), ValueError beyond; checked before any Ritz vector at the level
    LEVEL_SHARE lower^2 where a lower bound on ||T|| (normalised units) is given."""
    if q.WV.dtype != torch.float64:
        raise ValueError("the Ritz-deflated bound is certified in float64 only")
    if not (apply_err >= 0 and t_up > 0 and math.isfinite(apply_err) and math.isfinite(t_up)):
        raise ValueError(f"apply_err and t_up must be finite (got {apply_err}, {t_up}): not certified")
    t0 = time.perf_counter()
    if lower is not None and lower > 0 and math.isfinite(max_work):
        ck, _, _, s_up, _, _ = symbol_bounds(q, H, W, sn)
        check_work(int((s_up * s_up > LEVEL_SHARE * lower * lower).sum()), q.dim, max_work)
    n = H * W * q.dim
    k_mem = int(MEMORY / (8 * n * 2 * STEPS)) - EXTRA
    k = min(K_START if K is None else int(K), n - 1, k_mem)
    if k < 1:
        raise ValueError(f"N C = {n} leaves no Ritz vector within {MEMORY:g} bytes")
    env, level, tries = None, None, []
    while True:
        theta, Q = ritz_vectors(q, H, W, k, start=start)
        eta = orthonormality_defect(Q)
        if env is None:
            level = LEVEL_SHARE * float(theta[0])
            env = channel_envelope(q, H, W, sn, level, max_rows=max(2, int(MEMORY / (8 * n * 2))),
                                   max_work=max_work)
        m22 = _level_plus_norm2(env.level, _deflect(_Normed(Q, eta, bound=1.0), env.At)) if env.rows else _up(env.level)
        tries.append(dict(K=k, m22=m22, theta1=float(theta[0]), seconds=time.perf_counter() - t0))
        if K is not None or m22 <= M22_SHARE * float(theta[0]) or 2 * k > min(K_MAX, n - 1, k_mem):
            break
        if len(tries) > 1 and m22 > float(theta[0]) and m22 > STALL * tries[-2]["m22"]:
            break  # the complement is above ||T||^2 and barely moves: R_F's top lies outside T^T T's top space
        k, start = 2 * k, Q
    M11, X = gram_blocks(q, H, W, Q, eta, apply_err, t_up)
    # X_exact <= X^ + e_X I: certify with that (one rounding per diagonal entry), so that the shift g is chosen
    # knowing X's error (Ritz residuals leave X^ near 0, where e_X / g would otherwise decide the bound)
    Xi = X.val.clone()
    Xi.diagonal().add_(X.err)
    u = rounding.unit_roundoff(torch.float64)
    tau, est, g = certify_d4(M11, _Approx(Xi, _up(2 * u * (X.fro + X.err * math.sqrt(k)))), m22)
    return RitzBound(tau=tau, est=est, m22=m22, level=env.level, K=k, top=Q[:, 0].clone(),
                     info=dict(theorem="D5", g=g, eta=eta, rows=env.rows, hot=env.hot, frequencies=env.frequencies,
                               errors=dict(M11=M11.err, X=X.err, envelope=env.At.err), tries=tries,
                               seconds=time.perf_counter() - t0))
