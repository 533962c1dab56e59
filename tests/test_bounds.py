"""Certified SSoG bounds (S1, S2) against dense SVDs, and vector-field bounds (S3) against Jacobian norms."""
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipcheck import SSoG
from lipcheck.bounds import spectral, ssog_lipschitz, vector_field_lipschitz
from lipcheck.models.vit import Block

F64 = torch.float64
REL = 1e-9


def random_layer(seed, heads, comps, head_dim, mu_scale=6.0, log_sigma=(-2.5, 2.0)):
    """A fixed-kernel SSoG with mixed-sign alpha, wide offsets and widths, O(1) weights."""
    g = torch.Generator().manual_seed(seed)
    layer = SSoG(heads * head_dim, heads, comps, dtype=F64)
    u = lambda *s: torch.rand(*s, generator=g, dtype=F64)
    alpha = (2 * u(heads, comps) - 1) * 2
    mu = (2 * u(heads, comps, 2) - 1) * mu_scale
    sigma = torch.exp(log_sigma[0] + (log_sigma[1] - log_sigma[0]) * u(heads, comps, 2)) + 2e-3
    layer.set_gaussian_params(alpha, mu, sigma)
    with torch.no_grad():
        layer.v_proj.weight.copy_(torch.randn(layer.dim, layer.dim, generator=g, dtype=F64))
        layer.o_proj.weight.copy_(torch.randn(layer.dim, layer.dim, generator=g, dtype=F64))
        layer.o_proj.bias.copy_(torch.randn(layer.dim, generator=g, dtype=F64))
    return layer.freeze_kernels()


def le(a, b):
    return a <= b * (1 + REL) + 1e-300


layers = st.builds(lambda seed, h, M, d, H, W: (seed, h, M, d, H, W),
                   st.integers(0, 10 ** 6), st.integers(1, 4), st.integers(1, 4), st.integers(1, 2),
                   st.integers(1, 12), st.integers(1, 12)).filter(lambda c: c[4] * c[5] * c[1] * c[3] <= 600)


@settings(deadline=None, max_examples=8, suppress_health_check=[HealthCheck.too_slow])
@given(layers)
def test_sandwich_on_random_layers(cfg):
    """Must-show 1: lower <= exact <= upper <= resolution_free <= closed_form, and ||f(X)-f(Y)|| <= upper ||X-Y||."""
    seed, h, M, d, H, W = cfg
    layer = random_layer(seed, h, M, d)
    r = ssog_lipschitz(layer, H, W, rf_rtol=1e-2, max_steps=200)
    assert r.exact is not None
    assert le(r.lower, r.exact) and le(r.exact, r.upper)
    assert le(r.upper, r.resolution_free) and le(r.resolution_free, r.closed_form)
    assert le(r.exact, r.circulant) and le(r.exact, r.upper_probabilistic)
    # the Lipschitz inequality on random and worst-case pairs, through the module itself (bias included)
    g = torch.Generator().manual_seed(seed + 1)
    C = layer.dim
    X = torch.randn(3, H, W, C, generator=g, dtype=F64)
    Y = torch.randn(3, H, W, C, generator=g, dtype=F64)
    eps = torch.finfo(F64).eps

    def diff(a, b):
        # ||f(a) - f(b)|| and the rounding in it: the difference of two outputs carries an absolute
        # error ~ eps (||f(a)|| + ||f(b)||), which dominates when the operator norm is tiny.
        fa, fb = layer(a), layer(b)
        return float((fa - fb).norm()), 64 * eps * float(fa.norm() + fb.norm())

    with torch.no_grad():
        for i in range(3):
            lhs, err = diff(X[i:i + 1], Y[i:i + 1])
            assert le(lhs - err, r.upper * float((X[i] - Y[i]).norm()))
        T = spectral.dense_operator(spectral.ssog_params(layer), H, W)
        v = torch.linalg.svd(T).Vh[0].reshape(1, H, W, C)  # worst-case direction
        lhs, err = diff(X[:1] + v, X[:1])
        assert le(lhs - err, r.upper * float(v.norm()))
        assert lhs == pytest.approx(r.exact, rel=1e-9, abs=err)


