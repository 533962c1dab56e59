"""lipcheck.wellposed: tolerance sweeps, Gronwall growth and the a-posteriori certificate, checked against
exact solutions (the linear field F(x) = T x + b solved by expm) and known convergence orders."""
import copy
import importlib
import math

import mpmath
import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lipcheck import IntegrationError, ViT, vit_from_preset
from lipcheck import wellposed as wp
from lipcheck.wellposed.certificate import _quartic_fit, _upper_sum
from lipcheck.wellposed.solve import ENCLOSE_SSOG_BACKEND

D = torch.float64
LINEAR = dict(img_size=12, patch_size=4, dim=12, num_heads=3, num_components=2, depth=1, num_classes=3,
              use_norm=False, use_mlp=False)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def linear_model(seed=0, scale=0.3, **kw):
    """ODE ViT with F(x) = T x + b exactly: no LayerNorm, no MLP, frozen kernels."""
    torch.manual_seed(seed)
    model = ViT("ode", "ssog", dtype=D, **{**LINEAR, **kw})
    layer = model.vector_field.block.mixer.freeze_kernels()
    with torch.no_grad():
        for p in (layer.v_proj.weight, layer.o_proj.weight):
            p.normal_(std=scale)
        layer.o_proj.bias.normal_()
    return model, layer


def small_block(mixer, seed, *, num_components=2):
    """The block of a 1-layer ODE ViT (8 channels, 2 heads, pre-LN, MLP) with every parameter drawn N(0, 0.5^2)."""
    torch.manual_seed(seed)
    model = ViT("ode", mixer, dtype=D, img_size=8, patch_size=2, dim=8, num_heads=2, num_components=num_components,
                depth=1)
    block = model.vector_field.block
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.5)
    return block

def augmented_matrix(layer, H, W):
    """[[T, b], [0, 0]] on row-major vec(X), T = sum_h kron(K_h, P_h^T), b tiled over tokens."""
    K = layer.operator_matrix(H, W).detach()
    P = layer.head_projections().detach()
    T = sum(torch.kron(K[h].contiguous(), P[h].T.contiguous()) for h in range(layer.num_heads)).numpy()
    b = np.tile(layer.o_proj.bias.detach().numpy(), H * W)
    n = T.shape[0]
    A = np.zeros((n + 1, n + 1))
    A[:n, :n], A[:n, n] = T, b
    return A, T


def exact(A, x0, t):
    """Rows of exp(A t) [vec x0; 1] for every sample of x0 (B, H, W, C)."""
    n = A.shape[0] - 1
    Z = np.concatenate([x0.reshape(x0.shape[0], -1).numpy(), np.ones((x0.shape[0], 1))], axis=1)
    return (scipy.linalg.expm(A * t) @ Z.T).T[:, :n]


def test_linear_sweep_reference_and_errors_match_expm():
    model, layer = linear_model()
    images = torch.randn(2, 3, 12, 12, dtype=D)
    x0 = model.embed(images).detach()
    A, _ = augmented_matrix(layer, 3, 3)
    truth = exact(A, x0, model.t1)
    res = wp.tolerance_sweep(model, images, ("dopri5", "dopri8", "rk4"), (1e-3, 1e-6, 1e-10),
                             rk4_steps=(8, 16, 32), progress=False)
    ref = res.reference.states[-1].reshape(2, -1).numpy()
    rel = np.linalg.norm(ref - truth, axis=1) / np.linalg.norm(truth, axis=1)
    assert rel.max() < 1e-12, rel  # the converged reference is the exact solution to ~1e-12
    assert rel.max() <= 10 * res.reference.error_estimate + 1e-15  # and its estimate is honest
    assert np.linalg.norm(truth - x0.reshape(2, -1).numpy()) > 0.1  # the flow moved the state
    for r in res.runs:  # the reported error is the error against the exact solution
        key = (r["method"], r["tol"] if r["tol"] is not None else r["steps"])
        got = res.finals[key].reshape(2, -1).numpy()
        err = np.linalg.norm(got - truth, axis=1) / np.linalg.norm(truth, axis=1)
        assert abs(err.max() - r["error"]) <= 1e-11 + 1e-6 * r["error"], (r, err)
    tight = {r["method"]: r["error"] for r in res.runs if r["tol"] == 1e-10}
    assert tight["dopri5"] < 1e-8 and tight["dopri8"] < 1e-8
    assert res.mixer == "ssog" and all(r["mixer"] == "ssog" for r in res.runs)


def test_the_sweep_ends_on_t1_in_the_models_dtype():
    """t1 = 0.3 is not a float32 number: the sweep's reference and runs must end on float64's 0.3 (expm there),
    not on float32's 0.30000001 (a relative error of ~1e-8 in the end time would show as ~1e-8 in the state)."""
    model, layer = linear_model(seed=2, t1=0.3)
    images = torch.randn(1, 3, 12, 12, dtype=D)
    x0 = model.embed(images).detach()
    A, _ = augmented_matrix(layer, 3, 3)
    truth = exact(A, x0, 0.3)
    res = wp.tolerance_sweep(model, images, ("dopri8",), (1e-10,), progress=False)
    ref = res.reference.states[-1].reshape(1, -1).numpy()
    assert model.t1 == 0.3 and np.linalg.norm(ref - truth) / np.linalg.norm(truth) < 1e-11
    assert res.runs[0]["error"] < 1e-9


def test_linear_gronwall_and_power_iteration_against_expm():
    model, layer = linear_model(seed=1)
    images = torch.randn(1, 3, 12, 12, dtype=D)
    A, T = augmented_matrix(layer, 3, 3)
    g = wp.perturbation_growth(model, images, grid=16, power_iters=10, power_steps=16, eps=1e-2)
    # linear flow: y - x = exp(T t)(y0 - x0), so the worst growth at t1 is ||exp(T t1)||_2
    top = np.linalg.norm(scipy.linalg.expm(T * model.t1), 2)
    worst = g["directions"]["worst"]["growth_t1"][0]
    # power iteration approaches ||exp(T t1)||_2 from below (never above it), and beats a random direction
    assert top * 0.9 <= worst <= top * (1 + 1e-6), (worst, top)
    assert worst > g["directions"]["random"]["growth_t1"][0]
    # with no LayerNorm the local constant is the global one, ||T||_2 <= L; no sampled time exceeds exp(L t)
    assert g["L_local"] == g["L_global"] >= np.linalg.norm(T, 2) * (1 - 1e-9)
    assert g["violations"] == {"global": 0, "local": 0}
    for d in g["directions"].values():
        for k, tk in enumerate(g["t"]):
            assert d["growth"][0][k] <= math.exp(np.linalg.norm(T, 2) * tk) * (1 + 1e-9)


def test_linear_certificate_bounds_the_exact_error():
    model, layer = linear_model(seed=2)
    images = torch.randn(1, 3, 12, 12, dtype=D)
    A, T = augmented_matrix(layer, 3, 3)
    c = wp.aposteriori_certificate(model, images, tol=1e-3, per_step=8)
    assert (c["method"], c["tol"]) == ("dopri5", 1e-3)
    # per_step=None: an even count >= 8 per accepted step, so at least 8 intervals per step on the shared grid
    d = wp.aposteriori_certificate(model, images, tol=1e-3)
    assert len(d["t"]) >= 8 * d["accepted"] + 1 and d["violations"] == 0
    # the dense output it certified, recomputed, against the exact solution at every sampled time
    block, x0, _ = wp.prepare(model, images)
    y, _ = wp.solve(block, x0, torch.tensor(c["t"], dtype=D), "dopri5", tol=1e-3)
    truth = np.stack([exact(A, x0, t)[0] for t in c["t"]])
    err = np.linalg.norm(y[:, 0].reshape(len(c["t"]), -1).numpy() - truth, axis=1)
    assert np.allclose(err, c["actual"][0], rtol=1e-6, atol=1e-12)  # "actual" is the true error
    assert 1e-8 < err.max() < 1e-1  # a loose solve: a visible error, far below the state
    assert c["L"] >= np.linalg.norm(T, 2) * (1 - 1e-9)  # no LayerNorm: the constant is global, >= ||T||
    assert c["violations"] == 0
    assert np.all(np.array(c["bound"][0][1:]) >= err[1:])


def test_the_certificate_ends_on_t1_and_runs_in_the_asked_dtype(monkeypatch):
    """t1 = 0.3 is not a float32 number: the certificate's last sampled time is float64's 0.3, where its actual
    error is the exact one (expm); with dtype=float32 the solve runs in float32 (its actual error is float32's
    round-off above the float64 run's)."""
    model, layer = linear_model(seed=2, t1=0.3)
    images = torch.randn(1, 3, 12, 12, dtype=D)
    c = wp.aposteriori_certificate(model, images, tol=1e-3, per_step=8)
    assert c["t"][-1] == 0.3
    A, _ = augmented_matrix(layer, 3, 3)
    block, x0, _ = wp.prepare(model, images)
    y, _ = wp.solve(block, x0, torch.tensor(c["t"], dtype=D), "dopri5", tol=1e-3)
    err = float(np.linalg.norm(y[-1, 0].reshape(-1).numpy() - exact(A, x0, 0.3)[0]))
    assert c["actual_t1"][0] == pytest.approx(err, rel=1e-6)
    # the float32 run's constants as the float64 run found them (certifying them in float32 costs 35 s here)
    import lipcheck.wellposed.certificate as cert
    monkeypatch.setattr(cert, "vector_field_constants", lambda *a, **kw: (c["L_global"], c["L"], None))
    f = wp.aposteriori_certificate(model, images, tol=1e-3, per_step=8, dtype=torch.float32, reference_rtol=1e-6)
    assert f["t"][-1] == pytest.approx(0.3, rel=1e-7) and f["t"][-1] != 0.3  # float32's 0.3
    assert f["actual_t1"][0] != c["actual_t1"][0]
    # the dense output's round-off margin is float32's, not float64's
    assert f["derivative_roundoff_margin"] > 1e6 * c["derivative_roundoff_margin"] > 0


def test_tiny_model_sweep_converges():
    torch.manual_seed(0)
    model = vit_from_preset("tiny", "ode", "ssog", dtype=D)
    with torch.no_grad():  # O(1) weights: a field that moves the state (as the experiment's default)
        for mod in model.vector_field.block.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.normal_(0.0, 1.0 / math.sqrt(mod.in_features))
    images = torch.randn(1, 3, 32, 32, dtype=D)
    res = wp.tolerance_sweep(model, images, ("dopri5", "dopri8", "rk4"), (1e-2, 1e-6, 1e-10),
                             rk4_steps=(8, 16, 32, 64), progress=False)
    assert res.reference.error_estimate < 1e-12
    conv = res.convergence["per_method"]
    for m in ("dopri5", "dopri8"):
        assert conv[m]["orders_gained"] >= 3, conv[m]
        assert conv[m]["tightest"]["error"] < 1e-7
        # the end points of the sweep, as the runs recorded them
        runs = {r["tol"]: r["error"] for r in res.runs if r["method"] == m}
        assert conv[m]["loosest"] == {"tol": 1e-2, "error": runs[1e-2]}
        assert conv[m]["tightest"] == {"tol": 1e-10, "error": runs[1e-10]}
    assert abs(conv["rk4"]["slope"] - 4) <= 0.3, conv["rk4"]
    assert all(3.5 < o < 4.5 for o in conv["rk4"]["order_per_halving"])
    assert res.convergence["spread"] < 1e-7  # one limit trajectory
    for r in res.runs:
        if r["tol"] is not None:  # step accounting: every accepted or rejected attempt costs its stages
            stages = wp.STAGES[r["method"]]
            assert r["nfe"] >= stages * (r["accepted"] + r["rejected"])
        else:
            assert r["nfe"] == 4 * r["steps"] and r["accepted"] == r["steps"]


