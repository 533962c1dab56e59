"""A proven enclosure of the true trajectory of x' = F(x) around a computed one (proofs/S5.md, Theorems 5 and 6).

y is a piecewise quartic (`quartic`): on each accepted step [a, b] of the solver, the quartic through its dense
output at a + h (0, 1/4, 1/2, 3/4, 1), with coefficients c_k (floats, so y is known exactly).

Direct (Theorem 5, `ref_tol=None`, `direct`). With e = x - y and delta = y' - F(y):

    D+ ||e|| <= mu ||e|| + ||delta||,   mu >= mu_2(J_F(z)) for z on every segment [y(s), x(s)]

so on a sub-interval of length tau, r_end <= r e^{mu tau} + sup||delta|| tau phi(mu tau), phi(z) = (e^z - 1)/z.

- sup ||delta|| on each sub-interval [s_j, s_j + tau] (`defect`): the larger of ||delta|| at both ends (F at the
  nodes) plus tau^2 / 8 sup ||delta''|| (linear interpolation), delta'' = y^(3) - D^2F(y)[y', y'] - J_F(y) y''
  bounded from Bernstein sups of y's derivatives and F's constants; sub-intervals are refined until that remainder
  is below `defect_ratio` times the sampled defect (or an absolute target).
- mu over the tube of radius rho around y on a coarser sub-interval [u, u'] (`field`, `recurrence`): the larger of
  the two verified point log-norms plus curvature * (rho + token drift to the nearer end + ||fl(y) - y||)
  (Lemma 2); the tube is bootstrapped: assume rho, bound r, accept only if r <= rho on the whole sub-interval.
- rounding: a-priori bounds for F and the polynomial evaluation; the scalar recurrence in arb balls and exact
  rationals, every float rounded in the safe direction whatever its sign.

Tight (Theorem 6, the default): a second solve y_ref at ref_tol (on shorter steps) is enclosed directly, and
||x - y|| <= sup ||y - y_ref|| + r_ref on every interval, the sup proven from Bernstein coefficients of the
difference quartics (`distance`). The defects of y, which cancel in its true error, no longer add up: the radius
is close to y's actual error.

The same per-interval log-norms bound the growth of perturbations: `envelope.lognorm_envelope`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import torch

from ..bounds import lognorm as ln  # noqa: F401  (SSoGField's constants; tests replace them through here)
from .attention_field import make_field
from .direct import enclose_direct
from .distance import _distance, _node_distances, _rough_distance
from .envelope import lognorm_envelope  # noqa: F401
from .field import SSoGField, rayleigh_lower  # noqa: F401
from .options import DirectOptions, EnclosureError, check_inputs, check_method, check_settings
from .quartic import _bernstein_matrix, _sampled_defect, _sampled_defects, _step_defects  # noqa: F401
from .quartic import piecewise_quartic
from .result import Enclosure
from .solve import prepare

REF_FACTOR = 1e-3  # ref_tol = "auto": the reference solve at tol * REF_FACTOR ...
REF_FLOOR = 1e-11  # ... but not below this (dopri5's step count explodes near float64's floor)
REF_SHARE = 0.1  # y_ref's defect is aimed at r_ref(t1) <= this share of ||y(t1) - y_ref(t1)|| ...
REF_WORK_FLOOR = 1e-3  # ... with its target at most 1000x below ref_defect_ratio * sup ||y - y_ref|| / t1 (work)
REF_TUBE = 0.25  # ... but r_ref aimed at <= this / M2 (the tube's curvature term then adds <= this to the log-norm)
REF_REACH = 1e-12  # a reference defect below this times sup ||y'|| is out of float64's reach: refused, not tried
REF_STEPS = 512  # reference steps spent on tightness alone (up to ref_max_steps where the tube needs them)
# the default work budget (max_work) of an enclosure, in field evaluations (the same on any machine and under any
# load): the defect sub-intervals its reference enclosure is predicted to need (`_sub_intervals`) plus LOGNORM_WORK
# per predicted point log-norm (`_lognorm_points`). The sub-interval prediction is 1.5-2.3x the count used on the
# digits ODE models proven (SSoG trained and init, attention init: 25600-89998 used, 43000-207000 predicted), the
# log-norm one 499 against 457 used on the trained SSoG model (image 0); the trained attention model predicts
# 3.4e6-1.2e8 sub-intervals over its 450 test images (image 0: 9.5e6 and 5.1e5 point log-norms, t = 0.013 reached in
# 240 s). ti and s predict 3.7e4 and 1.9e4 sub-intervals at their settings
REF_WORK_BUDGET = 2_000_000
# a point log-norm counted as this many field evaluations in max_work, about the lowest ratio measured (a lower
# estimate elsewhere): 40 (tiny gain-2 test model, 3.7 us per defect sub-interval, 0.15 ms per log-norm), 140 (ti,
# structured), 230 (digits SSoG model, n = 768, 80 us and 18 ms), 750 (digits attention model, 60 ms). At 256 the
# tiny gain-2 model (proven in 6 s: 508544 sub-intervals and 2562 log-norms used) was refused
LOGNORM_WORK = 64
REF_SPLIT = 1.25  # a reference step is cut into 1.25 (sampled defect / target)^(1/4) pieces (the defect ~ h^4)
# ref_mu_slack by default: the larger of mu_slack and this / t1. The slack adds about itself to the log-norm of
# every interval, so about a factor e^(slack t1) = e at most to r_ref, REF_SHARE of the radius or less; the
# point log-norms it saves are most of a small model's time (digits, 1 image: 1634 -> 488 points, 80 -> 27 s)
REF_SLACK_GROWTH = 1.0

# Per-sample state size up to which the enclosure runs on one thread: its kernels are then too small for a second
# thread to pay, and on a shared machine waiting threads cost most (tiny model, 2 images: 7.0 s on two threads and
# 7.7 s on one on a quiet machine; 65 s on two with a spinning process on each core)
ONE_THREAD_STATE = 4096


def enclose(model, images, *, method: str = "dopri5", tol: float = 1e-3, ref_tol="auto", lognorm: str = "auto",
            defect_ratio: float = 0.25, mu_slack: float = 0.25, max_per_step: int = 1024, tube: float | None = None,
            max_tube: float | None = None, ref_defect_ratio: float = 0.02, ref_mu_slack: float | None = None,
            ref_max_per_step: int | None = None, ref_defect_abs: float | None = None, max_seconds: float | None = None,
            max_work: float | None = REF_WORK_BUDGET, input_scale: float = 1.0, device=None, dtype=torch.float64,
            progress: bool = True) -> Enclosure:
    """Proven enclosure of the ODE ViT's true trajectory from x0 = embed(images) on [0, t1] (SPEC S5).

    Solves with `method` (an adaptive Runge-Kutta method with dense output) at rtol = atol = `tol` in (0, 1), then
    proves ||x(s) - y(s)|| <= radius on every interval (see `Enclosure`, the module docstring and proofs/S5.md).
    `lognorm`: "dense" (exact mu_2 of the n x n Jacobian, n = H W C), "structured" (per-token blocks), "auto"
    (dense when n <= 4096). `tube`: a fixed tube radius to check instead of the bootstrap; `max_tube`: the largest
    tube tried. Where a check fails the sample is not proven, its radius is inf from there on and `reason` says
    which check failed, where (t, step) and with which numbers. Existence and uniqueness of x on [0, t1] follow
    for every proven sample (Theorem 5). The model is enclosed in `dtype` (float64: a float32 model's weights are
    re-embedded exactly, and the statement is about that float64 field). `max_seconds` and `max_work`: the
    budgets of `enclose_field`.
    """
    check_method(method)
    check_settings(tol, max_seconds, max_work)
    if torch.as_tensor(images).shape[:1] == (0,):
        raise EnclosureError("images is an empty batch: give at least one image")
    block, x0, t1 = prepare(model, images, input_scale=input_scale, device=device, dtype=dtype)
    field = make_field(block, x0.shape[1], x0.shape[2], lognorm=lognorm, dtype=dtype, device=x0.device)
    return enclose_field(field, x0, t1, method=method, tol=tol, ref_tol=ref_tol, defect_ratio=defect_ratio,
                         mu_slack=mu_slack, max_per_step=max_per_step, tube=tube, max_tube=max_tube,
                         ref_defect_ratio=ref_defect_ratio, ref_mu_slack=ref_mu_slack,
                         ref_max_per_step=ref_max_per_step, ref_defect_abs=ref_defect_abs, max_seconds=max_seconds,
                         max_work=max_work, progress=progress)


def _resolve_ref_tol(tol, ref_tol):
    if ref_tol is None:
        return None
    if ref_tol == "auto":
        ref_tol = max(tol * REF_FACTOR, REF_FLOOR)
        return ref_tol if ref_tol < tol else None
    if not (isinstance(ref_tol, (int, float)) and math.isfinite(ref_tol) and 0 < ref_tol < tol):
        raise EnclosureError(f"ref_tol must be 'auto', None or a positive number below tol = {tol}, got {ref_tol!r}")
    return float(ref_tol)


def _one_thread_when_small(fn):
    @functools.wraps(fn)
    def run(field, x0, t1, **kw):
        small = (torch.is_tensor(x0) and x0.dim() == 4 and x0.shape[0] > 0 and x0.device.type == "cpu"
                 and x0[0].numel() <= ONE_THREAD_STATE and torch.get_num_threads() > 1)
        if not small:
            return fn(field, x0, t1, **kw)
        from .. import threads
        with threads.set_threads(1):
            return fn(field, x0, t1, **kw)
    return run


@_one_thread_when_small
def enclose_field(field, x0: torch.Tensor, t1: float, *, method: str = "dopri5", tol: float = 1e-3,
                  ref_tol="auto", defect_ratio: float = 0.25, mu_slack: float = 0.25, max_per_step: int = 1024,
                  tube: float | None = None, max_tube: float | None = None, mu_claim=None,
                  solver_field=None, ref_defect_ratio: float = 0.02, ref_mu_slack: float | None = None,
                  ref_max_per_step: int | None = None, ref_max_steps: int = 4096,
                  ref_defect_abs: float | None = None, max_seconds: float | None = None,
                  max_work: float | None = REF_WORK_BUDGET, progress: bool = False) -> Enclosure:
    """The enclosure of field's true solution around the solve y at rtol = atol = `tol` (Theorems 5 and 6).

    ref_tol = None: the direct enclosure of y (Theorem 5). Otherwise (default "auto": tol * 1e-3, not below 1e-11;
    direct if that is not below tol) a second solve y_ref at `ref_tol` is enclosed directly with radius r_ref, and
    ||x - y|| <= sup ||y - y_ref|| + r_ref on every interval (Theorem 6): the defects of y no longer add up, so the
    radius is close to y's actual error. `.center` stays y (the user's solve), `.distance` holds the proven
    sup ||y - y_ref||, `.reference` the enclosure of y_ref, whose tube, log-norms and defects `.tube`, `.mu`,
    `.defect` report. `tube`, `max_tube`, `mu_claim` and `ref_mu_slack` (default the larger of `mu_slack` and
    1 / t1: its growth e^(slack t1) on r_ref is at most e) apply to the
    enclosure of y_ref, whose defect sub-intervals are refined (up to `ref_max_per_step`, default 8 max_per_step)
    until the remainder is below a per-sample target (`_defect_target`: aimed at r_ref(t1) <= 0.1
    ||y(t1) - y_ref(t1)|| from an estimate of int mu, at most `ref_defect_ratio` times a rough sup ||y - y_ref||
    / t1), or below `ref_defect_abs` where given (or the usual ratio); its steps are shortened (at most
    `ref_max_steps`) until its sampled defect is below the same target. `max_seconds`: a time budget for the whole
    call, counted from its start (the user's solve, the reference solve's refinement rounds and the enclosure
    loop); it is checked between refinement rounds (no further round starts once it is used up: they only tune)
    and after each step of the enclosure loop. When it is used up the samples not yet proven get the reason "time
    budget ... proven on [0, t] with radius r there" (the first step is always done).
    `max_work` (default REF_WORK_BUDGET; None: no budget): a budget in units of work, the same on any machine. Where
    the reference enclosure is predicted to need more field evaluations than this (its defect sub-intervals,
    `_sub_intervals`, plus LOGNORM_WORK per point log-norm, `_lognorm_points`, from the field's curvature and
    Lipschitz constants and the defect target), the batch is refused before any proof, each
    sample's reason giving the prediction and the constants behind it (a tuning test: it enters no bound).

    The field object has the `SSoGField` interface (__call__, lipschitz(v), curvature(v), rounding(y, v),
    lognorm(y, v, eps_J), uses_variance). `mu_claim` (float or callable y -> (B,)): a claimed point log-norm, used
    only where it is at or above the verified one (so it can only loosen the bound); a claim below the certified
    lower value of mu_2 (the Rayleigh quotient of the computed top eigenvector) is refuted, one between the two is
    not verified: either way the sample is not proven. `solver_field`: the field both solves integrate (default
    `field`): the trajectories may come from anything, e.g. a cheaper or perturbed model; the enclosure is always
    of `field`'s true solution."""
    check_method(method)
    check_settings(tol, max_seconds, max_work)
    start = time.perf_counter()  # max_seconds counts from here
    opts = DirectOptions(method=method, tol=tol, defect_ratio=defect_ratio, mu_slack=mu_slack,
                         max_per_step=max_per_step, tube=tube, max_tube=max_tube, mu_claim=mu_claim,
                         solver_field=solver_field, progress=progress, max_seconds=max_seconds, clock_start=start)
    check_inputs(x0, t1, opts)
    rt = _resolve_ref_tol(tol, ref_tol)
    if rt is None:
        return enclose_direct(field, x0, t1, opts)
    sf = solver_field or field
    steps, coefs, sol = piecewise_quartic(sf, x0, t1, method=method, tol=tol)
    solve_seconds = time.perf_counter() - start
    per_step = ref_max_per_step or 8 * max_per_step
    slack = ref_mu_slack or max(mu_slack, REF_SLACK_GROWTH / t1)
    rpieces, target = _reference_pieces(sf, x0, t1, (steps, coefs), rt, method, ref_defect_ratio, ref_defect_abs,
                                        ref_max_steps, field=field, max_per_step=per_step, max_work=max_work,
                                        deadline=None if max_seconds is None else start + max_seconds, slack=slack)
    if rpieces is None:  # the defect it would need is out of float64's reach, or its work over max_work: refused
        return _refused(field, x0, t1, steps, coefs, sol, target, tol, rt, start)
    ref_opts = dataclasses.replace(opts, tol=rt, mu_slack=slack, defect_abs=target,
                                   max_per_step=per_step)
    ref = enclose_direct(field, x0, t1, ref_opts, pieces=rpieces)
    seconds = dict(solve=solve_seconds, reference=time.perf_counter() - start - solve_seconds)
    return _combine(ref, steps, coefs, sol, x0.dtype, tol, rt, seconds, start)


