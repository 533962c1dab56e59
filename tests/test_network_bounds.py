"""Vector-field constants (lipcheck.bounds.network, SPEC S3) against Jacobians computed in this file.

References: dense Jacobians by torch.autograd.functional.jacobian and SVD, central finite differences,
the SSoG operator assembled here from SPEC's kernel g (its own lattice sum for Z), and the closed
forms (sup|GELU'| = Phi(sqrt 2) + sqrt 2 phi(sqrt 2), max|gamma| / sqrt(v + eps)) written out here.
"""
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lipcheck.bounds import network
from lipcheck.bounds.attention import attention_lipschitz_on_ball
from lipcheck.mixers.attention import DenseAttention
from lipcheck.mixers.ssog import SSoG
from lipcheck.models.vit import Block, vit_from_preset

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
GELU_SUP = 0.5 * (1 + math.erf(1.0)) + math.exp(-1.0) / math.sqrt(math.pi)  # Phi(sqrt2) + sqrt2 phi(sqrt2)


def svd_norm(M):
    return float(torch.linalg.svdvals(M.to(F64))[0])


def jac(f, x):
    """Dense Jacobian of f at x (any shape), rows = outputs."""
    return torch.autograd.functional.jacobian(lambda z: f(z).reshape(-1), x.to(F64)).reshape(-1, x.numel())


def g_kernel(k, mu, s):
    """SPEC's g(k; mu, sigma) with Z summed over |j - mu| <= 40 sigma + 40 (the rest is < 1e-300)."""
    j = torch.arange(math.floor(mu - 40 * s - 40), math.ceil(mu + 40 * s + 40) + 1, dtype=F64)
    Z = torch.exp(-(j - mu) ** 2 / (2 * s * s)).sum()
    return torch.exp(-(k.to(F64) - mu) ** 2 / (2 * s * s)) / Z


def dense_T(layer, H, W):
    """vec(T(X)) for X (N, C) row-major: T = sum_h K_h (x) P_h^T, K_h from SPEC's formula."""
    alpha, mu, sigma = (t.detach().to(F64) for t in layer.gaussian_params())
    h, M = alpha.shape
    C = layer.v_proj.weight.shape[0]
    d = C // h
    Wv, Wo = layer.v_proj.weight.detach().to(F64), layer.o_proj.weight.detach().to(F64)
    iy, ix = torch.arange(H), torch.arange(W)
    T = torch.zeros(H * W * C, H * W * C, dtype=F64)
    for hh in range(h):
        K = torch.zeros(H * W, H * W, dtype=F64)
        for m in range(M):
            Gy = g_kernel(iy[:, None] - iy[None, :], float(mu[hh, m, 0]), float(sigma[hh, m, 0]))
            Gx = g_kernel(ix[:, None] - ix[None, :], float(mu[hh, m, 1]), float(sigma[hh, m, 1]))
            K += float(alpha[hh, m]) * torch.kron(Gy, Gx)
        P = Wv.T[:, hh * d:(hh + 1) * d] @ Wo.T[hh * d:(hh + 1) * d, :]
        T += torch.kron(K, P.T.contiguous())
    return T


# ------------------------------------------------------------------------------- MLP

@pytest.mark.parametrize("seed", [0, 1])
def test_mlp_constant_is_the_closed_form_and_dominates_jacobians(seed):
    torch.manual_seed(seed)
    blk = Block(6, 2, "ssog", num_components=2).to(F64)
    mlp = blk.mlp
    W1, W2 = mlp.fc1.weight.detach(), mlp.fc2.weight.detach()
    ref = svd_norm(W1) * GELU_SUP * svd_norm(W2)
    L = network.mlp_lipschitz(mlp)
    assert ref <= L <= ref * (1 + 1e-9)
    # Jacobians, including a point whose pre-activations sit at GELU's steepest point sqrt(2)
    g = torch.Generator().manual_seed(seed)
    b1 = mlp.fc1.bias.detach()
    x_star = torch.linalg.lstsq(W1, (math.sqrt(2) - b1)[:, None]).solution[:, 0]
    for x in (torch.randn(6, generator=g, dtype=F64), x_star, 50 * torch.randn(6, generator=g, dtype=F64)):
        assert svd_norm(jac(mlp, x)) <= L
    # finite differences agree with the autograd Jacobian (the reference itself is checked)
    x = torch.randn(6, generator=g, dtype=F64)
    v = torch.randn(6, generator=g, dtype=F64)
    fd = (mlp(x + 1e-6 * v) - mlp(x - 1e-6 * v)) / 2e-6
    assert torch.allclose(fd, jac(mlp, x) @ v, rtol=1e-6, atol=1e-8)


