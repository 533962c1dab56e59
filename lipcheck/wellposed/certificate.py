"""The sampled a-posteriori certificate int_0^t exp(L (t - s)) ||delta(s)|| ds with the local Lipschitz constant
(kept for comparison: its defect is only sampled and L is a norm bound; `enclosure.enclose` is the proof)."""
from __future__ import annotations

import math

import torch

from ..models.ode import FIXED_STEP
from .gronwall import auto_grid, segment_variance_floor, token_speed_bound, vector_field_constants
from .solve import check_methods, check_tolerances, prepare, reference_solution, sample_norm, solve

# ------------------------------------------------------------------------------- a-posteriori certificate

def _quartic_fit(x: torch.Tensor, Y: torch.Tensor):
    """Least-squares quartic through samples Y (m+1, ...) at x in [0, 1]; the dense output of torchdiffeq's
    Runge-Kutta solvers is exactly a quartic per step, so the residual is round-off.

    Returns (coef (5, ...), slope_error): a bound on how far the fitted derivative d/dx can be from the true
    quartic's at x in [0, 1], per entry, if each sample carries an error up to the largest residual r
    (generously doubled): coefficient errors <= ||V^+||_2 sqrt(m+1) (2 r), d/dx sums k |dc_k| <= 10 max."""
    V = torch.stack([x ** k for k in range(5)], dim=1)
    flat = Y.reshape(Y.shape[0], -1)
    coef = torch.linalg.lstsq(V, flat).solution
    resid = float((V @ coef - flat).abs().max()) + 4 * torch.finfo(Y.dtype).eps * float(flat.abs().max())
    pinv_norm = 1.0 / float(torch.linalg.svdvals(V).min())
    return coef.reshape(5, *Y.shape[1:]), 10 * pinv_norm * math.sqrt(len(x)) * 2 * resid


def _upper_sum(delta: torch.Tensor, grid: torch.Tensor, L: float) -> torch.Tensor:
    """B(t_i) >= int_0^{t_i} e^{L (t_i - s)} d(s) ds with d taken as max(d(a), d(b)) on each interval [a, b]:
    B(t_{i+1}) = e^{L tau} B(t_i) + dmax (e^{L tau} - 1) / L, the exponential integrated exactly (inf on overflow)."""
    tau = grid[1:] - grid[:-1]
    dmax = torch.maximum(delta[:-1], delta[1:])
    grow = torch.exp(L * tau)
    gain = tau.clone() if L == 0 else torch.expm1(L * tau) / L  # (e^{L tau} - 1) / L -> tau as L -> 0
    bound = torch.zeros_like(delta)
    for i in range(len(tau)):
        bound[i + 1] = grow[i] * bound[i] + dmax[i] * gain[i]
    return bound


def _step_derivatives(steps, grid: torch.Tensor, y: torch.Tensor):
    """From the samples y (G, B, ...) on grid, per solver step: the fitted quartic's derivative at the samples,
    coefficient-sum sups of ||y'|| and ||y''|| per sample interval (n, B), the largest token's drift per interval
    (n,) and the fit's round-off in y' per sample (G,)."""
    fk = dict(dtype=y.dtype, device=y.device)
    n, B = len(grid) - 1, y.shape[1]
    dy = torch.empty_like(y)
    sup_d1, sup_d2 = torch.zeros(n, B, **fk), torch.zeros(n, B, **fk)
    drift_y = torch.zeros(n, **fk)
    slope_err = torch.zeros(len(grid), **fk)
    for a, b in steps:
        i0 = int(torch.searchsorted(grid, torch.tensor(a, **fk)))
        i1 = int(torch.searchsorted(grid, torch.tensor(b, **fk)))
        xs = (grid[i0:i1 + 1] - a) / (b - a)
        coef, serr = _quartic_fit(xs, y[i0:i1 + 1])
        h = b - a
        slope_err[i0:i1 + 1] = torch.maximum(slope_err[i0:i1 + 1], torch.tensor(serr / h, **fk))
        dy[i0:i1 + 1] = sum(k * coef[k] * xs.reshape(-1, *[1] * (y.dim() - 1)) ** (k - 1) for k in range(1, 5)) / h
        cn = [sample_norm(coef[k]) for k in range(5)]  # (B,)
        sup_d1[i0:i1] = sum(k * cn[k] for k in range(1, 5)) / h
        sup_d2[i0:i1] = sum(k * (k - 1) * cn[k] for k in range(2, 5)) / h ** 2
        tok = [coef[k].norm(dim=-1) for k in range(5)]  # per token: sup ||y_i'|| <= sum_k k ||c_k,i|| / h
        drift_y[i0:i1] = float(sum(k * tok[k] for k in range(1, 5)).max()) / h * (grid[i0 + 1:i1 + 1] - grid[i0:i1])
    return dy, sup_d1, sup_d2, drift_y, slope_err


