"""Exactness: the default certification of Lip(SSoG) (`ssog_lipschitz(layer, H, W)`, no options) at every token grid a
ViT uses: its certified gap upper / lower - 1, its seconds, the circulant embedding, and the exact norm where cheap.

Writes docs/exactness.md, docs/figures/exactness_gap.png and docs/data/exactness.json. Rows are kept by key (family,
C, H, W, seed): a run replaces its own rows in the JSON it writes and keeps the others, so the full table can be
measured in parts (--fresh starts from no rows).
    python experiments/exactness.py [--quick] [--widths 48 192] [--grids 14 28x28 14x28] [--families init wide]
    python experiments/exactness.py --merge part1.json part2.json   (one report from the rows of earlier runs)
    python experiments/exactness.py --replot docs/data/exactness.json   (the figure only, from saved rows)
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lipcheck import SSoG, report
from lipcheck.bounds import spectral, ssog_lipschitz
from lipcheck.mixers.taps import SIGMA_FLOOR
from lipcheck.reports import exactness as exactness_report
from lipcheck.reports.exactness import figure  # noqa: F401  (the figure of these rows)

from . import common

F64 = torch.float64
FAMILIES = ("init", "broad", "frozen", "wide", "floor")
WIDTHS = (48, 192, 384, 768)
GRIDS = ((8, 8), (14, 14), (16, 16), (28, 28), (32, 32), (64, 64))
LARGE_GRIDS, LARGE_WIDTHS = ((128, 128),), (192, 384)  # 128 x 128 only where its rows stay affordable
NON_SQUARE, NON_SQUARE_WIDTHS = ((14, 28), (20, 12)), (192,)  # a few layers on non-square grids
QUICK = dict(widths=(48,), grids=((8, 8), (14, 14)), families=("init", "broad"))
EXACT_DENSE = 4096  # an independent exact norm: dense SVD where N C <= this
EXACT_LANCZOS_GRID = 32  # else Lanczos where H, W <= this; beyond, the gap is measured against the certified lower
SCHEMA = 2  # rows of the default certification; schema-1 rows (docs/data/exactness.json before) are read for replots


def target(H: int, W: int) -> float:
    """The tracker's target for the certified gap: 1e-4 up to 64 x 64 tokens, 1e-3 beyond (128 x 128)."""
    return 1e-4 if H * W <= 64 * 64 else 1e-3


def heads_for(C: int) -> int:
    """12 heads at C = 768 (as preset b), 3 heads otherwise."""
    return 12 if C == 768 else 3


def exactness_layer(C: int, kernels: str, seed: int, heads: int | None = None, M: int | None = None) -> SSoG:
    """C channels, `heads` heads (default heads_for(C)), M components (default 8 for 'wide', else 4), float64:

    init: the default initialisation; broad: shifted signed kernels (alpha ~ N(0, 1), mu ~ 3 N(0, 1),
    sigma ~ U[0.5, 6.5]); frozen: narrow mixed-sign kernels as in the presets table (alpha ~ N(0, 1/M^2), |mu| <= 4,
    sigma log-uniform in [0.25, 3]); wide: as broad with sigma ~ U[0.5, 8] (M = 8 by default); floor: as broad with
    every sigma just above the library's floor SIGMA_FLOOR (the kernels are shifts of the grid by round(mu))."""
    if kernels not in FAMILIES:
        raise ValueError(f"kernels must be one of {', '.join(FAMILIES)}, got {kernels!r}")
    heads = heads_for(C) if heads is None else heads
    M = (8 if kernels == "wide" else 4) if M is None else M
    torch.manual_seed(seed)
    layer = SSoG(C, heads, M).double()
    h, rand, randn = heads, torch.rand, torch.randn
    sigma = {"broad": lambda: rand(h, M, 2, dtype=F64) * 6 + 0.5,
             "wide": lambda: rand(h, M, 2, dtype=F64) * 7.5 + 0.5,
             # softplus(raw) + floor never reaches the floor itself: the nearest width float64 carries well
             "floor": lambda: torch.full((h, M, 2), SIGMA_FLOOR * (1 + 1e-9), dtype=F64)}
    with torch.no_grad():
        if kernels in sigma:
            layer.set_gaussian_params(alpha=randn(h, M, dtype=F64), mu=randn(h, M, 2, dtype=F64) * 3,
                                      sigma=sigma[kernels]())
        elif kernels == "frozen":
            layer.set_gaussian_params(alpha=randn(h, M, dtype=F64) / M, mu=(rand(h, M, 2, dtype=F64) * 2 - 1) * 4,
                                      sigma=torch.exp(rand(h, M, 2, dtype=F64) * math.log(12)) * 0.25)
    return layer


