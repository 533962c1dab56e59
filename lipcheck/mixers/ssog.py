"""SSoG: separable sum-of-Gaussians token mixing (SPEC section 1).

    SSoG(X) = sum_h K_h X P_h + b,   K_h = sum_m alpha[h, m] G_H(mu_y, sigma_y) kron G_W(mu_x, sigma_x)

The pure function `ssog_mix` applies sum_m alpha G_H V G_W^T per head without ever building the
N x N matrix; the backends in `BACKENDS` are interchangeable implementations of it. The module
`SSoG` is a thin shell: value projection (no bias, so that the affine part is exactly b), the
mixing, the output projection.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import gaussian

SIGMA_FLOOR = 1e-3  # sigma = softplus(raw) + floor keeps every width strictly positive


def _check_grid(x: torch.Tensor, num_heads: int) -> None:
    if x.dim() != 5:
        raise ValueError(f"values must have shape (B, H, W, heads, head_dim), got {tuple(x.shape)}")
    if x.shape[3] != num_heads:
        raise ValueError(f"values have {x.shape[3]} heads, the kernels {num_heads}")


def axis_factors(H: int, W: int, alpha, mu, sigma):
    """alpha-weighted G_H and plain G_W, shapes (h, M, H, H) and (h, M, W, W)."""
    GH = gaussian.axis_matrix(H, mu[..., 0], sigma[..., 0]) * alpha[..., None, None]
    GW = gaussian.axis_matrix(W, mu[..., 1], sigma[..., 1])
    return GH, GW


def _mix_matmul(v, alpha, mu, sigma):
    """Dense axis factors: O(B C M (H^2 W + H W^2)) multiply-adds."""
    B, H, W, h, d = v.shape
    GH, GW = axis_factors(H, W, alpha, mu, sigma)
    t = torch.einsum("hmjl,bilhd->bhmijd", GW, v)  # along x
    return torch.einsum("hmik,bhmkjd->bijhd", GH, t)  # along y, summed over components


BACKENDS: dict[str, Callable] = {
    "matmul": _mix_matmul,
}


def ssog_mix(v: torch.Tensor, alpha: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor,
             backend: str = "matmul") -> torch.Tensor:
    """Per-head spatial mixing: out[:, :, :, h] = sum_m alpha[h, m] G_H v[:, :, :, h] G_W^T.

    v: (B, H, W, h, d); alpha: (h, M); mu, sigma: (h, M, 2) with [..., 0] the y axis, [..., 1] x.
    """
    _check_grid(v, alpha.shape[0])
    try:
        fn = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown SSoG backend {backend!r}; choose one of {sorted(BACKENDS)}") from None
    return fn(v, alpha, mu, sigma)


def operator_matrices(H: int, W: int, alpha, mu, sigma) -> torch.Tensor:
    """Dense K_h = sum_m alpha G_H kron G_W, shape (h, H*W, H*W), row-major tokens. Reference only."""
    GH, GW = axis_factors(H, W, alpha, mu, sigma)
    h, M = alpha.shape
    K = torch.einsum("hmac,hmbd->habcd", GH, GW)  # [a, b] = (i, j), [c, d] = (i', j')
    return K.reshape(h, H * W, H * W)


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return torch.where(y > 20, y, torch.log(torch.expm1(y)))


class SSoG(nn.Module):
    """Separable sum-of-Gaussians mixer on (B, H, W, C) token grids.

    Parameters: `alpha` (h, M), `mu` (h, M, 2), `sigma_raw` (h, M, 2) with
    sigma = softplus(sigma_raw) + SIGMA_FLOOR. `freeze_kernels()` fixes alpha, mu, sigma.
    """

    def __init__(self, dim: int, num_heads: int, num_components: int = 4, *, backend: str = "matmul",
                 init_sigma: tuple[float, float] = (0.5, 4.0), init_mu: float = 2.0,
                 device=None, dtype=None):
        super().__init__()
        if dim <= 0 or num_heads <= 0 or num_components <= 0:
            raise ValueError("dim, num_heads and num_components must be positive")
        if dim % num_heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}); "
                             f"pick num_heads among the divisors of dim")
        if backend not in BACKENDS and backend != "auto":
            raise ValueError(f"unknown SSoG backend {backend!r}; choose one of {sorted(BACKENDS)}")
        fk = dict(device=device, dtype=dtype)
        self.dim, self.num_heads, self.num_components = dim, num_heads, num_components
        self.head_dim = dim // num_heads
        self.backend = backend
        self.v_proj = nn.Linear(dim, dim, bias=False, **fk)
        self.o_proj = nn.Linear(dim, dim, **fk)
        h, M = num_heads, num_components
        self.alpha = nn.Parameter(torch.empty(h, M, **fk))
        self.mu = nn.Parameter(torch.empty(h, M, 2, **fk))
        self.sigma_raw = nn.Parameter(torch.empty(h, M, 2, **fk))
        self._init_sigma, self._init_mu = init_sigma, init_mu
        self.reset_kernels()

    @torch.no_grad()
    def reset_kernels(self) -> None:
        """alpha = 1/M (a smoothing average at start), offsets uniform in +-init_mu, widths log-uniform."""
        if self.alpha.is_meta:
            return
        M = self.num_components
        self.alpha.fill_(1.0 / M)
        self.mu.uniform_(-self._init_mu, self._init_mu)
        lo, hi = (math.log(s) for s in self._init_sigma)
        sig = torch.empty_like(self.sigma_raw).uniform_(lo, hi).exp()
        self.sigma_raw.copy_(_inverse_softplus(sig - SIGMA_FLOOR))

    def gaussian_params(self):
        """Effective (alpha, mu, sigma), shapes (h, M), (h, M, 2), (h, M, 2); [..., 0] is y, [..., 1] is x."""
        return self.alpha, self.mu, F.softplus(self.sigma_raw) + SIGMA_FLOOR

    @torch.no_grad()
    def set_gaussian_params(self, alpha=None, mu=None, sigma=None) -> None:
        """Set effective values; each may be omitted. sigma must exceed SIGMA_FLOOR."""
        h, M = self.num_heads, self.num_components
        for name, val, shape in (("alpha", alpha, (h, M)), ("mu", mu, (h, M, 2)), ("sigma", sigma, (h, M, 2))):
            if val is None:
                continue
            val = torch.as_tensor(val, dtype=self.alpha.dtype, device=self.alpha.device)
            if tuple(val.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(val.shape)}")
            if not torch.isfinite(val).all():
                raise ValueError(f"{name} must be finite")
            if name == "sigma":
                if not bool((val > 0).all()):
                    raise ValueError("sigma must be > 0 (every Gaussian width is positive); "
                                     f"got min {float(val.min()):.3g}")
                if not bool((val > SIGMA_FLOOR).all()):
                    raise ValueError(f"sigma must exceed the floor {SIGMA_FLOOR} of its softplus "
                                     f"parametrisation; got min {float(val.min()):.3g}")
                self.sigma_raw.copy_(_inverse_softplus(val - SIGMA_FLOOR))
            else:
                getattr(self, name).copy_(val)

    def freeze_kernels(self, frozen: bool = True) -> "SSoG":
        """Fixed-kernel SSoG: alpha, mu, sigma stop training; the map becomes affine in X."""
        for p in (self.alpha, self.mu, self.sigma_raw):
            p.requires_grad_(not frozen)
        return self

    def head_projections(self) -> torch.Tensor:
        """P_h = W_V[:, head h] @ W_O[head h, :], shape (h, C, C), right-multiplying X (N, C)."""
        d = self.head_dim
        WV = self.v_proj.weight.T  # (C_in, C): X @ WV is the value projection
        WO = self.o_proj.weight.T  # (C, C_out)
        return torch.stack([WV[:, i * d:(i + 1) * d] @ WO[i * d:(i + 1) * d, :] for i in range(self.num_heads)])

    def operator_matrix(self, H: int, W: int) -> torch.Tensor:
        """Dense K_h for every head, shape (h, H*W, H*W). For verification on small grids only."""
        return operator_matrices(H, W, *self.gaussian_params())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"SSoG expects (B, H, W, C={self.dim}), got {tuple(x.shape)}")
        B, H, W, C = x.shape
        v = self.v_proj(x).reshape(B, H, W, self.num_heads, self.head_dim)
        backend = self.backend
        if backend == "auto":
            backend = choose_backend(H, W, *self.gaussian_params())
        y = ssog_mix(v, *self.gaussian_params(), backend=backend)
        return self.o_proj(y.reshape(B, H, W, C))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.num_heads}, components={self.num_components}, backend={self.backend}"


def choose_backend(H: int, W: int, alpha, mu, sigma) -> str:
    """Cost model for backend='auto'. Only the dense-axis backend exists so far."""
    return "matmul"
