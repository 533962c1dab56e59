"""Tangent maps (X, V) -> (f(X), J(X) V) on batches (S, N, C): everything the probe computes is built from one.

For DenseAttention and for BlockMap / VectorField over a Block whose mixer is a DenseAttention the map is
written out with batched matmuls (`attention_tangent`, `layernorm_tangent`, `mlp_tangent`; the tests check
them against autograd). For any other module it is torch.func.jvp of the batched forward: the grids are
independent, so J of the batch is block diagonal and one jvp of the batch gives every grid's own J V, with
no vmap. Gradients come from reverse mode through the tangent map: grad_V 0.5 ||J V||^2 = J^T J V,
grad_X 0.5 ||J V||^2 (the envelope-theorem ascent direction of the top singular value).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, jvp

from ..mixers.attention import DenseAttention
from .maps import BlockMap, as_map, check_grid, default_device, frozen_state


def _linear(lin: nn.Linear, device, dtype):
    """(W^T, b) of an nn.Linear as constants: y = x W^T + b."""
    b = lin.bias.detach().to(device, dtype) if lin.bias is not None else None
    return lin.weight.detach().to(device, dtype).T.contiguous(), b


def attention_tangent(p: dict, X: torch.Tensor, V: torch.Tensor, need_y: bool = True):
    """(f(X), J(X) V) of DenseAttention for X, V (S, N, C) with batched matmuls (f(X) is None when not
    `need_y`: the probe's objective reads J V alone, which saves the primal output projection).

    With per-head Q = X W_Q + b_Q (K, V alike), S = Q K^T / sqrt d, P = softmax(S) row-wise:
    dQ = V W_Q, dS = (dQ K^T + Q dK^T) / sqrt d, dP = P o (dS - rowsum(P o dS)) (softmax's Jacobian
    diag(p) - p^T p per row), d(P Vv) = dP Vv + P dVv, dY = d(P Vv) W_O."""
    S, N, C = X.shape
    h = p["heads"]
    d = C // h
    heads = lambda t: t.reshape(S, N, h, d).transpose(1, 2)  # (S, h, N, d)
    # separate products per projection, primal and tangent: splitting one fused product costs more in
    # the backward pass (zero-filled slice gradients or a stack) than the extra calls
    q, k, v = (heads(X @ p[f"W{n}"] + p[f"b{n}"]) for n in "qkv")
    dq, dk, dv = (heads(V @ p[f"W{n}"]) for n in "qkv")
    scale = 1.0 / math.sqrt(d)
    P = torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1)
    dS = (dq @ k.transpose(-2, -1) + q @ dk.transpose(-2, -1)) * scale
    PdS = P * dS
    dP = PdS - P * PdS.sum(-1, keepdim=True)
    merge = lambda t: t.transpose(1, 2).reshape(S, N, C)
    y = merge(P @ v) @ p["Wo"] + p["bo"] if need_y else None
    dy = merge(dP @ v + P @ dv) @ p["Wo"]
    return y, dy


def layernorm_tangent(p: dict, X: torch.Tensor, V: torch.Tensor):
    """(LN(X), J V) per token: xhat = (x - mean) r, r = (var + eps)^-1/2 (biased variance),
    d xhat = r (dxc - xhat mean(xhat dxc)), dxc = dx - mean(dx); LN = gamma xhat + beta."""
    mu = X.mean(-1, keepdim=True)
    xc = X - mu
    r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + p["eps"])
    xhat = xc * r
    dxc = V - V.mean(-1, keepdim=True)
    dxhat = r * (dxc - xhat * (xhat * dxc).mean(-1, keepdim=True))
    g, b = p["gamma"], p["beta"]
    y = xhat if g is None else xhat * g
    return (y if b is None else y + b), (dxhat if g is None else dxhat * g)


_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)


def mlp_tangent(p: dict, X: torch.Tensor, V: torch.Tensor, need_y: bool = True):
    """(MLP(X), J V) for fc2(GELU(fc1 x)) with exact (erf) GELU: GELU'(a) = Phi(a) + a phi(a)."""
    a = X @ p["W1"] + p["b1"]
    da = V @ p["W1"]
    Phi = 0.5 * (1.0 + torch.erf(a * _INV_SQRT2))
    g1 = Phi + a * torch.exp(-0.5 * a * a) * _INV_SQRT2PI
    return ((a * Phi) @ p["W2"] + p["b2"] if need_y else None), (g1 * da) @ p["W2"]


def _attention_params(m: DenseAttention, device, dtype) -> dict:
    zero = torch.zeros(m.dim, device=device, dtype=dtype)
    p = {"heads": m.num_heads}
    for n, lin in (("q", m.q_proj), ("k", m.k_proj), ("v", m.v_proj), ("o", m.o_proj)):
        W, b = _linear(lin, device, dtype)
        p[f"W{n}"], p[f"b{n}"] = W, (b if b is not None else zero)
    return p


def _layernorm_params(m: nn.Module, device, dtype):
    if isinstance(m, nn.Identity):
        return None
    if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
        cv = lambda t: t.detach().to(device, dtype) if t is not None else None
        return {"eps": m.eps, "gamma": cv(m.weight), "beta": cv(m.bias)}
    raise NotImplementedError


def _mlp_params(m: nn.Module, device, dtype):
    from ..models.vit import Mlp
    if type(m) is not Mlp:
        raise NotImplementedError
    (W1, b1), (W2, b2) = _linear(m.fc1, device, dtype), _linear(m.fc2, device, dtype)
    z = lambda b, n: b if b is not None else torch.zeros(n, device=device, dtype=dtype)
    return {"W1": W1, "b1": z(b1, W1.shape[1]), "W2": W2, "b2": z(b2, W2.shape[1])}


def analytic_tangent(module: nn.Module, device, dtype):
    """The batched-matmul tangent map for DenseAttention and pre-norm blocks around one; None otherwise."""
    if type(module) is DenseAttention:
        p = _attention_params(module, device, dtype)
        return lambda X, V, need_y=True: attention_tangent(p, X, V, need_y)
    if not isinstance(module, BlockMap) or type(module.block.mixer) is not DenseAttention:
        return None
    b = module.block
    try:
        ln1 = _layernorm_params(b.norm1, device, dtype)
        pa = _attention_params(b.mixer, device, dtype)
        use_mlp = module.branch == "vector_field" and b.mlp is not None
        ln2 = _layernorm_params(b.norm2, device, dtype) if use_mlp else None
        pm = _mlp_params(b.mlp, device, dtype) if use_mlp else None
    except NotImplementedError:
        return None
    ident = lambda X, V: (X, V)
    lt1 = (lambda X, V: layernorm_tangent(ln1, X, V)) if ln1 is not None else ident
    lt2 = (lambda X, V: layernorm_tangent(ln2, X, V)) if ln2 is not None else ident

    def tangent(X, V, need_y=True):
        y, dy = attention_tangent(pa, *lt1(X, V), need_y)
        if pm is None:
            return y, dy
        ym, dym = mlp_tangent(pm, *lt2(X, V), need_y)
        return (y + ym if need_y else None), dy + dym
    return tangent


def tangent_map(layer: nn.Module, grid: tuple[int, int], *, device=None, dtype=torch.float64,
                analytic: bool = True):
    """T(X, V) = (f(X), J_f(X) V) for batches X, V (S, N, C) of grids, in (device, dtype).

    Analytic (batched matmuls) for DenseAttention and BlockMap / VectorField over a DenseAttention
    block when `analytic`; otherwise torch.func.jvp of the module's batched forward."""
    H, W = check_grid(grid)
    device = torch.device(device) if device is not None else default_device()
    module = as_map(layer).to(device=device, dtype=dtype)
    t = analytic_tangent(module, device, dtype) if analytic else None
    if t is not None:
        return t
    state = frozen_state(module)

    def f(X):
        S, N, C = X.shape
        return functional_call(module, state, (X.reshape(S, H, W, C),)).reshape(S, N, C)
    return lambda X, V, need_y=True: jvp(f, (X,), (V,))


def half_sq(tangent):
    """(X, V) -> (sum_s 0.5 ||J_s V_s||^2, per-sample 0.5 ||J_s V_s||^2): the probe's one objective."""
    def obj(X, V):
        val = 0.5 * tangent(X, V, False)[1].pow(2).flatten(1).sum(1)
        return val.sum(), val.detach()
    return obj


def jtj_of(tangent):
    """V -> (J^T J V, ||J V||^2) per sample: the gradient in V of 0.5 ||J V||^2."""
    g = grad_and_value(half_sq(tangent), argnums=1, has_aux=True)

    def jtj(X, V):
        gV, (_, val) = g(X, V)
        return gV, 2 * val
    return jtj
