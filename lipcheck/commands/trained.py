"""The three verdicts on trained models: certify (S1-S3), probe (S4), well-posedness (S5).

    python experiments/trained.py                 # docs/trained.md: trains the digits models if absent
    python experiments/trained.py --checkpoint runs/a/checkpoint.pt --checkpoint runs/b   # given checkpoints

`lipcheck certify|wellposed|probe --checkpoint RUN` come here too (`run_checkpoint`): the verdict on one trained
model, written to RUN/verdicts/ (or --docs). Bad input (missing or corrupt checkpoint, a model without SSoG layers
for certify, without attention for probe, not an ODE model for wellposed, a data set the model cannot take) stops
with one line naming the fix and exit status 2, before anything is written.
"""
from __future__ import annotations

import copy
import math
import sys
import time
from pathlib import Path


import matplotlib  # noqa: E402

matplotlib.use("Agg")
import torch  # noqa: E402

from lipcheck import report, verdicts, wellposed  # noqa: E402
from lipcheck import checkpoint as C  # noqa: E402
from lipcheck import train as T  # noqa: E402
from lipcheck.mixers.attention import DenseAttention  # noqa: E402

from .common import fail, set_threads  # noqa: E402
from . import common  # noqa: E402

F64 = torch.float64
GRID_MULTIPLES = (1, 2, 4)  # the model's own token grid and 2x, 4x that grid
SETTINGS = {
    "quick": dict(images=2, tolerances=(1e-2, 1e-4, 1e-6, 1e-8), rk4_steps=(4, 8, 16, 32),
                  methods=("dopri5", "bosh3", "rk4"), growth_grid=16, power_iters=2, power_steps=8, cert_tol=1e-3,
                  cert_per_step=8, radii=(1.0, 16.0, 256.0, 1024.0),
                  probe=dict(restarts=4, steps=8, certify_steps=20, certify_top=1)),
    "full": dict(images=4, tolerances=(1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9),
                 rk4_steps=(4, 8, 16, 32, 64, 128), methods=("dopri5", "dopri8", "bosh3", "rk4"), growth_grid=None,
                 power_iters=4, power_steps=16, cert_tol=1e-3, cert_per_step=None,
                 radii=(1.0, 4.0, 16.0, 64.0, 256.0, 1024.0),
                 probe=dict(restarts=6, steps=12, certify_steps=30, certify_top=1)),
}
BAD_INPUT = (FileNotFoundError, C.CheckpointError, ValueError)


# ------------------------------------------------------------------------------------------ analyses
def grids_of(ckpt_or_model) -> list[tuple[int, int]]:
    H, W = verdicts.model_grid(ckpt_or_model)
    return [(k * H, k * W) for k in GRID_MULTIPLES]


def certify(model, images, *, progress: bool = False) -> dict:
    """S1-S3 on one model: every SSoG layer at the model's grid and 2x/4x it, and the block / vector-field
    constants at the states `images` visit."""
    rows = verdicts.certify_ssog(model, grids_of(model), progress=progress) if verdicts.ssog_layers(model) else []
    return {"ssog": rows, "blocks": verdicts.block_constants(model, images)}


def certificate(model, images, *, tol: float, per_step=None) -> dict:
    """S5's certificate for one solve, summarised. The one line to change for the proven enclosure:
    `res = wellposed.enclose(model, images, tol=tol)`; `summarise_certificate` reads either result."""
    res = wellposed.aposteriori_certificate(model, images, tol=tol, per_step=per_step)
    return summarise_certificate(res)


def summarise_certificate(res) -> dict:
    if hasattr(res, "proven"):  # lipcheck.wellposed.enclose: a proven enclosure per sample
        radius = torch.as_tensor(res.radius)
        return {"kind": "enclosure", "proven": [bool(p) for p in torch.as_tensor(res.proven).tolist()],
                "radius_t1": radius[-1].tolist(), "reason": res.reason, "t": torch.as_tensor(res.t).tolist()}
    finite = all(math.isfinite(b) for row in res["bound"] for b in row)
    status = "vacuous" if not finite else ("holds" if res["violations"] == 0 else "violated")
    return {"kind": "a-posteriori", "tol": res["tol"], "nfe": res["nfe"], "L": res["L"], "L_global": res["L_global"],
            "bound_t1": res["bound_t1"], "actual_t1": res["actual_t1"], "violations": res["violations"],
            "min_ratio": res["min_ratio"], "max_ratio": res["max_ratio"], "max_delta": res["max_delta"],
            "proven": None, "status": status,
            "bound_holds": status == "holds",
            "reason": "not a proof: a bound from the solve's own defect (quadrature with a safety margin, not "
                      "interval-rigorous between samples), checked against a converged reference",
            "t": res["t"], "bound": res["bound"],
            "actual": res["actual"]}


