"""lipcheck.symbolic against numerics: theta-function closed forms, sup|GELU'|, LayerNorm's Jacobian bound."""
import math

import pytest
import torch

from lipcheck import gaussian, symbolic

F64 = torch.float64


@pytest.mark.parametrize("mu,sigma", [(0.3, 0.4), (-1.7, 1.2), (2.5, 3.0)])
def test_theta_forms_match_lattice_sums_and_gaussian_module(mu, sigma):
    z_theta = symbolic.evaluate(symbolic.normaliser_theta(12), mu=mu, sigma=sigma)
    z_lat = symbolic.evaluate(symbolic.normaliser_lattice(40), mu=mu, sigma=sigma)
    assert abs(z_theta - z_lat) < 1e-12 * abs(z_lat)
    z_num = float(gaussian.normaliser(torch.tensor(mu, dtype=F64), torch.tensor(sigma, dtype=F64)))
    assert z_num == pytest.approx(z_lat.real, rel=1e-12)
    for w in (0.0, 0.7, -2.9):
        s_theta = symbolic.evaluate(symbolic.symbol_theta(8), mu=mu, sigma=sigma, omega=w)
        s_lat = symbolic.evaluate(symbolic.symbol_lattice(40), mu=mu, sigma=sigma, omega=w)
        s_num = complex(gaussian.symbol(torch.tensor(w, dtype=F64), torch.tensor(mu, dtype=F64),
                                        torch.tensor(sigma, dtype=F64)))
        assert abs(s_theta - s_lat) < 1e-12 and abs(s_num - s_lat) < 1e-12
        assert abs(s_lat) <= 1 + 1e-14


@pytest.mark.parametrize("variant,approximate", [("exact", "none"), ("tanh", "tanh")])
def test_gelu_derivative_sup_matches_a_dense_scan(variant, approximate):
    x = torch.linspace(-8, 8, 400001, dtype=F64, requires_grad=True)
    (d,) = torch.autograd.grad(torch.nn.functional.gelu(x, approximate=approximate).sum(), x)
    sup = symbolic.gelu_derivative_sup(variant)
    assert float(d.abs().max()) <= sup * (1 + 1e-12)
    assert float(d.abs().max()) == pytest.approx(sup, rel=1e-9)
    if variant == "exact":
        assert symbolic.gelu_critical_point() == pytest.approx(math.sqrt(2), rel=1e-12)
        assert sup == pytest.approx(0.5 * (1 + math.erf(1)) + math.sqrt(2) * math.exp(-1) / math.sqrt(2 * math.pi), rel=1e-14)


@pytest.mark.parametrize("var", [0.0, 1e-8, 0.3, 4.0])
def test_layernorm_bound_matches_jacobian_norms(var):
    torch.manual_seed(0)
    C, eps = 8, 1e-6
    ln = torch.nn.LayerNorm(C, eps=eps, dtype=F64)
    with torch.no_grad():
        ln.weight.uniform_(-2, 2)
    bound = symbolic.layernorm_lipschitz(float(ln.weight.abs().max()), eps, var)
    worst = 0.0
    for _ in range(20):
        x = torch.randn(C, dtype=F64)
        x = (x - x.mean()) / x.std(unbiased=False) * math.sqrt(var) + 3.0 if var > 0 else torch.full((C,), 3.0, dtype=F64)
        J = torch.autograd.functional.jacobian(ln, x)
        worst = max(worst, float(torch.linalg.matrix_norm(J, ord=2)))
    assert worst <= bound * (1 + 1e-9)
    if var == 0.0:  # the global constant is attained at a constant token when gamma is constant
        ln.weight.data.fill_(1.5)
        J = torch.autograd.functional.jacobian(ln, torch.full((C,), 3.0, dtype=F64))
        assert float(torch.linalg.matrix_norm(J, ord=2)) == pytest.approx(
            symbolic.layernorm_lipschitz(1.5, eps), rel=1e-9)


def test_layernorm_bad_inputs():
    with pytest.raises(ValueError, match="eps"):
        symbolic.layernorm_lipschitz(1.0, 0.0)
    with pytest.raises(ValueError, match="finite"):
        symbolic.layernorm_lipschitz(float("nan"), 1e-6)
