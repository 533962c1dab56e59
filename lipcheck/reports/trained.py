"""The trained report (`lipcheck trained`): the three verdicts on `lipcheck train` checkpoints, as Markdown and
figures from the command's numbers (docs/data/trained.json), and the tables of the one-checkpoint reports
(`lipcheck certify|wellposed|probe --checkpoint RUN`)."""
from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from lipcheck import report, verdicts  # noqa: E402
from lipcheck.wellposed import LOGNORM_WORK, REF_WORK_BUDGET  # noqa: E402

COLORS = {"trained": "C0", "init": "C7"}


def certificate_line(c: dict) -> str:
    if c["kind"] == "enclosure":
        return f"Enclosure: proven per sample {c['proven']}, radius at t1 {c['radius_t1']}; {c['reason']}"
    fmt = lambda xs: ", ".join(f"{x:.3g}" for x in xs)
    return (f"A-posteriori bound at t1 (dopri5, tol {c['tol']:g}): {fmt(c['bound_t1'])} against the actual error "
            f"{fmt(c['actual_t1'])}; " + {"holds": "the bound holds at every sampled time",
                                          "violated": "THE BOUND IS VIOLATED at some sampled time",
                                          "vacuous": f"vacuous: exp(L t) with L = {c['L']:.3g} overflows, no finite bound"}
            [c["status"]] + f" ({c['reason']})")



def ssog_table(rows: list[dict]) -> str:
    return report.md_table(
        ["layer", "grid", "lower", "upper (certified)", "method", "gap", "upper (probabilistic)", "resolution-free",
         "exact", "seconds"],
        [[r["layer"], f"{r['H']}x{r['W']}", f"{r['lower']:.6g}", f"{r['upper']:.6g}", r.get("method") or "-",
          f"{r['gap']:.2e}", f"{r['upper_probabilistic']:.6g} (p_fail {r['failure_probability']:.0e})",
          f"{r['resolution_free']:.6g}", "-" if r["exact"] is None else f"{r['exact']:.6g}",
          f"{r['seconds']:.1f}"] for r in rows])


def blocks_table(rows: list[dict]) -> str:
    disc = any("block_global" in r for r in rows)
    head = ["block", "mixer", "Lip(mixer)", "Lip(MLP)", "F global", "F local (states)", "F lower (at a state)"]
    head += ["block global", "block local"] if disc else []
    body = []
    for r in rows:
        line = [r["block"], r["mixer_kind"], f"{r['mixer']:.4g}", f"{r['mlp']:.4g}",
                f"{r['field_global']:.4g}" + (" (vacuous)" if r["vacuous"] else ""), f"{r['field_local']:.4g}",
                f"{r['field_lower']:.4g}" if "field_lower" in r else "-"]
        if disc:
            line += [f"{r['block_global']:.4g}", f"{r['block_local']:.4g}"]
        body.append(line)
    return report.md_table(head, body)


def probe_table(trained: list[dict], init: list[dict] | None = None) -> str:
    radii = trained[0]["radii"]
    body = []
    for k, c in enumerate(trained):
        body.append([c["branch"], c["layer"]] + [f"{v:.4g}" for v in c["lower"]] + [f"{c['exponent']:.2f}"])
        if init is not None:
            i = init[k]
            body.append([c["branch"] + " (init)", i["layer"]] + [f"{v:.4g}" for v in i["lower"]] + [f"{i['exponent']:.2f}"])
    head = ["map", "layer"] + [f"L({r:g})" for r in radii] + ["fitted exponent"]
    return report.md_table(head, body)


def sweep_table(sw: dict) -> str:
    rows = [[r["method"], r["tol"] if r["tol"] is not None else f"{r['steps']} steps", f"{r['error']:.3e}", r["nfe"]]
            for r in sw["runs"]]
    return report.md_table(["method", "tol / steps", "max rel. error vs reference", "NFE"], rows)


