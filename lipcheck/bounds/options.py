"""What `ssog_lipschitz` is asked (CertifyOptions) and the size rule that decides which methods it runs (`plan`).

The rule reads the sizes alone, never a clock: every budget that can change a certified number (the resolution-free
rounds and work, the deflated bound's k and envelope budget, the Toeplitz majorant's rounds) is a count of work, so
the same call certifies the same bound on a busy and on a quiet machine. Only CertifyOptions.deadline_s reads the
clock, and a result it cut says so (SSoGBound.cut_short).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from . import deflation_plan
from .deflation_plan import LOWRANK_MAX_K, gram_affordable, planned_k
from .gram_dense import DENSE_GRAM_MAX
from .gram_envelope import affordable, dense
from .majorant import planned_rounds

# the resolution-free branch and bound's rounds cost about (anchors per round) C^3 each; the default caps them at this
# much work times budget_s / 60 s (200 rounds below C = 384; some 11 rounds, 20-40 s, at C = 768, where 200 rounds
# took many minutes); any stopping point is certified, only looser
RF_WORK = 2e10
# and caps the anchor bounds it evaluates (cells x 5 points x anchors x heads, over all rounds) at this count times
# budget_s / 60 s: at 8 heads, C = 128 its rounds grew to 9 s each by the fourth (one busy core), 200 would take hours
RF_PAIRS = 5e6

# The time budget the size rule's constants were sized for, on 2 cores: deflation_plan.planned_k's k C near 4608 and
# GRAM_BUDGET, gram_envelope.ENVELOPE_BUDGET (measured: the deflated bound 5-35 s up to 32 x 32 at C <= 384),
# majorant.MAJORANT_WORK
DEFAULT_BUDGET_S = 60.0

# the Ritz-deflated bound (ritz_deflation) holds its Krylov blocks and the envelope's rows as N C-long float64
# vectors: up to this N C (28 x 28 at C = 768, 32 x 32 at C = 384) they stay within a few GiB
RITZ_MAX = 1 << 20


# the default certification (lipschitz.deflated) retries the deflated bound once with twice the token functions where
# its certified gap to the Lanczos lower bound is above RETRY_GAP, up to k C = RETRY_KC (times budget^(1/3)). Smooth
# kernels on large grids have a flat top of T^T T: with k C near 4608 the vectors of U near its cut leak through M =
# T^T T into the complement and Theorem D4 loses to the envelope (C = 192, init kernels, 64 x 64: k = 24 left the
# circulant embedding's 7.4e-3; k = 48 gave 8e-8 in 32 s on 2 cores)
RETRY_GAP = 1e-4
RETRY_KC = 9216
# beyond 64 x 64 the top cluster is four times denser and twice the token functions do not resolve it (init kernels
# at 128 x 128: k = 48 gave 0.913 against the envelope's 0.8672, in 70 s): no retry there
RETRY_MAX_TOKENS = 4096
# and only where the complement sqrt(m22) is already below RETRY_COMPLEMENT times the lower bound: there the loss is
# the leakage X / g, which more token functions shrink; where the complement itself is near ||T||, a larger k lowers
# it slowly (sigma at the floor, C = 384: complement / lower 1.13, 0.98, 0.96 at 8x8, 14x14, 16x16 with k = 12; k = 24
# took their gaps from 20, 5.8, 4.3 % to 11.5, 2.9, 3.7 % at 2-3x the time). The successes above: 0.92 and 0.89
RETRY_COMPLEMENT = 0.95


def retry_k(H: int, W: int, C: int, heads: int, k: int, *, scale: float = 1.0) -> int | None:
    """Twice k where that still fits: N <= RETRY_MAX_TOKENS, 2k <= N - 1, 2k C <= RETRY_KC scale^(1/3), Theorem
    D4's h^4 (2k C)^2 within GRAM_BUDGET * min(scale, 1), and at most LOWRANK_MAX_K beyond 32 x 32; else None. Sizes
    alone, no clock."""
    k2 = 2 * int(k)
    if k < 1 or k2 > H * W - 1 or k2 * C > RETRY_KC * scale ** (1 / 3) or H * W > RETRY_MAX_TOKENS:
        return None
    if not gram_affordable(heads, k2, C, deflation_plan.GRAM_BUDGET * min(scale, 1.0)):
        return None
    if not dense(H, W) and k2 > LOWRANK_MAX_K:
        return None
    return k2


@dataclasses.dataclass(frozen=True)
class CertifyOptions:
    """How `ssog_lipschitz` certifies. The defaults give the tightest certified bound that fits budget_s.

    budget_s: seconds (on 2 cores) the size rule plans for. It is converted into units of work from the sizes alone
    (`plan`), never read from a clock, so the same call gives the same bound on a busy and on a quiet machine.
    deadline_s: optional wall-clock limit; past it, optional stages are skipped or stopped early at a certified point,
    and the result lists them (SSoGBound.cut_short, budget['cut']).
    deflated / majorant / dense_gram / ritz: None lets the size rule decide; True / False force the stage on or off.
    ritz_max: the Ritz-deflated bound (Theorem D4 on Ritz vectors of T^T T, the channel-resolved envelope on the
    complement) where N C <= ritz_max and the stages before it leave a gap above RETRY_GAP.
    dense_gram_max: the dense Gram (T^T T formed, one Cholesky factorisation in place; (N C)^2 float64) where
    N C <= dense_gram_max and the bounds before it leave a gap above gram_dense.DENSE_GRAM_GAP.
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
    dense_gram: bool | None = None
    dense_gram_max: int = DENSE_GRAM_MAX
    ritz: bool | None = None
    ritz_max: int = RITZ_MAX

    def __post_init__(self):
        for name in ("budget_s", "deadline_s"):
            v = getattr(self, name)
            if v is None and name == "deadline_s":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if not (0 < self.failure_probability < 1):
            raise ValueError(f"failure_probability must be in (0, 1), got {self.failure_probability}")
        for name in ("deflated", "majorant", "dense_gram", "ritz"):
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
    deflated with k token functions (its complement: 'gram' or 'auto'), dense_gram (where the stages before it leave
    a gap), majorant; rule says why; the work budgets of
    the resolution-free bound (rf_max_rounds, rf_max_work) and of the majorant's refinement (majorant_rounds)."""
    exact: bool
    deflated: bool
    deflation_k: int | None
    complement: str
    majorant: bool
    rule: str
    rf_max_rounds: int = 200
    rf_max_work: float | None = None
    majorant_rounds: int = 200
    dense_gram: bool = False
    ritz: bool = False


