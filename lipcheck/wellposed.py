"""Picard-Lindelof checked numerically on the Neural-ODE ViT (SPEC S5).

    x' = F(x) = Mixer(LN1(x)) + MLP(LN2(x)),  x(0) = x0 = embed(images),  t in [0, t1]

- `reference_solution`: fixed-step dopri8 (8th order) with step halving until successive results agree;
  that is how the reference's accuracy is known, not by trusting the tightest adaptive run.
- `tolerance_sweep`: adaptive methods over rtol = atol, fixed-step rk4 over step halvings; per run the
  per-sample final-state error against the reference, NFE, accepted/rejected steps and wall time.
- `perturbation_growth`: ||x(t) - y(t)|| / ||x0 - y0|| for random and worst-case (power iteration on the
  flow's Jacobian) perturbations against the Gronwall envelope exp(L t), L global and local.
- `aposteriori_certificate`: the defect delta = y' - F(y) of a loose solve's dense output and the bound
  ||x(t) - y(t)|| <= int_0^t exp(L (t - s)) ||delta(s)|| ds, against the actual error.

Norms are per sample: the Frobenius norm of one sample's (H, W, C) state. Samples never interact
(the mixer acts within one token grid), so every statement holds sample by sample.

The local constant. LayerNorm's Jacobian on a token of variance v has norm <= max|gamma| / sqrt(v + eps),
so `lipcheck.bounds.vector_field_lipschitz(block, min_variance=v).local_bound` bounds ||J_F(z)|| at every
state z whose tokens all have variance >= v. For ||F(x) - F(y)|| <= L ||x - y|| we need that bound on the
segment [x, y] (mean value theorem), at every t, not only at sampled t. `segment_variance_floor` gives a
lower bound on the token variance over all those points: per token, std is a seminorm / sqrt(C), so
std(y + s (x - y)) >= (std x + std y - std(x - y)) / 2 for s in [0, 1]; between sampled times each token
moves at most (speed bound) * dt, with the speed bound from the weights (`token_speed_bound`).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Sequence

import torch
from tqdm.auto import tqdm

from .models.ode import FIXED_STEP, SOLVERS, VectorField, integrate
from .mixers.attention import DenseAttention
from .mixers.ssog import SSoG

METHODS = ("dopri5", "dopri8", "bosh3", "rk4")
TOLERANCES = tuple(10.0 ** -k for k in range(2, 11))
RK4_STEPS = tuple(2 ** k for k in range(2, 10))  # 4 ... 512 steps, each halving the step
STAGES = {"dopri5": 6, "dopri8": 13, "bosh3": 3, "rk4": 4}  # new evaluations per step (FSAL counted once)


class CountingField(VectorField):
    """VectorField that also counts the solver's accepted and rejected steps.

    torchdiffeq calls `callback_accept_step` / `callback_reject_step` on the function it integrates at
    every step decision of its adaptive Runge-Kutta solvers, so these counts are exact, not inferred
    from NFE. Fixed-grid solvers make no decisions: there every step is accepted by construction.
    """

    def __init__(self, block):
        super().__init__(block)
        self.reset()

    def reset(self):
        self.nfe, self.rejected, self.steps = 0, 0, []

    @property
    def accepted(self) -> int:
        return len(self.steps)

    def callback_accept_step(self, t0, y0, dt):
        self.steps.append((float(t0), float(dt)))

    def callback_reject_step(self, t0, y0, dt):
        self.rejected += 1


# ----------------------------------------------------------------------------------------------- inputs

def check_methods(methods: Sequence[str]) -> tuple:
    methods = tuple(methods)
    if not methods:
        raise ValueError("methods must name at least one solver, e.g. ('dopri5', 'dopri8', 'bosh3', 'rk4')")
    for m in methods:
        if m not in SOLVERS:
            raise ValueError(f"unknown solver method {m!r} in methods; choose among {SOLVERS}")
    return methods


def check_tolerances(tolerances: Sequence[float]) -> tuple:
    tolerances = tuple(tolerances)
    if not tolerances:
        raise ValueError("tolerances must hold at least one positive number, e.g. (1e-3, 1e-6)")
    for tol in tolerances:
        if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
            raise ValueError(f"tolerances must be positive finite numbers (rtol = atol = tol), got {tol!r}")
    return tuple(sorted((float(t) for t in tolerances), reverse=True))


def prepare(model, images, *, input_scale: float = 1.0, device=None, dtype=torch.float64):
    """(block, x0, t1): the ODE ViT's block cast to dtype/device (a copy), x0 = input_scale * embed(images)."""
    if getattr(model, "variant", None) != "ode":
        raise ValueError("model must be an ODE ViT (lipcheck.ViT('ode', ...) or vit_from_preset(name, 'ode', ...)); "
                         f"got variant {getattr(model, 'variant', type(model).__name__)!r}")
    if not (math.isfinite(input_scale) and input_scale > 0):
        raise ValueError(f"input_scale must be a positive finite number, got {input_scale!r}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
    images = torch.as_tensor(images).to(device=device, dtype=dtype)
    if not torch.isfinite(images).all():
        raise ValueError("images must be finite (got NaN or inf)")
    with torch.no_grad():
        x0 = model.embed(images) * input_scale
    for p in model.parameters():
        p.requires_grad_(False)
    return model.vector_field.block, x0, float(model.t1)


def sample_norm(x: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of each sample: (..., B, H, W, C) -> (..., B)."""
    return x.flatten(-3).norm(dim=-1)


def token_std(x: torch.Tensor) -> torch.Tensor:
    """Per-token standard deviation as LayerNorm sees it (biased): (..., C) -> (...)."""
    return x.var(dim=-1, unbiased=False).sqrt()


# -------------------------------------------------------------------------------------------- solving

def solve(block, x0: torch.Tensor, t: torch.Tensor, method: str, *, tol: float | None = None,
          steps: int | None = None, step_t: torch.Tensor | None = None, land: bool = False,
          max_num_steps: int | None = None):
    """One integration through `lipcheck.models.ode.integrate`; returns (states at t, CountingField).

    Adaptive methods take rtol = atol = tol; `land=True` makes the last step end exactly on t[-1]
    (torchdiffeq's `step_t`) instead of overshooting and reading the final state off the dense output,
    which for every torchdiffeq Runge-Kutta method is a quartic (4th order, even for dopri8).
    Fixed steps (`steps` given): rk4 on its grid; an adaptive Runge-Kutta method with
    min_step = max_step = first_step = t1/steps, which torchdiffeq then accepts unconditionally, i.e. that
    method's tableau at a fixed step (optionally also landing on every time in `step_t`).
    """
    field = CountingField(block)
    if method in FIXED_STEP:  # fixed grids make no step decisions: no callbacks to call
        field = VectorField(block)
        field.steps, field.rejected = [], 0
    t1 = float(t[-1] - t[0])
    if steps is not None:
        if steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps}")
        h = t1 / steps
        if method in FIXED_STEP:
            options = {"step_size": h}
        else:
            options = {"first_step": h, "min_step": h, "max_step": h}
            if step_t is not None:
                options["step_t"] = step_t
        out = integrate(field, x0, t, method=method, rtol=1.0, atol=1.0, options=options)
        if method in FIXED_STEP:
            field.steps = [(float(t[0]) + k * h, h) for k in range(steps)]
            field.accepted = steps
        return out, field
    if tol is None or method in FIXED_STEP:
        raise ValueError(f"method {method!r} needs steps (fixed step)" if method in FIXED_STEP else
                         f"method {method!r} needs tol (rtol = atol) or steps (fixed step)")
    options = {"step_t": t[-1:]} if land else {}
    if max_num_steps is not None:
        options["max_num_steps"] = max_num_steps
    return integrate(field, x0, t, method=method, rtol=tol, atol=tol, options=options), field


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-sample ||x - ref|| / ||ref||."""
    return sample_norm(x - ref) / sample_norm(ref)


@dataclasses.dataclass
class Reference:
    """A converged fixed-step dopri8 solution at times t and how its accuracy is known."""
    t: torch.Tensor
    states: torch.Tensor  # (len(t), B, H, W, C)
    steps: int
    error_estimate: float  # max over samples and t of ||x_n - x_{n/2}|| / ||x_n||, last halving
    abs_error: torch.Tensor  # (len(t), B): ||x_n - x_{n/2}|| per sample and time
    history: list  # per level: steps, nfe, relative change at the final time

    def summary(self) -> dict:
        return {"method": "dopri8 fixed step, halved until successive results agree", "steps": self.steps,
                "error_estimate": self.error_estimate, "history": self.history}


def reference_solution(block, x0: torch.Tensor, t1: float, *, t: torch.Tensor | None = None,
                       rel_tol: float = 1e-13, start_steps: int = 8, max_steps: int = 4096,
                       min_steps: int = 0) -> Reference:
    """Fixed-step dopri8 with step halving until the final states of successive halvings agree to rel_tol
    (or stop improving: the round-off floor). If `t` (a grid) is given, steps also land on every t.

    The last change ||x_n - x_{n/2}|| is reported as the error estimate. For an 8th-order method in its
    asymptotic range, x_n's own error is ~ that change / 255, so the estimate is conservative.
    """
    tt = torch.tensor([0.0, t1], dtype=x0.dtype, device=x0.device) if t is None else t
    step_t = None if t is None else t[1:-1]
    n, prev, history = start_steps, None, []
    while True:
        cur, field = solve(block, x0, tt, "dopri8", steps=n, step_t=step_t)
        if prev is not None:
            change = float(relative_error(cur[-1], prev[-1]).max())
            history.append({"steps": n, "nfe": field.nfe, "change": change})
            done = (change <= rel_tol and n >= min_steps) or n * 2 > max_steps
            floor = len(history) >= 3 and change >= history[-2]["change"] and n >= min_steps
            if done or floor:
                abs_err = sample_norm(cur - prev)
                err = float((abs_err / sample_norm(cur).clamp_min(1e-300)).max())
                return Reference(tt, cur, n, max(err, change), abs_err, history)
        prev, n = cur, n * 2


# -------------------------------------------------------------------------------------- tolerance sweep

@dataclasses.dataclass
class SweepResult:
    mixer: str
    runs: list  # one dict per run
    reference: Reference
    convergence: dict
    finals: dict  # (method, tol or steps) -> final state, kept out of JSON

    def summary(self) -> dict:
        return {"mixer": self.mixer, "runs": self.runs, "reference": self.reference.summary(),
                "convergence": self.convergence}


def tolerance_sweep(model, images, methods: Sequence[str] = METHODS, tolerances: Sequence[float] = TOLERANCES, *,
                    reference: Reference | None = None, rk4_steps: Sequence[int] = RK4_STEPS,
                    input_scale: float = 1.0, reference_rtol: float = 1e-13, land_on_t1: bool = True,
                    device=None, dtype=torch.float64, progress: bool = True) -> SweepResult:
    """Integrate the ODE ViT from embed(images) with every method at every rtol = atol in `tolerances`
    (fixed-step methods instead over `rk4_steps` step counts), in `dtype`, and compare each final state
    with a converged fixed-step dopri8 reference (per sample, relative Frobenius error).

    `land_on_t1`: adaptive runs end their last step on t1 (see `solve`); False reads x(t1) off the dense
    output, torchdiffeq's default. Returns runs (mixer, method, tol, steps, error = max over samples,
    errors per sample, ratio error/tol, nfe, accepted, rejected, seconds, final: "step" or "interpolated"),
    the reference and a convergence summary (`convergence_summary`).
    """
    methods = check_methods(methods)
    tolerances = check_tolerances(tolerances)
    block, x0, t1 = prepare(model, images, input_scale=input_scale, device=device, dtype=dtype)
    mixer = "ssog" if isinstance(block.mixer, SSoG) else "attention"
    if reference is None:
        reference = reference_solution(block, x0, t1, rel_tol=reference_rtol)
    ref = reference.states[-1]
    t = torch.tensor([0.0, t1], dtype=dtype, device=x0.device)
    jobs = [(m, None, int(n)) for m in methods if m in FIXED_STEP for n in rk4_steps]
    jobs = [(m, tol, None) for m in methods if m not in FIXED_STEP for tol in tolerances] + jobs
    runs, finals = [], {}
    for method, tol, n in tqdm(jobs, desc=f"sweep {mixer}", disable=not progress, leave=False):
        start = time.perf_counter()
        with torch.no_grad():
            out, field = solve(block, x0, t, method, tol=tol, steps=n, land=land_on_t1)
        seconds = time.perf_counter() - start
        errors = relative_error(out[-1], ref)
        error = float(errors.max())
        runs.append({"mixer": mixer, "method": method, "tol": tol, "steps": n,
                     "step_size": t1 / n if n else None, "error": error, "errors": errors.tolist(),
                     "ratio": error / tol if tol else None, "nfe": field.nfe, "accepted": field.accepted,
                     "rejected": field.rejected, "seconds": seconds, "input_scale": input_scale,
                     "final": "step" if (n or land_on_t1) else "interpolated"})
        finals[(method, tol if tol is not None else n)] = out[-1]
    convergence = convergence_summary(runs, reference.error_estimate, finals)
    return SweepResult(mixer, runs, reference, convergence, finals)


def _fit_slope(x: list, y: list) -> float | None:
    if len(x) < 2:
        return None
    lx, ly = torch.tensor(x, dtype=torch.float64).log10(), torch.tensor(y, dtype=torch.float64).log10()
    lx = lx - lx.mean()
    return float((lx * (ly - ly.mean())).sum() / lx.square().sum())


def convergence_summary(runs: list, reference_error: float, finals: dict | None = None,
                        floor_factor: float = 100.0) -> dict:
    """Per method: slope of log error vs log tol (adaptive) or vs log step (fixed), fitted over the runs
    whose error exceeds floor_factor * the reference's error estimate; orders of magnitude gained from the
    loosest to the tightest tolerance; for fixed steps the observed order per halving. Over methods:
    the pooled adaptive slope and, at the tightest tolerance, the spread (largest relative distance
    between two methods' final states, and the largest error)."""
    floor = floor_factor * max(reference_error, 1e-16)
    per_method = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        rs = [r for r in runs if r["method"] == method]
        if rs[0]["tol"] is not None:
            rs = sorted(rs, key=lambda r: -r["tol"])
            above = [r for r in rs if r["error"] > floor]
            per_method[method] = {
                "kind": "adaptive", "slope": _fit_slope([r["tol"] for r in above], [r["error"] for r in above]),
                "fitted_points": len(above),
                "orders_gained": math.log10(rs[0]["error"] / max(rs[-1]["error"], 1e-300)),
                "loosest": {"tol": rs[0]["tol"], "error": rs[0]["error"]},
                "tightest": {"tol": rs[-1]["tol"], "error": rs[-1]["error"]}}
        else:
            rs = sorted(rs, key=lambda r: r["steps"])
            above = [r for r in rs if r["error"] > floor]
            per_method[method] = {
                "kind": "fixed", "slope": _fit_slope([r["step_size"] for r in above], [r["error"] for r in above]),
                "fitted_points": len(above),
                "order_per_halving": [math.log2(a["error"] / b["error"]) for a, b in zip(above, above[1:])],
                "finest": {"steps": rs[-1]["steps"], "error": rs[-1]["error"]}}
    adaptive = [r for r in runs if r["tol"] is not None]
    out = {"per_method": per_method, "floor": floor}
    if adaptive:
        above = [r for r in adaptive if r["error"] > floor]
        out["slope"] = _fit_slope([r["tol"] for r in above], [r["error"] for r in above])
        tight = min(r["tol"] for r in adaptive)
        at = [r for r in adaptive if r["tol"] == tight]
        out["tightest_tol"] = tight
        out["max_error_at_tightest"] = max(r["error"] for r in at)
        if finals is not None and len(at) > 1:
            states = [finals[(r["method"], tight)] for r in at]
            out["spread"] = max(float(relative_error(a, b).max()) for i, a in enumerate(states) for b in states[i + 1:])
        else:
            out["spread"] = None
    return out


# ------------------------------------------------------------------------------------ certified constants

def vector_field_constants(block, states: torch.Tensor, min_variance: float | None = None, *,
                           dtype=torch.float64, device=None):
    """(global L, local L on states whose tokens have variance >= min_variance, the full result), from
    `lipcheck.bounds.vector_field_lipschitz`; `states` (B, H, W, C) fixes the grid (attention's constant
    depends on the number of tokens)."""
    from .bounds import vector_field_lipschitz
    res = vector_field_lipschitz(block, states, min_variance=min_variance, dtype=dtype, device=device)
    # with states given the bound uses min(min_variance, the states' own minimum): never a larger constant
    local = res.local_bound if res.local_bound is not None else res.global_bound
    return float(res.global_bound), float(local), res


def token_speed_bound(block, *, dtype=torch.float64, device=None) -> float:
    """B with ||F(x)_i|| <= B for every state x and token i (inf without LayerNorm).

    Every LN output token lies in a ball of radius rho = max|gamma| sqrt(C) + ||beta||. SSoG: token i of
    sum_h K_h U P_h has norm <= sum_h (sum_j |K_h[i, j]|) ||P_h|| rho, and each normalised Gaussian row sums
    to <= 1, so sum_j |K_h[i, j]| <= sum_m |alpha[h, m]|. Attention: each head outputs a convex combination
    of its value tokens. MLP: |GELU(z)| <= |z|.
    """
    if not isinstance(block.norm1, torch.nn.LayerNorm):
        return math.inf
    fk = dict(dtype=dtype, device=device)
    op = lambda w: float(torch.linalg.matrix_norm(w.detach().to(**fk), ord=2))
    vec = lambda b: float(b.detach().to(**fk).norm()) if b is not None else 0.0
    from .bounds.attention import layernorm_image_radius
    rho1 = layernorm_image_radius(block.norm1)
    mixer = block.mixer
    if isinstance(mixer, SSoG):
        alpha = mixer.gaussian_params()[0].detach().to(**fk)
        P = mixer.head_projections().detach().to(**fk)
        speed = sum(float(alpha[h].abs().sum()) * op(P[h]) for h in range(mixer.num_heads)) * rho1
        speed += vec(mixer.o_proj.bias)
    elif isinstance(mixer, DenseAttention):
        d = mixer.head_dim
        WV, bV = mixer.v_proj.weight.detach().to(**fk), mixer.v_proj.bias
        heads = [op(WV[h * d:(h + 1) * d]) * rho1 + (vec(bV[h * d:(h + 1) * d]) if bV is not None else 0.0)
                 for h in range(mixer.num_heads)]
        speed = op(mixer.o_proj.weight) * math.sqrt(sum(v * v for v in heads)) + vec(mixer.o_proj.bias)
    else:
        raise TypeError(f"unknown mixer {type(mixer).__name__}; expected SSoG or DenseAttention")
    if block.mlp is not None:
        rho2 = layernorm_image_radius(block.norm2)
        fc1, fc2 = block.mlp.fc1, block.mlp.fc2
        speed += op(fc2.weight) * (op(fc1.weight) * rho2 + vec(fc1.bias)) + vec(fc2.bias)
    return speed


def segment_variance_floor(xa: torch.Tensor, xb: torch.Tensor, drift_a, drift_b, *, margin=0.0) -> float:
    """Lower bound on the token variance of every point of the segments [xa(t), xb(t)], t in [t_0, t_K].

    xa, xb: (K+1, B, H, W, C) at the sampled times t_k; drift_a, drift_b: bounds (scalar or (K,)) on how far
    any token of xa, xb moves (2-norm) within [t_k, t_{k+1}]; margin: a bound on the token-wise error of
    xa, xb themselves. Per token std(z) = ||z - mean z|| / sqrt(C) is a seminorm over sqrt(C), hence
    std(b + s (a - b)) >= (std a + std b - std(a - b)) / 2 on s in [0, 1], and it moves by at most
    (drift) / sqrt(C) within an interval.
    """
    C = xa.shape[-1]
    a, b, d = token_std(xa[:-1]), token_std(xb[:-1]), token_std(xa[:-1] - xb[:-1])
    a2, b2, d2 = token_std(xa[1:]), token_std(xb[1:]), token_std(xa[1:] - xb[1:])
    to_t = lambda v: torch.as_tensor(v, dtype=xa.dtype, device=xa.device).reshape(-1, *([1] * (a.dim() - 1)))
    slack = (to_t(drift_a) + to_t(drift_b) + 2 * margin) / math.sqrt(C)
    # the floor over the interval, from either end (the better of the two is valid)
    lo = torch.maximum((a + b - d) / 2, (a2 + b2 - d2) / 2) - slack
    return float(lo.clamp_min(0).min()) ** 2


# ---------------------------------------------------------------------------------- perturbation growth

def flow_map(block, t1: float, steps: int = 32):
    """x0 -> x(t1) by fixed-step rk4 through `integrate`, differentiable (for the flow's Jacobian)."""
    def phi(x):
        t = torch.tensor([0.0, t1], dtype=x.dtype, device=x.device)
        return integrate(VectorField(block), x, t, method="rk4", options={"step_size": t1 / steps})[-1]
    return phi


def worst_direction(block, x0: torch.Tensor, t1: float, *, iters: int = 8, steps: int = 32,
                    generator: torch.Generator | None = None):
    """Power iteration on J^T J, J the Jacobian of the flow x0 -> x(t1) (per sample); returns unit v and
    the estimate ||J v|| per sample (a lower bound on ||J||_2 of the rk4 flow)."""
    phi = flow_map(block, t1, steps)
    v = torch.randn(x0.shape, dtype=x0.dtype, device=x0.device, generator=generator)
    v = v / sample_norm(v)[:, None, None, None]
    sigma = None
    with torch.enable_grad():
        for _ in range(iters):
            _, Jv = torch.autograd.functional.jvp(phi, x0, v)
            _, JtJv = torch.autograd.functional.vjp(phi, x0, Jv)
            sigma = sample_norm(Jv)
            v = JtJv / sample_norm(JtJv)[:, None, None, None]
    return v.detach(), sigma.detach()


def auto_grid(block, x0: torch.Tensor, t1: float, *, lo: int = 16, hi: int = 512) -> int:
    """Sampled intervals so that the drift margin of `segment_variance_floor` (2 speed dt / sqrt(C)) is at most half
    the smallest token std of x0: then the certified variance floor keeps about a quarter of the initial one."""
    speed = token_speed_bound(block, dtype=x0.dtype, device=x0.device)
    if not math.isfinite(speed) or speed == 0:
        return lo
    sigma0 = float(token_std(x0).min())
    dt = sigma0 * math.sqrt(x0.shape[-1]) / (4 * speed)
    return int(min(hi, max(lo, 2 ** math.ceil(math.log2(max(t1 / max(dt, 1e-300), 1.0))))))


def perturbation_growth(model, images, *, eps: float = 1e-3, grid: int | None = None, directions=("random", "worst"),
                        power_iters: int = 6, power_steps: int = 32, input_scale: float = 1.0, seed: int = 0, device=None,
                        dtype=torch.float64, reference_rtol: float = 1e-13) -> dict:
    """Growth g(t) = ||x(t) - y(t)|| / ||x0 - y0|| of y0 = x0 + eps ||x0|| v (per sample, ||v|| = 1) against
    exp(L t) with L global and L local, on `grid` + 1 uniform times (None: `auto_grid`); violations count the (time, sample,
    direction) triples with g(t) > exp(L t) (compared in log space: exp(L_global t) overflows).

    Both trajectories are integrated in one batch by the converged fixed-step reference (steps landing on
    the grid), so their difference is not swamped by independent solver errors. The local L holds on every
    segment [x(t), y(t)], t in [0, t1] (`segment_variance_floor` with `token_speed_bound`).
    """
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite number (relative perturbation size), got {eps!r}")
    block, x0, t1 = prepare(model, images, input_scale=input_scale, device=device, dtype=dtype)
    B = x0.shape[0]
    grid = auto_grid(block, x0, t1) if grid is None else int(grid)
    if grid < 1:
        raise ValueError(f"grid must be a positive number of sampled intervals (or None), got {grid}")
    gen = torch.Generator(device=x0.device).manual_seed(seed)
    dirs, power = {}, None
    for name in directions:
        if name == "random":
            v = torch.randn(x0.shape, dtype=dtype, device=x0.device, generator=gen)
            dirs[name] = v / sample_norm(v)[:, None, None, None]
        elif name == "worst":
            dirs[name], sigma = worst_direction(block, x0, t1, iters=power_iters, steps=power_steps, generator=gen)
            power = sigma.tolist()
        else:
            raise ValueError(f"unknown direction {name!r}; choose among ('random', 'worst')")
    size = eps * sample_norm(x0)
    ys = [x0 + size[:, None, None, None] * v for v in dirs.values()]
    t = torch.linspace(0.0, t1, grid + 1, dtype=dtype, device=x0.device)
    ref = reference_solution(block, torch.cat([x0, *ys]), t1, t=t, rel_tol=reference_rtol,
                             start_steps=2 ** math.ceil(math.log2(grid)))  # steps land on the grid anyway
    X = ref.states[:, :B]
    drift = token_speed_bound(block, dtype=dtype, device=x0.device) * (t1 / grid)
    margin = float(ref.abs_error.max())  # every token's error is at most its sample's
    out = {"eps": eps, "grid": grid, "t": t.tolist(), "reference": ref.summary(),
           "speed_bound": drift * grid / t1, "power_iteration_sigma": power, "directions": {}}
    v_floor = math.inf
    for k, name in enumerate(dirs):
        Y = ref.states[:, (k + 1) * B:(k + 2) * B]
        v_floor = min(v_floor, segment_variance_floor(X, Y, drift, drift, margin=margin))
    # v_floor = 0 (no LayerNorm, or a floor lost in the drift margins) gives back the global constant
    L_global, L_local, _ = vector_field_constants(block, x0, v_floor, dtype=dtype, device=x0.device)
    out.update(min_variance=v_floor, L_local=L_local, L_global=L_global)
    total = {"global": 0, "local": 0}
    for k, name in enumerate(dirs):
        Y = ref.states[:, (k + 1) * B:(k + 2) * B]
        growth = sample_norm(X - Y) / size  # (T, B)
        log_g = growth.log()
        # t = 0 is excluded: there growth = 1 = envelope up to round-off
        viol = {kind: int((log_g[1:] > L * t[1:, None]).sum()) for kind, L in
                (("global", L_global), ("local", L_local))}
        for kind in total:
            total[kind] += viol[kind]
        out["directions"][name] = {
            "growth": growth.T.tolist(), "max_growth": float(growth.max()),
            "growth_t1": growth[-1].tolist(), "rate_t1": (log_g[-1] / t1).tolist(),
            "max_rate": float((log_g[1:] / t[1:, None]).max()),
            "violations": viol}
    out["violations"] = total
    return out


# ------------------------------------------------------------------------------- a-posteriori certificate

def _quartic_fit(x: torch.Tensor, Y: torch.Tensor):
    """Least-squares quartic through samples Y (m+1, ...) at x in [0, 1]; the dense output of torchdiffeq's
    Runge-Kutta solvers is exactly a quartic per step, so the residual is round-off.

    Returns (coef (5, ...), slope_error): a bound on how far the fitted derivative d/dx can be from the true
    quartic's at x in [0, 1], per entry, if each sample carries an error up to the largest residual r
    (generously doubled): coefficient errors <= ||V^+||_2 sqrt(m+1) (2 r), d/dx sums k |dc_k| <= 10 max."""
    V = torch.stack([x ** k for k in range(5)], dim=1)
    flat = Y.reshape(Y.shape[0], -1)
    coef = torch.linalg.lstsq(V, flat).solution
    resid = float((V @ coef - flat).abs().max()) + 4 * torch.finfo(Y.dtype).eps * float(flat.abs().max())
    pinv_norm = 1.0 / float(torch.linalg.svdvals(V).min())
    return coef.reshape(5, *Y.shape[1:]), 10 * pinv_norm * math.sqrt(len(x)) * 2 * resid


def _upper_sum(delta: torch.Tensor, grid: torch.Tensor, L: float) -> torch.Tensor:
    """B(t_i) >= int_0^{t_i} e^{L (t_i - s)} d(s) ds with d taken as max(d(a), d(b)) on each interval [a, b]:
    B(t_{i+1}) = e^{L tau} B(t_i) + dmax (e^{L tau} - 1) / L, the exponential integrated exactly (inf on overflow)."""
    tau = grid[1:] - grid[:-1]
    dmax = torch.maximum(delta[:-1], delta[1:])
    grow, gain = torch.exp(L * tau), torch.expm1(L * tau) / L
    bound = torch.zeros_like(delta)
    for i in range(len(tau)):
        bound[i + 1] = grow[i] * bound[i] + dmax[i] * gain[i]
    return bound


def aposteriori_certificate(model, images, *, method: str = "dopri5", tol: float = 1e-3, per_step: int | None = None,
                            reference_rtol: float = 1e-11, input_scale: float = 1.0, safety: float = 2.0,
                            device=None, dtype=torch.float64) -> dict:
    """Bound the error of an adaptive solve from its own dense output, and compare with the truth.

    y(t) is the solver's dense output (a quartic per accepted step, evaluated through `integrate` at
    per_step + 1 points per step; None: an even number >= 8 per step giving intervals no longer than
    t1 / `auto_grid`, so the variance floor survives the drift margin); the reference that gives the actual error
    lands on every sampled time and is converged to `reference_rtol` (1e-11: far below a loose solve's error); y'(t) is the derivative of that quartic, fitted exactly from the samples
    (round-off margin added); delta(t) = y'(t) - F(y(t)). Since y(0) = x0,
    ||x(t) - y(t)|| <= int_0^t exp(L (t - s)) ||delta(s)|| ds with L valid on every segment [x(s), y(s)]
    (`segment_variance_floor`, rigorous between samples).

    The quadrature takes ||delta|| on each sample interval as the larger endpoint value (`_upper_sum`) and adds
    an explicit safety margin: `safety` times the change of that sum when every other sample is dropped. This
    is not interval-rigorous between samples: the rigorous alternative, ||delta|| <= endpoint values + M tau / 2
    with M = sup||y''|| + L sup||y'|| from the quartic, is reported (`rigorous_margin_max`) and is far larger
    than the defect itself, because it ignores the cancellation y'' ~ J_F y'.
    """
    check_tolerances([tol])
    check_methods([method])
    if method in FIXED_STEP:
        raise ValueError(f"method must be an adaptive Runge-Kutta method with dense output, got {method!r}")
    if per_step is not None and (per_step < 4 or per_step % 2):
        raise ValueError(f"per_step must be an even number >= 4 (a quartic needs 5 points per step), got {per_step}")
    block, x0, t1 = prepare(model, images, input_scale=input_scale, device=device, dtype=dtype)
    B = x0.shape[0]
    fk = dict(dtype=dtype, device=x0.device)
    with torch.no_grad():
        _, field = solve(block, x0, torch.tensor([0.0, t1], **fk), method, tol=tol)
        steps = [(a, min(a + h, t1)) for a, h in field.steps if a < t1]
        dt = t1 / auto_grid(block, x0, t1, hi=1024)
        counts = [per_step or min(256, max(8, 2 * math.ceil((b - a) / (2 * dt)))) for a, b in steps]
        pts = torch.cat([a + (b - a) * torch.linspace(0.0, 1.0, m + 1, **fk)[:-1] for (a, b), m in zip(steps, counts)]
                        + [torch.tensor([t1], **fk)])
        grid = torch.unique(pts)  # sorted; shared step ends appear once
        y, field2 = solve(block, x0, grid, method, tol=tol)
        if field2.steps[:len(field.steps)] != field.steps[:len(field2.steps)]:
            raise RuntimeError("the solver took different steps when asked for dense output; cannot certify")
        F_y = block.vector_field(y.flatten(0, 1)).reshape(y.shape)
        start = 2 ** math.ceil(math.log2(max(len(grid) - 1, 8)))  # steps land on the grid anyway
        ref = reference_solution(block, x0, t1, t=grid, rel_tol=reference_rtol, start_steps=start)
    speed = token_speed_bound(block, dtype=dtype, device=x0.device)
    n = len(grid) - 1
    dy = torch.empty_like(y)
    sup_d1, sup_d2 = torch.zeros(n, B, **fk), torch.zeros(n, B, **fk)
    drift_y = torch.zeros(n, **fk)
    slope_err = torch.zeros(len(grid), **fk)
    for a, b in steps:
        i0 = int(torch.searchsorted(grid, torch.tensor(a, **fk)))
        i1 = int(torch.searchsorted(grid, torch.tensor(b, **fk)))
        xs = (grid[i0:i1 + 1] - a) / (b - a)
        coef, serr = _quartic_fit(xs, y[i0:i1 + 1])
        h = b - a
        slope_err[i0:i1 + 1] = torch.maximum(slope_err[i0:i1 + 1], torch.tensor(serr / h, **fk))
        dy[i0:i1 + 1] = sum(k * coef[k] * xs.reshape(-1, *[1] * (y.dim() - 1)) ** (k - 1) for k in range(1, 5)) / h
        cn = [sample_norm(coef[k]) for k in range(5)]  # (B,)
        sup_d1[i0:i1] = sum(k * cn[k] for k in range(1, 5)) / h
        sup_d2[i0:i1] = sum(k * (k - 1) * cn[k] for k in range(2, 5)) / h ** 2
        tok = [coef[k].norm(dim=-1) for k in range(5)]  # per token: sup ||y_i'|| <= sum_k k ||c_k,i|| / h
        drift_y[i0:i1] = float(sum(k * tok[k] for k in range(1, 5)).max()) / h * (grid[i0 + 1:i1 + 1] - grid[i0:i1])
    tau = grid[1:] - grid[:-1]
    # ||delta|| plus the fit's round-off in y' (per entry, times sqrt(entries) for the sample norm)
    delta = sample_norm(dy - F_y) + slope_err[:, None] * math.sqrt(x0[0].numel())  # (G, B)
    margin = float(ref.abs_error.max())
    v_floor = segment_variance_floor(ref.states, y, speed * tau, drift_y, margin=margin)
    L_global, L, _ = vector_field_constants(block, x0, v_floor, dtype=dtype, device=x0.device)
    fine = _upper_sum(delta, grid, L)
    coarse = _upper_sum(delta[::2], grid[::2], L)  # per_step even: every step end survives
    change = (coarse - fine[::2]).abs().nan_to_num(nan=math.inf)  # inf - inf: vacuous, say so
    # at the even samples; odd ones take the larger neighbouring change
    bound = fine.clone()
    bound[::2] += safety * change
    bound[1::2] += safety * torch.maximum(change[:-1], change[1:])
    actual = sample_norm(y - ref.states)
    viol = int((bound[1:] < actual[1:]).sum())
    ratio = bound[1:] / actual[1:].clamp_min(1e-300)
    rigorous = float(((sup_d2 + L * sup_d1) * tau[:, None] / 2).max())
    return {"method": method, "tol": tol, "accepted": field.accepted, "rejected": field.rejected, "nfe": field.nfe,
            "t": grid.tolist(), "bound": bound.T.tolist(), "actual": actual.T.tolist(), "delta": delta.T.tolist(),
            "L": L, "L_global": L_global, "min_variance": v_floor, "speed_bound": speed, "safety": safety,
            "quadrature_change": float((change / fine[::2].clamp_min(1e-300))[1:].nan_to_num(nan=math.inf).max()),
            "global_factor_log10_t1": L_global * t1 / math.log(10), "derivative_roundoff_margin": float(slope_err.max()),
            "rigorous_margin_max": rigorous, "max_delta": float(delta.max()),
            "reference": ref.summary(), "violations": viol,
            "min_ratio": float(ratio.min()), "max_ratio": float(ratio.max()),
            "bound_t1": bound[-1].tolist(), "actual_t1": actual[-1].tolist()}
