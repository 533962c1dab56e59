"""The dense Gram (lipcheck.bounds.gram_dense): M = T^T T formed from its Kronecker factors against T^T T of the dense
T written here from the SPEC definition (test_majorant.dense_T), and its Cholesky-certified bound against numpy's SVD
of that T."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipcheck.bounds import gram_dense as gd
from lipcheck.bounds import spectral as sp
from lipcheck.bounds.lipschitz import ssog_lipschitz
from lipcheck.bounds.options import plan
from lipcheck.mixers.ssog import SIGMA_FLOOR, SSoG
from test_majorant import dense_T, params, random_layer

U = 2.0 ** -53


def gamma(n):
    return n * U / (1 - n * U)


def normalised_layer(layer):
    return sp.normalised(params(*layer))


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(heads=st.integers(1, 3), M=st.integers(1, 3), d=st.integers(1, 3), H=st.integers(1, 5), W=st.integers(1, 5),
       shift=st.floats(0.0, 3.0), seed=st.integers(0, 10 ** 6))
def test_formed_gram_is_T_transpose_T_within_its_bound(heads, M, d, H, W, shift, seed):
    """fl(M) from the factors is T^T T of the SPEC's dense T within the certified error (plus the reference's own
    rounding, gamma_n ||T||_F^2), and that error is tiny (1e-10 of the layer's magnitude squared, (sum |alpha|
    ||W_V|| ||W_O||)^2: the taps' relative errors scale with the kernels, not with ||M||)."""
    rng = np.random.default_rng(seed)
    layer = random_layer(rng, heads, M, d, shift, 3.0)
    q = normalised_layer(layer)
    A, B = gd.gram_factors(q, H, W)
    err = gd.gram_error(A, B)
    Mf = gd.form_gram(A, B).numpy()
    T = dense_T(q.alpha.numpy(), q.mu.numpy(), q.sigma.numpy(), q.WV.numpy(), q.WO.numpy(), H, W)
    ref = T.T @ T
    ref_err = gamma(T.shape[0] + 2) * np.linalg.norm(T, "fro") ** 2
    dist = np.linalg.norm(Mf - ref, 2)
    assert dist <= err + ref_err, (dist, err, ref_err)
    mag = (np.abs(q.alpha.numpy()).sum() * np.linalg.norm(q.WV.numpy(), 2) * np.linalg.norm(q.WO.numpy(), 2)) ** 2
    assert err <= 1e-10 * mag
    # the factors are exactly transposes in pairs: the exact matrix of the stored factors is symmetric
    for h in range(heads):
        for g in range(heads):
            assert torch.equal(A[g][h].val, A[h][g].val.T) and torch.equal(B[g][h].val, B[h][g].val.T)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(heads=st.integers(1, 3), M=st.integers(1, 3), d=st.integers(1, 3), H=st.integers(1, 5), W=st.integers(2, 5),
       shift=st.floats(0.0, 3.0), seed=st.integers(0, 10 ** 6))
def test_bound_above_the_svd_and_within_1e6(heads, M, d, H, W, shift, seed):
    """Given a Ritz value within the first pad, the certified bound is above numpy's ||T||_2 and within 1e-6 of it."""
    rng = np.random.default_rng(seed)
    layer = random_layer(rng, heads, M, d, shift, 3.0)
    exact = float(np.linalg.norm(dense_T(*layer, H, W), 2))
    q = normalised_layer(layer)
    theta = (exact / 2.0 ** q.log2_scale) ** 2
    b = gd.dense_gram_bound(q, H, W, theta)
    assert exact <= b.upper <= exact * (1 + 1e-6), (b.upper, exact)
    assert b.tries == 1 and b.pad == gd.PADS[0]


def test_the_record_holds_the_certified_mu_and_error():
    """mu is the certified lambda_max(fl(M)) < mu, at least theta (1 + pad), and the bound is sqrt(mu + err) (rounded
    up) on the normalised operator: ||T||^2 of the normalised layer lies below mu + err."""
    rng = np.random.default_rng(2)
    layer = random_layer(rng, 2, 2, 2, 2.0, 3.0)
    q = normalised_layer(layer)
    exact_n = float(np.linalg.norm(dense_T(q.alpha.numpy(), q.mu.numpy(), q.sigma.numpy(), q.WV.numpy(),
                                           q.WO.numpy(), 4, 3), 2))
    b = gd.dense_gram_bound(q, 4, 3, exact_n ** 2)
    assert b.mu >= exact_n ** 2 * (1 + b.pad) and exact_n ** 2 <= b.mu + b.err <= exact_n ** 2 * (1 + 1e-6)
    assert 0 < b.err <= 1e-9 * b.mu
    assert math.sqrt(b.mu + b.err) <= math.ldexp(b.upper, -q.log2_scale) <= math.sqrt(b.mu + b.err) * (1 + 1e-9)


