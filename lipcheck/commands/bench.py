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

import itertools
import math
import os
import statistics
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")


import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from lipcheck import bench, report  # noqa: E402
from lipcheck.mixers.ssog import BACKENDS  # noqa: E402
from lipcheck.models.vit import PRESETS, VARIANTS  # noqa: E402
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
            dopri5_resolutions=[224], dopri5_widths=["ti"], mixer_grid=64, mixer_rounds=5,
            mixer_backends=list(BACKENDS),
            throughput_batch={224: 16, 384: 8, 512: 4, 768: 1, 1024: 1}, train_throughput_batch={224: 4},
            load_rows=[(224, "ti", "discrete"), (224, "s", "discrete")],
            target_grids=[14, 28, 64], target_dims=[(192, 3), (384, 6)],
            target_batch={14: 32, 28: 8, 64: 2}, target_repeats={14: 21, 28: 15, 64: 5}, target_rounds=3)
QUICK = dict(resolutions=[224], widths=["ti", "s"], variants=list(VARIANTS),
             train_upto={"discrete": {"ti": 224}}, train_resolutions=[224],
             variant_resolutions={}, math_rows=[], dopri5_resolutions=[], dopri5_widths=[],
             mixer_grid=64, mixer_rounds=0, mixer_backends=[],
             throughput_batch={224: 8}, train_throughput_batch={},
             load_rows=[(224, "ti", "discrete")],
             target_grids=[64], target_dims=[(384, 6)], target_batch={64: 2}, target_repeats={64: 3}, target_rounds=1)
LOADS = {"1 thread": dict(threads=1), "default threads": dict(threads=0),
         "default threads, busy core": dict(threads=0, busy=True)}
MIXER_ALONE = dict(dim=384, num_heads=6, num_components=4)
# The paper (GPU, matched batch size, 1024x1024): SSoG against dense attention.
PAPER = {"ode": "up to +154% throughput, >60% lower peak memory",
         "discrete": ">30% higher throughput", "looped": ">30% higher throughput"}
LABEL = {"ssog": "SSoG", "sdpa": "attention (fused SDPA)", "math": "attention (explicit)"}


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


def load_of(cfg: dict) -> str:
    """The machine-load label of a configuration (LOADS), '-' where it names none."""
    t, busy = cfg.get("threads"), bool(cfg.get("busy"))
    for name, spec in LOADS.items():
        if spec.get("threads") == t and bool(spec.get("busy")) == busy:
            return name
    return f"{t} threads" if t else "-"


