"""The kernel's one home: Z against a long direct sum and the Jacobi-theta closed form; g sums to one;
axis matrices are Toeplitz in g; the 1-D symbol against its defining series."""
import math

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lipcheck import gaussian

SIGMAS = [0.1, 0.2, 0.35, 0.499, 0.5, 0.75, 1.0, 2.0, 5.0, 12.5, 50.0]
MUS = [0.0, 0.25, -0.5, 1.7, -3.3, 7.49]


def direct_Z(mu, sigma):
    j = np.arange(math.floor(mu) - 2000, math.floor(mu) + 2001, dtype=np.float64)
    return float(np.exp(-(j - mu) ** 2 / (2 * sigma**2)).sum())


def theta_Z(mu, sigma):
    # Poisson summation: Z = sqrt(2 pi) sigma theta_3(pi mu, q), q = exp(-2 pi^2 sigma^2)
    mpmath.mp.dps = 30
    q = mpmath.exp(-2 * mpmath.pi**2 * mpmath.mpf(sigma) ** 2)
    return float(mpmath.sqrt(2 * mpmath.pi) * sigma * mpmath.jtheta(3, mpmath.pi * mpmath.mpf(mu), q))


@pytest.mark.parametrize("sigma", SIGMAS)
def test_normaliser_matches_direct_sum_and_theta(sigma):
    mu = torch.tensor(MUS, dtype=torch.float64)
    Z = gaussian.normaliser(mu, torch.full_like(mu, sigma))
    for m, z in zip(MUS, Z.tolist()):
        assert z == pytest.approx(direct_Z(m, sigma), rel=1e-12)
        assert z == pytest.approx(theta_Z(m, sigma), rel=1e-12)


@settings(deadline=None, max_examples=60)
@given(mu=st.floats(-20, 20), sigma=st.floats(0.05, 60))
def test_kernel_sums_to_one_and_symbol_is_its_series(mu, sigma):
    mu_t, s_t = torch.tensor(mu, dtype=torch.float64), torch.tensor(sigma, dtype=torch.float64)
    k = torch.arange(math.floor(mu) - int(12 * sigma) - 12, math.floor(mu) + int(12 * sigma) + 13,
                     dtype=torch.float64)
    g = gaussian.kernel(k, mu_t, s_t)
    assert float(g.sum()) == pytest.approx(1.0, abs=1e-12)
    for w in (0.0, 0.3, 1.0, -2.5, math.pi):
        series = complex((g * torch.exp(-1j * k * w)).sum())
        value = complex(gaussian.symbol(torch.tensor(w, dtype=torch.float64), mu_t, s_t))
        assert abs(value - series) < 1e-12
        assert abs(value) <= 1 + 1e-14
    assert abs(complex(gaussian.symbol(torch.tensor(0.0, dtype=torch.float64), mu_t, s_t)) - 1) < 1e-13


def test_axis_matrix_is_toeplitz_in_g():
    mu = torch.tensor([[0.3, -1.2]], dtype=torch.float64)
    sigma = torch.tensor([[0.4, 2.5]], dtype=torch.float64)
    G = gaussian.axis_matrix(7, mu, sigma)
    assert G.shape == (1, 2, 7, 7)
    for c in range(2):
        for i in range(7):
            for ip in range(7):
                expect = math.exp(-(i - ip - mu[0, c].item()) ** 2 / (2 * sigma[0, c].item() ** 2)) / direct_Z(
                    mu[0, c].item(), sigma[0, c].item())
                assert G[0, c, i, ip].item() == pytest.approx(expect, rel=1e-12, abs=1e-300)
    # transpose flips the offset: G(mu)^T = G(-mu)
    assert torch.allclose(G.transpose(-1, -2), gaussian.axis_matrix(7, -mu, sigma), atol=1e-15)


