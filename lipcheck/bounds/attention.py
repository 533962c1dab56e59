"""Certified Lipschitz upper bound for dense multi-head attention on a set of bounded tokens.

Dense attention is not globally Lipschitz (SPEC S4), but on the set

    D_rho = { X in R^{N x C} : ||x_i||_2 <= rho for every token i }

it is, and D_rho is exactly what a pre-norm block feeds it: LayerNorm maps every token into the ball
of radius sqrt(C) max|gamma| + ||beta||_2 (`layernorm_image_radius`). D_rho is convex, so the
Lipschitz constant of f on D_rho (Frobenius norm in and out) is sup_{X in D_rho} ||J_f(X)||_2, and a
bound on the Jacobian's norm over D_rho is a certified Lipschitz bound.

Notation (row vectors, x_i in R^C; nn.Linear weights transposed so that q = x W_Q + b_Q):
    per head h (head dim d):  A_h = W_Q^h (W_K^h)^T,  B_h = W_V^h W_O^h  (both C x C),
    c_h = b_Q^h (W_K^h)^T,  P^h = softmax(S^h) row-wise,  S^h = Q^h (K^h)^T / sqrt(d).
"""
from __future__ import annotations

import math

import torch

from ..mixers.attention import DenseAttention
from .. import symbolic


def head_matrices(layer: DenseAttention, *, dtype=torch.float64, device=None) -> dict:
    """A_h = W_Q^h W_K^h^T, B_h = W_V^h W_O^h, c_h = b_Q^h W_K^h^T and the per-head factors, in `dtype`.

    Shapes: A, B (h, C, C) acting on row vectors (x -> x A_h); c (h, C); W_Q, W_K, W_V (h, C, d); W_O (h, d, C).
    """
    if not isinstance(layer, DenseAttention):
        raise TypeError(f"layer must be a lipcheck DenseAttention, got {type(layer).__name__}")
    fk = dict(dtype=dtype, device=device if device is not None else layer.q_proj.weight.device)
    h, d, C = layer.num_heads, layer.head_dim, layer.dim
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        lin = getattr(layer, name)
        for p in (lin.weight, lin.bias):
            if p is not None and not bool(torch.isfinite(p).all()):
                raise ValueError(f"layer.{name} has non-finite weights (NaN or inf); certify a layer with "
                                 f"finite weights")

    def split_in(lin):  # (C_out, C_in) weight -> per head (h, C_in, d): x W^h gives head h's d features
        return lin.weight.detach().to(**fk).T.reshape(C, h, d).permute(1, 0, 2)

    def bias(lin):
        b = lin.bias.detach().to(**fk) if lin.bias is not None else torch.zeros(C, **fk)
        return b.reshape(h, d)

    WQ, WK, WV = split_in(layer.q_proj), split_in(layer.k_proj), split_in(layer.v_proj)
    WO = layer.o_proj.weight.detach().to(**fk).T.reshape(h, d, C)  # head h's rows of W_O
    A = WQ @ WK.transpose(1, 2)
    B = WV @ WO
    c = torch.einsum("hd,hcd->hc", bias(layer.q_proj), WK)
    return dict(A=A, B=B, c=c, WQ=WQ, WK=WK, WV=WV, WO=WO, bQ=bias(layer.q_proj), bK=bias(layer.k_proj),
                bV=bias(layer.v_proj), bO=(layer.o_proj.bias.detach().to(**fk) if layer.o_proj.bias is not None
                                           else torch.zeros(C, **fk)))


def _head_norms(layer: DenseAttention, *, dtype=torch.float64, device=None):
    """Per-head ||A_h||_2, ||B_h||_2, ||c_h|| and sqrt(d): everything the attention bounds read."""
    m = head_matrices(layer, dtype=dtype, device=device)
    return (torch.linalg.matrix_norm(m["A"], ord=2), torch.linalg.matrix_norm(m["B"], ord=2),
            torch.linalg.vector_norm(m["c"], dim=-1), math.sqrt(layer.head_dim))


def attention_lipschitz_terms(layer: DenseAttention, token_radius: float, num_tokens: int, *,
                              dtype=torch.float64, device=None) -> dict:
    """The three per-head terms of `attention_lipschitz_on_ball`, summed over heads (for reports)."""
    rho, N = _check_args(token_radius, num_tokens)
    nA, nB, nc, sd = _head_norms(layer, dtype=dtype, device=device)
    value = math.sqrt(N) * nB
    key_cov = rho ** 2 * nA * nB / sd
    query_side = math.sqrt(N) * rho * (rho * nA + nc) * nB / sd
    return {"value": float(value.sum()), "key_covariance": float(key_cov.sum()),
            "query_side": float(query_side.sum())}


