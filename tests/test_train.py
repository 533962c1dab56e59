"""Training loop: schedule and augmentation against closed forms, exact resume, 2-process gloo DDP
equal to one process on the same global batch, atomic checkpoints, and clear errors on bad input."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lipcheck import data as D
from lipcheck import train as T
from lipcheck.models.vit import ViT

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(dim=12, depth=2, num_heads=2, num_components=2)  # digits geometry, a smaller width


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these models are tiny, and on a busy machine OpenMP threads only wait on each other."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def small_cfg(**kw):
    base = dict(epochs=3, batch_size=16, lr=3e-3, warmup_epochs=1, crop_padding=1, seed=5)
    return T.TrainConfig(**{**base, **kw})


# ------------------------------------------------------------------------------- closed forms
def test_lr_schedule_matches_closed_form():
    """LambdaLR driven by lr_factor: linear warmup (s + 1) / w, then peak * (m + (1 - m)(1 + cos(pi p)) / 2)."""
    peak, w, total, m = 0.1, 4, 20, 0.05
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: T.lr_factor(s, w, total, m))
    for s in range(total):
        expect = peak * (s + 1) / w if s < w else peak * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * (s - w) / (total - w))))
        assert opt.param_groups[0]["lr"] == pytest.approx(expect, rel=1e-12)
        opt.step()
        sched.step()
    assert T.lr_factor(w - 1, w, total, m) == 1.0  # warmup ends exactly at the peak
    assert T.lr_factor(total, w, total, m) == pytest.approx(m)


def test_augment_is_a_shifted_crop_of_the_padded_image_then_flip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, 5, 7, generator=g)
    pad = 2
    shifts = torch.randint(0, 2 * pad + 1, (6, 2), generator=g)
    flips = torch.tensor([True, False, True, False, False, True])
    out = T.augment(x, shifts, flips, pad)
    xp = F.pad(x, (pad,) * 4)
    for b in range(6):
        dy, dx = shifts[b].tolist()
        ref = xp[b, :, dy:dy + 5, dx:dx + 7]
        assert torch.equal(out[b], ref.flip(-1) if flips[b] else ref)
    centre = torch.full((6, 2), pad)
    assert torch.equal(T.augment(x, centre, torch.zeros(6, dtype=torch.bool), pad), x)


def test_epoch_draws_depend_on_seed_and_epoch_only():
    a = T.epoch_draws(50, 3, 7, 1, True)
    b = T.epoch_draws(50, 3, 7, 1, True)
    c = T.epoch_draws(50, 4, 7, 1, True)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], c[0])
    assert int(a[0].min()) >= 0 and int(a[0].max()) <= 2


def test_evaluate_equals_direct_computation():
    tr, te = D.load_digits()
    te = te.subset(100)
    model = T.build_model("digits", "discrete", "ssog", in_chans=1, num_classes=10, seed=1, **SMALL)
    info = T.DistInfo()
    got = T.evaluate(model, te, info, batch_size=32, size=8, dtype=torch.float32)
    with torch.no_grad():
        logits = model((te.images - te.mean.float()) / te.std.float())
    assert got["acc"] == pytest.approx(float((logits.argmax(-1) == te.labels).double().mean()), abs=1e-12)
    assert got["loss"] == pytest.approx(float(F.cross_entropy(logits.double(), te.labels)), rel=1e-5)


# --------------------------------------------------------------------------------- exact resume
class Interrupted(Exception):
    pass


@pytest.mark.parametrize("variant,mixer", [("discrete", "attention"), ("ode", "ssog")])
def test_resume_is_bit_exact(tmp_path, variant, mixer):
    """Interrupt after epoch 1 of 3, resume from the checkpoint: final parameters equal the
    uninterrupted run's bit for bit, and so do the optimiser state and the logged metrics."""
    torch.use_deterministic_algorithms(True)
    try:
        kw = dict(data="digits", cfg=small_cfg(), device="cpu", progress=False, limit_train=96, limit_test=48,
                  **SMALL)
        full = T.run("digits", variant, mixer, out_dir=tmp_path / "full", **kw)

        def stop(epoch, record):
            if epoch == 1:
                raise Interrupted

        with pytest.raises(Interrupted):
            T.run("digits", variant, mixer, out_dir=tmp_path / "cut", on_epoch_end=stop, **kw)
        assert T.load_checkpoint(tmp_path / "cut" / T.CHECKPOINT)["epoch"] == 1
        resumed = T.run("digits", variant, mixer, out_dir=tmp_path / "cut", resume=True, **kw)
    finally:
        torch.use_deterministic_algorithms(False)
    a, b = full["model"].state_dict(), resumed["model"].state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the run really moved away from its initial weights (the equality is not vacuous)
    init = T.build_model("digits", variant, mixer, in_chans=1, num_classes=10, seed=5,
                         **{**SMALL, **({"method": "rk4", "options": {"step_size": 0.5}} if variant == "ode" else {})})
    assert max(float((init.state_dict()[k] - a[k]).abs().max()) for k in a) > 1e-3
    sa = T.load_checkpoint(tmp_path / "full" / T.CHECKPOINT)["optimizer"]["state"]
    sb = T.load_checkpoint(tmp_path / "cut" / T.CHECKPOINT)["optimizer"]["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    lines = lambda d: [json.loads(x) for x in (tmp_path / d / T.METRICS).read_text().splitlines()]
    la, lb = lines("full"), lines("cut")
    assert [r["epoch"] for r in lb] == [1, 2, 3]
    for ra, rb in zip(la, lb):
        assert (ra["train_loss"], ra["test_acc"], ra["lr"]) == (rb["train_loss"], rb["test_acc"], rb["lr"])


class DropoutViT(ViT):
    """A ViT whose training draws from the global torch RNG: dropout on the embedded tokens."""

    def forward(self, images):
        x = F.dropout(self.embed(images), p=0.3, training=self.training)
        return self.forward_head(self.forward_features(x))


def test_resume_is_exact_when_training_draws_from_the_global_rng(tmp_path):
    """Dropout draws from torch's global generator: interrupted after epoch 1 of 3 and resumed (after
    something else reseeded the global RNG), the run equals the uninterrupted one bit for bit, which holds
    only because the checkpoint restores the RNG states; a different global seed gives different weights."""
    train_data, test_data = (d.subset(n) for d, n in zip(D.load_digits(), (64, 32)))
    cfg = small_cfg(epochs=3, crop_padding=0)
    spec = {"test": "dropout"}

    def fresh(global_seed):
        torch.manual_seed(5)
        model = DropoutViT("discrete", "ssog", img_size=8, patch_size=2, in_chans=1, num_classes=10, **SMALL)
        torch.manual_seed(global_seed)  # the global stream dropout will draw from
        return model

    kw = dict(cfg=cfg, spec=spec, progress=False)
    torch.use_deterministic_algorithms(True)
    try:
        full = fresh(0)
        T.train(full, train_data, test_data, out_dir=tmp_path / "full", **kw)

        def stop(epoch, record):
            if epoch == 1:
                raise Interrupted

        with pytest.raises(Interrupted):
            T.train(fresh(0), train_data, test_data, out_dir=tmp_path / "cut", on_epoch_end=stop, **kw)
        resumed = fresh(123)  # the resumed process starts from another global RNG state
        T.train(resumed, train_data, test_data, out_dir=tmp_path / "cut", resume=True, **kw)
        other = fresh(1)
        T.train(other, train_data, test_data, out_dir=tmp_path / "other", **kw)
    finally:
        torch.use_deterministic_algorithms(False)
    a, b, c = full.state_dict(), resumed.state_dict(), other.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # dropout's draws matter: another global stream trains to other weights, so the equality is not vacuous
    assert max(float((a[k] - c[k]).abs().max()) for k in a) > 1e-6


# -------------------------------------------------------------------------------- multi-process
def test_two_gloo_processes_equal_one_process(tmp_path):
    """torchrun, 2 CPU processes, gloo, global batch 16 (8 per process), 4 steps in float64: parameters
    equal a single-process run on the same global batches to 1e-6; only rank 0 writes."""
    common = ["--variant", "looped", "--mixer", "ssog", "--epochs", "1", "--batch-size", "16", "--lr", "3e-3",
              "--crop-padding", "1", "--limit-train", "64", "--limit-test", "32", "--dtype", "float64",
              "--seed", "2", "--device", "cpu", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "experiments" / "train.py"), *common, "--out", str(tmp_path / "ddp")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ddp = T.load_checkpoint(tmp_path / "ddp" / T.CHECKPOINT)
    single = T.run("digits", "looped", "ssog", data="digits",
                   cfg=T.TrainConfig(epochs=1, batch_size=16, lr=3e-3, crop_padding=1, seed=2,
                                     warmup_epochs=T.TrainConfig.warmup_epochs),
                   out_dir=tmp_path / "one", device="cpu", dtype=torch.float64, progress=False,
                   limit_train=64, limit_test=32)
    one = single["model"].state_dict()
    init = T.build_model("digits", "looped", "ssog", in_chans=1, num_classes=10, seed=2, dtype=torch.float64)
    moved = max(float((init.state_dict()[k] - one[k]).abs().max()) for k in one)
    assert moved > 1e-3  # 4 AdamW steps moved the weights: the comparison below is not vacuous
    for k in one:
        torch.testing.assert_close(ddp["model"][k], one[k], rtol=0, atol=1e-6, msg=k)
    h_ddp, h_one = ddp["history"][-1], single["history"][-1]
    assert h_ddp["train_loss"] == pytest.approx(h_one["train_loss"], abs=1e-9)
    assert h_ddp["test_acc"] == h_one["test_acc"]
    assert len((tmp_path / "ddp" / T.METRICS).read_text().splitlines()) == 1  # rank 0 only
    result = json.loads((tmp_path / "ddp" / "result.json").read_text())
    assert result["world_size"] == 2


def load_script():
    from lipcheck.commands import train
    return train


# ---------------------------------------------------------------------------------- bad inputs
def test_missing_data_directory(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"cifar-100-python/train, cifar-100-python/test, cifar-100-python/meta"):
        T.run("ti", "discrete", "ssog", data="cifar100", data_dir=tmp_path / "absent", cfg=small_cfg(),
              progress=False)
    # the script turns bad input into a one-line error and exit status 2, not a traceback
    rc = load_script().main(["--data", "cifar100", "--data-dir", str(tmp_path / "absent"), "--variant", "looped",
                             "--out", str(tmp_path / "run")])
    assert rc == 2 and "cifar-100-python/meta" in capsys.readouterr().err


def test_resolution_mismatch_is_a_clear_error():
    tr, _ = D.load_digits()
    model = T.build_model("tiny", "discrete", "ssog", in_chans=1, num_classes=10)  # built for 32x32
    with pytest.raises(ValueError, match=r"8x8 but the model was built for 32x32.*--resize"):
        T.check_resolution(model, tr, resize=False)
    T.check_resolution(model, tr, resize=True)  # resampled: accepted
    assert T.prepare(tr.images[:2], tr, 32).shape == (2, 1, 32, 32)
    with pytest.raises(ValueError, match="multiple of patch_size"):
        T.build_model("digits", "discrete", "ssog", in_chans=1, num_classes=10, patch_size=3)
    rgb = T.build_model("digits", "discrete", "ssog", in_chans=3, num_classes=10)
    with pytest.raises(ValueError, match="in_chans=1"):
        T.check_resolution(rgb, tr, resize=False)


def test_synthetic_cifar_trains_end_to_end(tmp_path):
    """The CIFAR path (uint8 pickles, 100 classes, 32x32 resampled to the preset) runs and checkpoints."""
    D.write_synthetic_cifar(tmp_path / "data", n_train=32, n_test=16)
    res = T.run("tiny", "looped", "attention", data="cifar100", data_dir=tmp_path / "data",
                cfg=small_cfg(epochs=1, resize=True, flip=True), out_dir=tmp_path / "run", progress=False,
                img_size=16)
    assert res["model"].head.out_features == 100 and res["model"].img_size == 16
    assert T.load_checkpoint(tmp_path / "run" / T.CHECKPOINT)["epoch"] == 1


def _tiny_state():
    model = T.build_model("digits", "looped", "ssog", in_chans=1, num_classes=10, **SMALL)
    return {"model": model.state_dict(), "optimizer": {}, "scheduler": {}, "scaler": {}, "epoch": 1,
            "rng": T.rng_states(), "spec": {}, "history": []}


def test_corrupt_and_incomplete_checkpoints(tmp_path):
    path = tmp_path / T.CHECKPOINT
    path.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(T.CheckpointError, match="corrupt or unreadable"):
        T.load_checkpoint(path)
    T.save_checkpoint(_tiny_state(), path)
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])  # truncated, as by a crash of a non-atomic writer
    with pytest.raises(T.CheckpointError, match=str(path)):
        T.load_checkpoint(path)
    torch.save({"model": {}}, path)
    with pytest.raises(T.CheckpointError, match="incomplete"):
        T.load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="without --resume"):
        T.load_checkpoint(tmp_path / "none.pt")
    # resuming a run from a corrupt checkpoint fails loudly through the training entry point
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / T.CHECKPOINT).write_bytes(b"junk")
    with pytest.raises(T.CheckpointError):
        T.run("digits", "discrete", "ssog", cfg=small_cfg(), out_dir=run_dir, resume=True, progress=False,
              limit_train=16, limit_test=16, **SMALL)


