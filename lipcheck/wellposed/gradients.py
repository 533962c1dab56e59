"""Adjoint gradients against backpropagation through the solver, with the solver's work counted per pass.

What users of Neural-ODE solvers ask for: NFE of the forward and the backward (adjoint) pass counted
separately, accepted and rejected steps of each pass, steps of the forward pass accepted at the `min_step`
clamp (torchdiffeq accepts every step with dt <= min_step whatever its error; the adjoint pass runs without
min_step, so it has none), and how far the adjoint
gradient is from the gradient of the discrete solve (backpropagation through the solver's operations).
"""
from __future__ import annotations

import math
import time

import torch

from ..models.ode import integrate
from .solve import CountingField, check_methods, check_tolerances, prepare


class _PassCounter(CountingField):
    """CountingField that also counts the adjoint pass (torchdiffeq's `*_adjoint` callbacks) and the steps
    accepted at dt <= min_step."""

    def __init__(self, block, min_step: float):
        super().__init__(block)
        self.min_step = min_step

    def reset(self):
        super().reset()
        self.adj_steps, self.adj_rejected = [], 0

    def clamped(self, steps) -> int:
        return sum(1 for _, dt in steps if self.min_step > 0 and abs(dt) <= self.min_step)

    def callback_accept_step(self, t0, y0, dt):
        self.steps.append((float(t0.detach()), float(dt.detach())))

    def callback_accept_step_adjoint(self, t0, y0, dt):
        self.adj_steps.append((float(t0.detach()), float(dt.detach())))

    def callback_reject_step_adjoint(self, t0, y0, dt):
        self.adj_rejected += 1


def _one_pass(block, x0, t1, w, *, adjoint, method, tol, min_step):
    field = _PassCounter(block, min_step)
    params = [p for p in block.parameters() if p.requires_grad]
    x = x0.detach().clone().requires_grad_(True)
    tt = torch.tensor([0.0, t1], dtype=x0.dtype, device=x0.device)
    opts = {"step_t": tt[-1:]}
    if min_step > 0:
        opts["min_step"] = min_step
    start = time.perf_counter()
    xt = integrate(field, x, tt, method=method, rtol=tol, atol=tol, options=opts, adjoint=adjoint)[-1]
    loss = (xt * w).sum()
    nfe_fwd, fwd_steps, fwd_rej = field.nfe, list(field.steps), field.rejected
    grads = torch.autograd.grad(loss, [x] + params)
    seconds = time.perf_counter() - start
    return {"loss": float(loss.detach()), "grad_x0": grads[0].detach(), "grad_params": [g.detach() for g in grads[1:]],
            "nfe_forward": nfe_fwd, "nfe_backward": field.nfe - nfe_fwd, "accepted": len(fwd_steps),
            "rejected": fwd_rej, "min_step_clamps": field.clamped(fwd_steps),
            "accepted_backward": len(field.adj_steps), "rejected_backward": field.adj_rejected,
            # lipcheck's integrate gives the adjoint pass its own options (no min_step): nothing is clamped there
            "min_step_clamps_backward": 0 if adjoint else None, "seconds": seconds}


def gradient_check(model, images, *, method: str = "dopri5", tol: float = 1e-6, min_step: float = 0.0,
                   seed: int = 0, device=None, dtype=torch.float64) -> dict:
    """Gradients of the linear functional loss = <w, x(t1)> (w a seeded Gaussian direction) with respect to x0 and
    the block's parameters, by the adjoint method (torchdiffeq.odeint_adjoint) and by backpropagation through the
    solver (odeint), each with its NFE forward / backward, accepted / rejected steps and min-step clamps.
    Returns both passes' counts and the relative Frobenius distance of the two gradients (x0 and all parameters).
    Backpropagation re-evaluates nothing (nfe_backward 0): it differentiates the recorded solver operations, so it
    is the exact gradient of the discrete solve; the adjoint solves the continuous adjoint ODE, and the two agree
    to about the solver tolerance."""
    check_tolerances([tol])
    check_methods([method])
    if not (math.isfinite(min_step) and min_step >= 0):
        raise ValueError(f"min_step must be a finite number >= 0, got {min_step!r}")
    block, x0, t1 = prepare(model, images, device=device, dtype=dtype)
    for p in block.parameters():
        p.requires_grad_(True)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(x0.shape, generator=g, dtype=x0.dtype).to(x0.device)
    runs = {"backprop": _one_pass(block, x0, t1, w, adjoint=False, method=method, tol=tol, min_step=min_step),
            "adjoint": _one_pass(block, x0, t1, w, adjoint=True, method=method, tol=tol, min_step=min_step)}
    a, b = runs["adjoint"], runs["backprop"]
    flat = lambda r: torch.cat([r["grad_x0"].flatten()] + [q.flatten() for q in r["grad_params"]])  # noqa: E731
    rel = float((flat(a) - flat(b)).norm() / flat(b).norm().clamp_min(1e-300))
    rel_x0 = float((a["grad_x0"] - b["grad_x0"]).norm() / b["grad_x0"].norm().clamp_min(1e-300))
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("grad")}  # noqa: E731
    return {"method": method, "tol": tol, "min_step": min_step, "rel_diff": rel, "rel_diff_x0": rel_x0,
            "backprop": strip(b), "adjoint": strip(a), "grad_x0_adjoint": a["grad_x0"], "grad_x0_backprop": b["grad_x0"]}
