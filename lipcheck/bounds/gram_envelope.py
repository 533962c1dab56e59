"""Circulant Gram envelope: T^T T <= R_f kron I_C with R_f an N x N two-level Toeplitz matrix built from the symbol's
norms at the circulant embedding's frequencies (proofs/S2.md, 'Circulant Gram envelope').

T is the compression of the block circulant C = sum_h C_h kron P_h^T on the L1 x L2 torus (L1 = 2H - 1, L2 = 2W - 1:
every offset of the box without wrap-around collisions; proofs/S2.md, 'Block-circulant upper bound'), T = E^T C E
with E the zero padding of the H x W box. For X supported on the box, Parseval on the torus and the norm of each
frequency's C x C block give

    ||T X||^2 <= ||C E X||^2 = (L1 L2)^-1 sum_w ||S_L(w)^T x^(w)||^2 <= (L1 L2)^-1 sum_w f(w) sum_c |x_c^(w)|^2
              = sum_c x_c^T R_f x_c,     R_f[j, j'] = r(j - j'),   r(D) = (L1 L2)^-1 sum_w f(w) cos(w . D),

for any even f(w) >= ||S_L(w)||^2 at the L1 L2 torus frequencies. So ||T||^2 <= lambda_max(R_f) <= max f (the
circulant bound squared), and for token functions orthogonal to span(Q), ||T b||^2 <= lambda_max(R_f on span(Q)^perp)
||b||^2: the complement bound of Theorem D4 (lipcheck.bounds.deflation) with no leakage term. Only the phases of
S_L(w) x^(w) within each torus frequency are lost; the Toeplitz majorant loses them over the continuous torus and
pays for a cellwise envelope besides.

Cost: anchors (verified top singular triples of C x C symbol matrices) at the frequencies of half the torus where
the symbol is large (S_L(-w) is the conjugate of S_L(w)), the anchors' certified bounds or a cheap one elsewhere
(`torus_symbol_norms`).
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch

from .. import rounding
from . import spectral as sp
from .majorant import _upper_half, dense_toeplitz

# the anchors cost up to this many C^3 (about 390 at C = 384: some 20 s on 2 cores); the rest of the torus keeps
# the anchors' bounds or the cheap one (torus_symbol_norms)
ENVELOPE_BUDGET = 2.2e10
# certified norms stop once every remaining cheap bound squared is below THETA times the largest certified value.
# Measured on frozen narrow kernels at C = 384 (docs/exactness.md, 1 thread): at 14 x 14 (365 frequencies) theta =
# 0.5, 0.25, 0.1 certified 64, 96, 192 norms and left the deflated bound 0.34, 0.28, 0.22 % above exact (0.22 % with
# all 365); at 32 x 32 0.5 certified 256 (0.160 %), 0.25 and 0.1 the budget's 388 (0.155 %)
THETA = 0.1
# up to this many frequencies on half the torus (32 x 32: 1985) R_f is stored as an N x N matrix; beyond, the
# deflated bound reads f alone (lipcheck.bounds.gram_lowrank: Lanczos by FFT and a low-rank complement), up to
# MAX_TORUS_FREQUENCIES (128 x 128: 32513; past it the Toeplitz majorant or the circulant embedding serve)
MAX_FREQUENCIES = 2048
MAX_TORUS_FREQUENCIES = 32768
TWO_PI = 2 * math.pi  # fl(2 pi) = 2 fl(pi): within 2 pi u of 2 pi


@dataclasses.dataclass
class GramEnvelope:
    """R: the stored R_f (N x N, exactly symmetric), err >= ||R - R_f||_2 for the exact R_f of f; f (L1, L2):
    certified f(w) >= ||S_L(w)||^2 at the torus frequencies; all in normalised(p)'s units (squared)."""
    R: torch.Tensor
    err: float
    f: torch.Tensor
    seconds: float
    norms: int  # C x C norms certified (the rest of f is the cheap bound)


def half_torus(H: int, W: int) -> int:
    return math.ceil((2 * H - 1) * (2 * W - 1) / 2)


