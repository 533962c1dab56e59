"""A proven enclosure of the true trajectory of x' = F(x) around a computed one (proofs/S5.md, Theorems 5 and 6).

y is a piecewise quartic: on each accepted step [a, b] of the solver, the quartic through its dense output at
a + h (0, 1/4, 1/2, 3/4, 1), with coefficients c_k (floats, so y is known exactly).

Direct (Theorem 5, `ref_tol=None`). With e = x - y and delta = y' - F(y):

    D+ ||e|| <= mu ||e|| + ||delta||,   mu >= mu_2(J_F(z)) for z on every segment [y(s), x(s)]

so on a sub-interval of length tau, r_end <= r e^{mu tau} + sup||delta|| tau phi(mu tau), phi(z) = (e^z - 1)/z.

- sup ||delta|| on each sub-interval [s_j, s_j + tau]: the larger of ||delta|| at both ends (F at the nodes) plus
  tau^2 / 8 sup ||delta''|| (linear interpolation), delta'' = y^(3) - D^2F(y)[y', y'] - J_F(y) y'' bounded from
  Bernstein sups of y's derivatives and F's constants; sub-intervals are refined until that remainder is below
  `defect_ratio` times the sampled defect (or an absolute target).
- mu over the tube of radius rho around y on a coarser sub-interval [u, u']: the larger of the two verified point
  log-norms plus curvature * (rho + token drift to the nearer end) (Lemma 2); the tube is bootstrapped: assume rho,
  bound r, accept only if r <= rho on the whole sub-interval.
- rounding: a-priori bounds for F and the polynomial evaluation; the scalar recurrence in arb balls.

Tight (Theorem 6, the default): a second solve y_ref at ref_tol (on shorter steps) is enclosed directly, and
||x - y|| <= sup ||y - y_ref|| + r_ref on every interval, the sup proven from Bernstein coefficients of the
difference quartics. The defects of y, which cancel in its true error, no longer add up: the radius is close to
y's actual error.

The same per-interval log-norms bound the growth of perturbations: `lognorm_envelope`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import torch
from tqdm.auto import tqdm

from ..bounds import lognorm as ln
from ..bounds.network import token_variance_lower
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
        self._cache = {}  # structured: cached per-token eigenvectors (Cholesky first, eigensolver on failure)

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
        return ln.structured_lognorm(self.block, self.k, y, eps_J, cache=self._cache)


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
    distance: torch.Tensor = None  # (K, B) proven sup ||y - y_ref|| on each interval (reference method), else None
    reference: "Enclosure" = None  # the enclosure of the reference solve y_ref (reference method), else None
    _envelope_data: dict = dataclasses.field(default=None, repr=False)
    _pieces: dict = dataclasses.field(default=None, repr=False)

    def summary(self) -> dict:
        B = len(self.proven)
        return {"proven": self.proven.tolist(), "reason": self.reason, "t": self.t.tolist(),
                "radius": self.radius.T.tolist(), "tube_max": self.tube.amax(0).tolist(),
                "mu_max": self.mu.amax(0).tolist(), "mu_point": self.mu_point.T.tolist(),
                "defect_max": self.defect.amax(0).tolist(), "defect_sampled_max": self.defect_sampled.amax(0).tolist(),
                "radius_t1": self.radius[-1].tolist(), "samples": B,
                "distance_t1": None if self.distance is None else self.distance[-1].tolist(), **self.stats}


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


def _eval(field, y: torch.Tensor, tokens: int = 16384):
    """F(y) in chunks of about `tokens` tokens (memory)."""
    per = max(1, tokens // max(1, y[0, ..., 0].numel()))
    with torch.no_grad():
        return torch.cat([field(y[i:i + per]) for i in range(0, y.shape[0], per)])


def _bern_sup(c: torch.Tensor, h: float, d: int) -> torch.Tensor:
    """sup over the step of ||y^(d)|| per sample (B,), no larger than `_coef_sup`: y^(d) = sum_k a_k sigma^k with
    a_k = (k+d)!/k! c_{k+d} / h^d has Bernstein coefficients b_j = sum_{k<=j} C(j,k)/C(n,k) a_k on [0, 1] and
    ||y^(d)|| <= max_j ||b_j|| (convexity); float rounding of the weights and sums <= gamma_16 sum_k ||a_k||."""
    n = 4 - d
    a = [math.factorial(k + d) // math.factorial(k) * c[k + d] / h ** d for k in range(n + 1)]
    an = [sample_norm(x) for x in a]
    best = torch.stack([sample_norm(sum(math.comb(j, k) / math.comb(n, k) * a[k] for k in range(j + 1)))
                        for j in range(n + 1)]).amax(0)
    g = ln.gamma(16, ln.unit_roundoff(c.dtype))
    return torch.minimum(best + g * sum(an), _coef_sup([sample_norm(x) for x in c], h, d)) \
        * (1 + g)


def _token_speed(c: torch.Tensor, h: float) -> torch.Tensor:
    """Per token sup over the step of ||y_i'|| (B, N) from the Bernstein coefficients of the cubic y' (Lemma 6),
    rounded up by gamma_16 times the coefficient sums."""
    a = [(k + 1) * c[k + 1] / h for k in range(4)]
    b = torch.stack([sum(math.comb(j, k) / math.comb(3, k) * a[k] for k in range(j + 1)) for j in range(4)])
    g = ln.gamma(16 + c.shape[-1], ln.unit_roundoff(c.dtype))
    tok = lambda x: x.norm(dim=-1).flatten(1)  # noqa: E731  (B, H, W, C) -> (B, N)
    return (b.norm(dim=-1).flatten(2).amax(0) + g * sum(tok(x) for x in a)) * (1 + g)


def _coef_sup(cn: list, h: float, d: int):
    """sup over the step of ||y^(d)|| <= sum_k k!/(k-d)! ||c_k|| / h^d (cn: norms of c_k)."""
    return sum(math.factorial(k) // math.factorial(k - d) * cn[k] for k in range(d, 5)) / h ** d


# ------------------------------------------------------------------------------------------------ enclose

def enclose(model, images, *, method: str = "dopri5", tol: float = 1e-3, ref_tol="auto", lognorm: str = "auto",
            defect_ratio: float = 0.25, mu_slack: float = 0.25, max_per_step: int = 1024, tube: float | None = None,
            max_tube: float | None = None, ref_defect_ratio: float = 0.02, ref_mu_slack: float | None = None,
            ref_max_per_step: int | None = None, ref_defect_abs: float | None = None, max_seconds: float | None = None,
            input_scale: float = 1.0, device=None, dtype=torch.float64, progress: bool = True) -> Enclosure:
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
    return enclose_field(field, x0, t1, method=method, tol=tol, ref_tol=ref_tol, defect_ratio=defect_ratio,
                         mu_slack=mu_slack, max_per_step=max_per_step, tube=tube, max_tube=max_tube,
                         ref_defect_ratio=ref_defect_ratio, ref_mu_slack=ref_mu_slack,
                         ref_max_per_step=ref_max_per_step, ref_defect_abs=ref_defect_abs, max_seconds=max_seconds,
                         progress=progress)


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


def piecewise_quartic(field, x0: torch.Tensor, t1: float, *, method: str = "dopri5", tol: float = 1e-3,
                      grid_steps: int | None = None):
    """The computed solution y of x' = field(x) as a piecewise quartic: (steps [(a, b)], coefficients (5, B, H, W, C)
    per step, solver counts). On [a, b], y(t) = sum_k c_k ((t - a)/h)^k, h = b - a, is the quartic through the
    solver's dense output at a + h (0, 1/4, 1/2, 3/4, 1); the coefficients are floats, so y is known exactly.
    `grid_steps`: the solver must also step to every multiple of t1 / grid_steps (steps <= t1 / grid_steps: the
    interpolant's defect falls like h^4, the solver's own error control does not see it)."""
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
            return field(x)

    from ..models.ode import integrate
    cf = _Field()
    with torch.no_grad():
        tt = torch.tensor([0.0, t1], **fk)
        step_t = tt[-1:] if not grid_steps else torch.linspace(0.0, t1, grid_steps + 1, **fk)[1:]
        integrate(cf, x0, tt, method=method, rtol=tol, atol=tol, options={"step_t": step_t})
        steps = [(a, min(a + h, t1)) for a, h in cf.steps if a < t1]
        if not steps or abs(steps[-1][1] - t1) > 8 * u * t1:
            raise EnclosureError(f"the solver's steps do not end on t1 = {t1} (last {steps[-1] if steps else None})")
        nodes = torch.tensor(NODES, **fk)
        grid = torch.unique(torch.cat([a + (b - a) * nodes for a, b in steps]))
        cf2 = _Field()
        ys = integrate(cf2, x0, grid, method=method, rtol=tol, atol=tol, options={"step_t": step_t})
        if cf2.steps != cf.steps:
            raise EnclosureError("the solver took different steps when asked for dense output; cannot enclose")
    V = torch.stack([nodes ** k for k in range(5)], dim=1)  # (5, 5): samples = V @ coefficients
    coefs = []
    for a, b in steps:
        idx = torch.searchsorted(grid, a + (b - a) * nodes)
        idx = idx.clamp_max(len(grid) - 1)
        Y = ys[idx].reshape(5, -1)
        coefs.append(torch.linalg.solve(V, Y).reshape(5, B, H, W, C))
    return steps, coefs, dict(nfe_forward=cf.nfe, nfe_dense_output=cf2.nfe, accepted=cf.accepted,
                              rejected=cf.rejected, steps=len(steps))


REF_FACTOR = 1e-3  # ref_tol = "auto": the reference solve at tol * REF_FACTOR ...
REF_FLOOR = 1e-11  # ... but not below this (dopri5's step count explodes near float64's floor)


def _bernstein_matrix() -> list:
    """M (5 x 5, exact rationals) with b = M v: the Bernstein coefficients on [0, 1] of the quartic whose values at
    s = 0, 1/4, 1/2, 3/4, 1 are v. sup_[0,1] ||p|| <= max_j ||b_j|| (convex combination, proofs/S5.md, Lemma 6)."""
    from fractions import Fraction as Fr
    n = 5
    A = [[Fr(i, 4) ** k for k in range(n)] + [Fr(int(i == r)) for r in range(n)] for i in range(n)]
    for c in range(n):  # Gauss-Jordan in exact arithmetic: A = [V | I] -> [I | V^-1]
        piv = next(r for r in range(c, n) if A[r][c] != 0)
        A[c], A[piv] = A[piv], A[c]
        A[c] = [x / A[c][c] for x in A[c]]
        for r in range(n):
            if r != c and A[r][c] != 0:
                A[r] = [x - A[r][c] * y for x, y in zip(A[r], A[c])]
    Vinv = [row[n:] for row in A]  # power coefficients a = Vinv v
    binom = math.comb
    return [[sum(Fr(binom(j, k), binom(4, k)) * Vinv[k][i] for k in range(j + 1)) for i in range(n)]
            for j in range(n)]


_M = _bernstein_matrix()


def _resolve_ref_tol(tol, ref_tol):
    if ref_tol is None:
        return None
    if ref_tol == "auto":
        ref_tol = max(tol * REF_FACTOR, REF_FLOOR)
        return ref_tol if ref_tol < tol else None
    if not (isinstance(ref_tol, (int, float)) and math.isfinite(ref_tol) and 0 < ref_tol < tol):
        raise EnclosureError(f"ref_tol must be 'auto', None or a positive number below tol = {tol}, got {ref_tol!r}")
    return float(ref_tol)


# Per-sample state size up to which the enclosure runs on one thread: its kernels are then too small for a second
# thread to pay, and on a shared machine waiting threads cost most (tiny model, 2 images: 7.0 s on two threads and
# 7.7 s on one on a quiet machine; 65 s on two with a spinning process on each core)
ONE_THREAD_STATE = 4096


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
    until the remainder is below `ref_defect_ratio` times a rough sup ||y - y_ref|| / t1, or below
    `ref_defect_abs` where given (or the usual ratio); its steps are shortened (at most `ref_max_steps`) until its
    sampled defect is below the same target. `max_seconds`: a time budget for the enclosure loop; when it is used
    up the samples not yet proven get the reason "time budget ... proven on [0, t] with radius r there".

    The field object has the `SSoGField` interface (__call__, lipschitz(v), curvature(v), rounding(y, v),
    lognorm(y, v, eps_J), uses_variance). `mu_claim` (float or callable y -> (B,)) replaces the verified point
    log-norms by a claimed bound, checked against a certified lower value of mu_2 at every point (the Rayleigh
    quotient of the computed top eigenvector) and refuted if below it. `solver_field`: the field both solves
    integrate (default `field`): the trajectories may come from anything, e.g. a cheaper or perturbed model; the
    enclosure is always of `field`'s true solution."""
    _check_inputs(x0, t1, tube, max_tube, defect_ratio, mu_slack, max_per_step)
    check_tolerances([tol])
    rt = _resolve_ref_tol(tol, ref_tol)
    direct = dict(method=method, max_per_step=max_per_step, tube=tube, max_tube=max_tube, mu_claim=mu_claim,
                  solver_field=solver_field, progress=progress, max_seconds=max_seconds)
    if rt is None:
        return _enclose_direct(field, x0, t1, tol=tol, defect_ratio=defect_ratio, mu_slack=mu_slack, **direct)
    start = time.perf_counter()
    steps, coefs, sol = piecewise_quartic(solver_field or field, x0, t1, method=method, tol=tol)
    solve_seconds = time.perf_counter() - start
    # y_ref's defect only needs to be small against the distance it is added to: its steps are shortened until its
    # sampled defect, and its sub-intervals refined until the remainder, are below ref_defect_ratio * (a rough sup
    # of ||y - y_ref|| at the nodes) / t1 (tuning choices, not part of the proof)
    sf = solver_field or field
    rpieces = piecewise_quartic(sf, x0, t1, method=method, tol=rt)
    rough = _rough_distance(steps, coefs, rpieces[0], rpieces[1])
    target = ref_defect_abs if ref_defect_abs is not None else ref_defect_ratio * rough / t1
    for _ in range(3):
        d = _sampled_defect(sf, *rpieces[:2])
        if not (d > target and math.isfinite(d)):
            break
        K = math.ceil(len(rpieces[0]) * 1.25 * (d / target) ** 0.25)
        if K > ref_max_steps:
            break
        rpieces = piecewise_quartic(sf, x0, t1, method=method, tol=rt, grid_steps=K)
    direct["max_per_step"] = ref_max_per_step or 8 * max_per_step
    ref = _enclose_direct(field, x0, t1, tol=rt, defect_ratio=defect_ratio, mu_slack=ref_mu_slack or mu_slack,
                          defect_abs=target, pieces=rpieces, **direct)
    ref_seconds = time.perf_counter() - start - solve_seconds
    dist, centers = _distance(steps, coefs, ref._pieces, x0.dtype)
    B = x0.shape[0]
    rr = ref.radius
    radius = torch.where(torch.isfinite(rr), (dist + rr) * (1 + 4 * ln.unit_roundoff(torch.float64)), rr)
    reason = [None if r is None else f"reference solve at tol {rt:g}: {r}" for r in ref.reason]
    stats = {**ref.stats, "tol": tol, "ref_tol": rt, "nfe_forward": sol["nfe_forward"],
             "nfe_dense_output": sol["nfe_dense_output"], "accepted": sol["accepted"], "rejected": sol["rejected"],
             "steps": sol["steps"], "step_sizes": [b - a for a, b in steps], "method_kind": "reference",
             "reference": {k: ref.stats[k] for k in ("nfe_forward", "nfe_dense_output", "accepted", "rejected",
                                                      "steps", "fine_points", "lognorm_points")},
             "distance_max": dist.amax(0).tolist(), "r_ref_t1": ref.radius[-1].tolist(),
             "seconds": {"solve": solve_seconds, "reference": ref_seconds,
                         "reference_parts": ref.stats["seconds"],
                         "distance": time.perf_counter() - start - solve_seconds - ref_seconds,
                         "defect": ref.stats["seconds"]["defect"], "lognorm": ref.stats["seconds"]["lognorm"],
                         "total": time.perf_counter() - start}}
    stats["stiffness"] = ref.stats["stiffness"]
    return Enclosure(proven=ref.proven.clone(), t=ref.t, center=centers, radius=radius, reason=reason,
                     tube=ref.tube, mu=ref.mu, mu_point=ref.mu_point, defect=ref.defect,
                     defect_sampled=ref.defect_sampled, steps=steps, stats=stats, distance=dist, reference=ref,
                     _envelope_data=ref._envelope_data, _pieces=dict(steps=steps, coefs=coefs, spans=None))


