"""The circulant Gram envelope (lipcheck.bounds.gram_envelope) and the deflated bound built on it, against dense SVDs,
1-D Toeplitz norms and symbols written here from the definition."""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipcheck import rounding
from lipcheck.bounds import deflation as df
from lipcheck.bounds import deflation_plan as dp
from lipcheck.bounds import gram_envelope as ge
from lipcheck.bounds.spectral import _scale_back, normalised
from lipcheck.mixers.ssog import SIGMA_FLOOR
from test_majorant import axis, dense_T, params, random_layer, taps


def torus_coefficients_np(alpha, mu, sigma, H, W):
    """c (L1, L2, h): the DFT of each head's kernel taps at offsets |k| <= n - 1 at the (2H-1) x (2W-1) torus
    frequencies, from scratch."""
    h, M = alpha.shape
    L1, L2 = 2 * H - 1, 2 * W - 1

    def dft(n, L, m_, s_):
        k = np.arange(-(n - 1), n)
        w = 2 * np.pi * np.arange(L) / L
        return np.exp(-1j * w[:, None] * k[None, :]) @ taps(k, m_, s_)

    return np.stack([sum(alpha[i, m] * np.outer(dft(H, L1, mu[i, m, 0], sigma[i, m, 0]),
                                                 dft(W, L2, mu[i, m, 1], sigma[i, m, 1])) for m in range(M))
                     for i in range(h)], -1)


def head_projections_np(WV, WO, h):
    d = WV.shape[0] // h
    return [WV[:, i * d:(i + 1) * d] @ WO[i * d:(i + 1) * d, :] for i in range(h)]


def torus_norms_sq(alpha, mu, sigma, WV, WO, H, W):
    """||S_L(w)||^2 at the torus frequencies, S_L(w) = sum_h c_h(w) P_h (numpy SVDs)."""
    c = torus_coefficients_np(alpha, mu, sigma, H, W)
    P = head_projections_np(WV, WO, alpha.shape[0])
    return np.array([[np.linalg.norm(sum(ci * Pi for ci, Pi in zip(row, P)), 2) ** 2 for row in line] for line in c])


def cheap_bound_sq(alpha, mu, sigma, WV, WO, H, W):
    """min(sum_h |c_h| ||P_h||, ||W_V|| max_h |c_h| ||W_O||)^2 at the torus frequencies."""
    c = np.abs(torus_coefficients_np(alpha, mu, sigma, H, W))
    Pn = np.array([np.linalg.norm(P, 2) for P in head_projections_np(WV, WO, alpha.shape[0])])
    return np.minimum((c * Pn).sum(-1), np.linalg.norm(WV, 2) * np.linalg.norm(WO, 2) * c.max(-1)) ** 2


def envelope_matrix(f, H, W):
    """R_f[j, j'] = (L1 L2)^-1 sum_w f(w) e^{-i w.(j - j')} over the torus, as a dense complex sum (real for even f)."""
    L1, L2 = f.shape
    y, x = np.meshgrid(np.arange(H), np.arange(W), indexing="ij")
    wy = 2 * np.pi * np.arange(L1) / L1
    wx = 2 * np.pi * np.arange(L2) / L2
    E = np.exp(-1j * (wy[:, None, None] * y.reshape(-1)[None, None, :] + wx[None, :, None] * x.reshape(-1)[None, None, :]))
    E = E.reshape(L1 * L2, H * W)
    R = (E.conj().T * f.reshape(-1)[None, :]) @ E / (L1 * L2)
    return R.real


def frozen_layer(rng, h, M, d):
    """Narrow mixed-sign kernels as in the frozen presets: alpha ~ N(0, 1/M^2), |mu| <= 4, sigma in [0.25, 3]."""
    alpha, mu, _, WV, WO = random_layer(rng, h, M, d, 4.0, 3.0)
    return alpha / M, mu, 0.25 * np.exp(rng.uniform(0, math.log(12), (h, M, 2))), WV, WO


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(h=st.integers(1, 3), M=st.integers(1, 3), H=st.integers(1, 5), W=st.integers(1, 5),
       shift=st.floats(0.0, 3.0), width=st.floats(0.5, 4.0), seed=st.integers(0, 10 ** 6))
