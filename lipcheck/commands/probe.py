"""Attention growth (SPEC S4): certified lower bounds on L(R) for dense attention, the pre-LN block and
the dense Neural-ODE vector field, against certified upper bounds and SSoG's exact, flat constant.

    python experiments/probe.py [--quick] [--device cpu|cuda] [--seed 0] [--json PATH] [--docs DIR]
    python experiments/probe.py --grid 14x14 --width 384 [--device cuda] [--json PATH]

The first form (4x4 grid, width 192) writes docs/attention_growth.md, docs/figures/attention_growth*.png
and docs/data/attention_growth.json. Another grid or width is a size run: dense attention alone (default
initialisation, `width / 64` heads) on that token grid, written to docs/data/attention_growth_<H>x<W>_c<C>.json
(or only to --json PATH when given); the report tabulates every such file it finds.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path


import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from lipcheck import report  # noqa: E402
from lipcheck.bounds.attention import (attention_block_lipschitz, attention_lipschitz_on_frobenius_ball,  # noqa: E402
                                      head_matrices)
from lipcheck.mixers.attention import DenseAttention  # noqa: E402
from lipcheck.models.vit import vit_from_preset  # noqa: E402
from lipcheck.probe import (BlockMap, attention_growth, benchmark_batched_vs_loop,  # noqa: E402
                            default_device, witness_directions)

from .common import (add_checkpoint_arguments, add_output_arguments, grid, not_with_checkpoint, parse,  # noqa: E402
                     positive_int, set_threads)

SETTINGS = {  # search effort per map: quick fits the CPU budget, full is what the report is meant to show
    "quick": dict(attention=dict(restarts=8, steps=15, refine_rounds=1, certify_top=1),
                  ln=dict(restarts=4, steps=8, refine_rounds=1, certify_top=1),
                  ln_radii=[2.0 ** k for k in range(0, 13, 2)], bench_steps=3, vit_init_attention=False,
                  size=dict(restarts=4, steps=10, refine_rounds=1, refine_top=1, certify_top=1)),
    "full": dict(attention=dict(restarts=32, steps=60, certify_top=3),
                 ln=dict(restarts=16, steps=40, certify_top=2),
                 ln_radii=[2.0 ** k for k in range(13)], bench_steps=10, vit_init_attention=True,
                 # a ViT's own grid: the witnesses carry the large radii, so fewer restarts and a float32
                 # search (certification stays float64) keep 14x14 x 384 within minutes on 2 CPU cores
                 size=dict(restarts=6, steps=30, refine_rounds=1, refine_top=2, certify_top=1)),
}
SIZE_DTYPE = torch.float32  # search dtype of size runs
CERTIFY_TOL = 1e-6  # relative Lanczos residual at which certification stops


def ssog_exact(layer, H: int, W: int) -> tuple[float, str]:
    """SSoG's exact Lipschitz constant ||sum_h K_h (x) P_h^T||_2 on the H x W grid (float64)."""
    try:
        from lipcheck import bounds
        fn = getattr(bounds, "ssog_lipschitz", None)
        if fn is not None:
            res = fn(layer, H, W, resolution_free=False)  # only .exact is used here
            if getattr(res, "exact", None) is not None:
                return float(res.exact), "lipcheck.bounds.ssog_lipschitz(layer, H, W).exact"
    except ImportError:
        pass
    with torch.no_grad():
        K = layer.operator_matrix(H, W).double().contiguous()
        P = layer.head_projections().double().contiguous()
        M = sum(torch.kron(K[h], P[h].T.contiguous()) for h in range(K.shape[0]))
        # largest eigenvalue of M^T M: same number as the top singular value, a few times faster than SVD
        return float(torch.linalg.eigvalsh(M.T @ M)[-1].clamp_min(0).sqrt()), \
            "dense eigvalsh of M^T M, M = sum_h kron(K_h, P_h^T) (layer.operator_matrix, layer.head_projections)"


