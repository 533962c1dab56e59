"""The fast operator T(X) = sum_h K_h X P_h, its adjoint, and the dense (N C) x (N C) matrix where it fits."""
from __future__ import annotations

import torch

from .params import SSoGParams


def _mix(V: torch.Tensor, p: SSoGParams, mu: torch.Tensor) -> torch.Tensor:
    """sum_m alpha G_H(mu_y) V_h G_W(mu_x)^T per head, V of shape (B, H, W, C); never builds N x N."""
    from ..mixers.ssog import ssog_mix
    B, H, W, C = V.shape
    v = V.reshape(B, H, W, p.num_heads, p.head_dim)
    return ssog_mix(v, p.alpha, mu, p.sigma).reshape(B, H, W, C)


def apply_T(X: torch.Tensor, p: SSoGParams) -> torch.Tensor:
    """T(X) = sum_h K_h X P_h on X of shape (B, H, W, C)."""
    return _mix(X @ p.WV, p, p.mu) @ p.WO


def apply_T_adjoint(Y: torch.Tensor, p: SSoGParams) -> torch.Tensor:
    """T^*(Y) = sum_h K_h^T Y P_h^T; G_n(mu, sigma)^T = G_n(-mu, sigma), so it is the same fast operator."""
    return _mix(Y @ p.WO.T, p, -p.mu) @ p.WV.T


def dense_operator(p: SSoGParams, H: int, W: int) -> torch.Tensor:
    """The (N C) x (N C) matrix of T on row-major vec(X): entry [(n, c), (n', c')] = sum_h K_h[n, n'] P_h[c', c]."""
    from ..mixers.ssog import operator_matrices
    K = operator_matrices(H, W, p.alpha, p.mu, p.sigma)  # (h, N, N)
    P = p.head_projections()
    N, C = H * W, p.dim
    return torch.einsum("hab,hdc->acbd", K, P).reshape(N * C, N * C)

