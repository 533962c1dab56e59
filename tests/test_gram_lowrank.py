"""The low-rank complement of the circulant Gram envelope (lipcheck.bounds.gram_lowrank, Lemma G3 of proofs/S2.md)
against R_f written here from its definition, dense eigenvalues of P R_f P, and dense SVDs of the operator."""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipcheck.bounds import deflation as df
from lipcheck.bounds import deflation_plan as dp
from lipcheck.bounds import gram_envelope as ge
from lipcheck.bounds import gram_lowrank as gl
from test_gram_envelope import envelope_matrix, frozen_layer
from test_majorant import dense_T, params, random_layer


def even_symbol(rng, L1, L2, spike: float = 0.0):
    """A random f >= 0 on the L1 x L2 torus with f(-w) = f(w), with a peak of height `spike` at one pair."""
    f = rng.uniform(0, 1, (L1, L2)) ** 3
    a, b = np.arange(L1), np.arange(L2)
    f = (f + f[(-a) % L1][:, (-b) % L2]) / 2
    i, j = rng.integers(L1), rng.integers(L2)
    f[i, j] += spike
    f[(-i) % L1, (-j) % L2] = f[i, j]
    return f


def orthonormal(rng, N, k):
    return np.linalg.qr(rng.standard_normal((N, k)))[0]


def complement_top(R, Q):
    """lambda_max(P R P) with P = I - Q Q^T (numpy, Q orthonormal)."""
    P = np.eye(R.shape[0]) - Q @ Q.T
    return np.linalg.eigvalsh(P @ R @ P)[-1]


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(H=st.integers(1, 7), W=st.integers(1, 7), k=st.integers(0, 6), level=st.floats(0.0, 1.0),
       spike=st.floats(0.0, 50.0), seed=st.integers(0, 10 ** 6))
def test_complement_bound_is_sound_on_random_symbols(H, W, k, level, spike, seed):
    """m22 >= lambda_max(R_f on span(Q)^perp) for R_f built here from the torus sum, any level d0 in [0, max f] and a
    random orthonormal Q; with d0 = 0 (every frequency a column of A) it is that value up to rounding; and the
    envelope applied by FFT is R_f."""
    rng = np.random.default_rng(seed)
    N = H * W
    k = min(k, N - 1)
    f = even_symbol(rng, 2 * H - 1, 2 * W - 1, spike)
    R = envelope_matrix(f, H, W)
    x = rng.standard_normal((N, 3))
    np.testing.assert_allclose(gl.apply_envelope(f, H, W, x), R @ x, rtol=0, atol=1e-12 * np.abs(f).sum())
    Q = orthonormal(rng, N, k) if k else np.zeros((N, 0))
    want = complement_top(R, Q) if k else np.linalg.eigvalsh(R)[-1]
    ft = torch.tensor(f)
    Qt = torch.tensor(Q) if k else torch.zeros(N, 1, dtype=torch.float64)[:, :0]
    eta = df.orthonormality_defect(Qt) if k else 0.0
    d0 = level * float(f.max())
    m22, cols = gl.complement_bound(ft, H, W, Qt, eta, d0)
    assert m22 >= want * (1 - 1e-13) - 1e-300
    m0, cols0 = gl.complement_bound(ft, H, W, Qt, eta, 0.0)
    assert want <= m0 <= want * (1 + 1e-9) + 1e-12 * f.max()
    assert cols <= cols0


@pytest.mark.parametrize("H,W", [(3, 4), (5, 5)])
def test_split_majorises_the_envelope(H, W):
    """R_f <= d0 I + A^T A (Lemma G3) in the Loewner order for the A the library forms, against R_f written here, at
    several levels; at the top level A is empty and the bound is d0 = max f."""
    rng = np.random.default_rng(H * W)
    f = even_symbol(rng, 2 * H - 1, 2 * W - 1, 5.0)
    R = envelope_matrix(f, H, W)
    for d0 in (0.0, 0.1, 0.5, float(np.median(f)), float(f.max())):
        At = gl.envelope_columns(torch.tensor(f), H, W, d0)
        A = At.val.numpy()
        gap = np.linalg.eigvalsh(d0 * np.eye(H * W) + A @ A.T - R)[0]
        assert gap >= -1e-12 * f.max()
        assert A.shape[1] == sum(1 for v in f.reshape(-1) if v > d0)  # one column per torus frequency above d0
    assert gl.envelope_columns(torch.tensor(f), H, W, float(f.max())).val.shape[1] == 0


