"""The ViT variants: the linear ODE against the matrix exponential, training on a fixed batch,
weight sharing, position-embedding resampling, and every bad input of SPEC section 6 they touch."""
import contextlib
import math

import numpy as np

import pytest
import scipy.linalg
import torch

import lipcheck
from lipcheck import IntegrationError, ViT, vit_from_preset
from lipcheck.models.ode import integrate

D = torch.float64
SMALL = dict(img_size=16, patch_size=4, dim=12, depth=2, num_heads=3, num_classes=5, num_components=2)


def linear_field_matrix(layer, H, W):
    """T = sum_h kron(K_h, P_h^T) acting on the row-major vec of X (N, C)."""
    K = layer.operator_matrix(H, W).detach()
    P = layer.head_projections().detach()
    return sum(torch.kron(K[h].contiguous(), P[h].T.contiguous()) for h in range(layer.num_heads)).numpy()


@pytest.mark.parametrize("method,opts", [("dopri5", {}), ("dopri8", {}), ("rk4", {"step_size": 0.01})])
def test_linear_ode_matches_expm(method, opts):
    torch.manual_seed(0)
    model = ViT("ode", "ssog", dtype=D, use_norm=False, use_mlp=False, t1=1.0, **{**SMALL, "img_size": 12})
    layer = model.vector_field.block.mixer.freeze_kernels()
    with torch.no_grad():  # O(1) weights so the flow moves the state visibly
        for p in (layer.v_proj.weight, layer.o_proj.weight):
            p.normal_(std=0.3)
        layer.o_proj.bias.normal_()
    x0 = model.embed(torch.randn(1, 3, 12, 12, dtype=D)).detach()
    _, H, W, C = x0.shape
    T = linear_field_matrix(layer, H, W)
    b = np.tile(layer.o_proj.bias.detach().numpy(), H * W)
    n = T.shape[0]
    A = np.zeros((n + 1, n + 1))  # x' = T x + b as a homogeneous linear system
    A[:n, :n], A[:n, n] = T, b
    t = torch.tensor([0.0, 0.5, 1.0], dtype=D)
    if method != "rk4":  # land steps on the output times: torchdiffeq's dopri8 dense output is only 4th order
        opts = {**opts, "step_t": t}
    sol = integrate(model.vector_field, x0, t, method=method, rtol=1e-12, atol=1e-12, options=opts)
    for k, tk in enumerate(t.tolist()):
        exact = (scipy.linalg.expm(A * tk) @ np.append(x0.numpy().ravel(), 1.0))[:n]
        err = np.abs(sol[k].detach().numpy().ravel() - exact).max()
        assert err < 1e-9 * max(1.0, np.abs(exact).max()), (k, err)
    assert np.abs(exact - x0.numpy().ravel()).max() > 0.1  # the flow actually moved


@pytest.mark.parametrize("variant", ["discrete", "looped", "ode"])
@pytest.mark.parametrize("mixer", ["ssog", "attention"])
def test_every_variant_and_mixer_trains(variant, mixer):
    torch.manual_seed(1)
    model = ViT(variant, mixer, **SMALL, method="rk4", options={"step_size": 0.5})
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(100):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert min(losses[-5:]) <= 0.5 * losses[0], (losses[0], losses[-5:])


def test_looped_shares_one_block_and_discrete_has_depth_blocks():
    torch.manual_seed(0)
    looped = ViT("looped", "ssog", **SMALL, dtype=D)
    discrete = ViT("discrete", "ssog", **SMALL, dtype=D)
    assert len(looped.blocks) == 1 and len(discrete.blocks) == SMALL["depth"]
    x = looped.embed(torch.randn(2, 3, 16, 16, dtype=D))
    y = x
    for _ in range(SMALL["depth"]):
        y = looped.blocks[0](y)
    assert torch.equal(looped.forward_features(x), y)


