"""Picard-Lindelof checked on the SSoG Neural-ODE ViT (SPEC S5), contrasted with dense attention.

    python experiments/divergence.py [--quick] [--preset tiny|ti|s|b] [--device cpu|cuda] [--seed 0]
                                     [--json PATH] [--docs DIR]

Tolerance sweeps (dopri5, dopri8, bosh3 adaptive; rk4 fixed step, halved) against a converged
fixed-step dopri8 reference; perturbation growth against the Gronwall envelope with the certified
global and local constants; the a-posteriori defect certificate of a loose solve; dense attention at
input scales 1, 4, 16, 64. Writes docs/divergence.md, docs/figures/divergence_*.png, docs/data/divergence.json.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path

import torch

from lipcheck import report, wellposed
from lipcheck.models.vit import PRESETS, vit_from_preset
from lipcheck.reports import wellposed as wellposed_report

from .common import (add_checkpoint_arguments, add_output_arguments, not_with_checkpoint, parse, positive_int,
                     set_threads)

D = torch.float64
SETTINGS = {
    "full": dict(batch=4, tolerances=wellposed.TOLERANCES, rk4_steps=wellposed.RK4_STEPS, grid=None, power_iters=6,
                 power_steps=32,
                 cert_tol=1e-3, cert_per_step=None, scales=(1.0, 4.0, 16.0, 64.0), contrast_tols=(1e-3, 1e-6, 1e-9),
                 contrast_grid=None, gentle=True, enc_batch=4, enc_tol=1e-6, enc_slack=0.5, enc_defect_ratio=0.25,
                 enc_max_per_step=1024, enc_lognorm="dense", enc_ref_max_per_step=1024,
                 grad_tols=(1e-3, 1e-6, 1e-9), grad_batch=4, envelope_eps=1e-6),
    "quick": dict(batch=1, tolerances=(1e-2, 1e-5, 1e-8), rk4_steps=(8, 16, 32, 64), grid=32, power_iters=2,
                  power_steps=8, cert_tol=1e-3, cert_per_step=8, gentle=False, scales=(1.0, 16.0),
                  contrast_tols=(1e-3, 1e-6), contrast_grid=16, enc_batch=1, enc_tol=1e-7, enc_slack=1.0,
                  enc_defect_ratio=0.5, enc_max_per_step=256, enc_lognorm="structured", enc_ref_max_per_step=64,
                  grad_tols=(1e-3, 1e-6), grad_batch=1, envelope_eps=1e-6),
}


def build_models(preset: str, gain: float, seed: int, device):
    """Matched SSoG and dense ODE ViTs: same patch embedding, LayerNorms, MLP and value/output projections;
    every Linear of the block drawn N(0, gain^2 / fan_in) so the field moves the state visibly."""
    torch.manual_seed(seed)
    ssog = vit_from_preset(preset, "ode", "ssog", dtype=D, device=device)
    dense = vit_from_preset(preset, "ode", "attention", dtype=D, device=device)
    with torch.no_grad():
        for model in (ssog, dense):
            for mod in model.vector_field.block.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.normal_(0.0, gain / math.sqrt(mod.in_features))
        shared = {k: v for k, v in ssog.state_dict().items() if k in dense.state_dict()
                  and dense.state_dict()[k].shape == v.shape}
        dense.load_state_dict(shared, strict=False)
    return ssog, dense


def constants_row(model, x0, v=None) -> dict:
    from lipcheck.bounds import vector_field_lipschitz
    r = vector_field_lipschitz(model, x0, min_variance=v)
    return {k: getattr(r, k) for k in ("global_bound", "local_bound", "mixer", "mlp", "ln1_global", "ln2_global",
                                       "ln1_local", "ln2_local", "vacuous")}


def measure(args) -> tuple[str, dict, list]:
    """Every phase of the full report, timed: (Markdown, numbers, figures)."""
    cfg = SETTINGS["quick" if args.quick else "full"]
    device = torch.device(args.device)
    ssog, dense = build_models(args.preset, args.gain, args.seed, device)
    gen = torch.Generator().manual_seed(args.seed)
    images = torch.randn(cfg["batch"], 3, ssog.img_size, ssog.img_size, dtype=D, generator=gen).to(device)
    kw = dict(device=device, dtype=D, progress=not args.no_progress)
    timings = {}
    with timed(timings, "sweeps"):
        sweeps, interp = sweep_phase(ssog, dense, images, cfg, kw)
    with timed(timings, "gronwall"):
        growth, growth_small = gronwall_phase(ssog, images, cfg, args.seed, device)
    with timed(timings, "certificate"):
        cert, gentle, gentle_model = certificate_phase(ssog, images, cfg, args, device)
    with timed(timings, "enclosure"):
        enclosures = [enclosure_phase(ssog, images[:cfg["enc_batch"]], cfg, device, args.gain, growth, growth_small)]
        if gentle_model is not None:
            enclosures.append(enclosure_phase(gentle_model, images[:cfg["enc_batch"]], cfg, device, args.cert_gain,
                                              None))
    with timed(timings, "gradients"):
        gradients = gradient_phase(ssog, images, cfg, device, args)
    with timed(timings, "contrast"):
        contrast, contrast_runs = contrast_phase(ssog, dense, images, cfg, args.seed, kw)
    block_x0 = wellposed.prepare(ssog, images, device=device)[1]
    constants = {"ssog": constants_row(ssog, block_x0, growth["min_variance"]),
                 "attention": constants_row(dense, block_x0, growth["min_variance"])}
    runs = sweeps["ssog"].runs + interp.runs + sweeps["attention"].runs
    conv = {name: sw.convergence for name, sw in sweeps.items()}
    conv["ssog_dopri8_interpolated"] = interp.convergence
    data = {
        "settings": {"preset": args.preset, "quick": args.quick, "gain": args.gain, "seed": args.seed,
                     "batch": cfg["batch"], "t1": ssog.t1, "grid": list(PRESETS[args.preset].items())},
        "runs": runs,
        "reference": {name: sw.reference.summary() for name, sw in sweeps.items()},
        "convergence": conv,
        "gronwall": {"violations": growth["violations"]["global"] + growth["violations"]["local"],
                     "violations_by_constant": growth["violations"], **{k: v for k, v in growth.items()
                                                                        if k != "violations"}},
        "certificate": {**time_major(cert), "gentle": time_major(gentle) if gentle else None},
        "enclosure": enclosures, "enclosure_ti": load_ti(args), "gradients": gradients,
        "contrast": contrast, "contrast_runs": contrast_runs, "constants": constants,
        "must_show": must_show(sweeps["ssog"], growth, cert, gentle), "seconds": timings,
    }
    return wellposed_report.markdown(data), data, wellposed_report.figures(data)


@contextlib.contextmanager
def timed(timings: dict, phase: str):
    """timings[phase] = wall-clock seconds of the block."""
    start = time.perf_counter()
    yield
    timings[phase] = time.perf_counter() - start


def sweep_phase(ssog, dense, images, cfg, kw):
    """Both fields' tolerance sweeps, and dopri8 on the SSoG field with x(t1) read off the dense output."""
    sweeps = {}
    for name, model in (("ssog", ssog), ("attention", dense)):
        sweeps[name] = wellposed.tolerance_sweep(model, images, wellposed.METHODS, cfg["tolerances"],
                                                 rk4_steps=cfg["rk4_steps"], **kw)
    interp = wellposed.tolerance_sweep(ssog, images, ("dopri8",), cfg["tolerances"], land_on_t1=False,
                                       reference=sweeps["ssog"].reference, **kw)
    return sweeps, interp


