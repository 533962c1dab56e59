"""The certification entry point for Lip(SSoG) = ||T||_2 (SPEC S1, S2): `ssog_lipschitz`, a table of bound methods.

It reads the primitives of `spectral` (parameters, fast operator, Lanczos, circulant embedding, symbol sup, Gram
iteration) and runs the methods above them that the size rule (`options.plan`) picks: the deflated bound
(`deflation`, its complement by `gram_envelope`), the dense Gram (`gram_dense`) and the Toeplitz majorant
(`majorant`). METHODS maps each stage's name to a function of the run (normalised parameters, options, plan, what
the stages before found) that returns its certified value and description; the entry point runs them in order,
keeps the smallest certified upper bound, adds the Lanczos lower bound and the probabilistic upper bound
(`lanczos_bounds`), and assembles the SSoGBound. The state the stages share is `certify_run._Run`. Data flows one way:
spectral <- majorant, gram_envelope, deflation <- gram_dense, options <- certify_run <- lanczos_bounds <- this module.
"""
from __future__ import annotations

import dataclasses
import math
import secrets
import time
from typing import Callable

import torch

from ..rounding import norm2_upper
from . import spectral as sp
from .deflation import deflated_bound
from .ritz_deflation import WORK as RITZ_WORK, ritz_bound
from .gram_dense import DENSE_GRAM_GAP, dense_gram_bound
from .gram_envelope import ENVELOPE_BUDGET
from .krylov import dense_top_singular_value
from .majorant import toeplitz_majorant
from .certify_run import Stage, _Run
from .lanczos_bounds import (_continued_lanczos, _guide, _lower_of, _steps_cap, _symbol_start,  # noqa: F401
                             check_schedule, probabilistic_upper, symbol_start_lower)  # (tests reach the first here)
from .options import (DEFAULT_BUDGET_S, OPTION_NAMES, RETRY_COMPLEMENT, RETRY_GAP, RF_PAIRS, RF_WORK,  # noqa: F401
                      CertifyOptions, Plan, certify_options, plan, retry_k, rf_rounds)


