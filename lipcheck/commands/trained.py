"""The three verdicts on trained models: certify (S1-S3), probe (S4), well-posedness (S5).

    python experiments/trained.py                 # docs/trained.md: trains the digits models if absent
    python experiments/trained.py --checkpoint runs/a/checkpoint.pt --checkpoint runs/b   # given checkpoints

`lipcheck certify|wellposed|probe --checkpoint RUN` come here too (`run_checkpoint`): the verdict on one trained
model, written to RUN/verdicts/ (or --docs). Bad input (missing or corrupt checkpoint, a model without SSoG layers
for certify, without attention for probe, not an ODE model for wellposed, a data set the model cannot take) stops
with one line naming the fix and exit status 2, before anything is written.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from lipcheck import checkpoint as C
from lipcheck import report, shard, verdicts
from lipcheck import train as T
from lipcheck.reports import trained as trained_report
from lipcheck.reports import whole_split
from lipcheck.reports.trained import (blocks_table, certificate_line, enclosure_summary, probe_table, ssog_table,
                                      sweep_table)

from . import common
from .common import fail, set_threads, work_budget
from .trained_analyses import certify, probe, well_posed

SETTINGS = {
    "quick": dict(images=2, tolerances=(1e-2, 1e-4, 1e-6, 1e-8), rk4_steps=(4, 8, 16, 32),
                  methods=("dopri5", "bosh3", "rk4"), growth_grid=16, power_iters=2, power_steps=8, cert_tol=1e-3,
                  cert_per_step=8, radii=(1.0, 16.0, 256.0, 1024.0),
                  probe=dict(restarts=4, steps=8, certify_steps=20, certify_top=1), enclosure_seconds=240.0),
    "full": dict(images=4, tolerances=(1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9),
                 rk4_steps=(4, 8, 16, 32, 64, 128), methods=("dopri5", "dopri8", "bosh3", "rk4"), growth_grid=None,
                 power_iters=4, power_steps=16, cert_tol=1e-3, cert_per_step=None,
                 radii=(1.0, 4.0, 16.0, 64.0, 256.0, 1024.0),
                 probe=dict(restarts=6, steps=12, certify_steps=30, certify_top=1), enclosure_seconds=900.0),
}
BAD_INPUT = (FileNotFoundError, C.CheckpointError, ValueError)
# images per enclose call (`--batch`) when not given, per device. On a CPU one at a time: a batch shares its solver
# steps, sub-interval refinement and log-norm grid, each the worst of its images, and a CPU gains nothing from the
# wider kernels (digits ODE model, 8 images, one thread: 15.9 s per image one at a time, 32.8 s in one batch of 8).
# On a GPU 8: one kernel serves many states (not measured here).
DEFAULT_BATCH = {"cpu": 1, "cuda": 8}


def default_batch(device) -> int:
    return DEFAULT_BATCH.get(torch.device(device).type, 1)


def enclosure_verdict(rows: list[dict], mixer: str, noun: str = "images") -> tuple[str, str]:
    proven = sum(r["proven"] for r in rows)
    ratios = [r["ratio_t1"] for r in rows if r["proven"] and r["ratio_t1"] is not None]
    if proven == len(rows):
        return "holds", (f"Proven enclosure of the true trajectory on [0, t1] for {proven}/{len(rows)} {noun}; "
                         f"radius / actual error at t1 {min(ratios):.3g}-{max(ratios):.3g}.")
    if all(r.get("refused") for r in rows):
        return "not run", (f"Refused for the {mixer} field: {rows[0]['reason']}")
    return "partial", f"Proven on [0, t1] for {proven}/{len(rows)} {noun}; the others' reasons are in the table."


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


def _wellposed(ckpt, args, cfg) -> dict | None:
    if ckpt.variant != "ode":
        raise ValueError(f"checkpoint {str(ckpt.path)!r} holds a {ckpt.variant} model; wellposed needs an ODE "
                         f"model: train one with `lipcheck train --variant ode`")
    images = _images(ckpt, args, cfg)
    encl, run = _enclose_sharded(ckpt.model, images, args)
    if run["rank"] != 0:  # one report, from rank 0
        return None
    noun = "test images" if run["all_test_images"] else "images"
    status, number = enclosure_verdict(encl, ckpt.mixer, noun)
    v = report.verdict(f"S5, Picard-Lindelof on this {ckpt.mixer} ODE model: the true trajectory of each image is "
                       f"enclosed (a computer-assisted proof)", status, number)
    md = [f"# wellposed: {ckpt.variant}/{ckpt.mixer}, epoch {ckpt.epoch}, {ckpt.path}", "",
          *enclosure_summary(encl, run, t1=float(ckpt.model.t1), noun=noun), "",
          f"The solve is dopri5 at tol {verdicts.ENCLOSE_TOL:g} with a reference solve enclosed at tol * 1e-3; "
          "the actual error is against an independent fixed-step dopri8 solve converged to 1e-13 (proofs/S5.md)."
          + (f" The field's constants (||T||, curvature, LayerNorm) took {encl[0]['constants_s']:.1f} s once per "
             "process, beside each image's seconds." if encl and "constants_s" in encl[0] else ""), ""]
    data = {"enclosure": encl, "run": run}
    if not args.enclosure_only:
        few = images[:cfg["images"]] if run["all_test_images"] else images  # the sweep is a check, not a proof
        res = well_posed(ckpt.model, few, cfg, progress=not args.no_progress)
        g = res["growth"]
        md += [f"## Tolerance sweep against a converged reference ({len(few)} images)", "", sweep_table(res["sweep"]),
               "", f"Gronwall: L local {g['L_local']:.4g}, L global {g['L_global']:.4g}; max growth "
               f"{g['max_growth']}; envelope violations {g['violations']}", "", certificate_line(res["certificate"])]
        data.update(res)
    return {"md": md, "data": data, "verdict": v, "name": "wellposed_all" if run["all_test_images"] else None}


def _enclose_sharded(model, images, args) -> tuple[list[dict], dict]:
    """Every image's enclosure row, in batches of --batch dealt out over the torchrun processes (one process
    without torchrun), gathered on every rank; and how the run was split, with its wall time."""
    start = time.perf_counter()
    device = next(model.parameters()).device
    batch = args.batch or default_batch(device)
    with shard.processes(device) as info:
        plan = shard.batches(len(images), batch)
        mine = verdicts.enclose_images(model, images, batches=shard.share(plan, info.rank, info.world_size),
                                       max_seconds=args.max_seconds, **work_budget(args),
                                       progress=not args.no_progress and info.is_main)
        rows = shard.gather(mine, info, len(images))
    return rows, {"rank": info.rank, "world_size": info.world_size, "batch": batch, "batches": len(plan),
                  "all_test_images": bool(args.all_test_images), "wall_s": time.perf_counter() - start}


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
    # --all-test-images: a count no split reaches, so C.images gives the whole split
    n = sys.maxsize if getattr(args, "all_test_images", False) else args.images or cfg["images"]
    return C.images(ckpt, data=args.data, data_dir=args.data_dir, n=n)


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
    if out is None:  # a torchrun process other than rank 0: its rows are in rank 0's report
        return 0
    docs = report.docs_dir(args.docs, checkpoint=ckpt.path)
    st = report.stamp()
    data = {"checkpoint": str(ckpt.path), "variant": ckpt.variant, "mixer": ckpt.mixer, "epoch": ckpt.epoch,
            "quick": bool(args.quick), **out["data"]}
    path = report.write_report(out.get("name") or command, "\n".join(out["md"]), data, st, docs=docs,
                               json_path=args.json,
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
            # a budget per model: the attention field's proof can take hours (the report says up to which t it holds)
            res["enclosure"] = verdicts.enclose_images(model, x, progress=progress,
                                                       max_seconds=cfg["enclosure_seconds"])
            out["seconds"][f"enclosure_{state}"] = time.perf_counter() - t
        out[state] = res
    return out


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
    splits = [whole_split.summarize(f"{a['variant']}/{a['mixer']}", d) for a in results
              if (d := whole_split.load(a["checkpoint"], a["epoch"])) is not None]
    data = {"mode": mode, "settings": cfg, "elapsed_s": elapsed, "models": results, "all_test_images": splits}
    for name, fig in trained_report.figures(data):
        report.save_figure(fig, name, st, args.docs)
    md = trained_report.markdown(data, trained_here=trained_here, threads=torch.get_num_threads(),
                                 splits_md=whole_split.section(splits))
    v = report_verdict(results, splits)
    path = report.write_report("trained", md, data, st, docs=args.docs, json_path=args.json, verdict=v)
    print(f"({elapsed:.0f} s)")
    report.print_verdict(v, path)
    return 0


def report_verdict(results: list[dict], splits: list[dict] = ()) -> dict:
    """S1-S5 on trained models: every SSoG bound sound, every SSoG ODE image's enclosure proven (and of the whole
    test split where it was run: `whole_split`)."""
    gaps = [r["gap"] for a in results for r in a["trained"]["certify"]["ssog"]]
    encl = [e for a in results if a["mixer"] == "ssog" for e in a["trained"].get("enclosure", [])]
    proven = sum(e["proven"] for e in encl)
    whole = [s for s in splits if s["mixer"] == "ssog"]
    ok = (all(math.isfinite(g) and g >= 0 for g in gaps) and encl and proven == len(encl)
          and all(s["proven"] == s["images"] for s in whole))
    att = [e for a in results if a["mixer"] == "attention" for e in a["trained"].get("enclosure", [])]
    return report.verdict("S1-S5 on models trained by `lipcheck train` (digits)", "holds" if ok else "partial",
                          f"Loosest certified SSoG gap {max(gaps):.2e} over {len(gaps)} layer x grid bounds; proven "
                          f"enclosures of the trained SSoG ODE model: "
                          + (f"{proven}/{len(encl)} images" if encl else "not run")
                          + (f"; of the trained attention ODE model: {sum(e['proven'] for e in att)}/{len(att)}"
                             if att else "") + whole_split.verdict_text(splits) + ".")


def verdict_from(data: dict) -> dict:
    """The verdict of a finished run from its JSON (lipcheck report --verdicts)."""
    return report_verdict(data["models"], data.get("all_test_images", []))


if __name__ == "__main__":
    raise SystemExit(main())