def test_mlp_constant_tanh_variant_none_and_bad_weights():
    torch.manual_seed(2)
    blk = Block(4, 2, "ssog", num_components=1).to(F64)
    xs = torch.linspace(-8, 8, 200001, dtype=F64).requires_grad_(True)
    y = torch.nn.functional.gelu(xs, approximate="tanh").sum()
    (dg,) = torch.autograd.grad(y, xs)
    sup_tanh = float(dg.abs().max())
    ref = svd_norm(blk.mlp.fc1.weight.detach()) * svd_norm(blk.mlp.fc2.weight.detach())
    L = network.mlp_lipschitz(blk.mlp, variant="tanh")
    assert ref * sup_tanh <= L <= ref * sup_tanh * (1 + 1e-6)
    assert network.mlp_lipschitz(None) == 0.0
    with pytest.raises(ValueError, match="variant"):
        network.mlp_lipschitz(blk.mlp, variant="relu")
    for name in ("fc1", "fc2"):
        bad = Block(4, 2, "ssog", num_components=1).to(F64)
        with torch.no_grad():
            getattr(bad.mlp, name).weight[0, 0] = float("nan")
        with pytest.raises(ValueError, match=name):
            network.mlp_lipschitz(bad.mlp)


# ------------------------------------------------------------------------------- mixer

@settings(deadline=None, max_examples=4)
@given(st.integers(0, 2 ** 16), st.sampled_from([(4, 1, 1), (4, 2, 2), (6, 3, 1)]))
def test_ssog_mixer_constant_dominates_every_grid_and_the_closed_form_bounds_it(seed, cfg):
    C, h, M = cfg
    torch.manual_seed(seed)
    layer = SSoG(C, h, M).to(F64)
    L, terms = network.mixer_lipschitz(layer, rtol=1e-2)
    alpha = layer.gaussian_params()[0].detach().to(F64)
    Wv, Wo = layer.v_proj.weight.detach().to(F64), layer.o_proj.weight.detach().to(F64)
    d = C // h
    closed = sum(svd_norm(Wv.T[:, i * d:(i + 1) * d] @ Wo.T[i * d:(i + 1) * d, :]) * float(alpha[i].abs().sum())
                 for i in range(h))
    assert terms["kind"] == "ssog"
    assert L <= closed * (1 + 1e-9)  # S1's closed form bounds the resolution-free constant
    assert L <= terms["resolution_free"] * (1 + 1e-12) and L <= terms["closed_form"] * (1 + 1e-12)
    for H, W in ((1, 1), (2, 3), (5, 4)):
        assert svd_norm(dense_T(layer, H, W)) <= L
    # the Jacobian of the layer is T (it is affine): autograd on the forward reproduces the dense T
    X = torch.randn(1, 2, 3, C, dtype=F64)
    J = jac(layer, X)
    assert torch.allclose(J, dense_T(layer, 2, 3), atol=1e-10)


def test_attention_mixer_constant_needs_a_radius_and_tokens():
    torch.manual_seed(0)
    attn = DenseAttention(4, 2, dtype=F64)
    L, terms = network.mixer_lipschitz(attn, token_radius=2.0, num_tokens=6)
    assert terms == {"kind": "attention", "token_radius": 2.0, "num_tokens": 6}
    assert L == attention_lipschitz_on_ball(attn, 2.0, 6)
    X = torch.randn(1, 2, 3, 4, dtype=F64)
    X = X / X.norm(dim=-1, keepdim=True) * 2.0
    assert svd_norm(jac(attn, X)) <= L
    with pytest.raises(ValueError, match="not globally Lipschitz"):
        network.mixer_lipschitz(attn, num_tokens=6)
    with pytest.raises(ValueError, match="number of tokens"):
        network.mixer_lipschitz(attn, token_radius=2.0)
    with pytest.raises(TypeError, match="SSoG or DenseAttention"):
        network.mixer_lipschitz(torch.nn.Linear(4, 4))


# ------------------------------------------------------------------------------- vector field

def _ssog_block(seed, use_norm=True, use_mlp=True, eps=1e-2):
    torch.manual_seed(seed)
    blk = Block(4, 2, "ssog", num_components=2, use_norm=use_norm, use_mlp=use_mlp, norm_eps=eps).to(F64)
    with torch.no_grad():
        for n in (blk.norm1, blk.norm2):
            if isinstance(n, torch.nn.LayerNorm):
                n.weight.uniform_(0.5, 2.0)
                n.bias.uniform_(-0.5, 0.5)
    return blk