@dataclasses.dataclass
class SSoGBound:
    """Two-sided bounds on ||T||_2 for one fixed-kernel SSoG layer on an H x W grid (SPEC S1, S2).

    seed: the seed of the random Lanczos start (replay with ssog_lipschitz(..., seed=seed));
    margins: the rounding margins used, from the dtype's unit roundoff (proofs/S2.md);
    method: a description per stage; best_method: the stage whose certified bound is `upper` (a key of method:
    'exact', 'gram', 'dense_gram', 'ritz', 'deflated', 'majorant', 'circulant', 'resolution_free' or 'closed_form');
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


# the order in which equal certified values name the winner: the most direct certificate first
_WINNER_ORDER = ("exact", "gram", "dense_gram", "ritz", "deflated", "majorant", "circulant", "resolution_free",
                 "closed_form")


def closed_form(run: _Run) -> Stage:
    return Stage(sp.closed_form_bound(run.q), "sum_h ||P_h|| sum_m |alpha|")


def resolution_free(run: _Run) -> Stage:
    o = run.o
    if not o.resolution_free or run.late("resolution_free"):
        return Stage(None, "not computed (closed form)" if not o.resolution_free
                     else "skipped: past the deadline (closed form)")
    rf, rf_info = sp.resolution_free_bound(run.q, sn=run.sn, rtol=o.rf_rtol, progress=o.progress,
                                           max_rounds=run.pl.rf_max_rounds, max_work=run.pl.rf_max_work)
    return Stage(rf.upper, "branch and bound on the torus, SVD anchors, second-order cell bounds",
                 dict(symbol_sup_lower=rf.lower, argmax=rf.argmax, **rf_info))


def circulant(run: _Run) -> Stage:
    H, W = run.H, run.W
    run.circ_sn = sp.SymbolNorm(run.q)  # its anchors sit at the torus frequencies the Gram envelope reads
    circ = run.circ = sp.circulant_bound(run.q, H, W, sn=run.circ_sn, rtol=run.o.circulant_rtol)
    return Stage(circ.upper, f"block-circulant embedding, certified max over the {2 * H - 1}x{2 * W - 1} DFT grid",
                 dict(lower=circ.lower, argmax=circ.argmax, svds=circ.num_svd, points=circ.num_points))


def gram(run: _Run) -> Stage:
    if run.n > run.o.gram_max:
        return Stage(None, f"skipped: N*C = {run.n} > gram_max = {run.o.gram_max}")
    run.dense = sp.dense_operator(run.q, run.H, run.W)
    g_n, k = sp.gram_bound(run.dense)
    return Stage(sp._scale_back(g_n + run.dense_err, run.q.log2_scale, up=True),
                 f"Gram iteration, {k} squarings, Cauchy-interlacing tightening")


def deflated(run: _Run) -> Stage | None:
    """T exactly on the top token functions, an envelope beyond (deflation.py); a failure of the size rule's choice
    is reported and the next method serves, a failure of a deflated bound asked for by name stands."""
    o, pl = run.o, run.pl
    if not pl.deflated or run.late("deflated"):
        return None
    envelope_budget = None
    if o.deflated is None and o.budget_s != DEFAULT_BUDGET_S:
        envelope_budget = ENVELOPE_BUDGET * o.budget_s / DEFAULT_BUDGET_S
    # the majorant's envelope (complement 'majorant') refines for the plan's rounds, stopped by nothing but a deadline
    deadline = dict(time_budget=max(0.0, run.seconds_left()) if o.deadline_s is not None else None)
    guide = _guide(run) if pl.complement == "gram" else None
    # the envelope, computed once for the call and its retry, from the circulant stage's anchors on
    cache = {} if run.circ_sn is None else dict(symbol_norm=run.circ_sn)
    try:
        db = deflated_bound(run.q, run.H, run.W, k=pl.deflation_k, complement=pl.complement,
                            envelope_budget=envelope_budget, max_rounds=pl.majorant_rounds, guide=guide,
                            cache=cache, **deadline)
        db, guide = _unguided(run, db, guide, envelope_budget, cache)
        retried = _retry_deflated(run, db, guide, envelope_budget, cache)
        if retried is not None and retried.upper < db.upper:
            retried.info["guide_dropped"] = db.info.get("guide_dropped", False)
            db = retried
    except ValueError as err:  # asked for: the refusal stands; chosen by the size rule: the next method serves
        if o.deflated:
            raise
        return Stage(None, f"failed, not used: {err}", dict(error=str(err)))
    if db.info.get("envelope") == "majorant":
        run.late("deflated")  # past the deadline now: its envelope's refinement may have been stopped; listed
    dval = coarse_up(db.upper)  # already scaled back by q.log2_scale, as the majorant's
    info = dict(value=dval, k=db.k, delta=db.delta, theorem=db.info.get("theorem"), gave_upper=dval < run.upper,
                upper_from=db.info.get("upper_from"), retried_from_k=db.info.get("retried_from_k"),
                guide_dropped=db.info.get("guide_dropped", False))
    if db.info.get("theorem") == "D3":
        info.update(eps=db.eps, sigma=db.sigma)
    envelope = "circulant Gram envelope" if db.info.get("envelope") == "gram" else "majorant"
    if db.info.get("upper_from") in ("envelope", "majorant"):
        method = (f"the {envelope}'s own bound (it beat the deflated bound on {db.k} token functions), "
                  f"Cholesky-certified")
    else:
        method = (f"deflated bound: exact on {db.k} token functions x C channels, the {envelope} "
                  f"on the complement, Cholesky-certified")
    info["envelope"] = db.info.get("envelope")
    return Stage(dval, method, info)


def _above_gap(run: _Run, upper: float, gap: float = RETRY_GAP) -> bool:
    """Whether the certified `upper` is above (1 + gap) times the guide's lower bound (options.RETRY_GAP by default)."""
    lower = sp._scale_back(run.guide_lower or 0.0, run.q.log2_scale, up=False)
    return lower > 0 and upper > lower * (1 + gap)