def _sampled_defect(field, steps, coefs) -> float:
    """max ||y' - F(y)|| at the midpoints of y's quarter steps (all samples): a scale for tuning, not a bound."""
    out = 0.0
    for (a, b), c in zip(steps, coefs):
        s = torch.tensor([0.125, 0.375, 0.625, 0.875], dtype=c.dtype, device=c.device)
        y, d1 = _poly(c, s, b - a, 0), _poly(c, s, b - a, 1)
        Fy = _eval(field, y.reshape(-1, *y.shape[2:])).reshape(y.shape)
        out = max(out, float(sample_norm(d1 - Fy).max()))
    return out


def _rough_distance(steps, coefs, rsteps, rcoefs) -> float:
    """max over y_ref's step nodes of ||y - y_ref|| (all samples): a scale for tuning, not a bound."""
    import bisect
    ends = [b for _, b in steps]
    out = 0.0
    for (a, b), c in zip(rsteps, rcoefs):
        for sg in NODES:
            t = a + (b - a) * sg
            ky = min(bisect.bisect_right(ends, t), len(steps) - 1)
            ay, by = steps[ky]
            s = torch.tensor([(t - ay) / (by - ay)], dtype=c.dtype, device=c.device)
            yv = _poly(coefs[ky], s, by - ay, 0)[0]
            yr = _poly(c, torch.tensor([sg], dtype=c.dtype, device=c.device), b - a, 0)[0]
            out = max(out, float(sample_norm(yv - yr).max()))
    return out