def test_envelope_majorises_the_gram_matrix(h, M, H, W, shift, width, seed):
    """Lemma G1 on random layers: T^T T <= R_f kron I_C for f = ||S_L||^2 computed here (the smallest eigenvalue of
    the difference, dense, is >= 0 up to rounding); the library's f is certified (>= f, within 1e-8) and mirrored
    exactly; its stored R is within its declared error of R_f built here; its bounds lie between ||T|| and the
    circulant embedding's max ||S_L||."""
    rng = np.random.default_rng(seed)
    layer = random_layer(rng, h, M, 2, shift, width)
    T = dense_T(*layer, H, W)
    C = layer[3].shape[0]
    f = torus_norms_sq(*layer, H, W)
    R = envelope_matrix(f, H, W)
    G = T.T @ T
    gap = np.linalg.eigvalsh(np.kron(R, np.eye(C)) - G)[0]
    assert gap >= -1e-12 * np.linalg.norm(G, 2)
    p = params(*layer)
    q = normalised(p)
    s2 = 4.0 ** q.log2_scale  # normalised units (squared) -> the layer's
    L1, L2 = f.shape
    # the default stopping rule: certified norms where the cheap bound is large, the cheap bound (written here:
    # min(sum_h |c_h| ||P_h||, ||W_V|| max_h |c_h| ||W_O||)) elsewhere, never below the rule's threshold
    envd = ge.gram_envelope(q, H, W)
    fd = envd.f.numpy() * s2
    assert np.all(fd >= f * (1 - 1e-13)) and 1 <= envd.norms <= math.ceil(L1 * L2 / 2)
    gap_d = np.linalg.eigvalsh(np.kron(envd.R.numpy() * s2, np.eye(C)) - G)[0]
    assert gap_d >= -1e-12 * np.linalg.norm(G, 2)
    env = ge.gram_envelope(q, H, W, theta=0.0)  # every frequency certified
    assert env.norms == math.ceil(L1 * L2 / 2)
    fl = env.f.numpy() * s2
    # tight to 1e-7 relative, and to 1e-10 of the largest value (the coefficients' error is absolute: on one token
    # with a far-shifted kernel it reached 1.1e-8 of f)
    assert np.all(fl >= f * (1 - 1e-13)) and np.all(fl <= f * (1 + 1e-7) + 1e-10 * f.max() + 1e-300)
    cheap = cheap_bound_sq(*layer, H, W)
    loose = fd > fl * (1 + 1e-12)
    assert np.all(fd <= np.maximum(fl, cheap) * (1 + 1e-7) + 1e-10 * f.max() + 1e-300)
    assert np.all(cheap[loose] <= ge.THETA * fl.max() * (1 + 1e-8) + 1e-300)
    assert np.array_equal(fl, fl[(-np.arange(L1)) % L1][:, (-np.arange(L2)) % L2])
    assert np.array_equal(fd, fd[(-np.arange(L1)) % L1][:, (-np.arange(L2)) % L2])
    Rf = envelope_matrix(env.f.numpy(), H, W)  # R of the library's own f, built here
    assert np.linalg.norm(env.R.numpy() - Rf, 2) <= env.err
    _, e_r = ge.torus_toeplitz_coefficients(env.f, H, W)  # the documented N e_r, rounded up by gamma_4
    assert env.err == H * W * e_r * (1 + rounding.gamma(4))
    assert env.err <= 1e-12 * np.abs(Rf).max() * H * W + 1e-300
    assert np.array_equal(env.R.numpy(), env.R.numpy().T)
    norm = np.linalg.norm(T, 2)
    top = ge.certified_top(env) * s2
    assert norm ** 2 * (1 - 1e-12) <= top <= np.linalg.eigvalsh(R)[-1] * (1 + 1e-8) + 1e-300
    b = ge.circulant_gram_bound(p, H, W)
    assert norm * (1 - 1e-12) <= b <= math.sqrt(f.max()) * (1 + 1e-8)
    # the documented last steps: sqrt(tau) (1 + 2u) + conversion margin, scaled back outward
    u = 2.0 ** -53
    assert b == _scale_back(math.sqrt(ge.certified_top(envd)) * (1 + 2 * u) + q.conversion_error * q.magnitude(),
                            q.log2_scale, up=True)
    b2 = df.deflated_bound(p, H, W, k=1, complement="gram") if H * W > 1 else None
    if b2 is not None:  # the deflated bound's envelope value is this bound, computed once
        assert b2.info["envelope_bound"] == b and b2.info["envelope_seconds"] > 0 and b2.upper <= b
        assert b2.delta == b2.info["complement"] and 0 <= b2.delta < math.inf  # sqrt(m22) in the layer's units


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 31 - 1), heads=st.sampled_from([1, 2, 3]), spread=st.floats(0.3, 3.0))
def test_torus_norms_bound_the_exact_symbol_norms(seed, heads, spread):
    """f >= ||S_L(w)||^2 (numpy SVDs of the symbol written from the definition) at every torus frequency, f(-w) = f(w),
    f <= the cheap bound squared (never looser than it); with theta = 0 every frequency is an anchor and f is the exact
    value to 1e-9 (and 1e-10 max f: the coefficients' error); with a budget of 5 C^3 exactly 5 anchors; stopped by the rule (no budget), every frequency left
    looser than 1e-9 carries at most theta (max f) and max f is the exact maximum to 1e-9 (the anchors went where the
    bound was largest)."""
    from lipcheck.bounds import spectral as sp
    rng = np.random.default_rng(seed)
    layer = random_layer(rng, heads, 2, 2, spread, max(spread, 0.5))
    q = normalised(params(*layer))
    H, W = 3, 4
    ref = torus_norms_sq(*(np.asarray(x) for x in (q.alpha, q.mu, q.sigma, q.WV, q.WO)), H, W)
    cheap = cheap_bound_sq(*(np.asarray(x) for x in (q.alpha, q.mu, q.sigma, q.WV, q.WO)), H, W)
    C = q.dim
    sn = sp.SymbolNorm(q)
    err_c = float(sn.delta_norm(sp.coefficient_error(q, sp.truncated_symbol_error(q, H, W))))
    assert err_c > 1e-13 * math.sqrt(ref.max())  # large enough for the check below to see it
    half = [(a, b) for a in range(5) for b in range(7) if a * 7 + b <= ((-a) % 5) * 7 + (-b) % 7]
    hi, hj = np.array(half).T
    for theta, budget, chunk in ((0.0, None, 32), (0.0, 5 * C ** 3, 2), (0.1, None, 1), (0.5, None, 3)):
        f, n = ge.torus_symbol_norms(q, H, W, theta=theta, budget=budget, chunk=chunk)
        f = f.numpy()
        assert np.all(f >= ref * (1 - 1e-13))
        # the coefficients' error is added to every value (the norms' own guesses agree with ref to ~1e-15)
        assert np.all(f >= (np.sqrt(ref) * (1 - 1e-13) + err_c) ** 2)
        assert np.all(f <= cheap * (1 + 1e-9) + 1e-10 * ref.max())  # + the coefficients' error
        assert np.array_equal(f, np.roll(np.flip(f, (0, 1)), (1, 1), (0, 1)))  # f(-w) = f(w)
        if budget is not None:
            assert n == 5
            continue
        if theta > 0:  # a chunk starts above the rule: bound at pick (<= g) > sqrt(theta) s_max >= sqrt(theta) s_first
            first = int(np.argmax(cheap[hi, hj]))
            assert n <= int((cheap[hi, hj] * (1 + 1e-8) > theta * ref[hi, hj][first]).sum()) + chunk - 1
        if theta == 0.0:
            assert n == 18
            np.testing.assert_allclose(f, ref, rtol=1e-9, atol=1e-10 * ref.max())
        loose = f > ref * (1 + 1e-9) + 1e-10 * ref.max()
        assert np.all(f[loose] <= theta * ref.max() * (1 + 1e-6))
        assert f.max() <= ref.max() * (1 + 1e-9)


