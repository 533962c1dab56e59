"""Dense multi-head self-attention on (B, H, W, C) token grids, the matched baseline to SSoG.

    f(X) = concat_h softmax(X W_Q^h (X W_K^h)^T / sqrt(d)) X W_V^h  W_O + b

`attention` is the pure function; backend "sdpa" calls the fused
`torch.nn.functional.scaled_dot_product_attention`, backend "math" writes the softmax out
(materialising the N x N weights, as a standard ViT does, and batching under torch.func.vmap).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_BACKENDS = ("sdpa", "math")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over the token axis; q, k, v of shape (..., N, d)."""
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v)
    if backend == "math":
        w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        return w @ v
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")


class DenseAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v/o projections (all with bias, timm style)."""

    def __init__(self, dim: int, num_heads: int, *, backend: str = "sdpa", device=None, dtype=None):
        super().__init__()
        if dim <= 0 or num_heads <= 0:
            raise ValueError("dim and num_heads must be positive")
        if dim % num_heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}); "
                             f"pick num_heads among the divisors of dim")
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
        fk = dict(device=device, dtype=dtype)
        self.dim, self.num_heads, self.head_dim, self.backend = dim, num_heads, dim // num_heads, backend
        self.q_proj = nn.Linear(dim, dim, **fk)
        self.k_proj = nn.Linear(dim, dim, **fk)
        self.v_proj = nn.Linear(dim, dim, **fk)
        self.o_proj = nn.Linear(dim, dim, **fk)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        *lead, N, C = t.shape
        return t.reshape(*lead, N, self.num_heads, self.head_dim).transpose(-3, -2)  # (..., h, N, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"DenseAttention expects (B, H, W, C={self.dim}), got {tuple(x.shape)}")
        B, H, W, C = x.shape
        t = x.reshape(B, H * W, C)
        q, k, v = (self._heads(p(t)) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = attention(q, k, v, self.backend).transpose(-3, -2).reshape(B, H * W, C)
        return self.o_proj(y).reshape(B, H, W, C)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.num_heads}, backend={self.backend}"
