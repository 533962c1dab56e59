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
from . import common  # noqa: E402

# The paper (CIFAR-100, 224x224, widths 192/384/768, depth and recipe fixed): SSoG minus attention, top-1 points.
PAPER = {"discrete": (2.2, 4.1), "ode": (2.2, 4.1), "looped": (5.4, 8.1)}
PAPER_PARAMS_SAVED_PCT = (8.8, 16.6)

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


def setting_sentence(d: dict, n: int) -> str:
    """Plain words for one setting: is the paired difference distinguishable from seed noise?"""
    lo, hi = d["paper_delta"]
    sign = "higher" if d["delta_mean"] > 0 else "lower"
    if n < 2:
        s = f"SSoG minus attention is {d['delta_mean']:+.1f} points on a single seed (no spread estimate)"
    else:
        se = d["delta_std"] / n ** 0.5
        if abs(d["delta_mean"]) > 2 * se:
            s = (f"SSoG is {sign} by {abs(d['delta_mean']):.1f} points (paired over {n} seeds), more than twice "
                 f"the standard error of the mean difference ({se:.1f})")
        else:
            s = (f"SSoG minus attention is {d['delta_mean']:+.1f} points, within two standard errors "
                 f"({2 * se:.1f}) of zero: no difference resolved over {n} seeds")
    where = "inside" if lo <= d["delta_mean"] <= hi else ("above" if d["delta_mean"] > hi else "below")
    s += f"; {where} the paper's +{lo} to +{hi}"
    p_lo, p_hi = d["paper_params_saved_pct"]
    saved = d["params_saved_pct"]
    where = "inside" if p_lo <= saved <= p_hi else ("above" if saved > p_hi else "below")
    s += f"; {saved:.1f}% fewer parameters, {where} the paper's {p_lo}-{p_hi}%"
    s += f"; SSoG's wall time is {d['wall_ratio']:.2f}x attention's"
    return s


