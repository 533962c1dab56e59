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


def _dlog_moments(mu, f, s_d, s_p, small, logP):
    """(e1, e2): the lattice moments behind the first derivatives of log Z and log g.

    With offsets kk = k - round(mu) and f = mu - round(mu), each branch in its cancellation-free form:
        d log g(k) / d mu    = (P1(kk) - e1) / sigma^2,   d log g(k) / d sigma = (P2(kk) - e2) / sigma^3,
    small sigma (direct sum, weights p_j = softmax_j of -j (j - 2f) / (2 sigma^2)):
        P1 = kk, e1 = E[j];  P2 = kk (kk - 2f), e2 = E[j (j - 2f)]
    (the exponent `log_kernel` uses, so a near-delta kernel gets a near-zero derivative rather than a
    difference of two large numbers); large sigma (Poisson series, theta = 1 + 2 sum_n q^(n^2) cos(2 pi n f),
    q = exp(-2 pi^2 sigma^2), log Z = log(sqrt(2 pi) sigma) + log theta):
        P1 = kk - f, e1 = sigma^2 d log theta / d f = -4 pi sigma^2 sum_n n q^(n^2) sin(2 pi n f) / theta;
        P2 = (kk - f)^2, e2 = sigma^3 d log Z / d sigma = sigma^2 - 8 pi^2 sigma^4 sum_n n^2 q^(n^2) cos(2 pi n f) / theta.
    """
    j = torch.arange(-DIRECT_TERMS, DIRECT_TERMS + 1, dtype=mu.dtype, device=mu.device)
    fj = f.unsqueeze(-1)
    p = torch.softmax(-j * (j - 2 * fj) / (2 * s_d.square().unsqueeze(-1)), -1)
    e1_d = (p * j).sum(-1)
    e2_d = (p * j * (j - 2 * fj)).sum(-1)
    n = torch.arange(1, POISSON_TERMS + 1, dtype=mu.dtype, device=mu.device)
    s2 = s_p.square()
    q = torch.exp(-2 * math.pi ** 2 * s2.unsqueeze(-1) * n.square())
    theta = torch.exp(logP)
    arg = 2 * math.pi * n * fj
    e1_p = -4 * math.pi * s2 * (n * q * torch.sin(arg)).sum(-1) / theta
    e2_p = s2 - 8 * math.pi ** 2 * s2.square() * (n.square() * q * torch.cos(arg)).sum(-1) / theta
    return torch.where(small, e1_d, e1_p), torch.where(small, e2_d, e2_p)


def log_normaliser_grad(mu: torch.Tensor, sigma: torch.Tensor):
    """(d log Z / d mu, d log Z / d sigma), elementwise, in closed form (no autograd).

    Under p(j) = g(j; mu, sigma) on the lattice they are E[j - mu] / sigma^2 and E[(j - mu)^2] / sigma^3;
    computed from the moments of `_dlog_moments`.
    """
    mu, sigma, small, f, c, s_d, s_p, logS, logP = _pieces(mu, sigma)
    e1, e2 = _dlog_moments(mu, f, s_d, s_p, small, logP)
    s2 = sigma.square()
    d_mu = torch.where(small, e1 - f, e1) / s2
    d_sigma = torch.where(small, e2 + f.square(), e2) / (s2 * sigma)
    return d_mu, d_sigma


def _log_kernel_at(kk, small, f, s_d, s_p, logS, logP):
    """log g at integer offsets kk = k - round(mu) from the pieces of `_pieces` (broadcast together)."""
    direct = -kk * (kk - 2 * f) / (2 * s_d.square()) - logS
    poisson = -(kk - f).square() / (2 * s_p.square()) - (math.log(math.sqrt(2 * math.pi)) + torch.log(s_p) + logP)
    return torch.where(small, direct, poisson)


def lattice_taps(r: int, mu: torch.Tensor, sigma: torch.Tensor, derivatives: bool = False):
    """g(k; mu, sigma) at k = -r..r along a new last axis (shape mu.shape + (2r + 1,)), from one evaluation
    of the series: the same numbers as `kernel` at those k, in a few dozen operations however many
    (mu, sigma) pairs there are.

    derivatives=True returns (g, d log g / d mu, d log g / d sigma), the log-derivatives at the same k in
    the forms of `_dlog_moments` (no autograd): d g / d mu = g * (d log g / d mu), likewise for sigma.
    """
    mu, sigma, small, f, c, s_d, s_p, logS, logP = _pieces(mu, sigma)
    k = torch.arange(-r, r + 1, dtype=mu.dtype, device=mu.device)
    u = [t.unsqueeze(-1) for t in (small, f, s_d, s_p, logS, logP)]
    kk = k - c.unsqueeze(-1)  # integer offsets: exact
    g = torch.exp(_log_kernel_at(kk, *u))
    if not derivatives:
        return g
    small1, f1 = u[0], u[1]
    e1, e2 = _dlog_moments(mu, f, s_d, s_p, small, logP)
    p1 = torch.where(small1, kk, kk - f1)
    p2 = torch.where(small1, kk * (kk - 2 * f1), p1.square())
    s2 = sigma.square().unsqueeze(-1)
    return g, (p1 - e1.unsqueeze(-1)) / s2, (p2 - e2.unsqueeze(-1)) / (s2 * sigma.unsqueeze(-1))


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
    return _log_kernel_at(k - c, small, f, s_d, s_p, logS, logP)  # k - c: integer offset, exact


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
    # Fast sufficient test (the SSoG layer checks at every parameter update): sigma >= safe makes
    # 2 sigma^2 >= tiny and (2T + 1) T / (2 sigma^2) <= max, T = DIRECT_TERMS, whatever mu; then every
    # direct exponent, f^2 / (2 sigma^2) <= it and so log Z are finite too. The factor 2 covers the
    # rounding of 2 sigma^2 and of the bound itself.
    safe = 2 * math.sqrt(max(fi.tiny / 2, (2 * DIRECT_TERMS + 1) * DIRECT_TERMS / 2 / fi.max))  # 2 max overflows
    if bool((sig_d >= safe).all() & torch.isfinite(sig_d).all() & torch.isfinite(mu_d).all()):
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
