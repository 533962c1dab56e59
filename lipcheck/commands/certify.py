"""Certify: Lipschitz bounds for fixed-kernel SSoG, the block and the Neural-ODE vector field (S1-S3).

Writes docs/lipschitz.md, docs/figures/lipschitz_*.png and docs/data/lipschitz.json.
    python experiments/certify.py [--quick] [--device cpu] [--seed 0] [--json PATH] [--docs DIR]
"""
from __future__ import annotations

import math
import sys
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from lipcheck import SSoG, report, vit_from_preset
from lipcheck.bounds import spectral, ssog_lipschitz, vector_field_lipschitz
from lipcheck.models.ode import integrate
from lipcheck.models.vit import PRESETS
from lipcheck.reports import certify as certify_report
from lipcheck.reports.certify import edges_markdown, exactness_markdown, mutation_markdown  # noqa: F401 (kept here)
from lipcheck.threads import limited

from .common import add_checkpoint_arguments, add_output_arguments, parse, positive_int, set_threads
from .exactness import exactness_table  # noqa: F401  (its home is the exactness command)

F64 = torch.float64


def preset_layer(name: str, kernels: str, seed: int, device) -> SSoG:
    """An SSoG layer of preset `name` in float64: ViT initialisation (trunc-normal 0.02 weights, alpha = 1/M,
    mu in +-2, sigma log-uniform in [0.5, 4]); kernels='frozen' replaces them by fixed mixed-sign kernels."""
    torch.manual_seed(seed)
    cfg = PRESETS[name]
    layer = SSoG(cfg["dim"], cfg["num_heads"], 4, dtype=F64, device=device)
    with torch.no_grad():
        torch.nn.init.trunc_normal_(layer.v_proj.weight, std=0.02)
        torch.nn.init.trunc_normal_(layer.o_proj.weight, std=0.02)
        layer.o_proj.bias.zero_()
        if kernels == "frozen":
            h, M = layer.num_heads, layer.num_components
            layer.set_gaussian_params(alpha=torch.randn(h, M, dtype=F64) / M,
                                      mu=(torch.rand(h, M, 2, dtype=F64) * 2 - 1) * 4,
                                      sigma=torch.exp(torch.rand(h, M, 2, dtype=F64) * math.log(12)) * 0.25)
    return layer.freeze_kernels()


def preset_table(args, device) -> list[dict]:
    """Every preset's layer on a 14x14 grid, at its initialisation and with frozen mixed-sign kernels."""
    data = []
    presets = ["ti"] if args.quick else ["ti", "s", "b"]
    for name in tqdm(presets, desc="presets"):
        for kernels in ("random init", "frozen"):
            layer = preset_layer(name, "frozen" if kernels == "frozen" else "init", args.seed, device)
            grid = 14
            # the continuous sup costs many C x C SVDs for mixed-sign kernels: only for the initialisation here
            rf = kernels == "random init" and (name == "ti" or not args.quick) and name != "b"
            r = ssog_lipschitz(layer, grid, grid, device=device, resolution_free=rf, deflated=True,
                               rf_rtol=1e-2, target_gap=1e-3, max_steps=150 if args.quick else 300)
            d = r.as_dict()
            d.update(preset=name, kernels=kernels, C=layer.dim, heads=layer.num_heads)
            data.append(d)
    return data


def benchmark(args, device):
    """Must-show 3: preset-s-sized layer, 14x14 probabilistic (gap <= 1e-3 at failure <= 1e-6), 64x64 deterministic."""
    layer = preset_layer("s", "init", args.seed, device)
    out = {}
    grids = [(14, "probabilistic"), (64, "deterministic")]
    for n, kind in grids:
        t = time.perf_counter()
        r = ssog_lipschitz(layer, n, n, device=device, resolution_free=False, failure_probability=1e-6,
                           target_gap=1e-3, max_steps=300, probabilistic=(kind == "probabilistic"))
        sec = time.perf_counter() - t
        out[f"{n}x{n}"] = dict(kind=kind, seconds=sec, lower=r.lower, upper=r.upper,
                               upper_probabilistic=r.upper_probabilistic, gap=r.gap,
                               gap_probabilistic=r.gap_probabilistic, failure_probability=r.failure_probability,
                               exact=r.exact, exact_reason=r.exact_reason, method=r.method, stage_seconds=r.seconds,
                               info=r.info, seed=r.seed, margins=r.margins)
    return out