def certificate_line(c: dict) -> str:
    if c["kind"] == "enclosure":
        return f"Enclosure: proven per sample {c['proven']}, radius at t1 {c['radius_t1']}; {c['reason']}"
    fmt = lambda xs: ", ".join(f"{x:.3g}" for x in xs)
    return (f"A-posteriori bound at t1 (dopri5, tol {c['tol']:g}): {fmt(c['bound_t1'])} against the actual error "
            f"{fmt(c['actual_t1'])}; " + {"holds": "the bound holds at every sampled time",
                                          "violated": "THE BOUND IS VIOLATED at some sampled time",
                                          "vacuous": f"vacuous: exp(L t) with L = {c['L']:.3g} overflows, no finite bound"}
            [c["status"]] + f" ({c['reason']})")


def well_posed(model, images, cfg: dict, *, progress: bool = False) -> dict:
    """S5 on one ODE model: tolerance sweep against a converged reference, perturbation growth against the
    Gronwall envelope, and the certificate."""
    if getattr(model, "variant", None) != "ode":
        raise ValueError(f"wellposed needs an ODE model; this one is {getattr(model, 'variant', '?')!r}: "
                         f"train one with `lipcheck train --variant ode`")
    model = copy.deepcopy(model)
    for m in model.modules():  # SDPA has no double backward on CPU (worst direction); the explicit softmax is the same map
        if isinstance(m, DenseAttention):
            m.backend = "math"
    sw = wellposed.tolerance_sweep(model, images, cfg["methods"], cfg["tolerances"], rk4_steps=cfg["rk4_steps"],
                                   progress=progress)
    growth = wellposed.perturbation_growth(model, images, grid=cfg["growth_grid"], power_iters=cfg["power_iters"],
                                           power_steps=cfg["power_steps"])
    cert = certificate(model, images, tol=cfg["cert_tol"], per_step=cfg["cert_per_step"])
    g = {k: growth[k] for k in ("eps", "grid", "L_local", "L_global", "min_variance", "violations")}
    g["max_growth"] = {d: v["max_growth"] for d, v in growth["directions"].items()}
    g["max_rate"] = {d: v["max_rate"] for d, v in growth["directions"].items()}
    g["t"], g["growth"] = growth["t"], {d: v["growth"] for d, v in growth["directions"].items()}
    return {"sweep": sw.summary(), "growth": g, "certificate": cert}


def probe(model, cfg: dict, grid=None) -> list[dict]:
    return verdicts.attention_curves(model, cfg["radii"], grid, **cfg["probe"])


# ---------------------------------------------------------------------------------------- tables
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
        return "refused" if r.get("refused") else f"not proven; proven on [0, {r['t_proven']:.4g}]"
    return report.md_table(["image", "verdict", "radius at t1", "actual error at t1", "radius / actual", "seconds",
                            "reason (where not proven)"],
                           [[r["image"], cell(r), f"{r['radius_t1']:.3g}",
                             "-" if r["actual_t1"] is None else f"{r['actual_t1']:.3g}",
                             "-" if r["ratio_t1"] is None else f"{r['ratio_t1']:.3g}", f"{r['seconds']:.1f}",
                             r["reason"] or ""] for r in rows])


def enclosure_verdict(rows: list[dict], mixer: str) -> tuple[str, str]:
    proven = sum(r["proven"] for r in rows)
    ratios = [r["ratio_t1"] for r in rows if r["proven"] and r["ratio_t1"] is not None]
    if proven == len(rows):
        return "holds", (f"Proven enclosure of the true trajectory on [0, t1] for {proven}/{len(rows)} images; "
                         f"radius / actual error at t1 {min(ratios):.3g}-{max(ratios):.3g}.")
    if all(r.get("refused") for r in rows):
        return "not run", (f"Refused for the {mixer} field: {rows[0]['reason']}")
    return "partial", f"Proven on [0, t1] for {proven}/{len(rows)} images; the others' reasons are in the table."


