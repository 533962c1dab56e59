"""The certified attention bounds (lipcheck.bounds.attention) against Jacobians computed here.

Every reference is independent of the library: dense Jacobians by torch.autograd.functional.jacobian
on the layer's own forward, spectral norms by SVD, the bound's formula re-derived from the layer's
weights in this file. Witness inputs sit where one term of the bound dominates, so a bound that lost
that term (or shrank it) falls below an actual Jacobian norm and fails.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lipcheck.bounds import attention as ab
from lipcheck.mixers.attention import DenseAttention
from lipcheck.models.vit import Block

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64


def jac_norm(module, X):
    """||J_f(X)||_2 for X (H, W, C), Frobenius in and out, by plain autograd and an SVD."""
    H, W, C = X.shape
    f = lambda z: module(z.reshape(1, H, W, C)).reshape(-1)
    J = torch.autograd.functional.jacobian(f, X.reshape(-1).to(F64))
    return float(torch.linalg.matrix_norm(J, 2))


def set_head_weights(layer, WQ, WK, WV, WO, bQ=None):
    """Per-head factors (h, C, d) / (h, d, C) -> nn.Linear weights (x W + b convention); zero biases."""
    h, C, d = WQ.shape
    with torch.no_grad():
        for lin, Wh in ((layer.q_proj, WQ), (layer.k_proj, WK), (layer.v_proj, WV)):
            lin.weight.copy_(Wh.permute(1, 0, 2).reshape(C, h * d).T)
            lin.bias.zero_()
        layer.o_proj.weight.copy_(WO.reshape(h * d, C).T)
        layer.o_proj.bias.zero_()
        if bQ is not None:
            layer.q_proj.bias.copy_(bQ.reshape(-1))


def reference_terms(layer, rho, N):
    """The three terms of the documented bound, from the layer's weights, by this file's own algebra."""
    h, C, d = layer.num_heads, layer.dim, layer.head_dim
    Wq, Wk, Wv, Wo = (getattr(layer, n).weight.detach().to(F64) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    bq = layer.q_proj.bias.detach().to(F64)
    out = {"value": 0.0, "key_covariance": 0.0, "query_side": 0.0}
    for i in range(h):
        sl = slice(i * d, (i + 1) * d)
        A = Wq[sl, :].T @ Wk[sl, :]          # x A y^T = (x Wq^T)_h . (y Wk^T)_h
        Bm = Wv[sl, :].T @ Wo[:, sl].T       # x -> (x Wv^T)_h Wo_h^T
        c = Wk[sl, :].T @ bq[sl]
        nA, nB = (float(torch.linalg.svdvals(M)[0]) for M in (A, Bm))
        nc = float(c.norm())
        out["value"] += math.sqrt(N) * nB
        out["key_covariance"] += rho ** 2 * nA * nB / math.sqrt(d)
        out["query_side"] += math.sqrt(N) * rho * (rho * nA + nc) * nB / math.sqrt(d)
    return out


def query_side_witness(n_query, rho, alpha, beta, C=3):
    """One head (d = C) with A = -alpha e1 e1^T, B = beta I; n_query queries at rho e1, keys at +-rho e2.

    The queries' scores to the keys are 0 (e1 A e2^T = 0) and to each other -alpha rho^2 (ignored), so each
    query averages the two keys, and w_i = x_i A = -alpha rho e1: moving the keys along e1 moves every
    query's output along e2 B. The keys' perturbation term then has norm ~ sqrt(n_query / 2) rho^2 alpha beta / sqrt(d),
    which for n_query >= 8 exceeds value + key_covariance: the term that dominates the bound is needed.
    """
    layer = DenseAttention(C, 1, dtype=F64)
    e = torch.eye(C, dtype=F64)
    set_head_weights(layer, (-alpha * torch.outer(e[0], e[0]))[None], torch.outer(e[0], e[0])[None],
                     e[None], (beta * e)[None])
    X = torch.zeros(n_query + 2, C, dtype=F64)
    X[:n_query, 0] = rho
    X[n_query, 1], X[n_query + 1, 1] = rho, -rho
    return layer, X


# ------------------------------------------------------------------------------- the bound's formula

@settings(deadline=None, max_examples=10)
@given(st.integers(0, 2 ** 16), st.sampled_from([(4, 1), (6, 2), (6, 3), (8, 4)]), st.floats(0.0, 30.0),
       st.integers(1, 20), st.booleans())
def test_bound_is_the_documented_formula_rounded_up(seed, dims, rho, N, bias):
    """attention_lipschitz_on_ball = the docstring's sum over heads of three terms, at most a few u above it."""
    torch.manual_seed(seed)
    layer = DenseAttention(*dims, dtype=F64)
    if not bias:
        set_head_weights(layer, *(t for t in _factors(layer)))
    ref = reference_terms(layer, rho, N)
    total = sum(ref.values())
    got = ab.attention_lipschitz_on_ball(layer, rho, N)
    assert total <= got <= total * (1 + 1e-10), (got, total)
    terms = ab.attention_lipschitz_terms(layer, rho, N)
    for k, v in ref.items():
        assert v <= terms[k] <= v * (1 + 1e-10) + 1e-300, (k, terms[k], v)


