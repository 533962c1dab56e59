"""What the enclosure needs from the vector field: values, constants, rounding bounds and point log-norms."""
from __future__ import annotations

import math

import torch

from ..bounds import lognorm as ln
from .options import EnclosureError


class BlockField:
    """What every field F = Mixer(LN1 x) + MLP(LN2 x) shares: values, the constants of `self.k` (a
    `FieldConstants`), the point log-norms (dense `self._dense` or structured) and their eigenvector guesses."""
    uses_variance = True

    def _choose(self, lognorm: str, n: int) -> str:
        if lognorm == "auto":
            lognorm = "dense" if n <= 4096 else "structured"
        if lognorm not in ("dense", "structured"):
            raise EnclosureError(f"lognorm must be 'auto', 'dense' or 'structured', got {lognorm!r}")
        self.lognorm_kind = lognorm
        self._cache = {}  # structured: cached per-token eigenvectors (Cholesky first, eigensolver on failure)
        return lognorm

    def __call__(self, x):
        return self.block.vector_field(x)

    def lipschitz(self, v: float) -> float:
        return self.k.lipschitz(v)

    def curvature(self, v: float) -> float:
        return self.k.curvature(v)

    def curvature_parts(self, v: torch.Tensor) -> list:
        """Lemma 2 token by token at per-token variance floors v (`FieldConstants.curvature_parts`)."""
        return self.k.curvature_parts(v)

    def reset(self) -> None:
        """Forget the eigenvector guesses of earlier points (the next bounds do not depend on them)."""
        self._cache = {}
        if self._dense is not None:
            self._dense.vec = None

    def lognorm(self, y, v, eps_J):
        if self.lognorm_kind == "dense":
            return self._dense(y, eps_J)
        return ln.structured_lognorm(self.block, self.k, y, eps_J, cache=self._cache)


class SSoGField(BlockField):
    """What the enclosure needs from F = SSoG(LN1 x) + MLP(LN2 x): values, J w, constants, point log-norms.

    Any other field object with the same interface (__call__, lipschitz(v), curvature(v), rounding(y, v),
    lognorm(y, v, eps_J), uses_variance) is enclosed the same way."""
    directional = True  # Lemma 7's bounds along y' apply (`directional.piece_bounds`): a linear mixer and an MLP

    def __init__(self, block, H: int, W: int, *, lognorm: str = "auto", dtype=torch.float64, device=None):
        self.block = block
        self.k = ln.field_constants(block, H, W, dtype=dtype, device=device)
        dense = self._choose(lognorm, H * W * self.k.C) == "dense"
        self._dense = ln.DenseLogNorm(block, H, W, dtype=dtype, device=device) if dense else None

    def rounding(self, y, v):
        return ln.rounding_bounds(self.k, y, v)

    def constants(self, v: float) -> dict:
        """The field's constants at token-variance floor v, for reports (||T|| in the mixer's place; a linear
        mixer has no curvature of its own)."""
        return {"mixer": "ssog", "mixer_lipschitz": self.k.T_norm, "mixer_curvature": 0.0,
                "token_radius": self.k.rho1, "lipschitz": self.lipschitz(v), "curvature": self.curvature(v)}


def rayleigh_lower(field, y: torch.Tensor, eps_J: float) -> torch.Tensor:
    """A certified lower value of mu_2(J_F(y_b)) per sample: v^T S v / v^T v for the computed top eigenvector v of
    the symmetric part, less its rounding (dense Jacobian; small states only)."""
    out = []
    for b in range(y.shape[0]):
        J = field.jacobian(y[b:b + 1])[0][0] if hasattr(field, "jacobian") else ln.dense_jacobian(field.block, y[b])
        S = (J + J.T) / 2
        w, V = torch.linalg.eigh(S)
        v = V[:, -1]
        q = float(v @ S @ v) / float(v @ v)
        n = J.shape[0]
        out.append(q - ln.gamma(2 * n + 4) * float(torch.linalg.matrix_norm(S)) - math.sqrt(n) * eps_J)
    return torch.tensor(out, dtype=y.dtype, device=y.device)


def point_lognorms(field, ypts: torch.Tensor, v: float, eps_J: float, mu_claim=None) -> torch.Tensor:
    """Verified upper bounds on mu_2(J_F) at the states ypts (P, B, H, W, C) -> (P, B). With `mu_claim` (float or
    callable y -> (B,)): the claim where it is at or above the verified bound (so still an upper bound); -inf
    where it is below the certified lower value (refuted), nan where it lies between (not verified)."""
    lam = torch.stack([field.lognorm(yp, v, eps_J) for yp in ypts])
    if mu_claim is None:
        return lam
    B = ypts.shape[1]
    fk = dict(dtype=lam.dtype, device=lam.device)
    claim = torch.stack([torch.as_tensor(mu_claim(yp) if callable(mu_claim) else mu_claim, **fk).expand(B)
                         for yp in ypts])
    lower = torch.stack([rayleigh_lower(field, yp, eps_J) for yp in ypts])
    out = torch.where(claim >= lam, claim, torch.full_like(claim, math.nan))
    return torch.where(claim < lower, torch.full_like(claim, -math.inf), out)