@settings(deadline=None, max_examples=25)
@given(st.integers(0, 10_000), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(1e-3, 10.0))
def test_segment_variance_floor_is_a_lower_bound(seed, s, tau, scale):
    g = torch.Generator().manual_seed(seed)
    xa = torch.randn(2, 1, 2, 2, 5, dtype=D, generator=g) * scale  # two sampled times
    xb = xa + torch.randn(2, 1, 2, 2, 5, dtype=D, generator=g) * scale * 0.5
    # between the samples the states move along straight lines; drift = the largest token displacement
    drift_a = float((xa[1] - xa[0]).norm(dim=-1).max())
    drift_b = float((xb[1] - xb[0]).norm(dim=-1).max())
    floor = wp.segment_variance_floor(xa, xb, drift_a, drift_b)
    za, zb = xa[0] + tau * (xa[1] - xa[0]), xb[0] + tau * (xb[1] - xb[0])
    z = zb + s * (za - zb)  # a point of the segment [xa(t), xb(t)] at an unsampled time t
    assert float(z.var(dim=-1, unbiased=False).min()) >= floor * (1 - 1e-12) - 1e-15
    # with no movement the floor is the segment's own: attained up to the triangle inequality's slack
    still = wp.segment_variance_floor(xa[:1].expand(2, -1, -1, -1, -1), xb[:1].expand(2, -1, -1, -1, -1), 0.0, 0.0)
    z0 = xb[0] + s * (xa[0] - xb[0])
    assert float(z0.var(dim=-1, unbiased=False).min()) >= still * (1 - 1e-12) - 1e-15


@settings(deadline=None, max_examples=10)
@given(st.integers(0, 10_000), st.sampled_from(["ssog", "attention"]), st.floats(0.01, 100.0))
def test_token_speed_bound_holds(seed, mixer, scale):
    block = small_block(mixer, seed, num_components=2)
    x = torch.randn(3, 4, 4, 8, dtype=D) * scale
    with torch.no_grad():
        speed = float(block.vector_field(x).norm(dim=-1).max())
    assert speed <= wp.token_speed_bound(block) * (1 + 1e-12)


@pytest.mark.parametrize("mixer", ["ssog", "attention"])
def test_token_speed_bound_holds_where_the_output_bias_dominates(mixer):
    """With the mixer's output bias 100x the weights, every token's speed is about ||b_O||: a bound that
    subtracts the bias (or drops it) falls below the speed actually measured."""
    block = small_block(mixer, 3, num_components=2)
    with torch.no_grad():
        block.mixer.o_proj.bias.mul_(100)
        speed = float(block.vector_field(torch.randn(3, 4, 4, 8, dtype=D)).norm(dim=-1).max())
    bound = wp.token_speed_bound(block)
    assert speed >= 0.5 * float(block.mixer.o_proj.bias.norm()) and speed <= bound * (1 + 1e-12)


def test_quartic_fit_differentiates_exactly():
    x = torch.linspace(0, 1, 9, dtype=D)
    c = torch.tensor([0.3, -1.0, 2.0, 0.5, -0.7], dtype=D)
    Y = sum(c[k] * x ** k for k in range(5))[:, None]
    coef, slope_err = _quartic_fit(x, Y)
    assert torch.allclose(coef[:, 0], c, atol=1e-12)
    assert slope_err < 1e-9  # a generous round-off margin, still far below any defect it guards


# ------------------------------------------------------------------------------------------- bad inputs

class Blowup(torch.nn.Module):
    """x' = x^2 from x0 = 1: x(t) = 1 / (1 - t), infinite at t = 1."""
    def vector_field(self, x):
        return x * x


class NaNField(torch.nn.Module):
    def vector_field(self, x):
        return torch.where(x > 1.5, torch.full_like(x, float("nan")), torch.ones_like(x))


