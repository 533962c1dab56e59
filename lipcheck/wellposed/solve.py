"""Integration plumbing shared by the well-posedness checks: inputs, solves with exact step counts, the converged
fixed-step dopri8 reference.

Norms are per sample: the Frobenius norm of one sample's (H, W, C) state. Samples never interact (the mixer acts
within one token grid), so every statement holds sample by sample.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Sequence

import torch

from ..mixers.ssog import SSoG
from ..models.ode import FIXED_STEP, SOLVERS, VectorField, integrate

METHODS = ("dopri5", "dopri8", "bosh3", "rk4")
TOLERANCES = tuple(10.0 ** -k for k in range(2, 11))
RK4_STEPS = tuple(2 ** k for k in range(2, 10))  # 4 ... 512 steps, each halving the step
STAGES = {"dopri5": 6, "dopri8": 13, "bosh3": 3, "rk4": 4}  # new evaluations per step (FSAL counted once)


class CountingField(VectorField):
    """VectorField that also counts the solver's accepted and rejected steps.

    torchdiffeq calls `callback_accept_step` / `callback_reject_step` on the function it integrates at
    every step decision of its adaptive Runge-Kutta solvers, so these counts are exact, not inferred
    from NFE. Fixed-grid solvers make no decisions: there every step is accepted by construction.
    """

    def __init__(self, block):
        super().__init__(block)
        self.reset()

    def reset(self):
        self.nfe, self.rejected, self.steps = 0, 0, []

    @property
    def accepted(self) -> int:
        return len(self.steps)

    def callback_accept_step(self, t0, y0, dt):
        self.steps.append((float(t0), float(dt)))

    def callback_reject_step(self, t0, y0, dt):
        self.rejected += 1


# ----------------------------------------------------------------------------------------------- inputs

def check_methods(methods: Sequence[str]) -> tuple:
    methods = tuple(methods)
    if not methods:
        raise ValueError("methods must name at least one solver, e.g. ('dopri5', 'dopri8', 'bosh3', 'rk4')")
    for m in methods:
        if m not in SOLVERS:
            raise ValueError(f"unknown solver method {m!r} in methods; choose among {SOLVERS}")
    return methods


def check_tolerances(tolerances: Sequence[float]) -> tuple:
    tolerances = tuple(tolerances)
    if not tolerances:
        raise ValueError("tolerances must hold at least one positive number, e.g. (1e-3, 1e-6)")
    for tol in tolerances:
        if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
            raise ValueError(f"tolerances must be positive finite numbers (rtol = atol = tol), got {tol!r}")
    return tuple(sorted((float(t) for t in tolerances), reverse=True))


ENCLOSE_SSOG_BACKEND = "stacked"  # the SSoG backend of the block `prepare` returns (the field the proofs are about)


def prepare(model, images, *, input_scale: float = 1.0, device=None, dtype=torch.float64):
    """(block, x0, t1): the ODE ViT's block cast to dtype/device (a copy, an SSoG mixer set to the stacked GEMM
    backend, ENCLOSE_SSOG_BACKEND), x0 = input_scale * embed(images)."""
    if getattr(model, "variant", None) != "ode":
        raise ValueError("model must be an ODE ViT (lipcheck.ViT('ode', ...) or vit_from_preset(name, 'ode', ...)); "
                         f"got variant {getattr(model, 'variant', type(model).__name__)!r}")
    if not (math.isfinite(input_scale) and input_scale > 0):
        raise ValueError(f"input_scale must be a positive finite number, got {input_scale!r}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
    block = model.vector_field.block
    if isinstance(block.mixer, SSoG):
        # the GEMM backend whatever the model uses: Lemma 4's rounding model (dot products of lengths W and H M)
        # covers it (an FFT evaluation would not fit), and it is the fastest float64 field (ti: 1.5 ms a state
        # against 2.3 ms for the einsum reference, the same floats)
        block.mixer.backend = ENCLOSE_SSOG_BACKEND
        block.mixer.clear_kernel_cache()
    images = torch.as_tensor(images).to(device=device, dtype=dtype)
    if not torch.isfinite(images).all():
        raise ValueError("images must be finite (got NaN or inf)")
    with torch.no_grad():
        x0 = model.embed(images) * input_scale
    for p in model.parameters():
        p.requires_grad_(False)
    return block, x0, float(model.t1)


def sample_norm(x: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of each sample: (..., B, H, W, C) -> (..., B)."""
    return x.flatten(-3).norm(dim=-1)


def token_std(x: torch.Tensor) -> torch.Tensor:
    """Per-token standard deviation as LayerNorm sees it (biased): (..., C) -> (...)."""
    return x.var(dim=-1, unbiased=False).sqrt()


