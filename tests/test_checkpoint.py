"""Trained checkpoints through the verdicts: `lipcheck.load` round trips, `certify --checkpoint` equals the
library on the in-memory model, the training monitor's bound equals ssog_lipschitz on the saved weights
(and does not change training), foreign modules probe like lipcheck's own, and every bad input stops
with one line naming the fix (exit status 2, nothing overwritten)."""
import importlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import lipcheck
from lipcheck import checkpoint as C
from lipcheck import data as D
from lipcheck import probe as P
from lipcheck import train as T
from lipcheck import verdicts as V
from lipcheck.bounds import ssog_lipschitz
from lipcheck.mixers.ssog import operator_matrices

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(dim=8, depth=2, num_heads=2, num_components=2, patch_size=4)  # digits on a 2x2 grid, width 8: cheap
CHEAP_MONITOR = dict(n_images=2, radii=(1.0, 8.0), probe=dict(restarts=2, steps=2, certify_steps=10, certify_top=1),
                     times=3)


def script(name):
    from lipcheck.cli import command_module
    return command_module(name)  # a capability by its name or an older alias


def _run(out, variant, mixer, monitor=True):
    cfg = T.TrainConfig(epochs=1, batch_size=16, lr=3e-3, warmup_epochs=1, crop_padding=1, seed=3)
    return T.run("digits", variant, mixer, cfg=cfg, out_dir=out, progress=False, limit_train=32, limit_test=16,
                 monitor=V.Monitor(**CHEAP_MONITOR) if monitor else None, **SMALL)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("runs")
    out = {k: _run(root / f"{k[0]}-{k[1]}", *k) for k in (("discrete", "ssog"), ("discrete", "attention"))}
    out["root"] = root
    yield out
    torch.set_num_threads(n)


def dense_ssog_norm(layer, H, W) -> float:
    """||T||_2 from the dense matrix sum_h K_h (x) P_h^T built here (operator_matrix, v_proj, o_proj), float64."""
    h = layer.num_heads
    d = layer.v_proj.weight.shape[0] // h
    # the layer's effective (alpha, mu, sigma) as it computes them, then the dense kernel in float64
    K = operator_matrices(H, W, *(t.detach().double() for t in layer.gaussian_params()))
    WV, WO = layer.v_proj.weight.double().T.contiguous(), layer.o_proj.weight.double().T.contiguous()  # x W
    M = sum(torch.kron(K[i].contiguous(), (WV[:, i * d:(i + 1) * d] @ WO[i * d:(i + 1) * d, :]).T.contiguous())
            for i in range(h))
    return float(torch.linalg.matrix_norm(M, 2))


# ------------------------------------------------------------------------------------------ round trip
def test_load_rebuilds_the_trained_model(runs):
    res = runs[("discrete", "ssog")]
    ck = lipcheck.load(runs["root"] / "discrete-ssog")  # the run directory stands for its checkpoint.pt
    assert (ck.variant, ck.mixer, ck.grid, ck.epoch, ck.data["name"], ck.data["channels"]) == \
        ("discrete", "ssog", (2, 2), 1, "digits", 1)
    a, b = res["model"].state_dict(), ck.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not ck.model.training
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(ck.model(x), res["model"].eval()(x))
    # the initial weights: the run's seed rebuilds exactly what training started from, and training moved them
    init = T.build_model("digits", "discrete", "ssog", in_chans=1, num_classes=10, seed=3, **SMALL).state_dict()
    i2 = ck.initial_model().state_dict()
    assert all(torch.equal(init[k], i2[k]) for k in init)
    assert max(float((init[k] - a[k]).abs().max()) for k in a) > 1e-4


