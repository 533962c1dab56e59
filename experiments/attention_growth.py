"""Attention growth (SPEC S4): certified lower bounds on L(R) for dense attention, the pre-LN block and
the dense Neural-ODE vector field, against certified upper bounds and SSoG's exact, flat constant.

    python experiments/attention_growth.py [--quick] [--device cpu|cuda] [--seed 0] [--json PATH] [--docs DIR]

Writes docs/attention_growth.md, docs/figures/attention_growth.png and docs/data/attention_growth.json.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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

SETTINGS = {  # search effort per map: quick fits the CPU budget, full is what the report is meant to show
    "quick": dict(attention=dict(restarts=8, steps=15, certify_steps=30, certify_top=1),
                  ln=dict(restarts=4, steps=8, certify_steps=20, certify_top=1),
                  ln_radii=[2.0 ** k for k in range(0, 13, 2)], bench_steps=3, vit_init_attention=False),
    "full": dict(attention=dict(restarts=32, steps=60, certify_steps=200, certify_top=3),
                 ln=dict(restarts=16, steps=40, certify_steps=100, certify_top=2),
                 ln_radii=[2.0 ** k for k in range(13)], bench_steps=10, vit_init_attention=True),
}


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


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if any(a == "--checkpoint" or a.startswith("--checkpoint=") for a in argv):  # a trained model
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from trained import probe_main  # experiments/trained.py
        return probe_main(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer restarts and steps (CPU, under 3 minutes)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available, else cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", type=int, nargs=2, default=(4, 4), metavar=("H", "W"))
    ap.add_argument("--max-log2-radius", type=int, default=12, help="radii 1, 2, 4, ..., 2^this")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default 1 on cpu: the kernels are small, more threads only contend)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    ap.add_argument("--docs", type=Path, default=None, help="docs directory (default: the repository's docs/)")
    args = ap.parse_args(argv)

    device = torch.device(args.device) if args.device else default_device()
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    mode = "quick" if args.quick else "full"
    cfg = SETTINGS[mode]
    H, W = args.grid
    N = H * W
    radii = [2.0 ** k for k in range(args.max_log2_radius + 1)]
    st = report.stamp(device=device)
    t_start = time.perf_counter()
    common = dict(grid=(H, W), device=device, seed=args.seed, progress=True)

    # 1. one multi-head attention layer, preset ti width, its own default initialisation (nn.Linear's)
    torch.manual_seed(args.seed)
    attn = DenseAttention(192, 3, dtype=torch.float64)
    curves = {}
    t0 = time.perf_counter()
    curves["attention"] = attention_growth(attn, radii, **cfg["attention"], **common)
    times = {"attention": time.perf_counter() - t0}
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

    data = {"mode": mode, "grid": [H, W], "radii": radii, "curves": {k: v.as_dict() for k, v in curves.items()},
            "attention_upper_frobenius_ball": attn_upper, "witness_coefficient": witness_coef, "block_bounds": block_bounds, "ssog_exact": ssog_L,
            "ssog_exact_method": ssog_how, "benchmark": bench, "settings": {k: v for k, v in cfg.items()},
            "seconds": {**times, "total": total}, "threads": torch.get_num_threads()}
    md = render(data, curves, radii, attn_upper, block_bounds, ssog_L, ssog_how, bench, args)
    figure(curves, radii, attn_upper, block_bounds, ssog_L, st, args.docs)
    report.write_report("attention_growth", md, data, st, docs=args.docs, json_path=args.json)
    print(f"attention exponent {curves['attention'].exponent:.4f} CI {curves['attention'].exponent_ci}, "
          f"total {total:.1f} s")
    return 0


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
        "Frobenius norm of X (N x C); Jacobian: spectral norm. The search runs all restarts as one batched "
        "torch.func computation (power iteration on J^T J inside projected gradient ascent on X over the ball), "
        "started from the previous radius's best input, structured witnesses (a query whose logits towards two "
        "keys at m +- a u are balanced, u along the top singular directions of W_Q^h W_K^h^T and W_V^h W_O^h, "
        "uniform and focused variants) and random inputs. The certified value uses "
        f"`{a.certify_method}` certification (dense jacrev + SVD for N C <= 1024, else float64 subspace "
        "iteration with Rayleigh-Ritz; either way the number is ||J v|| for the reported v).", "",
        "## Must-show 1: dense attention, L(R) and its growth exponent", "",
        f"Fitted exponent on R >= {a.fit_min_radius:g}: **{a.exponent:.4f}**, 95% CI "
        f"[{a.exponent_ci[0]:.4f}, {a.exponent_ci[1]:.4f}] (least squares of log L on log R). "
        f"L(R) strictly increasing over all {len(radii)} radii: "
        f"**{all(y > x for x, y in zip(a.lower, a.lower[1:]))}**. "
        f"Restarts {a.restarts}, ascent steps {a.steps} per radius.", "",
    ]
    rows = []
    for i, R in enumerate(a.radii):
        rows.append([f"{R:g}", a.lower[i], a.search[i], a.witness[i], a.lower[i] / R ** 2, attn_upper[i],
                     attn_upper[i] / a.lower[i]])
    lines.append(report.md_table(["R", "L(R) certified", "search value", "best witness start (certified)",
                                  "L / R^2", "certified upper bound on L(R)", "upper / lower"], rows))
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
              f"Speedup >= 5x: float64 **{bench[0]['speedup'] >= 5}**, float32 **{bench[1]['speedup'] >= 5}**.", "",
              "## Reproduce", "",
              "```", "python experiments/attention_growth.py" + (" --quick" if data["mode"] == "quick" else ""),
              "pytest tests/test_probe.py", "```", "",
              f"Run time of this report: {data['seconds']['total']:.1f} s ({data['mode']} mode)."]
    return "\n".join(lines)


def N_of(data):
    return data["grid"][0] * data["grid"][1]


if __name__ == "__main__":
    raise SystemExit(main())