def gronwall_phase(ssog, images, cfg, seed, device):
    growth = wellposed.perturbation_growth(ssog, images, grid=cfg["grid"], power_iters=cfg["power_iters"],
                                           power_steps=cfg["power_steps"],
                                           seed=seed, device=device, dtype=D)
    # the same measurement at a size where the finite-size log-norm envelope is not vacuous (enclosure section)
    growth_small = wellposed.perturbation_growth(ssog, images[:cfg["enc_batch"]], eps=cfg["envelope_eps"],
                                                 grid=cfg["grid"], power_iters=cfg["power_iters"],
                                                 power_steps=cfg["power_steps"], seed=seed, device=device,
                                                 dtype=D)
    return growth, growth_small


def certificate_phase(ssog, images, cfg, args, device):
    """The a-posteriori certificate of the default field and (full run) of a gentler one: (cert, gentle, the
    gentler model) with None for the last two in a quick run."""
    cert = wellposed.aposteriori_certificate(ssog, images, tol=cfg["cert_tol"], per_step=cfg["cert_per_step"],
                                             device=device, dtype=D)
    gentle = gentle_model = None
    if cfg["gentle"]:
        gentle_model = build_models(args.preset, args.cert_gain, args.seed, device)[0]
        gentle = wellposed.aposteriori_certificate(gentle_model, images, tol=cfg["cert_tol"],
                                                   per_step=cfg["cert_per_step"], device=device, dtype=D)
        gentle["gain"] = args.cert_gain
    return cert, gentle, gentle_model