def _unguided(run: _Run, db, guide, envelope_budget, cache):
    """(the deflated bound, the guide the retry should use): the same k once more without the guide's token profiles
    (`deflation_search.guided_basis`), where the guided bound's certified gap is above RETRY_GAP, and the smaller
    certified bound kept. The guide puts T's top singular vector's profiles into U in place of R_f's top eigenvectors,
    which can leave a larger leak: C = 384 init kernels at 64 x 64, k = 12: 0.88710 guided, 0.85327 without, lower
    0.85311. Certified numbers and sizes decide, no clock; the envelope is the cache's."""
    if guide is None or run.pl.complement != "gram" or not _above_gap(run, db.upper) or run.late("deflated"):
        return db, guide
    plain = deflated_bound(run.q, run.H, run.W, k=db.k, complement="gram", envelope_budget=envelope_budget,
                           cache=cache)
    if plain.upper < db.upper:
        plain.info["guide_dropped"] = True
        return plain, None
    return db, guide


def _retry_deflated(run: _Run, db, guide, envelope_budget, cache):
    """The size rule's deflated bound once more with twice its token functions (options.retry_k), where its certified
    gap to the guide's lower bound is above options.RETRY_GAP and its complement bound below RETRY_COMPLEMENT times
    that lower bound: the decision reads these certified numbers and the sizes, no clock. None where it does not
    apply (k asked for, complement not the Gram envelope, no room, past the deadline)."""
    o, pl = run.o, run.pl
    lower = sp._scale_back(run.guide_lower or 0.0, run.q.log2_scale, up=False)
    complement = db.info.get("complement")
    if o.deflation_k is not None or pl.complement != "gram" or not _above_gap(run, db.upper) or complement is None or \
            not complement <= RETRY_COMPLEMENT * lower or run.late("deflated"):
        return None
    k2 = retry_k(run.H, run.W, run.q.dim, run.q.num_heads, db.k, scale=o.budget_s / DEFAULT_BUDGET_S)
    if k2 is None:
        return None
    again = deflated_bound(run.q, run.H, run.W, k=k2, complement="gram", envelope_budget=envelope_budget, guide=guide,
                           cache=cache)
    again.info["retried_from_k"] = db.k
    return again


def dense_gram(run: _Run) -> Stage | None:
    """M = T^T T formed densely and certified by one Cholesky factorisation (gram_dense.py), where the plan allows it
    (N C <= dense_gram_max) and the stages before it leave a certified gap above DENSE_GRAM_GAP to the Lanczos lower
    bound, the guide's Lanczos run continued first (the decision reads certified numbers and sizes, no clock): flat
    tops that no deflation resolves. Asked for by name (dense_gram=True) it always runs and a failure stands."""
    o, pl = run.o, run.pl
    if not pl.dense_gram or run.late("dense_gram"):
        return None
    asked = o.dense_gram is True
    _guide(run)
    if not asked and not _above_gap(run, run.upper, DENSE_GRAM_GAP):
        return None
    theta = _continued_lanczos(run)
    if not asked and not _above_gap(run, run.upper, DENSE_GRAM_GAP):
        return Stage(None, "not needed: the continued Lanczos lower bound closed the gap", dict(value=None))
    try:
        db = dense_gram_bound(run.q, run.H, run.W, theta)
    except ValueError as err:
        if asked:
            raise
        return Stage(None, f"failed, not used: {err}", dict(error=str(err), value=None))
    value = coarse_up(db.upper)
    return Stage(value, "dense Gram: T^T T formed (N C x N C), lambda_max certified by one Cholesky factorisation",
                 dict(value=value, pad=db.pad, tries=db.tries, error=db.err, gave_upper=value < run.upper))