def _distance(steps, coefs, ref_pieces, dtype):
    """((K, B) proven sup ||y(s) - y_ref(s)|| on every interval of the reference enclosure, (K, B, H, W, C) y at its
    times). Each interval is cut at y's step ends; on each piece the difference quartic's Bernstein coefficients
    (from its values at 5 equispaced nodes, exact matrix M) bound its sup; pieces are halved while that bound
    exceeds the largest node value by more than 1 %. Rounding of the nodes, the evaluations and M is added."""
    u = ln.unit_roundoff(dtype)
    fk = dict(dtype=coefs[0].dtype, device=coefs[0].device)
    M = torch.tensor([[float(x) for x in row] for row in _M], **fk)  # each entry within u of the rational
    Mabs_rows = M.abs().sum(1)  # (5,)
    ev = ln.gamma(12, u)

    def info(c):
        flat = c.flatten(2)  # (5, B, n)
        return dict(abs_sum=sample_norm(c.abs().sum(0)), dsig=sum(j * flat[j].norm(dim=-1) for j in range(1, 5)))

    yinfo = [info(c) for c in coefs]
    rsteps, rcoefs, spans = ref_pieces["steps"], ref_pieces["coefs"], ref_pieces["spans"]
    rinfo = [info(c) for c in rcoefs]
    ends = [b for _, b in steps]
    # jump margins at y's step ends: the polynomials of both neighbours, so ulp slivers are covered
    jump = [sample_norm(coefs[k + 1][0] - coefs[k].sum(0)) * (1 + ln.gamma(8, u)) + ev * (yinfo[k]["abs_sum"]
            + yinfo[k + 1]["abs_sum"]) for k in range(len(steps) - 1)]
    import bisect
    nodes = torch.tensor(NODES, **fk)

    def piece(kr, s0, s1, ky, margin):
        """bound on sup ||y - y_ref|| over ref sigma in [s0, s1], y from step ky; and the node values."""
        ar, br = rsteps[kr]
        hr = br - ar
        ay, by = steps[ky]
        hy = by - ay
        sig = s0 + (s1 - s0) * nodes  # ref variable
        tnode = ar + hr * sig
        sy = (tnode - ay) / hy
        yr = _poly(rcoefs[kr], sig, hr, 0).flatten(2)  # (5, B, n)
        yy = _poly(coefs[ky], sy, hy, 0).flatten(2)
        d = yy - yr
        bern = torch.einsum("ji,ibn->jbn", M, d)
        bmax = bern.norm(dim=-1).amax(0)  # (B,)
        vmax = d.norm(dim=-1).amax(0)
        dr = 8 * u  # node displacement in the ref variable
        dy = 16 * u * (abs(ar) + hr + abs(ay) + hy) / hy + 4 * u * hr / hy
        err_v = (ev * rinfo[kr]["abs_sum"] + ev * yinfo[ky]["abs_sum"] + dr * rinfo[kr]["dsig"] * (1 + ev)
                 + dy * yinfo[ky]["dsig"] * (1 + ev) + u * (yr.norm(dim=-1).amax(0) + yy.norm(dim=-1).amax(0)))
        err_b = float(Mabs_rows.max()) * (err_v + ln.gamma(8, u) * d.norm(dim=-1).amax(0))
        return bmax + err_b + margin, vmax, err_b + margin

    def bound(kr, s0, s1, ky, margin, depth=0):
        b, v, e = piece(kr, s0, s1, ky, margin)
        if depth >= 6 or bool((b <= 1.01 * v + e).all()) or s1 == s0:
            return b
        mid = (s0 + s1) / 2
        return torch.maximum(bound(kr, s0, mid, ky, margin, depth + 1), bound(kr, mid, s1, ky, margin, depth + 1))

    def y_at(t):
        ky = min(bisect.bisect_right(ends, t), len(steps) - 1) if t < ends[-1] else len(steps) - 1
        a, b = steps[ky]
        return _poly(coefs[ky], torch.tensor([(t - a) / (b - a)], **fk), b - a, 0)[0], ky

    rows, centers = [], []
    c0, _ = y_at(0.0)
    B = coefs[0].shape[1]
    zero = torch.zeros(B, **fk)
    rows.append(bound(0, 0.0, 0.0, 0, zero) + ev * yinfo[0]["abs_sum"])
    centers.append(c0)
    for span in spans:
        if span is None:  # the closing interval after every sample failed: no bound
            rows.append(torch.full((B,), math.inf, **fk))
            centers.append(y_at(float(steps[-1][1]))[0])
            continue
        kr, j0, j1, m = span
        ar, br = rsteps[kr]
        hr = br - ar
        s0, s1 = j0 / m, j1 / m
        ta, tb = ar + hr * s0, ar + hr * s1
        # y's step ends strictly inside (ta, tb) cut the interval
        cuts = [(ends[k] - ar) / hr for k in range(len(steps) - 1) if ta < ends[k] < tb]
        bounds = [s0] + cuts + [s1]
        best = zero
        for q in range(len(bounds) - 1):
            tm = ar + hr * (bounds[q] + bounds[q + 1]) / 2
            ky = min(bisect.bisect_right(ends, tm), len(steps) - 1)
            margin = zero
            if q > 0 or (ky > 0 and abs(ta - steps[ky][0]) <= 8 * u * max(1.0, abs(ta))):
                margin = margin + jump[ky - 1] if ky > 0 else margin
            if q < len(bounds) - 2 or (ky < len(steps) - 1 and abs(tb - ends[ky]) <= 8 * u * max(1.0, abs(tb))):
                margin = margin + jump[ky] if ky < len(steps) - 1 else margin
            best = torch.maximum(best, bound(kr, bounds[q], bounds[q + 1], ky, margin))
        c, ky = y_at(float(tb))
        rows.append(best + ev * yinfo[ky]["abs_sum"])  # the centre is fl(y(t)): its evaluation error
        centers.append(c)
    return torch.stack(rows), torch.stack(centers)



