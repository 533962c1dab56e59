"""The certify / probe verdicts on any model, trained or not, and the per-epoch training monitor.

- `ssog_layers`, `attention_layers`, `blocks`: the lipcheck SSoG layers, dense-attention layers and
  pre-norm blocks inside any nn.Module (found through `model.modules()`, shared layers once).
- `certify_ssog`: `lipcheck.bounds.ssog_lipschitz` for every SSoG layer on each grid (S1, S2).
- `visited_states`: the states each block's LayerNorms see on real inputs: the ODE trajectory
  (fixed times, a tight adaptive solve) or the inputs of every discrete/looped block application.
- `block_constants`: per block the vector field F(x) = Mixer(LN1 x) + MLP(LN2 x) and the residual block,
  globally and locally at the visited states (S3), through `lipcheck.bounds.vector_field_lipschitz`,
  beside a certified lower bound (the Jacobian norm evaluated at a visited state).
- `jacobian_lower_bound`: that lower bound for any module mapping (B, H, W, C) -> (B, H, W, C).
- `adaptive_nfe`: evaluations an adaptive solve of the ODE model needs at a fixed tolerance.
- `attention_curves`: `lipcheck.probe.attention_growth` of every attention layer and its pre-LN branch (S4).
- `Monitor`: the cheap per-epoch record `lipcheck train --monitor` keeps.

Local constants hold at the states visited, not on a region around them: LayerNorm's Jacobian norm on
tokens of variance >= v is <= max|gamma| / sqrt(v + eps), so the local number bounds ||J|| at every
visited state; the global one bounds it everywhere.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.func import jvp, vjp

from .bounds import ssog_lipschitz, vector_field_lipschitz
from .mixers.attention import DenseAttention
from .wellposed.enclosure import REF_WORK_BUDGET
from .mixers.ssog import SSoG

F64 = torch.float64
# ssog_lipschitz settings of the monitor: deterministic upper bound only (closed form, circulant
# embedding, Gram iteration, dense SVD), no branch and bound over the torus and no Lanczos run
MONITOR_SSOG = dict(resolution_free=False, probabilistic=False, deflated=False)  # cheap: every epoch
MONITOR_RADII = (1.0, 32.0, 1024.0)  # flat at small R, the R^2 growth at large R (trained digits widths)
MONITOR_PROBE = dict(restarts=4, steps=8, certify_steps=20, certify_top=1)
MONITOR_TOL = 1e-6


# ------------------------------------------------------------------------------------------- finding
def ssog_layers(model: nn.Module) -> list[tuple[str, SSoG]]:
    return [(n or "(model)", m) for n, m in model.named_modules() if isinstance(m, SSoG)]


def attention_layers(model: nn.Module) -> list[tuple[str, DenseAttention]]:
    return [(n or "(model)", m) for n, m in model.named_modules() if isinstance(m, DenseAttention)]


def is_block(m: nn.Module) -> bool:
    """A pre-norm block in lipcheck's layout: norm1, a lipcheck mixer, norm2, mlp (fc1, fc2) or None."""
    return (all(hasattr(m, a) for a in ("norm1", "mixer", "norm2", "mlp"))
            and isinstance(m.mixer, (SSoG, DenseAttention)))


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n or "(model)", m) for n, m in model.named_modules() if is_block(m)]


def model_grid(model: nn.Module, grid=None) -> tuple[int, int]:
    """The token grid a model works on: `grid` if given, else img_size / patch_size of a lipcheck ViT."""
    if grid is not None:
        H, W = grid
        return int(H), int(W)
    pe = getattr(model, "patch_embed", None)
    if pe is None or not hasattr(pe, "grid"):
        raise ValueError(f"cannot tell the token grid of a {type(model).__name__}; pass grid=(H, W)")
    return pe.grid, pe.grid


def _f64_copy(model: nn.Module) -> nn.Module:
    m = copy.deepcopy(model).to(F64).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