def test_anchor_bounds_tighten_the_frequencies_that_are_not_anchors():
    """Smooth kernels on an 8 x 8 grid (113 frequencies on half the torus), 10 anchors: the anchors' bounds bring more
    than the 10 anchors themselves below the cheap bound, max f is the exact peak, and every value stays above the exact
    norm (numpy SVDs)."""
    rng = np.random.default_rng(11)
    alpha, mu, _, WV, WO = random_layer(rng, 3, 2, 4, 1.0, 1.0)
    sigma = rng.uniform(2.0, 4.0, mu.shape)
    q = normalised(params(alpha, mu, sigma, WV, WO))
    args = [np.asarray(x) for x in (q.alpha, q.mu, q.sigma, q.WV, q.WO)]
    ref, cheap = torus_norms_sq(*args, 8, 8), cheap_bound_sq(*args, 8, 8)
    f, n = ge.torus_symbol_norms(q, 8, 8, theta=0.0, budget=10 * q.dim ** 3, chunk=2)
    f = f.numpy()
    assert n == 10 and np.all(f >= ref * (1 - 1e-13))
    tightened = int((f < cheap * (1 - 1e-6)).sum())  # both members of a pair (w, -w) count
    assert tightened > 2 * n
    assert cheap.max() > 4 * ref.max() and f.max() <= ref.max() * (1 + 1e-9)  # the peak found, where g is 4x off


