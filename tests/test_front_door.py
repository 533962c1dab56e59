"""What a user meets first: the command line (one argparse tree, grids checked, every listed flag accepted in
every mode), where reports go (a checkpoint's RUN/verdicts/ or --docs, quick runs never over a full report), the
verdict on top, and the proven enclosure on a trained ODE model checked against a solve made here."""
import copy
import json
import math

import pytest
import torch
from torchdiffeq import odeint

from lipcheck import checkpoint as C
from lipcheck import cli, report, verdicts
from lipcheck import train as T
from lipcheck.commands import common

SMALL = dict(dim=8, depth=1, num_heads=2, num_components=2, patch_size=4)  # digits on a 2x2 grid, width 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("runs")
    cfg = T.TrainConfig(epochs=1, batch_size=16, lr=3e-3, warmup_epochs=1, crop_padding=1, seed=5)
    # the SSoG model at the digits preset (width 48, 4x4 grid: errors well above round-off), attention small
    T.run("digits", "ode", "ssog", cfg=cfg, out_dir=root / "ode-ssog", progress=False, limit_train=32, limit_test=16)
    T.run("digits", "ode", "attention", cfg=cfg, out_dir=root / "ode-attention", progress=False, limit_train=32,
          limit_test=16, **SMALL)
    yield root
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("text, expected", [("14x14", (14, 14)), ("20x12", (20, 12)), ("14", (14, 14)),
                                            (" 8X8 ", (8, 8))])
def test_grids_that_parse(text, expected):
    assert common.grid(text) == expected


@pytest.mark.parametrize("text", ["14x", "14by14", "x14", "0x4", "4x0", "14x14x14", "-4x4", "", "1.5x2"])
def test_grids_that_do_not_parse_exit_2_with_the_commands_prefix(text, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["probe", "--grid", text])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "lipcheck probe: error: argument --grid:" in err


def _flags(command):
    """Every optional flag `lipcheck <command> --help` lists, with a value it accepts."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    out = []
    for a in sub._actions:
        flag = a.option_strings[-1] if a.option_strings else None
        if flag in (None, "--help", "--checkpoint"):
            continue
        if a.nargs == 0:
            out.append([flag])
        elif a.choices:
            out.append([flag, sorted(a.choices)[0]])
        elif a.dest == "grid":
            out.append([flag, "4x4"])
        else:
            out.append([flag, "2"])
    return out


@pytest.mark.parametrize("command", ["certify", "wellposed", "probe"])
def test_every_listed_flag_is_taken_with_a_checkpoint(command, tmp_path, capsys):
    """No flag that --help lists is 'unrecognized' in the checkpoint mode: each either reaches the checkpoint
    loader (here: a missing file, one line naming the fix) or says in one line why it has no meaning there."""
    flags = _flags(command)
    assert {"--docs", "--json", "--quick", "--threads", "--images"} <= {f[0] for f in flags}
    for flag in flags:
        rc = None
        try:
            rc = cli.main([command, "--checkpoint", str(tmp_path / "missing.pt"), *flag])
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1, (flag, err)
        assert err.startswith(f"lipcheck {command}: error:") and "unrecognized" not in err, (flag, err)
        assert "no checkpoint at" in err or f"drop {flag[0]}" in err, (flag, err)
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_corrupt_checkpoint_is_one_line_without_the_unsafe_hint(tmp_path, capsys):
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(b"PK\x03\x04 not a checkpoint" * 8)
    assert cli.main(["certify", "--checkpoint", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "corrupt or unreadable" in err and str(bad) in err
    assert "weights_only" not in err and "lipcheck train --out" in err


# ------------------------------------------------------------------------------------------ where reports go
def test_reports_go_where_they_should(tmp_path):
    assert report.docs_dir(tmp_path) == tmp_path
    assert report.docs_dir(tmp_path, quick=True) == tmp_path  # an explicit elsewhere is taken as given
    if report.CHECKOUT is not None:
        assert report.docs_dir() == report.DOCS
        assert report.docs_dir(quick=True) == report.DOCS / "quick"
        assert report.docs_dir(report.DOCS, quick=True) == report.DOCS / "quick"  # never over a full run
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"")
    assert report.docs_dir(checkpoint=run) == run / "verdicts"
    assert report.docs_dir(checkpoint=run / "checkpoint.pt") == run / "verdicts"
    assert report.docs_dir(tmp_path / "d", checkpoint=run) == tmp_path / "d"


def test_a_report_opens_with_its_verdict(tmp_path, capsys):
    st = report.stamp(command="lipcheck test")
    v = report.verdict("S0, a statement", "holds", "the number 1.5e-9", command="lipcheck test --x")
    path = report.write_report("divergence", "# body\n", {"x": 1}, st, docs=tmp_path, verdict=v)
    lines = path.read_text().splitlines()
    assert lines[0] == "**Verdict: S0, a statement: HOLDS.**" and lines[1] == "the number 1.5e-9"
    assert lines[2] == "Reproduce: `lipcheck test --x`" and lines[4].startswith("_Generated by `lipcheck test`")
    assert json.loads((tmp_path / "data" / "divergence.json").read_text())["verdict"] == v
    report.print_verdict(v, path)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 4 and out[-1] == "Reproduce: lipcheck test --x" and "HOLDS" in out[1]
    with pytest.raises(ValueError, match="verdict status"):
        report.verdict("S0", "maybe", "1")


# ------------------------------------------------------------------------------------------ proofs on checkpoints
def _solve_here(model, images):
    """x(t1) from classical RK4 at 1024 steps made here with torchdiffeq (not lipcheck.wellposed), checked against
    512 steps: fixed steps, because torchdiffeq's adaptive dopri8 at 1e-12 was measured 1.3e-7 off here."""
    m = copy.deepcopy(model).double()
    with torch.no_grad():
        x0 = m.embed(images.double())
        t = torch.tensor([0.0, float(m.t1)], dtype=torch.float64)
        fine, coarse = (odeint(m.vector_field, x0, t, method="rk4", options={"step_size": float(m.t1) / n})[-1]
                        for n in (1024, 512))
    assert float((fine - coarse).norm()) < 1e-11  # converged: RK4's error falls 16x per halving
    return fine