def write_compare_report(args, runs, cfg, seeds, variants, mixers, model_cfg, limit_train, limit_test,
                         elapsed: float) -> int:
    import matplotlib.pyplot as plt

    st = report.stamp(device=args.device)
    rows, deltas = summarise(runs, variants, mixers, seeds)
    presets = T.preset_param_counts(("tiny", "ti", "s", "b", "digits"))
    n = len(seeds)
    quick = " (`--quick`: shortened, numbers not meaningful)" if args.quick else ""
    threads = torch.get_num_threads()
    solver = ode_overrides(args, "ode")
    total_wall = sum(r["wall_s"] for r in runs)
    mean_curves = [torch.tensor([r["curve"] for r in runs if r["variant"] == v and r["mixer"] == m]).mean(0)
                   for v in variants for m in mixers]
    rising = any(len(c) >= 3 and float(c[-1] - c[-3]) > 0.01 for c in mean_curves)

    md = [f"# Training: matched SSoG vs attention on digits{quick}", ""]
    md += ["The paper trains on CIFAR-100 at 224x224 with three widths and reports SSoG above attention by "
           "2.2-4.1 top-1 points (discrete and continuous depth) and 5.4-8.1 points (looped), with 8.8-16.6% "
           "fewer parameters. This machine can neither download CIFAR-100 nor train at that scale, so the "
           "matched comparison here uses scikit-learn's bundled digits (8x8 grey images, 10 classes, a fixed "
           "stratified split of 1347 train / 450 test). The full pipeline (`--data cifar100 --data-dir DIR "
           "--preset ti|s|b`, AMP, torchrun/DDP) is the same code; no CIFAR-100 numbers are reported here.", ""]
    md += ["## Setup", "",
           f"- Model: `ViT(variant, mixer, img_size=8, patch_size=2, in_chans=1, num_classes=10, dim="
           f"{model_cfg['dim']}, depth={model_cfg['depth']}, num_heads={model_cfg['num_heads']})` (4x4 token "
           f"grid, no upsampling), SSoG with {model_cfg.get('num_components', 4)} Gaussian components per head. "
           "Only the mixer differs between the two columns of each pair.",
           f"- Variants: discrete ({model_cfg['depth']} blocks), looped (one block applied {model_cfg['depth']} "
           f"times), ode (one block's vector field integrated on [0, 1] with fixed-step `{solver.get('method')}`, "
           f"options {solver.get('options')}: {int(1 / solver['options']['step_size']) * 4 if solver.get('options') and solver.get('method') == 'rk4' else 'n/a'} "
           "vector-field evaluations per forward, back-propagated through the solver steps; t1 = 1 is the model "
           "default, so the flow covers one unit of residual time where the looped model takes four unit steps).",
           f"- Recipe (identical for every run): AdamW (weight decay {cfg.weight_decay}; none on biases, norms, "
           f"position embedding and Gaussian parameters), peak lr {cfg.lr}, {cfg.warmup_epochs:g} warmup epoch(s) "
           f"then cosine to {cfg.min_lr_ratio} x peak, batch {cfg.batch_size}, {cfg.epochs} epochs, label "
           f"smoothing {cfg.label_smoothing}, gradient clipping at norm {cfg.clip_grad}, random crop padding "
           f"{cfg.crop_padding} (a one-pixel shift is an eighth of a digit: off), no flips (mirrored digits are "
           f"other symbols), float32.",
           f"- Seeds {list(seeds)}: a seed fixes the initial weights and the data order; the same seed gives "
           "both mixers the same batches. Accuracy is on the full 450-image test split after the last epoch"
           + (f" (training limited to the first {limit_train} examples)" if limit_train else "") + ".",
           f"- Wall time: training plus per-epoch evaluation, {threads} CPU thread(s), on a machine shared with other "
           f"work (timings are noisy). Whole comparison: {total_wall / 60:.1f} min of training, {elapsed / 60:.1f} min "
           f"end to end ({len(runs)} runs, one after another).", ""]

    md += ["## Results", "",
           report.md_table(["variant", "mixer", "test acc % (mean ± std)", "per seed", "params", "wall s (mean)",
                            "NFE / forward"],
                           [[r["variant"], r["mixer"], f"{r['acc_mean']:.2f} ± {r['acc_std']:.2f}",
                             ", ".join(f"{a:.1f}" for a in r["acc_per_seed"]), f"{r['params']:,}",
                             f"{r['wall_mean']:.1f}", r["nfe_forward"] if r["nfe_forward"] is not None else "-"]
                            for r in rows]), ""]
    if deltas:
        md += ["## Against the paper", "",
               "SSoG minus attention, paired by seed (mean ± std over seeds), beside the paper's CIFAR-100 numbers.",
               "",
               report.md_table(["setting", "here: Δ top-1 (points)", "SSoG better in", "paper: Δ top-1",
                                "here: params saved", "paper: params saved", "wall time SSoG / attention"],
                               [[d["variant"], f"{d['delta_mean']:+.2f} ± {d['delta_std']:.2f}",
                                 f"{d['ssog_wins']}/{n} seeds", f"+{d['paper_delta'][0]} to +{d['paper_delta'][1]}",
                                 f"{d['params_saved_pct']:.1f}%", "8.8-16.6%", f"{d['wall_ratio']:.2f}"]
                                for d in deltas]), ""]
        md += ["What this shows:", ""]
        md += [f"- **{d['variant']}**: {setting_sentence(d, n)}." for d in deltas]
        md += ["- These are digits at 8x8 with a 4x4 token grid and a width-48 model trained for a few minutes, "
               "not CIFAR-100 at 224x224: agreement or disagreement here neither confirms nor refutes the paper's "
               "numbers, which this machine cannot reproduce."
               + (" The accuracy curves are still rising at the last epoch (by more than a point over the last "
                  "two epochs for at least one model), so the differences are those of a fixed short budget, not "
                  "of converged models." if rising else ""),
               "- SSoG's wall time is not lower here: on a 16-token grid attention's N x N cost is negligible, and "
               "SSoG recomputes its Gaussian axis matrices on every forward; the large-grid regime, where the "
               "costs part, is the throughput benchmark's (`lipcheck bench`).", ""]
    md += ["## Parameter savings per preset", "",
           "Counted as the sum of `numel` over the parameters of each model built on the meta device "
           "(`lipcheck info` prints the same). SSoG drops the query and key projections (2C^2 + 2C per block, "
           "and the value bias C) and adds 5hM Gaussian parameters per block.", "",
           report.md_table(["preset", "variant", "SSoG params", "attention params", "saved", "saved %",
                            "paper saved %"],
                           [[p["preset"], p["variant"], f"{p['ssog']:,}", f"{p['attention']:,}", f"{p['saved']:,}",
                             f"{p['saved_pct']:.1f}%", "8.8-16.6%"] for p in presets]), ""]
    disc = {p["preset"]: p["saved_pct"] for p in presets if p["variant"] == "discrete"}
    shared = {p["preset"]: p["saved_pct"] for p in presets if p["variant"] == "looped"}
    inside = [p for p in presets if p["preset"] in ("ti", "s", "b")
              and PAPER_PARAMS_SAVED_PCT[0] <= p["saved_pct"] <= PAPER_PARAMS_SAVED_PCT[1]]
    md += [f"The discrete ti/s/b presets save {disc['ti']:.1f}% / {disc['s']:.1f}% / {disc['b']:.1f}%, the looped and "
           f"ODE ones (one shared block, so the patch embedding and head weigh more) {shared['ti']:.1f}% / "
           f"{shared['s']:.1f}% / {shared['b']:.1f}%: {len(inside)} of 9 paper-size configurations fall inside the "
           f"paper's 8.8-16.6%. The paper's exact configurations (components per head, biases) are not known, so "
           "only the range is compared.", ""]
    watched = [r for r in runs if r.get("monitor") and all(r["monitor"])]
    if watched:
        md += monitor_section(watched, variants)
    md += ["## Pipeline guarantees (checked by tests/test_train.py)", "",
           "- Resume is exact: a run interrupted after epoch 1 of 3 and resumed from its checkpoint ends with "
           "parameters, AdamW moments and logged metrics equal bit for bit to an uninterrupted run (CPU, "
           "deterministic algorithms; discrete/attention and ode/ssog).",
           "- `torchrun --nproc_per_node=2` with gloo on CPU (global batch 16, 8 per process, 4 steps, float64) "
           "gives parameters equal to a single-process run on the same global batches to 1e-6; only rank 0 "
           "writes checkpoints and metrics. The shuffle and each example's augmentation are functions of "
           "(seed, epoch, example), so they do not depend on the number of processes.",
           "- Checkpoints are written to a temporary file and renamed, so an interrupted write leaves the previous "
           "one intact; corrupt or foreign checkpoints, a missing CIFAR-100 directory and a resolution mismatch "
           "stop with an error naming the fix.",
           "- Mixed precision (bfloat16 autocast, or float16 with gradient scaling) and nccl are used only on CUDA; "
           "this machine has no GPU, so those paths are not exercised here.", ""]
    md += ["## Figures", "", "![test accuracy per epoch](figures/training_curves.png)", "",
           "![final accuracy and parameters](figures/training_summary.png)", ""]
    md += ["## Regenerate", "", "```", "python experiments/train.py            # or: lipcheck train",
           "python experiments/train.py --quick    # a two-minute smoke version",
           "python experiments/train.py --no-monitor   # without the per-epoch constants",
           "python experiments/train.py --variant ode --mixer ssog --monitor --out runs/ode-ssog   # one monitored run",
           "```", ""]

    # figures
    fig, axes = plt.subplots(1, len(variants), figsize=(4.2 * len(variants), 3.5), squeeze=False,
                             constrained_layout=True)
    colors = {"ssog": "C0", "attention": "C3"}
    for ax, v in zip(axes[0], variants):
        for m in mixers:
            curves = torch.tensor([r["curve"] for r in runs if r["variant"] == v and r["mixer"] == m]) * 100
            ep = torch.arange(1, curves.shape[1] + 1)
            mean = curves.mean(0)
            ax.plot(ep, mean, color=colors[m], label=m, marker="o", markersize=3)
            if curves.shape[0] > 1:
                sd = curves.std(0)
                ax.fill_between(ep, mean - sd, mean + sd, color=colors[m], alpha=0.2)
        ax.set_title(v)
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy %")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"digits, mean ± std over {n} seed(s)")
    report.save_figure(fig, "training_curves", st, args.docs)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5), constrained_layout=True)
    xs = range(len(variants))
    w = 0.38
    for k, m in enumerate(mixers):
        rs = [next(r for r in rows if r["variant"] == v and r["mixer"] == m) for v in variants]
        a1.bar([x + (k - 0.5) * w for x in xs], [r["acc_mean"] for r in rs], w, yerr=[r["acc_std"] for r in rs],
               color=colors[m], label=m, capsize=3)
        a2.bar([x + (k - 0.5) * w for x in xs], [r["params"] for r in rs], w, color=colors[m], label=m)
    for a, yl in ((a1, "test accuracy %"), (a2, "parameters")):
        a.set_xticks(list(xs), variants)
        a.set_ylabel(yl)
        a.legend()
        a.grid(alpha=0.3, axis="y")
    lo = min(r["acc_mean"] - r["acc_std"] for r in rows)
    a1.set_ylim(max(0, lo - 5), 100)
    report.save_figure(fig, "training_summary", st, args.docs)

    if watched:
        report.save_figure(monitor_figure(watched, variants, mixers, colors), "training_monitor", st, args.docs)

    data = {"quick": args.quick, "config": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "seed"},
            "model": model_cfg, "ode_solver": solver, "seeds": list(seeds), "threads": threads,
            "limit_train": limit_train, "limit_test": limit_test, "total_wall_s": total_wall, "elapsed_s": elapsed,
            "summary": rows, "paired": deltas, "runs": runs, "presets": presets,
            "paper": {"delta_top1": PAPER, "params_saved_pct": PAPER_PARAMS_SAVED_PCT}}
    v = verdict(deltas)
    path = report.write_report("training", "\n".join(md), data, st, docs=args.docs, json_path=args.json, verdict=v)
    report.print_verdict(v, path)
    return 0