# ------------------------------------------------------------------------------------- one checkpoint
def enclosure_table(rows: list[dict]) -> str:
    def cell(r):
        if r["proven"]:
            return "proven on [0, t1]"
        if r.get("refused"):
            return "refused"
        if (r.get("reason") or "").startswith("not attempted"):
            return "not attempted"
        return f"not proven; proven on [0, {r['t_proven']:.4g}]"
    return report.md_table(["image", "verdict", "radius at t1", "actual error at t1", "radius / actual", "seconds",
                            "reason (where not proven)"],
                           [[r["image"], cell(r), f"{r['radius_t1']:.3g}",
                             "-" if r["actual_t1"] is None else f"{r['actual_t1']:.3g}",
                             "-" if r["ratio_t1"] is None else f"{r['ratio_t1']:.3g}", f"{r['seconds']:.1f}",
                             r["reason"] or ""] for r in rows])


PER_IMAGE_ROWS = 16  # up to this many images (constants lines) the report lists each; beyond, quantiles
CONSTANT_KEYS = ("token_radius", "mixer_lipschitz", "mixer_curvature", "variance_floor", "lipschitz", "curvature")


def _g(v: float) -> str:
    """A constant to 4 digits; '-' for nan (a refused image tried no tube: no log-norm over it)."""
    return "-" if v != v else f"{v:.4g}"


def field_constants_table(rows: list[dict]) -> str:
    """One line per distinct variance floor (one per enclose call): the constants each image's proof used; beyond
    PER_IMAGE_ROWS such lines, per mixer the min, median and max of each column over them."""
    seen, lines = set(), []
    for r in rows:
        f = r.get("field")
        if not f or f["variance_floor"] in seen:
            continue
        seen.add(f["variance_floor"])
        mus = [x["field"]["mu_max"] for x in rows
               if x.get("field") and x["field"]["variance_floor"] == f["variance_floor"]]
        lines.append((f["mixer"], [f[k] for k in CONSTANT_KEYS] + [max(mus)]))
    if not lines:
        return ""
    head = ["mixer", "token radius R", "mixer Lipschitz (on D_R)", "mixer curvature K2", "variance floor v",
            "field Lipschitz L(v)", "field curvature M2(v)", "largest tube log-norm"]
    if len(lines) <= PER_IMAGE_ROWS:
        return report.md_table(head, [[m] + [_g(v) for v in vals] for m, vals in lines])
    body = []
    for mixer in dict.fromkeys(m for m, _ in lines):
        cols = list(zip(*(vals for m, vals in lines if m == mixer)))
        n = len(cols[0])
        for name, pick in (("min", min), ("median", statistics.median), ("max", max)):
            body.append([f"{mixer} ({name} of {n})"] + [_g(pick(c)) for c in cols])
    return report.md_table(head, body)




def enclosure_summary(rows: list[dict], run: dict, *, t1: float, noun: str = "images") -> list[str]:
    """The answer first (how many images are proven on [0, t1]), then the radius and radius / actual error at t1
    over the proven images (min, median, max), the seconds per image and how the work was split over processes;
    every image's row when there are few, else only the unproven ones with their reasons."""
    proven = [r for r in rows if r["proven"]]
    wall, world = run["wall_s"], run["world_size"]
    md = [f"## Proven on [0, t1 = {t1:g}] for {len(proven)}/{len(rows)} {noun}", ""]
    quant = []
    for name, key in (("radius at t1", "radius_t1"), ("actual error at t1", "actual_t1"),
                      ("radius / actual error", "ratio_t1")):
        vals = sorted(r[key] for r in proven if isinstance(r.get(key), (int, float)))
        if vals:
            quant.append([name, f"{vals[0]:.3g}", f"{statistics.median(vals):.3g}", f"{vals[-1]:.3g}"])
    if quant:
        md += [report.md_table(["over the proven images", "min", "median", "max"], quant), ""]
    md += [f"{wall:.1f} s wall for {len(rows)} images on {world} process{'es' if world > 1 else ''} in batches of "
           f"{run['batch']} ({run['batches']} enclose calls): {wall / len(rows):.2f} s per image, "
           f"{wall * world / len(rows):.2f} process-seconds per image (with the independent solves of the images "
           f"attempted; an image's seconds below are its share of its batch's enclosure).", ""]
    consts = field_constants_table(rows)
    if consts:
        md += ["The field's constants (proofs/S5.md, Lemma 2 and \"The attention field\"): the mixer's Lipschitz bound "
               "on the LN1 image (||T|| for SSoG) and its own curvature (0 for SSoG's linear mixer), the field's "
               "Lipschitz and curvature constants at the token-variance floor the batch's tubes kept, and the largest "
               "log-norm over the tube (one line per enclose call; beyond 16 calls their min, median and max):", "", consts,
               ""]
    shown = rows if len(rows) <= PER_IMAGE_ROWS else [r for r in rows if not r["proven"]]
    if shown:
        md += ["Per image:" if shown is rows else "The images not proven, and why:", "", enclosure_table(shown)]
    return md