def test_enclosure_of_a_trained_ssog_model_holds_a_solve_made_here(runs):
    ck = C.load(runs / "ode-ssog")
    images = C.images(ck, n=2)
    rows = verdicts.enclose_images(ck.model, images, keep_center=True)
    assert [r["proven"] for r in rows] == [True, True]
    for i, r in enumerate(rows):
        x1 = _solve_here(ck.model, images[i:i + 1])[0]
        err = float((x1 - r["center_t1"]).norm())
        assert err <= r["radius_t1"], (i, err, r["radius_t1"])
        assert r["actual_t1"] == pytest.approx(err, rel=1e-3, abs=1e-12)  # the library's own reference agrees
        assert r["ratio_t1"] >= 1.0 and r["t_proven"] == pytest.approx(float(ck.model.t1))


def test_wellposed_on_a_checkpoint_writes_into_docs_only(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    before = sorted(p.name for p in (runs / "ode-ssog").iterdir())
    rc = cli.main(["wellposed", "--checkpoint", str(runs / "ode-ssog"), "--docs", str(out), "--images", "2",
                   "--enclosure-only", "--no-progress"])
    assert rc == 0
    assert sorted(p.name for p in (runs / "ode-ssog").iterdir()) == before  # nothing beside the checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing in the working directory
    md = (out / "wellposed.md").read_text().splitlines()
    assert md[0].startswith("**Verdict: S5") and "HOLDS" in md[0] and "2/2 images" in md[1]
    data = json.loads((out / "data" / "wellposed.json").read_text())
    assert [r["proven"] for r in data["enclosure"]] == [True, True]
    assert all(r["actual_t1"] <= r["radius_t1"] for r in data["enclosure"])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("Reproduce: lipcheck wellposed")


def test_enclosure_of_a_trained_attention_model_holds_a_solve_made_here(runs):
    ck = C.load(runs / "ode-attention")
    images = C.images(ck, n=1)
    r = verdicts.enclose_images(ck.model, images, keep_center=True)[0]
    assert r["proven"] and not r["refused"], r["reason"]
    err = float((_solve_here(ck.model, images)[0] - r["center_t1"]).norm())
    assert err <= r["radius_t1"] and r["ratio_t1"] >= 1.0
    f = r["field"]  # the constants the report shows: attention's own curvature enters the field's
    assert f["mixer"] == "attention" and 0 < f["mixer_curvature"] and f["mixer_lipschitz"] < f["lipschitz"]
    assert f["curvature"] > 0 and f["mixer_curvature"] > 0 and f["variance_floor"] > 0 and f["mu_max"] < math.inf


def test_a_mixer_without_a_field_is_refused_naming_it(runs):
    ck = C.load(runs / "ode-attention")
    model = copy.deepcopy(ck.model)
    model.vector_field.block.mixer = torch.nn.Identity()
    rows = verdicts.enclose_images(model, C.images(ck, n=1))
    assert rows[0]["refused"] and not rows[0]["proven"] and math.isinf(rows[0]["radius_t1"])
    assert "Identity" in rows[0]["reason"]


def test_an_image_over_the_work_budget_is_refused_without_the_independent_solve(runs, monkeypatch):
    """enclose_images with max_work below the prediction: each row not proven, radius inf, the reason the
    refusal's (the prediction and the constants), no actual error (the independent solve is not run: it is only
    compared with a proof), the constants still reported at the variance the prediction used."""
    from lipcheck import wellposed
    ck = C.load(runs / "ode-ssog")
    monkeypatch.setattr(wellposed, "reference_solution", lambda *a, **k: pytest.fail("solved for a refused image"))
    rows = verdicts.enclose_images(ck.model, C.images(ck, n=2), max_work=10.0)
    for r in rows:
        assert not r["proven"] and math.isinf(r["radius_t1"]) and r["t_proven"] == 0.0
        assert r["reason"].startswith("not attempted: the reference enclosure would need about")
        assert (r["actual_t1"], r["ratio_t1"], r["inside"], r["reference_error"]) == (None, None, None, None)
        assert r["field"]["variance_floor"] > 0 and r["field"]["curvature"] > 0
