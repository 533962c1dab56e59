"""Toeplitz majorant bound: ||T||_2 <= lambda_max(T_N(s_up)) for a scalar envelope s_up >= ||S(w)|| (proofs/S2.md,
'Toeplitz majorant').

T_N is the finite section of a 2-level block-Toeplitz operator with C x C symbol S(w) = sum_h c_h(w) P_h. For
box-supported X, Y with Fourier transforms x^, y^ (C^C per frequency),
    |<Y, T X>| <= (2 pi)^-2 int s(w) |y^(w)| |x^(w)| dw,   s(w) = ||S(w)||_2,
and Cauchy-Schwarz plus Parseval per channel give ||T|| <= lambda_max(T_N(s)), T_N(s) the N x N (N = H W) real
symmetric 2-level Toeplitz matrix of the scalar symbol s. T_N is monotone in the symbol (s <= s_up pointwise makes
T_N(s_up) - T_N(s) = T_N(s_up - s) positive semidefinite), so an envelope s_up that is bilinear on rectangles
(interpolating certified bounds of s at the corners of each cell's linearised symbol, plus a certified Taylor
remainder) has closed-form Fourier coefficients and a certified bound: lambda_max of the stored matrix by a
Cholesky certificate, plus the norm of the rounding in its entries.

The cells are refined where the majorant's top eigenvector lives (near the maximum of s); elsewhere coarse cells
cost little. The majorant is phase-blind (it keeps only ||S(w)||), so it is tight for positive symbols and loose
for shifted, signed kernels; it never drops below ||T||.
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch

from .. import gaussian
from . import spectral as sp
from .cell_set import CellSet
from ..rounding import cholesky_certifies  # Rump's Cholesky check (proofs/S2.md)

PI_HI = math.nextafter(math.pi, math.inf)  # a float >= pi
MAX_LEVELS = 64  # at most this many halvings of a cell (far below any useful width): bounds the centres' rounding


@dataclasses.dataclass
class MajorantBound:
    """upper >= ||T||_2 (certified); estimate = lambda_max of the envelope's Toeplitz matrix before margins;
    cells: rectangles in the envelope; anchors: exact SVDs of S(w); rounds: refinement rounds; info holds the cells,
    certified_eigenvalue (mu >= lambda_max of the stored Toeplitz matrix, Cholesky-checked; upper = (mu + margin)
    rounded up), symbol_max_upper and excess_estimate; cut_short: the time_budget stopped the refinement (the bound is
    certified all the same, only looser than the round budget would have made it)."""
    upper: float
    estimate: float
    cells: int
    anchors: int
    rounds: int
    seconds: float
    margin: float
    info: dict
    cut_short: bool = False


def centre_error(u: float) -> float:
    """Bound on |stored centre - exact centre| of every cell: the first grid errs by <= 4 u pi, each of at most
    MAX_LEVELS splits adds one rounding of w +- r/2 (<= u (pi + 1)) and half the stored width's error (<= u r): at most
    2 u pi per level, so (2 MAX_LEVELS + 4) u pi, rounded up."""
    return (2 * MAX_LEVELS + 4) * u * PI_HI * (1 + 4 * u)


def phase_error(k: float, u: float) -> float:
    """|fl(exp(-i k m)) - exp(-i k m)| for a stored centre |m| <= pi + 1: the product k m rounds once (u |k| (pi + 1)),
    cos and sin err by <= 2u each (proofs/S2.md, 'Toeplitz majorant')."""
    return abs(k) * u * (PI_HI + 1) * (1 + 2 * u) + 4 * u


def psi(x: torch.Tensor) -> torch.Tensor:
    """psi(x) = (sin x - x cos x) / x^2: the odd Taylor series x/3 - x^3/30 + ... for |x| <= 1 (no cancellation),
    the closed form beyond. |psi| <= 1 + 1/|x|; error <= PSI_ERROR (proofs/S2.md)."""
    small = x.abs() <= 1
    xs = torch.where(small, x, torch.zeros_like(x))
    x2 = xs * xs
    term, ser = xs / 3, torch.zeros_like(x)
    for n in range(1, 12):  # term_n = (-1)^(n+1) 2n x^(2n-1) / (2n+1)!
        ser = ser + term
        term = -term * x2 * (n + 1) / (n * (2 * n + 2) * (2 * n + 3))
    xb = torch.where(small, torch.ones_like(x), x)
    big = (torch.sin(xb) - xb * torch.cos(xb)) / (xb * xb)
    return torch.where(small, ser, big)


def psi_error(u: float) -> float:
    """Absolute error bound of `psi`: 16 u beyond |x| = 1 (argument, sin, cos, x cos x, the difference, the
    division, over x^2 >= 1), gamma_64 plus the series tail (< 1e-20) within."""
    return 16 * u + 64 * u / (1 - 64 * u) + 1e-20


def interval_transforms(k: torch.Tensor, m: torch.Tensor, h: torch.Tensor):
    """(I, L), each (J, K) complex, for the intervals [m - h, m + h]:
    I(k) = (1/2pi) int e^{-i k w} dw = e^{-i k m} sin(k h) / (pi k)  (h / pi at k = 0),
    L(k) = (1/2pi) int (w - m) / h e^{-i k w} dw = -i e^{-i k m} h psi(k h) / pi  (0 at k = 0).
    No cancellation: sin(kh)/(pi k) directly, psi by its series near 0; |I|, |L| <= h / pi."""
    kk = k[None, :]
    kh = kk * h[:, None]
    safe = torch.where(kk == 0, torch.ones_like(kh), kk)
    amp = torch.where(kk == 0, h[:, None].expand_as(kh) / math.pi, torch.sin(kh) / (math.pi * safe))
    lin = h[:, None] * psi(kh) / math.pi
    ph = -kk * m[:, None]
    cos, sin = torch.cos(ph), torch.sin(ph)
    return torch.complex(amp * cos, amp * sin), torch.complex(lin * sin, -lin * cos)


def bilinear_coefficients(kb: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """(J, 2, 2) coefficients a[p, q] of the envelope sum_{p,q} a[p, q] ((w_y - m_y)/h_y)^p ((w_x - m_x)/h_x)^q that
    interpolates the corner values kb (J, 4; corners (-,-), (-,+), (+,-), (+,+)) bilinearly, plus rho (J,)."""
    mm, mp, pm, pp = kb.unbind(-1)
    # a10, a01, a11 err by <= gamma_4 max kappa each and the basis is <= 1 in modulus on the cell: a00 absorbs
    # that, so the stored coefficients define an envelope >= the exact interpolant (proofs/S2.md)
    g4 = gaussian.gamma(4, kb.dtype)
    a00 = ((mm + mp + pm + pp) / 4 + rho) * (1 + g4) + 3 * g4 * kb.max(-1).values
    a10 = ((pm + pp) - (mm + mp)) / 4
    a01 = ((mp + pp) - (mm + pm)) / 4
    a11 = ((pp - pm) - (mp - mm)) / 4
    return torch.stack([torch.stack([a00, a01], -1), torch.stack([a10, a11], -1)], -2)


def toeplitz_coefficients(a: torch.Tensor, w: torch.Tensor, h: torch.Tensor, H: int, W: int):
    """Fourier coefficients t[k + H - 1, l + W - 1] = (2pi)^-2 int s_up(w) e^{-i (k wy + l wx)} dw of the even
    envelope s_up = sum_j (E_j(w) + E_j(-w)), E_j the bilinear function with coefficients a_j (bilinear_coefficients)
    on the rectangle [m_j - h_j, m_j + h_j] (zero outside): t = 2 Re sum_j sum_{p,q} a_j[p,q] By_j^p(k) Bx_j^q(l),
    B^0 = I, B^1 = L (interval_transforms). Exactly symmetric (t[-k, -l] is copied from t[k, l]).
    Returns (t (2H-1, 2W-1), bound on max |fl(t) - t|)."""
    dt = a.dtype
    u = gaussian.unit_roundoff(dt)
    ky = torch.arange(-(H - 1), H, dtype=dt, device=a.device)
    kx = torch.arange(-(W - 1), W, dtype=dt, device=a.device)
    Iy, Ly = interval_transforms(ky, w[:, 0], h[:, 0])  # (J, 2H-1)
    Ix, Lx = interval_transforms(kx, w[:, 1], h[:, 1])
    By, Bx = (Iy, Ly), (Ix, Lx)
    t = torch.zeros(2 * H - 1, 2 * W - 1, dtype=dt, device=a.device)
    for p_ in (0, 1):
        for q_ in (0, 1):
            Y, X, c = By[p_], Bx[q_], a[:, p_, q_][:, None]
            t = t + 2 * ((Y.real * c).T @ X.real - (Y.imag * c).T @ X.imag)
    t = torch.where(_upper_half(H, W, t.device), t, t.flip(0, 1))
    # error: every |B| <= h / pi; each B errs by <= (h / pi) (phase_error + gamma_10 + psi_error) (amplitude: h, kh,
    # sin or psi, the division); products and the sum of 8 J real terms: gamma_{8J+8}; the a's themselves are the
    # stored numbers defining the envelope (exact by definition)
    J = a.shape[0]
    V1 = float((a.abs().sum((1, 2)) * h[:, 0] * h[:, 1]).sum()) * 2 / math.pi ** 2 * (1 + gaussian.gamma(4 * J + 8, dt))
    eb = gaussian.gamma(10, dt) + psi_error(u)
    dy = phase_error(H - 1, u) + eb
    dx = phase_error(W - 1, u) + eb
    # (1 + dy)(1 + dx)(1 + g) - 1 expanded into positive terms: formed as written it cancels in float64 (dy ~ 100 u
    # next to 1) and came out up to 0.5% below the allowance; the sum of positive terms is rounded up by gamma_16
    g = gaussian.gamma(8 * J + 8, dt)
    rel = ((dy + dx + dy * dx) * (1 + g) + g) * (1 + gaussian.gamma(16, torch.float64))
    tiny = torch.finfo(dt).smallest_normal
    return t, V1 * rel + 32 * J * tiny


def stored_matrix_error(t_err: float, H: int, W: int, dtype) -> float:
    """||T_N(fl(t)) - T_N(t)||_2 <= the largest row sum of |entry errors| <= (2H - 1)(2W - 1) max error (the
    product rounded up in `dtype`'s unit roundoff)."""
    return (2 * H - 1) * (2 * W - 1) * t_err * (1 + gaussian.gamma(4, dtype))


def _upper_half(H: int, W: int, device) -> torch.Tensor:
    """Mask of the offsets (k, l) with k > 0 or (k == 0 and l >= 0) on the (2H-1) x (2W-1) offset grid."""
    k = torch.arange(-(H - 1), H, device=device)[:, None]
    l = torch.arange(-(W - 1), W, device=device)[None, :]
    return (k > 0) | ((k == 0) & (l >= 0))


def dense_toeplitz(t: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """The N x N matrix M[(a, b), (a', b')] = t[a - a' + H - 1, b - b' + W - 1] (row-major tokens)."""
    a = torch.arange(H, device=t.device)
    b = torch.arange(W, device=t.device)
    dy = (a[:, None] - a[None, :] + H - 1)  # (H, H)
    dx = (b[:, None] - b[None, :] + W - 1)
    return t[dy[:, None, :, None], dx[None, :, None, :]].reshape(H * W, H * W)


class ToeplitzMatvec:
    """x -> T_N(t) x by a (2H) x (2W) circulant embedding and real FFTs (for the refinement only, not the proof)."""

    def __init__(self, t: torch.Tensor, H: int, W: int):
        c = torch.zeros(2 * H, 2 * W, dtype=t.dtype, device=t.device)
        ky = torch.arange(-(H - 1), H, device=t.device) % (2 * H)
        kx = torch.arange(-(W - 1), W, device=t.device) % (2 * W)
        c[ky[:, None], kx[None, :]] = t
        self.f = torch.fft.rfft2(c)
        self.H, self.W = H, W

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        H, W = self.H, self.W
        y = torch.fft.irfft2(self.f * torch.fft.rfft2(x.reshape(H, W), s=(2 * H, 2 * W)), s=(2 * H, 2 * W))
        return y[:H, :W].reshape(x.shape)


class CellModel:
    """Certified max of s(w) = ||S(w)|| over a cell (centre w0, half widths r): the corners of the linearised box
    c(w0) + J (w - w0) (f is convex in c, so the max over the box is at a corner) plus ||S(R)|| for the Taylor
    remainder R and every rounding in c, J, the corners (the cell bound of `spectral.resolution_free_bound`)."""

    def __init__(self, p: sp.SSoGParams, sn: sp.SymbolNorm):
        self.p, self.sn = p, sn
        dt, dev = p.WV.dtype, p.WV.device
        self.D1, self.D2 = sp.derivative_bounds(p)
        A = p.alpha.abs()
        self.A = A
        es = sp.symbol_error(p)
        self.eta_c = sp.coefficient_error(p, es)
        ed = es * (torch.round(p.mu).abs() + 2 * gaussian.DIRECT_TERMS + 2 + 2 * p.sigma
                   + 2 * math.pi * p.sigma.square())
        D1 = self.D1
        eta_d = torch.stack([(A * (ed[..., 0] * (1 + es[..., 1]) + es[..., 0] * D1[..., 1])).sum(1),
                             (A * (ed[..., 1] * (1 + es[..., 0]) + es[..., 1] * D1[..., 0])).sum(1)], -1)
        self.eta_d = eta_d * (1 + p.gamma(p.alpha.shape[1] + 3))
        self.c_abs = A.sum(1)
        self.J_abs = torch.stack([(A * D1[..., 0]).sum(1), (A * D1[..., 1]).sum(1)], -1)
        self.corners = torch.tensor([[-1, -1], [-1, 1], [1, -1], [1, 1]], dtype=dt, device=dev)
        for name, t in (("D1", self.D1), ("D2", self.D2), ("eta_c", self.eta_c), ("eta_d", self.eta_d)):
            sp._no_nan(t, f"cell model {name}")

    def remainder(self, r: torch.Tensor) -> torch.Tensor:
        """(n, h) bound on |c_h(w) - c_h(w0) - J_h (w - w0)| over the cell plus the roundings."""
        p, A, D1, D2 = self.p, self.A, self.D1, self.D2
        ry, rx = r[:, :1, None], r[:, 1:, None]
        q = D2[..., 0] * ry ** 2 + 2 * D1[..., 0] * D1[..., 1] * ry * rx + D2[..., 1] * rx ** 2
        rr = r[:, None, :]
        rounding = (self.eta_c[None] + (self.eta_d[None] * rr).sum(-1)
                    + p.gamma(6) * (self.c_abs[None] + self.eta_c[None] + ((self.J_abs + self.eta_d)[None] * rr).sum(-1)))
        return 0.5 * (A * q).sum(-1) * (1 + p.gamma(p.alpha.shape[1] + 8)) + rounding

    def corner_bounds(self, c: torch.Tensor, J: torch.Tensor, r: torch.Tensor, anchors=None,
                      nearest: int = 2, batch: int = 64) -> torch.Tensor:
        """(n, 4) bounds of f at the corners of the linearised cells: the cheap bound and `anchors` (all of them
        when given), else the `nearest` anchors of each cell centre (distance sum_h |dc_h| F_h): any subset of
        anchors gives a valid bound, the nearest give nearly the best one at a fraction of the cost."""
        pts = c[:, None, :] + (J[:, None, :, :] * (self.corners[None, :, None, :] * r[:, None, None, :])).sum(-1)
        if anchors is not None:
            return self.sn.bound(pts.reshape(-1, pts.shape[-1]), anchors).reshape(-1, 4)
        out = self.sn.cheap(pts.reshape(-1, pts.shape[-1])).reshape(-1, 4)
        an = self.sn.all_anchors()
        if an is None or c.shape[0] == 0:
            return out
        F = self.sn.F.to(c.real.dtype)
        dist = torch.cat([((c[i:i + 4096].to(self.sn.cdt)[:, None, :] - an["c"][None]).abs() * F).sum(-1)
                          for i in range(0, c.shape[0], 4096)])
        near = torch.topk(dist, min(nearest, dist.shape[1]), largest=False).indices  # (n, k)
        # batches of cells sorted by nearest anchor, each against the union of its cells' nearest anchors
        order = torch.argsort(near[:, 0])
        for i in range(0, order.numel(), batch):
            rows = order[i:i + batch]
            ids = torch.unique(near[rows])
            sub = {key: val[ids] for key, val in an.items()}
            b = self.sn.bound(pts[rows].reshape(-1, pts.shape[-1]), sub).reshape(-1, 4)
            out[rows] = torch.minimum(out[rows], b)
        return out

    def rho(self, r: torch.Tensor) -> torch.Tensor:
        """(n,) ||S(R)|| bound of the remainder over cells of half widths r."""
        return sp._no_nan(self.sn.delta_norm(self.remainder(r)), "majorant remainder bounds")


def _widen(r: torch.Tensor, u: float) -> torch.Tensor:
    """Half widths enlarged to cover the exact cell: stored centres are within centre_error of the exact dyadic
    multiples of pi, stored half widths within 2u relative (halving is exact), so (r + centre_error)(1 + 4u)
    covers the exact cell."""
    return (r + centre_error(u)) * (1 + 4 * u)


def spectral_mass(v: torch.Tensor, w: torch.Tensor, r: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """Approximate (2pi)^-2 int_cell |v^(w)|^2 dw (both mirror cells) from v^ at the centre and the 4 corners."""
    V = v.reshape(H, W).to(torch.complex128 if v.dtype == torch.float64 else torch.complex64)
    a = torch.arange(H, dtype=v.dtype, device=v.device)
    b = torch.arange(W, dtype=v.dtype, device=v.device)
    tot = torch.zeros(w.shape[0], dtype=v.dtype, device=v.device)
    offs = ((0, 0), (-1, -1), (-1, 1), (1, -1), (1, 1))
    for oy, ox in offs:
        wy, wx = w[:, 0] + oy * r[:, 0], w[:, 1] + ox * r[:, 1]
        Ey = torch.exp(-1j * wy[:, None] * a[None, :])
        Ex = torch.exp(-1j * wx[:, None] * b[None, :])
        tot += ((Ey @ V) * Ex).sum(-1).abs().square()
    return tot / len(offs) * 2 * (4 * r[:, 0] * r[:, 1]) / (2 * math.pi) ** 2


def _lower_estimate(sn: sp.SymbolNorm, c: torch.Tensor) -> torch.Tensor:
    """max over anchors of |s1 + u1^* (S(c) - S(c_a)) v1| <= ||S(c)|| up to rounding: a cheap estimate for choosing
    anchors (not part of the bound)."""
    an = sn.all_anchors()
    if an is None:
        return torch.zeros(c.shape[0], dtype=sn.p.WV.dtype, device=c.device)
    dc = c.to(sn.cdt)[:, None, :] - an["c"][None]
    return (an["s1"][None] + torch.einsum("nah,ah->na", dc, an["t"])).abs().max(-1).values


def _top_eigen(t: torch.Tensor, H: int, W: int, v0: torch.Tensor | None, steps: int, target: int = 0):
    """(lambda estimate, eigenvector) of T_N(t): dense eigh for small N, Lanczos with the FFT matvec otherwise.
    target > 0: the (target + 1)-th eigenpair instead (dense eigh, or scipy's eigsh beyond N = 1024)."""
    N = H * W
    if target > 0:
        target = min(target, N - 1)
        if N <= 2048:
            with sp.single_thread():
                ev, evec = torch.linalg.eigh(dense_toeplitz(t, H, W))
            return float(ev[-1 - target]), evec[:, -1 - target]
        import numpy as np
        from scipy.sparse.linalg import eigsh
        from ..threads import limited
        with limited():  # scipy's BLAS on lipcheck's thread count
            w, V = eigsh(dense_toeplitz(t, H, W).cpu().numpy(), k=target + 1, which="LA", v0=np.ones(N))
        j = int(np.argsort(w)[0])
        return float(w[j]), torch.as_tensor(V[:, j].copy(), dtype=t.dtype, device=t.device)
    if N <= 1024:
        with sp.single_thread():
            ev, evec = torch.linalg.eigh(dense_toeplitz(t, H, W))
        return float(ev[-1]), evec[:, -1]
    A = ToeplitzMatvec(t, H, W)
    if v0 is None:
        v0 = 1 + 0.01 * torch.sin(torch.arange(N, dtype=t.dtype, device=t.device))  # deterministic, not symmetric
    theta, v, _ = sp.lanczos(lambda x: A(x), v0.reshape(1, N), steps)
    return theta, v.reshape(-1)


def _certify(t: torch.Tensor, H: int, W: int, lam: float, dtype) -> float:
    """mu >= lambda_max of the stored matrix T_N(fl(t)) by the Cholesky check, padding upward until it passes."""
    M = dense_toeplitz(t, H, W)
    u = gaussian.unit_roundoff(dtype)
    scale = max(lam, float(t.abs().max()), torch.finfo(dtype).tiny)
    for pad in (1e-10, 1e-8, 1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0):
        mu = torch.tensor(lam + pad * scale, dtype=dtype, device=t.device)
        with sp.single_thread():
            ok, mu_up = cholesky_certifies(M.clone(), mu, u)
        if bool(ok):
            return float(mu_up)
    raise ValueError("the Toeplitz majorant's Cholesky certificate failed at every pad: not certified")


# The refinement's round budget, in units of work: a round's anchors cost (anchors per round) C^3 each, so rounds =
# MAJORANT_WORK / that, between 12 and 200. Counted, never read from a clock: the same call certifies the same bound
# on a busy and on a quiet machine. 66 rounds at C = 384 (the 45 s limit it replaces allowed 35-51 in
# docs/exactness.md's runs), 200 (the old cap) up to C = 256, where the stopping rules (rtol, stall, max_cells, beat)
# end the runs first; never below 12 (C = 768: some 3-5 s a round on 2 cores, about what 45 s allowed; unmeasured).
MAJORANT_WORK = 3e10


def _anchor_count(C: int) -> int:
    """Anchors per round: they pay where SVDs are cheap (small C), so more per round there."""
    return max(8, min(32, int(4e7 / C ** 3)))


def planned_rounds(C: int, scale: float = 1.0) -> int:
    """Refinement rounds of `toeplitz_majorant` that fit MAJORANT_WORK * scale (scale: the certification's time
    budget over the 60 s the constant was sized for), from the channel count alone; between 12 and 200."""
    return int(max(12, min(200, MAJORANT_WORK * scale / (_anchor_count(C) * float(C) ** 3))))


@dataclasses.dataclass
class _Cells(CellSet):
    """The envelope's cells on the half torus: centres w, half widths r (n, 2), c (n, h) and its gradient J (n, h, 2)
    at the centres, anchored (an SVD was taken at the centre), level (halvings so far, <= MAX_LEVELS: centre_error),
    centre bounds cb (n,) and corner bounds kb (n, 4)."""
    w: torch.Tensor
    r: torch.Tensor
    c: torch.Tensor
    J: torch.Tensor
    anchored: torch.Tensor
    level: torch.Tensor
    cb: torch.Tensor
    kb: torch.Tensor


def _first_cells(q: sp.SSoGParams, model: CellModel, init_cells: int) -> _Cells:
    """max(2, init_cells / 2) x init_cells cells on wy in [0, pi], wx in [-pi, pi]; s(-w) = s(w) covers the rest.

    24 x 48 first cells by default: from a 8 x 16 grid the envelope of C = 384 layers stayed 4x above the symbol
    at 64 x 64 for the whole budget (the top eigenvector sat on a few loose cells and each round split only those);
    at C <= 192 the finer start reached the same bound 3x sooner."""
    dt, dev = q.WV.dtype, q.WV.device
    ny, nx = max(2, init_cells // 2), init_cells
    cy = (torch.arange(ny, dtype=dt, device=dev) + 0.5) / ny * math.pi
    cx = (-1 + (2 * torch.arange(nx, dtype=dt, device=dev) + 1) / nx) * math.pi
    w = torch.stack(torch.meshgrid(cy, cx, indexing="ij"), -1).reshape(-1, 2)
    r = torch.tensor([[math.pi / (2 * ny), math.pi / nx]], dtype=dt, device=dev).expand(w.shape[0], 2).clone()
    c, J = sp.symbol_and_gradient(q, w[:, 0], w[:, 1])
    sp._no_nan(c, "symbol coefficients"), sp._no_nan(J, "symbol gradients")
    level = torch.zeros(w.shape[0], dtype=torch.long, device=dev)
    return _bounded_cells(model, w, r, c, J, level)


def _bounded_cells(model: CellModel, w, r, c, J, level) -> _Cells:
    """Cells with their centre and corner bounds from the anchors so far, none anchored yet."""
    anchored = torch.zeros(w.shape[0], dtype=torch.bool, device=w.device)
    return _Cells(w, r, c, J, anchored, level, model.sn.bound(c), model.corner_bounds(c, J, _widen(r, model.p.u)))


def _envelope_top(model: CellModel, cells: _Cells, H: int, W: int, v, steps: int, target: int):
    """(lambda, eigenvector, spectral mass per cell) of T_N(s_up) for the envelope of the current cells."""
    h = _widen(cells.r, model.p.u)
    t, _ = toeplitz_coefficients(bilinear_coefficients(cells.kb, model.rho(h)), cells.w, h, H, W)
    lam, v = _top_eigen(t, H, W, v, steps, target)
    return lam, v, spectral_mass(v, cells.w, cells.r, H, W)


def _settled(history: list, lam: float, rtol: float, excess_prev: float, sn: sp.SymbolNorm, cells: _Cells,
             mass: torch.Tensor, beat_n: float | None, rounds: int) -> bool:
    """The refinement no longer pays: it stalled while the envelope is already close to s, or the estimate of
    v^T T_N(s) v, which no refinement can take the majorant below, exceeds the caller's bound beat_n."""
    if len(history) > 4 and history[-5] - lam < 0.25 * rtol * lam and excess_prev < 0.05 * lam:
        return True
    if beat_n is not None and rounds > 0:
        heavy = torch.topk(mass, min(256, mass.numel())).indices  # the other cells only add (s >= 0)
        if float((mass[heavy] * _lower_estimate(sn, cells.c[heavy])).sum() / mass.sum()) > beat_n:
            return True  # T_N(s_up) >= T_N(s) for every envelope: the caller's bound stays the better one
    return False


def _anchor_heavy_cells(model: CellModel, cells: _Cells, mass: torch.Tensor, rtol: float, k_anchor: int) -> bool:
    """Exact SVDs at heavy centres whose bound is not yet explained by a nearby anchor (slack against the cheap lower
    estimate |s1 + u1^* Delta v1| of the nearest anchors); the heavy cells' bounds tightened in place. True if any."""
    sn, u = model.sn, model.p.u
    cand = torch.nonzero(~cells.anchored).squeeze(1)
    if not cand.numel():
        return False
    cand = cand[torch.topk(mass[cand], min(4 * k_anchor, cand.numel())).indices]
    low = _lower_estimate(sn, cells.c[cand])
    slack = mass[cand] * (cells.cb[cand] - low).clamp_min(0)
    need = (cells.cb[cand] - low) > 0.25 * rtol * cells.cb[cand]
    if not bool(need.any()):
        return False
    cand, slack = cand[need], slack[need]
    pick = cand[torch.topk(slack, min(k_anchor, cand.numel())).indices]
    sn.all_anchors()
    sp._no_nan(sn.add_anchors(cells.c[pick]), "anchor singular values")
    new = sn.anchors[-1]
    cells.anchored[pick] = True
    # the new anchors tighten the heavy cells (any subset of anchors gives valid bounds elsewhere)
    hv = torch.topk(mass, min(4096, mass.numel())).indices
    cells.cb[hv] = torch.minimum(cells.cb[hv], sn.bound(cells.c[hv], new))
    cells.kb[hv] = torch.minimum(cells.kb[hv], model.corner_bounds(cells.c[hv], cells.J[hv], _widen(cells.r[hv], u),
                                                                   new))
    return True


def _split(q: sp.SSoGParams, model: CellModel, cells: _Cells, split: torch.Tensor) -> _Cells:
    """The cells with the `split` ones replaced by their 4 quarters."""
    keep = torch.ones(cells.w.shape[0], dtype=torch.bool, device=cells.w.device)
    keep[split] = False
    rs = cells.r[split] / 2
    wn = (cells.w[split][:, None, :] + model.corners[None] * rs[:, None, :]).reshape(-1, 2)
    rn = rs[:, None, :].expand(-1, 4, -1).reshape(-1, 2)
    cn, Jn = sp.symbol_and_gradient(q, wn[:, 0], wn[:, 1])
    sp._no_nan(cn, "symbol coefficients")
    return cells.take(keep).cat(_bounded_cells(model, wn, rn, cn, Jn, (cells.level[split] + 1).repeat_interleave(4)))


def toeplitz_majorant(p: sp.SSoGParams, H: int, W: int, *, rtol: float = 1e-3, init_cells: int = 48,
                      max_cells: int = 40000, max_rounds: int | None = None, split_per_round: int = 512,
                      anchors_per_round: int | None = None, lanczos_steps: int = 120,
                      time_budget: float | None = None, sn: sp.SymbolNorm | None = None,
                      beat: float | None = None, progress: bool = False, target: int = 0) -> MajorantBound:
    """Certified ||T||_2 <= lambda_max(T_N(s_up)) on an H x W grid (module docstring), with s_up a cellwise bilinear
    envelope of s(w) = ||S(w)|| refined adaptively where the top eigenvector of T_N(s_up) lives.

    Refinement stops when the estimated excess sum_j mass_j (cell bound - centre bound) is below rtol lambda, or at
    max_rounds (None: `planned_rounds` for the channel count) / max_cells; every stopping point gives a certified
    bound (coarser cells only make it looser), and these are counts, so the bound does not depend on the machine.
    time_budget: optional seconds; a run it stops early says so (cut_short). sn, when given, must be built on
    normalised(p).

    beat (in p's units), when given, is a bound the caller already holds: refinement stops once the estimate
    sum_j mass_j s(centre_j) of v^T T_N(s) v (over the 256 heaviest cells), which no refinement can take the
    majorant below, exceeds it.

    target > 0 refines where the (target + 1)-th eigenvector of T_N(s_up) lives instead of the top one: the envelope
    that lipcheck.bounds.deflation needs is tight below the top `target` eigenvalues (the bound returned is still
    lambda_max of the final envelope)."""
    sp._check_grid_size(H, W)
    t0 = time.perf_counter()
    q = sp.normalised(p)
    sp.require_finite(q, "Toeplitz majorant")
    sn = sn if sn is not None else sp.SymbolNorm(q)
    model = CellModel(q, sn)
    beat_n = math.ldexp(beat, -q.log2_scale) if beat is not None else None
    max_rounds = planned_rounds(q.dim) if max_rounds is None else max_rounds
    k_anchor = anchors_per_round or _anchor_count(q.dim)
    cells = _first_cells(q, model, init_cells)
    v, rounds, history, excess_prev, cut_short = None, 0, [], math.inf, False
    from tqdm.auto import tqdm
    bar = tqdm(total=max_rounds, desc="Toeplitz majorant", disable=not progress, leave=False)
    while True:
        lam, v, mass = _envelope_top(model, cells, H, W, v, lanczos_steps, target)
        history.append(lam)
        if rounds >= max_rounds:
            break
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            cut_short = True
            break
        if _settled(history, lam, rtol, excess_prev, sn, cells, mass, beat_n, rounds):
            break
        rounds += 1
        bar.update(1)
        new_anchor = _anchor_heavy_cells(model, cells, mass, rtol, k_anchor)
        # slack of the envelope over s on a cell: mean corner bound + remainder - centre bound (second order)
        score = (mass * (cells.kb.mean(-1) + model.rho(_widen(cells.r, q.u)) - cells.cb).clamp_min(0)
                 * (cells.level < MAX_LEVELS))
        excess = excess_prev = float(score.sum())
        if excess <= rtol * lam and not new_anchor:
            break
        if cells.w.shape[0] + 3 * split_per_round > max_cells:
            break
        top = torch.topk(score, min(split_per_round, cells.w.shape[0]))
        split = top.indices[top.values >= 0.01 * float(top.values[0])]
        if excess <= rtol * lam or split.numel() == 0:
            continue
        cells = _split(q, model, cells, split)
    bar.close()
    return _certified(q, model, cells, H, W, lam, v, mass, lanczos_steps, target,
                      dict(rounds=rounds, seconds=time.perf_counter() - t0, cut_short=cut_short))


def _certified(q: sp.SSoGParams, model: CellModel, cells: _Cells, H: int, W: int, lam: float, v, mass,
               lanczos_steps: int, target: int, run: dict) -> MajorantBound:
    """The final envelope's bound: lambda_max of its stored Toeplitz matrix certified by Cholesky, plus the rounding
    of its entries and of reading the weights, scaled back to the layer's units."""
    dt, u = q.WV.dtype, q.u
    h = _widen(cells.r, u)
    rho = model.rho(h)
    t, t_err = toeplitz_coefficients(bilinear_coefficients(cells.kb, rho), cells.w, h, H, W)
    sp._no_nan(t, "majorant Fourier coefficients")
    if H * W > 1024 or target > 0:  # a final accurate estimate so that the certificate needs little pad
        lam, _ = _top_eigen(t, H, W, v if target == 0 else None, max(lanczos_steps, 300))
    mu = _certify(t, H, W, lam, dt)
    # ||E||_2 <= sum of |entry errors| along a row <= (2H-1)(2W-1) max error; the weights' conversion error
    margin = stored_matrix_error(t_err, H, W, dt) + q.conversion_error * q.magnitude()
    upper = sp._finite((mu + margin) * (1 + 2 * u), "Toeplitz majorant bound")
    e = q.log2_scale
    excess = float((mass * (cells.kb.mean(-1) + rho - cells.cb).clamp_min(0)).sum())
    return MajorantBound(upper=sp._scale_back(upper, e, up=True), estimate=sp._scale_back(lam, e, up=False),
                         cells=int(cells.w.shape[0]), anchors=model.sn.num_svd, rounds=run["rounds"],
                         seconds=run["seconds"], margin=sp._scale_back(margin, e, up=True),
                         info=dict(cells=dict(centre=cells.w, half_width=h,
                                              coefficients=bilinear_coefficients(cells.kb, rho), log2_scale=e),
                                   certified_eigenvalue=sp._scale_back(mu, e, up=True),
                                   symbol_max_upper=sp._scale_back(float((cells.kb.max(-1).values + rho).max()), e,
                                                                   up=True),
                                   excess_estimate=sp._scale_back(excess, e, up=True)),
                         cut_short=run["cut_short"])


def toeplitz_majorant_bound(p: sp.SSoGParams, H: int, W: int, **kw) -> float:
    """Certified upper bound on ||T||_2 on an H x W grid by the Toeplitz majorant (see toeplitz_majorant)."""
    return toeplitz_majorant(p, H, W, **kw).upper