def contrast_phase(ssog, dense, images, cfg, seed, kw):
    """Both fields at every input scale: dopri5's work and the Gronwall constants against the measured rate."""
    device = kw["device"]
    contrast, contrast_runs = [], []
    for name, model in (("ssog", ssog), ("attention", dense)):
        for s in cfg["scales"]:
            sw = wellposed.tolerance_sweep(model, images, ("dopri5",), cfg["contrast_tols"], input_scale=s, **kw)
            g = wellposed.perturbation_growth(model, images, grid=cfg["contrast_grid"], directions=("random",),
                                              input_scale=s, seed=seed, device=device, dtype=D)
            contrast_runs += sw.runs
            d = g["directions"]["random"]
            contrast.append({"mixer": name, "scale": s, "L_global": g["L_global"], "L_local": g["L_local"],
                             "min_variance": g["min_variance"], "rate_t1": max(d["rate_t1"]),
                             "max_rate": d["max_rate"], "violations": g["violations"],
                             "runs": [{k: r[k] for k in ("tol", "nfe", "accepted", "rejected", "error", "seconds")}
                                      for r in sw.runs]})
    return contrast, contrast_runs


def trained_ode_model(args):
    """The digits ODE/SSoG model of experiments/trained.py (same run directory and arguments), trained by
    `lipcheck train` if it is not there yet (about 20 s on a CPU); (model, images) or None where that fails."""
    from lipcheck import checkpoint as C
    from . import trained
    root = Path(args.runs) / "ode-ssog"
    ck = root / "checkpoint.pt"
    try:
        from lipcheck import train as T
        if not (ck.is_file() and T.load_checkpoint(ck)["epoch"] == trained.REPORT_EPOCHS):
            argv = ["--variant", "ode", "--mixer", "ssog", "--epochs", str(trained.REPORT_EPOCHS), "--out", str(root),
                    "--threads", "1", "--seed", "0", "--no-progress"]
            if trained.train_script().main(argv) != 0:
                return None
        ckpt = C.load(ck)
        return ckpt.model.to(D), C.images(ckpt, n=4).to(D), str(ck)
    except (OSError, RuntimeError, ValueError, ImportError) as err:  # reported, not hidden
        return {"error": f"{type(err).__name__}: {err}"}


def gradient_phase(random_model, images, cfg, device, args) -> dict:
    """Adjoint vs backpropagation (`wellposed.gradient_check`) on the random and, in the full run, the trained
    model: NFE forward / backward, accepted / rejected steps of both passes, min-step clamps."""
    rows = []
    models = [("random (gain %g)" % args.gain, random_model, images[:cfg["grad_batch"]])]
    trained_info = None
    if not args.quick:
        got = trained_ode_model(args)
        if isinstance(got, tuple):
            models.append(("trained (digits, " + got[2] + ")", got[0], got[1]))
            trained_info = got[2]
        else:
            trained_info = got
    for name, model, x in models:
        for tol in cfg["grad_tols"]:
            r = wellposed.gradient_check(model, x, tol=tol, seed=args.seed, device=device, dtype=D)
            rows.append({"model": name, **{k: v for k, v in r.items() if not k.startswith("grad_x0")}})
    r = wellposed.gradient_check(random_model, images[:cfg["grad_batch"]], tol=1e-9, min_step=0.125, seed=args.seed,
                                 device=device, dtype=D)
    rows.append({"model": "random (gain %g), min_step 0.125" % args.gain,
                 **{k: v for k, v in r.items() if not k.startswith("grad_x0")}})
    return {"rows": rows, "trained": trained_info}


