"""The measurements behind docs/divergence.md (`lipcheck wellposed`), one function per phase: matched SSoG and dense
ODE ViTs, their tolerance sweeps, perturbation growth, certificates, proven enclosures, adjoint gradients and the
input-scale contrast. Each returns plain numbers for the report's JSON."""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch

from lipcheck import wellposed
from lipcheck.models.vit import vit_from_preset

D = torch.float64


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


def actual_error(block, x0, t1, enc, times: int = 17) -> dict:
    """The enclosure's actual error ||x(t) - y(t)|| at up to `times` of its times (t1 among them), x from an
    independent fixed-step dopri8 solve halved until two agree to 1e-13 (`wellposed.reference_solution`), landing
    on each of those times; the radius / actual ratio at t1 and whether every actual error is inside its radius."""
    t = time.perf_counter()
    keep = sorted(set(torch.linspace(0, len(enc.t) - 1, min(len(enc.t), times)).round().long().tolist()))
    ref = wellposed.reference_solution(block, x0, t1, t=enc.t[keep], rel_tol=1e-13, start_steps=64)
    actual = wellposed.sample_norm(ref.states - enc.center[keep])  # (len(keep), B)
    return {"actual": actual.T.tolist(), "actual_t": enc.t[keep].tolist(), "actual_t1": actual[-1].tolist(),
            "ratio_t1": (enc.point_radius_t1() / actual[-1]).tolist(),
            "contained": bool((actual <= enc.radius[keep]).all()),
            "reference_error": float(ref.abs_error.max()), "reference_steps": ref.steps,
            "reference_seconds": time.perf_counter() - t}


def enclosure_phase(model, images, cfg, device, gain, growth, growth_small=None) -> dict:
    """The proven enclosure (`wellposed.enclose`) of one field, its actual error against a converged reference
    landing on every enclosure time, and the log-norm perturbation envelope against the measured growth."""
    enc = wellposed.enclose(model, images, tol=cfg["enc_tol"], mu_slack=cfg["enc_slack"],
                            defect_ratio=cfg["enc_defect_ratio"], max_per_step=cfg["enc_max_per_step"],
                            ref_max_per_step=cfg["enc_ref_max_per_step"],
                            lognorm=cfg["enc_lognorm"], device=device, dtype=D, progress=False)
    block, x0, t1 = wellposed.prepare(model, images, device=device)
    dt = enc.t[1:] - enc.t[:-1]
    # the actual error at up to 65 of the enclosure times (the reference lands on each; more only costs time)
    out = {"gain": gain, **enc.summary(), **actual_error(block, x0, t1, enc, times=65),
           "int_mu": (enc.mu * dt[:, None]).sum(0).tolist(),
           "int_mu_point": (enc.mu_point[1:] * dt[:, None]).sum(0).tolist(),
           "state_norm_t1": wellposed.sample_norm(enc.center[-1]).tolist()}
    if enc.reference is not None:  # Theorem 6: the reference solve's own enclosure, for the report
        ref = enc.reference
        out["ref"] = {"tol": enc.stats["ref_tol"], "radius_t1": ref.point_radius_t1().tolist(), **enc.stats["reference"],
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
