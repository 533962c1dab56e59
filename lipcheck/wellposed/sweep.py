"""Tolerance sweeps: every method at every tolerance against the converged reference; convergence slopes."""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

import torch
from tqdm.auto import tqdm

from ..mixers.ssog import SSoG
from ..models.ode import FIXED_STEP
from .solve import (METHODS, RK4_STEPS, TOLERANCES, Reference, check_methods, check_tolerances, prepare,
                    reference_solution, relative_error, solve)


@dataclasses.dataclass
class SweepResult:
    mixer: str
    runs: list  # one dict per run
    reference: Reference
    convergence: dict
    finals: dict  # (method, tol or steps) -> final state, kept out of JSON

    def summary(self) -> dict:
        return {"mixer": self.mixer, "runs": self.runs, "reference": self.reference.summary(),
                "convergence": self.convergence}


def tolerance_sweep(model, images, methods: Sequence[str] = METHODS, tolerances: Sequence[float] = TOLERANCES, *,
                    reference: Reference | None = None, rk4_steps: Sequence[int] = RK4_STEPS,
                    input_scale: float = 1.0, reference_rtol: float = 1e-13, land_on_t1: bool = True,
                    device=None, dtype=torch.float64, progress: bool = True) -> SweepResult:
    """Integrate the ODE ViT from embed(images) with every method at every rtol = atol in `tolerances`
    (fixed-step methods instead over `rk4_steps` step counts), in `dtype`, and compare each final state
    with a converged fixed-step dopri8 reference (per sample, relative Frobenius error).

    `land_on_t1`: adaptive runs end their last step on t1 (see `solve`); False reads x(t1) off the dense
    output, torchdiffeq's default. Returns runs (mixer, method, tol, steps, error = max over samples,
    errors per sample, ratio error/tol, nfe, accepted, rejected, seconds, final: "step" or "interpolated"),
    the reference and a convergence summary (`convergence_summary`).
    """
    methods = check_methods(methods)
    tolerances = check_tolerances(tolerances)
    block, x0, t1 = prepare(model, images, input_scale=input_scale, device=device, dtype=dtype)
    mixer = "ssog" if isinstance(block.mixer, SSoG) else "attention"
    if reference is None:
        reference = reference_solution(block, x0, t1, rel_tol=reference_rtol)
    ref = reference.states[-1]
    t = torch.tensor([0.0, t1], dtype=dtype, device=x0.device)
    jobs = [(m, None, int(n)) for m in methods if m in FIXED_STEP for n in rk4_steps]
    jobs = [(m, tol, None) for m in methods if m not in FIXED_STEP for tol in tolerances] + jobs
    runs, finals = [], {}
    for method, tol, n in tqdm(jobs, desc=f"sweep {mixer}", disable=not progress, leave=False):
        start = time.perf_counter()
        with torch.no_grad():
            out, field = solve(block, x0, t, method, tol=tol, steps=n, land=land_on_t1)
        seconds = time.perf_counter() - start
        errors = relative_error(out[-1], ref)
        error = float(errors.max())
        runs.append({"mixer": mixer, "method": method, "tol": tol, "steps": n,
                     "step_size": t1 / n if n else None, "error": error, "errors": errors.tolist(),
                     "ratio": error / tol if tol else None, "nfe": field.nfe, "accepted": field.accepted,
                     "rejected": field.rejected, "seconds": seconds, "input_scale": input_scale,
                     "final": "step" if (n or land_on_t1) else "interpolated"})
        finals[(method, tol if tol is not None else n)] = out[-1]
    convergence = convergence_summary(runs, reference.error_estimate, finals)
    return SweepResult(mixer, runs, reference, convergence, finals)


def _fit_slope(x: list, y: list) -> float | None:
    if len(x) < 2:
        return None
    lx, ly = torch.tensor(x, dtype=torch.float64).log10(), torch.tensor(y, dtype=torch.float64).log10()
    lx = lx - lx.mean()
    return float((lx * (ly - ly.mean())).sum() / lx.square().sum())


def convergence_summary(runs: list, reference_error: float, finals: dict | None = None,
                        floor_factor: float = 100.0) -> dict:
    """Per method: slope of log error vs log tol (adaptive) or vs log step (fixed), fitted over the runs
    whose error exceeds floor_factor * the reference's error estimate; orders of magnitude gained from the
    loosest to the tightest tolerance; for fixed steps the observed order per halving. Over methods:
    the pooled adaptive slope and, at the tightest tolerance, the spread (largest relative distance
    between two methods' final states, and the largest error)."""
    floor = floor_factor * max(reference_error, 1e-16)
    per_method = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        rs = [r for r in runs if r["method"] == method]
        if rs[0]["tol"] is not None:
            rs = sorted(rs, key=lambda r: -r["tol"])
            above = [r for r in rs if r["error"] > floor]
            per_method[method] = {
                "kind": "adaptive", "slope": _fit_slope([r["tol"] for r in above], [r["error"] for r in above]),
                "fitted_points": len(above),
                "orders_gained": math.log10(rs[0]["error"] / max(rs[-1]["error"], 1e-300)),
                "loosest": {"tol": rs[0]["tol"], "error": rs[0]["error"]},
                "tightest": {"tol": rs[-1]["tol"], "error": rs[-1]["error"]}}
        else:
            rs = sorted(rs, key=lambda r: r["steps"])
            above = [r for r in rs if r["error"] > floor]
            per_method[method] = {
                "kind": "fixed", "slope": _fit_slope([r["step_size"] for r in above], [r["error"] for r in above]),
                "fitted_points": len(above),
                "order_per_halving": [math.log2(a["error"] / b["error"]) for a, b in zip(above, above[1:])],
                "finest": {"steps": rs[-1]["steps"], "error": rs[-1]["error"]}}
    adaptive = [r for r in runs if r["tol"] is not None]
    out = {"per_method": per_method, "floor": floor}
    if adaptive:
        above = [r for r in adaptive if r["error"] > floor]
        out["slope"] = _fit_slope([r["tol"] for r in above], [r["error"] for r in above])
        tight = min(r["tol"] for r in adaptive)
        at = [r for r in adaptive if r["tol"] == tight]
        out["tightest_tol"] = tight
        out["max_error_at_tightest"] = max(r["error"] for r in at)
        if finals is not None and len(at) > 1:
            states = [finals[(r["method"], tight)] for r in at]
            out["spread"] = max(float(relative_error(a, b).max()) for i, a in enumerate(states) for b in states[i + 1:])
        else:
            out["spread"] = None
    return out