@pytest.mark.parametrize("seed,h,M,d,H,W", [(1, 3, 4, 2, 10, 10), (2, 2, 3, 4, 9, 11), (3, 4, 2, 1, 12, 10)])
def test_gap_when_dense_fits(seed, h, M, d, H, W):
    """Must-show 2: N*C <= 4096 gives (upper - lower) / lower <= 1e-6 (Gram iteration meets Lanczos)."""
    layer = random_layer(seed, h, M, d)
    r = ssog_lipschitz(layer, H, W, rf_rtol=1e-3, max_steps=600, target_gap=1e-7)
    assert H * W * layer.dim <= 4096
    assert r.gap <= 1e-6, (r.lower, r.upper, r.method)
    assert r.lower <= r.exact * (1 + REL) <= r.upper * (1 + 2 * REL)


def test_default_settings_close_the_gap_up_to_exact_max():
    """With default arguments, 1536 < N*C <= 4096 (past Gram iteration's size) still meets the 1e-6 gap:
    the dense SVD with its rounding margin is the upper bound there, and Lanczos runs until it meets it."""
    layer = random_layer(4, 3, 4, 16)
    r = ssog_lipschitz(layer, 8, 8, rf_rtol=1e-3)
    assert 1536 < 8 * 8 * layer.dim <= 4096 and r.gram is None
    assert r.gap <= 1e-6, (r.lower, r.exact, r.upper)
    assert r.lower <= r.exact * (1 + REL) <= r.upper * (1 + 2 * REL)


