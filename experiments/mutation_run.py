"""The mutmut driver of experiments/mutation.py: a scratch copy of lipcheck/ and tests/ per module group with its
own [tool.mutmut] table, mutmut's own mutant generator, the run, and the statuses and diffs it left."""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _section_without_mutmut(text: str) -> str:
    """pyproject text with any [tool.mutmut] table removed (it is rewritten per group)."""
    out, skip = [], False
    for line in text.splitlines():
        if line.strip().startswith("["):
            skip = line.strip() == "[tool.mutmut]"
        if not skip:
            out.append(line)
    return "\n".join(out) + "\n"


def _toml_list(xs):
    return "[" + ", ".join(json.dumps(x) for x in xs) + "]"


def prepare(group: str, modules, tests, k_expr, args) -> Path:
    """A fresh scratch copy with a [tool.mutmut] table for this group only."""
    work = ROOT / "build" / "mutation" / group
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    shutil.copytree(ROOT / "lipcheck", work / "lipcheck", ignore=ignore)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=ignore)
    base = tomllib_load(ROOT / "pyproject.toml").get("tool", {}).get("mutmut", {})
    tests = [t for t in tests if (ROOT / t).exists()]
    if not tests:
        raise SystemExit(f"group {group}: none of its test files exist; edit GROUPS in experiments/mutation.py")
    selection = list(tests) + (["-k", k_expr] if k_expr else [])
    cli = list(base.get("pytest_add_cli_args", ["-p", "no:cacheprovider", "-x", "-q"]))
    conf = (f"\n[tool.mutmut]\nsource_paths = [\"lipcheck/\"]\nonly_mutate = {_toml_list(modules)}\n"
            f"pytest_add_cli_args = {_toml_list(cli)}\n"
            f"pytest_add_cli_args_test_selection = {_toml_list(selection)}\n"
            f"do_not_mutate_patterns = {_toml_list(base.get('do_not_mutate_patterns', []))}\n"
            f"process_isolation = \"{base.get('process_isolation', 'forkserver')}\"\n"
            f"timeout_multiplier = {float(args.timeout_multiplier)}\ntimeout_constant = {float(args.timeout_constant)}\n")
    (work / "pyproject.toml").write_text(_section_without_mutmut((ROOT / "pyproject.toml").read_text()) + conf)
    return work


def tomllib_load(path: Path) -> dict:
    import tomllib
    return tomllib.loads(path.read_text())


def _env():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the scratch copy is what gets imported
    env.update(HYPOTHESIS_PROFILE="mutation", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


GENERATE = ("from mutmut.__main__ import copy_src_dir, copy_also_copy_files, create_mutants\n"
            "from mutmut.mutation.data import SourceFileMutationData\n"
            "from mutmut.utils.file_utils import walk_mutatable_files\n"
            "import json, os\n"
            "os.makedirs('mutants', exist_ok=True); copy_src_dir(); copy_also_copy_files(); create_mutants(1)\n"
            "names = []\n"
            "for p in walk_mutatable_files():\n"
            "    m = SourceFileMutationData(path=p); m.load(); names += sorted(m.exit_code_by_key)\n"
            "print(json.dumps(names))\n")


def generate(work: Path) -> list[str]:
    """The group's mutant names, from mutmut's own generator (no tests run)."""
    out = subprocess.run([sys.executable, "-c", GENERATE], cwd=work, env=_env(), capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"mutant generation failed in {work}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_group(work: Path, args, names: list[str]) -> tuple[float, int, str]:
    t0 = time.time()
    proc = subprocess.run(["mutmut", "run", "--max-children", str(args.max_children), *names], cwd=work, env=_env(),
                          capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).replace("\r", "\n").strip().splitlines()[-5:]
    return time.time() - t0, proc.returncode, "\n".join(tail)


def collect(work: Path, modules, picked: set) -> list[dict]:
    """The picked mutants of the group's modules: name, function, status, diff (for the ones not killed)."""
    from mutmut.stats import status_by_exit_code
    rows = []
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        rel = meta.relative_to(work / "mutants").as_posix()[:-len(".meta")]
        if not any(fnmatch.fnmatch(rel, m) for m in modules):
            continue
        data = json.loads(meta.read_text())
        for key, code in sorted(data["exit_code_by_key"].items()):
            if key not in picked:
                continue
            status = status_by_exit_code[code]
            func = re.sub(r"__mutmut_\d+$", "", key.rsplit(".", 1)[-1]).removeprefix("x_").replace("ǁ", ".")
            row = dict(module=rel, mutant=key, function=func, status=status)
            if status not in ("killed", "timeout", "segfault"):
                show = subprocess.run(["mutmut", "show", key], cwd=work, capture_output=True, text=True)
                row["diff"] = "\n".join(ln for ln in show.stdout.splitlines()
                                        if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---")))
            rows.append(row)
    return rows
