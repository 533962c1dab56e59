"""Lemma 7 (proofs/S5.md): F's second derivative along the computed solution, against nested autograd and dense
Jacobians computed here; and the enclosure that uses it still contains an independent high-accuracy solve."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import block_field, layer_norm, random_block
from scipy.integrate import solve_ivp

import lipcheck.wellposed as wp
from lipcheck.wellposed import defect as dm
from lipcheck.wellposed import directional as dr
from lipcheck.wellposed.quartic import _poly, _token_sup, piecewise_quartic
from lipcheck.wellposed.recurrence import _mu_bar

D = torch.float64


def test_stride_leaves_at_least_16_pieces_of_a_power_of_two():
    assert [dr.stride(m) for m in (8, 10, 16, 31, 32, 40, 64, 512, 640, 896, 1024)] == \
        [1, 1, 1, 1, 2, 2, 4, 32, 32, 32, 64]
    for m in range(8, 2000):
        r = dr.stride(m)
        assert m % r == 0 and (r == 1 or m // r >= 16) and r & (r - 1) == 0
        assert not (m % (2 * r) == 0 and m // (2 * r) >= 16)  # the largest such


@pytest.mark.parametrize("affine", [True, False])
def test_ln_jvp_is_layer_norms_derivative(affine):
    norm = torch.nn.LayerNorm(7, eps=1e-3, elementwise_affine=affine, dtype=D)
    if affine:
        with torch.no_grad():
            norm.weight.normal_()
            norm.bias.normal_()
    g = torch.Generator().manual_seed(0)
    x, u = torch.randn(3, 5, 7, dtype=D, generator=g), torch.randn(3, 5, 7, dtype=D, generator=g)
    want = torch.func.jvp(lambda z: layer_norm(z, norm), (x,), (u,))[1]
    assert torch.allclose(dr.ln_jvp(norm, x, u), want, rtol=1e-12, atol=1e-12)
    assert dr.ln_jvp(torch.nn.Identity(), x, u) is u


def _case(seed=5, C=8, H=3):
    blk = random_block(C, heads=2, seed=seed)
    field = wp.SSoGField(blk, H, H)
    g = torch.Generator().manual_seed(2)
    scale = torch.linspace(0.4, 2.5, H * H, dtype=D).reshape(1, H, H, 1)  # tokens of different stds
    x0 = torch.randn(1, H, H, C, dtype=D, generator=g) * scale
    steps, coefs, _ = piecewise_quartic(blk.vector_field, x0, 0.3, method="dopri5", tol=1e-6)
    info = dm.step_bounds(steps, coefs, C)
    return blk, field, steps, coefs, info


def test_mlp_directions_are_the_norms_of_w1_times_the_ln_jvp():
    blk, _, _, coefs, info = _case()
    s = torch.linspace(0, 1, 5, dtype=D)
    y, d1 = _poly(coefs[0], s, info[0]["h"], 0), _poly(coefs[0], s, info[0]["h"], 1)
    a_inf, a_4, w_n = dr.mlp_directions(blk, y, d1)
    w = torch.func.jvp(lambda z: layer_norm(z, blk.norm2), (y,), (d1,))[1]
    a = w @ blk.mlp.fc1.weight.T
    assert torch.allclose(a_inf, a.abs().amax(-1).flatten(-2), rtol=1e-12)
    assert torch.allclose(a_4, a.abs().pow(4).sum(-1).pow(0.25).flatten(-2), rtol=1e-12)
    assert torch.allclose(w_n, w.norm(dim=-1).flatten(-2), rtol=1e-12)


@pytest.mark.parametrize("m", [16, 512])
def test_piece_bounds_cover_the_second_derivative_along_y(m):
    """curv >= ||D^2 F(y(s))[y'(s), y'(s)]|| (nested forward mode) and rate >= ||D^2 F(y(s))[y'(s), .]||_2 (the
    dense derivative of the Jacobian along y') at points inside every piece, mid-piece included (farthest from the
    nodes where a_i is evaluated); both below Lemma 2's direction-free values on this model."""
    blk, field, steps, coefs, info = _case()
    F = block_field(blk)
    for k in (0, len(steps) - 1):
        c, inf = coefs[k], info[k]
        smp = dm.sample_step(field, c, inf, m)
        r = smp["stride"]
        assert r == dr.stride(m) and smp["rate"].shape == (m // r, 1)
        s_nodes = torch.linspace(0, 1, m + 1, dtype=D)
        floor_tok = torch.minimum(smp["std"][:-1], smp["std"][1:]) - 1e-9
        got = dr.piece_bounds(field, c, inf, s_nodes, floor_tok)
        lemma2 = dm.token_curvature(field, floor_tok, inf["speed_tok"], blk.norm1.normalized_shape[0])
        assert bool((got["curv"] < lemma2).all())
        assert float(got["rate"].max()) < smp["M2"] * float(inf["speed"].max())
        for p in range(0, m // r, max(1, m // r // 4)):
            for frac in (0.0, 0.31, 0.5, 0.93):
                sig = torch.tensor([(p + frac) * r / m], dtype=D)
                y, d1 = _poly(c, sig, inf["h"], 0)[0], _poly(c, sig, inf["h"], 1)[0]
                dd = torch.func.jvp(lambda z: torch.func.jvp(F, (z,), (d1,))[1], (y,), (d1,))[1]
                j = min(int((p + frac) * r), m - 1)
                assert float(dd.norm()) <= float(got["curv"][j, 0])
                n = y.numel()
                jac = torch.func.jacfwd(lambda z: torch.func.jvp(F, (z,), (d1,))[1].reshape(-1))(y).reshape(n, n)
                assert float(torch.linalg.matrix_norm(jac, 2)) <= float(got["rate"][p, 0])


def test_bend_bounds_how_far_the_jacobian_moves_along_y():
    """||J_F(y(s)) - J_F(y(s_e))||_2 (dense Jacobians) for s in a log-norm interval and s_e its nearer end <= bend."""
    blk, field, steps, coefs, info = _case()
    F = block_field(blk)
    c, inf = coefs[1], info[1]
    m = 64
    smp = dm.sample_step(field, c, inf, m)

    def jac(sig):
        y = _poly(c, torch.tensor([sig], dtype=D), inf["h"], 0)[0]
        n = y.numel()
        return torch.func.jacfwd(lambda z: F(z).reshape(-1))(y).reshape(n, n)
    for j0, j1 in ((0, 16), (16, 64), (40, 48)):
        b = dr.bend(smp, j0, j1, 0)
        ends = (jac(j0 / m), jac(j1 / m))
        for frac in (0.2, 0.5, 0.8):
            sig = (j0 + frac * (j1 - j0)) / m
            near = ends[0] if frac <= 0.5 else ends[1]
            assert float(torch.linalg.matrix_norm(jac(sig) - near, 2)) <= b
    assert dr.bend({"m": 8}, 0, 8, 0) == math.inf  # no rates: no bend


def test_mu_bar_takes_the_bend_only_where_smaller():
    class Field:
        uses_variance = False

        @staticmethod
        def curvature(v):
            return 2.0
    base = _mu_bar(Field(), 0.5, 1.0, 0.25, 0.125, 4, 0.0625)[0]
    assert base == pytest.approx(0.5 + 2 * (0.125 + 0.25 + 0.0625), rel=1e-14) and base >= 0.5 + 2 * 0.4375
    assert _mu_bar(Field(), 0.5, 1.0, 0.25, 0.125, 4, 0.0625, math.inf)[0] == base
    assert _mu_bar(Field(), 0.5, 1.0, 0.25, 0.125, 4, 0.0625, 10.0)[0] == base  # larger than M2 drift: not used
    low = _mu_bar(Field(), 0.5, 1.0, 0.25, 0.125, 4, 0.0625, 0.125)[0]
    assert low == pytest.approx(0.5 + 2 * (0.125 + 0.0625) + 0.125, rel=1e-14) and low >= 0.5 + 0.375 + 0.125


def test_enclosure_with_lemma_7_is_cheaper_and_still_contains_the_solution():
    """The same enclosure without Lemma 7 (the field's `directional` off) needs more defect sub-intervals and point
    log-norms; with it, an independent DOP853 solve at 1e-12 lies inside every radius at the enclosure's times."""
    blk = random_block(8, heads=2, seed=5)
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(1, 3, 3, 8, dtype=D, generator=g) * torch.linspace(0.4, 2.5, 9, dtype=D).reshape(1, 3, 3, 1)
    field = wp.SSoGField(blk, 3, 3)
    off = wp.SSoGField(blk, 3, 3)
    off.directional = False
    kw = dict(tol=1e-6, ref_tol=None, defect_ratio=0.25, mu_slack=0.25)
    on_enc, off_enc = wp.enclose_field(field, x0, 1.0, **kw), wp.enclose_field(off, x0, 1.0, **kw)
    assert bool(on_enc.proven.all()) and bool(off_enc.proven.all())
    assert on_enc.stats["fine_points"] < off_enc.stats["fine_points"]
    assert on_enc.stats["lognorm_points"] < off_enc.stats["lognorm_points"]
    f = lambda t, z: blk.vector_field(torch.tensor(z, dtype=D).reshape(x0.shape)).reshape(-1).numpy()  # noqa: E731
    ts = on_enc.t.numpy()
    sol = solve_ivp(f, (0.0, 1.0), x0.reshape(-1).numpy(), method="DOP853", rtol=1e-12, atol=1e-12, t_eval=ts)
    err = np.linalg.norm(sol.y.T - on_enc.center.reshape(len(ts), -1).numpy(), axis=1)
    assert bool((torch.tensor(err) <= on_enc.radius[:, 0] + 1e-11).all())


def test_jy_bound_covers_the_jacobian_times_y_second_derivative():
    """jy_bound >= ||J_F(y(s)) y''(s)|| (forward mode, written-out LayerNorm) at points between its nodes, and below
    L sup ||y''||; the memo is dropped once refined_step is done with the step."""
    blk, field, steps, coefs, info = _case()
    F = block_field(blk)
    for k in (0, len(steps) - 1):
        c, inf = coefs[k], info[k]
        smp = dm.sample_step(field, c, inf, 16)
        got = dr.jy_bound(field, c, inf, smp["v_y"])
        assert float(got[0]) < smp["L"] * float(inf["d2"][0])
        for sig in np.linspace(0, 1, 41):
            t = torch.tensor([sig], dtype=D)
            y, d2 = _poly(c, t, inf["h"], 0)[0], _poly(c, t, inf["h"], 2)[0]
            assert float(torch.func.jvp(F, (y,), (d2,))[1].norm()) <= float(got[0])
    from lipcheck.wellposed.options import DirectOptions
    opts = DirectOptions(defect_ratio=0.25)
    dm.refined_step(field, coefs[0], info[0], opts)
    assert "_jy" not in info[0]


@pytest.mark.parametrize("size", [1e-3, 0.1, 0.5])
def test_carried_lognorm_bounds_the_log_norm_at_the_next_steps_start(size):
    """carried_lognorm(b -> a) >= mu_2 of the dense Jacobian at a (autograd, eigvalsh here), and it is the verified
    value at b plus no more than M2 times the largest token distance (rounding aside)."""
    from lipcheck.wellposed.direct import carried_lognorm
    from lipcheck.wellposed.defect import token_std_lower
    blk = random_block(8, heads=2, seed=3)
    field = wp.SSoGField(blk, 3, 3, lognorm="dense")
    g = torch.Generator().manual_seed(4)
    b = torch.randn(2, 3, 3, 8, dtype=D, generator=g)
    a = b + size * torch.randn(2, 3, 3, 8, dtype=D, generator=g)
    lam_b = torch.as_tensor(field.lognorm(b, 0.0, 0.0))
    std_b = token_std_lower(b[None])[0]
    got = carried_lognorm(field, lam_b, std_b, b, a, torch.zeros(2, dtype=D))
    F = block_field(blk)
    for i in range(2):
        n = a[i].numel()
        J = torch.func.jacfwd(lambda z: F(z[None]).reshape(-1))(a[i]).reshape(n, n)
        assert float(torch.linalg.eigvalsh((J + J.T) / 2)[-1]) <= float(got[i])
        dist = float((a[i] - b[i]).norm(dim=-1).max())
        floor = float(std_b[i].min()) - dist / math.sqrt(8)
        if floor <= 0:  # the ball around b reaches a token of variance 0: no curvature bound, inf
            assert got[i] == math.inf
            continue
        M2 = field.curvature(floor ** 2)
        assert float(got[i]) <= float(lam_b[i]) + M2 * dist * (1 + 1e-12) + 1e-12


def _gam(n):
    u = 2.0 ** -53
    return n * u / (1 - n * u)


def test_piece_bounds_are_lemma_7_to_the_last_term():
    """curv, rate, bend and jy_bound recomputed here from the statements of proofs/S5.md Lemma 7 (every term, every
    rounding factor) on one step of the test field, at m = 64 (4 sub-intervals a piece) and m = 16 (one)."""
    blk, field, steps, coefs, info = _case()
    k = field.k
    c, inf = coefs[1], info[1]
    C, hidden = 8, blk.mlp.fc1.weight.shape[0]
    for m in (64, 16):
        r = 4 if m == 64 else 1
        Q = m // r
        h, tau = inf["h"], inf["h"] / m
        smp = dm.sample_step(field, c, inf, m)
        floor_tok = torch.minimum(smp["std"][:-1], smp["std"][1:]) - 0.01
        got = dr.piece_bounds(field, c, inf, torch.linspace(0, 1, m + 1, dtype=D), floor_tok)
        assert got["stride"] == r
        # a_i at the piece ends: W1 applied to LayerNorm's derivative (autograd through the written-out LayerNorm)
        nodes = torch.linspace(0, 1, m + 1, dtype=D)[::r]
        y, d1 = _poly(c, nodes, h, 0), _poly(c, nodes, h, 1)
        w = torch.func.jvp(lambda z: layer_norm(z, blk.norm2), (y,), (d1,))[1]
        a = w @ blk.mlp.fc1.weight.T
        end = lambda x: torch.maximum(x[:-1], x[1:]).flatten(2)  # noqa: E731
        a_inf, a_4, wn = end(a.abs().amax(-1)), end(a.abs().pow(4).sum(-1).pow(0.25)), end(w.norm(dim=-1))
        wn = wn * (1 + _gam(C + 2))
        off = inf["err_y"][None, :, None] / math.sqrt(C) * (1 + _gam(2))  # fl(y) within e_y of y
        v = (floor_tok - off).reshape(Q, r, 1, -1).amin(1).clamp_min(0) ** 2 * (1 - _gam(4))
        sd = (v + blk.norm2.eps).sqrt()
        g2 = float(blk.norm2.weight.abs().max())
        l2, c2 = g2 / sd, 1.1547005383793 * g2 / (math.sqrt(C) * (v + blk.norm2.eps))
        c1 = 1.1547005383793 * float(blk.norm1.weight.abs().max()) / (math.sqrt(C) * (v + blk.norm1.eps))
        speed = inf["speed_tok"]
        accel = torch.stack([_poly(c, torch.linspace(0, 1, 2001, dtype=D), h, 2)]).norm(dim=-1).flatten(2).amax(1)
        assert bool((_token_sup(c, h, 2) >= accel).all())
        accel = _token_sup(c, h, 2)
        eta = r * tau / 2 * (1 + _gam(3))
        e_y, e_d1 = inf["err_y"][:, None], inf["err_d1"][:, None]
        dw = (c2 * (speed * eta + e_y) + 8 * _gam(2 * C + 32) * l2) * (speed + e_d1) + l2 * (accel * eta + e_d1)
        R, W1 = min(k.W1, k.W1_row), k.W1
        A_inf = torch.minimum((a_inf + R * dw + _gam(C) * R * wn) * (1 + _gam(16)), R * l2 * speed)
        A_4 = (a_4 * (1 + _gam(hidden + 8)) + math.sqrt(R * W1) * (1 + _gam(2)) * dw
               + _gam(C) * math.sqrt(hidden) * R * wn) * (1 + _gam(16))
        q = torch.minimum(A_4 ** 2, R * W1 * l2 ** 2 * speed ** 2)
        s2 = math.sqrt(2 / math.pi) * k.W2
        mlp = k.mlp_lipschitz * c2 * speed ** 2 + s2 * q
        N = speed.shape[-1]
        curv = (k.T_norm * (c1 ** 2 * speed ** 4).sum(-1).sqrt() + (mlp ** 2).sum(-1).sqrt()) \
            * (1 + _gam(N + 4 * C + 96))
        rate = (k.T_norm * (c1 * speed).amax(-1)
                + (k.mlp_lipschitz * c2 * speed + s2 * W1 * l2 * A_inf).amax(-1)) * (1 + _gam(16))
        assert torch.allclose(got["curv"], curv.repeat_interleave(r, 0), rtol=1e-12, atol=0)
        assert torch.allclose(got["rate"], rate, rtol=1e-12, atol=0)
        smp2 = dict(got, tau=tau)
        for j0, j1 in ((0, m), (r, 3 * r), (m - r, m)):
            want = (j1 - j0) * tau / 2 * float(rate[j0 // r:j1 // r].max()) * (1 + _gam(3))
            assert dr.bend(smp2, j0, j1, 0) == pytest.approx(want, rel=1e-14) and dr.bend(smp2, j0, j1, 0) >= want
    # ||J_F y''|| at JY_PIECES + 1 nodes plus how far J and y'' move, with Lemma 4's eps_J at the node states
    got = dr.jy_bound(field, c, dict(inf), smp["v_y"])
    lowered = math.sqrt(smp["v_y"]) * (1 - _gam(1)) - float(inf["err_y"].max()) / math.sqrt(C) * (1 + _gam(2))
    v = max(lowered, 0.0) ** 2 * (1 - _gam(2))
    L, M2 = field.lipschitz(v), field.curvature(v)
    assert 0 < v < smp["v_y"] and L > smp["L"]
    s = torch.linspace(0, 1, dr.JY_PIECES + 1, dtype=D)
    y, d2 = _poly(c, s, h, 0), _poly(c, s, h, 2)
    jy = torch.stack([torch.func.jvp(block_field(blk), (y[j],), (d2[j],))[1] for j in range(len(s))])
    eps_J = field.rounding(y.reshape(-1, *y.shape[2:]), v)[1]
    n = c[0].numel()
    at = jy.flatten(2).norm(dim=-1).amax(0) * (1 + _gam(n)) + eps_J * d2.flatten(2).norm(dim=-1).amax(0)
    eta = h / (2 * dr.JY_PIECES) * (1 + _gam(2))
    e_d2 = _gam(10) * sum(j * (j - 1) * inf["cn"][j] for j in range(2, 5)) / h ** 2
    move = M2 * (inf["speed"] * eta + inf["err_y"]) * inf["d2"] + L * (inf["d3"] * eta + e_d2)
    assert torch.allclose(got, (at + move) * (1 + _gam(8)), rtol=1e-9, atol=0)


def test_bend_takes_every_piece_the_interval_touches():
    """Hand-made rates: the interval's pieces are those from j0 // r to (j1 - 1) // r, the largest rate counts."""
    smp = dict(rate=torch.tensor([[1.0], [2.0], [5.0]], dtype=D), stride=2, tau=0.125)
    up = lambda x: math.nextafter(x * (1 + _gam(3)), math.inf)  # noqa: E731
    assert dr.bend(smp, 0, 6, 0) == up(6 * 0.125 / 2 * 5.0)  # all three pieces
    assert dr.bend(smp, 1, 5, 0) == up(4 * 0.125 / 2 * 5.0)  # sub-interval 4 lies in the last piece
    assert dr.bend(smp, 0, 4, 0) == up(4 * 0.125 / 2 * 2.0)  # the first two pieces only
    assert dr.bend(smp, 3, 4, 0) == up(1 * 0.125 / 2 * 2.0)  # inside the second piece


def test_sample_step_assembles_m_delta_from_the_smaller_bounds():
    """sample_step's remainder is tau^2 / 8 (sup ||y'''|| + min(Lemma 2's curvature terms, Lemma 7's per piece) +
    min(L sup ||y''||, jy_bound)), the pieces from piece_bounds at the step's own token floors."""
    blk, field, steps, coefs, info = _case()
    c, inf = coefs[1], info[1]
    m = 64
    smp = dm.sample_step(field, c, inf, m)
    tau = inf["h"] / m
    floor_tok = torch.minimum(smp["std"][:-1], smp["std"][1:])
    u = 2.0 ** -53
    reach = (inf["speed_tok"] * (tau / 2) + inf["err_y"][:, None]) / math.sqrt(8) * (1 + _gam(5))
    floor_tok = floor_tok - reach
    lemma2 = torch.minimum(smp["M2"] * torch.minimum(inf["sq4"], inf["d1"] ** 2),
                           dm.token_curvature(field, floor_tok, inf["speed_tok"], 8))
    pieces = dr.piece_bounds(field, c, inf, torch.linspace(0, 1, m + 1, dtype=D), floor_tok)
    jy = dr.jy_bound(field, c, dict(inf), smp["v_y"])
    want = tau ** 2 / 8 * (inf["d3"] + torch.minimum(lemma2, pieces["curv"])
                           + torch.minimum(smp["L"] * inf["d2"], jy))
    assert torch.allclose(smp["remainder"], want, rtol=1e-13, atol=0) and u > 0
    assert bool((pieces["curv"] < lemma2).all()) and bool((jy < smp["L"] * inf["d2"]).all())


def test_jy_bound_adds_lemma_4s_rounding_at_the_nodes():
    """With the field's own forward-mode products the node term is exact: jy_bound - (its formula without eps_J)
    equals eps_J ||fl(y'')|| (1 + gamma_8)."""
    blk, field, steps, coefs, info = _case()
    c, inf = coefs[0], info[0]
    smp = dm.sample_step(field, c, inf, 16)
    h = inf["h"]
    got = dr.jy_bound(field, c, dict(inf), smp["v_y"])
    v = dr.node_variance(smp["v_y"], inf, 8)
    L, M2 = field.lipschitz(v), field.curvature(v)
    s = torch.linspace(0, 1, dr.JY_PIECES + 1, dtype=D)
    y, d2 = _poly(c, s, h, 0), _poly(c, s, h, 2)
    jy = torch.stack([torch.func.jvp(field, (y[j],), (d2[j],))[1] for j in range(len(s))])
    eta = h / (2 * dr.JY_PIECES) * (1 + _gam(2))
    e_d2 = _gam(10) * sum(j * (j - 1) * inf["cn"][j] for j in range(2, 5)) / h ** 2
    move = M2 * (inf["speed"] * eta + inf["err_y"]) * inf["d2"] + L * (inf["d3"] * eta + e_d2)
    bare = (jy.flatten(2).norm(dim=-1).amax(0) * (1 + _gam(c[0].numel())) + move) * (1 + _gam(8))
    eps_J = field.rounding(y.reshape(-1, *y.shape[2:]), v)[1]
    extra = eps_J * d2.flatten(2).norm(dim=-1).amax(0) * (1 + _gam(8))
    assert float(extra[0]) > 0
    assert torch.allclose(got - bare, extra, rtol=1e-3, atol=0)


def test_carried_lognorm_counts_the_offset_of_the_other_evaluation():
    from lipcheck.wellposed.defect import token_std_lower
    from lipcheck.wellposed.direct import carried_lognorm
    blk = random_block(8, heads=2, seed=3)
    field = wp.SSoGField(blk, 3, 3, lognorm="dense")
    g = torch.Generator().manual_seed(4)
    b = torch.randn(1, 3, 3, 8, dtype=D, generator=g)
    a = b + 1e-3 * torch.randn(1, 3, 3, 8, dtype=D, generator=g)
    lam = torch.tensor([0.5], dtype=D)
    std = token_std_lower(b[None])[0]
    dist = float((a - b).norm(dim=-1).max()) * (1 + _gam(10))
    with_offset = carried_lognorm(field, lam, std, b, a, torch.tensor([0.05], dtype=D))
    without = carried_lognorm(field, lam, std, b, a, torch.zeros(1, dtype=D))
    assert float(with_offset[0]) == _mu_bar(field, 0.5, float(std.min()), 0.0, dist, 8, 0.05)[0]
    assert float(with_offset[0]) > float(without[0]) + 0.04 * field.curvature(float(std.min()) ** 2)