def _growth(field, steps, coefs) -> torch.Tensor:
    """(B,) an estimate of int_0^t1 mu along y: the trapezoid rule on the point log-norms at y's step ends (a
    tuning scale, not a bound: eps_J = 0, no tube)."""
    pts = [coefs[0][0]] + [c.sum(0) for c in coefs]
    lam = torch.stack([torch.as_tensor(field.lognorm(p, 0.0, 0.0), dtype=torch.float64).reshape(-1) for p in pts])
    lam = torch.nan_to_num(lam.cpu(), nan=0.0, posinf=1e3, neginf=-1e3)
    h = torch.tensor([b - a for a, b in steps], dtype=torch.float64)
    return ((lam[1:] + lam[:-1]) / 2 * h[:, None]).sum(0)


def _defect_target(field, user, rpieces, t1, ref_defect_ratio, g=None) -> tuple[torch.Tensor, bool]:
    """(B,) the defect y_ref is tuned to, per sample. Theorem 5 gives r_ref(t1) <= int exp(int_s^t1 mu) dbar ds,
    about 2 target t1 phi(g) for a defect dbar <= 2 target (sampled part and remainder) and g = int mu: the target
    aims r_ref(t1) at REF_SHARE of ||y(t1) - y_ref(t1)||, the part of the radius it adds to. Never above the
    earlier ref_defect_ratio * sup ||y - y_ref|| / t1, and not below REF_WORK_FLOOR times that (a budget on the
    refinement), unless the tube needs it: r_ref is also aimed at REF_TUBE / M2 (`_tube_aim`), above which the
    tube's curvature term M2 rho feeds the log-norm and the bootstrap runs away. Never below REF_REACH sup ||y'||
    (`_reach`). Also returns whether the tube aim is below the other for some sample (then the proof needs it). A
    tuning choice: every target gives a valid enclosure. g: `_growth(field, *user)` where the caller has it."""
    rough, at_t1 = _node_distances(*user, *rpieces[:2])
    rough, at_t1 = rough.double().cpu(), at_t1.double().cpu()
    g_full = _growth(field, *user) if g is None else g
    phi = _phi(g_full.clamp(-30.0, 30.0))
    base = ref_defect_ratio * rough / t1
    aim = REF_SHARE * at_t1 / (2 * t1 * phi)
    target = torch.minimum(base, torch.maximum(aim, REF_WORK_FLOOR * base))
    tube = _tube_aim(field, *user)[0] / (2 * t1 * _phi(g_full))
    return torch.maximum(torch.minimum(target, tube), _reach(*user)), bool((tube < target).any())