# -------------------------------------------------------------------------------------------- solving

def solve(block, x0: torch.Tensor, t: torch.Tensor, method: str, *, tol: float | None = None,
          steps: int | None = None, step_t: torch.Tensor | None = None, land: bool = False,
          max_num_steps: int | None = None):
    """One integration through `lipcheck.models.ode.integrate`; returns (states at t, CountingField).

    Adaptive methods take rtol = atol = tol; `land=True` makes the last step end exactly on t[-1]
    (torchdiffeq's `step_t`) instead of overshooting and reading the final state off the dense output,
    which for every torchdiffeq Runge-Kutta method is a quartic (4th order, even for dopri8).
    Fixed steps (`steps` given): rk4 on its grid; an adaptive Runge-Kutta method with
    min_step = max_step = first_step = t1/steps, which torchdiffeq then accepts unconditionally, i.e. that
    method's tableau at a fixed step (optionally also landing on every time in `step_t`).
    """
    field = CountingField(block)
    if method in FIXED_STEP:  # fixed grids make no step decisions: no callbacks to call
        field = VectorField(block)
        field.steps, field.rejected = [], 0
    t1 = float(t[-1] - t[0])
    if steps is not None:
        if steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps}")
        h = t1 / steps
        if method in FIXED_STEP:
            options = {"step_size": h}
        else:
            options = {"first_step": h, "min_step": h, "max_step": h}
            if step_t is not None:
                options["step_t"] = step_t
        out = integrate(field, x0, t, method=method, rtol=1.0, atol=1.0, options=options)
        if method in FIXED_STEP:
            field.steps = [(float(t[0]) + k * h, h) for k in range(steps)]
            field.accepted = steps
        return out, field
    if tol is None or method in FIXED_STEP:
        raise ValueError(f"method {method!r} needs steps (fixed step)" if method in FIXED_STEP else
                         f"method {method!r} needs tol (rtol = atol) or steps (fixed step)")
    options = {"step_t": t[-1:]} if land else {}
    if max_num_steps is not None:
        options["max_num_steps"] = max_num_steps
    return integrate(field, x0, t, method=method, rtol=tol, atol=tol, options=options), field


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-sample ||x - ref|| / ||ref||."""
    return sample_norm(x - ref) / sample_norm(ref)


@dataclasses.dataclass
class Reference:
    """A converged fixed-step dopri8 solution at times t and how its accuracy is known."""
    t: torch.Tensor
    states: torch.Tensor  # (len(t), B, H, W, C)
    steps: int
    error_estimate: float  # max over samples and t of ||x_n - x_{n/2}|| / ||x_n||, last halving
    abs_error: torch.Tensor  # (len(t), B): ||x_n - x_{n/2}|| per sample and time
    history: list  # per level: steps, nfe, relative change at the final time

    def summary(self) -> dict:
        return {"method": "dopri8 fixed step, halved until successive results agree", "steps": self.steps,
                "error_estimate": self.error_estimate, "history": self.history}


def reference_solution(block, x0: torch.Tensor, t1: float, *, t: torch.Tensor | None = None,
                       rel_tol: float = 1e-13, start_steps: int = 8, max_steps: int = 4096,
                       min_steps: int = 0) -> Reference:
    """Fixed-step dopri8 with step halving until the final states of successive halvings agree to rel_tol
    (or stop improving: the round-off floor). If `t` (a grid) is given, steps also land on every t.

    The last change ||x_n - x_{n/2}|| is reported as the error estimate. For an 8th-order method in its
    asymptotic range, x_n's own error is ~ that change / 255, so the estimate is conservative.
    """
    tt = torch.tensor([0.0, t1], dtype=x0.dtype, device=x0.device) if t is None else t
    step_t = None if t is None else t[1:-1]
    n, prev, history = start_steps, None, []
    while True:
        cur, field = solve(block, x0, tt, "dopri8", steps=n, step_t=step_t)
        if prev is not None:
            change = float(relative_error(cur[-1], prev[-1]).max())
            history.append({"steps": n, "nfe": field.nfe, "change": change})
            done = (change <= rel_tol and n >= min_steps) or n * 2 > max_steps
            floor = len(history) >= 3 and change >= history[-2]["change"] and n >= min_steps
            if done or floor:
                abs_err = sample_norm(cur - prev)
                err = float((abs_err / sample_norm(cur).clamp_min(1e-300)).max())
                return Reference(tt, cur, n, max(err, change), abs_err, history)
        prev, n = cur, n * 2


