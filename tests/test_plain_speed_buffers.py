"""SSoG's inference forward with its reused per-thread buffers (workspace.WORKSPACE_MAX_BYTES) against the dense
definition sum_h K_h X P_h + b: across calls with other inputs and shapes, in every layout that writes into the
buffers, under no_grad and inference mode, from two threads at once; and autograd untouched by them."""
import math
import threading

import pytest
import torch

from lipcheck import SSoG
from lipcheck.mixers import ssog, workspace
from lipcheck.mixers.backends import stacked

D = torch.float64
TOL = 1e-11


def random_ssog(C, h, M, seed):
    g = torch.Generator().manual_seed(seed)
    layer = SSoG(C, h, M, backend="stacked", dtype=D)
    with torch.no_grad():
        for p in (layer.v_proj.weight, layer.o_proj.weight, layer.o_proj.bias):
            p.copy_(torch.randn(p.shape, generator=g, dtype=D))
    alpha = torch.randn(h, M, generator=g, dtype=D)
    mu = (torch.rand(h, M, 2, generator=g, dtype=D) * 2 - 1) * 3.0
    sigma = torch.exp(torch.rand(h, M, 2, generator=g, dtype=D) * math.log(40) + math.log(0.15))
    layer.set_gaussian_params(alpha, mu, sigma)
    layer.thread_policy = None  # the thread count each case sets, not the policy's choice
    return layer


def dense_reference(layer, x):
    """sum_h K_h X P_h + b with plain matrices."""
    B, H, W, C = x.shape
    with torch.no_grad():
        K = layer.operator_matrix(H, W)
        d = C // layer.num_heads
        WV, WO = layer.v_proj.weight.T, layer.o_proj.weight.T
        X = x.reshape(B, H * W, C)
        out = sum(K[i] @ X @ (WV[:, i * d:(i + 1) * d] @ WO[i * d:(i + 1) * d, :]) for i in range(layer.num_heads))
        return (out + layer.o_proj.bias).reshape(B, H, W, C)


@pytest.fixture
def small_workspace(monkeypatch):
    """The buffers on grids small enough for the dense operator: every call above 0 tokens takes them."""
    monkeypatch.setattr(stacked, "FUSE_HEADS_TOKENS", 0)
    monkeypatch.setattr(workspace, "WORKSPACE_MAX_BYTES", 64 << 20)
    ssog.clear_workspace()
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    ssog.clear_workspace()


def _held():
    ws = ssog._WORKSPACE.__dict__.get("ws")
    return {} if ws is None else dict(ws.bufs)


# (threads, TRANSPOSED_MAX_TOKENS): the per-head layout with batch chunks (one thread), and the column blocks of
# batch 1 on large grids (two threads)
@pytest.mark.parametrize("threads, transposed_max", [(1, 10**9), (2, 0)])
@pytest.mark.parametrize("mode", ["no_grad", "inference"])
def test_reused_buffers_equal_dense_across_calls_and_shapes(small_workspace, monkeypatch, threads, transposed_max,
                                                           mode):
    monkeypatch.setattr(stacked, "TRANSPOSED_MAX_TOKENS", transposed_max)
    monkeypatch.setattr(stacked, "Y_COLUMN_BLOCKS", 2)
    torch.set_num_threads(threads)
    layer = random_ssog(12, 3, 2, seed=1)
    g = torch.Generator().manual_seed(2)
    shapes = [(1, 5, 8), (1, 6, 4), (1, 5, 8)] if threads > 1 else [(2, 5, 7), (1, 6, 4), (3, 5, 7), (2, 5, 7)]
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    kept = []
    for B, H, W in shapes:
        x = torch.randn(B, H, W, 12, dtype=D, generator=g)
        with ctx():
            y = layer(x)
        assert (y - dense_reference(layer, x)).abs().max() <= TOL * max(1.0, float(y.abs().max()))
        held = _held()
        assert "v" in held and "out" in held and "T" in held, "the call did not take the buffers"
        assert all(y.data_ptr() != t.data_ptr() for t in held.values())  # the result is the caller's own
        kept.append((x, y.clone(), y))
    for x, copy, y in kept:  # later calls wrote the buffers again; no earlier result changed
        assert torch.equal(copy, y)
    # the other mode on the buffers made in this one (made outside inference mode, both may write them)
    other = torch.inference_mode if mode == "no_grad" else torch.no_grad
    x = kept[0][0]
    with other():
        assert (layer(x) - dense_reference(layer, x)).abs().max() <= TOL * max(1.0, float(kept[0][1].abs().max()))


