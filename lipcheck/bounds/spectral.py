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
h numbers c_h(w). An exact SVD at an anchor w0 gives, for every other frequency w with Delta = S(w) - S(w0),
the certified bound || [[|s1 + a|, |b|], [|c|, s2 + ||Delta||]] ||_2 (a = u1^* Delta v1, b = u1^* Delta
restricted to v1-perp, c likewise): second order in w - w0, and O(h^2) per frequency. Branch and bound
with these anchors needs few SVDs even for C = 768.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Callable

import torch

from .. import gaussian

KW_CONSTANT = 1.648  # Kuczynski & Wozniakowski (1992), Theorem 4.2: P(eps >= e) <= 1.648 sqrt(n) exp(-sqrt(e)(2q-1))
ROUNDING = 1e-12  # relative margin added to values computed by LAPACK so they stay upper bounds in float64


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
    """Fixed-kernel SSoG as numbers: alpha (h, M), mu, sigma (h, M, 2), W_V, W_O (C, C), P_h via heads."""
    alpha: torch.Tensor
    mu: torch.Tensor
    sigma: torch.Tensor
    WV: torch.Tensor  # X @ WV is the value projection
    WO: torch.Tensor  # Y @ WO is the output projection (without bias)

    @property
    def num_heads(self) -> int:
        return self.alpha.shape[0]

    @property
    def dim(self) -> int:
        return self.WV.shape[0]

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def head_projections(self) -> torch.Tensor:
        d = self.head_dim
        return torch.stack([self.WV[:, i * d:(i + 1) * d] @ self.WO[i * d:(i + 1) * d, :]
                            for i in range(self.num_heads)])


def ssog_params(layer, *, dtype=torch.float64, device=None) -> SSoGParams:
    """Read alpha, mu, sigma, W_V, W_O from an SSoG module in `dtype`; non-finite values raise."""
    if not all(hasattr(layer, a) for a in ("gaussian_params", "v_proj", "o_proj")):
        raise TypeError(f"layer must be a lipcheck SSoG module, got {type(layer).__name__}")
    device = torch.device(device) if device is not None else layer.alpha.device
    with torch.no_grad():
        alpha, mu, sigma = (t.detach().to(device=device, dtype=dtype) for t in layer.gaussian_params())
        WV = layer.v_proj.weight.detach().T.to(device=device, dtype=dtype)
        WO = layer.o_proj.weight.detach().T.to(device=device, dtype=dtype)
    for name, t in (("alpha", alpha), ("mu", mu), ("sigma", sigma), ("v_proj.weight", WV), ("o_proj.weight", WO)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"layer parameter {name} has non-finite entries; a Lipschitz bound of a layer "
                             f"with NaN/inf weights is meaningless: reinitialise or fix the weights first")
    return SSoGParams(alpha, mu, sigma, WV, WO)


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
# Closed form (S1, last inequality)


def head_norms(p: SSoGParams) -> torch.Tensor:
    """||P_h||_2 for every head; P_h = W_V,h W_O,h has rank d, so QR reduces it to a d x d SVD."""
    d, out = p.head_dim, []
    with single_thread():
        return _head_norms(p, d, out)


def _head_norms(p, d, out):
    for i in range(p.num_heads):
        R1 = torch.linalg.qr(p.WV[:, i * d:(i + 1) * d]).R
        R2 = torch.linalg.qr(p.WO[i * d:(i + 1) * d, :].T).R
        out.append(torch.linalg.matrix_norm(R1 @ R2.T, ord=2))
    return torch.stack(out) * (1 + ROUNDING)


def closed_form_bound(p: SSoGParams) -> float:
    """sum_h ||P_h||_2 sum_m |alpha[h, m]|: no sigma, no mu, no grid."""
    return float((head_norms(p) * p.alpha.abs().sum(1)).sum())


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


