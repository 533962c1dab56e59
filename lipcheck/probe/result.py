"""What the probe reports: `GrowthResult` (per-radius certified lower bounds, the fitted growth exponent) and
how the certified candidates become it. Since the balls are nested, L is nondecreasing in R: `lower` is the
running maximum of the per-radius values `attained` (a smaller radius's input lies in every larger ball).
"""
from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass
class GrowthResult:
    """Per-radius certified lower bounds on L(R) and the fitted growth exponent.

    attained[r] = ||J(X) v|| in float64 at the best certified input the search found for radius r itself
    (||X||_F <= radii[r]); lower[r] = max(attained[:r + 1]) (nested balls: L is nondecreasing), with X[r],
    v[r] the input and vector attaining it. tolerance[r] is the relative Lanczos residual reached for that
    v (0 for dense SVD), lanczos_steps[r] the steps it took. search[r] is the best value the search saw
    (in its dtype); witness[r] the best certified value among the witness-started restarts (nan if none).
    exponent is the least-squares slope of log lower on log R over R >= fit_min_radius, with a 95%
    t-interval exponent_ci. seconds: wall time of the search and of the certification."""
    radii: list
    lower: list
    attained: list
    search: list
    witness: list
    tolerance: list
    lanczos_steps: list
    X: torch.Tensor
    v: torch.Tensor
    exponent: float
    exponent_ci: tuple
    fit_min_radius: float
    intercept: float
    grid: tuple
    restarts: int
    steps: int
    certify_method: str
    certify_tol: float
    map: str
    tangent: str
    device: str
    dtype: str
    seconds: dict

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("X"), d.pop("v")
        d["X_norms"] = self.X.flatten(1).norm(dim=1).tolist()
        return d


def fit_exponent(radii, values, min_radius: float) -> tuple[float, tuple[float, float], float]:
    """Least squares log L = k log R + b over R >= min_radius; returns (k, 95% CI of k, b)."""
    import numpy as np
    from scipy import stats
    R, L = np.asarray(radii, float), np.asarray(values, float)
    sel = R >= min_radius
    if sel.sum() < 2:
        raise ValueError(f"fitting an exponent needs at least 2 radii >= fit_min_radius={min_radius}; "
                         f"got {int(sel.sum())}")
    x, y = np.log(R[sel]), np.log(L[sel])
    k, b = np.polyfit(x, y, 1)
    n = len(x)
    if n < 3:
        return float(k), (float("nan"), float("nan")), float(b)
    resid = y - (k * x + b)
    se = math.sqrt(float(resid @ resid) / (n - 2) / float(((x - x.mean()) ** 2).sum()))
    t = float(stats.t.ppf(0.975, n - 2))
    return float(k), (float(k - t * se), float(k + t * se)), float(b)


def per_radius(cand: list, value, X64, v64, rel, steps, best, kinds: list) -> dict:
    """Per radius, the certified candidate of largest value: "attained", "X", "v", "tolerance" and
    "lanczos_steps" of it, "search" the best search value, "witness" the best certified witness-started
    value (nan if none). cand: (radius index, restart index) per certified row."""
    out = {k: [] for k in ("attained", "search", "witness", "X", "v", "tolerance", "lanczos_steps")}
    for r in range(best.shape[0]):
        mine = [j for j, c in enumerate(cand) if c[0] == r]
        j = max(mine, key=lambda j: float(value[j]))
        out["attained"].append(float(value[j])); out["X"].append(X64[j]); out["v"].append(v64[j])
        out["tolerance"].append(float(rel[j])); out["lanczos_steps"].append(int(steps[j]))
        out["search"].append(float(best[r].max()))
        w = [float(value[j]) for j in mine if kinds[r][cand[j][1]] == "witness"]
        out["witness"].append(max(w) if w else float("nan"))
    return out


def running_max(per: dict) -> dict:
    """"lower" = running maximum of per["attained"] over the radii (nested balls: a smaller radius's input is
    admissible in every larger one), with the "X", "v", "tolerance", "lanczos_steps" of the value it keeps."""
    keys = ("X", "v", "tolerance", "lanczos_steps")
    out = {k: [] for k in ("lower",) + keys}
    for r, a in enumerate(per["attained"]):
        keep = bool(out["lower"]) and not a >= out["lower"][-1]  # a nan value keeps the previous one too
        out["lower"].append(out["lower"][-1] if keep else a)
        for k in keys:
            out[k].append(out[k][-1] if keep else per[k][r])
    return out


def fit_or_nan(radii: list, lower: list, min_radius: float) -> tuple[float, tuple[float, float], float]:
    """`fit_exponent`, or nans when fewer than 2 radii reach min_radius."""
    if sum(r >= min_radius for r in radii) >= 2:
        return fit_exponent(radii, lower, min_radius)
    return float("nan"), (float("nan"), float("nan")), float("nan")
