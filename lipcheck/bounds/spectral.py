"""Certified two-sided bounds on ||T||_2 for fixed-kernel SSoG (SPEC S1, S2).

    T(X) = sum_h K_h X P_h,   K_h = sum_m alpha[h, m] G_H(mu_y, sigma_y) kron G_W(mu_x, sigma_x)

is the SSoG layer without its output bias; it is affine-free, so Lip(SSoG) = ||T||_2 (Frobenius norm
on X). Everything here reads the kernel from `lipcheck.gaussian` and never builds the (N C) x (N C)
matrix unless asked for the exact value or Gram iteration on a size that fits.

Bounds (all for the zero-padded, i.e. block-Toeplitz, operator):
- lower: Lanczos on T^T T with the fast operator; the value is ||T v|| / ||v|| for the Ritz vector v.
- probabilistic upper: the same Lanczos run with a random start and the Kuczynski-Wozniakowski bound.
- circulant: the (2H-1) x (2W-1) block-circulant embedding; its norm is the max over that DFT grid of
  ||S(w)||, S(w) = sum_h khat_h(w) P_h, with khat the symbol of the truncated kernel.
- resolution_free: sup over the continuous torus of ||S(w)|| with the full symbol; valid for every grid.
- closed_form: sum_h ||P_h|| sum_m |alpha[h, m]| (|ghat| <= 1).
- gram: Gram iteration on the dense matrix when it fits.

Maximising ||S(w)|| over many frequencies: S(w) = W_V diag(c_h(w) I_d) W_O depends on w only through the
h numbers c_h(w). The top singular triple at an anchor w0 (a Lanczos guess, verified) gives, for every other frequency w with Delta = S(w) - S(w0),
the certified bound || [[|s1 + a|, |b|], [|c|, s2 + ||Delta||]] ||_2 (a = u1^* Delta v1, b = u1^* Delta
restricted to v1-perp, c likewise): second order in w - w0, and O(h^2) per frequency. Branch and bound
with these anchors needs few of them even for C = 768.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from typing import Callable

import torch

from .. import gaussian, rounding
from ..rounding import norm2_upper

KW_CONSTANT = 1.648  # Kuczynski & Wozniakowski (1992), Theorem 4.2: P(eps >= e) <= 1.648 sqrt(n) exp(-sqrt(e)(2q-1))
# Lanczos checks its stopping rule every CHECK_EVERY steps; the failure probability is split over them.
CHECK_EVERY = 10


def _finite(x: float, what: str) -> float:
    """NaN/inf is never a bound: refuse with the quantity's name."""
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{what} came out {x}: not certified. Its inputs are finite, so the layer's scale is "
                         f"outside what the dtype can bound; rescale the weights or certify in float64")
    return x


def require_finite(q: "SSoGParams", what: str) -> None:
    """NaN/inf in any of the numbers a bound reads: refuse, naming the parameter."""
    for name, t in (("alpha", q.alpha), ("mu", q.mu), ("sigma", q.sigma), ("W_V", q.WV), ("W_O", q.WO)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} has NaN/inf entries: the {what} is not certified; fix the layer")


def _scale_back(v: float, e: int, *, up: bool) -> float:
    """v 2^e, rounded outward (up for an upper bound, down for a lower one) where it leaves the normal range."""
    if math.isnan(v) or (math.isinf(v) and not up):
        raise ValueError(f"a bound came out {v}: not certified")
    if v == 0.0:
        return 0.0
    try:
        r = math.ldexp(v, e)
    except OverflowError:
        r = math.inf
    if math.isinf(r):
        if up:
            raise ValueError(f"the Lipschitz bound {v:.6g} * 2^{e} exceeds the float64 range: not certified; "
                             f"rescale the layer's weights (alpha, v_proj, o_proj)")
        return math.nextafter(math.inf, 0.0)
    if r < sys.float_info.min:  # subnormal: ldexp rounded to nearest
        r = math.nextafter(r, math.inf if up else 0.0)
    return r


@contextlib.contextmanager
def single_thread():
    """Dense LAPACK calls on small matrices run far faster on one thread when the cores are shared
    (measured: a 384 x 384 complex SVD 0.15 s on one thread, over 10 s on two busy ones)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# --------------------------------------------------------------------------------------------------
# Parameters and the fast operator


@dataclasses.dataclass
class SSoGParams:
    """Fixed-kernel SSoG as numbers: alpha (h, M), mu, sigma (h, M, 2), W_V, W_O (C, C), P_h via heads.

    The layer's operator is 2^log2_scale times the operator of these numbers (see `normalised`);
    conversion_error bounds the relative rounding of reading the layer's weights into this dtype."""
    alpha: torch.Tensor
    mu: torch.Tensor
    sigma: torch.Tensor
    WV: torch.Tensor  # X @ WV is the value projection
    WO: torch.Tensor  # Y @ WO is the output projection (without bias)
    log2_scale: int = 0
    conversion_error: float = 0.0

    @property
    def num_heads(self) -> int:
        return self.alpha.shape[0]

    @property
    def dim(self) -> int:
        return self.WV.shape[0]

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def u(self) -> float:
        return rounding.unit_roundoff(self.WV.dtype)

    def gamma(self, n: float) -> float:
        return rounding.gamma(n, self.WV.dtype)

    def head_projections(self) -> torch.Tensor:
        d = self.head_dim
        return torch.stack([self.WV[:, i * d:(i + 1) * d] @ self.WO[i * d:(i + 1) * d, :]
                            for i in range(self.num_heads)])

    def head_frobenius(self) -> torch.Tensor:
        """F_h >= ||W_V,h||_F ||W_O,h||_F >= || |W_V,h| |W_O,h| ||_2: the scale of every rounding error in P_h."""
        d, h = self.head_dim, self.num_heads
        fv = self.WV.reshape(self.dim, h, d).square().sum((0, 2)).sqrt()
        fo = self.WO.reshape(h, d, self.dim).square().sum((1, 2)).sqrt()
        return fv * fo * (1 + self.gamma(2 * self.dim * d + 4))

    def magnitude(self) -> float:
        """B = sum_h F_h sum_m |alpha[h, m]| >= ||T|| and >= the norm of T with every entry replaced by its
        modulus: every rounding error below is a multiple of B (proofs/S2.md, 'rounding margins')."""
        return float((self.head_frobenius() * self.alpha.abs().sum(1)).sum()) * (1 + self.gamma(self.alpha.shape[1] + self.num_heads + 2))


def _pow2_exponent(t: torch.Tensor) -> int:
    """e with max|t| 2^-e in [1/2, 1) (0 for an all-zero tensor)."""
    m = float(t.abs().max()) if t.numel() else 0.0
    return math.frexp(m)[1] if m > 0 else 0


def _ldexp(t: torch.Tensor, e: int) -> torch.Tensor:
    """t 2^e in two exact halves (2^e alone may overflow a double); exact unless an entry leaves the normal range."""
    a = e // 2
    return t * (2.0 ** a) * (2.0 ** (e - a))


