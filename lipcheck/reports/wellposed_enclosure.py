"""The proven enclosures in the divergence reports (`lipcheck wellposed`): the section of docs/divergence.md, the
whole of docs/divergence_<preset>.md (the enclosure alone, full-size presets) and their figures, from the JSON."""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lipcheck import report  # noqa: E402


def fmt(x, d=3):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{d}g}" if math.isfinite(x) else str(x)
    return str(x)


def enclosure_figure(encs):
    fig, axes = plt.subplots(1, len(encs), figsize=(5 * len(encs), 4), squeeze=False)
    for ax, e in zip(axes[0], encs):
        t = e["t"]
        for i, (r, a) in enumerate(zip(e["radius"], e["actual"])):
            r = [x if math.isfinite(x) else float("nan") for x in r]
            ax.semilogy(t[1:], r[1:], color=f"C{i}", lw=1, label="proven radius" if i == 0 else None)
            if a is not None:  # None: no converged reference at this size (the full-size run)
                ax.semilogy(e.get("actual_t", t)[1:], [max(x, 1e-300) for x in a[1:]], color=f"C{i}", lw=1, ls=":",
                            label="actual error" if i == 0 else None)
        ax.set_xlabel("t")
        ax.set_ylabel("||x(t) - y(t)||")
        ax.set_title(f"gain {e['gain']}: dopri5 tol {e['tol']:g}, {figure_title_result(e)}", fontsize=9)
        ax.legend(fontsize=7)
    return ("divergence_enclosure", fig)


def proven_to(e) -> float:
    """The earliest time, over the run's images, to which the enclosure reached (the last time of finite radius; a
    saved JSON writes inf as the string 'inf')."""
    return min(max((t for t, r in zip(e["t"], rs) if math.isfinite(float(r))), default=0.0) for rs in e["radius"])


def figure_title_result(e) -> str:
    """What the title says of one run: the radius / actual range at t1 where every sample is proven (or the radius
    where no actual error was measured), else how far the proof reached."""
    if not all(e["proven"]):
        return (f"{sum(map(bool, e['proven']))}/{len(e['proven'])} proven on [0, t1]; "
                f"proven to t = {proven_to(e):.3g}")
    if e.get("ratio_t1"):
        return f"radius/actual at t1 {min(e['ratio_t1']):.3g}-{max(e['ratio_t1']):.3g}"
    return f"radius at t1 {max(e['radius_t1']):.3g} (no actual error at this size)"


def enclosure_markdown(encs, ti) -> str:
    out = enclosure_table(encs) + enclosure_solves(encs) + enclosure_targets(encs) + envelope_section(encs[0])
    return "\n".join(out + full_size_section(ti))