def add_arguments(ap) -> None:
    add_checkpoint_arguments(ap, "probe that model's attention layers and their pre-LN branches")
    ap.add_argument("--quick", action="store_true", help="fewer restarts and steps (CPU, under 3 minutes)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available, else cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", type=grid, default=None, metavar="HxW",
                    help="token grid, e.g. 14x14 (a 224x224 image in 16x16 patches); default 4x4 (the report), "
                         "with --checkpoint the model's own grid")
    ap.add_argument("--width", type=positive_int, default=192, help="channels C of the attention layer (heads: C / 64)")
    ap.add_argument("--heads", type=positive_int, default=None, help="attention heads (default C / 64, as the presets)")
    ap.add_argument("--restarts", type=positive_int, default=None, help="override the restarts per radius")
    ap.add_argument("--steps", type=positive_int, default=None, help="override the ascent steps")
    ap.add_argument("--max-log2-radius", type=int, default=12, help="radii 1, 2, 4, ..., 2^this")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="CPU threads for torch and BLAS (default 1 on cpu: the kernels are small, more threads only "
                         "contend)")
    add_output_arguments(ap)
    ap.set_defaults(run=run)


def main(argv=None) -> int:
    args, ap = parse(sys.modules[__name__], argv, prog="lipcheck probe")
    return run(args, ap)


