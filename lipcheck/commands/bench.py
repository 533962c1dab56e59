"""Throughput and peak memory of SSoG against dense attention, 224x224 up to 1024x1024.

    python experiments/bench.py                 # the full benchmark -> docs/throughput.md (~20-25 min, 2-core CPU)
    python experiments/bench.py --quick         # the 224 rows and the 64x64 mixer rows, under 5 minutes
    python experiments/bench.py --device cuda --bf16 --batch-size 8
    lipcheck bench [same options]

Every row in its own subprocess (lipcheck.bench.run_config); within a row SSoG and attention are built
from one seed and timed alternately (lipcheck.bench.measure_row) at batch 1 and at a throughput batch:
1a. mixer targets: SSoG (auto) against fused SDPA at 14x14, 28x28, 64x64 with C = 192 and 384, pinned
    to one thread, with torch's default thread count, and with a busy competing process; three rounds of
    each spread over the run, the median of the rounds' speed-ups reported;
1b. the SSoG backend table at 64x64, C=384 (one configuration per mixer, fused and explicit attention);
2. whole models, widths x variants x resolutions, inference and a training step, SSoG ("auto")
   against fused SDPA (and explicit attention where its memory is the reference); the ODE model with
   fixed-step rk4 (NFE = depth, the cost of the discrete model) and with dopri5 (NFE measured);
3. the analytic multiply-add ratio (dense axis factors) beside every measured ratio, the trend with
   resolution and its fitted exponents, and the paper's numbers in the same table.
Section 0 of the report lists every target with its measured number; a missed target says so.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")


import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from lipcheck import bench, report  # noqa: E402
# The analysis and the renderer, also reachable as attributes of this module.
from lipcheck.bench_results import (LOADS, MIXER_GRID, PRESETS_DEPTH, analyse, fits, flatten,  # noqa: E402,F401
                                    load_of, mixer_rows, other_share, pool_rounds, target_rows)
from lipcheck.mixers.ssog import BACKENDS  # noqa: E402
from lipcheck.models.vit import PRESETS, VARIANTS  # noqa: E402
from lipcheck.reports import bench as bench_report  # noqa: E402
from lipcheck.reports.bench import PAPER, _rounds, _solver_md, render  # noqa: E402,F401
from lipcheck.reports.bench_figures import figures  # noqa: E402
from . import common  # noqa: E402

# Model rows. train_upto[variant][width]: largest resolution with a training-step row; variant_resolutions:
# where a variant is measured (looped runs exactly the discrete model's operations with one block's
# weights, so between the ends of the range it adds time, not information); math_rows: (resolution,
# variant, width) triples that also time explicit attention (its memory is the reference of the memory target);
# throughput_batch: the second batch size of every row, fewer as the grid grows; load_rows: rows also
# measured with torch's default thread count and with a competing busy process.
FULL = dict(resolutions=[224, 384, 512, 768, 1024], widths=["ti", "s"], variants=list(VARIANTS),
            train_upto={"discrete": {"ti": 1024, "s": 512}, "looped": {"ti": 224, "s": 224},
                        "ode": {"ti": 224, "s": 224}},
            train_resolutions=[224, 512, 1024],
            variant_resolutions={"looped": [224, 1024], "ode": [224, 512, 1024]},
            math_rows=[(1024, "discrete", "ti")],
            dopri5_resolutions=[224], dopri5_widths=["ti"], mixer_grid=MIXER_GRID, mixer_rounds=5,
            mixer_backends=list(BACKENDS),
            throughput_batch={224: 16, 384: 8, 512: 4, 768: 1, 1024: 1}, train_throughput_batch={224: 4},
            load_rows=[(224, "ti", "discrete"), (224, "s", "discrete")],
            target_grids=[14, 28, 64], target_dims=[(192, 3), (384, 6)],
            target_batch={14: 32, 28: 8, 64: 2}, target_repeats={14: 21, 28: 15, 64: 5}, target_rounds=3)
QUICK = dict(resolutions=[224], widths=["ti", "s"], variants=list(VARIANTS),
             train_upto={"discrete": {"ti": 224}}, train_resolutions=[224],
             variant_resolutions={}, math_rows=[], dopri5_resolutions=[], dopri5_widths=[],
             mixer_grid=MIXER_GRID, mixer_rounds=0, mixer_backends=[],
             throughput_batch={224: 8}, train_throughput_batch={},
             load_rows=[(224, "ti", "discrete")],
             target_grids=[64], target_dims=[(384, 6)], target_batch={64: 2}, target_repeats={64: 3}, target_rounds=1)
MIXER_ALONE = dict(dim=384, num_heads=6, num_components=4)


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true",
                   help="the 224 rows (ti, s; every variant) and the 64x64 mixer rows, under 5 minutes")
    p.add_argument("--throughput-batch", type=int, default=None,
                   help="second batch size of every model row (default by resolution: 16 at 224 down to 1 at 1024; "
                        "0 = batch 1 only)")
    p.add_argument("--no-load-rows", action="store_true",
                   help="skip the rows with torch's default thread count and with a busy competing process")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    p.add_argument("--docs", type=Path, default=None, help="report directory (default: the repository's docs/)")
    p.add_argument("--resolutions", type=int, nargs="+", default=None, help="input sizes, multiples of 16")
    p.add_argument("--widths", nargs="+", default=None, help=f"presets among {sorted(PRESETS)}")
    p.add_argument("--variants", nargs="+", default=None, help=f"among {list(VARIANTS)}")
    p.add_argument("--batch-size", type=int, default=1, help="matched batch size (default 1)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (meant for CUDA)")
    p.add_argument("--ssog-backend", default="auto", help=f"SSoG backend for the models: auto or one of {sorted(BACKENDS)}")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per configuration (default 1 on CPU: on a shared machine OpenMP threads "
                        "that wait on each other distort timings far more than one thread; 0 = torch's default)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per configuration (default at batch 1: 31 at 224, 11 up to 768, 3 above; "
                        "at the throughput batch: 11 at 224, 5 up to 384, 3 above)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1)")
    p.add_argument("--no-train", action="store_true", help="skip the training-step measurements")
    p.add_argument("--mem-limit-gb", type=float, default=8.0,
                   help="CPU memory cap per configuration; beyond it the configuration is reported as out of memory")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop starting new configurations after this many minutes (the rest are reported as skipped)")
    p.add_argument("--rerender", type=Path, default=None,
                   help="rebuild the report from the raw results of an earlier run's JSON instead of measuring")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration before it is reported as timed out")
    p.set_defaults(run=run)


def parse(argv):
    return common.parse(sys.modules[__name__], argv, prog="lipcheck bench")[0]


def validate(args) -> None:
    """Clear errors before any work (SPEC section 6)."""
    for r in args.resolutions or []:
        bench.check_resolution(r, 16)
    for w in args.widths or []:
        if w not in PRESETS or w == "tiny":
            raise ValueError(f"--widths: unknown width {w!r}; choose among 'ti', 's', 'b'")
    for v in args.variants or []:
        if v not in VARIANTS:
            raise ValueError(f"--variants: unknown variant {v!r}; choose among {list(VARIANTS)}")
    if args.ssog_backend != "auto" and args.ssog_backend not in BACKENDS:
        raise ValueError(f"--ssog-backend: unknown SSoG backend {args.ssog_backend!r}; "
                         f"choose 'auto' or one of {sorted(BACKENDS)}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.throughput_batch is not None and args.throughput_batch < 0:
        raise ValueError(f"--throughput-batch must be >= 0, got {args.throughput_batch}")
    if args.device is not None and torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available; use --device cpu")


def plan(args, device: str) -> list[dict]:
    """Every configuration. Model rows and mixer-target rows time SSoG and attention alternately in one
    process (bench.measure_row), so their ratio is measured under one machine load; the backend table
    runs one configuration per mixer in interleaved rounds."""
    base = QUICK if args.quick else FULL
    threads = args.threads if args.threads is not None else (1 if device == "cpu" else 0)
    shared = dict(device=device, dtype="float32", bf16=args.bf16, batch_size=args.batch_size, seed=args.seed,
                  threads=threads)
    loads = [dict(threads=threads)] if args.no_load_rows or device != "cpu" else \
        [dict(threads=threads)] + [spec for name, spec in LOADS.items() if spec != dict(threads=threads)]
    target_rounds = _target_rounds(args, base, shared, loads)
    cfgs = list(target_rounds[0]) if target_rounds else []
    cfgs += _backend_rounds(args, base, shared)
    models = _model_rows(args, base, shared, loads, threads)
    # The later rounds of the mixer targets between the model rows, evenly: a slow spell of the machine that
    # lasts a minute then lands on one round of a target row, not on all its samples.
    R = max(1, len(target_rounds))  # with no target rows the models still run
    for r in range(1, R + 1):
        cfgs += models[(r - 1) * len(models) // R:r * len(models) // R]
        cfgs += target_rounds[r] if r < R else []
    return cfgs


def _repeats(args, res: int) -> int:
    if args.repeats:
        return args.repeats
    if args.quick:
        return 3
    # 224 carries the on-the-line targets: eleven rounds give its bootstrap intervals some resolution
    return 11 if res <= 224 else 5 if res <= 384 else 3


def _repeats_b1(args, res: int, mode: str) -> int:
    # Batch-1 steps below 1024 take well under a second (training at 512-768: 1-3 s), so more rounds cost
    # a minute or two in all and narrow the intervals where the targets are closest
    if args.repeats or args.quick or res > 768 or (mode == "train" and res > 512):
        return _repeats(args, res)
    return 31 if res <= 224 else 11


def _warmup(args) -> int:
    # Always one untimed step: under the caching allocator the first step also faults in every page
    # it will reuse, which costs the 1-second SSoG step at 1024 a larger share than attention's.
    return args.warmup if args.warmup is not None else 1


def _warmups(args, load: dict, n: int) -> dict:
    # With more than one thread SSoG's thread policy spends its first six or seven calls of a batch size
    # on timing each setting twice (the first call at a thread count is never timed) and switching to the
    # faster: untimed here, so that the timed steps are the steady state (and not the policy's
    # deliberately single-threaded initial samples).
    # The throughput batch gets two untimed steps (its larger buffers are first faulted in there).
    if args.warmup is not None:
        return dict(warmup=n, throughput_warmup=n)
    if load.get("threads") == 1:
        return dict(warmup=n, throughput_warmup=max(n, 2))
    return dict(warmup=max(n, 8), throughput_warmup=8)


def _throughput_batch(args, base: dict, res: int, mode: str) -> int:
    if args.throughput_batch is not None:
        return args.throughput_batch
    table = base["throughput_batch"] if mode == "inference" else base["train_throughput_batch"]
    return table.get(res, 1)


def _target_rounds(args, base: dict, shared: dict, loads: list[dict]) -> list[list[dict]]:
    """1. Mixer targets: SSoG (auto) against fused SDPA at each grid and width, batch 1 and a throughput batch,
    under each machine load; in rounds spread over the run (placed by `plan`), combined by target_rows."""
    target_rounds = []
    for rnd in range(base["target_rounds"]):
        target_rounds.append([])
        for g in base["target_grids"]:
            for dim, heads in base["target_dims"]:
                for load in loads:
                    target_rounds[-1].append(dict(
                        shared, **load, part="mixer_target", kind="mixer", mixers=["ssog", "sdpa"], mode="inference",
                        grid=g, dim=dim, num_heads=heads, num_components=4, ssog_backend="auto", round=rnd,
                        throughput_batch=base["target_batch"][g], repeats=args.repeats or base["target_repeats"][g],
                        throughput_repeats=args.repeats or base["target_repeats"][g],
                        **_warmups(args, load, _warmup(args)), check=g <= 28 and rnd == 0))
    return target_rounds


def _backend_rounds(args, base: dict, shared: dict) -> list[dict]:
    """2. The backend table (one configuration per mixer, pooled over interleaved rounds)."""
    g = base["mixer_grid"]
    mixers = [("sdpa", None), ("math", None), ("ssog", "auto")] + [("ssog", b) for b in base["mixer_backends"]]
    return [dict(shared, part="mixer", kind="mixer", mixer=mixer, mode="inference", grid=g,
                 ssog_backend=backend or "auto", repeats=args.repeats or (2 if args.quick else 3),
                 warmup=_warmup(args), round=rnd, **MIXER_ALONE)
            for rnd in range(base["mixer_rounds"]) for mixer, backend in mixers]


def _model_settings(args, base: dict):
    """(resolution, width, variant, method, mode) of every whole-model row. The smallest and the largest
    resolution first (the 224 targets and the 1024 no-regression rows): if the time budget (--max-minutes)
    runs out, those survive."""
    resolutions = sorted(args.resolutions or base["resolutions"])
    resolutions = resolutions[:1] + resolutions[-1:] + resolutions[1:-1] if len(resolutions) > 1 else resolutions
    modes = ["inference"] if args.no_train else ["inference", "train"]
    for res in resolutions:
        for width in args.widths or base["widths"]:
            for variant in args.variants or base["variants"]:
                if not args.variants and res not in base.get("variant_resolutions", {}).get(variant, [res]):
                    continue
                methods = ["rk4"] if variant == "ode" else [None]
                if variant == "ode" and res in base["dopri5_resolutions"] and width in base["dopri5_widths"]:
                    methods.append("dopri5")
                for method in methods:
                    for mode in modes:
                        if mode == "train" and (method == "dopri5" or res not in base["train_resolutions"]
                                                or res > base["train_upto"].get(variant, {}).get(width, 0)):
                            continue
                        yield res, width, variant, method, mode


def _model_rows(args, base: dict, shared: dict, loads: list[dict], threads: int) -> list[dict]:
    """3. Whole models, SSoG against fused SDPA (and explicit attention in base["math_rows"])."""
    models = []
    for res, width, variant, method, mode in _model_settings(args, base):
        mixers = ["ssog", "sdpa"]
        if mode == "inference" and method != "dopri5" and (res, variant, width) in base["math_rows"]:
            mixers.append("math")
        row_loads = [dict(threads=threads)]
        if mode == "inference" and method is None and (res, width, variant) in base["load_rows"]:
            row_loads = loads
        for load in row_loads:
            cfg = dict(shared, **load, part="model", kind="model", mixers=mixers, mode=mode,
                       width=width, resolution=res, variant=variant, ssog_backend=args.ssog_backend,
                       repeats=_repeats_b1(args, res, mode), throughput_repeats=_repeats(args, res),
                       **_warmups(args, load, _warmup(args)), throughput_batch=_throughput_batch(args, base, res, mode),
                       check=mode == "inference" and res <= 384 and load == dict(threads=threads))
            if method:
                cfg.update(method=method, rk4_steps=PRESETS_DEPTH // 4)
            models.append(cfg)
    return models


def mixer_table(results: list[dict]) -> tuple[list[dict], str]:
    """The backend table's rows (rounds pooled) and their Markdown."""
    rows = mixer_rows(results)
    return rows, bench_report.mixer_md(rows)


