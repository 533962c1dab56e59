"""The training report (`lipcheck train`, the matched comparison on digits): its numbers (per-model summaries,
paired differences, parameter counts, the monitored constants) as Markdown, section by section, and its figures."""
from __future__ import annotations

import torch

from lipcheck import report, verdicts

# The paper (CIFAR-100, 224x224, widths 192/384/768, depth and recipe fixed): SSoG minus attention, top-1 points.
PAPER = {"discrete": (2.2, 4.1), "ode": (2.2, 4.1), "looped": (5.4, 8.1)}
PAPER_PARAMS_SAVED_PCT = (8.8, 16.6)


def render(runs: list[dict], rows: list[dict], deltas: list[dict], presets: list[dict], *, quick: bool, cfg,
           seeds, model_cfg: dict, solver: dict, limit_train, threads: int, total_wall: float, elapsed: float,
           rising: bool, variants) -> str:
    """The report's Markdown. rows/deltas: the command's summaries; solver: the ODE models' solver options;
    rising: an accuracy curve still climbs at the last epoch."""
    md = _intro_md(quick)
    md += _setup_md(runs, cfg, seeds, model_cfg, solver, limit_train, threads, total_wall, elapsed)
    md += _results_md(rows)
    md += _paper_md(deltas, len(seeds), rising)
    md += _presets_md(presets)
    watched = monitored(runs)
    if watched:
        md += monitor_section(watched, variants)
    return "\n".join(md + _closing_md())


def monitored(runs: list[dict]) -> list[dict]:
    """The runs that recorded the constants after every epoch (`--monitor`)."""
    return [r for r in runs if r.get("monitor") and all(r["monitor"])]


def _intro_md(quick: bool) -> list[str]:
    quick = " (`--quick`: shortened, numbers not meaningful)" if quick else ""
    md = [f"# Training: matched SSoG vs attention on digits{quick}", ""]
    md += ["The paper trains on CIFAR-100 at 224x224 with three widths and reports SSoG above attention by "
           "2.2-4.1 top-1 points (discrete and continuous depth) and 5.4-8.1 points (looped), with 8.8-16.6% "
           "fewer parameters. This machine can neither download CIFAR-100 nor train at that scale, so the "
           "matched comparison here uses scikit-learn's bundled digits (8x8 grey images, 10 classes, a fixed "
           "stratified split of 1347 train / 450 test). The full pipeline (`--data cifar100 --data-dir DIR "
           "--preset ti|s|b`, AMP, torchrun/DDP) is the same code; no CIFAR-100 numbers are reported here.", ""]
    return md


def _setup_md(runs, cfg, seeds, model_cfg, solver, limit_train, threads, total_wall, elapsed) -> list[str]:
    return ["## Setup", "",
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


def _results_md(rows: list[dict]) -> list[str]:
    return ["## Results", "",
           report.md_table(["variant", "mixer", "test acc % (mean ± std)", "per seed", "params", "wall s (mean)",
                            "NFE / forward"],
                           [[r["variant"], r["mixer"], f"{r['acc_mean']:.2f} ± {r['acc_std']:.2f}",
                             ", ".join(f"{a:.1f}" for a in r["acc_per_seed"]), f"{r['params']:,}",
                             f"{r['wall_mean']:.1f}", r["nfe_forward"] if r["nfe_forward"] is not None else "-"]
                            for r in rows]), ""]


def _paper_md(deltas: list[dict], n: int, rising: bool) -> list[str]:
    """SSoG minus attention per setting beside the paper's numbers, and what that shows."""
    md = []
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
    return md


def _presets_md(presets: list[dict]) -> list[str]:
    """The parameter savings of every preset against the paper's range."""
    md = ["## Parameter savings per preset", "",
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
    return md


def _closing_md() -> list[str]:
    """What the tests guarantee, the figures, how to regenerate."""
    md = ["## Pipeline guarantees (checked by tests/test_train.py)", "",
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
    return md


def figures(runs: list[dict], rows: list[dict], variants, mixers, n: int, st: dict, docs) -> None:
    """Test accuracy per epoch, final accuracy and parameters, and (monitored runs) the constants per epoch."""
    colors = {"ssog": "C0", "attention": "C3"}
    report.save_figure(_curves_figure(runs, variants, mixers, n, colors), "training_curves", st, docs)
    report.save_figure(_summary_figure(rows, variants, mixers, colors), "training_summary", st, docs)
    watched = monitored(runs)
    if watched:
        report.save_figure(monitor_figure(watched, variants, mixers, colors), "training_monitor", st, docs)


def _curves_figure(runs, variants, mixers, n: int, colors):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(variants), figsize=(4.2 * len(variants), 3.5), squeeze=False,
                             constrained_layout=True)
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
    return fig


def _summary_figure(rows, variants, mixers, colors):
    import matplotlib.pyplot as plt
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
    return fig


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
