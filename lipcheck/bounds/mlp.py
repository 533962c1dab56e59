"""Lip(MLP) <= ||W1||_2 sup|GELU'| ||W2||_2 (SPEC S3): the one MLP constant, read by the block and vector-field
bounds of SSoG (network) and of attention (attention)."""
from __future__ import annotations

import torch

from .. import symbolic
from ..rounding import gamma as _gamma
from ..rounding import norm2_upper
from .spectral import single_thread

_U64 = torch.finfo(torch.float64).eps / 2  # Python floats and float64 tensors


def mlp_lipschitz(mlp, *, dtype=torch.float64, device=None, variant: str = "exact") -> float:
    """||W1||_2 sup|GELU'| ||W2||_2 (0 when the block has no MLP)."""
    if mlp is None:
        return 0.0
    # the stored weights as they are: norm2_upper verifies in float64, which holds them exactly (a conversion to a
    # coarser dtype would bound a rounded matrix instead); dtype is accepted for a uniform signature
    W1 = mlp.fc1.weight.detach().to(device=device)
    W2 = mlp.fc2.weight.detach().to(device=device)
    for name, t in (("mlp.fc1.weight", W1), ("mlp.fc2.weight", W2)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} has non-finite entries; fix the weights before certifying")
    with single_thread():
        # verified by Cholesky for the weights as stored (rounding.norm2_upper, proofs/S2.md)
        n1, n2 = float(norm2_upper(W1)), float(norm2_upper(W2))
    # sup|GELU'| is rounded to nearest (u; at the tanh variant's 12-digit critical point the value is stationary, so
    # the point's error enters squared), then two products: gamma_4 covers all three (proofs/S3.md, 'Rounding')
    return n1 * symbolic.gelu_derivative_sup(variant) * n2 * (1 + _gamma(4, _U64))
