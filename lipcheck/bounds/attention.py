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
from ..rounding import check_certified_dtype, gamma, norm2_upper, unit_roundoff
from .mlp import mlp_lipschitz


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


# Float64 roundings along any path of one head's contribution once the tensor norms are Python floats
# (the margins of _head_norms: <= 8; the three terms: <= 12; the sum over heads: 1), rounded up to 24.
# All quantities are >= 0, so k roundings change the result by a factor within 1 +- gamma_k.
_ASSEMBLY_OPS = 24


def _frobenius_upper(M: torch.Tensor, u: float) -> float:
    """Upper bound on ||M||_F from its computed value: a sum of k squares and one sqrt, gamma_{k+1}.

    M is first divided by 2^e, max|M| in [1/2, 1) (exact), so its squares neither overflow nor underflow
    wholesale; squares that still fall below the normal range err by <= one subnormal step each, covered by
    sqrt(k * smallest subnormal); the result is multiplied back by 2^e, rounded up. inf if it overflows."""
    m = float(M.abs().max()) if M.numel() else 0.0
    if m == 0.0 or not math.isfinite(m):
        return m
    e = math.frexp(m)[1]
    fi = torch.finfo(M.dtype)
    k = M.numel()
    s = float(torch.linalg.vector_norm(torch.ldexp(M, torch.tensor(-e, dtype=M.dtype, device=M.device))))
    s = s * (1 + gamma(k + 1, u)) + math.sqrt(k * fi.smallest_normal * fi.eps)
    try:
        r = math.ldexp(s * (1 + gamma(2, unit_roundoff(torch.float64))), e)
    except OverflowError:
        return math.inf
    return math.nextafter(r, math.inf) if r < 2.2250738585072014e-308 else r


def _head_norms(layer: DenseAttention, *, dtype=torch.float64, device=None):
    """Certified upper bounds on the per-head ||A_h||_2, ||B_h||_2, ||c_h|| (Python floats), and sqrt(d).

    A_h = W_Q^h W_K^h^T is formed in `dtype` from the weights converted to `dtype` (one rounding each), so
    the computed A_hat differs from it entrywise by at most gamma_{d+2} |W_Q^h| |W_K^h|^T, and the converted
    factors' Frobenius norms are within a factor 1 + u of the originals': ||A_h - A_hat||_2 <=
    gamma_{d+4} fl||W_Q^h||_F fl||W_K^h||_F; likewise for B_h and c_h = b_Q^h W_K^h^T. ||A_hat||_2 itself is
    a verified upper bound (Cholesky of mu I - fl(A_hat^T A_hat)). proofs/S4.md, "Rounding"."""
    u = unit_roundoff(check_certified_dtype(dtype))
    m = head_matrices(layer, dtype=dtype, device=device)
    # ||A_hat||_2, ||B_hat||_2 of the stored products, verified by Cholesky (lipcheck.rounding.norm2_upper);
    # a product that overflowed has inf entries and comes back inf (refused below, naming the weights)
    sA, sB = norm2_upper(m["A"]).tolist(), norm2_upper(m["B"]).tolist()
    d = layer.head_dim
    gd = gamma(d + 4, u)
    nA, nB, nc = [], [], []
    for h in range(layer.num_heads):
        fQ, fK, fV, fO = (_frobenius_upper(m[k][h], u) for k in ("WQ", "WK", "WV", "WO"))
        nA.append(sA[h] + gd * fQ * fK)
        nB.append(sB[h] + gd * fV * fO)
        nc.append(_frobenius_upper(m["c"][h], u) + gd * _frobenius_upper(m["bQ"][h], u) * fK)
    for name, vals, src in (("||A_h||", nA, "q_proj/k_proj"), ("||B_h||", nB, "v_proj/o_proj"),
                            ("||c_h||", nc, "q_proj.bias/k_proj")):
        if not all(math.isfinite(v) for v in vals):
            raise ValueError(f"{name} overflows {dtype} ({vals}): the {src} weights are too large for a certified "
                             f"bound in this dtype; rescale them or pass dtype=torch.float64")
    return nA, nB, nc, math.sqrt(d)


