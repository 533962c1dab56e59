"""A proven enclosure of the true trajectory of x' = F(x) around a computed one (proofs/S5.md, Theorem 5).

y is a piecewise quartic: on each accepted step [a, b] of the solver, the quartic through its dense output at
a + h (0, 1/4, 1/2, 3/4, 1), with coefficients c_k (floats, so y is known exactly). With e = x - y and
delta = y' - F(y):

    D+ ||e|| <= mu ||e|| + ||delta||,   mu >= mu_2(J_F(z)) for z on every segment [y(s), x(s)]

so on a sub-interval of length tau, r_end <= r e^{mu tau} + sup||delta|| tau phi(mu tau), phi(z) = (e^z - 1)/z.

- sup ||delta|| on each sub-interval [s_j, s_j + tau]: delta and delta' = y'' - J_F(y) y' at both ends (exact
  forward-mode derivatives) plus (tau/2)^2 / 2 sup ||delta''||, delta'' = y''' - D^2F(y)[y', y'] - J_F(y) y'',
  bounded from the coefficients and the second-derivative constant of F; sub-intervals are halved until that
  remainder is below `defect_ratio` times the sampled defect.
- mu over the tube of radius rho around y on a coarser sub-interval [u, u']: the larger of the two verified point
  log-norms plus curvature * (rho + token drift to the nearer end) (Lemma 2); the tube is bootstrapped: assume rho,
  bound r, accept only if r <= rho on the whole sub-interval.
- rounding: a-priori bounds for F, J_F w and the polynomial evaluation; the scalar recurrence in arb balls.

The same per-interval log-norms bound the growth of perturbations: `lognorm_envelope`.
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch
from tqdm.auto import tqdm

from ..bounds import lognorm as ln
from ..models.ode import FIXED_STEP
from .solve import check_methods, check_tolerances, prepare, sample_norm, solve

NODES = (0.0, 0.25, 0.5, 0.75, 1.0)


class EnclosureError(ValueError):
    """The enclosure cannot even be attempted (bad input): the message names the argument and the fix."""


# ------------------------------------------------------------------------------------------ the field's side

class SSoGField:
    """What the enclosure needs from F = SSoG(LN1 x) + MLP(LN2 x): values, J w, constants, point log-norms."""

    def __init__(self, block, H: int, W: int, *, lognorm: str = "auto", dtype=torch.float64, device=None):
        self.block = block
        self.k = ln.field_constants(block, H, W, dtype=dtype, device=device)
        n = H * W * self.k.C
        if lognorm == "auto":
            lognorm = "dense" if n <= 4096 else "structured"
        if lognorm not in ("dense", "structured"):
            raise EnclosureError(f"lognorm must be 'auto', 'dense' or 'structured', got {lognorm!r}")
        self.lognorm_kind = lognorm
        self.uses_variance = True
        self._dense = ln.DenseLogNorm(block, H, W, dtype=dtype, device=device) if lognorm == "dense" else None

    def __call__(self, x):
        return self.block.vector_field(x)

    def lipschitz(self, v: float) -> float:
        return self.k.lipschitz(v)

    def curvature(self, v: float) -> float:
        return self.k.curvature(v)

    def rounding(self, y, v):
        return ln.rounding_bounds(self.k, y, v)

    def lognorm(self, y, v, eps_J):
        if self.lognorm_kind == "dense":
            return self._dense(y, eps_J)
        return ln.structured_lognorm(self.block, self.k, y, eps_J)


# ------------------------------------------------------------------------------------------------ the result

@dataclasses.dataclass
class Enclosure:
    """||x(s) - center[p]|| <= radius[p] for the true solution x at every s in [t[p-1], t[p]] (and at t[p])."""
    proven: torch.Tensor  # (B,) bool
    t: torch.Tensor  # (K,), ends at t1
    center: torch.Tensor  # (K, B, H, W, C)
    radius: torch.Tensor  # (K, B), inf after the first failed check
    reason: list  # per sample: None or why not proven (which check, where)
    tube: torch.Tensor  # (K - 1, B) tube radius assumed and verified on each interval
    mu: torch.Tensor  # (K - 1, B) log-norm bound over that tube
    mu_point: torch.Tensor  # (K, B) verified point log-norm bound at the centres
    defect: torch.Tensor  # (K - 1, B) rigorous sup ||delta|| on the interval
    defect_sampled: torch.Tensor  # (K - 1, B) largest sampled ||delta|| on the interval
    steps: list  # accepted solver steps (a, b)
    stats: dict
    _envelope_data: dict = dataclasses.field(default=None, repr=False)

    def summary(self) -> dict:
        B = len(self.proven)
        return {"proven": self.proven.tolist(), "reason": self.reason, "t": self.t.tolist(),
                "radius": self.radius.T.tolist(), "tube_max": self.tube.amax(0).tolist(),
                "mu_max": self.mu.amax(0).tolist(), "mu_point": self.mu_point.T.tolist(),
                "defect_max": self.defect.amax(0).tolist(), "defect_sampled_max": self.defect_sampled.amax(0).tolist(),
                "radius_t1": self.radius[-1].tolist(), "samples": B, **self.stats}


def _arb():
    import flint
    return flint


def _up(x: float, terms: int = 32) -> float:
    """A float >= the exact value of a formula of <= terms nonnegative float terms computed in float64."""
    return x * (1 + ln.gamma(terms)) if math.isfinite(x) else math.inf


def _poly(c: torch.Tensor, s: torch.Tensor, h: float, d: int) -> torch.Tensor:
    """d-th derivative in t of sum_k c_k ((t - a)/h)^k at sigma = s; c (5, ...), s (m,) -> (m, ...)."""
    out = 0
    for k in range(d, 5):
        f = math.factorial(k) // math.factorial(k - d)
        out = out + f * c[k][None] * (s ** (k - d)).reshape(-1, *[1] * (c.dim() - 1))
    return out / h ** d if d else out


def _jvp(field, y: torch.Tensor, w: torch.Tensor, tokens: int = 16384):
    """(F(y), J_F(y) w) by forward mode, in chunks of about `tokens` tokens (memory), outside autograd's graph."""
    per = max(1, tokens // max(1, y[0, ..., 0].numel()))
    outs = []
    with torch.enable_grad():  # the MLP's no-grad slicing writes in place, which forward mode cannot trace
        for i in range(0, y.shape[0], per):
            f, j = torch.func.jvp(field, (y[i:i + per],), (w[i:i + per],))
            outs.append((f.detach(), j.detach()))
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def _coef_sup(cn: list, h: float, d: int):
    """sup over the step of ||y^(d)|| <= sum_k k!/(k-d)! ||c_k|| / h^d (cn: norms of c_k)."""
    return sum(math.factorial(k) // math.factorial(k - d) * cn[k] for k in range(d, 5)) / h ** d


# ------------------------------------------------------------------------------------------------ enclose

def enclose(model, images, *, method: str = "dopri5", tol: float = 1e-3, lognorm: str = "auto",
            defect_ratio: float = 0.25, mu_slack: float = 0.25, max_per_step: int = 1024, tube: float | None = None,
            max_tube: float | None = None, input_scale: float = 1.0, device=None, dtype=torch.float64,
            progress: bool = True) -> Enclosure:
    """Proven enclosure of the ODE ViT's true trajectory from x0 = embed(images) on [0, t1] (SPEC S5).

    Solves with `method` at rtol = atol = `tol`, then proves ||x(s) - y(s)|| <= radius on every interval (see the
    module docstring and proofs/S5.md). `lognorm`: "dense" (exact mu_2 of the n x n Jacobian, n = H W C),
    "structured" (per-token blocks), "auto" (dense when n <= 4096). `tube`: a fixed tube radius to check instead
    of the bootstrap; `max_tube`: the largest tube tried. Where a check fails the sample is not proven, its
    radius is inf from there on and `reason` says which check failed, where (t, step) and with which numbers.
    Existence and uniqueness of x on [0, t1] follow for every proven sample (Theorem 5).
    """
    check_tolerances([tol])
    check_methods([method])
    if method in FIXED_STEP:
        raise EnclosureError(f"method must be an adaptive Runge-Kutta method with dense output, got {method!r}")
    block, x0, t1 = prepare(model, images, input_scale=input_scale, device=device, dtype=dtype)
    field = SSoGField(block, x0.shape[1], x0.shape[2], lognorm=lognorm, dtype=dtype, device=x0.device)
    return enclose_field(field, x0, t1, method=method, tol=tol, defect_ratio=defect_ratio, mu_slack=mu_slack,
                         max_per_step=max_per_step, tube=tube, max_tube=max_tube, progress=progress)


def _check_inputs(x0, t1, tube, max_tube, defect_ratio, mu_slack, max_per_step):
    if not torch.is_tensor(x0) or x0.dim() != 4:
        raise EnclosureError("x0 must be a tensor of shape (B, H, W, C)")
    if not bool(torch.isfinite(x0).all()):
        raise EnclosureError("x0 must be finite (got NaN or inf in the initial state); fix the input")
    if not (isinstance(t1, (int, float)) and math.isfinite(t1) and t1 > 0):
        raise EnclosureError(f"t1 must be a positive finite end time, got {t1!r}")
    for name, v in (("tube", tube), ("max_tube", max_tube)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise EnclosureError(f"{name} must be a positive finite radius or None, got {v!r}")
    for name, v in (("defect_ratio", defect_ratio), ("mu_slack", mu_slack)):
        if not (math.isfinite(v) and v > 0):
            raise EnclosureError(f"{name} must be a positive finite number, got {v!r}")
    if max_per_step < 8:
        raise EnclosureError(f"max_per_step must be >= 8, got {max_per_step}")


def enclose_field(field, x0: torch.Tensor, t1: float, *, method: str = "dopri5", tol: float = 1e-3,
                  defect_ratio: float = 0.25, mu_slack: float = 0.25, max_per_step: int = 1024,
                  tube: float | None = None, max_tube: float | None = None, mu_claim=None,
                  solver_field=None, progress: bool = False) -> Enclosure:
    """The enclosure for any field object with the `SSoGField` interface (__call__, lipschitz(v), curvature(v),
    rounding(y, v), lognorm(y, v, eps_J), uses_variance). `mu_claim` (float or callable y -> (B,)) replaces the
    verified point log-norms by a claimed bound; the claim is then checked against a certified lower value of
    mu_2 at every point (the Rayleigh quotient of the computed top eigenvector) and refuted if below it.
    `solver_field`: the field the solver integrates (default `field`): the trajectory may come from anything,
    e.g. a cheaper or perturbed model; the enclosure is always of `field`'s true solution."""
    _check_inputs(x0, t1, tube, max_tube, defect_ratio, mu_slack, max_per_step)
    flint = _arb()
    start = time.perf_counter()
    B, H, W, C = x0.shape
    fk = dict(dtype=x0.dtype, device=x0.device)
    u = ln.unit_roundoff(x0.dtype)
    from .solve import CountingField

    class _Field(CountingField):  # the solver integrates `field`, with its steps counted
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.reset()
            self.last_t, self.last_norm = 0.0, 0.0

        def forward(self, t, x):
            self.nfe += 1
            self.last_t = float(t)
            self.last_norm = float(x.detach().norm())
            if not math.isfinite(self.last_norm):
                from ..models.ode import IntegrationError
                raise IntegrationError("non-finite state", t=self.last_t, nfe=self.nfe, state_norm=self.last_norm)
            return (solver_field or field)(x)

    from ..models.ode import integrate
    cf = _Field()
    with torch.no_grad():
        tt = torch.tensor([0.0, t1], **fk)
        integrate(cf, x0, tt, method=method, rtol=tol, atol=tol, options={"step_t": tt[-1:]})
        nfe, accepted, rejected = cf.nfe, cf.accepted, cf.rejected
        steps = [(a, min(a + h, t1)) for a, h in cf.steps if a < t1]
        if not steps or abs(steps[-1][1] - t1) > 8 * u * t1:
            raise EnclosureError(f"the solver's steps do not end on t1 = {t1} (last {steps[-1] if steps else None})")
        nodes = torch.tensor(NODES, **fk)
        grid = torch.unique(torch.cat([a + (b - a) * nodes for a, b in steps]))
        cf2 = _Field()
        ys = integrate(cf2, x0, grid, method=method, rtol=tol, atol=tol, options={"step_t": tt[-1:]})
        if cf2.steps != cf.steps:
            raise EnclosureError("the solver took different steps when asked for dense output; cannot enclose")
    solve_seconds = time.perf_counter() - start
    V = torch.stack([nodes ** k for k in range(5)], dim=1)  # (5, 5): samples = V @ coefficients
    coefs = []
    for a, b in steps:
        idx = torch.searchsorted(grid, a + (b - a) * nodes)
        idx = idx.clamp_max(len(grid) - 1)
        Y = ys[idx].reshape(5, -1)
        coefs.append(torch.linalg.solve(V, Y).reshape(5, B, H, W, C))

    # ---- per step: coefficient norms, derivative sups, jumps
    ev = ln.gamma(10, u)  # polynomial evaluation (<= 5 terms, powers of sigma)
    step_info = []
    for k, ((a, b), c) in enumerate(zip(steps, coefs)):
        h = b - a
        cn = [sample_norm(c[j]) for j in range(5)]
        tok = [c[j].norm(dim=-1).flatten(1) for j in range(5)]  # (B, N)
        speed_tok = sum(j * tok[j] for j in range(1, 5)) / h  # per token sup ||y_i'|| (B, N)
        abs_sum = sample_norm(c.abs().sum(0))
        step_info.append(dict(h=h, cn=cn, d1=_coef_sup(cn, h, 1), d2=_coef_sup(cn, h, 2), d3=_coef_sup(cn, h, 3),
                              speed=speed_tok.amax(1), err_y=ev * abs_sum,
                              err_d1=ev * sum(j * cn[j] for j in range(1, 5)) / h,
                              err_d2=ev * sum(j * (j - 1) * cn[j] for j in range(2, 5)) / h ** 2))
    jumps = [torch.zeros(B, **fk)] + [sample_norm(coefs[k + 1][0] - coefs[k].sum(0)) * (1 + ln.gamma(8, u))
                                     + step_info[k]["err_y"] + step_info[k + 1]["err_y"]
                                     for k in range(len(steps) - 1)]
    r0 = sample_norm(x0 - coefs[0][0]) * (1 + ln.gamma(4, u)) + step_info[0]["err_y"]

    def token_std(y):  # (P, B, H, W, C) -> (P, B, N), LayerNorm's (biased) std with a rounding margin
        return y.var(dim=-1, unbiased=False).sqrt().flatten(2) * (1 - ln.gamma(C + 8, u))

    # ---- defect on fine sub-intervals, refined per step
    def sample_step(k, m):
        a, b = steps[k]
        inf = step_info[k]
        h = inf["h"]
        s = torch.linspace(0.0, 1.0, m + 1, **fk)
        c = coefs[k]
        y, d1, d2 = _poly(c, s, h, 0), _poly(c, s, h, 1), _poly(c, s, h, 2)
        Fy, Jd1 = _jvp(field, y.reshape(-1, H, W, C), d1.reshape(-1, H, W, C))
        Fy, Jd1 = Fy.reshape(y.shape), Jd1.reshape(y.shape)
        std = token_std(y)  # (m+1, B, N)
        tau = h / m
        drift = (sum(j * c[j].norm(dim=-1).flatten(1) for j in range(1, 5)) / h)[None] * (tau / 2) / math.sqrt(C)
        floor = (torch.minimum(std[:-1], std[1:]) - drift).amin(-1)  # (m, B) token std floor on each sub-interval
        v_y = float(floor.clamp_min(0).min()) ** 2 if field.uses_variance else 0.0
        eps_F, eps_J = field.rounding(y.reshape(-1, H, W, C), v_y)
        eps_F = eps_F.reshape(m + 1, B).amax(0)
        L, M2 = field.lipschitz(v_y), field.curvature(v_y)
        dn = sample_norm(d1 - Fy)  # (m+1, B)
        dpn = sample_norm(d2 - Jd1)
        rd = inf["err_d1"] + eps_F + L * inf["err_y"]
        rdp = inf["err_d2"] + eps_J * inf["d1"] + L * inf["err_d1"] + M2 * inf["err_y"] * inf["d1"]
        Mdd = inf["d3"] + M2 * inf["d1"] ** 2 + L * inf["d2"]  # sup ||delta''|| on the step (B,)
        sup = (torch.maximum(dn[:-1], dn[1:]) + rd + (tau / 2) * (torch.maximum(dpn[:-1], dpn[1:]) + rdp)
               + (tau / 2) ** 2 / 2 * Mdd)
        rem = (tau / 2) ** 2 / 2 * Mdd + (tau / 2) * torch.maximum(dpn[:-1], dpn[1:])
        return dict(m=m, s=s, y=y, std=std, floor=floor, defect=sup * (1 + ln.gamma(16, u)), sampled=dn,
                    remainder=rem, v_y=v_y, L=L, M2=M2, eps_J=eps_J)

    fine = []
    for k in tqdm(range(len(steps)), desc="enclose: defect", disable=not progress, leave=False):
        m = 8
        while True:
            smp = sample_step(k, m)
            base = torch.maximum(smp["sampled"][:-1], smp["sampled"][1:])
            worst = float((smp["remainder"] / base.clamp_min(1e-300)).max())
            if worst <= defect_ratio or 2 * m > max_per_step or not math.isfinite(worst):
                break
            m = min(max_per_step, m * max(2, 2 ** math.ceil(math.log2(math.sqrt(worst / defect_ratio)))))
        fine.append(smp)
    defect_seconds = time.perf_counter() - start - solve_seconds

    # ---- log-norm points: every q-th fine point, so that curvature * drift / 2 <= mu_slack
    mu_pts, mu_groups = [], []
    for k, smp in enumerate(tqdm(fine, desc="enclose: log-norm", disable=not progress, leave=False)):
        inf, m = step_info[k], smp["m"]
        drift_rate = float(inf["speed"].max())
        P = max(1, math.ceil(smp["M2"] * drift_rate * inf["h"] / (2 * mu_slack))) if math.isfinite(smp["M2"]) else m
        P = min(m, 2 ** math.ceil(math.log2(P)))
        q = m // P
        idx = list(range(0, m + 1, q))
        ypts = smp["y"][idx]
        eps_J = smp["eps_J"]
        lam = torch.stack([field.lognorm(yp, smp["v_y"], eps_J) for yp in ypts])  # (P+1, B)
        if mu_claim is not None:
            claim = torch.stack([torch.as_tensor(mu_claim(yp) if callable(mu_claim) else mu_claim, **fk).expand(B)
                                 for yp in ypts])
            lower = torch.stack([rayleigh_lower(field, yp, eps_J) for yp in ypts])
            lam = torch.where(claim < lower, torch.full_like(claim, -math.inf), claim)  # -inf marks a refuted claim
        mu_pts.append(lam)
        mu_groups.append(idx)
    lognorm_seconds = time.perf_counter() - start - solve_seconds - defect_seconds

    # ---- propagation with the bootstrap, per sample, in arb
    times, radius, tubes, mus, defects, sampled_d, mu_point, centers = [0.0], [r0.tolist()], [], [], [], [], [], []
    centers.append(coefs[0][0])
    mu_point.append(mu_pts[0][0].tolist())
    reason = [None] * B
    r = [flint.arb(float(r0[b])) for b in range(B)]
    env_data = []
    for k, smp in enumerate(fine):
        inf, m, idx, lam = step_info[k], smp["m"], mu_groups[k], mu_pts[k]
        a, b_end = steps[k]
        h, tau = inf["h"], inf["h"] / m
        for bb in range(B):
            if reason[bb] is None and k > 0:
                r[bb] = r[bb] + flint.arb(float(jumps[k][bb]))
        for p in range(len(idx) - 1):
            j0, j1 = idx[p], idx[p + 1]
            t_end = a + h * j1 / m
            std_floor = torch.minimum(smp["std"][j0], smp["std"][j1]).amin(-1)  # (B,) token std at the ends
            half = (j1 - j0) * tau / 2
            drift = sum(j * coefs[k][j].norm(dim=-1).flatten(1) for j in range(1, 5)).amax(1) / h * half  # (B,)
            row_r, row_tube, row_mu, row_d, row_ds = [], [], [], [], []
            for bb in range(B):
                dsub = smp["defect"][j0:j1, bb]
                dmax_s = float(smp["sampled"][j0:j1 + 1, bb].max())
                if reason[bb] is not None:
                    row_r.append(math.inf), row_tube.append(math.nan), row_mu.append(math.nan)
                    row_d.append(float(dsub.max())), row_ds.append(dmax_s)
                    continue
                lam_hat = max(float(lam[p, bb]), float(lam[p + 1, bb]))
                out = _bootstrap(flint, field, r[bb], [float(x) for x in dsub], tau, lam_hat, float(std_floor[bb]),
                                 float(drift[bb]), C, tube, max_tube)
                if lam_hat == -math.inf:
                    out = dict(ok=False, why=f"claimed log-norm refuted: below the certified value of mu_2 at the "
                                             f"centre (interval ending t={t_end:.6g}, step {k})")
                if not out["ok"]:
                    reason[bb] = out["why"] if "where" not in out else out["why"]
                    if not reason[bb].endswith(")"):
                        reason[bb] += f" (interval [{a + h * j0 / m:.6g}, {t_end:.6g}], step {k})"
                    else:
                        reason[bb] += f" [interval ending t={t_end:.6g}, step {k}]"
                    row_r.append(math.inf), row_tube.append(out.get("rho", math.nan)), row_mu.append(out.get("mu", math.nan))
                else:
                    r[bb] = out["r_end"]
                    row_r.append(out["sup"]), row_tube.append(out["rho"]), row_mu.append(out["mu"])
                row_d.append(float(dsub.max())), row_ds.append(dmax_s)
            times.append(t_end)
            radius.append(row_r)
            tubes.append(row_tube)
            mus.append(row_mu)
            defects.append(row_d)
            sampled_d.append(row_ds)
            mu_point.append(lam[p + 1].tolist())
            centers.append(smp["y"][j1])
            env_data.append(dict(tau=(j1 - j0) * tau, lam=[max(float(lam[p, bb]), float(lam[p + 1, bb]))
                                                          for bb in range(B)],
                                 std=std_floor.tolist(), drift=drift.tolist()))
    stiff = [max(float(mu_pts[k].max()), 0.0) * step_info[k]["h"] for k in range(len(steps))]
    t = torch.tensor(times, **fk)
    t[-1] = t1
    stats = dict(method=method, tol=tol, nfe_forward=nfe, nfe_dense_output=cf2.nfe, accepted=accepted,
                 rejected=rejected, steps=len(steps), fine_points=sum(s["m"] for s in fine),
                 lognorm_points=sum(len(g) for g in mu_groups), lognorm=getattr(field, "lognorm_kind", "given"),
                 eigensolves=getattr(getattr(field, "_dense", None), "eigensolves", None),
                 stiffness_max=max(stiff), stiffness=stiff, step_sizes=[b - a for a, b in steps],
                 curvature_max=max(s["M2"] for s in fine), lipschitz_max=max(s["L"] for s in fine),
                 variance_floor=min(s["v_y"] for s in fine), defect_ratio=defect_ratio, mu_slack=mu_slack,
                 seconds={"solve": solve_seconds, "defect": defect_seconds, "lognorm": lognorm_seconds,
                          "total": time.perf_counter() - start})
    f64 = lambda rows: torch.tensor(rows, **fk)
    return Enclosure(proven=torch.tensor([x is None for x in reason]), t=t, center=torch.stack(centers),
                     radius=f64(radius), reason=reason, tube=f64(tubes), mu=f64(mus), mu_point=f64(mu_point),
                     defect=f64(defects), defect_sampled=f64(sampled_d), steps=steps, stats=stats,
                     _envelope_data=dict(intervals=env_data, field=field, radius=f64(radius), C=C))


def _mu_bar(field, lam_hat, std_floor, drift, rho, C):
    """mu over the tube: lam_hat + M2(v) (rho + drift), v the token-variance floor of the tube (Lemma 2)."""
    if field.uses_variance:
        s = std_floor - (rho + drift) / math.sqrt(C)
        if s <= 0:
            return math.inf, 0.0
        v = s * s
    else:
        v = 0.0
    M2 = field.curvature(v)
    return _up(lam_hat + M2 * (rho + drift), 8) if lam_hat > -math.inf else -math.inf, v


def _propagate(flint, r, dsub, tau, mu):
    """r e^{mu tau} + d tau phi(mu tau) over the sub-intervals, in arb; returns (end, sup over the interval)."""
    m = flint.arb(mu)
    z = m * tau
    grow = z.exp()
    phi = (z.exp() - 1) / z if mu != 0 else flint.arb(1)
    sup = float(r.upper())
    for d in dsub:
        r = r * grow + flint.arb(d) * tau * phi
        sup = max(sup, float(r.upper()))
    return r, flint.arb(sup)


def _bootstrap(flint, field, r, dsub, tau, lam_hat, std_floor, drift, C, tube, max_tube):
    """Assume the tube rho, bound r on the interval, accept iff r <= rho everywhere on it."""
    if not math.isfinite(float(r.upper())):
        return dict(ok=False, why="error bound is not finite")
    trials = [tube] if tube is not None else None
    if trials is None:
        mu0, _ = _mu_bar(field, lam_hat, std_floor, drift, 0.0, C)
        if not math.isfinite(mu0):
            return dict(ok=False, why=f"token variance floor lost: std floor {std_floor:.3g} - drift "
                                      f"{drift:.3g}/sqrt(C) <= 0, no curvature bound")
        _, sup0 = _propagate(flint, r, dsub, tau, mu0)
        rho = 2 * float(sup0.upper()) + 1e-300
        trials = []
        for _ in range(8):
            trials.append(rho)
            rho *= 4
        if max_tube is not None:
            trials = [min(x, max_tube) for x in trials]
            trials = sorted(set(trials))
    last = None
    for rho in trials:
        mu, v = _mu_bar(field, lam_hat, std_floor, drift, rho, C)
        if not math.isfinite(mu):
            last = dict(ok=False, rho=rho, mu=mu, why=f"tube radius {rho:.3g} leaves the region of token variance > 0 "
                                                     f"(std floor {std_floor:.3g}): no curvature bound")
            continue
        end, sup = _propagate(flint, r, dsub, tau, mu)
        s = float(sup.upper())
        if s <= rho:
            return dict(ok=True, rho=rho, mu=mu, r_end=end, sup=s)
        last = dict(ok=False, rho=rho, mu=mu, why=f"tube check failed: error bound {s:.3g} > tube radius {rho:.3g} "
                                                 f"(log-norm over the tube {mu:.4g})")
    return last


def rayleigh_lower(field, y: torch.Tensor, eps_J: float) -> torch.Tensor:
    """A certified lower value of mu_2(J_F(y_b)) per sample: v^T S v / v^T v for the computed top eigenvector v of
    the symmetric part, less its rounding (dense Jacobian; small states only)."""
    out = []
    for b in range(y.shape[0]):
        J = field.jacobian(y[b:b + 1])[0][0] if hasattr(field, "jacobian") else ln.dense_jacobian(field.block, y[b])
        S = (J + J.T) / 2
        w, V = torch.linalg.eigh(S)
        v = V[:, -1]
        q = float(v @ S @ v) / float(v @ v)
        n = J.shape[0]
        out.append(q - ln.gamma(2 * n + 4) * float(torch.linalg.matrix_norm(S)) - math.sqrt(n) * eps_J)
    return torch.tensor(out, dtype=y.dtype, device=y.device)


def lognorm_envelope(enc: Enclosure, perturbation) -> torch.Tensor:
    """Proven growth envelope G(t) with ||x~(t) - x(t)|| <= G(t) ||x~0 - x0|| for every start x~0 within
    `perturbation` (B,) of x0: G = exp(int mu), mu over the tube of radius enclosure radius + perturbation * G
    around the centre (bootstrapped per interval). Returns (K, B); inf where the bootstrap fails."""
    data = enc._envelope_data
    field, C = data["field"], data["C"]
    B = len(enc.proven)
    eps = torch.as_tensor(perturbation, dtype=torch.float64).expand(B).tolist()
    G = [[1.0] * B]
    for i, iv in enumerate(data["intervals"]):
        row = []
        for b in range(B):
            g0 = G[-1][b]
            rad = float(data["radius"][i + 1, b])
            if not (math.isfinite(g0) and math.isfinite(rad)):
                row.append(math.inf)
                continue
            guess = g0 * math.exp(max(iv["lam"][b], 0.0) * iv["tau"]) * 1.5
            ok = math.inf
            for _ in range(6):
                rho = rad + eps[b] * max(g0, guess)
                mu, _ = _mu_bar(field, iv["lam"][b], iv["std"][b], iv["drift"][b], rho, C)
                if not math.isfinite(mu):
                    break
                g1 = _up(g0 * math.exp(_up(mu * iv["tau"], 4)), 4)
                if max(g0, g1) <= max(g0, guess):
                    ok = g1
                    break
                guess = 2 * g1
            row.append(ok)
        G.append(row)
    return torch.tensor(G, dtype=torch.float64)