def name_of(a: dict) -> str:
    return f"{a['variant']}/{a['mixer']}"


def markdown(data: dict, *, trained_here: bool, threads: int, splits_md: list[str] = ()) -> str:
    """docs/trained.md from the command's numbers; trained_here: whether this run trained the models first,
    threads: torch's CPU threads; splits_md: the whole-test-split part (`whole_split.section`), after the proofs."""
    results, cfg = data["models"], data["settings"]
    md = intro(results, cfg) + s12_section(results) + s3_section(results) + s4_section(results, cfg)
    md += s5_section(results, cfg) + enclosure_section(results, cfg) + list(splits_md) + own_model_section()
    return "\n".join(md + regenerate_section(data["mode"], data["elapsed_s"], trained_here, threads))


def intro(results, cfg) -> list[str]:
    return ["# Trained models: the three verdicts", "",
            "Every other report certifies models that lipcheck builds at random initialisation. Here the same "
            "questions are asked of models `lipcheck train` trained on scikit-learn digits (8x8 grey, 4x4 token "
            "grid, width 48, 3 heads, depth 4; seed 0), loaded back from their checkpoints with `lipcheck.load`, each "
            "beside the same architecture at the run's own initial weights (\"init\": the seed rebuilds them). "
            f"Images: the first {cfg['images']} of the digits test split, normalised as in training.", "",
            report.md_table(["model", "epochs", "test acc", "training s (from the run's log)", "checkpoint"],
                            [[name_of(a), a["epoch"], f"{100 * a['test_acc']:.1f}%" if a["test_acc"] is not None else "-",
                              f"{a['train_wall_s']:.0f}" if a.get("train_wall_s") is not None else "-",
                              f"`{Path(a['checkpoint']).parent.name}/checkpoint.pt`"] for a in results]), "",
            "Short training (a few epochs on digits): the accuracies are those of a small budget, not converged models; "
            "the point is what training does to the constants.", ""]


def s12_section(results) -> list[str]:
    md = ["## S1-S2: every SSoG layer, at the model's grid and 2x/4x it", "",
          "`lipcheck.bounds.ssog_lipschitz` on each SSoG layer found in the model (`model.modules()`): certified lower "
          "and upper bounds on the fixed-kernel layer's constant ||T||_2, the probabilistic upper bound (Lanczos "
          "from a random start; fails with probability <= 1e-6), the relative gap, the resolution-free bound (every "
          "grid) and the dense SVD where the grid is small.", ""]
    for a in results:
        if not a["trained"]["certify"]["ssog"]:
            continue
        tr, ini = a["trained"]["certify"]["ssog"], a["init"]["certify"]["ssog"]
        rows = [[r["layer"], f"{r['H']}x{r['W']}", f"{r['lower']:.5g}", f"{r['upper']:.5g}",
                 f"{r['upper_probabilistic']:.5g}", f"{r['gap']:.1e}", f"{r['resolution_free']:.5g}",
                 f"{i['upper']:.5g}", f"{r['upper'] / i['upper']:.2f}x"] for r, i in zip(tr, ini)]
        md += [f"**{name_of(a)}**", "", report.md_table(
            ["layer", "grid", "lower", "upper", "upper (prob.)", "gap", "resolution-free", "init upper",
             "trained / init"], rows), ""]
        worst = max(tr, key=lambda r: r["resolution_free"])
        md += [f"Largest resolution-free bound: {worst['resolution_free']:.4g} ({worst['layer']}), against "
               f"{max(r['resolution_free'] for r in ini):.4g} at init: training changed SSoG's certified constant by "
               f"a factor {worst['resolution_free'] / max(r['resolution_free'] for r in ini):.2f}, and it stays "
               "finite and grid-independent (S1) after training.", ""]
    return md