def verdict(deltas: list[dict]) -> dict:
    """The paper's accuracy claim (SSoG 2.2-4.1 points above attention on CIFAR-100) checked on digits."""
    d = [r["delta_mean"] for r in deltas]
    saved = [r["params_saved_pct"] for r in deltas]
    per = ", ".join("%s %+.1f" % (r["variant"], r["delta_mean"]) for r in deltas)
    return report.verdict(
        "SSoG trains as well as matched dense attention with fewer parameters (digits, not the paper's CIFAR-100)",
        "holds" if min(d) >= 0 else "partial",
        f"Top-1 SSoG minus attention per variant: {per} points; parameters saved {min(saved):.1f}-{max(saved):.1f}%.")


# ----------------------------------------------------------------------------------------- monitor
def monitor_series(r: dict) -> dict:
    """Per-epoch curves of one monitored run: the largest value over layers / blocks."""
    mon = r["monitor"]
    out = {"field_local": [max(m["field_local"]) for m in mon], "field_global": [max(m["field_global"]) for m in mon]}
    if "ssog_upper" in mon[0]:
        out["ssog_upper"] = [max(m["ssog_upper"]) for m in mon]
    if "nfe" in mon[0]:
        out["nfe"] = [m["nfe"] for m in mon]
    if "attention_L" in mon[0]:
        out["attention_radii"] = mon[0]["attention_radii"]
        # per radius, the largest certified lower bound over the layers
        out["attention_L"] = [[max(layer[k] for layer in m["attention_L"]) for k in range(len(m["attention_radii"]))]
                              for m in mon]
    return out