def test_ode_variant_counts_nfe_and_converges_to_tight_solution():
    torch.manual_seed(0)
    model = vit_from_preset("tiny", "ode", "ssog", dtype=D)
    assert model.t1 == 1.0 and model.img_size == 32
    x0 = model.embed(torch.randn(2, 3, 32, 32, dtype=D)).detach()
    t = torch.tensor([0.0, model.t1], dtype=D)
    ref = integrate(model.vector_field, x0, t, method="dopri8", rtol=1e-12, atol=1e-12)[-1]
    model.flow.rtol = model.flow.atol = 1e-6
    out = model.flow(x0)
    assert model.flow.last_nfe > 6 and model.flow.last_nfe % 6 == 2  # dopri5: 2 initial + 6 per step
    assert (out - ref).norm() / ref.norm() < 1e-5


def test_position_embedding_resamples_to_other_resolutions():
    model = ViT("discrete", "ssog", **SMALL)
    assert model(torch.randn(1, 3, 24, 20)).shape == (1, 5)
    assert torch.equal(model.patch_embed.resampled_pos(4, 4), model.patch_embed.pos)


# --- bad input (SPEC section 6) ---------------------------------------------------------------

def test_image_size_not_multiple_of_patch():
    with pytest.raises(ValueError, match="multiple of the patch"):
        ViT("discrete", "ssog", **SMALL)(torch.randn(1, 3, 18, 16))
    with pytest.raises(ValueError, match="img_size"):
        ViT("discrete", "ssog", **{**SMALL, "img_size": 18})


def test_grid_channel_mismatch():
    with pytest.raises(ValueError, match="C=12"):
        lipcheck.SSoG(12, 3)(torch.randn(1, 4, 4, 10))
    with pytest.raises(ValueError, match="C=12"):
        lipcheck.DenseAttention(12, 3)(torch.randn(1, 4, 4, 10))
    with pytest.raises(ValueError, match="in_chans"):
        ViT("discrete", "ssog", **SMALL)(torch.randn(1, 1, 16, 16))


def test_dim_not_divisible_by_heads():
    for make in (lambda: lipcheck.SSoG(10, 3), lambda: lipcheck.DenseAttention(10, 3),
                 lambda: ViT("discrete", "ssog", **{**SMALL, "num_heads": 5})):
        with pytest.raises(ValueError, match="divisible by num_heads"):
            make()


def test_non_positive_sigma():
    layer = lipcheck.SSoG(6, 2, 2)
    with pytest.raises(ValueError, match="sigma must be > 0"):
        layer.set_gaussian_params(sigma=-torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="shape"):
        layer.set_gaussian_params(alpha=torch.ones(3))


def test_unknown_names():
    with pytest.raises(ValueError, match="variant"):
        ViT("recurrent", "ssog", **SMALL)
    with pytest.raises(ValueError, match="mixer"):
        ViT("discrete", "mamba", **SMALL)
    with pytest.raises(ValueError, match="preset"):
        vit_from_preset("xl")
    with pytest.raises(ValueError, match="solver method"):
        ViT("ode", "ssog", **SMALL, method="dopri7")
    with pytest.raises(TypeError, match="valid options"):
        ViT("discrete", "ssog", widht=3)


@pytest.mark.parametrize("tol", [0.0, -1e-6, float("nan")])
def test_non_positive_tolerance(tol):
    model = ViT("ode", "ssog", **SMALL, dtype=D)
    x0 = torch.zeros(1, 4, 4, 12, dtype=D)
    with pytest.raises(ValueError, match="rtol"):
        integrate(model.vector_field, x0, torch.tensor([0.0, 1.0], dtype=D), rtol=tol)


def test_non_finite_initial_state():
    model = ViT("ode", "ssog", **SMALL, dtype=D)
    x0 = torch.zeros(1, 4, 4, 12, dtype=D)
    x0[0, 1, 1, 1] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        integrate(model.vector_field, x0, torch.tensor([0.0, 1.0], dtype=D))