def enclosure_table(encs) -> list[str]:
    out = ["## Proven enclosure (Picard-Lindelof as a computer-assisted proof)", "",
           "`lipcheck.wellposed.enclose` proves ||x(t) - y(t)|| <= radius(t) for the true solution x and the computed "
           "y (the quartic through dopri5's dense output on each accepted step at the user's tolerance), on whole "
           "intervals. Tight radius (Theorem 6 in proofs/S5.md): a second solve y_ref at tol * 1e-3, on steps short "
           "enough that its interpolant's defect is small, is enclosed directly (Theorem 5: the defect y_ref' - "
           "F(y_ref) bounded on every sub-interval from its end values plus the linear-interpolation remainder "
           "tau^2/8 sup||delta''||, the logarithmic norm mu_2(J_F) verified at points (dense n x n Jacobian in closed "
           "form, Cholesky certificate) and extended to a tube by F's second-derivative constant, the tube "
           "bootstrapped, float64 rounding bounded a priori, the scalar recurrence in arb balls), and then "
           "||x - y|| <= sup ||y - y_ref|| + r_ref on every interval, the sup proven from the Bernstein coefficients of "
           "the difference quartics. The reported centre is y, the user's solve; its defects, which cancel in its true "
           "error, no longer add up. Existence and uniqueness of the true solution on [0, t1] follow for every proven "
           "sample (Picard-Lindelof on the tube).", ""]
    rows = []
    for e in encs:
        r = e.get("ref", {})
        for b in range(len(e["proven"])):
            rows.append([e["gain"], b, "yes" if e["proven"][b] else f"no: {e['reason'][b]}", fmt(e["radius_t1"][b]),
                         fmt(e["actual_t1"][b]), fmt(e["ratio_t1"][b]),
                         fmt(e["distance_t1"][b]) if e.get("distance_t1") else "-",
                         fmt(r["radius_t1"][b]) if r else "-", fmt(e["tube_max"][b]),
                         fmt(e["int_mu"][b]), fmt(e["int_mu_point"][b]), fmt(e["defect_max"][b]),
                         fmt(e["defect_sampled_max"][b])])
    out += [report.md_table(["gain", "sample", "proven", "radius at t1", "actual error at t1", "radius / actual",
                             "||y - y_ref|| at t1", "r_ref at t1", "largest tube", "int mu (tube)",
                             "int mu (points)", "sup defect of y_ref (proven)", "max sampled defect of y_ref"], rows),
            "", "The radius at t1 is the proven bound at t1 itself (||y - y_ref|| there plus r_ref there, "
            "proofs/S5.md, Theorem 6), compared with the actual error at t1; the containment check above uses every "
            "interval's sup radius.", ""]
    return out


def enclosure_solves(encs) -> list[str]:
    """Per field: the user's solve, the reference solve and where the time went."""
    out = []
    for e in encs:
        s = e["seconds"]
        r = e.get("ref")
        ref_txt = (f" Reference solve y_ref: dopri5 at {r['tol']:g} on forced steps, {r['accepted']} accepted and "
                   f"{r['rejected']} rejected steps, {r['nfe_forward']} NFE (plus {r['nfe_dense_output']} for its dense "
                   f"output samples); its enclosure: {r['fine_points']} defect sub-intervals, {r['lognorm_points']} "
                   f"point log-norms ({e['lognorm']}, {r['eigensolves']} eigensolves), r_ref at t1 up to "
                   f"{max(r['radius_t1']):.3g}.") if r else ""
        out += [f"Gain {e['gain']}: the user's solve y is dopri5 at rtol = atol = {e['tol']:g}: {e['accepted']} accepted "
                f"and {e['rejected']} rejected steps, {e['nfe_forward']} NFE forward (plus {e['nfe_dense_output']} for "
                f"the dense output samples; no adjoint in this run, so 0 backward: see the gradient section)."
                + ref_txt + f" Curvature constant up to {e['curvature_max']:.3g}, token-variance floor "
                f"{e['variance_floor']:.3g}; stiffness indicator max over steps of h * mu = {e['stiffness_max']:.3g} "
                "(non-stiff: below 1 to a few). "
                f"The actual error is measured against a fixed-step dopri8 reference landing on {len(e['actual_t'])} of the "
                f"{len(e['t'])} enclosure times (its own error estimate {e['reference_error']:.2g}); radius >= actual at every "
                f"time and sample: **{'yes' if e['contained'] else 'NO'}**. Time {s['total']:.1f} s (user's solve "
                f"{s['solve']:.1f}, reference enclosure {s.get('reference', 0.0):.1f} of which defect {s['defect']:.1f} "
                f"and log-norms {s['lognorm']:.1f}, distance {s.get('distance', 0.0):.1f}) on a shared CPU.", ""]
    return out