def s3_section(results) -> list[str]:
    md = ["## S3: block and vector-field constants", "",
          "`lipcheck.bounds.vector_field_lipschitz` per pre-norm block: F(x) = Mixer(LN1 x) + MLP(LN2 x) globally "
          "(LayerNorm's max|gamma|/sqrt(eps)) and locally at the states the test images visit (ODE: the trajectory "
          "at 9 times; discrete: each block's inputs, and LN2's own inputs for its factor); for discrete blocks also "
          "the residual block x -> x + Mixer(LN1 x) -> . + MLP(LN2 .). \"F lower\" is a certified lower bound: "
          "||J_F(x) v|| evaluated at a visited state x (power iteration), so lower <= local must hold. Attention's "
          "mixer constant is finite only because LN1 bounds its inputs (S4): it is the bound on that compact domain.", ""]
    rows = []
    for a in results:
        for state in ("trained", "init"):
            for b in a[state]["certify"]["blocks"]:
                rows.append([name_of(a), state, b["block"], f"{b['mixer']:.4g}", f"{b['mlp']:.4g}",
                             f"{b['field_global']:.4g}" + (" (vacuous)" if b["vacuous"] else ""),
                             f"{b['field_local']:.4g}", f"{b['field_lower']:.4g}",
                             f"{b['block_local']:.4g}" if "block_local" in b else "-"])
    md += [report.md_table(["model", "weights", "block", "Lip(mixer)", "Lip(MLP)", "F global", "F local", "F lower",
                            "block local"], rows), ""]
    bad = [(a, s, b) for a in results for s in ("trained", "init") for b in a[s]["certify"]["blocks"]
           if b["field_lower"] > b["field_local"] * (1 + 1e-9)]
    md += [("Every certified lower bound lies below its local upper bound." if not bad else
            f"**{len(bad)} lower bounds exceed their local upper bound: the local bound is wrong there.**"),
           "The global constants are vacuous wherever LayerNorm's 1/sqrt(eps) (eps = 1e-6) enters; the local ones "
           "along real trajectories are the usable numbers.", ""]
    return md


def s4_section(results, cfg) -> list[str]:
    md = ["## S4: attention growth, trained against init", "",
          f"`lipcheck.probe.attention_growth` on each dense-attention layer alone (\"mixer\") and on its pre-LN "
          f"residual branch x -> Attn(LN1 x) (\"block\"), at the 4x4 grid, radii {', '.join(f'{r:g}' for r in cfg['radii'])}; "
          f"{cfg['probe']['restarts']} restarts x {cfg['probe']['steps']} ascent steps per radius (cheap settings: "
          "each value is a certified lower bound, attained at an actual input, and the true L(R) may be larger).", ""]
    for a in results:
        if "probe" not in a["trained"]:
            continue
        md += [f"**{name_of(a)}**", "", probe_table(a["trained"]["probe"], a["init"]["probe"]), ""]
        mix = [(t, i) for t, i in zip(a["trained"]["probe"], a["init"]["probe"]) if t["branch"] == "mixer"]
        ratio = [t["lower"][-1] / i["lower"][-1] for t, i in mix]
        exps = [t["exponent"] for t, _ in mix]
        grows = all(e > 1.5 for e in exps)
        blk = [t for t in a["trained"]["probe"] if t["branch"] == "block"]
        flat = all(c["lower"][-1] <= 1.01 * c["lower"][-2] for c in blk)
        md += [f"At R = {cfg['radii'][-1]:g} the trained layers' lower bounds are {min(ratio):.2f}-{max(ratio):.2f}x "
               f"those at init; fitted exponents over the upper half of the radii (trained): "
               f"{', '.join(f'{e:.2f}' for e in exps)}. "
               + ("The growth without bound (about R^2) is there after training as at init. " if grows else
                  "**Not every trained layer shows R^2 growth over these radii** (the cheap search, or radii too small "
                  "for these weights). ")
               + ("The pre-LN branch levels off (LayerNorm makes its domain compact: a large but finite constant)."
                  if flat else "The pre-LN branch was still rising at the largest radius."), ""]
    return md


