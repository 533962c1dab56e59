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

This module holds the symbol and its certified maxima (SymbolNorm, the circulant embedding, the resolution-free
branch and bound). The parameters live in `params`, the fast operator in `fast_operator`, the rounding margins and
the closed form in `margins`, the derivative bounds in `derivatives`, what an anchor proves in `anchor`, Lanczos in
`krylov`, Gram iteration in `gram`; their names are re-exported here, where the package has always read them.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .. import gaussian, rounding
from ..rounding import norm2_upper
from .anchor import _up_to, anchor_verification, two_by_two_norm  # noqa: F401
from .cell_set import CellSet
from .derivatives import derivative_bounds, symbol_and_gradient  # noqa: F401
from .fast_operator import apply_T, apply_T_adjoint, dense_operator  # noqa: F401
from .gram import gram_bound, interlacing_tail  # noqa: F401
from .krylov import CHECK_EVERY, KW_CONSTANT, kw_epsilon, lanczos  # noqa: F401
from .margins import (_closed_form, _log_range, closed_form_bound, coefficient_error, dense_error,  # noqa: F401
                      head_norms, symbol_error, tap_error, truncated_symbol_error)
from .params import (SSoGParams, _check_grid_size, _finite, _ldexp, _no_nan, _pow2_exponent,  # noqa: F401
                     _scale_back, check_layer_dtype, normalised, require_finite, single_thread, ssog_params)


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


# --------------------------------------------------------------------------------------------------
# The resolution-free bound: branch and bound over cells of the continuous torus



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




@dataclasses.dataclass
class _Cells(CellSet):
    """Live cells of the half torus: centres w (n, 2), half widths r (n, 2), the coefficients at the centres c (n, h)
    and at the 4 corners K (n, 4, h), and their bounds cb (n,) and kb (n, 4) (without the remainder)."""
    w: torch.Tensor
    r: torch.Tensor
    c: torch.Tensor
    K: torch.Tensor
    cb: torch.Tensor
    kb: torch.Tensor


_CORNERS = ((-1, -1), (-1, 1), (1, -1), (1, 1))