def szego(args, device) -> tuple[list[dict], dict]:
    """Lower/upper vs grid size for a small layer, against its resolution-free bound (S2, Szego)."""
    torch.manual_seed(args.seed + 1)
    layer = SSoG(16, 2, 3, dtype=F64, device=device)
    with torch.no_grad():
        layer.v_proj.weight.normal_(0, 0.25)
        layer.o_proj.weight.normal_(0, 0.25)
    p = spectral.ssog_params(layer, device=device)
    rf, info = spectral.resolution_free_bound(p, rtol=1e-5)
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32] + ([] if args.quick else [48, 64])
    rows = []
    for n in tqdm(sizes, desc="Szego"):
        r = ssog_lipschitz(layer, n, n, device=device, resolution_free=False, max_steps=120, target_gap=1e-6)
        rows.append(dict(n=n, lower=r.lower, upper=r.upper, exact=r.exact, circulant=r.circulant))
    return rows, dict(resolution_free=rf.upper, symbol_sup_lower=rf.lower, closed_form=spectral.closed_form_bound(p),
                      **info)


def vector_field(args, device):
    """Global vs local vector-field bounds along ODE ViT trajectories of embedded random images."""
    out = []
    presets = ["tiny"] if args.quick else ["tiny", "ti"]
    for name in presets:
        torch.manual_seed(args.seed)
        model = vit_from_preset(name, "ode", "ssog", dtype=F64, device=device)
        images = torch.randn(2, 3, model.img_size, model.img_size, dtype=F64, device=device)
        with torch.no_grad():
            x0 = model.embed(images)
            t = torch.linspace(0, model.t1, 5, dtype=F64, device=device)
            xs = integrate(model.vector_field, x0, t, rtol=1e-6, atol=1e-8)
        b = vector_field_lipschitz(model, xs.reshape(-1, *xs.shape[2:]), rtol=1e-3)
        out.append(dict(preset=name, global_bound=b.global_bound, local_bound=b.local_bound, mixer=b.mixer, mlp=b.mlp,
                        ln1_global=b.ln1_global, ln1_local=b.ln1_local, ln2_global=b.ln2_global, ln2_local=b.ln2_local,
                        vacuous=b.vacuous, min_variance=b.terms["min_variance"], gelu_sup=b.terms["gelu_sup"],
                        eps=model.vector_field.block.norm1.eps))
    return out


# ---------------------------------------------------------------------------------------------------------
# Certification at the edges: each failure class against an exact value computed here, independently of
# lipcheck's kernel and bounds (mpmath taps, numpy dense SVD).


def _ref_taps(mu, sigma, n):
    import mpmath
    mpmath.mp.dps = 40
    m, s = mpmath.mpf(float(mu)), mpmath.mpf(float(sigma))
    c = int(mpmath.nint(m))
    R = int(13 * float(sigma)) + 20
    Z = mpmath.fsum(mpmath.exp(-(j - m) ** 2 / (2 * s * s)) for j in range(c - R, c + R + 1))
    return np.array([float(mpmath.exp(-(k - m) ** 2 / (2 * s * s)) / Z) for k in range(-(n - 1), n)])


def reference_norm(layer, H, W) -> float:
    """||T||_2 from the layer's stored numbers: taps in mpmath, T assembled in numpy (alpha divided by a power
    of two first, multiplied back after the SVD), a dense SVD. Nothing from lipcheck's kernel or bounds."""
    a, m, s = (t.detach().double().numpy() for t in layer.gaussian_params())
    WV = layer.v_proj.weight.detach().double().numpy().T
    WO = layer.o_proj.weight.detach().double().numpy().T
    e = math.frexp(float(np.abs(a).max()))[1]
    a = a * 2.0 ** (-e)
    h, M = a.shape
    C = WV.shape[0]
    d = C // h

    def axis(mu, sigma, n):
        t = _ref_taps(mu, sigma, n)
        i = np.arange(n)
        return t[(i[:, None] - i[None, :]) + n - 1]

    T = np.zeros((H * W * C, H * W * C))
    for hh in range(h):
        K = sum(a[hh, k] * np.kron(axis(m[hh, k, 0], s[hh, k, 0], H), axis(m[hh, k, 1], s[hh, k, 1], W))
                for k in range(M))
        T += np.kron(K, (WV[:, hh * d:(hh + 1) * d] @ WO[hh * d:(hh + 1) * d, :]).T)
    with limited():  # numpy's OpenBLAS on lipcheck's thread count
        return math.ldexp(float(np.linalg.norm(T, 2)), e)


