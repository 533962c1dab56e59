"""The default certification on held-out random layers against an independent exact norm.

For each layer (random Gaussian parameters: alpha ~ N(0, 1), mu ~ 2 N(0, 1), sigma = softplus(N(0, 1)) + the
layer's floor, v_proj / o_proj ~ N(0, 1/C), a random output bias): `ssog_lipschitz(layer, H, W)` with no options,
timed, against ||T||_2 from ARPACK (scipy.sparse.linalg.svds) on a LinearOperator built from the layer's own forward
pass minus its bias (float64; the adjoint by autograd), which shares no code with lipcheck's bounds.

    python experiments/heldout_default.py [--json PATH] [--large]

--large also times the default at 14x14 C=768 (12 heads) and 64x64 C=192 (3 heads), where the size rule falls back
from the deflated bound (no exact value there).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch

import lipcheck
from lipcheck.bounds import ssog_lipschitz

# (H, W, C, heads, components, seed): square and non-square grids of 12-24 tokens a side, widths up to 128
LAYERS = [(16, 16, 96, 3, 4, 101), (24, 24, 48, 3, 4, 102), (20, 12, 128, 4, 4, 103), (14, 18, 64, 4, 3, 104),
          (12, 12, 128, 8, 4, 105), (18, 22, 32, 2, 6, 106), (24, 16, 96, 6, 4, 107)]
LARGE = [(14, 14, 768, 12, 4, 201), (64, 64, 192, 3, 4, 202)]


def random_layer(C: int, heads: int, M: int, seed: int) -> lipcheck.SSoG:
    g = torch.Generator().manual_seed(seed)
    layer = lipcheck.SSoG(C, heads, M, dtype=torch.float64)
    with torch.no_grad():
        layer.alpha.copy_(torch.randn(heads, M, generator=g, dtype=torch.float64))
        layer.mu.copy_(2 * torch.randn(heads, M, 2, generator=g, dtype=torch.float64))
        layer.sigma_raw.copy_(torch.randn(heads, M, 2, generator=g, dtype=torch.float64))
        layer.v_proj.weight.copy_(torch.randn(C, C, generator=g, dtype=torch.float64) / math.sqrt(C))
        layer.o_proj.weight.copy_(torch.randn(C, C, generator=g, dtype=torch.float64) / math.sqrt(C))
        layer.o_proj.bias.copy_(torch.randn(C, generator=g, dtype=torch.float64))
    return layer.eval()


def arpack_norm(layer, H: int, W: int) -> float:
    """||T||_2 by ARPACK on x -> layer(x) - layer(0) and its adjoint (autograd), float64."""
    from scipy.sparse.linalg import LinearOperator, svds
    C = layer.v_proj.in_features
    n = H * W * C
    with torch.no_grad():
        b = layer(torch.zeros(1, H, W, C, dtype=torch.float64))

    def f(x):
        return layer(x) - b

    def mv(v):
        with torch.no_grad():
            x = torch.as_tensor(np.ascontiguousarray(v), dtype=torch.float64).reshape(1, H, W, C)
            return f(x).reshape(-1).numpy()

    def rmv(v):
        y = torch.as_tensor(np.ascontiguousarray(v), dtype=torch.float64).reshape(1, H, W, C)
        _, pull = torch.func.vjp(f, torch.zeros(1, H, W, C, dtype=torch.float64))
        return pull(y)[0].reshape(-1).detach().numpy()

    op = LinearOperator((n, n), matvec=lambda v: mv(v.ravel()), rmatvec=lambda v: rmv(v.ravel()),
                        dtype=np.float64)
    s = svds(op, k=1, which="LM", tol=1e-13, return_singular_vectors=False,
             v0=np.ones(n) + 0.01 * np.sin(np.arange(n)))
    return float(s[0])


def _load() -> float | None:
    """The machine's 1-minute load average (other work slows every timing here), where the platform has one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def run(rows, with_exact: bool = True) -> list[dict]:
    out = []
    for H, W, C, heads, M, seed in rows:
        layer = random_layer(C, heads, M, seed)
        t = time.perf_counter()
        r = ssog_lipschitz(layer, H, W)
        sec = time.perf_counter() - t
        row = dict(grid=f"{H}x{W}", C=C, heads=heads, M=M, seed=seed, lower=r.lower, upper=r.upper, gap=r.gap,
                   method=r.best_method, seconds=sec, rule=r.budget["rule"], cut_short=r.cut_short,
                   stages={k: round(v, 2) for k, v in r.seconds.items()}, load=_load())
        if with_exact:
            t = time.perf_counter()
            ex = arpack_norm(layer, H, W)
            row.update(exact=ex, upper_over_exact=r.upper / ex - 1, lower_under_exact=1 - r.lower / ex,
                       arpack_seconds=time.perf_counter() - t)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def table(rows) -> str:
    lines = ["| layer | grid | C | heads | default upper / ARPACK - 1 | certified gap upper/lower - 1 | seconds | "
             "load | method |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        ue = f"{r['upper_over_exact']:.2e}" if "exact" in r else "n/a"
        lines.append(f"| {i + 1} (seed {r['seed']}) | {r['grid']} | {r['C']} | {r['heads']} | {ue} | {r['gap']:.2e} | "
                     f"{r['seconds']:.1f} | {'' if r['load'] is None else round(r['load'], 1)} | {r['method']} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows to this path")
    ap.add_argument("--large", action="store_true", help="also time the default at 14x14 C=768 and 64x64 C=192")
    a = ap.parse_args(argv)
    rows = run(LAYERS)
    if a.large:
        rows += run(LARGE, with_exact=False)
    print(table(rows))
    bad = [r for r in rows if "exact" in r and not (r["lower"] <= r["exact"] * (1 + 1e-12)
                                                    and r["exact"] <= r["upper"] * (1 + 1e-12))]
    if bad:
        raise SystemExit(f"INVALID: a bound on the wrong side of ARPACK's value: {bad}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(rows=rows, torch=torch.__version__, threads=torch.get_num_threads()), fh, indent=1)


if __name__ == "__main__":
    main()