def zero_padding_bound(p, *, oversample: int = 8, max_grid: int = 384, tail: float = 1e-12) -> float:
    """An input-size-independent bound for the zero-padded operator in the style of Delattre et al. (2024): the
    kernel truncated to a fixed support |k - round(mu)| <= R (R from a tail mass < `tail`), its symbol -- a
    trigonometric polynomial of degree d = R + |round(mu)| per axis -- sampled on an n0 x n0 DFT grid, n0 =
    min(oversample * (2 d + 1), max_grid), inflated by 1 / (1 - pi d / n0)^2 (Bernstein, |q'| <= d ||q||_inf, applied to the real
    trigonometric polynomials Re(e^{-i theta} u^* S v) along each axis in turn), plus the dropped tail's norm
    (l1 mass of the kernel outside the support). Valid for every grid size; a baseline, evaluated in float64
    without rounding margins."""
    from lipcheck import gaussian
    sig, mu = p.sigma, p.mu
    R = int(math.ceil(float(sig.max()) * math.sqrt(2 * math.log(1 / tail)) + 1))
    d = int(R + float(torch.round(mu).abs().max()))
    n0 = max(2 * d + 2, min(oversample * (2 * d + 1), max_grid))  # cost: n0^2 symbol norms
    k = torch.arange(-d, d + 1, dtype=F64)
    w = 2 * math.pi * torch.arange(n0, dtype=F64) / n0
    g = gaussian.kernel(k[:, None, None, None], mu, sig)  # (2d+1, h, M, 2)
    ph = torch.exp(-1j * w[:, None] * k[None, :])  # (n0, 2d+1)
    gy = torch.einsum("jk,khm->jhm", ph, g[..., 0].to(ph.dtype))
    gx = torch.einsum("jk,khm->jhm", ph, g[..., 1].to(ph.dtype))
    c = torch.einsum("hm,ahm,bhm->abh", p.alpha.to(gy.dtype), gy, gx).reshape(-1, p.num_heads)
    sn = spectral.SymbolNorm(p)
    grid = torch.stack(torch.meshgrid(w, w, indexing="ij"), -1).reshape(-1, 2)
    m = spectral.certified_max_points(sn, c, grid, rtol=1e-9)
    factor = 1 / (1 - math.pi * d / n0) ** 2
    mass = (g[..., 0].sum(0) * g[..., 1].sum(0)).clamp(max=1)  # (h, M): kept mass of each component
    tail_norm = float((sn.Pnorm * (p.alpha.abs() * (1 - mass)).sum(1)).sum())
    return m.upper * factor + tail_norm


def exact_norm(p, H: int, W: int, steps: int = 300) -> tuple[float, str]:
    """Dense SVD where N C <= 4096, else Lanczos on T^T T with the fast operator (converged to ~1e-12 here)."""
    if H * W * p.dim <= EXACT_DENSE:
        return float(torch.linalg.matrix_norm(spectral.dense_operator(p, H, W), ord=2)), "dense SVD"
    A = lambda v: spectral.apply_T_adjoint(spectral.apply_T(v, p), p)  # noqa: E731
    v0 = torch.randn(1, H, W, p.dim, generator=torch.Generator().manual_seed(1), dtype=F64)
    theta, v, k = spectral.lanczos(A, v0, steps)
    return float(spectral.apply_T(v, p).norm() / v.norm()), f"Lanczos ({k} steps)"


def exact_affordable(H: int, W: int, C: int) -> bool:
    return H * W * C <= EXACT_DENSE or max(H, W) <= EXACT_LANCZOS_GRID


def plan_rows(widths=WIDTHS, grids=None, families=FAMILIES) -> list[tuple[str, int, int, int]]:
    """(family, C, H, W) of every row: the grids given for every width, else the tracker's set (GRIDS; 128 x 128
    at C = 192, 384; the non-square grids at C = 192)."""
    jobs = []
    for C in widths:
        gs = list(grids) if grids is not None else list(GRIDS) + [
            g for g, at in ((g, LARGE_WIDTHS) for g in LARGE_GRIDS) if C in at] + [
            g for g in NON_SQUARE if C in NON_SQUARE_WIDTHS]
        jobs += [(fam, C, H, W) for fam in families for H, W in gs]
    return jobs


