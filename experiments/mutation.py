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
import random
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lipcheck import report
from lipcheck.commands.mutation import verdict as mutation_verdict  # noqa: E402
from lipcheck.reports import mutation as mutation_report  # noqa: E402
from mutation_run import collect, generate, prepare, run_group  # noqa: E402  (beside this script)

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
    "lipschitz": (["lipcheck/bounds/lipschitz.py", "lipcheck/bounds/options.py", "lipcheck/bounds/lanczos_bounds.py",
                   "lipcheck/bounds/certify_run.py"],
                  ["tests/test_bounds.py", "tests/test_certify_default.py", "tests/test_budget_units.py",
                   "tests/test_deflation.py", "tests/test_gram_dense.py"],  # the deflated stage's retries; the dense Gram stage
                  "not default_settings_close"),
    # the ODE enclosure; its dense-attention field is the attention_field group's
    "wellposed": ([f"lipcheck/wellposed/{m}.py" for m in (
        "certificate", "defect", "direct", "distance", "enclosure", "envelope", "field", "gradients", "gronwall",
        "options", "quartic", "recurrence", "result", "solve", "sweep")],
        ["tests/test_wellposed.py", "tests/test_enclosure.py", "tests/test_enclosure_stiff.py"],
        "not gain_4_is_proven and not tol_1e9_at_gain_1"),  # the two 15-20 s enclosures of the stiff file left out
    # the dense-attention ODE field: its curvature and rounding constants and the field object built on them
    "attention_field": (["lipcheck/bounds/attention_field.py", "lipcheck/wellposed/attention_field.py"],
                        ["tests/test_attention_field.py"], None),
    "lognorm": (["lipcheck/bounds/lognorm.py"], ["tests/test_enclosure.py", "tests/test_lognorm.py"], None),
    "majorant": (["lipcheck/bounds/majorant.py"], ["tests/test_majorant.py"],
                 "not wired_into_ssog_lipschitz"),  # that test patches keyword defaults, which mutmut wraps
    "deflation": (["lipcheck/bounds/deflation.py", "lipcheck/bounds/deflation_plan.py"],
                  ["tests/test_deflation.py", "tests/test_gram_envelope.py",
                   "tests/test_certify_default.py", "tests/test_gram_lowrank.py"],
                  None),
    "gram_envelope": (["lipcheck/bounds/gram_envelope.py"], ["tests/test_gram_envelope.py"], None),
    "gram_lowrank": (["lipcheck/bounds/gram_lowrank.py"], ["tests/test_gram_lowrank.py"], None),
    "gram_heads": (["lipcheck/bounds/gram_heads.py"], ["tests/test_gram_heads.py"], None),
    "gram_dense": (["lipcheck/bounds/gram_dense.py"], ["tests/test_gram_dense.py"], None),
    # the deflated bound's parameter search: estimates only (any choice is certified), reported on its own
    "deflation_search": (["lipcheck/bounds/deflation_search.py"], ["tests/test_deflation.py"], None),
    "rounding": (["lipcheck/rounding.py"], ["tests/test_lognorm.py", "tests/test_bounds.py", "tests/test_gram_dense.py"],
                 "rounding or norm2 or lambda or cholesky or rump or gamma or anchor or gram or head_norms or op_is "
                 "or blocked"),
    "network": (["lipcheck/bounds/network.py", "lipcheck/bounds/mlp.py"], ["tests/test_network_bounds.py", "tests/test_bounds.py"],
                "network or vector_field or mixer or mlp or min_token"),
}

# Why a surviving mutant survives: (module glob, function-name regex, regex on the mutated line(s) of the diff,
# reason), kept as data in mutation_survivors.json beside this script. A reason says either that the mutant is
# equivalent (no input distinguishes it), or that the change only loosens a bound in a way no true-bound test can
# see. Anything unmatched is reported as "unexplained" and counts against the suite.
SURVIVOR_REASONS = [(r["module"], r["function"], r["mutant"], r["why"])
                    for r in json.loads((Path(__file__).with_name("mutation_survivors.json")).read_text())]


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


def write(runs: dict, args, st: dict) -> None:
    """docs/mutation.md + JSON from the per-group results (reasons re-derived from the stored diffs)."""
    summary, groups, survivors = mutation_report.tally(runs, reason_for)
    total = sum(r["seconds"] for r in runs.values())
    report.write_report("mutation", mutation_report.markdown(runs, summary, groups, survivors, GROUPS),
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
        runs = mutation_report.load_runs(json.loads(data_path.read_text()))
    st = report.stamp()
    for path in args.merge or []:
        theirs = mutation_report.load_runs(json.loads(path.read_text()))
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