def test_float32_layer_matches_the_layer_without_buffers(small_workspace, monkeypatch):
    """Same GEMMs, written into buffers: bit for bit what the forward without them gives."""
    torch.set_num_threads(1)
    layer = random_ssog(16, 2, 3, seed=3).float()
    xs = [torch.randn(B, 9, 10, 16, generator=torch.Generator().manual_seed(B)) for B in (1, 2, 1)]
    with torch.no_grad():
        got = [layer(x) for x in xs]
        assert _held()["v"].dtype == torch.float32
        monkeypatch.setattr(workspace, "WORKSPACE_MAX_BYTES", 0)
        ref = [layer(x) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_autograd_never_sees_the_buffers(small_workspace):
    """With grad mode on no buffer is taken; a no_grad call between a forward and its backward (which does write
    the buffers) leaves the graph's saved tensors alone: gradients equal the dense definition's."""
    torch.set_num_threads(1)
    layer = random_ssog(12, 3, 2, seed=4)
    ref_layer = random_ssog(12, 3, 2, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 7, 12, dtype=D, generator=g, requires_grad=True)
    R = torch.randn(2, 5, 7, 12, dtype=D, generator=g)
    y = layer(x)
    assert not _held()
    with torch.no_grad():
        layer(torch.randn(2, 5, 7, 12, dtype=D, generator=g))
        layer(torch.randn(1, 6, 4, 12, dtype=D, generator=g))
    assert _held()
    (y * R).sum().backward()

    xr = x.detach().clone().requires_grad_(True)
    B, H, W, C = xr.shape
    K = ref_layer.operator_matrix(H, W)
    d = C // ref_layer.num_heads
    WV, WO = ref_layer.v_proj.weight.T, ref_layer.o_proj.weight.T
    X = xr.reshape(B, H * W, C)
    yr = sum(K[i] @ X @ (WV[:, i * d:(i + 1) * d] @ WO[i * d:(i + 1) * d, :]) for i in range(ref_layer.num_heads))
    ((yr + ref_layer.o_proj.bias).reshape(B, H, W, C) * R).sum().backward()
    pairs = [(x.grad, xr.grad)] + [(p.grad, q.grad) for p, q in zip(layer.parameters(), ref_layer.parameters())]
    for a, b in pairs:
        assert a is not None and (a - b).abs().max() <= 1e-10 * max(1.0, float(b.abs().max()))


def test_two_threads_calling_one_layer_each_use_their_own_buffers(small_workspace):
    layer = random_ssog(12, 3, 2, seed=6)
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(B, 5, 7, 12, dtype=D, generator=g) for B in (1, 2, 3, 1, 2, 3)]
    refs = [dense_reference(layer, x) for x in xs]
    errors, barrier = [], threading.Barrier(2)

    def work(order):
        try:
            barrier.wait()
            with torch.no_grad():
                for _ in range(20):
                    for i in order:
                        if (layer(xs[i]) - refs[i]).abs().max() > TOL * max(1.0, float(refs[i].abs().max())):
                            errors.append(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(o,)) for o in ([0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0])]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_a_call_while_the_buffers_are_in_use_gets_none():
    """A second call on the same thread while the first holds the buffers (a hook running another SSoG) gets none
    and allocates its own; the buffers come back after the first."""
    ssog.clear_workspace()
    key = (1, 2, 3)
    ws = ssog._take_workspace(key, 0)
    try:
        assert ws is not None and ssog._take_workspace(key, 0) is None
    finally:
        ssog._give_workspace(ws)
    again = ssog._take_workspace(key, 0)
    ssog._give_workspace(again)
    assert again is ws
    assert ssog._take_workspace(key, workspace.WORKSPACE_MAX_BYTES + 1) is None  # too large: never kept
    ssog.clear_workspace()
