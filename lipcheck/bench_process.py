"""The benchmark's processes: every configuration in a fresh Python process (`run_config`, the worker being
`python -m lipcheck.bench`), a competing busy process for the loaded rows (`BusyProcess`, `spinners`), and what
else the machine did meanwhile (`cpu_times`, `other_load`)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

RESULT_TAG = "LIPCHECK_BENCH_RESULT "
# The timed steps' glibc malloc settings (lipcheck.bench, module docstring: CPU allocator): blocks up to 32 MB kept.
CACHING_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def _is_oom(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return isinstance(exc, MemoryError) or "out of memory" in msg or "can't allocate memory" in msg \
        or "cannot allocate memory" in msg


class BusyProcess:
    """A competing process for the loaded rows: one Python interpreter spinning on the CPU, pinned
    nowhere (the scheduler places it), started before a worker and stopped after it."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.2)  # running before the worker starts

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def cpu_times(path: str = "/proc/stat") -> dict | None:
    """The machine's CPU time so far, summed over its CPUs, in seconds: {"total", "busy", "steal"} from the
    first line of /proc/stat (busy = user + nice + system + irq + softirq; steal = time the hypervisor ran
    something else while a virtual CPU wanted to run). None where the file is absent or not in that form."""
    try:
        with open(path) as f:
            fields = f.readline().split()
        if fields[0] != "cpu" or len(fields) < 9:
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return dict(total=(user + nice + system + idle + iowait + irq + softirq + steal) / hz,
                busy=(user + nice + system + irq + softirq) / hz, steal=steal / hz)


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have been waited for (the workers, the busy process);
    0 where the platform has no `resource` module (there is no /proc/stat either, so no share is formed)."""
    try:
        import resource
    except ImportError:
        return 0.0
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                   resource.getrusage(resource.RUSAGE_CHILDREN)))


def other_load(before: dict | None, after: dict | None, own_s: float) -> dict | None:
    """What else the machine did between two `cpu_times` readings, as shares of its CPU time over the interval
    (number of CPUs x wall time): "others", CPU time of processes other than the benchmark's own (`own_s`: this
    process, its worker and its busy process), and "steal", time taken by the hypervisor. The benchmark alone
    gives 0 and 0 (up to the clock tick: /proc/stat counts in ticks of 1/100 s). None without /proc/stat."""
    if before is None or after is None:
        return None
    total = after["total"] - before["total"]
    if total <= 0:
        return None
    others = after["busy"] - before["busy"] - own_s
    return dict(others=min(1.0, max(0.0, others / total)), steal=min(1.0, max(0.0, (after["steal"] - before["steal"]) / total)),
                cpu_s=total)


def run_config(cfg: dict, *, timeout: float = 900.0, mem_limit_gb: float | None = None) -> dict:
    """Run `measure(cfg)` in a fresh Python process and return its result dict.

    mem_limit_gb caps the worker's data segment (RLIMIT_DATA, CPU only), so an oversized
    configuration fails its own allocation and is reported as "oom" instead of pushing the machine
    into swap or the OOM killer. A killed worker (SIGKILL) is also reported as "oom".
    """
    env = dict(os.environ)
    for k, val in CACHING_MALLOC_ENV.items():  # timed steps: a caching allocator (module docstring)
        env.setdefault(k, val)
    if int(cfg.get("threads", 0)) > 0:  # OpenMP reads this at start-up, before set_num_threads
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(int(cfg["threads"]))
    else:  # torch's default thread count, whatever the caller's environment pins
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.pop(k, None)
    preexec = None
    if mem_limit_gb and cfg.get("device", "cpu") == "cpu":
        limit = int(mem_limit_gb * 2**30)

        def preexec():
            import resource
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    cmd = [sys.executable, "-m", "lipcheck.bench", json.dumps(cfg)]
    t0, stat0, own0 = time.perf_counter(), cpu_times(), _own_cpu_s()
    busy = BusyProcess() if cfg.get("busy") else None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=preexec)
    except subprocess.TimeoutExpired:
        return {"config": cfg, "status": "timeout", "error": f"no result within {timeout:.0f} s",
                "wall_s": time.perf_counter() - t0}
    finally:
        if busy is not None:
            busy.stop()
    wall = time.perf_counter() - t0
    machine = other_load(stat0, cpu_times(), _own_cpu_s() - own0)  # what else ran while the worker did
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG):])
            res["wall_s"], res["machine"] = wall, machine
            return res
    tail = (proc.stderr.strip().splitlines() or [""])[-1][:300]
    if proc.returncode in (-9, 137) or _is_oom(RuntimeError(proc.stderr)):
        return {"config": cfg, "status": "oom", "error": f"worker killed or out of memory (rc {proc.returncode}): {tail}",
                "wall_s": wall, "machine": machine}
    return {"config": cfg, "status": "error", "error": f"worker exited {proc.returncode}: {tail}", "wall_s": wall,
            "machine": machine}


@contextlib.contextmanager
def spinners(k: int):
    """k CPU-bound competing processes (`while True: pass`) running for the block: a busy machine, made on purpose."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]
    try:
        time.sleep(0.5 if k else 0.0)  # running before the timing starts
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