def test_bad_tolerances_and_methods_raise_clear_errors():
    model, _ = linear_model()
    images = torch.randn(1, 3, 12, 12, dtype=D)
    for bad in (0.0, -1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tolerances must be positive"):
            wp.tolerance_sweep(model, images, ("dopri5",), (1e-3, bad), progress=False)
    with pytest.raises(ValueError, match="unknown solver method 'rk45'"):
        wp.tolerance_sweep(model, images, ("dopri5", "rk45"), (1e-3,), progress=False)
    with pytest.raises(ValueError, match="at least one"):
        wp.tolerance_sweep(model, images, (), (1e-3,), progress=False)
    with pytest.raises(ValueError, match="ODE ViT"):
        wp.tolerance_sweep(ViT("discrete", "ssog", **LINEAR), images, ("dopri5",), (1e-3,), progress=False)
    with pytest.raises(ValueError, match="eps must be"):
        wp.perturbation_growth(model, images, eps=0.0)
    with pytest.raises(ValueError, match="per_step"):
        wp.aposteriori_certificate(model, images, per_step=5)
    with pytest.raises(ValueError, match="adaptive"):
        wp.aposteriori_certificate(model, images, method="rk4")
    with pytest.raises(ValueError, match="images must be finite"):
        wp.tolerance_sweep(model, images * float("nan"), ("dopri5",), (1e-3,), progress=False)


def test_solver_failures_raise_integration_error_with_t_nfe_and_norm():
    x0 = torch.ones(1, 1, 1, 1, dtype=D)
    t = torch.tensor([0.0, 2.0], dtype=D)
    # blow-up at t = 1: the adaptive step underflows or the state turns non-finite, never a silent number
    with pytest.raises(IntegrationError) as e:
        wp.solve(Blowup(), x0, t, "dopri5", tol=1e-8)
    assert 0.9 < e.value.t <= 1.0 + 1e-6 and e.value.nfe > 10 and e.value.state_norm > 1e3
    # too many steps
    with pytest.raises(IntegrationError, match="too many steps") as e:
        wp.solve(Blowup(), x0, torch.tensor([0.0, 0.99], dtype=D), "dopri5", tol=1e-10, max_num_steps=3)
    assert e.value.nfe > 0 and e.value.t > 0 and e.value.state_norm >= 1.0
    # a non-finite state: F turns NaN once x passes 1.5 (x' = 1 from 1, so at t = 0.5)
    with pytest.raises(IntegrationError, match="non-finite") as e:
        wp.solve(NaNField(), x0, t, "rk4", steps=8)
    assert 0.5 <= e.value.t <= 1.0 and e.value.nfe > 0 and not math.isfinite(e.value.state_norm)


def test_gronwall_checker_flags_a_too_small_constant():
    """x' = x^2 from x0 = 1: x = 1/(1 - t); a perturbation grows like dx/dx0 = 1/(1 - t)^2. A constant taken at
    the initial state only (f'(x0) = 2) is too small later on: exp(2 t) < 1/(1 - t)^2 for t in (0, 1)."""
    t = torch.linspace(0.0, 0.9, 19, dtype=torch.float64)
    growth = (1 / (1 - t) ** 2)[:, None]
    assert wp.envelope_violations(t, growth, 2.0) > 0  # the local constant from x0 only is caught
    L_path = float(2 / (1 - t[-1]))  # f'(x(t)) <= 2 / (1 - 0.9) along the whole path: a valid constant
    assert wp.envelope_violations(t, growth, L_path) == 0
    assert wp.envelope_violations(t, growth, -1.0) == len(t) - 1
    with pytest.raises(ValueError, match="finite"):
        wp.envelope_violations(t, growth, float("nan"))


def test_aposteriori_certificate_with_a_too_small_constant_reports_violations(one_thread):
    from lipcheck import vit_from_preset
    torch.manual_seed(0)
    model = vit_from_preset("tiny", "ode", "ssog", dtype=torch.float64)
    with torch.no_grad():
        for mod in model.vector_field.block.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.normal_(0.0, 1.0 / math.sqrt(mod.in_features))
    images = torch.randn(1, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    bad = wp.aposteriori_certificate(model, images, tol=1e-3, per_step=8, lipschitz=-30.0)
    assert bad["violations"] > 0 and bad["L"] == -30.0
    # L = 0 (a constant field's, or one supplied): finite bounds, the defect integrated plainly, never NaN
    zero = wp.aposteriori_certificate(model, images, tol=1e-3, per_step=8, lipschitz=0.0)
    assert zero["L"] == 0.0 and all(math.isfinite(b) for row in zero["bound"] for b in row)
    assert zero["violations"] == sum(b < a for bs, as_ in zip(zero["bound"], zero["actual"])
                                     for b, a in zip(bs[1:], as_[1:]))


def test_upper_sum_is_the_closed_form_gronwall_integral():
    """Constant defect d, constant L: B(t) = d (e^{L t} - 1) / L exactly, on a non-uniform grid."""
    grid = torch.tensor([0.0, 0.1, 0.35, 0.4, 1.0, 1.7], dtype=D)
    for L, d in ((2.0, 0.3), (-1.5, 0.7), (0.01, 1.0), (0.0, 0.4)):
        got = _upper_sum(torch.full((6,), d, dtype=D), grid, L)
        want = d * np.expm1(L * grid.numpy()) / L if L else d * grid.numpy()  # L = 0: the limit d t
        assert np.allclose(got.numpy(), want, rtol=1e-13, atol=0), (L, got, want)
    # a defect only on the last interval [1.0, 1.7]: the larger endpoint value, integrated from 1.0 on
    delta = torch.tensor([0, 0, 0, 0, 0, 2.0], dtype=D)
    got = _upper_sum(delta, grid, 3.0)
    assert float(got[4]) == 0.0 and abs(float(got[5]) - 2.0 * math.expm1(3.0 * 0.7) / 3.0) <= 1e-13
    # a defect on the first interval only, then carried: B(t) = d tau1 phi e^{L (t - tau1)}
    delta = torch.tensor([0.5, 0, 0, 0, 0, 0], dtype=D)
    got = _upper_sum(delta, grid, 3.0)
    first = 0.5 * math.expm1(0.3) / 3.0
    assert np.allclose(got[1:].numpy(), first * np.exp(3.0 * (grid[1:].numpy() - 0.1)), rtol=1e-13)


def test_quartic_fit_slope_error_covers_noisy_samples():
    """Samples of a quartic with a perturbation r: the fitted derivative is within slope_err of the true one."""
    x = torch.linspace(0, 1, 9, dtype=D)
    c = torch.tensor([0.3, -1.0, 2.0, 0.5, -0.7], dtype=D)
    g = torch.Generator().manual_seed(0)
    for r in (1e-6, 1e-3):
        noise = r * (2 * torch.rand(9, 3, generator=g, dtype=D) - 1)
        Y = sum(c[k] * x ** k for k in range(5))[:, None] + noise
        coef, slope_err = _quartic_fit(x, Y)
        s = torch.linspace(0, 1, 101, dtype=D)
        fit = sum(k * coef[k][None] * s[:, None] ** (k - 1) for k in range(1, 5))
        true = sum(k * c[k] * s ** (k - 1) for k in range(1, 5))[:, None]
        worst = float((fit - true).abs().max())
        assert worst <= slope_err, (r, worst, slope_err)
        assert slope_err <= 1e6 * r  # and not absurd


def test_convergence_summary_recovers_known_orders():
    """Synthetic runs with error = 2 tol^0.8 (adaptive) and 3 h^4 (fixed): the fitted slopes are these exponents,
    runs below floor_factor * reference error are left out of the fit."""
    runs = [dict(method="dopri5", tol=t, steps=None, error=2 * t ** 0.8) for t in (1e-2, 1e-4, 1e-6)]
    runs.append(dict(method="dopri5", tol=1e-12, steps=None, error=1e-13))  # at the floor: not fitted
    runs += [dict(method="rk4", tol=None, steps=n, step_size=1.0 / n, error=3 * (1.0 / n) ** 4) for n in (8, 16, 32)]
    s = wp.convergence_summary(runs, reference_error=1e-14)
    dp, rk = s["per_method"]["dopri5"], s["per_method"]["rk4"]
    assert dp["kind"] == "adaptive" and abs(dp["slope"] - 0.8) < 1e-12 and dp["fitted_points"] == 3
    assert abs(dp["orders_gained"] - math.log10(2 * 1e-2 ** 0.8 / 1e-13)) < 1e-12
    assert rk["kind"] == "fixed" and abs(rk["slope"] - 4.0) < 1e-12
    assert np.allclose(rk["order_per_halving"], [4.0, 4.0], atol=1e-12)
    assert abs(s["slope"] - 0.8) < 1e-12 and s["tightest_tol"] == 1e-12 and s["max_error_at_tightest"] == 1e-13
    assert s["spread"] is None  # no final states given
    # the spread between methods at the tightest tolerance: the largest relative distance of their final states
    two = runs + [dict(method="dopri8", tol=1e-12, steps=None, error=2e-13)]
    assert wp.convergence_summary(two, reference_error=1e-14)["spread"] is None
    x = torch.ones(1, 2, 2, 3, dtype=D)
    finals = {("dopri5", 1e-12): x, ("dopri8", 1e-12): x * (1 + 1e-9)}
    assert wp.convergence_summary(two, reference_error=1e-14, finals=finals)["spread"] == pytest.approx(1e-9, rel=1e-6)
    assert wp.convergence_summary(runs, reference_error=1e-14, finals={("dopri5", 1e-12): x})["spread"] is None
    assert rk["finest"] == {"steps": 32, "error": 3 * (1.0 / 32) ** 4} and s["floor"] == 100 * 1e-14  # the default
    # fixed steps only: no pooled adaptive numbers; a reference error of 0 still leaves a floor (100 x 1e-16)
    fixed = wp.convergence_summary([r for r in runs if r["tol"] is None], reference_error=0.0)
    assert set(fixed) == {"per_method", "floor"} and fixed["floor"] == 100 * 1e-16
    one = wp.convergence_summary(runs[:1], reference_error=1e-14)["per_method"]["dopri5"]
    assert one["slope"] is None and one["fitted_points"] == 1  # one point fits no slope


def _gronwall_sum(t, d, L):
    """sum_j e^{L (t_i - t_{j+1})} max(d_j, d_{j+1}) (e^{L tau_j} - 1) / L at every t_i (numpy)."""
    out = np.zeros(len(t))
    for i in range(1, len(t)):
        tau = t[1:i + 1] - t[:i]
        dm = np.maximum(d[:i], d[1:i + 1])
        out[i] = np.sum(dm * np.expm1(L * tau) / L * np.exp(L * (t[i] - t[1:i + 1])))
    return out


def test_linear_certificate_bound_is_the_gronwall_sum_of_its_defect():
    """The reported bound recomputed here from the reported defect and L: the exact exponential integral
    sum_j e^{L (t - t_{j+1})} max(d_j, d_{j+1}) (e^{L tau_j} - 1) / L plus safety times the half-grid change."""
    model, layer = linear_model(seed=2)
    images = torch.randn(1, 3, 12, 12, dtype=D)
    c = wp.aposteriori_certificate(model, images, tol=1e-3, per_step=8)
    assert (c["method"], c["tol"]) == ("dopri5", 1e-3)
    # per_step=None: an even count >= 8 per accepted step, so at least 8 intervals per step on the shared grid
    d = wp.aposteriori_certificate(model, images, tol=1e-3)
    assert len(d["t"]) >= 8 * d["accepted"] + 1 and d["violations"] == 0
    t, d, L = np.array(c["t"]), np.array(c["delta"][0]), c["L"]
    fine, coarse = _gronwall_sum(t, d, L), _gronwall_sum(t[::2], d[::2], L)
    change = np.abs(coarse - fine[::2])
    want = fine.copy()
    want[::2] += c["safety"] * change
    want[1::2] += c["safety"] * np.maximum(change[:-1], change[1:])
    assert np.allclose(c["bound"][0], want, rtol=1e-10, atol=1e-300)
    assert c["max_delta"] == max(d) and 0 < c["rigorous_margin_max"] < math.inf
    assert c["bound_t1"][0] == c["bound"][0][-1] and c["actual_t1"][0] == c["actual"][0][-1]


def test_adjoint_and_backprop_gradients_against_finite_differences():
    """gradient_check: both gradients' directional derivatives along a random v match a central finite difference
    of <w, x(t1)> computed here with torchdiffeq's dopri8 at 1e-11 (independent of lipcheck's solver wrappers);
    NFE of the backward pass counted apart (0 for backprop, > 0 for the adjoint); min-step clamps counted."""
    import torchdiffeq
    from lipcheck import ViT
    torch.manual_seed(0)
    model = ViT("ode", "ssog", dtype=torch.float64, img_size=8, patch_size=4, dim=6, num_heads=2, num_components=2,
                depth=1, num_classes=3, mlp_ratio=2.0).eval()
    with torch.no_grad():
        for mod in model.vector_field.block.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.mul_(3.0)  # a field that bends the trajectory
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    r = wp.gradient_check(model, images, tol=1e-8, seed=3)
    blk = model.vector_field.block
    with torch.no_grad():
        x0 = model.embed(images)
        w = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        v = torch.randn(x0.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        tt = torch.tensor([0.0, float(model.t1)], dtype=torch.float64)
        f = lambda x: float((torchdiffeq.odeint(lambda t, z: blk.vector_field(z), x, tt, method="dopri8", rtol=1e-11,
                                                atol=1e-11)[-1] * w).sum())
        eps = 1e-5
        fd = (f(x0 + eps * v) - f(x0 - eps * v)) / (2 * eps)
    for name in ("adjoint", "backprop"):
        g = r["grad_x0_" + name]
        assert abs(float((g * v).sum()) - fd) <= 1e-5 * (1 + abs(fd)), (name, float((g * v).sum()), fd)
    assert r["backprop"]["nfe_backward"] == 0 and r["adjoint"]["nfe_backward"] > 0
    assert r["adjoint"]["accepted_backward"] > 0 and r["backprop"]["accepted"] == r["adjoint"]["accepted"]
    assert 0 < r["rel_diff"] < 1e-4 and r["backprop"]["min_step_clamps"] == 0  # min_step = 0: no clamp
    ga, gb = r["grad_x0_adjoint"], r["grad_x0_backprop"]  # the x0 part of the distance, from the two gradients
    assert r["rel_diff_x0"] == pytest.approx(float((ga - gb).norm() / gb.norm()), rel=1e-12) and r["rel_diff_x0"] < 1e-4
    clamped = wp.gradient_check(model, images, tol=1e-12, min_step=float(model.t1) / 4)
    # at tol 1e-12 the solver wants far shorter steps than t1/4: every step of length t1/4 is a forced accept
    assert 1 <= clamped["backprop"]["min_step_clamps"] <= clamped["backprop"]["accepted"] <= 4
    assert clamped["min_step"] == float(model.t1) / 4 and clamped["adjoint"]["min_step_clamps_backward"] == 0
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="min_step"):
            wp.gradient_check(model, images, min_step=bad)


def test_certificate_keeps_its_roundoff_margin_at_a_tiny_scale():
    """x' = T x (no bias) from a state of size 1e-50: the quartic fit's round-off margin on y' is at least
    80 sqrt(9) eps max|y| / (sigma_min(V) h) >= 35 eps max|x0| / t1 (sigma_min(V) <= ||V||_F <= sqrt(45)), a
    float64 number far below float32's range; the bound still covers the exact (expm) error."""
    model, layer = linear_model(seed=2)
    with torch.no_grad():
        layer.o_proj.bias.zero_()
    images = torch.randn(1, 3, 12, 12, dtype=D, generator=torch.Generator().manual_seed(0))
    scale = 1e-50
    c = wp.aposteriori_certificate(model, images, tol=1e-3, per_step=8, input_scale=scale)
    block, x0, t1 = wp.prepare(model, images, input_scale=scale)
    assert c["derivative_roundoff_margin"] >= 35 * torch.finfo(D).eps * float(x0.abs().max()) / t1 > 0
    A, T = augmented_matrix(layer, 3, 3)
    y, _ = wp.solve(block, x0, torch.tensor(c["t"], dtype=D), "dopri5", tol=1e-3)
    v0 = x0.reshape(-1).numpy()
    ks = range(8, len(c["t"]), 8)  # the step ends (per_step = 8), where the error has built up over whole steps
    err = [np.linalg.norm(y[k, 0].reshape(-1).numpy() - scipy.linalg.expm(T * c["t"][k]) @ v0) for k in ks]
    assert c["violations"] == 0 and all(c["bound"][0][k] >= e > 0 for k, e in zip(ks, err))


def test_gradient_check_computes_in_the_requested_dtype():
    """A float32 model checked at the default dtype float64: gradients in float64 that match a float64 central
    finite difference (torchdiffeq's dopri8 at 1e-11 on the model cast here) to 1e-6, beyond float32's reach."""
    import torchdiffeq
    torch.manual_seed(0)
    model = ViT("ode", "ssog", dtype=torch.float32, img_size=8, patch_size=4, dim=6, num_heads=2, num_components=2,
                depth=1, num_classes=3, mlp_ratio=2.0).eval()
    images = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    r = wp.gradient_check(model, images, tol=1e-9, seed=3)
    g = r["grad_x0_backprop"]
    assert g.dtype == D and r["grad_x0_adjoint"].dtype == D
    m64 = ViT("ode", "ssog", dtype=D, img_size=8, patch_size=4, dim=6, num_heads=2, num_components=2,
              depth=1, num_classes=3, mlp_ratio=2.0).eval()
    m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    blk = m64.vector_field.block
    with torch.no_grad():
        x0 = m64.embed(images.double())
        w = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3), dtype=D)
        v = torch.randn(x0.shape, generator=torch.Generator().manual_seed(9), dtype=D)
        tt = torch.tensor([0.0, float(m64.t1)], dtype=D)
        f = lambda x: float((torchdiffeq.odeint(lambda t, z: blk.vector_field(z), x, tt, method="dopri8", rtol=1e-11,
                                                atol=1e-11)[-1] * w).sum())
        eps = 1e-5
        fd = (f(x0 + eps * v) - f(x0 - eps * v)) / (2 * eps)
    assert abs(float((g * v).sum()) - fd) <= 1e-6 * (1 + abs(fd)), (float((g * v).sum()), fd)


