"""Bounds on the symbol's derivatives: the lattice sums D1, D2 >= sup |ghat'|, |ghat''| (rounded up), and c_h(w) with
its gradient for the Toeplitz majorant's linearised cells."""
from __future__ import annotations

import math

import torch

from .. import gaussian
from .margins import tap_error
from .params import SSoGParams


def derivative_bounds(p: SSoGParams) -> torch.Tensor:
    """(D1, D2) with Dj = sum_k |k|^j g(k; mu, sigma) >= sup_w |d^j ghat / dw^j|, each (h, M, 2), rounded up.

    A direct lattice sum over round(mu) +- R, R = 12 sigma + 12; the tail beyond is bounded by
    4 (|mu| + R + 1)^2 exp(-R'^2 / (2 sigma^2) - log Z) / (1 - exp(-1/sigma)), R' = R - 1/2 >= 12 sigma + 11."""
    R = int(math.ceil(12 * float(p.sigma.max()) + 12))
    j = torch.arange(-R, R + 1, dtype=p.mu.dtype, device=p.mu.device)
    k = torch.round(p.mu).unsqueeze(-1) + j
    g = gaussian.kernel(k, p.mu.unsqueeze(-1), p.sigma.unsqueeze(-1))
    Rp = 12 * p.sigma + 11
    tail = (4 * (p.mu.abs() + R + 1).square()
            * torch.exp(-Rp.square() / (2 * p.sigma.square()) - gaussian.log_normaliser(p.mu, p.sigma))
            / (-torch.expm1(-1 / p.sigma)) + 2 * (2 * R + 1) * torch.finfo(p.WV.dtype).smallest_normal
            * (p.mu.abs() + R + 1).square())
    rel = 1 + p.gamma(2 * R + 6) + tap_error(p)
    return (k.abs() * g).sum(-1) * rel + tail, (k.square() * g).sum(-1) * rel + tail


def symbol_and_gradient(p: SSoGParams, wy: torch.Tensor, wx: torch.Tensor):
    """c_h(w) (n, h) and its gradient dc_h/dw (n, h, 2), the 1-D derivatives by autograd through gaussian.symbol.

    Used by the Toeplitz majorant's linearised cells (lipcheck/bounds/majorant.py), whose derivative rounding
    allowance eta_d is a model (proofs/S2.md, Toeplitz majorant); the resolution-free bound needs no derivative."""
    def one(w, ax):
        # one omega per output entry, so the gradient of the sum is the elementwise derivative
        om = w.detach()[:, None, None].expand(-1, *p.alpha.shape).clone().requires_grad_(True)
        with torch.enable_grad():
            g = gaussian.symbol(om, p.mu[..., ax], p.sigma[..., ax])
            dre = torch.autograd.grad(g.real.sum(), om, retain_graph=True)[0]
            dim = torch.autograd.grad(g.imag.sum(), om)[0]
        return g.detach(), torch.complex(dre, dim)
    gy, dgy = one(wy, 0)
    gx, dgx = one(wx, 1)
    a = p.alpha.to(gy.dtype)
    c = (a * gy * gx).sum(-1)
    J = torch.stack([(a * dgy * gx).sum(-1), (a * gy * dgx).sum(-1)], -1)
    return c, J
