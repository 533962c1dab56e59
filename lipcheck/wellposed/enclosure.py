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
from .quartic import _bernstein_matrix, _sampled_defect, _sampled_defects, piecewise_quartic  # noqa: F401
from .result import Enclosure
from .solve import prepare

REF_FACTOR = 1e-3  # ref_tol = "auto": the reference solve at tol * REF_FACTOR ...
REF_FLOOR = 1e-11  # ... but not below this (dopri5's step count explodes near float64's floor)
REF_SHARE = 0.1  # y_ref's defect is aimed at r_ref(t1) <= this share of ||y(t1) - y_ref(t1)|| ...
REF_WORK_FLOOR = 1e-3  # ... with its target at most 1000x below ref_defect_ratio * sup ||y - y_ref|| / t1 (work)

# Per-sample state size up to which the enclosure runs on one thread: its kernels are then too small for a second
# thread to pay, and on a shared machine waiting threads cost most (tiny model, 2 images: 7.0 s on two threads and
# 7.7 s on one on a quiet machine; 65 s on two with a spinning process on each core)
ONE_THREAD_STATE = 4096


def enclose(model, images, *, method: str = "dopri5", tol: float = 1e-3, ref_tol="auto", lognorm: str = "auto",
            defect_ratio: float = 0.25, mu_slack: float = 0.25, max_per_step: int = 1024, tube: float | None = None,
            max_tube: float | None = None, ref_defect_ratio: float = 0.02, ref_mu_slack: float | None = None,
            ref_max_per_step: int | None = None, ref_defect_abs: float | None = None, max_seconds: float | None = None,
            input_scale: float = 1.0, device=None, dtype=torch.float64, progress: bool = True) -> Enclosure:
    """Proven enclosure of the ODE ViT's true trajectory from x0 = embed(images) on [0, t1] (SPEC S5).

    Solves with `method` (an adaptive Runge-Kutta method with dense output) at rtol = atol = `tol` in (0, 1), then
    proves ||x(s) - y(s)|| <= radius on every interval (see `Enclosure`, the module docstring and proofs/S5.md).
    `lognorm`: "dense" (exact mu_2 of the n x n Jacobian, n = H W C), "structured" (per-token blocks), "auto"
    (dense when n <= 4096). `tube`: a fixed tube radius to check instead of the bootstrap; `max_tube`: the largest
    tube tried. Where a check fails the sample is not proven, its radius is inf from there on and `reason` says
    which check failed, where (t, step) and with which numbers. Existence and uniqueness of x on [0, t1] follow
    for every proven sample (Theorem 5). The model is enclosed in `dtype` (float64: a float32 model's weights are
    re-embedded exactly, and the statement is about that float64 field).
    """
    check_method(method)
    check_settings(tol, max_seconds)
    if torch.as_tensor(images).shape[:1] == (0,):
        raise EnclosureError("images is an empty batch: give at least one image")
    block, x0, t1 = prepare(model, images, input_scale=input_scale, device=device, dtype=dtype)
    field = make_field(block, x0.shape[1], x0.shape[2], lognorm=lognorm, dtype=dtype, device=x0.device)
    return enclose_field(field, x0, t1, method=method, tol=tol, ref_tol=ref_tol, defect_ratio=defect_ratio,
                         mu_slack=mu_slack, max_per_step=max_per_step, tube=tube, max_tube=max_tube,
                         ref_defect_ratio=ref_defect_ratio, ref_mu_slack=ref_mu_slack,
                         ref_max_per_step=ref_max_per_step, ref_defect_abs=ref_defect_abs, max_seconds=max_seconds,
                         progress=progress)


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
                  ref_max_per_step: int | None = None, ref_max_steps: int = 512,
                  ref_defect_abs: float | None = None, max_seconds: float | None = None,
                  progress: bool = False) -> Enclosure:
    """The enclosure of field's true solution around the solve y at rtol = atol = `tol` (Theorems 5 and 6).

    ref_tol = None: the direct enclosure of y (Theorem 5). Otherwise (default "auto": tol * 1e-3, not below 1e-11;
    direct if that is not below tol) a second solve y_ref at `ref_tol` is enclosed directly with radius r_ref, and
    ||x - y|| <= sup ||y - y_ref|| + r_ref on every interval (Theorem 6): the defects of y no longer add up, so the
    radius is close to y's actual error. `.center` stays y (the user's solve), `.distance` holds the proven
    sup ||y - y_ref||, `.reference` the enclosure of y_ref, whose tube, log-norms and defects `.tube`, `.mu`,
    `.defect` report. `tube`, `max_tube`, `mu_claim` and `ref_mu_slack` (default `mu_slack`) apply to the
    enclosure of y_ref, whose defect sub-intervals are refined (up to `ref_max_per_step`, default 8 max_per_step)
    until the remainder is below a per-sample target (`_defect_target`: aimed at r_ref(t1) <= 0.1
    ||y(t1) - y_ref(t1)|| from an estimate of int mu, at most `ref_defect_ratio` times a rough sup ||y - y_ref||
    / t1), or below `ref_defect_abs` where given (or the usual ratio); its steps are shortened (at most
    `ref_max_steps`) until its sampled defect is below the same target. `max_seconds`: a time budget for the enclosure loop; when it is used
    up the samples not yet proven get the reason "time budget ... proven on [0, t] with radius r there".

    The field object has the `SSoGField` interface (__call__, lipschitz(v), curvature(v), rounding(y, v),
    lognorm(y, v, eps_J), uses_variance). `mu_claim` (float or callable y -> (B,)): a claimed point log-norm, used
    only where it is at or above the verified one (so it can only loosen the bound); a claim below the certified
    lower value of mu_2 (the Rayleigh quotient of the computed top eigenvector) is refuted, one between the two is
    not verified: either way the sample is not proven. `solver_field`: the field both solves integrate (default
    `field`): the trajectories may come from anything, e.g. a cheaper or perturbed model; the enclosure is always
    of `field`'s true solution."""
    check_method(method)
    opts = DirectOptions(method=method, tol=tol, defect_ratio=defect_ratio, mu_slack=mu_slack,
                         max_per_step=max_per_step, tube=tube, max_tube=max_tube, mu_claim=mu_claim,
                         solver_field=solver_field, progress=progress, max_seconds=max_seconds)
    check_inputs(x0, t1, opts)
    rt = _resolve_ref_tol(tol, ref_tol)
    if rt is None:
        return enclose_direct(field, x0, t1, opts)
    start = time.perf_counter()
    sf = solver_field or field
    steps, coefs, sol = piecewise_quartic(sf, x0, t1, method=method, tol=tol)
    solve_seconds = time.perf_counter() - start
    rpieces, target = _reference_pieces(sf, x0, t1, (steps, coefs), rt, method, ref_defect_ratio, ref_defect_abs,
                                        ref_max_steps, field=field)
    ref_opts = dataclasses.replace(opts, tol=rt, mu_slack=ref_mu_slack or mu_slack, defect_abs=target,
                                   max_per_step=ref_max_per_step or 8 * max_per_step)
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