def _certify(ckpt, args, cfg) -> dict:
    if not verdicts.ssog_layers(ckpt.model):  # before reading any data
        raise ValueError(f"checkpoint {str(ckpt.path)!r} holds a model with {ckpt.mixer} mixers and no SSoG layer to "
                         f"certify; use `lipcheck probe --checkpoint` for attention models")
    res = certify(ckpt.model, _images(ckpt, args, cfg), progress=not args.no_progress)
    rows = res["ssog"]
    ok = all(math.isfinite(r["upper"]) and r["lower"] <= r["upper"] for r in rows)
    worst = max(r["gap"] for r in rows)
    v = report.verdict("S1-S2 on this model's SSoG layers (certified lower <= ||T||_2 <= upper)",
                       "holds" if ok else "fails",
                       f"{len(rows)} layer x grid bounds, loosest certified gap upper/lower - 1: {worst:.2e}.")
    md = [f"# certify: {ckpt.variant}/{ckpt.mixer}, epoch {ckpt.epoch}, {ckpt.path}", "",
          f"SSoG layers at the model's {ckpt.grid[0]}x{ckpt.grid[1]} token grid and 2x/4x it:", "",
          ssog_table(rows), "", "Block and vector-field constants (local: at the states real inputs visit):", "",
          blocks_table(res["blocks"])]
    return {"md": md, "data": res, "verdict": v}


def _wellposed(ckpt, args, cfg) -> dict:
    if ckpt.variant != "ode":
        raise ValueError(f"checkpoint {str(ckpt.path)!r} holds a {ckpt.variant} model; wellposed needs an ODE "
                         f"model: train one with `lipcheck train --variant ode`")
    images = _images(ckpt, args, cfg)
    encl = verdicts.enclose_images(ckpt.model, images, max_seconds=args.max_seconds, progress=not args.no_progress)
    status, number = enclosure_verdict(encl, ckpt.mixer)
    v = report.verdict(f"S5, Picard-Lindelof on this {ckpt.mixer} ODE model: the true trajectory of each image is "
                       f"enclosed (a computer-assisted proof)", status, number)
    md = [f"# wellposed: {ckpt.variant}/{ckpt.mixer}, epoch {ckpt.epoch}, {ckpt.path}", "",
          "## Proven enclosure per image (lipcheck.wellposed.enclose)", "", enclosure_table(encl), "",
          f"The solve is dopri5 at tol {verdicts.ENCLOSE_TOL:g} with a reference solve enclosed at tol * 1e-3; "
          "the actual error is against an independent fixed-step dopri8 solve converged to 1e-13 (proofs/S5.md)."
          + (f" The field's constants (||T||, curvature, LayerNorm) took {encl[0]['constants_s']:.1f} s once, "
             "beside each image's seconds." if encl and "constants_s" in encl[0] else ""), ""]
    data = {"enclosure": encl}
    if not args.enclosure_only:
        res = well_posed(ckpt.model, images, cfg, progress=not args.no_progress)
        g = res["growth"]
        md += ["## Tolerance sweep against a converged reference", "", sweep_table(res["sweep"]), "",
               f"Gronwall: L local {g['L_local']:.4g}, L global {g['L_global']:.4g}; max growth {g['max_growth']}; "
               f"envelope violations {g['violations']}", "", certificate_line(res["certificate"])]
        data.update(res)
    return {"md": md, "data": data, "verdict": v}


def _probe(ckpt, args, cfg) -> dict:
    if not verdicts.attention_layers(ckpt.model):
        raise ValueError(f"checkpoint {str(ckpt.path)!r} holds a model with {ckpt.mixer} mixers and no dense-attention "
                         f"layer to probe; use `lipcheck certify --checkpoint` for SSoG models")
    trained = probe(ckpt.model, cfg, args.grid)
    init = probe(ckpt.initial_model(), cfg, args.grid)
    growth = max(c["lower"][-1] / c["lower"][0] for c in trained if c["lower"][0] > 0)
    v = report.verdict("S4, dense attention is not globally Lipschitz (certified lower bounds on L(R) grow with R)",
                       "holds" if growth > 1 else "fails",
                       f"Largest growth of the certified lower bound from R = {trained[0]['radii'][0]:g} to "
                       f"{trained[0]['radii'][-1]:g}: {growth:.3g}x.")
    grid = args.grid or ckpt.grid
    md = [f"# probe: {ckpt.variant}/{ckpt.mixer}, epoch {ckpt.epoch}, {ckpt.path}", "",
          f"Certified lower bounds on L(R) on the {grid[0]}x{grid[1]} grid, trained and at the run's initial weights "
          f"(init):", "", probe_table(trained, init)]
    return {"md": md, "data": {"trained": trained, "init": init}, "verdict": v}


