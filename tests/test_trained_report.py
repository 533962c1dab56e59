"""docs/trained.md's enclosure section: the two mixers' constants side by side, the budget, the verdict's counts
(synthetic rows: the numbers the report prints are the rows' own)."""
from lipcheck.commands import trained
from lipcheck.reports import trained as tr


def _row(mixer, proven, K2, M2, mu):
    return {"image": 0, "proven": proven, "refused": False, "reason": None if proven else "time budget used up",
            "t_proven": 1.0 if proven else 0.006, "radius_t1": 1e-4 if proven else float("inf"), "actual_t1": 5e-5,
            "ratio_t1": 2.0 if proven else None, "seconds": 1.0,
            "field": {"mixer": mixer, "token_radius": 7.0, "mixer_lipschitz": 1.7 if mixer == "ssog" else 215.0,
                      "mixer_curvature": K2, "variance_floor": 0.5, "lipschitz": 30.0, "curvature": M2,
                      "mu_max": mu}}


def test_constants_side_by_side_one_line_per_model_with_its_proven_count():
    models = [("ode/ssog, trained", [_row("ssog", True, 0.0, 441.0, 3.0), _row("ssog", True, 0.0, 441.0, 4.5)]),
              ("ode/attention, trained", [_row("attention", False, 1.2e3, 2.2e4, 9.0)])]
    lines = tr.constants_side_by_side(models).splitlines()
    assert len(lines) == 4  # header, rule, two models
    assert lines[2].startswith("| ode/ssog, trained | ssog | 1.7 | 0 |") and lines[2].endswith("| 441 | 4.5 | 2/2 |")
    assert "| attention | 215 | 1200 |" in lines[3] and lines[3].endswith("| 2.2e+04 | 9 | 0/1 |")
    assert tr.constants_side_by_side([("x", [{"proven": False}])]) == ""  # refused rows carry no constants


def test_the_enclosure_section_states_the_budget_and_the_verdict_counts_both_mixers():
    ssog = {"variant": "ode", "mixer": "ssog", "epoch": 8,
            "trained": {"enclosure": [_row("ssog", True, 0.0, 441.0, 3.0)],
                        "certify": {"ssog": [{"gap": 1e-7}]}}}
    att = {"variant": "ode", "mixer": "attention", "epoch": 8,
           "trained": {"enclosure": [_row("attention", False, 1.2e3, 2.2e4, 9.0)], "certify": {"ssog": []}}}
    md = "\n".join(tr.enclosure_section([ssog, att], trained.SETTINGS["quick"]))
    assert "budget of 240 s" in md and "| ode/attention, trained | attention |" in md
    assert "not proven; proven on [0, 0.006]" in md
    v = trained.report_verdict([ssog, att])
    assert v["status"] == "holds" and "SSoG ODE model: 1/1 images" in v["number"]
    assert v["number"].endswith("attention ODE model: 0/1.")
    assert trained.SETTINGS["full"]["enclosure_seconds"] >= trained.SETTINGS["quick"]["enclosure_seconds"] > 0


def test_many_enclose_calls_give_the_constants_as_quantiles():
    """Up to 16 enclose calls (distinct variance floors) the constants table has a line each; beyond, per mixer the
    min, median and max of every column over them (the floors 0.01 .. 0.20 of 20 calls: median 0.105)."""
    rows = []
    for k in range(20):
        r = _row("ssog", True, 0.0, 100.0 + k, 3.0 + k / 10)
        r["field"] = dict(r["field"], variance_floor=0.01 * (k + 1))
        rows.append(r)
    few = tr.field_constants_table(rows[:16]).splitlines()
    assert len(few) == 18 and few[2].startswith("| ssog | 7 |")
    many = tr.field_constants_table(rows).splitlines()
    assert len(many) == 5
    assert many[2].startswith("| ssog (min of 20) | 7 | 1.7 | 0 | 0.01 | 30 | 100 | 3 |")
    assert many[3].startswith("| ssog (median of 20) | 7 | 1.7 | 0 | 0.105 | 30 | 109.5 | 3.95 |")
    assert many[4].startswith("| ssog (max of 20) | 7 | 1.7 | 0 | 0.2 | 30 | 119 | 4.9 |")