def _defect_target(field, user, rpieces, t1, ref_defect_ratio) -> torch.Tensor:
    """(B,) the defect y_ref is tuned to, per sample. Theorem 5 gives r_ref(t1) <= int exp(int_s^t1 mu) dbar ds,
    about 2 target t1 phi(g) for a defect dbar <= 2 target (sampled part and remainder) and g = int mu: the target
    aims r_ref(t1) at REF_SHARE of ||y(t1) - y_ref(t1)||, the part of the radius it adds to. Never above the
    earlier ref_defect_ratio * sup ||y - y_ref|| / t1, and not below REF_WORK_FLOOR times that (a budget on the
    refinement). A tuning choice: every target gives a valid enclosure."""
    rough, at_t1 = _node_distances(*user, *rpieces[:2])
    rough, at_t1 = rough.double().cpu(), at_t1.double().cpu()
    g = _growth(field, *user).clamp(-30.0, 30.0)
    phi = torch.where(g.abs() > 1e-8, torch.expm1(g) / g, torch.ones_like(g))
    base = ref_defect_ratio * rough / t1
    aim = REF_SHARE * at_t1 / (2 * t1 * phi)
    return torch.minimum(base, torch.maximum(aim, REF_WORK_FLOOR * base))


def _reference_pieces(sf, x0, t1, user, rt, method, ref_defect_ratio, ref_defect_abs, ref_max_steps, field=None):
    """y_ref's piecewise quartic and the defect target it is tuned to (per sample, `_defect_target`, or
    ref_defect_abs where given): its steps are shortened until its sampled defect, and (in the enclosure) its
    sub-intervals refined until the remainder, are below the target (tuning choices, not part of the proof)."""
    rpieces = piecewise_quartic(sf, x0, t1, method=method, tol=rt)
    if ref_defect_abs is not None:
        target = ref_defect_abs
    elif field is None:
        target = ref_defect_ratio * _rough_distance(*user, rpieces[0], rpieces[1]) / t1
    else:
        target = _defect_target(field, user, rpieces, t1, ref_defect_ratio)
    for _ in range(3):
        d = _sampled_defects(sf, *rpieces[:2]) if torch.is_tensor(target) else _sampled_defect(sf, *rpieces[:2])
        excess = float((torch.as_tensor(d, dtype=torch.float64).cpu() / target).max())
        if not (excess > 1 and math.isfinite(excess)):
            break
        K = min(math.ceil(len(rpieces[0]) * 1.25 * excess ** 0.25), ref_max_steps)  # the defect falls like h^4
        if K <= len(rpieces[0]):
            break
        rpieces = piecewise_quartic(sf, x0, t1, method=method, tol=rt, grid_steps=K)
    return rpieces, target


