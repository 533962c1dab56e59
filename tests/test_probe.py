"""Attention growth probe (SPEC S4) and the certified attention bound on bounded tokens.

References are independent of the probe's torch.func machinery: dense Jacobians from
torch.autograd.functional.jacobian on the layer's own forward (SDPA backend) and exact SVDs.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lipcheck.bounds.attention import (attention_lipschitz_on_ball, attention_lipschitz_on_frobenius_ball, head_matrices,
                                      layernorm_image_radius)
from lipcheck.mixers.attention import DenseAttention
from lipcheck.models.vit import Block
from lipcheck.probe import BlockMap, attention_growth, attention_witness, witness_closed_form, witness_directions


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def dense_jacobian(module, X):
    """J[(j, a), (i, b)] = d y_i[b] / d x_j[a] (rows index inputs) for X (H, W, C), float64, plain autograd."""
    H, W, C = X.shape
    f = lambda z: module(z.reshape(1, H, W, C)).reshape(-1)
    return torch.autograd.functional.jacobian(f, X.reshape(-1).double()).T


def spectral(J):
    return float(torch.linalg.matrix_norm(J, 2))


def zero_qkv_bias(layer):
    with torch.no_grad():
        for p in (layer.q_proj, layer.k_proj, layer.v_proj):
            p.bias.zero_()
    return layer


# ------------------------------------------------------------------------------- must-show 1

def test_growth_ti_width_is_strictly_increasing_with_exponent_two():
    torch.manual_seed(0)
    layer = DenseAttention(192, 3)  # preset ti width, default initialisation
    radii = [2.0 ** k for k in range(13)]
    r = attention_growth(layer, radii, grid=(4, 4), restarts=6, steps=8, power_warmup=6, certify_top=1,
                         certify_steps=15, device="cpu", seed=0)
    assert r.fit_min_radius == 64.0
    assert all(b > a for a, b in zip(r.lower, r.lower[1:])), r.lower
    assert 1.9 <= r.exponent <= 2.1, (r.exponent, r.lower)
    assert r.exponent_ci[0] <= r.exponent <= r.exponent_ci[1]
    norms = r.X.flatten(1).norm(dim=1)
    assert bool((norms <= torch.tensor(radii, dtype=norms.dtype)).all())


# ------------------------------------------------------------------------------- must-show 2

@settings(deadline=None, max_examples=5)
@given(st.sampled_from([(4, 1), (6, 2), (8, 2)]), st.sampled_from([(2, 2), (2, 3), (3, 1)]),
       st.integers(0, 2 ** 16), st.sampled_from(["dense", "subspace"]))
def test_probe_values_equal_exact_jacobian_norm(shape, grid, seed, method):
    C, h = shape
    torch.manual_seed(seed)
    layer = DenseAttention(C, h, dtype=torch.float64)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(4.0)  # larger weights: the softmax is no longer nearly uniform
    radii = [0.5, 2.0, 6.0]
    r = attention_growth(layer, radii, grid=grid, restarts=4, steps=6, certify_method=method,
                         certify_steps=120, certify_top=1, device="cpu", seed=seed)
    for R, L, X in zip(radii, r.lower, r.X):
        assert float(X.norm()) <= R
        exact = spectral(dense_jacobian(layer, X))  # SDPA forward, independent of the probe's math path
        assert L <= exact * (1 + 1e-12)
        assert abs(L - exact) <= 1e-9 * exact


def test_probe_on_pre_ln_block_equals_exact():
    torch.manual_seed(1)
    block = Block(8, 2, "attention", dtype=torch.float64)
    fmap = BlockMap(block, "vector_field")
    r = attention_growth(fmap, [1.0, 8.0], grid=(2, 2), restarts=3, steps=5, device="cpu")
    for L, X in zip(r.lower, r.X):
        exact = spectral(dense_jacobian(fmap, X))
        assert abs(L - exact) <= 1e-9 * exact


# ------------------------------------------------------------------------------- must-show 3

def balanced_direction(A):
    """A unit u with u A u^T = 0: mix eigenvectors of sym(A) with eigenvalues of opposite sign."""
    lam, Q = torch.linalg.eigh((A + A.T) / 2)
    lp, ln = float(lam[-1]), float(lam[0])
    assert lp > 0 > ln
    u = math.sqrt(-ln) * Q[:, -1] + math.sqrt(lp) * Q[:, 0]
    return u / u.norm()


@pytest.mark.parametrize("R", [0.5, 3.0, 40.0])
def test_witness_single_head_closed_form(R):
    torch.manual_seed(2)
    layer = zero_qkv_bias(DenseAttention(6, 1, dtype=torch.float64))
    u = balanced_direction(head_matrices(layer)["A"][0])
    cf = witness_closed_form(layer, R, (2, 3), u)
    assert cf["balanced"]
    J = dense_jacobian(layer, cf["X"])
    assert torch.allclose(J, cf["jacobian"], rtol=1e-10, atol=1e-12 * float(J.abs().max()))
    # the R^2 part alone: its norm is the scalar closed form
    N, C = 6, 6
    B = head_matrices(layer)["B"][0]
    T = J - torch.kron(torch.ones(N, N, dtype=J.dtype) / N, B)
    assert spectral(T) == pytest.approx(cf["norm_R2"], rel=1e-10)
    assert abs(spectral(J) - cf["norm_R2"]) <= cf["remainder_bound"] * (1 + 1e-12)


def test_witness_multi_head_closed_form():
    torch.manual_seed(3)
    layer = zero_qkv_bias(DenseAttention(12, 3, dtype=torch.float64))
    grid, R = (2, 3), 7.0
    for u in list(witness_directions(layer).values())[:3]:  # generic u: the zero tokens' rows are exact
        cf = witness_closed_form(layer, R, grid, u)
        J = dense_jacobian(layer, cf["X"])
        C = 12
        for i, Ji in cf["rows"]:
            assert torch.allclose(J[:, i * C:(i + 1) * C], Ji, rtol=1e-10, atol=1e-12 * float(J.abs().max()))
        assert spectral(J) >= cf["D_norm"] * (1 - 1e-12)
        # and with b_Q = 0 the probe's uniform witness is exactly this input
        Xw = attention_witness(layer, R, grid, u)
        assert torch.allclose(Xw, cf["X"], atol=1e-12)
    # make a common u balanced in every head (u W_Q^h orthogonal to u W_K^h): the whole Jacobian is exact
    m = head_matrices(layer)
    u = torch.randn(C, dtype=torch.float64)
    u /= u.norm()
    with torch.no_grad():
        Wq = layer.q_proj.weight  # (C_out, C_in): row block h is W_Q^h^T
        for h in range(3):
            rows = slice(4 * h, 4 * h + 4)
            uWk = u @ m["WK"][h]
            uWq = Wq[rows] @ u
            uWq -= (uWq @ uWk) / (uWk @ uWk) * uWk
            Wq[rows] += torch.outer(uWq - Wq[rows] @ u, u)
    cf = witness_closed_form(layer, R, grid, u)
    assert cf["balanced"]
    J = dense_jacobian(layer, cf["X"])
    assert torch.allclose(J, cf["jacobian"], rtol=1e-10, atol=1e-12 * float(J.abs().max()))


# ------------------------------------------------------------------------------- the bound

@settings(deadline=None, max_examples=8)
@given(st.integers(0, 2 ** 16), st.floats(0.1, 20.0))
def test_attention_bound_dominates_jacobian_on_bounded_tokens(seed, rho):
    torch.manual_seed(seed)
    layer = DenseAttention(8, 2, dtype=torch.float64)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(3.0)
    H, W, C = 2, 2, 8
    bound = attention_lipschitz_on_ball(layer, rho, H * W)
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):  # random tokens inside D_rho, some on its boundary
        X = torch.randn(H * W, C, generator=g, dtype=torch.float64)
        X = X / X.norm(dim=1, keepdim=True) * rho * torch.rand(H * W, 1, generator=g, dtype=torch.float64) ** 0.1
        assert spectral(dense_jacobian(layer, X.reshape(H, W, C))) <= bound
    # adversarial: the probe's inputs on the Frobenius ball of radius rho (inside D_rho)
    frob = attention_lipschitz_on_frobenius_ball(layer, rho, H * W)
    r = attention_growth(layer, [rho], grid=(H, W), restarts=4, steps=8, device="cpu", seed=seed)
    assert r.lower[0] <= min(bound, frob)
    X = torch.randn(H, W, C, generator=g, dtype=torch.float64)
    assert spectral(dense_jacobian(layer, X * (rho / X.norm()))) <= frob


def test_layernorm_image_radius_holds():
    torch.manual_seed(4)
    norm = torch.nn.LayerNorm(16, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(-2, 2), norm.bias.uniform_(-1, 1)
    x = torch.randn(500, 16, dtype=torch.float64) * torch.logspace(-4, 4, 500, dtype=torch.float64)[:, None]
    assert float(norm(x).norm(dim=1).max()) <= layernorm_image_radius(norm)


# ------------------------------------------------------------------------------- must-show 5

def test_bad_inputs_raise_clear_errors():
    layer = DenseAttention(8, 2)
    for radii, word in (([0.0, 1.0], "positive"), ([-1.0], "positive"), ([], "empty"),
                        ([1.0, float("nan")], "positive"), ([2.0, 1.0], "increasing")):
        with pytest.raises(ValueError, match=word):
            attention_growth(layer, radii, grid=(2, 2), device="cpu")
    with pytest.raises(ValueError, match="restarts"):
        attention_growth(layer, [1.0], grid=(2, 2), restarts=0, device="cpu")
    with pytest.raises(ValueError, match="grid"):
        attention_growth(layer, [1.0], grid=(0, 2), device="cpu")
    bad = DenseAttention(8, 2)
    with torch.no_grad():
        bad.k_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        attention_growth(bad, [1.0], grid=(2, 2), device="cpu")
    with pytest.raises(ValueError, match="non-finite"):
        attention_lipschitz_on_ball(bad, 1.0, 4)
    with pytest.raises(ValueError, match="token_radius"):
        attention_lipschitz_on_ball(layer, -1.0, 4)
    with pytest.raises(ValueError, match="num_tokens"):
        attention_lipschitz_on_ball(layer, 1.0, 0)
