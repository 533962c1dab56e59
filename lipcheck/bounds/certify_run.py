"""The state one certification carries from stage to stage (`_Run`) and what a stage returns (`Stage`): read by the
stages of lipcheck.bounds.lipschitz and by the Lanczos runs of lipcheck.bounds.lanczos_bounds."""
from __future__ import annotations

import dataclasses
import time

import torch

from . import spectral as sp
from .options import CertifyOptions, Plan


@dataclasses.dataclass
class _Run:
    """One certification: the normalised parameters q, the options o and plan pl, the rounding margins (B = the
    magnitude every rounding error is a multiple of), the clock the deadline reads, and what the stages found so far
    (certified upper bounds by stage in the layer's units, SSoGBound's seconds, method and info, the dense matrix
    where it was built, the circulant embedding's maximum, the dense SVD's value)."""
    q: sp.SSoGParams
    H: int
    W: int
    o: CertifyOptions
    pl: Plan
    sn: sp.SymbolNorm
    B: float
    dense_err: float
    apply_err: float
    margins: dict
    t_start: float
    bounds: dict = dataclasses.field(default_factory=dict)
    seconds: dict = dataclasses.field(default_factory=dict)
    method: dict = dataclasses.field(default_factory=dict)
    info: dict = dataclasses.field(default_factory=dict)
    cut: list = dataclasses.field(default_factory=list)
    dense: torch.Tensor | None = None
    circ: sp.SymbolMax | None = None
    circ_sn: sp.SymbolNorm | None = None
    exact: float | None = None
    exact_reason: str | None = None
    guide: torch.Tensor | None = None  # a Lanczos Ritz vector (normalised units), shared by the deflated bound
    guide_lower: float | None = None  # and the lower bound: ||T v|| / ||v|| at it, less its rounding

    @property
    def n(self) -> int:
        return self.H * self.W * self.q.dim

    @property
    def upper(self) -> float:
        return min(self.bounds.values())

    def late(self, stage: str) -> bool:
        """Past the wall-clock deadline: the stage is skipped (or stopped), and the result says so."""
        if self.o.deadline_s is not None and self.seconds_left() < 0:
            if stage not in self.cut:
                self.cut.append(stage)
            return True
        return False

    def seconds_left(self) -> float:
        return self.o.deadline_s - (time.perf_counter() - self.t_start)


@dataclasses.dataclass
class Stage:
    """What a bound method found: its certified upper bound in the layer's units (None: it gave none), the
    description SSoGBound.method shows, and its entry in SSoGBound.info (None: no entry)."""
    value: float | None
    method: str
    info: dict | None = None