# ------------------------------------------------------------------------------------------ certify
def certify_ssog(model: nn.Module, grids, *, layers=None, progress: bool = False, **kw) -> list[dict]:
    """One row per SSoG layer and grid (H, W): lower, deterministic upper, probabilistic upper, gaps,
    exact (dense SVD where small), resolution-free, closed form; kw go to `ssog_lipschitz`."""
    layers = ssog_layers(model) if layers is None else layers
    if not layers:
        raise ValueError(f"the model ({type(model).__name__}) has no lipcheck SSoG layer to certify; certify "
                         f"takes a model with SSoG mixers (use probe for attention models)")
    rows = []
    jobs = [(name, layer, tuple(g)) for name, layer in layers for g in grids]
    if progress:
        from tqdm.auto import tqdm
        jobs = tqdm(jobs, desc="certify SSoG layers", leave=False)
    for name, layer, (H, W) in jobs:
        r = ssog_lipschitz(layer, H, W, **kw)
        rows.append(dict(layer=name, H=H, W=W, lower=r.lower, upper=r.upper,
                         upper_probabilistic=r.upper_probabilistic, failure_probability=r.failure_probability,
                         gap=r.gap, gap_probabilistic=r.gap_probabilistic, exact=r.exact,
                         resolution_free=r.resolution_free, closed_form=r.closed_form, seed=r.seed,
                         method=r.best_method, cut_short=r.cut_short, seconds=sum(r.seconds.values())))
    return rows


# ------------------------------------------------------------------------------------- states visited
def ode_trajectory(model: nn.Module, images: torch.Tensor, *, times: int = 9, tol: float = 1e-7) -> torch.Tensor:
    """x(t) of the ODE ViT from embed(images) at `times` equally spaced t in [0, t1], (times, B, H, W, C),
    float64, dopri5 at rtol = atol = tol."""
    from .models.ode import VectorField, integrate
    m = _f64_copy(model)
    with torch.no_grad():
        x0 = m.embed(images.to(F64))
        t = torch.linspace(0.0, float(m.t1), times, dtype=F64)
        return integrate(VectorField(m.vector_field.block), x0, t, method="dopri5", rtol=tol, atol=tol)


def visited_states(model: nn.Module, images: torch.Tensor, *, times: int = 9) -> dict:
    """{block name: {"norm1": states (S, H, W, C), "norm2": states}}: what each block's LayerNorms see on
    `images` (float64). ODE: the trajectory at `times` points (both norms see x(t)); otherwise the inputs of
    every block application in a forward pass (a looped block's `depth` applications pooled)."""
    if getattr(model, "variant", None) == "ode":
        xs = ode_trajectory(model, images, times=times)
        flat = xs.reshape(-1, *xs.shape[2:])
        return {"vector_field.block": {"norm1": flat, "norm2": flat}}
    m = _f64_copy(model)
    named = blocks(m)
    if not named:
        raise ValueError(f"no pre-norm block (norm1, mixer, norm2, mlp) with a lipcheck mixer in "
                         f"{type(model).__name__}; pass states to jacobian_lower_bound instead")
    seen = {n: {"norm1": [], "norm2": []} for n, _ in named}
    hooks = []
    for n, b in named:
        for which in ("norm1", "norm2"):
            hooks.append(getattr(b, which).register_forward_pre_hook(
                lambda mod, args, n=n, which=which: seen[n][which].append(args[0].detach())))
    try:
        with torch.no_grad():
            m(images.to(F64))
    finally:
        for h in hooks:
            h.remove()
    return {n: {k: torch.cat(v) for k, v in d.items() if v} for n, d in seen.items()}


# ----------------------------------------------------------------------------------------- constants
def jacobian_lower_bound(module: nn.Module, states: torch.Tensor, *, iters: int = 20, seed: int = 0) -> dict:
    """Certified lower bounds on sup ||J_f||: ||J_f(x) v|| / ||v|| evaluated in float64 at each state x
    (B, H, W, C) for v from per-sample power iteration on J^T J. Any module mapping (B, H, W, C) -> (B, H, W, C)
    whose samples do not interact (true of every token mixer acting within one grid)."""
    f = _f64_copy(module)
    for sub in f.modules():  # SDPA has no forward-mode derivative on CPU; the explicit softmax is the same map
        if isinstance(sub, DenseAttention):
            sub.backend = "math"
    x = states.detach().to(F64)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("states contain NaN or inf; pass finite states")
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(x.shape, generator=gen, dtype=F64)
    norm = lambda t: t.flatten(1).norm(dim=1).reshape(-1, *[1] * (t.dim() - 1))
    v = v / norm(v)
    best = torch.zeros(x.shape[0], dtype=F64)
    for _ in range(iters):
        _, Jv = jvp(f, (x,), (v,))
        best = torch.maximum(best, norm(Jv).flatten())  # ||v|| = 1: an actual ||J v||
        _, pull = vjp(f, x)
        w = pull(Jv)[0]
        v = w / norm(w).clamp_min(1e-300)
    return {"lower": float(best.max()), "per_state": best.tolist(), "iters": iters}


