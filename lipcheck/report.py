"""Stamped, atomic report writing: docs/<name>.md, docs/figures/*.png, docs/data/<name>.json.

Every report and figure carries the command that made it, the commit, versions, device and date,
so a reader can regenerate it. Writes go to a temporary file first and are renamed into place, so
an interrupted run never leaves a half-written report.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

from .files import atomic_write  # noqa: F401  (reports write through it; it lives below every layer)

ROOT = Path(__file__).resolve().parents[1]
# Inside a source checkout the reports live in its docs/; an installed package has no docs/ of its own.
CHECKOUT = ROOT if (ROOT / "pyproject.toml").is_file() and (ROOT / "docs").is_dir() else None
DOCS = ROOT / "docs"
INSTALLED_DOCS = "lipcheck-reports"  # where an installed lipcheck writes, relative to the working directory
QUICK = "quick"  # quick runs write to this subdirectory of the default docs, never over a full-run report


def docs_dir(docs=None, *, quick: bool = False, checkpoint=None) -> Path:
    """Where a command writes its report. --docs when given; else a checkpoint's RUN/verdicts/; else the
    checkout's docs/ (an installed lipcheck: ./lipcheck-reports/). A quick run goes to <that>/quick/, also when
    --docs names the checkout's docs/: a full-run report is never overwritten by a reduced one."""
    if docs is not None:
        docs = Path(docs)
        if quick and CHECKOUT is not None and docs.resolve() == DOCS.resolve():
            return DOCS / QUICK
        return docs
    if checkpoint is not None:  # the run directory, or the directory of the checkpoint file named
        run = Path(checkpoint)
        return (run if run.is_dir() else run.parent) / "verdicts"
    base = DOCS if CHECKOUT is not None else Path.cwd() / INSTALLED_DOCS
    return base / QUICK if quick else base


STATUSES = ("holds", "fails", "vacuous", "partial", "not run")


def verdict(statement: str, status: str, number: str, command: str | None = None) -> dict:
    """What a report says first: the statement, holds / fails / vacuous / partial, the one number that says how
    well, and the command that reproduces it (default: this process's command line)."""
    if status not in STATUSES:
        raise ValueError(f"verdict status must be one of {STATUSES}, got {status!r}")
    return {"statement": statement, "status": status, "number": number,
            "command": command or stamp()["command"]}


def verdict_lines(v: dict) -> list[str]:
    """At most six lines: statement and status, the number, the command."""
    return [f"**Verdict: {v['statement']}: {v['status'].upper()}.**", f"{v['number']}",
            f"Reproduce: `{v['command']}`"]


def print_verdict(v: dict, path=None) -> None:
    """A command's last output: where the report went, then the verdict."""
    if path is not None:
        print(f"wrote {path}")
    print("\n".join(ln.replace("**", "").replace("`", "") for ln in verdict_lines(v)), flush=True)