def enclosure_phase(model, images, cfg, device, gain, growth, growth_small=None) -> dict:
    """The proven enclosure (`wellposed.enclose`) of one field, its actual error against a converged reference
    landing on every enclosure time, and the log-norm perturbation envelope against the measured growth."""
    enc = wellposed.enclose(model, images, tol=cfg["enc_tol"], mu_slack=cfg["enc_slack"],
                            defect_ratio=cfg["enc_defect_ratio"], max_per_step=cfg["enc_max_per_step"],
                            ref_max_per_step=cfg["enc_ref_max_per_step"],
                            lognorm=cfg["enc_lognorm"], device=device, dtype=D, progress=False)
    block, x0, t1 = wellposed.prepare(model, images, device=device)
    # the actual error at up to 65 of the enclosure times (the reference lands on each; more only costs time)
    keep = sorted(set(torch.linspace(0, len(enc.t) - 1, min(len(enc.t), 65)).round().long().tolist()))
    ref = wellposed.reference_solution(block, x0, t1, t=enc.t[keep], rel_tol=1e-13, start_steps=64)
    actual = wellposed.sample_norm(ref.states - enc.center[keep])  # (len(keep), B)
    dt = enc.t[1:] - enc.t[:-1]
    out = {"gain": gain, **enc.summary(), "actual": actual.T.tolist(), "actual_t1": actual[-1].tolist(),
           "actual_t": enc.t[keep].tolist(),
           "reference_error": float(ref.abs_error.max()),
           "ratio_t1": (enc.radius[-1] / actual[-1]).tolist(),
           "contained": bool((actual <= enc.radius[keep]).all()),
           "int_mu": (enc.mu * dt[:, None]).sum(0).tolist(),
           "int_mu_point": (enc.mu_point[1:] * dt[:, None]).sum(0).tolist(),
           "state_norm_t1": wellposed.sample_norm(enc.center[-1]).tolist()}
    if enc.reference is not None:  # Theorem 6: the reference solve's own enclosure, for the report
        ref = enc.reference
        out["ref"] = {"tol": enc.stats["ref_tol"], "radius_t1": ref.radius[-1].tolist(), **enc.stats["reference"],
                      "defect_max": ref.defect.amax(0).tolist(), "defect_sampled_max": ref.defect_sampled.amax(0).tolist(),
                      "stiffness_max": ref.stats["stiffness_max"], "eigensolves": ref.stats["eigensolves"]}
    if growth is not None:  # the perturbations of perturbation_growth: size eps ||x0||
        size = growth["eps"] * wellposed.sample_norm(x0)
        G = wellposed.lognorm_envelope(enc, size)
        G0 = wellposed.lognorm_envelope(enc, torch.zeros_like(size))
        measured = max(d["max_growth"] for d in growth["directions"].values())
        out["envelope"] = {"eps": growth["eps"], "G_t1": G[-1].tolist(), "G_max": G.amax(0).tolist(),
                           "G0_t1": G0[-1].tolist(), "G0_max": G0.amax(0).tolist(),
                           "measured_max_growth": measured, "ratio": float(G.amax()) / measured,
                           "ratio_infinitesimal": float(G0.amax()) / measured,
                           "L_local": growth["L_local"], "L_global": growth["L_global"]}
    if growth_small is not None:  # a smaller size: the tube eps ||x0|| G no longer inflates mu by M2 rho
        size = growth_small["eps"] * wellposed.sample_norm(x0)
        G = wellposed.lognorm_envelope(enc, size)
        measured = max(d["max_growth"] for d in growth_small["directions"].values())
        out["envelope_small"] = {"eps": growth_small["eps"], "G_max": G.amax(0).tolist(),
                                 "measured_max_growth": measured, "ratio": float(G.amax()) / measured}
    return out