def test_single_point_axis_and_integer_offsets():
    """n = 1 is a legal axis (a 1 x 1 grid): G_1 = [g(0)]; integer mu with no dtype is representable."""
    mu, sigma = torch.tensor([0.3], dtype=torch.float64), torch.tensor([0.7], dtype=torch.float64)
    G = gaussian.axis_matrix(1, mu, sigma)
    expect = math.exp(-0.3 ** 2 / (2 * 0.7 ** 2)) / direct_Z(0.3, 0.7)
    assert G.shape == (1, 1, 1) and G.item() == pytest.approx(expect, rel=1e-13)
    gaussian.check_representable(torch.tensor([2]), torch.tensor([0.7]))  # integer offsets: no refusal
    with pytest.raises(ValueError, match="n must be >= 1"):
        gaussian.axis_matrix(0, mu, sigma)


def test_non_positive_sigma_rejected():
    with pytest.raises(ValueError, match="sigma"):
        gaussian.normaliser(torch.tensor(0.0), torch.tensor(0.0))
    with pytest.raises(ValueError, match="axis length"):
        gaussian.axis_matrix(0, torch.tensor(0.0), torch.tensor(1.0))


# ------------------------------------------------------------------ log form, underflow, relative precision

def mp_log_Z(mu, sigma):
    """log Z in mpmath (no exponent range: no lattice term underflows)."""
    mpmath.mp.dps = 40
    m, s = mpmath.mpf(float(mu)), mpmath.mpf(float(sigma))
    c = int(mpmath.nint(m))
    R = int(13 * float(sigma)) + 20  # terms beyond are below exp(-84) relative
    return mpmath.log(mpmath.fsum(mpmath.exp(-(j - m) ** 2 / (2 * s * s)) for j in range(c - R, c + R + 1)))


def mp_g(k, mu, sigma):
    m, s = mpmath.mpf(float(mu)), mpmath.mpf(float(sigma))
    return mpmath.exp(-(k - m) ** 2 / (2 * s * s) - mp_log_Z(mu, sigma))


FLOOR = 1e-3
mus = st.one_of(st.floats(-30, 30), st.integers(-30, 30).map(lambda i: i + 0.5),
                st.tuples(st.integers(-30, 30), st.floats(-1e-6, 1e-6)).map(lambda t: t[0] + 0.5 + t[1]))
sigmas = st.one_of(st.floats(FLOOR, 0.06), st.floats(0.06, 80.0))


@settings(deadline=None, max_examples=40)
@given(mu=mus, sigma=sigmas, dt=st.sampled_from([torch.float64, torch.float32]))
def test_kernel_is_specs_g_in_relative_precision(mu, sigma, dt):
    """Against mpmath: log Z to the dtype's precision, and every tap that is a normal number of the dtype
    within the a-priori bound gaussian.tap_relative_error (sigma down to the floor, mu at half-integers,
    where every lattice term of Z underflows); taps below the smallest normal number err by less than it."""
    m = torch.tensor(mu, dtype=dt)
    s = torch.tensor(sigma, dtype=dt)
    mu_s, sig_s = float(m), float(s)  # the numbers actually stored in dtype
    lz = float(gaussian.log_normaliser(m, s))
    ref = float(mp_log_Z(mu_s, sig_s))
    assert abs(lz - ref) <= 64 * gaussian.unit_roundoff(dt) * (abs(ref) + 4)
    k = torch.arange(round(mu_s) - 6, round(mu_s) + 7, dtype=dt)
    g = gaussian.kernel(k, m, s)
    bound = gaussian.tap_relative_error(k, m, s)
    tiny = torch.finfo(dt).smallest_normal
    for kk, gv, b in zip(k.tolist(), g.tolist(), bound.tolist()):
        exact = mp_g(kk, mu_s, sig_s)
        if exact >= tiny:
            assert abs(gv / float(exact) - 1) <= b, (kk, gv, float(exact), b)
        else:
            assert abs(gv - float(exact)) <= tiny
    assert math.isfinite(lz) and bool(torch.isfinite(g).all())


def test_underflowing_lattice_is_still_normalised():
    """sigma near the floor, mu at a half-integer: exp(-(j - mu)^2 / (2 sigma^2)) underflows for every j, yet
    g(0) = g(1) = 1/2 exactly as SPEC's definition says (two equal nearest terms)."""
    for dt in (torch.float64, torch.float32):
        m, s = torch.tensor(0.5, dtype=dt), torch.tensor(0.0105, dtype=dt)
        assert float(gaussian.normaliser(m, s)) == 0.0  # Z itself is below the dtype's range
        g = gaussian.kernel(torch.tensor([-1.0, 0.0, 1.0, 2.0], dtype=dt), m, s)
        assert g.tolist() == pytest.approx([0.0, 0.5, 0.5, 0.0], abs=1e-30)