def _factors(layer):
    m = ab.head_matrices(layer)
    return m["WQ"], m["WK"], m["WV"], m["WO"]


def test_head_matrices_match_the_forward_pass():
    """A_h, B_h, c_h reproduce the layer's scores and outputs (one head's logits and value path by hand)."""
    torch.manual_seed(3)
    layer = DenseAttention(6, 2, dtype=F64)
    m = ab.head_matrices(layer)
    X = torch.randn(5, 6, dtype=F64)
    q, k, v = layer.q_proj(X), layer.k_proj(X), layer.v_proj(X)
    for h in range(2):
        sl = slice(3 * h, 3 * h + 3)
        logits = q[:, sl] @ k[:, sl].T
        # bias of the key cancels inside softmax rows: compare up to a per-row constant
        ours = X @ m["A"][h] @ X.T + (m["c"][h] @ X.T)[None, :]
        diff = logits - ours
        assert torch.allclose(diff - diff[:, :1], torch.zeros_like(diff), atol=1e-10)
        P = torch.softmax(logits / math.sqrt(3), dim=-1)
        y_h = (P @ v[:, sl]) @ layer.o_proj.weight[:, sl].T.to(F64)
        assert torch.allclose(y_h, P @ X @ m["B"][h] + (m["bV"][h] @ m["WO"][h])[None], atol=1e-10)
    y = layer(X.reshape(1, 1, 5, 6)).reshape(5, 6)
    assert torch.allclose(y, sum(torch.softmax((X @ m["A"][h] @ X.T + m["c"][h] @ X.T) / math.sqrt(3), -1) @ X
                                 @ m["B"][h] + m["bV"][h] @ m["WO"][h] for h in range(2)) + m["bO"], atol=1e-10)


# ------------------------------------------------------------------------------- witnesses near each term

@pytest.mark.parametrize("n_query,rho", [(14, 4.0), (30, 3.0)])
def test_bound_needs_its_largest_term_at_the_query_side_witness(n_query, rho):
    layer, X = query_side_witness(n_query, rho, alpha=2.0, beta=1.5)
    N = n_query + 2
    J = jac_norm(layer, X.reshape(1, N, 3))
    t = reference_terms(layer, rho, N)
    assert max(t, key=t.get) == "query_side"
    # the witness needs the largest term: without it the bound would be a lie
    assert J > t["value"] + t["key_covariance"], (J, t)
    # and the library's bound holds there (every token has norm rho)
    assert float(X.norm(dim=1).max()) <= rho * (1 + 1e-15)
    assert J <= ab.attention_lipschitz_on_ball(layer, rho, N)
    assert J <= ab.attention_lipschitz_on_frobenius_ball(layer, float(X.norm()), N)
    # not vacuous: within a factor 2 of the witness (the sqrt(2) of one key pair and the value term)
    assert ab.attention_lipschitz_on_ball(layer, rho, N) <= 2.0 * J


@pytest.mark.parametrize("N", [1, 4])
def test_bound_needs_the_value_term_at_zero_radius(N):
    """On D_0 (every token 0) f is affine with Jacobian (11^T / N) (x) sum_h B_h: norm exactly ||sum_h B_h||,
    and for one token f(x) = x sum_h B_h + const on every radius. Only the value term is nonzero at rho = 0."""
    torch.manual_seed(N)
    layer = DenseAttention(4, 2, dtype=F64)
    Bsum = sum(ab.head_matrices(layer)["B"])
    ref = float(torch.linalg.svdvals(Bsum)[0])
    J = jac_norm(layer, torch.zeros(1, N, 4, dtype=F64))
    assert abs(J - ref) <= 1e-12 * ref
    assert J <= ab.attention_lipschitz_on_ball(layer, 0.0, N)
    assert J <= ab.attention_lipschitz_on_frobenius_ball(layer, 0.0, N)
    if N == 1:
        x = torch.randn(1, 1, 4, dtype=F64) * 5
        assert abs(jac_norm(layer, x) - ref) <= 1e-12 * ref
        # one head: the bound at rho = 0 is exactly ||B|| (rounded up), so a missing value term fails
        one = DenseAttention(4, 1, dtype=F64)
        nB = float(torch.linalg.svdvals(ab.head_matrices(one)["B"][0])[0])
        assert abs(jac_norm(one, torch.zeros(1, 1, 4, dtype=F64)) - nB) <= 1e-12 * nB
        assert nB <= ab.attention_lipschitz_on_ball(one, 0.0, 1) <= nB * (1 + 1e-12)