def _block_row(name: str, block: nn.Module, s1: torch.Tensor, s2: torch.Tensor, *, ode: bool,
               lower_iters: int) -> dict:
    r1 = vector_field_lipschitz(block, s1)
    v2 = float(s2.var(dim=-1, unbiased=False).min())
    # second call only for LN2 at its own inputs' variance (min with LN1's: never a smaller constant)
    r2 = vector_field_lipschitz(block, s1, min_variance=v2, mixer_bound=(r1.mixer, r1.terms["mixer_terms"]))
    ln2_local = r2.ln2_local
    a_g, b_g = r1.mixer * r1.ln1_global, r1.mlp * r1.ln2_global
    a_l, b_l = r1.mixer * r1.ln1_local, r1.mlp * ln2_local
    row = dict(block=name, mixer_kind=r1.terms["mixer_terms"].get("kind"), mixer=r1.mixer, mlp=r1.mlp,
               ln1_global=r1.ln1_global, ln2_global=r1.ln2_global, ln1_local=r1.ln1_local, ln2_local=ln2_local,
               min_variance_ln1=r1.terms["min_variance"], min_variance_ln2=min(v2, r1.terms["min_variance"]),
               field_global=a_g + b_g, field_local=a_l + b_l, vacuous=r1.vacuous, states=int(s1.shape[0]))
    if not ode:  # x -> y = x + Mixer(LN1 x) -> y + MLP(LN2 y): the product of the two residual factors
        row.update(block_global=(1 + a_g) * (1 + b_g), block_local=(1 + a_l) * (1 + b_l))
    if lower_iters:
        from .probe import BlockMap
        row["field_lower"] = jacobian_lower_bound(BlockMap(block, "vector_field"), s1, iters=lower_iters)["lower"]
    return row


def block_constants(model: nn.Module, images: torch.Tensor, *, times: int = 9, lower_iters: int = 10) -> list[dict]:
    """Per pre-norm block: Lip(Mixer), Lip(MLP), LayerNorm constants (global; local at the visited states),
    the vector field F's constant (global, local) and for discrete/looped blocks the residual block's;
    `field_lower` is a certified lower bound (||J_F v|| at a visited state), so field_lower <= field_local."""
    ode = getattr(model, "variant", None) == "ode"
    states = visited_states(model, images, times=times)
    m = _f64_copy(model)
    named = dict(blocks(m))
    if ode:
        named = {"vector_field.block": m.vector_field.block}
    return [_block_row(n, named[n], st["norm1"], st.get("norm2", st["norm1"]), ode=ode, lower_iters=lower_iters)
            for n, st in states.items()]


def adaptive_nfe(model: nn.Module, images: torch.Tensor, *, method: str = "dopri5", tol: float = MONITOR_TOL) -> dict:
    """NFE, accepted and rejected steps of one adaptive solve of the ODE ViT from embed(images) to t1."""
    from . import wellposed
    block, x0, t1 = wellposed.prepare(model, images, dtype=F64)
    with torch.no_grad():
        _, field = wellposed.solve(block, x0, torch.tensor([0.0, t1], dtype=F64), method, tol=tol)
    return {"method": method, "tol": tol, "nfe": field.nfe, "accepted": field.accepted, "rejected": field.rejected}