def normalised(p: SSoGParams) -> SSoGParams:
    """The same operator with max|alpha|, max|W_V|, max|W_O| in [1/2, 1), the power of two moved to
    log2_scale. Scaling by powers of two is exact (up to entries that underflow, covered by the
    margins through the smallest normal number), so every bound of the normalised operator times
    2^log2_scale bounds the layer, at any scale of alpha and weights the dtype can hold."""
    ea, ev, eo = _pow2_exponent(p.alpha), _pow2_exponent(p.WV), _pow2_exponent(p.WO)
    if ea == ev == eo == 0:
        return p
    return dataclasses.replace(p, alpha=_ldexp(p.alpha, -ea), WV=_ldexp(p.WV, -ev), WO=_ldexp(p.WO, -eo),
                               log2_scale=p.log2_scale + ea + ev + eo)


def check_layer_dtype(layer) -> None:
    """Half-precision layers are refused: their kernel exponents overflow at ordinary widths."""
    dt = layer.alpha.dtype
    if dt not in (torch.float32, torch.float64):
        raise ValueError(f"layer parameters are {dt}: a {dt} SSoG layer is not certified (its kernel exponents "
                         f"-(k - mu)^2 / (2 sigma^2) overflow at ordinary widths); convert it with layer.float() "
                         f"or layer.double() and certify that")


def ssog_params(layer, *, dtype=torch.float64, device=None) -> SSoGParams:
    """Read alpha, mu, sigma, W_V, W_O from an SSoG module in `dtype`; non-finite values raise.

    The kernel must be representable both in the layer's own dtype (else its forward pass is NaN)
    and in `dtype` (else its bound is)."""
    if not all(hasattr(layer, a) for a in ("gaussian_params", "v_proj", "o_proj")):
        raise TypeError(f"layer must be a lipcheck SSoG module, got {type(layer).__name__}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"certification dtype must be torch.float32 or torch.float64, got {dtype}")
    check_layer_dtype(layer)
    device = torch.device(device) if device is not None else layer.alpha.device
    with torch.no_grad():
        raw = [t.detach() for t in layer.gaussian_params()]
        raw += [layer.v_proj.weight.detach().T, layer.o_proj.weight.detach().T]
    for name, t in zip(("alpha", "mu", "sigma", "v_proj.weight", "o_proj.weight"), raw):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"layer parameter {name} has non-finite entries; a Lipschitz bound of a layer "
                             f"with NaN/inf weights is meaningless: reinitialise or fix the weights first")
    gaussian.check_representable(raw[1], raw[2], raw[2].dtype, name="the layer's kernel (its own dtype)")
    alpha, mu, sigma, WV, WO = (t.to(device=device, dtype=dtype) for t in raw)
    gaussian.check_representable(mu, sigma, dtype, name=f"the kernel in the certification dtype {dtype}")
    for name, t0, t in zip(("alpha", "mu", "sigma", "v_proj.weight", "o_proj.weight"), raw, (alpha, mu, sigma, WV, WO)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"layer parameter {name} overflows {dtype}; certify in float64")
    # reading float64 weights into float32 rounds each entry once (relative u): a perturbation of the operator
    conv = 3 * rounding.gamma(3, dtype) if torch.finfo(raw[0].dtype).bits > torch.finfo(dtype).bits else 0.0
    return SSoGParams(alpha, mu, sigma, WV, WO, conversion_error=conv)


def _mix(V: torch.Tensor, p: SSoGParams, mu: torch.Tensor) -> torch.Tensor:
    """sum_m alpha G_H(mu_y) V_h G_W(mu_x)^T per head, V of shape (B, H, W, C); never builds N x N."""
    from ..mixers.ssog import ssog_mix
    B, H, W, C = V.shape
    v = V.reshape(B, H, W, p.num_heads, p.head_dim)
    return ssog_mix(v, p.alpha, mu, p.sigma).reshape(B, H, W, C)


def apply_T(X: torch.Tensor, p: SSoGParams) -> torch.Tensor:
    """T(X) = sum_h K_h X P_h on X of shape (B, H, W, C)."""
    return _mix(X @ p.WV, p, p.mu) @ p.WO


def apply_T_adjoint(Y: torch.Tensor, p: SSoGParams) -> torch.Tensor:
    """T^*(Y) = sum_h K_h^T Y P_h^T; G_n(mu, sigma)^T = G_n(-mu, sigma), so it is the same fast operator."""
    return _mix(Y @ p.WO.T, p, -p.mu) @ p.WV.T


def dense_operator(p: SSoGParams, H: int, W: int) -> torch.Tensor:
    """The (N C) x (N C) matrix of T on row-major vec(X): entry [(n, c), (n', c')] = sum_h K_h[n, n'] P_h[c', c]."""
    from ..mixers.ssog import operator_matrices
    K = operator_matrices(H, W, p.alpha, p.mu, p.sigma)  # (h, N, N)
    P = p.head_projections()
    N, C = H * W, p.dim
    return torch.einsum("hab,hdc->acbd", K, P).reshape(N * C, N * C)


# --------------------------------------------------------------------------------------------------
# Rounding errors of the kernel as the bounds read it (proofs/S2.md, "rounding margins")


def _log_range(dtype) -> float:
    """-log of the smallest positive (subnormal) number: |log g| of every tap that is not flushed to 0."""
    fi = torch.finfo(dtype)
    return -math.log(fi.smallest_normal) - math.log(fi.eps) + 1


def tap_error(p: SSoGParams) -> torch.Tensor:
    """(h, M, 2) bound on the relative error of every tap g(k) that is a normal number (gaussian.tap_relative_error
    at the largest |log g| the dtype holds); taps below the smallest normal number err by at most that number."""
    lz = gaussian.log_normaliser(p.mu, p.sigma).abs()
    return torch.expm1(p.gamma(8) * (_log_range(p.WV.dtype) + 2 * lz + 4)) + p.u


def symbol_error(p: SSoGParams, terms: int = 2 * gaussian.DIRECT_TERMS + 1) -> torch.Tensor:
    """(h, M, 2) bound on |fl(ghat(w)) - ghat(w)| for |w| <= pi + 2 pi (terms sum of <= `terms` taps
    times phases exp(-i k w) with |k| <= |round(mu)| + terms): taps, phases, the sum, flushed taps."""
    c = torch.round(p.mu).abs()
    tiny = torch.finfo(p.WV.dtype).smallest_normal
    return (tap_error(p) + p.gamma(terms + 6) + 4 * p.u * (2 + 3 * math.pi * (c + terms + 2))
            + terms * tiny)


def coefficient_error(p: SSoGParams, e: torch.Tensor) -> torch.Tensor:
    """(h,) bound on |fl(c_h) - c_h|, c_h = sum_m alpha ghat_y ghat_x, from per-axis symbol errors e (h, M, 2)."""
    ey, ex = e[..., 0], e[..., 1]
    A = p.alpha.abs()
    M = p.alpha.shape[1]
    return ((A * (ey + ex + ey * ex)).sum(1) + p.gamma(M + 3) * (A * (1 + ey) * (1 + ex)).sum(1)
            + M * torch.finfo(p.WV.dtype).smallest_normal)


def dense_error(p: SSoGParams, N: int) -> float:
    """Bound on ||fl(T) - T||_2 for the dense matrix (and the fast operator) on N tokens: relative errors
    of the taps and of the products alpha g_y g_x P_h, flushed taps, and reading the weights into the dtype."""
    eps = float(tap_error(p).max())
    tiny = torch.finfo(p.WV.dtype).smallest_normal
    rel = 2 * eps + eps * eps + p.gamma(p.alpha.shape[1] + p.head_dim + 2 * p.dim + 8) + p.conversion_error
    return (rel + 4 * N * tiny) * p.magnitude()