def _enclose_direct(field, x0: torch.Tensor, t1: float, *, method: str = "dopri5", tol: float = 1e-3,
                  defect_ratio: float = 0.25, mu_slack: float = 0.25, max_per_step: int = 1024,
                  tube: float | None = None, max_tube: float | None = None, mu_claim=None,
                  solver_field=None, progress: bool = False, defect_abs: float = 0.0,
                  pieces=None, max_seconds: float | None = None) -> Enclosure:
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
    steps, coefs, sol = pieces or piecewise_quartic(solver_field or field, x0, t1, method=method, tol=tol)
    nfe, accepted, rejected = sol["nfe_forward"], sol["accepted"], sol["rejected"]
    solve_seconds = time.perf_counter() - start

    # ---- per step: coefficient norms, derivative sups, jumps
    ev = ln.gamma(10, u)  # polynomial evaluation (<= 5 terms, powers of sigma)
    step_info = []
    N = H * W
    for k, ((a, b), c) in enumerate(zip(steps, coefs)):
        h = b - a
        cn = [sample_norm(c[j]) for j in range(5)]
        tok = [c[j].norm(dim=-1).flatten(1) for j in range(5)]  # (B, N)
        speed_tok = torch.minimum(sum(j * tok[j] for j in range(1, 5)) / h, _token_speed(c, h))  # sup ||y_i'||
        abs_sum = sample_norm(c.abs().sum(0))
        step_info.append(dict(h=h, cn=cn, d1=_bern_sup(c, h, 1), d2=_bern_sup(c, h, 2), d3=_bern_sup(c, h, 3),
                              speed=speed_tok.amax(1), speed_tok=speed_tok, err_y=ev * abs_sum,
                              sq4=(speed_tok ** 4).sum(1).sqrt() * (1 + ln.gamma(N + 4 * C + 64, u)),
                              err_d1=ev * sum(j * cn[j] for j in range(1, 5)) / h))
    jumps = [torch.zeros(B, **fk)] + [sample_norm(coefs[k + 1][0] - coefs[k].sum(0)) * (1 + ln.gamma(8, u))
                                     + step_info[k]["err_y"] + step_info[k + 1]["err_y"]
                                     for k in range(len(steps) - 1)]
    r0 = sample_norm(x0 - coefs[0][0]) * (1 + ln.gamma(4, u)) + step_info[0]["err_y"]

    def token_std(y):  # (P, B, H, W, C) -> (P, B, N): a lower bound on LayerNorm's (biased) token std
        # the variance's proven lower bound (proofs/S3.md, 'Rounding'), then one square root and one product
        return token_variance_lower(y).sqrt().flatten(2) * (1 - ln.gamma(2, u))

    # ---- defect on fine sub-intervals, refined per step
    def sample_step(k, m):
        a, b = steps[k]
        inf = step_info[k]
        h = inf["h"]
        s = torch.linspace(0.0, 1.0, m + 1, **fk)
        c = coefs[k]
        y, d1 = _poly(c, s, h, 0), _poly(c, s, h, 1)
        Fy = _eval(field, y.reshape(-1, H, W, C)).reshape(y.shape)
        std = token_std(y)  # (m+1, B, N)
        tau = h / m
        drift = inf["speed_tok"][None] * (tau / 2) / math.sqrt(C) * (1 + ln.gamma(4, u))  # tau, sqrt, /, *: rounded up
        floor = (torch.minimum(std[:-1], std[1:]) - drift).amin(-1)  # (m, B) token std floor on each sub-interval
        # the subtraction (where positive) and the square round once each: 1 - gamma_4 keeps v_y below floor^2
        v_y = float(floor.clamp_min(0).min()) ** 2 * (1 - ln.gamma(4, u)) if field.uses_variance else 0.0
        eps_F, eps_J = field.rounding(y.reshape(-1, H, W, C), v_y)
        eps_F = eps_F.reshape(m + 1, B).amax(0)
        L, M2 = field.lipschitz(v_y), field.curvature(v_y)
        dn = sample_norm(d1 - Fy)  # (m+1, B)
        rd = inf["err_d1"] + eps_F + L * inf["err_y"]
        # sup ||delta''|| on the step (B,): ||D^2F[u, u]|| <= M2 (sum_i ||u_i||^4)^(1/2) token by token (Lemma 2)
        Mdd = inf["d3"] + M2 * torch.minimum(inf["sq4"], inf["d1"] ** 2) + L * inf["d2"]
        # delta - (its linear interpolant) = -int G delta'', G >= 0, int G = s (tau - s) / 2 <= tau^2 / 8
        rem = tau ** 2 / 8 * Mdd
        sup = torch.maximum(dn[:-1], dn[1:]) + rd + rem
        return dict(m=m, s=s, y=y, std=std, floor=floor, defect=sup * (1 + ln.gamma(16, u)), sampled=dn,
                    remainder=rem, v_y=v_y, L=L, M2=M2, eps_J=eps_J)

    # ---- propagation with the bootstrap, per sample, in arb
    times, radius, tubes, mus, defects, sampled_d, mu_point, centers = [0.0], [r0.tolist()], [], [], [], [], [], []
    centers.append(coefs[0][0])
    reason = [None] * B
    r = [flint.arb(float(r0[b])) for b in range(B)]
    env_data, spans = [], []
    fine, mu_pts, mu_groups = [], [], []
    defect_seconds = lognorm_seconds = 0.0
    bar = tqdm(range(len(steps)), desc="enclose", disable=not progress, leave=False)
    for k in bar:
        # one step at a time (defect, log-norms, propagation), so that a failure stops the work where it happens
        clock = time.perf_counter()
        m = 8
        while True:
            smp = sample_step(k, m)
            base = torch.maximum(defect_ratio * torch.maximum(smp["sampled"][:-1], smp["sampled"][1:]),
                                 torch.as_tensor(defect_abs, **fk))  # remainder <= ratio * sampled, or <= abs
            worst = defect_ratio * float((smp["remainder"] / base.clamp_min(1e-300)).max())
            if worst <= defect_ratio or 2 * m > max_per_step or not math.isfinite(worst):
                break
            m = min(max_per_step, m * max(2, 2 ** math.ceil(math.log2(math.sqrt(worst / defect_ratio)))))
        fine.append(smp)
        defect_seconds += time.perf_counter() - clock
        clock = time.perf_counter()
        smp = fine[k]
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
        lognorm_seconds += time.perf_counter() - clock
        if k == 0:
            mu_point.append(mu_pts[0][0].tolist())
        smp = fine[k]
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
            drift = inf["speed"] * half  # (B,) how far any token moves from the nearer end
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
            spans.append((k, j0, j1, m))
            radius.append(row_r)
            tubes.append(row_tube)
            mus.append(row_mu)
            defects.append(row_d)
            sampled_d.append(row_ds)
            mu_point.append(lam[p + 1].tolist())
            centers.append(smp["y"][j1].clone())  # a copy: the fine samples are dropped after the step
            env_data.append(dict(tau=(j1 - j0) * tau, lam=[max(float(lam[p, bb]), float(lam[p + 1, bb]))
                                                          for bb in range(B)],
                                 std=std_floor.tolist(), drift=drift.tolist()))
        smp["y"] = None  # (m+1) states of n numbers: not kept across steps (memory at full size)
        bar.set_postfix(t=f"{times[-1]:.4g}", radius=f"{max(radius[-1]):.3g}")
        if max_seconds is not None and time.perf_counter() - start > max_seconds and k < len(steps) - 1:
            for bb in range(B):  # out of time: what holds so far is reported, the rest is not proven
                if reason[bb] is None:
                    reason[bb] = (f"time budget of {max_seconds:.0f} s used up after step {k}: proven on "
                                  f"[0, {times[-1]:.6g}] with radius {radius[-1][bb]:.3g} there, not beyond")
        if all(x is not None for x in reason) and k < len(steps) - 1:
            # every sample has failed: one closing interval to t1 with an infinite radius, nothing more to compute
            times.append(t1), spans.append(None), radius.append([math.inf] * B)
            for rows in (tubes, mus, defects, sampled_d, mu_point):
                rows.append([math.nan] * B)
            centers.append(coefs[-1].sum(0))
            env_data.append(dict(tau=t1 - times[-2], lam=[math.inf] * B, std=[0.0] * B, drift=[math.inf] * B))
            break
    stiff = [max(float(mu_pts[k].max()), 0.0) * step_info[k]["h"] for k in range(len(fine))]
    t = torch.tensor(times, **fk)
    t[-1] = t1
    stats = dict(method=method, tol=tol, nfe_forward=nfe, nfe_dense_output=sol["nfe_dense_output"], accepted=accepted,
                 rejected=rejected, steps=len(steps), fine_points=sum(s["m"] for s in fine),
                 lognorm_points=sum(len(g) for g in mu_groups), lognorm=getattr(field, "lognorm_kind", "given"),
                 eigensolves=(field._dense.eigensolves if getattr(field, "_dense", None) is not None
                              else getattr(field, "_cache", {}).get("eigensolves")),
                 stiffness_max=max(stiff), stiffness=stiff, step_sizes=[b - a for a, b in steps],
                 curvature_max=max(s["M2"] for s in fine), lipschitz_max=max(s["L"] for s in fine),
                 variance_floor=min(s["v_y"] for s in fine), defect_ratio=defect_ratio, mu_slack=mu_slack,
                 seconds={"solve": solve_seconds, "defect": defect_seconds, "lognorm": lognorm_seconds,
                          "total": time.perf_counter() - start})
    f64 = lambda rows: torch.tensor(rows, **fk)
    return Enclosure(proven=torch.tensor([x is None for x in reason]), t=t, center=torch.stack(centers),
                     radius=f64(radius), reason=reason, tube=f64(tubes), mu=f64(mus), mu_point=f64(mu_point),
                     defect=f64(defects), defect_sampled=f64(sampled_d), steps=steps, stats=stats,
                     _envelope_data=dict(intervals=env_data, field=field, radius=f64(radius), C=C),
                     _pieces=dict(steps=steps, coefs=coefs, spans=spans))


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