def test_shrunk_columns_fail():
    """The check can fail: A with its weights scaled by 0.99 no longer majorises R_f at level 0 on a peaked symbol,
    and neither does a level lowered below its own value."""
    rng = np.random.default_rng(3)
    H, W = 4, 4
    f = even_symbol(rng, 7, 7, 20.0)
    R = envelope_matrix(f, H, W)
    A = gl.envelope_columns(torch.tensor(f), H, W, 0.0).val.numpy() * 0.99
    assert np.linalg.eigvalsh(A @ A.T - R)[0] < -1e-6
    f = even_symbol(rng, 7, 7, 0.0)
    R = envelope_matrix(f, H, W)
    d0 = float(np.median(f))
    A = gl.envelope_columns(torch.tensor(f), H, W, d0).val.numpy()
    assert np.linalg.eigvalsh(0.5 * d0 * np.eye(H * W) + A @ A.T - R)[0] < -1e-6


def test_lanczos_vectors_are_the_top_of_the_envelope():
    """top_vectors: the leading eigenvalues of R_f from its dense eigendecomposition here, and Q spans their space."""
    rng = np.random.default_rng(7)
    H, W, k = 6, 5, 4
    f = even_symbol(rng, 2 * H - 1, 2 * W - 1, 10.0)
    ev_ref, V = np.linalg.eigh(envelope_matrix(f, H, W))
    ev, Q = gl.top_vectors(torch.tensor(f), H, W, k)
    np.testing.assert_allclose(ev.numpy(), ev_ref[::-1][:k + 1], rtol=1e-8, atol=1e-10)
    if ev_ref[-k] - ev_ref[-k - 1] > 1e-3:
        top = V[:, -k:]
        assert np.linalg.norm(top.T @ Q.numpy(), 2) == pytest.approx(1.0, abs=1e-8)


@pytest.mark.parametrize("kind,seed", [("random", 0), ("frozen", 1)])
def test_low_rank_path_against_dense_svd(monkeypatch, kind, seed):
    """The deflated bound through the low-rank complement (forced on a small grid by storing no R_f densely) lies
    above ||T|| (dense SVD of T built here from SPEC's definition) and within 0.1 % of the dense path's bound with
    the same k (the split level loosens m22 a little: measured 5.16e-6 against 5.12e-6 over ||T|| on the random
    layer, 0.503 % against 0.484 % on the frozen one, where k = 8 of 42 token functions is few)."""
    rng = np.random.default_rng(seed)
    layer = random_layer(rng, 2, 3, 3, 2.0, 3.0) if kind == "random" else frozen_layer(rng, 3, 4, 2)
    H, W, k = 7, 6, 8
    exact = np.linalg.norm(dense_T(*layer, H, W), 2)
    dense = df.deflated_bound(params(*layer), H, W, k=k, complement="gram")
    monkeypatch.setattr(ge, "MAX_FREQUENCIES", 0)
    assert not ge.dense(H, W)
    low = df.deflated_bound(params(*layer), H, W, k=k, complement="gram")
    assert low.info["complement_method"] == "low-rank" and low.info["kC"] == k * layer[3].shape[0]
    assert 0 < low.info["envelope_seconds"] <= low.seconds and low.info["columns"] >= 1
    assert exact * (1 - 1e-12) <= low.upper <= dense.upper * (1 + 1e-3)
    assert exact * (1 - 1e-12) <= dense.upper <= exact * 1.01
    if kind == "random":
        assert low.upper <= exact * (1 + 1e-4)


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1.0, 1e150, 1e300])
def test_low_rank_path_at_extreme_scales(monkeypatch, scale):
    """alpha scaled by 1e-300..1e300: the bound scales with it and stays above scale ||T|| (dense SVD here at scale
    1, times scale: T is linear in alpha), no NaN/inf."""
    rng = np.random.default_rng(11)
    alpha, mu, sigma, WV, WO = random_layer(rng, 2, 2, 2, 1.5, 2.5)
    H, W = 5, 6
    exact = np.linalg.norm(dense_T(alpha, mu, sigma, WV, WO, H, W), 2)
    monkeypatch.setattr(ge, "MAX_FREQUENCIES", 0)
    b = df.deflated_bound(params(alpha * scale, mu, sigma, WV, WO), H, W, k=6, complement="gram")
    assert math.isfinite(b.upper) and b.info["complement_method"] == "low-rank"
    assert exact * scale * (1 - 1e-12) <= b.upper <= exact * scale * (1 + 1e-3)


