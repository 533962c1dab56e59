"""docs/mutation.md: the mutation-testing run's numbers (per group and module) and its survivors with their reasons.
The run itself is `python experiments/mutation.py` (it needs a source checkout); this module only counts and writes."""
from __future__ import annotations

from .. import report


def _rates(n: int, alive: int, eq: int, since: int) -> dict:
    """Detected share; the mutation score proper (equivalent mutants are not faults, so they leave the
    denominator); the score counting survivors killed by tests added since the run."""
    return dict(kill_rate=round((n - alive) / n, 4) if n else None,
                score=round((n - alive) / (n - eq), 4) if n > eq else None,
                score_since=round((n - alive + since) / (n - eq), 4) if n > eq else None)


def summarise(g: str, generated: int, rows: list[dict], reason_for) -> list[dict]:
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


def load_runs(data: dict) -> dict:
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


def tally(runs: dict, reason_for) -> tuple[list[dict], list[dict], list[dict]]:
    """(per-module summary, per-group totals, survivors with their reasons) from the per-group rows;
    reason_for(row) -> the reason a survivor survives (experiments/mutation_survivors.json)."""
    summary, survivors = [], []
    for g, r in runs.items():
        summary += summarise(g, r["generated"], r["rows"], reason_for)
        for row in r["rows"]:
            if row["status"] not in ("killed", "timeout", "segfault"):
                survivors.append(dict(row, reason=reason_for(row), group=g))
    return summary, group_totals(summary), survivors


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if x is not None else "-"


def markdown(runs: dict, summary: list[dict], groups: list[dict], survivors: list[dict], all_groups: dict) -> str:
    """The report; all_groups: every group the run knows (name -> (modules, tests, -k)), to name those not in it."""
    total = sum(r["seconds"] for r in runs.values())
    n_run = sum(s["mutants"] for s in summary)
    n_det = sum(s["mutants"] - s["surviving"] for s in summary)
    n_eq = sum(s.get("equivalent", 0) for s in summary)
    return "\n".join(_intro(runs, total, n_run, n_det, n_eq) + _tables(summary, groups)
                     + _missing(runs, all_groups) + _survivors(survivors))


def _intro(runs, total, n_run, n_det, n_eq) -> list[str]:
    return ["# Mutation testing", "",
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
          "kills (each checked by applying the mutant by hand; the next fresh sample is the real check).", ""]


def _tables(summary, groups) -> list[str]:
    return [
          report.md_table(["group", "modules", "generated", "run", "killed", "timeout", "surviving", "explained",
                           "equivalent", "detected", "score", "killed since", "with later kills"],
                          [[x["group"], len(x["modules"]), x["generated"], x["mutants"], x["killed"], x["timeout"],
                            x["surviving"], x["explained"], x["equivalent"],
                            _pct(x["kill_rate"]),
                            _pct(x.get("score")), x["killed_since"],
                            _pct(x.get("score_since"))]
                           for x in groups]),
          "", "Per module:", "",
          report.md_table(["group", "module", "generated", "run", "killed", "timeout", "surviving", "explained",
                           "equivalent", "detected", "score"],
                          [[x["group"], x["module"], x["generated"], x["mutants"], x["killed"], x["timeout"],
                            x["surviving"], x["explained"], x.get("equivalent", 0),
                            _pct(x["kill_rate"]),
                            _pct(x.get("score"))] for x in summary])]


def _missing(runs, all_groups) -> list[str]:
    return ["", ("Not in this report (run `python experiments/mutation.py --modules NAME --update` to add them): "
               + ", ".join(f"`{g}` ({', '.join(all_groups[g][0])})" for g in all_groups if g not in runs) + "."
               if any(g not in runs for g in all_groups) else "All module groups are in this report.")]


def _survivors(survivors) -> list[str]:
    md = ["", "## Surviving mutants", "",
          "A reason is one of: *equivalent* (no input tells the mutant from the code), *loosens* (the mutant "
          "returns a larger, still true bound or margin: a test of a true bound cannot fail on it; a tightness "
          "test would need to pin the constant to O(u)), or *unexplained* (a test is missing).", ""]
    for r in survivors:
        md.append(f"- `{r['module']}` `{r['function']}` ({r['status']}): {r['reason']}")
        for ln in r.get("diff", "").splitlines()[:4]:
            md.append(f"    `{ln.strip()[:160]}`")
    return md