def git_commit() -> str:
    """Short HEAD hash, "+dirty" when a tracked file outside docs/ differs from it. Reports that an
    earlier run rewrote in docs/ say nothing about the code that makes the next one."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        return (out.stdout.strip() or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device=None) -> str:
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


_COMMAND = None  # the command line `lipcheck` was given, when it runs a command in this process (cli.main)


def set_command(argv) -> None:
    """Name the reports of what runs next after `lipcheck` and argv (None: back to this process's sys.argv)."""
    global _COMMAND
    _COMMAND = None if argv is None else " ".join(["lipcheck"] + [shlex.quote(str(a)) for a in argv])


def stamp(command: str | None = None, device=None) -> dict:
    """Who made this and how: command, commit, versions, device, date (UTC)."""
    command = command or _COMMAND
    if command is None:
        prog = sys.argv[0] if sys.argv else ""
        # an installed console script (`lipcheck probe`) is named as the user typed it, not by its absolute path
        if prog and not prog.endswith(".py") and os.path.basename(prog) == "lipcheck":
            command = " ".join(["lipcheck"] + [shlex.quote(a) for a in sys.argv[1:]])
        else:
            command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    return {
        "command": command,
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def stamp_markdown(st: dict) -> str:
    return (f"_Generated by `{st['command']}` at commit `{st['commit']}`, torch {st['torch']}, "
            f"python {st['python']}, on {st['device']}, {st['date']}._\n")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if torch.is_tensor(x):
        return _jsonable(x.detach().cpu().tolist())
    if hasattr(x, "item") and hasattr(x, "dtype"):  # numpy scalars
        return _jsonable(x.item())
    if hasattr(x, "tolist"):
        return _jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON has no inf/nan; keep them readable
    return x


def write_json(path: Path, data: dict) -> Path:
    return atomic_write(path, json.dumps(_jsonable(data), indent=1) + "\n")


def save_figure(fig, name: str, st: dict, docs: Path | None = None) -> Path:
    """Save a matplotlib figure to docs/figures/<name>.png with the stamp in its footer."""
    docs = Path(docs) if docs else docs_dir()
    # Hung below the figure's bottom edge (va="top" at y = 0): bbox_inches="tight" widens the saved area
    # to include it, so the stamp can never overlap an axis label. Wrapped to the figure's width (about 22
    # characters per inch at 5 pt): a long command (a --merge of many files) would otherwise widen the saved image
    # until the plots are a strip.
    text = f"{st['command']} | {st['commit']} | torch {st['torch']} | {st['device']} | {st['date']}"
    fig.text(0.005, -0.005, textwrap.fill(text, width=max(60, int(fig.get_figwidth() * 22)), break_on_hyphens=False),
             fontsize=5, color="0.4", ha="left", va="top")
    path = docs / "figures" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=130, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def write_report(name: str, markdown: str, data: dict, st: dict, docs: Path | None = None,
                 json_path: Path | None = None, verdict: dict | None = None, index: bool = True) -> Path:
    """docs/<name>.md (the verdict, then the stamp, on top) and docs/data/<name>.json ({'stamp': ...,
    'verdict': ..., **data}); optional extra JSON copy."""
    docs = Path(docs) if docs else docs_dir()
    payload = {"stamp": st, **({"verdict": verdict} if verdict else {}), **data}
    write_json(docs / "data" / f"{name}.json", payload)
    if json_path is not None:
        write_json(Path(json_path), payload)
    head = "\n".join(verdict_lines(verdict)) + "\n\n" if verdict else ""
    path = atomic_write(docs / f"{name}.md", head + stamp_markdown(st) + "\n" + markdown.rstrip() + "\n")
    if index:
        write_index(docs)
    return path


def put_verdict(name: str, v: dict, docs: Path | None = None) -> Path:
    """Put verdict v on top of an existing docs/<name>.md (replacing the one there) and into its JSON, without
    rerunning: the verdict of the numbers that run measured, its command the one that made them."""
    docs = Path(docs) if docs else docs_dir()
    md = (docs / f"{name}.md").read_text().splitlines()
    start = next((i for i, ln in enumerate(md) if ln.startswith("_Generated by")), 0)
    path = atomic_write(docs / f"{name}.md", "\n".join(verdict_lines(v) + [""] + md[start:]) + "\n")
    jpath = docs / "data" / f"{name}.json"
    data = json.loads(jpath.read_text())
    write_json(jpath, {"stamp": data.pop("stamp", None), "verdict": v, **{k: x for k, x in data.items() if k != "verdict"}})
    return path


def md_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


# The reports docs/ can hold, in reading order: name -> what it shows (one line for docs/index.md).
REPORTS = {
    "claims": "Every report's verdict in one table: the statement, holds / fails / partial, how well, the command.",
    "architecture": "How the code is laid out, and where each statement S1-S5 lives.",
    "divergence": "Picard-Lindelof checked on the SSoG Neural-ODE ViT: solvers and tolerances converge to one "
                  "trajectory, perturbations stay inside the Gronwall envelope, dense attention contrasted (S5).",
    "divergence_ti": "The proven enclosure of the full-size ODE ViT (preset ti, 224x224, one image): radius, time, "
                     "or the check that failed and where (`experiments/divergence.py --enclosure-only --preset ti`).",
    "lipschitz": "Certified two-sided Lipschitz bounds for fixed-kernel SSoG at every grid size, the resolution-free "
                 "bound, and the block / vector-field constants (S1-S3).",
    "exactness": "The default certification at every grid and width a ViT uses: certified lower and upper bounds on "
                 "Lip(SSoG), their gap against a target, seconds, beside the circulant embedding and the exact norm.",
    "attention_growth": "Certified lower bounds showing dense attention's local Lipschitz constant grows like R^2, "
                        "against SSoG's flat constant (S4).",
    "throughput": "Throughput and peak memory of SSoG vs dense attention up to 1024x1024, with multiply-add ratios.",
    "training": "Matched SSoG vs attention training on scikit-learn digits, beside the paper's CIFAR-100 numbers.",
    "trained": "The three verdicts (S1-S5) on models trained by `lipcheck train`, beside the same architecture at init.",
    "mutation": "Mutation testing of the certified code: mutants per module, the share the tests detect, and why "
                "each survivor survives.",
    "assumptions": "Where lipcheck fixes what the paper leaves open, and where it departs from the spec.",
}


def write_index(docs: Path | None = None) -> Path:
    docs = Path(docs) if docs else docs_dir()
    lines = ["# lipcheck reports", "", "Regenerate all of them with `lipcheck report`.", ""]
    for name, what in REPORTS.items():
        if (docs / f"{name}.md").exists():
            lines.append(f"- [{name}]({name}.md): {what}")
    return atomic_write(docs / "index.md", "\n".join(lines) + "\n")
