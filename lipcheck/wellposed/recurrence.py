"""The radius recurrence of Theorem 5 (proofs/S5.md): the log-norm over a tube and the bootstrapped comparison
function, every scalar rounded in the safe direction whatever its sign.

Scalars are formed exactly in rationals (`fractions.Fraction`, exact for floats) and rounded once, up or down;
exponentials run in arb balls, whose upper ends are rounded up to floats (`upper`).
"""
from __future__ import annotations

import math
from fractions import Fraction

from ..rounding import gamma

INF = math.inf


def _arb():
    import flint
    return flint


def round_up(q: Fraction) -> float:
    """The smallest float >= the rational q (inf above the float range)."""
    try:
        f = float(q)
    except OverflowError:
        return INF
    return f if Fraction(f) >= q else math.nextafter(f, INF)


def round_down(q: Fraction) -> float:
    """The largest float <= the rational q (-inf below the float range)."""
    try:
        f = float(q)
    except OverflowError:
        return -INF
    return f if Fraction(f) <= q else math.nextafter(f, -INF)


def upper(x) -> float:
    """A float >= every point of the arb ball x: its exact upper end, rounded up (float() rounds to nearest)."""
    hi = x.upper()
    f = float(hi)
    if math.isnan(f):
        return INF
    if math.isinf(f):
        return f
    return f if _arb().arb(f) >= hi else math.nextafter(f, INF)


def up(x: float, terms: int = 4) -> float:
    """A float >= the exact value of a formula of <= terms float operations (or libm calls accurate to a few ulps)
    whose computed value is x with relative error <= gamma_terms, whatever x's sign: x + gamma_terms |x|, then
    one float up for the rounding of that sum (x (1 + gamma) would round a negative x the wrong way)."""
    if not math.isfinite(x):
        return x if x == -INF else INF
    return math.nextafter(x + gamma(terms) * abs(x), INF)


def _div_sqrt_up(a: Fraction, C: int) -> Fraction:
    """A float w >= a / sqrt(C) (a >= 0), checked exactly by w^2 C >= a^2."""
    w = float(a) / math.sqrt(C)
    while Fraction(w) ** 2 * C < a * a:
        w = math.nextafter(w, INF)
    return Fraction(w)


def tube_variance(std_floor: float, reach: float, C: int) -> float:
    """A float v <= (std_floor - reach / sqrt(C))^2 where that is positive, else 0 (Lemma 2: a token moved by d
    changes its std by at most d / sqrt(C)); -1 when the floor is lost (std_floor - reach / sqrt(C) <= 0)."""
    s = Fraction(std_floor) - _div_sqrt_up(Fraction(reach), C)
    return round_down(s * s) if s > 0 else -1.0


def _mu_bar(field, lam_hat, std_floor, drift, rho, C, offset=0.0, bend=INF):
    """mu over the tube: lam_hat + M2(v) (rho + drift), v the token-variance floor of the tube (Lemma 2). The sum is
    formed exactly (lam_hat may be negative) with gamma_8 (|lam_hat| + the growth) added for the float
    evaluation of M2(v), then rounded up. `offset`: the distance between the centre y and the float state at
    which lam_hat and std_floor were evaluated (its tube reaches that much further). `bend`: a bound on
    ||J_F(y(s)) - J_F(y(s_e))|| along y (Lemma 7), used in place of M2(v) drift where smaller. Returns (mu, v);
    (inf, 0) when the floor is lost."""
    if not (math.isfinite(rho + drift + offset) and math.isfinite(std_floor)):
        return INF, 0.0
    reach = Fraction(rho) + Fraction(drift) + Fraction(offset)
    if field.uses_variance:
        v = tube_variance(std_floor, round_up(reach), C)
        if v < 0:
            return INF, 0.0
    else:
        v = 0.0
    if lam_hat == -INF:
        return -INF, v
    M2 = field.curvature(v)
    if not math.isfinite(M2) or not math.isfinite(lam_hat):
        return INF, v
    lam = Fraction(lam_hat)
    along = Fraction(M2) * Fraction(drift)
    if math.isfinite(bend):
        along = min(along, Fraction(bend))
    grow = Fraction(M2) * (Fraction(rho) + Fraction(offset)) + along
    return round_up(lam + grow + Fraction(gamma(8)) * (abs(lam) + grow)), v