def test_a_low_guess_is_padded_until_it_passes_and_a_hopeless_one_refused():
    """A Ritz value 1e-3 below lambda_max fails the first three pads (one formation and factorisation each) and
    passes the fourth, still above the SVD; one at half of lambda_max fails every pad: ValueError, no number."""
    rng = np.random.default_rng(3)
    layer = random_layer(rng, 2, 2, 3, 2.0, 3.0)
    exact = float(np.linalg.norm(dense_T(*layer, 4, 5), 2))
    q = normalised_layer(layer)
    lam = (exact / 2.0 ** q.log2_scale) ** 2
    b = gd.dense_gram_bound(q, 4, 5, lam * (1 - 1e-3))
    assert b.tries == 4 and b.pad == gd.PADS[3] and b.upper >= exact
    with pytest.raises(ValueError, match="failed at every pad"):
        gd.dense_gram_bound(q, 4, 5, lam / 2)


def test_nan_float32_and_bad_guesses_are_refused():
    rng = np.random.default_rng(4)
    layer = random_layer(rng, 2, 2, 2, 2.0, 3.0)
    q = normalised_layer(layer)
    with pytest.raises(ValueError, match="float64"):
        gd.dense_gram_bound(sp.SSoGParams(*(getattr(q, f).float() for f in ("alpha", "mu", "sigma", "WV", "WO"))),
                            3, 3, 1.0)
    bad = params(*layer)
    bad.alpha[0, 0] = math.nan
    with pytest.raises(ValueError):
        gd.dense_gram_bound(bad, 3, 3, 1.0)
    for theta in (math.nan, math.inf, 0.0, -1.0):
        with pytest.raises(ValueError, match="guess"):
            gd.dense_gram_bound(q, 3, 3, theta)


@pytest.mark.parametrize("e", [-990, 0, 990])
def test_exactly_covariant_at_extreme_scales(e):
    """alpha scaled by 2^e (1e-298 .. 1e298): the bound is the unscaled one times 2^e, exactly, and above the SVD."""
    rng = np.random.default_rng(5)
    layer = random_layer(rng, 3, 2, 2, 2.0, 3.0)
    exact = float(np.linalg.norm(dense_T(*layer, 4, 4), 2))
    scaled = (np.ldexp(layer[0], e),) + tuple(layer[1:])
    q = normalised_layer(scaled)
    theta = (exact / 2.0 ** (q.log2_scale - e)) ** 2
    b = gd.dense_gram_bound(q, 4, 4, theta)
    base = gd.dense_gram_bound(normalised_layer(layer), 4, 4, theta)
    assert b.upper == math.ldexp(base.upper, e)
    assert base.upper >= exact


def test_default_call_runs_it_where_a_gap_is_left_and_skips_it_where_not():
    """With the dense SVD and the deflated bound off (exact_max = gram_max = 1, deflated = majorant = False) the
    circulant embedding leaves a gap, so the default dense_gram stage runs and wins, above numpy's SVD of the SPEC
    operator and within 1e-6 of it; with the deflated bound on, a tight layer never reaches it (no entry, no
    seconds)."""
    rng = np.random.default_rng(6)
    mod, layer = _module(random_layer(rng, 2, 2, 3, 2.5, 3.0))
    exact = float(np.linalg.norm(dense_T(*layer, 5, 4), 2))
    r = ssog_lipschitz(mod, 5, 4, exact_max=1, gram_max=1, deflated=False, majorant=False, probabilistic=False)
    assert r.budget["dense_gram"] and r.best_method == "dense_gram"
    assert exact <= r.upper <= exact * (1 + 1e-6) and r.lower <= exact
    assert r.info["dense_gram"]["tries"] == 1
    tight = ssog_lipschitz(mod, 5, 4, exact_max=1, gram_max=1, probabilistic=False)
    assert tight.best_method == "deflated" and "dense_gram" not in tight.seconds
    off = ssog_lipschitz(mod, 5, 4, exact_max=1, gram_max=1, deflated=False, majorant=False, dense_gram=False,
                         ritz=False, probabilistic=False)
    assert "dense_gram" not in off.seconds and off.upper > r.upper