def rf_rounds(C: int, scale: float = 1.0) -> int:
    """Rounds of the resolution-free branch and bound that fit RF_WORK * scale: (anchors per round) C^3 each, the
    anchors as `_resolution_free` picks them; between 8 and 200."""
    k_anchor = max(4, min(64, int(1e8 / C ** 3)))
    return int(max(8, min(200, RF_WORK * scale / (k_anchor * float(C) ** 3))))


def plan(H: int, W: int, C: int, heads: int, options: CertifyOptions | None = None) -> Plan:
    """The size rule of the default certification: the tightest method that fits, best first.

    1. N C <= exact_max: the dense SVD, verified by Cholesky, is ||T|| up to rounding: nothing beats it.
    2. The deflated bound with the circulant Gram envelope on the complement (Theorem D4) where the envelope fits
       (half the torus within gram_envelope.MAX_TORUS_FREQUENCIES: up to 128 x 128; stored densely up to 32 x 32,
       beyond as f alone with the low-rank complement of Lemma G3) and some k >= 1 token functions fit
       the work budgets (deflation_plan.planned_k: k C near 4608, heads^4 (k C)^2 <= GRAM_BUDGET, both scaled by
       budget_s / 60 s); half of the k token functions are the profiles of a Lanczos Ritz vector of T.
    2b. The dense Gram where N C <= dense_gram_max (float64) and the deflated bound (or whatever ran) leaves a
       certified gap above gram_dense.DENSE_GRAM_GAP to the Lanczos lower bound: T^T T formed, one Cholesky.
    3. The Toeplitz majorant up to 4096 tokens (64 x 64), its refinement capped at majorant.planned_rounds (scaled
       by budget_s / 60 s).
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
    dense_gram = o.dense_gram if o.dense_gram is not None else (
        not exact and o.dtype == torch.float64 and n <= o.dense_gram_max)
    if dense_gram:
        rule += f"; dense Gram where a gap is left (N*C = {n} <= dense_gram_max = {o.dense_gram_max})"
    ritz = o.ritz if o.ritz is not None else (not exact and o.dtype == torch.float64 and n <= o.ritz_max)
    if ritz:
        rule += f"; Ritz-deflated bound where a gap is left (N*C = {n} <= ritz_max = {o.ritz_max})"
    rounds = o.rf_max_rounds if o.rf_max_rounds is not None else rf_rounds(C, scale)
    rf_work = None if o.rf_max_rounds is not None else RF_PAIRS * scale  # rounds asked for: no cap on their work
    return Plan(exact=exact, deflated=deflated, deflation_k=k, complement=complement, majorant=majorant, rule=rule,
                rf_max_rounds=int(rounds), rf_max_work=rf_work, majorant_rounds=planned_rounds(C, scale),
                dense_gram=bool(dense_gram), ritz=bool(ritz))