@pytest.mark.parametrize("mixer", ["ssog", "attention"])
def test_vector_field_global_and_local_constants(mixer):
    torch.manual_seed(3)
    blk = Block(4, 2, mixer, num_components=2, norm_eps=1e-2).to(F64)
    with torch.no_grad():
        blk.norm1.weight.uniform_(0.5, 2.0)
        blk.norm2.weight.uniform_(0.5, 3.0)
    g = torch.Generator().manual_seed(3)
    states = torch.randn(2, 2, 3, 4, generator=g, dtype=F64) * 2
    b = network.vector_field_lipschitz(blk, states, rtol=1e-3)
    v = exact_min_variance(states)
    g1, g2 = float(blk.norm1.weight.abs().max()), float(blk.norm2.weight.abs().max())
    eps = 1e-2
    mlp_ref = svd_norm(blk.mlp.fc1.weight.detach()) * GELU_SUP * svd_norm(blk.mlp.fc2.weight.detach())
    assert mlp_ref <= b.mlp <= mlp_ref * (1 + 1e-9)
    assert g1 / math.sqrt(eps) <= b.ln1_global <= g1 / math.sqrt(eps) * (1 + 1e-12)
    assert g2 / math.sqrt(eps) <= b.ln2_global <= g2 / math.sqrt(eps) * (1 + 1e-12)
    assert g1 / math.sqrt(v + eps) <= b.ln1_local <= g1 / math.sqrt(v + eps) * (1 + 1e-12)
    assert g2 / math.sqrt(v + eps) <= b.ln2_local <= g2 / math.sqrt(v + eps) * (1 + 1e-12)
    glob = b.mixer * g1 / math.sqrt(eps) + mlp_ref * g2 / math.sqrt(eps)
    loc = b.mixer * g1 / math.sqrt(v + eps) + mlp_ref * g2 / math.sqrt(v + eps)
    assert glob <= b.global_bound <= glob * (1 + 1e-9)
    assert loc <= b.local_bound <= loc * (1 + 1e-9)
    assert b.local_bound < b.global_bound and b.vacuous == (b.global_bound > network.VACUOUS)
    assert v * (1 - 1e-13) <= b.terms["min_variance"] <= v and b.terms["use_norm"] and b.terms["use_mlp"]
    if mixer == "attention":
        rho1 = math.sqrt(4) * g1 + float(blk.norm1.bias.norm())
        assert b.mixer >= attention_lipschitz_on_ball(blk.mixer, rho1, 6) * (1 - 1e-12)
        assert b.terms["mixer_terms"]["num_tokens"] == 6
    # Jacobian of F at each state (variance >= v) is below the local bound; at a nearly constant
    # token (variance -> 0) it is below the global one and above the local one of those states
    for s in states:
        assert svd_norm(jac(blk.vector_field, s[None])) <= b.local_bound
    flat = torch.full((1, 2, 3, 4), 0.3, dtype=F64) + 1e-4 * torch.randn(1, 2, 3, 4, generator=g, dtype=F64)
    J_flat = svd_norm(jac(blk.vector_field, flat))
    assert J_flat <= b.global_bound
    # min_variance takes the smaller of the two
    b2 = network.vector_field_lipschitz(blk, states, min_variance=v / 4, mixer_bound=(b.mixer, b.terms["mixer_terms"]))
    assert b2.terms["min_variance"] == v / 4 and b2.local_bound > b.local_bound
    b3 = network.vector_field_lipschitz(blk, states, min_variance=4 * v, mixer_bound=(b.mixer, b.terms["mixer_terms"]))
    assert b3.terms["min_variance"] == b.terms["min_variance"] and b3.local_bound == b.local_bound