def _phi(g: torch.Tensor) -> torch.Tensor:
    """(e^g - 1) / g (1 at 0), finite up to g = 700."""
    g = g.clamp(-700.0, 700.0)
    return torch.where(g.abs() > 1e-8, torch.expm1(g) / g, torch.ones_like(g))


def _tube_aim(field, steps, coefs) -> tuple[float, float, float]:
    """(REF_TUBE / M2(v), M2(v), v): the tube radius r_ref is aimed at, with v the square of 0.9 times the smallest
    token std of y at its step ends (a tuning scale, not a bound; v = 0 for a field without a variance floor)."""
    from .solve import token_std
    ends = torch.stack([coefs[0][0]] + [c.sum(0) for c in coefs])
    v = float(0.9 * token_std(ends).min()) ** 2 if getattr(field, "uses_variance", False) else 0.0
    M2 = float(field.curvature(v)) if hasattr(field, "curvature") else 0.0
    return (REF_TUBE / M2 if M2 > 0 else math.inf), M2, v


def _reach(steps, coefs) -> torch.Tensor:
    """(B,) REF_REACH times sup ||y'|| at y's step ends: the smallest reference defect worth aiming at."""
    speed = torch.stack([c[1:].sum(0).flatten(1).norm(dim=-1) / (b - a) for (a, b), c in zip(steps, coefs)])
    return REF_REACH * speed.amax(0).double().cpu()


