"""The defect delta = y' - F(y) of the piecewise quartic y, bounded on whole sub-intervals (proofs/S5.md,
Theorem 5, condition 1): the larger end value, the rounding, and tau^2 / 8 sup ||delta''||."""
from __future__ import annotations

import math

import torch

from ..bounds import lognorm as ln
from ..bounds.network import token_variance_lower
from . import directional
from .quartic import _bern_sup, _eval, _poly, _token_speed
from .solve import sample_norm

EVAL_TERMS = 10  # polynomial evaluation (<= 5 terms, powers of sigma): error <= gamma_10 sum |c_k|


def step_bounds(steps, coefs, C: int) -> list:
    """Per step: h, sups of ||y'||, ||y''||, ||y'''|| (B,), per-token speed sup ||y_i'|| (B, N) and its largest
    `speed`, (sum_i sup ||y_i'||^4)^(1/2) `sq4`, and the evaluation errors of y (`err_y`) and y' (`err_d1`)."""
    out = []
    for (a, b), c in zip(steps, coefs):
        u = ln.unit_roundoff(c.dtype)
        ev = ln.gamma(EVAL_TERMS, u)
        h = b - a
        cn = [sample_norm(c[j]) for j in range(5)]
        tok = [c[j].norm(dim=-1).flatten(1) for j in range(5)]  # (B, N)
        speed_tok = torch.minimum(sum(j * tok[j] for j in range(1, 5)) / h, _token_speed(c, h))  # sup ||y_i'||
        N = speed_tok.shape[1]
        out.append(dict(h=h, cn=cn, d1=_bern_sup(c, h, 1), d2=_bern_sup(c, h, 2), d3=_bern_sup(c, h, 3),
                        speed=speed_tok.amax(1), speed_tok=speed_tok, err_y=ev * sample_norm(c.abs().sum(0)),
                        sq4=(speed_tok ** 4).sum(1).sqrt() * (1 + ln.gamma(N + 4 * C + 64, u)),
                        err_d1=ev * sum(j * cn[j] for j in range(1, 5)) / h))
    return out


def jumps_and_start(x0, coefs, info) -> tuple[list, torch.Tensor]:
    """([0, ||J_1||, ...] the jumps between steps with both sides' evaluation errors, r(0) >= ||x0 - fl(y(0))||)."""
    u = ln.unit_roundoff(x0.dtype)
    jumps = [torch.zeros(x0.shape[0], dtype=x0.dtype, device=x0.device)]
    jumps += [sample_norm(coefs[k + 1][0] - coefs[k].sum(0)) * (1 + ln.gamma(8, u))
              + info[k]["err_y"] + info[k + 1]["err_y"] for k in range(len(coefs) - 1)]
    r0 = sample_norm(x0 - coefs[0][0]) * (1 + ln.gamma(4, u)) + info[0]["err_y"]
    return jumps, r0


def token_std_lower(y: torch.Tensor) -> torch.Tensor:
    """(P, B, H, W, C) -> (P, B, N): a lower bound on LayerNorm's (biased) token std of the float states y: the
    variance's proven lower bound (proofs/S3.md, 'Rounding'), then one square root and one product."""
    return token_variance_lower(y).sqrt().flatten(2) * (1 - ln.gamma(2, ln.unit_roundoff(y.dtype)))


# sample points of a step evaluated together in `sample_step`: at most this many tokens (all samples) at once, so
# that no (m + 1) B n tensor is formed (ti, B = 8, m = 2048: 4.9 GB each for y, y' and F(y), which made a batch of
# 8 images 1.6x slower per image than one image alone)
SAMPLE_TOKENS = 16384