def test_vector_field_without_norm_or_mlp_and_without_states():
    blk = _ssog_block(4, use_norm=False, use_mlp=False)
    b = network.vector_field_lipschitz(blk, rtol=1e-3)
    assert b.local_bound is None and b.mlp == 0.0 and b.ln1_global == 1.0 and b.ln2_global == 0.0
    # the mixer's constant alone, rounded up by gamma_3 (proofs/S3.md, 'Rounding')
    assert b.mixer < b.global_bound <= b.mixer * (1 + 4 * 2.0 ** -53) and not b.terms["use_norm"] and not b.terms["use_mlp"]
    X = torch.randn(1, 2, 2, 4, dtype=F64)
    assert svd_norm(jac(blk.vector_field, X)) <= b.global_bound
    # with the min_variance argument alone the local bound exists
    b = network.vector_field_lipschitz(_ssog_block(4), min_variance=0.5, rtol=1e-3)
    g1 = float(_ssog_block(4).norm1.weight.abs().max())
    assert b.terms["min_variance"] == 0.5 and b.ln1_local >= g1 / math.sqrt(0.5 + 1e-2)
    # a list of states is accepted (concatenated)
    s = [torch.randn(1, 2, 2, 4, dtype=F64) for _ in range(2)]
    vmin = min(float(t.var(dim=-1, unbiased=False).min()) for t in s)
    b = network.vector_field_lipschitz(_ssog_block(4), s, rtol=1e-3)
    assert abs(b.terms["min_variance"] - vmin) <= 1e-15 * vmin


def test_ode_model_uses_its_block_and_refuses_bad_input():
    torch.manual_seed(0)
    m = vit_from_preset("tiny", "ode", "ssog", dtype=F64)
    b = network.vector_field_lipschitz(m, rtol=1e-2)
    ref = network.vector_field_lipschitz(m.vector_field.block, rtol=1e-2)
    assert b.global_bound == ref.global_bound
    with pytest.raises(TypeError, match="Block"):
        network.vector_field_lipschitz(torch.nn.Linear(3, 3))
    blk = _ssog_block(1)
    x = torch.randn(1, 2, 2, 4, dtype=F64)
    with pytest.raises(ValueError, match="non-finite"):
        network.vector_field_lipschitz(blk, x * float("nan"))
    with pytest.raises(ValueError, match="min_variance"):
        network.vector_field_lipschitz(blk, x, min_variance=-1.0)
    with pytest.raises(ValueError, match="min_variance"):
        network.vector_field_lipschitz(blk, x, min_variance=float("inf"))
    with torch.no_grad():
        blk.norm2.bias[0] = float("inf")
    with pytest.raises(ValueError, match="LayerNorm"):
        network.vector_field_lipschitz(blk, x)
    blk = _ssog_block(1)
    blk.norm1 = torch.nn.BatchNorm1d(4)
    with pytest.raises(TypeError, match="LayerNorm"):
        network.vector_field_lipschitz(blk, x)


def exact_min_variance(states) -> float:
    """min over tokens of the biased variance, in exact rational arithmetic, rounded down to a float."""
    rows = states.detach().reshape(-1, states.shape[-1]).tolist()
    best = None
    for row in rows:
        xs = [Fraction(v) for v in row]
        m = sum(xs) / len(xs)
        var = sum((v - m) ** 2 for v in xs) / len(xs)
        best = var if best is None or var < best else best
    f = float(best)
    return f if Fraction(f) <= best else math.nextafter(f, -math.inf)


@pytest.mark.parametrize("mean,spread,dtype", [(0.0, 1.0, torch.float32), (1e8, 1.0, F64), (3e3, 1e-4, torch.float32),
                                               (-7.0, 1e-6, F64)])
def test_min_token_variance_is_a_lower_bound_at_full_precision(mean, spread, dtype):
    """The smallest token variance is what LayerNorm's local constant divides by, so it must not exceed the exact
    value (computed here in rational arithmetic) even where the mean dwarfs the spread (the two-pass sum then carries
    the mean's rounding); and it is the exact value to ~C u, also for float32 states (converted exactly to float64)."""
    g = torch.Generator().manual_seed(5)
    x = (mean + spread * torch.randn(6, 24, generator=g, dtype=F64)).to(dtype)
    v = exact_min_variance(x)
    got = network.min_token_variance(x)
    assert got <= v
    rel = 1e-12 if abs(mean) / spread < 1e4 else 1e-6  # the mean's rounding allowance: (24 u mean)^2 / spread^2
    assert got >= v * (1 - rel)


