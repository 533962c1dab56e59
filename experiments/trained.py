"""The three verdicts on trained models: certify (S1-S3), probe (S4), well-posedness (S5).

    python experiments/trained.py                 # docs/trained.md: trains the digits models if absent
    python experiments/trained.py --checkpoint runs/a/checkpoint.pt --checkpoint runs/b   # given checkpoints

`lipcheck certify|wellposed|probe --checkpoint PATH` come here too (the three experiment scripts hand
their arguments over): `certify_main`, `wellposed_main`, `probe_main` print the tables for one trained
model and, with --json, write its numbers. Bad input (missing or corrupt checkpoint, a model without
SSoG layers for certify, without attention for probe, not an ODE model for wellposed, a data set the
model cannot take) stops with one line naming the fix and exit status 2, before anything is written.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import torch  # noqa: E402

from lipcheck import report, verdicts, wellposed  # noqa: E402
from lipcheck import checkpoint as C  # noqa: E402
from lipcheck import train as T  # noqa: E402

F64 = torch.float64
GRID_MULTIPLES = (1, 2, 4)  # the model's own token grid and 2x, 4x that grid
SETTINGS = {
    "quick": dict(images=2, tolerances=(1e-2, 1e-4, 1e-6, 1e-8), rk4_steps=(4, 8, 16, 32), methods=("dopri5", "bosh3", "rk4"),
                  growth_grid=16, power_iters=2, power_steps=8, cert_tol=1e-3, cert_per_step=8,
                  radii=(1.0, 4.0, 16.0, 64.0), probe=dict(restarts=4, steps=8, certify_steps=20, certify_top=1)),
    "full": dict(images=4, tolerances=(1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9), rk4_steps=(4, 8, 16, 32, 64, 128),
                 methods=("dopri5", "dopri8", "bosh3", "rk4"), growth_grid=None, power_iters=4, power_steps=16,
                 cert_tol=1e-3, cert_per_step=None, radii=(1.0, 4.0, 16.0, 64.0, 256.0),
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
    return {"kind": "a-posteriori", "tol": res["tol"], "nfe": res["nfe"], "L": res["L"], "L_global": res["L_global"],
            "bound_t1": res["bound_t1"], "actual_t1": res["actual_t1"], "violations": res["violations"],
            "min_ratio": res["min_ratio"], "max_ratio": res["max_ratio"], "max_delta": res["max_delta"],
            "proven": None, "bound_holds": res["violations"] == 0 and all(math.isfinite(b) for b in res["bound_t1"]),
            "reason": "not a proof: a bound from the solve's own defect (quadrature with a safety margin, not "
                      "interval-rigorous between samples), checked against a converged reference", "t": res["t"], "bound": res["bound"],
            "actual": res["actual"]}


def certificate_line(c: dict) -> str:
    if c["kind"] == "enclosure":
        return f"Enclosure: proven per sample {c['proven']}, radius at t1 {c['radius_t1']}; {c['reason']}"
    fmt = lambda xs: ", ".join(f"{x:.3g}" for x in xs)
    return (f"A-posteriori bound at t1 (dopri5, tol {c['tol']:g}): {fmt(c['bound_t1'])} against the actual error "
            f"{fmt(c['actual_t1'])}; bound {'holds' if c['bound_holds'] else 'VIOLATED'} at every sampled time "
            f"({c['reason']})")


def well_posed(model, images, cfg: dict, *, progress: bool = False) -> dict:
    """S5 on one ODE model: tolerance sweep against a converged reference, perturbation growth against the
    Gronwall envelope, and the certificate."""
    if getattr(model, "variant", None) != "ode":
        raise ValueError(f"wellposed needs an ODE model; this one is {getattr(model, 'variant', '?')!r}: "
                         f"train one with `lipcheck train --variant ode`")
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


def probe(model, cfg: dict) -> list[dict]:
    return verdicts.attention_curves(model, cfg["radii"], **cfg["probe"])


# ---------------------------------------------------------------------------------------- tables
def ssog_table(rows: list[dict]) -> str:
    return report.md_table(
        ["layer", "grid", "lower", "upper (certified)", "upper (probabilistic)", "gap", "resolution-free",
         "exact"],
        [[r["layer"], f"{r['H']}x{r['W']}", f"{r['lower']:.6g}", f"{r['upper']:.6g}",
          f"{r['upper_probabilistic']:.6g} (p_fail {r['failure_probability']:.0e})", f"{r['gap']:.2e}",
          f"{r['resolution_free']:.6g}", "-" if r["exact"] is None else f"{r['exact']:.6g}"] for r in rows])


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
    head = ["map", "layer"] + [f"L({r:g}) trained" for r in radii] + ["exponent"]
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
def _parser(prog: str, what: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=f"{what} of a model that `lipcheck train` wrote.")
    p.add_argument("--checkpoint", required=True, help="checkpoint.pt written by `lipcheck train` (or its run directory)")
    p.add_argument("--data", choices=("digits", "cifar100"), help="images from this data set (default: the one the "
                   "model was trained on)")
    p.add_argument("--data-dir", help="directory holding cifar-100-python/ (CIFAR-100 models)")
    p.add_argument("--images", type=int, help="how many test images (default: 2 quick, 4 otherwise)")
    p.add_argument("--quick", action="store_true", help="cheaper settings")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--device", default="cpu", help="accepted for symmetry with the random-init run; the "
                   "verification runs on the CPU in float64")
    p.add_argument("--seed", type=int, default=0)
    return p


def _run(prog: str, what: str, argv, body) -> int:
    args = _parser(prog, what).parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    try:
        out = body(args, SETTINGS["quick" if args.quick else "full"])
    except BAD_INPUT as e:  # the message names the fix
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.json is not None:
        report.write_json(args.json, {"stamp": report.stamp(), **out["data"]})
    print(out["md"])
    return 0


def _images(ckpt, args, cfg):
    return C.images(ckpt, data=args.data, data_dir=args.data_dir, n=args.images or cfg["images"])


def certify_main(argv) -> int:
    def body(args, cfg):
        ckpt = C.load(args.checkpoint)
        if not verdicts.ssog_layers(ckpt.model):  # before reading any data
            raise ValueError(f"checkpoint {str(ckpt.path)!r} holds a model with {ckpt.mixer} mixers and no SSoG layer to "
                             f"certify; use `lipcheck probe --checkpoint` for attention models")
        res = certify(ckpt.model, _images(ckpt, args, cfg), progress=not args.no_progress)
        md = [f"# certify: {ckpt.variant}/{ckpt.mixer}, epoch {ckpt.epoch}, {ckpt.path}", "",
              f"SSoG layers at the model's {ckpt.grid[0]}x{ckpt.grid[1]} token grid and 2x/4x it:", "",
              ssog_table(res["ssog"]), "", "Block and vector-field constants (local: at the states real inputs "
              "visit):", "", blocks_table(res["blocks"])]
        return {"md": "\n".join(md), "data": {"checkpoint": str(ckpt.path), "variant": ckpt.variant,
                                               "mixer": ckpt.mixer, "epoch": ckpt.epoch, **res}}
    return _run("lipcheck certify", "Certified Lipschitz bounds (S1-S3)", argv, body)


def wellposed_main(argv) -> int:
    def body(args, cfg):
        ckpt = C.load(args.checkpoint)
        if ckpt.variant != "ode":
            raise ValueError(f"checkpoint {str(ckpt.path)!r} holds a {ckpt.variant} model; wellposed needs an ODE "
                             f"model: train one with `lipcheck train --variant ode`")
        res = well_posed(ckpt.model, _images(ckpt, args, cfg), cfg, progress=not args.no_progress)
        c, g = res["certificate"], res["growth"]
        md = [f"# wellposed: {ckpt.variant}/{ckpt.mixer}, epoch {ckpt.epoch}, {ckpt.path}", "", sweep_table(res["sweep"]),
              "", f"Gronwall: L local {g['L_local']:.4g}, L global {g['L_global']:.4g}; max growth "
              f"{g['max_growth']}; envelope violations {g['violations']}", "",
              certificate_line(c)]
        return {"md": "\n".join(md), "data": {"checkpoint": str(ckpt.path), "variant": ckpt.variant,
                                               "mixer": ckpt.mixer, "epoch": ckpt.epoch, **res}}
    return _run("lipcheck wellposed", "Picard-Lindelof checks (S5)", argv, body)


def probe_main(argv) -> int:
    def body(args, cfg):
        ckpt = C.load(args.checkpoint)
        if not verdicts.attention_layers(ckpt.model):
            raise ValueError(f"checkpoint {str(ckpt.path)!r} holds a model with {ckpt.mixer} mixers and no dense-attention "
                             f"layer to probe; use `lipcheck certify --checkpoint` for SSoG models")
        trained = probe(ckpt.model, cfg)
        init = probe(ckpt.initial_model(), cfg)
        md = [f"# probe: {ckpt.variant}/{ckpt.mixer}, epoch {ckpt.epoch}, {ckpt.path}", "",
              f"Certified lower bounds on L(R) on the {ckpt.grid[0]}x{ckpt.grid[1]} grid, trained and at the run's "
              f"initial weights (init):", "", probe_table(trained, init)]
        return {"md": "\n".join(md), "data": {"checkpoint": str(ckpt.path), "variant": ckpt.variant,
                                               "mixer": ckpt.mixer, "epoch": ckpt.epoch, "trained": trained,
                                               "init": init}}
    return _run("lipcheck probe", "Attention growth (S4)", argv, body)


def wants_checkpoint(argv) -> bool:
    """True when an experiment script's arguments ask for a trained model."""
    return any(a == "--checkpoint" or a.startswith("--checkpoint=") for a in (argv or []))