def _combine(ref, steps, coefs, sol, dtype, tol, rt, seconds, start) -> Enclosure:
    """Theorem 6: radius = (sup ||y - y_ref|| + r_ref) (1 + 4u) on every interval of y_ref's enclosure."""
    dist, centers = _distance(steps, coefs, ref._pieces, dtype)
    rr = ref.radius
    radius = torch.where(torch.isfinite(rr), (dist + rr) * (1 + 4 * ln.unit_roundoff(torch.float64)), rr)
    reason = [None if r is None else f"reference solve at tol {rt:g}: {r}" for r in ref.reason]
    total = time.perf_counter() - start
    stats = {**ref.stats, "tol": tol, "ref_tol": rt, "nfe_forward": sol["nfe_forward"],
             "nfe_dense_output": sol["nfe_dense_output"], "accepted": sol["accepted"], "rejected": sol["rejected"],
             "steps": sol["steps"], "step_sizes": [b - a for a, b in steps], "method_kind": "reference",
             "reference": {k: ref.stats[k] for k in ("nfe_forward", "nfe_dense_output", "accepted", "rejected",
                                                      "steps", "fine_points", "lognorm_points")},
             "distance_max": dist.amax(0).tolist(), "r_ref_t1": ref.radius[-1].tolist(),
             "seconds": {**seconds, "reference_parts": ref.stats["seconds"],
                         "distance": total - seconds["solve"] - seconds["reference"],
                         "defect": ref.stats["seconds"]["defect"], "lognorm": ref.stats["seconds"]["lognorm"],
                         "total": total}}
    stats["stiffness"] = ref.stats["stiffness"]
    return Enclosure(proven=ref.proven.clone(), t=ref.t, center=centers, radius=radius, reason=reason,
                     tube=ref.tube, mu=ref.mu, mu_point=ref.mu_point, defect=ref.defect,
                     defect_sampled=ref.defect_sampled, steps=steps, stats=stats, distance=dist, reference=ref,
                     _envelope_data=ref._envelope_data, _pieces=dict(steps=steps, coefs=coefs, spans=None))