def _sub_intervals(field, steps, coefs, target) -> torch.Tensor:
    """(K,) about how many defect sub-intervals each step needs for its remainder tau^2 / 8 M_delta to be below
    target (worst sample): h sqrt(M_delta / (8 target)), M_delta from the step's derivative sups and the field's
    constants at the variance `_tube_aim` uses (a tuning scale, not a bound)."""
    from .defect import step_bounds
    _, M2, v = _tube_aim(field, steps, coefs)
    L = float(field.lipschitz(v)) if hasattr(field, "lipschitz") else 0.0
    out = []
    for inf in step_bounds(steps, coefs, coefs[0].shape[-1]):
        Md = (inf["d3"] + M2 * torch.minimum(inf["sq4"], inf["d1"] ** 2) + L * inf["d2"]).double().cpu()
        out.append(float((inf["h"] * (Md / (8 * target)).sqrt()).max()))
    return torch.tensor(out, dtype=torch.float64)


def _out_of_reach(field, steps, coefs, t1, g=None):
    """Per sample, why the enclosure is refused without being tried, or None: the tube aim REF_TUBE / M2 divided
    by the growth 2 t1 phi(int mu) along y asks for a reference defect below REF_REACH sup ||y'|| (float64 cannot
    deliver it). None for every sample if any can be tried (a tuning test: the estimates enter no bound). g:
    `_growth(field, steps, coefs)` where the caller has it."""
    g = _growth(field, steps, coefs) if g is None else g
    rho, M2, v = _tube_aim(field, steps, coefs)
    need = rho / (2 * t1 * _phi(g))
    reach = _reach(steps, coefs)
    if not bool((need < reach).all()):
        return None
    return [f"not attempted: the log-norm along the solve integrates to about {float(gb):.3g} (growth e^{float(gb):.3g}), "
            f"so keeping the tube within {REF_TUBE:g} / M2 = {rho:.3g} (curvature M2 = {M2:.4g} at token variance "
            f"{v:.3g}) needs a reference defect of about {float(nb):.3g}, below float64's reach "
            f"({REF_REACH:g} sup ||y'|| = {float(rb):.3g})" for gb, nb, rb in zip(g, need, reach)]


