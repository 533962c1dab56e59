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


def test_non_positive_sigma_rejected():
    with pytest.raises(ValueError, match="sigma"):
        gaussian.normaliser(torch.tensor(0.0), torch.tensor(0.0))
    with pytest.raises(ValueError, match="axis length"):
        gaussian.axis_matrix(0, torch.tensor(0.0), torch.tensor(1.0))
