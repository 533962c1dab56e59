"""Train SSoG / attention ViTs, and the matched SSoG-vs-attention comparison on scikit-learn digits.

    python experiments/train.py                      # the matched comparison -> docs/training.md
    python experiments/train.py --quick              # the same, shortened (under two minutes on a CPU)
    python experiments/train.py --variant ode --mixer ssog --epochs 30 --out runs/ode-ssog
    python experiments/train.py --data cifar100 --data-dir ~/data --preset ti --variant looped --mixer ssog
    torchrun --nproc_per_node=2 experiments/train.py --variant discrete --mixer ssog --out runs/ddp

With no model chosen (no --variant/--mixer, digits data) the script runs the comparison, which is
what `lipcheck report` regenerates; `--compare` asks for it explicitly.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")


import torch  # noqa: E402

from lipcheck import report  # noqa: E402
from lipcheck.models.vit import VARIANTS  # noqa: E402
from lipcheck.mixers import MIXERS  # noqa: E402
from lipcheck import train as T  # noqa: E402
from lipcheck import verdicts  # noqa: E402
from lipcheck.reports import training as training_report  # noqa: E402
from lipcheck.reports.training import PAPER, PAPER_PARAMS_SAVED_PCT  # noqa: E402
from . import common  # noqa: E402

# Digits recipe shared by every run of the comparison.
COMPARE_EPOCHS, COMPARE_SEEDS = 12, (0, 1, 2)
QUICK_EPOCHS, QUICK_SEEDS, QUICK_LIMIT = 2, (0,), 512

DATA_DEFAULTS = {  # per data set: preset, recipe
    "digits": dict(preset="digits", epochs=COMPARE_EPOCHS, batch_size=32, lr=2e-3, warmup_epochs=1.0,
                   crop_padding=0, flip=False, resize=False),
    "cifar100": dict(preset="ti", epochs=100, batch_size=128, lr=1e-3, warmup_epochs=5.0,
                     crop_padding=4, flip=True, resize=True),
}


def add_arguments(p) -> None:
    p.add_argument("--preset", choices=sorted(T.TRAIN_PRESETS), help="model preset (default: digits for "
                   "--data digits, ti for cifar100); in_chans and num_classes always come from the data")
    p.add_argument("--variant", choices=VARIANTS, help="depth variant (default discrete in a single run)")
    p.add_argument("--mixer", choices=MIXERS, help="token mixer (default ssog in a single run)")
    p.add_argument("--data", choices=("digits", "cifar100"), default="digits")
    p.add_argument("--data-dir", help="directory holding cifar-100-python/{train,test,meta}")
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int, help="global batch (split over torchrun processes)")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=float)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0, help="max gradient norm (0 disables)")
    p.add_argument("--crop-padding", type=int, help="random-crop padding in pixels (0 disables)")
    p.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None, help="random horizontal flips")
    p.add_argument("--resize", action=argparse.BooleanOptionalAction, default=None,
                   help="resample images to the preset's resolution (default: on for cifar100, off for digits)")
    p.add_argument("--no-amp", action="store_true", help="disable mixed precision (it is only used on CUDA)")
    p.add_argument("--ode-method", default=T.ODE_TRAIN_SOLVER["method"], help="ODE solver for training")
    p.add_argument("--ode-step", type=float, default=T.ODE_TRAIN_SOLVER["options"]["step_size"],
                   help="step size of a fixed-step ODE solver")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", help="comma-separated seeds for --compare (default 0,1,2)")
    p.add_argument("--out", help="run directory: checkpoint.pt, metrics.jsonl, result.json "
                   "(default runs/<data>-<preset>-<variant>-<mixer>-s<seed>; the comparison uses a temporary one)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    p.add_argument("--quick", action="store_true", help="a short run (comparison: 1 seed, 2 epochs, 512 examples)")
    p.add_argument("--compare", action="store_true", help="the matched SSoG-vs-attention comparison on digits")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--threads", type=int, help="torch CPU threads (comparison default 1: steadier wall times)")
    p.add_argument("--limit-train", type=int, help="use only the first N training examples")
    p.add_argument("--limit-test", type=int, help="use only the first N test examples")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    p.add_argument("--monitor", action=argparse.BooleanOptionalAction, default=None,
                   help="record each epoch the certified SSoG constants, the local vector-field constant along real "
                        "trajectories, the adaptive NFE (ODE) and attention's L(R) (default: off for a single run, "
                        "on for the first seed of the comparison)")
    p.add_argument("--json", help="also write the numbers to this path")
    p.add_argument("--docs", help="report directory (default the repository's docs/)")
    p.set_defaults(run=run)


def parse(argv):
    return common.parse(sys.modules[__name__], argv, prog="lipcheck train")[0]


def config_from(args, data: str) -> T.TrainConfig:
    d = DATA_DEFAULTS[data]
    pick = lambda v, k: d[k] if v is None else v
    return T.TrainConfig(epochs=pick(args.epochs, "epochs"), batch_size=pick(args.batch_size, "batch_size"),
                         lr=pick(args.lr, "lr"), weight_decay=args.weight_decay,
                         warmup_epochs=pick(args.warmup_epochs, "warmup_epochs"),
                         label_smoothing=args.label_smoothing, clip_grad=args.clip_grad,
                         crop_padding=pick(args.crop_padding, "crop_padding"), flip=pick(args.flip, "flip"),
                         resize=pick(args.resize, "resize"), amp=not args.no_amp, seed=args.seed)


def ode_overrides(args, variant: str) -> dict:
    if variant != "ode":
        return {}
    return {"method": args.ode_method, "options": {"step_size": args.ode_step}} if args.ode_method in \
        ("euler", "midpoint", "heun3", "rk4") else {"method": args.ode_method}


def single(args) -> int:
    variant, mixer = args.variant or "discrete", args.mixer or "ssog"
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = args.preset or DATA_DEFAULTS[args.data]["preset"]
    cfg = config_from(args, args.data)
    limit_train, limit_test = args.limit_train, args.limit_test
    if args.quick:
        cfg.epochs = min(cfg.epochs, 1)
        limit_train, limit_test = limit_train or 256, limit_test or 128
    out = Path(args.out or f"runs/{args.data}-{preset}-{variant}-{mixer}-s{cfg.seed}")
    dtype = getattr(torch, args.dtype)
    def log(epoch, r):  # rank 0 only: torchrun sets RANK for every process
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"epoch {epoch}: train loss {r['train_loss']:.4f} acc {r['train_acc']:.4f} | test loss "
                  f"{r['test_loss']:.4f} acc {r['test_acc']:.4f} | {r['epoch_s']:.1f}s", flush=True)

    res = T.run(preset, variant, mixer, data=args.data, data_dir=args.data_dir, cfg=cfg, out_dir=out,
                resume=args.resume, device=args.device, dtype=dtype, progress=not args.no_progress,
                limit_train=limit_train, limit_test=limit_test, on_epoch_end=log,
                monitor=verdicts.Monitor() if args.monitor else None, **ode_overrides(args, variant))
    if res["rank"] == 0:
        payload = {k: v for k, v in res.items() if k != "model"}
        payload["config"] = dataclasses.asdict(cfg)
        payload["stamp"] = report.stamp(device=res["model"].head.weight.device)
        report.write_json(out / "result.json", payload)
        if args.json:
            report.write_json(Path(args.json), payload)
        print(f"{variant}/{mixer} on {args.data}: test accuracy {res['test_acc']:.4f}, {res['params']:,} parameters, "
              f"{res['wall_s']:.1f}s on {res['world_size']} process(es); run directory {out}")
    return 0


# --------------------------------------------------------------------------------------- comparison
def compare(args) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("--compare runs its models one after another in one process; launch it without torchrun")
    if args.data != "digits":
        raise SystemExit("--compare is the matched comparison on digits; train CIFAR-100 models one at a time "
                         "with --data cifar100 --variant ... --mixer ...")
    if args.device.startswith("cpu"):
        torch.set_num_threads(args.threads or 1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    args.docs = report.docs_dir(args.docs, quick=args.quick)
    cfg0 = config_from(args, "digits")
    seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else COMPARE_SEEDS
    limit_train, limit_test = args.limit_train, args.limit_test
    if args.quick:
        cfg0.epochs = args.epochs or QUICK_EPOCHS
        seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else QUICK_SEEDS
        limit_train = limit_train or QUICK_LIMIT
    preset = args.preset or "digits"
    dtype = getattr(torch, args.dtype)
    variants = (args.variant,) if args.variant else VARIANTS
    mixers = (args.mixer,) if args.mixer else MIXERS
    from tqdm.auto import tqdm

    tmp = None if args.out else tempfile.TemporaryDirectory(prefix="lipcheck-compare-")
    root = Path(args.out) if args.out else Path(tmp.name)
    runs = []
    jobs = [(v, m, s) for v in variants for s in seeds for m in mixers]
    t_start = time.perf_counter()
    try:
        for v, m, s in tqdm(jobs, desc="matched comparison", disable=args.no_progress):
            cfg = dataclasses.replace(cfg0, seed=s)
            out = root / f"{v}-{m}-s{s}"
            watch = args.monitor is not False and s == seeds[0]  # the constants of one seed per model
            res = T.run(preset, v, m, data="digits", cfg=cfg, out_dir=out,
                        resume=args.resume and (out / T.CHECKPOINT).exists(), device=args.device, dtype=dtype,
                        progress=False, limit_train=limit_train, limit_test=limit_test,
                        monitor=verdicts.Monitor() if watch else None, **ode_overrides(args, v))
            model = res.pop("model")
            runs.append(dict(variant=v, mixer=m, seed=s, test_acc=res["test_acc"], test_loss=res["test_loss"],
                             params=res["params"], wall_s=res["wall_s"],
                             nfe_forward=res["history"][-1].get("nfe_forward"),
                             curve=[h["test_acc"] for h in res["history"]],
                             train_loss=[h["train_loss"] for h in res["history"]],
                             **({"monitor": [h.get("monitor") for h in res["history"]],
                                 "monitor_s": sum(h.get("monitor_s", 0.0) for h in res["history"])} if watch else {})))
            tqdm.write(f"{v:8s} {m:9s} seed {s}: test acc {res['test_acc']:.4f}  {res['params']:,} params  "
                       f"{res['wall_s']:.1f}s") if not args.no_progress else None
            del model
    finally:
        if tmp is not None:
            tmp.cleanup()
    elapsed = time.perf_counter() - t_start  # end to end: data, model building, checkpoints included
    model_cfg = {**T.TRAIN_PRESETS[preset], "in_chans": 1, "num_classes": 10}
    return write_compare_report(args, runs, cfg0, seeds, variants, mixers, model_cfg, limit_train, limit_test,
                                elapsed)


def _mean_std(xs):
    xs = list(xs)
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarise(runs, variants, mixers, seeds):
    """Per variant x mixer: accuracy mean/std over seeds, params, wall time; per variant the paired
    (same seed) SSoG minus attention difference in points and the parameter saving."""
    by = {(r["variant"], r["mixer"], r["seed"]): r for r in runs}
    rows, deltas = [], []
    for v in variants:
        for m in mixers:
            rs = [by[v, m, s] for s in seeds]
            acc_m, acc_s = _mean_std(100 * r["test_acc"] for r in rs)
            wall_m, wall_s = _mean_std(r["wall_s"] for r in rs)
            rows.append(dict(variant=v, mixer=m, acc_mean=acc_m, acc_std=acc_s,
                             acc_per_seed=[100 * r["test_acc"] for r in rs], params=rs[0]["params"],
                             wall_mean=wall_m, wall_std=wall_s, nfe_forward=rs[0]["nfe_forward"]))
        if set(MIXERS) <= set(mixers):
            d = [100 * (by[v, "ssog", s]["test_acc"] - by[v, "attention", s]["test_acc"]) for s in seeds]
            dm, ds = _mean_std(d)
            pa, ps = by[v, "attention", seeds[0]]["params"], by[v, "ssog", seeds[0]]["params"]
            wins = sum(x > 0 for x in d)
            deltas.append(dict(variant=v, delta_mean=dm, delta_std=ds, delta_per_seed=d, ssog_wins=wins,
                               params_attention=pa, params_ssog=ps, params_saved_pct=100 * (1 - ps / pa),
                               paper_delta=PAPER[v], paper_params_saved_pct=PAPER_PARAMS_SAVED_PCT,
                               wall_ratio=statistics.fmean(by[v, "ssog", s]["wall_s"] for s in seeds)
                               / statistics.fmean(by[v, "attention", s]["wall_s"] for s in seeds)))
    return rows, deltas


def write_compare_report(args, runs, cfg, seeds, variants, mixers, model_cfg, limit_train, limit_test,
                         elapsed: float) -> int:
    """The comparison's report (lipcheck.reports.training), figures and JSON, and its verdict."""
    st = report.stamp(device=args.device)
    rows, deltas = summarise(runs, variants, mixers, seeds)
    presets = T.preset_param_counts(("tiny", "ti", "s", "b", "digits"))
    threads = torch.get_num_threads()
    solver = ode_overrides(args, "ode")
    total_wall = sum(r["wall_s"] for r in runs)
    md = training_report.render(runs, rows, deltas, presets, quick=args.quick, cfg=cfg, seeds=seeds,
                                model_cfg=model_cfg, solver=solver, limit_train=limit_train, threads=threads,
                                total_wall=total_wall, elapsed=elapsed, rising=still_rising(runs, variants, mixers),
                                variants=variants)
    training_report.figures(runs, rows, variants, mixers, len(seeds), st, args.docs)
    data = {"quick": args.quick, "config": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "seed"},
            "model": model_cfg, "ode_solver": solver, "seeds": list(seeds), "threads": threads,
            "limit_train": limit_train, "limit_test": limit_test, "total_wall_s": total_wall, "elapsed_s": elapsed,
            "summary": rows, "paired": deltas, "runs": runs, "presets": presets,
            "paper": {"delta_top1": PAPER, "params_saved_pct": PAPER_PARAMS_SAVED_PCT}}
    v = verdict(deltas)
    path = report.write_report("training", md, data, st, docs=args.docs, json_path=args.json, verdict=v)
    report.print_verdict(v, path)
    return 0


