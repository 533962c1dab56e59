"""Rounding errors of the kernel and its symbols as the bounds read them (proofs/S2.md, 'rounding margins'), and
the closed form (S1, last inequality) with its certified head norms."""
from __future__ import annotations

import math

import torch

from .. import gaussian
from ..rounding import norm2_upper
from .params import SSoGParams, _finite, _scale_back, normalised, single_thread


def _log_range(dtype) -> float:
    """-log of the smallest positive (subnormal) number: |log g| of every tap that is not flushed to 0."""
    fi = torch.finfo(dtype)
    return -math.log(fi.smallest_normal) - math.log(fi.eps) + 1


def tap_error(p: SSoGParams) -> torch.Tensor:
    """(h, M, 2) bound on the relative error of every tap g(k) that is a normal number (gaussian.tap_relative_error
    at the largest |log g| the dtype holds); taps below the smallest normal number err by at most that number."""
    lz = gaussian.log_normaliser(p.mu, p.sigma).abs()
    return torch.expm1(p.gamma(8) * (_log_range(p.WV.dtype) + 2 * lz + 4)) + p.u


def symbol_error(p: SSoGParams, terms: int = 2 * gaussian.DIRECT_TERMS + 1) -> torch.Tensor:
    """(h, M, 2) bound on |fl(ghat(w)) - ghat(w)| for |w| <= pi + 2 pi (terms sum of <= `terms` taps
    times phases exp(-i k w) with |k| <= |round(mu)| + terms): taps, phases, the sum, flushed taps."""
    c = torch.round(p.mu).abs()
    tiny = torch.finfo(p.WV.dtype).smallest_normal
    return (tap_error(p) + p.gamma(terms + 6) + 4 * p.u * (2 + 3 * math.pi * (c + terms + 2))
            + terms * tiny)


def coefficient_error(p: SSoGParams, e: torch.Tensor) -> torch.Tensor:
    """(h,) bound on |fl(c_h) - c_h|, c_h = sum_m alpha ghat_y ghat_x, from per-axis symbol errors e (h, M, 2)."""
    ey, ex = e[..., 0], e[..., 1]
    A = p.alpha.abs()
    M = p.alpha.shape[1]
    return ((A * (ey + ex + ey * ex)).sum(1) + p.gamma(M + 3) * (A * (1 + ey) * (1 + ex)).sum(1)
            + M * torch.finfo(p.WV.dtype).smallest_normal)


def dense_error(p: SSoGParams, N: int) -> float:
    """Bound on ||fl(T) - T||_2 for the dense matrix (and the fast operator) on N tokens: relative errors
    of the taps and of the products alpha g_y g_x P_h, flushed taps, and reading the weights into the dtype."""
    eps = float(tap_error(p).max())
    tiny = torch.finfo(p.WV.dtype).smallest_normal
    rel = 2 * eps + eps * eps + p.gamma(p.alpha.shape[1] + p.head_dim + 2 * p.dim + 8) + p.conversion_error
    return (rel + 4 * N * tiny) * p.magnitude()



def truncated_symbol_error(p: SSoGParams, H: int, W: int) -> torch.Tensor:
    """(h, M, 2) bound on the error of `truncated_symbols`: 2n - 1 taps times phases with |k w| <= 2 pi n."""
    e = tap_error(p)
    tiny = torch.finfo(p.WV.dtype).smallest_normal
    out = [e[..., ax] + p.gamma(2 * n + 2) + 4 * p.u * (2 + 2 * math.pi * n) + 2 * n * tiny
           for ax, n in ((0, H), (1, W))]
    return torch.stack(out, -1)



def head_norms(p: SSoGParams) -> torch.Tensor:
    """Certified ||P_h||_2 >= the exact norm for every head: P_h = W_V,h W_O,h formed in the dtype (an inner
    product of length d: entrywise error <= gamma_{d+2} |W_V,h| |W_O,h|, Frobenius <= gamma_{d+2} F_h), its norm
    verified by Cholesky (rounding.norm2_upper), plus reading the weights into the dtype."""
    with single_thread():
        s = norm2_upper(p.head_projections()).to(p.WV.dtype)
    return s * (1 + p.gamma(2)) + (p.gamma(p.head_dim + 2) + p.conversion_error) * p.head_frobenius()


def _closed_form(q: SSoGParams) -> float:
    return _finite(float((head_norms(q) * q.alpha.abs().sum(1)).sum())
                   * (1 + q.gamma(q.alpha.shape[1] + q.num_heads + 2)), "closed-form bound")


def closed_form_bound(p: SSoGParams) -> float:
    """sum_h ||P_h||_2 sum_m |alpha[h, m]|: no sigma, no mu, no grid. Certified (rounded up), any scale."""
    q = normalised(p)
    return _scale_back(_closed_form(q), q.log2_scale, up=True)