def _lognorm_points(field, steps, coefs, slack) -> torch.Tensor:
    """(K,) about how many point log-norms each step of the reference enclosure takes: `direct.lognorm_grid`'s
    ceil(M2 sup ||y'|| h / (2 slack)) intervals (worst sample) plus the step's end (a tuning scale, not a bound; the
    refinement's cuts add at most one point per piece, and at most ref_max_steps pieces in all, so they are left out:
    on the tiny main job the refinement made 185 points where the cuts alone would have predicted 8580)."""
    from .defect import step_bounds
    _, M2, _ = _tube_aim(field, steps, coefs)
    grid = torch.tensor([M2 * float(inf["speed"].max()) * inf["h"] / (2 * slack)
                         for inf in step_bounds(steps, coefs, coefs[0].shape[-1])], dtype=torch.float64)
    return grid.ceil().clamp_min(1) + 1


def _over_budget(field, rpieces, target, max_work, slack=1.0):
    """Per sample, why the enclosure is refused for its work, or None: the work the reference enclosure is predicted
    to need, its defect sub-intervals (`_sub_intervals` on y_ref's first steps, worst sample per step, so one count
    for the batch) plus LOGNORM_WORK per point log-norm (`_lognorm_points` at the log-norm slack `slack`), above
    max_work. The reason names the counts and the constants that set them."""
    tgt = torch.as_tensor(target, dtype=torch.float64).reshape(-1)
    subs = _sub_intervals(field, *rpieces[:2], tgt)
    points = float(_lognorm_points(field, *rpieces[:2], slack).sum())
    work = float(subs.sum()) + LOGNORM_WORK * points
    if not work > max_work:  # NaN: not refused here (the proof itself then says what fails)
        return None
    _, M2, v = _tube_aim(field, *rpieces[:2])
    L = float(field.lipschitz(v)) if hasattr(field, "lipschitz") else 0.0
    B = rpieces[1][0].shape[1]
    tgts = tgt.expand(B).tolist()
    return [f"not attempted: the reference enclosure would need about {work:.3g} field evaluations "
            f"({float(subs.sum()):.3g} defect sub-intervals and {points:.3g} point log-norms at {LOGNORM_WORK} each), "
            f"over the work budget max_work = {max_work:.6g} (predicted from the field's curvature M2 = {M2:.4g} and "
            f"Lipschitz constant L = {L:.4g} at token variance {v:.3g}, for a reference defect of {t:.3g}); a larger "
            f"max_work (or None) tries it" for t in tgts]


