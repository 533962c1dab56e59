"""The settings of the enclosure (proofs/S5.md, Theorem 5) and the checks on what it is given."""
from __future__ import annotations

import dataclasses
import math

import torch

from ..models.ode import SOLVERS

# adaptive Runge-Kutta methods with dense output, whose accepted steps the enclosure follows
ENCLOSE_METHODS = tuple(m for m in ("adaptive_heun", "bosh3", "dopri5", "dopri8", "fehlberg2") if m in SOLVERS)


class EnclosureError(ValueError):
    """The enclosure cannot even be attempted (bad input): the message names the argument and the fix."""


@dataclasses.dataclass(frozen=True)
class DirectOptions:
    """How one solve is enclosed directly (Theorem 5). `defect_ratio`: sub-intervals are refined until the Taylor
    remainder is below this times the sampled defect, or below `defect_abs`; `mu_slack`: the curvature term of
    the log-norm over a tube may grow by about this much on a log-norm interval; `max_per_step`: the most defect
    sub-intervals per solver step; `tube` / `max_tube`: a fixed tube radius, the largest tube tried; `mu_claim`:
    a claimed point log-norm (float or callable y -> (B,)), used only where it is verified; `solver_field`: the
    field the solver integrates (default: the enclosed one); `max_seconds`: a time budget, counted from
    `clock_start` (a time.perf_counter() value; None: the start of the enclosure loop's call), checked after each
    step."""
    method: str = "dopri5"
    tol: float = 1e-3
    defect_ratio: float = 0.25
    mu_slack: float = 0.25
    max_per_step: int = 1024
    tube: float | None = None
    max_tube: float | None = None
    mu_claim: object = None
    solver_field: object = None
    progress: bool = False
    defect_abs: float = 0.0
    max_seconds: float | None = None
    clock_start: float | None = None


def check_method(method) -> str:
    if method not in ENCLOSE_METHODS:
        raise EnclosureError(f"method must be an adaptive Runge-Kutta method with dense output, one of "
                             f"{', '.join(ENCLOSE_METHODS)}; got {method!r}")
    return method


def check_settings(tol, max_seconds, max_work=None) -> None:
    if not (isinstance(tol, (int, float)) and math.isfinite(tol) and 0 < tol < 1):
        raise EnclosureError(f"tol must be a number in (0, 1) (rtol = atol = tol), got {tol!r}")
    # 0 is allowed: the first step is done, then the budget is spent
    if max_seconds is not None and not (isinstance(max_seconds, (int, float)) and max_seconds >= 0):
        raise EnclosureError(f"max_seconds must be a number of seconds >= 0 or None, got {max_seconds!r}")
    if max_work is not None and not (isinstance(max_work, (int, float)) and not isinstance(max_work, bool)
                                     and max_work > 0 and not math.isnan(max_work)):
        raise EnclosureError(f"max_work must be a positive number of defect sub-intervals or None (no budget), "
                             f"got {max_work!r}")


def check_inputs(x0, t1, opts: DirectOptions) -> None:
    """Refuse what cannot be enclosed, naming the argument."""
    if not torch.is_tensor(x0) or x0.dim() != 4:
        raise EnclosureError("x0 must be a tensor of shape (B, H, W, C)")
    if x0.shape[0] == 0:
        raise EnclosureError("the batch is empty (x0 has 0 samples): give at least one image")
    if not bool(torch.isfinite(x0).all()):
        raise EnclosureError("x0 must be finite (got NaN or inf in the initial state); fix the input")
    if not (isinstance(t1, (int, float)) and math.isfinite(t1) and t1 > 0):
        raise EnclosureError(f"t1 must be a positive finite end time, got {t1!r}")
    for name, v in (("tube", opts.tube), ("max_tube", opts.max_tube)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise EnclosureError(f"{name} must be a positive finite radius or None, got {v!r}")
    for name, v in (("defect_ratio", opts.defect_ratio), ("mu_slack", opts.mu_slack)):
        if not (math.isfinite(v) and v > 0):
            raise EnclosureError(f"{name} must be a positive finite number, got {v!r}")
    if opts.max_per_step < 8:
        raise EnclosureError(f"max_per_step must be >= 8, got {opts.max_per_step}")
    check_settings(opts.tol, opts.max_seconds)