def test_key_covariance_term_is_attained_by_a_focused_query():
    """The block-diagonal part dx_i -> dx_i A Sigma_i B / sqrt(d) of the Jacobian, computed here, stays
    below the key_covariance term and reaches 95% of it at a query that weights +-rho u equally."""
    C, rho, alpha = 3, 3.0, 1.0
    layer = DenseAttention(C, 1, dtype=F64)
    e = torch.eye(C, dtype=F64)
    # A = alpha (e1 e2^T - e3 e3^T): the query rho e3 scores the keys +-rho e2 equally (0) and itself at
    # -alpha rho^2 (ignored); a move dx along e1 shifts its scores by alpha (dx . e1)(x_j . e2)
    A = alpha * (torch.outer(e[0], e[1]) - torch.outer(e[2], e[2]))
    set_head_weights(layer, A[None], e[None], e[None], e[None])
    X = torch.stack([rho * e[2], rho * e[1], -rho * e[1]])
    P = torch.softmax(X @ A @ X.T / math.sqrt(C), dim=-1)
    xbar = P[0] @ X
    Sigma = ((X - xbar).T * P[0]) @ (X - xbar)
    block = A @ Sigma / math.sqrt(C)
    t = ab.attention_lipschitz_terms(layer, rho, 3)
    assert float(torch.linalg.matrix_norm(block, 2)) <= t["key_covariance"]
    assert float(torch.linalg.matrix_norm(block, 2)) >= 0.95 * t["key_covariance"]
    J = jac_norm(layer, X.reshape(1, 3, C))
    # the whole Jacobian is above that block's norm less the value path (||P|| <= sqrt(3)), so a bound
    # without its key_covariance term (value + query_side) must still exceed it: here it does not by much
    assert J >= float(torch.linalg.matrix_norm(block, 2)) - math.sqrt(3)
    assert J <= ab.attention_lipschitz_on_ball(layer, rho, 3)


@settings(deadline=None, max_examples=6)
@given(st.integers(0, 2 ** 16), st.floats(0.5, 8.0), st.sampled_from([(6, 1), (6, 2)]))
def test_random_layers_and_witness_inputs_stay_below_both_bounds(seed, rho, dims):
    """Random weights (with biases) at witness-shaped inputs: queries along A's top direction, keys at
    +-rho along a second direction, plus random tokens of norm rho."""
    torch.manual_seed(seed)
    layer = DenseAttention(*dims, dtype=F64)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(2.0)
    C = dims[0]
    g = torch.Generator().manual_seed(seed)
    A0 = ab.head_matrices(layer)["A"][0]
    U, _, Vh = torch.linalg.svd(A0)
    X = torch.randn(8, C, generator=g, dtype=F64)
    X[:4] = U[:, 0]
    X[4], X[5] = Vh[1], -Vh[1]
    X = X / X.norm(dim=1, keepdim=True) * rho
    J = jac_norm(layer, X.reshape(1, 8, C))
    assert J <= ab.attention_lipschitz_on_ball(layer, rho, 8)
    assert J <= ab.attention_lipschitz_on_frobenius_ball(layer, float(X.norm()), 8)


def test_frobenius_ball_bound_formula_and_growth():
    """L(R) bound = sum_h ||B_h|| [sqrt N + R^2 ||A_h|| / sqrt d + R (R ||A_h|| + sqrt N ||c_h||) / sqrt d]
    (re-derived here); quadratic in R; above the S4 witness's Jacobian at every R."""
    torch.manual_seed(11)
    layer = DenseAttention(4, 2, dtype=F64)
    N = 5
    m = ab.head_matrices(layer)
    for R in (0.0, 0.5, 3.0, 40.0):
        ref = 0.0
        for h in range(2):
            nA, nB = float(torch.linalg.svdvals(m["A"][h])[0]), float(torch.linalg.svdvals(m["B"][h])[0])
            nc = float(m["c"][h].norm())
            ref += nB * (math.sqrt(N) + R ** 2 * nA / math.sqrt(2) + R * (R * nA + math.sqrt(N) * nc) / math.sqrt(2))
        got = ab.attention_lipschitz_on_frobenius_ball(layer, R, N)
        assert ref <= got <= ref * (1 + 1e-10)
    # S4 witness: a query at 0, keys at +-a u (u = A_0's top left singular vector): ||J|| grows like R^2
    U = torch.linalg.svd(m["A"][0])[0][:, 0]
    for R in (1.0, 10.0, 100.0):
        a = R / math.sqrt(2)
        X = torch.zeros(N, 4, dtype=F64)
        X[1], X[2] = a * U, -a * U
        assert jac_norm(layer, X.reshape(1, N, 4)) <= ab.attention_lipschitz_on_frobenius_ball(layer, R, N)