def plan(args, device: str) -> list[dict]:
    """Every configuration. Model rows and mixer-target rows time SSoG and attention alternately in one
    process (bench.measure_row), so their ratio is measured under one machine load; the backend table
    runs one configuration per mixer in interleaved rounds."""
    base = QUICK if args.quick else FULL
    resolutions = args.resolutions or base["resolutions"]
    widths = args.widths or base["widths"]
    variants = args.variants or base["variants"]
    threads = args.threads if args.threads is not None else (1 if device == "cpu" else 0)
    common = dict(device=device, dtype="float32", bf16=args.bf16, batch_size=args.batch_size, seed=args.seed,
                  threads=threads)
    loads = [dict(threads=threads)] if args.no_load_rows or device != "cpu" else \
        [dict(threads=threads)] + [spec for name, spec in LOADS.items() if spec != dict(threads=threads)]

    def reps(res):
        if args.repeats:
            return args.repeats
        if args.quick:
            return 3
        # 224 carries the on-the-line targets: eleven rounds give its bootstrap intervals some resolution
        return 11 if res <= 224 else 5 if res <= 384 else 3

    def reps_b1(res, mode):
        # Batch-1 steps below 1024 take well under a second (training at 512-768: 1-3 s), so more rounds cost
        # a minute or two in all and narrow the intervals where the targets are closest
        if args.repeats or args.quick or res > 768 or (mode == "train" and res > 512):
            return reps(res)
        return 31 if res <= 224 else 11

    def warm(res):
        # Always one untimed step: under the caching allocator the first step also faults in every page
        # it will reuse, which costs the 1-second SSoG step at 1024 a larger share than attention's.
        return args.warmup if args.warmup is not None else 1

    def warm_load(load, n):
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

    def tbatch(res, mode):
        if args.throughput_batch is not None:
            return args.throughput_batch
        table = base["throughput_batch"] if mode == "inference" else base["train_throughput_batch"]
        return table.get(res, 1)

    cfgs = []
    # 1. Mixer targets: SSoG (auto) against fused SDPA at each grid and width, batch 1 and a throughput
    # batch, under each machine load; in rounds spread over the run (placed below), combined by target_rows.
    target_rounds = []
    for rnd in range(base["target_rounds"]):
        target_rounds.append([])
        for g in base["target_grids"]:
            for dim, heads in base["target_dims"]:
                for load in loads:
                    target_rounds[-1].append(dict(
                        common, **load, part="mixer_target", kind="mixer", mixers=["ssog", "sdpa"], mode="inference",
                        grid=g, dim=dim, num_heads=heads, num_components=4, ssog_backend="auto", round=rnd,
                        throughput_batch=base["target_batch"][g], repeats=args.repeats or base["target_repeats"][g],
                        throughput_repeats=args.repeats or base["target_repeats"][g], **warm_load(load, warm(0)),
                        check=g <= 28 and rnd == 0))
    cfgs += target_rounds[0] if target_rounds else []
    # 2. Backend table at 64x64 (one configuration per mixer, pooled over interleaved rounds).
    g = base["mixer_grid"]
    mixers = [("sdpa", None), ("math", None), ("ssog", "auto")] + [("ssog", b) for b in base["mixer_backends"]]
    for rnd in range(base["mixer_rounds"]):
        for mixer, backend in mixers:
            cfgs.append(dict(common, part="mixer", kind="mixer", mixer=mixer, mode="inference", grid=g,
                             ssog_backend=backend or "auto", repeats=args.repeats or (2 if args.quick else 3),
                             warmup=warm(0), round=rnd, **MIXER_ALONE))
    # 3. Whole models. The smallest and the largest resolution first (the 224 targets and the 1024
    # no-regression rows): if the time budget (--max-minutes) runs out, those survive.
    resolutions = sorted(resolutions)
    resolutions = resolutions[:1] + resolutions[-1:] + resolutions[1:-1] if len(resolutions) > 1 else resolutions
    modes = ["inference"] if args.no_train else ["inference", "train"]
    models = []
    for res in resolutions:
        for width in widths:
            for variant in variants:
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
                        mixers = ["ssog", "sdpa"]
                        if mode == "inference" and method != "dopri5" and (res, variant, width) in base["math_rows"]:
                            mixers.append("math")
                        row_loads = [dict(threads=threads)]
                        if mode == "inference" and method is None and (res, width, variant) in base["load_rows"]:
                            row_loads = loads
                        for load in row_loads:
                            cfg = dict(common, **load, part="model", kind="model", mixers=mixers, mode=mode,
                                       width=width, resolution=res, variant=variant, ssog_backend=args.ssog_backend,
                                       repeats=reps_b1(res, mode), throughput_repeats=reps(res), **warm_load(load, warm(res)),
                                       throughput_batch=tbatch(res, mode),
                                       check=mode == "inference" and res <= 384 and load == dict(threads=threads))
                            if method:
                                cfg.update(method=method, rk4_steps=PRESETS_DEPTH // 4)
                            models.append(cfg)
    # The later rounds of the mixer targets between the model rows, evenly: a slow spell of the machine that
    # lasts a minute then lands on one round of a target row, not on all its samples.
    R = max(1, len(target_rounds))  # with no target rows the models still run
    for r in range(1, R + 1):
        cfgs += models[(r - 1) * len(models) // R:r * len(models) // R]
        cfgs += target_rounds[r] if r < R else []
    return cfgs


def flatten(results: list[dict]) -> list[dict]:
    """One result per (configuration, mixer): a row worker's results are unpacked, the others kept."""
    out = []
    for r in results:
        if "results" in r:
            for sub in r["results"]:
                out.append(dict(sub, wall_s=r.get("wall_s"), threads_used=r.get("threads_used"),
                                solver=r.get("solver"), machine=r.get("machine")))
        elif "mixers" in r["config"]:  # the row worker itself failed (timeout, killed): every mixer failed
            for m in r["config"]["mixers"]:
                cfg = {k: v for k, v in r["config"].items() if k != "mixers"}
                out.append(dict(r, config=dict(cfg, mixer=m)))
        else:
            out.append(r)
    return out


PRESETS_DEPTH = 12  # every ti/s/b preset has depth 12


def _macs(cfg: dict, res: dict) -> int:
    if cfg["kind"] == "mixer":
        return bench.mixer_macs(cfg["mixer"], cfg["grid"], cfg["grid"], cfg["dim"], cfg["num_components"],
                                batch=cfg["batch_size"])
    dim = PRESETS[cfg["width"]]["dim"]
    evals = res.get("nfe") if cfg["variant"] == "ode" else None
    return bench.model_macs(cfg["mixer"], cfg["resolution"], dim=dim, depth=PRESETS_DEPTH, evaluations=evals,
                            batch=cfg["batch_size"])


def _key(cfg):
    return (cfg["kind"], cfg.get("width"), cfg.get("resolution"), cfg.get("variant"), cfg.get("method"), cfg["mode"],
            load_of(cfg))


def analyse(results: list[dict]) -> dict:
    """Group by setting; ratios of SSoG to both attention backends, next to the multiply-add ratio."""
    groups: dict = {}
    for r in results:
        cfg = r["config"]
        if cfg["kind"] == "mixer":
            continue
        r["macs"] = _macs(cfg, r) if r.get("status") == "ok" or cfg["variant"] != "ode" else None
        groups.setdefault(_key(cfg), {})[cfg["mixer"]] = r
    rows = []
    for key, by in groups.items():
        _, width, res, variant, method, mode, load = key
        row = dict(width=width, resolution=res, tokens=(res // 16) ** 2, variant=variant, method=method, mode=mode,
                   load=load)
        for m in ("ssog", "sdpa", "math"):
            r = by.get(m, {})
            tp = r.get("throughput") or {}
            row[m] = dict(status=r.get("status", "missing"), images_per_s=r.get("images_per_s"),
                          median_s=r.get("median_s"), spread=r.get("spread"), peak_bytes=r.get("peak_bytes"),
                          nfe=r.get("nfe"), macs=r.get("macs"), error=r.get("error"),
                          backend=r.get("ssog_backend_used"), check=r.get("check"),
                          tp_batch=tp.get("batch"), tp_median_s=tp.get("median_s"),
                          tp_images_per_s=tp.get("images_per_s"), tp_spread=tp.get("spread"))
        s = row["ssog"]
        for base in ("sdpa", "math"):
            b = row[base]
            ok = s["status"] == "ok" and b["status"] == "ok"
            row[f"speedup_vs_{base}"] = b["median_s"] / s["median_s"] if ok else None
            row[f"mac_ratio_vs_{base}"] = b["macs"] / s["macs"] if ok and b["macs"] and s["macs"] else None
            row[f"memory_ratio_vs_{base}"] = (s["peak_bytes"] / b["peak_bytes"]
                                              if ok and b["peak_bytes"] else None)
        sp, mr = row["speedup_vs_sdpa"], row["mac_ratio_vs_sdpa"]
        row["speedup_fraction_of_mac_ratio"] = sp / mr if sp and mr else None
        b = row["sdpa"]
        tp_ok = s["tp_median_s"] and b["tp_median_s"] and s["tp_batch"] == b["tp_batch"]
        row["throughput_batch"] = s["tp_batch"] if tp_ok else None
        row["tp_speedup_vs_sdpa"] = b["tp_median_s"] / s["tp_median_s"] if tp_ok else None
        row["tp_fraction_of_mac_ratio"] = row["tp_speedup_vs_sdpa"] / mr if tp_ok and mr else None
        rs, ra = by.get("ssog", {}), by.get("sdpa", {})
        row["fraction_ci"] = _fraction_ci(ra.get("times_s"), rs.get("times_s"), mr) if sp else None
        row["tp_fraction_ci"] = _fraction_ci(_tp_times(ra), _tp_times(rs), mr) if tp_ok else None
        row["rounds"] = [len(rs.get("times_s") or []), len(_tp_times(rs) or [])]  # timed samples per mixer
        row["other_load"] = other_share(rs.get("machine"))
        solver = (by.get("ssog") or {}).get("solver") or {}
        row["solver_s"] = solver.get("median_s") if solver.get("status", "ok") == "ok" else None
        row["solver_nfe"] = solver.get("nfe")
        # the same ratios with the solver's own work (the same for both mixers, no multiply-adds) taken out of both
        st = row["solver_s"]
        ok = st is not None and s["status"] == "ok" and b["status"] == "ok" and s["median_s"] > st
        row["speedup_without_solver"] = (b["median_s"] - st) / (s["median_s"] - st) if ok else None
        row["fraction_without_solver"] = row["speedup_without_solver"] / mr if ok and mr else None
        rows.append(row)
    return {"rows": rows}


def other_share(machine: dict | None) -> float | None:
    """The share of the machine's CPU time that went to other processes or to the hypervisor (steal) while a
    row's worker ran (`bench.other_load`); None where it was not recorded."""
    return None if not machine else machine["others"] + machine["steal"]


def _tp_times(r: dict) -> list[float] | None:
    return (r.get("throughput") or {}).get("times_s")


def _fraction_ci(base_times, ssog_times, mac_ratio) -> list[float] | None:
    """95 % interval of (speed-up over the base / MAC ratio) from a row's interleaved samples (bench.ratio_interval)."""
    iv = bench.ratio_interval(base_times or [], ssog_times or []) if mac_ratio else None
    return [iv[0] / mac_ratio, iv[1] / mac_ratio] if iv else None


def pool_target_rounds(rounds: list[dict]) -> dict:
    """One mixer's results of a target row over its rounds (in round order) as one result, each round's timed
    samples kept apart (`round_times_s`, batch 1 and the throughput batch), so that a speed-up is formed within a
    round; median_s is the median of the rounds' medians. A round skipped by the time budget is left out, any
    other failure is the pooled result's status; the output check from the round that made one."""
    done = [r for r in rounds if r.get("status") != "skipped"]
    if not done:
        return rounds[0] if rounds else {}
    bad = next((r for r in done if r.get("status") != "ok"), None)
    if bad is not None:
        return bad
    out = dict(done[0], rounds=len(done), round_times_s=[r["times_s"] for r in done],
               round_machine=[r.get("machine") for r in done],
               median_s=statistics.median(r["median_s"] for r in done))
    if all(r.get("throughput") for r in done):
        out["throughput"] = dict(done[0]["throughput"], round_times_s=[r["throughput"]["times_s"] for r in done],
                                 median_s=statistics.median(r["throughput"]["median_s"] for r in done))
    else:
        out.pop("throughput", None)
    check = next((r["check"] for r in done if "check" in r), None)
    if check is not None:
        out["check"] = check
    return out


def target_rows(results: list[dict]) -> list[dict]:
    """Mixer-alone targets: SSoG against fused SDPA per grid, width and load, at batch 1 and at the
    throughput batch, with the multiply-add ratio and their quotient. A row measured in rounds
    (pool_target_rounds): its speed-up is the median over rounds of each round's speed-up (bench.rounds_ratio),
    every round's fraction kept beside it; the times shown are medians over rounds of each round's median."""
    groups: dict = {}
    for r in results:
        cfg = r["config"]
        if cfg.get("part") != "mixer_target":
            continue
        groups.setdefault((cfg["grid"], cfg["dim"], cfg["num_heads"], load_of(cfg)), {}).setdefault(
            cfg["mixer"], []).append(r)
    rows = []
    for (g, dim, heads, load), by_rounds in groups.items():
        by = {m: pool_target_rounds(sorted(rs, key=lambda r: r["config"].get("round", 0)))
              for m, rs in by_rounds.items()}
        s, a = by.get("ssog", {}), by.get("sdpa", {})
        mr = bench.mixer_macs("sdpa", g, g, dim) / bench.mixer_macs("ssog", g, g, dim)
        ok = s.get("status") == "ok" and a.get("status") == "ok"
        row = dict(grid=g, dim=dim, heads=heads, load=load, mac_ratio=mr, status=(s.get("status"), a.get("status")),
                   check_ok=all((x.get("check") or {}).get("ok", True) for x in (s, a)),
                   checked=any("check" in x for x in (s, a)), rounds=s.get("rounds", 0) if ok else 0,
                   round_other_load=[other_share(m) for m in s.get("round_machine", [])] if ok else [])
        for tag in ("b1", "tp"):
            rs_, ra_ = (s, a) if tag == "b1" else (s.get("throughput") or {}, a.get("throughput") or {})
            runs_s, runs_a = rs_.get("round_times_s"), ra_.get("round_times_s")
            have = ok and bool(runs_s) and bool(runs_a) and len(runs_s) == len(runs_a)
            row[f"{tag}_batch"] = (s["config"].get("batch_size", 1) if tag == "b1" else rs_.get("batch")) if ok else None
            row[f"{tag}_ssog_ms"] = rs_["median_s"] * 1e3 if have else None
            row[f"{tag}_sdpa_ms"] = ra_["median_s"] * 1e3 if have else None
            row[f"{tag}_speedup"] = bench.rounds_ratio(runs_a, runs_s) if have else None
            row[f"{tag}_fraction"] = row[f"{tag}_speedup"] / mr if have else None
            iv = bench.rounds_ratio_interval(runs_a, runs_s) if have else None
            row[f"{tag}_fraction_ci"] = [iv[0] / mr, iv[1] / mr] if iv else None
            row[f"{tag}_round_fractions"] = [x / mr for x in bench.run_ratios(runs_a, runs_s)] \
                if have and len(runs_s) > 1 else None
        rows.append(row)
    return rows


def pool_rounds(results: list[dict]) -> list[dict]:
    """One result per mixer-alone configuration, its rounds pooled: every timed repeat, median and
    spread over all of them, the largest peak; a configuration that failed in any round keeps that status."""
    pooled: dict = {}
    for r in results:
        cfg = r["config"]
        if cfg["kind"] != "mixer" or cfg.get("part") == "mixer_target":
            continue
        key = (cfg["mixer"], cfg.get("ssog_backend"))
        if key not in pooled:
            pooled[key] = dict(r, config={k: v for k, v in cfg.items() if k != "round"}, rounds=0, times_s=[])
        p = pooled[key]
        p["rounds"] += 1
        if r.get("status") != "ok":
            p.update(status=r.get("status"), error=r.get("error"))
        elif p.get("status") == "ok":
            p["times_s"] = p["times_s"] + r["times_s"]
            p["peak_bytes"] = max(p["peak_bytes"], r["peak_bytes"])
    for p in pooled.values():
        if p.get("status") == "ok":
            p.update(bench.summarize(p["times_s"]))
    return list(pooled.values())


def mixer_table(results: list[dict]) -> tuple[list[dict], str]:
    rows = []
    results = pool_rounds(results)
    ref = next((r for r in results if r["config"]["mixer"] == "sdpa"), None)
    for r in results:
        cfg = r["config"]
        macs = bench.mixer_macs(cfg["mixer"], cfg["grid"], cfg["grid"], cfg["dim"], cfg["num_components"],
                                batch=cfg["batch_size"])
        name = LABEL[cfg["mixer"]] + (f" [{cfg['ssog_backend']}]" if cfg["mixer"] == "ssog" else "")
        ok = r.get("status") == "ok"
        speed = (ref["median_s"] / r["median_s"]) if ok and ref and ref.get("status") == "ok" else None
        rows.append(dict(name=name, mixer=cfg["mixer"], grid=cfg["grid"],
                         backend=cfg["ssog_backend"] if cfg["mixer"] == "ssog" else None,
                         status=r.get("status"), median_s=r.get("median_s"), spread=r.get("spread"),
                         rounds=r.get("rounds", 1), gmac=macs / 1e9,
                         gmac_per_s=(macs / 1e9 / r["median_s"]) if ok else None,
                         peak_mb=(r["peak_bytes"] / 2**20) if ok else None, speedup_vs_sdpa=speed, error=r.get("error")))
    table = report.md_table(
        ["mixer", "GMAC", "median ms", "spread", "GMAC/s", "peak MB", "speed-up vs fused SDPA", "status"],
        [[x["name"], x["gmac"], _f(x["median_s"], 1e3), _f(x["spread"]), _f(x["gmac_per_s"]), _f(x["peak_mb"]),
          _f(x["speedup_vs_sdpa"]), x["status"]] for x in rows])
    return rows, table


def _f(x, scale=1.0):
    return "-" if x is None else f"{x * scale:.3g}"


def _fci(x, ci):
    """A fraction with its 95 % interval: 0.91 [0.87, 0.93]."""
    return _f(x) if x is None or not ci else f"{x:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"


def _rounds(fracs) -> str:
    """The lowest and highest single-round fraction of a target row: ' {0.84-0.95}'; '' for one round."""
    return f" {{{min(fracs):.2f}-{max(fracs):.2f}}}" if fracs else ""


OTHER_LOAD_NOTED = 0.1  # a row process beside more than this share of other work is counted in section 0


def _other_pct(shares, where: str = "") -> str:
    """' (other load 12 %)' or ' (other load in its rounds 3/40/2 %)'; '' where nothing was recorded."""
    shares = [x for x in shares or [] if x is not None]
    if not shares:
        return ""
    return f" (other load{' ' + where if where else ''} " + "/".join(f"{100 * x:.0f}" for x in shares) + " %)"


def _interval_note(items, target: float, label) -> tuple[str, dict]:
    """How many of the (value, interval, item) that meet `target` keep their whole 95 % interval at or above it, and
    which are on the line (the point meets it, the interval reaches below)."""
    met = [(v, ci, it) for v, ci, it in items if v >= target]
    line = [(v, ci, it) for v, ci, it in met if ci and ci[0] < target]
    clear = [x for x in met if x[1] and x[1][0] >= target]
    text = (f" Bootstrap 95 % intervals of the fraction (rounds of the interleaved samples resampled): "
            f"{len(clear)} of the {len(met)} that meet it keep the whole interval at or above {target:g}"
            + ("; on the line: " + "; ".join(f"{label(it)} {_fci(v, ci)}" for v, ci, it in line) if line else "")
            + (f"; {len(met) - len(clear) - len(line)} without an interval (fewer than 3 samples)"
               if len(met) - len(clear) - len(line) else "") + ".")
    return text, dict(clear=len(clear), on_the_line=[dict(row=label(it), fraction=v, interval=ci) for v, ci, it in line])


def _mem(r):
    if r["status"] == "missing":  # not planned for this row
        return "-"
    if r["status"] != "ok":
        return r["status"].upper()
    return f"{r['peak_bytes'] / 2**20:.0f}"


def _check(row) -> str:
    checks = [row[m].get("check") for m in ("ssog", "sdpa", "math") if row[m].get("check")]
    if not checks:
        return "-"
    worst = max(c["max_rel_err"] for c in checks)
    return ("ok " if all(c["ok"] for c in checks) else "FAILED ") + f"{worst:.1e}"


def _primary_load(rows) -> str | None:
    """The load most rows were measured under (the pinned one); figures and fits use those rows."""
    loads = [r.get("load", "-") for r in rows]
    return max(set(loads), key=loads.count) if loads else None


def _targets_md(targets: list[dict], rows: list[dict], must: dict) -> list[str]:
    """Section 0 (every target of the benchmark with its measured number) and section 1a (the mixer rows)."""
    md = ["## 0. Targets, as measured", ""]
    lines = []
    # mixer alone >= 0.8 of its MAC ratio
    t1 = [t for t in targets if t["b1_fraction"] is not None]
    if t1:
        fr = [(t, tag) for t in t1 for tag in ("b1", "tp") if t[f"{tag}_fraction"] is not None]
        miss = [(t, tag) for t, tag in fr if t[f"{tag}_fraction"] < 0.8]
        quiet = [(t, tag) for t, tag in fr if t["load"] != "default threads, busy core"]
        qmiss = [(t, tag) for t, tag in quiet if t[f"{tag}_fraction"] < 0.8]
        must["mixer_fraction_target"] = dict(rows=len(quiet), missed=len(qmiss),
                                             min_fraction=min((t[f"{tag}_fraction"] for t, tag in quiet), default=None))
        lines.append(f"- Mixer alone (14x14, 28x28, 64x64; C = 192, 384), measured speed-up over fused SDPA >= 0.8 of "
                     f"the multiply-add ratio, without a busy process: "
                     + ("holds in all " + str(len(quiet)) + " measurements" if not qmiss else
                        f"**missed in {len(qmiss)} of {len(quiet)}**: " + "; ".join(
                            f"{t['grid']}x{t['grid']} C={t['dim']} {t['load']} batch {t[tag + '_batch']}: "
                            f"{t[tag + '_fraction']:.2f}" + _other_pct(t.get("round_other_load"), "in its rounds")
                            for t, tag in qmiss))
                     + f" (lowest {must['mixer_fraction_target']['min_fraction']:.2f}). With the busy core: "
                     + f"{len(fr) - len(quiet) - len([m for m in miss if m[0]['load'] == 'default threads, busy core'])}"
                     + f" of {len(fr) - len(quiet)} at >= 0.8.")
        note, stats = _interval_note([(t[f"{tag}_fraction"], t.get(f"{tag}_fraction_ci"), (t, tag)) for t, tag in quiet],
                                     0.8, lambda x: f"{x[0]['grid']}x{x[0]['grid']} C={x[0]['dim']} {x[0]['load']} "
                                                    f"batch {x[0][x[1] + '_batch']}")
        lines[-1] += note
        must["mixer_fraction_target"].update(stats)
        single = [(t, tag, f, o) for t, tag in quiet  # each round's fraction with that round's other load
                  for f, o in zip(t.get(f"{tag}_round_fractions") or [], t.get("round_other_load") or itertools.repeat(None))]
        if single:  # the rows' single rounds, said plainly: a round can miss where the row does not
            low = [(t, tag, f, o) for t, tag, f, o in single if f < 0.8]
            must["mixer_fraction_target"]["single_rounds"] = dict(rounds=len(single), below=len(low))
            lines[-1] += (f" Single rounds (of the {len(quiet)} measurements): {len(single) - len(low)} of "
                          f"{len(single)} at >= 0.8" + ("; below: " + "; ".join(
                              f"{t['grid']}x{t['grid']} C={t['dim']} {t['load']} batch {t[tag + '_batch']}: {f:.2f}"
                              + _other_pct([o]) for t, tag, f, o in low) if low else "") + ".")
        if any(t["checked"] for t in targets):
            bad = [t for t in targets if t["checked"] and not t["check_ok"]]
            lines.append("- Mixer outputs (float64, against the einsum reference path and explicit softmax): "
                         + ("all agree to 1e-10 relative" if not bad else f"**{len(bad)} rows disagree**"))
    # busy core at 64x64
    busy = []
    for t in targets:
        if t["grid"] != 64 or t["load"] != "default threads, busy core":
            continue
        q = next((u for u in targets if u["grid"] == 64 and u["dim"] == t["dim"] and u["load"] == "default threads"), None)
        for tag in ("b1", "tp"):
            if q and q[f"{tag}_speedup"] and t[f"{tag}_speedup"]:
                busy.append(dict(dim=t["dim"], batch=t[f"{tag}_batch"], quiet=q[f"{tag}_speedup"],
                                 busy=t[f"{tag}_speedup"], kept=t[f"{tag}_speedup"] / q[f"{tag}_speedup"]))
    if busy:
        must["busy_core_64"] = busy
        lines.append("- With one core busy, the 64x64 mixer keeps >= 0.5 of its default-thread speed-up over fused SDPA: "
                     + "; ".join(f"C={b['dim']} batch {b['batch']}: {b['busy']:.2f}x busy / {b['quiet']:.2f}x default "
                                 f"= {b['kept']:.2f} ({'holds' if b['kept'] >= 0.5 else '**missed**'})" for b in busy))
    # whole models >= 0.9 of the MAC ratio
    prim = _primary_load(rows)
    fr = [(r, tag) for r in rows for tag in ("", "tp_")
          if r.get("load", "-") == prim and r["method"] != "dopri5"
          and r.get(f"{tag}fraction_of_mac_ratio" if tag else "speedup_fraction_of_mac_ratio") is not None]
    val = lambda r, tag: r["tp_fraction_of_mac_ratio"] if tag else r["speedup_fraction_of_mac_ratio"]
    if fr:
        miss = [(r, tag) for r, tag in fr if val(r, tag) < 0.9]
        must["model_fraction_target"] = dict(load=prim, rows=len(fr), missed=len(miss),
                                             min_fraction=min(val(r, tag) for r, tag in fr))
        lines.append(f"- Whole models ({prim}; every measured width, variant, resolution and mode, batch 1 and the "
                     f"throughput batch): SSoG throughput >= 0.9 x (MAC ratio) x fused-SDPA throughput: "
                     + (f"holds in all {len(fr)}" if not miss else f"**missed in {len(miss)} of {len(fr)}**: " + "; ".join(
                         f"{r['width']} {r['resolution']} {r['variant']} {r['mode']} "
                         f"{'batch ' + str(r['throughput_batch']) if tag else 'batch 1'}: {val(r, tag):.2f}"
                         + (f" ({r['fraction_without_solver']:.2f} without the ODE solver's own work, section 2)"
                            if not tag and r.get("fraction_without_solver") else "") + _other_pct([r.get("other_load")])
                         for r, tag in miss))
                     + f" (lowest {must['model_fraction_target']['min_fraction']:.2f}).")
        ci = lambda r, tag: r.get("tp_fraction_ci") if tag else r.get("fraction_ci")
        note, stats = _interval_note([(val(r, tag), ci(r, tag), (r, tag)) for r, tag in fr], 0.9,
                                     lambda x: f"{x[0]['width']} {x[0]['resolution']} {x[0]['variant']} {x[0]['mode']} "
                                               f"{'batch ' + str(x[0]['throughput_batch']) if x[1] else 'batch 1'}")
        lines[-1] += note
        must["model_fraction_target"].update(stats)
        at224 = [(r, tag) for r, tag in fr if r["resolution"] == 224]
        if at224:
            sp = lambda r, tag: r["tp_speedup_vs_sdpa"] if tag else r["speedup_vs_sdpa"]
            slow = [(r, tag) for r, tag in at224 if sp(r, tag) <= 1.0]
            lines.append("- At 224, SSoG faster than fused SDPA in every row: "
                         + ("holds (" + ", ".join(f"{r['width']} {r['variant']} {r['mode']} "
                                                   f"{'B' + str(r['throughput_batch']) if tag else 'B1'} {sp(r, tag):.2f}x"
                                                   for r, tag in at224) + ")" if not slow else
                            "**missed** in " + ", ".join(f"{r['width']} {r['variant']} {r['mode']} "
                                                         f"{'B' + str(r['throughput_batch']) if tag else 'B1'} "
                                                         f"({sp(r, tag):.2f}x)" for r, tag in slow)))
    procs = [x for t in targets for x in t.get("round_other_load") or []] + [r.get("other_load") for r in rows]
    procs = [x for x in procs if x is not None]
    annotated = "(other load" in "".join(lines)
    if procs:  # what else the machine did: the context of every number above
        hi = sum(x > OTHER_LOAD_NOTED for x in procs)
        must["other_load"] = dict(processes=len(procs), median=statistics.median(procs), max=max(procs), above=hi)
        lines.append(f"- Other work on the machine while the rows ran (CPU time of processes other than the benchmark's, "
                     f"plus time the hypervisor gave to other machines, as a share of all CPU time while a row's process "
                     f"ran; `bench.other_load`): median {100 * statistics.median(procs):.0f} %, highest "
                     f"{100 * max(procs):.0f} %, above {100 * OTHER_LOAD_NOTED:.0f} % in {hi} of {len(procs)} row "
                     "processes. A number measured beside other work says less about the code than one measured "
                     "without" + ("; each number below its line above carries its own." if annotated else "."))
    md += lines + [""] if lines else ["(no target rows in this run)", ""]
    if targets:
        md += ["## 1a. Mixer alone: SSoG (auto backend) against fused SDPA", "",
               "Forward with projections, 4 components, eval, no grad; both mixers timed alternately in one process, "
               "at batch 1 and at the throughput batch (with more than one thread after eight untimed steps per batch "
               "size, in which SSoG's thread policy times both thread counts). "
               f"Each row ran in {max(t['rounds'] for t in targets)} round(s), each in its own process, spread over "
               "the run (the first before the backend table, the others between the model rows), and its samples are "
               "combined: a slow spell of the machine lands on one round, not on the whole row. Each round's speed-up "
               "is formed from its own samples (SSoG and SDPA alternating), and `x vs SDPA` is the median over rounds "
               "of those speed-ups (the machine's speed differs between rounds minutes apart, so it is not the "
               "quotient of the time columns, which are medians over rounds of each round's median). "
               "`frac` = that speed-up / multiply-add ratio (target >= 0.8), with its bootstrap 95 % interval (samples "
               "resampled within each round) and, in braces, the lowest and highest fraction of a single round.",
               ""]
        trows = [[f"{t['grid']}x{t['grid']}", t["dim"], t["load"], _f(t["mac_ratio"]),
                  t["b1_batch"] or "-", _f(t["b1_ssog_ms"]), _f(t["b1_sdpa_ms"]), _f(t["b1_speedup"]),
                  _fci(t["b1_fraction"], t.get("b1_fraction_ci")) + _rounds(t.get("b1_round_fractions")),
                  t["tp_batch"] or "-", _f(t["tp_ssog_ms"]), _f(t["tp_sdpa_ms"]), _f(t["tp_speedup"]),
                  _fci(t["tp_fraction"], t.get("tp_fraction_ci")) + _rounds(t.get("tp_round_fractions")),
                  "ok" if t["check_ok"] and t["checked"] else ("-" if not t["checked"] else "FAILED")]
                 for t in sorted(targets, key=lambda t: (t["grid"], t["dim"], list(LOADS).index(t["load"])
                                                          if t["load"] in LOADS else 9))]
        md += [report.md_table(["grid", "C", "load", "MAC ratio", "B", "SSoG ms", "SDPA ms", "x vs SDPA", "frac",
                                "TB", "SSoG ms @TB", "SDPA ms @TB", "x vs SDPA @TB", "frac @TB", "output check"], trows), ""]
    return md


def _solver_md(rows: list[dict], must: dict) -> list[str]:
    """The ODE rows' solver work: time per forward of the fixed-step solver on a vector field that costs nothing
    (bench.solver_seconds), its share of each model's time, and the ratios with it taken out of both."""
    srows = [r for r in rows if r.get("solver_s") is not None]
    if not srows:
        return []
    must["ode_solver"] = [dict(width=r["width"], resolution=r["resolution"], method=r["method"], load=r.get("load"),
                               nfe=r.get("solver_nfe"), solver_s=r["solver_s"], ssog_s=r["ssog"]["median_s"],
                               sdpa_s=r["sdpa"]["median_s"], fraction=r["speedup_fraction_of_mac_ratio"],
                               fraction_without_solver=r["fraction_without_solver"]) for r in srows]
    share = lambda r, m: _f(100 * r["solver_s"] / r[m]["median_s"]) + " %" if r[m]["median_s"] else "-"
    table = [[r["width"], r["resolution"], r["method"], r.get("load", "-"), r.get("solver_nfe") or "-",
              _f(1e3 * r["solver_s"]), _f(1e3 * r["ssog"]["median_s"]) if r["ssog"]["median_s"] else "-",
              _f(1e3 * r["sdpa"]["median_s"]) if r["sdpa"]["median_s"] else "-", share(r, "ssog"), share(r, "sdpa"),
              _f(r["speedup_fraction_of_mac_ratio"]), _f(r["fraction_without_solver"])] for r in srows]
    return ["### The ODE solver's own work (batch 1, inference)", "",
            "The fixed-step solver's arithmetic on the state (torchdiffeq's stage combinations and copies of the "
            "solution, lipcheck's NFE and finiteness watch), timed in the row's process on the row's own embedded "
            "input and step grid with a vector field that costs nothing (`bench.solver_seconds`): it is the same "
            "for both mixers and no multiply-add count includes it, so it weighs on the faster model's ratio. "
            "`frac` is the table's; `frac w/o solver` the same quotient with the solver's time taken out of both "
            "models' times. The targets above are judged on `frac`.", "",
            report.md_table(["width", "res", "method", "load", "NFE", "solver ms", "SSoG ms", "SDPA ms",
                             "solver / SSoG", "solver / SDPA", "frac", "frac w/o solver"], table), ""]


def _ips(r):
    if r["status"] == "missing":
        return "-"
    return f"{r['images_per_s']:.3g}" if r["status"] == "ok" else r["status"].upper()


def fits(rows: list[dict]) -> dict:
    """Fitted exponents against the token count N: time per image of each mixer (inference) and the
    measured SSoG speed-up, per width and variant; the multiply-add ratio's exponent beside them.
    Only the rows of the primary load (the pinned thread count) enter."""
    out = {}
    prim = _primary_load(rows)
    rows = [r for r in rows if r.get("load", "-") == prim]
    for r0 in rows:
        if r0["mode"] != "inference" or r0["method"] == "dopri5":
            continue
        key = f"{r0['width']}/{r0['variant']}"
        if key in out:
            continue
        sel = sorted([r for r in rows if r["width"] == r0["width"] and r["variant"] == r0["variant"]
                      and r["mode"] == "inference" and r["method"] != "dopri5"], key=lambda r: r["tokens"])
        N = [r["tokens"] for r in sel]
        ent = {"tokens": N}
        for m in ("ssog", "sdpa", "math"):
            pts = [(r["tokens"], r[m]["median_s"]) for r in sel if r[m]["status"] == "ok"]
            ent[f"time_exponent_{m}"] = bench.fit_exponent(*zip(*pts)) if len(pts) >= 2 else None
        for name in ("speedup_vs_sdpa", "mac_ratio_vs_sdpa", "speedup_vs_math"):
            pts = [(r["tokens"], r[name]) for r in sel if r[name]]
            ent[f"{name}_exponent"] = bench.fit_exponent(*zip(*pts)) if len(pts) >= 2 else None
            ent[name] = [r[name] for r in sel]
        # Monotone growth of the measured ratio with resolution.
        sp = [r["speedup_vs_sdpa"] for r in sel if r["speedup_vs_sdpa"]]
        ent["speedup_vs_sdpa_increasing"] = all(b >= a for a, b in zip(sp, sp[1:])) if len(sp) >= 2 else None
        out[key] = ent
    return out


def _ticks(ax, Ns):
    """Tick labels at the measured token counts only (log axes otherwise print overlapping minor labels)."""
    from matplotlib.ticker import NullFormatter
    ax.set_xticks(sorted(set(Ns)))
    ax.set_xticklabels([str(n) for n in sorted(set(Ns))], fontsize=7)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def figures(rows, st, docs):
    import matplotlib.pyplot as plt
    prim = _primary_load(rows)
    rows = [r for r in rows if r.get("load", "-") == prim]
    sel_rows = [r for r in rows if r["mode"] == "inference" and r["variant"] == "discrete"]
    widths = sorted({r["width"] for r in sel_rows}, key=lambda w: PRESETS[w]["dim"])
    paths = []
    if not widths:
        return paths
    colors = {"ssog": "C0", "sdpa": "C1", "math": "C3"}
    for what, ylabel, name in (("median_s", "seconds per image (inference, discrete)", "throughput_time"),
                               ("peak_bytes", "peak memory added by the step, MB (inference, discrete)",
                                "throughput_memory")):
        fig, axes = plt.subplots(1, len(widths), figsize=(5.2 * len(widths), 4.2), squeeze=False)
        for ax, w in zip(axes[0], widths):
            sel = sorted([r for r in sel_rows if r["width"] == w], key=lambda r: r["tokens"])
            for m in ("ssog", "sdpa", "math"):
                pts = [(r["tokens"], r[m][what] / (2**20 if what == "peak_bytes" else 1)) for r in sel
                       if r[m]["status"] == "ok" and r[m][what]]
                if pts:
                    ax.loglog(*zip(*pts), "o-", color=colors[m], label=LABEL[m])
            ref = [(r["tokens"], r["sdpa"][what] / (2**20 if what == "peak_bytes" else 1)) for r in sel
                   if r["sdpa"]["status"] == "ok" and r["sdpa"][what]]
            if len(ref) >= 2:
                N0, y0 = ref[-1]
                Ns = [r["tokens"] for r in sel]
                for p, ls in ((2.0, ":"), (1.5, "--")):
                    ax.loglog(Ns, [y0 * (n / N0) ** p for n in Ns], ls, color="0.5", lw=1,
                              label=f"slope N^{p:g}")
            _ticks(ax, [r["tokens"] for r in sel])
            ax.set_xlabel("tokens N = (resolution / 16)^2")
            ax.set_ylabel(ylabel)
            ax.set_title(f"width {w} (C={PRESETS[w]['dim']})")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        paths.append(report.save_figure(fig, name, st, docs=docs))
    # Measured speed-up against the multiply-add ratio.
    fig, axes = plt.subplots(1, len(widths), figsize=(5.2 * len(widths), 4.2), squeeze=False)
    for ax, w in zip(axes[0], widths):
        for v, mk in (("discrete", "o"), ("looped", "s"), ("ode", "^")):
            sel = sorted([r for r in rows if r["width"] == w and r["variant"] == v and r["mode"] == "inference"
                          and r["method"] != "dopri5" and r["speedup_vs_sdpa"]], key=lambda r: r["tokens"])
            if sel:
                ax.loglog([r["tokens"] for r in sel], [r["speedup_vs_sdpa"] for r in sel], mk + "-",
                          label=f"measured vs fused SDPA, {v}")
        sel = sorted([r for r in rows if r["width"] == w and r["variant"] == "discrete" and r["mac_ratio_vs_sdpa"]
                      and r["mode"] == "inference"], key=lambda r: r["tokens"])
        if sel:
            ax.loglog([r["tokens"] for r in sel], [r["mac_ratio_vs_sdpa"] for r in sel], "k--",
                      label="multiply-add ratio (dense axis factors)")
        _ticks(ax, [r["tokens"] for r in rows if r["width"] == w])
        yt = [0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8]
        ax.set_yticks(yt)
        ax.set_yticklabels([f"{t:g}" for t in yt])
        ax.set_xlabel("tokens N")
        ax.set_ylabel("attention time / SSoG time")
        ax.set_title(f"width {w}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    paths.append(report.save_figure(fig, "throughput_ratio", st, docs=docs))
    return paths


def render(mixer_rows, mixer_md, rows, fit, device_str, args, threads, elapsed, targets=None,
           load_note="") -> tuple[str, dict]:
    must = {}
    md = ["# Throughput and peak memory: SSoG against dense attention", ""]
    md += [f"Device: **{device_str}** (the torch default; the benchmark pinned {threads} thread(s) per configuration "
           "except in the rows marked with another load), float32"
           + (" with bfloat16 autocast" if args.bf16 else "") + f", batch size {args.batch_size} and a throughput batch "
           f"per row. Every row ran in its own process; the benchmark took {elapsed / 60:.1f} min. {load_note} "
           "Timings on a CPU shared with other work are noisy: within a row the mixers were timed alternately "
           "(SSoG, attention, SSoG, ...) in one process, so a slow spell lands on both, and ratios are of medians; a timed "
           f"sample is one step, or, for steps shorter than {bench.MIN_BLOCK_S * 1e3:.0f} ms, the mean of as many consecutive "
           "steps as run in that time after the warm-up (counted by running them: `bench.steps_per_block`), so that a step of half a "
           "millisecond is not timed with the caches the other model's step left behind. Peak memory is what the measured step adds: on CPU the peak resident "
           "size during the step minus the resident size just before it (model and input already in place); "
           "on CUDA `max_memory_allocated` after a reset. The CUDA path (CUDA events, `max_memory_allocated`, "
           "bf16 autocast) is written but was not run for this report unless the device above says cuda.", "",
           "CPU allocator: the timed steps run with glibc malloc keeping and reusing freed blocks up to 32 MB "
           "(`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`), as PyTorch's CUDA allocator does and as a "
           "tuned CPU deployment does with jemalloc or tcmalloc. With every large tensor a fresh mmap instead, "
           "the kernel zeroes each page on first touch, a cost per byte allocated rather than per multiply-add: "
           "it slowed the SSoG mixer at 64x64 by 1.7x and fused SDPA by 2%, so it would measure page faults, "
           "not mixing. Peak memory comes from one further step per configuration, after the allocator is "
           "switched to returning every block of 128 kB and more to the OS and its free pages are released "
           "(`lipcheck.bench`, module docstring).", ""]
    md += _targets_md(targets or [], rows, must)
    # 1. mixer alone
    sd = next((x for x in mixer_rows if x["mixer"] == "sdpa"), None)
    best = max((x for x in mixer_rows if x["mixer"] == "ssog" and x["speedup_vs_sdpa"]),
               key=lambda x: x["speedup_vs_sdpa"], default=None)
    auto = next((x for x in mixer_rows if x["mixer"] == "ssog" and x["backend"] == "auto"), None)
    g = mixer_rows[0]["gmac"] if mixer_rows else None
    mac_ratio = (sd["gmac"] / auto["gmac"]) if sd and auto else None
    grid = mixer_rows[0]["grid"] if mixer_rows else (QUICK if args.quick else FULL)["mixer_grid"]
    md += [f"## 1b. SSoG backends, mixer alone: {grid}x{grid} grid, C=384, 6 heads, 4 components, forward, "
           "one configuration per process", "",
           f"Multiply-add ratio with dense axis factors: {_f(mac_ratio)}x "
           f"({_f(sd['gmac'] if sd else None)} vs {_f(auto['gmac'] if auto else None)} GMAC). "
           "The truncated and FFT backends do fewer multiply-adds than the GMAC column (which counts dense factors). "
           f"The whole set ran in {max((x['rounds'] for x in mixer_rows), default=1)} interleaved round(s), "
           "each mixer's timed repeats pooled over them (median, spread = (max - min) / median), so that a slow "
           "spell of the machine falls on every mixer alike.", "",
           mixer_md, ""]
    if auto and auto["speedup_vs_sdpa"]:
        measured = (f"Measured with `auto`: {auto['speedup_vs_sdpa']:.2f}x; best backend ({best['name']}): "
                    f"{best['speedup_vs_sdpa']:.2f}x")
        must["1_mixer_speedup_auto"] = auto["speedup_vs_sdpa"]
        must["1_mixer_speedup_best_backend"] = best["speedup_vs_sdpa"] if best else None
        if grid == 64:
            ok = auto["speedup_vs_sdpa"] >= 7.6
            must["1_holds"] = ok
            verdict = ("Holds." if ok else "Does not hold on this run; the GMAC/s column shows where the time goes.")
        else:  # the target is stated for 64x64 only
            must["1_holds"] = None
            verdict = (f"Quick run: a {grid}x{grid} grid, where the multiply-add ratio is {_f(mac_ratio)}x; "
                       "the 7.6x target is for 64x64 (the full run).")
        md += [f"**Target (64x64): SSoG at least 7.6x faster than fused SDPA.** {measured}. {verdict}", ""]
    # 2. whole models
    md += ["## 2. Whole models", "",
           "Images/s and the peak memory (MB) the step adds. `x vs SDPA` is SSoG's measured speed-up over fused "
           "SDPA, `MAC ratio` the analytic multiply-add ratio with dense SSoG axis factors (counted with each "
           "model's own NFE for the ODE), `frac` their quotient (target >= 0.9) with its bootstrap 95 % interval "
           "(whole rounds of the interleaved samples resampled, 4000 times: `bench.ratio_interval`), `mem/math` SSoG's peak over "
           "explicit attention's (target <= 0.4), `mem/SDPA` over fused SDPA's. ODE rk4 uses 3 steps "
           "(NFE 12 = depth, the discrete model's cost); dopri5 rtol = atol = 1e-3 with its NFE as counted. "
           "`TB` is the row's throughput batch (timed in the same process after batch 1, after at least two untimed "
           "steps; `@TB` columns), `rounds` the timed samples per mixer at batch 1 / at TB, "
           "`load` the thread setting (`1 thread` pinned; `default threads` torch's count; `busy core` with a "
           "spinning competing process started by the benchmark; rows with more than one thread start each batch "
           "size with eight untimed steps, in which SSoG's thread policy times both thread counts), "
           "`output check` the float64 comparison of the "
           "timed model against its reference paths (largest relative error). "
           "To fit the CPU budget the full run measures training steps at 224 (every variant), 512 and 1024 "
           "(discrete; s up to 512), the looped model (the discrete model's operations with one block's weights) "
           "at 224 and 1024, the ODE at 224, 512 and 1024, explicit attention at 1024 (discrete ti), "
           "dopri5 at 224; rows missing below were not planned, rows marked SKIPPED ran out of the time budget.", ""]
    header = ["width", "res", "N", "variant", "mode", "load", "SSoG img/s", "SDPA img/s", "math img/s", "x vs SDPA",
              "MAC ratio", "frac", "rounds", "TB", "SSoG img/s @TB", "SDPA img/s @TB", "x vs SDPA @TB", "frac @TB",
              "x vs math", "SSoG MB", "SDPA MB", "math MB", "mem/math", "mem/SDPA", "NFE s/a", "SSoG backend", "output check"]
    table = []
    for r in rows:
        v = r["variant"] + (f" ({r['method']})" if r["method"] else "")
        nfe = f"{r['ssog']['nfe']}/{r['sdpa']['nfe']}" if r["ssog"]["nfe"] is not None else "-"
        tpi = lambda m: _f(r[m].get("tp_images_per_s")) if r.get("throughput_batch") else "-"
        table.append([r["width"], r["resolution"], r["tokens"], v, r["mode"], r.get("load", "-"), _ips(r["ssog"]),
                      _ips(r["sdpa"]), _ips(r["math"]), _f(r["speedup_vs_sdpa"]), _f(r["mac_ratio_vs_sdpa"]),
                      _fci(r["speedup_fraction_of_mac_ratio"], r.get("fraction_ci")),
                      "/".join(str(n) for n in r["rounds"] if n) if r.get("rounds") else "-", r.get("throughput_batch") or "-",
                      tpi("ssog"), tpi("sdpa"), _f(r.get("tp_speedup_vs_sdpa")),
                      _fci(r.get("tp_fraction_of_mac_ratio"), r.get("tp_fraction_ci")),
                      _f(r["speedup_vs_math"]), _mem(r["ssog"]),
                      _mem(r["sdpa"]), _mem(r["math"]), _f(r["memory_ratio_vs_math"]), _f(r["memory_ratio_vs_sdpa"]),
                      nfe, r["ssog"]["backend"] or "-", _check(r)])
    md += [report.md_table(header, table), ""]
    md += _solver_md(rows, must)
    errs = [(r, m) for r in rows for m in ("ssog", "sdpa", "math") if r[m]["status"] not in ("ok", "missing")]
    if errs:
        md += ["Configurations that did not finish (out of memory under the per-configuration cap of "
               f"{args.mem_limit_gb:g} GB, timeout or error):", ""]
        md += [f"- {r['width']} {r['resolution']} {r['variant']} {r['mode']} {LABEL[m]}: {r[m]['status']} "
               f"({(r[m]['error'] or '')[:160]})" for r, m in errs]
        md += [""]
    # Must-show 2 at the largest resolution.
    top = max((r["resolution"] for r in rows), default=None)
    big = [r for r in rows if r["resolution"] == top and r["mode"] == "inference" and r["method"] != "dopri5"]
    if big:
        md += [f"## Targets at {top}x{top} (inference)", ""]
        trows, verdicts = [], []
        for r in big:
            frac, memr = r["speedup_fraction_of_mac_ratio"], r["memory_ratio_vs_math"]
            t_ok = frac is not None and frac >= 0.9
            m_ok = memr is not None and memr <= 0.4
            verdicts.append(dict(width=r["width"], variant=r["variant"], speedup_vs_sdpa=r["speedup_vs_sdpa"],
                                 mac_ratio=r["mac_ratio_vs_sdpa"], fraction=frac, throughput_holds=t_ok,
                                 memory_ratio_vs_math=memr, memory_holds=m_ok,
                                 memory_ratio_vs_sdpa=r["memory_ratio_vs_sdpa"]))
            gain = lambda x: f"{100 * (x - 1):+.0f}%" if x else "-"
            red = lambda x: "-" if x is None else (f"{100 * (1 - x):.0f}% lower" if x <= 1 else f"{100 * (x - 1):.0f}% higher")
            trows.append([r["width"], r["variant"], gain(r["speedup_vs_sdpa"]), gain(r["speedup_vs_math"]),
                          _f(r["mac_ratio_vs_sdpa"]), _f(frac), "yes" if t_ok else "NO", red(memr),
                          "yes" if m_ok else ("NO" if memr is not None else "not measured"), red(r["memory_ratio_vs_sdpa"]),
                          PAPER[r["variant"]]])
        md += [report.md_table(["width", "variant", "throughput vs SDPA", "vs math", "MAC ratio", "frac",
                                "frac >= 0.9", "memory vs math", "<= 0.4x", "memory vs SDPA", "paper (vs attention)"],
                               trows), ""]
        must["2_at_top_resolution"] = verdicts
        nt = sum(not v["throughput_holds"] for v in verdicts)
        nm = sum(not v["memory_holds"] for v in verdicts if v["memory_ratio_vs_math"] is not None)
        n_mem = sum(v["memory_ratio_vs_math"] is not None for v in verdicts)
        md += [f"Throughput target at this resolution (measured ratio >= 90% of the multiply-add ratio; every "
               f"resolution: section 0): {'holds in every row of this table' if nt == 0 else f'fails in {nt} of {len(verdicts)} rows'}. "
               f"Memory target (SSoG <= 0.4x explicit attention): "
               + (f"holds in every row where explicit attention was measured ({n_mem} of {len(verdicts)})"
                  if nm == 0 else f"fails in {nm} of the {n_mem} rows where explicit attention was measured")
               + ". Against fused SDPA, which never stores the N x N weights, the memory ratio is reported as measured. "
               "The paper's percentages are against its attention baseline on a GPU; ours are on the device above.", ""]
    # Backends
    from lipcheck.mixers.ssog import (COST_WEIGHTS, FUSE_HEADS_TOKENS, TRANSPOSED_MAX_TOKENS, Y_COLUMN_BLOCKS,
                                      ThreadPolicy)
    policy = ThreadPolicy()
    used = sorted({(r["resolution"], r["ssog"]["backend"]) for r in rows if r["ssog"]["backend"]})
    md += ["## SSoG backends", "",
           "All backends live in one table (`lipcheck.mixers.ssog.BACKENDS`) and read the same taps "
           "g(k; mu, sigma) from `lipcheck.gaussian`; the tests check each against the dense operator to 1e-10 "
           "in float64, forward and backward (x, alpha, mu, sigma).", "",
           "- `matmul`: dense axis factors through `einsum` (the reference semantics).",
           "- `stacked`: dense axis factors as two GEMMs per head with the M components stacked: "
           "[G_W^1; ...; G_W^M] (MW x W) applied to every (W x d) slab in place, then [alpha_m G_H^m] with columns "
           "ordered (k, m) (H x HM), so the component sum happens inside the GEMM's contraction.",
           "- `truncated`: per component, depthwise convolutions along x and y with the taps cut at radius "
           "r = min(n - 1, ceil(max(|mu| + t sigma))), t = sqrt(2 ln(2 (1 + sigma/t0) / tol)), "
           "t0 = sqrt(2 ln(2/tol)). Bound: the dropped mass of each normalised 1-D factor is at most "
           "2 exp(-t^2/2) (1 + sigma/t) <= tol, so every output entry is off by at most "
           "sum_m |alpha_m| (2 tol + tol^2) max|v|; tol = eps(dtype)/4 (5.6e-17 in float64, 3.0e-8 in float32), "
           "below the rounding of the kept sum. A radius of n - 1 keeps every offset: exact.",
           "- `fft`: 2-D FFT of the summed kernel sum_m alpha_m g_y (x) g_x, zero-padded to the smallest "
           "2^a 3^b 5^c >= 2n - 1 per axis (linear, not circular, convolution); cost independent of M and sigma.",
           "- `auto` (used for every model above): the cheapest backend under a cost model, in GEMM multiply-add "
           f"units per channel: stacked M N (H + W) x {COST_WEIGHTS['stacked']:g}, truncated N sum_m (2 r_x,m + "
           f"2 r_y,m + 2) x {COST_WEIGHTS['truncated']:g}, fft L log2 L x {COST_WEIGHTS['fft']:g} "
           "(weights measured on this 2-core AVX2 CPU; a GPU would want its own).", "",
           "Backend chosen by `auto` per resolution (initial kernels: widths log-uniform in [0.5, 4], "
           "offsets in [-2, 2]): " + (", ".join(f"{r}: {b}" for r, b in used) or "-") + ". "
           "At these grids (14 to 64 tokens a side) the truncation radius for sigma near 4 is comparable to the "
           "grid, so the dense stacked GEMMs win; truncation pays on larger grids or narrower kernels.", "",
           "Around the products (`lipcheck.mixers.ssog.SSoG`): the prepared factors (normaliser, taps, the "
           "representability check, the backend choice) are cached per grid while alpha, mu, sigma keep their values "
           "(compared exactly; in training they are built once per parameter update with autograd and that graph "
           "serves every use); without autograd the stacked products run per head on strided slabs of the values "
           "(no copy in), with autograd head-major as one batched GEMM per axis; up to "
           f"{FUSE_HEADS_TOKENS} tokens (batch x grid) all heads go in one GEMM per axis, and with more than one "
           f"thread and no autograd, up to {TRANSPOSED_MAX_TOKENS} tokens the "
           "x coordinate goes outermost and at batch 1 above that the y axis runs as a batch of GEMMs over blocks of "
           f"whole x coordinates (at most {Y_COLUMN_BLOCKS}), layouts whose GEMMs split across the threads (these "
           "token thresholds and the block count were measured on a 2-core x86 CPU with MKL and torch 2.13 only; every "
           "layout computes the same numbers, so on another CPU a threshold can only cost speed, and would want "
           "measuring again); on a CPU "
           "each call runs at torch's "
           "thread count or on one thread, whichever the call's own timings show faster (the other setting "
           f"re-probed after {policy.probe_every} calls, the interval doubling up to {policy.max_period} calls while "
           "the choice holds), "
           "which is what keeps a shared machine from parking one thread of every small parallel region. "
           "The MLP's token slicing (a memory-traffic saving) runs only where the hidden activation exceeds 8 MiB.", ""]
    # 3. trend
    md += ["## 3. Trend with resolution", "",
           "Exponents p of least-squares fits t ~ N^p (seconds per image, inference) and of the speed-up "
           "ratio against N. Attention's mixing is O(N^2), SSoG's O(N^1.5) with dense factors; the MLP and "
           "projections (O(N)) dilute both at small N, so the fitted exponents over 224-1024 sit below 2 and 1.5.", ""]
    frows = []
    for k, e in fit.items():
        frows.append([k, _f(e["time_exponent_ssog"]), _f(e["time_exponent_sdpa"]), _f(e["time_exponent_math"]),
                      _f(e["speedup_vs_sdpa_exponent"]), _f(e["mac_ratio_vs_sdpa_exponent"]),
                      " ".join(_f(x) for x in e["speedup_vs_sdpa"]), "yes" if e["speedup_vs_sdpa_increasing"] else "no"])
    md += [report.md_table(["width/variant", "p SSoG", "p SDPA", "p math", "p speed-up", "p MAC ratio",
                            "speed-up vs SDPA by resolution", "increasing"], frows), ""]
    must["3_fits"] = fit
    md += ["![time](figures/throughput_time.png)", "", "![memory](figures/throughput_memory.png)", "",
           "![ratio](figures/throughput_ratio.png)", ""]
    md += ["## Regenerate", "", "    python experiments/bench.py          # full (about 20-25 min on a 2-core CPU)",
           "    python experiments/bench.py --quick  # the 224 rows and the 64x64 mixer rows, under 5 minutes",
           "    python experiments/bench.py --device cuda --bf16 --batch-size 8   # on a GPU", ""]
    return "\n".join(md), must


def main(argv=None) -> int:
    args, p = common.parse(sys.modules[__name__], argv, prog="lipcheck bench")
    return run(args, p)


def run(args, p) -> int:
    import time
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
    else:
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
        results = flatten(results)
        load_after = os.getloadavg()
        machine_load = dict(loadavg_before=load_before, loadavg_after=load_after, cpus=os.cpu_count())
    if args.rerender:
        machine_load = old.get("machine_load")
    load_note = ("Machine load (1/5/15-minute load averages over " + str(os.cpu_count()) + " CPUs) before the run "
                 + "/".join(f"{x:.1f}" for x in machine_load["loadavg_before"]) + ", after "
                 + "/".join(f"{x:.1f}" for x in machine_load["loadavg_after"])
                 + ": other processes shared the CPU whenever the load exceeds what the benchmark itself adds (one).") \
        if machine_load else ""
    mixer_rows, mixer_md = mixer_table(results)
    targets = target_rows(results)
    rows = analyse(results)["rows"]
    fit = fits(rows)
    device_str = st["device"]
    md, must = render(mixer_rows, mixer_md, rows, fit, device_str, args, threads or torch.get_num_threads(), elapsed,
                      targets=targets, load_note=load_note)
    if args.rerender:  # the stamp is the measuring run's; say what made this text
        now = report.stamp(device=device)
        md = (f"_Re-rendered from that run's raw results (`{args.rerender}`) by `{now['command']}` at commit "
              f"`{now['commit']}`, {now['date']}: no new measurements._\n\n" + md)
    data = dict(device=device, threads=threads, batch_size=args.batch_size, bf16=args.bf16, elapsed_s=elapsed,
                machine_load=machine_load, mixer_targets=targets, mixer_alone=mixer_rows, rows=rows, fits=fit,
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
