"""The lattice-normalised Gaussian kernel: the one home of Z, g, axis matrices and 1-D symbols.

Everything else (the fast operator, the dense reference, the spectral bounds) reads the kernel
from here, so that a change to the definition (SPEC section 1) changes all of them at once.

    g(k; mu, sigma) = exp(-(k - mu)^2 / (2 sigma^2)) / Z(mu, sigma)
    Z(mu, sigma)    = sum_{j in Z} exp(-(j - mu)^2 / (2 sigma^2))
                    = sqrt(2 pi) sigma sum_n exp(-2 pi^2 sigma^2 n^2) cos(2 pi n mu)   (Poisson)

Z is evaluated in log form, so that no lattice term can underflow: with c = round(mu), f = mu - c
(|f| <= 1/2, computed exactly) and every exponent taken relative to the largest term,

    small sigma:  log Z = -f^2 / (2 sigma^2) + log S,  S = sum_j exp(-j (j - 2 f) / (2 sigma^2))  (1 <= S <= 3)
    large sigma:  log Z = log(sqrt(2 pi) sigma) + log1p(2 sum_n q^(n^2) cos(2 pi n f)),  q = exp(-2 pi^2 sigma^2)

and g(k) = exp(-kk (kk - 2 f) / (2 sigma^2) - log S) with kk = k - c (an integer, exact), i.e. one
exponential of an exponent computed with a few roundings and no cancellation: g agrees with SPEC's
g in relative precision wherever it is a normal number of the dtype (see `tap_relative_error`).
Where the dtype cannot carry the kernel at all (2 sigma^2 below its smallest normal number, an
exponent that overflows, half precision at the sigma floor) `check_representable` raises.
"""
from __future__ import annotations

import math

import torch

from .rounding import gamma, unit_roundoff  # noqa: F401  (re-exported: the kernel's margins use them)

# Below this width the direct lattice sum is used, at or above it the Poisson (theta) series.
SIGMA_SWITCH = 0.5
# Direct sum: j in -DIRECT_TERMS..DIRECT_TERMS around round(mu). At sigma < 0.5 the first term left
# out is below exp(-(7^2 - 7) / (2 * 0.25)) = exp(-84) relative to S >= 1.
DIRECT_TERMS = 7
# Poisson sum: n in 1..POISSON_TERMS. At sigma >= 0.5 the first term left out is q^25 < exp(-123).
POISSON_TERMS = 4


def _check_sigma(sigma: torch.Tensor) -> None:
    if not torch.is_tensor(sigma) or not sigma.numel():
        return
    if not bool(torch.isfinite(sigma).all()):
        raise ValueError("sigma must be finite everywhere (got NaN or inf); fix the kernel widths")
    if not bool((sigma > 0).all()):
        raise ValueError("sigma must be > 0 everywhere (got a non-positive width)")


def _split(mu: torch.Tensor):
    """(c, f) with c = round(mu) (no gradient) and f = mu - c in [-1/2, 1/2], exact in floating point."""
    c = torch.round(mu).detach()
    return c, mu - c


def _pieces(mu: torch.Tensor, sigma: torch.Tensor):
    """(small, f, c, two_s2, log S or Poisson log-normaliser) shared by Z, g and the symbol."""
    mu, sigma = torch.broadcast_tensors(torch.as_tensor(mu), torch.as_tensor(sigma))
    if not mu.is_floating_point():
        mu = mu.to(torch.get_default_dtype())
    sigma = sigma.to(mu.dtype)
    _check_sigma(sigma)
    if mu.numel() and not bool(torch.isfinite(mu).all()):
        raise ValueError("mu must be finite everywhere (got NaN or inf); fix the kernel offsets")
    c, f = _split(mu)
    small = sigma < SIGMA_SWITCH
    # each branch sees only the widths it is accurate for (no NaN from the other branch, not even in gradients)
    s_d = torch.where(small, sigma, torch.full_like(sigma, 0.25))
    s_p = torch.where(small, torch.full_like(sigma, 1.0), sigma)
    j = torch.arange(-DIRECT_TERMS, DIRECT_TERMS + 1, dtype=mu.dtype, device=mu.device)
    two_d = 2 * s_d.square()
    logS = torch.logsumexp(-j * (j - 2 * f.unsqueeze(-1)) / two_d.unsqueeze(-1), -1)
    n = torch.arange(1, POISSON_TERMS + 1, dtype=mu.dtype, device=mu.device)
    terms = torch.exp(-2 * math.pi ** 2 * s_p.unsqueeze(-1).square() * n.square()) * torch.cos(
        2 * math.pi * n * f.unsqueeze(-1))
    logP = torch.log1p(2 * terms.sum(-1))  # log(theta_3) >= log(1 - 2 sum q^{n^2}) > -0.02
    return mu, sigma, small, f, c, s_d, s_p, logS, logP