def test_certificate_samples_every_step_evenly_and_reports_the_quartic_margin():
    """per_step = 8: the times are 8 equal sub-intervals of each accepted step (steps end on t1); the reported
    rigorous margin max (sup||y''|| + L sup||y'||) tau / 2 recomputed here from numpy least-squares quartics through
    the dense output (sup||y^(d)|| <= sum_k k!/(k-d)! ||c_k|| / h^d)."""
    model, layer = linear_model(seed=2)
    images = torch.randn(1, 3, 12, 12, dtype=D)
    c = wp.aposteriori_certificate(model, images, tol=1e-3, per_step=8)
    assert (c["method"], c["tol"]) == ("dopri5", 1e-3)
    # per_step=None: an even count >= 8 per accepted step, so at least 8 intervals per step on the shared grid
    d = wp.aposteriori_certificate(model, images, tol=1e-3)
    assert len(d["t"]) >= 8 * d["accepted"] + 1 and d["violations"] == 0
    t = np.array(c["t"])
    K = c["accepted"]
    assert K >= 2 and len(t) == 8 * K + 1 and t[0] == 0.0 and t[-1] == model.t1
    block, x0, _ = wp.prepare(model, images)
    y, _ = wp.solve(block, x0, torch.tensor(t, dtype=D), "dopri5", tol=1e-3)
    y = y[:, 0].reshape(len(t), -1).numpy()
    worst = 0.0
    for j in range(K):
        ts = t[8 * j:8 * j + 9]
        h = ts[-1] - ts[0]
        assert np.allclose(np.diff(ts), h / 8, rtol=1e-12, atol=0)
        x = (ts - ts[0]) / h
        coef = np.linalg.lstsq(np.vander(x, 5, increasing=True), y[8 * j:8 * j + 9], rcond=None)[0]
        cn = np.linalg.norm(coef, axis=1)
        d1 = sum(k * cn[k] for k in range(1, 5)) / h
        d2 = sum(k * (k - 1) * cn[k] for k in range(2, 5)) / h ** 2
        worst = max(worst, (d2 + c["L"] * d1) * h / 8 / 2)
    assert abs(c["rigorous_margin_max"] - worst) <= 1e-6 * worst, (c["rigorous_margin_max"], worst)


def test_auto_grid_is_the_coarsest_power_of_two_meeting_the_drift_criterion():
    """auto_grid: the fewest intervals n = 2^k (16 <= n <= 512) with drift margin 2 speed (t1 / n) / sqrt(C) <= half
    the smallest token std of x0; states scaled so that t1 / n sits just below the limit (0.9 of it)."""
    torch.manual_seed(0)
    model = ViT("ode", "ssog", dtype=D, img_size=8, patch_size=2, dim=8, num_heads=2, num_components=2, depth=1)
    block = model.vector_field.block
    speed = wp.token_speed_bound(block)
    C, t1 = 8, 1.0
    base = torch.randn(1, 4, 4, C, dtype=D, generator=torch.Generator().manual_seed(1))
    s0 = float(base.var(-1, unbiased=False).sqrt().min())
    for n in (32, 64, 256):
        # drift 2 speed (t1 / m) / sqrt(C) <= sigma / 2  <=>  m >= 4 speed t1 / (sigma sqrt(C)); put that at 0.9 n
        sigma = 4 * speed * t1 / (math.sqrt(C) * 0.9 * n)
        x0 = base * (sigma / s0)
        sig = float(x0.var(-1, unbiased=False).sqrt().min())
        got = wp.auto_grid(block, x0, t1)
        assert 2 * speed * (t1 / got) / math.sqrt(C) <= sig / 2  # the criterion holds
        assert 2 * speed * (t1 / (got / 2)) / math.sqrt(C) > sig / 2  # and half as many intervals would fail it
        assert got == n
    assert wp.auto_grid(block, base * 1e6, t1) == 16 and wp.auto_grid(block, base * 1e-9, t1) == 512  # the clamps


def bias_free_linear_case():
    """x' = T x on a 3x3 grid (the linear model with its output bias zeroed): block, x0, t1 and T (numpy)."""
    model, layer = linear_model(seed=1, scale=1.0)
    with torch.no_grad():
        layer.o_proj.bias.zero_()
    images = torch.randn(1, 3, 12, 12, dtype=D, generator=torch.Generator().manual_seed(2))
    block, x0, t1 = wp.prepare(model, images)
    _, T = augmented_matrix(layer, 3, 3)
    return block, x0, t1, T


def rk4_step_matrix(T, h):
    """One classical rk4 step on x' = T x multiplies by sum_{k<=4} (hT)^k / k!."""
    return sum(np.linalg.matrix_power(h * T, k) / math.factorial(k) for k in range(5))


def test_flow_map_is_fixed_step_rk4():
    """flow_map on x' = T x (no bias): rk4 with h = t1 / steps multiplies by R(hT) = sum_{k<=4} (hT)^k / k! per step,
    so two steps give R(hT)^2 x0 (numpy), visibly not expm(T t1) x0 at this step size."""
    block, x0, t1, T = bias_free_linear_case()
    h = t1 / 2
    R = rk4_step_matrix(T, h)
    want = R @ R @ x0.reshape(-1).numpy()
    got = wp.flow_map(block, t1, steps=2)(x0).reshape(-1).numpy()
    assert np.allclose(got, want, rtol=1e-11, atol=1e-11 * np.abs(want).max())
    exact_t1 = scipy.linalg.expm(T * t1) @ x0.reshape(-1).numpy()
    assert np.linalg.norm(got - exact_t1) > 1e-4 * np.linalg.norm(exact_t1)
    # an end time float32 cannot hold (0.1): the flow integrates to it in the state's float64, not to fl32(0.1)
    R = sum(np.linalg.matrix_power(0.05 * T, k) / math.factorial(k) for k in range(5))
    want = R @ R @ x0.reshape(-1).numpy()
    got = wp.flow_map(block, 0.1, steps=2)(x0).reshape(-1).numpy()
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_worst_direction_single_iteration_is_a_lower_bound():
    """One power iteration: sigma = ||J v|| / ||v|| for the random start, never above ||J||_2 (the rk4 flow's
    Jacobian R(hT)^steps, formed in numpy); the returned direction has unit norm."""
    model, layer = linear_model(seed=1, scale=1.0)
    images = torch.randn(2, 3, 12, 12, dtype=D, generator=torch.Generator().manual_seed(2))
    block, x0, t1 = wp.prepare(model, images)
    _, T = augmented_matrix(layer, 3, 3)
    h = t1 / 4
    R = rk4_step_matrix(T, h)
    top = np.linalg.norm(np.linalg.matrix_power(R, 4), 2)
    for iters in (1, 3):
        v, sigma = wp.worst_direction(block, x0, t1, iters=iters, steps=4, generator=torch.Generator().manual_seed(0))
        assert np.allclose(v.flatten(1).norm(dim=-1).numpy(), 1.0, rtol=1e-12)
        assert (sigma.numpy() <= top * (1 + 1e-9)).all() and (sigma.numpy() > 0.1 * top).all(), (sigma, top)


def test_growth_rate_is_log_growth_over_t1():
    """rate_t1 = log(g(t1)) / t1 on a model with t1 = 0.5 (linear field: g from expm(T t) applied here)."""
    torch.manual_seed(4)
    model = ViT("ode", "ssog", dtype=D, t1=0.5, **LINEAR)
    layer = model.vector_field.block.mixer.freeze_kernels()
    with torch.no_grad():
        for p in (layer.v_proj.weight, layer.o_proj.weight):
            p.normal_(std=0.5)
    images = torch.randn(1, 3, 12, 12, dtype=D, generator=torch.Generator().manual_seed(5))
    g = wp.perturbation_growth(model, images, grid=4, directions=("random",), eps=1e-3)
    _, T = augmented_matrix(layer, 3, 3)
    d = g["directions"]["random"]
    assert model.t1 == 0.5 and g["t"][-1] == 0.5
    gen = torch.Generator().manual_seed(0)
    x0 = wp.prepare(model, images)[1]
    v = torch.randn(x0.shape, dtype=D, generator=gen)
    v = (v / v.norm()).reshape(-1).numpy()
    want = np.linalg.norm(scipy.linalg.expm(T * 0.5) @ v)  # linear flow: g(t1) = ||expm(T t1) v||
    assert abs(d["growth_t1"][0] - want) <= 1e-8 * want
    assert abs(d["rate_t1"][0] - math.log(want) / 0.5) <= 1e-7 * (1 + abs(math.log(want)))


def test_convergence_fit_leaves_out_runs_at_the_floor():
    """A run whose error equals floor_factor * reference error exactly (powers of two) is not fitted: the pooled and
    per-method slopes are those of the runs strictly above it."""
    ref = 2.0 ** -40
    floor = 64 * ref
    runs = [dict(method="dopri5", tol=t, steps=None, error=2 * t ** 0.8) for t in (1e-2, 1e-4, 1e-6)]
    runs.append(dict(method="dopri5", tol=1e-9, steps=None, error=floor))  # exactly at the floor
    runs += [dict(method="rk4", tol=None, steps=n, step_size=1.0 / n, error=3 * (1.0 / n) ** 4) for n in (8, 16)]
    runs.append(dict(method="rk4", tol=None, steps=64, step_size=1.0 / 64, error=floor))
    s = wp.convergence_summary(runs, reference_error=ref, floor_factor=64.0)
    assert s["floor"] == floor
    assert abs(s["slope"] - 0.8) < 1e-12 and s["per_method"]["dopri5"]["fitted_points"] == 3
    assert abs(s["per_method"]["dopri5"]["slope"] - 0.8) < 1e-12
    assert s["per_method"]["rk4"]["fitted_points"] == 2 and abs(s["per_method"]["rk4"]["slope"] - 4.0) < 1e-12


def test_gradient_check_counts_against_an_independent_count_of_field_calls():
    """x' = T x + b: every evaluation of the field is counted here by a forward hook on the mixer (which pass it
    belongs to from autograd's state: odeint_adjoint's forward solve runs without grad). Per pass the counts equal
    the reported NFE, and dopri5's cost 2 + 6 (accepted + rejected) (two evaluations pick the first step, six new
    stages per attempt) ties the step counts to them, in a case with a rejected step in both passes; the loss is
    <w, x(t1)> with x(t1) from expm."""
    model, layer = linear_model(seed=0, scale=1.0)
    calls = []
    layer.register_forward_hook(lambda m, i, o: calls.append(torch.is_grad_enabled()))
    images = torch.randn(1, 3, 12, 12, generator=torch.Generator().manual_seed(1), dtype=D)
    r = wp.gradient_check(model, images)  # the defaults: dopri5, tol 1e-6, no min_step, seed 0
    assert (r["method"], r["tol"], r["min_step"]) == ("dopri5", 1e-6, 0.0)
    b, a = r["backprop"], r["adjoint"]
    keys = {"loss", "nfe_forward", "nfe_backward", "accepted", "rejected", "min_step_clamps", "accepted_backward",
            "rejected_backward", "min_step_clamps_backward", "seconds"}
    assert set(a) == set(b) == keys and a["seconds"] > 0 and b["seconds"] > 0
    # only the adjoint pass solves backwards, and without min_step: nothing clamped there
    assert (a["min_step_clamps_backward"], b["min_step_clamps_backward"]) == (0, None)
    assert (b["accepted_backward"], b["rejected_backward"]) == (0, 0)
    assert r["rel_diff"] != r["rel_diff_x0"]  # the parameters' gradients count too
    first_off = calls.index(False)
    bp, adj_fwd, adj_bwd = first_off, calls.count(False), len(calls) - first_off - calls.count(False)
    assert all(calls[:first_off]) and all(calls[first_off + adj_fwd:])
    assert (b["nfe_forward"], b["nfe_backward"], a["nfe_forward"], a["nfe_backward"]) == (bp, 0, adj_fwd, adj_bwd)
    assert b["rejected"] >= 1 and a["rejected_backward"] >= 1
    assert bp == 2 + 6 * (b["accepted"] + b["rejected"]) and adj_fwd == 2 + 6 * (a["accepted"] + a["rejected"])
    assert adj_bwd == 2 + 6 * (a["accepted_backward"] + a["rejected_backward"])
    x0 = model.embed(images).detach()
    A, _ = augmented_matrix(layer, 3, 3)
    w = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0), dtype=D).reshape(-1).numpy()
    loss = float(w @ exact(A, x0, model.t1)[0])
    for p in (a, b):
        assert abs(p["loss"] - loss) <= 1e-4 * abs(loss), (p["loss"], loss)


