"""The SSoG backends: interchangeable ways of applying sum_m alpha G_H v G_W^T, one module each, behind one
table (name -> implementation).

All read the taps g(k; mu, sigma) from lipcheck.gaussian.kernel at the integer offsets k = i - i' (the same
numbers axis_matrix puts in G_n), computed once per grid by `_axis_taps`, and differ only in how they apply
them: dense factors (matmul), stacked GEMMs (dense factors, components stacked so each axis is one batched
GEMM), truncated depthwise convolution (taps beyond a radius cut, error bound in `truncation_radius`), FFT
(exact linear convolution by zero padding to >= 2n - 1).
"""
from __future__ import annotations

from typing import Callable

from ..taps import _axis_taps
from .fft import _apply_fft, _prepare_fft
from .matmul import _apply_matmul, _prepare_matmul
from .stacked import _apply_stacked, _prepare_stacked
from .truncated import _apply_truncated, _mix_truncated, _prepare_truncated

# Every backend is a pair: prepare(H, W, alpha, mu, sigma, ty, tx) -> factors, which depends on the
# kernel parameters only (the module caches it while they do not change), and apply(v, *factors).
# ty, tx are the taps of `_axis_taps`; mu and sigma serve only choices that take no gradient (the
# truncation radii), so the factors depend on mu and sigma through the taps alone.
BACKEND_PARTS: dict[str, tuple[Callable, Callable]] = {
    "matmul": (_prepare_matmul, _apply_matmul),
    "stacked": (_prepare_stacked, _apply_stacked),
    "truncated": (_prepare_truncated, _apply_truncated),
    "fft": (_prepare_fft, _apply_fft),
}


def _one_call(prepare, apply):
    def mix(v, alpha, mu, sigma):
        H, W = v.shape[1], v.shape[2]
        return apply(v, *prepare(H, W, alpha, mu, sigma, *_axis_taps(H, W, mu, sigma)))
    return mix


BACKENDS: dict[str, Callable] = {name: _one_call(*parts) for name, parts in BACKEND_PARTS.items()}
BACKENDS["truncated"] = _mix_truncated  # takes an explicit tol as well
