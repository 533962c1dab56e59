"""Every SSoG backend equals the dense reference K_h = sum_m alpha G_H kron G_W (operator_matrices),
forward and backward, in float64; the truncation bound holds; the cost model picks its argmin."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lipcheck import gaussian
from lipcheck.mixers import ssog
from lipcheck.mixers.backends import stacked
from lipcheck.mixers.ssog import (BACKENDS, SSoG, backend_costs, choose_backend, fft_size, operator_matrices,
                                  ssog_mix, truncation_radius)

F64 = torch.float64
TOL = 1e-10


def dense_mix(v, alpha, mu, sigma):
    """Reference: out[b, :, :, h] = K_h v[b, :, :, h] with the dense (h, N, N) operator."""
    B, H, W, h, d = v.shape
    K = operator_matrices(H, W, alpha, mu, sigma)
    return torch.einsum("hnk,bkhd->bnhd", K, v.reshape(B, H * W, h, d)).reshape(B, H, W, h, d)


def random_params(g, h, M, *, mu_scale=4.0, sigma_lo=0.05, sigma_hi=12.0):
    alpha = torch.randn(h, M, dtype=F64, generator=g)  # negative weights included
    mu = (torch.rand(h, M, 2, dtype=F64, generator=g) * 2 - 1) * mu_scale  # non-integer offsets
    sigma = sigma_lo * (sigma_hi / sigma_lo) ** torch.rand(h, M, 2, dtype=F64, generator=g)
    return alpha, mu, sigma


def grads(fn, v, alpha, mu, sigma, R):
    leaves = [t.clone().requires_grad_(True) for t in (v, alpha, mu, sigma)]
    (fn(*leaves) * R).sum().backward()
    return [t.grad for t in leaves]


@settings(deadline=None, max_examples=12)
@given(H=st.integers(1, 9), W=st.integers(1, 9), h=st.integers(1, 3), M=st.integers(1, 3), d=st.integers(1, 3),
       B=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_backends_equal_dense_forward_and_backward(H, W, h, M, d, B, seed):
    g = torch.Generator().manual_seed(seed)
    alpha, mu, sigma = random_params(g, h, M)
    v = torch.randn(B, H, W, h, d, dtype=F64, generator=g)
    R = torch.randn(B, H, W, h, d, dtype=F64, generator=g)
    ref = dense_mix(v, alpha, mu, sigma)
    ref_grads = grads(dense_mix, v, alpha, mu, sigma, R)
    scale = max(1.0, float(ref.abs().max()))
    fuse, chunk = stacked.FUSE_HEADS_TOKENS, stacked.STACKED_CHUNK_BYTES
    per_element = H * W * M * d * v.element_size()  # bytes of one batch element's intermediate, per head
    # the stacked backend per head (whole batch, chunks of one and of two batch elements) and all heads in one call
    variants = [(n, fuse, chunk) for n in BACKENDS] + [("stacked", 0, 10**12), ("stacked", 0, 1),
                                                        ("stacked", 0, 2 * per_element), ("stacked", 10**9, chunk)]
    try:
        for name, fuse_tokens, chunk_bytes in variants:
            stacked.FUSE_HEADS_TOKENS, stacked.STACKED_CHUNK_BYTES = fuse_tokens, chunk_bytes
            fn = lambda *a, name=name: ssog_mix(*a, backend=name)
            out = fn(v, alpha, mu, sigma)
            assert out.shape == ref.shape
            assert (out - ref).abs().max() <= TOL * scale, (name, fuse_tokens, chunk_bytes)
            for which, gb, gr in zip(("x", "alpha", "mu", "sigma"), grads(fn, v, alpha, mu, sigma, R), ref_grads):
                assert (gb - gr).abs().max() <= TOL * max(1.0, float(gr.abs().max())), (name, which, fuse_tokens)
    finally:
        stacked.FUSE_HEADS_TOKENS, stacked.STACKED_CHUNK_BYTES = fuse, chunk


@settings(deadline=None, max_examples=12)
@given(H=st.integers(1, 9), W=st.integers(1, 9), h=st.integers(1, 3), M=st.integers(1, 3), d=st.integers(1, 3),
       B=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_stacked_transposed_layout_equals_dense(H, W, h, M, d, B, seed):
    """The x-outermost layout of the stacked products (inference with several threads, mid-sized problems)
    equals the dense operator, and `_apply_stacked` takes it exactly there: no autograd, more than one
    thread, FUSE_HEADS_TOKENS < B H W <= TRANSPOSED_MAX_TOKENS."""
    g = torch.Generator().manual_seed(seed)
    alpha, mu, sigma = random_params(g, h, M)
    v = torch.randn(B, H, W, h, d, dtype=F64, generator=g)
    ref = dense_mix(v, alpha, mu, sigma)
    GW, GH = ssog._prepare_stacked(H, W, alpha, mu, sigma, *ssog._axis_taps(H, W, mu, sigma))
    scale = max(1.0, float(ref.abs().max()))
    for _ in range(2):  # the second call reads the reordered factors kept on GW
        assert (stacked._stacked_transposed(v, GW, GH) - ref).abs().max() <= TOL * scale
    # the same GW with another GH (alpha doubled) must not be served the reordered factors of the first
    assert (stacked._stacked_transposed(v, GW, 2 * GH) - 2 * ref).abs().max() <= 2 * TOL * scale
    taken, n = [], B * H * W
    saved = stacked._stacked_transposed, stacked.FUSE_HEADS_TOKENS, stacked.TRANSPOSED_MAX_TOKENS, torch.get_num_threads()
    stacked._stacked_transposed = lambda *a: taken.append(1) or saved[0](*a)
    stacked.FUSE_HEADS_TOKENS = n - 1
    try:
        for threads, limit, grad, expect in [(2, n, False, 1), (1, n, False, 0), (2, n - 1, False, 0), (2, n, True, 0)]:
            torch.set_num_threads(threads)
            stacked.TRANSPOSED_MAX_TOKENS = limit
            taken.clear()
            out = ssog._apply_stacked(v.clone().requires_grad_(grad), GW, GH)
            assert len(taken) == expect, (threads, limit, grad)
            assert (out - ref).abs().max() <= TOL * scale
    finally:
        stacked._stacked_transposed, stacked.FUSE_HEADS_TOKENS, stacked.TRANSPOSED_MAX_TOKENS = saved[:3]
        torch.set_num_threads(saved[3])


@settings(deadline=None, max_examples=12)
@given(H=st.integers(1, 9), W=st.integers(1, 17), h=st.integers(1, 3), M=st.integers(1, 3), d=st.integers(1, 3),
       blocks=st.sampled_from([1, 2, 3, 4, 8]), seed=st.integers(0, 2**31 - 1))
def test_stacked_column_blocks_equal_dense(H, W, h, M, d, blocks, seed):
    """The batch-1 layout with the y axis in blocks of columns (inference with several threads, large grids)
    equals the dense operator for every number of blocks (gcd(W, blocks): one block, several, one per x
    coordinate), and `_apply_stacked` takes it exactly there: batch 1, no autograd, more than one thread,
    B H W > TRANSPOSED_MAX_TOKENS."""
    g = torch.Generator().manual_seed(seed)
    alpha, mu, sigma = random_params(g, h, M)
    v = torch.randn(2, H, W, h, d, dtype=F64, generator=g)
    ref = dense_mix(v, alpha, mu, sigma)
    GW, GH = ssog._prepare_stacked(H, W, alpha, mu, sigma, *ssog._axis_taps(H, W, mu, sigma))
    scale = max(1.0, float(ref.abs().max()))
    taken, n = [], H * W
    saved = (stacked._stacked_column_blocks, stacked.FUSE_HEADS_TOKENS, stacked.TRANSPOSED_MAX_TOKENS, stacked.Y_COLUMN_BLOCKS,
             torch.get_num_threads())
    stacked.Y_COLUMN_BLOCKS = blocks
    try:
        for b in range(2):
            out = stacked._stacked_column_blocks(v[b:b + 1], GW, GH)
            assert out.shape == (1, H, W, h, d)
            assert (out - ref[b:b + 1]).abs().max() <= TOL * scale
        stacked._stacked_column_blocks = lambda *a: taken.append(1) or saved[0](*a)
        stacked.FUSE_HEADS_TOKENS = 0
        for threads, limit, batch, grad, expect in [(2, n - 1, 1, False, 1), (1, n - 1, 1, False, 0),
                                                    (2, n, 1, False, 0), (2, n - 1, 2, False, 0),
                                                    (2, n - 1, 1, True, 0)]:
            torch.set_num_threads(threads)
            stacked.TRANSPOSED_MAX_TOKENS = limit
            taken.clear()
            out = ssog._apply_stacked(v[:batch].clone().requires_grad_(grad), GW, GH)
            assert len(taken) == expect, (threads, limit, batch, grad)
            assert (out - ref[:batch]).abs().max() <= TOL * scale
    finally:
        (stacked._stacked_column_blocks, stacked.FUSE_HEADS_TOKENS, stacked.TRANSPOSED_MAX_TOKENS,
         stacked.Y_COLUMN_BLOCKS) = saved[:4]
        torch.set_num_threads(saved[4])


def test_derived_factors_with_a_graph_are_built_afresh():
    """Repeated and reordered forms of a factor are kept on an inference factor, but a factor with a graph (a
    parameter-like tensor, which an optimizer step changes in place) gets new ones at every call: a kept form
    would carry the old values."""
    g = torch.Generator().manual_seed(5)
    alpha, mu, sigma = random_params(g, 2, 2)
    GW, GH = ssog._prepare_stacked(3, 4, alpha, mu, sigma, *ssog._axis_taps(3, 4, mu, sigma))
    for G in (GW, GH):
        G = G.clone().requires_grad_(True)
        for _ in range(2):  # the second backward fails if the first call's form is served again
            ssog._repeated(G, 3).square().sum().backward()
        assert torch.allclose(G.grad, 2 * 2 * 3 * G.detach())  # d/dG sum (G repeated 3x)^2, twice
        with torch.no_grad():
            G.mul_(-2.0)  # an in-place update, as an optimizer step makes
        assert torch.equal(ssog._repeated(G, 3).detach(), G.detach().repeat_interleave(3, 0))
    GW, GH = GW.clone().requires_grad_(True), GH.clone().requires_grad_(True)
    for _ in range(2):
        sum(t.square().sum() for t in ssog._transposed_factors(GW, GH, 3, 4)).backward()
    assert torch.allclose(GW.grad, 2 * 2 * GW.detach()) and torch.allclose(GH.grad, 2 * 2 * 4 * GH.detach())
    with torch.no_grad():
        GW.mul_(-2.0), GH.mul_(-2.0)
    fresh = ssog._transposed_factors(GW.detach().clone(), GH.detach().clone(), 3, 4)
    assert all(torch.equal(a.detach(), b) for a, b in zip(ssog._transposed_factors(GW, GH, 3, 4), fresh))
    kept = GW.detach()
    assert ssog._repeated(kept, 3) is ssog._repeated(kept, 3)  # without a graph: kept


def test_transposed_layout_factors_follow_the_kernels():
    """A module in inference on the transposed layout (two threads, 3 x 5 grid at batch 2): equal to its
    dense operator before and after its kernels change in place and through set_gaussian_params."""
    torch.manual_seed(0)
    layer = SSoG(6, 2, 2, backend="stacked", dtype=F64).eval()
    layer.thread_policy = None
    x = torch.randn(2, 3, 5, 6, dtype=F64)
    threads, fuse = torch.get_num_threads(), stacked.FUSE_HEADS_TOKENS
    try:
        torch.set_num_threads(2)
        stacked.FUSE_HEADS_TOKENS = 0
        for change in (None, "in place", "setter"):
            with torch.no_grad():
                if change == "in place":
                    layer.mu.add_(0.37)
                elif change == "setter":
                    layer.set_gaussian_params(sigma=torch.full((2, 2, 2), 1.7, dtype=F64))
                K, P = layer.operator_matrix(3, 5), layer.head_projections()
                ref = torch.einsum("hnk,bkc,hcf->bnf", K, x.reshape(2, 15, 6), P) + layer.o_proj.bias
                for _ in range(2):
                    out = layer(x).reshape(2, 15, 6)
                    assert (out - ref).abs().max() <= TOL * max(1.0, float(ref.abs().max())), change
    finally:
        torch.set_num_threads(threads)
        stacked.FUSE_HEADS_TOKENS = fuse


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_backend_gradients_match_finite_differences(backend):
    g = torch.Generator().manual_seed(3)
    alpha, mu, sigma = random_params(g, 2, 2, sigma_lo=0.3, sigma_hi=5.0)
    v = torch.randn(1, 4, 5, 2, 2, dtype=F64, generator=g)
    inputs = tuple(t.clone().requires_grad_(True) for t in (v, alpha, mu, sigma))
    assert torch.autograd.gradcheck(lambda *a: ssog_mix(*a, backend=backend), inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", sorted(BACKENDS) + ["auto"])
def test_module_equals_sum_of_heads_with_projections(backend):
    """SSoG(X) = sum_h K_h X P_h + b with P_h = head_projections(), on a non-square grid."""
    torch.manual_seed(0)
    layer = SSoG(12, 3, 2, backend=backend, dtype=F64)
    g = torch.Generator().manual_seed(1)
    alpha, mu, sigma = random_params(g, 3, 2, sigma_lo=0.2, sigma_hi=9.0)
    layer.set_gaussian_params(alpha, mu, sigma)
    H, W = 5, 8
    X = torch.randn(2, H, W, 12, dtype=F64)
    K, P = layer.operator_matrix(H, W), layer.head_projections()
    ref = torch.einsum("hnk,bkc,hcf->bnf", K, X.reshape(2, H * W, 12), P) + layer.o_proj.bias
    out = layer(X).reshape(2, H * W, 12)
    assert (out - ref).abs().max() <= TOL * max(1.0, float(ref.detach().abs().max()))


def test_taps_are_the_axis_matrix_entries():
    """The fast backends read the same g as gaussian.axis_matrix: identical numbers, only arranged."""
    g = torch.Generator().manual_seed(5)
    _, mu, sigma = random_params(g, 2, 3)
    for n in (1, 2, 7):
        A = gaussian.axis_matrix(n, mu[..., 0], sigma[..., 0])
        T = ssog._toeplitz(n, mu[..., 0], sigma[..., 0])
        assert torch.equal(torch.where(A < torch.finfo(F64).tiny, torch.zeros_like(A), A), T)


def test_truncation_radius_reaches_the_grid_for_wide_kernels():
    """Width large relative to the grid: the radius is capped at n - 1 and the cut is exact."""
    mu = torch.tensor([[0.3]], dtype=F64)
    sigma = torch.tensor([[20.0]], dtype=F64)
    assert truncation_radius(16, mu, sigma, 1e-16) == 15
    v = torch.randn(1, 16, 16, 1, 2, dtype=F64)
    alpha = torch.tensor([[1.0]], dtype=F64)
    mu2, sigma2 = mu[..., None].expand(1, 1, 2), sigma[..., None].expand(1, 1, 2)
    assert (ssog_mix(v, alpha, mu2, sigma2, "truncated") - dense_mix(v, alpha, mu2, sigma2)).abs().max() < 1e-13


@pytest.mark.parametrize("tol", [1e-4, 1e-8, 1e-16])
def test_truncation_dropped_mass_below_tol(tol):
    """The dropped mass beyond the radius, summed far out, is at most tol (the bound in truncation_radius)."""
    g = torch.Generator().manual_seed(11)
    _, mu, sigma = random_params(g, 4, 4, mu_scale=3.0, sigma_lo=0.01, sigma_hi=6.0)
    for m_, s_ in zip(mu[..., 0].flatten(), sigma.flatten()[:16]):
        r = truncation_radius(10_000, m_.reshape(1), s_.reshape(1), tol)
        assert r < 10_000 - 1
        k = torch.arange(-r - 400, r + 401, dtype=F64)
        gk = gaussian.kernel(k, m_, s_)
        dropped = float(gk[(k.abs() > r)].sum())
        assert dropped <= tol, (float(m_), float(s_), r, dropped)


def test_truncated_backend_error_within_stated_bound():
    """With a loose tol the cut is visible, and the error stays inside sum_m |alpha| (2 tol + tol^2) max|v|."""
    tol = 1e-4
    g = torch.Generator().manual_seed(2)
    alpha, mu, sigma = random_params(g, 2, 3, mu_scale=2.0, sigma_lo=0.5, sigma_hi=2.0)
    H, W = 40, 33
    v = torch.randn(1, H, W, 2, 3, dtype=F64, generator=g)
    ry = max(truncation_radius(H, mu[:, m, 0], sigma[:, m, 0], tol) for m in range(3))
    assert ry < H - 1  # a real cut happens on this grid
    out = BACKENDS["truncated"](v, alpha, mu, sigma, tol=tol)
    err = (out - dense_mix(v, alpha, mu, sigma)).abs().amax(dim=(0, 1, 2, 4))  # per head
    bound = alpha.abs().sum(1) * (2 * tol + tol**2) * v.abs().max()
    assert (err <= bound).all()
    assert float(err.max()) > 0


def test_fft_size_is_the_smallest_5_smooth_length():
    def smooth(m):
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        return m == 1
    for n in range(1, 80):
        L = fft_size(n)
        assert L >= 2 * n - 1 and smooth(L)
        assert not any(smooth(m) for m in range(2 * n - 1, L))


def test_cost_model_is_the_argmin_and_follows_sigma():
    g = torch.Generator().manual_seed(0)
    alpha, mu, _ = random_params(g, 3, 4, mu_scale=1.0)
    narrow = torch.full((3, 4, 2), 0.6, dtype=F64)
    wide = torch.full((3, 4, 2), 4.0, dtype=F64)
    for sigma in (narrow, wide):
        for n in (8, 64, 256):
            costs = backend_costs(n, n, alpha, mu, sigma)
            assert choose_backend(n, n, alpha, mu, sigma) == min(costs, key=costs.get)
            # the stacked cost is the dense-factor multiply-add count per channel
            assert costs["stacked"] == ssog.COST_WEIGHTS["stacked"] * 4 * n * n * (2 * n)
    assert choose_backend(14, 14, alpha, mu, wide) == "stacked"  # small grid: dense GEMMs
    assert choose_backend(256, 256, alpha, mu, narrow) == "truncated"  # large grid, narrow kernels


def test_unknown_backend_is_a_clear_error():
    v = torch.zeros(1, 2, 2, 1, 1)
    p = (torch.ones(1, 1), torch.zeros(1, 1, 2), torch.ones(1, 1, 2))
    with pytest.raises(ValueError, match="unknown SSoG backend 'nope'"):
        ssog_mix(v, *p, backend="nope")
    with pytest.raises(ValueError, match="unknown SSoG backend"):
        SSoG(8, 2, backend="nope")
    with pytest.raises(ValueError, match="tol"):
        truncation_radius(4, p[1][..., 0], p[2][..., 0], 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["stacked", "truncated", "fft"])
def test_module_tap_floor_drops_at_most_half_the_tolerance(dtype, backend):
    """The SSoG module keeps no tap below tap_floor (whose products with ordinary values would be subnormal)
    and drops at most truncation_tol / 2 of each component's mass per axis (taps summed in float64 from
    gaussian.kernel); its output stays within the truncated backend's error statement of the dense operator."""
    g = torch.Generator().manual_seed(9)
    alpha, mu, sigma = random_params(g, 3, 4, mu_scale=6.0, sigma_lo=0.3, sigma_hi=9.0)
    H, W = 30, 21
    layer = SSoG(6, 3, 4, backend=backend, dtype=dtype)
    layer.set_gaussian_params(alpha.to(dtype), mu.to(dtype), sigma.to(dtype))
    x = torch.randn(2, H, W, 6, dtype=dtype, generator=g)
    with torch.no_grad():
        out = layer(x)
    entry = next(iter(layer._kernel_cache.values()))
    taps = entry["taps"].double()  # (h, M, 2, 2 r + 1), offsets -r..r with r = max(H, W) - 1
    floor = ssog.tap_floor(max(H, W), dtype)
    assert floor == ssog.truncation_tol(dtype) / (2 * (2 * max(H, W) - 1))
    assert bool(((taps == 0) | (taps >= floor)).all())
    r = max(H, W) - 1
    k = torch.arange(-r, r + 1, dtype=F64)
    a, m64, s64 = (t.detach().double() for t in layer.gaussian_params())
    exact = gaussian.kernel(k, m64[..., None], s64[..., None])
    dropped = (exact * (taps == 0)).sum(-1)
    assert float(dropped.max()) <= ssog.truncation_tol(dtype) / 2
    assert float(dropped.max()) > 0  # the floor does cut something here
    tol = ssog.truncation_tol(dtype) * (1.5 if backend == "truncated" else 0.5)
    with torch.no_grad():
        v = layer.v_proj(x).double().reshape(2, H, W, 3, 2)
        mixed = dense_mix(v, a, m64, s64)
        scale = (a.abs().sum(1) * (2 * tol + tol**2))[None, None, None, :, None] * v.abs().amax(dim=(1, 2), keepdim=True)
        got = layer.mix_values(v.to(dtype)).double()
    rounding = 64 * gaussian.unit_roundoff(dtype) * (H + W) * float(a.abs().sum(1).max()) * float(v.abs().max())
    assert bool(((got - mixed).abs() <= scale + rounding).all())
    assert torch.isfinite(out).all()
