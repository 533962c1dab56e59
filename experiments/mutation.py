"""Mutation testing of the certified code: do the tests tell a lying bound from a true one?

    python experiments/mutation.py [--modules attention,gaussian,...] [--max-mutants 40] [--seed 0]
                                   [--max-children 2] [--timeout-multiplier 4] [--timeout-constant 10]
                                   [--update] [--report-only] [--merge JSON ...] [--docs DIR]

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

from lipcheck import report
from lipcheck.commands.mutation import verdict as mutation_verdict  # noqa: E402

# group -> (modules to mutate (fnmatch on paths under lipcheck/), test files, pytest -k expression or None).
# Only fast tests: mutmut runs, for each mutant, just the selected tests that call the mutated function.
GROUPS = {
    "attention": (["lipcheck/bounds/attention.py"],
                  ["tests/test_attention_bounds.py", "tests/test_probe.py"],
                  "not growth_ti and not probe_values_equal and not jacobian_formula"),
    "gaussian": (["lipcheck/gaussian.py"], ["tests/test_gaussian.py"], None),
    # the spectral primitives, one module per job since the split of spectral.py
    "spectral": (["lipcheck/bounds/spectral.py", "lipcheck/bounds/params.py", "lipcheck/bounds/fast_operator.py",
                  "lipcheck/bounds/margins.py", "lipcheck/bounds/derivatives.py", "lipcheck/bounds/anchor.py",
                  "lipcheck/bounds/krylov.py", "lipcheck/bounds/gram.py", "lipcheck/bounds/cell_set.py"],
                 ["tests/test_bounds.py"], "not default_settings_close"),
    # the entry point above the methods: options, the size rule, the choice of the tightest bound
    "lipschitz": (["lipcheck/bounds/lipschitz.py", "lipcheck/bounds/options.py"],
                  ["tests/test_bounds.py", "tests/test_certify_default.py", "tests/test_budget_units.py"],
                  "not default_settings_close"),
    "wellposed": (["lipcheck/wellposed/*"], ["tests/test_wellposed.py", "tests/test_enclosure.py"], None),
    "lognorm": (["lipcheck/bounds/lognorm.py"], ["tests/test_enclosure.py", "tests/test_lognorm.py"], None),
    "majorant": (["lipcheck/bounds/majorant.py"], ["tests/test_majorant.py"],
                 "not wired_into_ssog_lipschitz"),  # that test patches keyword defaults, which mutmut wraps
    "deflation": (["lipcheck/bounds/deflation.py"], ["tests/test_deflation.py", "tests/test_gram_envelope.py",
                                                     "tests/test_certify_default.py"], None),
    "gram_envelope": (["lipcheck/bounds/gram_envelope.py"], ["tests/test_gram_envelope.py"], None),
    # the deflated bound's parameter search: estimates only (any choice is certified), reported on its own
    "deflation_search": (["lipcheck/bounds/deflation_search.py"], ["tests/test_deflation.py"], None),
    "rounding": (["lipcheck/rounding.py"], ["tests/test_lognorm.py", "tests/test_bounds.py"],
                 "rounding or norm2 or lambda or cholesky or rump or gamma or anchor or gram or head_norms or op_is"),
    "network": (["lipcheck/bounds/network.py", "lipcheck/bounds/mlp.py"], ["tests/test_network_bounds.py", "tests/test_bounds.py"],
                "network or vector_field or mixer or mlp or min_token"),
}

# Why a surviving mutant survives: (module glob, function-name regex, regex on the mutated line(s) of the diff,
# reason), kept as data in mutation_survivors.json beside this script. A reason says either that the mutant is
# equivalent (no input distinguishes it), or that the change only loosens a bound in a way no true-bound test can
# see. Anything unmatched is reported as "unexplained" and counts against the suite.
SURVIVOR_REASONS = [(r["module"], r["function"], r["mutant"], r["why"])
                    for r in json.loads((Path(__file__).with_name("mutation_survivors.json")).read_text())]


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


def reason_for(row: dict) -> str:
    added = "\n".join(ln for ln in row.get("diff", "").splitlines() if ln.startswith(("+", "-")))
    for mod, func, pat, why in SURVIVOR_REASONS:
        if fnmatch.fnmatch(row["module"], mod) and re.search(func, row["function"]) and re.search(pat, added):
            # a function no selected test called counts only a test added since ("now killed by ...") as its reason
            if row["status"] != "no tests" or why.startswith("now killed by"):
                return why
    if row["status"] == "no tests":
        return "unexplained: no selected test calls this function"
    return "unexplained: needs a test"


def _rates(n: int, alive: int, eq: int, since: int) -> dict:
    """Detected share; the mutation score proper (equivalent mutants are not faults, so they leave the
    denominator); the score counting survivors killed by tests added since the run."""
    return dict(kill_rate=round((n - alive) / n, 4) if n else None,
                score=round((n - alive) / (n - eq), 4) if n > eq else None,
                score_since=round((n - alive + since) / (n - eq), 4) if n > eq else None)


def summarise(g: str, generated: int, rows: list[dict]) -> list[dict]:
    out = []
    for mod in sorted({r["module"] for r in rows}):
        mine = [r for r in rows if r["module"] == mod]
        alive = [r for r in mine if r["status"] not in ("killed", "timeout", "segfault")]
        out.append(dict(group=g, module=mod, generated=generated, mutants=len(mine),
                        killed=sum(r["status"] == "killed" for r in mine),
                        timeout=sum(r["status"] == "timeout" for r in mine), surviving=len(alive),
                        explained=sum(not reason_for(r).startswith("unexplained") for r in alive),
                        equivalent=(eq := sum(reason_for(r).startswith("equivalent") for r in alive)),
                        # survivors a test added after the run kills (each checked by applying the mutant by hand)
                        killed_since=(ks := sum(reason_for(r).startswith("now killed") for r in alive)),
                        **_rates(len(mine), len(alive), eq, ks)))
    return out


def group_totals(summary: list[dict]) -> list[dict]:
    """One row per group (the unit the target is set for): a group's modules share one sample, so a module
    with one or two sampled mutants says little on its own."""
    out = []
    for g in dict.fromkeys(x["group"] for x in summary):
        mine = [x for x in summary if x["group"] == g]
        n, alive, eq, ks = (sum(x.get(k, 0) for x in mine) for k in ("mutants", "surviving", "equivalent", "killed_since"))
        out.append(dict(group=g, modules=[x["module"] for x in mine], generated=mine[0]["generated"], mutants=n,
                        killed=sum(x["killed"] for x in mine), timeout=sum(x["timeout"] for x in mine),
                        surviving=alive, explained=sum(x["explained"] for x in mine), equivalent=eq,
                        killed_since=ks, **_rates(n, alive, eq, ks)))
    return out


def _load_runs(data: dict) -> dict:
    """Per-group results from a report; a report written before rows were stored is rebuilt from its
    summary (killed/timeout counts) and survivors."""
    runs = data["runs"]
    for g, r in runs.items():
        if "rows" in r:
            continue
        rows = [dict(x) for x in data.get("survivors", []) if any(
            s["group"] == g and s["module"] == x["module"] for s in data["summary"])]
        for s_ in data["summary"]:
            if s_["group"] == g:
                rows += [dict(module=s_["module"], mutant="", function="", status="killed")] * s_["killed"]
                rows += [dict(module=s_["module"], mutant="", function="", status="timeout")] * s_["timeout"]
        r["rows"] = rows
        r.setdefault("stamp", data.get("stamp"))
    return runs


def write(runs: dict, args, st: dict) -> None:
    """docs/mutation.md + JSON from the per-group results (reasons re-derived from the stored diffs)."""
    summary, survivors = [], []
    for g, r in runs.items():
        summary += summarise(g, r["generated"], r["rows"])
        for row in r["rows"]:
            if row["status"] not in ("killed", "timeout", "segfault"):
                survivors.append(dict(row, reason=reason_for(row), group=g))
    groups = group_totals(summary)
    total = sum(r["seconds"] for r in runs.values())
    n_run = sum(s["mutants"] for s in summary)
    n_det = sum(s["mutants"] - s["surviving"] for s in summary)
    n_eq = sum(s.get("equivalent", 0) for s in summary)
    md = ["# Mutation testing", "",
          "Each mutant is a small change to the certified code (an operator, a constant, a comparison, a "
          "keyword argument, a string). A mutant is *killed* when a test fails on it, *timeout* when its tests "
          "ran past the per-mutant CPU limit (counted as detected); a survivor is listed with the reason it "
          "survives. Error-message text in `raise` statements is not mutated (the tests match the parameter "
          "each message names).", "",
          "Command: `python experiments/mutation.py` (mutmut 3, two workers); one group again after a change: "
          "`python experiments/mutation.py --modules attention --update`. Per group the wall time on this "
          "machine (a 2-core CPU shared with other jobs while it ran; see the stamp of each group in the JSON): "
          + ", ".join(f"{g} {r['seconds'] / 60:.1f} min ({r['run']} mutants)" for g, r in runs.items())
          + f"; {total / 60:.1f} min in all.", "",
          "The code each group ran on (a group's numbers describe that commit; a group run before its module last "
          "changed is out of date): " + ", ".join(
              f"{g} at `{r.get('stamp', {}).get('commit', '?')}` (sample seed {r.get('settings', {}).get('seed', '?')}, "
              f"{r.get('stamp', {}).get('date', '?')})"
              for g, r in runs.items()) + ".", "",
          f"Mutants per group: all when a group has at most `--max-mutants` of them, else a seeded random sample "
          f"of that many; the detected fraction of a sample estimates the whole module's (binomial standard "
          f"error sqrt(p(1-p)/n): 3 points at n = 100, 4 at n = 60, 5 at n = 40, for p = 0.9). Overall: {n_det} of {n_run} detected "
          f"({100 * n_det / max(n_run, 1):.1f}%); {n_eq} survivors are equivalent mutants (no input can tell them from "
          f"the code), and the *score* leaves those out of the denominator: {n_det} of {n_run - n_eq} "
          f"({100 * n_det / max(n_run - n_eq, 1):.1f}%). The target is a score of at least 90% in every module "
          f"group.", "",
          "*score* is the run's own; *with later kills* also counts the survivors that a test added after the run "
          "kills (each checked by applying the mutant by hand; the next fresh sample is the real check).", "",
          report.md_table(["group", "modules", "generated", "run", "killed", "timeout", "surviving", "explained",
                           "equivalent", "detected", "score", "killed since", "with later kills"],
                          [[x["group"], len(x["modules"]), x["generated"], x["mutants"], x["killed"], x["timeout"],
                            x["surviving"], x["explained"], x["equivalent"],
                            f"{100 * x['kill_rate']:.1f}%" if x["kill_rate"] is not None else "-",
                            f"{100 * x['score']:.1f}%" if x.get("score") is not None else "-", x["killed_since"],
                            f"{100 * x['score_since']:.1f}%" if x.get("score_since") is not None else "-"]
                           for x in groups]),
          "", "Per module:", "",
          report.md_table(["group", "module", "generated", "run", "killed", "timeout", "surviving", "explained",
                           "equivalent", "detected", "score"],
                          [[x["group"], x["module"], x["generated"], x["mutants"], x["killed"], x["timeout"],
                            x["surviving"], x["explained"], x.get("equivalent", 0),
                            f"{100 * x['kill_rate']:.1f}%" if x["kill_rate"] is not None else "-",
                            f"{100 * x['score']:.1f}%" if x.get("score") is not None else "-"] for x in summary]),
          "", ("Not in this report (run `python experiments/mutation.py --modules NAME --update` to add them): "
               + ", ".join(f"`{g}` ({', '.join(GROUPS[g][0])})" for g in GROUPS if g not in runs) + "."
               if any(g not in runs for g in GROUPS) else "All module groups are in this report."),
          "", "## Surviving mutants", "",
          "A reason is one of: *equivalent* (no input tells the mutant from the code), *loosens* (the mutant "
          "returns a larger, still true bound or margin: a test of a true bound cannot fail on it; a tightness "
          "test would need to pin the constant to O(u)), or *unexplained* (a test is missing).", ""]
    for r in survivors:
        md.append(f"- `{r['module']}` `{r['function']}` ({r['status']}): {r['reason']}")
        for ln in r.get("diff", "").splitlines()[:4]:
            md.append(f"    `{ln.strip()[:160]}`")
    report.write_report("mutation", "\n".join(md),
                        dict(summary=summary, groups=groups, survivors=survivors, total_seconds=round(total, 1),
                             runs={g: {k: v for k, v in r.items() if k != "rows"} | {"rows": r["rows"]}
                                   for g, r in runs.items()}),
                        st, docs=args.docs, verdict=mutation_verdict(groups))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", default=",".join(GROUPS), help=f"comma-separated groups from {list(GROUPS)}")
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--timeout-multiplier", type=float, default=4.0)
    ap.add_argument("--timeout-constant", type=float, default=10.0)
    ap.add_argument("--max-mutants", type=int, default=40,
                    help="per group: run a seeded random sample of this many mutants (0: all of them)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the mutant sample")
    ap.add_argument("--update", action="store_true",
                    help="keep the other groups' results from docs/data/mutation.json and replace these")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: rewrite the report from docs/data/mutation.json (reasons re-derived)")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                    help="run nothing: take the groups of these reports (mutation.json written elsewhere with "
                         "--docs) into docs/data/mutation.json, replacing the same groups, and rewrite the report")
    ap.add_argument("--docs", type=Path, default=None)
    args = ap.parse_args(argv)
    groups = [g.strip() for g in args.modules.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise SystemExit(f"unknown module group(s) {unknown}; choose from {list(GROUPS)}")
    data_path = (args.docs or report.DOCS) / "data" / "mutation.json"
    runs = {}
    if args.update or args.report_only or args.merge:
        if not data_path.exists():
            raise SystemExit(f"--update/--report-only need an earlier {data_path}; run without them first")
        runs = _load_runs(json.loads(data_path.read_text()))
    st = report.stamp()
    for path in args.merge or []:
        theirs = _load_runs(json.loads(path.read_text()))
        runs.update(theirs)
        print(f"took {sorted(theirs)} from {path}")
    if args.report_only or args.merge:
        write(runs, args, st)
        print(f"rewrote the report from {data_path}")
        return
    if shutil.which("mutmut") is None:
        raise SystemExit("mutmut is not installed: pip install -e '.[dev]'")
    for g in groups:
        modules, tests, k_expr = GROUPS[g]
        work = prepare(g, modules, tests, k_expr, args)
        print(f"[{g}] mutating {modules} against {tests} (-k {k_expr!r})", flush=True)
        t0 = time.time()
        names = generate(work)
        picked = names if args.max_mutants <= 0 or len(names) <= args.max_mutants else \
            sorted(random.Random(args.seed).sample(names, args.max_mutants))
        print(f"[{g}] {len(names)} mutants, running {len(picked)}", flush=True)
        _, rc, tail = run_group(work, args, picked)
        rows = collect(work, modules, set(picked))
        seconds = time.time() - t0
        runs[g] = dict(seconds=round(seconds, 1), mutmut_exit_code=rc, tail=tail, tests=tests, k=k_expr,
                       generated=len(names), run=len(picked), stamp=report.stamp(), rows=rows,
                       settings={k: v for k, v in vars(args).items() if k != "docs"})
        print(f"[{g}] {len(rows)} mutants in {seconds:.0f} s (mutmut exit {rc})\n{tail}", flush=True)
        write(runs, args, st)  # after every group, so an interrupted run keeps what it measured
    print(f"total {sum(r['seconds'] for r in runs.values()) / 60:.1f} min; wrote docs/mutation.md")


if __name__ == "__main__":
    main()