# ------------------------------------------------ report keys, default paths and dtypes (found by mutation tests)

def _small_ln_model(seed=0, dtype=D):
    """An ODE ViT with LayerNorm and MLP on a 2 x 2 token grid of 6 channels (cheap to integrate)."""
    torch.manual_seed(seed)
    return ViT("ode", "ssog", dtype=dtype, img_size=8, patch_size=4, dim=6, num_heads=2, num_components=2, depth=1,
               num_classes=3, mlp_ratio=2.0).eval()


def test_perturbation_growth_default_grid_and_report_against_an_independent_solve():
    """grid=None: the sampled times are auto_grid's number of uniform intervals (32 here, not one of its clamps);
    the report echoes eps, gives the weights' token speed bound, no power-iteration sigma without the 'worst'
    direction, a variance floor below every token variance of x(t) and y(t) at the sampled times (torchdiffeq's
    dopri8 at 1e-12, independent of lipcheck's reference) and the local constant certified at that floor; the growth,
    its maximum, the largest rate log(g) / t (t > 0) and the violations of exp(L t) as that solve gives them."""
    import torchdiffeq
    model = _small_ln_model()
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=D)
    scale, eps = 0.01, 1e-3  # small states: token std small against the drift, so auto_grid is above its floor 16
    g = wp.perturbation_growth(model, images, directions=("random",), eps=eps, input_scale=scale)
    block, x0, t1 = wp.prepare(model, images, input_scale=scale)
    n = wp.auto_grid(block, x0, t1)
    assert g["grid"] == n == 32 and len(g["t"]) == n + 1
    assert np.allclose(g["t"], np.linspace(0.0, t1, n + 1), rtol=0, atol=1e-15)
    assert g["eps"] == eps and g["power_iteration_sigma"] is None
    assert g["speed_bound"] == pytest.approx(wp.token_speed_bound(block), rel=1e-12)
    v = torch.randn(x0.shape, dtype=D, generator=torch.Generator().manual_seed(0))  # the seed-0 random direction
    v = v / v.flatten(1).norm(dim=1)[:, None, None, None]
    size = eps * x0.flatten(1).norm(dim=1)
    t = torch.tensor(g["t"], dtype=D)
    with torch.no_grad():
        f = lambda s, z: block.vector_field(z)  # noqa: E731
        X = torchdiffeq.odeint(f, x0, t, method="dopri8", rtol=1e-12, atol=1e-12)
        Y = torchdiffeq.odeint(f, x0 + size[:, None, None, None] * v, t, method="dopri8", rtol=1e-12, atol=1e-12)
    growth = ((X - Y).flatten(2).norm(dim=-1) / size).numpy()  # (T, B)
    d = g["directions"]["random"]
    assert np.allclose(np.array(d["growth"]).T, growth, rtol=1e-6, atol=0)
    assert d["max_growth"] == max(max(row) for row in d["growth"]) and d["max_growth"] > 1.0
    rates = np.log(growth[1:]) / t.numpy()[1:, None]
    assert d["max_rate"] == pytest.approx(float(rates.max()), rel=1e-5)
    var_min = float(torch.cat([X, Y]).var(-1, unbiased=False).min())
    assert var_min / 16 <= g["min_variance"] <= var_min  # a lower bound, and not vacuous (auto_grid's aim)
    L_glob, L_loc, _ = wp.vector_field_constants(block, x0, g["min_variance"])
    assert g["L_local"] == L_loc < g["L_global"] == L_glob
    for kind, L in (("global", L_glob), ("local", L_loc)):
        viol = int((np.log(growth[1:]) > L * t.numpy()[1:, None]).sum())
        assert d["violations"][kind] == g["violations"][kind] == viol


def _float32_linear_model(seed, *, bias):
    """A float32 ODE model whose field is linear (LINEAR: no LN, no MLP), with O(1) random weights."""
    torch.manual_seed(seed)
    model = ViT("ode", "ssog", dtype=torch.float32, **LINEAR)
    layer = model.vector_field.block.mixer.freeze_kernels()
    with torch.no_grad():
        for p in (layer.v_proj.weight, layer.o_proj.weight):
            p.normal_(std=0.3)
        if bias:
            layer.o_proj.bias.normal_()
    return model, layer

