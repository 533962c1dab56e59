"""The adversarial search: batched projected ascent of ||J(X)||_2 over the balls ||X||_F <= R.

All radii and all restarts move together as one batch (S = radii x restarts): each step takes one
power-iteration step for the top right singular vector v of J(X) and one projected ascent step on X along
grad_X ||J(X) v||, onto each sample's own ball ||X||_F <= R. Steps that do not improve are undone with a
halved step, so a restart never ends below its start. Starts per radius: structured witnesses, constant
tokens for maps with a LayerNorm, then random inputs on the sphere drawn from a generator seeded by
(seed, R), so a radius draws the same starts alone or among others. Then `refine_rounds` rounds, again one
batch over all radii, continue each radius's best `refine_top` restarts and start one more from the next
smaller radius's best input (it lies inside the larger ball): a warm-started sweep over the radii,
pipelined one radius per round. Every sample keeps its own step size and the batch only stacks independent
computations, so `batch_radii=False` (one radius at a time) gives the same numbers.
"""
from __future__ import annotations

import hashlib
import math
import time

import torch
from torch import nn
from torch.func import grad_and_value

from .balls import ball, col, sphere, unit
from .maps import as_map, check_grid, default_device, infer_channels
from .tangents import half_sq, jtj_of, tangent_map
from .witness import assemble_witness


def ascend(tangent, X: torch.Tensor, R, *, steps: int, lr: float = 0.05, power_warmup: int = 10,
           generator: torch.Generator | None = None, v0: torch.Tensor | None = None, progress: bool = False):
    """Batched projected ascent of ||J(X)||_2 over ||X||_F <= R from the starts X (S, N, C).

    tangent: (X, V) -> (f(X), J V) on batches. R: one radius, or one per sample (S,). One call per step
    returns, for every sample, 0.5 ||J(X) v||^2 and its gradients in X and v (reverse mode through the
    tangent map): the v-gradient J^T J v is the power-iteration step for the top right singular vector, the
    X-gradient (envelope theorem) the ascent direction. A step that does not raise ||J v|| is undone and
    the step halved, one that does grows it 1.5x; every sample keeps its own step, so its path does not
    depend on the others in the batch. Returns (best (S,), bestX (S, N, C), bestv (S, N, C)) with
    best[s] = ||J(bestX[s]) v|| for an actual v."""
    S = X.shape[0]
    Rc = col(R, X)
    value_grad = grad_and_value(half_sq(tangent), argnums=(0, 1), has_aux=True)
    jtj = jtj_of(tangent)
    v = unit(v0.to(X) if v0 is not None else torch.randn(X.shape, generator=generator, dtype=torch.float64).to(X))
    for _ in range(power_warmup):
        v = unit(jtj(X, v)[0])
    best = torch.full((S,), -math.inf, dtype=X.dtype, device=X.device)
    bestX, bestv, bestg = X.clone(), v.clone(), torch.zeros_like(X)
    step = lr * Rc.clone()
    it = range(steps + 1)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=f"search ({S} starts)", unit="step", leave=False)
    for _ in it:
        (gX, gv), (_, val) = value_grad(X, v)
        sigma = (2 * val).clamp_min(0).sqrt()
        ok = (sigma > best) & torch.isfinite(sigma) & torch.isfinite(gX.flatten(1).sum(1))  # a finite sum: all finite
        okb = ok.reshape(S, 1, 1)
        best = torch.where(ok, sigma, best)
        bestX = torch.where(okb, X, bestX)
        bestv = torch.where(okb, unit(gv), bestv)
        bestg = torch.where(okb, unit(gX), bestg)
        step = torch.where(okb, step * 1.5, step * 0.5)
        X = ball(bestX + step * bestg, Rc)
        v = bestv
    return best, bestX, bestv


