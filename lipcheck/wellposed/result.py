"""The result of the enclosure: what is proven, where, and with which numbers."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Enclosure:
    """What is proven for each sample b where proven[b] (proofs/S5.md, Theorems 5 and 6), x the true solution and y
    the computed piecewise quartic (the solver's dense output, known exactly):

    - on every interval [t[p-1], t[p]]: ||x(s) - y(s)|| <= radius[p, b] for every s in it (about y, not about the
      float `center[p]`); at t[0] = 0, radius[0, b] >= ||x0 - y(0)||;
    - at t1 itself: ||x(t1) - center[-1, b]|| <= radius_t1[b] (a point bound, no larger than the last interval's
      sup radius[-1, b] up to rounding; it is what the reports compare with the actual error at t1); with
      ref_tol=None it is about y(t1), as radius is;
    - at the returned times, center[p] = fl(y(t[p])): with the reference method (the default) radius[p] includes
      that evaluation's rounding, so ||x(t[p]) - center[p, b]|| <= radius[p, b]; with ref_tol=None add
      gamma_10 sum_k ||c_k|| (~1e-16 relative, Lemma 4) to it;
    - x exists and is unique on [0, t1], or, for a sample not proven, on [0, t[p]] up to its last finite radius.

    Where a check fails the radius is inf from there on and `reason` says which check failed, first where (time,
    step) and with which numbers. A float32 model is enclosed through its float64 re-embedding (its weights cast
    to float64 exactly): the statement is about that float64 field, not about float32 evaluation."""
    proven: torch.Tensor  # (B,) bool
    t: torch.Tensor  # (K,), ends at t1
    center: torch.Tensor  # (K, B, H, W, C)
    radius: torch.Tensor  # (K, B), inf after the first failed check
    reason: list  # per sample: None or why not proven (which check, where)
    tube: torch.Tensor  # (K - 1, B) tube radius assumed and verified on each interval
    mu: torch.Tensor  # (K - 1, B) log-norm bound over that tube
    mu_point: torch.Tensor  # (K, B) verified point log-norm bound at the centres
    defect: torch.Tensor  # (K - 1, B) rigorous sup ||delta|| on the interval
    defect_sampled: torch.Tensor  # (K - 1, B) largest sampled ||delta|| on the interval
    steps: list  # accepted solver steps (a, b)
    stats: dict
    distance: torch.Tensor = None  # (K, B) proven sup ||y - y_ref|| on each interval (reference method), else None
    reference: "Enclosure" = None  # the enclosure of the reference solve y_ref (reference method), else None
    radius_t1: torch.Tensor = None  # (B,) proven ||x(t1) - center[-1]|| at t1 itself; inf where not proven
    _envelope_data: dict = dataclasses.field(default=None, repr=False)
    _pieces: dict = dataclasses.field(default=None, repr=False)

    def point_radius_t1(self) -> torch.Tensor:
        """(B,) the proven bound at t1 itself: radius_t1 where the method gave one, else the last interval's radius."""
        return self.radius[-1] if self.radius_t1 is None else self.radius_t1

    def summary(self) -> dict:
        B = len(self.proven)
        return {"proven": self.proven.tolist(), "reason": self.reason, "t": self.t.tolist(),
                "radius": self.radius.T.tolist(), "tube_max": self.tube.amax(0).tolist(),
                "mu_max": self.mu.amax(0).tolist(), "mu_point": self.mu_point.T.tolist(),
                "defect_max": self.defect.amax(0).tolist(), "defect_sampled_max": self.defect_sampled.amax(0).tolist(),
                "radius_t1": self.point_radius_t1().tolist(), "radius_last_interval": self.radius[-1].tolist(),
                "samples": B,
                **self.stats, "distance_t1": self.stats.get("distance_t1")}