def test_sweep_runs_in_the_requested_dtype_on_a_float32_model():
    """tolerance_sweep(dtype=float64, the default) on a float32 linear model: the model is cast, so the reference
    and every final state are float64 and dopri5 at tol 1e-10 is within 1e-8 of expm of the float32 weights (exact
    in float64): beyond float32's reach (u = 6e-8)."""
    model, layer = _float32_linear_model(0, bias=True)
    images = torch.randn(1, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    res = wp.tolerance_sweep(model, images, ("dopri5",), (1e-10,), progress=False)
    final = res.finals[("dopri5", 1e-10)]
    assert final.dtype == D and res.reference.states.dtype == D
    m64 = copy.deepcopy(model).double()  # the float32 weights, each exactly a float64; kernels formed in float64
    A, _ = augmented_matrix(m64.vector_field.block.mixer, 3, 3)
    truth = exact(A, m64.embed(images.double()).detach(), model.t1)
    rel = lambda y: np.linalg.norm(y.reshape(1, -1).numpy() - truth) / np.linalg.norm(truth)  # noqa: E731
    assert rel(final) < 1e-8 and rel(res.reference.states[-1]) < 1e-11, (rel(final), rel(res.reference.states[-1]))
    assert res.runs[0]["error"] == pytest.approx(rel(final), rel=1e-3, abs=1e-13)


def test_sweep_run_records_and_a_given_reference():
    """Every run records ratio = error / tol (adaptive) or step_size = t1 / steps (fixed), the input_scale, and where
    x(t1) came from: 'step' (the last step lands on t1: the default, and always for fixed steps) or 'interpolated'
    (land_on_t1=False: read off the dense output, then not the landed state); a given reference is used as is
    (errors against its final state); summary() holds mixer, runs, reference and convergence."""
    model, layer = linear_model(seed=3)
    images = torch.randn(1, 3, 12, 12, dtype=D, generator=torch.Generator().manual_seed(2))
    kw = dict(rk4_steps=(4,), input_scale=0.5, progress=False)
    land = wp.tolerance_sweep(model, images, ("dopri5", "rk4"), (1e-4,), **kw)
    free = wp.tolerance_sweep(model, images, ("dopri5", "rk4"), (1e-4,), reference=land.reference, land_on_t1=False,
                              **kw)
    assert free.reference is land.reference
    for res, how in ((land, "step"), (free, "interpolated")):
        a, f = res.runs  # adaptive first, then fixed
        assert (a["method"], a["tol"], a["steps"], a["step_size"], f["method"], f["tol"], f["steps"]) == \
            ("dopri5", 1e-4, None, None, "rk4", None, 4)
        assert a["ratio"] == a["error"] / 1e-4 and f["ratio"] is None and f["step_size"] == model.t1 / 4
        assert (a["final"], f["final"]) == (how, "step") and a["input_scale"] == f["input_scale"] == 0.5
        ref = res.reference.states[-1]
        for r in res.runs:
            key = (r["method"], r["tol"] if r["tol"] is not None else r["steps"])
            want = float(((res.finals[key] - ref).norm() / ref.norm()))
            assert r["error"] == pytest.approx(want, rel=1e-12) and r["errors"] == [r["error"]]
        s = res.summary()
        assert s["mixer"] == "ssog" and s["runs"] is res.runs and s["convergence"] is res.convergence
        assert all(isinstance(r["seconds"], float) and r["seconds"] > 0 for r in res.runs)  # wall time per run
        assert s["reference"] == res.reference.summary() and s["reference"]["steps"] == res.reference.steps
    # the interpolated final state is another (nearby) value than the landed one
    d = float((free.finals[("dopri5", 1e-4)] - land.finals[("dopri5", 1e-4)]).norm())
    assert 0 < d < 1e-2 * float(land.reference.states[-1].norm())
    assert torch.equal(free.finals[("rk4", 4)], land.finals[("rk4", 4)])
    # input_scale: the sweep starts from 0.5 embed(images) (the reference's first state)
    assert torch.allclose(land.reference.states[0], 0.5 * model.embed(images).detach(), rtol=1e-15, atol=0)


@pytest.mark.parametrize("mixer", ["ssog", "attention"])
def test_token_speed_bound_is_the_documented_formula(mixer):
    """token_speed_bound against its docstring, evaluated here with numpy: rho = max|gamma| sqrt(C) + ||beta|| per
    LayerNorm; SSoG rho1 sum_h (sum_m |alpha_hm|) ||P_h||_2 + ||b_O||; attention ||W_O||_2 sqrt(sum_h (||W_V,h||_2 rho1
    + ||b_V,h||)^2) + ||b_O||; MLP ||W2||_2 (||W1||_2 rho2 + ||b1||) + ||b2||; inf without LayerNorm."""
    block = small_block(mixer, 5, num_components=3)
    n2 = lambda w: np.linalg.norm(w.detach().numpy(), 2)  # noqa: E731
    nv = lambda b: np.linalg.norm(b.detach().numpy())  # noqa: E731
    rho = lambda ln: math.sqrt(8) * float(ln.weight.abs().max()) + nv(ln.bias)  # noqa: E731
    m = block.mixer
    if mixer == "ssog":
        alpha = m.gaussian_params()[0].detach().numpy()
        P = m.head_projections()
        want = rho(block.norm1) * sum(np.abs(alpha[h]).sum() * n2(P[h]) for h in range(2)) + nv(m.o_proj.bias)
    else:
        WV, bV = m.v_proj.weight, m.v_proj.bias
        heads = [n2(WV[4 * h:4 * (h + 1)]) * rho(block.norm1) + nv(bV[4 * h:4 * (h + 1)]) for h in range(2)]
        want = n2(m.o_proj.weight) * math.sqrt(sum(v * v for v in heads)) + nv(m.o_proj.bias)
    fc1, fc2 = block.mlp.fc1, block.mlp.fc2
    want += n2(fc2.weight) * (n2(fc1.weight) * rho(block.norm2) + nv(fc1.bias)) + nv(fc2.bias)
    got = wp.token_speed_bound(block)
    # rounded up: verified norms and the assembly's 1 + gamma_{2h+12} (16 u here) put it above the numpy value by
    # more than numpy's own few-u rounding, and by no more than ~1e-13
    assert want * (1 + 10 * 2.0 ** -53) <= got <= want * (1 + 1e-12), (got, want)
    with torch.no_grad():
        block.mlp.fc1.weight[0, 0] = math.nan
    with pytest.raises(ValueError, match="not finite"):
        wp.token_speed_bound(block)
    plain = ViT("ode", mixer, dtype=D, img_size=8, patch_size=2, dim=8, num_heads=2, num_components=3, depth=1,
                use_norm=False)
    assert wp.token_speed_bound(plain.vector_field.block) == math.inf



def test_token_speed_bound_rounding_allowances():
    """Weights whose exact products vanish, so that only the documented allowances remain, checked at 50 digits:
    with W_V^h using value channels 0-1 and W_O^h reading channels 2-3 only, P_h = W_V^h W_O^h = 0 exactly, and
    the bound carries gamma_{d+2} ||W_V^h||_F ||W_O^h||_F for the product's rounding; the MLP weights are zero and
    the biases are not; the assembly is rounded up by 1 + gamma_{2h+12}."""
    mpmath.mp.dps = 50
    torch.manual_seed(7)
    model = ViT("ode", "ssog", dtype=D, img_size=8, patch_size=2, dim=8, num_heads=2, num_components=3, depth=1)
    block, m = model.vector_field.block, model.vector_field.block.mixer
    C, d, u = 8, 4, mpmath.mpf(2) ** -53
    with torch.no_grad():
        m.v_proj.weight.normal_()
        m.o_proj.weight.normal_()
        for h in range(2):  # v_proj.weight is (out, in): rows h*d+2, h*d+3 of W_V^T are zero; o_proj columns h*d, h*d+1
            m.v_proj.weight[h * d + 2:h * d + 4] = 0
            m.o_proj.weight[:, h * d:h * d + 2] = 0
        m.o_proj.bias.normal_()
        block.mlp.fc1.weight.zero_()
        block.mlp.fc2.weight.zero_()
        block.mlp.fc2.bias.normal_()
    assert float(m.head_projections().abs().max()) == 0.0
    g = lambda n: n * u / (1 - n * u)  # noqa: E731
    fro = lambda t: mpmath.sqrt(mpmath.fsum(mpmath.mpf(float(x)) ** 2 for x in t.flatten()))  # noqa: E731
    alpha = m.gaussian_params()[0].detach()
    from lipcheck.bounds.attention import layernorm_image_radius
    rho1 = mpmath.mpf(layernorm_image_radius(block.norm1))
    heads = mpmath.fsum(mpmath.fsum(abs(mpmath.mpf(float(a))) for a in alpha[h]) * (1 + g(4)) * g(d + 2)
                        * fro(m.v_proj.weight[h * d:(h + 1) * d]) * (1 + g(C * d + 1))
                        * fro(m.o_proj.weight[:, h * d:(h + 1) * d]) * (1 + g(C * d + 1)) for h in range(2))
    want = (rho1 * heads + fro(m.o_proj.bias) * (1 + g(C + 1)) + fro(block.mlp.fc2.bias) * (1 + g(C + 1))) * (1 + g(16))
    got = wp.token_speed_bound(block)
    assert abs(got - want) <= 6 * u * want, (got, want)  # the float64 evaluation of the formula: ~2 u here

def test_segment_variance_floor_is_the_documented_formula():
    """segment_variance_floor against its docstring, evaluated here with numpy: per token and interval k the larger of
    (std a + std b - std(a - b)) / 2 at its two ends, less (drift_a[k] + drift_b[k] + 2 margin) / sqrt(C); the floor is
    the square of the smallest of these (0 if negative). Per-interval drifts: the smallest end value sits on the
    interval with the smallest drift, so a drift taken from another interval would show."""
    g = torch.Generator().manual_seed(3)
    K, C = 3, 5
    xa = 2 * torch.randn(K + 1, 2, 2, 1, C, generator=g, dtype=D)
    xb = xa + 0.3 * torch.randn(K + 1, 2, 2, 1, C, generator=g, dtype=D)
    std = lambda x: x.numpy().std(-1)  # noqa: E731  (biased, as LayerNorm)
    ends = (std(xa) + std(xb) - std(xa - xb)) / 2  # (K + 1, B, H, W)
    best = np.maximum(ends[:-1], ends[1:]).reshape(K, -1).min(1)
    k0 = int(best.argmin())
    da, db = np.full(K, 0.3), np.full(K, 0.2)
    da[k0], db[k0] = 0.01, 0.0
    margin = 0.02

    def want(da, db, margin):
        lo = np.maximum(ends[:-1], ends[1:]) - ((da + db + 2 * margin) / math.sqrt(C))[:, None, None, None]
        return max(float(lo.min()), 0.0) ** 2

    got = wp.segment_variance_floor(xa, xb, torch.tensor(da), torch.tensor(db), margin=margin)
    assert got == pytest.approx(want(da, db, margin), rel=1e-12) and got > 0
    assert wp.segment_variance_floor(xa, xb, 0.05, 0.1) == pytest.approx(want(np.full(K, 0.05), np.full(K, 0.1), 0.0),
                                                                          rel=1e-12)
    assert wp.segment_variance_floor(xa, xb, 100.0, 0.0) == 0.0  # a floor lost in the drift


def test_envelope_violations_compare_in_float64():
    """t given as a list: growth exp(L t) (1 + 1e-12) at t = 0.1 exceeds the envelope in float64 (where t = 0.1 read
    in float32 would not: it is 1.5e-9 larger there), and exp(L t) (1 - 1e-12) does not."""
    L = 1.0
    above = [[1.0], [math.exp(0.1) * (1 + 1e-12)]]
    below = [[1.0], [math.exp(0.1) * (1 - 1e-12)]]
    assert wp.envelope_violations([0.0, 0.1], above, L) == 1 and wp.envelope_violations([0.0, 0.1], below, L) == 0
    # growth exactly on the envelope (L = 0: exp(0 t) = 1) does not exceed it
    assert wp.envelope_violations([0.0, 0.5, 1.0], [[1.0], [1.0], [1.0]], 0.0) == 0


def test_perturbation_growth_in_float64_and_with_the_default_power_iteration():
    """A float32 linear model at the default dtype float64: growth_t1 of the worst direction is ||expm(T t1) v|| for
    the v the power iteration returns (float64 expm of the float32 weights, to 1e-9: beyond float32); the reported
    sigma is worst_direction's on the rk4 flow of the documented default power_steps = 32 steps (seed 0)."""
    model, layer = _float32_linear_model(1, bias=False)
    images = torch.randn(1, 3, 12, 12, generator=torch.Generator().manual_seed(2))
    g = wp.perturbation_growth(model, images, grid=4, directions=("worst",), power_iters=1)  # one iteration: cheap
    block, x0, t1 = wp.prepare(model, images)
    assert x0.dtype == D
    v, sigma = wp.worst_direction(block, x0, t1, iters=1, steps=32, generator=torch.Generator().manual_seed(0))
    assert g["power_iteration_sigma"] == sigma.tolist()
    m64 = copy.deepcopy(model).double()
    _, T = augmented_matrix(m64.vector_field.block.mixer, 3, 3)
    want = np.linalg.norm(scipy.linalg.expm(T * t1) @ v.reshape(-1).numpy())
    assert abs(g["directions"]["worst"]["growth_t1"][0] - want) <= 1e-9 * want


def test_reference_solution_stopping_rules():
    """reference_solution halves the step until successive final states agree to rel_tol, but not before min_steps
    (rel_tol = 1 is met at once: the first level with n >= min_steps = 8 ends it), or until the change stops
    improving (rel_tol = 0, a linear field at the round-off floor from the start: the first halving, from the third
    on, whose change is not below the previous one ends it). The error estimate is the largest relative change over
    the grid times and samples (at least the last final-state change); summary() reports steps, estimate, history."""
    model, layer = linear_model(seed=0)
    images = torch.randn(1, 3, 12, 12, dtype=D, generator=torch.Generator().manual_seed(0))
    block, x0, t1 = wp.prepare(model, images)
    quick = wp.reference_solution(block, x0, t1, rel_tol=1.0, start_steps=2, min_steps=8)
    assert quick.steps == 8 and [h["steps"] for h in quick.history] == [4, 8]
    t = torch.linspace(0.0, t1, 5, dtype=D)
    floor = wp.reference_solution(block, x0, t1, t=t, rel_tol=0.0, start_steps=8)
    ch = [h["change"] for h in floor.history]
    stop = next(i for i in range(2, len(ch)) if ch[i] >= ch[i - 1])
    assert len(ch) == stop + 1 and floor.steps == 8 * 2 ** len(ch) and floor.steps < 4096
    assert floor.abs_error.shape == (5, 1) and floor.states.shape == (5, *x0.shape) and torch.equal(floor.t, t)
    rel = (floor.abs_error / floor.states.flatten(2).norm(dim=-1)).max()
    assert floor.error_estimate == max(float(rel), ch[-1])
    s = floor.summary()
    assert (s["steps"], s["error_estimate"], s["history"]) == (floor.steps, floor.error_estimate, floor.history)
    assert "dopri8" in s["method"]
    # the default rel_tol 1e-13 on a faster field (scale 3): halvings from 8 steps until the change is below it
    fast, _ = linear_model(seed=0, scale=3.0)
    block3, x3, t3 = wp.prepare(fast, images)
    d = wp.reference_solution(block3, x3, t3)
    ch = [h["change"] for h in d.history]
    assert len(ch) >= 2 and ch[-1] <= 1e-13 < min(ch[:-1]) and d.steps == 8 * 2 ** len(ch)


def test_perturbation_growth_refuses_bad_settings_and_takes_grid_one():
    """grid must be a positive number of intervals (1 is the smallest: t = [0, t1]), directions among 'random' and
    'worst', eps positive and finite."""
    model, layer = linear_model(seed=1)
    images = torch.randn(1, 3, 12, 12, dtype=D, generator=torch.Generator().manual_seed(2))
    for kw, msg in ((dict(grid=0), "grid"), (dict(grid=-3), "grid"), (dict(directions=("best",)), "unknown direction"),
                    (dict(eps=math.nan), "eps"), (dict(eps=-1e-3), "eps")):
        with pytest.raises(ValueError, match=msg):
            wp.perturbation_growth(model, images, **kw)
    g = wp.perturbation_growth(model, images, grid=1, directions=("random",))
    assert g["grid"] == 1 and g["t"] == [0.0, model.t1] and len(g["directions"]["random"]["growth"][0]) == 2


def test_vector_field_constants_never_exceed_the_states_own_variance():
    """vector_field_constants(block, states, v): the local constant holds on the states themselves even where v claims
    more variance than they have (the smaller of the two is used): at v = 1e6 it is the constant at the states' own
    smallest token variance (v = None), and it bounds ||J_F(x)||_2 there (autograd); a smaller variance floor gives a
    larger constant, never above the global one; a dense-attention block takes its number of tokens from the states."""
    model = _small_ln_model(seed=2)
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3), dtype=D)
    block, x0, _ = wp.prepare(model, images)
    g_own, own, _ = wp.vector_field_constants(block, x0, None)
    g_big, big, _ = wp.vector_field_constants(block, x0, 1e6)
    _, small, _ = wp.vector_field_constants(block, x0, 1e-3 * float(x0.var(-1, unbiased=False).min()))
    assert big == own < small <= g_own == g_big
    for b in range(2):
        J = torch.autograd.functional.jacobian(lambda z: block.vector_field(z[None])[0], x0[b]).reshape(24, 24)
        assert float(torch.linalg.matrix_norm(J, 2)) <= big
    att = ViT("ode", "attention", dtype=D, img_size=8, patch_size=4, dim=6, num_heads=2, depth=1).eval()
    ab, ax0, _ = wp.prepare(att, images)
    ga, la, _ = wp.vector_field_constants(ab, ax0, None)
    assert 0 < la <= ga < math.inf


