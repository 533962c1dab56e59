"""Theorem D4's X through the heads' rank (lipcheck.bounds.gram_heads) against X computed here from the dense T of
the SPEC definition: X = Qk^T M (I - Qk Qk^T) M Qk with M = T^T T and Qk = Q kron I_C."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipcheck.bounds import deflation as df
from lipcheck.bounds import deflation_plan as dp
from lipcheck.bounds import gram_heads as gh
from lipcheck.bounds.approx import _Approx
from test_majorant import axis, dense_T, params, random_layer


def kernels(alpha, mu, sigma, H, W):
    """K_h (N x N) from the SPEC definition, per head."""
    h, M = alpha.shape
    return [sum(alpha[i, m] * np.kron(axis(H, mu[i, m, 0], sigma[i, m, 0]), axis(W, mu[i, m, 1], sigma[i, m, 1]))
                for m in range(M)) for i in range(h)]


def exact_X(layer, H, W, Q):
    """Qk^T M (I - Qk Qk^T) M Qk in the coordinates (token function, channel), from the dense T."""
    T = dense_T(*layer, H, W)
    C = T.shape[0] // (H * W)
    Qk = np.kron(Q, np.eye(C))
    MQ = T.T @ (T @ Qk)
    R = MQ - Qk @ (Qk.T @ MQ)
    return R.T @ R


def token_parts(layer, H, W, Q):
    """W_hg = (I - Q Q^T) K_h^T K_g Q from the dense K_h, pairs (h, g) in the order h * heads + g."""
    K = kernels(*layer[:3], H, W)
    P = np.eye(H * W) - Q @ Q.T
    return [P @ K[a].T @ K[b] @ Q for a in range(len(K)) for b in range(len(K))]


def orthonormal(rng, N, k):
    return np.linalg.qr(rng.standard_normal((N, k)))[0]


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(heads=st.integers(1, 4), d=st.integers(1, 3), H=st.integers(2, 5), W=st.integers(1, 5),
       k=st.integers(1, 4), seed=st.integers(0, 10 ** 6))
def test_coupling_gram_equals_the_dense_X_within_its_bound(heads, d, H, W, k, seed):
    """Through the heads' rank, X is the dense X (within its certified error), and that error is small (1e-9 of
    ||X||); term by term (deflation._gram_kron) gives the same matrix."""
    rng = np.random.default_rng(seed)
    layer = random_layer(rng, heads, 2, d, 2.0, 3.0)
    k = min(k, H * W - 1) if H * W > 1 else 1
    Q = orthonormal(rng, H * W, k)
    Wm = [_Approx(torch.tensor(w), 0.0) for w in token_parts(layer, H, W, Q)]
    Xh = gh.coupling_gram(params(*layer), Wm)
    Xe = exact_X(layer, H, W, Q)
    scale = max(np.linalg.norm(Xe, 2), 1e-300)
    assert np.linalg.norm(Xh.val.numpy() - Xe, 2) <= Xh.err + 1e-12 * scale
    assert Xh.err <= 1e-9 * scale
    P = df.head_projections(params(*layer))
    pp = df._pairwise(P, P, tY=True)
    F = [pp[g][h] for h in range(heads) for g in range(heads)]
    Xk = df._gram_kron(Wm, df._pairwise(F, F, tY=True))
    assert np.linalg.norm(Xh.val.numpy() - Xk.val.numpy(), 2) <= Xh.err + Xk.err


def test_errors_of_the_token_parts_propagate():
    """W_hg stored with a perturbation of norm e and declared err e: the bound covers the distance of the result to
    the exact X (a bound that dropped the token parts' errors would claim rounding only, 1e-13 of ||X||)."""
    rng = np.random.default_rng(3)
    layer = random_layer(rng, 3, 2, 2, 2.0, 3.0)
    H, W, k = 4, 5, 3
    Q = orthonormal(rng, H * W, k)
    Wm = []
    for w in token_parts(layer, H, W, Q):
        E = rng.standard_normal(w.shape)
        e = 1e-3 * np.linalg.norm(w, 2)
        Wm.append(_Approx(torch.tensor(w + E * (e / np.linalg.norm(E, 2))), e * (1 + 1e-12)))
    Xh = gh.coupling_gram(params(*layer), Wm)
    Xe = exact_X(layer, H, W, Q)
    dist = np.linalg.norm(Xh.val.numpy() - Xe, 2)
    assert dist > 1e-5 * np.linalg.norm(Xe, 2)  # the perturbation shows
    assert dist <= Xh.err


def test_work_is_the_documented_count():
    """h^4 ((k r)^2 + 2 r^3) + 2 k^2 C^3 / GEMM_SPEEDUP (proofs/S2.md: 2.8e10 at 12 heads, C = 768, k = 10)."""
    assert gh.work(12, 10, 768) == 12 ** 4 * (640.0 ** 2 + 2 * 64.0 ** 3) + 2 * 100.0 * 768.0 ** 3 / gh.GEMM_SPEEDUP
    assert 2.7e10 < gh.work(12, 10, 768) < 2.9e10
    assert gh.work(3, 4, 6) == 81 * (8.0 ** 2 + 16) + 2 * 16 * 216 / gh.GEMM_SPEEDUP


def test_nan_and_float32_are_refused():
    """A NaN in a token part (or in its error bound), or float32 inputs: ValueError, never a number."""
    layer = random_layer(np.random.default_rng(4), 2, 1, 2, 1.0, 2.0)
    Q = orthonormal(np.random.default_rng(5), 9, 2)
    parts = token_parts(layer, 3, 3, Q)
    good = [_Approx(torch.tensor(w), 0.0) for w in parts]
    assert gh.coupling_gram(params(*layer), good).val.shape == (8, 8)
    bad = [_Approx(good[0].val.clone(), 0.0)] + good[1:]
    bad[0].val[0, 0] = math.nan
    with pytest.raises(ValueError, match="non-finite"):
        gh.coupling_gram(params(*layer), bad)
    with pytest.raises(ValueError, match="non-finite"):
        gh.coupling_gram(params(*layer), [_Approx(good[0].val, math.nan)] + good[1:])
    with pytest.raises(ValueError, match="float64"):
        gh.coupling_gram(params(*layer), [_Approx(w.val.float(), 0.0) for w in good])


def test_refused_where_heads_do_not_split_the_channels():
    layer = random_layer(np.random.default_rng(0), 2, 1, 2, 1.0, 2.0)
    p = params(*layer)
    p = type(p)(p.alpha[:1], p.mu[:1], p.sigma[:1], p.WV[:3, :3], p.WO[:3, :3])  # 1 head of 3: fine
    Wm = [_Approx(torch.zeros(6, 2, dtype=torch.float64), 0.0)]
    assert gh.coupling_gram(p, Wm).val.shape == (6, 6)
    assert df.x_route(5, 2, 12) != "heads"  # 5 heads do not divide 12 channels


@pytest.mark.parametrize("scale", [2.0 ** -990, 1.0, 2.0 ** 990])
def test_deflated_bound_through_the_heads_against_dense_svd(monkeypatch, scale):
    """With GRAM_BUDGET below X's term-by-term route but above the heads' route, the deflated bound (Theorem D4,
    circulant Gram envelope) is above ||T|| (numpy SVD here), within 1e-6 of it, the same as term by term to 1e-9,
    and exactly covariant in the kernel weights' scale (powers of two) up to 2^-990..2^990."""
    rng = np.random.default_rng(11)
    layer = random_layer(rng, 4, 2, 2, 1.5, 3.0)
    H, W, k = 5, 6, 14
    C = 8
    s = np.linalg.svd(dense_T(*layer, H, W), compute_uv=False)[0]
    ref = df.deflated_bound(params(*layer), H, W, k=k, complement="gram")
    assert df.x_route(4, k, C) == "kron"
    monkeypatch.setattr(dp, "GRAM_BUDGET", 4 ** 4 * float(k * C) ** 2 - 1)
    assert df.x_route(4, k, C) == "heads"
    scaled = (layer[0] * scale,) + tuple(layer[1:])
    b = df.deflated_bound(params(*scaled), H, W, k=k, complement="gram")
    assert b.info["theorem"] == "D4"
    assert b.upper / scale >= s * (1 - 1e-12) and b.upper / scale <= s * (1 + 1e-6)
    assert math.isclose(b.upper / scale, ref.upper, rel_tol=1e-9)
    if scale != 1.0:
        assert b.upper / scale == df.deflated_bound(params(*layer), H, W, k=k, complement="gram").upper