def s5_section(results, cfg) -> list[str]:
    md = ["## S5: well-posedness of the trained ODE models", "",
          "`lipcheck.wellposed.tolerance_sweep` (methods " + ", ".join(cfg["methods"]) + ", rtol = atol in "
          + ", ".join(f"{t:g}" for t in cfg["tolerances"]) + "; rk4 at " + ", ".join(map(str, cfg["rk4_steps"]))
          + " steps; errors against a converged fixed-step dopri8 reference), `perturbation_growth` (random and "
          "power-iteration worst directions against the Gronwall envelope exp(L t), L local along the trajectories "
          "and global) and `aposteriori_certificate` (dopri5 at tol 1e-3: the bound from the solve's own defect "
          "against its actual error). The certificate is not interval-rigorous between samples; the proof is the "
          "enclosure below.", ""]
    return md + s5_table(results) + s5_findings(results, cfg)


def s5_table(results) -> list[str]:
    rows = []
    for a in results:
        if "wellposed" not in a["trained"]:
            continue
        for state in ("trained", "init"):
            w = a[state]["wellposed"]
            conv, g, c = w["sweep"]["convergence"], w["growth"], w["certificate"]
            nfe = {r["tol"]: r["nfe"] for r in w["sweep"]["runs"] if r["method"] == "dopri5"}
            rows.append([name_of(a), state, f"{conv.get('slope') or float('nan'):.2f}",
                         f"{conv['max_error_at_tightest']:.1e}", f"{conv['spread']:.1e}" if conv.get("spread") else "-",
                         " / ".join(str(nfe[t]) for t in sorted(nfe, reverse=True)),
                         f"{g['L_local']:.3g}", f"{g['L_global']:.3g}",
                         f"{max(g['max_growth'].values()):.4g}", f"{g['violations']['local']}",
                         ", ".join(f"{b:.2e}" for b in c.get("bound_t1", [])),
                         ", ".join(f"{b:.2e}" for b in c.get("actual_t1", [])),
                         c.get("status", "proven" if c.get("proven") else "not proven")])
    return [report.md_table(["model", "weights", "error/tol slope", "max error at tightest tol",
                             "spread between methods", "dopri5 NFE (loose -> tight)", "L local", "L global",
                             "max growth", "envelope violations", "certificate bound at t1", "actual error at t1",
                             "certificate"], rows), ""]


