"""The SSoG kernels on a grid: the taps g(k; mu, sigma) at integer offsets k = i - i', and the Toeplitz axis
factors G_n built from them. Every backend, the module's kernel cache and the dense reference read these."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import gaussian

SIGMA_FLOOR = 1e-3  # sigma = softplus(raw) + floor keeps every width strictly positive


def _effective_sigma(sigma_raw: torch.Tensor) -> torch.Tensor:
    return F.softplus(sigma_raw) + SIGMA_FLOOR


def truncation_tol(dtype: torch.dtype) -> float:
    """Largest mass of one normalised 1-D factor the truncated backend may drop: eps(dtype) / 4
    (5.6e-17 in float64, 3.0e-8 in float32), below the rounding of the kept sum."""
    return torch.finfo(dtype).eps / 4


def axis_factors(H: int, W: int, alpha, mu, sigma):
    """alpha-weighted G_H and plain G_W, shapes (h, M, H, H) and (h, M, W, W)."""
    GH = gaussian.axis_matrix(H, mu[..., 0], sigma[..., 0]) * alpha[..., None, None]
    GW = gaussian.axis_matrix(W, mu[..., 1], sigma[..., 1])
    return GH, GW


def _flush(g: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """Taps below max(floor, the dtype's smallest normal number) set to zero: subnormal floats slow every
    later multiply by an order of magnitude on x86 and change nothing above 1e-308 (float64) or 1e-38
    (float32) absolute."""
    return torch.where(g < max(floor, torch.finfo(g.dtype).tiny), torch.zeros((), dtype=g.dtype, device=g.device), g)


def tap_floor(n: int, dtype: torch.dtype) -> float:
    """Smallest tap the SSoG module keeps on an axis of n <= `n` points: truncation_tol(dtype) / (2 (2n - 1)).

    A tap of 1e-30 is a normal float32, but its products with ordinary activations and gradients
    (1e-9 and below) are subnormal, and a GEMM meeting subnormal products runs several times slower
    (measured: the 64x64 mixer's forward 1.5x, its training step 1.4x). At most 2n - 1 taps per
    component and axis fall below the floor, so they drop at most truncation_tol / 2 of the mass: the
    error statement of the truncated backend (eps <= tol per factor) holds with eps <= tol / 2 for the
    dense backends and eps <= 1.5 tol for the truncated one, below the rounding of the kept sums. The
    functional `ssog_mix` (the bounds' operator) flushes only below the smallest normal number.
    """
    return truncation_tol(dtype) / (2 * (2 * max(int(n), 1) - 1))


def _taps(r: int, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """g(k; mu, sigma) for k = -r..r, shape mu.shape + (2r + 1,), subnormal values flushed to zero."""
    return _flush(gaussian.lattice_taps(r, mu, sigma))


def _toeplitz(n: int, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """G_n(mu, sigma) built from its 2n - 1 distinct taps (equal to gaussian.axis_matrix entry by entry)."""
    return _toeplitz_from_taps(n, _taps(n - 1, mu, sigma))


def _full_taps(H: int, W: int, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Taps of both axes from one kernel evaluation: g(k) for |k| <= max(H, W) - 1, shape (h, M, 2, 2r+1)."""
    return _taps(max(H, W) - 1, mu, sigma)


def _split_taps(H: int, W: int, taps: torch.Tensor):
    """(y taps for |k| <= H - 1, x taps for |k| <= W - 1) out of `_full_taps`."""
    r = (taps.shape[-1] - 1) // 2
    return taps[..., 0, r - (H - 1):r + H], taps[..., 1, r - (W - 1):r + W]


def _axis_taps(H: int, W: int, mu: torch.Tensor, sigma: torch.Tensor):
    """(y taps, x taps) of an H x W grid: one kernel evaluation for both axes."""
    return _split_taps(H, W, _full_taps(H, W, mu, sigma))


def _toeplitz_from_taps(n: int, taps: torch.Tensor) -> torch.Tensor:
    """G_n[i, i'] = taps[i - i' + n - 1] for taps over k = -(n-1)..n-1: row i is the window of the reversed
    taps that starts at n - 1 - i (two flips and a strided view: a third of the time of a gather)."""
    return taps.flip(-1).unfold(-1, n, 1).flip(-2)
