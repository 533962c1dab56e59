"""The analyses `lipcheck trained` and `lipcheck certify|wellposed|probe --checkpoint` run on one model: S1-S3
(every SSoG layer at the model's grid and 2x/4x it, block and vector-field constants), S4 (attention growth) and
S5 (tolerance sweep, perturbation growth, certificate). Each returns plain numbers for the reports' JSON."""
from __future__ import annotations

import copy
import math

import torch

from lipcheck import verdicts, wellposed
from lipcheck.mixers.attention import DenseAttention

GRID_MULTIPLES = (1, 2, 4)  # the model's own token grid and 2x, 4x that grid


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
        return {"kind": "enclosure", "proven": [bool(p) for p in torch.as_tensor(res.proven).tolist()],
                "radius_t1": res.point_radius_t1().tolist(), "reason": res.reason, "t": torch.as_tensor(res.t).tolist()}
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