# --------------------------------------------------------------------------------------------------
# Closed form (S1, last inequality)


def head_norms(p: SSoGParams) -> torch.Tensor:
    """Certified ||P_h||_2 >= the exact norm for every head: P_h = W_V,h W_O,h formed in the dtype (an inner
    product of length d: entrywise error <= gamma_{d+2} |W_V,h| |W_O,h|, Frobenius <= gamma_{d+2} F_h), its norm
    verified by Cholesky (rounding.norm2_upper), plus reading the weights into the dtype."""
    with single_thread():
        s = norm2_upper(p.head_projections()).to(p.WV.dtype)
    return s * (1 + p.gamma(2)) + (p.gamma(p.head_dim + 2) + p.conversion_error) * p.head_frobenius()


def _closed_form(q: SSoGParams) -> float:
    return _finite(float((head_norms(q) * q.alpha.abs().sum(1)).sum())
                   * (1 + q.gamma(q.alpha.shape[1] + q.num_heads + 2)), "closed-form bound")


def closed_form_bound(p: SSoGParams) -> float:
    """sum_h ||P_h||_2 sum_m |alpha[h, m]|: no sigma, no mu, no grid. Certified (rounded up), any scale."""
    q = normalised(p)
    return _scale_back(_closed_form(q), q.log2_scale, up=True)


# --------------------------------------------------------------------------------------------------
# The symbol S(w) = sum_h c_h(w) P_h and certified maxima of ||S(w)||


def symbol_coefficients(p: SSoGParams, wy: torch.Tensor, wx: torch.Tensor) -> torch.Tensor:
    """c_h(w) = sum_m alpha[h, m] ghat(wy; mu_y, sigma_y) ghat(wx; mu_x, sigma_x) at points (wy, wx): (n, h)."""
    gy = gaussian.symbol(wy[:, None, None], p.mu[..., 0], p.sigma[..., 0])  # (n, h, M)
    gx = gaussian.symbol(wx[:, None, None], p.mu[..., 1], p.sigma[..., 1])
    return (p.alpha.to(gy.dtype) * gy * gx).sum(-1)


def truncated_symbols(p: SSoGParams, H: int, W: int):
    """Symbols of the kernels truncated to offsets |k| <= n - 1 on the (2n-1)-point DFT grid, per axis.

    Returns (ghat_y (2H-1, h, M), ghat_x (2W-1, h, M), wy, wx): the eigenvalues of the circulant embedding.
    """
    out = []
    for n, ax in ((H, 0), (W, 1)):
        L = 2 * n - 1
        k = torch.arange(-(n - 1), n, dtype=p.mu.dtype, device=p.mu.device)
        g = gaussian.kernel(k[:, None, None], p.mu[..., ax], p.sigma[..., ax])  # (L, h, M)
        w = 2 * math.pi * torch.arange(L, dtype=p.mu.dtype, device=p.mu.device) / L
        w = torch.where(w > math.pi, w - 2 * math.pi, w)
        phase = torch.exp(-1j * w[:, None] * k[None, :].to(torch.complex128 if p.mu.dtype == torch.float64
                                                             else torch.complex64))  # (L, L)
        out.append((torch.einsum("jk,khm->jhm", phase, g.to(phase.dtype)), w))
    (gy, wy), (gx, wx) = out
    return gy, gx, wy, wx


def torus_coefficients(p: SSoGParams, H: int, W: int):
    """(c (2H-1, 2W-1, h), wy, wx): c_h at the circulant embedding's torus frequencies from the truncated symbols
    (error: coefficient_error(p, truncated_symbol_error(p, H, W)))."""
    gy, gx, wy, wx = truncated_symbols(p, H, W)
    return torch.einsum("hm,ahm,bhm->abh", p.alpha.to(gy.dtype), gy, gx), wy, wx


def truncated_symbol_error(p: SSoGParams, H: int, W: int) -> torch.Tensor:
    """(h, M, 2) bound on the error of `truncated_symbols`: 2n - 1 taps times phases with |k w| <= 2 pi n."""
    e = tap_error(p)
    tiny = torch.finfo(p.WV.dtype).smallest_normal
    out = [e[..., ax] + p.gamma(2 * n + 2) + 4 * p.u * (2 + 2 * math.pi * n) + 2 * n * tiny
           for ax, n in ((0, H), (1, W))]
    return torch.stack(out, -1)


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


