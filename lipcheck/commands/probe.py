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


import torch

from lipcheck import report
from lipcheck.bounds.attention import attention_block_lipschitz, attention_lipschitz_on_frobenius_ball, head_matrices
from lipcheck.mixers.attention import DenseAttention
from lipcheck.models.vit import vit_from_preset
from lipcheck.probe import BlockMap, attention_growth, benchmark_batched_vs_loop, default_device, witness_directions
from lipcheck.reports import probe as probe_report

from .common import (add_checkpoint_arguments, add_output_arguments, grid, not_with_checkpoint, parse,
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
    if args.heads <= 0 or args.width % args.heads:
        raise SystemExit(f"--heads must divide --width ({args.width}), got {args.heads}")
    radii = [2.0 ** k for k in range(args.max_log2_radius + 1)]
    st = report.stamp(device=device)
    if (H, W) != (4, 4) or args.width != 192 or args.heads != 3:
        return size_run(args, mode, cfg, (H, W), radii, device, st)
    return report_run(args, mode, cfg, (H, W), radii, device, st)


def report_run(args, mode, cfg, grid, radii, device, st) -> int:
    """The 4x4 report: dense attention, the pre-LN block and the dense vector field against SSoG, and the
    batched-vs-loop benchmark; docs/attention_growth.md, its figures and JSON."""
    t_start = time.perf_counter()
    over = {k: v for k, v in (("restarts", args.restarts), ("steps", args.steps)) if v is not None}
    search = dict(grid=grid, device=device, seed=args.seed, progress=True, certify_tol=CERTIFY_TOL)
    cfg = {**cfg, "attention": {**cfg["attention"], **over}}
    times, cpu_times = {}, {}
    attn, curves, attn_upper, witness_coef = attention_phase(args.seed, radii, cfg, search, times, cpu_times)
    block_bounds = block_phase(args.seed, radii, cfg, search, curves, times)
    ssog_L, ssog_how = ssog_phase(args.seed, grid, times)
    t0 = time.perf_counter()
    bench = [benchmark_batched_vs_loop(attn, 64.0, grid, restarts=64, steps=cfg["bench_steps"],
                                       power_warmup=cfg["bench_steps"], device=device, dtype=dt, seed=args.seed)
             for dt in (torch.float64, torch.float32)]
    times["benchmark"] = time.perf_counter() - t0
    total = time.perf_counter() - t_start

    size_runs = load_size_runs(args.docs)
    data = {"mode": mode, "grid": list(grid), "radii": radii, "size_runs": size_runs,
            "curves": {k: v.as_dict() for k, v in curves.items()}, "attention_upper_frobenius_ball": attn_upper,
            "witness_coefficient": witness_coef, "block_bounds": block_bounds, "ssog_exact": ssog_L,
            "ssog_exact_method": ssog_how, "benchmark": bench, "settings": {k: v for k, v in cfg.items()},
            "seconds": {**times, "total": total}, "cpu_seconds": cpu_times, "threads": torch.get_num_threads()}
    md = probe_report.render(data)
    report.save_figure(probe_report.figure(data), "attention_growth", st, docs=args.docs)
    if size_runs:
        report.save_figure(probe_report.size_figure(data), "attention_growth_grids", st, docs=args.docs)
    v = verdict(curves["attention"], ssog_L)
    path = report.write_report("attention_growth", md, data, st, docs=args.docs, json_path=args.json, verdict=v)
    print(f"attention exponent {curves['attention'].exponent:.4f} CI {curves['attention'].exponent_ci}, "
          f"total {total:.1f} s")
    report.print_verdict(v, path)
    return 0


def attention_phase(seed, radii, cfg, search, times, cpu_times):
    """One multi-head attention layer, preset ti width, its own default initialisation (nn.Linear's): its
    curve, its certified upper bounds and the coefficient the focused witness predicts."""
    N = search["grid"][0] * search["grid"][1]
    torch.manual_seed(seed)
    attn = DenseAttention(192, 3, dtype=torch.float64)
    curves = {}
    t0, c0 = time.perf_counter(), time.process_time()
    curves["attention"] = attention_growth(attn, radii, **cfg["attention"], **search)
    times["attention"] = time.perf_counter() - t0
    cpu_times["attention"] = time.process_time() - c0  # this process's CPU time: what a machine of its own needs
    attn_upper = [attention_lipschitz_on_frobenius_ball(attn, R, N) for R in radii]
    # what the focused witness predicts: query covariance a^2 u^T u with a^2 ~ R^2 / 2 in the dominant head
    hm = head_matrices(attn)
    witness_coef = max(float((hm["A"][h] @ u).norm() * (u @ hm["B"][h]).norm())
                       for u in witness_directions(attn).values() for h in range(attn.num_heads)) \
        / (2 * math.sqrt(attn.head_dim))
    return attn, curves, attn_upper, witness_coef


def block_phase(seed, radii, cfg, search, curves, times) -> dict:
    """The pre-LN block and the Neural-ODE vector field of the dense ODE ViT (ViT initialisation): their curves
    into `curves`, their certified upper bounds returned."""
    N = search["grid"][0] * search["grid"][1]
    torch.manual_seed(seed)
    model = vit_from_preset("ti", "ode", "attention", dtype=torch.float64)
    block = model.vector_field.block
    if cfg["vit_init_attention"]:
        t0 = time.perf_counter()
        curves["attention_vit_init"] = attention_growth(block.mixer, radii, **cfg["attention"], **search)
        times["attention_vit_init"] = time.perf_counter() - t0
    for name, branch in (("pre_ln_block", "mixer"), ("vector_field", "vector_field")):
        t0 = time.perf_counter()
        curves[name] = attention_growth(BlockMap(block, branch), cfg["ln_radii"], **cfg["ln"], **search)
        times[name] = time.perf_counter() - t0
    block_bounds = attention_block_lipschitz(block, N)
    try:  # the certification module's S3 bound for the same vector field, as a cross-check
        from lipcheck.bounds import vector_field_lipschitz
        block_bounds["bounds_vector_field_lipschitz_global"] = float(
            vector_field_lipschitz(block, states=curves["vector_field"].X.to(torch.float64)).global_bound)
    except (ImportError, AttributeError, NotImplementedError, TypeError, ValueError) as err:
        block_bounds["bounds_vector_field_lipschitz_global"] = f"unavailable: {err}"
    return block_bounds


def ssog_phase(seed, grid, times) -> tuple[float, str]:
    """SSoG at the same width, same grid: affine, so its constant is one number for every radius."""
    torch.manual_seed(seed)
    ssog_model = vit_from_preset("ti", "ode", "ssog", dtype=torch.float64)
    t0 = time.perf_counter()
    out = ssog_exact(ssog_model.vector_field.block.mixer, *grid)
    times["ssog_exact"] = time.perf_counter() - t0
    return out


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


if __name__ == "__main__":
    raise SystemExit(main())