def load_ti(args):
    """Numbers of the separate full-size run (`--enclosure-only --preset ti`), if it has been made."""
    import json
    path = (Path(args.docs) if args.docs else report.docs_dir()) / "data" / "divergence_ti.json"
    if args.preset != "tiny" or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def time_major(cert: dict) -> dict:
    """bound, actual, delta as one list per sampled time (of per-sample values), as the JSON keeps them."""
    return {**cert, **{k: [list(r) for r in zip(*cert[k])] for k in ("bound", "actual", "delta")}}


def must_show(sw, growth, cert, gentle) -> dict:
    conv = sw.convergence["per_method"]
    adaptive = {m: c["orders_gained"] for m, c in conv.items() if c["kind"] == "adaptive"}
    tight = sw.convergence["tightest_tol"]
    at_tight = {r["method"]: r["error"] for r in sw.runs if r["tol"] == tight}
    rk4 = conv.get("rk4", {})
    return {
        "orders_gained": adaptive, "every_adaptive_gains_3_orders": all(v >= 3 for v in adaptive.values()),
        "dopri_at_tightest": {m: at_tight.get(m) for m in ("dopri5", "dopri8")}, "tightest_tol": tight,
        "dopri_within_1e-7": all((at_tight.get(m) or 1.0) <= 1e-7 for m in ("dopri5", "dopri8")),
        "rk4_slope": rk4.get("slope"),
        "rk4_order_4": rk4.get("slope") is not None and abs(rk4["slope"] - 4) <= 0.3,
        "gronwall_violations": growth["violations"],
        "certificate_violations": cert["violations"] + (gentle["violations"] if gentle else 0),
    }


ENCLOSURE_ONLY = dict(enc_batch=1, enc_tol=1e-6, enc_slack=1.5, enc_defect_ratio=1.0, enc_max_per_step=64,
                      enc_ref_max_per_step=2048, enc_ref_defect_abs=3e-6)


def run_enclosure_only(args) -> tuple[str, dict, list]:
    """One image, the enclosure alone (the full-size presets: sweeps there would take hours on a CPU)."""
    device = torch.device(args.device)
    ssog, _ = build_models(args.preset, args.gain, args.seed, device)
    gen = torch.Generator().manual_seed(args.seed)
    images = torch.randn(1, 3, ssog.img_size, ssog.img_size, dtype=D, generator=gen).to(device)
    cfg = dict(ENCLOSURE_ONLY)
    start = time.perf_counter()
    enc = wellposed.enclose(ssog, images, tol=cfg["enc_tol"], mu_slack=cfg["enc_slack"],
                            defect_ratio=cfg["enc_defect_ratio"], max_per_step=cfg["enc_max_per_step"],
                            ref_max_per_step=cfg["enc_ref_max_per_step"], ref_defect_abs=cfg["enc_ref_defect_abs"],
                            max_seconds=args.max_seconds, device=device, dtype=D, progress=not args.no_progress)
    seconds = time.perf_counter() - start
    block, x0, t1 = wellposed.prepare(ssog, images, device=device)
    e = {"gain": args.gain, **enc.summary(), "state_norm_t1": wellposed.sample_norm(enc.center[-1]).tolist(),
         "wall_seconds": seconds}
    H, W, C = x0.shape[1:]
    data = {"settings": {"preset": args.preset, "grid": f"{H}x{W} tokens, C = {C}, n = {H * W * C}",
                         "threads": args.threads, "seed": args.seed, **cfg}, "enclosure": [e]}
    md = wellposed_report.enclosure_only_markdown(data, t1=t1, shape=(H, W, C))
    return md, data, wellposed_report.enclosure_only_figures(data)


def add_arguments(p) -> None:
    add_checkpoint_arguments(p, "prove the enclosure of every image's trajectory (and, without --enclosure-only, run "
                                "the sweep and Gronwall envelope) on that ODE model")
    p.add_argument("--quick", action="store_true", help="a reduced run (under a minute on a CPU)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model width preset (default tiny)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gain", type=float, default=1.0,
                   help="block Linear weights ~ N(0, gain^2/fan_in) (default 1)")
    p.add_argument("--cert-gain", type=float, default=0.5,
                   help="gain of the gentler field on which the certificate is also shown (default 0.5)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="CPU threads for torch and BLAS (default 1: the tensors are small and threads only contend)")
    add_output_arguments(p)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="a time budget for each enclosure (--enclosure-only, --checkpoint); when used up, the report "
                        "says up to which t the enclosure is proven and with which radius")
    p.add_argument("--runs", type=Path, default=Path("runs/trained"),
                   help="where experiments/trained.py keeps its digits models (the ODE/SSoG one is trained if missing)")
    p.add_argument("--enclosure-only", action="store_true",
                   help="only the proven enclosure: of one image of the preset (writes docs/divergence_<preset>.md), or "
                        "with --checkpoint of the checkpoint's images")
    p.set_defaults(run=run)