def test_torus_norms_from_the_circulant_stage_anchors():
    """A SymbolNorm that already holds the circulant embedding's anchors (at these very torus frequencies) seeds f:
    those frequencies are exact at once and never anchored again (the budget counts new anchors only), every value
    stays >= the exact norm (numpy SVDs) and <= the cheap bound; a SymbolNorm of another layer is refused."""
    from lipcheck.bounds import spectral as sp
    rng = np.random.default_rng(5)
    alpha, mu, _, WV, WO = random_layer(rng, 3, 2, 4, 1.0, 1.0)
    sigma = rng.uniform(0.4, 2.0, mu.shape)
    q = normalised(params(alpha, mu, sigma, WV, WO))
    args = [np.asarray(x) for x in (q.alpha, q.mu, q.sigma, q.WV, q.WO)]
    H, W = 5, 6
    half = (2 * H - 1) * (2 * W - 1) // 2 + 1
    ref = torus_norms_sq(*args, H, W)

    def circulant_anchors():
        sn = sp.SymbolNorm(q)
        sp.circulant_bound(q, H, W, sn=sn, rtol=1e-9)
        return sn, sn.all_anchors()["c"].shape[0]

    sn, A = circulant_anchors()
    assert 1 <= A < half
    f, n = ge.torus_symbol_norms(q, H, W, theta=0.0, sn=sn)
    assert n == half - A  # every other frequency anchored once; none of the circulant's again
    np.testing.assert_allclose(f.numpy(), ref, rtol=1e-9, atol=1e-10 * ref.max())
    assert np.all(f.numpy() >= ref * (1 - 1e-13))
    sn, _ = circulant_anchors()
    f1, n1 = ge.torus_symbol_norms(q, H, W, theta=0.0, budget=2 * q.dim ** 3, chunk=1, sn=sn)
    cheap = cheap_bound_sq(*args, H, W)
    f1 = f1.numpy()
    exact = np.isclose(f1, ref, rtol=1e-9, atol=1e-10 * ref.max())
    assert n1 == 2 and np.all(f1 >= ref * (1 - 1e-13)) and np.all(f1 <= cheap * (1 + 1e-9) + 1e-10 * ref.max())
    assert exact.sum() >= 2 * A - 1  # the circulant's anchors and their mirrors (w = 0 is its own)
    other = normalised(params(alpha * 3, mu, sigma, WV, WO))
    with pytest.raises(ValueError, match="other parameters"):
        ge.torus_symbol_norms(other, H, W, sn=sn)


def test_a_nan_anchor_bound_keeps_the_frequency_bound(monkeypatch):
    """An anchor bound that comes out NaN is "not certified": the frequencies it would have tightened keep their
    bound (never 0), so f stays above the exact norms (numpy SVDs)."""
    from lipcheck.bounds import spectral as sp
    rng = np.random.default_rng(2)
    q = normalised(params(*random_layer(rng, 2, 2, 2, 1.0, 2.0)))
    H, W = 4, 4
    ref = torus_norms_sq(*(np.asarray(x) for x in (q.alpha, q.mu, q.sigma, q.WV, q.WO)), H, W)
    monkeypatch.setattr(sp.SymbolNorm, "anchor_bound", lambda self, c, anchor: torch.full(
        (c.shape[0],), math.nan, dtype=torch.float64))
    f, n = ge.torus_symbol_norms(q, H, W, theta=0.0, budget=2 * q.dim ** 3, chunk=1)
    assert n == 2 and np.all(f.numpy() >= ref * (1 - 1e-13))