def _images(ckpt, args, cfg):
    return C.images(ckpt, data=args.data, data_dir=args.data_dir, n=args.images or cfg["images"])


CHECKPOINT_BODIES = {"certify": _certify, "wellposed": _wellposed, "probe": _probe}


def run_checkpoint(command: str, args, parser) -> int:
    """`lipcheck certify|wellposed|probe --checkpoint RUN`: the verdict on that trained model, written to
    RUN/verdicts/<command>.md and data/<command>.json (or --docs), the verdict printed last. Bad input (missing or
    corrupt checkpoint, a model the verdict does not apply to, a data set it cannot take) stops with one line
    naming the fix and exit status 2, before anything is written."""
    prog = parser.prog
    set_threads(args.threads)
    cfg = SETTINGS["quick" if args.quick else "full"]
    try:
        ckpt = C.load(args.checkpoint)
        out = CHECKPOINT_BODIES[command](ckpt, args, cfg)
    except BAD_INPUT as e:  # the message names the fix
        return fail(prog, e)
    docs = report.docs_dir(args.docs, checkpoint=ckpt.path)
    st = report.stamp()
    data = {"checkpoint": str(ckpt.path), "variant": ckpt.variant, "mixer": ckpt.mixer, "epoch": ckpt.epoch,
            "quick": bool(args.quick), **out["data"]}
    path = report.write_report(command, "\n".join(out["md"]), data, st, docs=docs, json_path=args.json,
                               verdict=out["verdict"], index=False)
    report.print_verdict(out["verdict"], path)
    return 0


def wants_checkpoint(argv) -> bool:
    """True when an experiment script's arguments ask for a trained model."""
    return any(a == "--checkpoint" or a.startswith("--checkpoint=") for a in (argv or []))


# --------------------------------------------------------------------------------------- the report
MODELS = (("discrete", "ssog"), ("discrete", "attention"), ("ode", "ssog"), ("ode", "attention"))
REPORT_EPOCHS = 8


def train_script():
    from . import train as train_script_module  # what `lipcheck train` runs
    return train_script_module


def ensure_checkpoints(root: Path, epochs: int, *, progress: bool) -> list[Path]:
    """The digits models of MODELS, trained by `lipcheck train` into root/<variant>-<mixer>/ unless a finished
    checkpoint of that many epochs is already there."""
    paths = []
    for v, m in MODELS:
        out = root / f"{v}-{m}"
        ck = out / T.CHECKPOINT
        done = ck.is_file() and T.load_checkpoint(ck)["epoch"] == epochs
        if not done:
            argv = ["--variant", v, "--mixer", m, "--epochs", str(epochs), "--out", str(out), "--threads", "1",
                    "--seed", "0"] + ([] if progress else ["--no-progress"])
            print(f"== lipcheck train {' '.join(argv)}", flush=True)
            if train_script().main(argv) != 0:
                raise RuntimeError(f"training {v}/{m} failed")
        paths.append(ck)
    return paths


def analyse(path, cfg: dict, *, progress: bool) -> dict:
    """Every verdict that applies to one checkpoint, for the trained weights and for the run's initial ones."""
    ckpt = C.load(path)
    x = C.images(ckpt, n=cfg["images"])
    hist = ckpt.history[-1] if ckpt.history else {}
    out = {"checkpoint": str(ckpt.path), "variant": ckpt.variant, "mixer": ckpt.mixer, "epoch": ckpt.epoch,
           "test_acc": hist.get("test_acc"), "train_wall_s": hist.get("wall_s"), "config": ckpt.config,
           "grid": list(ckpt.grid), "seconds": {}}
    for state, model in (("trained", ckpt.model), ("init", ckpt.initial_model())):
        res = {}
        t = time.perf_counter()
        res["certify"] = certify(model, x, progress=progress)
        out["seconds"][f"certify_{state}"] = time.perf_counter() - t
        if verdicts.attention_layers(model):
            t = time.perf_counter()
            res["probe"] = probe(model, cfg)
            out["seconds"][f"probe_{state}"] = time.perf_counter() - t
        if ckpt.variant == "ode":
            t = time.perf_counter()
            res["wellposed"] = well_posed(model, x, cfg, progress=progress)
            out["seconds"][f"wellposed_{state}"] = time.perf_counter() - t
            t = time.perf_counter()
            res["enclosure"] = verdicts.enclose_images(model, x, progress=progress)
            out["seconds"][f"enclosure_{state}"] = time.perf_counter() - t
        out[state] = res
    return out