def main(argv=None) -> int:
    args, p = common.parse(sys.modules[__name__], argv, prog="lipcheck bench")
    return run(args, p)


def measure(args, device: str) -> tuple[list[dict], float, dict]:
    """Every configuration of the plan, each in its own process: (results, seconds, machine load)."""
    cfgs = plan(args, device)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    results = []
    for cfg in tqdm(cfgs, desc="bench", unit="config"):
        if args.max_minutes and time.perf_counter() - t0 > 60 * args.max_minutes:
            results.append({"config": cfg, "status": "skipped", "error": f"time budget of {args.max_minutes:g} min used up"})
            continue
        results.append(bench.run_config(cfg, timeout=args.timeout, mem_limit_gb=args.mem_limit_gb))
    elapsed = time.perf_counter() - t0
    machine_load = dict(loadavg_before=load_before, loadavg_after=os.getloadavg(), cpus=os.cpu_count())
    return flatten(results), elapsed, machine_load


def run(args, p) -> int:
    validate(args)
    args.docs = report.docs_dir(args.docs, quick=args.quick)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    threads = args.threads if args.threads is not None else (1 if device == "cpu" else 0)
    st = report.stamp(device=device)
    if args.rerender:
        import json
        old = json.loads(Path(args.rerender).read_text())
        results, elapsed, st = flatten(old["raw"]), old["elapsed_s"], old["stamp"]
        threads, device = old.get("threads", threads), old.get("device", device)
        machine_load = old.get("machine_load")
    else:
        results, elapsed, machine_load = measure(args, device)
    mixer_rows_, mixer_md = mixer_table(results)
    targets = target_rows(results)
    rows = analyse(results)["rows"]
    fit = fits(rows)
    md, must = render(mixer_rows_, mixer_md, rows, fit, st["device"], args, threads or torch.get_num_threads(),
                      elapsed, targets=targets, load_note=bench_report.load_note(machine_load))
    if args.rerender:  # the stamp is the measuring run's; say what made this text
        md = bench_report.rerendered_note(args.rerender, report.stamp(device=device)) + md
    data = dict(device=device, threads=threads, batch_size=args.batch_size, bf16=args.bf16, elapsed_s=elapsed,
                machine_load=machine_load, mixer_targets=targets, mixer_alone=mixer_rows_, rows=rows, fits=fit,
                must_show=must, paper=PAPER, raw=results)
    figures(rows, st, args.docs)
    v = verdict(must)
    path = report.write_report("throughput", md, data, st, docs=args.docs, json_path=args.json, verdict=v)
    print(md.split("## 1a.")[0][-3000:])
    report.print_verdict(v, path)
    return 0
def verdict(must: dict) -> dict:
    """The paper's speed claim holds when every mixer and model row meets its target fraction of the MAC ratio."""
    mix, mod = must.get("mixer_fraction_target") or {}, must.get("model_fraction_target") or {}
    rows = mix.get("rows", 0) + mod.get("rows", 0)
    missed = mix.get("missed", 0) + mod.get("missed", 0)
    speed = must.get("1_mixer_speedup_auto")
    number = (f"{rows - missed}/{rows} rows meet their target; lowest fraction of the MAC ratio: mixer "
              f"{mix.get('min_fraction', float('nan')):.3f}, model {mod.get('min_fraction', float('nan')):.3f}"
              + (f"; SSoG mixer {speed:.2f}x fused SDPA at 64x64, C = 384, one thread." if speed else "."))
    return report.verdict("SSoG is faster than dense attention as the multiply-add counts predict",
                          "not run" if not rows else "holds" if missed == 0 else "partial", number)


def verdict_from(data: dict) -> dict:
    """The verdict of a finished run from its JSON (lipcheck report --verdicts)."""
    return verdict(data["must_show"])


if __name__ == "__main__":
    raise SystemExit(main())