# ------------------------------------------------------------------------------- LayerNorm and the block

@settings(deadline=None, max_examples=8)
@given(st.integers(0, 2 ** 16), st.integers(2, 12), st.floats(1e-8, 1e-2))
def test_layernorm_radius_and_lipschitz_against_autograd(seed, C, eps):
    torch.manual_seed(seed)
    norm = torch.nn.LayerNorm(C, eps=eps, dtype=F64)
    with torch.no_grad():
        norm.weight.uniform_(-3, 3)
        norm.bias.uniform_(-2, 2)
    gmax = float(norm.weight.abs().max())
    lip = ab.layernorm_lipschitz(norm)
    assert gmax / math.sqrt(eps) <= lip <= gmax / math.sqrt(eps) * (1 + 1e-12)
    rad = ab.layernorm_image_radius(norm)
    ref_rad = math.sqrt(C) * gmax + float(norm.bias.norm())
    assert ref_rad <= rad <= ref_rad * (1 + 1e-12)
    g = torch.Generator().manual_seed(seed)
    # tokens of every scale, and nearly constant tokens where ||J|| approaches max|gamma| / sqrt(eps)
    x = torch.randn(64, C, generator=g, dtype=F64) * torch.logspace(-6, 6, 64, dtype=F64)[:, None]
    assert float(norm(x).norm(dim=1).max()) <= rad
    for xi in (x[0], x[30], torch.full((C,), 0.7, dtype=F64) + 1e-9 * x[1]):
        J = torch.autograd.functional.jacobian(norm, xi)
        assert float(torch.linalg.matrix_norm(J, 2)) <= lip
    # the constant is attained in the limit: at zero variance ||J|| = max|gamma| / sqrt(eps) (direction of the top gamma)
    J0 = torch.autograd.functional.jacobian(norm, torch.zeros(C, dtype=F64))
    assert float(torch.linalg.matrix_norm(J0, 2)) >= lip * (1 - 1e-6) * (1 - 1 / C) ** 0.5 - 1e-12


def test_layernorm_without_affine_and_bad_norms():
    norm = torch.nn.LayerNorm(9, eps=1e-4, elementwise_affine=False, dtype=F64)
    assert 3.0 <= ab.layernorm_image_radius(norm) <= 3.0 * (1 + 1e-12)
    assert 100.0 <= ab.layernorm_lipschitz(norm) <= 100.0 * (1 + 1e-12)
    with pytest.raises(TypeError, match="nn.LayerNorm"):
        ab.layernorm_image_radius(torch.nn.Identity())
    with pytest.raises(TypeError, match="nn.LayerNorm"):
        ab.layernorm_lipschitz(torch.nn.Identity())
    bad = torch.nn.LayerNorm(4, dtype=F64)
    with torch.no_grad():
        bad.weight[1] = float("nan")
    with pytest.raises(ValueError, match="LayerNorm weight has non-finite"):  # names the parameter
        ab.layernorm_image_radius(bad)
    with pytest.raises(ValueError, match="LayerNorm weight has non-finite"):
        ab.layernorm_lipschitz(bad)
    bad = torch.nn.LayerNorm(4, dtype=F64)
    with torch.no_grad():
        bad.bias[0] = float("inf")
    with pytest.raises(ValueError, match="LayerNorm bias has non-finite"):
        ab.layernorm_image_radius(bad)


def _block(seed, mlp=True, use_norm=True):
    torch.manual_seed(seed)
    blk = Block(6, 2, "attention", use_mlp=mlp, use_norm=use_norm).to(F64)
    with torch.no_grad():
        for n in (blk.norm1, blk.norm2):
            if isinstance(n, torch.nn.LayerNorm):
                n.weight.uniform_(0.5, 1.5)
                n.bias.uniform_(-0.5, 0.5)
                n.eps = 1e-2  # keeps the global constants in a range a Jacobian can approach
    return blk