def derivative_bounds(p: SSoGParams) -> torch.Tensor:
    """(D1, D2) with Dj = sum_k |k|^j g(k; mu, sigma) >= sup_w |d^j ghat / dw^j|, each (h, M, 2).

    A direct lattice sum over round(mu) +- (12 sigma + 12): the neglected tail is below exp(-72) relative.
    """
    R = int(math.ceil(12 * float(p.sigma.max()) + 12))
    j = torch.arange(-R, R + 1, dtype=p.mu.dtype, device=p.mu.device)
    k = torch.round(p.mu).unsqueeze(-1) + j
    g = gaussian.kernel(k, p.mu.unsqueeze(-1), p.sigma.unsqueeze(-1))
    return (k.abs() * g).sum(-1) * (1 + 1e-9), (k.square() * g).sum(-1) * (1 + 1e-9)


def symbol_and_gradient(p: SSoGParams, wy: torch.Tensor, wx: torch.Tensor):
    """c_h(w) (n, h) and its gradient dc_h/dw (n, h, 2), the 1-D derivatives by autograd through gaussian.symbol."""
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


class SymbolNorm:
    """f(c) = ||W_V diag(c_h I_d) W_O||_2 for coefficient vectors c in C^h, exact at anchors, bounded elsewhere."""

    def __init__(self, p: SSoGParams):
        self.p = p
        cdt = torch.complex128 if p.WV.dtype == torch.float64 else torch.complex64
        self.cdt = cdt
        self.WV, self.WO = p.WV.to(cdt), p.WO.to(cdt)
        self.h, self.d = p.num_heads, p.head_dim
        self.Pnorm = head_norms(p)  # (h,)
        with single_thread():
            self.nWV = float(torch.linalg.matrix_norm(p.WV, ord=2)) * (1 + ROUNDING)
            self.nWO = float(torch.linalg.matrix_norm(p.WO, ord=2)) * (1 + ROUNDING)
        self.anchors: list[dict] = []
        self.num_svd = 0

    def matrix(self, c: torch.Tensor) -> torch.Tensor:
        """S for a batch of coefficient vectors c (k, h): (k, C, C)."""
        scale = c.to(self.cdt).repeat_interleave(self.d, dim=-1)  # (k, C)
        return (self.WV[None] * scale[:, None, :]) @ self.WO[None]

    def delta_norm(self, dc: torch.Tensor) -> torch.Tensor:
        """Certified ||sum_h dc_h P_h||: the smaller of the triangle bound and ||W_V|| max|dc| ||W_O||."""
        a = dc.abs()
        return torch.minimum((a * self.Pnorm).sum(-1), self.nWV * self.nWO * a.max(-1).values)

    def cheap(self, c: torch.Tensor) -> torch.Tensor:
        return self.delta_norm(c)

    def add_anchors(self, c: torch.Tensor) -> torch.Tensor:
        """Exact SVDs at coefficient vectors c (k, h); stores what the anchor bound needs; returns s1 (k,)."""
        S = self.matrix(c)
        with single_thread():
            U, s, Vh = torch.linalg.svd(S)
        self.num_svd += c.shape[0]
        u1, v1 = U[..., :, 0], Vh[..., 0, :].conj()  # S v1 = s1 u1
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
        s1 = s[:, 0] * (1 + ROUNDING)
        s2 = (s[:, 1] if s.shape[1] > 1 else torch.zeros_like(s[:, 0])) * (1 + ROUNDING)
        new = dict(c=c.to(self.cdt), s1=s1, s2=s2, t=t, Gu=Gu, Gv=Gv)
        self.anchors.append(new)
        return s[:, 0]

    def anchor_bound(self, c: torch.Tensor, anchor: dict) -> torch.Tensor:
        """Certified upper bound on f at coefficient vectors c (n, h) from a batch of anchors: min over them.

        For one anchor (s1 >= s2 its top singular values, u1, v1): with Delta = S(c) - S(anchor),
        a = u1^* Delta v1, b = u1^* Delta minus its v1 part, r = Delta v1 minus its u1 part,
        ||S(c)|| <= || [[|s1 + a|, ||b||], [||r||, s2 + ||Delta||]] ||_2 (norm of the block-norm matrix).
        """
        dc = c.to(self.cdt)[:, None, :] - anchor["c"][None]  # (n, A, h)
        a = torch.einsum("nah,ah->na", dc, anchor["t"])
        bu = torch.einsum("nai,aij,naj->na", dc, anchor["Gu"], dc.conj()).real.clamp_min(0)  # ||u1^* Delta||^2
        bv = torch.einsum("nai,aij,naj->na", dc.conj(), anchor["Gv"], dc).real.clamp_min(0)  # ||Delta v1||^2
        aa = a.abs().square()
        q2 = (bu - aa).clamp_min(0) * (1 + 1e-9) + 1e-300
        r2 = (bv - aa).clamp_min(0) * (1 + 1e-9) + 1e-300
        dn = self.delta_norm(dc)
        pp = (anchor["s1"][None] + a).abs()
        ss = anchor["s2"][None] + dn
        tr = pp.square() + q2 + r2 + ss.square()
        det = (pp * ss - (q2 * r2).sqrt()).abs()
        two_by_two = ((tr + (tr.square() - 4 * det.square()).clamp_min(0).sqrt()) / 2).sqrt()
        first_order = anchor["s1"][None] + dn
        return torch.minimum(two_by_two, first_order).min(-1).values * (1 + 1e-12)

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