def exactness_table(widths=WIDTHS, grids=None, families=FAMILIES, seed: int = 0, progress: bool = True,
                    zero_padding: bool = False) -> list[dict]:
    """One row per (family, C, H, W) of `plan_rows`: the default certification, the circulant embedding it computed,
    the exact norm where cheap (exact_affordable), the target and whether it is met; with zero_padding, the
    size-independent zero-padding bound of each layer (the same in every row of that layer)."""
    rows, zp, commit = [], {}, report.git_commit()
    bar = tqdm(plan_rows(widths, grids, families), desc="exactness", disable=not progress)
    for fam, C, H, W in bar:
        bar.set_description(f"exactness {fam} C={C} {H}x{W}")
        layer = exactness_layer(C, fam, seed)
        row = dict(C=C, heads=layer.num_heads, M=layer.num_components, kernels=fam, H=H, W=W, seed=seed,
                   commit=commit)
        row.update(measure_row(layer, H, W))
        if zero_padding:
            if (fam, C) not in zp:
                t, q = time.perf_counter(), spectral.normalised(spectral.ssog_params(layer))
                zp[fam, C] = (zero_padding_bound(q) * 2.0 ** q.log2_scale, time.perf_counter() - t)
            row["zero_padding"], row["zero_padding_seconds"] = zp[fam, C]
        rows.append(judge_row(row))
    return rows


def measure_row(layer, H: int, W: int) -> dict:
    """The default certification on the H x W grid (its values, the stage that won, its seconds in all and per stage),
    the circulant embedding it computed, and an independent exact norm where exact_affordable."""
    t = time.perf_counter()
    r = ssog_lipschitz(layer, H, W)
    seconds = time.perf_counter() - t
    row = dict(lower=r.lower, upper=r.upper, method=r.best_method, seconds=seconds, stage_seconds=dict(r.seconds),
               certify_seed=r.seed, cut=list(r.budget.get("cut", [])), circulant=r.circulant,
               circulant_seconds=r.seconds.get("circulant"), exact=None, exact_method=None, exact_seconds=None)
    if exact_affordable(H, W, layer.dim):
        t = time.perf_counter()
        row["exact"], row["exact_method"] = exact_norm(spectral.ssog_params(layer), H, W)
        row["exact_seconds"] = time.perf_counter() - t
    return row


def judge_row(row: dict, tol: float = 1e-9) -> dict:
    """The certified gap upper / lower - 1 (lower is an actual ||T v|| / ||v||, so it bounds upper / exact - 1 from
    above), the circulant's, upper / exact - 1 where exact was run, the target and whether it is met, and whether
    each value lies on its side (lower <= upper; lower <= exact <= upper up to tol, the exact value's accuracy)."""
    lo, up, ex = row["lower"], row["upper"], row.get("exact")
    rel = (lambda x: x / lo - 1) if lo > 0 else (lambda x: math.inf)
    row["gap"], row["circulant_gap"] = rel(up), rel(row["circulant"])
    row["exact_gap"] = up / ex - 1 if ex else None
    row["target"] = target(row["H"], row["W"])
    row["met"] = row["gap"] <= row["target"]
    row["valid"] = dict(sandwich=lo <= up, circulant=row["circulant"] >= up)
    if ex is not None:
        row["valid"].update(lower=lo <= ex * (1 + tol), upper=up >= ex * (1 - tol))
    return row


def row_key(r: dict) -> tuple:
    return r["kernels"], r["C"], r["H"], r["W"], r.get("seed", 0)


def merge_rows(*row_lists) -> list[dict]:
    """The union by row_key, a later list's row replacing an earlier one's, in report order (family, C, tokens)."""
    rows = {}
    for lst in row_lists:
        rows.update({row_key(r): r for r in lst})
    order = {f: i for i, f in enumerate(FAMILIES)}
    return sorted(rows.values(), key=lambda r: (order.get(r["kernels"], 99), r["C"], r["H"] * r["W"], r["H"]))


