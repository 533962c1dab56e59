"""Closed-form gradients of the cached taps: d g = g d log g, pulled back to mu and sigma_raw (the
matmul, truncated and FFT backends in training; the stacked backend's own node reuses the pieces)."""
from __future__ import annotations

import torch

from .taps import _effective_sigma, _taps


class _TapGrad(torch.autograd.Function):
    """Identity on cached (graph-free) taps of `_full_taps` whose backward pulls their gradient back to
    mu and sigma_raw through the kernel's log-derivatives, computed in closed form with the taps
    (`gaussian.lattice_taps`): d g / d mu = g d log g / d mu, a handful of operations per use instead
    of differentiating through the kernel's evaluation, which cost more than the mixing itself at
    14x14 tokens. A double backward (create_graph) differentiates the kernel's own evaluation instead,
    so second derivatives come from the same definition."""

    @staticmethod
    def forward(ctx, mu, sigma_raw, taps, d_mu, d_sigma):
        ctx.save_for_backward(mu, sigma_raw, taps, d_mu, d_sigma)
        return taps.detach()

    @staticmethod
    def backward(ctx, grad):
        mu, sigma_raw, taps, d_mu, d_sigma = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():  # create_graph: keep the path to the parameters themselves
            r = (taps.shape[-1] - 1) // 2
            return (*_autograd_of([_taps(r, mu, _effective_sigma(sigma_raw))], [grad], (mu, sigma_raw), need),
                    None, None, None)
        return (*_taps_vjp(grad, taps, d_mu, d_sigma, sigma_raw, need), None, None, None)


def _taps_vjp(grad, taps, d_mu, d_sigma, sigma_raw, need):
    """(grad mu, grad sigma_raw) from a gradient on the cached taps: d g = g d log g with the log-derivatives
    cached beside the taps (gaussian.lattice_taps), and d sigma / d sigma_raw = sigmoid(sigma_raw). Flushed
    taps are zero, so no gradient flows through them."""
    w = grad * taps
    return ((w * d_mu).sum(-1) if need[0] else None,
            (w * d_sigma).sum(-1) * torch.sigmoid(sigma_raw) if need[1] else None)


def _autograd_of(outs, grads, inputs, need):
    """Gradients of the plain differentiable composition `outs` (a double backward's path), None where not needed."""
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    wanted = [t for t, n in zip(inputs, need) if n]
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                   create_graph=True, allow_unused=True))
    return tuple(next(got) if n else None for n in need)