def test_certify_checkpoint_equals_the_library_on_the_in_memory_model(runs, tmp_path, one_thread):
    out = tmp_path / "certify.json"
    rc = script("lipschitz").main(["--checkpoint", str(runs["root"] / "discrete-ssog"), "--json", str(out),
                                   "--no-progress", "--quick"])
    assert rc == 0
    rows = json.loads(out.read_text())["ssog"]
    model = runs[("discrete", "ssog")]["model"]
    layers = [m for m in model.modules() if isinstance(m, lipcheck.SSoG)]
    assert len(layers) == 2 and len(rows) == 2 * 3  # every layer at the model's 2x2 grid, 4x4 and 8x8
    assert {(r["H"], r["W"]) for r in rows} == {(2, 2), (4, 4), (8, 8)}
    names = [n for n, m in model.named_modules() if isinstance(m, lipcheck.SSoG)]
    for r in rows:
        layer = layers[names.index(r["layer"])]
        ref = ssog_lipschitz(layer, r["H"], r["W"], seed=r["seed"])  # the recorded seed replays the run
        for k in ("lower", "upper", "upper_probabilistic", "resolution_free"):
            assert r[k] == getattr(ref, k), (r["layer"], r["H"], k)
        exact = dense_ssog_norm(layer, r["H"], r["W"])  # independent: dense matrix and SVD here
        assert r["lower"] <= exact * (1 + 1e-12) and exact <= r["upper"] * (1 + 1e-12)
        assert exact <= r["resolution_free"] * (1 + 1e-12)


def test_monitor_bound_is_ssog_lipschitz_on_the_saved_weights_and_does_not_change_training(runs, tmp_path,
                                                                                           one_thread):
    res = runs[("discrete", "ssog")]
    rec = res["history"][-1]["monitor"]
    ck = lipcheck.load(runs["root"] / "discrete-ssog")
    layers = V.ssog_layers(ck.model)
    assert rec["ssog_layers"] == [n for n, _ in layers]
    assert rec["ssog_upper"] == [ssog_lipschitz(l, 2, 2, **V.MONITOR_SSOG).upper for _, l in layers]
    for (_, layer), up in zip(layers, rec["ssog_upper"]):
        assert dense_ssog_norm(layer, 2, 2) <= up * (1 + 1e-12)
    # the checkpoint holds the monitored record too, and the local field constant is at most the global one
    assert T.load_checkpoint(ck.path)["history"][-1]["monitor"] == rec
    assert all(0 < l <= g for l, g in zip(rec["field_local"], rec["field_global"]))
    # the global RNG is restored around the monitor: the same run without it trains to the same weights
    bare = _run(tmp_path / "bare", "discrete", "ssog", monitor=False)["model"].state_dict()
    a = res["model"].state_dict()
    assert all(torch.equal(a[k], bare[k]) for k in a)


def test_monitor_of_an_attention_model_records_certified_growth(runs):
    rec = runs[("discrete", "attention")]["history"][-1]["monitor"]
    assert "ssog_upper" not in rec and rec["attention_radii"] == [1.0, 8.0]
    ck = lipcheck.load(runs["root"] / "discrete-attention")
    for (_, layer), curve in zip(V.attention_layers(ck.model), rec["attention_L"]):
        assert len(curve) == 2 and 0 < curve[0] <= curve[1]  # L(R) is nondecreasing in R
        # a certified lower bound: never above the Jacobian norm's sup, e.g. the bound on the ball of radius R
        from lipcheck.bounds.attention import attention_lipschitz_on_frobenius_ball
        for R, v in zip(rec["attention_radii"], curve):
            assert v <= attention_lipschitz_on_frobenius_ball(layer, R, ck.grid[0] * ck.grid[1]) * (1 + 1e-9)


# ------------------------------------------------------------------------------------------ bad input
def _cli(name, argv, capsys):
    rc = script(name).main(argv)
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize("name", ["lipschitz", "divergence", "attention_growth"])
def test_missing_and_corrupt_checkpoints_exit_2_and_overwrite_nothing(tmp_path, capsys, name):
    out = tmp_path / "numbers.json"
    out.write_text("old")
    rc, err = _cli(name, ["--checkpoint", str(tmp_path / "nope.pt"), "--json", str(out)], capsys)
    assert rc == 2 and "no checkpoint at" in err and "lipcheck train --out" in err and len(err.splitlines()) == 1
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(b"\x00not a checkpoint" * 8)
    rc, err = _cli(name, ["--checkpoint", str(bad), "--json", str(out)], capsys)
    assert rc == 2 and "corrupt or unreadable" in err and len(err.splitlines()) == 1
    assert out.read_text() == "old"


