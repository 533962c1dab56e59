"""Per-sample geometry of a batch (S, ...): unit vectors, and the sphere and ball ||X_s||_F = / <= R_s."""
from __future__ import annotations

import torch


def unit(t):
    """t / ||t|| per sample (leading dimension), safe at 0."""
    return t / t.flatten(1).norm(dim=1).clamp_min(1e-300).reshape(-1, *([1] * (t.dim() - 1)))


def col(R, X):
    """R as a (S, 1, 1) tensor beside X (S, N, C): one radius per sample."""
    return torch.as_tensor(R, dtype=X.dtype, device=X.device).reshape(-1, 1, 1).expand(X.shape[0], 1, 1)


def sphere(X, R):
    """X scaled onto the spheres ||X_s||_F = R_s."""
    n = X.flatten(1).norm(dim=1).clamp_min(1e-300).reshape(-1, 1, 1)
    return X * (col(R, X) / n)


def ball(X, R):
    """X projected onto the balls ||X_s||_F <= R_s (samples inside are left as they are)."""
    R = col(R, X)
    n = X.flatten(1).norm(dim=1).reshape(-1, 1, 1)
    return torch.where(n > R, X * (R / n.clamp_min(1e-300)), X)
