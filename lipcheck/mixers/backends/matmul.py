"""The reference backend: dense axis factors through einsum."""
from __future__ import annotations

import torch

from ..taps import _toeplitz_from_taps


def _prepare_matmul(H, W, alpha, mu, sigma, ty, tx):
    return _toeplitz_from_taps(H, ty) * alpha[..., None, None], _toeplitz_from_taps(W, tx)


def _apply_matmul(v, GH, GW):
    """Dense axis factors: O(B C M (H^2 W + H W^2)) multiply-adds."""
    t = torch.einsum("hmjl,bilhd->bhmijd", GW, v)  # along x
    return torch.einsum("hmik,bhmkjd->bijhd", GH, t)  # along y, summed over components