def verdict_from(data: dict) -> dict:
    """The verdict of a finished run from its JSON (lipcheck report --verdicts)."""
    return verdict(data["paired"])


def monitor_section(watched: list, variants) -> list:
    seed = watched[0]["seed"]
    m0 = verdicts.MONITOR_PROBE
    md = ["## Constants during training (`--monitor`)", "",
          f"Recorded after every epoch of the seed-{seed} run of each model (`lipcheck.verdicts.Monitor`; not part of "
          "the wall times above): the certified upper bound on every SSoG layer's constant at the model's 4x4 grid "
          "(`ssog_lipschitz` with the closed form, circulant embedding, Gram iteration and dense SVD; no Lanczos), the "
          f"local vector-field constant Lip(Mixer) Lip_loc(LN1) + Lip(MLP) Lip_loc(LN2) at the states {verdicts.Monitor().n_images} "
          "test images visit (ODE: the trajectory at 5 times; discrete/looped: every block's inputs), the NFE of an "
          f"adaptive dopri5 solve at rtol = atol = {verdicts.MONITOR_TOL:g} (ODE), and for attention models certified "
          f"lower bounds on L(R) at R = {', '.join(f'{r:g}' for r in verdicts.MONITOR_RADII)} (each layer alone, "
          f"{m0['restarts']} restarts x {m0['steps']} steps: a cheap search, so a loose lower bound). Largest over "
          "layers/blocks; first and last epoch:", ""]
    rows = []
    for r in watched:
        c = monitor_series(r)
        first_last = lambda xs: f"{xs[0]:.4g} -> {xs[-1]:.4g}"
        rows.append([r["variant"], r["mixer"], first_last(c["ssog_upper"]) if "ssog_upper" in c else "-",
                     first_last(c["field_local"]), first_last(c["field_global"]),
                     first_last(c["nfe"]) if "nfe" in c else "-",
                     first_last([x[-1] for x in c["attention_L"]]) if "attention_L" in c else "-",
                     f"{r['monitor_s']:.0f}"])
    md += [report.md_table(["variant", "mixer", "SSoG upper (max layer)", "F local", "F global", "NFE dopri5",
                            f"attention L({verdicts.MONITOR_RADII[-1]:g}) lower", "monitor s"], rows), ""]
    md += ["SSoG's number is a certified upper bound on a global constant; attention's is a certified lower bound on "
           "its constant on a ball of radius R, which has no finite global value: the two columns answer different "
           "questions, and only SSoG's can bound what training does to the model everywhere. The global field "
           "constant carries LayerNorm's 1/sqrt(eps) and says little; the local one is the useful number.", "",
           "![constants during training](figures/training_monitor.png)", ""]
    return md


