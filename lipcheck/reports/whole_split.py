"""Every test image of a trained ODE model, as the trained report shows it: the whole-split runs of
`lipcheck wellposed --checkpoint RUN --all-test-images` (RUN/verdicts/data/wellposed_all.json), summarised per model
(proven count, the unproven grouped by reason, radius / actual error quantiles, the field's constants) so that the
report and its JSON stay small whatever the split's size."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from lipcheck import report

from .trained import field_constants_table

SPLIT_JSON = Path("verdicts") / "data" / "wellposed_all.json"  # under the run directory
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?")


def load(checkpoint: str | Path, epoch: int) -> dict | None:
    """The whole-split run of this checkpoint, if one was made of this epoch's weights (else None)."""
    path = Path(checkpoint).parent / SPLIT_JSON
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if data.get("epoch") == epoch and data.get("enclosure") else None


def _number(v):
    """A JSON value back as the number it was: the report's JSON writes inf and nan as strings."""
    return float(v) if v in ("inf", "-inf", "nan") else v


def reason_groups(rows: list[dict]) -> list[dict]:
    """The unproven images grouped by their reason with its numbers blanked: count, one example, and the range of
    the first number of each reason (the predicted work, or the t reached), most frequent first."""
    groups: dict[str, dict] = {}
    for r in rows:
        if r["proven"]:
            continue
        why = r.get("reason") or "no reason given"
        g = groups.setdefault(_NUMBER.sub("#", why), {"count": 0, "example": why, "images": [], "first": []})
        g["count"] += 1
        g["images"].append(r["image"])
        m = _NUMBER.search(why.split(":", 1)[-1])
        if m:
            g["first"].append(float(m.group()))
    out = sorted(groups.values(), key=lambda g: -g["count"])
    for g in out:
        first = g.pop("first")
        g["first_range"] = [min(first), max(first)] if first else None
        g["images"] = g["images"][:8]  # the first few, for a rerun by hand
    return out


def summarize(name: str, data: dict) -> dict:
    """One model's whole-split run in a few numbers (what docs/data/trained.json keeps of it)."""
    rows, run = data["enclosure"], data["run"]
    proven = [r for r in rows if r["proven"]]
    quant = {}
    for key in ("radius_t1", "actual_t1", "ratio_t1"):
        vals = sorted(r[key] for r in proven if isinstance(r.get(key), (int, float)))
        if vals:
            quant[key] = [vals[0], statistics.median(vals), vals[-1]]
    stamp = data.get("stamp") or {}
    fields = [dict(r, field={k: _number(v) for k, v in r["field"].items()}) for r in rows if r.get("field")]
    return {"model": name, "mixer": data.get("mixer"), "images": len(rows), "proven": len(proven),
            "refused": sum(1 for r in rows if not r["proven"] and (r.get("reason") or "").startswith("not attempted")),
            "reasons": reason_groups(rows), "quantiles": quant, "wall_s": run["wall_s"],
            "world_size": run["world_size"], "command": stamp.get("command"), "commit": stamp.get("commit"),
            "date": stamp.get("date"), "constants": field_constants_table(fields)}


def section(splits: list[dict]) -> list[str]:
    """The report's "every test image" part: one row per model, then the reasons of the unproven, then the
    constants of both mixers side by side, then the commands that made the runs."""
    if not splits:
        return []
    md = ["### Every test image", "",
          "The whole digits test split, each image's enclosure as above (`--all-test-images`, sharded over torchrun "
          "processes); an image is either proven on [0, t1] or counted with its reason.", ""]
    body = []
    for s in splits:
        q = s["quantiles"].get("ratio_t1")
        body.append([s["model"], s["images"], f"**{s['proven']}/{s['images']}**", s["refused"],
                     s["images"] - s["proven"] - s["refused"],
                     "-" if q is None else f"{q[0]:.3g} / {q[1]:.3g} / {q[2]:.3g}",
                     f"{s['wall_s'] / 60:.1f} min on {s['world_size']}", s["commit"] or "-"])
    md += [report.md_table(["model", "test images", "proven on [0, t1]", "refused before any proof",
                            "other unproven", "radius / actual at t1 (min / median / max)",
                            "wall time, processes", "run at commit"], body), ""]
    for s in splits:
        for g in s["reasons"]:
            rng = g["first_range"]
            md += [f"- {s['model']}: **{g['count']}** image(s)"
                   + (f" (the number in the reason from {rng[0]:.3g} to {rng[1]:.3g})"
                      if rng and rng[0] != rng[1] else "")
                   + f", for example image {g['images'][0]}: {g['example']}"]
    if any(s["reasons"] for s in splits):
        md += [""]
    tables = [s["constants"].splitlines() for s in splits if s["constants"]]
    if tables:  # one table, the mixers side by side (every table has the same header and rule)
        md += ["The constants of every enclose call, per mixer (min, median and max over the split where it has many "
               "calls; for a refused image the constants its prediction used, no tube log-norm):", ""]
        md += [*tables[0][:2], *(line for t in tables for line in t[2:]), ""]
    md += ["Made by:", "", "```"] + [_launch(s) for s in splits if s["command"]] + ["```", ""]
    return md


def _launch(s: dict) -> str:
    """The run's command as launched: its stamp records `lipcheck ...` in each torchrun process."""
    cmd, world = s["command"], s["world_size"]
    if world > 1 and cmd.startswith("lipcheck "):
        return f"torchrun --nproc_per_node {world} -m lipcheck.cli {cmd[len('lipcheck '):]}"
    return cmd


def verdict_text(splits: list[dict]) -> str:
    """The whole-split counts for the report's one-line verdict ('' without runs)."""
    return "".join(f"; whole test split, {s['model']}: {s['proven']}/{s['images']} proven"
                   + (f" ({s['refused']} refused for their predicted work)" if s["refused"] else "")
                   for s in splits)
