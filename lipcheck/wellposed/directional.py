"""F's second derivative along the computed solution (proofs/S5.md, Lemma 7): Lemma 2's MLP term in the direction
y' from computed vectors a_i = W1 J_LN2(y_i) y_i', on pieces of a step.

Lemma 2 bounds the MLP's ||(W1 w) * (W1 w')||_2 by R ||W1|| ||w|| ||w'|| for every direction. Along the solution
w_i = J_LN2(y_i) y_i' is known: on `ti` ||W1 w_i||_4^2 is 12-14x below R ||W1|| ||w_i||^2 and ||W1 w_i||_inf
3.5-5x below R ||w_i||, and that term is 88 % of M2. Both enter where the bound follows the solution: the defect's
remainder (||D^2 F(y)[y', y']||) and the log-norm's drift along y (||J_F(y(s)) - J_F(y(s'))||).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..bounds import lognorm as ln
from .quartic import _poly, _token_sup

DIRECTION_PIECES = 16  # pieces per step on which a_i is bounded (a_i at a node costs about half an evaluation of F)


def stride(m: int) -> int:
    """Sub-intervals per piece: the largest power of two dividing m that leaves at least DIRECTION_PIECES pieces
    (1, every node, for m below 2 DIRECTION_PIECES)."""
    r = 1
    while m % (2 * r) == 0 and m // (2 * r) >= DIRECTION_PIECES:
        r *= 2
    return r


def ln_jvp(norm, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """J_LN(x) u token by token (..., C): gamma * (u_c - xh <xh, u_c> / C) / s, with u_c = u - mean(u), s^2 the
    biased variance plus eps, xh = (x - mean(x)) / s (Identity: u)."""
    if isinstance(norm, nn.Identity):
        return u
    xc = x - x.mean(-1, keepdim=True)
    s = (xc.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    xh = xc / s
    uc = u - u.mean(-1, keepdim=True)
    out = (uc - xh * (xh * uc).mean(-1, keepdim=True)) / s
    return out * norm.weight if norm.weight is not None else out


def mlp_directions(block, y: torch.Tensor, dy: torch.Tensor) -> tuple:
    """Per token (..., N): ||fl(a_i)||_inf, ||fl(a_i)||_4 and ||fl(w_i)|| with w_i = J_LN2(y_i) dy_i and
    a_i = W1 w_i, for states y and directions dy (..., H, W, C). Unrounded: `piece_bounds` adds the errors."""
    w = ln_jvp(block.norm2, y, dy)
    a = w @ block.mlp.fc1.weight.T
    flat = lambda x: x.flatten(-2)  # noqa: E731  (..., H, W) -> (..., N)
    return flat(a.abs().amax(-1)), flat(a.pow(4).sum(-1).sqrt().sqrt()), flat(w.norm(dim=-1))


def applies(field) -> bool:
    """The bounds here are for SSoG fields with an MLP (a linear mixer: its curvature is the LayerNorm's alone)."""
    return getattr(field, "directional", False) and getattr(field.block, "mlp", None) is not None


def piece_bounds(field, c: torch.Tensor, inf: dict, s: torch.Tensor, floor_tok: torch.Tensor) -> dict:
    """On the m sub-intervals of one step (coefficients c, `step_bounds` info inf, nodes s, per-token std floors
    floor_tok (m, B, N)), in pieces of r = `stride(m)` sub-intervals: `curv` (m, B) >= sup ||D^2 F(y)[y', y']|| on
    each sub-interval and `rate` (Q, B) >= sup ||D^2 F(y)[y', .]||_2 on each piece (Lemma 7), and r."""
    k, block = field.k, field.block
    u = ln.unit_roundoff(c.dtype)
    h, m = inf["h"], len(s) - 1
    B, H, W, C = c.shape[1:]
    r = stride(m)
    Q = m // r
    nodes = s[::r]
    per = max(1, (2 ** 14) // (B * H * W))  # nodes per chunk (memory: the (nodes, B, N, hidden) products)
    parts = [mlp_directions(block, _poly(c, nodes[i:i + per], h, 0), _poly(c, nodes[i:i + per], h, 1))
             for i in range(0, Q + 1, per)]
    a_inf, a_4, w_n = (torch.cat(x) for x in zip(*parts))  # (Q + 1, B, N)
    ends = lambda x: torch.maximum(x[:-1], x[1:])  # noqa: E731  the larger of a piece's two end nodes
    a_inf, a_4, w_n = ends(a_inf), ends(a_4), ends(w_n)
    # token floors on the piece, less e_y / sqrt(C): the evaluated states fl(y(s_j)) and the segments to y(s_j)
    # lie within e_y of y (std is 1/sqrt(C)-Lipschitz)
    off = inf["err_y"][None, :, None] / math.sqrt(C) * (1 + ln.gamma(2, u))
    v = (floor_tok - off).reshape(Q, r, B, -1).amin(1).clamp_min(0) ** 2 * (1 - ln.gamma(4, u))  # (Q, B, N)
    l2, c2 = k._ln_tokens(2, v)
    _, c1 = k._ln_tokens(1, v)
    speed, accel = inf["speed_tok"], _token_sup(c, h, 2)  # (B, N) sups over the step
    half = r * (h / m) / 2 * (1 + ln.gamma(3, u))  # how far a point of a piece is from its nearer end node
    e_y, e_d1 = inf["err_y"][:, None], inf["err_d1"][:, None]
    # ||w_i(s) - fl(w_i)|| from that node: J_LN2 moves with y_i (c2 per unit, y_i within speed half + e_y of the
    # evaluated state) and acts on fl(y_i'), y_i' moves by accel half + e_d1, and fl(w_i) errs by
    # 8 gamma_{2C+32} l2 ||fl(y_i')||
    dw = ((c2 * (speed * half + e_y) + 8 * ln.gamma(2 * C + 32, u) * l2) * (speed + e_d1)
          + l2 * (accel * half + e_d1))
    R, W1, hidden = min(k.W1, k.W1_row), k.W1, k.hidden
    gC = ln.gamma(C, u)
    w_n = w_n * (1 + ln.gamma(C + 2, u))  # the norm's own evaluation
    # ||W1 x||_inf <= R ||x||, ||W1 x||_4 <= (R ||W1||)^(1/2) ||x||; the product W1 w errs by gamma_C |W1| |w|
    sup_inf = a_inf + R * dw + gC * R * w_n
    sup_4 = a_4 * (1 + ln.gamma(hidden + 8, u)) + math.sqrt(R * W1) * (1 + ln.gamma(2, u)) * dw \
        + gC * math.sqrt(hidden) * R * w_n
    grow = 1 + ln.gamma(16, u)  # the sums and products above, all of nonnegative terms
    sup_inf = torch.minimum(sup_inf * grow, R * l2 * speed)  # Lemma 2's own bounds are valid too
    sq_4 = torch.minimum((sup_4 * grow) ** 2, R * W1 * l2 * l2 * speed * speed)
    g2 = ln.GELU2_SUP * k.W2
    # ||D^2 F[y', y']||: ||T|| (sum_i c1^2 s_i^4)^(1/2) + (sum_i (Lip(MLP) c2 s_i^2 + ||W2|| sup|GELU''| q_i)^2)^(1/2)
    s4 = speed ** 4
    mlp = k.mlp_lipschitz * c2 * speed * speed + g2 * sq_4
    N = speed.shape[-1]
    curv = (k.T_norm * (c1 * c1 * s4).sum(-1).sqrt() + (mlp * mlp).sum(-1).sqrt()) * (1 + ln.gamma(N + 4 * C + 96, u))
    # ||D^2 F[y', .]||_2: ||T|| max_i c1 s_i + max_i (Lip(MLP) c2 s_i + ||W2|| sup|GELU''| ||W1|| l2 a_i,inf)
    rate = (k.T_norm * (c1 * speed).amax(-1) + (k.mlp_lipschitz * c2 * speed + g2 * W1 * l2 * sup_inf).amax(-1)) \
        * (1 + ln.gamma(16, u))
    nan_inf = lambda x: torch.nan_to_num(x, nan=math.inf)  # noqa: E731  (an inf constant times 0)
    return dict(curv=nan_inf(curv).repeat_interleave(r, 0), rate=nan_inf(rate), stride=r)


def bend(smp: dict, j0: int, j1: int, b: int) -> float:
    """>= ||J_F(y(s)) - J_F(y(s_e))|| for s in the sub-intervals j0..j1 of a step and s_e the nearer of its two
    ends: (j1 - j0) tau / 2 times the largest `rate` of the pieces they touch, rounded up (inf without rates)."""
    if "rate" not in smp:
        return math.inf
    r, tau = smp["stride"], smp["tau"]
    worst = float(smp["rate"][j0 // r:(j1 - 1) // r + 1, b].max())
    return math.nextafter((j1 - j0) * tau / 2 * worst * (1 + ln.gamma(3)), math.inf)


JY_PIECES = 4  # pieces per step on which ||J_F(y) y''|| is bounded (a forward-mode product at each end node)


def _jy_nodes(field, c: torch.Tensor, h: float) -> dict:
    """At the JY_PIECES + 1 equally spaced nodes of a step: the float states fl(y), ||fl(y'')|| and
    ||fl(J_F(fl(y)) fl(y''))|| (torch.func.jvp of the field), per sample (computed once per step)."""
    s = torch.linspace(0.0, 1.0, JY_PIECES + 1, dtype=c.dtype, device=c.device)
    y, d2 = _poly(c, s, h, 0), _poly(c, s, h, 2)
    # every node in one batch (samples never interact; torch.func.jvp costs ~10 ms a call on small fields); grad
    # mode on (nothing requires grad, so no graph): without it the MLP takes its in-place sliced path on large
    # batches, not meant for dual numbers
    with torch.enable_grad():
        jy = torch.func.jvp(field, (y.flatten(0, 1),), (d2.flatten(0, 1),))[1].reshape(y.shape)
    norm = lambda x: x.flatten(2).norm(dim=-1)  # noqa: E731  (nodes, B, ...) -> (nodes, B)
    return dict(y=y, d2=norm(d2), jy=norm(jy))


def node_variance(v: float, inf: dict, C: int) -> float:
    """The variance floor v of a step lowered for states within e_y of y: (sqrt(v) - e_y / sqrt(C))^2, rounded down
    (0 where that is not positive)."""
    u = ln.unit_roundoff(torch.float64)
    s = math.sqrt(v) * (1 - ln.gamma(1, u)) - float(inf["err_y"].max()) / math.sqrt(C) * (1 + ln.gamma(2, u))
    return max(s, 0.0) ** 2 * (1 - ln.gamma(2, u))


def jy_bound(field, c: torch.Tensor, inf: dict, v: float) -> torch.Tensor:
    """(B,) >= sup over the step of ||J_F(y(s)) y''(s)|| (Lemma 7), in place of L sup ||y''||: the largest node
    value ||fl(J fl(y''))|| (its norm rounded up, plus Lemma 4's eps_J ||fl(y'')|| at the node states), plus, within
    eta = h / (2 JY_PIECES) of the nearer node, M2 (sup ||y_i'|| eta + e_y) sup ||y''|| (J moves, Lemma 2) and
    L (sup ||y'''|| eta + e_d2) (y'' moves, and fl(y'') errs by e_d2 = gamma_10 sum_k k (k - 1) ||c_k|| / h^2).
    L, M2 and eps_J at `node_variance(v)`: the node states fl(y_j) and the paths to y lie within e_y of y. The memo
    of the node values lives in inf (they do not depend on v)."""
    if "_jy" not in inf:
        inf["_jy"] = _jy_nodes(field, c, inf["h"])
    nodes = inf["_jy"]
    u = ln.unit_roundoff(c.dtype)
    B = c.shape[1]
    v = node_variance(v, inf, c.shape[-1])
    L, M2 = field.lipschitz(v), field.curvature(v)
    _, eps_J = field.rounding(nodes["y"].reshape(-1, *c.shape[2:]), v)
    h = inf["h"]
    eta = h / (2 * JY_PIECES) * (1 + ln.gamma(2, u))
    e_d2 = ln.gamma(10, u) * sum(j * (j - 1) * inf["cn"][j] for j in range(2, 5)) / h ** 2
    at = nodes["jy"].amax(0) * (1 + ln.gamma(c[0].numel(), u)) + eps_J * nodes["d2"].amax(0)
    move = M2 * (inf["speed"] * eta + inf["err_y"]) * inf["d2"] + L * (inf["d3"] * eta + e_d2)
    out = (at.reshape(B) + move) * (1 + ln.gamma(8, u))
    return torch.nan_to_num(out, nan=math.inf)