def _corner_points(w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """(n, 4, 2): the 4 corners of every cell (centre w, half widths r)."""
    corners = torch.tensor(_CORNERS, dtype=w.dtype, device=w.device)
    return w[:, None, :] + corners[None] * r[:, None, :]


def _new_cells(p: SSoGParams, sn: SymbolNorm, w: torch.Tensor, r: torch.Tensor) -> _Cells:
    """Cells at centres w with half widths r: coefficients at centres and corners, their bounds (no anchor yet)."""
    c = symbol_coefficients(p, w[:, 0], w[:, 1])
    pts = _corner_points(w, r).reshape(-1, 2)
    K = symbol_coefficients(p, pts[:, 0], pts[:, 1]).reshape(-1, 4, p.num_heads)
    _no_nan(c, "symbol coefficients"), _no_nan(K, "corner coefficients")
    return _Cells(w, r, c, K, sn.bound(c), sn.bound(K.reshape(-1, K.shape[-1])).reshape(-1, 4))


def _first_cells(p: SSoGParams, init_cells: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A grid of max(2, init_cells / 2) x init_cells cells on wy in [0, pi], wx in [-pi, pi] (f(-w) = f(w))."""
    dt, dev = p.WV.dtype, p.WV.device
    ny, nx = max(2, init_cells // 2), init_cells
    ry, rx = math.pi / (2 * ny), math.pi / nx
    cy = (torch.arange(ny, dtype=dt, device=dev) + 0.5) * 2 * ry
    cx = -math.pi + (torch.arange(nx, dtype=dt, device=dev) + 0.5) * 2 * rx
    w = torch.stack(torch.meshgrid(cy, cx, indexing="ij"), -1).reshape(-1, 2)
    return w, torch.tensor([[ry, rx]], dtype=dt, device=dev).expand(w.shape[0], 2).clone()


def _quarters(cells: _Cells) -> tuple[torch.Tensor, torch.Tensor]:
    """Centres and half widths of the 4 quarters of every cell."""
    rs = cells.r / 2
    return _corner_points(cells.w, rs).reshape(-1, 2), rs[:, None, :].expand(-1, 4, -1).reshape(-1, 2)


def _remainder(p: SSoGParams, D2: torch.Tensor, eta_c: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """(n, h): the bilinear-interpolation error of c_h over cells of half widths r, plus the corners' rounding eta_c."""
    ry, rx = r[:, :1, None], r[:, 1:, None]
    q = D2[..., 0] * ry ** 2 + D2[..., 1] * rx ** 2
    return 0.5 * (p.alpha.abs() * q).sum(-1) * (1 + p.gamma(p.alpha.shape[1] + 8)) + eta_c[None]


def _anchor_round(p: SSoGParams, sn: SymbolNorm, cells: _Cells, best: float, arg: tuple, rtol: float,
                  k_anchor: int) -> tuple[_Cells, float, tuple, float]:
    """SVD anchors at the centres with the largest corner bounds among those not yet within best (1 + rtol / 4);
    every cell's bounds tightened by them. Returns (cells, best, its argmax, anchor bounds evaluated)."""
    need = cells.cb > best * (1 + rtol / 4)
    if not bool(need.any()):
        return cells, best, arg, 0.0
    idx = torch.nonzero(need).squeeze(1)
    ubn = cells.kb[idx].max(-1).values
    pick = idx[torch.topk(ubn, min(k_anchor, idx.numel())).indices]
    sn.all_anchors()
    _no_nan(sn.add_anchors(cells.c[pick]), "anchor singular values")
    vals = sn._last_values
    new = sn.anchors[-1]
    j = int(vals.argmax())
    if float(vals[j]) > best:
        best, arg = float(vals[j]), (float(cells.w[pick[j], 0]), float(cells.w[pick[j], 1]))
    cb = torch.minimum(cells.cb, sn.bound(cells.c, new))
    kb = torch.minimum(cells.kb, sn.bound(cells.K.reshape(-1, cells.K.shape[-1]), new).reshape(-1, 4))
    work = 5.0 * cells.w.shape[0] * pick.numel() * p.num_heads
    return dataclasses.replace(cells, cb=cb, kb=kb), best, arg, work


def _resolution_free(p: SSoGParams, *, sn: SymbolNorm, rtol: float, init_cells: int, max_cells: int,
                     max_rounds: int, anchors_per_round: int | None, progress: bool,
                     max_work: float | None = None) -> tuple[SymbolMax, dict]:
    _, D2 = derivative_bounds(p)  # (h, M, 2): sup |ghat''| per axis
    # rounding: every computed coefficient vector (centres and corners) errs by <= eta_c per head
    eta_c = coefficient_error(p, symbol_error(p))  # (h,)
    cells = _new_cells(p, sn, *_first_cells(p, init_cells))
    _no_nan(D2, "derivative bounds")

    def cell_upper(cells):  # corner bounds plus the remainder: >= f on the whole cell
        return _no_nan(cells.kb.max(-1).values + sn.delta_norm(_remainder(p, D2, eta_c, cells.r)),
                       "resolution-free cell bounds")

    best, arg, retired, rounds, work = 0.0, (0.0, 0.0), 0.0, 0, 0.0
    from tqdm.auto import tqdm
    bar = tqdm(total=max_rounds, desc="resolution-free sup", disable=not progress, leave=False)
    # SVDs cost C^3: many anchors per round for small C, few for large C
    k_anchor = anchors_per_round or max(4, min(64, int(1e8 / p.dim ** 3)))
    while rounds < max_rounds and cells.w.shape[0] and (max_work is None or work <= max_work):
        rounds += 1
        bar.update(1)
        cells, best, arg, spent = _anchor_round(p, sn, cells, best, arg, rtol, k_anchor)
        work += spent
        ub = cell_upper(cells)
        ok = ub <= best * (1 + rtol)
        if bool(ok.any()):
            retired = max(retired, float(ub[ok].max()))
        cells, ub = cells.take(~ok), ub[~ok]
        if cells.w.shape[0] == 0:
            break
        # split cells whose bound is not explained by their centre (the cell is too wide)
        # cells whose centre still needs an anchor wait for it instead of multiplying
        split = ((ub - cells.cb) > best * rtol / 2) & (cells.cb <= best * (1 + rtol / 4))
        if not bool(split.any()):
            continue
        if 4 * int(split.sum()) + int((~split).sum()) > max_cells:
            break
        cells = cells.take(~split).cat(_new_cells(p, sn, *_quarters(cells.take(split))))
    bar.close()
    upper = max(retired, best)
    if cells.w.shape[0]:
        upper = max(upper, float(cell_upper(cells).max()))
    upper = _finite(upper, "resolution-free bound")
    info = dict(rounds=rounds, svds=sn.num_svd, cells_left=int(cells.w.shape[0]), work=work,
                achieved_rtol=upper / best - 1 if best > 0 else float("inf"))
    return SymbolMax(best, upper, arg, sn.num_svd, -1), info