def test_bad_level_refused():
    f = torch.ones(3, 3, dtype=torch.float64)
    Q = torch.zeros(4, 1, dtype=torch.float64)
    Q[0, 0] = 1.0
    for d0 in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="split level"):
            gl.complement_bound(f, 2, 2, Q, 0.0, d0)


@pytest.mark.parametrize("guide_kind", ["top", "noise", "zero", "nan"])
@pytest.mark.parametrize("low_rank", [False, True])
def test_guided_basis_is_sound_and_tightens(monkeypatch, guide_kind, low_rank):
    """Half of the token functions from a guide (deflated_bound(guide=...)): sound for any guide (the top right
    singular vector from the dense SVD here, Gaussian noise, zeros, NaN: every bound >= ||T||), and with the true top
    vector at least as tight as without (frozen narrow kernels, few token functions: k = 6 of 42)."""
    rng = np.random.default_rng(2)
    layer = frozen_layer(rng, 3, 4, 2)
    H, W, k = 7, 6, 6
    T = dense_T(*layer, H, W)
    _, s, Vt = np.linalg.svd(T)
    exact = s[0]
    if low_rank:
        monkeypatch.setattr(ge, "MAX_FREQUENCIES", 0)
    C = T.shape[0] // (H * W)
    guide = {"top": Vt[0], "noise": rng.standard_normal(T.shape[0]), "zero": np.zeros(T.shape[0]),
             "nan": np.full(T.shape[0], np.nan)}[guide_kind]
    g = torch.tensor(guide.reshape(1, H, W, C))
    plain = df.deflated_bound(params(*layer), H, W, k=k, complement="gram")
    b = df.deflated_bound(params(*layer), H, W, k=k, complement="gram", guide=g)
    assert exact * (1 - 1e-12) <= b.upper and exact * (1 - 1e-12) <= plain.upper
    if guide_kind in ("zero", "nan"):
        assert b.info["guide_profiles"] == 0 and b.upper == plain.upper
    if guide_kind == "top":
        assert b.info["guide_profiles"] == k // 2
        assert b.upper <= plain.upper * (1 + 1e-9) and b.upper <= exact * (1 + 1e-4)


def test_guided_basis_holds_the_guide():
    """guided_basis: orthonormal columns, the guide's leading token profiles inside their span, the envelope's
    vectors after them; r = 0 without a guide."""
    rng = np.random.default_rng(4)
    N, C, k = 30, 5, 8
    Qe = torch.linalg.qr(torch.tensor(rng.standard_normal((N, k))))[0]
    G = torch.tensor(rng.standard_normal((N, 2)) @ rng.standard_normal((2, C)))  # rank 2: two profiles
    Q, r = df.guided_basis(Qe, G, k)
    assert r == 2 and Q.shape == (N, k)
    np.testing.assert_allclose((Q.T @ Q).numpy(), np.eye(k), atol=1e-12)
    resid = G - Q @ (Q.T @ G)
    assert float(resid.norm()) <= 1e-6 * float(G.norm())  # the guide passes through float32
    assert df.guided_basis(Qe, None, k) == (Qe, 0)


