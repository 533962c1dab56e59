"""Attention growth (SPEC S4): certified lower bounds on L(R) = sup_{||X||_F <= R} ||J_f(X)||_2.

The map probed is any nn.Module f mapping token grids (B, H, W, C) -> (B, H, W, C) that treats the B
grids independently (eval mode: no batch statistics), as a map of one grid X (N x C, N = H W). For
lipcheck's `DenseAttention` that is the whole multi-head layer with its output projection and biases,

    f(X) = sum_h softmax(Q^h K^h^T / sqrt(d)) V^h W_O^h + b_O,  Q^h = X W_Q^h + b_Q^h (K, V alike);

the same probe runs on a pre-norm block's mixer branch x -> Mixer(LN1 x) and on the Neural-ODE vector
field F(x) = Mixer(LN1 x) + MLP(LN2 x) (`BlockMap`). Inputs are measured in the Frobenius norm of X,
the Jacobian in the spectral norm.

The probe (`attention_growth`) searches every radius at once by batched projected ascent (`search`, from
structured `witness` inputs and random ones), re-evaluates the best inputs in float64 at an actual vector
(`certification`: each value is a Jacobian norm attained at an actual input, a certified lower bound on
L(R)), and fits the exponent of L(R) ~ R^k (`result`). Every computation is built from one tangent map
(X, V) -> (f(X), J(X) V) on batches (`tangents`); the search and certification knobs are a `ProbeOptions`.

A foreign attention block on (B, N, C) tokens (timm's `Attention`, say) is probed through a wrapper:

    class OnGrid(nn.Module):
        def __init__(self, attn):
            super().__init__()
            self.attn = attn
        def forward(self, x):                      # (B, H, W, C) -> (B, H, W, C)
            B, H, W, C = x.shape
            return self.attn(x.reshape(B, H * W, C)).reshape(B, H, W, C)

    attention_growth(OnGrid(timm_block.attn).double(), radii, grid=(14, 14), dim=C)

(`dim` is needed when the module has no `.dim`, LayerNorm or DenseAttention to read C from; a fused
"""
from .certification import certify
from .growth import attention_growth
from .maps import BlockMap, default_device, exact_jacobian_norm
from .options import ProbeOptions
from .result import GrowthResult
from .search import ascend, benchmark_batched_vs_loop
from .tangents import tangent_map
from .witness import attention_witness, witness_closed_form, witness_directions
# the machinery behind them, importable from here as before
from .certification import CERTIFY_METHODS, lanczos_top  # noqa: F401
from .result import fit_exponent  # noqa: F401
from .tangents import attention_tangent, layernorm_tangent, mlp_tangent  # noqa: F401
from .witness import WITNESS_FOCUS  # noqa: F401

__all__ = ["attention_growth", "ProbeOptions", "GrowthResult", "BlockMap", "tangent_map", "ascend", "certify",
           "witness_directions", "attention_witness", "witness_closed_form", "exact_jacobian_norm",
           "benchmark_batched_vs_loop", "default_device"]