def enclosure_targets(encs) -> list[str]:
    ratios = {e["gain"]: max(e["ratio_t1"]) for e in encs}
    target = {1.0: 100, 0.5: 10}
    return ["Targets, as measured: " + "; ".join(
        f"gain {g}: radius / actual at t1 up to {r:.3g} (target {target.get(g, '-')}: "
        f"**{'met' if g in target and r <= target[g] else 'missed'}**)" for g, r in ratios.items())
        + ". What remains of the ratio: r_ref (the reference's own proven radius, dominated by the "
        "linear-interpolation remainder tau^2/8 sup||delta''||, whose bound adds the third derivative of y_ref, "
        "D^2F[y', y'] and J_F y'' by the triangle inequality) and the Bernstein bound on ||y - y_ref|| at t1 (its "
        "node rounding). The direct enclosure of y itself (Theorem 5, `ref_tol=None`) was 64-145x "
        "(gain 1) and 90-133x (gain 0.5) in the previous run: there the defects of y's steps, which cancel in its "
        "actual error, add up in the bound.", ""]


def envelope_section(e) -> list[str]:
    """The log-norm perturbation envelope of the first field against the growth measured by the Gronwall phase."""
    out = []
    if "envelope" in e:
        v = e["envelope"]
        out += ["### Perturbation envelope from the log-norm", "",
                f"For every start within eps ||x0|| (eps = {v['eps']:g}) of x0, ||x~(t) - x(t)|| <= G(t) ||x~0 - x0|| "
                "with G = exp(int mu), mu over a tube that holds both trajectories (bootstrapped). Against the growth "
                f"measured above (largest over directions and samples {v['measured_max_growth']:.3g}): G up to "
                + ", ".join(f"{x:.3g}" for x in v["G_max"]) + f" (ratio {v['ratio']:.3g}); for infinitesimal "
                "perturbations (the flow's derivative) G up to " + ", ".join(f"{x:.3g}" for x in v["G0_max"])
                + f" (ratio {v['ratio_infinitesimal']:.3g}). The same envelope with the local Lipschitz constant is "
                f"exp({v['L_local']:.3g}) = {math.exp(min(v['L_local'], 700)):.3g} and with the global one "
                f"10^{v['L_global'] / math.log(10):.0f}. At eps = {v['eps']:g} the finite-size envelope is "
                + ("vacuous (the tube of radius eps ||x0|| G makes the curvature term M2 rho too large for the "
                   "bootstrap)" if not all(math.isfinite(x) for x in v["G_max"]) else "finite")
                + "; the infinitesimal one is the sharp statement.", ""]
        if "envelope_small" in e:
            w = e["envelope_small"]
            out[-2] += (f" At eps = {w['eps']:g} (the growth measured again at that size, random and power-iterated worst directions: largest "
                        f"{w['measured_max_growth']:.3g}) the finite-size envelope, a bound for every start within "
                        f"that distance, is G up to " + ", ".join(f"{x:.3g}" for x in w["G_max"])
                        + f" (ratio {w['ratio']:.3g}; target within 10x: "
                        f"**{'met' if w['ratio'] <= 10 else 'missed'}**).")
    return out


def full_size_section(ti) -> list[str]:
    """The separate full-size run's numbers (`--enclosure-only --preset ti [--images N]`), once it exists."""
    if ti is not None:
        d = ti["data"] if "data" in ti else ti
        encs = d["enclosure"]
        enc, n = encs[0], len(encs)
        done = sum(all(e["proven"]) for e in encs)
        total = sum(e.get("wall_seconds", e["seconds"]["total"]) for e in encs) + d.get("field_seconds", 0.0)
        ratios = [e["ratio_t1"][0] for e in encs if "ratio_t1" in e]
        target = 600 if n == 1 else 600 * n / 8  # one image, or 8 images, in under 10 minutes
        return ["### Full-size ODE ViT", "",
                f"Preset `{d['settings']['preset']}` ({d['settings']['grid']}), {n} image(s), gain {enc['gain']}: "
                f"**{done}/{n} proven** on [0, t1]"
                + (f", radius / actual error at t1 {fmt(min(ratios))}-{fmt(max(ratios))}" if ratios else "")
                + f", {total:.0f} s in all on {d['settings'].get('threads')} thread(s) of a shared CPU (image 0: "
                f"{enc['accepted']} steps, {enc['fine_points']} defect sub-intervals, {enc['lognorm_points']} point "
                f"log-norms ({enc['lognorm']}); target: {'one image' if n == 1 else f'{n} images'} proven in under "
                f"{target:.0f} s on 2 cores: **{'met' if done == n and total <= target else 'missed'}**); see "
                "docs/divergence_ti.md.", ""]
    return ["The full-size run (`python experiments/divergence.py --enclosure-only --preset ti`) writes "
            "docs/divergence_ti.md; its numbers appear here once it has been run (docs/data/divergence_ti.json).", ""]