def log_normaliser(mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """log Z(mu, sigma), elementwise, without forming a single lattice term (no underflow)."""
    mu, sigma, small, f, c, s_d, s_p, logS, logP = _pieces(mu, sigma)
    direct = -f.square() / (2 * s_d.square()) + logS
    poisson = math.log(math.sqrt(2 * math.pi)) + torch.log(s_p) + logP
    return torch.where(small, direct, poisson)


def normaliser(mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Z(mu, sigma) = sum over the integer lattice of exp(-(j - mu)^2 / (2 sigma^2)), elementwise.

    Z itself underflows (to 0) where every lattice term does (small sigma, mu near a half-integer);
    g does not: it is computed from `log_normaliser`."""
    return torch.exp(log_normaliser(mu, sigma))


def log_kernel(k: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """log g(k; mu, sigma), broadcasting k against mu and sigma (-inf where g is 0 in the dtype's exponent range)."""
    mu_t = torch.as_tensor(mu)
    k = torch.as_tensor(k, dtype=mu_t.dtype if mu_t.is_floating_point() else None, device=mu_t.device)
    mu, sigma, small, f, c, s_d, s_p, logS, logP = _pieces(mu, sigma)
    k, mu, sigma, small, f, c, s_d, s_p, logS, logP = torch.broadcast_tensors(
        k, mu, sigma, small, f, c, s_d, s_p, logS, logP)
    kk = k - c  # integer offset from the nearest lattice point to mu: exact
    direct = -kk * (kk - 2 * f) / (2 * s_d.square()) - logS
    poisson = -(kk - f).square() / (2 * s_p.square()) - (math.log(math.sqrt(2 * math.pi)) + torch.log(s_p) + logP)
    return torch.where(small, direct, poisson)


def kernel(k: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """g(k; mu, sigma), broadcasting k against mu and sigma; sums to one over k in Z."""
    return torch.exp(log_kernel(k, mu, sigma))


def tap_relative_error(k: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A-priori bound on |fl(g) - g| / g for the taps `kernel` returns (proofs/S2.md, 'kernel taps').

    The exponent x = kk (kk - 2 f) / (2 sigma^2) + log S (or its Poisson form) is a sum of a few
    products and quotients: |fl(x) - x| <= gamma_8 (|x| + |log S| + 1) + (truncation < u), and
    exp adds one rounding: |fl(g)/g - 1| <= exp(gamma_8 (|x| + |log Z| + 2)) - 1 + u. Valid where
    g is a normal number; below the smallest normal the absolute error is at most that number.
    """
    with torch.no_grad():
        lk = log_kernel(k, mu, sigma)
        lz = log_normaliser(torch.as_tensor(mu), torch.as_tensor(sigma)).abs()
        g8 = gamma(8, lk.dtype)
        return torch.expm1(g8 * (lk.abs() + 2 * lz + 4)) + unit_roundoff(lk.dtype)


def check_representable(mu: torch.Tensor, sigma: torch.Tensor, dtype: torch.dtype | None = None,
                        name: str = "kernel") -> None:
    """Raise ValueError where the kernel cannot be computed in `dtype` (default: mu's dtype).

    Representable means: 2 sigma^2 is a normal number (else every exponent is inf or 0/0), the
    largest exponent kk (kk - 2f) / (2 sigma^2) at |kk| <= DIRECT_TERMS is finite, and log Z is finite.
    Then every tap is exp of a finite exponent: a normal number or an underflow of a value below
    the dtype's smallest normal number, never NaN.
    """
    mu_t = torch.as_tensor(mu)
    dtype = dtype or (mu_t.dtype if mu_t.is_floating_point() else torch.get_default_dtype())
    mu_d, sig_d = mu_t.detach().to(dtype), torch.as_tensor(sigma).detach().to(dtype)
    fi = torch.finfo(dtype)
    if sig_d.numel() == 0:
        return
    _check_sigma(sig_d)
    fix = ("compute in float32 or float64 (e.g. layer.float()), or keep sigma larger" if fi.bits < 32
           else "use float64, or keep sigma larger")
    two_s2 = 2 * sig_d.square()
    bad = ~(two_s2 >= fi.tiny)
    worst = (2 * DIRECT_TERMS + 1) * DIRECT_TERMS / two_s2  # largest |exponent| among the direct terms
    bad |= ~torch.isfinite(worst)
    lz = log_normaliser(mu_d, sig_d)
    bad |= ~torch.isfinite(lz)
    if bool(bad.any()):
        i = int(torch.nonzero(bad.reshape(-1))[0])
        s_bad = float(sig_d.reshape(-1)[i])
        m_bad = float(torch.broadcast_to(mu_d, sig_d.shape).reshape(-1)[i])
        raise ValueError(f"{name} not representable in {dtype}: sigma = {s_bad:.4g} (mu = {m_bad:.4g}) makes "
                         f"2 sigma^2 or the exponents -(k - mu)^2 / (2 sigma^2) leave {dtype}'s range; {fix}")


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
    symbol; |ghat| <= 1 with equality at omega = 0 because g >= 0 sums to one. With mu = c + f,
    ghat(omega; mu) = exp(-i c omega) ghat(omega; f), and Poisson summation gives
    sum_k exp(-(k-f)^2/(2 s^2)) e^{-ik w} = sqrt(2 pi) s sum_n exp(-s^2 (w + 2 pi n)^2 / 2) e^{-i (w + 2 pi n) f}.
    Every term is taken relative to the largest (log form), so nothing underflows.
    omega broadcasts against mu and sigma.
    """
    mu_t = torch.as_tensor(mu)
    omega, mu, sigma = torch.broadcast_tensors(torch.as_tensor(omega, dtype=mu_t.dtype, device=mu_t.device),
                                               mu_t, torch.as_tensor(sigma))
    mu, sigma, small, f, c, s_d, s_p, logS, logP = _pieces(mu, sigma)
    # Direct lattice sum, weights exp(-j (j - 2f) / (2 s^2) - log S) <= 1.
    j = torch.arange(-DIRECT_TERMS, DIRECT_TERMS + 1, dtype=mu.dtype, device=mu.device)
    wd = torch.exp(-j * (j - 2 * f.unsqueeze(-1)) / (2 * s_d.unsqueeze(-1).square()) - logS.unsqueeze(-1))
    phase = -j * omega.unsqueeze(-1)
    direct_re = (wd * torch.cos(phase)).sum(-1)
    direct_im = (wd * torch.sin(phase)).sum(-1)
    # Poisson dual, divided by sqrt(2 pi) s theta_3 = Z.
    n = torch.arange(-POISSON_TERMS, POISSON_TERMS + 1, dtype=mu.dtype, device=mu.device)
    nu = omega.unsqueeze(-1) + 2 * math.pi * n
    amp = torch.exp(-s_p.unsqueeze(-1).square() * nu.square() / 2 - logP.unsqueeze(-1))
    phase = -nu * f.unsqueeze(-1)
    pois_re = (amp * torch.cos(phase)).sum(-1)
    pois_im = (amp * torch.sin(phase)).sum(-1)
    re = torch.where(small, direct_re, pois_re)
    im = torch.where(small, direct_im, pois_im)
    # shift by the integer part: exp(-i c omega)
    cr, ci = torch.cos(c * omega), -torch.sin(c * omega)
    return torch.complex(re * cr - im * ci, re * ci + im * cr)