def certified_max_points(sn: SymbolNorm, c: torch.Tensor, w: torch.Tensor, *, rtol: float = 1e-9,
                         batch: int = 4, max_svd: int = 100000) -> SymbolMax:
    """Certified max of f over finitely many frequencies (coefficients c (n, h), frequencies w (n, 2)).

    Branch and bound: SVD at the point with the largest current upper bound, update every bound from
    the new anchor, drop points whose bound is within rtol of the best value, repeat.
    """
    n = c.shape[0]
    ub = sn.bound(c)
    best, arg = -1.0, 0
    done = torch.zeros(n, dtype=torch.bool, device=c.device)
    while True:
        active = (~done) & (ub > best * (1 + rtol))
        if not bool(active.any()) or sn.num_svd >= max_svd:
            break
        idx = torch.nonzero(active).squeeze(1)
        pick = idx[torch.topk(ub[idx], min(batch, idx.numel())).indices]
        sn.all_anchors()
        vals = sn.add_anchors(c[pick])
        new = sn.anchors[-1]
        done[pick] = True
        ub[pick] = vals * (1 + ROUNDING)
        for j in range(vals.numel()):
            if float(vals[j]) > best:
                best, arg = float(vals[j]), int(pick[j])
        rest = ~done
        if bool(rest.any()):
            ub[rest] = torch.minimum(ub[rest], sn.bound(c[rest], new))
    return SymbolMax(best, max(best, float(ub.max())), (float(w[arg, 0]), float(w[arg, 1])), sn.num_svd, n)


def circulant_bound(p: SSoGParams, H: int, W: int, *, sn: SymbolNorm | None = None, rtol: float = 1e-9) -> SymbolMax:
    """||T||_2 <= ||block-circulant embedding|| = max over the (2H-1) x (2W-1) DFT grid of ||S(w)|| (S2)."""
    gy, gx, wy, wx = truncated_symbols(p, H, W)
    c = torch.einsum("hm,ahm,bhm->abh", p.alpha.to(gy.dtype), gy, gx).reshape(-1, p.num_heads)
    w = torch.stack(torch.meshgrid(wy, wx, indexing="ij"), -1).reshape(-1, 2)
    # f(-w) = f(w) (real kernels: conjugate symbols), so half of the grid suffices
    keep = (w[:, 0] > 0) | ((w[:, 0] == 0) & (w[:, 1] >= 0))
    sn = sn if sn is not None else SymbolNorm(p)
    return certified_max_points(sn, c[keep], w[keep], rtol=rtol)