def test_solver_failures_raise_integration_error():
    torch.manual_seed(0)
    model = ViT("ode", "ssog", **SMALL, dtype=D)
    x0 = model.embed(torch.randn(1, 3, 16, 16, dtype=D)).detach()
    t = torch.tensor([0.0, 1.0], dtype=D)
    with pytest.raises(IntegrationError, match="too many steps") as e:
        integrate(model.vector_field, x0, t, rtol=1e-12, atol=1e-12, options={"max_num_steps": 3})
    assert e.value.nfe > 0 and e.value.state_norm > 0 and 0 <= e.value.t <= 1
    # a field that blows up in finite time: x' = x^2 (elementwise) reaches inf before t = 1
    block = model.vector_field.block
    block.vector_field = lambda x: x * x
    with pytest.raises(IntegrationError) as e:
        integrate(model.vector_field, torch.full_like(x0, 4.0), t, rtol=1e-6, atol=1e-6)
    assert "underflow" in str(e.value) or "non-finite" in str(e.value)
    assert e.value.t < 1.0


def test_adjoint_gradients_match_backprop_through_the_solver():
    torch.manual_seed(0)
    images = torch.randn(2, 3, 16, 16, dtype=D)
    grads = []
    for adjoint in (False, True):
        torch.manual_seed(3)
        model = ViT("ode", "ssog", **SMALL, dtype=D, rtol=1e-10, atol=1e-10, adjoint=adjoint)
        model(images).square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-6, atol=1e-8)


def test_mlp_token_slices_equal_the_whole_product():
    """Without autograd the MLP runs in slices of tokens; every row must equal the one-shot product."""
    from lipcheck.models.vit import Mlp
    torch.manual_seed(0)
    mlp = Mlp(6, 24, dtype=torch.float64)
    mlp.chunk_tokens = 7
    mlp.chunk_min_bytes = 0  # slice even this small activation
    x = torch.randn(2, 5, 3, 6, dtype=torch.float64)  # 30 tokens: four full slices and a partial one
    whole = mlp.fc2(torch.nn.functional.gelu(mlp.fc1(x)))
    with torch.no_grad():
        sliced = mlp(x)
    assert sliced.shape == whole.shape
    assert torch.allclose(sliced, whole, rtol=0, atol=1e-14)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("hooked", [False, True])
def test_mlp_token_slices_in_place_and_through_modules(bias, hooked):
    """Both slicing paths (buffers written in place for plain Linear layers; the modules themselves when a hook
    is registered) equal the one-shot product row by row, with and without biases, and the hooks see every slice."""
    from lipcheck.models.vit import Mlp
    torch.manual_seed(1)
    mlp = Mlp(5, 20, dtype=torch.float64)
    if not bias:
        mlp.fc1.bias, mlp.fc2.bias = None, None
    mlp.chunk_tokens, mlp.chunk_min_bytes = 8, 0
    seen = []
    if hooked:
        mlp.fc2.register_forward_hook(lambda mod, inp, out: seen.append(out.shape[0]))
    x = torch.randn(3, 4, 2, 5, dtype=torch.float64)  # 24 tokens: three slices of 8
    w1, w2 = mlp.fc1.weight, mlp.fc2.weight
    b1 = mlp.fc1.bias if bias else torch.zeros(20, dtype=torch.float64)
    b2 = mlp.fc2.bias if bias else torch.zeros(5, dtype=torch.float64)
    u = x.reshape(-1, 5) @ w1.T + b1
    gelu = 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))
    expect = (gelu @ w2.T + b2).reshape(3, 4, 2, 5)
    with torch.no_grad():
        got = mlp(x)
    assert torch.allclose(got, expect, rtol=0, atol=1e-13)
    assert seen == ([8, 8, 8] if hooked else [])