@pytest.mark.parametrize("guided", [False, True])
def test_theorem_d3_with_the_envelope_where_d4_does_not_fit(monkeypatch, guided):
    """Where Theorem D4's h^4 terms exceed GRAM_BUDGET (shrunk here so that a small layer takes that branch), Theorem
    D3 with delta = sqrt(m22) from the Gram envelope serves: above ||T|| (dense SVD here), and within 2 % of it on a
    random 3-head layer (measured 1.4e-4 guided, 2.1e-4 unguided at k = 6 of 42)."""
    rng = np.random.default_rng(8)
    layer = random_layer(rng, 3, 2, 2, 2.0, 3.0)
    H, W, k = 7, 6, 6
    T = dense_T(*layer, H, W)
    _, s, Vt = np.linalg.svd(T)
    C = T.shape[0] // (H * W)
    # below both of X's routes: term by term (3^4 (k C)^2) and through the heads' rank (gram_heads.work)
    monkeypatch.setattr(dp, "GRAM_BUDGET", min(3 ** 4 * (k * C) ** 2, df.gh.work(3, k, C)) - 1)
    assert not df.gram_affordable(3, k, C) and df.d3_affordable(3, k, C, dp.GRAM_BUDGET)
    guide = torch.tensor(Vt[0].reshape(1, H, W, C)) if guided else None
    b = df.deflated_bound(params(*layer), H, W, k=k, complement="gram", guide=guide)
    assert b.info["theorem"] == "D3"
    assert s[0] * (1 - 1e-12) <= b.upper <= s[0] * 1.02


def test_envelope_on_one_vector_and_the_documented_margins():
    """apply_envelope on a vector returns a vector (R_f x, against R_f written here); envelope_columns' error bound and
    complement_bound's value are the formulas of proofs/S2.md (Lemma G3, 'Rounding'), recomputed here from the
    stored matrices, so a loosened or tightened margin is caught."""
    from lipcheck import rounding
    from lipcheck.bounds.approx import _Approx, _deflect, _mm, _up
    from lipcheck.bounds.gram_envelope import trig_error
    rng = np.random.default_rng(12)
    H, W = 4, 5
    f = even_symbol(rng, 7, 9, 6.0)
    R = envelope_matrix(f, H, W)
    x = rng.standard_normal(H * W)
    y = gl.apply_envelope(f, H, W, x)
    assert y.shape == (H * W,)
    np.testing.assert_allclose(y, R @ x, atol=1e-12 * np.abs(f).sum())
    ft = torch.tensor(f)
    d0 = float(np.quantile(f, 0.6))
    At = gl.envelope_columns(ft, H, W, d0)
    u = 2.0 ** -53
    e = trig_error(u)
    rel = (2 * (2 * e + e * e) + 4 * u * (1 + e) ** 2) * (1 + 3 * u) + 5 * u
    val = At.val
    # the weights squared: per column the largest |entry| is at most the weight; sum_rows weight^2 from g itself
    ff = ft.reshape(-1)
    L1, L2 = f.shape
    a, b = torch.arange(L1), torch.arange(L2)
    idx = (a[:, None] * L2 + b[None, :]).reshape(-1)
    mirror = (((L1 - a) % L1)[:, None] * L2 + ((L2 - b) % L2)[None, :]).reshape(-1)
    pick = (idx <= mirror) & (ff > d0)
    g = torch.nextafter(ff[pick] - d0, torch.tensor(math.inf, dtype=torch.float64))
    sm = (idx[pick] == mirror[pick]).double()
    wt = torch.sqrt(((2.0 - sm) * g) / (L1 * L2))
    wsum = float((wt.square() * (1 + (sm == 0).double())).sum()) * (1 + rounding.gamma(2 * wt.numel() + 4))
    fro = float(val.square().sum().sqrt()) * (1 + rounding.gamma(val.numel() + 4))
    err = (rel * math.sqrt(H * W * wsum) * (1 + 4 * u) + 3 * u * fro) * (1 + 4 * u)
    assert At.err == _up(err)
    Q = torch.linalg.qr(torch.tensor(rng.standard_normal((H * W, 3))))[0]
    eta = df.orthonormality_defect(Q)
    Z = _deflect(_Approx(Q, eta), At)
    G = _mm(_Approx(Z.val, 0.0), _Approx(Z.val, 0.0), tX=True)
    S = (G.val + G.val.T) / 2
    from lipcheck.bounds import spectral as sp
    with sp.single_thread():
        lam = float(rounding.verified_lambda_max(S, tries=20))
    znorm = math.sqrt(_up(max(lam, 0.0) + G.err + 2 * u * G.fro)) * (1 + 2 * u)
    want = _up((d0 + _up((znorm + Z.err) ** 2 * (1 + 4 * u))) * (1 + 2 * u))
    assert gl.complement_bound(ft, H, W, Q, eta, d0) == (want, val.shape[1])