@pytest.mark.parametrize("mlp", [True, False])
def test_pre_ln_attention_block_bound_against_jacobians(mlp):
    blk = _block(5, mlp)
    N = 6
    b = ab.attention_block_lipschitz(blk, N)
    # re-derive the pieces from their definitions
    rho1 = ab.layernorm_image_radius(blk.norm1)
    ln1 = float(blk.norm1.weight.abs().max()) / math.sqrt(blk.norm1.eps)
    attn = ab.attention_lipschitz_on_ball(blk.mixer, rho1, N)
    assert b["token_radius"] == rho1 and b["attention_on_ln_image"] == attn
    assert ln1 <= b["lip_ln1"] <= ln1 * (1 + 1e-12)
    assert attn * ln1 <= b["mixer_branch"] <= attn * ln1 * (1 + 1e-10)
    if mlp:
        W1, W2 = blk.mlp.fc1.weight.detach(), blk.mlp.fc2.weight.detach()
        gelu_sup = 0.5 * (1 + math.erf(1.0)) + math.exp(-1.0) / math.sqrt(math.pi)
        lip_mlp = float(torch.linalg.svdvals(W1)[0]) * gelu_sup * float(torch.linalg.svdvals(W2)[0])
        ln2 = float(blk.norm2.weight.abs().max()) / math.sqrt(blk.norm2.eps)
        assert lip_mlp <= b["lip_mlp"] <= lip_mlp * (1 + 1e-10)
        assert lip_mlp * ln2 <= b["mlp_branch"] <= lip_mlp * ln2 * (1 + 1e-10)
    else:
        assert b["mlp_branch"] == 0.0
    assert b["mixer_branch"] + b["mlp_branch"] <= b["vector_field"] <= (b["mixer_branch"] + b["mlp_branch"]) * (1 + 1e-12)
    ref_update = (1 + b["mixer_branch"]) * (1 + b["mlp_branch"])
    assert ref_update <= b["block_update"] <= ref_update * (1 + 1e-12)
    # each branch and the whole block against autograd Jacobians at random and nearly constant tokens
    g = torch.Generator().manual_seed(0)
    mixer_branch = lambda z: blk.mixer(blk.norm1(z))
    for scale in (1e-3, 1.0, 30.0):
        X = torch.randn(1, 2, 3, 6, generator=g, dtype=F64) * scale
        J_mix = jac_norm(mixer_branch, X[0])
        assert J_mix <= b["mixer_branch"]
        assert jac_norm(blk, X[0]) <= b["block_update"]


def test_block_bound_refuses_without_layernorm_and_for_other_mixers():
    blk = _block(1, use_norm=False)
    with pytest.raises(ValueError, match="LayerNorm"):
        ab.attention_block_lipschitz(blk, 4)
    torch.manual_seed(0)
    ssog_blk = Block(6, 2, "ssog", num_components=2).to(F64)
    with pytest.raises(TypeError, match="DenseAttention"):
        ab.attention_block_lipschitz(ssog_blk, 4)


# ------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("name", ["q_proj", "k_proj", "v_proj", "o_proj"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_refuse_naming_the_parameter(name, value):
    layer = DenseAttention(4, 2, dtype=F64)
    with torch.no_grad():
        getattr(layer, name).weight[0, 1] = value
    for fn in (lambda: ab.attention_lipschitz_on_ball(layer, 1.0, 4),
               lambda: ab.attention_lipschitz_on_frobenius_ball(layer, 1.0, 4),
               lambda: ab.attention_lipschitz_terms(layer, 1.0, 4)):
        with pytest.raises(ValueError, match=name):
            fn()


def test_non_finite_bias_refuses():
    layer = DenseAttention(4, 2, dtype=F64)
    with torch.no_grad():
        layer.q_proj.bias[0] = float("nan")
    with pytest.raises(ValueError, match="q_proj"):
        ab.attention_lipschitz_on_ball(layer, 1.0, 4)


@pytest.mark.parametrize("rho", [float("nan"), float("inf"), -1e-9])
def test_bad_radius_refuses(rho):
    layer = DenseAttention(4, 2, dtype=F64)
    with pytest.raises(ValueError, match="token_radius"):
        ab.attention_lipschitz_on_ball(layer, rho, 4)
    with pytest.raises(ValueError, match="^radius must be finite"):
        ab.attention_lipschitz_on_frobenius_ball(layer, rho, 4)


def test_bad_arguments_refuse():
    layer = DenseAttention(4, 2, dtype=F64)
    for N in (0, -3, 2.0, "4"):
        with pytest.raises(ValueError, match="num_tokens"):
            ab.attention_lipschitz_on_ball(layer, 1.0, N)
    with pytest.raises(TypeError, match="token_radius"):
        ab.attention_lipschitz_on_ball(layer, "big", 4)
    with pytest.raises(TypeError, match="DenseAttention"):
        ab.head_matrices(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="float16|dtype"):
        ab.attention_lipschitz_on_ball(layer, 1.0, 4, dtype=torch.float16)


@pytest.mark.parametrize("names,scale,message", [
    (("q_proj.weight", "k_proj.weight"), 1e200, r"\|\|A_h\|\| overflows .*the q_proj/k_proj weights"),
    (("v_proj.weight", "o_proj.weight"), 1e200, r"\|\|B_h\|\| overflows .*the v_proj/o_proj weights"),
    (("q_proj.bias",), 1e300, r"\|\|c_h\|\| overflows .*the q_proj.bias/k_proj weights")])
