"""The certification entry point for Lip(SSoG) = ||T||_2 (SPEC S1, S2): `ssog_lipschitz` and its options.

It reads the primitives of `spectral` (parameters, fast operator, Lanczos, circulant embedding, symbol sup, Gram
iteration) and runs the methods above them that the size rule (`plan`) picks: the deflated bound (`deflation`,
its complement by `gram_envelope`) and the Toeplitz majorant (`majorant`). Data flows one way: spectral <- majorant,
gram_envelope, deflation <- this module.
"""
from __future__ import annotations

import dataclasses
import math
import secrets
import time

import torch

from ..rounding import norm2_upper
from . import spectral as sp
from .deflation import deflated_bound, planned_k
from .gram_envelope import ENVELOPE_BUDGET, affordable
from .majorant import toeplitz_majorant

# the resolution-free branch and bound's rounds cost about (anchors per round) C^3 each; the default caps them at this
# much work times budget_s / 60 s (200 rounds below C = 384; some 11 rounds, 20-40 s, at C = 768, where 200 rounds
# took many minutes); any stopping point is certified, only looser
RF_WORK = 2e10
# and caps the anchor bounds it evaluates (cells x 5 points x anchors x heads, over all rounds) at this count times
# budget_s / 60 s: at 8 heads, C = 128 its rounds grew to 9 s each by the fourth (one busy core), 200 would take hours
RF_PAIRS = 5e6

# The time budget the size rule's constants were sized for, on 2 cores: deflation.planned_k's k C near 4608 and
# GRAM_BUDGET, gram_envelope.ENVELOPE_BUDGET (measured: the deflated bound 5-35 s up to 32 x 32 at C <= 384)
DEFAULT_BUDGET_S = 60.0


@dataclasses.dataclass(frozen=True)
class CertifyOptions:
    """How `ssog_lipschitz` certifies. The defaults give the tightest certified bound that fits budget_s.

    budget_s: seconds (on 2 cores) the size rule plans for. It is converted into units of work from the sizes alone
    (`plan`), never read from a clock, so the same call gives the same bound on a busy and on a quiet machine.
    deadline_s: optional wall-clock limit; past it, optional stages are skipped or stopped early at a certified point,
    and the result lists them (SSoGBound.cut_short, budget['cut']).
    deflated / majorant: None lets the size rule decide; True / False force the stage on or off.
    deflation_k: token functions of the deflated bound (None: the size rule's k).
    exact_max: a dense SVD (Cholesky-verified) where N C <= exact_max; gram_max: Gram iteration where N C <= gram_max.
    resolution_free, rf_rtol, rf_max_rounds: the bound valid on every grid, its branch-and-bound tolerance and
    rounds (None: the size rule's, from RF_WORK and RF_PAIRS; a number: that many rounds, no work cap).
    circulant_rtol: tolerance of the circulant embedding's certified maximum.
    probabilistic, failure_probability, seed, target_gap, max_steps, memory_bytes: the Lanczos run that gives the
    lower bound and the probabilistic upper bound (it stops once both are within target_gap of the lower bound).
    symbol_start, symbol_start_tokens, symbol_steps: a symbol-guided Lanczos start on grids of many tokens.
    dtype, device: where the bounds are computed (float32 or float64; the deflated bound needs float64)."""
    budget_s: float = DEFAULT_BUDGET_S
    deadline_s: float | None = None
    dtype: torch.dtype = torch.float64
    device: object = None
    failure_probability: float = 1e-6
    target_gap: float = 1e-3
    max_steps: int = 400
    memory_bytes: float = 2e9
    exact_max: int = 4096
    gram_max: int = 1536
    resolution_free: bool = True
    rf_rtol: float = 1e-6
    rf_max_rounds: int | None = None
    circulant_rtol: float = 1e-9
    symbol_start: bool = True
    symbol_start_tokens: int = 1024
    symbol_steps: int = 40
    probabilistic: bool = True
    seed: int | None = None
    progress: bool = False
    majorant: bool | None = None
    deflated: bool | None = None
    deflation_k: int | None = None

    def __post_init__(self):
        for name in ("budget_s", "deadline_s"):
            v = getattr(self, name)
            if v is None and name == "deadline_s":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if not (0 < self.failure_probability < 1):
            raise ValueError(f"failure_probability must be in (0, 1), got {self.failure_probability}")
        for name in ("deflated", "majorant"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be None (the size rule decides), True or False, "
                                 f"got {getattr(self, name)!r}")


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(CertifyOptions))


