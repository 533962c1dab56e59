"""Cholesky checks on a busy machine, with scipy's BLAS limited to lipcheck's thread count and without.

Times `rounding.cholesky_certifies` (one scipy dpotrf per call) and `rounding.norm2_upper` (Gram matrix, torch's
eigvalsh, then the same check) on a 768 x 768 matrix, `--repeats` calls each, with torch on `--threads` threads:

- limited: as lipcheck runs (lipcheck.threads.limited around the scipy call: its OpenBLAS on torch's count);
- unlimited: the same calls with that limit taken out, so scipy's OpenBLAS keeps its own pool (one per core);

each on the machine as it is ("quiet") and with one CPU-bound competing process per core ("busy"), started before
and killed after. Each row also gives what else ran meanwhile (bench.other_load: share of the machine's CPU time
taken by processes other than this one: in the busy rows the spinners too). `python experiments/threads_busy.py [--json OUT]`.
"""
import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout runs without installing

import torch  # noqa: E402

from lipcheck import bench, rounding, threads  # noqa: E402
from lipcheck.bench import spinners  # noqa: E402


def spd(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    B = torch.randn(n, n, generator=g, dtype=torch.float64)
    return B @ B.T / n + torch.eye(n, dtype=torch.float64)


def timed(fn, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return time.perf_counter() - t0


def run(n: int, repeats: int, torch_threads: int) -> list[dict]:
    S = spd(n)
    lam = float(torch.linalg.eigvalsh(S)[-1])
    mu = torch.tensor(lam * (1 + 1e-6), dtype=torch.float64)
    M = torch.linalg.cholesky(S).T.contiguous()  # ||M||_2^2 = lambda_max(S)
    assert bool(rounding.cholesky_certifies(S.clone(), mu)[0])
    jobs = {"cholesky_certifies": lambda: rounding.cholesky_certifies(S.clone(), mu),
            "norm2_upper": lambda: rounding.norm2_upper(M)}
    cores = os.cpu_count() or 1
    rows = []
    real_limited = rounding.limited
    torch.set_num_threads(torch_threads)
    for load in ("quiet", "busy"):
        with spinners(cores if load == "busy" else 0):
            for mode in ("limited", "unlimited"):
                rounding.limited = real_limited if mode == "limited" else (lambda n=None: contextlib.nullcontext())
                try:
                    for name, fn in jobs.items():
                        fn()  # warm-up (first scipy call, thread start)
                        before, own0 = bench.cpu_times(), bench._own_cpu_s()
                        wall = timed(fn, repeats)
                        other = bench.other_load(before, bench.cpu_times(), bench._own_cpu_s() - own0)
                        rows.append(dict(load=load, mode=mode, call=name, repeats=repeats, n=n, seconds=wall,
                                         torch_threads=torch.get_num_threads(),
                                         blas_threads_in_call=blas_in_call(mode),
                                         spinners=cores if load == "busy" else 0,
                                         other_load=None if other is None else round(other["others"], 3)))
                        print(f"{load:5s} {mode:9s} {name:18s} {repeats} x n={n}: {wall:7.2f} s"
                              f"  (scipy BLAS threads {rows[-1]['blas_threads_in_call']}, other load "
                              f"{rows[-1]['other_load']})", flush=True)
                finally:
                    rounding.limited = real_limited
    return rows


def blas_in_call(mode: str) -> int:
    """The scipy OpenBLAS pool size a call gets in that mode (read inside the block, as the call would see it)."""
    ctx = threads.limited() if mode == "limited" else contextlib.nullcontext()
    with ctx:
        return max(threads.blas_threads().values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch's thread count (what lipcheck was given)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    rows = run(a.n, a.repeats, a.threads)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
