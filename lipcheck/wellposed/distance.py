"""The proven sup ||y - y_ref|| between two piecewise quartics on every interval (proofs/S5.md, Theorem 6), and
a rough scale of that distance used to tune the reference solve (not a bound)."""
from __future__ import annotations

import bisect
import math

import torch

from ..bounds import lognorm as ln
from .quartic import NODES, _M, _poly
from .solve import sample_norm


def _rough_distance(steps, coefs, rsteps, rcoefs) -> float:
    """max over y_ref's step nodes of ||y - y_ref|| (all samples): a scale for tuning, not a bound."""
    return float(_node_distances(steps, coefs, rsteps, rcoefs)[0].max())


def _node_distances(steps, coefs, rsteps, rcoefs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample (B,): max over y_ref's step nodes of ||y - y_ref||, and ||y(t1) - y_ref(t1)||, the last node's
    (scales for tuning, not bounds)."""
    ends = [b for _, b in steps]
    out = last = None
    for (a, b), c in zip(rsteps, rcoefs):
        for sg in NODES:
            t = a + (b - a) * sg
            ky = min(bisect.bisect_right(ends, t), len(steps) - 1)
            ay, by = steps[ky]
            s = torch.tensor([(t - ay) / (by - ay)], dtype=c.dtype, device=c.device)
            yv = _poly(coefs[ky], s, by - ay, 0)[0]
            yr = _poly(c, torch.tensor([sg], dtype=c.dtype, device=c.device), b - a, 0)[0]
            last = sample_norm(yv - yr)
            out = last if out is None else torch.maximum(out, last)
    return out, last


class _Pair:
    """y (user's steps and coefficients) and y_ref on one footing: the Bernstein bound of y - y_ref on a piece of
    one reference step, with the rounding of the node values, their positions and M added."""

    def __init__(self, steps, coefs, rsteps, rcoefs, dtype):
        self.u = u = ln.unit_roundoff(dtype)
        self.fk = dict(dtype=coefs[0].dtype, device=coefs[0].device)
        self.M = torch.tensor([[float(x) for x in row] for row in _M], **self.fk)  # each entry within u of M
        self.M_rows = float(self.M.abs().sum(1).max())
        self.ev = ln.gamma(12, u)
        self.steps, self.coefs, self.rsteps, self.rcoefs = steps, coefs, rsteps, rcoefs
        self.yinfo, self.rinfo = [self._info(c) for c in coefs], [self._info(c) for c in rcoefs]
        self.ends = [b for _, b in steps]
        self.nodes = torch.tensor(NODES, **self.fk)
        # jump margins at y's step ends: the polynomials of both neighbours, so ulp slivers are covered
        self.jump = [sample_norm(coefs[k + 1][0] - coefs[k].sum(0)) * (1 + ln.gamma(8, u))
                     + self.ev * (self.yinfo[k]["abs_sum"] + self.yinfo[k + 1]["abs_sum"])
                     for k in range(len(steps) - 1)]

    @staticmethod
    def _info(c):
        flat = c.flatten(2)  # (5, B, n)
        return dict(abs_sum=sample_norm(c.abs().sum(0)), dsig=sum(j * flat[j].norm(dim=-1) for j in range(1, 5)))

    def piece(self, kr, s0, s1, ky, margin):
        """(bound on sup ||y - y_ref|| over ref sigma in [s0, s1] with y from step ky, largest node value, the
        rounding part of the bound)."""
        u, ev = self.u, self.ev
        (ar, br), (ay, by) = self.rsteps[kr], self.steps[ky]
        hr, hy = br - ar, by - ay
        sig = s0 + (s1 - s0) * self.nodes  # ref variable
        sy = (ar + hr * sig - ay) / hy
        yr = _poly(self.rcoefs[kr], sig, hr, 0).flatten(2)  # (5, B, n)
        yy = _poly(self.coefs[ky], sy, hy, 0).flatten(2)
        d = yy - yr
        bmax = torch.einsum("ji,ibn->jbn", self.M, d).norm(dim=-1).amax(0)  # (B,)
        vmax = d.norm(dim=-1).amax(0)
        dr = 8 * u  # node displacement in the ref variable
        dy = 16 * u * (abs(ar) + hr + abs(ay) + hy) / hy + 4 * u * hr / hy
        ri, yi = self.rinfo[kr], self.yinfo[ky]
        err_v = (ev * ri["abs_sum"] + ev * yi["abs_sum"] + dr * ri["dsig"] * (1 + ev) + dy * yi["dsig"] * (1 + ev)
                 + u * (yr.norm(dim=-1).amax(0) + yy.norm(dim=-1).amax(0)))
        err_b = self.M_rows * (err_v + ln.gamma(8, u) * vmax)
        return bmax + err_b + margin, vmax, err_b + margin

    def bound(self, kr, s0, s1, ky, margin, depth=0):
        """`piece`, halved (up to 6 times) while the bound exceeds the largest node value by more than 1 %."""
        b, v, e = self.piece(kr, s0, s1, ky, margin)
        if depth >= 6 or bool((b <= 1.01 * v + e).all()) or s1 == s0:
            return b
        mid = (s0 + s1) / 2
        return torch.maximum(self.bound(kr, s0, mid, ky, margin, depth + 1),
                             self.bound(kr, mid, s1, ky, margin, depth + 1))

    def y_at(self, t):
        """(fl(y(t)), its step)."""
        ky = min(bisect.bisect_right(self.ends, t), len(self.steps) - 1) if t < self.ends[-1] else len(self.steps) - 1
        a, b = self.steps[ky]
        return _poly(self.coefs[ky], torch.tensor([(t - a) / (b - a)], **self.fk), b - a, 0)[0], ky

    def span(self, kr, s0, s1):
        """The bound on one reference interval, cut at y's step ends, with the jump margins where a piece ends on
        one of them."""
        u, steps = self.u, self.steps
        ar, br = self.rsteps[kr]
        hr = br - ar
        ta, tb = ar + hr * s0, ar + hr * s1
        cuts = [(self.ends[k] - ar) / hr for k in range(len(steps) - 1) if ta < self.ends[k] < tb]
        bounds = [s0] + cuts + [s1]
        best = torch.zeros(self.coefs[0].shape[1], **self.fk)
        for q in range(len(bounds) - 1):
            tm = ar + hr * (bounds[q] + bounds[q + 1]) / 2
            ky = min(bisect.bisect_right(self.ends, tm), len(steps) - 1)
            margin = torch.zeros_like(best)
            if q > 0 or (ky > 0 and abs(ta - steps[ky][0]) <= 8 * u * max(1.0, abs(ta))):
                margin = margin + self.jump[ky - 1] if ky > 0 else margin
            if q < len(bounds) - 2 or (ky < len(steps) - 1 and abs(tb - self.ends[ky]) <= 8 * u * max(1.0, abs(tb))):
                margin = margin + self.jump[ky] if ky < len(steps) - 1 else margin
            best = torch.maximum(best, self.bound(kr, bounds[q], bounds[q + 1], ky, margin))
        return best


def _distance(steps, coefs, ref_pieces, dtype):
    """((K, B) proven sup ||y(s) - y_ref(s)|| on every interval of the reference enclosure, (K, B, H, W, C) y at its
    times). Each interval is cut at y's step ends; on each piece the difference quartic's Bernstein coefficients
    (from its values at 5 equispaced nodes, exact matrix M) bound its sup; pieces are halved while that bound
    exceeds the largest node value by more than 1 %. Rounding of the nodes, the evaluations and M is added, and
    each row includes the evaluation error of its centre fl(y(t))."""
    pair = _Pair(steps, coefs, ref_pieces["steps"], ref_pieces["coefs"], dtype)
    B = coefs[0].shape[1]
    zero = torch.zeros(B, **pair.fk)
    c0, _ = pair.y_at(0.0)
    rows, centers = [pair.bound(0, 0.0, 0.0, 0, zero) + pair.ev * pair.yinfo[0]["abs_sum"]], [c0]
    for span in ref_pieces["spans"]:
        if span is None:  # the closing interval after every sample failed: no bound
            rows.append(torch.full((B,), math.inf, **pair.fk))
            centers.append(pair.y_at(float(steps[-1][1]))[0])
            continue
        kr, j0, j1, m = span
        best = pair.span(kr, j0 / m, j1 / m)
        ar, br = pair.rsteps[kr]
        c, ky = pair.y_at(float(ar + (br - ar) * (j1 / m)))
        rows.append(best + pair.ev * pair.yinfo[ky]["abs_sum"])  # the centre is fl(y(t)): its evaluation error
        centers.append(c)
    return torch.stack(rows), torch.stack(centers)