def _edge_layer(seed=0, scale=1.0, dtype=F64, mu=None, sigma=None, h=2, M=2, d=2):
    g = torch.Generator().manual_seed(seed)
    layer = SSoG(h * d, h, M, dtype=dtype)
    a = (torch.rand(h, M, generator=g, dtype=F64) * 2 - 1) * scale
    mu = mu if mu is not None else (torch.rand(h, M, 2, generator=g, dtype=F64) * 2 - 1) * 3
    sigma = sigma if sigma is not None else torch.rand(h, M, 2, generator=g, dtype=F64) * 2 + 0.2
    with torch.no_grad():
        layer.v_proj.weight.copy_(torch.randn(h * d, h * d, generator=g, dtype=F64))
        layer.o_proj.weight.copy_(torch.randn(h * d, h * d, generator=g, dtype=F64))
    layer.set_gaussian_params(a.to(dtype), mu.to(dtype), sigma.to(dtype))
    return layer


def edges(args, device):
    """One row per case: what lipcheck returns (bounds or the refusal) beside the independent exact value."""
    H, W = 4, 5
    rows = []

    def certify(cls, case, make, dtype=F64, grid=(H, W), **kw):
        try:
            layer = make()
            r = ssog_lipschitz(layer, *grid, dtype=dtype, rf_rtol=1e-3, **kw)
        except ValueError as e:
            rows.append(dict(cls=cls, case=case, refused=str(e), exact=None))
            return None
        ex = reference_norm(layer, *grid)
        ups = {k: getattr(r, k) for k in ("upper", "upper_probabilistic", "circulant", "resolution_free",
                                         "closed_form")}
        if r.gram is not None:
            ups["gram"] = r.gram
        ok_up = all(v >= ex for v in ups.values())
        rows.append(dict(cls=cls, case=case, lower=r.lower, upper=r.upper, resolution_free=r.resolution_free,
                         gram=r.gram, exact=ex, upper_ok=ok_up, lower_ok=r.lower <= ex, seed=r.seed,
                         upper_rel=(r.upper / ex - 1) if ex > 0 else None, margins=r.margins))
        return r

    for k in (-300, -80, 0, 76, 300):
        certify("scale", f"alpha x 1e{k}", lambda k=k: _edge_layer(1, 10.0 ** k))
    certify("scale", "weights x 1e150 each (norm ~1e300)",
            lambda: _scaled_weights(_edge_layer(2), 1e150))
    certify("scale", "weights x 1e160 each (norm beyond float64)", lambda: _scaled_weights(_edge_layer(2), 1e160))
    half = torch.full((2, 2, 2), 0.5, dtype=F64)
    narrow = torch.full((2, 2, 2), 0.0105, dtype=F64)
    certify("underflowing kernel", "sigma 0.0105, mu 0.5 (every lattice term of Z underflows), float64",
            lambda: _edge_layer(3, mu=half, sigma=narrow))
    certify("underflowing kernel", "sigma at the floor (1.001e-3), mu = 3.5 - 1e-7",
            lambda: _edge_layer(3, mu=half * 0 + 3.5 - 1e-7, sigma=narrow * 0 + 1.001e-3))
    certify("underflowing kernel", "kernel shifted off the grid (mu = 50, sigma 0.3): ||T|| ~ 1e-1900",
            lambda: _edge_layer(3, mu=half * 0 + 50, sigma=narrow * 0 + 0.3))
    certify("float32", "float32 layer, certified in float32", lambda: _edge_layer(4, dtype=torch.float32),
            dtype=torch.float32)
    certify("float32", "float32 layer, sigma 0.0105 at mu 0.5, certified in float32",
            lambda: _edge_layer(4, dtype=torch.float32, mu=half, sigma=narrow), dtype=torch.float32)
    certify("float32", "float64 layer certified in float32 (weights rounded: conversion margin)",
            lambda: _edge_layer(4), dtype=torch.float32)
    r1 = certify("probabilistic", "fresh seed (default)", lambda: _edge_layer(5), grid=(12, 12), exact_max=0,
                 gram_max=0, resolution_free=False, max_steps=60)
    certify("probabilistic", f"replay of seed {r1.seed if r1 else None}", lambda: _edge_layer(5), grid=(12, 12),
            exact_max=0, gram_max=0, resolution_free=False, max_steps=60, seed=r1.seed if r1 else 0)
    certify("rounding", "Gram iteration with close top singular values (one head, alpha = +-1)",
            lambda: _edge_layer(6, mu=half * 0, sigma=narrow * 0 + 2.0))
    certify("NaN/inf", "NaN in v_proj.weight", lambda: _with(_edge_layer(7), "v_proj", float("nan")))
    certify("NaN/inf", "inf in o_proj.weight", lambda: _with(_edge_layer(7), "o_proj", float("inf")))
    certify("NaN/inf", "alpha = inf (set_gaussian_params)",
            lambda: _edge_layer(7, scale=float("inf")))
    certify("bad grid", "H = 0", lambda: _edge_layer(8), grid=(0, 4))
    certify("bad grid", "W = -3", lambda: _edge_layer(8), grid=(4, -3))
    certify("float16", "float16 layer", lambda: _edge_layer(9).to(torch.float16))
    certify("float16", "float16 layer, sigma 0.0105 (set_gaussian_params)",
            lambda: _edge_layer(9, dtype=torch.float16, mu=half, sigma=narrow))

    # the 2 x 2 norm the anchor bound uses, against an exact rational SVD
    import mpmath
    mpmath.mp.dps = 50
    p_, q_ = 1.0, 1e-9
    t = lambda x: torch.tensor([x], dtype=F64)  # noqa: E731
    stable = float(spectral.two_by_two_norm(t(p_), t(q_), t(q_), t(p_)))
    tr = 2 * p_ ** 2 + 2 * q_ ** 2
    old = math.sqrt((tr + math.sqrt(max(tr * tr - 4 * (p_ * p_ - q_ * q_) ** 2, 0.0))) / 2)
    S = mpmath.svd_r(mpmath.matrix([[p_, q_], [q_, p_]]), compute_uv=False)
    exact2 = float(max(S[0], S[1]))
    two = dict(matrix=[[p_, q_], [q_, p_]], stable=stable, trace_formula=old, exact=exact2)
    return rows, two, certify_report.lies(rows)