def last_proven(e) -> str:
    """The last time up to which the enclosure holds, and its radius there."""
    r = e["radius"][0]
    k = max(i for i, x in enumerate(r) if math.isfinite(x))
    return (f"Proven on [0, {e['t'][k]:.6g}] (t1 = {e['t'][-1]:g}), radius there {r[k]:.3g}"
            + ("." if k == len(r) - 1 else f"; not beyond: {e['reason'][0]}"))


def time_breakdown(e) -> str:
    """Where an enclosure's time went (the profile the full-size runs need)."""
    s = e["seconds"]
    ref = e.get("reference") or {}
    lp = max(1, e["lognorm_points"])
    return (f"Where the time went ({s['total']:.0f} s): user's solve {s['solve']:.1f} s; reference solve y_ref at "
            f"{e.get('ref_tol', float('nan')):g} ({ref.get('accepted', '-')} steps) with its step grid "
            f"{s.get('reference', 0.0) - s['defect'] - s['lognorm']:.0f} s; defect on {e['fine_points']} sub-intervals "
            f"(one evaluation of F each) {s['defect']:.0f} s; {e['lognorm_points']} point log-norms ({e['lognorm']}) "
            f"{s['lognorm']:.0f} s, {s['lognorm'] / lp:.2f} s each; distance ||y - y_ref|| "
            f"{s.get('distance', 0.0):.1f} s; the propagation and bootstrap take the rest.")


def enclosure_only_markdown(data, *, t1, shape) -> str:
    """docs/divergence_<preset>.md: the proven enclosures of random images of a full-size preset, one row each; t1
    and the state's (H, W, C) are the model's."""
    s, encs = data["settings"], data["enclosure"]
    e = encs[0]
    H, W, C = shape
    n = len(encs)
    images = "one random image" if n == 1 else f"{n} random images (seed {s['seed']}), each enclosed on its own"
    once = data.get("field_seconds", 0.0)  # the field's constants, built once for every image
    total = sum(x["wall_seconds"] for x in encs) + once
    in_all = [] if n == 1 else [f"In all: {sum(all(x['proven']) for x in encs)}/{n} images proven on [0, t1] in "
                                f"{total:.0f} s ({total / 60:.1f} min: the field's constants once, {once:.0f} s, then "
                                f"{(total - once) / n:.0f} s per image; the independent solves for the actual errors "
                                f"not counted).", ""]
    return "\n".join([
        f"# Proven enclosure of the full-size ODE ViT (preset `{s['preset']}`)", "",
        f"{H}x{W} tokens, C = {C} (n = {H * W * C} state dimensions), {images}, block weights at gain "
        f"{e['gain']}, t1 = {t1}, float64, {s['threads']} torch thread(s) on a CPU shared with other jobs.", "",
        f"dopri5 at rtol = atol = {s['enc_tol']:g}: {e['accepted']} accepted / {e['rejected']} rejected steps, "
        f"{e['nfe_forward']} NFE forward. Log-norm: {e['lognorm']} "
        + ("(per-token blocks: mu_2(J) <= ||T|| max ||D1_i|| + max mu_2(D2_i), looser than the dense one, affordable "
           "at this n)" if e["lognorm"] == "structured" else "(the whole n x n Jacobian)")
        + f"; {e['lognorm_points']} point log-norms, "
        f"{e['fine_points']} defect sub-intervals (defect_ratio {s['enc_defect_ratio']}, mu_slack {s['enc_slack']}; "
        f"reference at {ref_tol_text(s.get('enc_ref_tol', 'auto'), e.get('ref_tol'))} with defect target "
        f"{s.get('enc_ref_defect_abs', 'adaptive')})" + (" (image 0)." if n > 1 else "."), "",
        report.md_table((["image"] if n > 1 else []) + [
            "proven", "radius at t1", "actual error at t1", "radius / actual", "state norm at t1", "largest tube",
            "int mu bound", "curvature", "variance floor", "stiffness h*mu", "seconds"],
            [([str(x.get("image", i))] if n > 1 else []) + image_row(x) for i, x in enumerate(encs)]), "",
        *in_all, ("Image 0. " if n > 1 else "") + time_breakdown(e), "", last_proven(e), "",
        "Existence and uniqueness of the true solution on [0, t1] follow where proven (proofs/S5.md, Theorem 5). "
        + actual_sentence(e), "",
        f"Regenerate: `python experiments/divergence.py --enclosure-only --preset {s['preset']} --threads {s['threads']}"
        + (f" --images {n}`." if n > 1 else "`."),
        "", f"![enclosure](figures/{figure_name(s['preset'])}.png)", ""])