def attention_lipschitz_on_ball(layer: DenseAttention, token_radius: float, num_tokens: int, *,
                                dtype=torch.float64, device=None) -> float:
    """Certified upper bound on Lip(f) over D_rho (every token norm <= rho), Frobenius in and out.

        Lip(f | D_rho) <= sum_h ||B_h||_2 [ sqrt(N) + rho^2 ||A_h||_2 / sqrt(d)
                                           + sqrt(N) rho (rho ||A_h||_2 + ||c_h||_2) / sqrt(d) ]

    Derivation. f(X) = sum_h P^h V^h W_O^h + b_O with V^h = X W_V^h + 1 b_V^h, so

        dY = sum_h [ P^h dX W_V^h + dP^h V^h ] W_O^h.

    Softmax's derivative, row i (p_i = row i of P^h, s_i of S^h): dp_i = ds_i (diag p_i - p_i^T p_i), hence
    (dP V)_i = sum_j p_ij ds_ij (v_j - vbar_i) with vbar_i = sum_j p_ij v_j, and
    ds_ij = (dx_i W_Q k_j^T + q_i W_K^T dx_j^T) / sqrt(d). Three terms, bounded on D_rho:

    1. value path dX -> P dX B_h: ||P||_2 <= sqrt(||P||_1 ||P||_inf) <= sqrt(N * 1) (rows sum to one,
       columns to at most N), so its norm is <= sqrt(N) ||B_h||.
    2. the query's own perturbation, dx_i -> dx_i A_h Sigma_i B_h / sqrt(d), with
       Sigma_i = sum_j p_ij (x_j - xbar_i)^T (x_j - xbar_i) the p_i-weighted covariance of the tokens
       (the key and value biases cancel inside a covariance). This map is block diagonal over i, and
       ||Sigma_i||_2 = sup_|w|=1 Var_{p_i}(x . w) <= E_{p_i}[(x . w)^2] <= rho^2, so its norm is
       <= rho^2 ||A_h|| ||B_h|| / sqrt(d). This is the term that grows like R^2 without LayerNorm.
    3. the keys' perturbation, (dX)_i -> sum_j p_ij (dx_j . w_i)(x_j - xbar_i) B_h / sqrt(d) with
       w_i = q_i W_K^T = x_i A_h + c_h, ||w_i|| <= rho ||A_h|| + ||c_h||. By Cauchy-Schwarz in the
       weights p_ij: ||sum_j p_ij (dx_j . w_i)(x_j - xbar_i)|| <= (sum_j p_ij (dx_j . w_i)^2)^{1/2} rho,
       and sum_i sum_j p_ij ||dx_j||^2 ||w_i||^2 <= N max_i ||w_i||^2 ||dX||_F^2 (column sums <= N),
       so its norm is <= sqrt(N) rho (rho ||A_h|| + ||c_h||) ||B_h|| / sqrt(d).

    The triangle inequality over terms and heads gives the bound; the output bias b_O does not enter.
    Spectral norms are computed by SVD in `dtype` (float64 by default: relative error ~1e-15, far
    below the slack of the triangle inequalities). The bound is finite for every rho but grows like
    rho^2, which is the certified counterpart of the R^2 growth the probe measures.
    """
    t = attention_lipschitz_terms(layer, token_radius, num_tokens, dtype=dtype, device=device)
    return t["value"] + t["key_covariance"] + t["query_side"]


def attention_lipschitz_on_frobenius_ball(layer: DenseAttention, radius: float, num_tokens: int, *,
                                          dtype=torch.float64, device=None) -> float:
    """Certified upper bound on L(R) = sup_{||X||_F <= R} ||J_f(X)||_2 (the probe's quantity):

        L(R) <= sum_h ||B_h||_2 [ sqrt(N) + R^2 ||A_h||_2 / sqrt(d) + R (R ||A_h||_2 + sqrt(N) ||c_h||_2) / sqrt(d) ].

    Same three terms as `attention_lipschitz_on_ball`, with what the Frobenius ball adds: every token has
    norm <= R (so the weighted covariances are <= R^2 in norm), and in term 3 the bound
    sum_i sum_j p_ij (dx_j . w_i)^2 <= ||dX||_F^2 sum_i ||w_i||^2 (p_ij <= 1) with
    sum_i ||w_i||^2 = ||X A_h + 1 c_h||_F^2 <= (R ||A_h|| + sqrt(N) ||c_h||)^2 replaces the factor sqrt(N) on the
    R^2 part."""
    R, N = _check_args(radius, num_tokens)
    nA, nB, nc, sd = _head_norms(layer, dtype=dtype, device=device)
    return float((nB * (math.sqrt(N) + R ** 2 * nA / sd + R * (R * nA + math.sqrt(N) * nc) / sd)).sum())