def run(args, ap) -> int:
    if args.checkpoint:
        not_with_checkpoint(args, ap, {"width": 192, "heads": None, "restarts": None, "steps": None,
                                       "max_log2_radius": 12})
        if args.threads is None:
            args.threads = 1
        from .trained import run_checkpoint
        return run_checkpoint("probe", args, ap)
    device = torch.device(args.device) if args.device else default_device()
    set_threads(args.threads or 1 if device.type == "cpu" else args.threads)
    args.docs = report.docs_dir(args.docs, quick=args.quick)
    mode = "quick" if args.quick else "full"
    cfg = SETTINGS[mode]
    if args.heads is None:
        args.heads = args.width // 64 if args.width % 64 == 0 else 1
    if args.width % args.heads:
        ap.error(f"--heads must divide --width ({args.width}), got {args.heads}")
    H, W = args.grid or (4, 4)
    if args.width <= 0:
        raise SystemExit(f"--width must be a positive number of channels, got {args.width}")
    if args.heads is None:
        args.heads = args.width // 64 if args.width % 64 == 0 else 1
    if args.heads <= 0 or args.width % args.heads:
        raise SystemExit(f"--heads must divide --width ({args.width}), got {args.heads}")
    N = H * W
    radii = [2.0 ** k for k in range(args.max_log2_radius + 1)]
    st = report.stamp(device=device)
    if (H, W) != (4, 4) or args.width != 192 or args.heads != 3:
        return size_run(args, mode, cfg, (H, W), radii, device, st)
    t_start = time.perf_counter()
    over = {k: v for k, v in (("restarts", args.restarts), ("steps", args.steps)) if v is not None}
    common = dict(grid=(H, W), device=device, seed=args.seed, progress=True, certify_tol=CERTIFY_TOL)
    cfg = {**cfg, "attention": {**cfg["attention"], **over}}

    # 1. one multi-head attention layer, preset ti width, its own default initialisation (nn.Linear's)
    torch.manual_seed(args.seed)
    attn = DenseAttention(192, 3, dtype=torch.float64)
    curves = {}
    t0, c0 = time.perf_counter(), time.process_time()
    curves["attention"] = attention_growth(attn, radii, **cfg["attention"], **common)
    times = {"attention": time.perf_counter() - t0}
    cpu_times = {"attention": time.process_time() - c0}  # this process's CPU time: what a machine of its own needs
    attn_upper = [attention_lipschitz_on_frobenius_ball(attn, R, N) for R in radii]
    # what the focused witness predicts: query covariance a^2 u^T u with a^2 ~ R^2 / 2 in the dominant head
    hm = head_matrices(attn)
    witness_coef = max(float((hm["A"][h] @ u).norm() * (u @ hm["B"][h]).norm())
                       for u in witness_directions(attn).values() for h in range(attn.num_heads)) \
        / (2 * math.sqrt(attn.head_dim))

    # 2. the pre-LN block and the Neural-ODE vector field of the dense ODE ViT (ViT initialisation)
    torch.manual_seed(args.seed)
    model = vit_from_preset("ti", "ode", "attention", dtype=torch.float64)
    block = model.vector_field.block
    if cfg["vit_init_attention"]:
        t0 = time.perf_counter()
        curves["attention_vit_init"] = attention_growth(block.mixer, radii, **cfg["attention"], **common)
        times["attention_vit_init"] = time.perf_counter() - t0
    for name, branch in (("pre_ln_block", "mixer"), ("vector_field", "vector_field")):
        t0 = time.perf_counter()
        curves[name] = attention_growth(BlockMap(block, branch), cfg["ln_radii"], **cfg["ln"], **common)
        times[name] = time.perf_counter() - t0
    block_bounds = attention_block_lipschitz(block, N)
    try:  # the certification module's S3 bound for the same vector field, as a cross-check
        from lipcheck.bounds import vector_field_lipschitz
        block_bounds["bounds_vector_field_lipschitz_global"] = float(
            vector_field_lipschitz(block, states=curves["vector_field"].X.to(torch.float64)).global_bound)
    except (ImportError, AttributeError, NotImplementedError, TypeError, ValueError) as err:
        block_bounds["bounds_vector_field_lipschitz_global"] = f"unavailable: {err}"

    # 3. SSoG at the same width, same grid: affine, so its constant is one number for every radius
    torch.manual_seed(args.seed)
    ssog_model = vit_from_preset("ti", "ode", "ssog", dtype=torch.float64)
    t0 = time.perf_counter()
    ssog_L, ssog_how = ssog_exact(ssog_model.vector_field.block.mixer, H, W)
    times["ssog_exact"] = time.perf_counter() - t0

    # 4. batched vs a Python loop over restarts (must-show 4)
    t0 = time.perf_counter()
    bench = [benchmark_batched_vs_loop(attn, 64.0, (H, W), restarts=64, steps=cfg["bench_steps"],
                                       power_warmup=cfg["bench_steps"], device=device, dtype=dt, seed=args.seed)
             for dt in (torch.float64, torch.float32)]
    times["benchmark"] = time.perf_counter() - t0
    total = time.perf_counter() - t_start

    size_runs = load_size_runs(args.docs)
    data = {"mode": mode, "grid": [H, W], "radii": radii, "size_runs": size_runs, "curves": {k: v.as_dict() for k, v in curves.items()},
            "attention_upper_frobenius_ball": attn_upper, "witness_coefficient": witness_coef, "block_bounds": block_bounds, "ssog_exact": ssog_L,
            "ssog_exact_method": ssog_how, "benchmark": bench, "settings": {k: v for k, v in cfg.items()},
            "seconds": {**times, "total": total}, "cpu_seconds": cpu_times, "threads": torch.get_num_threads()}
    md = render(data, curves, radii, attn_upper, block_bounds, ssog_L, ssog_how, bench, args)
    figure(curves, radii, attn_upper, block_bounds, ssog_L, st, args.docs)
    if size_runs:
        size_figure(curves["attention"], size_runs, st, args.docs)
    v = verdict(curves["attention"], ssog_L)
    path = report.write_report("attention_growth", md, data, st, docs=args.docs, json_path=args.json, verdict=v)
    print(f"attention exponent {curves['attention'].exponent:.4f} CI {curves['attention'].exponent_ci}, "
          f"total {total:.1f} s")
    report.print_verdict(v, path)
    return 0


def verdict(a, ssog_L: float) -> dict:
    """S4 holds when the certified lower bounds grow without a ceiling: a fitted exponent near 2 (R^2)."""
    lo, hi = a.exponent_ci
    return report.verdict(
        "S4, dense attention is not globally Lipschitz (certified lower bounds on L(R) grow like R^2)",
        "holds" if lo > 1.5 else "fails",
        f"Fitted exponent {a.exponent:.3f} (95% CI [{lo:.3f}, {hi:.3f}]); L({a.radii[-1]:g}) >= {a.lower[-1]:.4g} "
        f"against SSoG's flat {ssog_L:.4g} at every R.")