def image_row(e) -> list:
    """One image's row of the full-size table."""
    return ["yes" if e["proven"][0] else f"no: {e['reason'][0]}", fmt(e["radius_t1"][0]),
            fmt(e["actual_t1"][0]) if "actual_t1" in e else "-", fmt(e["ratio_t1"][0]) if "ratio_t1" in e else "-",
            fmt(e["state_norm_t1"][0]), fmt(e["tube_max"][0]), fmt(e["mu_max"][0]), fmt(e["curvature_max"]),
            fmt(e["variance_floor"]), fmt(e["stiffness_max"]), f"{e['wall_seconds']:.0f}"]


def ref_tol_text(asked, used) -> str:
    """The reference tolerance the run used (the enclosure's stats), and the rule behind it where 'auto' chose it."""
    from lipcheck.wellposed.enclosure import REF_FACTOR
    if used is None:
        return "an unrecorded tolerance" if asked == "auto" else f"{asked:g}"
    factor = f"{REF_FACTOR:.0e}".replace("e-0", "e-")  # 1e-3, as proofs/S5.md writes it
    return f"tol * {factor} = {used:g}" if asked == "auto" else f"{used:g}"


def actual_sentence(e) -> str:
    """How the actual error was measured (the full-size run), or that it was not (a report from before it was)."""
    if "actual_t1" not in e:
        return "No actual error was measured in this run."
    return (f"The actual error ||x(t) - y(t)|| comes from an independent fixed-step dopri8 solve "
            f"({e['reference_steps']} steps, halved until two agree to 1e-13; estimated error "
            f"{fmt(e['reference_error'])}, {e['reference_seconds']:.0f} s) landing on {len(e['actual_t'])} of the "
            f"enclosure's times; every actual error lies inside its radius: "
            f"**{'yes' if e['contained'] else 'NO (a contradiction: the proof is wrong somewhere)'}**.")


def figure_name(preset: str) -> str:
    return f"divergence_{preset}_enclosure"


def enclosure_only_figures(data) -> list:
    """The first image's radius and actual error over t (every image's where there are up to 4)."""
    encs = data["enclosure"][:4]
    runs = [{**e, **({} if "actual_t1" in e else {"actual": [None], "ratio_t1": None}),
             "tol": data["settings"]["enc_tol"]} for e in encs]
    fig = enclosure_figure(runs)
    return [(figure_name(data["settings"]["preset"]), fig[1])]