def test_representability_refusals():
    """half precision cannot carry a kernel near the sigma floor; float32/float64 can. The refusal names sigma."""
    mu, sigma = torch.tensor([0.5, 0.0]), torch.tensor([0.0105, 1.0])
    gaussian.check_representable(mu, sigma, torch.float32)
    gaussian.check_representable(mu.double(), sigma.double(), torch.float64)
    with pytest.raises(ValueError, match="sigma = 0.0105"):
        gaussian.check_representable(mu, sigma, torch.float16)
    with pytest.raises(ValueError, match="sigma"):
        gaussian.check_representable(torch.tensor(0.0), torch.tensor(1e-200, dtype=torch.float64))
    with pytest.raises(ValueError, match="finite"):
        gaussian.kernel(torch.tensor(0.0), torch.tensor(float("nan")), torch.tensor(1.0))
    with pytest.raises(ValueError, match="finite"):
        gaussian.normaliser(torch.tensor(0.0), torch.tensor(float("inf")))


@settings(deadline=None, max_examples=20)
@given(mu=mus, sigma=st.one_of(st.floats(FLOOR, 0.06), st.floats(0.06, 20.0)), w=st.floats(-math.pi, math.pi))
def test_symbol_within_its_error_bound(mu, sigma, w):
    """ghat(w) against mpmath's series, within the a-priori bound the certified bounds add (spectral.symbol_error)."""
    from lipcheck.bounds import spectral
    m = torch.tensor([[mu]], dtype=torch.float64)
    s = torch.tensor([[sigma]], dtype=torch.float64)
    v = complex(gaussian.symbol(torch.tensor(w, dtype=torch.float64), m, s)[0, 0])
    c = round(mu)
    R = int(12 * sigma) + 14
    mpmath.mp.dps = 40
    lz = mp_log_Z(mu, sigma)
    ref = mpmath.fsum(mpmath.exp(-(k - mpmath.mpf(mu)) ** 2 / (2 * mpmath.mpf(sigma) ** 2) - lz)
                      * mpmath.expj(-k * mpmath.mpf(w)) for k in range(c - R, c + R + 1))
    p = spectral.SSoGParams(torch.ones(1, 1, dtype=torch.float64), torch.stack([m, m], -1),
                            torch.stack([s, s], -1), torch.eye(1, dtype=torch.float64), torch.eye(1, dtype=torch.float64))
    bound = float(spectral.symbol_error(p)[0, 0, 0])
    assert abs(v - complex(ref)) <= bound, (v, complex(ref), bound)
    assert abs(v) <= 1 + bound


def test_unit_roundoff_and_gamma_n():
    """u = 2^-53 / 2^-24; gamma_n = n u / (1 - n u), infinite once n u >= 1 (Higham, Lemma 3.1)."""
    assert gaussian.unit_roundoff(torch.float64) == 2.0 ** -53
    assert gaussian.unit_roundoff(torch.float32) == 2.0 ** -24
    u = 2.0 ** -24
    for n in (1, 7, 1000, 2 ** 22):
        assert gaussian.gamma(n, torch.float32) == n * u / (1 - n * u)
    assert gaussian.gamma(2 ** 23, torch.float32) == 1.0  # n u = 1/2
    assert gaussian.gamma(2 ** 24, torch.float32) == math.inf  # n u = 1
    assert gaussian.gamma(3 * 2 ** 23, torch.float32) == math.inf  # n u = 3/2
    assert gaussian.gamma(2 ** 25, torch.float32) == math.inf