def test_resume_refuses_a_different_run(tmp_path):
    kw = dict(cfg=small_cfg(epochs=1), out_dir=tmp_path, progress=False, limit_train=16, limit_test=16, **SMALL)
    T.run("digits", "discrete", "ssog", **kw)
    with pytest.raises(T.CheckpointError, match="different run"):
        T.run("digits", "discrete", "attention", resume=True, **kw)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    """A write interrupted half-way (error or KeyboardInterrupt) leaves the previous checkpoint intact
    and no temporary file behind."""
    path = tmp_path / T.CHECKPOINT
    first = _tiny_state()
    T.save_checkpoint(first, path)
    before = path.read_bytes()
    real_save = torch.save

    for exc in (OSError("disk full"), KeyboardInterrupt()):
        def broken_save(obj, f, *a, **k):
            f.write(b"partial bytes")
            raise exc

        monkeypatch.setattr(T.torch, "save", broken_save)
        with pytest.raises(type(exc)):
            T.save_checkpoint({**first, "epoch": 2}, path)
        monkeypatch.setattr(T.torch, "save", real_save)
        assert path.read_bytes() == before
        assert T.load_checkpoint(path)["epoch"] == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == [T.CHECKPOINT]


# ---------------------------------------------------------------------------------- the script
def test_compare_script_writes_a_consistent_report(tmp_path):
    rc = load_script().main(["--compare", "--quick", "--variant", "discrete", "--epochs", "1", "--limit-train", "48",
                   "--docs", str(tmp_path), "--no-progress", "--json", str(tmp_path / "copy.json")])
    assert rc == 0
    data = json.loads((tmp_path / "data" / "training.json").read_text())
    assert json.loads((tmp_path / "copy.json").read_text()) == data
    runs = {r["mixer"]: r for r in data["runs"]}
    assert set(runs) == {"ssog", "attention"}
    (d,) = data["paired"]
    assert d["delta_mean"] == pytest.approx(100 * (runs["ssog"]["test_acc"] - runs["attention"]["test_acc"]))
    # parameter counts in the report equal those of freshly built models
    for m in ("ssog", "attention"):
        model = T.build_model("digits", "discrete", m, in_chans=1, num_classes=10, device="meta")
        assert runs[m]["params"] == sum(p.numel() for p in model.parameters())
    presets = {(p["preset"], p["variant"]): p for p in data["presets"]}
    C, h, M, depth = 192, 3, 4, 12  # ti: attention has q,k projections (2C^2 + 2C) per block; SSoG 5hM Gaussians
    assert presets["ti", "discrete"]["saved"] == depth * (2 * C * C + 2 * C + C - 5 * h * M)
    md = (tmp_path / "training.md").read_text()
    assert "8.8-16.6%" in md and (tmp_path / "figures" / "training_curves.png").exists()
    # the first seed is monitored: one record per epoch, SSoG bounds for every SSoG layer, L(R) for attention
    assert len(runs["ssog"]["monitor"]) == 1 and len(runs["ssog"]["monitor"][0]["ssog_upper"]) == 4
    assert len(runs["attention"]["monitor"][0]["attention_L"]) == 4 and "ssog_upper" not in runs["attention"]["monitor"][0]
    assert "Constants during training" in md and (tmp_path / "figures" / "training_monitor.png").exists()


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    """torch, numpy and python RNG states survive save/load: the draws after restoring repeat exactly."""
    import random

    import numpy as np

    torch.manual_seed(11), np.random.seed(11), random.seed(11)
    T.save_checkpoint({**_tiny_state(), "rng": T.rng_states()}, tmp_path / T.CHECKPOINT)
    first = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)], np.random.randn(1))
    T.set_rng_states(T.load_checkpoint(tmp_path / T.CHECKPOINT)["rng"])
    again = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)], np.random.randn(1))
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    assert first[2] == again[2] and np.array_equal(first[3], again[3])