def _scaled_weights(layer, s):
    with torch.no_grad():
        layer.v_proj.weight.mul_(s)
        layer.o_proj.weight.mul_(s)
    return layer


def _with(layer, name, value):
    with torch.no_grad():
        getattr(layer, name).weight[0, 0] = value
    return layer


def add_arguments(ap) -> None:
    add_checkpoint_arguments(ap, "certify every SSoG layer of that model at its grid and 2x, 4x it")
    ap.add_argument("--quick", action="store_true", help="smaller run (about 2 minutes on a CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=positive_int, default=1, help="CPU threads for torch and BLAS (default 1)")
    add_output_arguments(ap)
    ap.set_defaults(run=run)


def main(argv=None) -> int:
    args, ap = parse(sys.modules[__name__], argv, prog="lipcheck certify")
    return run(args, ap)


def run(args, ap) -> int:
    if args.checkpoint:
        from .trained import run_checkpoint
        return run_checkpoint("certify", args, ap)
    set_threads(args.threads)
    args.docs = report.docs_dir(args.docs, quick=args.quick)
    device = torch.device(args.device)
    st = report.stamp(device=device)

    bench = benchmark(args, device)
    presets = preset_table(args, device)
    sz_rows, sz_info = szego(args, device)
    vf = vector_field(args, device)
    edge_rows, two, lies = edges(args, device)
    data = dict(benchmark=bench, presets=presets, szego=dict(rows=sz_rows, **sz_info), vector_field=vf,
                edges=dict(rows=edge_rows, two_by_two=two, finite_upper_below_exact=len(lies)),
                quick=args.quick, seed=args.seed)
    report.save_figure(certify_report.szego_figure(data["szego"]), "lipschitz_szego", st, docs=args.docs)
    v = verdict(presets, sz_info)
    path = report.write_report("lipschitz", certify_report.markdown(data, args.docs), data, st, docs=args.docs,
                               json_path=args.json, verdict=v)
    report.print_verdict(v, path)
    return 0


def verdict(presets: list[dict], sz_info: dict) -> dict:
    """S1-S2 hold when every bound is finite and lower <= upper; the number is the loosest certified gap."""
    ok = all(math.isfinite(r["upper"]) and r["lower"] <= r["upper"] for r in presets)
    worst = max(presets, key=lambda r: r["gap"])
    return report.verdict(
        "S1-S2, fixed-kernel SSoG is globally Lipschitz (certified lower <= ||T||_2 <= upper)",
        "holds" if ok else "fails",
        f"Loosest certified gap upper/lower - 1 over {len(presets)} preset layers at 14x14: {worst['gap']:.2e} "
        f"({worst['preset']}, {worst['kernels']}); resolution-free bound (every grid) of the Szego layer "
        f"{sz_info['resolution_free']:.6g}.")


def verdict_from(data: dict) -> dict:
    """The verdict of a finished run from its JSON (lipcheck report --verdicts)."""
    return verdict(data["presets"], data["szego"])


if __name__ == "__main__":
    raise SystemExit(main())