def test_size_rule():
    """Planned where N C fits dense_gram_max and the dense SVD does not; never in float32 or where asked off."""
    assert plan(8, 8, 384, 3).dense_gram and not plan(8, 8, 768, 12).dense_gram
    assert not plan(4, 4, 48, 3).dense_gram  # N C = 768: the dense SVD serves
    from lipcheck.bounds.options import CertifyOptions
    assert not plan(8, 8, 384, 3, CertifyOptions(dtype=torch.float32)).dense_gram
    assert not plan(8, 8, 384, 3, CertifyOptions(dense_gram=False)).dense_gram
    assert plan(16, 16, 384, 3, CertifyOptions(dense_gram=True)).dense_gram
    assert not plan(16, 16, 384, 3).dense_gram


def test_sigma_floor_layer_through_the_default_call():
    """Every sigma just above the floor (the kernels are shifts): the default call's dense Gram stage against numpy's
    SVD of the SPEC operator (its taps in log-sum-exp form: the plain sum underflows to 0/0)."""
    rng = np.random.default_rng(9)
    alpha, mu, _, WV, WO = random_layer(rng, 2, 2, 3, 3.0, 1.0)
    sigma = np.full(mu.shape, SIGMA_FLOOR * (1 + 1e-9))
    mod, layer = _module((alpha, mu, sigma, WV, WO))
    exact = float(np.linalg.norm(dense_T(*layer, 5, 5), 2))
    r = ssog_lipschitz(mod, 5, 5, exact_max=1, gram_max=1, deflated=False, majorant=False, probabilistic=False)
    assert r.best_method == "dense_gram" and exact <= r.upper <= exact * (1 + 1e-6), (r.upper, exact)


def _module(layer):
    """(an SSoG module holding the numbers of `layer`, the numbers it holds as read back: sigma passes through the
    softplus parametrisation) for the reference SVD."""
    alpha, mu, sigma, WV, WO = (torch.tensor(np.asarray(a), dtype=torch.float64) for a in layer)
    heads, M = alpha.shape
    mod = SSoG(WV.shape[0], heads, num_components=M).double()
    mod.set_gaussian_params(alpha, mu, sigma)
    with torch.no_grad():
        mod.v_proj.weight.copy_(WV.T)
        mod.o_proj.weight.copy_(WO.T)
    p = sp.ssog_params(mod)
    return mod, tuple(t.numpy() for t in (p.alpha, p.mu, p.sigma, p.WV, p.WO))


@pytest.mark.parametrize("n, nb", [(300, 64), (257, 256), (130, 1024)])
def test_blocked_in_place_cholesky_is_cholesky(n, nb):
    """rounding._blocked_cholesky_ (the in-place factorisation beyond LAPACK_MAX_N) against numpy's Cholesky: the same
    factor to rounding on a positive definite matrix; refused on an indefinite one and on one with a NaN."""
    from lipcheck import rounding
    rng = np.random.default_rng(n)
    X = rng.standard_normal((n, n))
    A = X @ X.T / n + np.eye(n)
    L = np.linalg.cholesky(A)
    S = torch.tensor(A)
    assert rounding._blocked_cholesky_(S, nb)
    assert np.abs(np.tril(S.numpy()) - L).max() <= 1e-12 * np.abs(L).max()
    B = A.copy()
    B[n - 1, n - 1] -= 2 * np.linalg.eigvalsh(A)[0] + 1e-3 + (A[n - 1, n - 1] - (L[n - 1, :n - 1] ** 2).sum())
    assert not rounding._blocked_cholesky_(torch.tensor(B), nb)
    C = A.copy()
    C[n // 2, 3] = C[3, n // 2] = math.nan
    assert not rounding._blocked_cholesky_(torch.tensor(C), nb)


def test_certificates_beyond_lapack_max_n_go_through_the_blocked_factorisation(monkeypatch):
    """With LAPACK_MAX_N lowered below the order, verified_lambda_max of a matrix with known spectrum (Q diag Q^T)
    goes through `_blocked_cholesky_` and stays above the true top eigenvalue, within 1e-9 of it."""
    from lipcheck import rounding
    calls = []
    real = rounding._blocked_cholesky_
    monkeypatch.setattr(rounding, "LAPACK_MAX_N", 100)
    monkeypatch.setattr(rounding, "_blocked_cholesky_", lambda A, *a: calls.append(A.shape) or real(A, 64))
    rng = np.random.default_rng(1)
    Q = np.linalg.qr(rng.standard_normal((300, 300)))[0]
    ev = np.linspace(-1.0, 2.0, 300)
    S = torch.tensor((Q * ev) @ Q.T)
    lam = float(rounding.verified_lambda_max(S, lam=torch.tensor(2.0)))
    assert calls and 2.0 <= lam <= 2.0 * (1 + 1e-9)
