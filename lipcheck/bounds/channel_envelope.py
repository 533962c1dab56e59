"""The channel-resolved circulant Gram envelope, split at a level into a constant and a low-rank part
(proofs/S2.md, 'Lemma G4').

T is the compression to the H x W box of the block circulant Cb on the L1 x L2 torus (L = 2n - 1) whose symbol, in
the row convention X -> X S, is S(w) = sum_h c_h(w) P_h (spectral.torus_coefficients). So

    T^T T <= E^T Cb^T Cb E = R_F,   x^T R_F x = (L1 L2)^-1 sum_w xhat(w) F(w) xhat(w)^*,   F(w) = S(w) S(w)^*.

Unlike the scalar envelope R_f (x) I (gram_envelope), R_F keeps the channels: its eigenvalues above a level are about
N / (L1 L2) times the number of pairs (w, j) with lambda_j(F(w)) above it, a few dozen where R_f (x) I has thousands
(every channel of every hot token function). At each torus frequency, F(w) <= l(w) I + sum_j beta_j u_j u_j^* with
certified l(w) (a Cholesky check, below) and then, pairing w with -w (F(-w) = conj F(w), xhat(-w) = conj xhat(w)),

    R_F <= d I + A^T A,   d = max(level, max_w l(w)),

one pair of real rows of A per (w, j): sqrt(kappa beta_j / (L1 L2)) (cos(w . n) Re u_j + sin(w . n) Im u_j) and
(cos(w . n) Im u_j - sin(w . n) Re u_j) over (token n, channel), kappa = 2 (1 at the self-mirrored w = 0). For b
orthogonal to any subspace U with projector P onto its complement, b^T R_F b <= (d + ||A P||^2) ||b||^2.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .. import rounding
from . import spectral as sp
from .approx import _Approx, _up
from .gram_envelope import angle_table, torus_pairs, trig_error

# frequencies per batched eigendecomposition (C x C complex each)
CHUNK = 16


@dataclasses.dataclass
class ChannelEnvelope:
    """At = A^T (N C x m) with its error; level d (normalised units squared); hot: frequencies split; rows: m."""
    At: _Approx
    level: float
    hot: int
    rows: int
    frequencies: int


def split_frequency(S: torch.Tensor, level: float):
    """Guides for one batch of stored symbols S (b, C, C): F = fl(S S^*), its eigenpairs above `level` (u_j, beta_j =
    lambda_j - level). Nothing here is certified; `certify_split` makes the split a proof."""
    F = S @ S.conj().transpose(-1, -2)
    F = (F + F.conj().transpose(-1, -2)) / 2
    with sp.single_thread():
        lam, U = torch.linalg.eigh(F)
    return F, lam, U


def certify_split(F: torch.Tensor, S_fro2: torch.Tensor, U: torch.Tensor, beta: torch.Tensor,
                  guess: torch.Tensor | None = None) -> torch.Tensor:
    """(b,) l~ >= lambda_max(S S^* - U diag(beta) U^*) for the stored S, U, beta (beta zero where unused).

    fl(S S^*) errs entrywise by <= gamma_{2C+4} (|S| |S|^*) (complex inner products of length C), in norm by
    <= gamma_{2C+4} ||S||_F^2; fl(U diag(beta) U^*) by <= gamma_{2C+4} sum_j beta_j ||u_j||^2; the difference and the
    Hermitian parts (of fl(S S^*) and of the difference) add 3u (||G^||_F + ||S||_F^2 + sum_j beta_j ||u_j||^2)
    (||S S^*||_F <= trace = ||S||_F^2); underflow adds 8 (C + 2) eta per entry of each
    product. The stored matrix's lambda_max is Cholesky-checked
    (rounding.verified_lambda_max on its real form, from `guess` where given: the split puts the top at the level)."""
    C = F.shape[-1]
    u = rounding.unit_roundoff(torch.float64)
    g = rounding.gamma(2 * C + 4)
    Ub = U * beta.to(U.dtype)[:, None, :]
    D = Ub @ U.conj().transpose(-1, -2)
    G = F - D
    G = (G + G.conj().transpose(-1, -2)) / 2
    with sp.single_thread():
        lam = rounding.verified_lambda_max(rounding.hermitian_as_real(G), tries=20, lam=guess)
    fro_g = rounding.sum_of_squares(G).sqrt() * (1 + rounding.gamma(2 * C * C + 4))
    beta_u = (beta * U.abs().square().sum(-2)).sum(-1) * (1 + rounding.gamma(2 * C + 4))
    # underflow in the two products: <= 8 (C + 2) eta per entry each, as in rounding.norm2_upper's Gram matrix
    err = g * S_fro2 + g * beta_u + 3 * u * (fro_g + S_fro2 + beta_u) \
        + 16 * (C + 2) * C * rounding.tiny_subnormal(torch.float64)
    return (lam + err) * (1 + 4 * u)


def symbol_bounds(q: sp.SSoGParams, H: int, W: int, sn: sp.SymbolNorm):
    """(coefficients ck (s, h) at one frequency of each pair {w, -w} of the L1 x L2 torus, their flat torus indices,
    the mirror table, s_up (s,) >= ||S(w)|| certified (SymbolNorm bound plus the truncated coefficients' error, two
    additions rounded up), that error, (L1, L2))."""
    u = rounding.unit_roundoff(torch.float64)
    c, _, _ = sp.torus_coefficients(q, H, W)  # (L1, L2, h)
    L1, L2, h = c.shape
    idx, mirror = torus_pairs(L1, L2, c.device)
    keep = idx <= mirror
    ck = c.reshape(-1, h)[keep]
    err_c = float(sn.delta_norm(sp.coefficient_error(q, sp.truncated_symbol_error(q, H, W))))
    s_up = (sp._no_nan(sn.bound(ck), "symbol norms") + err_c) * (1 + 2 * u)
    return ck, idx[keep], mirror, s_up, err_c, (L1, L2)


def check_work(hot: int, C: int, max_work: float | None) -> None:
    """ValueError where splitting `hot` frequencies at C channels, counted as hot C^2, exceeds max_work."""
    if max_work is not None and hot * float(C) ** 2 > max_work:
        raise ValueError(f"{hot} frequencies to split at C = {C} exceed the work budget "
                         f"({hot * float(C) ** 2:.3g} > {max_work:.3g} units of C^2)")


def channel_envelope(q: sp.SSoGParams, H: int, W: int, sn: sp.SymbolNorm, level: float, *,
                     max_rows: int | None = None, max_work: float | None = None) -> ChannelEnvelope:
    """R_F <= d I + A^T A (module docstring), certified, in normalised(p)'s units: frequencies whose certified
    ||S(w)||^2 (SymbolNorm bound, with the truncated symbols' coefficient error) is at most the level take no rows;
    the others are split at it by their eigenpairs, each split Cholesky-checked. The level is `level`, raised where
    more than max_rows rows would stand above it (a first pass of eigenvalues counts them): a tuning choice.
    max_work: refuse (ValueError) where the hot frequencies' eigendecompositions, counted as (hot frequencies) C^2,
    exceed it: a count, no clock."""
    if not (level > 0 and math.isfinite(level)):
        raise ValueError(f"the split level must be finite and > 0, got {level}: not certified")
    u = rounding.unit_roundoff(torch.float64)
    ck, sel_idx, mirror, s_up, err_c, (L1, L2) = symbol_bounds(q, H, W, sn)
    dev = ck.device
    f_up = s_up * s_up * (1 + 8 * u)
    hot = torch.nonzero(f_up > level).squeeze(1)
    check_work(hot.numel(), q.dim, max_work)
    if max_rows is not None and hot.numel() * q.dim > max_rows // 2:
        level = _level_for_rows(sn, ck, hot, level, max_rows)
        hot = torch.nonzero(f_up > level).squeeze(1)
    d = _up(level)
    freq, vecs, betas = [], [], []
    for chunk in (hot.split(CHUNK) if hot.numel() else ()):
        cc = ck[chunk]
        S = sn.matrix(cc)
        eS = sn.matrix_error(cc) + err_c  # ||S^ - S(w)|| for the exact symbol at w
        F, lam, U = split_frequency(S, level)
        beta = (lam - level).clamp_min(0) * (1 + 1e-9)
        beta = torch.where(lam > level, beta, torch.zeros_like(beta))
        S_fro2 = rounding.sum_of_squares(S) * (1 + rounding.gamma(2 * S.shape[-1] ** 2 + 4))
        guess = torch.where(lam > level, torch.full_like(lam, level), lam).max(-1).values
        lt = sp._no_nan(certify_split(F, S_fro2, U, beta, guess), "split certificate")
        # ||x S|| <= ||x S^|| + eS ||x||, ||S^|| <= s_up + eS: F(w) <= F^ + (2 eS (s_up + eS) + eS^2) I
        ls = lt + (2 * eS * (s_up[chunk] + eS) + eS * eS) * (1 + 4 * u)
        if not bool(torch.isfinite(ls).all()):
            raise ValueError("a frequency's split could not be certified: not certified")
        d = max(d, _up(float(ls.max())))
        for i in range(cc.shape[0]):
            use = beta[i] > 0
            if bool(use.any()):
                freq.append(torch.full((int(use.sum()),), int(sel_idx[chunk[i]]), device=dev))
                vecs.append(U[i][:, use].T)
                betas.append(beta[i][use])
    if not freq:
        empty = torch.zeros(H * W * q.dim, 0, dtype=torch.float64, device=dev)
        return ChannelEnvelope(_Approx(empty, 0.0), d, int(hot.numel()), 0, int(ck.shape[0]))
    At = envelope_rows(torch.cat(freq), torch.cat(vecs), torch.cat(betas), mirror, L1, L2, H, W)
    return ChannelEnvelope(At, d, int(hot.numel()), At.val.shape[1], int(ck.shape[0]))


def _level_for_rows(sn: sp.SymbolNorm, ck: torch.Tensor, hot: torch.Tensor, level: float, max_rows: int) -> float:
    """The smallest level >= `level` that leaves at most max_rows rows (two per eigenvalue of F(w) above it at the hot
    frequencies): the (max_rows / 2 + 1)-th largest of those eigenvalues where there are more. A guess only."""
    lams = []
    for chunk in (hot.split(CHUNK) if hot.numel() else ()):
        F = sn.matrix(ck[chunk])
        F = F @ F.conj().transpose(-1, -2)
        with sp.single_thread():
            lam = torch.linalg.eigvalsh((F + F.conj().transpose(-1, -2)) / 2).reshape(-1)
        lams.append(lam[lam > level])
    lam = torch.sort(torch.cat(lams), descending=True).values if lams else torch.zeros(0)
    keep = max_rows // 2
    return level if lam.numel() <= keep else max(level, float(lam[keep]))


def envelope_rows(fi: torch.Tensor, Uc: torch.Tensor, beta: torch.Tensor, mirror: torch.Tensor, L1: int, L2: int,
                  H: int, W: int) -> _Approx:
    """A^T (N C x 2 r) for r pairs (frequency index fi on the L1 x L2 torus, complex u (C,), beta >= 0), columns
    (token n, channel c) row-major: s (cos(w . n) Re u_c + sin(w . n) Im u_c), s (cos(w . n) Im u_c - sin(w . n) Re u_c)
    with s = sqrt(kappa beta / (L1 L2)) for the stored beta (kappa = 1 at a self-mirrored w, else 2).

    Rounding: the computed cos(w . n), sin(w . n) err by <= et = 2 (2e + e^2) + 4u (1 + e)^2 (e = trig_error(u), as in
    gram_lowrank.envelope_columns), the weight by <= 3u relative, the two products, their sum and the weight's product
    by <= 4u relative of the moduli: each entry within rel s (|Re u_c| + |Im u_c|), rel = (et + 7u)(1 + et)(1 + 4u),
    plus 4 eta (underflow). Frobenius over all entries: rel sqrt(2 N sum_r s_r^2 sum_c (|Re u_c| + |Im u_c|)^2)."""
    dev = Uc.device
    dt = torch.float64
    u = rounding.unit_roundoff(dt)
    ai, bi = fi // L2, fi % L2
    kappa = torch.where(mirror[fi] == fi, 1.0, 2.0).to(dt)
    s = torch.sqrt(kappa * beta / (L1 * L2))
    cy, sy = angle_table(ai, torch.arange(H, device=dev), L1, dt)  # (r, H)
    cx, sx = angle_table(bi, torch.arange(W, device=dev), L2, dt)  # (r, W)
    cos = (cy[:, :, None] * cx[:, None, :] - sy[:, :, None] * sx[:, None, :]).reshape(-1, H * W)
    sin = (sy[:, :, None] * cx[:, None, :] + cy[:, :, None] * sx[:, None, :]).reshape(-1, H * W)
    a, b = Uc.real * s[:, None], Uc.imag * s[:, None]  # (r, C)
    re = cos[:, :, None] * a[:, None, :] + sin[:, :, None] * b[:, None, :]
    im = cos[:, :, None] * b[:, None, :] - sin[:, :, None] * a[:, None, :]
    r, C = Uc.shape
    val = torch.cat([re, im], 0).reshape(2 * r, H * W * C).T.contiguous()
    e = trig_error(u)
    et = 2 * (2 * e + e * e) + 4 * u * (1 + e) ** 2
    rel = (et + 7 * u) * (1 + et) * (1 + 4 * u)
    mass = ((Uc.real.abs() + Uc.imag.abs()).square().sum(1) * s.square()).sum() * (1 + rounding.gamma(4 * C + 8))
    tiny = rounding.tiny_subnormal(dt)
    err = rel * math.sqrt(2 * H * W * float(mass)) * (1 + 4 * u) + 4 * tiny * math.sqrt(val.numel())
    return _Approx(val, _up(err))
