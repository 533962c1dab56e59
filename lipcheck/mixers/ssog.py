"""SSoG: separable sum-of-Gaussians token mixing (SPEC section 1).

    SSoG(X) = sum_h K_h X P_h + b,   K_h = sum_m alpha[h, m] G_H(mu_y, sigma_y) kron G_W(mu_x, sigma_x)

The pure function `ssog_mix` applies sum_m alpha G_H V G_W^T per head without ever building the
N x N matrix; the backends in `BACKENDS` are interchangeable implementations of it. The module
`SSoG` is a thin shell: value projection (no bias, so that the affine part is exactly b), the
mixing, the output projection.

Where the machinery lives, one job per module: the taps and Toeplitz factors in `taps`, their closed-form
gradients in `tap_grad`, one module per backend under `backends` (the table `BACKENDS`; the cost model of
backend='auto' in `backends.cost`), the kernel cache and `prepared_kernels` in `kernel_cache`, the reused
inference buffers in `workspace`, the thread count of each call in `thread_policy`. The names other code uses
are importable from here as well.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from .. import gaussian
from . import workspace
from .backends import BACKENDS, stacked
from .kernel_cache import _FUNCTORCH, _PEEK_STACK, KernelCache
from .taps import SIGMA_FLOOR, _effective_sigma, axis_factors
from .thread_policy import ThreadPolicy
from .workspace import _give_workspace, _take_workspace
# the rest of the machinery's names that callers and tests import from here
from .backends import BACKEND_PARTS  # noqa: F401
from .backends.cost import COST_WEIGHTS, backend_costs, choose_backend  # noqa: F401
from .backends.fft import fft_size  # noqa: F401
from .backends.stacked import _apply_stacked, _prepare_stacked, _repeated, _transposed_factors  # noqa: F401
from .backends.truncated import truncation_radius  # noqa: F401
from .kernel_cache import prepared_kernels  # noqa: F401
from .taps import _axis_taps, _toeplitz, tap_floor, truncation_tol  # noqa: F401
from .workspace import _WORKSPACE, clear_workspace  # noqa: F401


def _check_grid(x: torch.Tensor, num_heads: int) -> None:
    if x.dim() != 5:
        raise ValueError(f"values must have shape (B, H, W, heads, head_dim), got {tuple(x.shape)}")
    if x.shape[3] != num_heads:
        raise ValueError(f"values have {x.shape[3]} heads, the kernels {num_heads}")


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


_HOOK_TABLES = tuple(getattr(torch.nn.modules.module, n, None) for n in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))


def plain_linear(mod: nn.Module) -> bool:
    """mod is a plain nn.Linear with no hooks of its own and none global: calling its weight and bias directly
    is then exactly mod(x). Anything else (hooks, a quantised, parametrised or otherwise replaced projection)
    must be called as the module it is."""
    return (type(mod) is nn.Linear and not (mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks
                                            or mod._backward_pre_hooks)
            and None not in _HOOK_TABLES and not any(_HOOK_TABLES))


def _linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """mod(x), as F.linear where `plain_linear(mod)`: nn.Module's call machinery costs about 7 microseconds per
    call, 5 % of a C = 192 layer at 14 x 14, batch 1."""
    if plain_linear(mod):
        p = mod._parameters
        return F.linear(x, p["weight"], p["bias"])
    return mod(x)


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return torch.where(y > 20, y, torch.log(torch.expm1(y)))


class SSoG(KernelCache, nn.Module):
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
        # CPU only: on other devices the mixing is one stream of kernels with no thread count to choose
        self.thread_policy = ThreadPolicy() if torch.device(device or "cpu").type == "cpu" else None
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
        return self.alpha, self.mu, _effective_sigma(self.sigma_raw)

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
                gaussian.check_representable(self.mu, val, self.alpha.dtype, name="SSoG kernel")
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
        policy = self.thread_policy
        if policy is None or not x.is_cpu or torch.get_num_threads() <= 1:
            return self._mix(x)
        B, H, W, _ = x.shape
        key = (B, H, W, self.backend, x.dtype, torch.is_grad_enabled())
        n = torch.get_num_threads()
        k = policy.choose(key)
        if k != n:
            torch.set_num_threads(k)
        t0 = time.perf_counter()
        try:
            y = self._mix(x)
        finally:
            if k != n:
                torch.set_num_threads(n)
        policy.record(key, k, time.perf_counter() - t0)
        return y

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        """Value projection, per-head spatial mixing with the (cached) factors, output projection."""
        B, H, W, C = x.shape
        mods = self._modules
        ws = self._workspace(x)
        if ws is None:
            v = _linear(mods["v_proj"], x).reshape(B, H, W, self.num_heads, self.head_dim)
            return _linear(mods["o_proj"], self.mix_values(v).reshape(B, H, W, C))
        try:
            # the value projection as F.linear computes it without a bias (one GEMM on the flattened tokens)
            v = torch.mm(x.reshape(B * H * W, C), mods["v_proj"]._parameters["weight"].t(),
                         out=ws.get("v", (B * H * W, C), x))
            mixed = self.mix_values(v.view(B, H, W, self.num_heads, self.head_dim), ws)
            return _linear(mods["o_proj"], mixed.reshape(B, H, W, C))  # fresh: the caller keeps it
        finally:
            _give_workspace(ws)

    def _workspace(self, x: torch.Tensor):
        """The thread's `_Workspace` for this call, or None: only for calls above FUSE_HEADS_TOKENS tokens (below,
        glibc's heap serves the small tensors without fresh pages) on a CPU, with grad mode off (nothing may save a
        buffer for a backward), no torch.func transform, plain projections and x of the weights' dtype."""
        B, H, W, C = x.shape
        # the limits read where they live (assignments through this module reach them there)
        if (workspace.WORKSPACE_MAX_BYTES <= 0 or B * H * W <= stacked.FUSE_HEADS_TOKENS
                or torch.is_grad_enabled() or type(x) is not torch.Tensor or not x.is_cpu
                or x.layout is not torch.strided):
            return None
        mods = self._modules
        weight = mods["v_proj"]._parameters["weight"]
        if (x.dtype is not weight.dtype or not weight.is_cpu or not plain_linear(mods["v_proj"])
                or not plain_linear(mods["o_proj"]) or (_FUNCTORCH and _PEEK_STACK() is not None)):
            return None
        # v and the mixed values, plus the per-head intermediate (at most M times one head's values)
        nbytes = x.numel() * x.element_size() * (2 + (self.num_components + 1) / self.num_heads)
        return _take_workspace((B, H, W, C, self.num_heads, self.num_components, x.dtype), nbytes)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.num_heads}, components={self.num_components}, backend={self.backend}"
