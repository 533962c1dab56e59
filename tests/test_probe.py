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
from lipcheck.probe import (BlockMap, attention_growth, attention_witness, tangent_map, witness_closed_form,
                            witness_directions)


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
                         refine_rounds=1, refine_steps=8, certify_steps=15, device="cpu", seed=0)
    assert r.fit_min_radius == 64.0
    assert all(b > a for a, b in zip(r.lower, r.lower[1:])), r.lower
    assert 1.9 <= r.exponent <= 2.1, (r.exponent, r.lower)
    norms = r.X.flatten(1).norm(dim=1)
    assert bool((norms <= torch.tensor(radii, dtype=norms.dtype)).all())
    # the slope computed here, independently of the library's fit
    x = torch.log(torch.tensor(radii[6:], dtype=torch.float64))
    y = torch.log(torch.tensor(r.lower[6:], dtype=torch.float64))
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    assert slope == pytest.approx(r.exponent, rel=1e-9)


# ------------------------------------------------------------------------------- must-show 2

@settings(deadline=None, max_examples=5)
@given(st.sampled_from([(4, 1), (6, 2), (8, 2)]), st.sampled_from([(2, 2), (2, 3), (3, 1)]),
       st.integers(0, 2 ** 16), st.sampled_from(["dense", "lanczos"]))
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
    for R, L, X, v in zip(radii, r.lower, r.X, r.v):
        assert float(X.norm()) <= R
        J = dense_jacobian(layer, X)  # SDPA forward, independent of the probe's math path
        exact = spectral(J)
        assert L <= exact * (1 + 1e-12)
        assert abs(L - exact) <= 1e-9 * exact
        # the certified number is ||J v|| / ||v|| for the returned v, recomputed here from the dense J
        vv = v.reshape(-1).double()
        assert L == pytest.approx(float((vv @ J).norm() / vv.norm()), rel=1e-12)


def test_probe_on_pre_ln_block_equals_exact():
    torch.manual_seed(1)
    block = Block(8, 2, "attention", dtype=torch.float64)
    fmap = BlockMap(block, "vector_field")
    r = attention_growth(fmap, [1.0, 8.0], grid=(2, 2), restarts=3, steps=5, device="cpu")
    for L, X in zip(r.lower, r.X):
        exact = spectral(dense_jacobian(fmap, X))
        assert abs(L - exact) <= 1e-9 * exact


# ------------------------------------------------------------------------------- tangent maps, certification