def test_envelope_coefficients_and_their_error_against_long_double():
    """torus_toeplitz_coefficients: every t[D] within e_r of r(D) evaluated in long double here, e_r as documented
    (relative rel = 2 (2e + e^2) + 2 g (1 + e)^2 + 4u (1 + e)^2 (1 + g) with e = trig_error, g = gamma_{L1+L2+2}),
    and t exactly even (t[-D] = t[D])."""
    H, W = 6, 5
    L1, L2 = 2 * H - 1, 2 * W - 1
    rng = np.random.default_rng(3)
    f = rng.uniform(0.5, 3.0, (L1, L2))
    f = (f + f[(-np.arange(L1)) % L1][:, (-np.arange(L2)) % L2]) / 2
    t, e_r = ge.torus_toeplitz_coefficients(torch.tensor(f), H, W)
    fl = f.astype(np.longdouble)
    pi = np.longdouble("3.14159265358979323846264338327950288")
    ref = np.zeros((L1, L2), dtype=np.longdouble)
    for dy in range(-(H - 1), H):
        for dx in range(-(W - 1), W):
            a = np.arange(L1, dtype=np.longdouble)[:, None] * dy / L1 + np.arange(L2, dtype=np.longdouble)[None, :] * dx / L2
            ref[dy + H - 1, dx + W - 1] = (fl * np.cos(2 * pi * a)).sum() / (L1 * L2)
    err = np.abs(t.numpy().astype(np.longdouble) - ref).max()
    assert err <= e_r
    u = 2.0 ** -53
    e = 2 * math.pi * 3.01 * u + 2 * u
    assert ge.trig_error(u) == e
    g = rounding.gamma(L1 + L2 + 2)
    rel = 2 * (2 * e + e * e) + 2 * g * (1 + e) ** 2 + 4 * u * (1 + e) ** 2 * (1 + g)
    eta = rounding.tiny_subnormal(torch.float64)

    def want(f):  # the documented bound, evaluated in the library's order (F from torch's sum, as the library's)
        F = float(torch.tensor(f).sum()) * (1 + 2 * rounding.gamma(L1 * L2 + 2))
        return F / (L1 * L2) * rel * (1 + rounding.gamma(8)) + 4 * (L1 * L2 + 1) * eta

    assert e_r == want(f)
    assert np.array_equal(t.numpy(), t.numpy()[::-1, ::-1])
    # subnormal f: the relative part underflows and the allowance for underflowing products carries the bound
    tiny = f * 1e-310
    t2, e2 = ge.torus_toeplitz_coefficients(torch.tensor(tiny), H, W)
    assert e2 == want(tiny) and e2 >= 4 * (L1 * L2 + 1) * eta
    ref2 = ref * np.longdouble(1e-310)
    assert np.abs(t2.numpy().astype(np.longdouble) - ref2).max() <= e2


def test_gram_deflation_tight_on_frozen_narrow_kernels():
    """Frozen-preset-like kernels (narrow, shifted, mixed signs; 3 heads, 4 components, C = 12) on a 10 x 10 grid
    (N C = 1200: dense SVD here), k = 10 token functions: the Gram-deflated bound lies within 1 % of ||T|| (measured
    0.54 %; the Toeplitz majorant's deflation 9.6 % at the same k, 4 refinement rounds), the envelope alone between
    ||T|| and the circulant embedding's max ||S_L|| computed here (measured 15 % and 33 % above ||T||)."""
    rng = np.random.default_rng(5)
    layer = frozen_layer(rng, 3, 4, 4)
    H = W = 10
    exact = np.linalg.norm(dense_T(*layer, H, W), 2)
    circ = math.sqrt(torus_norms_sq(*layer, H, W).max())
    b = df.deflated_bound(params(*layer), H, W, k=10, complement="gram")
    assert b.info["envelope"] == "gram" and b.info["upper_from"] == "D4" and b.k == 10
    assert exact * (1 - 1e-12) <= b.upper <= exact * 1.01
    assert exact * (1 - 1e-12) <= b.info["envelope_bound"] <= circ * (1 + 1e-9)
    assert b.upper == b.info["deflated"] <= b.info["envelope_bound"] and b.estimate <= b.upper