def certify_options(options: CertifyOptions | None = None, **kw) -> CertifyOptions:
    """`options` (default CertifyOptions()) with the keyword arguments applied: the names of ssog_lipschitz's keyword
    arguments before CertifyOptions, and every other field. An unknown name raises TypeError listing the known ones."""
    if options is None:
        options = CertifyOptions()
    elif not isinstance(options, CertifyOptions):
        raise TypeError(f"options must be a lipcheck.bounds.CertifyOptions, got {type(options).__name__}")
    bad = sorted(set(kw) - set(OPTION_NAMES))
    if bad:
        raise TypeError(f"unknown certification option(s) {', '.join(map(repr, bad))}; the options are "
                        f"{', '.join(OPTION_NAMES)}")
    return dataclasses.replace(options, **kw) if kw else options


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which optional stages `ssog_lipschitz` runs, decided from the sizes alone (no clock): exact (dense SVD),
    deflated with k token functions (its complement: 'gram' or 'auto'), majorant; rule says why."""
    exact: bool
    deflated: bool
    deflation_k: int | None
    complement: str
    majorant: bool
    rule: str
    rf_max_rounds: int = 200
    rf_max_work: float | None = None


def rf_rounds(C: int, scale: float = 1.0) -> int:
    """Rounds of the resolution-free branch and bound that fit RF_WORK * scale: (anchors per round) C^3 each, the
    anchors as `_resolution_free` picks them; between 8 and 200."""
    k_anchor = max(4, min(64, int(1e8 / C ** 3)))
    return int(max(8, min(200, RF_WORK * scale / (k_anchor * float(C) ** 3))))


def plan(H: int, W: int, C: int, heads: int, options: CertifyOptions | None = None) -> Plan:
    """The size rule of the default certification: the tightest method that fits, best first.

    1. N C <= exact_max: the dense SVD, verified by Cholesky, is ||T|| up to rounding: nothing beats it.
    2. The deflated bound with the circulant Gram envelope on the complement (Theorem D4) where the envelope fits
       (half the torus within gram_envelope.MAX_FREQUENCIES: up to 32 x 32) and some k >= 1 token functions fit
       the work budgets (deflation.planned_k: k C near 4608, heads^4 (k C)^2 <= GRAM_BUDGET, both scaled by
       budget_s / 60 s): within 1e-6 to 1e-3 of ||T|| on the layers measured, 5-35 s.
    3. The Toeplitz majorant up to 4096 tokens (64 x 64).
    4. Beyond: the circulant embedding and the closed forms (always computed).
    deflated / majorant set to True or False in the options override the rule for that stage."""
    o = options if options is not None else CertifyOptions()
    N, n = H * W, H * W * C
    scale = o.budget_s / DEFAULT_BUDGET_S
    exact = n <= o.exact_max
    complement, k = "auto", o.deflation_k
    if o.deflated is not None:
        deflated, rule = o.deflated, f"deflated={o.deflated} (asked)"
    elif exact:
        deflated, rule = False, f"N*C = {n} <= exact_max = {o.exact_max}: the Cholesky-verified dense SVD"
    elif o.dtype != torch.float64:
        deflated, rule = False, "the deflated bound is certified in float64 only"
    else:
        kk = planned_k(H, W, C, heads, scale=scale) if o.deflation_k is None else int(o.deflation_k)
        deflated = kk >= 1
        if deflated:
            k, complement = kk, "gram" if o.deflation_k is None else "auto"
            rule = (f"deflated bound, circulant Gram envelope on the complement, k = {kk} token functions "
                    f"(k C = {kk * C}, {heads} heads, budget {o.budget_s:g} s)")
        else:
            rule = ("deflated bound does not fit: " + (f"the {H}x{W} grid is beyond the Gram envelope's frequencies"
                                                       if not affordable(H, W) else
                                                       f"{heads} heads at C = {C} exceed GRAM_BUDGET * {scale:g}"))
    if o.majorant is not None:
        majorant = o.majorant
    else:
        majorant = not deflated and not exact and N <= 4096
        if majorant:
            rule += "; Toeplitz majorant (N <= 4096)"
        elif not deflated and not exact:
            rule += f"; N = {N} > 4096: circulant embedding and closed forms only"
    rounds = o.rf_max_rounds if o.rf_max_rounds is not None else rf_rounds(C, scale)
    rf_work = None if o.rf_max_rounds is not None else RF_PAIRS * scale  # rounds asked for: no cap on their work
    return Plan(exact=exact, deflated=deflated, deflation_k=k, complement=complement, majorant=majorant, rule=rule,
                rf_max_rounds=int(rounds), rf_max_work=rf_work)


@dataclasses.dataclass
class SSoGBound:
    """Two-sided bounds on ||T||_2 for one fixed-kernel SSoG layer on an H x W grid (SPEC S1, S2).

    seed: the seed of the random Lanczos start (replay with ssog_lipschitz(..., seed=seed));
    margins: the rounding margins used, from the dtype's unit roundoff (proofs/S2.md);
    method: a description per stage; best_method: the stage whose certified bound is `upper` (a key of method:
    'exact', 'gram', 'deflated', 'majorant', 'circulant', 'resolution_free' or 'closed_form');
    budget: the plan (Plan's fields), the budget and deadline, and 'cut': stages a deadline skipped or stopped."""
    H: int
    W: int
    lower: float
    upper: float
    upper_probabilistic: float
    failure_probability: float
    exact: float | None
    exact_reason: str | None
    resolution_free: float
    closed_form: float
    circulant: float
    gram: float | None
    seconds: dict
    method: dict
    info: dict
    seed: int | None = None
    margins: dict = dataclasses.field(default_factory=dict)
    best_method: str | None = None
    budget: dict = dataclasses.field(default_factory=dict)

    @property
    def gap(self) -> float:
        return (self.upper - self.lower) / self.lower if self.lower > 0 else math.inf

    @property
    def gap_probabilistic(self) -> float:
        return (self.upper_probabilistic - self.lower) / self.lower if self.lower > 0 else math.inf

    @property
    def cut_short(self) -> bool:
        """True where the wall-clock deadline skipped or stopped a stage (the bounds are certified all the same)."""
        return bool(self.budget.get("cut"))

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["gap"], d["gap_probabilistic"] = self.gap, self.gap_probabilistic
        return d


def check_schedule(steps_cap: int) -> list[int]:
    """The Lanczos steps at which the stopping rule may look at the bound: every CHECK_EVERY steps, and the
    last step. Fixed before the run, so a union bound over it covers whichever check stops the run."""
    return sorted(set(range(sp.CHECK_EVERY, steps_cap + 1, sp.CHECK_EVERY)) | {steps_cap})


# the order in which equal certified values name the winner: the most direct certificate first
_WINNER_ORDER = ("exact", "gram", "deflated", "majorant", "circulant", "resolution_free", "closed_form")


def ssog_lipschitz(layer, H: int, W: int, options: CertifyOptions | None = None, **kw) -> SSoGBound:
    """Certified bounds on Lip(SSoG) = ||T||_2 on an H x W grid: the tightest certified upper bound the size rule fits
    in the time budget (CertifyOptions.budget_s, 60 s on 2 cores), best_method naming what won.

    options: a CertifyOptions; keyword arguments (dtype, device, failure_probability, target_gap, max_steps,
    memory_bytes, exact_max, gram_max, resolution_free, rf_rtol, circulant_rtol, symbol_start, symbol_start_tokens,
    symbol_steps, probabilistic, seed, progress, majorant, deflated, deflation_k, budget_s, deadline_s) set its fields.

    lower <= ||T||_2 <= upper <= resolution_free <= closed_form, upper = min(closed form, resolution-free,
    circulant embedding, Gram iteration, dense SVD, the Toeplitz majorant, the deflated bound with deflation_k token
    functions, its complement bounded by the circulant Gram envelope where affordable, else by the majorant's
    envelope), each stage run where `plan` says it fits (the dense SVD where N C <= exact_max, else the deflated bound
    up to 32 x 32, else the majorant up to 64 x 64), every one rounded outward with margins derived from the unit
    roundoff of `dtype` (float32 or float64). The operator is normalised first (powers of two out of alpha, W_V,
    W_O) and the bounds scaled back, so any scale the dtype holds is certified; a bound that cannot be represented, a
    NaN/inf anywhere, a half-precision layer or a kernel its dtype cannot carry raise ValueError instead of returning
    a number.

    upper_probabilistic holds with probability >= 1 - failure_probability over the random Lanczos start,
    the adaptive stopping rule included (union bound over the fixed check schedule). seed=None (default)
    draws a fresh seed, recorded in the result. A seed you choose gives the guarantee only for layers
    chosen independently of that seed (a layer tuned against a fixed seed can defeat it); reusing the
    recorded seed replays the run. exact is a dense SVD when N C <= exact_max, else None with the reason.
    """
    sp._check_grid_size(H, W)
    o = certify_options(options, **kw)
    t_start = time.perf_counter()
    cut = []

    def late(stage: str) -> bool:
        """Past the wall-clock deadline: the stage is skipped (or stopped), and the result says so."""
        if o.deadline_s is not None and time.perf_counter() - t_start > o.deadline_s:
            if stage not in cut:
                cut.append(stage)
            return True
        return False

    dtype, progress, failure_probability, seed = o.dtype, o.progress, o.failure_probability, o.seed
    p = sp.ssog_params(layer, dtype=dtype, device=o.device)
    q = sp.normalised(p)
    e2 = q.log2_scale
    N, C = H * W, q.dim
    n = N * C
    pl = plan(H, W, C, q.num_heads, o)
    seconds, method, info = {}, {}, {}
    bounds = {}  # certified upper bounds by stage, in the layer's units
    B = q.magnitude()
    dense_err = sp.dense_error(q, N)
    margins = dict(dtype=str(dtype), unit_roundoff=q.u, log2_scale=e2, magnitude=sp._scale_back(B, e2, up=True),
                   dense_error=sp._scale_back(dense_err, e2, up=True),
                   spectral_norms="verified by Cholesky (rounding.norm2_upper), no SVD error model",
                   tap_relative_error=float(sp.tap_error(q).max()), conversion_error=q.conversion_error)

    t = time.perf_counter()
    closed = sp.closed_form_bound(q)
    seconds["closed_form"], method["closed_form"] = time.perf_counter() - t, "sum_h ||P_h|| sum_m |alpha|"
    bounds["closed_form"] = closed

    sn = sp.SymbolNorm(q)
    t = time.perf_counter()
    if o.resolution_free and not late("resolution_free"):
        rf, rf_info = sp.resolution_free_bound(q, sn=sn, rtol=o.rf_rtol, progress=progress, max_rounds=pl.rf_max_rounds,
                                            max_work=pl.rf_max_work)
        rfree = min(rf.upper, closed)
        info["resolution_free"] = dict(symbol_sup_lower=rf.lower, argmax=rf.argmax, **rf_info)
        method["resolution_free"] = "branch and bound on the torus, SVD anchors, second-order cell bounds"
        bounds["resolution_free"] = rf.upper
    else:
        rfree = closed
        method["resolution_free"] = ("not computed (closed form)" if not o.resolution_free
                                     else "skipped: past the deadline (closed form)")
    seconds["resolution_free"] = time.perf_counter() - t

    t = time.perf_counter()
    circ = sp.circulant_bound(q, H, W, sn=sp.SymbolNorm(q), rtol=o.circulant_rtol)
    seconds["circulant"] = time.perf_counter() - t
    method["circulant"] = f"block-circulant embedding, certified max over the {2 * H - 1}x{2 * W - 1} DFT grid"
    info["circulant"] = dict(lower=circ.lower, argmax=circ.argmax, svds=circ.num_svd, points=circ.num_points)
    bounds["circulant"] = circ.upper

    dense = None
    gram = None
    t = time.perf_counter()
    if n <= o.gram_max:
        dense = sp.dense_operator(q, H, W)
        g_n, k = sp.gram_bound(dense)
        gram = sp._scale_back(g_n + dense_err, e2, up=True)
        method["gram"] = f"Gram iteration, {k} squarings, Cauchy-interlacing tightening"
        bounds["gram"] = gram
    else:
        method["gram"] = f"skipped: N*C = {n} > gram_max = {o.gram_max}"
    seconds["gram"] = time.perf_counter() - t
    upper = min(bounds.values())
    db = None
    if pl.deflated and not late("deflated"):  # deflation.py: T exactly on the top token functions, an envelope beyond
        envelope_budget = None
        if o.deflated is None and o.budget_s != DEFAULT_BUDGET_S:
            envelope_budget = ENVELOPE_BUDGET * o.budget_s / DEFAULT_BUDGET_S
        t = time.perf_counter()
        try:
            db = deflated_bound(q, H, W, k=pl.deflation_k, complement=pl.complement, envelope_budget=envelope_budget)
        except ValueError as err:  # asked for: the refusal stands; chosen by the size rule: the next method serves
            if o.deflated:
                raise
            db = None
            seconds["deflated"] = time.perf_counter() - t
            method["deflated"] = f"failed, not used: {err}"
            info["deflated"] = dict(error=str(err))
    if pl.deflated and db is not None:
        seconds["deflated"] = time.perf_counter() - t
        dval = db.upper  # already scaled back by q.log2_scale, as the majorant's
        info["deflated"] = dict(value=dval, k=db.k, delta=db.delta, theorem=db.info.get("theorem"),
                                gave_upper=dval < upper, upper_from=db.info.get("upper_from"))
        if db.info.get("theorem") == "D3":
            info["deflated"].update(eps=db.eps, sigma=db.sigma)
        envelope = "circulant Gram envelope" if db.info.get("envelope") == "gram" else "majorant"
        if db.info.get("upper_from") in ("envelope", "majorant"):
            method["deflated"] = (f"the {envelope}'s own bound (it beat the deflated bound on {db.k} token functions), "
                                  f"Cholesky-certified")
        else:
            method["deflated"] = (f"deflated bound: exact on {db.k} token functions x C channels, the {envelope} "
                                  f"on the complement, Cholesky-certified")
        info["deflated"]["envelope"] = db.info.get("envelope")
        upper = min(upper, dval)
        bounds["deflated"] = dval

    fallback = (pl.deflated and db is None and o.deflated is None and o.majorant is None and not pl.exact
                and N <= 4096)  # the deflated bound was skipped or failed: the next method of the rule
    if (pl.majorant or fallback) and not late("majorant"):  # Toeplitz majorant (majorant.py)
        mkw = {}
        if o.deadline_s is not None:  # any stopping point of its refinement is certified
            mkw["time_budget"] = max(0.0, min(45.0, o.deadline_s - (time.perf_counter() - t_start)))
        t, mb = time.perf_counter(), toeplitz_majorant(q, H, W, sn=sn, beat=upper, progress=progress, **mkw)
        mval, seconds["majorant"] = mb.upper, time.perf_counter() - t  # already scaled back by q.log2_scale
        info["majorant"] = dict(value=mval, cells=mb.cells, rounds=mb.rounds, gave_upper=mval < upper)
        method["majorant"], upper = "Toeplitz majorant lambda_max(T_N(s_up)), Cholesky-certified", min(upper, mval)
        bounds["majorant"] = mval
    t = time.perf_counter()
    exact, reason = None, None
    if n <= o.exact_max and not late("exact"):
        dense = dense if dense is not None else sp.dense_operator(q, H, W)
        with sp.single_thread():
            s1 = sp._finite(float(torch.linalg.matrix_norm(dense, ord=2)), "dense SVD")
        exact = sp._scale_back(s1, e2, up=True)
        method["exact"] = "dense SVD"
        # the SVD's value is a guess; Cholesky of mu I - fl(T^T T) proves ||T as stored|| <= it (rounding.norm2_upper),
        # and dense_err covers the stored matrix's distance to T
        with sp.single_thread():
            certified = float(norm2_upper(dense, s=torch.tensor(s1)))
        bounds["exact"] = sp._scale_back(sp._finite(certified, "verified dense norm") + dense_err, e2, up=True)
        upper = min(upper, bounds["exact"])
    elif n <= o.exact_max:
        reason = "skipped: past the deadline"
        method["exact"] = "not computed"
    else:
        reason = (f"N*C = {n} > exact_max = {o.exact_max}: the dense matrix would take "
                  f"{n * n * 8 / 2 ** 30:.1f} GiB in float64 and O((NC)^3) time")
        method["exact"] = "not computed"
    seconds["exact"] = time.perf_counter() - t

    # Lanczos on T^T T: a symbol-guided start for the lower bound on large grids, a random start for the
    # probabilistic bound (Kuczynski-Wozniakowski needs a start uniform on the sphere)
    t = time.perf_counter()
    A = lambda v: sp.apply_T_adjoint(sp.apply_T(v, q), q)  # noqa: E731
    steps_cap = int(max(2, min(o.max_steps, o.memory_bytes // (8 * n))))
    # ||fl(T v) - T v|| <= (dense_err + gamma_n-rounding of the norms) ||v||: the lower bound subtracts it
    apply_err = dense_err + q.gamma(2 * C + H * q.alpha.shape[1] + W + 8) * B
    margins["apply_error"] = sp._scale_back(apply_err, e2, up=True)

    def lower_of(v):
        r = float(sp.apply_T(v, q).norm() / v.norm())
        sp._finite(r, "Lanczos Rayleigh quotient")
        return max(0.0, r * (1 - q.gamma(2 * n + 4)) - apply_err)

    lower = 0.0
    symbol_start = o.symbol_start and N >= o.symbol_start_tokens
    if symbol_start and (not o.probabilistic or not late("lower")):  # the only lower bound without the random run
        # plane wave at the circulant argmax times the top singular direction, under a sine window
        cs = sp.symbol_coefficients(q, torch.tensor([circ.argmax[0]], dtype=dtype, device=q.WV.device),
                                 torch.tensor([circ.argmax[1]], dtype=dtype, device=q.WV.device))
        with sp.single_thread():
            U = torch.linalg.svd(sn.matrix(cs)).U[0, :, 0]
        iy = torch.arange(H, dtype=dtype, device=q.WV.device)
        ix = torch.arange(W, dtype=dtype, device=q.WV.device)
        win = torch.sin(math.pi * (iy[:, None] + 1) / (H + 1)) * torch.sin(math.pi * (ix[None, :] + 1) / (W + 1))
        phase = torch.exp(1j * (circ.argmax[0] * iy[:, None] + circ.argmax[1] * ix[None, :]))
        s0 = (win * phase)[..., None] * U.conj()[None, None, :]
        s0 = s0.real if float(s0.real.norm()) > float(s0.imag.norm()) else s0.imag
        s0 = s0[None].to(dtype)
        theta2, v2, k2 = sp.lanczos(A, s0, max(2, min(steps_cap, o.symbol_steps)), progress=progress)
        lower = lower_of(v2)
        info["lanczos_symbol_start"] = dict(steps=k2, theta=theta2, lower=sp._scale_back(lower, e2, up=False))
    seconds["lower"] = time.perf_counter() - t
    method["lower"] = "||T v|| / ||v|| at a Lanczos Ritz vector (fast operator), minus its rounding bound"

    upper_n = math.ldexp(upper, -e2)  # the deterministic bound in normalised units, for the stopping rule
    t = time.perf_counter()
    if o.probabilistic:
        if seed is None:
            seed = secrets.randbits(63)
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        v0 = torch.randn(1, H, W, C, generator=gen, dtype=dtype).to(q.WV.device)
        schedule = set(check_schedule(min(steps_cap, n)))
        delta_each = failure_probability / len(schedule)
        # theta is a verified upper bound on the top eigenvalue of the stored tridiagonal (Cholesky); the
        # tridiagonal's own entries carry the rounding of the recurrence, <= gamma_(4n+8) B^2 (proofs/S2.md)
        theta_err = lambda j: q.gamma(4 * n + 8) * B ** 2  # noqa: E731

        # where the dense value closed the upper bound, run Lanczos until the lower bound meets it too
        gap_goal = o.target_gap if exact is None else min(o.target_gap, 1e-8)
        checks = []

        def stop(theta, j):
            if j not in schedule:
                return False
            checks.append(j)
            if late("upper_probabilistic"):  # at a planned check only: the union bound stays as planned
                return True
            eps = sp.kw_epsilon(n, j, delta_each)
            if eps >= 1:
                return False
            up = math.sqrt(max(theta + theta_err(j), 0.0) / (1 - eps))
            return (min(up, upper_n) / math.sqrt(max(theta, 1e-300)) - 1) <= gap_goal * 0.9

        theta, v, steps = sp.lanczos(A, v0, steps_cap, stop=stop, progress=progress, verified=True)
        sp._finite(theta, "Lanczos Ritz value")
        lower = max(lower, lower_of(v))
        eps = sp.kw_epsilon(n, steps, delta_each)
        up_prob_n = math.sqrt(max(theta + theta_err(steps), 0.0) / (1 - eps)) if eps < 1 else math.inf
        up_prob = sp._scale_back(up_prob_n, e2, up=True) if math.isfinite(up_prob_n) else math.inf
        info["lanczos"] = dict(steps=steps, theta=theta, kw_epsilon=eps, n=n, checks=checks,
                               schedule_size=len(schedule), failure_probability_per_check=delta_each)
        method["upper_probabilistic"] = (f"Lanczos, {steps} steps from a Gaussian start (seed {seed}), "
                                         f"Kuczynski-Wozniakowski bound (relative eigenvalue error {eps:.3g}), "
                                         f"failure probability split over {len(schedule)} planned checks")
    else:
        up_prob, failure_probability = upper, 0.0
        method["upper_probabilistic"] = "not run: the deterministic upper bound (failure probability 0)"
    seconds["upper_probabilistic"] = time.perf_counter() - t
    up_prob = min(up_prob, upper)
    lower = sp._scale_back(lower, e2, up=False)
    best = next(name for name in _WINNER_ORDER if name in bounds and bounds[name] == upper)
    budget = dict(dataclasses.asdict(pl), budget_s=o.budget_s, deadline_s=o.deadline_s, cut=cut,
                  seconds=time.perf_counter() - t_start)
    return SSoGBound(H=H, W=W, lower=lower, upper=upper, upper_probabilistic=up_prob,
                     failure_probability=failure_probability, exact=exact, exact_reason=reason,
                     resolution_free=rfree, closed_form=closed, circulant=circ.upper, gram=gram,
                     seconds=seconds, method=method, info=info, seed=seed if o.probabilistic else None,
                     margins=margins, best_method=best, budget=budget)