def _chunks(m: int, B: int, N: int) -> list:
    per = max(1, SAMPLE_TOKENS // (B * N))
    return [(i, min(i + per, m + 1)) for i in range(0, m + 1, per)]


def step_states(c: torch.Tensor, smp: dict, h: float, idx) -> torch.Tensor:
    """fl(y(s_j)) at the sample points j in idx of the step `sample_step` sampled as smp: (len(idx), B, H, W, C),
    each within the evaluation error err_y of y(s_j) (as every evaluation of y in the proof)."""
    return _poly(c, smp["s"][list(idx)], h, 0)


def sample_step(field, c: torch.Tensor, inf: dict, m: int) -> dict:
    """The defect bound on the m sub-intervals of one step with coefficients c (5, B, H, W, C): per sub-interval
    and sample `defect` >= sup ||delta||, with the sampled values, the remainder and the constants it used. The
    samples are evaluated in chunks of about SAMPLE_TOKENS tokens, y twice (once more for the rounding bounds, which
    need the variance floor of all chunks; the states at the log-norm points are evaluated again by `step_states`):
    the per-sample numbers and the maxima are those of one evaluation of all."""
    B, H, W, C = c.shape[1:]
    fk = dict(dtype=c.dtype, device=c.device)
    u = ln.unit_roundoff(c.dtype)
    h = inf["h"]
    s = torch.linspace(0.0, 1.0, m + 1, **fk)
    chunks = _chunks(m, B, H * W)
    std, dn = [], []
    for i, j in chunks:
        y, d1 = _poly(c, s[i:j], h, 0), _poly(c, s[i:j], h, 1)
        std.append(token_std_lower(y))  # (j - i, B, N), at fl(y(s_j))
        dn.append(sample_norm(d1 - _eval(field, y.reshape(-1, H, W, C)).reshape(y.shape)))  # (j - i, B)
    std, dn = torch.cat(std), torch.cat(dn)
    tau = h / m
    # how far a token of y moves from the nearer end, plus fl(y) - y (the stds are those of fl(y)); the products,
    # the sum and the division by sqrt(C) rounded up by 1 + gamma_5
    reach = (inf["speed_tok"] * (tau / 2) + inf["err_y"][:, None]) / math.sqrt(C) * (1 + ln.gamma(5, u))
    floor_tok = torch.minimum(std[:-1], std[1:]) - reach  # (m, B, N) each token's std floor on each sub-interval
    floor = floor_tok.amin(-1)  # (m, B)
    # the subtraction (where positive) and the square round once each: 1 - gamma_4 keeps v_y below floor^2
    v_y = float(floor.clamp_min(0).min()) ** 2 * (1 - ln.gamma(4, u)) if field.uses_variance else 0.0
    # per chunk: eps_F is per state, eps_J increasing in the largest LayerNorm amplification over the states (both
    # fields), so the maxima over the chunks are the values on all states at once
    eps_F, eps_J = torch.zeros(B, **fk), 0.0
    for i, j in chunks:
        e_F, e_J = field.rounding(_poly(c, s[i:j], h, 0).reshape(-1, H, W, C), v_y)
        eps_F, eps_J = torch.maximum(eps_F, torch.as_tensor(e_F, **fk).reshape(j - i, B).amax(0)), max(eps_J, e_J)
    L, M2 = field.lipschitz(v_y), field.curvature(v_y)
    rd = inf["err_d1"] + eps_F + L * inf["err_y"]
    # sup ||delta''|| on the step (B,): ||D^2F[u, u]|| <= M2 (sum_i ||u_i||^4)^(1/2) token by token (Lemma 2), or
    # with each token's constant at its own variance floor where the field gives them (`token_curvature`)
    curv = M2 * torch.minimum(inf["sq4"], inf["d1"] ** 2)
    if field.uses_variance and hasattr(field, "curvature_parts"):
        curv = torch.minimum(curv, token_curvature(field, floor_tok, inf["speed_tok"], C))
    along = {}
    if field.uses_variance and directional.applies(field):  # along y' (Lemma 7): per piece, (m, B)
        along = directional.piece_bounds(field, c, inf, s, floor_tok)
        curv = torch.minimum(curv, along.pop("curv"))
    Jd2 = L * inf["d2"]  # ||J_F(y) y''|| on the step: Lemma 2, or Lemma 7 along y where smaller
    if along:
        Jd2 = torch.minimum(Jd2, directional.jy_bound(field, c, inf, v_y))
    Mdd = inf["d3"] + curv + Jd2
    # delta - (its linear interpolant) = -int G delta'', G >= 0, int G = s (tau - s) / 2 <= tau^2 / 8
    rem = tau ** 2 / 8 * Mdd
    sup = torch.maximum(dn[:-1], dn[1:]) + rd + rem
    return dict(m=m, s=s, C=C, std=std, floor=floor, defect=sup * (1 + ln.gamma(16, u)), sampled=dn,
                remainder=rem, v_y=v_y, L=L, M2=M2, eps_J=eps_J, tau=tau, **along)


def token_curvature(field, floor_tok: torch.Tensor, speed_tok: torch.Tensor, C: int) -> torch.Tensor:
    """(B,) >= sup ||D^2 F(y)[y', y']|| on a step, Lemma 2 token by token: sum_k a_k (sum_i c_ki(v_i)^2 s_i^4)^(1/2)
    with v_i = (token i's std floor over the step's sub-intervals)^2 (1 - gamma_4) and s_i >= sup ||y_i'||
    (`field.curvature_parts`). Every quantity is >= 0: the c_ki (<= 8 operations each), the squares, fourth powers
    and products, the sum over N tokens, the root and the sum over parts are rounded up together by
    1 + gamma_{N + 4C + 96} (4C as for `step_bounds`' sq4: s_i's own evaluation error to the fourth power). nan
    (an inf constant times a token that does not move) counts as inf."""
    u = ln.unit_roundoff(floor_tok.dtype)
    N = floor_tok.shape[-1]
    v = floor_tok.clamp_min(0).amin(0) ** 2 * (1 - ln.gamma(4, u))  # (B, N)
    s4 = speed_tok ** 4
    total = sum(a * (c * c * s4).sum(-1).sqrt() for a, c in field.curvature_parts(v))
    total = total * (1 + ln.gamma(N + 4 * C + 96, u))
    return torch.nan_to_num(total, nan=math.inf)


def sub_interval_count(x: float) -> int:
    """The smallest m >= x (and >= 8) of the form q 2^a with q in 4..7: consecutive counts at most 25 % apart, so
    a step gets about the sub-intervals its remainder needs (powers of two overshot by 44 % on average), and m
    keeps a power-of-two divisor >= m / 7 for the log-norm grid (`direct.lognorm_grid`)."""
    a = 1
    while True:
        for q in (4, 5, 6, 7):
            if q << a >= x:
                return q << a
        a += 1


def refined_step(field, c, inf, opts) -> dict:
    """`sample_step` on 8 sub-intervals, then on as many as the remainder asks for (it falls like tau^2: the
    count is scaled by sqrt(remainder / target), 0.1 % over, rounded up by `sub_interval_count`, at least 25 % more
    each round; on `ti` the remainder fell exactly like 1/m^2, and 3 % over cost 10 % more evaluations), until the remainder is below defect_ratio times the sampled defect (or below defect_abs), or
    max_per_step is reached (a tuning loop: every result is a valid bound)."""
    fk = dict(dtype=c.dtype, device=c.device)
    m = 8
    while True:
        smp = sample_step(field, c, inf, m)
        base = torch.maximum(opts.defect_ratio * torch.maximum(smp["sampled"][:-1], smp["sampled"][1:]),
                             torch.as_tensor(opts.defect_abs, **fk))  # remainder <= ratio * sampled, or <= abs
        worst = float((smp["remainder"] / base.clamp_min(1e-300)).max())
        if worst <= 1 or m >= opts.max_per_step or not math.isfinite(worst):
            inf.pop("_jy", None)  # Lemma 7's node states, kept for the rounds of this step only (memory)
            return smp
        m = min(opts.max_per_step, sub_interval_count(max(1.25 * m, 1.001 * m * math.sqrt(worst))))