def test_min_step_clamp_count_includes_steps_at_the_floor():
    """A step accepted at exactly min_step was held at the floor (the controller asked for less): it counts as a
    clamp, as does any shorter one (the last step to t1); longer steps and min_step = 0 count none."""
    from lipcheck.wellposed.gradients import _PassCounter
    model, _ = linear_model(seed=0)
    steps = [(0.0, 0.25), (0.25, 0.25), (0.5, 0.375), (0.875, 0.125), (1.0, -0.25)]  # (t, dt) as recorded
    assert _PassCounter(model.vector_field.block, 0.25).clamped(steps) == 4
    assert _PassCounter(model.vector_field.block, 0.0).clamped(steps) == 0


def test_certificate_on_a_layernorm_model_reports_what_its_keys_name():
    """aposteriori_certificate at its defaults on a model with LayerNorm, each reported number recomputed here: the
    first solve's step counts and NFE (solved again); per_step=None samples each accepted step [a, b] at
    max(8, 2 ceil((b - a) / (2 dt))) equal intervals, dt = t1 / auto_grid(hi=1024) (here 8 and 10: both rules act);
    the weights' token speed bound; the variance floor of the segments [x, y] from the converged reference, y's
    dense output and its drift per interval sum_k k ||c_k,i|| / h tau (numpy quartics through the samples); the
    constants certified at that floor (the global one also as L t1 / ln 10); safety 2; the relative change of the
    quadrature under halving; the extreme ratios bound / actual; a reference converged to 1e-11."""
    model = _small_ln_model()
    images = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=D)
    c = wp.aposteriori_certificate(model, images, tol=1e-3)
    block, x0, t1 = wp.prepare(model, images)
    _, f = wp.solve(block, x0, torch.tensor([0.0, t1], dtype=D), "dopri5", tol=1e-3)
    assert (c["accepted"], c["rejected"], c["nfe"]) == (f.accepted, f.rejected, f.nfe)
    steps = [(a, min(a + h, t1)) for a, h in f.steps]
    dt = t1 / wp.auto_grid(block, x0, t1, hi=1024)
    counts = [max(8, 2 * math.ceil((b - a) / (2 * dt))) for a, b in steps]
    assert sorted(counts) == [8, 10]
    want = np.unique(np.concatenate([a + (b - a) * np.linspace(0, 1, m + 1)[:-1] for (a, b), m in zip(steps, counts)]
                                    + [[t1]]))
    t = np.array(c["t"])
    assert len(t) == len(want) and np.allclose(t, want, rtol=0, atol=1e-15)
    speed = wp.token_speed_bound(block)
    assert c["speed_bound"] == speed and c["safety"] == 2.0
    grid = torch.tensor(c["t"], dtype=D)
    y, _ = wp.solve(block, x0, grid, "dopri5", tol=1e-3)
    ref = wp.reference_solution(block, x0, t1, t=grid, rel_tol=1e-11)
    drift = np.zeros(len(t) - 1)
    for a, b in steps:
        i0, i1 = int(np.argmin(np.abs(t - a))), int(np.argmin(np.abs(t - b)))
        V = np.vander((t[i0:i1 + 1] - a) / (b - a), 5, increasing=True)
        cf = np.linalg.lstsq(V, y[i0:i1 + 1].reshape(i1 + 1 - i0, -1).numpy(), rcond=None)[0].reshape(5, *y.shape[1:])
        tok = np.linalg.norm(cf, axis=-1)  # (5, B, H, W)
        drift[i0:i1] = sum(k * tok[k] for k in range(1, 5)).max() / (b - a) * np.diff(t[i0:i1 + 1])
    tau = torch.tensor(np.diff(t), dtype=D)
    floor = wp.segment_variance_floor(ref.states, y, speed * tau, torch.tensor(drift, dtype=D),
                                      margin=float(ref.abs_error.max()))
    assert floor > 0 and c["min_variance"] == pytest.approx(floor, rel=1e-9)
    L_global, L, _ = wp.vector_field_constants(block, x0, c["min_variance"])
    assert (c["L_global"], c["L"]) == (L_global, L) and L < L_global
    assert c["global_factor_log10_t1"] == pytest.approx(L_global * t1 / math.log(10), rel=1e-15)
    d = np.array(c["delta"][0])
    fine, coarse = _gronwall_sum(t, d, L), _gronwall_sum(t[::2], d[::2], L)
    change = np.abs(coarse - fine[::2])[1:] / fine[::2][1:]  # t = 0 left out (0 / 0)
    assert c["quadrature_change"] == pytest.approx(float(change.max()), rel=1e-8)
    ratio = np.array(c["bound"][0][1:]) / np.array(c["actual"][0][1:])
    assert (c["min_ratio"], c["max_ratio"]) == (pytest.approx(ratio.min(), rel=1e-12), pytest.approx(ratio.max(), rel=1e-12))
    assert c["violations"] == 0 and c["min_ratio"] > 1
    r = c["reference"]
    assert r["error_estimate"] <= 1e-11 and r["history"][-1]["change"] <= 1e-11 and "dopri8" in r["method"]


def test_certificate_defect_carries_the_fitted_slopes_roundoff():
    """F = 0 (every weight and bias zero): y is x0 up to the dense output's rounding, so the reported defect is the
    fit's round-off margin on y' (times sqrt of the entries, for the sample norm) with hardly anything else; per_step
    = 4 (the fewest points a quartic needs) is taken, odd counts and fewer points are refused. A caller's constant
    (1 here) is used as is."""
    model, layer = linear_model(seed=0)
    with torch.no_grad():
        for p in (layer.v_proj.weight, layer.o_proj.weight, layer.o_proj.bias):
            p.zero_()
    images = torch.randn(1, 3, 12, 12, dtype=D, generator=torch.Generator().manual_seed(1))
    for bad in (2, 3, 6.5):
        with pytest.raises(ValueError, match="per_step"):
            wp.aposteriori_certificate(model, images, per_step=bad)
    c = wp.aposteriori_certificate(model, images, tol=1e-3, per_step=4, lipschitz=1.0)
    n = wp.prepare(model, images)[1][0].numel()
    assert len(c["t"]) == 4 * c["accepted"] + 1 and c["L"] == 1.0
    margin = c["derivative_roundoff_margin"] * math.sqrt(n)
    assert margin > 0 and margin <= c["max_delta"] <= margin * (1 + 1e-3)
    assert c["violations"] == 0 and max(c["actual"][0]) < 1e-13 < min(c["bound"][0][1:])


def test_quartic_fit_slope_error_is_its_documented_formula():
    """_quartic_fit: slope_error = 10 ||V^+||_2 sqrt(m + 1) (2 r), r = the largest residual of the returned fit plus
    4 eps max|Y| (the round-off of the samples themselves), ||V^+||_2 = 1 / sigma_min(V) of the Vandermonde matrix on
    x (numpy). Exact quartic samples: r is mostly the 4 eps term; noisy samples: mostly the residual."""
    eps = float(np.finfo(np.float64).eps)
    c = torch.tensor([0.3, -1.0, 2.0, 0.5, -0.7], dtype=D)
    for m, noise in ((8, 0.0), (12, 1e-6)):
        x = torch.linspace(0, 1, m + 1, dtype=D)
        Y = torch.stack([sum(c[k] * x ** k for k in range(5)), 3 * x - 1], dim=1)
        Y = Y + noise * torch.randn(m + 1, 2, generator=torch.Generator().manual_seed(m), dtype=D)
        coef, slope_err = _quartic_fit(x, Y)
        V = np.vander(x.numpy(), 5, increasing=True)
        r = np.abs(V @ coef.numpy() - Y.numpy()).max() + 4 * eps * np.abs(Y.numpy()).max()
        want = 10 * math.sqrt(m + 1) * 2 * r / np.linalg.svd(V, compute_uv=False).min()
        assert slope_err == pytest.approx(want, rel=1e-9), (m, slope_err, want)


def test_gradient_check_in_float32_with_another_method():
    """dtype=float32, method='bosh3': the gradients are float32 and each forward pass takes the steps of a bosh3
    solve at that tol landing on t1 (repeated here through lipcheck's solve, NFE included)."""
    model, _ = linear_model(seed=0, scale=1.0)
    images = torch.randn(1, 3, 12, 12, generator=torch.Generator().manual_seed(1), dtype=D)
    r = wp.gradient_check(model, images, method="bosh3", tol=1e-4, dtype=torch.float32)
    assert r["method"] == "bosh3" and r["grad_x0_backprop"].dtype == r["grad_x0_adjoint"].dtype == torch.float32
    block, x0, t1 = wp.prepare(model, images, dtype=torch.float32)
    _, f = wp.solve(block, x0, torch.tensor([0.0, t1], dtype=torch.float32), "bosh3", tol=1e-4, land=True)
    for p in ("backprop", "adjoint"):
        assert (r[p]["accepted"], r[p]["rejected"], r[p]["nfe_forward"]) == (f.accepted, f.rejected, f.nfe), p


