"""Statistics of benchmark timings: the summary of a row's repeats, the speed-up of one mixer over another
formed within a round and combined over rounds, their percentile-bootstrap intervals, and fitted exponents."""
from __future__ import annotations

import math
import statistics


def fit_exponent(x, y) -> float:
    """Least-squares slope of log y against log x (the exponent p of y ~ x^p)."""
    pts = [(math.log(a), math.log(b)) for a, b in zip(x, y) if a and b and a > 0 and b > 0]
    if len(pts) < 2:
        return float("nan")
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx > 0 else float("nan")


def summarize(times: list[float]) -> dict:
    """Median, min, max and relative spread (max - min) / median of repeat times."""
    med = statistics.median(times)
    return {"median_s": med, "min_s": min(times), "max_s": max(times),
            "spread": (max(times) - min(times)) / med if med > 0 else float("nan"), "repeats": len(times)}


def ratio_interval(num: list[float], den: list[float], level: float = 0.95, n_boot: int = 4000,
                   seed: int = 0) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of median(num) / median(den) (a speed-up: num the attention's times, den
    SSoG's). `measure_row` takes the i-th sample of each mixer in the same round, one after the other, so a slow
    spell of a shared machine moves both: with as many samples of each, whole rounds are resampled (the pairing
    kept); otherwise each list on its own. None with fewer than three samples of either."""
    return rounds_ratio_interval([num], [den], level, n_boot, seed)


def run_ratios(nums: list[list[float]], dens: list[list[float]]) -> list[float]:
    """median(num_k) / median(den_k) for each run k: a speed-up formed from one run's own samples (taken under one
    machine state)."""
    return [statistics.median(a) / statistics.median(b) for a, b in zip(nums, dens)]


def rounds_ratio(nums: list[list[float]], dens: list[list[float]]) -> float:
    """Median over runs of `run_ratios`: the runs (minutes apart, the machine's speed between them differing)
    combined by their median."""
    return statistics.median(run_ratios(nums, dens))


def rounds_ratio_interval(nums: list[list[float]], dens: list[list[float]], level: float = 0.95, n_boot: int = 4000,
                          seed: int = 0) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of `rounds_ratio`: every run's samples resampled within that run (as
    `ratio_interval` does for one), the runs kept. None when a run has fewer than three samples of either."""
    import numpy as np
    if not nums or len(nums) != len(dens):
        return None
    rng = np.random.default_rng(seed)
    per_run = []
    for num, den in zip(nums, dens):
        a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
        if a.size < 3 or b.size < 3:
            return None
        ia = rng.integers(0, a.size, (n_boot, a.size))
        ib = ia if a.size == b.size else rng.integers(0, b.size, (n_boot, b.size))
        per_run.append(np.median(a[ia], axis=1) / np.median(b[ib], axis=1))
    ratios = np.median(np.stack(per_run), axis=0)
    tail = 50 * (1 - level)
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return float(lo), float(hi)