def main(argv=None) -> int:
    args, p = parse(sys.modules[__name__], argv, prog="lipcheck wellposed")
    return run(args, p)


def run(args, p) -> int:
    if args.max_seconds is not None and not (math.isfinite(args.max_seconds) and args.max_seconds > 0):
        p.error(f"--max-seconds must be a positive number of seconds, got {args.max_seconds}")
    if args.checkpoint:
        not_with_checkpoint(args, p, {"preset": "tiny", "gain": 1.0, "cert_gain": 0.5, "runs": Path("runs/trained")})
        from .trained import run_checkpoint
        return run_checkpoint("wellposed", args, p)
    for name in ("gain", "cert_gain"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            p.error(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    args.docs = report.docs_dir(args.docs, quick=args.quick)
    threads = set_threads(args.threads)
    try:
        st = report.stamp(device=args.device)
        start = time.perf_counter()
        if args.enclosure_only:
            md, data, figures = run_enclosure_only(args)
            data["seconds"] = {"total": time.perf_counter() - start}
            name = f"divergence_{args.preset}"
        else:
            md, data, figures = measure(args)
            data["seconds"]["total"] = time.perf_counter() - start
            name = "divergence"
        for fname, fig in figures:
            report.save_figure(fig, fname, st, docs=args.docs)
        v = verdict(data, enclosure_only=args.enclosure_only)
        path = report.write_report(name, md, data, st, docs=args.docs, json_path=args.json, verdict=v)
    finally:
        threads.restore()
    print(f"({data['seconds']['total']:.0f} s)")
    report.print_verdict(v, path)
    return 0


def verdict(data: dict, *, enclosure_only: bool = False) -> dict:
    """S5 holds when the proven enclosure covers every image on [0, t1] and, in the full report, the adaptive
    solvers converge to one trajectory and no perturbation leaves the Gronwall envelope."""
    encs = data.get("enclosure") or []
    encs = [encs] if isinstance(encs, dict) else encs
    proven = [p for e in encs for p in e.get("proven", [])]
    ratios = [r for e in encs for r in e.get("ratio_t1", []) if isinstance(r, (int, float))]
    statement = "S5, Picard-Lindelof on the SSoG Neural-ODE ViT (proven enclosure of the true trajectory"
    if enclosure_only:
        n = sum(proven)
        return report.verdict(statement + ")", "holds" if proven and all(proven) else "partial" if n else "fails",
                              f"Proven on [0, t1] for {n}/{len(proven)} image(s).")
    ms = data.get("must_show", {})
    converge = bool(ms.get("every_adaptive_gains_3_orders")) and bool(ms.get("dopri_within_1e-7"))
    gron = ms.get("gronwall_violations", {})
    no_violation = not any(gron.values()) if gron else False
    ok = converge and no_violation and proven and all(proven)
    ratio = f", radius / actual error at t1 {min(ratios):.3g}-{max(ratios):.3g}" if ratios else ""
    return report.verdict(
        statement + "; solvers converge to one limit; Gronwall envelope)",
        "holds" if ok else "partial",
        f"Enclosure proven for {sum(proven)}/{len(proven)} image runs{ratio}; solvers converge to one trajectory: "
        f"{'yes' if converge else 'NO'}; Gronwall envelope violations: {sum(gron.values()) if gron else 'n/a'}.")


def verdict_from(data: dict) -> dict:
    """The verdict of a finished run from its JSON (lipcheck report --verdicts): divergence or divergence_<preset>."""
    return verdict(data, enclosure_only="must_show" not in data)


if __name__ == "__main__":
    raise SystemExit(main())