def _name(a: dict) -> str:
    return f"{a['variant']}/{a['mixer']}"


def report_markdown(results: list[dict], cfg: dict, mode: str, elapsed: float, trained_here: bool) -> str:
    md = ["# Trained models: the three verdicts", "",
          "Every other report certifies models that lipcheck builds at random initialisation. Here the same "
          "questions are asked of models `lipcheck train` trained on scikit-learn digits (8x8 grey, 4x4 token "
          "grid, width 48, 3 heads, depth 4; seed 0), loaded back from their checkpoints with `lipcheck.load`, each "
          "beside the same architecture at the run's own initial weights (\"init\": the seed rebuilds them). "
          f"Images: the first {cfg['images']} of the digits test split, normalised as in training.", "",
          report.md_table(["model", "epochs", "test acc", "training s (from the run's log)", "checkpoint"],
                          [[_name(a), a["epoch"], f"{100 * a['test_acc']:.1f}%" if a["test_acc"] is not None else "-",
                            f"{a['train_wall_s']:.0f}" if a.get("train_wall_s") is not None else "-",
                            f"`{Path(a['checkpoint']).parent.name}/checkpoint.pt`"] for a in results]), "",
          "Short training (a few epochs on digits): the accuracies are those of a small budget, not converged models; "
          "the point is what training does to the constants.", ""]

    # S1-S2
    md += ["## S1-S2: every SSoG layer, at the model's grid and 2x/4x it", "",
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
        md += [f"**{_name(a)}**", "", report.md_table(
            ["layer", "grid", "lower", "upper", "upper (prob.)", "gap", "resolution-free", "init upper",
             "trained / init"], rows), ""]
        worst = max(tr, key=lambda r: r["resolution_free"])
        md += [f"Largest resolution-free bound: {worst['resolution_free']:.4g} ({worst['layer']}), against "
               f"{max(r['resolution_free'] for r in ini):.4g} at init: training changed SSoG's certified constant by "
               f"a factor {worst['resolution_free'] / max(r['resolution_free'] for r in ini):.2f}, and it stays "
               "finite and grid-independent (S1) after training.", ""]

    # S3
    md += ["## S3: block and vector-field constants", "",
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
                rows.append([_name(a), state, b["block"], f"{b['mixer']:.4g}", f"{b['mlp']:.4g}",
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

    # S4
    md += ["## S4: attention growth, trained against init", "",
           f"`lipcheck.probe.attention_growth` on each dense-attention layer alone (\"mixer\") and on its pre-LN "
           f"residual branch x -> Attn(LN1 x) (\"block\"), at the 4x4 grid, radii {', '.join(f'{r:g}' for r in cfg['radii'])}; "
           f"{cfg['probe']['restarts']} restarts x {cfg['probe']['steps']} ascent steps per radius (cheap settings: "
           "each value is a certified lower bound, attained at an actual input, and the true L(R) may be larger).", ""]
    for a in results:
        if "probe" not in a["trained"]:
            continue
        md += [f"**{_name(a)}**", "", probe_table(a["trained"]["probe"], a["init"]["probe"]), ""]
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

    # S5
    md += ["## S5: well-posedness of the trained ODE models", "",
           "`lipcheck.wellposed.tolerance_sweep` (methods " + ", ".join(cfg["methods"]) + ", rtol = atol in "
           + ", ".join(f"{t:g}" for t in cfg["tolerances"]) + "; rk4 at " + ", ".join(map(str, cfg["rk4_steps"]))
           + " steps; errors against a converged fixed-step dopri8 reference), `perturbation_growth` (random and "
           "power-iteration worst directions against the Gronwall envelope exp(L t), L local along the trajectories "
           "and global) and `aposteriori_certificate` (dopri5 at tol 1e-3: the bound from the solve's own defect "
           "against its actual error). The certificate is not interval-rigorous between samples; the proof is the "
           "enclosure below.", ""]
    rows = []
    for a in results:
        if "wellposed" not in a["trained"]:
            continue
        for state in ("trained", "init"):
            w = a[state]["wellposed"]
            conv, g, c = w["sweep"]["convergence"], w["growth"], w["certificate"]
            nfe = {r["tol"]: r["nfe"] for r in w["sweep"]["runs"] if r["method"] == "dopri5"}
            rows.append([_name(a), state, f"{conv.get('slope') or float('nan'):.2f}",
                         f"{conv['max_error_at_tightest']:.1e}", f"{conv['spread']:.1e}" if conv.get("spread") else "-",
                         " / ".join(str(nfe[t]) for t in sorted(nfe, reverse=True)),
                         f"{g['L_local']:.3g}", f"{g['L_global']:.3g}",
                         f"{max(g['max_growth'].values()):.4g}", f"{g['violations']['local']}",
                         ", ".join(f"{b:.2e}" for b in c.get("bound_t1", [])),
                         ", ".join(f"{b:.2e}" for b in c.get("actual_t1", [])),
                         c.get("status", "proven" if c.get("proven") else "not proven")])
    md += [report.md_table(["model", "weights", "error/tol slope", "max error at tightest tol", "spread between methods",
                            "dopri5 NFE (loose -> tight)", "L local", "L global", "max growth", "envelope violations",
                            "certificate bound at t1", "actual error at t1", "certificate"], rows), ""]
    ws = [(a, st_, a[st_]["wellposed"]) for a in results if "wellposed" in a["trained"] for st_ in ("trained", "init")]
    if ws:
        viol = [f"{_name(a)} {s_}" for a, s_, w in ws if w["growth"]["violations"]["local"]]
        broken = [f"{_name(a)} {s_}" for a, s_, w in ws if w["certificate"].get("status") == "violated"]
        vacuous = [f"{_name(a)} {s_} (L = {w['certificate']['L']:.3g})" for a, s_, w in ws
                   if w["certificate"].get("status") == "vacuous"]
        spread = max(w["sweep"]["convergence"].get("spread") or 0.0 for _, _, w in ws)
        same = [f"{_name(a)} {s_}" for a, s_, w in ws if w["growth"]["L_local"] >= w["growth"]["L_global"]]
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

    md += ["### The proof: enclosures of every image's true trajectory", "",
           "`lipcheck.wellposed.enclose` per image (dopri5 at tol " f"{verdicts.ENCLOSE_TOL:g}" ", its reference solve "
           "enclosed at tol * 1e-3; proofs/S5.md), the radius at t1 beside the actual error against an independent "
           "fixed-step dopri8 solve converged to 1e-13. This is what `lipcheck wellposed --checkpoint RUN` runs.", ""]
    for a in results:
        for state in ("trained", "init"):
            if "enclosure" in a.get(state, {}):
                md += [f"**{_name(a)}, {state} weights**", "", enclosure_table(a[state]["enclosure"]), ""]
    md += ["Dense attention's field is refused, not proven: the enclosure needs a bound on the field's second "
           "derivative over the visited ball, which lipcheck has for SSoG's linear mixer only. Both fields have "
           "solutions on [0, t1] (pre-LN: linear growth at most, S5); the contrast is which one lipcheck can prove.", ""]
    md += ["## Your own model", "",
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
    md += ["## Figures", "", "![SSoG constants, trained vs init](figures/trained_ssog.png)", "",
           "![attention growth, trained vs init](figures/trained_attention.png)", "",
           "![tolerance sweeps and certificates](figures/trained_wellposed.png)", ""]
    md += ["## Regenerate", "", "```",
           "python experiments/trained.py            # trains the four digits models into runs/trained/ if absent",
           "python experiments/trained.py --checkpoint runs/a --checkpoint runs/b   # any `lipcheck train` checkpoints",
           "lipcheck certify --checkpoint runs/trained/discrete-ssog      # one model, one verdict",
           "lipcheck probe --checkpoint runs/trained/discrete-attention",
           "lipcheck wellposed --checkpoint runs/trained/ode-ssog", "```", "",
           f"Settings: `{mode}`. Whole command: {elapsed / 60:.1f} min" +
           (" including training" if trained_here else " (checkpoints already trained)") +
           f", {torch.get_num_threads()} CPU thread(s).", ""]
    return "\n".join(md)


def figures(results: list[dict], st: dict, docs) -> None:
    import matplotlib.pyplot as plt
    colors = {"trained": "C0", "init": "C7"}

    ssog = [a for a in results if a["trained"]["certify"]["ssog"]]
    if ssog:
        fig, axes = plt.subplots(1, len(ssog), figsize=(5 * len(ssog), 3.6), squeeze=False, constrained_layout=True)
        for ax, a in zip(axes[0], ssog):
            for state in ("trained", "init"):
                rows = a[state]["certify"]["ssog"]
                for name in dict.fromkeys(r["layer"] for r in rows):
                    rs = [r for r in rows if r["layer"] == name]
                    n = [r["H"] for r in rs]
                    ax.plot(n, [r["upper"] for r in rs], color=colors[state], marker="o", ms=3, alpha=0.8,
                            label=f"{state}: certified upper" if name == rows[0]["layer"] else None)
                    ax.plot(n, [r["lower"] for r in rs], color=colors[state], ls=":", marker=".", alpha=0.8,
                            label=f"{state}: lower" if name == rows[0]["layer"] else None)
                    ax.axhline(rs[0]["resolution_free"], color=colors[state], ls="--", lw=0.8, alpha=0.6,
                               label=f"{state}: resolution-free" if name == rows[0]["layer"] else None)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("grid side H = W (tokens)")
            ax.set_ylabel("Lip(SSoG layer)")
            ax.set_title(f"{_name(a)}: every SSoG layer")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        report.save_figure(fig, "trained_ssog", st, docs)

    att = [a for a in results if "probe" in a["trained"]]
    if att:
        fig, axes = plt.subplots(1, 2 * len(att), figsize=(4.2 * 2 * len(att), 3.6), squeeze=False,
                                 constrained_layout=True)
        for k, a in enumerate(att):
            for j, branch in enumerate(("mixer", "block")):
                ax = axes[0][2 * k + j]
                for state in ("trained", "init"):
                    for i, c in enumerate(c for c in a[state]["probe"] if c["branch"] == branch):
                        ax.plot(c["radii"], c["lower"], color=colors[state], marker="o", ms=3, alpha=0.8,
                                label=state if i == 0 else None)
                r = torch.tensor(a["trained"]["probe"][0]["radii"], dtype=F64)
                if branch == "mixer":
                    top = max(c["lower"][-1] for c in a["trained"]["probe"] if c["branch"] == "mixer")
                    ax.plot(r, top * (r / r[-1]) ** 2, color="k", ls="--", lw=0.8, label="R^2 slope")
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.set_xlabel("radius R (Frobenius)")
                ax.set_ylabel("certified lower bound on L(R)")
                ax.set_title(f"{_name(a)}: " + ("attention layers" if branch == "mixer" else "x -> Attn(LN1 x)"))
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
        report.save_figure(fig, "trained_attention", st, docs)

    ode = [a for a in results if "wellposed" in a["trained"]]
    if ode:
        fig, axes = plt.subplots(1, 2 * len(ode), figsize=(4.2 * 2 * len(ode), 3.6), squeeze=False,
                                 constrained_layout=True)
        for k, a in enumerate(ode):
            ax, axc = axes[0][2 * k], axes[0][2 * k + 1]
            for state in ("trained", "init"):
                w = a[state]["wellposed"]
                for j, m in enumerate(dict.fromkeys(r["method"] for r in w["sweep"]["runs"] if r["tol"] is not None)):
                    rs = [r for r in w["sweep"]["runs"] if r["method"] == m]
                    ax.plot([r["tol"] for r in rs], [max(r["error"], 1e-17) for r in rs], color=colors[state],
                            marker="osd^"[j % 4], ms=4, alpha=0.8, label=f"{state}: {m}")
                c = w["certificate"]
                if c["kind"] == "a-posteriori":
                    t = c["t"]
                    bound = [max(b[i] for b in c["bound"]) for i in range(len(t))]
                    actual = [max(x[i] for x in c["actual"]) for i in range(len(t))]
                    if c["status"] == "vacuous" or max(bound) > 1e6 * max(actual):  # would only flatten the plot
                        axc.plot([], [], color=colors[state], label=f"{state}: certificate bound vacuous "
                                 f"(L = {c['L']:.3g}; off the scale)")
                    else:
                        axc.plot(t, bound, color=colors[state], label=f"{state}: certificate bound")
                    axc.plot(t, actual, color=colors[state], ls=":", label=f"{state}: actual error")
            tols = sorted({r["tol"] for r in a["trained"]["wellposed"]["sweep"]["runs"] if r["tol"] is not None})
            ax.plot(tols, tols, color="k", lw=0.8, ls="--", label="error = tol")
            for a_ in (ax, axc):
                a_.set_yscale("log")
                a_.grid(alpha=0.3)
                a_.legend(fontsize=6)
            ax.set_xscale("log")
            ax.set_xlabel("rtol = atol")
            ax.set_ylabel("max relative error at t1")
            ax.set_title(f"{_name(a)}: tolerance sweep")
            axc.set_xlabel("t")
            axc.set_ylabel("||x(t) - y(t)||")
            axc.set_title(f"{_name(a)}: dopri5 at tol {a['trained']['wellposed']['certificate'].get('tol', '')}")
        report.save_figure(fig, "trained_wellposed", st, docs)


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", action="append", help="a `lipcheck train` checkpoint (repeatable); default: the "
                   "four digits models in --runs, trained there first if absent")
    p.add_argument("--runs", type=Path, default=Path("runs/trained"), help="where the digits models are trained")
    p.add_argument("--epochs", type=int, default=REPORT_EPOCHS, help="epochs of the digits models")
    p.add_argument("--full", action="store_true", help="more images, tolerances, radii and restarts (slower)")
    p.add_argument("--quick", action="store_true", help="the default settings (accepted for `lipcheck report --quick`)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the numbers here")
    p.add_argument("--docs", type=Path, help="docs directory (default: the repository's docs/)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def main(argv=None) -> int:
    args, p = common.parse(sys.modules[__name__], argv, prog="lipcheck trained")
    return run(args, p)


def run(args, p) -> int:
    set_threads(max(1, args.threads))
    mode = "full" if args.full else "quick"
    cfg = SETTINGS[mode]
    start = time.perf_counter()
    try:
        trained_here = False
        if args.checkpoint:
            paths = [C.resolve(c) for c in args.checkpoint]
            for c in paths:  # every checkpoint readable before any work is done
                C.load(c)
        else:
            before = [(args.runs / f"{v}-{m}" / T.CHECKPOINT).is_file() for v, m in MODELS]
            paths = ensure_checkpoints(args.runs, args.epochs, progress=not args.no_progress)
            trained_here = not all(before)
        st = report.stamp()
        results = []
        for c in paths:
            print(f"== verdicts on {c}", flush=True)
            results.append(analyse(c, cfg, progress=not args.no_progress))
    except BAD_INPUT as e:
        print(f"trained: error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    figures(results, st, args.docs)
    md = report_markdown(results, cfg, mode, elapsed, trained_here)
    v = report_verdict(results)
    path = report.write_report("trained", md, {"mode": mode, "settings": cfg, "elapsed_s": elapsed,
                                               "models": results}, st, docs=args.docs, json_path=args.json, verdict=v)
    print(f"({elapsed:.0f} s)")
    report.print_verdict(v, path)
    return 0


def report_verdict(results: list[dict]) -> dict:
    """S1-S5 on trained models: every SSoG bound sound, every SSoG ODE image's enclosure proven."""
    gaps = [r["gap"] for a in results for r in a["trained"]["certify"]["ssog"]]
    encl = [e for a in results if a["mixer"] == "ssog" for e in a["trained"].get("enclosure", [])]
    proven = sum(e["proven"] for e in encl)
    ok = all(math.isfinite(g) and g >= 0 for g in gaps) and encl and proven == len(encl)
    return report.verdict("S1-S5 on models trained by `lipcheck train` (digits)", "holds" if ok else "partial",
                          f"Loosest certified SSoG gap {max(gaps):.2e} over {len(gaps)} layer x grid bounds; proven "
                          f"enclosures of the trained SSoG ODE model: "
                          + (f"{proven}/{len(encl)} images." if encl else "not run."))


def verdict_from(data: dict) -> dict:
    """The verdict of a finished run from its JSON (lipcheck report --verdicts)."""
    return report_verdict(data["models"])


if __name__ == "__main__":
    raise SystemExit(main())
