"""Budgets in units of work: the size rule turns budget_s into counts (rounds, cells, matrix products) from the sizes
alone, so the same call certifies the same numbers on a quiet and on a busy machine; only deadline_s reads a clock,
and a result it cut says so."""
import torch

import lipcheck
from lipcheck.bench import spinners
from lipcheck.bounds import CertifyOptions, plan, ssog_lipschitz
from lipcheck.bounds import majorant as mj
from lipcheck.bounds import spectral

F64 = torch.float64


def small_layer(C=8, heads=2, seed=0):
    """The default initialisation (every head averages): its majorant settles in a few rounds."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return lipcheck.SSoG(C, heads, dtype=F64)


def deterministic(r):
    return (r.upper, r.lower, r.circulant, r.resolution_free, r.closed_form, r.best_method,
            r.info["majorant"]["rounds"], r.info["majorant"]["cells"])


# the Toeplitz majorant (the stage that used to stop at a wall-clock limit) and the circulant embedding on an 8 x 8 grid:
# the dense stages, the deflated bound and the resolution-free bound off to keep the test lean
LEAN = dict(seed=0, probabilistic=False, resolution_free=False, exact_max=0, gram_max=0, deflated=False)


def test_the_same_call_certifies_the_same_bound_on_a_busy_machine():
    """The same layer certified on a quiet machine and again while two CPU-bound processes compete: identical
    numbers, the majorant's rounds and cells included (not a timing: the budget is counted, not clocked)."""
    layer = small_layer()
    quiet = ssog_lipschitz(layer, 8, 8, **LEAN)
    assert "majorant" in quiet.seconds and not quiet.cut_short
    with spinners(2):
        busy = ssog_lipschitz(layer, 8, 8, **LEAN)
    assert deterministic(busy) == deterministic(quiet) and not busy.cut_short


def test_a_generous_deadline_changes_nothing_a_spent_one_says_so():
    """deadline_s only stops work: far from it the numbers are those of the call without one; the majorant stopped
    by its time limit reports cut_short, and so does the certification that gave it the time left."""
    layer = small_layer()
    free = ssog_lipschitz(layer, 8, 8, **LEAN)
    timed = ssog_lipschitz(layer, 8, 8, deadline_s=3600, **LEAN)
    assert deterministic(timed) == deterministic(free) and not timed.cut_short
    p = spectral.ssog_params(layer)
    stopped = mj.toeplitz_majorant(p, 3, 4, time_budget=0.0)
    assert stopped.cut_short and stopped.rounds == 0
    assert not mj.toeplitz_majorant(p, 3, 4, max_rounds=0).cut_short  # a round budget is not a cut


def test_round_budgets_come_from_the_sizes():
    """The majorant's rounds: 200 (the old cap) for small C, fewer as (anchors per round) C^3 grows, never below 12,
    scaled by budget_s; the plan carries them, the same for the same sizes."""
    assert mj.planned_rounds(48) == mj.planned_rounds(192) == 200
    assert 60 <= mj.planned_rounds(384) < 200 and mj.planned_rounds(768) == 12
    assert mj.planned_rounds(384, scale=0.5) < mj.planned_rounds(384)
    assert plan(64, 64, 384, 3).majorant_rounds == mj.planned_rounds(384)
    assert plan(64, 64, 384, 3, CertifyOptions(budget_s=30)).majorant_rounds == mj.planned_rounds(384, 0.5)
    assert mj.toeplitz_majorant.__kwdefaults__["time_budget"] is None  # no clock unless asked for


def test_the_default_deflated_bound_is_the_same_on_a_busy_machine():
    """The default plan beyond 32 x 32 (the deflated bound on the anchored torus norms, Lanczos by FFT, the low-rank
    complement, then the Lanczos stopping rules) with a fixed seed: quiet and beside two CPU-bound processes, the
    same certified upper and lower bounds, the same stopping steps and anchors."""
    layer = small_layer(C=6, heads=3, seed=2)
    kw = dict(seed=0, exact_max=0, gram_max=0, resolution_free=False)
    quiet = ssog_lipschitz(layer, 33, 34, **kw)
    assert quiet.best_method == "deflated" and quiet.info["deflated"]["envelope"] == "gram"
    with spinners(2):
        busy = ssog_lipschitz(layer, 33, 34, **kw)
    assert (busy.upper, busy.lower, busy.upper_probabilistic) == (quiet.upper, quiet.lower, quiet.upper_probabilistic)
    assert busy.info["lanczos"]["steps"] == quiet.info["lanczos"]["steps"] and not busy.cut_short
    assert busy.info["deflated"] == quiet.info["deflated"]


def test_the_dense_gram_is_the_same_on_a_busy_machine():
    """The dense Gram stage (its guide's Lanczos run continued, then one Cholesky factorisation of a 1728 x 1728
    matrix on every thread) quiet and beside two CPU-bound processes: the same certified bound, pad and tries."""
    layer = small_layer(C=12, heads=3, seed=4)
    kw = dict(seed=0, exact_max=0, gram_max=0, deflated=False, majorant=False, resolution_free=False,
              probabilistic=False, dense_gram=True)
    quiet = ssog_lipschitz(layer, 12, 12, **kw)
    assert quiet.best_method == "dense_gram"
    with spinners(2):
        busy = ssog_lipschitz(layer, 12, 12, **kw)
    assert (busy.upper, busy.lower) == (quiet.upper, quiet.lower) and busy.info["dense_gram"] == quiet.info["dense_gram"]
