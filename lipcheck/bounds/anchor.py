"""What one anchor proves: a guessed top singular triple of a symbol matrix S, verified in float64 (residuals and
the rest of S by Cholesky), and the stable 2 x 2 norm its bound is read through (proofs/S2.md, 'anchor bound')."""
from __future__ import annotations

import math

import torch

from .. import rounding
from ..rounding import norm2_upper


def two_by_two_norm(p: torch.Tensor, q: torch.Tensor, r: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """||[[p, q], [r, s]]||_2 = (hypot(p + s, q - r) + hypot(p - s, q + r)) / 2 for real entries: sums and
    hypot only, no cancellation against a trace, no overflow of squares. Relative error <= gamma_4 for
    nonnegative entries (proofs/S2.md)."""
    return (torch.hypot(p + s, q - r) + torch.hypot(p - s, q + r)) / 2



def anchor_verification(S: torch.Tensor, s1: torch.Tensor, u1: torch.Tensor, v1: torch.Tensor,
                        s2: torch.Tensor) -> dict:
    """What a guess (s1, u1, v1, s2) of the top singular triple and second singular value of the stored matrices S (k, C, C) proves, in float64 (proofs/S2.md):

    delta >= |1 - ||u1||| + |1 - ||v1|||, rho_r >= ||S v^ - s1 u^||, rho_b >= ||S^* u^ - s1 v^|| (u^ = u1 / ||u1||,
    v^ = v1 / ||v1||), tau2 >= ||S - s1 u1 v1^*|| >= ||U2^* S V2|| for orthonormal completions U2 of u^, V2 of v^
    (U2^* u1 = 0), the last verified by Cholesky. Entries are inf where the guess proves nothing."""
    dt = s1.dtype
    S, u1, v1, s1 = S.to(torch.complex128), u1.to(torch.complex128), v1.to(torch.complex128), s1.double()
    C = S.shape[-1]
    g = lambda n: rounding.gamma(n, torch.float64)  # noqa: E731
    nu2, nv2 = u1.abs().square().sum(-1), v1.abs().square().sum(-1)
    delta = (nu2 - 1).abs() + (nv2 - 1).abs() + g(2 * C + 4) * (nu2 + nv2)
    delta = torch.where(delta < 0.1, delta, torch.full_like(delta, math.inf))
    # underflow (a symbol of underflowing kernels has subnormal entries): every real operation may add an absolute
    # error of at most eta, which no relative gamma covers; each allowance below gets its count of them
    eta = rounding.tiny_subnormal(torch.float64)
    SF = (rounding.sum_of_squares(S) * (1 + g(4 * C * C + 4)) + 2 * C * C * eta).sqrt() * (1 + g(2))  # 2 C^2 squares
    nu, nv = (nu2 * (1 + g(2 * C + 4))).sqrt(), (nv2 * (1 + g(2 * C + 4))).sqrt()  # >= ||u1||, ||v1||
    Rv = (S @ v1[..., None]).squeeze(-1) - s1[:, None] * u1
    Ru = (u1.conj()[:, None, :] @ S).squeeze(-2).conj() - s1[:, None] * v1  # S^* u1 without copying S^*
    # |fl(S v - s1 u) - (S v - s1 u)| <= gamma_{C+4} (|S| |v| + s1 |u|): in norm <= gamma_{C+4} (||S||_F ||v|| + s1 ||u||)
    # and <= 8 (C + 4) eta per entry from underflow (C complex products and sums, then s1 u): sqrt(C) times in norm
    err = g(C + 4) * (SF * torch.maximum(nu, nv) + s1 * torch.maximum(nu, nv)) + 8 * (C + 4) * math.sqrt(C) * eta
    norm_up = lambda x: (x.abs().square().sum(-1) * (1 + g(2 * C + 4)) + 2 * C * eta).sqrt() * (1 + g(2))  # noqa: E731
    # S v^ - s1 u^ = (S v1 - s1 u1) / ||v1|| + s1 u1 (1 / ||v1|| - 1 / ||u1||): ||.|| <= (||Rv|| + s1 delta) / (1 - delta)
    rho_r = ((norm_up(Rv) + err + s1 * delta) / (1 - delta)) * (1 + g(4))
    rho_b = ((norm_up(Ru) + err + s1 * delta) / (1 - delta)) * (1 + g(4))
    D = S - s1[:, None, None] * (u1[:, :, None] * v1.conj()[:, None, :])
    # forming D: a complex product of three numbers and a difference per entry, gamma_6 of |S| + s1 |u1| |v1|^T
    eD = g(6) * (SF + s1 * nu * nv) + 32 * C * eta  # underflow: <= 32 eta per entry, C^2 entries: C in norm
    tau2 = (norm2_upper(D, s=s2.double()) + eD) * (1 + g(2))
    return {k: _up_to(torch.where(torch.isnan(v), math.inf, v), dt)
            for k, v in dict(rho_r=rho_r, rho_b=rho_b, tau2=tau2, delta=delta).items()}


def _up_to(x: torch.Tensor, dtype) -> torch.Tensor:
    """x (float64, >= 0) in `dtype`, rounded up (a float32 conversion rounds to nearest)."""
    y = x.to(dtype)
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)

