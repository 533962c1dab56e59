"""Theorem D4's coupling matrix X through the heads' low rank (proofs/S2.md, 'X through the heads').

X = sum_{(h,g),(h',g')} (W_hg^T W_h'g') kron (F_hg F_h'g'^T), F_hg = P_g P_h^T, has h^4 Kronecker terms; formed
term by term it needs h^4 products of C x C matrices (98 GB held at once at 12 heads, C = 768). Each head's P_h =
V_h O_h (V_h = W_V's columns of head h, O_h = W_O's rows, rank r = C / h), so

    F_hg F_h'g'^T = V_g core(g, h, h', g') V_g'^T,   core = a_gh b_hh' a_h'g',   a = blocks of W_O W_O^T,
                                                                                  b = blocks of W_V^T W_V,

and X = (I_k kron W_V) B (I_k kron W_V)^T with B[(i, g, x), (j, g', y)] = sum_{h,h'} (W_hg^T W_h'g')[i, j]
core(g, h, h', g')[x, y]: h^4 products of r x r matrices, one (k^2 x h^2) by (h^2 x r^2) product per (g, g'), and
two products with W_V of k^2 C^3 multiply-adds. Every factor carries a bound on its distance to the exact matrix
(as lipcheck.bounds.approx), block by block.
"""
from __future__ import annotations

import torch

from .. import rounding
from .approx import _Approx, _up

# the two products with W_V run as BLAS-3 at about this many times the rate per multiply-add of the Kronecker sums
# that GRAM_BUDGET was measured on (12 heads, C = 768, k = 10: X in 5 s on 2 cores)
GEMM_SPEEDUP = 10.0