def _refused(field, x0, t1, steps, coefs, sol, reasons, tol, rt, start) -> Enclosure:
    """The enclosure of samples refused before any proof: nothing proven beyond t = 0 (radius inf at t1)."""
    from .defect import jumps_and_start, step_bounds
    B = x0.shape[0]
    fk = dict(dtype=x0.dtype, device=x0.device)
    _, r0 = jumps_and_start(x0, coefs, step_bounds(steps, coefs, x0.shape[-1]))
    nan = torch.full((1, B), math.nan, **fk)
    stats = {"method": None, "tol": tol, "ref_tol": rt, "nfe_forward": sol["nfe_forward"], "refused": True,
             "steps": sol["steps"], "step_sizes": [b - a for a, b in steps], "method_kind": "refused",
             # no tube was tried: the variance the refusal's constants were taken at (`_tube_aim`, an estimate)
             "variance_floor": _tube_aim(field, steps, coefs)[2], "seconds": {"total": time.perf_counter() - start}}
    return Enclosure(proven=torch.zeros(B, dtype=torch.bool), t=torch.tensor([0.0, t1], **fk),
                     center=torch.stack([coefs[0][0], coefs[-1].sum(0)]),
                     radius=torch.stack([r0.to(**fk), torch.full((B,), math.inf, **fk)]), reason=list(reasons),
                     tube=nan, mu=nan.clone(), mu_point=torch.full((2, B), math.nan, **fk), defect=nan.clone(),
                     defect_sampled=nan.clone(), steps=steps, stats=stats)


