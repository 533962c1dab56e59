"""Gram iteration on a dense matrix (Delattre et al. 2023) with every rounding error carried, tightened at its last
level by Cauchy interlacing (proofs/S2.md, 'Gram iteration')."""
from __future__ import annotations

import math

import torch

from .. import gaussian, rounding
from .params import _finite, _ldexp, _pow2_exponent, _scale_back, single_thread


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
            ritz_b = _interlacing_bound(N, F[-1], min(ritz, n))
            break
        G = N @ N
        G = (G + G.T) / 2
    best, used = math.inf, 0
    for K in range(len(f)):
        cand = _backward(f, F, K, F[K], e0, ek, dt)
        if K == len(f) - 1 and ritz_b is not None:
            cand = min(cand, _backward(f, F, K, ritz_b, e0, ek, dt))
        if cand < best:
            best, used = cand, K
    return _finite(best, "Gram iteration bound"), used



def _interlacing_bound(N: torch.Tensor, FK: float, m: int) -> float:
    """b >= ||N||_2 for the symmetric N with ||N||_F <= FK: FK^2 less the Cauchy-interlacing tail of a computed
    m-column basis of its top eigenvectors (interlacing_tail), every product's rounding carried."""
    dt, n = N.dtype, N.shape[0]
    g = lambda k: gaussian.gamma(k, dt)  # noqa: E731
    with single_thread():
        V = torch.linalg.eigh(N).eigenvectors[:, -m:]
        V = torch.linalg.qr(V).Q
        I = torch.eye(m, dtype=dt, device=N.device)
        eta = float((V.T @ V - I).norm()) * (1 + g(m * m + 2)) + g(n) * m * 2
        Mh = V.T @ N @ V
        Mh = (Mh + Mh.T) / 2
        # ||Mh - V^T N V||_F <= eB (two products of length n, |V| |N| |V| in Frobenius <= m (1 + eta) F)
        eB = 2 * g(n + 2) * m * (1 + eta) * FK * (1 + g(4))
        lam1 = float(rounding.verified_lambda_max(Mh)) + eB  # >= lambda_1(V^T N V)
        neg = max(float(rounding.verified_lambda_max(-Mh)) + eB, 0.0)  # >= -lambda_min(V^T N V)
    fro = max(float(Mh.norm()) * (1 - g(m * m + 2)) - eB, 0.0)  # <= ||V^T N V||_F
    tail = interlacing_tail(fro, lam1, neg, m, eta, dt)
    rest = FK ** 2 * (1 + g(2)) - tail
    return math.sqrt(max(rest, 0.0)) * (1 + g(4))


def _backward(f: list, F: list, K: int, bK: float, e0: float, ek: float, dt) -> float:
    """The bound on ||T||_2 run back from b_K >= ||N_K||_2 through the levels' recursion (gram_bound)."""
    g = lambda k: gaussian.gamma(k, dt)  # noqa: E731
    u = gaussian.unit_roundoff(dt)
    up = u / (1 - u)
    b = bK
    for k in range(K - 1, -1, -1):
        b = math.sqrt(f[k + 1] * (b + up * F[k + 1]) + ek * F[k] ** 2) * (1 + g(6))
    return math.sqrt(f[0] * (b + up * F[0]) + e0) * (1 + g(6))
