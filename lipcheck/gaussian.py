"""The lattice-normalised Gaussian kernel: the one home of Z, g, axis matrices and 1-D symbols.

Everything else (the fast operator, the dense reference, the spectral bounds) reads the kernel
from here, so that a change to the definition (SPEC section 1) changes all of them at once.

    g(k; mu, sigma) = exp(-(k - mu)^2 / (2 sigma^2)) / Z(mu, sigma)
    Z(mu, sigma)    = sum_{j in Z} exp(-(j - mu)^2 / (2 sigma^2))
                    = sqrt(2 pi) sigma sum_n exp(-2 pi^2 sigma^2 n^2) cos(2 pi n mu)   (Poisson)

The lattice sum converges fast for small sigma, its Poisson dual for large sigma; each function
evaluates both on a fixed number of terms and keeps the accurate one, so everything stays
vectorised and differentiable in mu and sigma.
"""
from __future__ import annotations

import math

import torch

# Below this width the direct lattice sum is used, at or above it the Poisson (theta) series.
SIGMA_SWITCH = 0.5
# Direct sum: j in round(mu) +- DIRECT_TERMS. At sigma < 0.5 a term 6 away is < exp(-72) relative.
DIRECT_TERMS = 7
# Poisson sum: n in -POISSON_TERMS..POISSON_TERMS. At sigma >= 0.5, exp(-2 pi^2 sigma^2 n^2) < 1e-30 for |n| > 3.
POISSON_TERMS = 4


def _check_sigma(sigma: torch.Tensor) -> None:
    if not torch.is_tensor(sigma):
        return
    if sigma.numel() and not bool((sigma > 0).all()):
        raise ValueError("sigma must be > 0 everywhere (got a non-positive width)")


def normaliser(mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Z(mu, sigma) = sum over the integer lattice of exp(-(j - mu)^2 / (2 sigma^2)), elementwise."""
    mu, sigma = torch.broadcast_tensors(torch.as_tensor(mu), torch.as_tensor(sigma))
    _check_sigma(sigma)
    # Direct sum around the nearest lattice point (accurate for small sigma).
    j = torch.arange(-DIRECT_TERMS, DIRECT_TERMS + 1, dtype=mu.dtype, device=mu.device)
    centre = torch.round(mu).detach()
    d = (centre.unsqueeze(-1) + j) - mu.unsqueeze(-1)
    s = sigma.unsqueeze(-1)
    direct = torch.exp(-d.square() / (2 * s.square())).sum(-1)
    # Poisson dual (accurate for large sigma): sqrt(2 pi) sigma theta_3(pi mu, exp(-2 pi^2 sigma^2)).
    n = torch.arange(1, POISSON_TERMS + 1, dtype=mu.dtype, device=mu.device)
    terms = torch.exp(-2 * math.pi**2 * s.square() * n.square()) * torch.cos(2 * math.pi * n * mu.unsqueeze(-1))
    poisson = math.sqrt(2 * math.pi) * sigma * (1 + 2 * terms.sum(-1))
    return torch.where(sigma < SIGMA_SWITCH, direct, poisson)


def kernel(k: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """g(k; mu, sigma), broadcasting k against mu and sigma; sums to one over k in Z."""
    k = torch.as_tensor(k, dtype=torch.as_tensor(mu).dtype, device=torch.as_tensor(mu).device)
    return torch.exp(-(k - mu).square() / (2 * sigma.square())) / normaliser(mu, sigma)


def axis_matrix(n: int, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """G_n(mu, sigma)[..., i, i'] = g(i - i'; mu, sigma): the zero-padded Toeplitz axis factor.

    mu and sigma may carry leading batch dimensions (heads, components); the result has shape
    mu.shape + (n, n).
    """
    if int(n) < 1:
        raise ValueError(f"axis length n must be >= 1, got {n}")
    idx = torch.arange(n, dtype=mu.dtype, device=mu.device)
    offsets = idx[:, None] - idx[None, :]  # i - i'
    return kernel(offsets, mu[..., None, None], sigma[..., None, None])


def symbol(omega: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """1-D symbol ghat(omega) = sum_k g(k; mu, sigma) exp(-i k omega), a complex tensor.

    The Toeplitz matrix with entries g(i - i') is the finite section of the Laurent operator with this
    symbol; |ghat| <= 1 with equality at omega = 0 because g >= 0 sums to one. Poisson summation gives
    sum_k exp(-(k-mu)^2/(2 s^2)) e^{-ik w} = sqrt(2 pi) s sum_n exp(-s^2 (w + 2 pi n)^2 / 2) e^{-i (w + 2 pi n) mu}.
    omega broadcasts against mu and sigma.
    """
    omega, mu, sigma = torch.broadcast_tensors(torch.as_tensor(omega, dtype=torch.as_tensor(mu).dtype), mu, sigma)
    _check_sigma(sigma)
    z = normaliser(mu, sigma)
    # Direct lattice sum.
    j = torch.arange(-DIRECT_TERMS, DIRECT_TERMS + 1, dtype=mu.dtype, device=mu.device)
    k = torch.round(mu).detach().unsqueeze(-1) + j
    w = torch.exp(-(k - mu.unsqueeze(-1)).square() / (2 * sigma.unsqueeze(-1).square()))
    phase = -k * omega.unsqueeze(-1)
    direct_re = (w * torch.cos(phase)).sum(-1)
    direct_im = (w * torch.sin(phase)).sum(-1)
    # Poisson dual.
    n = torch.arange(-POISSON_TERMS, POISSON_TERMS + 1, dtype=mu.dtype, device=mu.device)
    nu = omega.unsqueeze(-1) + 2 * math.pi * n
    amp = math.sqrt(2 * math.pi) * sigma.unsqueeze(-1) * torch.exp(-sigma.unsqueeze(-1).square() * nu.square() / 2)
    phase = -nu * mu.unsqueeze(-1)
    pois_re = (amp * torch.cos(phase)).sum(-1)
    pois_im = (amp * torch.sin(phase)).sum(-1)
    small = sigma < SIGMA_SWITCH
    re = torch.where(small, direct_re, pois_re) / z
    im = torch.where(small, direct_im, pois_im) / z
    return torch.complex(re, im)
