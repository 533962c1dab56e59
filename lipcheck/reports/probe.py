"""The attention_growth report (`lipcheck probe`): certified lower bounds on L(R) for dense attention, the pre-LN
block and the dense vector field against SSoG's flat constant, as Markdown and figures from the command's numbers
(docs/data/attention_growth.json and the size runs' attention_growth_<H>x<W>_c<C>.json)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lipcheck import report  # noqa: E402


def curves_of(data) -> dict:
    """Each probed map's curve (`attention_growth`'s result as the JSON keeps it), its fields as attributes."""
    return {k: SimpleNamespace(**v) for k, v in data["curves"].items()}


def size_figure(data):
    """L(R) on every size run's grid beside the 4x4 report's."""
    curve4, runs = curves_of(data)["attention"], data["size_runs"]
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
    return fig


def figure(data):
    """Every probed map's L(R) against its certified upper bound, and SSoG's flat constant."""
    curves, radii, attn_upper = curves_of(data), data["radii"], data["attention_upper_frobenius_ball"]
    block_bounds, ssog_L = data["block_bounds"], data["ssog_exact"]
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
    return fig


def render(data) -> str:
    """docs/attention_growth.md from the numbers of `lipcheck probe` (its JSON)."""
    curves = curves_of(data)
    a = curves["attention"]
    lines = intro(data, a) + attention_section(data, a) + tightness_section(data, a)
    if "attention_vit_init" in curves:
        c = curves["attention_vit_init"]
        lines += [f"With the ViT initialisation (truncated normal std 0.02, zero biases) the same layer gives "
                  f"exponent {c.exponent:.4f}, 95% CI [{c.exponent_ci[0]:.4f}, {c.exponent_ci[1]:.4f}] on "
                  f"R >= {c.fit_min_radius:g}; L(4096) = {c.lower[-1]:.6g}.", ""]
    lines += size_section(data, a) + block_section(data, curves) + ssog_section(data)
    return "\n".join(lines + benchmark_section(data))


def intro(data, a) -> list[str]:
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
    ]
    return lines


def attention_section(data, a) -> list[str]:
    radii, attn_upper = data["radii"], data["attention_upper_frobenius_ball"]
    lines = [
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
    return lines


def tightness_section(data, a) -> list[str]:
    attn_upper = data["attention_upper_frobenius_ball"]
    c2 = data["witness_coefficient"]
    same = [R for R, s, w in zip(a.radii, a.search, a.witness) if R >= 32 and abs(s - w) <= 1e-6 * w]
    return [f"Tightness. The focused witness predicts L(R) ~ c R^2 with c = max_(h, u) ||A_h u^T|| ||u B_h|| / "
              f"(2 sqrt d) = {c2:.6g} over the witness directions u (the query puts weight ~1/2 on each key, so its "
              f"attention covariance is a^2 u^T u with a^2 ~ R^2 / 2); the measured L(R) / R^2 at R = "
              f"{a.radii[-1]:g} is {a.lower[-1] / a.radii[-1] ** 2:.6g}. "
              f"At {len(same)} of the {sum(R >= 32 for R in a.radii)} radii "
              f"R >= 32 the ascent ended where the best witness started (search value = witness value to 1e-6), "
              f"i.e. it found no better input near the witnesses. The reported L(R) is what this witness family "
              f"reaches; whether the true sup is larger is open within the factor {attn_upper[-1] / a.lower[-1]:.3g} that separates it "
              f"from the certified upper bound.", ""]


def block_section(data, curves) -> list[str]:
    bb = data["block_bounds"]
    lines = ["## Pre-LN attention block and the dense Neural-ODE vector field", "",
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
              "bound on the LN image, not growth.", ""]
    return lines


def ssog_section(data) -> list[str]:
    H, W = data["grid"]
    return ["## SSoG", "",
            f"SSoG at the same width (3 heads, 4 components, ViT initialisation), same {H}x{W} grid: exact "
            f"Lipschitz constant **{data['ssog_exact']:.6g}** ({data['ssog_exact_method']}). SSoG with fixed kernels is affine in X, so this "
            "one number is its constant at every radius: the flat line in the figure.", "",
            "![attention growth](figures/attention_growth.png)", "",
            "## Must-show 4: batched search vs a Python loop over restarts", ""]


def benchmark_section(data) -> list[str]:
    bench = data["benchmark"]
    lines = []
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
    return lines


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


