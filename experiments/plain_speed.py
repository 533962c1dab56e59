"""The speed a user gets: the SSoG mixer against fused SDPA in plain `python` processes (glibc malloc as shipped),
next to processes whose allocator is tuned as the benchmark's workers tune it (lipcheck/bench.py: blocks up to
32 MB kept, nothing trimmed; here set with mallopt at start-up), one thread, inference (torch.no_grad, frozen
kernels), batch 1 unless stated.

Each variant runs in its own worker process, so that its heap is shaped by its own calls only (a plain process that
also runs SDPA serves SSoG's temporaries from a heap SDPA grew, which a user's SSoG-only process does not have). The
workers take turns, block by block, for many rounds, so that every variant sees the same machine load; the table
gives medians over rounds, the per-round paired ratios' medians, and minor page faults per forward
(getrusage). "SSoG before" is the library with its reused inference buffers switched off
(workspace.WORKSPACE_MAX_BYTES = 0). Whether a plain process pays for fresh pages depends on where its heap's small
blocks happen to lie (glibc trims the free top of the heap only when nothing lives above it), which differs from
one process to the next: --sets N measures N fresh sets of workers per configuration.

    python experiments/plain_speed.py            # 64x64 C=384, 64x64 C=192, 14x14 C=192 at batch 1 and 32
    python experiments/plain_speed.py --quick    # fewer rounds, 64x64 C=384 and 14x14 C=192 only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = [(64, 384, 6, 1), (64, 192, 3, 1), (14, 192, 3, 1), (14, 192, 3, 32)]  # grid, C, heads, batch
QUICK_CONFIGS = [(64, 384, 6, 1), (14, 192, 3, 1)]
VARIANTS = [("ssog", "before"), ("ssog", "after"), ("sdpa", None)]


def worker(spec: dict) -> None:
    """One mixer in this process; on each input line n, run n forwards and print (seconds, minor faults)."""
    import ctypes
    import resource

    import torch
    from lipcheck.mixers import DenseAttention, SSoG, workspace

    if spec["tuned"]:  # bench.py's CACHING_MALLOC_ENV, applied at run time (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)
        libc = ctypes.CDLL("libc.so.6")
        assert libc.mallopt(-3, 32 << 20) == 1 and libc.mallopt(-1, 2**31 - 1) == 1
    if spec["variant"] == "before":
        workspace.WORKSPACE_MAX_BYTES = 0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g, C, h, B = spec["grid"], spec["dim"], spec["heads"], spec["batch"]
    if spec["mixer"] == "ssog":
        m = SSoG(C, h, 4, backend="auto").freeze_kernels()
        m.thread_policy = None  # one thread: nothing to choose
    else:
        m = DenseAttention(C, h, backend="sdpa")
    m.eval()
    x = torch.randn(B, g, g, C)
    with torch.no_grad():
        for _ in range(3):
            m(x)
        print("ready", flush=True)
        for line in sys.stdin:
            n = int(line)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            for _ in range(n):
                m(x)
            dt = time.perf_counter() - t0
            print(json.dumps([dt / n, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / n]), flush=True)


def measure(config, rounds: int, block_s: float) -> dict:
    """{(mixer, variant, tuned): ([ms per round], [faults per forward per round])} for one configuration."""
    g, C, h, B = config
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # plain: no allocator tuning
    procs = {}
    for tuned in (False, True):
        for mixer, variant in VARIANTS:
            spec = dict(grid=g, dim=C, heads=h, batch=B, mixer=mixer, variant=variant, tuned=tuned)
            procs[(mixer, variant, tuned)] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        for p in procs.values():
            assert p.stdout.readline().strip() == "ready"

        def run(p, n):
            p.stdin.write(f"{n}\n")
            p.stdin.flush()
            return json.loads(p.stdout.readline())

        # forwards per block: about block_s of work for each variant
        reps = {k: max(1, round(block_s / run(p, 1)[0])) for k, p in procs.items()}
        out = {k: ([], []) for k in procs}
        keys = list(procs)
        for r in range(rounds):
            for k in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotate the order between rounds
                sec, flt = run(procs[k], reps[k])
                out[k][0].append(sec * 1e3)
                out[k][1].append(flt)
        return out
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait()


def summarise(config, res) -> list[list[str]]:
    med = statistics.median
    rows = []
    for tuned in (False, True):
        sdpa, plain_sdpa = res[("sdpa", None, tuned)], res[("sdpa", None, False)]
        for variant in ("before", "after"):
            s = res[("ssog", variant, tuned)]
            plain = res[("ssog", variant, False)]
            rows.append([f"{config[0]}x{config[0]}", str(config[1]), str(config[3]), "tuned" if tuned else "plain",
                         variant, f"{med(s[0]):.2f}", f"{med(s[1]):.0f}", f"{med(sdpa[0]):.2f}", f"{med(sdpa[1]):.0f}",
                         f"{med(a / b for a, b in zip(sdpa[0], s[0])):.2f}",
                         "" if not tuned else f"{med(a / b for a, b in zip(plain[0], s[0])):.2f}",
                         "" if not tuned else f"{med(a / b for a, b in zip(plain_sdpa[0], sdpa[0])):.2f}"])
        if not tuned:  # after / before, paired per round, plain processes
            b, a = res[("ssog", "before", False)], res[("ssog", "after", False)]
            rows[-1].append(f"{med(x / y for x, y in zip(b[0], a[0])):.2f}")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="5 rounds, 64x64 C=384 and 14x14 C=192 only")
    p.add_argument("--rounds", type=int, help="rounds per configuration (default 15, quick 5)")
    p.add_argument("--block-s", type=float, default=0.25, help="seconds of forwards per block (default 0.25)")
    p.add_argument("--sets", type=int, default=1, help="fresh sets of worker processes per configuration (default 1)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    rounds = args.rounds or (5 if args.quick else 15)
    head = ["grid", "C", "B", "malloc", "SSoG", "SSoG ms", "SSoG faults", "SDPA ms", "SDPA faults", "x vs SDPA",
            "SSoG plain/tuned", "SDPA plain/tuned", "before/after"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for config in (QUICK_CONFIGS if args.quick else CONFIGS):
        for _ in range(args.sets):
            for row in summarise(config, measure(config, rounds, args.block_s)):
                print("| " + " | ".join(row + [""] * (len(head) - len(row))) + " |", flush=True)
    print(f"\none thread, inference, medians over {rounds} rounds of workers taking turns; faults: minor page faults "
          "per forward; x vs SDPA, plain/tuned (a mixer's time in the plain process over the tuned one) and "
          "before/after (SSoG, plain processes): medians of the ratios paired per round")


if __name__ == "__main__":
    main()