def _reference_pieces(sf, x0, t1, user, rt, method, ref_defect_ratio, ref_defect_abs, ref_max_steps, field=None,
                      max_per_step=None, max_work=None, deadline=None, slack=1.0):
    """y_ref's piecewise quartic and the defect target it is tuned to (per sample, `_defect_target`, or
    ref_defect_abs where given): its steps are shortened until its sampled defect, and (in the enclosure) its
    sub-intervals refined until the remainder, are below the target (tuning choices, not part of the proof).
    (None, reasons) where the target is out of float64's reach for every sample (`_out_of_reach`), or the work it
    would take is over max_work (`_over_budget`, with the enclosure's log-norm slack `slack`). No refinement round
    starts after `deadline` (a time.perf_counter() value, from max_seconds): the rounds only tune, and the enclosure
    refines what they left."""
    rpieces = piecewise_quartic(sf, x0, t1, method=method, tol=rt)
    if ref_defect_abs is not None or field is None:  # a given target: tightness alone, REF_STEPS steps
        ref_max_steps = min(ref_max_steps, REF_STEPS)
    if ref_defect_abs is not None:
        target = ref_defect_abs
    elif field is None:
        target = ref_defect_ratio * _rough_distance(*user, rpieces[0], rpieces[1]) / t1
    else:
        g = _growth(field, *user)  # point log-norms at y's step ends: once for both
        refusal = _out_of_reach(field, *user, t1, g=g)
        if refusal is not None:
            return None, refusal
        target, needed = _defect_target(field, user, rpieces, t1, ref_defect_ratio, g=g)
        if not needed:  # beyond REF_STEPS reference steps only where the tube needs them
            ref_max_steps = min(ref_max_steps, REF_STEPS)
    if field is not None and max_work is not None:
        refusal = _over_budget(field, rpieces, target, max_work, slack)
        if refusal is not None:
            return None, refusal
    forced = []  # the times the reference is made to step to, kept from one refinement to the next
    for _ in range(3):
        if deadline is not None and time.perf_counter() > deadline:
            break
        d = _step_defects(sf, *rpieces[:2]).double().cpu()  # (K, B)
        tgt = torch.as_tensor(target, dtype=torch.float64)
        excess = (d / tgt).amax(1)  # (K,) per step, worst sample
        # each step cut into pieces where its defect is above the target (the defect falls like h^4), and where
        # its remainder would need more than half of max_per_step sub-intervals
        cuts = torch.where(excess > 1, (REF_SPLIT * excess.clamp_min(1) ** 0.25).ceil(), torch.ones_like(excess))
        if field is not None and max_per_step:
            cuts = torch.maximum(cuts, (_sub_intervals(field, *rpieces[:2], tgt) / (max_per_step / 2)).ceil())
        if not (float(cuts.max()) > 1 and math.isfinite(float(cuts.sum()))):
            break
        capped = float(cuts.sum()) > ref_max_steps
        if capped:  # a budget: the cuts scaled down to at most ref_max_steps steps
            cuts = (cuts * ref_max_steps / float(cuts.sum())).floor().clamp_min(1)
        if float(cuts.sum()) <= len(rpieces[0]):
            break
        # the interior cuts only: a time the solver lands on by itself stops its step_t there (torchdiffeq tests
        # t0 < t < t0 + dt strictly and never moves past it), and the solve up to the first cut repeats the last
        forced += [a + (b - a) * j / int(n) for (a, b), n in zip(rpieces[0], cuts.tolist()) for j in range(1, int(n))]
        rpieces = piecewise_quartic(sf, x0, t1, method=method, tol=rt, step_times=_spaced(forced, t1))
        if capped:  # the budget is spent: another round would only repeat it
            break
    return rpieces, target


