"""The exactness report's table on a tiny configuration: the default certification's rows against the Jacobian of the
layer's own forward pass (its spectral norm computed here), the gap and target arithmetic, non-square rows, and the
report written, merged by key and replotted."""
import json

import pytest
import torch

from lipcheck.commands import exactness as ex


def jacobian_norm(layer, H, W):
    """||d layer(x) / dx||_2 from autograd through the forward pass: the layer is affine in x (fixed kernels)."""
    x = torch.zeros(1, H, W, layer.dim, dtype=torch.float64)
    J = torch.autograd.functional.jacobian(layer, x).reshape(H * W * layer.dim, H * W * layer.dim)
    return float(torch.linalg.matrix_norm(J, ord=2))


@pytest.mark.parametrize("kernels,H,W", [("broad", 4, 4), ("floor", 4, 6)])
def test_rows_bracket_the_norm_of_the_forward_pass(kernels, H, W):
    layer = ex.exactness_layer(6, kernels, seed=3)
    assert (layer.num_heads, layer.num_components) == (3, 4)
    if kernels == "floor":  # every width just above the library's floor
        sigma = layer.gaussian_params()[2]
        assert torch.allclose(sigma, torch.full_like(sigma, ex.SIGMA_FLOOR), rtol=1e-6)
    row = ex.judge_row(dict(C=6, kernels=kernels, H=H, W=W, **ex.measure_row(layer, H, W)))
    norm = jacobian_norm(layer, H, W)
    assert row["lower"] <= norm * (1 + 1e-12) and norm <= row["upper"] * (1 + 1e-12)
    assert row["gap"] == pytest.approx(row["upper"] / row["lower"] - 1, rel=1e-12)
    assert row["exact"] == pytest.approx(norm, rel=1e-10) and row["exact_method"] == "dense SVD"
    assert row["exact_gap"] == pytest.approx(row["upper"] / norm - 1, rel=1e-3, abs=1e-13)
    assert row["circulant"] >= row["upper"] and row["seconds"] > 0
    assert (row["H"] != row["W"]) == (H != W)
    assert row["target"] == 1e-4 and row["met"] == (row["gap"] <= 1e-4) and all(row["valid"].values())


def test_targets_flags_and_verdict():
    assert ex.target(64, 64) == 1e-4 and ex.target(14, 28) == 1e-4 and ex.target(128, 128) == 1e-3
    base = dict(C=6, kernels="init", circulant=2.0, exact=1.0)
    ok = ex.judge_row(dict(base, H=4, W=4, lower=1.0, upper=1.00005))
    slack = ex.judge_row(dict(base, H=128, W=128, lower=1.0, upper=1.0005, exact=None))
    miss = ex.judge_row(dict(base, H=14, W=28, lower=1.0, upper=1.0002))
    assert ok["met"] and slack["met"] and not miss["met"]
    assert miss["gap"] == pytest.approx(2e-4) and slack["exact_gap"] is None
    assert ex.verdict([ok, slack])["status"] == "holds"
    v = ex.verdict([ok, slack, miss])
    assert v["status"] == "partial" and v["number"].startswith("1 of 3 rows miss") and "14x28" in v["number"]
    wrong = ex.judge_row(dict(base, H=4, W=4, lower=1.0, upper=1.00001, exact=1.001))  # exact above upper
    assert not wrong["valid"]["upper"] and ex.verdict([ok, wrong])["status"] == "fails"


def test_plan_rows_and_merge_by_key():
    jobs = ex.plan_rows()
    assert ("floor", 768, 64, 64) in jobs and ("wide", 192, 128, 128) in jobs and ("init", 48, 128, 128) not in jobs
    assert ("broad", 192, 14, 28) in jobs and ("broad", 192, 20, 12) in jobs
    assert ex.exactness_layer(768, "init", 0).num_heads == 12 and ex.exactness_layer(48, "wide", 0).num_components == 8
    a = [dict(kernels="wide", C=48, H=8, W=8, x=1), dict(kernels="init", C=48, H=14, W=14, x=1)]
    b = [dict(kernels="wide", C=48, H=8, W=8, x=2)]
    m = ex.merge_rows(a, b)
    assert [(r["kernels"], r["x"]) for r in m] == [("init", 1), ("wide", 2)]


def test_command_writes_merges_and_replots(tmp_path, capsys):
    args = ["--widths", "6", "--families", "init", "--docs", str(tmp_path), "--no-progress", "--threads", "1"]
    assert ex.main(args + ["--grids", "4x6"]) == 0
    assert ex.main(args + ["--grids", "4"]) == 0  # a second part: its row joins the first
    data = json.loads((tmp_path / "data" / "exactness.json").read_text())
    assert data["schema"] == ex.SCHEMA and [(r["H"], r["W"]) for r in data["rows"]] == [(4, 4), (4, 6)]
    assert (tmp_path / "figures" / "exactness_gap.png").stat().st_size > 0
    md = (tmp_path / "exactness.md").read_text()
    assert md.startswith("**Verdict:") and "| 4x6 |" in md
    other = tmp_path / "merged"
    assert ex.main(["--merge", str(tmp_path / "data" / "exactness.json"), "--docs", str(other)]) == 0
    assert json.loads((other / "data" / "exactness.json").read_text())["rows"] == data["rows"]
    legacy = tmp_path / "legacy.json"  # the schema-1 rows (square grid n) still replot
    legacy.write_text(json.dumps(dict(rows=[dict(C=48, heads=3, kernels="init", grid=14, lower=1.0, upper=1.001,
                                                 circulant=1.1, exact=1.0)])))
    assert ex.main(["--replot", str(legacy), "--docs", str(tmp_path / "re")]) == 0
    assert (tmp_path / "re" / "figures" / "exactness_gap.png").exists()
