"""Gronwall with the logarithmic norm: the proven growth of perturbations along an enclosure (proofs/S5.md)."""
from __future__ import annotations

import math

import torch

from .recurrence import _mu_bar, up


def _interval_growth(field, C, iv, b, g0, rad, eps):
    """G at the end of one interval from G = g0 at its start, with the tube radius rad + eps G bootstrapped;
    inf where the bootstrap fails."""
    guess = g0 * math.exp(max(iv["lam"][b], 0.0) * iv["tau"]) * 1.5
    for _ in range(6):
        rho = rad + eps * max(g0, guess)
        mu, _ = _mu_bar(field, iv["lam"][b], iv["std"][b], iv["drift"][b], rho, C, iv["offset"][b], iv["bend"][b])
        if not math.isfinite(mu):
            return math.inf
        g1 = up(g0 * math.exp(up(mu * iv["tau"], 4)), 4)  # directed for either sign of mu
        if max(g0, g1) <= max(g0, guess):
            return g1
        guess = 2 * g1
    return math.inf


def lognorm_envelope(enc, perturbation) -> torch.Tensor:
    """Proven growth envelope G(t) with ||x~(t) - x(t)|| <= G(t) ||x~0 - x0|| for every start x~0 within
    `perturbation` (B,) of x0: G = exp(int mu), mu over the tube of radius enclosure radius + perturbation * G
    around the centre (bootstrapped per interval). Returns (K, B); inf where the bootstrap fails, and after t = 0
    for an enclosure refused before any proof (it has no intervals)."""
    data = enc._envelope_data
    if data is None:
        G = torch.full((len(enc.t), len(enc.proven)), math.inf, dtype=torch.float64)
        G[0] = 1.0
        return G
    field, C = data["field"], data["C"]
    B = len(enc.proven)
    eps = torch.as_tensor(perturbation, dtype=torch.float64).expand(B).tolist()
    G = [[1.0] * B]
    for i, iv in enumerate(data["intervals"]):
        row = []
        for b in range(B):
            g0, rad = G[-1][b], float(data["radius"][i + 1, b])
            ok = math.isfinite(g0) and math.isfinite(rad)
            row.append(_interval_growth(field, C, iv, b, g0, rad, eps[b]) if ok else math.inf)
        G.append(row)
    return torch.tensor(G, dtype=torch.float64)
