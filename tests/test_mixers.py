"""SSoG against its dense definition sum_h K_h X P_h + b, gradients by finite differences, dense attention
against a hand-written softmax, and the exact parameter difference between matched blocks."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lipcheck import DenseAttention, SSoG
from lipcheck.mixers.ssog import ssog_mix
from lipcheck.models.vit import Block

D = torch.float64


def random_ssog(C, h, M, seed=0, mu_scale=3.0):
    g = torch.Generator().manual_seed(seed)
    layer = SSoG(C, h, M, dtype=D)
    with torch.no_grad():
        for p in (layer.v_proj.weight, layer.o_proj.weight, layer.o_proj.bias):
            p.copy_(torch.randn(p.shape, generator=g, dtype=D))
    alpha = torch.randn(h, M, generator=g, dtype=D)  # mixed signs
    mu = (torch.rand(h, M, 2, generator=g, dtype=D) * 2 - 1) * mu_scale  # non-integer offsets
    sigma = torch.exp(torch.rand(h, M, 2, generator=g, dtype=D) * math.log(40) + math.log(0.15))
    layer.set_gaussian_params(alpha, mu, sigma)
    return layer


def dense_reference(layer, x):
    """sum_h K_h X P_h + b, written from the definition with plain matrices."""
    B, H, W, C = x.shape
    K = layer.operator_matrix(H, W)
    d = C // layer.num_heads
    WV, WO = layer.v_proj.weight.T, layer.o_proj.weight.T
    out = torch.zeros(B, H * W, C, dtype=x.dtype)
    X = x.reshape(B, H * W, C)
    for hh in range(layer.num_heads):
        P = WV[:, hh * d:(hh + 1) * d] @ WO[hh * d:(hh + 1) * d, :]
        out += K[hh] @ X @ P
    return (out + layer.o_proj.bias).reshape(B, H, W, C)


@settings(deadline=None, max_examples=25)
@given(H=st.integers(1, 9), W=st.integers(1, 9), h=st.integers(1, 4), M=st.integers(1, 4),
       d=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_ssog_forward_equals_dense_reference(H, W, h, M, d, seed):
    layer = random_ssog(h * d, h, M, seed)
    x = torch.randn(2, H, W, h * d, dtype=D, generator=torch.Generator().manual_seed(seed + 1))
    assert torch.allclose(layer(x), dense_reference(layer, x), rtol=0, atol=1e-12 * (1 + x.abs().max()))


def test_operator_matrix_kron_structure_and_params_roundtrip():
    layer = random_ssog(6, 2, 3, seed=3)
    alpha, mu, sigma = (p.detach() for p in layer.gaussian_params())
    K = layer.operator_matrix(3, 5).detach()
    assert K.shape == (2, 15, 15)
    # entry ((i, j), (i', j')) = sum_m alpha g(i - i'; mu_y, s_y) g(j - j'; mu_x, s_x)
    from lipcheck.gaussian import kernel
    i, j, ip, jp, hh = 2, 1, 0, 4, 1
    expect = sum(alpha[hh, m] * kernel(torch.tensor(float(i - ip), dtype=D), mu[hh, m, 0], sigma[hh, m, 0])
                 * kernel(torch.tensor(float(j - jp), dtype=D), mu[hh, m, 1], sigma[hh, m, 1]) for m in range(3))
    assert K[hh, i * 5 + j, ip * 5 + jp].item() == pytest.approx(float(expect), rel=1e-13)
    layer2 = SSoG(6, 2, 3, dtype=D)
    layer2.set_gaussian_params(alpha.detach(), mu.detach(), sigma.detach())
    for a, b in zip(layer.gaussian_params(), layer2.gaussian_params()):
        assert torch.allclose(a, b, rtol=1e-13, atol=1e-14)


def test_gradcheck_input_alpha_mu_sigma():
    layer = random_ssog(4, 2, 2, seed=7)
    alpha, mu, sigma = (p.detach().clone().requires_grad_() for p in layer.gaussian_params())
    x = torch.randn(1, 3, 4, 4, dtype=D, requires_grad=True)

    def f(x, alpha, mu, sigma):
        v = layer.v_proj(x).reshape(1, 3, 4, 2, 2)
        return layer.o_proj(ssog_mix(v, alpha, mu, sigma).reshape(1, 3, 4, 4))

    assert torch.autograd.gradcheck(f, (x, alpha, mu, sigma), eps=1e-6, atol=1e-7)
    # the parametrised module agrees with the pure function and its gradients reach every parameter
    layer(x).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


def test_frozen_kernels_make_the_map_affine():
    layer = random_ssog(6, 3, 2, seed=11).freeze_kernels()
    assert not any(p.requires_grad for p in (layer.alpha, layer.mu, layer.sigma_raw))
    x, y = torch.randn(2, 1, 4, 5, 6, dtype=D)
    a, b = 0.7, -1.9
    lhs = layer(a * x + b * y) - layer.o_proj.bias
    rhs = a * (layer(x) - layer.o_proj.bias) + b * (layer(y) - layer.o_proj.bias)
    assert torch.allclose(lhs, rhs, atol=1e-12)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_dense_attention_matches_numpy_softmax(backend):
    torch.manual_seed(0)
    C, h = 12, 3
    layer = DenseAttention(C, h, backend=backend, dtype=D)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    x = torch.randn(2, 3, 4, C, dtype=D)
    out = layer(x).detach().numpy().reshape(2, 12, C)
    w = {n: (getattr(layer, n).weight.detach().numpy(), getattr(layer, n).bias.detach().numpy())
         for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    X = x.numpy().reshape(2, 12, C)
    d = C // h
    for b in range(2):
        q, k, v = (X[b] @ w[n][0].T + w[n][1] for n in ("q_proj", "k_proj", "v_proj"))
        heads = []
        for hh in range(h):
            s = slice(hh * d, (hh + 1) * d)
            logits = q[:, s] @ k[:, s].T / math.sqrt(d)
            e = np.exp(logits - logits.max(1, keepdims=True))
            heads.append((e / e.sum(1, keepdims=True)) @ v[:, s])
        ref = np.concatenate(heads, 1) @ w["o_proj"][0].T + w["o_proj"][1]
        assert np.abs(out[b] - ref).max() < 1e-12 * (1 + np.abs(ref).max())


@pytest.mark.parametrize("C,h,M", [(192, 3, 4), (384, 6, 4), (768, 12, 4), (48, 3, 2), (10, 5, 1)])
def test_block_parameter_difference_is_exact(C, h, M):
    """Attention: q,k,v,o with biases (4C^2 + 4C). SSoG: v without bias, o with bias, 5 numbers per
    Gaussian component (alpha, mu_y, mu_x, sigma_y, sigma_x): 2C^2 + C + 5hM. Difference 2C^2 + 3C - 5hM."""
    count = lambda m: sum(p.numel() for p in Block(C, h, m, num_components=M, device="meta").parameters())
    assert count("attention") - count("ssog") == 2 * C * C + 3 * C - 5 * h * M