def test_refusal_names_the_offending_component_and_the_fix():
    mu = torch.tensor([[0.0, 0.5, -2.25]])
    sigma = torch.tensor([[1.0, 0.0105, 2.0]])
    with pytest.raises(ValueError, match=r"sigma = 0\.0105 \(mu = 0\.5\).*float32 or float64"):
        gaussian.check_representable(mu, sigma, torch.float16)
    with pytest.raises(ValueError, match=r"sigma = 1e-20 \(mu = -2\.25\).*use float64"):
        gaussian.check_representable(mu, torch.tensor([[1.0, 0.5, 1e-20]]), torch.float32)
    with pytest.raises(ValueError, match=r"^SSoG kernel not representable"):
        gaussian.check_representable(0.5, torch.tensor(0.0105), torch.float16, name="SSoG kernel")
    with pytest.raises(ValueError, match="must be finite"):
        gaussian.check_representable(mu, torch.tensor([[1.0, float("nan"), 1.0]]), torch.float32)
    with pytest.raises(ValueError, match="> 0"):
        gaussian.check_representable(mu, torch.tensor([[1.0, -1.0, 1.0]]), torch.float32)


def test_batched_symbol_and_kernel_match_their_scalar_values():
    """Broadcasting over a batch of (omega, mu, sigma) gives each element's own value (no mixing across the batch)."""
    mu = torch.tensor([0.3, -2.5, 7.49, 0.5], dtype=torch.float64)
    sigma = torch.tensor([0.2, 3.0, 0.011, 0.7], dtype=torch.float64)
    w = torch.tensor([0.4, -1.1, 2.9, math.pi], dtype=torch.float64)
    batch = gaussian.symbol(w, mu, sigma)
    k = torch.tensor([0.0, -3.0, 7.0, 1.0], dtype=torch.float64)
    gb = gaussian.kernel(k, mu, sigma)
    for i in range(4):
        assert complex(batch[i]) == complex(gaussian.symbol(w[i], mu[i], sigma[i]))
        # a frequency given as a Python number is read in mu's dtype (float64), not the default float32
        assert complex(batch[i]) == complex(gaussian.symbol(float(w[i]), mu[i], sigma[i]))
        assert float(gb[i]) == pytest.approx(float(mp_g(float(k[i]), float(mu[i]), float(sigma[i]))), rel=1e-12)
    assert gaussian.kernel(torch.tensor(1.0, dtype=torch.float32), torch.tensor(0.2, dtype=torch.float32),
                           torch.tensor(0.7, dtype=torch.float32)).dtype == torch.float32


def test_check_representable_reads_the_dtype_of_mu_and_the_exponent_limit():
    """Without a dtype the check is made in mu's own dtype: sigma = 1e-20 is a width float64 carries (2 sigma^2 =
    2e-40 is normal there) and float32 does not. And the exponent bound (2 R + 1) R / (2 sigma^2), R = DIRECT_TERMS,
    must be finite: at 2 sigma^2 = 5.5e-307 it overflows float64 (105 / 5.5e-307 > 1.8e308) and the kernel is refused,
    at 6e-307 (just inside: 105 / 6e-307 = 1.75e308) and 1e-305 it does not."""
    mu32, s32 = torch.tensor([0.3], dtype=torch.float32), torch.tensor([1e-20], dtype=torch.float32)
    with pytest.raises(ValueError, match="float32"):
        gaussian.check_representable(mu32, s32)
    gaussian.check_representable(mu32.double(), s32.double())  # float64: fine
    R = gaussian.DIRECT_TERMS
    for two_s2, refused in ((5.5e-307, True), (6.0e-307, False), (1e-305, False)):
        assert ((2 * R + 1) * R / two_s2 == math.inf) == refused
        sig = torch.tensor([math.sqrt(two_s2 / 2)], dtype=torch.float64)
        if refused:
            with pytest.raises(ValueError, match="not representable"):
                gaussian.check_representable(torch.zeros(1, dtype=torch.float64), sig)
        else:
            gaussian.check_representable(torch.zeros(1, dtype=torch.float64), sig)


def mp_moments(mu, sigma):
    """E[j - mu], E[(j - mu)^2] under p(j) ~ exp(-(j - mu)^2 / (2 sigma^2)) on the integers, by direct summation."""
    mpmath.mp.dps = 40
    m, s = mpmath.mpf(mu), mpmath.mpf(sigma)
    J = int(40 * sigma) + 12
    c = round(mu)
    w = [(mpmath.exp(-(j - m) ** 2 / (2 * s * s)), j - m) for j in range(c - J, c + J + 1)]
    Z = sum(a for a, _ in w)
    return sum(a * t for a, t in w) / Z, sum(a * t * t for a, t in w) / Z


