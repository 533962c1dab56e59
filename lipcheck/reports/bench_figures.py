"""The throughput report's figures (`lipcheck bench`): time and peak memory against the token count, and the
measured speed-up against the multiply-add ratio, per width, from the rows of a run (lipcheck.bench_results)."""
from __future__ import annotations

from lipcheck import report
from lipcheck.bench_results import LABEL, primary_load
from lipcheck.models.vit import PRESETS


def figures(rows, st, docs):
    """Time and peak memory against the token count (discrete, inference) and the measured speed-up against the
    multiply-add ratio, per width, from the primary load's rows; the paths written."""
    prim = primary_load(rows)
    rows = [r for r in rows if r.get("load", "-") == prim]
    sel_rows = [r for r in rows if r["mode"] == "inference" and r["variant"] == "discrete"]
    widths = sorted({r["width"] for r in sel_rows}, key=lambda w: PRESETS[w]["dim"])
    if not widths:
        return []
    paths = [_scaling_figure(sel_rows, widths, what, ylabel, name, st, docs) for what, ylabel, name in (
        ("median_s", "seconds per image (inference, discrete)", "throughput_time"),
        ("peak_bytes", "peak memory added by the step, MB (inference, discrete)", "throughput_memory"))]
    paths.append(_ratio_figure(rows, widths, st, docs))
    return paths


def _scaling_figure(sel_rows, widths, what, ylabel, name, st, docs):
    """One panel per width: each mixer's `what` against N on log axes, slopes N^2 and N^1.5 through SDPA's last."""
    import matplotlib.pyplot as plt
    colors = {"ssog": "C0", "sdpa": "C1", "math": "C3"}
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
    return report.save_figure(fig, name, st, docs=docs)


def _ratio_figure(rows, widths, st, docs):
    """Measured speed-up against the multiply-add ratio, per width and variant."""
    import matplotlib.pyplot as plt
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
    return report.save_figure(fig, "throughput_ratio", st, docs=docs)


def _ticks(ax, Ns):
    """Tick labels at the measured token counts only (log axes otherwise print overlapping minor labels)."""
    from matplotlib.ticker import NullFormatter
    ax.set_xticks(sorted(set(Ns)))
    ax.set_xticklabels([str(n) for n in sorted(set(Ns))], fontsize=7)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
