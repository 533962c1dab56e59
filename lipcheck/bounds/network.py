"""Lipschitz bounds for a pre-norm block's vector field and the Neural-ODE right-hand side (SPEC S3).

    F(x) = Mixer(LN1(x)) + MLP(LN2(x)),   Lip(F) <= Lip(Mixer) Lip(LN1) + Lip(MLP) Lip(LN2)
    Lip(MLP) <= ||W1|| sup|GELU'| ||W2||,  Lip(LN) <= max|gamma| / sqrt(eps)  (global)
    ||J_LN(x)|| <= max|gamma| / sqrt(v + eps) at tokens of variance >= v      (local)

The discrete block x + F-like update has Lip <= 1 + Lip(Mixer) Lip(LN1) + ... ; here F is the
quantity the ODE theory (S5) needs. The global constant is dominated by 1/sqrt(eps): with eps = 1e-6
it is about 1000 max|gamma| per LayerNorm and says little; the local one along real states is the useful number.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .. import symbolic
from . import spectral
from ..rounding import gamma as _gamma

from .mlp import mlp_lipschitz

VACUOUS = 1e3  # a global bound above this says nothing useful about an ODE on [0, 1]
_U64 = torch.finfo(torch.float64).eps / 2  # Python floats and float64 tensors


@dataclasses.dataclass
class VectorFieldBound:
    global_bound: float
    local_bound: float | None
    mixer: float
    mlp: float
    ln1_global: float
    ln2_global: float
    ln1_local: float | None
    ln2_local: float | None
    vacuous: bool
    terms: dict


def _block_of(model_or_block) -> nn.Module:
    if hasattr(model_or_block, "vector_field") and hasattr(model_or_block.vector_field, "block"):
        return model_or_block.vector_field.block
    if all(hasattr(model_or_block, a) for a in ("norm1", "mixer", "norm2", "mlp")):
        return model_or_block
    raise TypeError("model_or_block must be an ODE ViT (with .vector_field.block) or a Block; "
                    f"got {type(model_or_block).__name__}")


def _ln_constants(norm: nn.Module, v: float | None, device):
    """(global, local, token_radius) of one LayerNorm (Identity: 1, 1, inf)."""
    if isinstance(norm, nn.Identity):
        return 1.0, 1.0, math.inf
    if not isinstance(norm, nn.LayerNorm):
        raise TypeError(f"unsupported norm {type(norm).__name__}; expected nn.LayerNorm or nn.Identity")
    C = norm.normalized_shape[-1]
    # the stored weights, exactly (float64 holds every float32/bf16 value): converting a float64 layer to a coarser
    # certification dtype would round max|gamma| and beta, possibly down
    f64 = dict(dtype=torch.float64, device=device)
    gamma = norm.weight.detach().to(**f64) if norm.weight is not None else torch.ones(C, **f64)
    beta = norm.bias.detach().to(**f64) if norm.bias is not None else torch.zeros(C, **f64)
    if not (bool(torch.isfinite(gamma).all()) and bool(torch.isfinite(beta).all())):
        raise ValueError("LayerNorm weight/bias have non-finite entries; fix the weights before certifying")
    gmax = float(gamma.abs().max())
    up = 1 + 8 * torch.finfo(torch.float64).eps  # the closed form is evaluated in 53-bit arithmetic (sum, sqrt, division, product)
    glob = symbolic.layernorm_lipschitz(gmax, norm.eps) * up
    loc = symbolic.layernorm_lipschitz(gmax, norm.eps, v) * up if v is not None else None
    # LN output token: gamma * z + beta with ||z|| <= sqrt(C); the norm of beta (C squares, a sum, a sqrt), sqrt(C),
    # one product and one sum, all in float64: gamma_{C+4} (proofs/S3.md, 'Rounding')
    radius = (math.sqrt(C) * gmax + float(beta.norm())) * (1 + _gamma(C + 4, _U64))
    return glob, loc, radius


def mixer_lipschitz(mixer, *, token_radius: float = math.inf, num_tokens: int | None = None,
                    dtype=torch.float64, device=None, rtol: float = 1e-4) -> tuple[float, dict]:
    """Certified Lipschitz constant of the mixer. SSoG: the resolution-free bound (every grid).
    DenseAttention: only finite on a bounded domain, via lipcheck.bounds.attention.attention_lipschitz_on_ball."""
    from ..mixers.attention import DenseAttention
    from ..mixers.ssog import SSoG
    if isinstance(mixer, SSoG):
        p = spectral.ssog_params(mixer, dtype=dtype, device=device)
        closed = spectral.closed_form_bound(p)
        rf, info = spectral.resolution_free_bound(p, rtol=rtol)
        return min(rf.upper, closed), dict(kind="ssog", resolution_free=rf.upper, symbol_sup_lower=rf.lower,
                                           closed_form=closed, **info)
    if isinstance(mixer, DenseAttention):
        if not math.isfinite(token_radius):
            raise ValueError("dense attention is not globally Lipschitz without LayerNorm in front of it "
                             "(use_norm=False): no finite bound exists")
        if num_tokens is None:
            raise ValueError("a dense-attention bound depends on the number of tokens: pass states (B, H, W, C)")
        try:
            from .attention import attention_lipschitz_on_ball
        except ImportError as e:
            raise NotImplementedError("the dense-attention Lipschitz bound needs "
                                      "lipcheck.bounds.attention.attention_lipschitz_on_ball, which is not "
                                      f"available in this checkout ({e})") from None
        L = float(attention_lipschitz_on_ball(mixer, token_radius, num_tokens, dtype=dtype, device=device))
        return L, dict(kind="attention", token_radius=token_radius, num_tokens=num_tokens)
    raise TypeError(f"unsupported mixer {type(mixer).__name__}; expected SSoG or DenseAttention")


def min_token_variance(states: torch.Tensor) -> float:
    """Smallest per-token (biased, over channels) variance: what LayerNorm divides by."""
    if not torch.is_tensor(states) or states.dim() < 2:
        raise ValueError("states must be a tensor (..., C), e.g. (B, H, W, C)")
    if not bool(torch.isfinite(states).all()):
        raise ValueError("states contain non-finite values; certify only finite states")
    return float(token_variance_lower(states).min())


def token_variance_lower(x: torch.Tensor) -> torch.Tensor:
    """Per token (last axis), a proven lower bound on the biased variance of the stored values, in float64."""
    x = x.detach().to(torch.float64)
    C = x.shape[-1]
    # a lower bound, not the computed value (proofs/S3.md, 'Rounding'): the two-pass variance s^ of a token exceeds
    # (1 / C) sum (x_i - m^)^2 by at most gamma_{C+3}, and that sum exceeds C var by C (m^ - m)^2, |m^ - m| <= gamma_C mean|x|
    m = x.mean(dim=-1, keepdim=True)
    s = (x - m).square().mean(dim=-1)
    e_m = _gamma(C, _U64) * x.abs().mean(dim=-1) * (1 + _gamma(C, _U64))
    low = (s * (1 - _gamma(C + 3, _U64)) - e_m.square() * (1 + _gamma(3, _U64))) * (1 - _gamma(2, _U64))
    return low.clamp_min(0)


def vector_field_lipschitz(model_or_block, states=None, *, min_variance: float | None = None,
                           dtype=torch.float64, device=None, rtol: float = 1e-4,
                           gelu_variant: str = "exact", mixer_bound: tuple[float, dict] | None = None) -> VectorFieldBound:
    """Global and local Lipschitz bounds for F(x) = Mixer(LN1 x) + MLP(LN2 x) (SPEC S3).

    model_or_block: an ODE ViT (its `.vector_field.block` is used) or a Block.
    states: optional (B, H, W, C) tensor(s) along which the local bound holds; the local bound uses
    v = min token variance over the states (and `min_variance` if given, the smaller of the two).
    The global bound uses LayerNorm's global constant max|gamma| / sqrt(eps). `mixer_bound` = (value, terms)
    reuses a mixer constant from an earlier call (SSoG's does not depend on the states).
    """
    block = _block_of(model_or_block)
    if isinstance(states, (list, tuple)):
        states = torch.cat([s.reshape(-1, s.shape[-1]) for s in states]) if states else None
    v = None
    num_tokens = None
    if states is not None:
        v = min_token_variance(states)
        num_tokens = int(states.shape[1] * states.shape[2]) if states.dim() == 4 else None
    if min_variance is not None:
        if not math.isfinite(min_variance) or min_variance < 0:
            raise ValueError(f"min_variance must be finite and >= 0, got {min_variance}")
        v = min_variance if v is None else min(v, min_variance)
    ln1_g, ln1_l, radius1 = _ln_constants(block.norm1, v, device)
    use_mlp = block.mlp is not None
    if use_mlp:
        ln2_g, ln2_l, _ = _ln_constants(block.norm2, v, device)
    else:
        ln2_g, ln2_l = 0.0, (0.0 if v is not None else None)
    if mixer_bound is not None:  # reuse a mixer constant computed before (it does not depend on the states)
        mixer, mixer_terms = mixer_bound
    else:
        mixer, mixer_terms = mixer_lipschitz(block.mixer, token_radius=radius1, num_tokens=num_tokens,
                                             dtype=dtype, device=device, rtol=rtol)
    mlp = mlp_lipschitz(block.mlp, dtype=dtype, device=device, variant=gelu_variant)
    up = 1 + _gamma(3, _U64)  # two products and a sum of non-negative floats (proofs/S3.md, 'Rounding')
    glob = (mixer * ln1_g + mlp * ln2_g) * up
    loc = None if v is None else (mixer * ln1_l + mlp * (ln2_l or 0.0)) * up
    terms = dict(mixer=mixer, mixer_terms=mixer_terms, mlp=mlp, gelu_sup=symbolic.gelu_derivative_sup(gelu_variant),
                 ln1_global=ln1_g, ln2_global=ln2_g, ln1_local=ln1_l, ln2_local=ln2_l, min_variance=v,
                 global_bound=glob, local_bound=loc, use_norm=not isinstance(block.norm1, nn.Identity),
                 use_mlp=use_mlp, vacuous_threshold=VACUOUS)
    return VectorFieldBound(global_bound=glob, local_bound=loc, mixer=mixer, mlp=mlp, ln1_global=ln1_g,
                            ln2_global=ln2_g, ln1_local=ln1_l, ln2_local=ln2_l, vacuous=glob > VACUOUS, terms=terms)