def attention_curves(model: nn.Module, radii, grid=None, *, branches=("mixer", "block"), seed: int = 0,
                     **probe_kw) -> list[dict]:
    """`attention_growth` of every dense-attention layer (branch "mixer": the layer alone) and of its pre-LN
    residual branch x -> Attn(LN1 x) (branch "block"), at the model's token grid."""
    from .probe import BlockMap, attention_growth
    H, W = model_grid(model, grid)
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"the model ({type(model).__name__}) has no dense-attention layer to probe; probe takes "
                         f"a model with attention mixers (use certify for SSoG models)")
    owner = {id(b.mixer): (n, b) for n, b in blocks(model)}
    out = []
    for name, layer in layers:
        maps = [("mixer", name, layer)]
        if "block" in branches and id(layer) in owner:
            bn, b = owner[id(layer)]
            maps.append(("block", bn, BlockMap(b, "mixer")))
        for branch, n, f in maps:
            if branch not in branches:
                continue
            g = attention_growth(f, list(radii), (H, W), device="cpu", seed=seed, **probe_kw)
            out.append(dict(layer=n, branch=branch, map=g.map, radii=list(g.radii), lower=list(g.lower),
                            exponent=g.exponent, grid=[H, W]))
    return out


# ------------------------------------------------------------------------------------------- monitor
class Monitor:
    """Per-epoch record for `lipcheck train --monitor`: certified upper bound of every SSoG layer at the
    model's grid (`MONITOR_SSOG` settings), the vector-field constants at the states visited by `n_images`
    test images, the NFE of an adaptive dopri5 solve at `tol` (ODE models), and attention's L(R) at `radii`
    (attention models; the layer alone, each layer)."""

    def __init__(self, *, n_images: int = 8, tol: float = MONITOR_TOL, radii=MONITOR_RADII, probe: dict | None = None,
                 times: int = 5):
        self.n_images, self.tol, self.radii, self.times = n_images, tol, tuple(radii), times
        self.probe = dict(MONITOR_PROBE if probe is None else probe)

    def images(self, data) -> torch.Tensor:
        x, _ = data.batch(torch.arange(min(self.n_images, len(data))), dtype=F64)
        return x

    def __call__(self, model: nn.Module, data) -> dict:
        from .train import prepare
        H, W = model_grid(model)
        x = prepare(self.images(data), data, model.img_size)
        rec = {}
        ssog = ssog_layers(model)
        if ssog:
            rec["ssog_layers"] = [n for n, _ in ssog]
            rec["ssog_upper"] = [ssog_lipschitz(layer, H, W, **MONITOR_SSOG).upper for _, layer in ssog]
        consts = block_constants(model, x, times=self.times, lower_iters=0)
        rec["field_local"] = [c["field_local"] for c in consts]
        rec["field_global"] = [c["field_global"] for c in consts]
        if getattr(model, "variant", None) == "ode":
            rec["nfe"] = adaptive_nfe(model, x, tol=self.tol)["nfe"]
        if attention_layers(model):
            curves = attention_curves(model, self.radii, branches=("mixer",), **self.probe)
            rec["attention_radii"] = list(self.radii)
            rec["attention_L"] = [c["lower"] for c in curves]
        return rec


ENCLOSE_TOL = 1e-6  # the solve every image's enclosure is built around (its reference solve: tol * 1e-3)