def s5_findings(results, cfg) -> list[str]:
    md = []
    ws = [(a, st_, a[st_]["wellposed"]) for a in results if "wellposed" in a["trained"] for st_ in ("trained", "init")]
    if ws:
        viol = [f"{name_of(a)} {s_}" for a, s_, w in ws if w["growth"]["violations"]["local"]]
        broken = [f"{name_of(a)} {s_}" for a, s_, w in ws if w["certificate"].get("status") == "violated"]
        vacuous = [f"{name_of(a)} {s_} (L = {w['certificate']['L']:.3g})" for a, s_, w in ws
                   if w["certificate"].get("status") == "vacuous"]
        spread = max(w["sweep"]["convergence"].get("spread") or 0.0 for _, _, w in ws)
        same = [f"{name_of(a)} {s_}" for a, s_, w in ws if w["growth"]["L_local"] >= w["growth"]["L_global"]]
        md += [f"Solvers agree at the tightest tolerance to within {spread:.1e} (relative, largest spread between methods). "
               + ("Perturbations stay inside the local Gronwall envelope in every run. " if not viol else
                  f"**The local Gronwall envelope is violated in {', '.join(viol)}.** ")
               + ("The a-posteriori bound is never below the actual error at a sampled time. " if not broken else
                  f"**The a-posteriori bound fails in {', '.join(broken)}.** ")
               + (f"It is vacuous (exp(L t) overflows: no finite number) in {', '.join(vacuous)}: there the certified "
                  "constant is too large for a Gronwall-type bound to say anything on [0, t1]. " if vacuous else "")
               + (f"In {', '.join(same)} the local L equals the global one: at {cfg['growth_grid']} sampled intervals "
                  "the token-variance floor on the segments between trajectories is lost in the drift margin "
                  "(`--full` samples finely enough to keep it). " if same else "")
               + "With pre-LN both mixers' fields are Lipschitz on the states visited: what separates them is the size "
               "of the constants, not existence (S5).", ""]
    return md


def constants_side_by_side(models: list[tuple[str, list[dict]]]) -> str:
    """`field_constants_table`'s columns, one line per model and weights (the first enclose call's constants)."""
    body = []
    for name, rows in models:
        f = next((r["field"] for r in rows if r.get("field")), None)
        if f is None:
            continue
        mus = [r["field"]["mu_max"] for r in rows if r.get("field")]
        body.append([name, f["mixer"]] + [f"{f[k]:.4g}" for k in ("mixer_lipschitz", "mixer_curvature",
                                                                  "variance_floor", "lipschitz", "curvature")]
                    + [_g(max(mus)), f"{sum(r['proven'] for r in rows)}/{len(rows)}"])
    if not body:
        return ""
    return report.md_table(["model", "mixer", "mixer Lipschitz (on D_R)", "mixer curvature K2", "variance floor v",
                            "field Lipschitz L(v)", "field curvature M2(v)", "largest tube log-norm", "proven"], body)


def enclosure_section(results, cfg: dict | None = None) -> list[str]:
    md = ["### The proof: enclosures of every image's true trajectory", "",
          "`lipcheck.wellposed.enclose` per image (dopri5 at tol " f"{verdicts.ENCLOSE_TOL:g}" ", its reference solve "
          "enclosed at tol * 1e-3; proofs/S5.md), the radius at t1 beside the actual error against an independent "
          "fixed-step dopri8 solve converged to 1e-13. This is what `lipcheck wellposed --checkpoint RUN` runs.", ""]
    consts = []
    for a in results:
        for state in ("trained", "init"):
            if "enclosure" in a.get(state, {}):
                md += [f"**{name_of(a)}, {state} weights**", "", enclosure_table(a[state]["enclosure"]), ""]
                consts.append((f"{name_of(a)}, {state}", a[state]["enclosure"]))
    if cfg is not None and cfg.get("enclosure_seconds"):
        md += [f"Each model's enclose call had a budget of {cfg['enclosure_seconds']:g} s; where it was used up, the "
               "row says up to which t the proof holds. Each also had the default work budget (max_work = "
               f"{REF_WORK_BUDGET:.3g} field evaluations predicted for its reference enclosure: defect sub-intervals, "
               f"and {LOGNORM_WORK} per point log-norm): an image predicted "
               "above it is refused before any proof, its reason giving the prediction and the constants behind it.",
               ""]
    table = constants_side_by_side(consts)
    if table:
        md += ["The constants each proof used, the two mixers side by side (proofs/S5.md, Lemma 2 and \"The "
               "attention field\"): the mixer's Lipschitz bound on the LN1 image (||T|| for SSoG) and its curvature "
               "(0 for SSoG's linear mixer), then the field's at the token-variance floor the tubes kept.", "", table,
               ""]
    md += ["Both fields are enclosed the same way: pre-LN keeps attention's tokens in a ball, where its Jacobian and "
           "second derivative are bounded (proofs/S5.md, \"The attention field\"); both have solutions on [0, t1] "
           "(S5). The contrast is in the constants: attention's curvature grows like R^3 and makes its proof far "
           "costlier per image.", ""]
    return md