def test_perturbation_growth_defaults_and_violation_totals(monkeypatch):
    """perturbation_growth at its default directions ('random' then 'worst', both drawn from one seed-0 generator),
    power_iters = 6 and eps = 1e-3: the reported sigma is worst_direction's (6 iterations, the power_steps given,
    after the random draw); the reference is converged to the default 1e-13 (it halves until a change is at most
    that). Violations: with a too small local constant (-50, patched in) every (time > 0, sample) pair of each
    direction violates it, and the total adds the directions up; the global one (1000) none."""
    from lipcheck.wellposed import gronwall
    model, layer = linear_model(seed=1, scale=1.0)
    images = torch.randn(2, 3, 12, 12, dtype=D, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(gronwall, "vector_field_constants", lambda *a, **k: (1000.0, -50.0, None))
    g = wp.perturbation_growth(model, images, grid=2, power_steps=4)
    assert list(g["directions"]) == ["random", "worst"] and g["eps"] == 1e-3
    block, x0, t1 = wp.prepare(model, images)
    gen = torch.Generator().manual_seed(0)
    torch.randn(x0.shape, dtype=D, generator=gen)  # the random direction comes first
    _, sigma = wp.worst_direction(block, x0, t1, iters=6, steps=4, generator=gen)
    assert g["power_iteration_sigma"] == sigma.tolist()
    ch = [h["change"] for h in g["reference"]["history"]]
    assert ch[0] > 1e-13 and (ch[-1] <= 1e-13 or (len(ch) >= 3 and ch[-1] >= ch[-2]))
    assert all(c > 1e-13 for c in ch[:-1])
    for d in g["directions"].values():
        assert d["violations"] == {"global": 0, "local": 2 * 2}
    assert g["violations"] == {"global": 0, "local": 2 * 2 * 2} and (g["L_global"], g["L_local"]) == (1000.0, -50.0)


def test_solve_and_reference_settings(monkeypatch):
    """solve: a fixed-step rk4 run records its steps (t0 + k h, h) from the first time on; no tol for an adaptive
    method, no steps for rk4, steps < 1 are refused. reference_solution on a grid t: its steps land on every time, so
    the states at the interior times are the exact solution (expm) too, not a dense-output interpolation; max_steps
    stops the halving (8 -> 16 here, rel_tol = 0 never met). check_tolerances sorts loosest first."""
    model, layer = linear_model(seed=1)
    images = torch.randn(1, 3, 12, 12, dtype=D, generator=torch.Generator().manual_seed(2))
    block, x0, t1 = wp.prepare(model, images)
    _, f = wp.solve(block, x0, torch.tensor([0.5, 1.5], dtype=D), "rk4", steps=4)
    assert f.steps == [(0.5, 0.25), (0.75, 0.25), (1.0, 0.25), (1.25, 0.25)] and f.accepted == 4
    tt = torch.tensor([0.0, t1], dtype=D)
    for kw, msg in ((dict(method="dopri5"), "needs tol"), (dict(method="rk4", tol=1e-3), "needs steps"),
                    (dict(method="rk4", steps=0), "positive integer")):
        with pytest.raises(ValueError, match=msg):
            wp.solve(block, x0, tt, kw.pop("method"), **kw)
    A, _ = augmented_matrix(layer, 3, 3)
    times = torch.tensor([0.0, 0.1, 0.37, 0.8, 1.0], dtype=D) * t1
    _, f = wp.solve(block, x0, times, "dopri8", steps=4, step_t=times[1:-1])  # fixed steps that also land on times
    starts = [a for a, _ in f.steps]
    assert all(min(abs(a - s) for a in starts) <= 1e-15 for s in times[1:-1].tolist())  # each time starts a step
    S = importlib.import_module("lipcheck.wellposed.solve")
    calls, real = [], S.solve
    monkeypatch.setattr(S, "solve", lambda *a, **k: calls.append(k.get("step_t")) or real(*a, **k))
    ref = wp.reference_solution(block, x0, t1, t=times, rel_tol=1e-12)
    assert len(calls) >= 2 and all(torch.equal(st, times[1:-1]) for st in calls)  # every level lands on the times
    for k, tk in enumerate(times.tolist()):
        truth = exact(A, x0, tk)[0]
        assert np.linalg.norm(ref.states[k, 0].reshape(-1).numpy() - truth) <= 1e-11 * np.linalg.norm(truth), k
    capped = wp.reference_solution(block, x0, t1, rel_tol=0.0, start_steps=4, max_steps=16)
    assert capped.steps == 16 and [h["steps"] for h in capped.history] == [8, 16]
    assert wp.check_tolerances([1e-6, 1e-3, 1e-4]) == (1e-3, 1e-4, 1e-6) and wp.check_methods(["rk4"]) == ("rk4",)
    with pytest.raises(ValueError, match="tolerances"):
        wp.check_tolerances(["1e-3"])


def test_prepare_refuses_bad_scales_and_freezes_a_copy():
    """prepare: input_scale must be positive and finite; the block returned is a frozen copy cast to dtype (the
    model's own parameters untouched), x0 = input_scale * embed(images), t1 the model's."""
    model, _ = _float32_linear_model(0, bias=True)
    images = torch.randn(1, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="input_scale"):
            wp.prepare(model, images, input_scale=bad)
    before = [p.requires_grad for p in model.vector_field.block.parameters()]
    block, x0, t1 = wp.prepare(model, images, input_scale=0.25)
    assert any(before) and all(not p.requires_grad and p.dtype == D for p in block.parameters())
    after = model.vector_field.block.parameters()
    assert [p.requires_grad for p in after] == before and all(p.dtype == torch.float32 for p in after)
    m64 = copy.deepcopy(model).double()
    assert torch.equal(x0, 0.25 * m64.embed(images.double()).detach()) and t1 == float(model.t1)


def test_prepare_evaluates_ssog_with_the_gemm_backend_whatever_the_model_uses():
    """The block prepare returns (the enclosures' field) evaluates the SSoG mixer with the stacked GEMM backend,
    Lemma 4's dot-product model, even for a model built with the FFT backend (whose own backend is untouched); its
    field agrees with the einsum reference backend's to rounding."""
    torch.manual_seed(0)
    model = ViT("ode", "ssog", dtype=D, img_size=16, patch_size=2, dim=12, num_heads=3, depth=1,
                ssog_backend="fft").eval()
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=D)
    block, x0, _ = wp.prepare(model, images)
    assert block.mixer.backend == ENCLOSE_SSOG_BACKEND == "stacked"
    assert model.vector_field.block.mixer.backend == "fft"
    ref = copy.deepcopy(block)
    ref.mixer.backend = "matmul"
    ref.mixer.clear_kernel_cache()
    y = x0 + 0.1 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(2), dtype=D)
    with torch.no_grad():
        got, want = block.vector_field(y), ref.vector_field(y)
    assert torch.allclose(got, want, rtol=1e-13, atol=1e-13 * float(want.abs().max()))


def test_sweep_names_the_attention_mixer():
    """A dense-attention ODE ViT: the sweep and each run say 'attention'."""
    torch.manual_seed(0)
    model = ViT("ode", "attention", dtype=D, img_size=8, patch_size=4, dim=6, num_heads=2, depth=1).eval()
    images = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=D)
    res = wp.tolerance_sweep(model, images, ("dopri5",), (1e-3,), reference_rtol=1e-8, progress=False)
    assert res.mixer == "attention" and res.runs[0]["mixer"] == "attention" and res.summary()["mixer"] == "attention"


def test_power_iteration_and_flow_map_defaults():
    """worst_direction at its defaults (8 iterations on the rk4 flow of 32 steps) against the same power iteration
    on the matrix R(hT)^32 in numpy, from the same seeded start; flow_map's default is 32 rk4 steps too."""
    block, x0, t1, T = bias_free_linear_case()
    h = t1 / 32
    J = np.linalg.matrix_power(rk4_step_matrix(T, h), 32)
    assert np.allclose(wp.flow_map(block, t1)(x0).reshape(-1).numpy(), J @ x0.reshape(-1).numpy(), rtol=1e-11,
                       atol=1e-11 * float(x0.abs().max()))
    v = torch.randn(x0.shape, dtype=D, generator=torch.Generator().manual_seed(5)).reshape(-1).numpy()
    v = v / np.linalg.norm(v)
    for _ in range(8):
        sigma = np.linalg.norm(J @ v)
        v = J.T @ (J @ v)
        v = v / np.linalg.norm(v)
    got_v, got_sigma = wp.worst_direction(block, x0, t1, generator=torch.Generator().manual_seed(5))
    assert float(got_sigma[0]) == pytest.approx(sigma, rel=1e-10)
    assert np.allclose(got_v.reshape(-1).numpy(), v, rtol=0, atol=1e-9)


class _Decay(torch.nn.Module):
    """x' = lam x."""
    def __init__(self, lam):
        super().__init__()
        self.lam = lam

    def vector_field(self, x):
        return self.lam * x


def test_fixed_step_dopri5_is_its_tableau_even_where_its_error_estimate_is_huge():
    """steps = 4 with dopri5 on x' = -200 x: every step accepted at h = 1/4 (h lam = -50, far outside its
    stability region: left to itself the solver rejects such a step even at rtol = atol = 1), and x(1) =
    R(h lam)^4 x0 with R(z) = 1 + z + z^2/2 + z^3/6 + z^4/24 + z^5/120 + z^6/600, dopri5's stability polynomial."""
    lam, n = -200.0, 4
    out, f = wp.solve(_Decay(lam), torch.ones(1, 1, 1, 1, dtype=D), torch.tensor([0.0, 1.0], dtype=D), "dopri5",
                      steps=n)
    z = lam / n
    R = 1 + z + z ** 2 / 2 + z ** 3 / 6 + z ** 4 / 24 + z ** 5 / 120 + z ** 6 / 600
    assert f.steps == [(k / n, 1 / n) for k in range(n)] and f.rejected == 0
    assert float(out[-1]) == pytest.approx(R ** n, rel=1e-12)


def test_step_derivatives_fit_each_step_on_its_own_samples():
    """Each step's quartic is fitted to that step's samples only: two steps carrying different quartics, the first
    ending at 0.1 (float32 rounds it up), give each step's exact derivative at its inner samples."""
    from lipcheck.wellposed.certificate import _step_derivatives
    steps = [(0.0, 0.1), (0.1, 0.3)]
    nodes = torch.linspace(0, 1, 5, dtype=D)
    grid = torch.unique(torch.cat([a + (b - a) * nodes for a, b in steps]))
    c1 = torch.tensor([0.3, -1.0, 2.0, 0.5, -0.7], dtype=D)
    c2 = torch.tensor([0.0, 4.0, -3.0, 1.0, 2.5], dtype=D)  # y = p1(0.1) + p2(t - 0.1) on the second step
    p = lambda c, s: sum(c[k] * s ** k for k in range(5))  # noqa: E731
    dp = lambda c, s: sum(k * c[k] * s ** (k - 1) for k in range(1, 5))  # noqa: E731
    y = torch.where(grid <= 0.1, p(c1, grid), p(c1, torch.tensor(0.1, dtype=D)) + p(c2, grid - 0.1))
    dy = _step_derivatives(steps, grid, y.reshape(-1, 1, 1, 1, 1))[0].reshape(-1)  # (G, B, H, W, C)
    first, second = grid < 0.1, grid > 0.1
    assert torch.allclose(dy[first], dp(c1, grid[first]), rtol=1e-9, atol=1e-9)
    assert torch.allclose(dy[second], dp(c2, grid[second] - 0.1), rtol=1e-9, atol=1e-9)


def test_gradient_check_passes_land_on_t1():
    """Both passes step onto t1 (torchdiffeq's step_t) instead of overshooting it and reading x(t1) off the dense
    output: their loss is <w, x(t1)> of dopri5 landing on t1, solved here with torchdiffeq directly, to rounding,
    and visibly not the overshooting solve's."""
    import torchdiffeq
    model, _ = linear_model(seed=0, scale=1.0)
    images = torch.randn(1, 3, 12, 12, generator=torch.Generator().manual_seed(1), dtype=D)
    r = wp.gradient_check(model, images)  # dopri5, tol 1e-6, seed 0
    block, x0, t1 = wp.prepare(model, images)
    w = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0), dtype=D)
    tt = torch.tensor([0.0, t1], dtype=D)
    with torch.no_grad():
        solve = lambda **kw: torchdiffeq.odeint(lambda t, x: block.vector_field(x), x0, tt, method="dopri5",  # noqa
                                                rtol=1e-6, atol=1e-6, **kw)[-1]
        land, over = float((solve(options={"step_t": tt[-1:]}) * w).sum()), float((solve() * w).sum())
    assert abs(land - over) > 1e-10 * abs(land)
    for p in (r["backprop"], r["adjoint"]):
        assert p["loss"] == pytest.approx(land, rel=1e-13, abs=0), (p["loss"], land, over)
