"""The maps the probe measures: any nn.Module on token grids (B, H, W, C), a pre-norm block's branches
(`BlockMap`), and the float-checked private copy every probe works on."""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call, jacrev

from ..mixers.attention import DenseAttention


def default_device() -> torch.device:
    """cuda when available, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class BlockMap(nn.Module):
    """A pre-norm Block as a map of (B, H, W, C): branch "mixer" is x -> Mixer(LN1 x) (the residual
    branch; the block's update adds the identity, i.e. at most +1 on the constant), "vector_field" is
    F(x) = Mixer(LN1 x) + MLP(LN2 x), the Neural-ODE right-hand side."""

    BRANCHES = ("mixer", "vector_field")

    def __init__(self, block: nn.Module, branch: str = "mixer"):
        super().__init__()
        if branch not in self.BRANCHES:
            raise ValueError(f"unknown branch {branch!r}; choose one of {self.BRANCHES}")
        self.block, self.branch = block, branch

    def forward(self, x):
        if self.branch == "mixer":
            return self.block.mixer(self.block.norm1(x))
        return self.block.vector_field(x)


def check_grid(grid):
    """(H, W) as two positive ints, or a ValueError naming `grid`."""
    try:
        H, W = (int(g) for g in grid)
    except (TypeError, ValueError):
        raise ValueError(f"grid must be a pair (H, W) of positive integers, got {grid!r}") from None
    if H <= 0 or W <= 0 or (H, W) != tuple(grid):
        raise ValueError(f"grid must be a pair (H, W) of positive integers, got {grid!r}")
    return H, W


def as_map(layer: nn.Module) -> nn.Module:
    """A private float-checked copy in eval mode: attention on the explicit-softmax "math" backend
    (SDPA has no forward-mode AD rule on every device); a VectorField (which logs its state) becomes
    its block's field."""
    from ..models.ode import VectorField
    if isinstance(layer, VectorField):
        layer = BlockMap(layer.block, "vector_field")
    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer must be an nn.Module mapping (B, H, W, C) -> (B, H, W, C), got {type(layer).__name__}")
    m = copy.deepcopy(layer)
    for sub in m.modules():
        if isinstance(sub, DenseAttention):
            sub.backend = "math"
    for name, p in m.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise ValueError(f"layer parameter {name!r} has non-finite entries (NaN or inf); probe a layer with "
                             f"finite weights")
    return m.eval()


def frozen_state(module: nn.Module) -> dict:
    """The module's parameters and buffers, detached: constants for functional_call."""
    state = {k: v.detach() for k, v in module.named_parameters()}
    state.update({k: v.detach() for k, v in module.named_buffers()})
    return state


def functional(module: nn.Module, H: int, W: int, *, device, dtype):
    """f(X) on one grid X (N, C) -> (N, C), with the module's weights as constants in (device, dtype)."""
    module = module.to(device=device, dtype=dtype)
    state = frozen_state(module)

    def f(X):
        return functional_call(module, state, (X.reshape(1, H, W, X.shape[-1]),)).reshape(X.shape)
    return f


def infer_channels(module: nn.Module) -> int:
    """C of the grids the module maps, read from its first DenseAttention, LayerNorm or `.dim`."""
    for m in module.modules():
        if isinstance(m, DenseAttention):
            return m.dim
        if isinstance(m, nn.LayerNorm):
            return m.normalized_shape[-1]
        if hasattr(m, "dim") and isinstance(m.dim, int):
            return m.dim
    raise ValueError("cannot infer the channel count C of layer; pass dim=C, or a DenseAttention, a BlockMap or a "
                     "module with a .dim attribute")


def exact_jacobian_norm(layer: nn.Module, X: torch.Tensor) -> float:
    """Reference: ||J_f(X)||_2 by dense jacrev + SVD in float64, X (H, W, C). For small grids only."""
    H, W, C = X.shape
    f = functional(as_map(layer), H, W, device=X.device, dtype=torch.float64)
    J = jacrev(f)(X.reshape(H * W, C).to(torch.float64)).reshape(H * W * C, H * W * C)
    return float(torch.linalg.matrix_norm(J, 2))