def work(heads: int, k: int, C: int) -> float:
    """Multiply-adds of `coupling_gram` in GRAM_BUDGET's units: the Kronecker contraction h^4 (k r)^2, the cores
    2 h^4 r^3 and the products with W_V 2 k^2 C^3 / GEMM_SPEEDUP."""
    r = max(int(C) // max(int(heads), 1), 1)
    return heads ** 4 * (float(k * r) ** 2 + 2.0 * r ** 3) + 2.0 * float(k) ** 2 * float(C) ** 3 / GEMM_SPEEDUP


def _block_fro(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """||block||_F over the trailing `dims`, rounded up (the float sum and square root: gamma_{n + 4})."""
    n = 1
    for d in dims:
        n *= t.shape[d]
    return t.square().sum(dims).sqrt() * (1 + rounding.gamma(n + 4))


def _product_error(na, ea, nb, eb, fa, fb, n: int):
    """||fl(A B) - A B|| <= ||A|| e_B + ||B|| e_A + e_A e_B + gamma_{n+2} ||A^||_F ||B^||_F (approx._mm), on tensors of
    block norms (na, nb: bounds on the exact blocks' norms; fa, fb: the stored blocks' Frobenius norms)."""
    return (na * eb + nb * ea + ea * eb + rounding.gamma(n + 2) * fa * fb) * (1 + 1e-12)


def _channel_gram(F: torch.Tensor, heads: int, transpose: bool):
    """(blocks (h, h, r, r), their errors (h, h), Frobenius norms (h, h)) of F F^T (W_O: rows of head h) or F^T F
    (W_V: columns), F exact: entrywise |fl - exact| <= gamma_{C+2} |F_g| |F_h|^T, so in norm <= gamma ||F_g||_F
    ||F_h||_F."""
    C = F.shape[0]
    r = C // heads
    G = (F.T @ F) if transpose else (F @ F.T)
    G = G.reshape(heads, r, heads, r).permute(0, 2, 1, 3)
    parts = F.T.reshape(heads, r, C) if transpose else F.reshape(heads, r, C)
    fro = _block_fro(parts, (1, 2))
    err = rounding.gamma(C + 2) * fro[:, None] * fro[None, :] * (1 + 1e-12)
    return G, err, _block_fro(G, (2, 3))


def coupling_gram(q, W: list[_Approx]) -> _Approx:
    """X of Theorem D4 (k C x k C, rows and columns (token function, channel)) for the normalised float64 parameters
    q and W_hg (N x k each, pairs (h, g) in the order h * heads + g), through the heads' rank (module docstring).
    Equal to deflation.gram_matrices' X up to rounding; both carry a certified error bound."""
    h, r, C = q.num_heads, q.head_dim, q.dim
    if h * r != C:
        raise ValueError(f"X through the heads needs C = heads x head_dim (got C = {C}, {h} x {r})")
    N, k = W[0].val.shape
    dt = W[0].val.dtype
    if dt != torch.float64 or q.WV.dtype != torch.float64:
        raise ValueError("X through the heads is certified in float64 only (its margins are float64's)")
    # token parts T4[(h,g),(h',g')] = W_hg^T W_h'g' (k x k), one product; approx._pairwise's bound per block
    Wc = torch.cat([w.val for w in W], 1)
    T4 = (Wc.T @ Wc).reshape(h, h, k, h, h, k)
    wf = torch.tensor([w.fro for w in W], dtype=dt).reshape(h, h)
    we = torch.tensor([w.err for w in W], dtype=dt).reshape(h, h)
    wn = wf + we
    t_err = _product_error(wn[:, :, None, None], we[:, :, None, None], wn[None, None], we[None, None],
                           wf[:, :, None, None], wf[None, None], N)  # (h, g, h', g')
    t_fro = _block_fro(T4.permute(0, 1, 3, 4, 2, 5), (4, 5))
    t_nrm = t_fro + t_err
    # channel cores: a[g, h] = O_g O_h^T, b[h, h'] = V_h^T V_h'; L[g, h, h'] = a_gh b_hh'; core = L a_h'g'
    a, a_err, a_fro = _channel_gram(q.WO, h, transpose=False)
    b, b_err, b_fro = _channel_gram(q.WV, h, transpose=True)
    a_nrm, b_nrm = a_fro + a_err, b_fro + b_err
    L = torch.einsum("ghxy,hHyz->ghHxz", a, b)
    L_err = _product_error(a_nrm[:, :, None], a_err[:, :, None], b_nrm[None], b_err[None],
                           a_fro[:, :, None], b_fro[None], r)  # (g, h, h')
    L_fro = _block_fro(L, (3, 4))
    L_nrm = L_fro + L_err
    core = torch.einsum("ghHxz,HGzy->gGhxHy", L, a)  # (g, g', h, x, h', y)
    # L[g, h, h'] (g, h, h') against a[h', g'] (h', g'): broadcast to (g, g', h, h')
    Ln, Le, Lf = (t.permute(0, 1, 2)[:, None] for t in (L_nrm, L_err, L_fro))
    An, Ae, Af = (t.T[None, :, None, :] for t in (a_nrm, a_err, a_fro))
    c_err = _product_error(Ln, Le, An, Ae, Lf, Af, r)  # (g, g', h, h')
    c_fro = _block_fro(core.permute(0, 1, 2, 4, 3, 5), (4, 5))
    c_nrm = c_fro + c_err
    # B's block (g, g') = sum_{h,h'} T4[(h,g),(h',g')] kron core(g,h,h',g'): approx._kron_sum's bound per block, and
    # the block matrix's norm is at most the Frobenius norm of its blocks' norms
    tn, te, tf = (t.permute(1, 3, 0, 2) for t in (t_nrm, t_err, t_fro))  # (g, g', h, h')
    blk = (tn * c_err + c_nrm * te + te * c_err).sum((2, 3)) \
        + rounding.gamma(h * h + 2) * (tf * c_fro).sum((2, 3))
    B_err = _up(float(blk.square().sum().sqrt()) * (1 + rounding.gamma(h * h + 4)))
    B = torch.einsum("hgiHGj,gGhxHy->igxjGy", T4, core).reshape(k, C, k, C)
    del core, L
    B_fro = _Approx(B, 0.0).fro
    # (I_k kron W_V) B (I_k kron W_V)^T: W_V exact, || |I kron W_V| ||_2 <= ||W_V||_F; each entry a length-C dot
    v_fro = _Approx(q.WV, 0.0).fro
    g = rounding.gamma(C + 2)
    Y = torch.einsum("cz,izjw->icjw", q.WV, B)
    del B
    Y_err = _up(v_fro * B_err + g * v_fro * B_fro)
    Y_fro = _Approx(Y, 0.0).fro
    X = torch.einsum("icjw,dw->icjd", Y, q.WV).reshape(k * C, k * C)
    del Y
    X_err = _up(v_fro * Y_err + g * Y_fro * v_fro)
    S = (X + X.T) / 2
    err = _up(X_err + 2 * rounding.unit_roundoff(dt) * _Approx(X, 0.0).fro)
    if not (torch.isfinite(S).all() and err < float("inf")):  # NaN or inf anywhere: no bound
        raise ValueError("X through the heads came out non-finite: not certified")
    return _Approx(S, err)