def ritz(run: _Run) -> Stage | None:
    """Theorem D4 on Ritz vectors of T^T T with the channel-resolved envelope on the complement (ritz_deflation.py),
    where the plan allows it (float64, N C <= ritz_max) and the stages before it leave a certified gap above RETRY_GAP
    to the Lanczos lower bound (certified numbers and sizes decide, no clock): kernels at the sigma floor, twelve heads
    at C = 768, where no k C the deflated bound affords resolves the scalar envelope's top. Its top Ritz vector's
    ||T v|| / ||v|| replaces the lower bound where larger. Asked for by name (ritz=True) it always runs and a failure
    stands."""
    o, pl = run.o, run.pl
    if not pl.ritz or run.late("ritz"):
        return None
    asked = o.ritz is True
    _guide(run)
    if not asked and not _above_gap(run, run.upper):
        return None
    q, e = run.q, run.q.log2_scale
    u = q.u
    t_up = math.ldexp(run.upper, -e) * (1 + 4 * u)  # >= ||T|| in normalised units (a power of two, then rounding)
    try:
        rb = ritz_bound(q, run.H, run.W, run.circ_sn or run.sn, apply_err=run.apply_err, t_up=t_up,
                        start=run.guide.reshape(-1, 1) if run.guide is not None else None,
                        max_work=RITZ_WORK * o.budget_s / DEFAULT_BUDGET_S if not asked else math.inf,
                        lower=run.guide_lower)
    except ValueError as err:
        if asked:
            raise
        return Stage(None, f"failed, not used: {err}", dict(error=str(err), value=None))
    lower = _lower_of(run, rb.top.reshape(1, run.H, run.W, q.dim))
    if lower > (run.guide_lower or 0.0):
        run.guide, run.guide_lower = rb.top.reshape(1, run.H, run.W, q.dim), lower
    upper_n = sp._finite(math.sqrt(rb.tau) * (1 + 2 * u) + q.conversion_error * q.magnitude(), "Ritz-deflated bound")
    value = coarse_up(sp._scale_back(upper_n, e, up=True))
    info = dict(value=value, K=rb.K, complement=sp._scale_back(math.sqrt(rb.m22), e, up=True),
                level=sp._scale_back(math.sqrt(rb.level), e, up=True), rows=rb.info["rows"], hot=rb.info["hot"],
                tries=[dict(K=t["K"], complement=sp._scale_back(math.sqrt(t["m22"]), e, up=True))
                       for t in rb.info["tries"]],
                gave_upper=value < run.upper)
    return Stage(value, f"Ritz-deflated bound: exact on {rb.K} Ritz vectors of T^T T, the channel-resolved circulant "
                        f"Gram envelope on the complement ({rb.info['rows']} rows), Cholesky-certified", info)


def coarse_up(x: float) -> float:
    """x rounded up to 40 significant bits (at most 2^-39 relative, exact arithmetic): an upper bound stays one, and
    the last-bit differences the deflated stage shows between two identical calls in one process (BLAS paths that
    depend on memory alignment; 1-2 ulp measured) no longer reach the result, but where they straddle a step."""
    if not (math.isfinite(x) and x > 0):
        return x
    m, e = math.frexp(x)
    return math.ldexp(math.ceil(math.ldexp(m, 40)), e - 40)


def majorant(run: _Run) -> Stage | None:
    """The Toeplitz majorant (majorant.py), where the plan picks it or where the deflated bound the size rule chose
    was skipped, failed or did not beat the circulant embedding (too few token functions for the grid: C = 384 at
    64 x 64, k = 12), and the grid is within its reach."""
    o, pl = run.o, run.pl
    lost = "deflated" not in run.bounds or not run.info.get("deflated", {}).get("gave_upper", False)
    lost = lost and "dense_gram" not in run.bounds
    fallback = pl.deflated and lost and o.deflated is None and o.majorant is None and not pl.exact and \
        run.H * run.W <= 4096
    if not (pl.majorant or fallback) or run.late("majorant"):
        return None
    mkw = {}
    if o.deadline_s is not None:  # any stopping point of its refinement is certified; a stop says so (cut_short)
        mkw["time_budget"] = max(0.0, run.seconds_left())
    if o.budget_s != DEFAULT_BUDGET_S:  # the default budget is the majorant's own size rule
        mkw["max_rounds"] = pl.majorant_rounds
    upper = run.upper
    mb = toeplitz_majorant(run.q, run.H, run.W, sn=run.sn, beat=upper, progress=o.progress, **mkw)
    if mb.cut_short:
        run.cut.append("majorant")
    return Stage(mb.upper, "Toeplitz majorant lambda_max(T_N(s_up)), Cholesky-certified",  # scaled back already
                 dict(value=mb.upper, cells=mb.cells, rounds=mb.rounds, gave_upper=mb.upper < upper))


