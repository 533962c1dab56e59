"""The cost model behind backend='auto': modelled multiply-adds of each fast backend, the cheapest chosen."""
from __future__ import annotations

import math

from ..taps import truncation_tol
from .fft import fft_size
from .truncated import truncation_radius

# Relative cost of one multiply-add (or of one L log2 L FFT unit) per backend, in units of a GEMM
# multiply-add. Measured on a 2-core AVX2 CPU (torch 2.13, MKL/oneDNN): depthwise convolutions run
# at about a quarter of GEMM throughput; a real 2-D FFT costs about 20 GEMM multiply-adds per
# L log2 L point and channel (forward + inverse + product).
COST_WEIGHTS = {"stacked": 1.0, "truncated": 4.0, "fft": 20.0}


def backend_costs(H: int, W: int, alpha, mu, sigma, tol: float | None = None) -> dict[str, float]:
    """Modelled cost per channel and batch element of each fast backend, GEMM-multiply-add units."""
    M = alpha.shape[1]
    N = H * W
    tol = truncation_tol(mu.dtype) if tol is None else tol
    taps = sum(2 * truncation_radius(H, mu[:, m, 0], sigma[:, m, 0], tol) + 1
               + 2 * truncation_radius(W, mu[:, m, 1], sigma[:, m, 1], tol) + 1 for m in range(M))
    L = fft_size(H) * fft_size(W)
    return {
        "stacked": COST_WEIGHTS["stacked"] * M * N * (H + W),
        "truncated": COST_WEIGHTS["truncated"] * N * taps,
        "fft": COST_WEIGHTS["fft"] * L * math.log2(max(L, 2)),
    }


def choose_backend(H: int, W: int, alpha, mu, sigma) -> str:
    """Cost model for backend='auto': the cheapest of backend_costs (stacked GEMMs, truncated
    depthwise convolution, FFT). All are exact to float rounding, so the choice changes only speed."""
    costs = backend_costs(H, W, alpha, mu, sigma)
    return min(costs, key=costs.get)