@pytest.mark.parametrize("mu,sigma,C", [((2.7, -1.4), (0.3, 0.6), 64), ((0.0, 3.5), (2.0, 0.25), 96)])
def test_gram_deflation_on_a_factorised_layer(mu, sigma, C):
    """One head, one component at 14 x 14 (N C = 12544, beyond a dense SVD): T = alpha (G_y kron G_x) kron P^T, so
    ||T|| = |alpha| ||G_y|| ||G_x|| ||P|| from 1-D matrices built here; the Gram-deflated bound lies within 1 % of it
    and above it."""
    rng = np.random.default_rng(C)
    H = W = 14
    alpha = np.array([[-0.8]])
    mus = np.array([[[mu[0], mu[1]]]])
    sig = np.array([[[sigma[0], sigma[1]]]])
    WV = rng.standard_normal((C, C)) / math.sqrt(C)
    WO = rng.standard_normal((C, C)) / math.sqrt(C)
    exact = 0.8 * np.linalg.norm(axis(H, mu[0], sigma[0]), 2) * np.linalg.norm(axis(W, mu[1], sigma[1]), 2) \
        * np.linalg.norm(WV @ WO, 2)
    b = df.deflated_bound(params(alpha, mus, sig, WV, WO), H, W, complement="gram")
    assert exact * (1 - 1e-12) <= b.upper <= exact * 1.01


def test_complement_choice_and_bad_input():
    """choose_complement: the Gram envelope stored densely up to MAX_FREQUENCIES (2048 on half the torus: 32 x 33
    exactly, not 33 x 33; 32 x 32 at any C), read as f alone up to MAX_TORUS_FREQUENCIES (128 x 128), and GRAM_BUDGET; default_k_gram near k C = 4608; float32, NaN, an unknown complement
    and a k beyond GRAM_BUDGET are refused."""
    assert ge.dense(32, 32) and ge.dense(32, 33) and ge.dense(33, 32) and not ge.dense(33, 33)
    assert ge.dense(2048, 1) and not ge.dense(2049, 1)  # 4095 and 4097 frequencies: 2048, 2049 halves
    assert not ge.dense(64, 64) and ge.affordable(64, 64) and ge.affordable(128, 128) and not ge.affordable(129, 129)
    assert [df.default_k_gram(196, C) for C in (12, 48, 192, 384, 768)] == [195, 96, 24, 12, 10]
    assert df.default_k_gram(4, 1) == 3
    assert df.choose_complement(14, 14, 384, 6) == "gram" and df.choose_complement(32, 32, 384, 6) == "gram"
    assert df.choose_complement(64, 64, 48, 3) == "gram" and df.choose_complement(129, 129, 48, 3) == "majorant"
    # 6^4 (24 * 384)^2 > GRAM_BUDGET, but X through the heads' rank 64 fits; at k = 100 neither route does
    assert df.choose_complement(14, 14, 384, 6, k=24) == "gram" and df.x_route(6, 24, 384) == "heads"
    assert df.choose_complement(14, 14, 384, 6, k=100) == "majorant"
    rng = np.random.default_rng(1)
    layer = random_layer(rng, 2, 2, 2, 1.0, 2.0)
    p = params(*layer)
    with pytest.raises(ValueError, match="complement"):
        df.deflated_bound(p, 3, 3, complement="circulant")
    with pytest.raises(ValueError, match="GRAM_BUDGET"):
        old = dp.GRAM_BUDGET
        dp.GRAM_BUDGET = 0.0
        try:
            df.deflated_bound(p, 3, 3, complement="gram")
        finally:
            dp.GRAM_BUDGET = old
    p32 = params(*layer)
    p32 = type(p32)(*(x.float() for x in (p32.alpha, p32.mu, p32.sigma, p32.WV, p32.WO)))
    with pytest.raises(ValueError, match="float64"):
        ge.gram_envelope(p32, 3, 3)
    bad = params(layer[0] * np.nan, *layer[1:])
    with pytest.raises(ValueError):
        ge.circulant_gram_bound(bad, 3, 3)
    with pytest.raises(ValueError, match="torus symbol norms"):  # NaN coefficients: the cheap bounds refuse
        ge.torus_symbol_norms(bad, 3, 3)
    with pytest.raises(ValueError, match="torus symbol norms"):  # finite norms whose squares overflow (unnormalised)
        ge.torus_symbol_norms(params(layer[0] * 1e200, *layer[1:]), 3, 3)