def monitor_figure(watched: list, variants, mixers, colors):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, len(variants), figsize=(4.2 * len(variants), 9), squeeze=False,
                             constrained_layout=True)
    for j, v in enumerate(variants):
        a_mix, a_field, a_nfe = axes[0][j], axes[1][j], axes[2][j]
        for r in (r for r in watched if r["variant"] == v):
            c = monitor_series(r)
            ep = list(range(1, len(c["field_local"]) + 1))
            col = colors[r["mixer"]]
            if "ssog_upper" in c:
                a_mix.plot(ep, c["ssog_upper"], color=col, marker="o", ms=3, label="SSoG: certified upper")
            if "attention_L" in c:
                for k, R in enumerate(c["attention_radii"]):
                    a_mix.plot(ep, [x[k] for x in c["attention_L"]], color=col, ls="--", marker="s", ms=3,
                               alpha=0.4 + 0.6 * (k + 1) / len(c["attention_radii"]),
                               label=f"attention: L({R:g}) lower")
            a_field.plot(ep, c["field_local"], color=col, marker="o", ms=3, label=f"{r['mixer']}: local")
            if "nfe" in c:
                a_nfe.plot(ep, c["nfe"], color=col, marker="o", ms=3, label=r["mixer"])
        a_mix.set_title(f"{v}: mixer constant (max over layers)")
        a_field.set_title(f"{v}: vector field F, local constant")
        for a in (a_mix, a_field):
            a.set_yscale("log")
        a_nfe.set_title(f"{v}: NFE, dopri5 at tol {verdicts.MONITOR_TOL:g}" if v == "ode" else f"{v}: (no ODE solve)")
        for a in (a_mix, a_field, a_nfe):
            a.set_xlabel("epoch")
            a.grid(alpha=0.3)
            if a.lines:
                a.legend(fontsize=7)
        if not a_nfe.lines:
            a_nfe.axis("off")
    return fig


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