def test_the_whole_split_is_counted_with_the_unproven_grouped_by_reason(tmp_path):
    """whole_split: a run of --all-test-images read back from RUN/verdicts/data/wellposed_all.json (only for the
    checkpoint's own epoch), its images counted (proven, refused before any proof, other), the unproven grouped by
    their reason with the numbers blanked (two work-budget refusals with different predictions are one group, the
    range of their predictions given), radius / actual quantiles over the proven; the verdict gains the counts and
    holds only if every SSoG image of the split is proven."""
    import json

    from lipcheck.reports import whole_split as ws
    work = ("not attempted: the reference enclosure would need about {} field evaluations (1e+05 defect "
            "sub-intervals and 3e+04 point log-norms at 64 each), over the work budget max_work = 2e+06")
    rows = [dict(_row("attention", False, 1.2e3, 2.2e4, 9.0), image=i, reason=work.format(n))
            for i, n in enumerate(("9.5e+06", "3.1e+06", "8.87e+06"))]
    rows.append(dict(_row("attention", False, 1.2e3, 2.2e4, 9.0), image=3))  # "time budget used up"
    rows += [dict(_row("attention", True, 1.2e3, 2.2e4, 9.0), image=4 + i, ratio_t1=r) for i, r in enumerate((1, 3, 2))]
    run = {"wall_s": 120.0, "world_size": 2, "batch": 1, "batches": 7}
    data = {"epoch": 8, "mixer": "attention", "enclosure": rows, "run": run,
            "stamp": {"command": "lipcheck wellposed --all-test-images", "commit": "abc1234"}}
    (tmp_path / "verdicts" / "data").mkdir(parents=True)
    (tmp_path / "verdicts" / "data" / "wellposed_all.json").write_text(json.dumps(data))
    ckpt = tmp_path / "checkpoint.pt"
    assert ws.load(ckpt, 7) is None and ws.load(tmp_path / "elsewhere" / "checkpoint.pt", 8) is None
    s = ws.summarize("ode/attention", ws.load(ckpt, 8))
    assert (s["images"], s["proven"], s["refused"]) == (7, 3, 3)
    assert s["quantiles"]["ratio_t1"] == [1, 2, 3]
    (g1, g2) = s["reasons"]
    assert (g1["count"], g1["images"], g1["first_range"]) == (3, [0, 1, 2], [3.1e6, 9.5e6])
    assert (g2["count"], g2["images"], g2["example"]) == (1, [3], "time budget used up")
    md = "\n".join(ws.section([s]))
    assert "| ode/attention | 7 | **3/7** | 3 | 1 | 1 / 2 / 3 | 2.0 min on 2 | abc1234 |" in md
    assert "**3** image(s) (the number in the reason from 3.1e+06 to 9.5e+06), for example image 0: not attempted" in md
    assert "torchrun --nproc_per_node 2 -m lipcheck.cli wellposed --all-test-images" in md and ws.section([]) == []
    twin = dict(s, model="ode/ssog", constants=s["constants"].replace("attention", "ssog"))
    both = ws.section([s, twin])  # one constants table: one header, both mixers' lines under it
    assert sum(line.startswith("| mixer |") for line in both) == 1
    assert any(line.startswith("| attention |") for line in both) and any(line.startswith("| ssog |") for line in both)
    refused = dict(_row("attention", False, 1.2e3, 2.2e4, float("nan")), image=9)
    assert tr.field_constants_table([refused]).splitlines()[2].endswith("| 2.2e+04 | - |")  # no tube: no log-norm
    ssog = {"variant": "ode", "mixer": "ssog", "epoch": 8,
            "trained": {"enclosure": [_row("ssog", True, 0.0, 441.0, 3.0)], "certify": {"ssog": [{"gap": 1e-7}]}}}
    v = trained.report_verdict([ssog], [s])
    assert v["status"] == "holds" and v["number"].endswith(
        "whole test split, ode/attention: 3/7 proven (3 refused for their predicted work).")
    assert trained.report_verdict([ssog], [dict(s, mixer="ssog")])["status"] == "partial"  # an SSoG image unproven
