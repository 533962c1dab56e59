"""The direct enclosure of one computed solution (proofs/S5.md, Theorem 5): step by step, the defect on whole
sub-intervals, point log-norms on a coarser grid, and the bootstrapped radius recurrence per log-norm interval."""
from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from ..bounds import lognorm as ln
from . import directional
from .defect import jumps_and_start, refined_step, step_bounds, step_states
from .field import point_lognorms
from .options import DirectOptions, check_inputs
from .quartic import piecewise_quartic
from .recurrence import _arb, _bootstrap, _mu_bar, upper
from .result import Enclosure

ROWS = ("radius", "tube", "mu", "defect", "sampled", "mu_point")


def lognorm_grid(smp: dict, inf: dict, mu_slack: float) -> list:
    """Indices of the fine nodes where point log-norms are taken: P intervals, enough that the curvature term
    M2 * drift (or Lemma 7's bend along y) grows by about mu_slack on each: the smallest divisor of the m
    sub-intervals at or above that count (the next power of two when m is one; the counts of
    `defect.sub_interval_count` have divisors 2^a >= m / 7)."""
    m = smp["m"]
    rate = smp["M2"] * float(inf["speed"].max())  # how fast J_F moves along y: Lemma 2, or Lemma 7 where smaller
    if "rate" in smp:
        rate = min(rate, float(smp["rate"].max()))
    P = max(1, math.ceil(rate * inf["h"] / (2 * mu_slack))) if math.isfinite(rate) else m
    P = next(d for d in range(min(m, P), m + 1) if m % d == 0)
    return list(range(0, m + 1, m // P))


LOGNORM_BATCH = 2 ** 23  # matrix entries per batched point log-norm call (memory): n^2 per state of n numbers


def batched_lognorms(field, ypts: torch.Tensor, v: float, eps_J: float, mu_claim=None) -> torch.Tensor:
    """`point_lognorms` (P, B, H, W, C) -> (P, B) with the P points of a step handed to the field as one batch of
    P B states (in chunks of about LOGNORM_BATCH matrix entries): the same verified bound at every state (each is
    certified on its own), one call instead of P. With a claim, point by point (`point_lognorms`)."""
    if mu_claim is not None:
        return point_lognorms(field, ypts, v, eps_J, mu_claim)
    P, B = ypts.shape[:2]
    n = ypts[0, 0].numel()
    per = max(1, LOGNORM_BATCH // (B * n * min(n, 4096)))
    flat = ypts.reshape(P * B, *ypts.shape[2:])
    out = []
    for i in range(0, P * B, per * B):
        lam = torch.as_tensor(field.lognorm(flat[i:i + per * B], v, eps_J)).reshape(-1)
        if lam.numel() != min(per * B, P * B - i):  # a field that answers per sample only: point by point
            return point_lognorms(field, ypts, v, eps_J)
        out.append(lam)
    return torch.cat(out).reshape(P, B)


def carried_lognorm(field, lam_end, std_end, y_end, y_start, offset) -> torch.Tensor:
    """(B,) >= mu_2(J_F(y_start)) from the verified lam_end >= mu_2(J_F(y_end)) at the previous step's last float
    state: mu_2(J_F(a)) <= mu_2(J_F(b)) + M2(v) max_i ||a_i - b_i|| (Lemma 2), v the variance floor of the ball around
    y_end reaching that far (`recurrence._mu_bar`, exact and rounded up). The distance is rounded up by
    1 + gamma_{C+2}; `offset` (2 e_y) covers the token stds std_end having been taken at y_end's other evaluation."""
    C = y_end.shape[-1]
    dist = ((y_start - y_end).norm(dim=-1).flatten(1).amax(1) * (1 + ln.gamma(C + 2, ln.unit_roundoff(y_end.dtype))))
    floor = std_end.amin(-1)
    return torch.tensor([_mu_bar(field, float(lam_end[b]), float(floor[b]), 0.0, float(dist[b]), C,
                                 float(offset[b]))[0] for b in range(len(dist))], dtype=lam_end.dtype,
                        device=lam_end.device)


def _where(out: dict, k: int, a: float, h: float, j0: int, j1: int, m: int) -> str:
    """The failure reason with where it happened: the interval, the step and where the bound first left the tube."""
    t0, t_end = a + h * j0 / m, a + h * j1 / m
    why = out["why"]
    if not why.endswith(")"):
        return why + f" (interval [{t0:.6g}, {t_end:.6g}], step {k})"
    first = out.get("first")
    at = f"first above it at t={a + h * (j0 + first) / m:.6g}; " if first is not None else ""
    return why + f" [{at}interval ending t={t_end:.6g}, step {k}]"


def _claim_failure(lam_hat: float, k: int, t_end: float):
    if lam_hat == -math.inf:
        return f"claimed log-norm refuted: below the certified value of mu_2 at the centre (interval ending " \
               f"t={t_end:.6g}, step {k})"
    if math.isnan(lam_hat):
        return f"claimed log-norm not verified: below the verified upper bound on mu_2 at the centre (interval " \
               f"ending t={t_end:.6g}, step {k})"
    return None


def _lam_hat(lam, p: int, b: int) -> float:
    """The larger of the two end log-norms; a refuted claim (-inf) or an unverified one (nan) at either end wins."""
    ends = (float(lam[p, b]), float(lam[p + 1, b]))
    if any(math.isnan(x) for x in ends):
        return math.nan
    return -math.inf if -math.inf in ends else max(ends)


def interval_rows(flint, field, state, smp, inf, lam, p, idx, k, a, opts):
    """Theorem 5 on one log-norm interval [idx[p], idx[p+1]] of step k, every sample: updates state (radius arbs,
    reasons) and returns the interval's row of every reported quantity and its envelope data."""
    m, h, C = smp["m"], inf["h"], smp["C"]
    j0, j1 = idx[p], idx[p + 1]
    tau = h / m
    std_floor = torch.minimum(smp["std"][j0], smp["std"][j1]).amin(-1)  # (B,) token std at the ends
    # how far a token moves from the nearer end (rounded up), and the evaluation error of fl(y) at the ends
    drift = inf["speed"] * ((j1 - j0) * tau / 2) * (1 + ln.gamma(3, ln.unit_roundoff(std_floor.dtype)))
    offset = inf["err_y"]
    rows = {name: [] for name in ROWS}
    bends = [directional.bend(smp, j0, j1, b) for b in range(len(state["r"]))]  # Lemma 7 (inf: not available)
    for b in range(len(state["r"])):
        dsub = smp["defect"][j0:j1, b]
        rows["defect"].append(float(dsub.max()))
        rows["sampled"].append(float(smp["sampled"][j0:j1 + 1, b].max()))
        rows["mu_point"].append(float(lam[p + 1, b]))
        if state["reason"][b] is not None:
            rows["radius"].append(math.inf), rows["tube"].append(math.nan), rows["mu"].append(math.nan)
            continue
        lam_hat = _lam_hat(lam, p, b)
        claim = _claim_failure(lam_hat, k, a + h * j1 / m)
        out = dict(ok=False, why=claim) if claim else _bootstrap(
            flint, field, state["r"][b], [float(x) for x in dsub], tau, lam_hat, float(std_floor[b]),
            float(drift[b]), C, opts.tube, opts.max_tube, float(offset[b]), bends[b])
        if out["ok"]:
            state["r"][b] = out["r_end"]
            rows["radius"].append(out["sup"]), rows["tube"].append(out["rho"]), rows["mu"].append(out["mu"])
        else:
            state["reason"][b] = out["why"] if claim else _where(out, k, a, h, j0, j1, m)
            rows["radius"].append(math.inf)
            rows["tube"].append(out.get("rho", math.nan)), rows["mu"].append(out.get("mu", math.nan))
    # the envelope's tubes reach drift + ||fl(y) - y|| from the evaluated points (the two kept apart: Lemma 7's bend
    # replaces the drift's curvature term only)
    env = dict(tau=(j1 - j0) * tau, lam=[_lam_hat(lam, p, b) for b in range(len(state["r"]))], bend=bends,
               std=std_floor.tolist(), drift=drift.tolist(), offset=offset.tolist())
    return rows, env


class _Table:
    """The rows of the result, one per interval end (t = 0 first)."""

    def __init__(self, r0, c0):
        self.t, self.center, self.spans, self.env = [0.0], [c0], [], []
        self.rows = {name: [] for name in ROWS}
        self.rows["radius"].append(r0.tolist())

    def add(self, t, center, span, rows, env):
        self.t.append(t), self.center.append(center), self.spans.append(span), self.env.append(env)
        for name in ROWS:
            self.rows[name].append(rows[name])

    def close(self, t1, center, B):
        """Every sample has failed: one closing interval to t1 with an infinite radius."""
        rows = {name: [math.nan] * B for name in ROWS}
        rows["radius"] = [math.inf] * B
        self.add(t1, center, None, rows, dict(tau=t1 - self.t[-1], lam=[math.inf] * B, std=[0.0] * B,
                                              drift=[math.inf] * B, offset=[0.0] * B, bend=[math.inf] * B))


def _out_of_time(state, table, opts, k):
    for b, why in enumerate(state["reason"]):  # out of time: what holds so far is reported, the rest is not proven
        if why is None:
            state["reason"][b] = (f"time budget of {opts.max_seconds:.0f} s used up after step {k}: proven on "
                                  f"[0, {table.t[-1]:.6g}] with radius {table.rows['radius'][-1][b]:.3g} there, "
                                  f"not beyond")


def enclose_direct(field, x0: torch.Tensor, t1: float, opts: DirectOptions, pieces=None) -> Enclosure:
    """Theorem 5 for any field object with the `SSoGField` interface (__call__, lipschitz(v), curvature(v),
    rounding(y, v), lognorm(y, v, eps_J), uses_variance), around the solve `pieces` (default: solved here with
    opts.method at opts.tol, integrating opts.solver_field or field)."""
    check_inputs(x0, t1, opts)
    flint = _arb()
    start = time.perf_counter()
    B, C = x0.shape[0], x0.shape[-1]
    steps, coefs, sol = pieces or piecewise_quartic(opts.solver_field or field, x0, t1, method=opts.method,
                                                    tol=opts.tol)
    clock = dict(solve=time.perf_counter() - start, defect=0.0, lognorm=0.0)
    info = step_bounds(steps, coefs, C)
    jumps, r0 = jumps_and_start(x0, coefs, info)
    state = dict(r=[flint.arb(float(x)) for x in r0], reason=[None] * B)
    table, fine, lams, carried = _Table(r0, coefs[0][0]), [], [], 0
    bar = tqdm(range(len(steps)), desc="enclose", disable=not opts.progress, leave=False)
    for k in bar:  # one step at a time (defect, log-norms, propagation): a failure stops the work where it happens
        now = time.perf_counter()
        smp = refined_step(field, coefs[k], info[k], opts)
        clock["defect"] += time.perf_counter() - now
        now = time.perf_counter()
        idx = lognorm_grid(smp, info[k], opts.mu_slack)
        ypts = step_states(coefs[k], smp, info[k]["h"], idx)  # fl(y) at the log-norm points
        if k > 0 and opts.mu_claim is None:  # the step's start from the previous step's end (one log-norm fewer)
            lam = batched_lognorms(field, ypts[1:], smp["v_y"], smp["eps_J"])
            lam0 = carried_lognorm(field, lams[-1][1][-1], fine[-1]["std"][-1], lams[-1][2], ypts[0],
                                   2 * info[k - 1]["err_y"])
            if not bool(torch.isfinite(lam0).all()):  # the carried bound lost its floor: taken at the point
                lam0 = torch.where(torch.isfinite(lam0), lam0,
                                   batched_lognorms(field, ypts[:1], smp["v_y"], smp["eps_J"])[0])
            lam = torch.cat([lam0[None], lam])
            carried += 1
        else:
            lam = batched_lognorms(field, ypts, smp["v_y"], smp["eps_J"], opts.mu_claim)
        clock["lognorm"] += time.perf_counter() - now
        fine.append(smp), lams.append((idx, lam, ypts[-1]))
        if k == 0:
            table.rows["mu_point"].append(lam[0].tolist())
        for b in range(B):
            if state["reason"][b] is None and k > 0:
                state["r"][b] = state["r"][b] + flint.arb(float(jumps[k][b]))
        a = steps[k][0]
        for p in range(len(idx) - 1):
            rows, env = interval_rows(flint, field, state, smp, info[k], lam, p, idx, k, a, opts)
            table.add(a + info[k]["h"] * idx[p + 1] / smp["m"], ypts[p + 1].clone(),
                      (k, idx[p], idx[p + 1], smp["m"]), rows, env)
        bar.set_postfix(t=f"{table.t[-1]:.4g}", radius=f"{max(table.rows['radius'][-1]):.3g}")
        begun = start if opts.clock_start is None else opts.clock_start
        if opts.max_seconds is not None and time.perf_counter() - begun > opts.max_seconds and k < len(steps) - 1:
            _out_of_time(state, table, opts, k)
        if all(x is not None for x in state["reason"]) and k < len(steps) - 1:
            table.close(t1, coefs[-1].sum(0), B)
            break
    clock["total"] = time.perf_counter() - start
    return _assemble(table, state, steps, coefs, sol, fine, lams, field, x0, t1, opts, clock, carried)


def _assemble(table, state, steps, coefs, sol, fine, lams, field, x0, t1, opts, clock, carried) -> Enclosure:
    fk = dict(dtype=x0.dtype, device=x0.device)
    stiff = [max(float(torch.nan_to_num(lam, nan=-math.inf).max()), 0.0) * (steps[k][1] - steps[k][0])
             for k, (_, lam, _) in enumerate(lams)]
    t = torch.tensor(table.t, **fk)
    t[-1] = t1
    dense = getattr(field, "_dense", None)
    stats = dict(method=opts.method, tol=opts.tol, nfe_forward=sol["nfe_forward"],
                 nfe_dense_output=sol["nfe_dense_output"], accepted=sol["accepted"], rejected=sol["rejected"],
                 steps=len(steps), fine_points=sum(s["m"] for s in fine),
                 lognorm_points=sum(len(idx) for idx, _, _ in lams) - carried, lognorm_carried=carried,
                 lognorm=getattr(field, "lognorm_kind", "given"),
                 eigensolves=(dense.eigensolves if dense is not None
                              else getattr(field, "_cache", {}).get("eigensolves")),
                 stiffness_max=max(stiff), stiffness=stiff, step_sizes=[b - a for a, b in steps],
                 curvature_max=max(s["M2"] for s in fine), lipschitz_max=max(s["L"] for s in fine),
                 variance_floor=min(s["v_y"] for s in fine), defect_ratio=opts.defect_ratio,
                 mu_slack=opts.mu_slack, seconds=clock)
    f64 = lambda rows: torch.tensor(rows, **fk)  # noqa: E731
    rows = {name: f64(table.rows[name]) for name in ROWS}
    # the recurrence's ball at the last sub-interval end, t1: a point bound, below the last interval's sup
    at_t1 = f64([upper(r) if why is None else math.inf for r, why in zip(state["r"], state["reason"])])
    return Enclosure(proven=torch.tensor([x is None for x in state["reason"]]), t=t,
                     center=torch.stack(table.center), radius=rows["radius"], radius_t1=at_t1,
                     reason=state["reason"], tube=rows["tube"], mu=rows["mu"], mu_point=rows["mu_point"],
                     defect=rows["defect"],
                     defect_sampled=rows["sampled"], steps=steps, stats=stats,
                     _envelope_data=dict(intervals=table.env, field=field, radius=rows["radius"], C=x0.shape[-1]),
                     _pieces=dict(steps=steps, coefs=coefs, spans=table.spans))


def _enclose_direct(field, x0: torch.Tensor, t1: float, *, pieces=None, **settings) -> Enclosure:
    """`enclose_direct` with the settings of `DirectOptions` given by name."""
    return enclose_direct(field, x0, t1, DirectOptions(**settings), pieces=pieces)