def test_mlp_token_slices_under_autocast():
    """Sliced and one-shot MLP agree under bfloat16 autocast too (the slices take autocast's dtype)."""
    from lipcheck.models.vit import Mlp
    torch.manual_seed(0)
    mlp = Mlp(8, 32)
    mlp.chunk_tokens = 16
    mlp.chunk_min_bytes = 0
    x = torch.randn(1, 9, 7, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        sliced = mlp(x)
        whole = mlp.fc2(torch.nn.functional.gelu(mlp.fc1(x)))
    assert sliced.dtype == whole.dtype == torch.bfloat16
    assert torch.equal(sliced, whole)


def test_mlp_slices_only_above_the_activation_size():
    """The token-slicing path runs only when the whole hidden activation exceeds chunk_min_bytes
    (and never with autograd); counted through fc1's calls."""
    from lipcheck.models.vit import Mlp
    mlp = Mlp(4, 16, dtype=torch.float64)
    mlp.chunk_tokens = 10
    calls = []
    mlp.fc1.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(1, 5, 8, 4, dtype=torch.float64)  # 40 tokens, hidden activation 40 * 16 * 8 = 5120 bytes
    for limit, grad, expect in ((5120, False, 1), (5119, False, 4), (0, True, 1)):
        mlp.chunk_min_bytes = limit
        calls.clear()
        with torch.set_grad_enabled(grad):
            mlp(x)
        assert len(calls) == expect, (limit, grad, len(calls))


@pytest.mark.parametrize("variant", ["discrete", "looped", "ode"])
@pytest.mark.parametrize("backend", ["stacked", "truncated", "auto"])
def test_batched_kernel_refresh_equals_layer_by_layer(variant, backend, monkeypatch):
    """The ViT evaluates every block's kernels at once (ssog.prepared_kernels) and builds the stacked factors
    once per forward, from one autograd node: over two SGD steps (the second after every kernel changed), with
    some kernels frozen, its outputs and every gradient equal those of the same model evaluated call by call."""
    import lipcheck.models.vit as vit_mod

    def build():
        torch.manual_seed(3)
        m = ViT(variant, "ssog", img_size=24, patch_size=4, dim=12, depth=3, num_heads=3, num_classes=5,
                ssog_backend=backend, dtype=torch.float64, method="rk4", options={"step_size": 0.5})
        if variant == "discrete":
            m.blocks[1].mixer.mu.requires_grad_(False)  # a block whose offsets do not train: its own group
        return m

    x = torch.randn(2, 3, 24, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    runs = {}
    for batched in (True, False):
        if not batched:
            monkeypatch.setattr(vit_mod, "prepared_kernels", lambda layers, H, W: contextlib.nullcontext())
        m = build()
        outs, grads = [], []
        for _ in range(2):
            y = m(x)
            y.square().sum().backward()
            outs.append(y.detach())
            grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-1e-2)
                        p.grad = None
        for _ in range(2):  # unchanged parameters: no factors (or graph) of an earlier forward are reused
            m(x).sum().backward()
        blk = m.blocks[0] if variant != "ode" else m.vector_field.block
        blk.mixer(torch.randn(1, 6, 6, 12, dtype=torch.float64)).sum().backward()  # the layer on its own too
        runs[batched] = (outs, grads)
    (o1, g1), (o2, g2) = runs[True], runs[False]
    for a, b in zip(o1, o2):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(g1, g2):
        assert a.keys() == b.keys() and any(n.endswith("mixer.mu") for n in a)
        assert variant != "discrete" or ("blocks.1.mixer.mu" not in a and "blocks.0.mixer.mu" in a)
        for n in a:
            assert torch.allclose(a[n], b[n], rtol=1e-10, atol=1e-12), n


def test_prepared_factors_are_served_only_for_the_parameters_they_were_made_from():
    """Inside `prepared_kernels` a training layer mixes with the factors made on entry only while its kernel
    parameters are the same tensors at the same versions: after an in-place edit (with autograd on or off) or a
    swapped parameter, its output is the dense operator of its current kernels (built in the test); on leaving
    the block nothing of them is left on the layer."""
    from lipcheck.mixers.ssog import SSoG, prepared_kernels

    torch.manual_seed(5)
    H, W, C, h = 5, 4, 6, 2
    layers = [SSoG(C, h, 3, backend="stacked", dtype=torch.float64) for _ in range(2)]
    v = torch.randn(2, H, W, h, C // h, dtype=torch.float64)

    def dense(layer):  # sum_m alpha_m G_H^m v G_W^m^T per head, from gaussian.kernel
        a, m, s = (t.detach() for t in layer.gaussian_params())
        out = torch.zeros_like(v)
        for i in range(h):
            for c in range(a.shape[1]):
                ky = torch.arange(H, dtype=torch.float64)
                kx = torch.arange(W, dtype=torch.float64)
                GH = lipcheck.gaussian.kernel(ky[:, None] - ky[None, :], m[i, c, 0], s[i, c, 0])
                GW = lipcheck.gaussian.kernel(kx[:, None] - kx[None, :], m[i, c, 1], s[i, c, 1])
                out[..., i, :] += a[i, c] * torch.einsum("ik,bkle,jl->bije", GH, v[..., i, :], GW)
        return out

    with prepared_kernels(layers, H, W):
        assert all("_live" in layer.__dict__ for layer in layers)
        y = layers[0].mix_values(v)
        assert y.requires_grad and torch.allclose(y, dense(layers[0]), rtol=1e-12, atol=1e-14)
        v2 = torch.randn(1, H + 1, W, h, C // h, dtype=torch.float64)  # another grid: made afresh
        ref = SSoG(C, h, 3, backend="stacked", dtype=torch.float64)
        ref.load_state_dict(layers[0].state_dict())
        assert torch.allclose(layers[0].mix_values(v2), ref.mix_values(v2), rtol=1e-12, atol=1e-14)
        with torch.no_grad():
            layers[0].mu.add_(0.25)  # in place: a new version
        assert torch.allclose(layers[0].mix_values(v), dense(layers[0]), rtol=1e-12, atol=1e-14)
        swapped = torch.nn.Parameter(layers[1].sigma_raw.detach() + 0.5)  # another tensor at the same version
        with torch.no_grad():
            while swapped._version < layers[1].sigma_raw._version:
                swapped.add_(0.0)
        assert swapped._version == layers[1].sigma_raw._version
        layers[1].sigma_raw = swapped
        assert torch.allclose(layers[1].mix_values(v), dense(layers[1]), rtol=1e-12, atol=1e-14)
    with prepared_kernels(layers, H, W):
        with torch.no_grad():
            y = layers[0].mix_values(v)
        assert not y.requires_grad and torch.allclose(y, dense(layers[0]), rtol=1e-12, atol=1e-14)
        with torch.no_grad():
            layers[0].alpha.mul_(2.0)
        assert torch.allclose(layers[0].mix_values(v), dense(layers[0]), rtol=1e-12, atol=1e-14)
    assert not any("_live" in layer.__dict__ for layer in layers)


def test_batched_kernel_refresh_refuses_an_unrepresentable_block():
    """One block's kernel that float16 cannot carry is refused by the batched check as by the layer's own."""
    m = ViT("discrete", "ssog", img_size=16, patch_size=4, dim=8, depth=2, num_heads=2, num_classes=3,
            ssog_backend="stacked", dtype=torch.float16)
    with torch.no_grad():
        m.blocks[1].mixer.sigma_raw.fill_(-30.0)  # sigma = 1e-3 + softplus(-30): 2 sigma^2 below float16's normals
    for grad in (False, True):  # inference: the kernel caches; training: the factors made from the parameters
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="not representable"):
            m(torch.randn(1, 3, 16, 16, dtype=torch.float16))