def affordable(H: int, W: int) -> bool:
    """Whether the deflated bound can use the envelope at this grid: half the torus within MAX_TORUS_FREQUENCIES
    (the certified norms are capped by ENVELOPE_BUDGET at any C)."""
    return half_torus(H, W) <= MAX_TORUS_FREQUENCIES


def dense(H: int, W: int) -> bool:
    """Whether R_f is stored as an N x N matrix (half the torus within MAX_FREQUENCIES: up to 32 x 32); beyond, only
    f is kept (lipcheck.bounds.gram_lowrank)."""
    return half_torus(H, W) <= MAX_FREQUENCIES


def torus_pairs(L1: int, L2: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, mirror) over the L1 x L2 torus, row-major: each frequency's flat index and that of -w (mod the torus)."""
    a, b = torch.arange(L1, device=device), torch.arange(L2, device=device)
    idx = (a[:, None] * L2 + b[None, :]).reshape(-1)
    mirror = (((L1 - a) % L1)[:, None] * L2 + ((L2 - b) % L2)[None, :]).reshape(-1)
    return idx, mirror


def angle_table(rows: torch.Tensor, cols: torch.Tensor, L: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of 2 pi (r c mod L) / L for integers r in rows, c in cols: the reduction exact in integers, each
    entry within trig_error(u) of the exact value."""
    m = (rows[:, None] * cols[None, :]) % L  # exact integers in [0, L)
    ang = (m.to(dtype) * TWO_PI) / L
    return torch.cos(ang), torch.sin(ang)


def trig_error(u: float) -> float:
    """|fl(cos(fl(fl(TWO_PI m) / L))) - cos(2 pi m / L)| for integers 0 <= m < L (and sin likewise): TWO_PI errs by
    <= 2 pi u, the product and the division round once each, so the angle (<= 2 pi) errs by <= 2 pi (3u + 3u^2); cos
    is 1-Lipschitz and the library's cos, sin err by <= 2u (the model of proofs/S2.md, 'Toeplitz majorant')."""
    return 2 * math.pi * 3.01 * u + 2 * u


def torus_symbol_norms(q: sp.SSoGParams, H: int, W: int, *, chunk: int = 32, theta: float | None = None,
                       budget: float | None = None, sn: sp.SymbolNorm | None = None) -> tuple[torch.Tensor, int]:
    """(f (L1, L2), the number of anchors): f(w) >= ||S_L(w)||^2 at every torus frequency w = (2 pi a / L1, 2 pi b /
    L2), S_L the symbol of the kernels truncated to the box's offsets (sp.truncated_symbols, error
    sp.truncated_symbol_error), on half the torus; the mirror frequency (-a mod L1, -b mod L2) takes the same value
    (real taps: S_L(-w) = conj(S_L(w)), the same norm).

    Every frequency starts from the cheap bound g = SymbolNorm.cheap (the triangle bound over the heads or ||W_V||
    max|c_h| ||W_O||, certified). Branch and bound: the `chunk` frequencies of largest current bound become anchors
    (SymbolNorm.add_anchors: a verified top singular triple, certified at the anchor itself), and every frequency
    still above the stopping level takes the smaller of its bound and the new anchors' (SymbolNorm.anchor_bound: near
    an anchor it is within second order of the exact norm). It stops when every remaining bound squared is at most
    theta times the largest anchor value, or the anchors have cost budget / C^3 of them. Either way f is certified
    (every value is a minimum of upper bounds): the rule only decides where looser bounds stand, and <= theta max f
    there costs little, for R_f's top eigenvalues follow f's largest values (proofs/S2.md, 'Circulant Gram
    envelope', (i)). Anchoring where the bound is largest, not where g is (as certified norms in g's order did),
    finds the peak of f where g misjudges it: C = 384 init kernels at 128 x 128, max f 382324 -> 193569.

    sn: a SymbolNorm on the same q that already holds anchors (the circulant embedding's sit at these very
    frequencies): every frequency starts from the smaller of g and their bounds, a frequency that is one of them
    is not anchored again, and the budget counts new anchors only."""
    theta = THETA if theta is None else float(theta)
    budget = ENVELOPE_BUDGET if budget is None else float(budget)
    c, _, _ = sp.torus_coefficients(q, H, W)  # (L1, L2, h)
    L1, L2 = c.shape[:2]
    dev = c.device
    idx, mirror = torus_pairs(L1, L2, dev)
    keep = idx <= mirror  # one of each pair (w, -w); the self-mirrored ones once
    if sn is None:
        sn = sp.SymbolNorm(q)
    elif not all(torch.equal(getattr(sn.p, n), getattr(q, n)) for n in ("alpha", "mu", "sigma", "WV", "WO")):
        raise ValueError("the SymbolNorm passed was built on other parameters (another layer or scale): its anchors "
                         "do not bound this symbol; pass one built on normalised(p)")
    err_c = float(sn.delta_norm(sp.coefficient_error(q, sp.truncated_symbol_error(q, H, W))))
    ck = c.reshape(-1, q.num_heads)[keep]
    s = sp._no_nan(sn.bound(ck), "torus symbol norms")  # the cheap bound, or the anchors' already made
    open_, best = _not_anchored(sn, ck)
    most = max(1, int(budget // float(q.dim) ** 3))
    done = 0
    level = math.sqrt(theta)  # g^2 <= theta best^2, compared unsquared (no overflow)
    while done < min(most, s.numel()) and bool(open_.any()):
        rest = torch.where(open_, s, torch.full_like(s, -math.inf))
        pick = torch.topk(rest, min(chunk, most - done, int(open_.sum()))).indices
        if float(s[pick[0]]) <= level * best:
            break
        open_[pick] = False
        done += pick.numel()
        try:
            cert = sn.add_anchors(ck[pick])
        except torch.linalg.LinAlgError:  # the guess's eigensolver (S^* S out of range): these stay at g
            continue
        # NaN from an anchor is "not certified": the frequency keeps its bound
        s[pick] = torch.minimum(s[pick], torch.nan_to_num(cert, nan=math.inf))
        best = max(best, float(sn._last_values.max()))
        live = torch.nonzero(open_ & (s > level * best)).squeeze(1)
        if live.numel():
            s[live] = torch.minimum(s[live], torch.nan_to_num(sn.bound(ck[live], sn.anchors[-1]), nan=math.inf))
    u = rounding.unit_roundoff(torch.float64)
    # two additions rounded to nearest (<= u each), then the square (<= u): 8u covers them
    s = (s + err_c) * (1 + 2 * u)
    f = sp._no_nan(s * s * (1 + 8 * u), "torus symbol norms")
    out = torch.empty(L1 * L2, dtype=torch.float64, device=dev)
    out[idx[keep]] = f
    out[mirror[keep]] = f
    return out.reshape(L1, L2), done


def _not_anchored(sn: sp.SymbolNorm, ck: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, float]:
    """(mask of the coefficient vectors ck (n, h) that are not exactly one of sn's anchors, the largest anchor value
    s1 among those that are, 0.0 where none): where to anchor, and the stopping rule's start."""
    open_ = torch.ones(ck.shape[0], dtype=torch.bool, device=ck.device)
    an = sn.all_anchors()
    if an is None:
        return open_, 0.0
    used = torch.zeros(an["c"].shape[0], dtype=torch.bool, device=ck.device)
    for i in range(0, ck.shape[0], chunk):
        eq = (ck[i:i + chunk].to(sn.cdt)[:, None, :] - an["c"][None]).abs().amax(-1) == 0
        open_[i:i + chunk] = ~eq.any(1)
        used |= eq.any(0)
    return open_, float(an["s1"][used].max()) if bool(used.any()) else 0.0


def torus_toeplitz_coefficients(f: torch.Tensor, H: int, W: int) -> tuple[torch.Tensor, float]:
    """(t (2H - 1, 2W - 1), e_r): t[D] = fl(r(D)), r(D) = (L1 L2)^-1 sum_w f(w) cos(w . D) for the offsets |D_y| <= H - 1,
    |D_x| <= W - 1, copied from the half D > 0 onto -D (r is even) so that the matrix is exactly symmetric, and e_r >=
    |t[D] - r(D)|. Separable: cos(a + b) = cos a cos b - sin a sin b, each part two matrix products over L1 then L2
    terms with nonnegative f; the angles are 2 pi ((a D) mod L) / L with the reduction exact in integers."""
    L1, L2 = f.shape
    dev, dt = f.device, f.dtype
    u = rounding.unit_roundoff(dt)

    def tables(L: int, n: int):
        return angle_table(torch.arange(-(n - 1), n, device=dev), torch.arange(L, device=dev), L, dt)

    cy, sy = tables(L1, H)
    cx, sx = tables(L2, W)
    t = ((cy @ f) @ cx.T - (sy @ f) @ sx.T) / (L1 * L2)
    t = torch.where(_upper_half(H, W, dev), t, t.flip(0, 1))
    # sum_w f(w) rounded up: a sum of L1 L2 nonnegative terms errs by <= gamma_{L1 L2} of itself
    F = float(f.sum()) * (1 + 2 * rounding.gamma(L1 * L2 + 2, u))
    e = trig_error(u)
    # per part: the tables' errors (|c'_y c'_x - c_y c_x| <= 2e + e^2) and the nested products (gamma_{L1 + L2} of
    # sum f |c'_y| |c'_x| <= (1 + e)^2 F); then the difference of the parts and the division (u each, of <= 2 (1 +
    # e)^2 F (1 + gamma)); all relative to F / (L1 L2), rounded up by gamma_8
    g = rounding.gamma(L1 + L2 + 2, u)
    rel = 2 * (2 * e + e * e) + 2 * g * (1 + e) ** 2 + 4 * u * (1 + e) ** 2 * (1 + g)
    # underflow: each of the 2 L1 L2 products per part may lose one subnormal eta
    e_r = F / (L1 * L2) * rel * (1 + rounding.gamma(8, u)) + 4 * (L1 * L2 + 1) * rounding.tiny_subnormal(dt)
    return t, e_r


def gram_envelope(q: sp.SSoGParams, H: int, W: int, *, theta: float | None = None,
                  budget: float | None = None, sn: sp.SymbolNorm | None = None) -> GramEnvelope:
    """R_f for f = torus_symbol_norms (normalised parameters q, float64; theta, budget: its stopping rule, default
    THETA and ENVELOPE_BUDGET; sn: anchors already made on q): the stored matrix T_N(t) of torus_toeplitz_coefficients differs from R_f by a
    two-level Toeplitz matrix with entries <= e_r, so by <= N e_r in norm (every row holds N of them)."""
    if q.WV.dtype != torch.float64:
        raise ValueError("the circulant Gram envelope is certified in float64 only: pass ssog_params(layer) in float64")
    sp._check_grid_size(H, W)
    sp.require_finite(q, "circulant Gram envelope")
    t0 = time.perf_counter()
    f, norms = torus_symbol_norms(q, H, W, theta=theta, budget=budget, sn=sn)
    t, e_r = torus_toeplitz_coefficients(f, H, W)
    sp._no_nan(t, "circulant Gram envelope coefficients")
    R = dense_toeplitz(t, H, W)
    err = H * W * e_r * (1 + rounding.gamma(4))
    return GramEnvelope(R=R, err=err, f=f, seconds=time.perf_counter() - t0, norms=norms)


def certified_top(env: GramEnvelope) -> float:
    """tau >= lambda_max(R_f) >= ||T||^2 (normalised units): Cholesky-checked lambda_max of the stored R plus err."""
    with sp.single_thread():
        lam = float(rounding.verified_lambda_max(env.R, tries=20))
    if not math.isfinite(lam):
        raise ValueError("the circulant Gram envelope's Cholesky certificate failed at every pad: not certified")
    return (lam + env.err) * (1 + 2 * rounding.unit_roundoff(torch.float64))


def circulant_gram_bound(p: sp.SSoGParams, H: int, W: int) -> float:
    """Certified ||T||_2 <= sqrt(lambda_max(R_f)) on an H x W grid (module docstring), in p's units: at most the
    circulant embedding's bound, below it where the symbol's peak is narrow against the grid."""
    q = sp.normalised(p)
    tau = certified_top(gram_envelope(q, H, W))
    u = rounding.unit_roundoff(torch.float64)
    upper = sp._finite(math.sqrt(tau) * (1 + 2 * u) + q.conversion_error * q.magnitude(), "circulant Gram bound")
    return sp._scale_back(upper, q.log2_scale, up=True)