def test_overflowing_bound_refuses_instead_of_inf(names, scale, message):
    """Weights whose products overflow the dtype: not certified (ValueError naming the weights), never inf or nan."""
    torch.manual_seed(0)
    layer = DenseAttention(4, 1, dtype=F64)
    with torch.no_grad():
        for n in names:
            layer.get_parameter(n).mul_(scale)
        if names == ("q_proj.bias",):
            layer.k_proj.weight.mul_(1e10)
    with pytest.raises(ValueError, match=message):
        ab.attention_lipschitz_on_ball(layer, 1.0, 4)


def test_unit_roundoff_and_gamma():
    """The shared rounding constants (lipcheck.rounding): exact values, and half precisions refused by the bound."""
    from lipcheck import rounding
    assert ab.unit_roundoff(torch.float64) == 2.0 ** -53 and ab.unit_roundoff(torch.float32) == 2.0 ** -24
    for dt in (torch.float16, torch.bfloat16, torch.int32):
        with pytest.raises(ValueError, match="dtype"):
            rounding.unit_roundoff(rounding.check_certified_dtype(dt))
    with pytest.raises(ValueError, match="dtype"):
        ab.attention_lipschitz_on_ball(DenseAttention(4, 2, dtype=F64), 1.0, 4, dtype=torch.float16)
    from fractions import Fraction as Fr
    u = 2.0 ** -24
    for n in (1, 7, 1000):
        exact = Fr(n) * Fr(u) / (1 - Fr(n) * Fr(u))
        assert abs(Fr(ab.gamma(n, u)) - exact) <= exact * Fr(2.0 ** -50)
    assert ab.gamma(2 ** 24, u) == math.inf  # n u = 1: no a-priori bound, and every caller refuses inf


def test_layers_without_biases():
    """nn.Linear(bias=False) projections: zero biases in head_matrices, and the bound still dominates Jacobians."""
    torch.manual_seed(9)
    layer = DenseAttention(4, 2, dtype=F64)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(layer, name).bias = None
    m = ab.head_matrices(layer)
    assert float(m["c"].abs().max()) == 0.0 and m["bO"].shape == (4,) and float(m["bO"].abs().max()) == 0.0
    assert m["bV"].shape == (2, 2) and m["bQ"].shape == (2, 2) and m["bK"].shape == (2, 2)
    X = torch.randn(1, 2, 3, 4, dtype=F64)
    X = X / X.norm(dim=-1, keepdim=True) * 3.0
    assert jac_norm(layer, X[0]) <= ab.attention_lipschitz_on_ball(layer, 3.0, 6)


def test_float32_bound_is_rounded_up_from_float32_arithmetic():
    """Computed in float32, the bound still dominates the float64 value of the same formula."""
    torch.manual_seed(7)
    layer = DenseAttention(8, 2, dtype=F64)
    for rho in (0.3, 5.0):
        ref = sum(reference_terms(layer, rho, 9).values())
        got32 = ab.attention_lipschitz_on_ball(layer, rho, 9, dtype=torch.float32)
        assert ref <= got32 <= ref * (1 + 1e-3)


# ------------------------------------------------------------------------------- rounding, against exact arithmetic

def _mp_norm2(M, dps=40):
    """||M||_2 of a float64 matrix in mpmath at `dps` digits (the entries are exact binary floats)."""
    import mpmath
    with mpmath.workdps(dps):
        S = mpmath.svd_r(mpmath.matrix(M.tolist()), compute_uv=False)
        return max(S)


