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