def test_circulant_bound_is_the_dense_embedding_norm():
    """The circulant bound equals the norm of the explicitly built (2H-1) x (2W-1) block-circulant embedding."""
    layer = random_layer(7, 2, 3, 2)
    p = spectral.ssog_params(layer)
    H, W = 4, 5
    Ly, Lx = 2 * H - 1, 2 * W - 1
    K = torch.zeros(p.num_heads, Ly * Lx, Ly * Lx, dtype=F64)
    from lipcheck import gaussian
    for a in range(Ly):
        for b in range(Lx):
            for c in range(Ly):
                for e in range(Lx):
                    ky = (a - c + Ly // 2) % Ly - Ly // 2  # wrap offsets into -(H-1)..(H-1)
                    kx = (b - e + Lx // 2) % Lx - Lx // 2
                    gy = gaussian.kernel(torch.tensor(float(ky), dtype=F64), p.mu[..., 0], p.sigma[..., 0])
                    gx = gaussian.kernel(torch.tensor(float(kx), dtype=F64), p.mu[..., 1], p.sigma[..., 1])
                    K[:, a * Lx + b, c * Lx + e] = (p.alpha * gy * gx).sum(-1)
    P = p.head_projections()
    big = torch.einsum("hab,hdc->acbd", K, P).reshape(Ly * Lx * p.dim, -1)
    # T is a compression of the embedding: check the index embedding reproduces T
    idx = torch.tensor([i * Lx + j for i in range(H) for j in range(W)])
    sel = (idx[:, None] * p.dim + torch.arange(p.dim)[None]).reshape(-1)
    assert torch.allclose(big[sel][:, sel], spectral.dense_operator(p, H, W), atol=1e-12)
    circ = spectral.circulant_bound(p, H, W)
    assert circ.upper == pytest.approx(float(torch.linalg.matrix_norm(big, ord=2)), rel=1e-9)


def test_resolution_free_brackets_a_fine_grid_and_szego():
    """S1/S2: the certified sup is >= ||S(w)|| on a fine grid (brute force), and ||T_n|| increases to it."""
    layer = random_layer(11, 2, 2, 2, mu_scale=2.0, log_sigma=(-0.5, 1.0))
    p = spectral.ssog_params(layer)
    rf, info = spectral.resolution_free_bound(p, rtol=1e-6)
    wy = torch.linspace(-math.pi, math.pi, 101, dtype=F64)
    grid = torch.stack(torch.meshgrid(wy, wy, indexing="ij"), -1).reshape(-1, 2)
    c = spectral.symbol_coefficients(p, grid[:, 0], grid[:, 1])
    brute = float(torch.linalg.matrix_norm(spectral.SymbolNorm(p).matrix(c), ord=2).max())
    assert brute <= rf.upper * (1 + REL)
    assert rf.upper <= rf.lower * (1 + 2e-6) and rf.lower >= brute * (1 - 1e-3)
    norms = [float(torch.linalg.matrix_norm(spectral.dense_operator(p, n, n), ord=2)) for n in (2, 4, 8, 14)]
    assert all(a <= b * (1 + REL) for a, b in zip(norms, norms[1:]))  # sections of one Toeplitz operator
    assert norms[-1] <= rf.upper * (1 + REL) and norms[-1] >= 0.9 * rf.upper


def test_adjoint_and_fast_operator_match_dense():
    layer = random_layer(5, 3, 2, 2)
    p = spectral.ssog_params(layer)
    T = spectral.dense_operator(p, 5, 6)
    X = torch.randn(1, 5, 6, p.dim, dtype=F64)
    assert torch.allclose(spectral.apply_T(X, p).reshape(-1), T @ X.reshape(-1), atol=1e-12)
    assert torch.allclose(spectral.apply_T_adjoint(X, p).reshape(-1), T.T @ X.reshape(-1), atol=1e-12)


def test_lanczos_and_kw_epsilon():
    g = torch.Generator().manual_seed(0)
    B = torch.randn(60, 60, generator=g, dtype=F64)
    A = B.T @ B
    theta, v, k = spectral.lanczos(lambda x: A @ x, torch.randn(60, generator=g, dtype=F64), 60)
    assert theta == pytest.approx(float(torch.linalg.eigvalsh(A)[-1]), rel=1e-10)
    # KW: failure probability 1.648 sqrt(n) exp(-sqrt(eps)(2q - 1)) equals the requested one at eps
    eps = spectral.kw_epsilon(10 ** 5, 200, 1e-6)
    assert 1.648 * math.sqrt(1e5) * math.exp(-math.sqrt(eps) * 399) == pytest.approx(1e-6, rel=1e-9)


def test_bad_inputs_and_no_exact_for_large_grids():
    layer = random_layer(3, 1, 1, 2)
    with torch.no_grad():
        layer.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        ssog_lipschitz(layer, 4, 4)
    layer = random_layer(3, 1, 2, 2, log_sigma=(0.0, 1.0))
    with pytest.raises(ValueError, match="H must be a positive integer"):
        ssog_lipschitz(layer, 0, 4)
    r = ssog_lipschitz(layer, 60, 60, max_steps=20, rf_rtol=1e-3)  # N*C = 7200 > exact_max
    assert r.exact is None and "exact_max" in r.exact_reason
    assert r.lower <= r.upper * (1 + REL)


# ------------------------------------------------------------------ S3: the vector field


def jacobian_norm(f, x, iters=25, seed=0):
    """Power iteration on J^T J at x (jvp + vjp): an actual lower value of ||J_f(x)||_2."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(x.shape, generator=g, dtype=x.dtype)
    v /= v.norm()
    s = 0.0
    for _ in range(iters):
        _, Jv = torch.func.jvp(f, (x,), (v,))
        _, vjp = torch.func.vjp(f, x)
        (w,) = vjp(Jv)
        s = float(Jv.detach().norm())
        if float(w.norm()) == 0.0:  # J = 0 (e.g. LayerNorm over one channel)
            return s
        v = w / w.norm()
    return s


blocks = st.builds(lambda seed, h, d, use_norm, use_mlp, H, W: (seed, h, d, use_norm, use_mlp, H, W),
                   st.integers(0, 10 ** 6), st.integers(1, 3), st.integers(1, 3), st.booleans(), st.booleans(),
                   st.integers(1, 4), st.integers(1, 4))


def random_block(seed, h, d, use_norm, use_mlp):
    torch.manual_seed(seed)
    blk = Block(h * d, h, "ssog", num_components=2, use_norm=use_norm, use_mlp=use_mlp, dtype=F64)
    with torch.no_grad():
        for prm in blk.parameters():
            prm.normal_(0, 0.7)
        blk.mixer.set_gaussian_params(sigma=torch.rand(h, 2, 2, dtype=F64) * 2 + 0.2)
    return blk


@settings(deadline=None, max_examples=5, suppress_health_check=[HealthCheck.too_slow])
@given(blocks)
def test_vector_field_bounds_dominate_jacobians(cfg):
    """Must-show 4: global and local bounds >= ||J_F|| by power iteration, at random and adversarial states."""
    seed, h, d, use_norm, use_mlp, H, W = cfg
    blk = random_block(seed, h, d, use_norm, use_mlp)
    C = h * d
    g = torch.Generator().manual_seed(seed)
    x_rand = torch.randn(1, H, W, C, generator=g, dtype=F64) * 3
    # adversarial: nearly constant tokens (variance ~1e-7) make LayerNorm's Jacobian ~ 1/sqrt(var + eps)
    x_adv = 5 + 3e-4 * torch.randn(1, H, W, C, generator=g, dtype=F64)
    b = vector_field_lipschitz(blk, x_rand, rtol=1e-2)
    f = blk.vector_field
    for x in (x_rand, x_adv):
        assert jacobian_norm(f, x) <= b.global_bound * (1 + 1e-7)
    assert jacobian_norm(f, x_rand) <= b.local_bound * (1 + 1e-7)
    if use_norm:
        assert b.ln1_global == pytest.approx(float(blk.norm1.weight.detach().abs().max()) / math.sqrt(1e-6))
        # adversarial state is near the global constant's regime: the local bound there is large
        b_adv = vector_field_lipschitz(blk, x_adv, mixer_bound=(b.mixer, b.terms['mixer_terms']))
        assert jacobian_norm(f, x_adv) <= b_adv.local_bound * (1 + 1e-7)
    else:
        assert b.global_bound == pytest.approx(b.local_bound)


def test_vector_field_of_ode_vit_and_attention():
    from lipcheck import vit_from_preset
    m = vit_from_preset("tiny", "ode", "ssog", dtype=F64)
    x0 = m.embed(torch.randn(2, 3, 32, 32, dtype=F64))
    b = vector_field_lipschitz(m, x0, rtol=1e-2)
    assert b.local_bound < b.global_bound
    assert b.terms["min_variance"] == pytest.approx(float(x0.var(-1, unbiased=False).min()))
    jn = jacobian_norm(lambda x: m.vector_field(0.0, x), x0[:1])
    assert jn <= b.local_bound
    with pytest.raises(ValueError, match="non-finite"):
        vector_field_lipschitz(m, x0 * float("nan"))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LIPCHECK_SLOW"), reason="slow: set LIPCHECK_SLOW=1")
def test_vector_field_with_attention_mixer():
    from lipcheck import vit_from_preset
    ma = vit_from_preset("tiny", "ode", "attention", dtype=F64, attn_backend="math")  # forward AD
    xa = ma.embed(torch.randn(1, 3, 32, 32, dtype=F64))
    ba = vector_field_lipschitz(ma, xa)
    assert jacobian_norm(lambda x: ma.vector_field(0.0, x), xa) <= ba.local_bound