def _mp_exact_factors(layer):
    """Per head ||A_h||, ||B_h||, ||c_h|| from the float64 weights, products and norms in 40-digit arithmetic."""
    import mpmath
    mpmath.mp.dps = 40
    h, C, d = layer.num_heads, layer.dim, layer.head_dim
    Wq, Wk, Wv, Wo = (mpmath.matrix(getattr(layer, n).weight.detach().to(F64).tolist())
                      for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    bq = layer.q_proj.bias.detach().to(F64).tolist()
    out = []
    for i in range(h):
        rows = range(i * d, (i + 1) * d)
        A = mpmath.matrix(C, C)
        Bm = mpmath.matrix(C, C)
        c = [mpmath.mpf(0)] * C
        for a in range(C):
            for b in range(C):
                A[a, b] = mpmath.fsum(Wq[r, a] * Wk[r, b] for r in rows)
                Bm[a, b] = mpmath.fsum(Wv[r, a] * Wo[b, r] for r in rows)
            c[a] = mpmath.fsum(Wk[r, a] * bq[r] for r in rows)
        nA = max(mpmath.svd_r(A, compute_uv=False))
        nB = max(mpmath.svd_r(Bm, compute_uv=False))
        out.append((nA, nB, mpmath.sqrt(mpmath.fsum(x * x for x in c))))
    return out


def _near_cancelling_layer(seed, C=4, h=2, delta=1e-6):
    """Heads whose products cancel: W_K^h = -(W_Q^h with its two rows swapped) + delta noise, so A_h = O(delta)
    + a skew part, and B_h = O(delta) (equal value rows, opposite output columns): the rounding of the products is
    then as large as the rounded quantity in float32, and only the gamma_{d+4} margins cover it."""
    g = torch.Generator().manual_seed(seed)
    layer = DenseAttention(C, h, dtype=F64)
    d = C // h
    with torch.no_grad():
        Wq = torch.randn(C, C, generator=g, dtype=F64) / 3
        layer.q_proj.weight.copy_(Wq)
        # x A x'^T = (x Wq^T)_h (x' Wk^T)_h: choose Wk rows so that each head's Wq_h^T Wk_h nearly cancels
        Wk = Wq.clone()
        for i in range(h):
            r = slice(i * d, (i + 1) * d)
            Wk[r] = -Wq[r].flip(0) if d == 2 else Wq[r]
        Wk = Wk + delta * torch.randn(C, C, generator=g, dtype=F64)
        layer.k_proj.weight.copy_(Wk)
        layer.q_proj.bias.copy_(torch.randn(C, generator=g, dtype=F64))
        # B_h = sum_r Wv[r]^T Wo[:, r]^T: equal value rows and opposite output columns (plus delta) cancel too
        Wv = torch.randn(C, C, generator=g, dtype=F64) * 3
        Wo = torch.randn(C, C, generator=g, dtype=F64) * 3
        for i in range(h):
            r = list(range(i * d, (i + 1) * d))
            Wv[r[1:]] = Wv[r[0]].clone()
            Wo[:, r[1]] = -Wo[:, r[0]].clone() + delta * torch.randn(C, generator=g, dtype=F64)
        layer.v_proj.weight.copy_(Wv)
        layer.o_proj.weight.copy_(Wo)
    return layer


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_head_norm_bounds_dominate_exact_norms(dtype):
    """_head_norms' upper bounds >= the 40-digit norms of the exact products, also when the products cancel
    (float32: the rounding of W_Q W_K^T is then as large as A itself, and only the gamma_d margin covers it)."""
    for seed in range(6):
        for layer in (_near_cancelling_layer(seed), _near_cancelling_layer(seed, delta=1e-3), DenseAttention(4, 2, dtype=F64)):
            nA, nB, nc, sd = ab._head_norms(layer, dtype=dtype)
            for (eA, eB, ec), a, b, c in zip(_mp_exact_factors(layer), nA, nB, nc):
                assert a >= eA and b >= eB and c >= ec, (seed, dtype, a, float(eA), b, float(eB), c, float(ec))
                # and not vacuous: within a few gamma of the exact values plus the product error
                assert a <= float(eA) * (1 + 1e-3) + 1e-4 and b <= float(eB) * (1 + 1e-3) + 1e-4
            assert sd == math.sqrt(2)


def test_assembly_is_rounded_up_from_the_head_norms():
    """The bound is >= the formula evaluated in exact rational arithmetic on the (already rounded-up) per-head
    norms: the float64 roundings of the assembly are covered."""
    from fractions import Fraction as Fr
    import mpmath
    for seed in range(8):
        torch.manual_seed(seed)
        layer = DenseAttention(6, 3, dtype=F64)
        for rho, N in ((0.7, 5), (13.0, 49), (1e-3, 2)):
            nA, nB, nc, sd = ab._head_norms(layer)
            with mpmath.workdps(50):
                sN, sdd = mpmath.sqrt(N), mpmath.sqrt(3)
                terms = [sN * b + rho * rho * a * b / sdd + sN * rho * (rho * a + c) * b / sdd
                         for a, b, c in zip(map(Fr, nA), map(Fr, nB), map(Fr, nc))]
                exact = mpmath.fsum(mpmath.mpf(t.numerator) / t.denominator if isinstance(t, Fr) else t for t in terms)
                got = ab.attention_lipschitz_on_ball(layer, rho, N)
                assert mpmath.mpf(got) >= exact, (seed, rho, N)
                R = rho
                frob = mpmath.fsum(b * (sN + R * R * a / sdd + R * (R * a + sN * c) / sdd)
                                   for a, b, c in zip(nA, nB, nc))
                assert mpmath.mpf(ab.attention_lipschitz_on_frobenius_ball(layer, R, N)) >= frob
                t = ab.attention_lipschitz_terms(layer, rho, N)
                kc = mpmath.fsum(rho * rho * a * b / sdd for a, b in zip(nA, nB))
                assert mpmath.mpf(t["key_covariance"]) >= kc
                assert mpmath.mpf(t["value"]) >= mpmath.fsum(sN * b for b in nB)


def test_layernorm_constants_dominate_high_precision_values():
    import mpmath
    for seed in range(12):
        torch.manual_seed(seed)
        C = 3 + seed
        norm = torch.nn.LayerNorm(C, eps=10.0 ** -(seed % 7 + 1), dtype=F64)
        with torch.no_grad():
            norm.weight.uniform_(-3, 3)
            norm.bias.uniform_(-2, 2)
        with mpmath.workdps(40):
            gmax = mpmath.mpf(float(norm.weight.abs().max()))
            rad = mpmath.sqrt(C) * gmax + mpmath.sqrt(mpmath.fsum(mpmath.mpf(x) ** 2 for x in norm.bias.tolist()))
            lip = gmax / mpmath.sqrt(mpmath.mpf(norm.eps))
            assert mpmath.mpf(ab.layernorm_image_radius(norm)) >= rad
            assert mpmath.mpf(ab.layernorm_lipschitz(norm)) >= lip


def test_block_bounds_are_rounded_up_from_their_parts():
    from fractions import Fraction as Fr
    for seed in range(6):
        blk = _block(seed)
        b = ab.attention_block_lipschitz(blk, 4)
        assert Fr(b["mixer_branch"]) >= Fr(b["attention_on_ln_image"]) * Fr(b["lip_ln1"])
        assert Fr(b["mlp_branch"]) >= Fr(b["lip_mlp"]) * Fr(b["lip_ln2"])
        assert Fr(b["vector_field"]) >= Fr(b["mixer_branch"]) + Fr(b["mlp_branch"])
        assert Fr(b["block_update"]) >= (1 + Fr(b["mixer_branch"])) * (1 + Fr(b["mlp_branch"]))


def test_block_with_an_identity_second_norm_uses_lip_one():
    blk = _block(2)
    blk.norm2 = torch.nn.Identity()
    b = ab.attention_block_lipschitz(blk, 4)
    assert b["lip_ln2"] == 1.0
    assert b["lip_mlp"] <= b["mlp_branch"] <= b["lip_mlp"] * (1 + 1e-12)


def test_overflow_messages_name_the_term():
    torch.manual_seed(0)
    layer = DenseAttention(4, 1, dtype=F64)
    with pytest.raises(ValueError, match="the key-covariance bound overflows"):
        ab.attention_lipschitz_on_ball(layer, 1e160, 4)
    kc1 = ab.attention_lipschitz_terms(layer, 1.0, 4)["key_covariance"]
    with pytest.raises(ValueError, match="the query-side bound overflows"):  # key term finite, sqrt(N) x it not
        ab.attention_lipschitz_terms(layer, math.sqrt(1e306) / math.sqrt(kc1), 10 ** 6)
    with pytest.raises(ValueError, match="the Frobenius-ball attention bound overflows"):
        ab.attention_lipschitz_on_frobenius_ball(layer, 1e160, 4)
    # three finite terms whose sum overflows: scale W_O so that the key-covariance term is 0.7e308 at rho = 1e150
    # (the query-side term is then about twice that: finite alone, not summed)
    with torch.no_grad():
        layer.o_proj.weight.mul_(0.7e8 / kc1)
    t = ab.attention_lipschitz_terms(layer, 1e150, 4)
    assert all(math.isfinite(v) for v in t.values()) and not math.isfinite(sum(t.values())), t
    with pytest.raises(ValueError, match="the attention bound overflows"):
        ab.attention_lipschitz_on_ball(layer, 1e150, 4)


@pytest.mark.parametrize("dt,scales", [(torch.float64, (1e-300, 1e-170, 1.0, 1e170, 1e300)),
                                       (torch.float32, (1e-30, 1.0, 1e30))])
def test_frobenius_upper_at_every_scale(dt, scales):
    """_frobenius_upper against the 40-digit Frobenius norm: never below it, within a few gamma_{k+1} of it, at
    scales where the plain sum of squares underflows to 0 or overflows to inf (3e-170, 4e-170 -> 0 in float64)."""
    import mpmath
    from lipcheck.bounds.attention import _frobenius_upper
    mpmath.mp.dps = 40
    u = torch.finfo(dt).eps / 2
    g = torch.Generator().manual_seed(2)
    for sc in scales:
        x = (torch.randn(5, 7, generator=g, dtype=torch.float64) * sc).to(dt)
        exact = mpmath.sqrt(mpmath.fsum(mpmath.mpf(float(t)) ** 2 for t in x.double().flatten()))
        v = _frobenius_upper(x, u)
        assert exact <= v <= exact * (1 + 3 * 37 * u), (sc, v, exact)
    assert _frobenius_upper(torch.zeros(3, dtype=dt), u) == 0.0
    assert math.isnan(_frobenius_upper(torch.tensor([1.0, math.nan], dtype=dt), u))  # callers refuse non-finite
