"""The verdict of a mutation-testing run (docs/mutation.md). The run itself is `python experiments/mutation.py`:
it mutates the checkout's certified code and runs its tests, so it needs a source checkout, not a wheel."""
from __future__ import annotations

from .. import report

TARGET = 0.9  # the score every module group is held to


def verdict(groups: list[dict]) -> dict:
    """Holds when every group's score (equivalent mutants left out) is at least TARGET."""
    low = [g for g in groups if g["score"] < TARGET]
    worst = min(groups, key=lambda g: g["score"])
    return report.verdict("The tests detect mutants of the certified code (score >= 90% in every module group)",
                          "holds" if not low else "partial",
                          f"{len(groups) - len(low)}/{len(groups)} groups at or above 90%; lowest "
                          f"{worst['group']} {100 * worst['score']:.1f}%.")


def verdict_from(data: dict) -> dict:
    """The verdict of a finished run from its JSON (lipcheck report --verdicts)."""
    return verdict(data["groups"])