def _round_up(value: float, num_heads: int, what: str) -> float:
    """Cover the float64 rounding of the assembly (_ASSEMBLY_OPS per head) and refuse a non-finite result."""
    out = value * (1 + gamma(_ASSEMBLY_OPS * num_heads + 2, torch.finfo(torch.float64).eps / 2))
    if not math.isfinite(out):
        raise ValueError(f"the {what} bound overflows float64 ({value}): the weights or the radius are too large "
                         f"for a finite certified bound; rescale them")
    return out


def attention_lipschitz_terms(layer: DenseAttention, token_radius: float, num_tokens: int, *,
                              dtype=torch.float64, device=None) -> dict:
    """The three per-head terms of `attention_lipschitz_on_ball`, summed over heads, each rounded up."""
    rho, N = _check_args(token_radius, num_tokens)
    nA, nB, nc, sd = _head_norms(layer, dtype=dtype, device=device)
    sN = math.sqrt(N)
    h = layer.num_heads
    value = sum(sN * b for b in nB)
    # b / sd first: no intermediate exceeds the result by more than a factor 1 (no spurious overflow)
    key_cov = sum(rho * (rho * a) * (b / sd) for a, b in zip(nA, nB))
    query_side = sum(sN * rho * (rho * a + c) * (b / sd) for a, b, c in zip(nA, nB, nc))
    return {"value": _round_up(value, h, "value-path"), "key_covariance": _round_up(key_cov, h, "key-covariance"),
            "query_side": _round_up(query_side, h, "query-side")}


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
    Norms are computed in `dtype` (float32 or float64) and rounded up by margins derived from its unit
    roundoff (`_head_norms`, `_round_up`; proofs/S4.md, "Rounding"). The bound is finite for every rho but
    grows like rho^2, which is the certified counterpart of the R^2 growth the probe measures. A result
    that overflows is refused (ValueError), never returned as inf.
    """
    t = attention_lipschitz_terms(layer, token_radius, num_tokens, dtype=dtype, device=device)
    return _round_up(t["value"] + t["key_covariance"] + t["query_side"], 1, "attention")


def attention_lipschitz_on_frobenius_ball(layer: DenseAttention, radius: float, num_tokens: int, *,
                                          dtype=torch.float64, device=None) -> float:
    """Certified upper bound on L(R) = sup_{||X||_F <= R} ||J_f(X)||_2 (the probe's quantity):

        L(R) <= sum_h ||B_h||_2 [ sqrt(N) + R^2 ||A_h||_2 / sqrt(d) + R (R ||A_h||_2 + sqrt(N) ||c_h||_2) / sqrt(d) ].

    Same three terms as `attention_lipschitz_on_ball`, with what the Frobenius ball adds: every token has
    norm <= R (so the weighted covariances are <= R^2 in norm), and in term 3 the bound
    sum_i sum_j p_ij (dx_j . w_i)^2 <= ||dX||_F^2 sum_i ||w_i||^2 (p_ij <= 1) with
    sum_i ||w_i||^2 = ||X A_h + 1 c_h||_F^2 <= (R ||A_h|| + sqrt(N) ||c_h||)^2 replaces the factor sqrt(N) on the
    R^2 part."""
    R, N = _check_args(radius, num_tokens, name="radius")
    nA, nB, nc, sd = _head_norms(layer, dtype=dtype, device=device)
    sN = math.sqrt(N)
    total = sum(b * (sN + R * (R * a) / sd + R * (R * a + sN * c) / sd) for a, b, c in zip(nA, nB, nc))
    return _round_up(total, layer.num_heads, "Frobenius-ball attention")


def _layernorm_affine(norm: torch.nn.Module):
    """(gamma, beta) of a LayerNorm in float64 (ones / zeros without affine), refusing non-finite entries."""
    if not isinstance(norm, torch.nn.LayerNorm):
        raise TypeError(f"norm must be an nn.LayerNorm, got {type(norm).__name__}")
    C = norm.normalized_shape[-1]
    g = norm.weight.detach().double() if norm.weight is not None else torch.ones(C, dtype=torch.float64)
    b = norm.bias.detach().double() if norm.bias is not None else torch.zeros(C, dtype=torch.float64)
    for name, t in (("weight", g), ("bias", b)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"LayerNorm {name} has non-finite entries (NaN or inf); certify finite weights")
    return g, b


def layernorm_image_radius(norm: torch.nn.Module) -> float:
    """rho = sqrt(C) max|gamma| + ||beta||: LN(x) = gamma * xhat + beta with ||xhat|| <= sqrt(C).

    Rounded up: ||beta|| is a sum of C squares and a sqrt, then one sqrt, one product, one sum (gamma_{C+4})."""
    g, b = _layernorm_affine(norm)
    C = g.numel()
    u = torch.finfo(torch.float64).eps / 2
    return (math.sqrt(C) * float(g.abs().max()) + float(b.norm())) * (1 + gamma(C + 4, u))


def layernorm_lipschitz(norm: torch.nn.Module) -> float:
    """Global Lip(LN) <= max|gamma| / sqrt(eps) (per token, hence also for the token-wise map in Frobenius).

    symbolic.layernorm_lipschitz evaluates the closed form in 53-bit arithmetic (a sqrt, a division, a
    product); gamma_4 covers those roundings."""
    g, _ = _layernorm_affine(norm)
    u = torch.finfo(torch.float64).eps / 2
    return symbolic.layernorm_lipschitz(float(g.abs().max()), norm.eps) * (1 + gamma(4, u))


def _check_args(token_radius, num_tokens, name="token_radius"):
    try:
        rho = float(token_radius)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {token_radius!r}") from None
    if not (math.isfinite(rho) and rho >= 0):
        raise ValueError(f"{name} must be finite and >= 0 (the bound covers inputs of norm <= {name}); "
                         f"got {token_radius!r}")
    if not (isinstance(num_tokens, int) and num_tokens >= 1):
        raise ValueError(f"num_tokens must be a positive integer (H * W), got {num_tokens!r}")
    return rho, num_tokens


def attention_block_lipschitz(block, num_tokens: int, *, dtype=torch.float64, device=None) -> dict:
    """Certified upper bounds for a pre-norm attention Block (lipcheck.models.vit.Block, mixer "attention").

    mixer_branch: Lip(x -> Attn(LN1 x)) <= Lip(Attn | D_rho1) Lip(LN1), rho1 = `layernorm_image_radius(LN1)`
    (LN1 maps every token into the ball of radius rho1, so Attn only ever sees D_rho1);
    mlp_branch: Lip(MLP) Lip(LN2) with Lip(MLP) <= ||W1|| sup|GELU'| ||W2|| (`mlp.mlp_lipschitz`);
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
    up = 1 + 2 * torch.finfo(torch.float64).eps  # covers a float64 rounding of the product or sum below and of this factor
    out = {"token_radius": rho1, "lip_ln1": ln1, "attention_on_ln_image": attn, "mixer_branch": attn * ln1 * up}
    mlp_branch = 0.0
    if block.mlp is not None:
        lip_mlp = mlp_lipschitz(block.mlp, dtype=dtype, device=device)
        ln2 = layernorm_lipschitz(block.norm2) if isinstance(block.norm2, torch.nn.LayerNorm) else 1.0
        mlp_branch = lip_mlp * ln2 * up
        out.update(lip_mlp=lip_mlp, lip_ln2=ln2)
    out["mlp_branch"] = mlp_branch
    out["vector_field"] = (out["mixer_branch"] + mlp_branch) * up
    out["block_update"] = (1 + out["mixer_branch"]) * (1 + mlp_branch) * up ** 3
    for k in ("mixer_branch", "mlp_branch", "vector_field", "block_update"):
        if not math.isfinite(out[k]):
            raise ValueError(f"the block's {k} bound overflows float64: rescale the block's weights")
    return out
