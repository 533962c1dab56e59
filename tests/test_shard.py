"""Proving many images: batched enclosures against one image at a time and a DOP853 solve made here, the batches
dealt out to processes (every image once, whatever the number of processes), and two gloo processes under torchrun
giving one process's numbers and one report."""
import copy
import json
import os
import subprocess
import sys
from argparse import Namespace

import numpy as np
import pytest
import torch
from scipy.integrate import solve_ivp

from lipcheck import checkpoint as C
from lipcheck import cli, shard, threads, verdicts
from lipcheck import train as T
from lipcheck.commands import trained
from lipcheck.data import load_dataset

SMALL = dict(dim=8, depth=1, num_heads=2, num_components=2, patch_size=4)  # digits on a 2x2 grid, width 8
TOL = 1e-3  # a loose solve: radii (about 1e-3 here) far above the DOP853 solve's own error


# ------------------------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("n, batch, world", [(1, 1, 1), (7, 3, 2), (450, 8, 2), (10, 4, 3), (5, 8, 4), (9, 2, 9)])
def test_every_image_is_proven_once_in_batches_that_do_not_depend_on_the_world(n, batch, world):
    plan = shard.batches(n, batch)
    assert [i for b in plan for i in b] == list(range(n)) and all(1 <= len(b) <= batch for b in plan)
    assert all(len(b) == batch for b in plan[:-1])
    dealt = [shard.share(plan, r, world) for r in range(world)]
    assert sorted(map(tuple, (b for d in dealt for b in d))) == sorted(map(tuple, plan))  # same batches, once
    rows = [[{"image": i} for b in d for i in b] for d in dealt]
    assert [r["image"] for r in shard.merge(rows, n)] == list(range(n))


def test_a_lost_or_doubled_shard_is_refused():
    with pytest.raises(ValueError, match=r"missing \[2\]"):
        shard.merge([[{"image": 0}], [{"image": 1}]], 3)
    with pytest.raises(ValueError, match=r"doubled \[1\]"):
        shard.merge([[{"image": 0}, {"image": 1}], [{"image": 1}, {"image": 2}]], 3)
    with pytest.raises(ValueError, match="--batch"):
        shard.batches(4, 0)
    with pytest.raises(ValueError, match="rank"):
        shard.share([[0]], 2, 2)


# ------------------------------------------------------------------------------------------- batched = per image
def _dop853(model, images, t1):
    """x(t1) per image from scipy's DOP853 at rtol 1e-13 on the model's own vector field (float64), made here
    without lipcheck.wellposed; checked against rtol 1e-11 (its error is far below the radii)."""
    m = copy.deepcopy(model).double()
    out = []
    with torch.no_grad():
        x0 = m.embed(images.double())
        for x in x0:
            def f(t, y, s=x.shape):
                return m.vector_field(t, torch.from_numpy(y).reshape(1, *s))[0].flatten().numpy()
            ends = [solve_ivp(f, (0.0, t1), x.flatten().numpy(), method="DOP853", rtol=r, atol=r * 1e-2).y[:, -1]
                    for r in (1e-13, 1e-11)]
            assert np.linalg.norm(ends[0] - ends[1]) < 1e-8
            out.append(torch.from_numpy(ends[0]).reshape(x.shape))
    return out