def two_by_two_norm(p: torch.Tensor, q: torch.Tensor, r: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """||[[p, q], [r, s]]||_2 = (hypot(p + s, q - r) + hypot(p - s, q + r)) / 2 for real entries: sums and
    hypot only, no cancellation against a trace, no overflow of squares. Relative error <= gamma_4 for
    nonnegative entries (proofs/S2.md)."""
    return (torch.hypot(p + s, q - r) + torch.hypot(p - s, q + r)) / 2


def top_singular_guess(S: torch.Tensor, steps: int = 40):
    """Guesses (s1, u1, v1, s2) of the top singular triple and the second singular value of each matrix of S (k, m, n):
    Lanczos on S^* S with full reorthogonalisation, batched over k, `steps` matrix-vector pairs (all n when n <=
    steps, where the Krylov space is the whole space and the values are exact up to rounding). A full SVD costs
    O(n^3) (46 ms at n = 384); this O(steps n^2). Only guesses: anchor_verification proves what they give. u1 is
    S v1 / ||S v1|| and s1 = ||S v1||, so the residual S v^ - s1 u^ is rounding only and the anchor's excess over
    ||S|| is second order in v1's error (its other residual enters the 2 x 2 bound squared). s2 is the second
    Ritz value raised by 2 % of the gap to s1: a Ritz value lies below the eigenvalue it approximates, and a guess
    below ||S - s1 u1 v1^*|| only costs norm2_upper a retry."""
    k, m, n = S.shape
    steps = min(steps, n)
    dt = S.dtype
    real = S.real.dtype
    V = torch.zeros(k, steps, n, dtype=dt, device=S.device)
    v = torch.ones(k, n, dtype=dt, device=S.device) + 0.01 * torch.sin(torch.arange(n, dtype=real, device=S.device))
    v = v / torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    alphas = torch.zeros(k, steps, dtype=real, device=S.device)
    betas = torch.zeros(k, max(steps - 1, 0), dtype=real, device=S.device)
    eye = torch.eye(n, dtype=dt, device=S.device)

    def orthogonalise(x, j):  # against V[:, :j + 1], twice (Kahan: twice is enough)
        for _ in range(2):
            x = x - torch.einsum("kjn,kj->kn", V[:, :j + 1], torch.einsum("kjn,kn->kj", V[:, :j + 1].conj(), x))
        return x

    for j in range(steps):
        V[:, j] = v
        # S^* (S v) as ((S v)^* S)^*: a row times S, so S is never copied into its conjugate transpose
        w = ((S @ v[..., None]).mH @ S).squeeze(-2).conj()
        alphas[:, j] = torch.einsum("kn,kn->k", v.conj(), w).real
        w = orthogonalise(w, j)  # full reorthogonalisation
        if j + 1 == steps:
            break
        b = torch.linalg.vector_norm(w, dim=-1)
        scale = alphas[:, :j + 1].abs().amax(-1)
        dead = b <= 1e-12 * scale  # an invariant subspace: go on with a fresh direction (beta = 0 there)
        if bool(dead.any()):
            fresh = orthogonalise(eye[j % n].expand(k, n), j)
            fresh = fresh / torch.linalg.vector_norm(fresh, dim=-1, keepdim=True).clamp_min(torch.finfo(real).tiny)
            w = torch.where(dead[:, None], fresh, w / torch.where(dead, torch.ones_like(b), b)[:, None])
            b = torch.where(dead, torch.zeros_like(b), b)
        else:
            w = w / b[:, None]
        betas[:, j] = b
        v = w
    T = torch.diag_embed(alphas) + torch.diag_embed(betas, 1) + torch.diag_embed(betas, -1)
    with single_thread():
        theta, Z = torch.linalg.eigh(T)
    v1 = torch.einsum("kj,kjn->kn", Z[:, :, -1].to(dt), V)
    Sv = (S @ v1[..., None]).squeeze(-1)
    s1 = torch.linalg.vector_norm(Sv, dim=-1)
    e0 = torch.zeros(m, dtype=dt, device=S.device)
    e0[0] = 1
    # S v1 = 0 (a zero symbol): any unit vector is a top left singular vector
    # divided as real numbers: a complex division by a subnormal s1 overflows (to inf) inside torch's algorithm
    den = torch.where(s1 > 0, s1, torch.ones_like(s1))
    q = torch.view_as_complex(torch.view_as_real(Sv) / den[:, None, None]) if Sv.is_complex() else Sv / den[:, None]
    u1 = torch.where((s1 > 0)[:, None], q, e0)
    r2 = theta[:, -2].clamp_min(0).sqrt() if steps > 1 else torch.zeros_like(s1)
    s2 = torch.minimum(r2 + 0.02 * (s1 - r2).clamp_min(0), s1)
    return s1, u1, v1, s2


def anchor_verification(S: torch.Tensor, s1: torch.Tensor, u1: torch.Tensor, v1: torch.Tensor,
                        s2: torch.Tensor) -> dict:
    """What a guess (s1, u1, v1, s2) of the top singular triple and second singular value of the stored matrices S (k, C, C) proves, in float64 (proofs/S2.md):

    delta >= |1 - ||u1||| + |1 - ||v1|||, rho_r >= ||S v^ - s1 u^||, rho_b >= ||S^* u^ - s1 v^|| (u^ = u1 / ||u1||,
    v^ = v1 / ||v1||), tau2 >= ||S - s1 u1 v1^*|| >= ||U2^* S V2|| for orthonormal completions U2 of u^, V2 of v^
    (U2^* u1 = 0), the last verified by Cholesky. Entries are inf where the guess proves nothing."""
    dt = s1.dtype
    S, u1, v1, s1 = S.to(torch.complex128), u1.to(torch.complex128), v1.to(torch.complex128), s1.double()
    C = S.shape[-1]
    g = lambda n: rounding.gamma(n, torch.float64)  # noqa: E731
    nu2, nv2 = u1.abs().square().sum(-1), v1.abs().square().sum(-1)
    delta = (nu2 - 1).abs() + (nv2 - 1).abs() + g(2 * C + 4) * (nu2 + nv2)
    delta = torch.where(delta < 0.1, delta, torch.full_like(delta, math.inf))
    # underflow (a symbol of underflowing kernels has subnormal entries): every real operation may add an absolute
    # error of at most eta, which no relative gamma covers; each allowance below gets its count of them
    eta = rounding.tiny_subnormal(torch.float64)
    SF = (rounding.sum_of_squares(S) * (1 + g(4 * C * C + 4)) + 2 * C * C * eta).sqrt() * (1 + g(2))  # 2 C^2 squares
    nu, nv = (nu2 * (1 + g(2 * C + 4))).sqrt(), (nv2 * (1 + g(2 * C + 4))).sqrt()  # >= ||u1||, ||v1||
    Rv = (S @ v1[..., None]).squeeze(-1) - s1[:, None] * u1
    Ru = (u1.conj()[:, None, :] @ S).squeeze(-2).conj() - s1[:, None] * v1  # S^* u1 without copying S^*
    # |fl(S v - s1 u) - (S v - s1 u)| <= gamma_{C+4} (|S| |v| + s1 |u|): in norm <= gamma_{C+4} (||S||_F ||v|| + s1 ||u||)
    # and <= 8 (C + 4) eta per entry from underflow (C complex products and sums, then s1 u): sqrt(C) times in norm
    err = g(C + 4) * (SF * torch.maximum(nu, nv) + s1 * torch.maximum(nu, nv)) + 8 * (C + 4) * math.sqrt(C) * eta
    norm_up = lambda x: (x.abs().square().sum(-1) * (1 + g(2 * C + 4)) + 2 * C * eta).sqrt() * (1 + g(2))  # noqa: E731
    # S v^ - s1 u^ = (S v1 - s1 u1) / ||v1|| + s1 u1 (1 / ||v1|| - 1 / ||u1||): ||.|| <= (||Rv|| + s1 delta) / (1 - delta)
    rho_r = ((norm_up(Rv) + err + s1 * delta) / (1 - delta)) * (1 + g(4))
    rho_b = ((norm_up(Ru) + err + s1 * delta) / (1 - delta)) * (1 + g(4))
    D = S - s1[:, None, None] * (u1[:, :, None] * v1.conj()[:, None, :])
    # forming D: a complex product of three numbers and a difference per entry, gamma_6 of |S| + s1 |u1| |v1|^T
    eD = g(6) * (SF + s1 * nu * nv) + 32 * C * eta  # underflow: <= 32 eta per entry, C^2 entries: C in norm
    tau2 = (norm2_upper(D, s=s2.double()) + eD) * (1 + g(2))
    return {k: _up_to(torch.where(torch.isnan(v), math.inf, v), dt)
            for k, v in dict(rho_r=rho_r, rho_b=rho_b, tau2=tau2, delta=delta).items()}


def _up_to(x: torch.Tensor, dtype) -> torch.Tensor:
    """x (float64, >= 0) in `dtype`, rounded up (a float32 conversion rounds to nearest)."""
    y = x.to(dtype)
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)