def _rewrite(src: Path, dst: Path, **changes) -> Path:
    state = torch.load(src / T.CHECKPOINT, weights_only=True)
    state.update(changes)
    dst.mkdir()
    torch.save(state, dst / T.CHECKPOINT)
    return dst


def test_newer_format_and_other_architectures_are_refused(runs, tmp_path):
    src = runs["root"] / "discrete-ssog"
    with pytest.raises(T.CheckpointError, match="newer than this lipcheck reads.*upgrade"):
        C.load(_rewrite(src, tmp_path / "new", format=T.FORMAT + 1))
    with pytest.raises(T.CheckpointError, match="not a lipcheck.ViT"):
        C.load(_rewrite(src, tmp_path / "timm", arch="timm.VisionTransformer"))
    cfg = dict(torch.load(src / T.CHECKPOINT, weights_only=True)["model_config"], dim=24)
    with pytest.raises(T.CheckpointError, match="do not fit a discrete/ssog ViT"):
        C.load(_rewrite(src, tmp_path / "wide", model_config=cfg))
    with pytest.raises(T.CheckpointError, match="variant 'pyramid'"):
        C.load(_rewrite(src, tmp_path / "pyr", variant="pyramid"))
    # a checkpoint written before the format was recorded is rebuilt from the run's spec
    state = torch.load(src / T.CHECKPOINT, weights_only=True)
    old = {k: v for k, v in state.items() if k not in ("format", "arch", "variant", "mixer", "model_config",
                                                       "data_info")}
    (tmp_path / "old").mkdir()
    torch.save(old, tmp_path / "old" / T.CHECKPOINT)
    ck = C.load(tmp_path / "old")
    assert ck.format == 0 and all(torch.equal(v, state["model"][k]) for k, v in ck.model.state_dict().items())


def test_a_verdict_that_does_not_apply_exits_2(runs, tmp_path, capsys):
    out = tmp_path / "numbers.json"
    rc, err = _cli("lipschitz", ["--checkpoint", str(runs["root"] / "discrete-attention"), "--json", str(out)], capsys)
    assert rc == 2 and "no SSoG layer" in err and "lipcheck probe --checkpoint" in err
    rc, err = _cli("attention_growth", ["--checkpoint", str(runs["root"] / "discrete-ssog"), "--json", str(out)],
                   capsys)
    assert rc == 2 and "no dense-attention layer" in err and "lipcheck certify --checkpoint" in err
    rc, err = _cli("divergence", ["--checkpoint", str(runs["root"] / "discrete-ssog"), "--json", str(out)], capsys)
    assert rc == 2 and "--variant ode" in err
    assert not out.exists()


def test_a_data_set_the_model_cannot_take_exits_2(runs, tmp_path, capsys):
    D.write_synthetic_cifar(tmp_path / "cifar", n_train=8, n_test=4)
    ck = C.load(runs["root"] / "discrete-ssog")
    with pytest.raises(ValueError, match="channels.*--data digits"):  # 3-channel CIFAR into a 1-channel model
        C.images(ck, data="cifar100", data_dir=tmp_path / "cifar")
    rc, err = _cli("lipschitz", ["--checkpoint", str(ck.path), "--data", "cifar100", "--data-dir",
                                 str(tmp_path / "cifar"), "--json", str(tmp_path / "x.json")], capsys)
    assert rc == 2 and "channels" in err and len(err.splitlines()) == 1 and not (tmp_path / "x.json").exists()
    # the images the model is fed are the training pipeline's: normalised with the training split's statistics
    x = C.images(ck, n=3)
    train, test = D.load_digits(dtype=torch.float64)
    ref = (test.images[:3].double() - train.mean.double()[None, :, None, None]) / train.std.double()[None, :, None, None]
    assert torch.allclose(x, ref, rtol=0, atol=1e-12)