def benchmark_batched_vs_loop(layer: nn.Module, radius: float, grid: tuple[int, int] = (4, 4), *,
                              restarts: int = 64, steps: int = 10, power_warmup: int = 10, device=None,
                              dtype=torch.float64, seed: int = 0) -> dict:
    """Wall time of `ascend` on `restarts` random starts as one batch vs a Python loop over them (same
    starts and power-iteration vectors, same steps). Returns seconds for both, the ratio, and the best value
    of each run (the same computation, so they agree up to rounding)."""
    H, W = check_grid(grid)
    device = torch.device(device) if device is not None else default_device()
    module = as_map(layer)
    C = infer_channels(module)
    tan = tangent_map(layer, (H, W), device=device, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    X0 = sphere(torch.randn(restarts, H * W, C, generator=g, dtype=torch.float64), radius).to(device, dtype)
    V0 = torch.randn(restarts, H * W, C, generator=g, dtype=torch.float64).to(device, dtype)
    ascend(tan, X0[:2], radius, steps=1, power_warmup=1)  # warm-up: first-call overheads out of the timing
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync(); t0 = time.perf_counter()
    b_batch = ascend(tan, X0, radius, steps=steps, power_warmup=power_warmup, v0=V0)[0]
    sync(); t_batch = time.perf_counter() - t0
    t0 = time.perf_counter()
    b_loop = torch.cat([ascend(tan, X0[s:s + 1], radius, steps=steps, power_warmup=power_warmup, v0=V0[s:s + 1])[0]
                        for s in range(restarts)])
    sync(); t_loop = time.perf_counter() - t0
    return {"restarts": restarts, "steps": steps, "power_warmup": power_warmup, "radius": radius,
            "batched_s": t_batch, "loop_s": t_loop, "speedup": t_loop / t_batch,
            "best_batched": float(b_batch.max()), "best_loop": float(b_loop.max()),
            "dtype": str(dtype).replace("torch.", ""), "device": str(device)}


def radius_generator(seed: int, R: float) -> torch.Generator:
    """A CPU generator seeded by (seed, R) alone: a radius draws the same starts in any batch."""
    h = hashlib.sha256(f"{int(seed)}:{float(R).hex()}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(h[:8], "little") & (2 ** 63 - 1))


def radius_starts(R: float, H: int, W: int, C: int, restarts: int, dirs: list, is_ln_map: bool, seed: int,
                  device, dtype):
    """Starting inputs (restarts, N, C), power-iteration vectors and their kinds for one radius."""
    N = H * W
    starts, kinds = [], []
    for parts in dirs[:restarts]:  # radius-free witness parts, focused first
        starts.append(assemble_witness(parts, R, (H, W)).reshape(N, C))
        kinds.append("witness")
    if is_ln_map and len(starts) < restarts:  # constant tokens: zero variance, where LayerNorm's Jacobian is largest
        starts.append(torch.full((N, C), R / math.sqrt(N * C), dtype=torch.float64, device=device))
        kinds.append("constant")
    gen = radius_generator(seed, R)
    n_rand = restarts - len(starts)
    X = torch.stack(starts).to(dtype) if starts else torch.empty(0, N, C, dtype=dtype, device=device)
    if n_rand:
        Z = torch.randn(n_rand, N, C, generator=gen, dtype=torch.float64).to(device)
        X = torch.cat([X, sphere(Z, R).to(dtype)])
        kinds += ["random"] * n_rand
    V0 = torch.randn(restarts, N, C, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    return X, V0, kinds


def _ascend_grouped(tangent, X, V, Rs, steps: int, options, progress: bool):
    """`ascend` over samples grouped by radius, (radii, P, ...) in and out: one batch, or one radius at a time
    when not options.batch_radii (the same numbers: every sample keeps its own step)."""
    nR, P = X.shape[:2]
    kw = dict(steps=steps, lr=options.lr, power_warmup=options.power_warmup)
    if options.batch_radii:
        out = ascend(tangent, X.flatten(0, 1), Rs.repeat_interleave(P), v0=V.flatten(0, 1), progress=progress, **kw)
        return tuple(t.reshape(nR, P, *t.shape[1:]) for t in out)
    outs = [ascend(tangent, X[r], Rs[r:r + 1], v0=V[r], **kw) for r in range(nR)]
    return tuple(torch.stack([o[i] for o in outs]) for i in range(3))


def _refine(tangent, best, bestX, bestv, Rs, options, progress: bool):
    """One refinement round, again one batch over radii: each radius continues its best restarts and also
    starts from the smaller radius's best input (inside its ball), so good inputs travel up the radii as in a
    sequential warm-started sweep, pipelined one radius per round. Returns (best, bestX, bestv), one more
    sample per radius (the carried input)."""
    nR = best.shape[0]
    k = min(options.refine_top, best.shape[1])
    top = torch.argsort(best, dim=1, descending=True)[:, :k]  # (nR, k)
    ar = torch.arange(nR, device=top.device)[:, None]
    pidx = (torch.arange(nR, device=top.device) - 1).clamp_min(0)  # radius 0: its own best once more
    prevX = bestX[pidx, top[pidx, 0]][:, None]
    prevv = bestv[pidx, top[pidx, 0]][:, None]
    Xr = torch.cat([bestX[ar, top], prevX], 1)
    Vr = torch.cat([bestv[ar, top], prevv], 1)
    refine_steps = options.steps if options.refine_steps is None else options.refine_steps
    b2, X2, v2 = _ascend_grouped(tangent, Xr, Vr, Rs, refine_steps, options, progress)
    # refined samples replace their origins (an ascent never ends below its start); the carried input joins
    best, bestX, bestv = best.clone(), bestX.clone(), bestv.clone()
    best[ar, top], bestX[ar, top], bestv[ar, top] = b2[:, :k], X2[:, :k], v2[:, :k]
    best = torch.cat([best, b2[:, k:]], 1)
    return best, torch.cat([bestX, X2[:, k:]], 1), torch.cat([bestv, v2[:, k:]], 1)


def search_radii(tangent, radii: list, grid: tuple[int, int], C: int, dirs: list, is_ln_map: bool, options, *,
                 device, progress: bool = False):
    """The whole search: one batched ascent over every (radius, restart), then options.refine_rounds rounds.
    Returns (best (radii, P), bestX, bestv (radii, P, N, C), kinds: per radius the start kind of each sample)."""
    H, W = grid
    per = [radius_starts(R, H, W, C, options.restarts, dirs, is_ln_map, options.seed, device, options.dtype)
           for R in radii]
    kinds = [p[2] for p in per]
    Rs = torch.tensor(radii, dtype=torch.float64).to(device=device, dtype=options.dtype)
    best, bestX, bestv = _ascend_grouped(tangent, torch.stack([p[0] for p in per]), torch.stack([p[1] for p in per]),
                                         Rs, options.steps, options, progress)
    for _ in range(options.refine_rounds):
        best, bestX, bestv = _refine(tangent, best, bestX, bestv, Rs, options, progress)
        kinds = [kd + ["previous"] for kd in kinds]
    return best, bestX, bestv, kinds
