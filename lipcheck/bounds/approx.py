"""Matrices with a bound on their distance to the exact matrices they stand for, and the products, sums and
Kronecker sums of them that the deflated bound forms (proofs/S2.md, 'Deflated majorant': every matrix formed in
float64 with an error bound in spectral norm)."""
from __future__ import annotations

import dataclasses

import torch

from .. import rounding


@dataclasses.dataclass
class _Approx:
    """A matrix as computed (val) and a bound err >= ||val - exact||_2 on the exact matrix it stands for."""
    val: torch.Tensor
    err: float

    @property
    def fro(self) -> float:
        """||val||_F rounded up (a bound on ||val||_2)."""
        return float(self.val.square().sum().sqrt()) * (1 + rounding.gamma(self.val.numel() + 4))

    @property
    def norm(self) -> float:
        """A bound on the spectral norm of the exact matrix."""
        return self.fro + self.err


@dataclasses.dataclass
class _Normed(_Approx):
    """An _Approx with a certified bound on the exact matrix's spectral norm tighter than ||val||_F + err (an
    orthonormal basis: 1; M Q for ||M|| <= t^2: t^2)."""
    bound: float = float("inf")

    @property
    def norm(self) -> float:
        return min(self.fro + self.err, self.bound)


def _up(x: float) -> float:
    """x rounded up generously (the error bounds are sums of a few float terms)."""
    return x * (1 + 1e-12) + 1e-300


def _mm(X: _Approx, Y: _Approx, *, tX: bool = False, tY: bool = False) -> _Approx:
    """fl(X Y) (X or Y transposed when asked): ||fl(XY) - X Y|| <= ||X|| e_Y + ||Y|| e_X + e_X e_Y + gamma_n ||X^||_F ||Y^||_F
    (entrywise |fl(x.y) - x.y| <= gamma_n |x|.|y|, and || |X^| |Y^| || <= ||X^||_F ||Y^||_F)."""
    a = X.val.T if tX else X.val
    b = Y.val.T if tY else Y.val
    n = a.shape[-1]
    err = X.norm * Y.err + Y.norm * X.err + X.err * Y.err + rounding.gamma(n + 2) * X.fro * Y.fro
    return _Approx(a @ b, _up(err))


def _pairwise(Xs: list[_Approx], Ys: list[_Approx], *, tX: bool = False, tY: bool = False) -> list[list[_Approx]]:
    """All products fl(X_i Y_j) (X_i or Y_j transposed when asked) in one matrix product, each with _mm's error bound
    (every entry is the same length-n dot product, so the same gamma_{n+2} bound holds)."""
    a = torch.cat([x.val.T if tX else x.val for x in Xs], 0)
    b = torch.cat([y.val.T if tY else y.val for y in Ys], 1)
    n = a.shape[1]
    prod = a @ b
    rows = [x.val.shape[1] if tX else x.val.shape[0] for x in Xs]
    cols = [y.val.shape[0] if tY else y.val.shape[1] for y in Ys]
    xn, yn = [x.norm for x in Xs], [y.norm for y in Ys]
    xf, yf = [x.fro for x in Xs], [y.fro for y in Ys]
    g = rounding.gamma(n + 2)
    out, r0 = [], 0
    for i, (r, x) in enumerate(zip(rows, Xs)):
        row, c0 = [], 0
        for j, (c, y) in enumerate(zip(cols, Ys)):
            err = xn[i] * y.err + yn[j] * x.err + x.err * y.err + g * xf[i] * yf[j]
            row.append(_Approx(prod[r0:r0 + r, c0:c0 + c], _up(err)))
            c0 += c
        out.append(row)
        r0 += r
    return out


def _sub(X: _Approx, Y: _Approx) -> _Approx:
    """fl(X - Y): one rounding per entry, <= u ||fl(X - Y)||_F / (1 - u)."""
    d = X.val - Y.val
    u = rounding.unit_roundoff(d.dtype)
    out = _Approx(d, 0.0)
    return _Approx(d, _up(X.err + Y.err + 2 * u * out.fro))


def _kron_sum(L: list[_Approx], P: list[_Approx], transpose_P: bool) -> _Approx:
    """sum_j L_j kron P_j' as a (k C) x (k C) matrix with rows (i, c), columns (j, d): entry sum_j L_j[i, j] P'_j[c, d],
    P' = P_j^T when transpose_P. Error: `kron_sum_error` (transposing P_j changes none of its norms)."""
    k, C = L[0].val.shape[0], P[0].val.shape[0]
    Ls = torch.stack([x.val for x in L])
    Ps = torch.stack([x.val for x in P])
    if transpose_P:
        Ps = Ps.transpose(1, 2)
    val = torch.einsum("jab,jcd->acbd", Ls, Ps).reshape(k * C, k * C)
    return _Approx(val, kron_sum_error(L, P))


def kron_sum_error(L: list[_Approx], P: list[_Approx]) -> float:
    """>= ||fl(sum_j L_j kron P_j) - sum_j exact L_j kron exact P_j||_2 for any order of each entry's J products: the
    factors' errors (||X kron Y|| = ||X|| ||Y||) and gamma_{J+2} sum_j ||L_j||_F ||P_j||_F (entrywise |fl - exact| <=
    gamma_{J+2} sum_j |l_j| |p_j|, and || |X| kron |Y| ||_2 <= ||X||_F ||Y||_F)."""
    err = sum(a.norm * b.err + b.norm * a.err + a.err * b.err for a, b in zip(L, P))
    err += rounding.gamma(len(L) + 2) * sum(a.fro * b.fro for a, b in zip(L, P))
    return _up(err)


def _sym(X: _Approx) -> _Approx:
    """(X + X^T) / 2, exactly symmetric in floating point; it is as close to the (symmetric) exact matrix as X is,
    plus one rounding."""
    S = (X.val + X.val.T) / 2
    return _Approx(S, _up(X.err + 2 * rounding.unit_roundoff(S.dtype) * X.fro))


def _deflect(Qa: _Approx, Y: _Approx) -> _Approx:
    """(I - Qbar Qbar^T) Y for Qbar the orthonormal basis that Qa approximates (its error eta)."""
    return _sub(Y, _mm(Qa, _mm(Qa, Y, tX=True)))
