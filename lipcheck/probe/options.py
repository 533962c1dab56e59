"""The probe's knobs (`ProbeOptions`: search effort, certification, fit) and the checks of its arguments."""
from __future__ import annotations

import dataclasses
import math

import torch

from .certification import CERTIFY_METHODS


@dataclasses.dataclass(frozen=True)
class ProbeOptions:
    """How hard `attention_growth` searches and how it certifies; checked on construction.

    restarts: starting points per radius; all radii's restarts are searched together as one batch
    (witnesses, constant tokens, random). steps: projected ascent steps. lr: initial step as a fraction of R
    (adapted per restart). power_warmup: power-iteration steps for v before the ascent. refine_rounds,
    refine_steps (None: steps), refine_top: the batched refinement rounds (continue the best refine_top
    restarts per radius, plus one from the next smaller radius's best input). certify_top: how many of the
    best restarts per radius are certified in float64 (plus the best witness-started one), by Lanczos
    ("auto") stopped at relative residual certify_tol or after certify_steps, or by dense jacrev + SVD
    ("dense", small grids). fit_min_radius: the smallest radius of the exponent fit (None: the upper half of
    the radii). witnesses: start from the structured witnesses (DenseAttention). analytic: use the
    batched-matmul tangent map where one exists (else torch.func.jvp). batch_radii: False runs each radius's
    ascent and certification on its own (same numbers, slower; for checking). dtype: of the search
    (certification is float64). seed: of the random starts (each radius draws from (seed, R) alone)."""
    restarts: int = 16
    steps: int = 60
    lr: float = 0.05
    power_warmup: int = 10
    certify_method: str = "auto"
    certify_steps: int = 60
    certify_tol: float = 1e-6
    certify_top: int = 2
    refine_rounds: int = 2
    refine_steps: int | None = None
    refine_top: int = 4
    fit_min_radius: float | None = None
    witnesses: bool = True
    analytic: bool = True
    batch_radii: bool = True
    dtype: torch.dtype = torch.float64
    seed: int = 0

    def __post_init__(self):
        check_options(self)


def check_options(o: ProbeOptions) -> None:
    """A ValueError naming the first bad knob."""
    if not (isinstance(o.restarts, int) and o.restarts >= 1):
        raise ValueError(f"restarts must be an integer >= 1 (the number of starting points per radius), "
                         f"got {o.restarts!r}")
    if not (isinstance(o.steps, int) and o.steps >= 0):
        raise ValueError(f"steps must be an integer >= 0, got {o.steps!r}")
    if not (isinstance(o.certify_top, int) and o.certify_top >= 1):
        raise ValueError(f"certify_top must be an integer >= 1, got {o.certify_top!r}")
    if not (isinstance(o.certify_steps, int) and o.certify_steps >= 1):
        raise ValueError(f"certify_steps must be an integer >= 1 (the most Lanczos steps), got {o.certify_steps!r}")
    tol = o.certify_tol
    if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
        raise ValueError(f"certify_tol must be a positive relative tolerance such as 1e-6, got {tol!r}")
    if o.certify_method not in CERTIFY_METHODS:
        raise ValueError(f"unknown certify_method {o.certify_method!r}; choose one of {CERTIFY_METHODS}")
    if not (isinstance(o.refine_rounds, int) and o.refine_rounds >= 0):
        raise ValueError(f"refine_rounds must be an integer >= 0, got {o.refine_rounds!r}")
    refine_steps = o.steps if o.refine_steps is None else o.refine_steps
    if not (isinstance(refine_steps, int) and refine_steps >= 0):
        raise ValueError(f"refine_steps must be an integer >= 0, got {refine_steps!r}")
    if not (isinstance(o.refine_top, int) and o.refine_top >= 1):
        raise ValueError(f"refine_top must be an integer >= 1, got {o.refine_top!r}")


def probe_options(options: ProbeOptions | None, knobs: dict) -> ProbeOptions:
    """`options` (default ProbeOptions()) with the keyword arguments `knobs` in place of its fields."""
    if options is None:
        options = ProbeOptions()
    elif not isinstance(options, ProbeOptions):
        raise TypeError(f"options must be a ProbeOptions, got {type(options).__name__}")
    fields = {f.name for f in dataclasses.fields(ProbeOptions)}
    unknown = sorted(set(knobs) - fields)
    if unknown:
        raise TypeError(f"attention_growth() got an unexpected keyword argument {unknown[0]!r}")
    return dataclasses.replace(options, **knobs) if knobs else options


def check_radii(radii) -> list:
    """radii as a list of floats, positive, finite and strictly increasing, or a ValueError naming `radii`."""
    try:
        radii = [float(r) for r in radii]
    except (TypeError, ValueError):
        raise ValueError(f"radii must be a sequence of positive numbers, got {radii!r}") from None
    if not radii:
        raise ValueError("radii is empty; pass at least one positive radius, e.g. [1, 2, 4]")
    bad = [r for r in radii if not (math.isfinite(r) and r > 0)]
    if bad:
        raise ValueError(f"radii must be positive and finite (L(R) is a sup over ||X||_F <= R); bad values: {bad}")
    if any(b <= a for a, b in zip(radii, radii[1:])):
        raise ValueError(f"radii must be strictly increasing, got {radii}; sort them")
    return radii