def layernorm_image_radius(norm: torch.nn.Module) -> float:
    """rho = sqrt(C) max|gamma| + ||beta||: LN(x) = gamma * xhat + beta with ||xhat|| <= sqrt(C)."""
    if not isinstance(norm, torch.nn.LayerNorm):
        raise TypeError(f"norm must be an nn.LayerNorm, got {type(norm).__name__}")
    C = norm.normalized_shape[-1]
    g = norm.weight.detach().double() if norm.weight is not None else torch.ones(C, dtype=torch.float64)
    b = norm.bias.detach().double() if norm.bias is not None else torch.zeros(C, dtype=torch.float64)
    return math.sqrt(C) * float(g.abs().max()) + float(b.norm())


def layernorm_lipschitz(norm: torch.nn.Module) -> float:
    """Global Lip(LN) <= max|gamma| / sqrt(eps) (per token, hence also for the token-wise map in Frobenius)."""
    if not isinstance(norm, torch.nn.LayerNorm):
        raise TypeError(f"norm must be an nn.LayerNorm, got {type(norm).__name__}")
    gmax = float(norm.weight.detach().abs().max()) if norm.weight is not None else 1.0
    return symbolic.layernorm_lipschitz(gmax, norm.eps)


def _check_args(token_radius, num_tokens):
    try:
        rho = float(token_radius)
    except (TypeError, ValueError):
        raise TypeError(f"token_radius must be a number, got {token_radius!r}") from None
    if not (math.isfinite(rho) and rho >= 0):
        raise ValueError(f"token_radius must be finite and >= 0 (the bound covers tokens of norm <= token_radius); "
                         f"got {token_radius!r}")
    if not (isinstance(num_tokens, int) and num_tokens >= 1):
        raise ValueError(f"num_tokens must be a positive integer (H * W), got {num_tokens!r}")
    return rho, num_tokens


# sup_x |GELU'(x)| = Phi(sqrt 2) + sqrt 2 phi(sqrt 2) ~ 1.12890 (GELU'' = phi(x)(2 - x^2) vanishes at +-sqrt 2;
# the minimum, at -sqrt 2, is ~ -0.129, smaller in modulus)
GELU_PRIME_SUP = 0.5 * (1 + math.erf(1.0)) + math.sqrt(2) * math.exp(-1.0) / math.sqrt(2 * math.pi)


def attention_block_lipschitz(block, num_tokens: int, *, dtype=torch.float64, device=None) -> dict:
    """Certified upper bounds for a pre-norm attention Block (lipcheck.models.vit.Block, mixer "attention").

    mixer_branch: Lip(x -> Attn(LN1 x)) <= Lip(Attn | D_rho1) Lip(LN1), rho1 = `layernorm_image_radius(LN1)`
    (LN1 maps every token into the ball of radius rho1, so Attn only ever sees D_rho1);
    mlp_branch: Lip(MLP) Lip(LN2) with Lip(MLP) <= ||W1|| sup|GELU'| ||W2||;
    vector_field: Lip(F) <= mixer_branch + mlp_branch for F(x) = Attn(LN1 x) + MLP(LN2 x) (SPEC S3);
    block_update: the discrete update x + F-branches in sequence is bounded by (1 + mixer)(1 + mlp).
    Every factor is global, so these hold for all inputs; Lip(LN) <= max|gamma| / sqrt(eps) is what makes
    them large (it is attained at tokens of zero variance)."""
    if not isinstance(block.mixer, DenseAttention):
        raise TypeError(f"block.mixer must be a DenseAttention, got {type(block.mixer).__name__}")
    if not isinstance(block.norm1, torch.nn.LayerNorm):
        raise ValueError("block has no LayerNorm before its mixer (use_norm=False): attention is then not globally "
                         "Lipschitz and no finite bound exists")
    rho1 = layernorm_image_radius(block.norm1)
    ln1 = layernorm_lipschitz(block.norm1)
    attn = attention_lipschitz_on_ball(block.mixer, rho1, num_tokens, dtype=dtype, device=device)
    out = {"token_radius": rho1, "lip_ln1": ln1, "attention_on_ln_image": attn, "mixer_branch": attn * ln1}
    mlp_branch = 0.0
    if block.mlp is not None:
        W1 = block.mlp.fc1.weight.detach().to(dtype)
        W2 = block.mlp.fc2.weight.detach().to(dtype)
        lip_mlp = float(torch.linalg.matrix_norm(W1, 2)) * GELU_PRIME_SUP * float(torch.linalg.matrix_norm(W2, 2))
        ln2 = layernorm_lipschitz(block.norm2) if isinstance(block.norm2, torch.nn.LayerNorm) else 1.0
        mlp_branch = lip_mlp * ln2
        out.update(lip_mlp=lip_mlp, lip_ln2=ln2)
    out["mlp_branch"] = mlp_branch
    out["vector_field"] = out["mixer_branch"] + mlp_branch
    out["block_update"] = (1 + out["mixer_branch"]) * (1 + mlp_branch)
    return out