def test_min_token_variance_is_the_biased_variance():
    x = torch.tensor([[[1.0, 3.0], [2.0, 2.0]], [[0.0, 4.0], [-1.0, 1.0]]], dtype=F64)
    assert network.min_token_variance(x) == 0.0
    assert 1 - 1e-14 <= network.min_token_variance(x[:, :1]) <= 1.0  # tokens (1, 3) and (0, 4): variances 1 and 4
    with pytest.raises(ValueError, match="states"):
        network.min_token_variance(torch.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        network.min_token_variance(torch.tensor([[float("inf"), 0.0]]))


def test_terms_record_every_constant_of_the_bound():
    """The terms dict (what the reports print) carries the same numbers as the result's fields."""
    blk = _ssog_block(6)
    x = torch.randn(1, 2, 2, 4, dtype=F64)
    b = network.vector_field_lipschitz(blk, x, rtol=1e-2, gelu_variant="tanh")
    t = b.terms
    assert t["mixer"] == b.mixer and t["mlp"] == b.mlp and t["global_bound"] == b.global_bound
    assert t["local_bound"] == b.local_bound and t["ln1_global"] == b.ln1_global and t["ln2_global"] == b.ln2_global
    assert t["ln1_local"] == b.ln1_local and t["ln2_local"] == b.ln2_local
    assert t["vacuous_threshold"] == network.VACUOUS and t["mixer_terms"]["kind"] == "ssog"
    # the tanh GELU's sup |GELU'| (a dense grid here) is what the MLP constant used
    xs = torch.linspace(-8, 8, 200001, dtype=F64).requires_grad_(True)
    (dg,) = torch.autograd.grad(torch.nn.functional.gelu(xs, approximate="tanh").sum(), xs)
    assert float(dg.abs().max()) <= t["gelu_sup"] <= float(dg.abs().max()) * (1 + 1e-6)
    ref = svd_norm(blk.mlp.fc1.weight.detach()) * float(dg.abs().max()) * svd_norm(blk.mlp.fc2.weight.detach())
    assert ref <= b.mlp <= ref * (1 + 1e-6)
    assert 0 < t["mixer_terms"]["symbol_sup_lower"] <= b.mixer * (1 + 1e-12)
    assert svd_norm(dense_T(blk.mixer, 6, 6)) <= b.mixer


def test_no_norm_no_mlp_with_states_and_norms_without_affine():
    blk = _ssog_block(7, use_norm=False, use_mlp=False)
    x = torch.randn(1, 2, 2, 4, dtype=F64)
    b = network.vector_field_lipschitz(blk, x, rtol=1e-2)
    assert b.ln1_local == 1.0 and b.ln2_local == 0.0 and b.local_bound == b.global_bound
    assert b.mixer < b.global_bound <= b.mixer * (1 + 4 * 2.0 ** -53)
    assert svd_norm(jac(blk.vector_field, x)) <= b.local_bound
    # an empty list of states is no states
    b0 = network.vector_field_lipschitz(blk, [], rtol=1e-2)
    assert b0.local_bound is None and b0.terms["min_variance"] is None
    # attention without LayerNorm has no finite bound
    torch.manual_seed(0)
    ablk = Block(4, 2, "attention", use_norm=False).to(F64)
    with pytest.raises(ValueError, match="not globally Lipschitz"):
        network.vector_field_lipschitz(ablk, x)
    # LayerNorm without affine parameters: gamma = 1, beta = 0
    blk = _ssog_block(8)
    blk.norm1 = torch.nn.LayerNorm(4, eps=1e-2, elementwise_affine=False, dtype=F64)
    blk.norm2 = torch.nn.LayerNorm(4, eps=1e-2, elementwise_affine=False, dtype=F64)
    b = network.vector_field_lipschitz(blk, x, rtol=1e-2)
    assert 10.0 <= b.ln1_global <= 10.0 * (1 + 1e-12) and 10.0 <= b.ln2_global <= 10.0 * (1 + 1e-12)
    v = float(x.var(dim=-1, unbiased=False).min())
    assert 1 / math.sqrt(v + 1e-2) <= b.ln1_local <= 1 / math.sqrt(v + 1e-2) * (1 + 1e-12)


def test_attention_block_radius_is_the_layernorm_image():
    """The attention mixer's constant is taken on the ball LN1 maps into: radius sqrt(C) max|gamma| + ||beta||."""
    torch.manual_seed(4)
    blk = Block(4, 2, "attention", norm_eps=1e-2).to(F64)
    with torch.no_grad():
        blk.norm1.weight.uniform_(0.5, 2.0)
        blk.norm1.bias.uniform_(-1, 1)
    x = torch.randn(1, 2, 2, 4, dtype=F64)
    b = network.vector_field_lipschitz(blk, x)
    rho = 2 * float(blk.norm1.weight.abs().max()) + float(blk.norm1.bias.norm())
    assert b.terms["mixer_terms"]["token_radius"] == pytest.approx(rho, rel=1e-14)
    assert attention_lipschitz_on_ball(blk.mixer, rho * (1 - 1e-12), 4) <= b.mixer
    assert b.mixer <= attention_lipschitz_on_ball(blk.mixer, rho * (1 + 1e-12), 4)
    # 2-D states (tokens, C) fix no grid: attention then asks for states with a grid
    with pytest.raises(ValueError, match="number of tokens"):
        network.vector_field_lipschitz(blk, x.reshape(4, 4))
    with pytest.raises(ValueError, match="number of tokens"):  # no states at all: no grid either
        network.vector_field_lipschitz(blk)
    v = exact_min_variance(x.reshape(4, 4))
    assert v * (1 - 1e-13) <= network.min_token_variance(x.reshape(4, 4)) <= v


def test_layernorm_output_radius_rounded_up_in_the_certification_dtype():
    """The radius of LN1's image, sqrt(C) max|gamma| + ||beta||, bounds every token the attention bound is taken on:
    it must be >= its exact value (40 digits, from the float32 weights as stored) and within float64 rounding of it
    when certified in float64 (a norm taken in float32 would be off by ~1e-7)."""
    import mpmath
    torch.manual_seed(8)
    blk = Block(8, 2, "attention", norm_eps=1e-2)
    with torch.no_grad():
        blk.norm1.weight.uniform_(0.5, 2.0)
        blk.norm1.bias.uniform_(-1, 1)
    x = torch.randn(1, 2, 2, 8)
    b = network.vector_field_lipschitz(blk, x, dtype=F64)
    mpmath.mp.dps = 40
    g = max(abs(mpmath.mpf(float(t))) for t in blk.norm1.weight.detach())
    beta = mpmath.sqrt(sum(mpmath.mpf(float(t)) ** 2 for t in blk.norm1.bias.detach()))
    exact = mpmath.sqrt(8) * g + beta
    got = b.terms["mixer_terms"]["token_radius"]
    assert exact <= got <= exact * (1 + 1e-14)
    # certified in float32 the radius is the same number: LayerNorm's weights are read exactly, in float64
    got32 = network.vector_field_lipschitz(blk, x, dtype=torch.float32).terms["mixer_terms"]["token_radius"]
    assert got32 == got


def test_vector_field_passes_its_rtol_to_the_mixer_bound():
    """rtol sets how tight SSoG's resolution-free bound is: a coarse rtol gives a looser (still true) mixer constant,
    the same one mixer_lipschitz gives at that rtol; the default gives a tighter one."""
    blk = _ssog_block(2)
    x = torch.randn(1, 3, 3, 4, dtype=F64)
    coarse = network.vector_field_lipschitz(blk, x, rtol=0.3)
    fine = network.vector_field_lipschitz(blk, x)
    assert coarse.mixer == network.mixer_lipschitz(blk.mixer, rtol=0.3)[0]
    assert fine.mixer == network.mixer_lipschitz(blk.mixer)[0] < coarse.mixer
    # a variance floor of 0 is legal (it gives LayerNorm's global constant); a negative one is refused
    zero = network.vector_field_lipschitz(blk, min_variance=0.0, mixer_bound=(fine.mixer, {}))
    assert zero.local_bound == zero.global_bound and zero.terms["min_variance"] == 0.0
    with pytest.raises(ValueError, match="min_variance"):
        network.vector_field_lipschitz(blk, min_variance=-1e-300)


def test_min_token_variance_subtracts_each_tokens_mean_allowance():
    """Where a token's mean dwarfs its spread (1e12 against 1), the computed mean may be off by gamma_C mean|x| and the
    two-pass value then exceeds the variance by up to that squared (proofs/S3.md, 'Rounding'). The lower bound must
    take this allowance from the token's own mean|x| (not an average over tokens, which a small-valued token halves):
    it lies below the exact variance by 0.5 to 1.5 times (gamma_C mean|x|)^2, here ~7e-6."""
    C = 24
    g = torch.Generator().manual_seed(2)
    big = 1e12 + torch.randn(1, C, generator=g, dtype=F64)
    small = 10 * torch.randn(1, C, generator=g, dtype=F64)  # variance ~100: not the smallest
    x = torch.cat([big, small])
    v = exact_min_variance(big)
    u = 2.0 ** -53
    e = C * u / (1 - C * u) * 1e12
    got = network.min_token_variance(x)
    assert v - 1.5 * e ** 2 - 1e-12 * v <= got <= v - 0.5 * e ** 2