def load_rows(path: Path, legacy: bool = False) -> list[dict]:
    """The rows of a saved run; schema-1 rows (before the default certification was measured) only if legacy."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") == SCHEMA:
        return data["rows"]
    return [legacy_row(r) for r in data.get("rows", [])] if legacy else []


def legacy_row(r: dict) -> dict:
    """A schema-1 row (square grid n, lipcheck's smallest upper beside exact) in this schema's fields."""
    r = dict(r, H=r.get("H", r.get("grid")), W=r.get("W", r.get("grid")))
    return judge_row(r) if "gap" not in r else r


def add_arguments(ap) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="C = 48 on 8x8 and 14x14, init and broad: 4 rows (5-10 min on 2 busy cores)")
    ap.add_argument("--widths", type=common.positive_int, nargs="+", default=None,
                    help=f"channel counts C (default {' '.join(map(str, WIDTHS))}; 12 heads at 768, else 3)")
    ap.add_argument("--grids", type=common.grid, nargs="+", default=None,
                    help="token grids, n or HxW (e.g. 14 28x28 14x28; default 8 14 16 28 32 64, 128x128 at C = 192 "
                         "and 384, 14x28 and 20x12 at C = 192)")
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=None, help="kernel families (default all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=common.positive_int, default=2, help="CPU threads (default 2)")
    ap.add_argument("--zero-padding", action="store_true",
                    help="also the size-independent zero-padding bound, once per layer (20-40 s each at C = 384)")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                    help="measure nothing: one report from the rows of these runs' JSON files (later files win)")
    ap.add_argument("--fresh", action="store_true", help="drop the rows already in the report's JSON")
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON",
                    help="only redraw the figure from a saved docs/data/exactness.json (its rows as measured)")
    common.add_output_arguments(ap)
    ap.set_defaults(run=run)


def main(argv=None) -> int:
    args, ap = common.parse(sys.modules[__name__], argv, prog="lipcheck exactness")
    return run(args, ap)


def run(args, ap) -> int:
    args.docs = report.docs_dir(args.docs, quick=args.quick)
    if args.replot:
        rows = load_rows(args.replot, legacy=True)
        print(report.save_figure(figure(rows), "exactness_gap", report.stamp(), docs=args.docs))
        return 0
    old = args.docs / "data" / "exactness.json"
    kept = load_rows(old) if old.exists() and not args.fresh else []
    st = report.stamp()
    if args.merge:
        rows = merge_rows(kept, *(load_rows(p) for p in args.merge))
        sel = dict(merged=[str(p) for p in args.merge])
    else:
        sel = dict(QUICK) if args.quick else {}
        sel.update({k: tuple(v) for k, v in (("widths", args.widths), ("grids", args.grids),
                                             ("families", args.families)) if v})
        common.set_threads(args.threads)
        rows = merge_rows(kept, exactness_table(seed=args.seed, progress=not args.no_progress,
                                                zero_padding=args.zero_padding, **sel))
    if not rows:
        return common.fail(ap.prog, "no rows to report: the --merge files hold none of this schema")
    report.save_figure(figure(rows), "exactness_gap", st, docs=args.docs)
    md = exactness_report.markdown(rows)
    v = verdict(rows)
    path = report.write_report("exactness", md, dict(schema=SCHEMA, rows=rows, quick=args.quick, seed=args.seed,
                                                     selection=sel), st, docs=args.docs, json_path=args.json, verdict=v)
    print(md)
    report.print_verdict(v, path)
    return 0


def verdict(rows: list[dict]) -> dict:
    """Holds when every row meets its target (and every value lies on its side); else how many miss, the loosest."""
    statement = ("lipcheck's default certification of Lip(SSoG) within 1e-4 of its certified lower bound up to 64x64 "
                 "tokens, 1e-3 at 128x128")
    if not rows:
        return report.verdict(statement, "not run", "No rows measured.")
    bad = [r for r in rows if not all(r["valid"].values())]
    miss = [r for r in rows if not r["met"]]
    worst = max(rows, key=lambda r: r["gap"] / r["target"])
    where = f"C = {worst['C']}, {worst['kernels']}, {worst['H']}x{worst['W']}"
    loosest = f"loosest: gap {worst['gap']:.2e} against target {worst['target']:.0e} ({where})"
    number = (f"All {len(rows)} rows meet their target; {loosest}." if not miss else
              f"{len(miss)} of {len(rows)} rows miss their target; {loosest}.")
    if bad:
        number += f" {len(bad)} row(s) have a value on the wrong side of another (INVALID in the table)."
    return report.verdict(statement, "fails" if bad else "partial" if miss else "holds", number)


def verdict_from(data: dict) -> dict:
    """The verdict of a finished run from its JSON (lipcheck report --verdicts)."""
    rows = data["rows"] if data.get("schema") == SCHEMA else [legacy_row(r) for r in data["rows"]]
    return verdict(rows)


if __name__ == "__main__":
    raise SystemExit(main())
