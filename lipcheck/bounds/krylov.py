"""Lanczos on a symmetric PSD operator (lower bound, probabilistic upper bound) and the Kuczynski-Wozniakowski
error of its top Ritz value."""
from __future__ import annotations

import math
from typing import Callable

import torch

from .. import rounding
from .params import single_thread

KW_CONSTANT = 1.648  # Kuczynski & Wozniakowski (1992), Theorem 4.2: P(eps >= e) <= 1.648 sqrt(n) exp(-sqrt(e)(2q-1))
# Lanczos checks its stopping rule every CHECK_EVERY steps; the failure probability is split over them.
CHECK_EVERY = 10


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


def dense_top_singular_value(M: torch.Tensor) -> float:
    """||M||_2 of a dense real matrix to rounding: ARPACK's Lanczos at full precision (tol 0) from a seeded Gaussian
    start (never orthogonal to the top singular vector but with probability 0; the same matrix gives the same
    value); the full SVD where ARPACK cannot run (min side <= 2, a start in the null space) or does not converge. Measured at 3072 x 3072 (one thread): 1.1 s against 31 s for the full SVD, within 6e-16 of
    it. A value only: callers prove what they use of it (rounding.norm2_upper)."""
    m, n = M.shape
    if min(m, n) > 2:
        import numpy as np
        from scipy.sparse.linalg import ArpackError, svds

        from ..threads import limited
        try:
            with limited():
                v0 = np.random.default_rng(0).standard_normal(min(m, n))
                s = svds(M.detach().cpu().numpy(), k=1, tol=0, v0=v0, return_singular_vectors=False)
            return float(s[0])
        except ArpackError:  # ArpackNoConvergence is one
            pass
    return float(torch.linalg.matrix_norm(M, ord=2))