def resolution_free_bound(p: SSoGParams, *, sn: SymbolNorm | None = None, rtol: float = 1e-6,
                          init_cells: int = 32, max_cells: int = 400_000, max_rounds: int = 200,
                          anchors_per_round: int | None = None, progress: bool = False) -> tuple[SymbolMax, dict]:
    """Certified sup over the continuous torus of ||S(w)|| (S1): valid for every H, W at once.

    Cells of the half torus wy in [0, pi], wx in [-pi, pi] (f(-w) = f(w)). On a cell with centre w0 and
    half widths r, c(w) = c(w0) + J (w - w0) + R with |R_h| <= 1/2 sum_m |alpha| (D2y ry^2 + 2 D1y D1x ry rx
    + D2x rx^2), Dj = sum_k |k|^j g(k) >= |ghat^(j)|. c -> ||S(c)|| is convex, so its max over the
    linearised box is at one of the 4 corners: the cell bound is max_corners bound(c0 + J v) + ||S(R)||,
    second order in r. Branch and bound: SVD anchors at the most promising centres, retire cells within
    best (1 + rtol), split the others. Returns (SymbolMax, info); info['achieved_rtol'] says how tight it got.
    """
    sn = sn if sn is not None else SymbolNorm(p)
    dt, dev = p.WV.dtype, p.WV.device
    D1, D2 = derivative_bounds(p)  # (h, M, 2)
    A = p.alpha.abs()
    corners = torch.tensor([[-1, -1], [-1, 1], [1, -1], [1, 1]], dtype=dt, device=dev)

    def remainder(r):  # (n, h): Taylor remainder of c_h over the cell
        ry, rx = r[:, :1, None], r[:, 1:, None]
        q = D2[..., 0] * ry ** 2 + 2 * D1[..., 0] * D1[..., 1] * ry * rx + D2[..., 1] * rx ** 2
        return 0.5 * (A * q).sum(-1)

    def cell_bounds(c, J, r, anchors=None):  # (n, 4) corner bounds (without the remainder)
        pts = c[:, None, :] + (J[:, None, :, :] * (corners[None, :, None, :] * r[:, None, None, :])).sum(-1)
        flat = pts.reshape(-1, pts.shape[-1])
        return sn.bound(flat, anchors).reshape(-1, 4)

    ny, nx = max(2, init_cells // 2), init_cells
    ry, rx = math.pi / (2 * ny), math.pi / nx
    cy = (torch.arange(ny, dtype=dt, device=dev) + 0.5) * 2 * ry
    cx = -math.pi + (torch.arange(nx, dtype=dt, device=dev) + 0.5) * 2 * rx
    w = torch.stack(torch.meshgrid(cy, cx, indexing="ij"), -1).reshape(-1, 2)
    r = torch.tensor([[ry, rx]], dtype=dt, device=dev).expand(w.shape[0], 2).clone()
    c, J = symbol_and_gradient(p, w[:, 0], w[:, 1])
    cb = sn.bound(c)
    kb = cell_bounds(c, J, r)
    best, arg = 0.0, (0.0, 0.0)
    retired = 0.0
    rounds = 0
    from tqdm.auto import tqdm
    bar = tqdm(total=max_rounds, desc="resolution-free sup", disable=not progress, leave=False)
    # SVDs cost C^3: many anchors per round for small C, few for large C
    k_anchor = anchors_per_round or max(4, min(64, int(1e8 / p.dim ** 3)))
    while rounds < max_rounds and w.shape[0]:
        rounds += 1
        bar.update(1)
        need = cb > best * (1 + rtol / 4)
        if bool(need.any()):
            idx = torch.nonzero(need).squeeze(1)
            ubn = kb[idx].max(-1).values
            pick = idx[torch.topk(ubn, min(k_anchor, idx.numel())).indices]
            sn.all_anchors()
            vals = sn.add_anchors(c[pick])
            new = sn.anchors[-1]
            j = int(vals.argmax())
            if float(vals[j]) > best:
                best, arg = float(vals[j]), (float(w[pick[j], 0]), float(w[pick[j], 1]))
            cb = torch.minimum(cb, sn.bound(c, new))
            kb = torch.minimum(kb, cell_bounds(c, J, r, new))
        ub = kb.max(-1).values + sn.delta_norm(remainder(r))
        ok = ub <= best * (1 + rtol)
        if bool(ok.any()):
            retired = max(retired, float(ub[ok].max()))
        w, r, c, J, cb, kb, ub = w[~ok], r[~ok], c[~ok], J[~ok], cb[~ok], kb[~ok], ub[~ok]
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
        cn, Jn = symbol_and_gradient(p, wn[:, 0], wn[:, 1])
        keep = ~split
        w, r = torch.cat([w[keep], wn]), torch.cat([r[keep], rn])
        c, J = torch.cat([c[keep], cn]), torch.cat([J[keep], Jn])
        cb, kb = torch.cat([cb[keep], sn.bound(cn)]), torch.cat([kb[keep], cell_bounds(cn, Jn, rn)])
    bar.close()
    upper = max(retired, best)
    if w.shape[0]:
        upper = max(upper, float((kb.max(-1).values + sn.delta_norm(remainder(r))).max()))
    info = dict(rounds=rounds, svds=sn.num_svd, cells_left=int(w.shape[0]),
                achieved_rtol=upper / best - 1 if best > 0 else float("inf"))
    return SymbolMax(best, upper, arg, sn.num_svd, -1), info


# --------------------------------------------------------------------------------------------------
# Lanczos (lower bound, probabilistic upper bound), Gram iteration, exact


def kw_epsilon(n: int, steps: int, failure_probability: float) -> float:
    """Relative eigenvalue error e with P(lambda_max - theta >= e lambda_max) <= failure_probability after
    `steps` Lanczos steps from a random start (Kuczynski-Wozniakowski 1992, Thm 4.2)."""
    return (math.log(KW_CONSTANT * math.sqrt(n) / failure_probability) / (2 * steps - 1)) ** 2


def lanczos(A: Callable[[torch.Tensor], torch.Tensor], v0: torch.Tensor, steps: int, *,
            stop: Callable[[float, int], bool] | None = None, progress: bool = False):
    """Lanczos with full reorthogonalisation on a symmetric PSD operator A.

    Returns (theta_max, ritz_vector, steps_done). `stop(theta, j)` may end the run early.
    """
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


def gram_bound(T: torch.Tensor, *, squarings: int = 6, ritz: int = 16) -> tuple[float, int]:
    """Gram iteration (Delattre et al. 2023) on the dense T: ||T||^2 = lambda_1(G), G = T^T T, and for
    G_k = G^(2^k): lambda_1^(2^(k+1)) <= ||G_k||_F^2 - sum_{i=2..m} mu_i^2 with mu the Ritz values of G_k
    on m orthonormal vectors (Cauchy interlacing, G_k PSD). Returns (bound, squarings used)."""
    G = T.T @ T
    logscale = 0.0
    best = math.inf
    n = G.shape[0]
    used = 0
    for k in range(squarings + 1):
        fro = float(G.norm())
        G = G / fro
        logscale = logscale + math.log(fro) / 2 ** k  # G_k = exp(2^k logscale) * G
        if k < squarings:  # plain Frobenius bound; the interlacing tightening only at the last iterate
            bound = math.exp(logscale / 2)
            if bound < best:
                best, used = bound, k
            G = G @ G
            G = (G + G.T) / 2
            continue
        # top-m Ritz values of the normalised G_k
        m = min(ritz, n)
        with single_thread():
            V = torch.linalg.eigh(G).eigenvectors[:, -m:]
            V = torch.linalg.qr(V).Q
            mu = torch.linalg.eigvalsh(V.T @ G @ V).clamp_min(0)
        rest = max(1.0 - float(mu[:-1].square().sum()), 0.0) + 4 * n * 2.2e-16  # ||G_k||_F = 1 now
        lam = math.exp(logscale + math.log(rest) / 2 ** (k + 1))
        bound = math.sqrt(lam)
        if bound < best:
            best, used = bound, k
    return best * (1 + ROUNDING), used


@dataclasses.dataclass
class SSoGBound:
    """Two-sided bounds on ||T||_2 for one fixed-kernel SSoG layer on an H x W grid (SPEC S1, S2)."""
    H: int
    W: int
    lower: float
    upper: float
    upper_probabilistic: float
    failure_probability: float
    exact: float | None
    exact_reason: str | None
    resolution_free: float
    closed_form: float
    circulant: float
    gram: float | None
    seconds: dict
    method: dict
    info: dict

    @property
    def gap(self) -> float:
        return (self.upper - self.lower) / self.lower if self.lower > 0 else math.inf

    @property
    def gap_probabilistic(self) -> float:
        return (self.upper_probabilistic - self.lower) / self.lower if self.lower > 0 else math.inf

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["gap"], d["gap_probabilistic"] = self.gap, self.gap_probabilistic
        return d


def _check_grid_size(H, W):
    for name, v in (("H", H), ("W", W)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer grid size, got {v!r}")


def ssog_lipschitz(layer, H: int, W: int, *, dtype=torch.float64, device=None,
                   failure_probability: float = 1e-6, target_gap: float = 1e-3, max_steps: int = 400,
                   memory_bytes: float = 2e9, exact_max: int = 4096, gram_max: int = 1536,
                   resolution_free: bool = True, rf_rtol: float = 1e-6, circulant_rtol: float = 1e-9,
                   symbol_start: bool = True, symbol_start_tokens: int = 1024, symbol_steps: int = 40,
                   probabilistic: bool = True, seed: int = 0,
                   progress: bool = False) -> SSoGBound:
    """Certified bounds on Lip(SSoG) = ||T||_2 on an H x W grid.

    lower <= exact <= upper <= resolution_free <= closed_form, upper = min(closed form, resolution-free,
    circulant embedding, Gram iteration); upper_probabilistic holds with probability >= 1 - failure_probability
    over the random Lanczos start. exact is a dense SVD when N C <= exact_max, else None with the reason.
    """
    _check_grid_size(H, W)
    if not (0 < failure_probability < 1):
        raise ValueError(f"failure_probability must be in (0, 1), got {failure_probability}")
    p = ssog_params(layer, dtype=dtype, device=device)
    N, C = H * W, p.dim
    n = N * C
    seconds, method, info = {}, {}, {}

    t = time.perf_counter()
    closed = closed_form_bound(p)
    seconds["closed_form"], method["closed_form"] = time.perf_counter() - t, "sum_h ||P_h|| sum_m |alpha|"

    sn = SymbolNorm(p)
    t = time.perf_counter()
    if resolution_free:
        rf, rf_info = resolution_free_bound(p, sn=sn, rtol=rf_rtol, progress=progress)
        rfree = min(rf.upper, closed)
        info["resolution_free"] = dict(symbol_sup_lower=rf.lower, argmax=rf.argmax, **rf_info)
        method["resolution_free"] = "branch and bound on the torus, SVD anchors, second-order cell bounds"
    else:
        rfree, method["resolution_free"] = closed, "not computed (closed form)"
    seconds["resolution_free"] = time.perf_counter() - t

    t = time.perf_counter()
    circ = circulant_bound(p, H, W, sn=SymbolNorm(p), rtol=circulant_rtol)
    seconds["circulant"] = time.perf_counter() - t
    method["circulant"] = f"block-circulant embedding, certified max over the {2 * H - 1}x{2 * W - 1} DFT grid"
    info["circulant"] = dict(lower=circ.lower, argmax=circ.argmax, svds=circ.num_svd, points=circ.num_points)

    dense = None
    gram = None
    t = time.perf_counter()
    if n <= gram_max:
        dense = dense_operator(p, H, W)
        gram, k = gram_bound(dense)
        method["gram"] = f"Gram iteration, {k} squarings, Cauchy-interlacing tightening"
    else:
        method["gram"] = f"skipped: N*C = {n} > gram_max = {gram_max}"
    seconds["gram"] = time.perf_counter() - t
    upper = min(closed, rfree, circ.upper, gram if gram is not None else math.inf)

    t = time.perf_counter()
    exact, reason = None, None
    if n <= exact_max:
        dense = dense if dense is not None else dense_operator(p, H, W)
        with single_thread():
            exact = float(torch.linalg.matrix_norm(dense, ord=2))
        method["exact"] = "dense SVD"
        # A backward-stable SVD returns sigma_1 of T + E with ||E|| <= c n eps ||T||: with that margin the
        # dense value is itself a certified upper bound, which closes the gap where Gram iteration was skipped.
        upper = min(upper, exact * (1 + max(ROUNDING, 16 * n * torch.finfo(torch.float64).eps)))
    else:
        reason = (f"N*C = {n} > exact_max = {exact_max}: the dense matrix would take "
                  f"{n * n * 8 / 2 ** 30:.1f} GiB in float64 and O((NC)^3) time")
        method["exact"] = "not computed"
    seconds["exact"] = time.perf_counter() - t

    # Lanczos on T^T T: a symbol-guided start for the lower bound on large grids, a random start for the
    # probabilistic bound (Kuczynski-Wozniakowski needs a start uniform on the sphere)
    t = time.perf_counter()
    A = lambda v: apply_T_adjoint(apply_T(v, p), p)
    steps_cap = int(max(2, min(max_steps, memory_bytes // (8 * n))))

    def lower_of(v):
        return float(apply_T(v, p).norm() / v.norm())

    lower = 0.0
    if symbol_start and N >= symbol_start_tokens:
        # plane wave at the circulant argmax times the top singular direction, under a sine window
        cs = symbol_coefficients(p, torch.tensor([circ.argmax[0]], dtype=dtype, device=p.WV.device),
                                 torch.tensor([circ.argmax[1]], dtype=dtype, device=p.WV.device))
        with single_thread():
            U = torch.linalg.svd(sn.matrix(cs)).U[0, :, 0]
        iy = torch.arange(H, dtype=dtype, device=p.WV.device)
        ix = torch.arange(W, dtype=dtype, device=p.WV.device)
        win = torch.sin(math.pi * (iy[:, None] + 1) / (H + 1)) * torch.sin(math.pi * (ix[None, :] + 1) / (W + 1))
        phase = torch.exp(1j * (circ.argmax[0] * iy[:, None] + circ.argmax[1] * ix[None, :]))
        s0 = (win * phase)[..., None] * U.conj()[None, None, :]
        s0 = s0.real if float(s0.real.norm()) > float(s0.imag.norm()) else s0.imag
        s0 = s0[None].to(dtype)
        theta2, v2, k2 = lanczos(A, s0, max(2, min(steps_cap, symbol_steps)), progress=progress)
        lower = lower_of(v2)
        info["lanczos_symbol_start"] = dict(steps=k2, theta=theta2, lower=lower)
    seconds["lower"] = time.perf_counter() - t
    method["lower"] = "||T v|| / ||v|| at a Lanczos Ritz vector (fast operator)"

    t = time.perf_counter()
    if probabilistic:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        v0 = torch.randn(1, H, W, C, generator=gen, dtype=dtype).to(p.WV.device)

        # where the dense value closed the upper bound, run Lanczos until the lower bound meets it too
        gap_goal = target_gap if exact is None else min(target_gap, 1e-8)

        def stop(theta, j):
            if j < 5 or j % 5:
                return False
            eps = kw_epsilon(n, j, failure_probability)
            if eps >= 1:
                return False
            up = math.sqrt(max(theta, 0.0) / (1 - eps))
            return (min(up, upper) / math.sqrt(max(theta, 1e-300)) - 1) <= gap_goal * 0.9

        theta, v, steps = lanczos(A, v0, steps_cap, stop=stop, progress=progress)
        lower = max(lower, lower_of(v))
        eps = kw_epsilon(n, steps, failure_probability)
        up_prob = math.sqrt(max(theta, 0.0) * (1 + ROUNDING) / (1 - eps)) if eps < 1 else math.inf
        info["lanczos"] = dict(steps=steps, theta=theta, kw_epsilon=eps, n=n)
        method["upper_probabilistic"] = (f"Lanczos, {steps} steps from a Gaussian start, Kuczynski-Wozniakowski "
                                         f"bound (relative eigenvalue error {eps:.3g})")
    else:
        up_prob, failure_probability = upper, 0.0
        method["upper_probabilistic"] = "not run: the deterministic upper bound (failure probability 0)"
    seconds["upper_probabilistic"] = time.perf_counter() - t
    up_prob = min(up_prob, upper)
    return SSoGBound(H=H, W=W, lower=lower, upper=upper, upper_probabilistic=up_prob,
                     failure_probability=failure_probability, exact=exact, exact_reason=reason,
                     resolution_free=rfree, closed_form=closed, circulant=circ.upper, gram=gram,
                     seconds=seconds, method=method, info=info)
