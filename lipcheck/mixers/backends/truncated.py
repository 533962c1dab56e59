"""The truncated backend: depthwise convolutions with the taps cut at a radius whose dropped mass is bounded."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..taps import _axis_taps, truncation_tol


def truncation_radius(n: int, mu: torch.Tensor, sigma: torch.Tensor, tol: float) -> int:
    """Smallest common radius r <= n - 1 such that every component drops at most `tol` of its mass.

    Bound. Take r >= |mu| + t sigma. The lattice point nearest mu is kept, so Z >= exp(-1/(8 sigma^2));
    the dropped offsets lie at distance D >= t sigma + 1 from mu, at most one per unit step on each
    side, so the dropped mass is
        sum_drop g <= 2 exp(-(D^2 - 1/4) / (2 sigma^2)) / (1 - exp(-D / sigma^2))
                   <= 2 exp(-t^2 / 2) (1 + sigma / t).
    t = sqrt(2 ln(2 (1 + sigma / t0) / tol)) with t0 = sqrt(2 ln(2 / tol)) <= t makes this <= tol.
    r = n - 1 keeps every offset of an n-point axis: then the cut is exact.
    """
    if not 0 < tol < 1:
        raise ValueError(f"tol must lie in (0, 1), got {tol}")
    mu, sigma = mu.detach().double(), sigma.detach().double()
    t0 = math.sqrt(2 * math.log(2 / tol))
    t = torch.sqrt(2 * torch.log(2 * (1 + sigma / t0) / tol))
    r = math.ceil(float((mu.abs() + t * sigma).max()))
    return max(0, min(int(n) - 1, r))


def _prepare_truncated(H, W, alpha, mu, sigma, ty, tx, tol=None):
    """Per component m: (r_y, r_x, y taps alpha_m g_y,m flipped, x taps g_x,m flipped), each
    component with its own radii (the largest over heads), so narrow components cost few taps."""
    M = alpha.shape[1]
    tol = truncation_tol(mu.dtype) if tol is None else tol
    out = []
    for m in range(M):
        ry = truncation_radius(H, mu[:, m, 0], sigma[:, m, 0], tol)
        rx = truncation_radius(W, mu[:, m, 1], sigma[:, m, 1], tol)
        # conv2d is a cross-correlation, out[i] = sum_t w[t] x[i + t - r], so w[t] = g(r - t): flip the taps.
        gx = tx[:, m, W - 1 - rx:W + rx].flip(-1)  # (h, 2rx+1): offsets -rx..rx
        gy = (ty[:, m, H - 1 - ry:H + ry] * alpha[:, m, None]).flip(-1)  # (h, 2ry+1)
        out.append((ry, rx, gy, gx))
    return tuple(out)


def _apply_truncated(v, *components):
    """Truncated depthwise convolution along each axis: O(B C N sum_m (r_x,m + r_y,m)) multiply-adds.

    Per component m: a depthwise convolution along x with g_x,m, then one along y with alpha_m g_y,m,
    summed over m. The convolution's zero padding is exactly the zero padding of the Toeplitz
    factors. Error per output entry <= sum_m |alpha_m| (eps_y + eps_x + eps_y eps_x) max|v| with
    eps <= tol (see truncation_radius; 1.5 tol in the SSoG module, see tap_floor): below float rounding
    at the default tol.
    """
    B, H, W, h, d = v.shape
    C = h * d
    # (B, H, W, C) viewed as (B, C, H, W) is the channels_last layout the depthwise kernels like best.
    x = v.reshape(B, H, W, C).permute(0, 3, 1, 2)
    out = None
    for ry, rx, gy, gx in components:
        wx = gx[:, None].expand(h, d, 2 * rx + 1).reshape(C, 1, 1, 2 * rx + 1)
        wy = gy[:, None].expand(h, d, 2 * ry + 1).reshape(C, 1, 2 * ry + 1, 1)
        y = F.conv2d(F.conv2d(x, wx, padding=(0, rx), groups=C), wy, padding=(ry, 0), groups=C)
        out = y if out is None else out + y
    return out.permute(0, 2, 3, 1).reshape(B, H, W, h, d)


def _mix_truncated(v, alpha, mu, sigma, tol=None):
    """Truncated backend in one call (prepare + apply), with an explicit truncation tolerance."""
    H, W = v.shape[1], v.shape[2]
    return _apply_truncated(v, *_prepare_truncated(H, W, alpha, mu, sigma, *_axis_taps(H, W, mu, sigma), tol))
