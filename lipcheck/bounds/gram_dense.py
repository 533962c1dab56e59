"""The dense Gram: ||T||^2 = lambda_max(M) with M = T^T T formed entry by entry as an N C x N C matrix from its
Kronecker factors, and certified by one Cholesky factorisation of mu I - fl(M) (proofs/S2.md, 'The dense Gram').

Where the spectrum of T^T T is flat at the top (kernels at the sigma floor are shifts of the grid: every token
function carries a singular value near ||T||), no k token functions deflate it and the envelopes stay 5-20 % above
the norm. On small grids of wide layers (8x8 at C = 384: N C = 24576) the dense SVD is out of reach (a full
eigendecomposition is some 10x the work of one factorisation) but M itself fits: with rows and columns (token,
channel), M = sum_{h,g} (K_h^T K_g) kron (P_h P_g^T), N x N token factors and C x C channel factors, formed from
the same parameters as every other bound. A guess theta of lambda_max(M) (Lanczos on the fast operator) padded by
a small relative amount becomes a proof when Cholesky of mu I - fl(M) minus Rump's shift completes.

Errors (spectral norm), each in S2.md: the factors' errors as `_Approx` carries them (taps, products), the factors
made exactly symmetric in pairs (the (g, h) factor is the transpose of the (h, g) one, so the exact matrix of the
computed factors is symmetric and the factorisation reads its lower triangle), and the h^2-term sum per entry
(gamma_{h^2 + 2} sum ||A_hg||_F ||B_hg||_F). Memory: M, factorised in place, (N C)^2 float64 (4.5 GiB at N C = 24576).
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch

from .. import rounding
from . import spectral as sp
from .approx import _Approx, _pairwise, _sym, _up, kron_sum_error
from .deflation import apply_kernel, head_projections, kernel_factors

# N C up to which the default certification forms M densely where the other bounds leave a gap above
# DENSE_GRAM_GAP: M takes (N C)^2 float64 (4.5 GiB; factorised in place, rounding._blocked_cholesky_), one
# factorisation (N C)^3 / 3 multiply-adds (about 60 s on 2 cores at 24576)
DENSE_GRAM_MAX = 24576
DENSE_GRAM_GAP = 1e-4
# relative pads of the Ritz value tried in turn, one formation and factorisation each: the first holds wherever the
# Ritz value is within 1e-7 of lambda_max (a gap of 5e-8 in ||T||, Rump's shift some 7e-8 more at N C = 24576)
PADS = (1e-7, 4e-6, 1.6e-4, 1e-2)


@dataclasses.dataclass
class DenseGramBound:
    """upper >= ||T||_2 (certified, the layer's units); mu: the certified lambda_max(fl(M)) < mu and
    err >= ||fl(M) - M|| (normalised units); pad: the relative pad of the Ritz value that passed; tries:
    factorisations run; seconds."""
    upper: float
    mu: float
    err: float
    pad: float
    tries: int
    seconds: float


def token_matrices(q: sp.SSoGParams, H: int, W: int) -> list[_Approx]:
    """K_h (N x N, row-major tokens) with its error: `apply_kernel` on the identity, which is exact."""
    N = H * W
    eye = _Approx(torch.eye(N, dtype=q.WV.dtype, device=q.WV.device), 0.0)
    return [apply_kernel(f, eye) for f in kernel_factors(q, H, W)]


def _symmetric_pairs(pairs: list[list[_Approx]]) -> list[list[_Approx]]:
    """The (g, h) entry replaced by the exact transpose of the (h, g) one (g > h; the same error bound, as the exact
    matrices are transposes of each other too), the diagonal ones symmetrised."""
    n = len(pairs)
    out = [list(row) for row in pairs]
    for h in range(n):
        out[h][h] = _sym(pairs[h][h])
        for g in range(h + 1, n):
            out[g][h] = _Approx(pairs[h][g].val.T, pairs[h][g].err)
    return out


def gram_factors(q: sp.SSoGParams, H: int, W: int) -> tuple[list[list[_Approx]], list[list[_Approx]]]:
    """(A, B): A[h][g] ~ K_h^T K_g (N x N), B[h][g] ~ P_h P_g^T (C x C), exactly symmetric in pairs."""
    K = token_matrices(q, H, W)
    P = head_projections(q)
    return _symmetric_pairs(_pairwise(K, K, tX=True)), _symmetric_pairs(_pairwise(P, P, tY=True))


def gram_error(A: list[list[_Approx]], B: list[list[_Approx]]) -> float:
    """>= ||fl(M) - M||_2: `approx.kron_sum_error` over the h^2 pairs (each entry of fl(M) one dot product of length
    h^2, `form_gram`)."""
    return kron_sum_error([a for row in A for a in row], [b for row in B for b in row])


def form_gram(A: list[list[_Approx]], B: list[list[_Approx]]) -> torch.Tensor:
    """fl(M), M[(i, c), (j, d)] = sum_t A_t[i, j] B_t[c, d] over the h^2 pairs t: per token row i one product
    (N x h^2) (h^2 x C^2), each entry one dot product of length h^2, written into M's rows of token i (a temporary of
    N C^2, not another N C x N C)."""
    a = torch.stack([x.val for row in A for x in row])  # (J, N, N)
    b = torch.stack([x.val for row in B for x in row]).flatten(1)  # (J, C^2)
    J, N, C = a.shape[0], a.shape[1], B[0][0].val.shape[0]
    M = torch.empty(N * C, N * C, dtype=a.dtype, device=a.device)
    M4 = M.view(N, C, N, C)
    for i in range(N):
        M4[i].copy_((a[:, i, :].T @ b).view(N, C, C).transpose(0, 1))
    return M


def dense_gram_bound(q: sp.SSoGParams, H: int, W: int, theta: float, *, pads=PADS) -> DenseGramBound:
    """Certified ||T||_2 <= upper from M formed densely (module docstring). q: normalised parameters (float64);
    theta: a guess of lambda_max(M) in q's units (a Lanczos Ritz value of T^T T), padded by each of `pads` in turn
    until the Cholesky certificate passes. ValueError where none passes or anything is NaN/inf: not certified."""
    t0 = time.perf_counter()
    if q.WV.dtype != torch.float64:
        raise ValueError("the dense Gram is certified in float64 only: pass ssog_params(layer) in float64")
    sp.require_finite(q, "dense Gram")
    if not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"the dense Gram needs a finite positive guess of lambda_max(T^T T), got {theta!r}")
    A, B = gram_factors(q, H, W)
    err = gram_error(A, B)
    if not math.isfinite(err):
        raise ValueError("the dense Gram's error bound is not finite: not certified")
    u = rounding.unit_roundoff(torch.float64)
    for i, pad in enumerate(pads):
        M = form_gram(A, B)
        mu = torch.tensor(theta * (1 + pad), dtype=torch.float64)
        ok, mu_up = rounding.cholesky_certifies(M, mu, u, overwrite=True)  # every thread: one large factorisation
        del M
        if bool(ok):
            lam = _up(float(mu_up) + err)  # lambda_max(M) <= lambda_max(fl(M)) + ||fl(M) - M||
            upper_n = sp._finite(math.sqrt(lam) * (1 + 2 * u) + q.conversion_error * q.magnitude(), "dense Gram")
            return DenseGramBound(upper=sp._scale_back(upper_n, q.log2_scale, up=True), mu=float(mu_up), err=err,
                                  pad=pad, tries=i + 1, seconds=time.perf_counter() - t0)
    raise ValueError(f"the dense Gram's Cholesky certificate failed at every pad {list(pads)} of theta = {theta:.6g}: "
                     f"not certified")
