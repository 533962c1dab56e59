"""The circulant Gram envelope's complement bound without an N x N matrix (proofs/S2.md, 'Low-rank complement').

R_f (lipcheck.bounds.gram_envelope) is the compression to the H x W box of the circulant with eigenvalues f(w) on the
L1 x L2 torus. Theorem D4 needs m22 >= lambda_max(R_f on span(Q)^perp). Split f at a level d0: f <= d0 + g with
g = (f - d0)_+, so (compressions of circulants are monotone in the symbol, and the constant d0 compresses to d0 I)

    R_f <= d0 I + R_g,    R_g = A^T A,   A's rows sqrt(2 g(w) / (L1 L2)) (cos(w . n), sin(w . n))_n

over one of each pair (w, -w) with g(w) > 0 (a self-mirrored w has sin = 0 and weight sqrt(g / (L1 L2))). For b
orthogonal to span(Q), b^T R_f b <= d0 ||b||^2 + ||A P b||^2 with P the projector onto span(Q)^perp, so

    m22 = d0 + ||P A^T||^2,

a matrix with N rows and as many columns as frequencies above d0 (a few times k: the eigenvalues of R_f above a
level are about N times the share of the torus where f exceeds it, Szego). Q comes from Lanczos on R_f applied by
FFT; any Q is sound (its departure from orthonormality, eta, enters as in `deflation._deflect`). Nothing here is
N x N: the cost is the Lanczos run and the N x s products, so the deflated bound reaches 64 x 64 and 128 x 128.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import rounding
from . import spectral as sp
from .approx import _Approx, _deflect, _mm, _up
from .gram_envelope import angle_table, torus_pairs, trig_error

# columns of A at most (about one per torus frequency above the level): the N x s products and the s x s Cholesky
# stay within seconds at 64 x 64 and 128 x 128
MAX_COLUMNS = 2048


def apply_envelope(f: np.ndarray, H: int, W: int, x: np.ndarray) -> np.ndarray:
    """R_f x for x (N,) or (N, m), row-major tokens: zero-pad to the torus, multiply by f in frequency, crop."""
    L1, L2 = f.shape
    m = 1 if x.ndim == 1 else x.shape[1]
    X = np.zeros((m, L1, L2))
    X[:, :H, :W] = x.reshape(H, W, m).transpose(2, 0, 1) if x.ndim > 1 else x.reshape(1, H, W)
    Y = np.fft.irfft2(np.fft.rfft2(X) * f[:, : L2 // 2 + 1], s=(L1, L2))[:, :H, :W]
    out = Y.reshape(m, H * W).T
    return out[:, 0] if x.ndim == 1 else out


def top_vectors(f: torch.Tensor, H: int, W: int, k: int, *, seed: int = 0, tol: float = 1e-9):
    """(eigenvalues descending (k + 1,), Q (N, k) orthonormal up to rounding): the top of R_f by Lanczos (ARPACK)
    with a fixed start vector, so the same call gives the same Q. Only a guide: nothing here is certified."""
    from scipy.sparse.linalg import LinearOperator, eigsh
    N = H * W
    fn = f.detach().cpu().numpy()
    op = LinearOperator((N, N), matvec=lambda v: apply_envelope(fn, H, W, np.asarray(v).reshape(-1)),
                        dtype=np.float64)
    v0 = np.random.default_rng(seed).standard_normal(N)
    ev, V = eigsh(op, k=k + 1, which="LA", v0=v0, tol=tol, ncv=min(N, max(2 * k + 2, k + 32)))
    order = np.argsort(ev)[::-1]
    ev, V = ev[order], V[:, order]
    Q = torch.linalg.qr(torch.from_numpy(np.ascontiguousarray(V[:, :k])))[0]
    return torch.from_numpy(ev.copy()), Q.to(f.device)


def level_for(f: torch.Tensor, lam_top: float, lam_next: float, *, max_columns: int = MAX_COLUMNS) -> float:
    """The split level d0 (a tuning choice: any d0 >= 0 is sound). m22 lands between lambda_{k+1} and lambda_{k+1} +
    d0 (the loss is d0 times the energy the complement's top vector has where f <= d0), and Theorem D4 only needs
    m22 clearly below ||T||^2 ~ lambda_1: so d0 is the level that keeps A within max_columns, or, where that is
    lower, up to half the gap lambda_1 - lambda_{k+1} and half lambda_{k+1} (fewer columns, same bound)."""
    s = torch.sort(f.reshape(-1), descending=True).values
    # A holds about one column per torus frequency above the level (pairs give two, and the torus holds both)
    floor = float(s[max_columns - 1]) if s.numel() > max_columns else 0.0
    return max(floor, min(lam_next, lam_top - lam_next) / 2, 0.0)


def envelope_columns(f: torch.Tensor, H: int, W: int, d0: float) -> _Approx:
    """A^T (N x s) with rows of A for the torus frequencies w with f(w) > d0, one of each pair (w, -w), as an _Approx
    of the exact matrix for g = fl(f - d0) rounded up (g >= f - d0, so R_f <= d0 I + A^T A still holds).

    Entries: cos(w . n) = cy cx - sy sx, sin(w . n) = sy cx + cy sx from the axis tables (each within e =
    trig_error(u) of the exact value), weight fl(sqrt(fl(fl(c g) / L))) with c = 2 (or 1 where w = -w). Each entry
    errs by <= weight' ((2 e + e^2) 2 + 4 u (1 + e)^2) + |entry| 3u: the products and the difference as in
    `gram_envelope.torus_toeplitz_coefficients`, the weight's three roundings (<= 3u relative, through the square
    root at most 1.5u + u); so ||A^T^ - A^T||_2 <= ||.||_F <= rel * ||A^T^||_F (1 + rel) with rel below."""
    L1, L2 = f.shape
    dev, dt = f.device, torch.float64
    u = rounding.unit_roundoff(dt)
    idx, mirror = torus_pairs(L1, L2, dev)
    ff = f.reshape(-1)
    pick = (idx <= mirror) & (ff > d0)
    sel = idx[pick]
    ai, bi = sel // L2, sel % L2
    g = ff[pick] - d0
    g = torch.nextafter(g, torch.full_like(g, math.inf))  # fl(f - d0) rounded up: >= f - d0
    self_mirror = (idx[pick] == mirror[pick]).to(dt)
    wt = torch.sqrt(((2.0 - self_mirror) * g) / (L1 * L2))

    cy, sy = angle_table(ai, torch.arange(H, device=dev), L1, dt)  # (s, H)
    cx, sx = angle_table(bi, torch.arange(W, device=dev), L2, dt)  # (s, W)
    cos = (cy[:, :, None] * cx[:, None, :] - sy[:, :, None] * sx[:, None, :]).reshape(-1, H * W)
    sin = (sy[:, :, None] * cx[:, None, :] + cy[:, :, None] * sx[:, None, :]).reshape(-1, H * W)
    keep_sin = self_mirror == 0  # sin(w . n) vanishes at a self-mirrored w (w = -w mod the torus: w in {0, pi}^2)
    rows = torch.cat([cos * wt[:, None], (sin * wt[:, None])[keep_sin]], 0)
    e = trig_error(u)
    rel = (2 * (2 * e + e * e) + 4 * u * (1 + e) ** 2) * (1 + 3 * u) + 5 * u
    val = rows.T.contiguous()
    fro = float(val.square().sum().sqrt()) * (1 + rounding.gamma(val.numel() + 4))
    # the entries' bound is relative to the weight, and |cos|, |sin| <= 1: ||E||_F <= rel' sqrt(N sum weight^2)
    wsum = float((wt.square() * (1 + keep_sin.to(dt))).sum()) * (1 + rounding.gamma(2 * wt.numel() + 4))
    err = (rel * math.sqrt(H * W * wsum) * (1 + 4 * u) + 3 * u * fro) * (1 + 4 * u)
    return _Approx(val, _up(err))


def complement_bound(f: torch.Tensor, H: int, W: int, Q: torch.Tensor, eta: float, d0: float) -> tuple[float, int]:
    """(m22, columns): m22 >= lambda_max(R_f on span(Q)^perp) (module docstring), certified: ||P A^T|| <= ||Z^|| +
    e_Z for Z^ = fl(A^T - Q (Q^T A^T)) (`_deflect`'s bound), ||Z^||^2 <= lambda_max(fl(Z^T Z^)) (Cholesky-checked)
    plus fl's gamma_{N+2} ||Z^||_F^2; then d0 + that, rounded up."""
    if not (d0 >= 0 and math.isfinite(d0)):
        raise ValueError(f"the split level must be finite and >= 0, got {d0}: not certified")
    At = envelope_columns(f, H, W, d0)
    if At.val.shape[1] == 0:
        return _up(d0), 0
    return _level_plus_norm2(d0, _deflect(_Approx(Q, eta), At)), At.val.shape[1]


def envelope_top(f: torch.Tensor, H: int, W: int, *, max_columns: int = MAX_COLUMNS) -> tuple[float, float, int]:
    """(tau_R, d0, columns): tau_R >= lambda_max(R_f) on all of R^N, certified, without an N x N matrix: R_f <= d0 I +
    A^T A (module docstring) with no projector, so lambda_max(R_f) <= d0 + ||A^T||^2, the level d0 the max_columns-th
    largest f. Never above max f (returned where that is smaller): the compression of g = (f - d0)_+ loses what
    R_f's top vector loses at the box's edges, which max f does not see (C = 192, init kernels: 0.8688 -> 0.86268 at
    64 x 64 and 0.86718 at 128 x 128, ||T|| >= 0.86242 and 0.86714)."""
    fmax = float(f.max())
    if not (math.isfinite(fmax) and bool(torch.isfinite(f).all())):
        raise ValueError("the envelope's symbol norms are not all finite: not certified")
    s = torch.sort(f.reshape(-1), descending=True).values
    d0 = max(float(s[max_columns - 1]), 0.0) if s.numel() > max_columns else 0.0
    At = envelope_columns(f, H, W, d0)
    if At.val.shape[1] == 0:
        return min(fmax, _up(d0)), d0, 0
    return min(fmax, _level_plus_norm2(d0, At)), d0, At.val.shape[1]


def _level_plus_norm2(d0: float, Z: _Approx) -> float:
    """d0 + ||Z_exact||^2 rounded up: ||Z^||^2 <= lambda_max(fl(Z^T Z^)) (Cholesky-checked) plus fl's gamma_{N+2}
    ||Z^||_F^2, then Z's own error."""
    G = _mm(_Approx(Z.val, 0.0), _Approx(Z.val, 0.0), tX=True)
    S = (G.val + G.val.T) / 2
    u = rounding.unit_roundoff(S.dtype)
    with sp.single_thread():
        lam = float(rounding.verified_lambda_max(S, tries=20))
    if not math.isfinite(lam):
        raise ValueError("the low-rank complement's Cholesky certificate failed at every pad: not certified")
    znorm = math.sqrt(_up(max(lam, 0.0) + G.err + 2 * u * G.fro)) * (1 + 2 * u)
    top = _up((znorm + Z.err) ** 2 * (1 + 4 * u))
    return _up((d0 + top) * (1 + 2 * u))