@settings(deadline=None, max_examples=40)
@given(mu=mus, sigma=sigmas)
def test_closed_form_derivatives_of_log_z_and_log_g(mu, sigma):
    """d log Z / d(mu, sigma) = (E[j - mu] / sigma^2, E[(j - mu)^2] / sigma^3) and d log g(k) / d(mu, sigma) =
    ((k - mu) / sigma^2, (k - mu)^2 / sigma^3) minus them, against high-precision direct sums, down to the
    sigma floor (a near-delta kernel: derivatives of order 1e-300 that no cancellation may swamp)."""
    m, s = torch.tensor(mu, dtype=torch.float64), torch.tensor(sigma, dtype=torch.float64)
    mu_s, sig_s = float(m), float(s)
    e1, e2 = mp_moments(mu_s, sig_s)
    d_mu, d_sigma = gaussian.log_normaliser_grad(m, s)
    u = gaussian.unit_roundoff(torch.float64)
    assert abs(float(d_mu) - float(e1 / sig_s**2)) <= 256 * u * (1 + 1 / sig_s**2)
    assert abs(float(d_sigma) - float(e2 / sig_s**3)) <= 256 * u * (1 + 1 / sig_s**3) * (1 + float(e2))
    r = 8
    g, dl_mu, dl_sigma = gaussian.lattice_taps(r, m, s, derivatives=True)
    assert torch.equal(g, gaussian.kernel(torch.arange(-r, r + 1, dtype=torch.float64), m, s))
    for i, k in enumerate(range(-r, r + 1)):
        km = mpmath.mpf(k) - mpmath.mpf(mu_s)
        ref_mu, ref_sigma = (km - e1) / sig_s**2, (km * km - e2) / sig_s**3
        a = abs(float(km)) + 1 + math.sqrt(float(e2))
        # The forms of _dlog_moments: an absolute error of a few roundings of (|k - mu| + 1 + sqrt E[(j - mu)^2])^p
        # / sigma^q; where g itself is below 1e-300 its derivative is irrelevant (multiplied by g): only finiteness.
        assert math.isfinite(float(dl_mu[i])) and math.isfinite(float(dl_sigma[i]))
        if float(g[i]) > 1e-300:
            assert abs(float(dl_mu[i]) - float(ref_mu)) <= 256 * u * a / sig_s**2, (k, float(dl_mu[i]), ref_mu)
            assert abs(float(dl_sigma[i]) - float(ref_sigma)) <= 256 * u * a * a / sig_s**3, (k, float(dl_sigma[i]))


def test_taps_derivatives_are_autograd_of_the_kernel():
    """sum_k grad_k g(k) d log g(k) (the closed form the SSoG backward uses) equals autograd through `kernel`."""
    gen = torch.Generator().manual_seed(4)
    mu = (torch.rand(5, 3, 2, generator=gen, dtype=torch.float64) * 12 - 6).requires_grad_()
    sigma = torch.exp(torch.rand(5, 3, 2, generator=gen, dtype=torch.float64) * math.log(2000) + math.log(0.02))
    sigma.requires_grad_()
    r = 20
    g = gaussian.kernel(torch.arange(-r, r + 1, dtype=torch.float64), mu[..., None], sigma[..., None])
    w = torch.randn(g.shape, generator=gen, dtype=torch.float64)
    a_mu, a_sigma = torch.autograd.grad((g * w).sum(), (mu, sigma))
    g2, d_mu, d_sigma = gaussian.lattice_taps(r, mu.detach(), sigma.detach(), derivatives=True)
    scale = (w.abs() * g2).sum(-1) * (1 + r / sigma.detach() ** 2 + r * r / sigma.detach() ** 3)
    assert ((a_mu - (w * g2 * d_mu).sum(-1)).abs() <= 1e-13 * scale).all()
    assert ((a_sigma - (w * g2 * d_sigma).sum(-1)).abs() <= 1e-13 * scale).all()