def test_anchored_low_rank_path_at_extreme_scales():
    """Beyond 32 x 32 (f alone: the anchored torus norms, Lanczos by FFT, the low-rank complement), alpha x 2^e
    (exact in float64, |alpha| near 1e-298 and 1e298) with a budget of a few anchors, so the branch and bound stops
    part way: the bound stays above the dense SVD of the unscaled layer times 2^e (written here), neither overflows
    nor underflows, and scales exactly with alpha."""
    rng = np.random.default_rng(5)
    alpha, mu, sigma, WV, WO = random_layer(rng, 2, 2, 1, 2.0, 2.5)
    H, W = 34, 33
    assert not ge.dense(H, W)
    exact = float(np.linalg.norm(dense_T(alpha, mu, sigma, WV, WO, H, W), 2))
    kw = dict(k=8, complement="gram", envelope_budget=40 * 2 ** 3)  # 40 anchors of C = 2 out of ~2244 frequencies
    b0 = df.deflated_bound(params(alpha, mu, sigma, WV, WO), H, W, **kw)
    for e in (0, -990, 990):
        b = df.deflated_bound(params(alpha * 2.0 ** e, mu, sigma, WV, WO), H, W, **kw) if e else b0
        assert b.info["envelope"] == "gram" and b.info.get("complement_method") == "low-rank", b.info
        assert 0 < b.info["envelope_norms"] <= 40
        assert math.isfinite(b.upper) and b.upper > 0
        assert b.upper >= math.ldexp(exact, e) * (1 - 1e-12)
        assert b.upper <= math.ldexp(exact, e) * 1.05  # still a useful bound at every scale
        assert b.upper == pytest.approx(math.ldexp(b0.upper, e), rel=1e-12)


def test_certified_top_and_the_envelope_refusal():
    """certified_top is the Cholesky-verified lambda_max of the stored R plus the envelope's error, rounded up by
    (1 + 2u) (proofs/S2.md, Lemma G1), and lies above the exact squared norm (numpy SVD of the dense operator); a NaN
    in the kernels is refused, naming the parameter and the envelope."""
    rng = np.random.default_rng(3)
    alpha, mu, sigma, WV, WO = random_layer(rng, 2, 2, 2, 1.5, 2.0)
    q = normalised(params(alpha, mu, sigma, WV, WO))
    env = ge.gram_envelope(q, 5, 4)
    u = rounding.unit_roundoff(torch.float64)
    lam = float(rounding.verified_lambda_max(env.R, tries=20))
    assert ge.certified_top(env) == (lam + env.err) * (1 + 2 * u)
    T = dense_T(*(np.asarray(x) for x in (q.alpha, q.mu, q.sigma, q.WV, q.WO)), 5, 4)
    assert ge.certified_top(env) >= float(np.linalg.norm(T, 2)) ** 2
    bad = params(np.where(np.arange(alpha.size).reshape(alpha.shape) == 0, np.nan, alpha), mu, sigma, WV, WO)
    with pytest.raises(ValueError, match="alpha has NaN/inf entries: the circulant Gram envelope is not certified"):
        ge.gram_envelope(bad, 5, 4)


def test_anchored_low_rank_path_at_the_sigma_floor():
    """Every sigma just above the floor (each kernel a shift of the grid by round(mu): a flat symbol, the anchors'
    hardest case) beyond 32 x 32: the deflated bound on the anchored torus norms and the low-rank complement stays
    above the exact norm of the dense layer written here (numpy SVD of test_majorant.dense_T), within 5% with k = 8."""
    rng = np.random.default_rng(8)
    alpha, mu, _, WV, WO = random_layer(rng, 2, 2, 1, 3.0, 1.0)
    sigma = np.full(mu.shape, SIGMA_FLOOR * (1 + 1e-9))
    H, W = 33, 34
    exact = float(np.linalg.norm(dense_T(alpha, mu, sigma, WV, WO, H, W), 2))
    b = df.deflated_bound(params(alpha, mu, sigma, WV, WO), H, W, k=8, complement="gram",
                          envelope_budget=40 * 2 ** 3)
    assert b.info.get("complement_method") == "low-rank" and 0 < b.info["envelope_norms"] <= 40
    assert exact * (1 - 1e-12) <= b.upper <= exact * 1.05, (b.upper, exact)  # k = 8 at the floor: 3.5% here
