"""Mutation testing of the certified code: do the tests tell a lying bound from a true one?

    python experiments/mutation.py [--modules attention,network,...] [--max-children 2]
                                   [--timeout-multiplier 4] [--timeout-constant 10] [--docs DIR]

Runs mutmut (pyproject [tool.mutmut]) once per module group on a fresh scratch copy of lipcheck/ and
tests/ under build/mutation/<group>/, each group against its own fast test files (GROUPS below), with
the "mutation" hypothesis profile (derandomised, no shrinking) and a per-mutant CPU-time limit of
2 * timeout_multiplier * (the mutant's tests' clean duration + timeout_constant) seconds. Nothing here
knows line numbers or mutant ids: mutants are regenerated from the code as it is, and every survivor
is matched against SURVIVOR_REASONS by function name and the mutated text. Not part of the default
pytest run. Writes docs/mutation.md and docs/data/mutation.json.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lipcheck import report  # noqa: E402

# group -> (modules to mutate (fnmatch on paths under lipcheck/), test files, pytest -k expression or None).
# Only fast tests: mutmut runs, for each mutant, just the selected tests that call the mutated function.
GROUPS = {
    "attention": (["lipcheck/bounds/attention.py"],
                  ["tests/test_attention_bounds.py", "tests/test_probe.py"],
                  "not growth_ti and not probe_values_equal and not jacobian_formula"),
    "network": (["lipcheck/bounds/network.py"], ["tests/test_network_bounds.py", "tests/test_bounds.py"],
                "network or vector_field or mixer or mlp or min_token"),
    "gaussian": (["lipcheck/gaussian.py"], ["tests/test_gaussian.py"], None),
    "spectral": (["lipcheck/bounds/spectral.py"], ["tests/test_bounds.py"], "not default_settings_close"),
    "wellposed": (["lipcheck/wellposed*"], ["tests/test_wellposed.py"], None),
}

# Why a surviving mutant survives: (module glob, function-name regex, regex on the mutated line(s) of the
# diff, reason). A reason says either that the mutant is equivalent (no input distinguishes it), or that
# the change only loosens a bound in a way no true-bound test can see. Anything unmatched is reported as
# "unexplained" and counts against the suite.
SURVIVOR_REASONS = [
    ("lipcheck/bounds/attention.py", r"head_matrices", r"dtype=|device=",
     "equivalent: the dtype/device are the caller's, and the float64 default equals what every caller passes"),
    ("lipcheck/bounds/attention.py", r"_check_args", r"rho >= 0|rho > 0",
     "equivalent: rho = 0 and rho > 0 take the same path (a zero radius is legal and finite)"),
    ("lipcheck/bounds/network.py", r"mixer_lipschitz", r"rtol",
     "equivalent: rtol only sets how tight the SSoG resolution-free bound is; every value stays an upper bound"),
    ("lipcheck/bounds/network.py", r"vector_field_lipschitz", r"rtol",
     "equivalent: rtol only sets how tight the SSoG resolution-free bound is; every value stays an upper bound"),
    ("lipcheck/bounds/network.py", r"_ln_constants", r"up = 1 \+ 8 \* torch\.finfo|up = 1 \+ 9",
     "loosens a rounding margin by a few ulp: still an upper bound, no test of a true bound can see it"),
    ("lipcheck/bounds/attention.py", r"_round_up|_frobenius_upper|_spectral_upper|_head_norms|layernorm_",
     r"gamma\(|SVD_CONSTANT|_ASSEMBLY_OPS|\+ 4\b|\+ 5\b|\+ 3\b|\+ 2\b|\+ 1\b",
     "changes a rounding margin by O(u) (1e-16 relative): invisible to any test whose reference is computed in "
     "the same precision; the margins themselves are derived in proofs/S4.md"),
    ("lipcheck/bounds/attention.py", r"attention_block_lipschitz", r"up = 1 \+|\* up",
     "changes a float64 rounding margin of O(u): invisible to a float64 reference, derived in proofs/S4.md"),
]


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
        raise SystemExit(f"group {group}: none of its test files exist; edit GROUPS in {__file__}")
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


def collect(work: Path, modules) -> list[dict]:
    """Every mutant of the group's modules: name, function, status, diff (for the ones not killed)."""
    from mutmut.stats import status_by_exit_code
    rows = []
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        rel = meta.relative_to(work / "mutants").as_posix()[:-len(".meta")]
        if not any(fnmatch.fnmatch(rel, m) for m in modules):
            continue
        data = json.loads(meta.read_text())
        for key, code in sorted(data["exit_code_by_key"].items()):
            status = status_by_exit_code[code]
            func = re.sub(r"__mutmut_\d+$", "", key.rsplit(".", 1)[-1]).removeprefix("x_").replace("ǁ", ".")
            row = dict(module=rel, mutant=key, function=func, status=status)
            if status not in ("killed", "timeout", "segfault"):
                show = subprocess.run(["mutmut", "show", key], cwd=work, capture_output=True, text=True)
                row["diff"] = "\n".join(ln for ln in show.stdout.splitlines()
                                        if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---")))
            rows.append(row)
    return rows


def reason_for(row: dict) -> str:
    if row["status"] == "no tests":
        return "unexplained: no selected test calls this function"
    added = "\n".join(ln for ln in row.get("diff", "").splitlines() if ln.startswith(("+", "-")))
    for mod, func, pat, why in SURVIVOR_REASONS:
        if fnmatch.fnmatch(row["module"], mod) and re.search(func, row["function"]) and re.search(pat, added):
            return why
    return "unexplained: needs a test"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", default=",".join(GROUPS), help=f"comma-separated groups from {list(GROUPS)}")
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--timeout-multiplier", type=float, default=4.0)
    ap.add_argument("--timeout-constant", type=float, default=10.0)
    ap.add_argument("--max-mutants", type=int, default=100,
                    help="per group: run a seeded random sample of this many mutants (0: all of them)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the mutant sample")
    ap.add_argument("--docs", type=Path, default=None)
    args = ap.parse_args(argv)
    groups = [g.strip() for g in args.modules.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise SystemExit(f"unknown module group(s) {unknown}; choose from {list(GROUPS)}")
    if shutil.which("mutmut") is None:
        raise SystemExit("mutmut is not installed: pip install -e '.[dev]'")
    st = report.stamp()
    summary, survivors, runs = [], [], {}
    t_all = time.time()
    for g in groups:
        modules, tests, k_expr = GROUPS[g]
        work = prepare(g, modules, tests, k_expr, args)
        print(f"[{g}] mutating {modules} against {tests} (-k {k_expr!r})", flush=True)
        names = generate(work)
        picked = names if args.max_mutants <= 0 or len(names) <= args.max_mutants else \
            sorted(random.Random(args.seed).sample(names, args.max_mutants))
        print(f"[{g}] {len(names)} mutants, running {len(picked)}", flush=True)
        seconds, rc, tail = run_group(work, args, picked)
        rows = [r for r in collect(work, modules) if r["mutant"] in set(picked)]
        runs[g] = dict(seconds=round(seconds, 1), mutmut_exit_code=rc, tail=tail, tests=tests, k=k_expr,
                       generated=len(names), run=len(picked))
        print(f"[{g}] {len(rows)} mutants in {seconds:.0f} s (mutmut exit {rc})\n{tail}", flush=True)
        for mod in sorted({r["module"] for r in rows}):
            mine = [r for r in rows if r["module"] == mod]
            detected = [r for r in mine if r["status"] in ("killed", "timeout", "segfault")]
            alive = [r for r in mine if r not in detected]
            for r in alive:
                r["reason"] = reason_for(r)
            survivors += alive
            summary.append(dict(group=g, module=mod, generated=len(names), mutants=len(mine),
                                killed=sum(r["status"] == "killed" for r in mine),
                                timeout=sum(r["status"] == "timeout" for r in mine),
                                surviving=len(alive),
                                explained=sum(not r["reason"].startswith("unexplained") for r in alive),
                                kill_rate=round(len(detected) / len(mine), 4) if mine else None))
    total = time.time() - t_all
    md = ["# Mutation testing", "",
          "Each mutant is a small change to the certified code (an operator, a constant, a comparison, a "
          "string). A mutant is *killed* when a test fails on it, *timeout* when its tests ran past the "
          "per-mutant CPU limit (counted as detected); a survivor is listed with the reason it survives.",
          "", f"Command: `python experiments/mutation.py` (mutmut, `--max-children {args.max_children}`); total wall "
          f"time {total / 60:.1f} min on this machine.", "",
          f"Mutants per group: all when a group has at most `--max-mutants {args.max_mutants}` of them, else a "
          f"random sample of that many (seed {args.seed}); the detected fraction of a sample estimates the whole "
          "module's (binomial standard error sqrt(p(1-p)/n), about 3 points at n = 100, p = 0.9).", "",
          report.md_table(["group", "module", "generated", "run", "killed", "timeout", "surviving", "explained",
                           "detected"],
                          [[s["group"], s["module"], s["generated"], s["mutants"], s["killed"], s["timeout"], s["surviving"],
                            s["explained"], f"{100 * s['kill_rate']:.1f}%" if s["kill_rate"] is not None else "-"]
                           for s in summary]), "",
          "Per group: " + ", ".join(f"{g} {r['seconds'] / 60:.1f} min" for g, r in runs.items()) + ".", "",
          "## Surviving mutants", ""]
    for r in survivors:
        md.append(f"- `{r['module']}` `{r['function']}` ({r['status']}): {r['reason']}")
        for ln in r.get("diff", "").splitlines()[:4]:
            md.append(f"    `{ln.strip()[:160]}`")
    report.write_report("mutation", "\n".join(md), dict(summary=summary, survivors=survivors, runs=runs,
                                                        total_seconds=round(total, 1),
                                                        settings=vars(args) | {"docs": str(args.docs)}),
                        st, docs=args.docs)
    print(f"total {total / 60:.1f} min; wrote docs/mutation.md")


if __name__ == "__main__":
    main()