def enclose_images(model, images, *, tol: float = ENCLOSE_TOL, max_seconds: float | None = None,
                   max_work: float | None = REF_WORK_BUDGET, progress: bool = False, keep_center: bool = False,
                   batch: int = 1, batches: list[list[int]] | None = None) -> list[dict]:
    """S5 as a proof on each image: `wellposed.enclose` on `batch` images at a time, and each image's actual error
    at t1 against an independent converged solve (fixed-step dopri8, `wellposed.reference_solution`).

    One enclose call per batch: one solve of the whole batch, its defects and point log-norms evaluated batched.
    The batch shares the solver's steps, the sub-interval refinement and the variance floor of the field's
    constants, so an image's radius depends on its batch mates (every one is still a proof) and on nothing else:
    each batch starts from fresh eigenvector guesses. `batches`: the index lists into images to prove (default:
    consecutive runs of `batch`; `lipcheck.shard` deals them out to processes); rows come in that order.
    max_seconds, max_work: each enclose call's budgets (`wellposed.enclose_field`): a batch whose predicted work is
    over max_work is refused before any proof, with the prediction and the constants as its reason.

    Per image: proven, the proven interval [0, t_proven], radius at t1, radius / actual error, seconds (its share
    of its batch's), the field's constants (`field`: the mixer's Lipschitz and curvature constants, the field's
    at the batch's token-variance floor, the largest log-norm over the tube), and where not proven the reason.
    SSoG and dense-attention fields are enclosed (`wellposed.make_field`); a model whose mixer
    has no field (or attention without LayerNorm) is refused per image with that reason, not proven.
    keep_center: each row also holds the enclosure's centre at t1 ("center_t1", a tensor) for checks against
    another solve."""
    import time

    from . import shard, wellposed
    block, x0, t1 = wellposed.prepare(model, images)
    if batches is None:
        batches = shard.batches(x0.shape[0], batch)
    t = time.perf_counter()
    try:  # the field's constants (||T|| or attention's, curvature, LayerNorm's) once for every image
        field = wellposed.make_field(block, x0.shape[1], x0.shape[2])
    except (TypeError, ValueError) as err:  # no field for this mixer (or no LayerNorm before attention)
        return [{"image": i, "proven": False, "refused": True, "reason": str(err), "t_proven": 0.0,
                 "radius_t1": math.inf, "actual_t1": None, "ratio_t1": None, "seconds": time.perf_counter() - t}
                for idx in batches for i in idx]
    constants_s = time.perf_counter() - t
    rows = []
    for idx in batches:
        rows += _enclose_batch(field, block, x0[idx], t1, idx, tol=tol, max_seconds=max_seconds, max_work=max_work,
                               progress=progress, keep_center=keep_center, constants_s=constants_s)
    return rows


def _enclose_batch(field, block, x0, t1, idx, *, tol, max_seconds, max_work, progress, keep_center,
                   constants_s) -> list[dict]:
    """The rows of one batch of images (global indices idx): one enclose call, one reference solve (none for a
    batch refused before any proof: its actual error, ratio and `inside` are None)."""
    import time

    from . import wellposed
    t = time.perf_counter()
    field.reset()  # eigenvector guesses start afresh: a batch's numbers do not depend on the batch before it
    enc = wellposed.enclose_field(field, x0, t1, tol=tol, max_seconds=max_seconds, max_work=max_work,
                                  progress=progress)
    seconds = (time.perf_counter() - t) / len(idx)
    if enc.stats.get("refused"):  # nothing proven to compare: the independent solve (slow on a stiff field) skipped
        actual = ref_error = [None] * len(idx)
    else:
        ref = wellposed.reference_solution(block, x0, t1, rel_tol=1e-13, start_steps=64)
        actual = wellposed.sample_norm(ref.states[-1] - enc.center[-1]).tolist()
        ref_error = ref.abs_error.amax(0).tolist()
    consts = field.constants(enc.stats["variance_floor"])  # at the floor the tubes of this batch kept
    rows = []
    for b, i in enumerate(idx):
        finite = torch.isfinite(enc.radius[:, b])
        last = int(finite.nonzero().max()) if bool(finite.any()) else -1
        row = {"image": i, "proven": bool(enc.proven[b]), "refused": False, "reason": enc.reason[b],
               "t_proven": float(enc.t[last]) if last >= 0 else 0.0, "radius_t1": float(enc.point_radius_t1()[b]),
               "radius_proven": float(enc.radius[last, b]) if last >= 0 else math.inf, "seconds": seconds,
               "batch": len(idx), "constants_s": constants_s, "actual_t1": actual[b],
               "reference_error": ref_error[b],
               "field": {**consts, "variance_floor": enc.stats["variance_floor"],
                         "mu_max": _finite_max(enc.mu[:, b])}}
        if actual[b] is None:
            row.update(ratio_t1=None, inside=None)
        else:
            row.update(ratio_t1=row["radius_t1"] / actual[b] if actual[b] > 0 else math.inf,
                       inside=bool(actual[b] <= row["radius_t1"]))
        if keep_center:
            row["center_t1"] = enc.center[-1, b]
        rows.append(row)
    return rows


def _finite_max(x: torch.Tensor) -> float:
    """The largest finite entry (the log-norm over the intervals proven before a budget or a failure), nan if none."""
    x = x[torch.isfinite(x)]
    return float(x.max()) if x.numel() else math.nan