def aposteriori_certificate(model, images, *, method: str = "dopri5", tol: float = 1e-3, per_step: int | None = None,
                            reference_rtol: float = 1e-11, input_scale: float = 1.0, safety: float = 2.0,
                            lipschitz: float | None = None, device=None, dtype=torch.float64) -> dict:
    """Bound the error of an adaptive solve from its own dense output, and compare with the truth.

    y(t) is the solver's dense output (a quartic per accepted step, evaluated through `integrate` at
    per_step + 1 points per step; None: an even number >= 8 per step giving intervals no longer than
    t1 / `auto_grid`, so the variance floor survives the drift margin); the reference that gives the actual error
    lands on every sampled time and is converged to `reference_rtol` (1e-11: far below a loose solve's error); y'(t) is the derivative of that quartic, fitted exactly from the samples
    (round-off margin added); delta(t) = y'(t) - F(y(t)). Since y(0) = x0,
    ||x(t) - y(t)|| <= int_0^t exp(L (t - s)) ||delta(s)|| ds with L valid on every segment [x(s), y(s)]
    (`segment_variance_floor`, rigorous between samples).

    The quadrature takes ||delta|| on each sample interval as the larger endpoint value (`_upper_sum`) and adds
    an explicit safety margin: `safety` times the change of that sum when every other sample is dropped. This
    is not interval-rigorous between samples: the rigorous alternative, ||delta|| <= endpoint values + M tau / 2
    with M = sup||y''|| + L sup||y'|| from the quartic, is reported (`rigorous_margin_max`) and is far larger
    than the defect itself, because it ignores the cancellation y'' ~ J_F y'.
    """
    check_tolerances([tol])
    check_methods([method])
    if method in FIXED_STEP:
        raise ValueError(f"method must be an adaptive Runge-Kutta method with dense output, got {method!r}")
    if per_step is not None and (per_step < 4 or per_step % 2):
        raise ValueError(f"per_step must be an even number >= 4 (a quartic needs 5 points per step), got {per_step}")
    block, x0, t1 = prepare(model, images, input_scale=input_scale, device=device, dtype=dtype)
    fk = dict(dtype=dtype, device=x0.device)
    with torch.no_grad():
        _, field = solve(block, x0, torch.tensor([0.0, t1], **fk), method, tol=tol)
        steps = [(a, min(a + h, t1)) for a, h in field.steps if a < t1]
        dt = t1 / auto_grid(block, x0, t1, hi=1024)
        counts = [per_step or min(256, max(8, 2 * math.ceil((b - a) / (2 * dt)))) for a, b in steps]
        pts = torch.cat([a + (b - a) * torch.linspace(0.0, 1.0, m + 1, **fk)[:-1] for (a, b), m in zip(steps, counts)]
                        + [torch.tensor([t1], **fk)])
        grid = torch.unique(pts)  # sorted; shared step ends appear once
        y, field2 = solve(block, x0, grid, method, tol=tol)
        if field2.steps[:len(field.steps)] != field.steps[:len(field2.steps)]:
            raise RuntimeError("the solver took different steps when asked for dense output; cannot certify")
        F_y = block.vector_field(y.flatten(0, 1)).reshape(y.shape)
        start = 2 ** math.ceil(math.log2(max(len(grid) - 1, 8)))  # steps land on the grid anyway
        ref = reference_solution(block, x0, t1, t=grid, rel_tol=reference_rtol, start_steps=start)
    speed = token_speed_bound(block, device=x0.device)
    dy, sup_d1, sup_d2, drift_y, slope_err = _step_derivatives(steps, grid, y)
    tau = grid[1:] - grid[:-1]
    # ||delta|| plus the fit's round-off in y' (per entry, times sqrt(entries) for the sample norm)
    delta = sample_norm(dy - F_y) + slope_err[:, None] * math.sqrt(x0[0].numel())  # (G, B)
    margin = float(ref.abs_error.max())
    v_floor = segment_variance_floor(ref.states, y, speed * tau, drift_y, margin=margin)
    L_global, L, _ = vector_field_constants(block, x0, v_floor, dtype=dtype, device=x0.device)
    if lipschitz is not None:  # a constant supplied by the caller (checked, not trusted: violations say if too small)
        L = float(lipschitz)
    fine = _upper_sum(delta, grid, L)
    coarse = _upper_sum(delta[::2], grid[::2], L)  # per_step even: every step end survives
    change = (coarse - fine[::2]).abs().nan_to_num(nan=math.inf)  # inf - inf: vacuous, say so
    # at the even samples; odd ones take the larger neighbouring change
    bound = fine.clone()
    bound[::2] += safety * change
    bound[1::2] += safety * torch.maximum(change[:-1], change[1:])
    actual = sample_norm(y - ref.states)
    viol = int((~(bound[1:] >= actual[1:])).sum())  # a NaN bound is no bound: it counts as violated
    ratio = bound[1:] / actual[1:].clamp_min(1e-300)
    rigorous = float(((sup_d2 + L * sup_d1) * tau[:, None] / 2).max())
    return {"method": method, "tol": tol, "accepted": field.accepted, "rejected": field.rejected, "nfe": field.nfe,
            "t": grid.tolist(), "bound": bound.T.tolist(), "actual": actual.T.tolist(), "delta": delta.T.tolist(),
            "L": L, "L_global": L_global, "min_variance": v_floor, "speed_bound": speed, "safety": safety,
            "quadrature_change": float((change / fine[::2].clamp_min(1e-300))[1:].nan_to_num(nan=math.inf).max()),
            "global_factor_log10_t1": L_global * t1 / math.log(10), "derivative_roundoff_margin": float(slope_err.max()),
            "rigorous_margin_max": rigorous, "max_delta": float(delta.max()),
            "reference": ref.summary(), "violations": viol,
            "min_ratio": float(ratio.min()), "max_ratio": float(ratio.max()),
            "bound_t1": bound[-1].tolist(), "actual_t1": actual[-1].tolist()}