def test_batched_enclosures_are_proofs_like_one_image_at_a_time(one_thread):
    """An image's radius depends on its batch mates: the batch shares the solver's steps (one error norm over the
    batch), the sub-interval refinement and the variance floor of the field's constants. So batched and per-image
    radii differ; each is an upper bound on the error against DOP853, and the same batch gives the same numbers
    whatever else is proven before or beside it (what makes a sharded run's numbers one process's)."""
    model = T.build_model("digits", "ode", "ssog", in_chans=1, num_classes=10, seed=7, **SMALL).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # every Linear of the block N(0, 1/fan_in): a field that moves the state visibly
        for mod in model.vector_field.block.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.normal_(0.0, 1.0 / mod.in_features ** 0.5)
    images = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    one = verdicts.enclose_images(model, images, tol=TOL, batch=1, keep_center=True)
    two = verdicts.enclose_images(model, images, tol=TOL, batch=2, keep_center=True)
    truth = _dop853(model, images, float(model.t1))
    assert [r["image"] for r in one] == [r["image"] for r in two] == [0, 1, 2, 3]
    assert [r["proven"] for r in one] == [r["proven"] for r in two] == [True] * 4
    for a, b, x in zip(one, two, truth):
        for r in (a, b):
            err = float((x - r["center_t1"]).norm())
            assert err <= r["radius_t1"], (r["image"], err, r["radius_t1"])
    assert any(a["radius_t1"] != b["radius_t1"] for a, b in zip(one, two))  # the steps are the batch's
    # the second batch alone, after nothing: bit for bit the rows it had after the first batch
    again = verdicts.enclose_images(model, images, tol=TOL, batches=[[2, 3]])
    keys = ("image", "proven", "radius_t1", "t_proven", "actual_t1")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in two[2:]]


# ------------------------------------------------------------------------------------------- processes
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A small ODE SSoG digits checkpoint (one epoch on 32 images)."""
    out = tmp_path_factory.mktemp("shard") / "ode-ssog"
    with threads.set_threads(1):
        T.run("digits", "ode", "ssog", cfg=T.TrainConfig(epochs=1, batch_size=16, warmup_epochs=1, seed=5),
              out_dir=out, progress=False, limit_train=32, limit_test=16, **SMALL)
    return out


ARGS = ["--images", "4", "--batch", "2", "--enclosure-only", "--no-progress"]


def test_two_gloo_processes_give_one_process_numbers_and_one_report(run_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["wellposed", "--checkpoint", str(run_dir), "--docs", str(tmp_path / "one"), *ARGS]) == 0
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "lipcheck.cli", "wellposed", "--checkpoint", str(run_dir),
                           "--docs", str(tmp_path / "two"), *ARGS],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    one = json.loads((tmp_path / "one" / "data" / "wellposed.json").read_text())
    two = json.loads((tmp_path / "two" / "data" / "wellposed.json").read_text())
    assert (one["run"]["world_size"], two["run"]["world_size"]) == (1, 2)
    keys = ("image", "proven", "radius_t1", "t_proven", "actual_t1", "reason")
    assert [[r[k] for k in keys] for r in two["enclosure"]] == [[r[k] for k in keys] for r in one["enclosure"]]
    assert [r["image"] for r in two["enclosure"]] == [0, 1, 2, 3]
    files = sorted(p.relative_to(tmp_path / "two").as_posix() for p in (tmp_path / "two").rglob("*") if p.is_file())
    assert files == ["data/wellposed.json", "wellposed.md"]  # rank 1 wrote nothing
    assert done.stdout.count("wrote ") == 1 and done.stdout.count("Verdict:") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]


def test_all_test_images_is_the_whole_split_and_not_with_images(run_dir, capsys):
    ckpt = C.load(run_dir)
    args = Namespace(all_test_images=True, images=None, data=None, data_dir=None)
    assert len(trained._images(ckpt, args, trained.SETTINGS["full"])) == len(load_dataset("digits")[1])
    with pytest.raises(SystemExit) as e:
        cli.main(["wellposed", "--checkpoint", str(run_dir), "--all-test-images", "--images", "3"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "drop --images" in err
    for flag in (["--all-test-images"], ["--batch", "2"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["wellposed", *flag])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and "give --checkpoint RUN" in err and f"drop {flag[0]}" in err


def test_the_default_batch_is_one_image_on_a_cpu():
    """Without --batch a CPU proves one image per enclose call (a batch shares its steps, refinement and log-norm
    grid, each the worst of its images: twice the time per image on the digits model), a GPU 8."""
    from lipcheck.commands import trained
    assert trained.default_batch("cpu") == 1 and trained.default_batch(torch.device("cpu")) == 1
    assert trained.default_batch("cuda") == 8 and trained.default_batch("meta") == 1