def still_rising(runs, variants, mixers) -> bool:
    """Whether some model's mean test accuracy rose by more than a point over its last two epochs."""
    mean_curves = [torch.tensor([r["curve"] for r in runs if r["variant"] == v and r["mixer"] == m]).mean(0)
                   for v in variants for m in mixers]
    return any(len(c) >= 3 and float(c[-1] - c[-3]) > 0.01 for c in mean_curves)


def verdict(deltas: list[dict]) -> dict:
    """The paper's accuracy claim (SSoG 2.2-4.1 points above attention on CIFAR-100) checked on digits."""
    d = [r["delta_mean"] for r in deltas]
    saved = [r["params_saved_pct"] for r in deltas]
    per = ", ".join("%s %+.1f" % (r["variant"], r["delta_mean"]) for r in deltas)
    return report.verdict(
        "SSoG trains as well as matched dense attention with fewer parameters (digits, not the paper's CIFAR-100)",
        "holds" if min(d) >= 0 else "partial",
        f"Top-1 SSoG minus attention per variant: {per} points; parameters saved {min(saved):.1f}-{max(saved):.1f}%.")


def verdict_from(data: dict) -> dict:
    """The verdict of a finished run from its JSON (lipcheck report --verdicts)."""
    return verdict(data["paired"])


def main(argv=None) -> int:
    args, p = common.parse(sys.modules[__name__], argv, prog="lipcheck train")
    return run(args, p)


def run(args, p) -> int:
    try:
        if args.compare or (args.variant is None and args.mixer is None and args.data == "digits"):
            return compare(args)
        return single(args)
    except (FileNotFoundError, T.CheckpointError, ValueError) as e:  # bad input: the message names the fix
        print(f"lipcheck train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