def _spaced(times, t1) -> list:
    """The sorted times without those within 1e-12 t1 of the one before (or of t1): the solver's step_t skips
    every later time once one lies within an ulp or two of where it landed; t1 last."""
    out = []
    for t in sorted(times):
        if (not out or t - out[-1] > 1e-12 * t1) and t1 - t > 1e-12 * t1:
            out.append(t)
    return out + [t1]


def _combine(ref, steps, coefs, sol, dtype, tol, rt, seconds, start) -> Enclosure:
    """Theorem 6: radius = (sup ||y - y_ref|| + r_ref) (1 + 4u) on every interval of y_ref's enclosure."""
    dist, centers, dist_t1 = _distance(steps, coefs, ref._pieces, dtype)
    rr, grow = ref.radius, 1 + 4 * ln.unit_roundoff(torch.float64)
    radius = torch.where(torch.isfinite(rr), (dist + rr) * grow, rr)
    # at t1 itself: ||x - y|| <= ||x - y_ref|| + ||y_ref - y||, both point bounds there
    rr1 = ref.point_radius_t1()
    radius_t1 = torch.where(torch.isfinite(rr1) & ref.proven.to(rr1.device), (dist_t1 + rr1) * grow,
                            torch.full_like(rr1, math.inf))
    reason = [None if r is None else f"reference solve at tol {rt:g}: {r}" for r in ref.reason]
    total = time.perf_counter() - start
    stats = {**ref.stats, "tol": tol, "ref_tol": rt, "nfe_forward": sol["nfe_forward"],
             "nfe_dense_output": sol["nfe_dense_output"], "accepted": sol["accepted"], "rejected": sol["rejected"],
             "steps": sol["steps"], "step_sizes": [b - a for a, b in steps], "method_kind": "reference",
             "reference": {k: ref.stats[k] for k in ("nfe_forward", "nfe_dense_output", "accepted", "rejected",
                                                      "steps", "fine_points", "lognorm_points")},
             "distance_max": dist.amax(0).tolist(), "distance_t1": dist_t1.tolist(),
             "r_ref_t1": rr1.tolist(),
             "seconds": {**seconds, "reference_parts": ref.stats["seconds"],
                         "distance": total - seconds["solve"] - seconds["reference"],
                         "defect": ref.stats["seconds"]["defect"], "lognorm": ref.stats["seconds"]["lognorm"],
                         "total": total}}
    stats["stiffness"] = ref.stats["stiffness"]
    return Enclosure(proven=ref.proven.clone(), t=ref.t, center=centers, radius=radius, radius_t1=radius_t1,
                     reason=reason,
                     tube=ref.tube, mu=ref.mu, mu_point=ref.mu_point, defect=ref.defect,
                     defect_sampled=ref.defect_sampled, steps=steps, stats=stats, distance=dist, reference=ref,
                     _envelope_data=ref._envelope_data, _pieces=dict(steps=steps, coefs=coefs, spans=None))