def test_certify_and_probe_find_layers_in_any_model():
    class Wrapper(nn.Module):  # a foreign container: lipcheck layers somewhere inside
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(4, 4)
            self.inner = nn.Sequential(lipcheck.SSoG(8, 2, 2), nn.GELU(), lipcheck.DenseAttention(8, 2))
    m = Wrapper()
    assert [n for n, _ in V.ssog_layers(m)] == ["inner.0"]
    assert [n for n, _ in V.attention_layers(m)] == ["inner.2"]
    rows = V.certify_ssog(m, [(3, 3)])
    assert rows[0]["lower"] <= dense_ssog_norm(m.inner[0], 3, 3) * (1 + 1e-12) <= rows[0]["upper"] * (1 + 1e-12)
    with pytest.raises(ValueError, match="pass grid"):
        V.attention_curves(m, [1.0])
    with pytest.raises(ValueError, match="no lipcheck SSoG layer"):
        V.certify_ssog(nn.Linear(2, 2), [(2, 2)])


# -------------------------------------------------------------------------------------- foreign modules
class TimmAttention(nn.Module):
    """timm's Attention layout: one fused qkv Linear, (B, N, C) tokens, scaled dot product, proj."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-2, -1) / self.head_dim ** 0.5).softmax(-1)
        return self.proj((a @ v).transpose(1, 2).reshape(B, N, C))


class GridWrapper(nn.Module):
    """(B, H, W, C) -> (B, H, W, C) around a (B, N, C) token module: all the probe needs."""

    def __init__(self, inner, dim):
        super().__init__()
        self.inner, self.dim = inner, dim

    def forward(self, x):
        B, H, W, C = x.shape
        return self.inner(x.reshape(B, H * W, C)).reshape(B, H, W, C)


def test_probe_on_a_wrapped_foreign_module_agrees_with_dense_attention(one_thread):
    torch.manual_seed(0)
    C_, h = 8, 2
    ours = lipcheck.DenseAttention(C_, h, dtype=torch.float64)
    theirs = TimmAttention(C_, h).double()
    with torch.no_grad():  # copy the weights across the two layouts
        theirs.qkv.weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        theirs.qkv.bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.proj.weight.copy_(ours.o_proj.weight)
        theirs.proj.bias.copy_(ours.o_proj.bias)
    wrapped = GridWrapper(theirs, C_)
    X = torch.randn(3, 3, C_, dtype=torch.float64) * 4
    assert P.exact_jacobian_norm(wrapped, X) == pytest.approx(P.exact_jacobian_norm(ours, X), rel=1e-12)
    kw = dict(grid=(3, 3), restarts=3, steps=4, certify_steps=20, witnesses=False, device="cpu", seed=1)
    g_ours = P.attention_growth(ours, [1.0, 16.0], **kw)
    g_theirs = P.attention_growth(wrapped, [1.0, 16.0], **kw)
    assert g_theirs.lower == pytest.approx(g_ours.lower, rel=1e-8)
    # each reported value is the Jacobian norm in a direction at an actual input: below the norm there
    for R, L, Xr in zip(g_theirs.radii, g_theirs.lower, g_theirs.X):
        assert float(Xr.norm()) <= R and L <= P.exact_jacobian_norm(wrapped, Xr) * (1 + 1e-12)
    # the vector-field style lower bound accepts the foreign module too, and is below the exact norm
    lb = V.jacobian_lower_bound(wrapped, X[None], iters=30)["lower"]
    exact = P.exact_jacobian_norm(wrapped, X)
    assert lb <= exact * (1 + 1e-12) and lb >= 0.99 * exact