def exact(run: _Run) -> Stage:
    """The dense matrix's top singular value (krylov.dense_top_singular_value: ARPACK to rounding, 30x faster than a
    full SVD at N C = 3072), certified: Cholesky of mu I - fl(T^T T) proves ||T as stored|| <= it
    (rounding.norm2_upper), and dense_err covers the stored matrix's distance to T."""
    n, o, e2 = run.n, run.o, run.q.log2_scale
    if n > o.exact_max:
        run.exact_reason = (f"N*C = {n} > exact_max = {o.exact_max}: the dense matrix would take "
                            f"{n * n * 8 / 2 ** 30:.1f} GiB in float64 and O((NC)^3) time")
        return Stage(None, "not computed")
    if run.late("exact"):
        run.exact_reason = "skipped: past the deadline"
        return Stage(None, "not computed")
    dense = run.dense if run.dense is not None else sp.dense_operator(run.q, run.H, run.W)
    with sp.single_thread():
        s1 = sp._finite(dense_top_singular_value(dense), "dense SVD")
    run.exact = sp._scale_back(s1, e2, up=True)
    with sp.single_thread():
        certified = float(norm2_upper(dense, s=torch.tensor(s1)))
    return Stage(sp._scale_back(sp._finite(certified, "verified dense norm") + run.dense_err, e2, up=True), "dense SVD")


# The bound methods in the order they run: each sees the bounds before it (the majorant stops refining once it
# cannot beat them); names are the keys of SSoGBound.method, seconds and best_method.
METHODS: dict[str, Callable[[_Run], Stage | None]] = {
    "closed_form": closed_form, "resolution_free": resolution_free, "circulant": circulant, "gram": gram,
    "deflated": deflated, "dense_gram": dense_gram, "ritz": ritz, "majorant": majorant, "exact": exact}


# --------------------------------------------------------------------------------------------------
# The entry point


def _start(layer, H: int, W: int, o: CertifyOptions, t_start: float) -> _Run:
    """Read and normalise the layer, plan the stages, and fix the rounding margins every stage reads."""
    q = sp.normalised(sp.ssog_params(layer, dtype=o.dtype, device=o.device))
    e2, N, C = q.log2_scale, H * W, q.dim
    B = q.magnitude()
    dense_err = sp.dense_error(q, N)
    # ||fl(T v) - T v|| <= (dense_err + gamma_n-rounding of the norms) ||v||: the lower bound subtracts it
    apply_err = dense_err + q.gamma(2 * C + H * q.alpha.shape[1] + W + 8) * B
    margins = dict(dtype=str(o.dtype), unit_roundoff=q.u, log2_scale=e2, magnitude=sp._scale_back(B, e2, up=True),
                   dense_error=sp._scale_back(dense_err, e2, up=True),
                   spectral_norms="verified by Cholesky (rounding.norm2_upper), no SVD error model",
                   tap_relative_error=float(sp.tap_error(q).max()), conversion_error=q.conversion_error,
                   apply_error=sp._scale_back(apply_err, e2, up=True))
    return _Run(q=q, H=H, W=W, o=o, pl=plan(H, W, C, q.num_heads, o), sn=sp.SymbolNorm(q), B=B, dense_err=dense_err,
                apply_err=apply_err, margins=margins, t_start=t_start)