def own_model_section() -> list[str]:
    return ["## Your own model", "",
            "`lipcheck.load(path)` returns the model of any `lipcheck train` checkpoint with its configuration and data "
            "description; `lipcheck.verdicts` runs the same analyses on any nn.Module: `certify_ssog(model, grids)` finds "
            "every lipcheck SSoG layer inside it, `block_constants(model, images)` every pre-norm block with a lipcheck "
            "mixer, `jacobian_lower_bound(module, states)` certifies lower bounds for any module mapping (B, H, W, C) to "
            "(B, H, W, C), and `lipcheck.probe.attention_growth` probes any such module. A timm-style attention (tokens "
            "(B, N, C)) needs a few lines (tests/test_checkpoint.py checks that it probes exactly like `DenseAttention` "
            "with copied weights):", "",
            "```python",
            "class Grid(torch.nn.Module):              # (B, H, W, C) -> (B, H, W, C) around a (B, N, C) module",
            "    def __init__(self, inner, dim):",
            "        super().__init__(); self.inner, self.dim = inner, dim",
            "    def forward(self, x):",
            "        B, H, W, C = x.shape",
            "        return self.inner(x.reshape(B, H * W, C)).reshape(B, H, W, C)",
            "",
            "growth = lipcheck.probe.attention_growth(Grid(timm_block.attn, 192), radii=[1, 16, 256], grid=(14, 14))",
            "```", "",
            "Certified upper bounds need the structure (SSoG's operator, LayerNorm, the MLP's weights): for a foreign "
            "block only lower bounds are available.", ""]


def regenerate_section(mode, elapsed, trained_here, threads) -> list[str]:
    return ["## Figures", "", "![SSoG constants, trained vs init](figures/trained_ssog.png)", "",
            "![attention growth, trained vs init](figures/trained_attention.png)", "",
            "![tolerance sweeps and certificates](figures/trained_wellposed.png)", "",
            "## Regenerate", "", "```",
            "python experiments/trained.py            # trains the four digits models into runs/trained/ if absent",
            "python experiments/trained.py --checkpoint runs/a --checkpoint runs/b   # any `lipcheck train` checkpoints",
            "lipcheck certify --checkpoint runs/trained/discrete-ssog      # one model, one verdict",
            "lipcheck probe --checkpoint runs/trained/discrete-attention",
            "lipcheck wellposed --checkpoint runs/trained/ode-ssog", "```", "",
            f"Settings: `{mode}`. Whole command: {elapsed / 60:.1f} min" +
            (" including training" if trained_here else " (checkpoints already trained)") +
            f", {threads} CPU thread(s).", ""]


def figures(data: dict) -> list:
    """(name, figure) for each figure that has models to show."""
    results = data["models"]
    ssog = [a for a in results if a["trained"]["certify"]["ssog"]]
    att = [a for a in results if "probe" in a["trained"]]
    ode = [a for a in results if "wellposed" in a["trained"]]
    return (([("trained_ssog", ssog_figure(ssog))] if ssog else [])
            + ([("trained_attention", attention_figure(att))] if att else [])
            + ([("trained_wellposed", wellposed_figure(ode))] if ode else []))


