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


def _amax_into(out: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """out[rows[q]] = max(out[rows[q]], values[q]) for every q (rows may repeat)."""
    out.scatter_reduce_(0, rows[:, None].expand(-1, out.shape[1]), values, "amax")


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
        self.zero = torch.zeros(coefs[0].shape[1], **self.fk)
        self.n = coefs[0][0, 0].numel()
        # jump margins at y's step ends: the polynomials of both neighbours, so ulp slivers are covered
        self.jump = [sample_norm(coefs[k + 1][0] - coefs[k].sum(0)) * (1 + ln.gamma(8, u))
                     + self.ev * (self.yinfo[k]["abs_sum"] + self.yinfo[k + 1]["abs_sum"])
                     for k in range(len(steps) - 1)]

    @staticmethod
    def _info(c):
        flat = c.flatten(2)  # (5, B, n)
        return dict(abs_sum=sample_norm(c.abs().sum(0)), dsig=sum(j * flat[j].norm(dim=-1) for j in range(1, 5)))

    def piece(self, kr, s0, s1, ky, margin):
        """(bound on sup ||y - y_ref|| over ref sigma in [s0_q, s1_q] with y from step ky, largest node value, the
        rounding part of the bound) for Q pieces at once: s0, s1 (Q,), margin (Q, B) -> three (Q, B)."""
        u, ev = self.u, self.ev
        (ar, br), (ay, by) = self.rsteps[kr], self.steps[ky]
        hr, hy = br - ar, by - ay
        sig = s0[:, None] + (s1 - s0)[:, None] * self.nodes  # (Q, 5) ref variable
        sy = (ar + hr * sig - ay) / hy
        Q = sig.shape[0]
        yr = _poly(self.rcoefs[kr], sig.reshape(-1), hr, 0).flatten(2).reshape(Q, 5, -1, self.n)  # (Q, 5, B, n)
        yy = _poly(self.coefs[ky], sy.reshape(-1), hy, 0).flatten(2).reshape(Q, 5, -1, self.n)
        d = yy - yr
        bmax = torch.einsum("ji,qibn->qjbn", self.M, d).norm(dim=-1).amax(1)  # (Q, B)
        vmax = d.norm(dim=-1).amax(1)
        dr = 8 * u  # node displacement in the ref variable
        dy = 16 * u * (abs(ar) + hr + abs(ay) + hy) / hy + 4 * u * hr / hy
        ri, yi = self.rinfo[kr], self.yinfo[ky]
        err_v = (ev * ri["abs_sum"] + ev * yi["abs_sum"] + dr * ri["dsig"] * (1 + ev) + dy * yi["dsig"] * (1 + ev)
                 + u * (yr.norm(dim=-1).amax(1) + yy.norm(dim=-1).amax(1)))
        err_b = self.M_rows * (err_v + ln.gamma(8, u) * vmax)
        return bmax + err_b + margin, vmax, err_b + margin

    def bound(self, kr, s0, s1, ky, margin):
        """`piece` for Q pieces (s0, s1 (Q,), margin (Q, B)) -> (Q, B): each piece halved (up to 6 times) while its
        bound exceeds its largest node value by more than 1 % for some sample; a piece's bound is the largest of
        its parts'."""
        Q = s0.shape[0]
        out = torch.zeros(Q, margin.shape[1], **self.fk)
        owner = torch.arange(Q)
        for depth in range(7):
            b, v, e = self.piece(kr, s0, s1, ky, margin)
            done = (b <= 1.01 * v + e).all(-1) | (s1 == s0) | (depth >= 6)
            _amax_into(out, owner[done], b[done])
            if bool(done.all()):
                break
            keep = ~done
            mid = (s0[keep] + s1[keep]) / 2
            s0, s1 = torch.cat([s0[keep], mid]), torch.cat([mid, s1[keep]])
            owner, margin = owner[keep].repeat(2), margin[keep].repeat(2, 1)
        return out

    def step_of(self, t):
        """y's step holding t (the last one from its end on)."""
        return min(bisect.bisect_right(self.ends, t), len(self.steps) - 1) if t < self.ends[-1] else len(self.steps) - 1

    def y_at(self, ts):
        """(fl(y(t)) for every t in ts (K, B, H, W, C), their steps)."""
        ks = [self.step_of(t) for t in ts]
        out = [None] * len(ts)
        for ky in set(ks):
            at = [i for i, k in enumerate(ks) if k == ky]
            a, b = self.steps[ky]
            s = torch.tensor([(ts[i] - a) / (b - a) for i in at], **self.fk)
            vals = _poly(self.coefs[ky], s, b - a, 0)
            for j, i in enumerate(at):
                out[i] = vals[j]
        return torch.stack(out), ks

    def pieces(self, kr, s0, s1):
        """The pieces of one reference interval [s0, s1] (its variable), cut at y's step ends: (s0, s1, ky, margin)
        with the jump margins where a piece ends on one of y's step ends."""
        u, steps = self.u, self.steps
        ar, br = self.rsteps[kr]
        hr = br - ar
        ta, tb = ar + hr * s0, ar + hr * s1
        inner = self.ends[:-1]
        cuts = [(e - ar) / hr for e in inner[bisect.bisect_right(inner, ta):bisect.bisect_left(inner, tb)]]
        bounds = [s0] + cuts + [s1]
        out = []
        for q in range(len(bounds) - 1):
            tm = ar + hr * (bounds[q] + bounds[q + 1]) / 2
            ky = min(bisect.bisect_right(self.ends, tm), len(steps) - 1)
            margin = self.zero
            if q > 0 or (ky > 0 and abs(ta - steps[ky][0]) <= 8 * u * max(1.0, abs(ta))):
                margin = margin + self.jump[ky - 1] if ky > 0 else margin
            if q < len(bounds) - 2 or (ky < len(steps) - 1 and abs(tb - self.ends[ky]) <= 8 * u * max(1.0, abs(tb))):
                margin = margin + self.jump[ky] if ky < len(steps) - 1 else margin
            out.append((bounds[q], bounds[q + 1], ky, margin))
        return out

    def spans(self, kr, windows):
        """(len(windows), B): the bound on each interval [s0, s1] of reference step kr, all pieces of one of y's
        steps evaluated together."""
        best = torch.zeros(len(windows), len(self.zero), **self.fk)
        groups = {}
        for w, (s0, s1) in enumerate(windows):
            for a, b, ky, margin in self.pieces(kr, s0, s1):
                groups.setdefault(ky, []).append((w, a, b, margin))
        for ky, rows in groups.items():
            t = lambda i: torch.tensor([r[i] for r in rows], **self.fk)  # noqa: E731
            got = self.bound(kr, t(1), t(2), ky, torch.stack([r[3] for r in rows]))
            _amax_into(best, torch.tensor([r[0] for r in rows]), got)
        return best


def _distance(steps, coefs, ref_pieces, dtype):
    """((K, B) proven sup ||y(s) - y_ref(s)|| on every interval of the reference enclosure, (K, B, H, W, C) y at its
    times, (B,) proven ||y(t1) - y_ref(t1)|| at t1 itself). Each interval is cut at y's step ends; on each piece the
    difference quartic's Bernstein coefficients (from its values at 5 equispaced nodes, exact matrix M) bound its
    sup; pieces are halved while that bound exceeds the largest node value by more than 1 %. Rounding of the nodes,
    the evaluations and M is added, and each row includes the evaluation error of its centre fl(y(t)). The intervals
    of one reference step are evaluated together (one polynomial evaluation per step of y they meet)."""
    pair = _Pair(steps, coefs, ref_pieces["steps"], ref_pieces["coefs"], dtype)
    B = coefs[0].shape[1]
    spans = ref_pieces["spans"]
    first = pair.bound(0, torch.zeros(1, **pair.fk), torch.zeros(1, **pair.fk), 0, pair.zero[None])[0]
    rows = [None] * len(spans)
    times = [0.0] * len(spans)
    for kr in sorted({sp[0] for sp in spans if sp is not None}):
        at = [i for i, sp in enumerate(spans) if sp is not None and sp[0] == kr]
        got = pair.spans(kr, [(spans[i][1] / spans[i][3], spans[i][2] / spans[i][3]) for i in at])
        ar, br = pair.rsteps[kr]
        for j, i in enumerate(at):
            rows[i] = got[j]
            times[i] = float(ar + (br - ar) * (spans[i][2] / spans[i][3]))
    for i, sp in enumerate(spans):  # the closing interval after every sample failed: no bound
        if sp is None:
            rows[i], times[i] = torch.full((B,), math.inf, **pair.fk), float(steps[-1][1])
    centers, ks = pair.y_at([0.0] + times)
    ev = [pair.ev * pair.yinfo[k]["abs_sum"] for k in ks]  # the centre is fl(y(t)): its evaluation error
    out = [first + ev[0]] + [r + e for r, e in zip(rows, ev[1:])]
    # at t1 itself (both quartics at the end of their last steps): a degenerate piece, as `first` at t = 0
    one, ky = torch.ones(1, **pair.fk), len(steps) - 1
    end = pair.bound(len(pair.rsteps) - 1, one, one, ky, pair.zero[None])[0] + pair.ev * pair.yinfo[ky]["abs_sum"]
    return torch.stack(out), centers, end