def ssog_lipschitz(layer, H: int, W: int, options: CertifyOptions | None = None, **kw) -> SSoGBound:
    """Certified bounds on Lip(SSoG) = ||T||_2 on an H x W grid: the tightest certified upper bound the size rule fits
    in the budget (CertifyOptions.budget_s, 60 s on 2 cores, as counts of work), best_method naming what won.

    options: a CertifyOptions; keyword arguments (dtype, device, failure_probability, target_gap, max_steps,
    memory_bytes, exact_max, gram_max, resolution_free, rf_rtol, circulant_rtol, symbol_start, symbol_start_tokens,
    symbol_steps, probabilistic, seed, progress, majorant, deflated, deflation_k, dense_gram, dense_gram_max, budget_s,
    deadline_s) set its fields.

    lower <= ||T||_2 <= upper <= resolution_free <= closed_form, upper = min(closed form, resolution-free,
    circulant embedding, Gram iteration, dense SVD, the Toeplitz majorant, the deflated bound with deflation_k token
    functions, its complement bounded by the circulant Gram envelope where affordable, else by the majorant's
    envelope), each stage run where `plan` says it fits (the dense SVD where N C <= exact_max, else the deflated bound
    up to 128 x 128, else the majorant up to 64 x 64), every one rounded outward with margins derived from the unit
    roundoff of `dtype` (float32 or float64). The operator is normalised first (powers of two out of alpha, W_V,
    W_O) and the bounds scaled back, so any scale the dtype holds is certified; a bound that cannot be represented, a
    NaN/inf anywhere, a half-precision layer or a kernel its dtype cannot carry raise ValueError instead of returning
    a number. Without deadline_s the deterministic bounds depend on the layer, the sizes and the options alone, not
    on the machine or its load; a deadline that skips or stops a stage is listed in budget['cut'] (cut_short).

    upper_probabilistic holds with probability >= 1 - failure_probability over the random Lanczos start,
    the adaptive stopping rule included (union bound over the fixed check schedule). seed=None (default)
    draws a fresh seed, recorded in the result. A seed you choose gives the guarantee only for layers
    chosen independently of that seed (a layer tuned against a fixed seed can defeat it); reusing the
    recorded seed replays the run. exact is a dense SVD when N C <= exact_max, else None with the reason.
    """
    sp._check_grid_size(H, W)
    o = certify_options(options, **kw)
    run = _start(layer, H, W, o, time.perf_counter())
    for name, method in METHODS.items():
        t = time.perf_counter()
        stage = method(run)
        if stage is None:
            continue
        run.seconds[name], run.method[name] = time.perf_counter() - t, stage.method
        if stage.info is not None:
            run.info[name] = stage.info
        if stage.value is not None:
            run.bounds[name] = stage.value
    return _with_lanczos(run)


def _with_lanczos(run: _Run) -> SSoGBound:
    """The Lanczos lower bound and probabilistic upper bound added to the deterministic stages: the SSoGBound."""
    o, q, bounds = run.o, run.q, run.bounds
    steps_cap = _steps_cap(run)
    t = time.perf_counter()
    lower = run.guide_lower or 0.0  # the deflated bound's guide, where it ran
    if _symbol_start(run) and "lanczos_symbol_start" not in run.info and (not o.probabilistic or not run.late("lower")):
        lower = max(lower, symbol_start_lower(run, steps_cap))  # the only lower bound without the random run
    run.seconds["lower"] = time.perf_counter() - t
    run.method["lower"] = "||T v|| / ||v|| at a Lanczos Ritz vector (fast operator), minus its rounding bound"
    t = time.perf_counter()
    upper, seed, failure_probability = run.upper, o.seed, o.failure_probability
    if o.probabilistic:
        seed = secrets.randbits(63) if seed is None else seed
        up_prob, lower_prob = probabilistic_upper(run, steps_cap, seed)
        lower = max(lower, lower_prob)
    else:
        up_prob, failure_probability = upper, 0.0
        run.method["upper_probabilistic"] = "not run: the deterministic upper bound (failure probability 0)"
    run.seconds["upper_probabilistic"] = time.perf_counter() - t
    closed = bounds["closed_form"]
    best = next(name for name in _WINNER_ORDER if name in bounds and bounds[name] == upper)
    budget = dict(dataclasses.asdict(run.pl), budget_s=o.budget_s, deadline_s=o.deadline_s, cut=run.cut,
                  seconds=time.perf_counter() - run.t_start)
    return SSoGBound(H=run.H, W=run.W, lower=sp._scale_back(lower, q.log2_scale, up=False), upper=upper,
                     upper_probabilistic=min(up_prob, upper), failure_probability=failure_probability,
                     exact=run.exact, exact_reason=run.exact_reason,
                     resolution_free=min(bounds.get("resolution_free", closed), closed), closed_form=closed,
                     circulant=bounds["circulant"], gram=bounds.get("gram"), seconds=run.seconds, method=run.method,
                     info=run.info, seed=seed if o.probabilistic else None, margins=run.margins, best_method=best,
                     budget=budget)