class SymbolNorm:
    """f(c) = ||W_V diag(c_h I_d) W_O||_2 for coefficient vectors c in C^h, exact at anchors, bounded elsewhere.

    Every bound returned is >= the exact f at the given c, rounding included (proofs/S2.md)."""

    def __init__(self, p: SSoGParams):
        self.p = p
        cdt = torch.complex128 if p.WV.dtype == torch.float64 else torch.complex64
        self.cdt = cdt
        self.WV, self.WO = p.WV.to(cdt), p.WO.to(cdt)
        self.h, self.d = p.num_heads, p.head_dim
        C = p.dim
        self.Pnorm = head_norms(p)  # (h,)
        self.F = p.head_frobenius()  # (h,)
        with single_thread():
            self.nWV, self.nWO = (float(v) for v in norm2_upper(torch.stack([p.WV, p.WO])))
        self.sum_rel = p.gamma(self.h + 3)
        # rounding in the anchor quantities (inner products of length <= 2 C + d through the head blocks)
        self.ip = p.gamma(2 * C + self.d + 2 * self.h + 8)
        self.anchors: list[dict] = []
        self.num_svd = 0

    def matrix(self, c: torch.Tensor) -> torch.Tensor:
        """S for a batch of coefficient vectors c (k, h): (k, C, C). W_V and W_O are real: the real and imaginary
        parts are two real products (half the multiply-adds of one complex product), each entry an inner product
        of length C with terms W_V Re(c_h) W_O (or Im): error <= gamma_{C+2} sum_h |c_h| |W_V,h| |W_O,h| per part."""
        scale = c.to(self.cdt).repeat_interleave(self.d, dim=-1)  # (k, C)
        WV, WO = self.WV.real, self.WO.real
        parts = (WV[None] * torch.cat([scale.real, scale.imag])[:, None, :]) @ WO[None]  # (2k, C, C)
        return torch.complex(*parts.split(c.shape[0]))

    def matrix_error(self, c: torch.Tensor) -> torch.Tensor:
        """(k,) bound on ||matrix(c) - S(c)||_2 for the stored c: real and imaginary parts each err by <= gamma_{C+2}
        sum_h |c_h| F_h in Frobenius norm."""
        return 2 * self.p.gamma(self.p.dim + 2) * (c.abs() * self.F).sum(-1)

    def delta_norm(self, dc: torch.Tensor) -> torch.Tensor:
        """Certified ||sum_h dc_h P_h||: the smaller of the triangle bound and ||W_V|| max|dc| ||W_O||."""
        a = dc.abs()
        return torch.minimum((a * self.Pnorm).sum(-1), self.nWV * self.nWO * a.max(-1).values) * (1 + self.sum_rel)

    def cheap(self, c: torch.Tensor) -> torch.Tensor:
        return self.delta_norm(c)

    def add_anchors(self, c: torch.Tensor) -> torch.Tensor:
        """Anchors at coefficient vectors c (k, h); stores what the anchor bound needs; returns a certified upper
        bound on f(c) (k,). `top_singular_guess`'s output is only a guess: with u1, v1 its top singular vectors,
        the residuals rho_r >= ||S v^ - s1 u^||, rho_b >= ||S^* u^ - s1 v^|| (u^ = u1 / ||u1||, v^ likewise) and
        tau2 >= ||S - s1 u1 v1^*|| (verified by Cholesky) bound S in the basis (u^, u^-perp), (v^, v^-perp):
        ||S|| <= ||[[s1 + rho_r, rho_b], [rho_r, tau2]]||. S itself was formed with error <= 2 gamma_{C+2}
        sum_h |c_h| F_h (eS; real and imaginary parts). proofs/S2.md, 'anchor bound'."""
        S = self.matrix(c)
        with single_thread():
            s1, u1, v1, s2 = top_singular_guess(S)  # S v1 ~ s1 u1
        self.num_svd += c.shape[0]
        d = self.d
        # rows u1^* P_h and columns P_h v1, via the head blocks of W_V and W_O
        uWV = (u1.conj()[:, None, :] @ self.WV[None]).squeeze(1)  # (k, C)
        WOv = (self.WO[None] @ v1[:, :, None]).squeeze(-1)  # (k, C)
        rows = torch.stack([uWV[:, i * d:(i + 1) * d, None] * self.WO[None, i * d:(i + 1) * d, :]
                            for i in range(self.h)], 1).sum(2)  # (k, h, C) = u1^* P_h
        cols = torch.stack([(self.WV[None, :, i * d:(i + 1) * d] * WOv[:, None, i * d:(i + 1) * d]).sum(-1)
                            for i in range(self.h)], 1)  # (k, h, C) = P_h v1
        t = torch.einsum("khc,kc->kh", rows, v1)  # u1^* P_h v1
        Gu = torch.einsum("kac,kbc->kab", rows, rows.conj())  # <row_a, row_b>
        Gv = torch.einsum("kac,kbc->kab", cols.conj(), cols)
        v = anchor_verification(S, s1, u1, v1, s2)
        eS = self.matrix_error(c)
        # + 8 eta: the sums and hypots may underflow (subnormal symbols)
        top = two_by_two_norm(s1 + v["rho_r"], v["rho_b"], v["rho_r"], v["tau2"]) * (1 + self.p.gamma(8)) \
            + 8 * rounding.tiny_subnormal(torch.float64)
        new = dict(c=c.to(self.cdt), s1=s1, t=t, Gu=Gu, Gv=Gv, eS=eS, top=top, **v)
        self.anchors.append(new)
        self._last_values = s1
        return top + eS

    def anchor_bound(self, c: torch.Tensor, anchor: dict) -> torch.Tensor:
        """Certified upper bound on f at coefficient vectors c (n, h) from a batch of anchors: min over them.

        For one anchor (u^, v^ its normalised singular vectors, rho_r, rho_b, tau2 from `anchor_verification`):
        with Delta = S(c) - S(anchor), a = u1^* Delta v1, b = u^^* Delta minus its v^ part, r = Delta v^ minus
        its u^ part, ||S(c)|| <= || [[|s1 + a| + rho_r, ||b|| + rho_b], [||r|| + rho_r, tau2 + ||Delta||]] ||_2.
        Rounding: the quadratic forms are inner products, |a| errs by <= e = ip D_F, ||b||^2 and ||r||^2 by
        <= 4 e D_F (D_F = sum_h |dc_h| F_h, D = ||Delta|| certified); the normalisation of u1, v1 (delta) adds
        delta' (|a| + e) to |a| and 3 delta D^2 under the roots; the 2 x 2 norm gamma_6 relative and the roundings
        that formed its entries gamma_10.
        """
        dc = c.to(self.cdt)[:, None, :] - anchor["c"][None]  # (n, A, h)
        a = torch.einsum("nah,ah->na", dc, anchor["t"])
        bu = torch.einsum("nai,aij,naj->na", dc, anchor["Gu"], dc.conj()).real  # ||u1^* Delta||^2
        bv = torch.einsum("nai,aij,naj->na", dc.conj(), anchor["Gv"], dc).real  # ||Delta v1||^2
        dn = self.delta_norm(dc)
        DF = (dc.abs() * self.F).sum(-1) * (1 + self.sum_rel)
        delta = anchor["delta"][None]
        e = self.ip * DF * (1 + delta).square()
        aa = a.abs().square()
        scale = 1 / (1 - delta).square()
        under = 3 * delta * dn.square()
        q = (((bu - aa).clamp_min(0) + 4 * e * DF) * scale + under).sqrt() + anchor["rho_b"][None]
        r = (((bv - aa).clamp_min(0) + 4 * e * DF) * scale + under).sqrt() + anchor["rho_r"][None]
        pp = (anchor["s1"][None] + a).abs() + e + (scale - 1) * (a.abs() + e) + anchor["rho_r"][None]
        ss = anchor["tau2"][None] + dn
        # gamma_6 for the 2 x 2 formula, gamma_10 for the <= 10 roundings that formed its nonnegative entries
        two = two_by_two_norm(pp, q, r, ss) * (1 + self.p.gamma(16))
        first_order = (anchor["top"][None] + dn) * (1 + self.p.gamma(2))
        return (torch.minimum(two, first_order) + anchor["eS"][None]).min(-1).values

    def all_anchors(self) -> dict | None:
        if not self.anchors:
            return None
        if len(self.anchors) > 1:
            self.anchors = [{k: torch.cat([an[k] for an in self.anchors]) for k in self.anchors[0]}]
        return self.anchors[0]

    def bound(self, c: torch.Tensor, anchors: dict | None = None, chunk_elems: int = 1 << 21) -> torch.Tensor:
        """min over the cheap bound and every anchor's bound (or only `anchors`), at c (n, h)."""
        an = anchors if anchors is not None else self.all_anchors()
        A = an["c"].shape[0] if an is not None else 1
        chunk = max(1, chunk_elems // (A * self.h))
        out = []
        for c0 in c.split(chunk):
            b = self.cheap(c0)
            if an is not None:
                b = torch.minimum(b, self.anchor_bound(c0, an))
            out.append(b)
        return torch.cat(out) if out else torch.zeros(0, dtype=self.p.WV.dtype, device=c.device)


@dataclasses.dataclass
class SymbolMax:
    """Certified max of ||S(w)|| over a set: lower = an actual ||S(w*)||, upper >= every value."""
    lower: float
    upper: float
    argmax: tuple[float, float]
    num_svd: int
    num_points: int


def _no_nan(t: torch.Tensor, what: str) -> torch.Tensor:
    if bool(torch.isnan(t).any()) or bool(torch.isinf(t).any()):
        raise ValueError(f"{what} has NaN/inf entries: not certified (a non-finite symbol or SVD); "
                         f"check the layer's kernel (sigma, mu) and weights, or certify in float64")
    return t


def certified_max_points(sn: SymbolNorm, c: torch.Tensor, w: torch.Tensor, *, rtol: float = 1e-9,
                         batch: int = 4, max_svd: int = 100000) -> SymbolMax:
    """Certified max of f over finitely many frequencies (coefficients c (n, h), frequencies w (n, 2)).

    Branch and bound: SVD at the point with the largest current upper bound, update every bound from
    the new anchor, drop points whose bound is within rtol of the best value, repeat.
    """
    n = c.shape[0]
    ub = _no_nan(sn.bound(_no_nan(c, "symbol coefficients")), "symbol-norm bounds")
    best, arg = -1.0, 0
    done = torch.zeros(n, dtype=torch.bool, device=c.device)
    while True:
        active = (~done) & (ub > best * (1 + rtol))
        if not bool(active.any()) or sn.num_svd >= max_svd:
            break
        idx = torch.nonzero(active).squeeze(1)
        pick = idx[torch.topk(ub[idx], min(batch, idx.numel())).indices]
        sn.all_anchors()
        cert = _no_nan(sn.add_anchors(c[pick]), "anchor singular values")
        vals = sn._last_values
        new = sn.anchors[-1]
        done[pick] = True
        ub[pick] = cert
        for j in range(vals.numel()):
            if float(vals[j]) > best:
                best, arg = float(vals[j]), int(pick[j])
        rest = ~done
        if bool(rest.any()):
            ub[rest] = torch.minimum(ub[rest], _no_nan(sn.bound(c[rest], new), "anchor bounds"))
    upper = max(best, float(ub.max())) if n else 0.0
    return SymbolMax(max(best, 0.0), _finite(upper, "symbol maximum"),
                     (float(w[arg, 0]), float(w[arg, 1])) if n else (0.0, 0.0), sn.num_svd, n)


def _scaled(m: SymbolMax, e: int) -> SymbolMax:
    return dataclasses.replace(m, lower=_scale_back(m.lower, e, up=False), upper=_scale_back(m.upper, e, up=True))


def circulant_bound(p: SSoGParams, H: int, W: int, *, sn: SymbolNorm | None = None, rtol: float = 1e-9) -> SymbolMax:
    """||T||_2 <= ||block-circulant embedding|| = max over the (2H-1) x (2W-1) DFT grid of ||S(w)|| (S2).

    Computed for the normalised operator (sn, when given, must be built on `normalised(p)`) and scaled
    back; upper includes the rounding of the truncated symbols (truncated_symbol_error)."""
    _check_grid_size(H, W)
    q = normalised(p)
    c, wy, wx = torus_coefficients(q, H, W)
    c = c.reshape(-1, q.num_heads)
    w = torch.stack(torch.meshgrid(wy, wx, indexing="ij"), -1).reshape(-1, 2)
    # f(-w) = f(w) (real kernels: conjugate symbols), so half of the grid suffices
    keep = (w[:, 0] > 0) | ((w[:, 0] == 0) & (w[:, 1] >= 0))
    sn = sn if sn is not None else SymbolNorm(q)
    m = certified_max_points(sn, c[keep], w[keep], rtol=rtol)
    err = float(sn.delta_norm(coefficient_error(q, truncated_symbol_error(q, H, W))))
    m = dataclasses.replace(m, upper=m.upper + err)
    return _scaled(m, q.log2_scale)


def resolution_free_bound(p: SSoGParams, *, sn: SymbolNorm | None = None, rtol: float = 1e-6,
                          init_cells: int = 32, max_cells: int = 400_000, max_rounds: int = 200,
                          anchors_per_round: int | None = None, progress: bool = False,
                          max_work: float | None = None) -> tuple[SymbolMax, dict]:
    """Certified sup over the continuous torus of ||S(w)|| (S1): valid for every H, W at once.

    Cells of the half torus wy in [0, pi], wx in [-pi, pi] (f(-w) = f(w)). On a cell with half widths r,
    c(w) = I(w) + R with I the bilinear interpolation of c between the cell's 4 corners (a convex combination
    of the corner values) and |R_h| <= 1/2 sum_m |alpha| (D2y ry^2 + D2x rx^2), Dj = sum_k |k|^j g(k) >=
    |ghat^(j)|. c -> ||S(c)|| is convex, so ||S(I(w))|| <= max over the corners: the cell bound is
    max_corners bound(c_corner) + ||S(R + rounding)||, second order in r, with no derivative of the symbol. Branch and bound: SVD anchors at the most promising centres, retire cells within
    best (1 + rtol), split the others. Returns (SymbolMax, info); info['achieved_rtol'] says how tight it got.
    max_work: stop once the anchor bounds evaluated (cells x 5 points x new anchors x heads, summed over rounds) exceed
    it: a count, not a clock (the cells left keep their certified bounds).
    """
    q0 = normalised(p)
    m, info = _resolution_free(q0, sn=sn if sn is not None else SymbolNorm(q0), rtol=rtol, init_cells=init_cells,
                               max_cells=max_cells, max_rounds=max_rounds, anchors_per_round=anchors_per_round,
                               progress=progress, max_work=max_work)
    return _scaled(m, q0.log2_scale), info


def _resolution_free(p: SSoGParams, *, sn: SymbolNorm, rtol: float, init_cells: int, max_cells: int,
                     max_rounds: int, anchors_per_round: int | None, progress: bool,
                     max_work: float | None = None) -> tuple[SymbolMax, dict]:
    dt, dev = p.WV.dtype, p.WV.device
    _, D2 = derivative_bounds(p)  # (h, M, 2): sup |ghat''| per axis
    A = p.alpha.abs()
    corners = torch.tensor([[-1, -1], [-1, 1], [1, -1], [1, 1]], dtype=dt, device=dev)
    # rounding: every computed coefficient vector (centres and corners) errs by <= eta_c per head
    eta_c = coefficient_error(p, symbol_error(p))  # (h,)

    def remainder(r):  # (n, h): bilinear-interpolation error of c_h over the cell, plus the corners' rounding
        ry, rx = r[:, :1, None], r[:, 1:, None]
        q = D2[..., 0] * ry ** 2 + D2[..., 1] * rx ** 2
        return 0.5 * (A * q).sum(-1) * (1 + p.gamma(p.alpha.shape[1] + 8)) + eta_c[None]

    def corner_coefficients(w, r):  # (n, 4, h): c at the 4 corners of every cell
        pts = (w[:, None, :] + corners[None] * r[:, None, :]).reshape(-1, 2)
        return symbol_coefficients(p, pts[:, 0], pts[:, 1]).reshape(-1, 4, p.num_heads)

    def cell_bounds(K, anchors=None):  # (n, 4) corner bounds (without the remainder)
        return sn.bound(K.reshape(-1, K.shape[-1]), anchors).reshape(-1, 4)

    ny, nx = max(2, init_cells // 2), init_cells
    ry, rx = math.pi / (2 * ny), math.pi / nx
    cy = (torch.arange(ny, dtype=dt, device=dev) + 0.5) * 2 * ry
    cx = -math.pi + (torch.arange(nx, dtype=dt, device=dev) + 0.5) * 2 * rx
    w = torch.stack(torch.meshgrid(cy, cx, indexing="ij"), -1).reshape(-1, 2)
    r = torch.tensor([[ry, rx]], dtype=dt, device=dev).expand(w.shape[0], 2).clone()
    c, K = symbol_coefficients(p, w[:, 0], w[:, 1]), corner_coefficients(w, r)
    _no_nan(c, "symbol coefficients"), _no_nan(K, "corner coefficients"), _no_nan(D2, "derivative bounds")
    cb = sn.bound(c)
    kb = cell_bounds(K)
    best, arg = 0.0, (0.0, 0.0)
    retired = 0.0
    rounds = 0
    work = 0.0
    from tqdm.auto import tqdm
    bar = tqdm(total=max_rounds, desc="resolution-free sup", disable=not progress, leave=False)
    # SVDs cost C^3: many anchors per round for small C, few for large C
    k_anchor = anchors_per_round or max(4, min(64, int(1e8 / p.dim ** 3)))
    while rounds < max_rounds and w.shape[0] and (max_work is None or work <= max_work):
        rounds += 1
        bar.update(1)
        need = cb > best * (1 + rtol / 4)
        if bool(need.any()):
            idx = torch.nonzero(need).squeeze(1)
            ubn = kb[idx].max(-1).values
            pick = idx[torch.topk(ubn, min(k_anchor, idx.numel())).indices]
            sn.all_anchors()
            _no_nan(sn.add_anchors(c[pick]), "anchor singular values")
            vals = sn._last_values
            new = sn.anchors[-1]
            j = int(vals.argmax())
            if float(vals[j]) > best:
                best, arg = float(vals[j]), (float(w[pick[j], 0]), float(w[pick[j], 1]))
            cb = torch.minimum(cb, sn.bound(c, new))
            kb = torch.minimum(kb, cell_bounds(K, new))
            work += 5.0 * w.shape[0] * pick.numel() * p.num_heads
        ub = _no_nan(kb.max(-1).values + sn.delta_norm(remainder(r)), "resolution-free cell bounds")
        ok = ub <= best * (1 + rtol)
        if bool(ok.any()):
            retired = max(retired, float(ub[ok].max()))
        w, r, c, K, cb, kb, ub = w[~ok], r[~ok], c[~ok], K[~ok], cb[~ok], kb[~ok], ub[~ok]
        if w.shape[0] == 0:
            break
        # split cells whose bound is not explained by their centre (the cell is too wide)
        # cells whose centre still needs an anchor wait for it instead of multiplying
        split = ((ub - cb) > best * rtol / 2) & (cb <= best * (1 + rtol / 4))
        if not bool(split.any()):
            continue
        if 4 * int(split.sum()) + int((~split).sum()) > max_cells:
            break
        ws, rs = w[split], r[split] / 2
        wn = (ws[:, None, :] + corners[None] * rs[:, None, :]).reshape(-1, 2)
        rn = rs[:, None, :].expand(-1, 4, -1).reshape(-1, 2)
        cn, Kn = symbol_coefficients(p, wn[:, 0], wn[:, 1]), corner_coefficients(wn, rn)
        _no_nan(cn, "symbol coefficients"), _no_nan(Kn, "corner coefficients")
        keep = ~split
        w, r = torch.cat([w[keep], wn]), torch.cat([r[keep], rn])
        c, K = torch.cat([c[keep], cn]), torch.cat([K[keep], Kn])
        cb, kb = torch.cat([cb[keep], sn.bound(cn)]), torch.cat([kb[keep], cell_bounds(Kn)])
    bar.close()
    upper = max(retired, best)
    if w.shape[0]:
        left = _no_nan(kb.max(-1).values + sn.delta_norm(remainder(r)), "resolution-free cell bounds")
        upper = max(upper, float(left.max()))
    upper = _finite(upper, "resolution-free bound")
    info = dict(rounds=rounds, svds=sn.num_svd, cells_left=int(w.shape[0]), work=work,
                achieved_rtol=upper / best - 1 if best > 0 else float("inf"))
    return SymbolMax(best, upper, arg, sn.num_svd, -1), info


# --------------------------------------------------------------------------------------------------
# Lanczos (lower bound, probabilistic upper bound), Gram iteration, exact


def kw_epsilon(n: int, steps: int, failure_probability: float) -> float:
    """Relative eigenvalue error e with P(lambda_max - theta >= e lambda_max) <= failure_probability after
    `steps` Lanczos steps from a random start (Kuczynski-Wozniakowski 1992, Thm 4.2)."""
    return (math.log(KW_CONSTANT * math.sqrt(n) / failure_probability) / (2 * steps - 1)) ** 2


def lanczos(A: Callable[[torch.Tensor], torch.Tensor], v0: torch.Tensor, steps: int, *,
            stop: Callable[[float, int], bool] | None = None, progress: bool = False, verified: bool = False):
    """Lanczos with full reorthogonalisation on a symmetric PSD operator A.

    Returns (theta_max, ritz_vector, steps_done). `stop(theta, j)` may end the run early. verified=True:
    theta is a verified upper bound on the top eigenvalue of the computed tridiagonal (Cholesky), not the
    eigensolver's value."""
    from tqdm.auto import tqdm
    n = v0.numel()
    Q = torch.empty(min(steps, n) + 1, n, dtype=v0.dtype, device=v0.device)
    Q[0] = v0.reshape(-1) / v0.norm()
    alphas, betas = [], []
    theta, y = 0.0, None
    j = 0
    for j in tqdm(range(min(steps, n)), desc="lanczos", disable=not progress, leave=False):
        z = A(Q[j].reshape(v0.shape)).reshape(-1)
        a = float(Q[j] @ z)
        alphas.append(a)
        # full reorthogonalisation; a second pass only when the first cancelled a lot (Kahan: twice is enough)
        before = float(z.norm())
        z = z - Q[:j + 1].T @ (Q[:j + 1] @ z)
        if float(z.norm()) < 0.7 * before:
            z = z - Q[:j + 1].T @ (Q[:j + 1] @ z)
        b = float(z.norm())
        Tm = torch.diag(torch.tensor(alphas, dtype=torch.float64))
        if betas:
            off = torch.tensor(betas, dtype=torch.float64)
            Tm = Tm + torch.diag(off, 1) + torch.diag(off, -1)
        with single_thread():
            ev, evec = torch.linalg.eigh(Tm)
            theta, y = float(ev[-1]), evec[:, -1]
            if verified:
                theta = float(rounding.verified_lambda_max(Tm, lam=ev[-1]))
        if b <= 1e-14 * max(abs(a), 1e-300) or j + 1 >= n:
            j += 1
            break
        betas.append(b)
        Q[j + 1] = z / b
        if stop is not None and stop(theta, j + 1):
            j += 1
            break
    else:
        j = min(steps, n)
    k = len(alphas)
    v = (y.to(v0.dtype).to(v0.device) @ Q[:k]).reshape(v0.shape)
    return theta, v, k


def interlacing_tail(fro: float, lam1: float, neg: float, m: int, eta: float, dtype) -> float:
    """Lower bound, rounded down, on sum_{i=2..m} max(lambda_i(N), 0)^2 for the symmetric N whose compression
    V^T N V to a computed n x m basis V has Frobenius norm >= fro, lambda_max <= lam1 and -lambda_min <= neg
    (verified), with eta >= ||V^T V - I||_2; 0 where eta >= 1 (the basis proves nothing) or fro is not finite.

    sum_{i=2..m} max(lambda_i(V^T N V), 0)^2 >= ||.||_F^2 - lambda_1^2 - (m - 1) neg^2 (|lambda_1| <= max(lam1, neg),
    each negative eigenvalue's square <= neg^2); Ostrowski divides by (1 + eta)^2 to reach the orthonormal basis,
    Cauchy interlacing reaches N (proofs/S2.md, 'Gram iteration'); gamma_4 per product for the rounding."""
    g = lambda k: gaussian.gamma(k, dtype)  # noqa: E731
    tail = (fro ** 2 * (1 - g(4)) - max(lam1, neg) ** 2 * (1 + g(4))
            - (m - 1) * neg ** 2 * (1 + g(4)))
    return max(tail, 0.0) / (1 + eta) ** 2 * (1 - g(4)) if eta < 1 and math.isfinite(tail) else 0.0


def gram_bound(T: torch.Tensor, *, squarings: int = 6, ritz: int = 16) -> tuple[float, int]:
    """Certified ||T||_2 for the matrix T as stored, by Gram iteration (Delattre et al. 2023) with every
    rounding error carried: returns (bound, squarings used).

    G_0 = fl(T^T T) = T^T T + E_0, ||E_0||_F <= (gamma_m + 2u) ||T||_F^2. At level k the iterate is divided by
    f_k = its computed Frobenius norm, N_k = fl(G_k / f_k), and G_{k+1} = sym(fl(N_k N_k)) = N_k^2 + E_k with
    ||E_k||_F <= (gamma_n + 2u) ||N_k||_F^2 (|N||N| has Frobenius norm <= ||N||_F^2). Hence, with F_k >= ||N_k||_F,
        ||N_k||_2^2 <= f_{k+1} (||N_{k+1}||_2 + u' F_{k+1}) + (gamma_n + 2u) F_k^2,   u' = u / (1 - u),
        ||T||_2^2  <= f_0 (||N_0||_2 + u' F_0) + (gamma_m + 2u) ||T||_F^2,
    run backwards from b_K = F_K >= ||N_K||_2 or, at the last level, from the Cauchy-interlacing bound
    ||N_K||_2^2 <= F_K^2 - sum_{i=2..m} max(lambda_i(V^T N V), 0)^2 / (1 + eta)^2 for a computed basis V
    (eta >= ||V^T V - I||: Ostrowski), the sum bounded below through ||V^T N V||_F and verified (Cholesky) upper
    bounds on lambda_max and -lambda_min of V^T N V: no eigensolver is trusted. proofs/S2.md, 'Gram iteration'.
    """
    dt = T.dtype
    g = lambda k: gaussian.gamma(k, dt)  # noqa: E731
    u = gaussian.unit_roundoff(dt)
    up = u / (1 - u)
    m_rows, n = T.shape
    if not bool(torch.isfinite(T).all()):
        raise ValueError("the dense operator has NaN/inf entries: not certified")
    e = _pow2_exponent(T)
    if e:  # an exact power-of-two rescaling: T^T T neither overflows nor underflows
        b, k = gram_bound(_ldexp(T, -e), squarings=squarings, ritz=ritz)
        return _scale_back(b, e, up=True), k
    tF = float(T.norm()) * (1 + g(m_rows * n + 2))
    if tF == 0.0:
        return 0.0, 0
    e0 = (g(m_rows) + 2 * u) * tF ** 2
    ek = g(n) + 2 * u
    G = T.T @ T
    G = (G + G.T) / 2
    f, F = [], []
    ritz_b = None
    for k in range(squarings + 1):
        fk = float(G.norm())
        if fk == 0.0 or not math.isfinite(fk):
            if fk == 0.0:  # N_{k-1}^2 rounded to zero: ||N_{k-1}||_2^2 <= its error term alone
                f.append(0.0)
                F.append(0.0)
                break
            raise ValueError(f"Gram iteration: a Frobenius norm came out {fk}: not certified")
        N = G / fk
        f.append(fk)
        F.append(float(N.norm()) * (1 + g(n * n + 2)))
        if k == squarings:
            m = min(ritz, n)
            with single_thread():
                V = torch.linalg.eigh(N).eigenvectors[:, -m:]
                V = torch.linalg.qr(V).Q
                I = torch.eye(m, dtype=dt, device=T.device)
                eta = float((V.T @ V - I).norm()) * (1 + g(m * m + 2)) + g(n) * m * 2
                Mh = V.T @ N @ V
                Mh = (Mh + Mh.T) / 2
                # ||Mh - V^T N V||_F <= eB (two products of length n, |V| |N| |V| in Frobenius <= m (1 + eta) F)
                eB = 2 * g(n + 2) * m * (1 + eta) * F[-1] * (1 + g(4))
                lam1 = float(rounding.verified_lambda_max(Mh)) + eB  # >= lambda_1(V^T N V)
                neg = max(float(rounding.verified_lambda_max(-Mh)) + eB, 0.0)  # >= -lambda_min(V^T N V)
            fro = max(float(Mh.norm()) * (1 - g(m * m + 2)) - eB, 0.0)  # <= ||V^T N V||_F
            tail = interlacing_tail(fro, lam1, neg, m, eta, dt)
            rest = F[-1] ** 2 * (1 + g(2)) - tail
            ritz_b = math.sqrt(max(rest, 0.0)) * (1 + g(4))
            break
        G = N @ N
        G = (G + G.T) / 2

    def back(K: int, bK: float) -> float:
        b = bK
        for k in range(K - 1, -1, -1):
            b = math.sqrt(f[k + 1] * (b + up * F[k + 1]) + ek * F[k] ** 2) * (1 + g(6))
        return math.sqrt(f[0] * (b + up * F[0]) + e0) * (1 + g(6))

    best, used = math.inf, 0
    for K in range(len(f)):
        cand = back(K, F[K])
        if K == len(f) - 1 and ritz_b is not None:
            cand = min(cand, back(K, ritz_b))
        if cand < best:
            best, used = cand, K
    return _finite(best, "Gram iteration bound"), used


def _check_grid_size(H, W):
    for name, v in (("H", H), ("W", W)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer grid size, got {v!r}")
