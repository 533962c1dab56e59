"""What a busy machine costs: the README's main job and `wellposed.enclose` on the tiny model, each timed in a
fresh process on the machine as it is ("quiet") and with one CPU-bound competing process per core ("busy").

    python experiments/busy_machine.py [--quick] [--json PATH]

Both run as a user runs them: the main job as `python experiments/divergence.py` (its default --threads 1), the
enclosure as a plain library call with torch's default thread count. --quick: the main job's --quick mode.
Prints one row per workload and load, and the busy / quiet ratio.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a checkout runs without installing

from lipcheck.bench import spinners  # noqa: E402

ENCLOSE = """
import torch, lipcheck
from lipcheck import wellposed
torch.manual_seed(0)
model = lipcheck.vit_from_preset("tiny", "ode", "ssog", dtype=torch.float64)
images = torch.randn(2, 3, model.img_size, model.img_size, dtype=torch.float64)
enc = wellposed.enclose(model, images, tol=1e-6, progress=False)
print("proven", enc.proven.tolist(), "torch threads", torch.get_num_threads())
"""


def workloads(quick: bool, docs: str) -> dict:
    main = [sys.executable, str(ROOT / "experiments" / "divergence.py"), "--docs", docs, "--no-progress"]
    return {"main job (experiments/divergence.py" + (" --quick)" if quick else ")"): main + (["--quick"] if quick else []),
            "enclose, tiny model, 2 images (library call)": [sys.executable, "-c", ENCLOSE]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the main job's --quick mode")
    ap.add_argument("--only", choices=("main", "enclose"), help="time one of the two workloads")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rows = []
    with tempfile.TemporaryDirectory() as docs:
        for name, cmd in workloads(a.quick, docs).items():
            if a.only and not name.startswith({"main": "main", "enclose": "enclose"}[a.only]):
                continue
            secs = {}
            for load, k in (("quiet", 0), ("busy", cores)):
                with spinners(k):
                    t0 = time.perf_counter()
                    proc = subprocess.run(cmd, cwd=docs, env=env, capture_output=True, text=True)
                    secs[load] = time.perf_counter() - t0
                if proc.returncode != 0:
                    raise SystemExit(f"{name} failed ({load}):\n{proc.stderr[-3000:]}")
                print(f"{name:50s} {load:5s} {secs[load]:8.1f} s", flush=True)
            rows.append({"workload": name, "quiet_s": secs["quiet"], "busy_s": secs["busy"],
                         "ratio": secs["busy"] / secs["quiet"], "spinners": cores})
            print(f"{name:50s} busy / quiet = {rows[-1]['ratio']:.2f}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