def _walk(flint, r, dsub, tau, mu):
    """R_{j+1} = R_j e^{mu tau} + d_j tau phi(mu tau) in arb from R_0 = r; returns (R_end, [upper(R_j)])."""
    m = flint.arb(mu)
    z = m * tau
    grow = z.exp()
    phi = (z.exp() - 1) / z if mu != 0 else flint.arb(1)
    ups = [upper(r)]
    for d in dsub:
        r = r * grow + flint.arb(d) * tau * phi
        ups.append(upper(r))
    return r, ups


def _propagate(flint, r, dsub, tau, mu):
    """r e^{mu tau} + d tau phi(mu tau) over the sub-intervals, in arb; returns (end, sup over the interval)."""
    end, ups = _walk(flint, r, dsub, tau, mu)
    return end, flint.arb(max(ups))


def _ladder(flint, field, r, dsub, tau, lam_hat, std_floor, drift, C, tube, max_tube, offset, bend=INF):
    """The tube radii to try: `tube` alone, or 2 s0 4^i (i < 8) capped by max_tube, s0 the sup at rho = 0."""
    if tube is not None:
        return [tube]
    mu0, _ = _mu_bar(field, lam_hat, std_floor, drift, 0.0, C, offset, bend)
    if not math.isfinite(mu0):
        return None
    _, sup0 = _propagate(flint, r, dsub, tau, mu0)
    rho = 2 * upper(sup0) + 1e-300
    trials = []
    for _ in range(8):
        trials.append(rho)
        rho *= 4
    return trials if max_tube is None else sorted({min(x, max_tube) for x in trials})


def _bootstrap(flint, field, r, dsub, tau, lam_hat, std_floor, drift, C, tube, max_tube, offset=0.0, bend=INF):
    """Assume the tube rho, bound r on the interval, accept iff r <= rho everywhere on it. A failure records the
    last tube tried (rho, mu) and `first`: the first sub-interval end (0 = the start) where the bound left the
    smallest tube tried; `why` says how the smallest and the largest tube failed (often differently: the error bound
    above the smallest, the largest leaving the region of positive token variance)."""
    if not math.isfinite(upper(r)):
        return dict(ok=False, why="error bound is not finite", first=0)
    trials = _ladder(flint, field, r, dsub, tau, lam_hat, std_floor, drift, C, tube, max_tube, offset, bend)
    if trials is None:
        return dict(ok=False, first=0, why=f"token variance floor lost: std floor {std_floor:.3g} - drift "
                                           f"{drift:.3g}/sqrt(C) <= 0, no curvature bound")
    last = smallest = None
    for rho in trials:
        mu, v = _mu_bar(field, lam_hat, std_floor, drift, rho, C, offset, bend)
        if not math.isfinite(mu):
            last = dict(ok=False, rho=rho, mu=mu, first=0, why=f"tube radius {rho:.3g} leaves the region of token "
                        f"variance > 0 (std floor {std_floor:.3g}): no curvature bound")
        else:
            end, ups = _walk(flint, r, dsub, tau, mu)
            s = max(ups)
            if s <= rho:
                return dict(ok=True, rho=rho, mu=mu, r_end=end, sup=s)
            last = dict(ok=False, rho=rho, mu=mu, first=next(j for j, x in enumerate(ups) if x > rho),
                        why=f"tube check failed: error bound {s:.3g} > tube radius {rho:.3g} (log-norm over the "
                            f"tube {mu:.4g})")
        smallest = smallest or last
    if smallest is not last:  # the smallest tube shows where the bound first failed; the largest, where it stopped
        last = dict(last, first=smallest["first"],
                    why=f"{smallest['why']} at the smallest tube tried; at the largest, {last['why']}")
    return last