def ssog_figure(ssog):
    fig, axes = plt.subplots(1, len(ssog), figsize=(5 * len(ssog), 3.6), squeeze=False, constrained_layout=True)
    for ax, a in zip(axes[0], ssog):
        for state in ("trained", "init"):
            rows = a[state]["certify"]["ssog"]
            for name in dict.fromkeys(r["layer"] for r in rows):
                rs = [r for r in rows if r["layer"] == name]
                n = [r["H"] for r in rs]
                ax.plot(n, [r["upper"] for r in rs], color=COLORS[state], marker="o", ms=3, alpha=0.8,
                        label=f"{state}: certified upper" if name == rows[0]["layer"] else None)
                ax.plot(n, [r["lower"] for r in rs], color=COLORS[state], ls=":", marker=".", alpha=0.8,
                        label=f"{state}: lower" if name == rows[0]["layer"] else None)
                ax.axhline(rs[0]["resolution_free"], color=COLORS[state], ls="--", lw=0.8, alpha=0.6,
                           label=f"{state}: resolution-free" if name == rows[0]["layer"] else None)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("grid side H = W (tokens)")
        ax.set_ylabel("Lip(SSoG layer)")
        ax.set_title(f"{name_of(a)}: every SSoG layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def panels(n: int):
    """Two axes per model in one row."""
    return plt.subplots(1, 2 * n, figsize=(4.2 * 2 * n, 3.6), squeeze=False, constrained_layout=True)


def attention_figure(att):
    fig, axes = panels(len(att))
    for k, a in enumerate(att):
        for j, branch in enumerate(("mixer", "block")):
            ax = axes[0][2 * k + j]
            for state in ("trained", "init"):
                for i, c in enumerate(c for c in a[state]["probe"] if c["branch"] == branch):
                    ax.plot(c["radii"], c["lower"], color=COLORS[state], marker="o", ms=3, alpha=0.8,
                            label=state if i == 0 else None)
            r = torch.tensor(a["trained"]["probe"][0]["radii"], dtype=torch.float64)
            if branch == "mixer":
                top = max(c["lower"][-1] for c in a["trained"]["probe"] if c["branch"] == "mixer")
                ax.plot(r, top * (r / r[-1]) ** 2, color="k", ls="--", lw=0.8, label="R^2 slope")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("radius R (Frobenius)")
            ax.set_ylabel("certified lower bound on L(R)")
            ax.set_title(f"{name_of(a)}: " + ("attention layers" if branch == "mixer" else "x -> Attn(LN1 x)"))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return fig


def wellposed_figure(ode):
    fig, axes = panels(len(ode))
    for k, a in enumerate(ode):
        ax, axc = axes[0][2 * k], axes[0][2 * k + 1]
        for state in ("trained", "init"):
            w = a[state]["wellposed"]
            for j, m in enumerate(dict.fromkeys(r["method"] for r in w["sweep"]["runs"] if r["tol"] is not None)):
                rs = [r for r in w["sweep"]["runs"] if r["method"] == m]
                ax.plot([r["tol"] for r in rs], [max(r["error"], 1e-17) for r in rs], color=COLORS[state],
                        marker="osd^"[j % 4], ms=4, alpha=0.8, label=f"{state}: {m}")
            c = w["certificate"]
            if c["kind"] == "a-posteriori":
                t = c["t"]
                bound = [max(b[i] for b in c["bound"]) for i in range(len(t))]
                actual = [max(x[i] for x in c["actual"]) for i in range(len(t))]
                if c["status"] == "vacuous" or max(bound) > 1e6 * max(actual):  # would only flatten the plot
                    axc.plot([], [], color=COLORS[state], label=f"{state}: certificate bound vacuous "
                             f"(L = {c['L']:.3g}; off the scale)")
                else:
                    axc.plot(t, bound, color=COLORS[state], label=f"{state}: certificate bound")
                axc.plot(t, actual, color=COLORS[state], ls=":", label=f"{state}: actual error")
        tols = sorted({r["tol"] for r in a["trained"]["wellposed"]["sweep"]["runs"] if r["tol"] is not None})
        ax.plot(tols, tols, color="k", lw=0.8, ls="--", label="error = tol")
        for a_ in (ax, axc):
            a_.set_yscale("log")
            a_.grid(alpha=0.3)
            a_.legend(fontsize=6)
        ax.set_xscale("log")
        ax.set_xlabel("rtol = atol")
        ax.set_ylabel("max relative error at t1")
        ax.set_title(f"{name_of(a)}: tolerance sweep")
        axc.set_xlabel("t")
        axc.set_ylabel("||x(t) - y(t)||")
        axc.set_title(f"{name_of(a)}: dopri5 at tol {a['trained']['wellposed']['certificate'].get('tol', '')}")
    return fig