def verdict_from(data: dict) -> dict:
    """The verdict of a finished run from its JSON (lipcheck report --verdicts)."""
    import types
    return verdict(types.SimpleNamespace(**data["curves"]["attention"]), float(data["ssog_exact"]))


def size_json_path(docs, H: int, W: int, C: int) -> Path:
    return (Path(docs) if docs else report.docs_dir()) / "data" / f"attention_growth_{H}x{W}_c{C}.json"


def size_run(args, mode, cfg, grid, radii, device, st) -> int:
    """Dense attention alone on another token grid / width: its curve, fit and times to one JSON."""
    H, W = grid
    C = args.width
    heads = args.heads
    torch.manual_seed(args.seed)
    attn = DenseAttention(C, heads, dtype=torch.float64)  # default initialisation, as the 4x4 report
    kw = {**cfg["size"], **{k: v for k, v in (("restarts", args.restarts), ("steps", args.steps)) if v is not None}}
    fit_min = 64.0 if radii[-1] > 64.0 else radii[len(radii) // 2]
    t0, c0 = time.perf_counter(), time.process_time()
    res = attention_growth(attn, radii, grid=grid, dtype=SIZE_DTYPE, certify_tol=CERTIFY_TOL, fit_min_radius=fit_min,
                           device=device, seed=args.seed, progress=True, **kw)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    upper = [attention_lipschitz_on_frobenius_ball(attn, R, H * W) for R in radii]
    data = {"kind": "size_run", "mode": mode, "grid": [H, W], "width": C, "heads": heads, "radii": radii,
            "curve": res.as_dict(), "attention_upper_frobenius_ball": upper, "settings": kw,
            "search_dtype": str(SIZE_DTYPE).replace("torch.", ""), "seconds": seconds, "cpu_seconds": cpu_seconds,
            "threads": torch.get_num_threads(), "device": str(device)}
    path = Path(args.json) if args.json else size_json_path(args.docs, H, W, C)
    v = verdict(res, float("nan"))
    v["number"] = v["number"].split(" against")[0] + f" ({H}x{W} grid, C={C})."
    report.write_json(path, {"stamp": st, "verdict": v, **data})
    print(f"{H}x{W} grid, C={C}: exponent {res.exponent:.4f} CI {res.exponent_ci} on R >= {fit_min:g}; "
          f"L({radii[-1]:g}) = {res.lower[-1]:.6g}; max Lanczos residual {max(res.tolerance):.2g}; "
          f"{seconds:.1f} s on {device} ({torch.get_num_threads()} threads)")
    report.print_verdict(v, path)
    return 0


def load_size_runs(docs) -> list:
    """Every size-run JSON in docs/data, smallest grid and width first."""
    folder = (Path(docs) if docs else report.docs_dir()) / "data"
    runs = []
    for path in sorted(folder.glob("attention_growth_*x*_c*.json")):
        d = json.loads(path.read_text())
        if d.get("kind") == "size_run":
            runs.append({**d, "file": f"data/{path.name}"})
    return sorted(runs, key=lambda d: (d["grid"][0] * d["grid"][1], d["width"]))


def size_figure(curve4, runs, st, docs):
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.loglog(curve4.radii, curve4.lower, "o-", ms=3, label=f"4x4 grid, C=192 (exponent {curve4.exponent:.3f})")
    for i, d in enumerate(runs):
        c = d["curve"]
        ax.loglog(c["radii"], c["lower"], "s-", ms=3, color=f"C{i + 1}",
                  label=f"{d['grid'][0]}x{d['grid'][1]} grid, C={d['width']} (exponent {c['exponent']:.3f})")
    R = [r for r in curve4.radii if r >= 64]
    ax.loglog(R, [curve4.lower[-1] * (r / R[-1]) ** 2 for r in R], "k:", lw=1, label="slope 2")
    ax.set_xlabel("radius R (Frobenius norm of the token grid X)")
    ax.set_ylabel("certified lower bound on L(R)")
    ax.set_title("Dense attention, default initialisation: L(R) on a ViT's own token grid", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    report.save_figure(fig, "attention_growth_grids", st, docs=docs)


def figure(curves, radii, attn_upper, block_bounds, ssog_L, st, docs):
    fig, ax = plt.subplots(figsize=(7.2, 5.0))
    a = curves["attention"]
    ax.loglog(a.radii, a.lower, "o-", color="C0", label="dense attention: certified lower bound on L(R)")
    k, b = a.exponent, a.intercept
    Rf = [r for r in radii if r >= a.fit_min_radius]
    ax.loglog(Rf, [math.exp(b) * r ** k for r in Rf], "--", color="C0", lw=1,
              label=f"fit R^{k:.3f} (R >= {a.fit_min_radius:g})")
    ax.loglog(radii, attn_upper, ":", color="C0", label="dense attention: certified upper bound on L(R)")
    if "attention_vit_init" in curves:
        c = curves["attention_vit_init"]
        ax.loglog(c.radii, c.lower, "x-", color="C4", ms=4, label="dense attention, ViT init (lower bound)")
    for name, color, label in (("pre_ln_block", "C1", "pre-LN attention branch Attn(LN1 x)"),
                               ("vector_field", "C2", "dense Neural-ODE vector field F")):
        c = curves[name]
        ax.loglog(c.radii, c.lower, "s-", color=color, ms=4, label=f"{label}: lower bound")
        key = "mixer_branch" if name == "pre_ln_block" else "vector_field"
        ax.axhline(block_bounds[key], color=color, ls=":", lw=1, label=f"{label}: certified upper bound")
    ax.axhline(ssog_L, color="C3", lw=2, label="SSoG: exact constant (flat)")
    ax.set_xlabel("radius R (Frobenius norm of the token grid X)")
    ax.set_ylabel("spectral norm of the Jacobian")
    ax.set_title("Local Lipschitz constant L(R) = sup_{||X|| <= R} ||J(X)||, width 192, 3 heads, 4x4 grid",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left")
    report.save_figure(fig, "attention_growth", st, docs=docs)


def render(data, curves, radii, attn_upper, bb, ssog_L, ssog_how, bench, args) -> str:
    a = curves["attention"]
    H, W = data["grid"]
    lines = ["# Attention growth: certified lower bounds on L(R) (S4)", ""]
    lines += [
        "Dense attention is not globally Lipschitz: its local constant "
        "L(R) = sup_{||X||_F <= R} ||J_f(X)||_2 grows without bound. Every value below is a certified lower "
        "bound: the Jacobian's spectral norm ||J(X) v|| / ||v||, re-evaluated in float64 at the returned input X "
        "(||X||_F <= R checked) and an actual vector v.", "",
        "**Map probed.** f is the whole multi-head attention layer `DenseAttention` on one grid of "
        f"N = {H}x{W} = {N_of(data)} tokens, width C = 192, 3 heads (preset `ti` width): "
        "f(X) = sum_h softmax(Q^h K^h^T / sqrt(d)) V^h W_O^h + b_O, with the output projection and all four "
        "biases (q, k, v, o) included, in its default initialisation (that of `nn.Linear`). Input norm: "
        "Frobenius norm of X (N x C); Jacobian: spectral norm. The search is one batched computation over every "
        "radius and restart (projected gradient ascent on X over each sample's own ball, with a power-iteration "
        "step for the top singular vector each step), through the layer's tangent map (X, V) -> (f(X), J V) written "
        f"with batched matmuls (`{a.tangent}`; checked against autograd in the tests). Starts: structured witnesses "
        "(a query whose logits towards two keys at m +- a u are balanced, u along the top singular directions of "
        "W_Q^h W_K^h^T and W_V^h W_O^h, focused and uniform variants) and random inputs; then "
        "refinement rounds, again batched over radii, continue each radius's best restarts and start one from the "
        "next smaller radius's best input (a pipelined warm-started sweep). Certification: Lanczos on J^T J in "
        f"float64 from the search's own vector, stopped at relative residual {a.certify_tol:g}; the number reported "
        "is ||J v|| for the Ritz vector v, recomputed in float64, so it is a Jacobian norm at an actual input "
        "whether or not Lanczos converged (the residual reached is in the table). Balls are nested, so L(R) is "
        "the running maximum of the per-radius values.", "",
        "## Must-show 1: dense attention, L(R) and its growth exponent", "",
        f"Fitted exponent on R >= {a.fit_min_radius:g}: **{a.exponent:.4f}**, 95% CI "
        f"[{a.exponent_ci[0]:.4f}, {a.exponent_ci[1]:.4f}] (least squares of log L on log R). "
        f"L(R) strictly increasing over all {len(radii)} radii: "
        f"**{all(y > x for x, y in zip(a.lower, a.lower[1:]))}**. "
        f"Restarts {a.restarts}, ascent steps {a.steps} per radius. Time for the 13 radii: "
        f"**{data['seconds']['attention']:.1f} s** wall (search {a.seconds['search']:.1f} s, certification "
        f"{a.seconds['certify']:.1f} s; process CPU time {data['cpu_seconds']['attention']:.1f} s) on "
        f"{data['threads']} thread(s) of a 2-core machine shared with other jobs.", "",
    ]
    rows = []
    for i, R in enumerate(a.radii):
        rows.append([f"{R:g}", a.lower[i], a.search[i], a.witness[i], f"{a.tolerance[i]:.1e}", a.lower[i] / R ** 2,
                     attn_upper[i], attn_upper[i] / a.lower[i]])
    lines.append(report.md_table(["R", "L(R) certified", "search value", "best witness start (certified)",
                                  "Lanczos residual", "L / R^2", "certified upper bound on L(R)", "upper / lower"],
                                 rows))
    lines += ["", "At small R the linear (value-path) part of the Jacobian dominates, so L is nearly flat; from "
              "R ~ 16 the softmax's covariance term takes over and L grows like R^2. The upper bound is "
              "`lipcheck.bounds.attention.attention_lipschitz_on_frobenius_ball(layer, R, N)` (the Jacobian formula "
              "bounded term by term on the ball); it also grows like R^2, so the R^2 rate is certified from both "
              "sides, with a constant-factor gap between the witness-found lower bound and the triangle-"
              "inequality upper bound (last column).", ""]
    c2 = data["witness_coefficient"]
    same = [R for R, s, w in zip(a.radii, a.search, a.witness) if R >= 32 and abs(s - w) <= 1e-6 * w]
    lines += [f"Tightness. The focused witness predicts L(R) ~ c R^2 with c = max_(h, u) ||A_h u^T|| ||u B_h|| / "
              f"(2 sqrt d) = {c2:.6g} over the witness directions u (the query puts weight ~1/2 on each key, so its "
              f"attention covariance is a^2 u^T u with a^2 ~ R^2 / 2); the measured L(R) / R^2 at R = "
              f"{a.radii[-1]:g} is {a.lower[-1] / a.radii[-1] ** 2:.6g}. "
              f"At {len(same)} of the {sum(R >= 32 for R in a.radii)} radii "
              f"R >= 32 the ascent ended where the best witness started (search value = witness value to 1e-6), "
              f"i.e. it found no better input near the witnesses. The reported L(R) is what this witness family "
              f"reaches; whether the true sup is larger is open within the factor {attn_upper[-1] / a.lower[-1]:.3g} that separates it "
              f"from the certified upper bound.", ""]
    if "attention_vit_init" in curves:
        c = curves["attention_vit_init"]
        lines += [f"With the ViT initialisation (truncated normal std 0.02, zero biases) the same layer gives "
                  f"exponent {c.exponent:.4f}, 95% CI [{c.exponent_ci[0]:.4f}, {c.exponent_ci[1]:.4f}] on "
                  f"R >= {c.fit_min_radius:g}; L(4096) = {c.lower[-1]:.6g}.", ""]
    lines += size_section(data, a)
    lines += ["## Pre-LN attention block and the dense Neural-ODE vector field", "",
              "Same probe on x -> Attn(LN1 x) (the block's mixer branch; the discrete update adds the identity) "
              "and on F(x) = Attn(LN1 x) + MLP(LN2 x) of the dense ODE ViT (`vit_from_preset('ti', 'ode', "
              "'attention')`, ViT initialisation: LN gamma = 1, beta = 0, linear weights std 0.02, zero biases). "
              "LayerNorm maps every token into the ball of radius sqrt(C) max|gamma| + ||beta|| = "
              f"{bb['token_radius']:.4g}, so attention only sees a compact set and the constant saturates. "
              "Starts include constant tokens (zero variance), where LayerNorm's Jacobian "
              "gamma / sqrt(eps) (I - 11^T / C) is largest.", ""]
    rows = []
    pl, vf = curves["pre_ln_block"], curves["vector_field"]
    for i, R in enumerate(pl.radii):
        rows.append([f"{R:g}", pl.lower[i], vf.lower[i]])
    lines.append(report.md_table(["R", "Attn(LN1 x): L(R) certified", "vector field F: L(R) certified"], rows))
    lines += ["", report.md_table(["quantity", "measured max (certified lower bound)", "certified upper bound",
                                   "upper / measured"],
                                  [["Attn(LN1 x)", max(pl.lower), bb["mixer_branch"], bb["mixer_branch"] / max(pl.lower)],
                                   ["F = Attn(LN1 x) + MLP(LN2 x)", max(vf.lower), bb["vector_field"],
                                    bb["vector_field"] / max(vf.lower)]]), "",
              f"The upper bounds (`lipcheck.bounds.attention.attention_block_lipschitz`) are "
              f"Lip(Attn on the LN image) x Lip(LN1) = {bb['attention_on_ln_image']:.4g} x {bb['lip_ln1']:.4g} for the "
              f"branch, plus Lip(MLP) Lip(LN2) = {bb.get('lip_mlp', 0):.4g} x {bb.get('lip_ln2', 0):.4g} for F. "
              + (f"`lipcheck.bounds.vector_field_lipschitz(block, states).global_bound` gives "
                 f"{bb['bounds_vector_field_lipschitz_global']:.6g} for F. "
                 if isinstance(bb.get("bounds_vector_field_lipschitz_global"), float) else "") +
              "Both are global and finite, as S4 says for pre-LN attention, and both are large: LayerNorm's "
              f"global constant max|gamma| / sqrt(eps) = {bb['lip_ln1']:.4g} is attained at zero-variance tokens, "
              "which the probe finds at every radius, so the measured constant is large already at R = 1 and "
              "then flat. The gap to the upper bound is the slack of the triangle inequalities in the attention "
              "bound on the LN image, not growth.", "",
              "## SSoG", "",
              f"SSoG at the same width (3 heads, 4 components, ViT initialisation), same {H}x{W} grid: exact "
              f"Lipschitz constant **{ssog_L:.6g}** ({ssog_how}). SSoG with fixed kernels is affine in X, so this "
              "one number is its constant at every radius: the flat line in the figure.", "",
              "![attention growth](figures/attention_growth.png)", "",
              "## Must-show 4: batched search vs a Python loop over restarts", ""]
    rows = [[b["dtype"], b["restarts"], b["steps"], b["radius"], b["batched_s"], b["loop_s"], b["speedup"],
             b["best_batched"], b["best_loop"]] for b in bench]
    lines.append(report.md_table(["dtype", "restarts", "ascent steps", "R", "batched [s]", "loop [s]",
                                  "speedup", "best value (batched)", "best value (loop)"], rows))
    lines += ["", f"Same 64 random starts and the same number of steps (plus as many power-iteration warm-up steps), "
              f"on {data['threads']} CPU thread(s); the loop calls the same `lipcheck.probe.ascend` once per restart. "
              "Both runs start from the same inputs and power-iteration vectors, so their best values agree up to rounding. "
              f"Speedup >= 5x: float64 **{bench[0]['speedup'] >= 5}**, float32 **{bench[1]['speedup'] >= 5}**. "
              "Both sides run the same batched-matmul tangent map (no vmap): a restart's own work is a few dense "
              "products, so the loop's extra cost is the per-call overhead, "
              + ", ".join(f"{1e3 * (b['loop_s'] - b['batched_s']) / (b['restarts'] * (b['steps'] + 1 + b['power_warmup'])):.1f} ms"
                          f" per restart and step in {b['dtype']}" for b in bench)
              + ", and the ratio is largest where the products are cheapest (float32).", "",
              "## Reproduce", "",
              "```"] + [f"lipcheck probe --grid {d['grid'][0]}x{d['grid'][1]} --width {d['width']}"
                        + (" --quick" if d["mode"] == "quick" else "") for d in data["size_runs"]] + [
              "python experiments/probe.py" + (" --quick" if data["mode"] == "quick" else ""),
              "pytest tests/test_probe.py", "```", "",
              "(`lipcheck probe ...` runs the same script with the same options; the size runs go first: this "
              "report tabulates every `docs/data/attention_growth_<H>x<W>_c<C>.json` it finds.)", "",
              f"Run time of this report: {data['seconds']['total']:.1f} s ({data['mode']} mode, "
              f"{data['threads']} thread(s), a 2-core machine shared with other jobs): "
              + ", ".join(f"{k} {v:.1f} s" for k, v in data["seconds"].items() if k != "total") + "."]
    return "\n".join(lines)


def size_section(data, a) -> list:
    runs = data["size_runs"]
    out = ["## A ViT's own token grid: 14x14 tokens, widths 192 and 384", ""]
    if not runs:
        return out + ["No size run found in docs/data (run `lipcheck probe --grid 14x14 --width 192` first).", ""]
    out += ["Dense attention in its default initialisation (heads = C / 64, as the ti and s presets) on the grid "
            "of a 224x224 image in 16x16 patches, same radii, same probe; each run is "
            "`python experiments/probe.py --grid HxW --width C` (= `lipcheck probe ...`), a float32 "
            "search with float64 certification, timed end to end (witness set-up, search, certification, fit).", ""]
    rows = [["4x4", 192, data["threads"], "float64", a.restarts, a.steps, data["seconds"]["attention"],
             data["cpu_seconds"]["attention"],
             a.exponent, f"[{a.exponent_ci[0]:.4f}, {a.exponent_ci[1]:.4f}]", 1.9 <= a.exponent <= 2.1,
             f"{max(a.tolerance):.1e}", a.lower[-1]]]
    for d in runs:
        c = d["curve"]
        rows.append([f"{d['grid'][0]}x{d['grid'][1]}", d["width"], d["threads"], d["search_dtype"], c["restarts"],
                     c["steps"], d["seconds"], d.get("cpu_seconds", "not recorded"), c["exponent"], f"[{c['exponent_ci'][0]:.4f}, {c['exponent_ci'][1]:.4f}]",
                     1.9 <= c["exponent"] <= 2.1, f"{max(c['tolerance']):.1e}", c["lower"][-1]])
    out.append(report.md_table(["grid", "C", "threads", "search dtype", "restarts", "steps", "wall time [s]",
                                "process CPU time [s]",
                                f"exponent (R >= {a.fit_min_radius:g})", "95% CI", "in [1.9, 2.1]",
                                "max Lanczos residual", "L(4096)"], rows))
    out += ["", "Certified lower bounds per radius:", ""]
    head = ["R", "4x4, C=192"] + [f"{d['grid'][0]}x{d['grid'][1]}, C={d['width']}" for d in runs] + \
        [f"upper bound {d['grid'][0]}x{d['grid'][1]}, C={d['width']}" for d in runs]
    rows = []
    for i, R in enumerate(a.radii):
        row = [f"{R:g}", a.lower[i]]
        for d in runs:
            row.append(d["curve"]["lower"][i] if i < len(d["curve"]["lower"]) else "")
        for d in runs:
            u = d["attention_upper_frobenius_ball"]
            row.append(u[i] if i < len(u) else "")
        rows.append(row)
    out.append(report.md_table(head, rows))
    out += ["", "Stamps of the size runs: " + "; ".join(
        f"{d['file']}: commit {d['stamp']['commit']}, {d['stamp']['device']}, {d['stamp']['date']}" for d in runs)
        + ".", "", "![attention growth on token grids](figures/attention_growth_grids.png)", ""]
    return out


def N_of(data):
    return data["grid"][0] * data["grid"][1]


if __name__ == "__main__":
    raise SystemExit(main())