def test_coarse_rounding_is_upward_and_absorbs_last_bits():
    """coarse_up (the deflated stage's result): never below x, at most 2^-39 above, a fixed point, and x and the
    floats one or two ulps away land on the same value unless a 40-bit step lies between them."""
    from lipcheck.bounds.lipschitz import coarse_up
    rng = np.random.default_rng(0)
    same = 0
    for x in np.exp(rng.uniform(-690, 690, 200)):
        y = coarse_up(float(x))
        assert x <= y <= x * (1 + 2.0 ** -39) and coarse_up(y) == y
        same += coarse_up(float(np.nextafter(np.nextafter(x, np.inf), np.inf))) == y
    assert same >= 195
    assert coarse_up(0.0) == 0.0 and coarse_up(math.inf) == math.inf and math.isnan(coarse_up(math.nan))


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(H=st.integers(1, 9), W=st.integers(1, 9), columns=st.integers(1, 40), spike=st.floats(0.0, 50.0),
       seed=st.integers(0, 10 ** 6))
def test_envelope_top_is_sound_and_never_above_max_f(H, W, columns, spike, seed):
    """envelope_top's tau_R >= lambda_max(R_f) for R_f built here from the torus sum, at most max f, and with every
    frequency a column (d0 = 0) it is lambda_max(R_f) up to rounding."""
    rng = np.random.default_rng(seed)
    f = even_symbol(rng, 2 * H - 1, 2 * W - 1, spike)
    want = np.linalg.eigvalsh(envelope_matrix(f, H, W))[-1]
    ft = torch.tensor(f)
    tau, d0, cols = gl.envelope_top(ft, H, W, max_columns=columns)
    assert want * (1 - 1e-13) <= tau <= float(f.max())
    assert d0 >= 0 and cols <= (2 * H - 1) * (2 * W - 1)
    every, d_all, _ = gl.envelope_top(ft, H, W, max_columns=f.size)
    assert d_all == 0.0 and want * (1 - 1e-13) <= every <= want * (1 + 1e-9) + 1e-12 * f.max()


def test_envelope_top_sees_the_box_edges_on_a_smooth_symbol():
    """A smooth peaked symbol on a 24 x 24 box: lambda_max(R_f) is visibly below max f (the box's edges), and the
    certified envelope_top, from the 64 largest frequencies alone, recovers most of that difference."""
    H = W = 24
    L1, L2 = 2 * H - 1, 2 * W - 1
    a = 2 * np.pi * np.minimum(np.arange(L1), L1 - np.arange(L1)) / L1
    b = 2 * np.pi * np.minimum(np.arange(L2), L2 - np.arange(L2)) / L2
    f = np.exp(-(a[:, None] ** 2 + b[None, :] ** 2))  # even, peak 1 at w = 0
    want = np.linalg.eigvalsh(envelope_matrix(f, H, W))[-1]
    assert want < 0.99 * f.max()
    tau, _, cols = gl.envelope_top(torch.tensor(f), H, W, max_columns=64)
    assert want <= tau <= want + 0.2 * (f.max() - want) and cols <= 64


def test_envelope_top_refuses_nan():
    f = torch.ones(3, 3, dtype=torch.float64)
    f[1, 2] = f[2, 1] = math.nan
    with pytest.raises(ValueError, match="not certified"):
        gl.envelope_top(f, 2, 2)