def bumped(module, scale=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


@pytest.mark.parametrize("kind", ["attention", "mixer", "vector_field"])
def test_analytic_tangent_map_equals_autograd(kind):
    """The batched-matmul J V against the dense Jacobian of the module's own forward (SDPA, reverse mode)."""
    torch.manual_seed(5)
    if kind == "attention":
        layer = bumped(DenseAttention(12, 3, dtype=torch.float64))
    else:
        layer = BlockMap(bumped(Block(12, 3, "attention", dtype=torch.float64)), kind)
    H, W, C = 2, 3, 12
    T = tangent_map(layer, (H, W), device="cpu")
    X = torch.randn(3, H * W, C, dtype=torch.float64) * 3
    V = torch.randn_like(X)
    Y, JV = T(X, V)
    for s in range(3):
        y_ref = layer(X[s].reshape(1, H, W, C)).reshape(H * W, C)
        jv_ref = (V[s].reshape(-1) @ dense_jacobian(layer, X[s].reshape(H, W, C))).reshape(H * W, C)
        assert torch.allclose(Y[s], y_ref, rtol=1e-12, atol=1e-13)
        assert torch.allclose(JV[s], jv_ref, rtol=1e-11, atol=1e-12 * float(jv_ref.abs().max()))


@settings(deadline=None, max_examples=6)
@given(st.integers(0, 2 ** 16), st.sampled_from([(1e-1, 2), (1e-3, 4), (1e-8, 200)]))
def test_early_stopped_certificate_is_a_jacobian_norm_below_the_exact_one(seed, tol_steps):
    """Lanczos stopped early: the value is still ||J v|| / ||v|| at the returned input, never above
    ||J||_2 (jacrev + SVD here), and the reported residual is ||J^T J v - theta v|| / theta, theta = ||J v||^2."""
    tol, steps = tol_steps
    torch.manual_seed(seed)
    layer = bumped(DenseAttention(8, 2, dtype=torch.float64), scale=1.0, seed=seed)
    grid, radii = (2, 3), [1.0, 5.0]
    r = attention_growth(layer, radii, grid=grid, restarts=2, steps=2, refine_rounds=0, certify_tol=tol,
                         certify_steps=steps, certify_top=1, device="cpu", seed=seed)
    f = lambda z: layer(z.reshape(1, 2, 3, 8)).reshape(-1)
    for L, X, v, rel in zip(r.lower, r.X, r.v, r.tolerance):
        J = torch.func.jacrev(f)(X.reshape(-1).double()).detach()  # (out, in), independent of the probe's tangent map
        vv = v.reshape(-1).double()
        Jv = J @ vv / vv.norm()
        assert L == pytest.approx(float(Jv.norm()), rel=1e-12)
        assert L <= float(torch.linalg.svdvals(J)[0]) * (1 + 1e-12)
        theta = float(Jv @ Jv)
        u = vv / vv.norm()
        resid = float((J.T @ (J @ u) - theta * u).norm()) / theta
        assert resid == pytest.approx(rel, rel=1e-6, abs=1e-13)
        assert rel <= tol or steps < 48  # converged, or stopped by the step limit (n = 48: exact by then)


def test_batched_and_per_radius_runs_are_identical():
    torch.manual_seed(6)
    layer = bumped(DenseAttention(16, 2, dtype=torch.float64), scale=0.5)
    radii = [1.0, 4.0, 16.0, 64.0]
    kw = dict(grid=(2, 3), restarts=5, steps=6, refine_rounds=2, refine_steps=4, certify_top=2, device="cpu",
              seed=3)
    a = attention_growth(layer, radii, batch_radii=True, **kw)
    b = attention_growth(layer, radii, batch_radii=False, **kw)
    assert a.attained == b.attained and a.lower == b.lower and a.tolerance == b.tolerance
    assert torch.equal(a.X, b.X) and torch.equal(a.v, b.v)
    # without refinement (the only coupling between radii) a radius alone gets the same starts and value
    kw["refine_rounds"] = 0
    c = attention_growth(layer, radii, **kw)
    for i, R in enumerate(radii):
        d = attention_growth(layer, [R], **kw)
        assert d.attained[0] == c.attained[i]
        assert torch.equal(d.X[0], c.X[i])


class TokenAttention(torch.nn.Module):
    """A hand-written timm-style attention on (B, N, C) tokens: fused qkv, explicit softmax."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, dtype=torch.float64)
        self.proj = torch.nn.Linear(dim, dim, dtype=torch.float64)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(C // self.heads), dim=-1)
        return self.proj((a @ v).transpose(1, 2).reshape(B, N, C))


class OnGrid(torch.nn.Module):  # the wrapper of lipcheck.probe's docstring
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        B, H, W, C = x.shape
        return self.attn(x.reshape(B, H * W, C)).reshape(B, H, W, C)


def test_probe_on_a_wrapped_foreign_module_agrees_with_dense_attention():
    torch.manual_seed(7)
    ours = bumped(DenseAttention(12, 3, dtype=torch.float64), scale=0.5)
    foreign = TokenAttention(12, 3)
    with torch.no_grad():
        foreign.qkv.weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        foreign.qkv.bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        foreign.proj.weight.copy_(ours.o_proj.weight)
        foreign.proj.bias.copy_(ours.o_proj.bias)
    radii = [0.5, 4.0, 32.0]
    kw = dict(grid=(2, 2), restarts=4, steps=6, refine_rounds=1, certify_top=1, witnesses=False, device="cpu",
              seed=1)
    a = attention_growth(ours, radii, **kw)
    b = attention_growth(OnGrid(foreign), radii, dim=12, **kw)
    assert a.tangent.startswith("analytic") and b.tangent == "torch.func.jvp"
    assert a.lower == pytest.approx(b.lower, rel=1e-9)
    for L, X in zip(b.lower, b.X):  # and the foreign module's value is its own Jacobian's norm
        J = dense_jacobian(OnGrid(foreign), X)
        assert L == pytest.approx(spectral(J), rel=1e-9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_path_agrees_with_cpu():
    """Same starts (drawn on the CPU), no ascent: the tangent map and Lanczos give the same certified values."""
    torch.manual_seed(8)
    layer = DenseAttention(16, 2, dtype=torch.float64)
    kw = dict(grid=(2, 3), restarts=4, steps=0, power_warmup=0, refine_rounds=0, certify_top=1, seed=0,
              certify_tol=1e-10, certify_steps=96)
    a = attention_growth(layer, [1.0, 16.0], device="cpu", **kw)
    b = attention_growth(layer, [1.0, 16.0], device="cuda", **kw)
    assert b.device.startswith("cuda")
    assert a.lower == pytest.approx(b.lower, rel=1e-9)


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
    with pytest.raises(ValueError, match="certify_tol"):
        attention_growth(layer, [1.0], grid=(2, 2), certify_tol=0.0, device="cpu")
    with pytest.raises(ValueError, match="certify_steps"):
        attention_growth(layer, [1.0], grid=(2, 2), certify_steps=0, device="cpu")
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
