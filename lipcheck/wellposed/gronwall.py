"""Perturbation growth against the Gronwall envelope exp(L t), L the global and the local (variance-floor) constant.

The local constant. LayerNorm's Jacobian on a token of variance v has norm <= max|gamma| / sqrt(v + eps),
so `lipcheck.bounds.vector_field_lipschitz(block, min_variance=v).local_bound` bounds ||J_F(z)|| at every
state z whose tokens all have variance >= v. For ||F(x) - F(y)|| <= L ||x - y|| we need that bound on the
segment [x, y] (mean value theorem), at every t, not only at sampled t. `segment_variance_floor` gives a
lower bound on the token variance over all those points: per token, std is a seminorm / sqrt(C), so
std(y + s (x - y)) >= (std x + std y - std(x - y)) / 2 for s in [0, 1]; between sampled times each token
moves at most (speed bound) * dt, with the speed bound from the weights (`token_speed_bound`).
The log-norm envelope exp(int mu) (sharper) is `lipcheck.wellposed.lognorm_envelope` (`envelope`).
"""
from __future__ import annotations

import math

import torch

from ..mixers.attention import DenseAttention
from ..mixers.ssog import SSoG
from ..models.ode import VectorField, integrate
from .solve import prepare, reference_solution, sample_norm, token_std

# ------------------------------------------------------------------------------------ certified constants

def vector_field_constants(block, states: torch.Tensor, min_variance: float | None = None, *,
                           dtype=torch.float64, device=None):
    """(global L, local L on states whose tokens have variance >= min_variance, the full result), from
    `lipcheck.bounds.vector_field_lipschitz`; `states` (B, H, W, C) fixes the grid (attention's constant
    depends on the number of tokens)."""
    from ..bounds import vector_field_lipschitz
    res = vector_field_lipschitz(block, states, min_variance=min_variance, dtype=dtype, device=device)
    # with states given the bound uses min(min_variance, the states' own minimum): never a larger constant
    local = res.local_bound if res.local_bound is not None else res.global_bound
    return float(res.global_bound), float(local), res


def token_speed_bound(block, *, device=None) -> float:
    """B with ||F(x)_i|| <= B for every state x and token i (inf without LayerNorm), rounding included.

    Every LN output token lies in a ball of radius rho = max|gamma| sqrt(C) + ||beta||. SSoG: token i of
    sum_h K_h U P_h has norm <= sum_h (sum_j |K_h[i, j]|) ||P_h|| rho, and each normalised Gaussian row sums
    to <= 1, so sum_j |K_h[i, j]| <= sum_m |alpha[h, m]|. Attention: each head outputs a convex combination
    of its value tokens. MLP: |GELU(z)| <= |z|.

    Evaluated in float64 from the weights as stored (an exact conversion) and rounded up, so B is a true bound:
    spectral norms verified by Cholesky (rounding.norm2_upper), ||P_h|| <= ||fl(W_V^h W_O^h)||_2 +
    gamma_{d+2} ||W_V^h||_F ||W_O^h||_F, vector norms and sums of k terms times 1 + gamma_{k+1}, and the assembly
    (nonnegative terms, at most 2 h + 12 operations along any path) times 1 + gamma_{2h+12}.
    """
    if not isinstance(block.norm1, torch.nn.LayerNorm):
        return math.inf
    from ..bounds.attention import _frobenius_upper, layernorm_image_radius
    from ..rounding import gamma, norm2_upper, unit_roundoff
    u = unit_roundoff(torch.float64)
    f64 = lambda w: w.detach().to(dtype=torch.float64, device=device)  # noqa: E731
    op = lambda w: float(norm2_upper(f64(w)))  # noqa: E731
    fro = lambda w: _frobenius_upper(f64(w), u)  # noqa: E731
    vec = lambda b: fro(b) if b is not None else 0.0  # noqa: E731
    rho1 = layernorm_image_radius(block.norm1)
    mixer = block.mixer
    if isinstance(mixer, SSoG):
        alpha = f64(mixer.gaussian_params()[0])
        d = mixer.head_dim
        WV, WO = f64(mixer.v_proj.weight).T, f64(mixer.o_proj.weight).T  # X @ WV, then @ WO (head_projections)
        heads = mixer.num_heads
        speed = 0.0
        for h in range(heads):
            Vh, Oh = WV[:, h * d:(h + 1) * d], WO[h * d:(h + 1) * d, :]
            P = op(Vh @ Oh) + gamma(d + 2, u) * fro(Vh) * fro(Oh)
            speed += float(alpha[h].abs().sum()) * (1 + gamma(alpha.shape[1] + 1, u)) * P
        speed = speed * rho1 + vec(mixer.o_proj.bias)
    elif isinstance(mixer, DenseAttention):
        d, heads = mixer.head_dim, mixer.num_heads
        WV, bV = mixer.v_proj.weight, mixer.v_proj.bias
        per = [op(WV[h * d:(h + 1) * d]) * rho1 + (vec(bV[h * d:(h + 1) * d]) if bV is not None else 0.0)
               for h in range(heads)]
        speed = op(mixer.o_proj.weight) * math.sqrt(sum(v * v for v in per)) + vec(mixer.o_proj.bias)
    else:
        raise TypeError(f"unknown mixer {type(mixer).__name__}; expected SSoG or DenseAttention")
    if block.mlp is not None:
        rho2 = layernorm_image_radius(block.norm2)
        fc1, fc2 = block.mlp.fc1, block.mlp.fc2
        speed += op(fc2.weight) * (op(fc1.weight) * rho2 + vec(fc1.bias)) + vec(fc2.bias)
    speed *= 1 + gamma(2 * heads + 12, u)
    if not math.isfinite(speed):
        raise ValueError(f"the token speed bound came out {speed}: the block's weights are not finite or too large "
                         f"for float64; check them")
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

def envelope_violations(t: torch.Tensor, growth: torch.Tensor, L: float) -> int:
    """Number of (time, sample) pairs with growth(t) > exp(L t), compared in log space (exp(L t) may overflow);
    t = 0 is excluded (growth 1 = envelope up to round-off). growth: (len(t), B)."""
    if not math.isfinite(L):
        raise ValueError(f"L must be a finite constant, got {L!r}")
    t = torch.as_tensor(t, dtype=torch.float64)
    log_g = torch.as_tensor(growth, dtype=torch.float64).log()
    return int((log_g[1:] > L * t[1:, None]).sum())


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
    speed = token_speed_bound(block, device=x0.device)
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
    drift = token_speed_bound(block, device=x0.device) * (t1 / grid)
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
        viol = {kind: envelope_violations(t, growth, L) for kind, L in
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


