"""The enclosure of the ODE field whose mixer is dense attention (lipcheck.bounds.attention_field,
lipcheck.wellposed.attention_field; proofs/S5.md, "The attention field").

References computed here, independently of the library: second derivatives by nested forward-mode autograd of the
layer's own forward (math backend), Jacobians by reverse-mode autograd, adversarial states and directions by
gradient ascent on the very ratio each bound caps, a dopri8 solve at rtol 1e-12 (torchdiffeq), and float32
evaluations against float64 ones. A constant shrunk 1e6-fold is caught by the same comparisons.
"""
import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lipcheck import ViT
from lipcheck import wellposed as wp
from lipcheck.bounds import attention as ab
from lipcheck.bounds import attention_field as af
from lipcheck.bounds.lognorm import FieldConstants
from lipcheck.mixers.attention import DenseAttention
from lipcheck.models.vit import Block
from lipcheck.rounding import norm2_upper
from lipcheck.wellposed.attention_field import AttentionField, make_field
from conftest import block_field

pytestmark = pytest.mark.usefixtures("one_thread")

D = torch.float64


def attention_block(C=6, heads=2, seed=0, scale=0.6, mlp=True):
    torch.manual_seed(seed)
    blk = Block(C, heads, "attention", dtype=D, mlp_ratio=1.5, use_mlp=mlp).eval()
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(std=scale)
            p.requires_grad_(False)
    return blk


def math_layer(layer):
    """The same weights on the written-out softmax (nested forward mode does not pass the fused kernel)."""
    m = DenseAttention(layer.dim, layer.num_heads, backend="math", dtype=D)
    m.load_state_dict(layer.state_dict())
    return m.requires_grad_(False)


def second_derivative(f, Z, U, V):
    """D^2 f(Z)[U, V] by nested forward mode."""
    return torch.func.jvp(lambda z: torch.func.jvp(f, (z,), (U,))[1], (Z,), (V,))[1]


def in_ball(X, R):
    """Tokens of X mapped into the ball of radius R (a smooth parametrisation for the ascent)."""
    n = X.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return X / n * R * torch.tanh(n)


def worst_curvature(layer, R, N, *, seed=0, steps=40, starts=3):
    """The largest ratios ||D^2 A(Z)[U, V]|| / (max_j ||u_j|| ||V||) and ||D^2 A(Z)[U, U]|| / (sum_j ||u_j||^4)^(1/2)
    found by Adam ascent over Z in D_R (tokens on the boundary, peaked softmax included) and the directions."""
    m = math_layer(layer)
    C = layer.dim
    f = lambda z: m(z.reshape(1, 1, N, C)).reshape(N, C)  # noqa: E731
    g = torch.Generator().manual_seed(seed)
    best = [0.0, 0.0]
    for s in range(starts):
        X = (torch.randn(N, C, generator=g, dtype=D) * (1 + 3 * s)).requires_grad_()
        U = torch.randn(N, C, generator=g, dtype=D).requires_grad_()
        V = torch.randn(N, C, generator=g, dtype=D).requires_grad_()
        opt = torch.optim.Adam([X, U, V], lr=0.1)
        for _ in range(steps):
            Z = in_ball(X, R)
            ra = second_derivative(f, Z, U, V).norm() / (U.norm(dim=-1).max() * V.norm())
            rb = second_derivative(f, Z, U, U).norm() / (U.norm(dim=-1) ** 4).sum().sqrt()
            best = [max(best[0], float(ra.detach())), max(best[1], float(rb.detach()))]
            opt.zero_grad()
            (-(ra + rb)).backward()
            opt.step()
    return best


def jac_norm(f, x):
    J = torch.autograd.functional.jacobian(lambda z: f(z.reshape(x.shape)).reshape(-1), x.reshape(-1))
    return float(torch.linalg.matrix_norm(J, 2)), J


# --------------------------------------------------------------------------------------------- constants
def test_curvature_constant_formula_from_the_head_norms():
    """K2 is Lemma A2's sum over heads, re-evaluated here from the certified head norms, rounded up only slightly."""
    blk = attention_block(C=8, heads=2, seed=1)
    R, N = 3.0, 5
    nA, nB, nc, sd = ab._head_norms(blk.mixer)
    want = 0.0
    for a, b, c in zip(nA, nB, nc):
        w, k = a * R + c, 2 * a * R + c
        want += b * (2 * a * R / sd + 2 * a * R * R * k / sd ** 2
                     + math.sqrt(N) * (2 * k / sd + 2 * R * w * k / sd ** 2))
    K2 = af.attention_curvature_on_ball(blk.mixer, R, N)
    assert want <= K2 <= want * (1 + 1e-12)


@settings(max_examples=12, deadline=None)
@given(C=st.sampled_from([4, 6]), heads=st.sampled_from([1, 2]), N=st.integers(1, 5),
       scale=st.sampled_from([0.3, 1.0, 2.0]), R=st.sampled_from([0.5, 2.0, 6.0]), seed=st.integers(0, 50))
def test_curvature_constant_bounds_adversarial_second_derivatives(C, heads, N, scale, R, seed):
    blk = attention_block(C=C, heads=heads, seed=seed, scale=scale)
    K2 = af.attention_curvature_on_ball(blk.mixer, R, N)
    ra, rb = worst_curvature(blk.mixer, R, N, seed=seed, steps=15, starts=2)
    assert ra <= K2 and rb <= K2, (ra, rb, K2)


def test_curvature_ascent_reaches_a_visible_share_and_a_shrunk_constant_is_caught(monkeypatch):
    """The ascent is a real adversary: it finds second derivatives far above K2 * 1e-6, so a constant shrunk
    1e6-fold (monkeypatched where the field takes it) fails the very comparison the tests above make; and the
    shrunk field constant reaches the field's curvature."""
    blk = attention_block(C=6, heads=2, seed=3, scale=1.0)
    R = ab.layernorm_image_radius(blk.norm1)
    K2 = af.attention_curvature_on_ball(blk.mixer, R, 4)
    ra, rb = worst_curvature(blk.mixer, R, 4, seed=3)
    assert max(ra, rb) <= K2
    assert max(ra, rb) > 1e-3 * K2  # found: a shrunk constant would not survive
    true_M2 = AttentionField(blk, 2, 2).curvature(0.5)
    shrunk = af.attention_curvature_on_ball
    monkeypatch.setattr(af, "attention_curvature_on_ball", lambda *a, **k: shrunk(*a, **k) * 1e-6)
    small = AttentionField(blk, 2, 2)
    assert small.k.K2 == pytest.approx(K2 * 1e-6) and max(ra, rb) > small.k.K2
    assert small.curvature(0.5) < true_M2


def test_field_curvature_bounds_jacobian_differences_and_second_derivatives():
    """Lemma A3 at the field: ||J_F(x) - J_F(x')|| <= M2(v) max_i ||x_i - x'_i|| and ||D^2 F(x)[u, u]|| <=
    M2(v) (sum_i ||u_i||^4)^(1/2), v below every token variance on the segment; large pre-LN states included."""
    blk = attention_block(C=6, heads=2, seed=4, scale=0.8)
    H, W, C = 2, 2, 6
    f = AttentionField(blk, H, W)
    ml = math_layer(blk.mixer)
    F = block_field(blk, ml)  # LayerNorm written out: nested forward mode through the native one is wrong
    g = torch.Generator().manual_seed(4)
    worst = 0.0
    for scale in (0.2, 0.5, 1.0, 30.0):
        for _ in range(4):
            x = torch.randn(1, H, W, C, generator=g, dtype=D) * scale
            d = torch.randn(1, H, W, C, generator=g, dtype=D) * 0.05 * scale
            seg = torch.stack([x + t * d for t in torch.linspace(0, 1, 41, dtype=D)])
            v = float(seg.var(-1, unbiased=False).min()) * 0.999
            _, J0 = jac_norm(F, x)
            _, J1 = jac_norm(F, x + d)
            lhs = float(torch.linalg.matrix_norm(J1 - J0, 2))
            rhs = f.curvature(v) * float(d.norm(dim=-1).max())
            assert lhs <= rhs
            u = torch.randn(1, H, W, C, generator=g, dtype=D) * scale
            v0 = float(x.var(-1, unbiased=False).min()) * 0.999
            dd = float(second_derivative(F, x, u, u).norm())
            sq4 = float((u.norm(dim=-1) ** 4).sum().sqrt())
            assert dd <= f.curvature(v0) * sq4
            worst = max(worst, lhs / rhs, dd / (f.curvature(v0) * sq4))
    # random states are far from the worst case over the ball (the layer's own ascent above gets much closer),
    # but a field constant shrunk 1e6-fold already fails here
    assert worst > 1e-6


def test_lipschitz_constants_bound_autograd_jacobians():
    """||J_Attn(Z)|| <= Lip(Attn | D_R) at states on the ball's boundary, ||J_F(x)|| <= lipschitz(v) at pre-LN states
    of any size (v their least token variance)."""
    blk = attention_block(C=6, heads=2, seed=5, scale=1.0)
    f = AttentionField(blk, 2, 2)
    g = torch.Generator().manual_seed(5)
    ml = math_layer(blk.mixer)
    for _ in range(5):
        Z = in_ball(torch.randn(1, 2, 2, 6, generator=g, dtype=D) * 4, f.k.R)
        nrm, _ = jac_norm(ml, Z)
        assert nrm <= f.k.T_norm
    for scale in (0.3, 1.0, 100.0):
        x = torch.randn(1, 2, 2, 6, generator=g, dtype=D) * scale
        nrm, _ = jac_norm(blk.vector_field, x)
        assert nrm <= f.lipschitz(float(x.var(-1, unbiased=False).min()))


def test_closed_form_jacobian_and_dense_lognorm_against_autograd():
    blk = attention_block(C=6, heads=3, seed=6, scale=0.7)
    f = AttentionField(blk, 2, 3)
    assert f.lognorm_kind == "dense" and f.uses_variance
    y = torch.randn(3, 2, 3, 6, generator=torch.Generator().manual_seed(6), dtype=D) * 2
    J, err = f.jacobian(y)
    v = float(y.var(-1, unbiased=False).min())
    mu = f.lognorm(y, v, 0.0)
    mu_s = AttentionField(blk, 2, 3, lognorm="structured").lognorm(y, v, 0.0)
    for b in range(3):
        _, Jr = jac_norm(blk.vector_field, y[b:b + 1])
        assert float((Jr - J[b]).abs().max()) <= 1e-13 * float(Jr.abs().max())
        assert float(torch.linalg.matrix_norm(Jr - J[b])) <= float(err[b])
        ref = float(np.linalg.eigvalsh(((Jr + Jr.T) / 2).numpy()).max())
        assert ref <= float(mu[b]) <= ref + 1e-6 * (1 + abs(ref)) and float(mu[b]) <= float(mu_s[b])
    f.reset()
    assert f._dense.vec is None and f._cache == {}


def test_rounding_bounds_dominate_float32_errors():
    """eps_F, eps_J evaluated for float32 bound the float32 evaluation's distance from float64 (same weights,
    exactly representable in both), at moderate and badly scaled states."""
    b64 = attention_block(C=8, heads=2, seed=7, scale=0.5)
    with torch.no_grad():
        for p in b64.parameters():
            p.copy_(p.float().double())
    b32 = attention_block(C=8, heads=2, seed=7, scale=0.5).float()
    with torch.no_grad():
        for p, q in zip(b32.parameters(), b64.parameters()):
            p.copy_(q.float())
    H, W, C = 2, 3, 8
    f64 = AttentionField(b64, H, W)
    f32 = AttentionField(b32, H, W, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    y = torch.randn(4, H, W, C, generator=g, dtype=D)
    y[1] *= 50.0
    y[2] += 3.0  # a large mean: LayerNorm's centring amplifies the rounding
    y32 = y.float()
    v = float(y32.double().var(-1, unbiased=False).min()) * 0.999
    eps_F, eps_J = f64.rounding(y32, v)
    with torch.no_grad():
        errF = (b32.vector_field(y32).double() - b64.vector_field(y32.double())).flatten(1).norm(dim=-1)
    assert (errF <= eps_F.double()).all() and float(errF.max()) > 0
    J32, _ = f32.jacobian(y32)
    J64, err64 = f64.jacobian(y32.double())
    w = torch.randn(4, J64.shape[-1], generator=g, dtype=D)
    errJ = ((J32.double() - J64) @ w[..., None])[..., 0].norm(dim=-1) / w.norm(dim=-1)
    assert (errJ <= eps_J).all() and float(errJ.max()) > 0
    assert (err64 < 1e-6).all()  # float64's forming allowance is small against any log-norm


def test_rounding_of_float64_against_exact_rationals_of_the_float32_weights():
    """float64's eps_F against a 40-digit evaluation (mpmath) of the same field on one small state."""
    mpmath = pytest.importorskip("mpmath")
    blk = attention_block(C=4, heads=2, seed=8, scale=0.8)
    f = AttentionField(blk, 1, 3)
    y = torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(8), dtype=D) * 3
    eps_F, _ = f.rounding(y, float(y.var(-1, unbiased=False).min()) * 0.999)
    mpmath.mp.dps = 40
    ref = _mp_field(blk, y[0, 0], mpmath)
    got = blk.vector_field(y)[0, 0]
    err = math.sqrt(sum((float(ref[i][c] - mpmath.mpf(float(got[i, c])))) ** 2 for i in range(3) for c in range(4)))
    assert 0 <= err <= float(eps_F[0])


def _mp_field(blk, x, mp):
    """F(x) for tokens x (N, C) in mpmath: LayerNorm, softmax attention, exact GELU, written out here."""
    M = lambda t: [[mp.mpf(float(a)) for a in row] for row in t.tolist()]  # noqa: E731
    vec = lambda t: [mp.mpf(float(a)) for a in t.tolist()]  # noqa: E731
    N, C = x.shape
    X = M(x)

    def ln(norm, row):
        m = sum(row) / C
        var = sum((a - m) ** 2 for a in row) / C
        s = mp.sqrt(var + mp.mpf(norm.eps))
        return [(a - m) / s * g + b for a, g, b in zip(row, vec(norm.weight), vec(norm.bias))]

    def lin(layer, row):
        Wt, b = M(layer.weight), vec(layer.bias)
        return [sum(Wt[o][i] * row[i] for i in range(len(row))) + b[o] for o in range(len(b))]

    at = blk.mixer
    Z = [ln(blk.norm1, r) for r in X]
    Q, K, V = ([lin(p, r) for r in Z] for p in (at.q_proj, at.k_proj, at.v_proj))
    d, h = at.head_dim, at.num_heads
    out = [[mp.mpf(0)] * C for _ in range(N)]
    for hh in range(h):
        sl = slice(hh * d, (hh + 1) * d)
        for i in range(N):
            s = [sum(a * b for a, b in zip(Q[i][sl], K[j][sl])) / mp.sqrt(d) for j in range(N)]
            e = [mp.exp(t - max(s)) for t in s]
            p = [t / sum(e) for t in e]
            for c in range(d):
                out[i][hh * d + c] = sum(p[j] * V[j][sl][c] for j in range(N))
    A = [lin(at.o_proj, r) for r in out]
    gelu = lambda t: t * (1 + mp.erf(t / mp.sqrt(2))) / 2  # noqa: E731
    Mlp = [lin(blk.mlp.fc2, [gelu(t) for t in lin(blk.mlp.fc1, ln(blk.norm2, r))]) for r in X]
    return [[A[i][c] + Mlp[i][c] for c in range(C)] for i in range(N)]


# --------------------------------------------------------------------------------------------- the field
def test_make_field_picks_by_mixer_and_refuses_others():
    from conftest import random_block
    assert isinstance(make_field(attention_block(), 2, 2), AttentionField)
    assert make_field(attention_block(), 2, 2, lognorm="structured").lognorm_kind == "structured"  # settings reach it
    assert isinstance(make_field(random_block(6), 2, 2), wp.SSoGField)
    blk = attention_block()
    blk.mixer = torch.nn.Identity()
    with pytest.raises(TypeError, match="Identity"):
        make_field(blk, 2, 2)
    with pytest.raises(wp.EnclosureError, match="lognorm"):
        AttentionField(attention_block(), 2, 2, lognorm="exact")
    no_ln = Block(6, 2, "attention", dtype=D, use_norm=False).eval()
    with pytest.raises(ValueError, match="LayerNorm"):
        make_field(no_ln, 2, 2)


def _tiny_attention_ode(seed=0):
    torch.manual_seed(seed)
    return ViT("ode", "attention", dtype=D, img_size=8, patch_size=4, dim=6, num_heads=2, depth=1, num_classes=3,
               mlp_ratio=2.0).eval()


def test_attention_ode_enclosure_contains_a_tight_solution():
    """End to end: `enclose` on a tiny attention ODE ViT proves both images, and an independent dopri8 solve at
    rtol 1e-12 lies inside the radius at every returned time (not vacuously: the radius is within 1e4 of it)."""
    import torchdiffeq
    model = _tiny_attention_ode()
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=D)
    enc = wp.enclose(model, images, tol=1e-4, progress=False)
    assert enc.proven.all(), enc.reason
    assert enc.stats["curvature_max"] > 0 and enc.stats["lognorm"] == "dense"
    blk = model.vector_field.block
    with torch.no_grad():
        truth = torchdiffeq.odeint(lambda t, x: blk.vector_field(x), model.embed(images), enc.t, method="dopri8",
                                   rtol=1e-12, atol=1e-12)
    err = (truth - enc.center).flatten(2).norm(dim=-1)
    assert (err <= enc.radius).all(), (err / enc.radius).max()
    assert float((err[1:] / enc.radius[1:]).max()) > 1e-4


def test_too_small_curvature_is_not_a_proof(monkeypatch):
    """With the field's curvature shrunk 1e6-fold the tube's log-norm falls below the log-norm the field really
    has somewhere in the tube: the bound mu_bar computed from the shrunk constant is refuted by a point log-norm
    taken inside the tube, while the true constant's bound holds there."""
    from lipcheck.wellposed.recurrence import _mu_bar
    model = _tiny_attention_ode(seed=2)
    block, x0, _ = wp.prepare(model, torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(2), dtype=D))
    f = AttentionField(block, 2, 2)
    std = float(x0.var(-1, unbiased=False).min().sqrt()) * (1 - 1e-9)
    lam0 = float(f.lognorm(x0, 0.0, 0.0)[0])
    g = torch.Generator().manual_seed(3)
    far = max((x0 + 0.05 * std * torch.randn(x0.shape, generator=g, dtype=D) for _ in range(20)),
              key=lambda z: float(f.lognorm(z, 0.0, 0.0)[0]))
    reach = float((far - x0).norm(dim=-1).max())
    lam_far = float(f.lognorm(far, 0.0, 0.0)[0])
    mu_true, _ = _mu_bar(f, lam0, std, 0.0, reach, 6)
    assert lam_far <= mu_true
    monkeypatch.setattr(f.k, "K2", f.k.K2 * 1e-6)
    monkeypatch.setattr(f, "curvature", lambda v: AttentionField.curvature(f, v) * 1e-6)
    mu_small, _ = _mu_bar(f, lam0, std, 0.0, reach, 6)
    assert mu_small < lam_far  # a shrunk constant claims a tube log-norm the field exceeds


# --------------------------------------------------------------------------------------------- Lemmas A3, A4 as written
U = 2.0 ** -53  # float64's unit roundoff


def _gamma(n, u=U):
    return n * u / (1 - n * u)


def _head_slices(layer):
    """Per head (|| |W_Q^h| ||, ||b_Q^h||, ... for Q, K, V, O) from the Linear layers' own rows and columns."""
    d = layer.head_dim
    op = lambda w: float(norm2_upper(w.detach().double().abs()))  # noqa: E731  (a certified norm of |W|)
    out = []
    for h in range(layer.num_heads):
        rows = slice(h * d, (h + 1) * d)
        q, k, v = (op(getattr(layer, p).weight[rows]) for p in ("q_proj", "k_proj", "v_proj"))
        bq, bk, bv = (float(getattr(layer, p).bias[rows].double().norm()) for p in ("q_proj", "k_proj", "v_proj"))
        out.append((q, k, v, op(layer.o_proj.weight[:, rows]), bq, bk, bv))
    return out


def test_rounding_magnitudes_are_lemma_a4_on_the_absolute_weights():
    """out', score' and |J|' re-evaluated from the absolute weights of each head's rows (Lemma A4 and S4's
    Lipschitz formula on |W|), rounded up by no more than 1 + 2 gamma_{64 h + 8}."""
    blk = attention_block(C=8, heads=2, seed=9, scale=0.7)
    layer, N = blk.mixer, 5
    R = ab.layernorm_image_radius(blk.norm1)
    assert R > 1  # R^2 and R differ
    sd = math.sqrt(layer.head_dim)
    out, score, jac = float(layer.o_proj.bias.double().norm()), 0.0, 0.0
    for q, k, v, o, bq, bk, bv in _head_slices(layer):
        out += o * (v * R + bv)
        score = max(score, (q * R + bq) * (k * R + bk) / sd)
        jac += v * o * (math.sqrt(N) + R * R * q * k / sd + math.sqrt(N) * R * (R * q * k + bq * k) / sd)
    got = af.rounding_magnitudes(layer, R, N)
    slack = 1 + 2 * _gamma(64 * layer.num_heads + 8)
    for key, want in (("out", out), ("score", score), ("jacobian", jac)):
        assert want <= got[key] <= want * slack, (key, got[key], want)


def test_a_magnitude_past_float64_is_refused_by_name():
    """Weights of 1e100: out' and score' (1e200) are finite, |J|' (their product, 1e400) is not; W_Q, W_K of 1e200
    alone: score' (1e400) is not, out' is. Each refused, naming the bound that overflows."""
    for scaled, what in ((("q_proj", "k_proj", "v_proj", "o_proj"), "the attention Jacobian magnitude bound"),
                         (("q_proj", "k_proj"), "the score magnitude bound")):
        blk = attention_block(C=4, heads=1, seed=10)
        with torch.no_grad():
            for p in scaled:
                getattr(blk.mixer, p).weight.mul_(1e100 if len(scaled) == 4 else 1e200)
        with pytest.raises(ValueError, match=what):
            af.rounding_magnitudes(blk.mixer, 2.0, 3)


def test_softmax_score_error_covers_perturbed_scores_and_is_inf_past_half():
    """theta = (a + b + a b)(1 + gamma_4), a = 2 delta e^{2 delta}, b = gamma_{N+8}, delta = gamma_K score (the two
    relative errors composed); scores moved by up to delta (the worst case: one up, the rest down) move every weight
    by less than a; no bound once 2 delta >= 1."""
    K, N = 200, 6
    g = torch.Generator().manual_seed(11)
    for score in (1.0, 1e10, 0.2 / _gamma(K), 0.49 / _gamma(K)):
        delta = _gamma(K) * score
        theta = af.softmax_score_error(score, K, N)
        a, b = 2 * delta * math.exp(2 * delta), _gamma(N + 8)
        assert theta >= a + b + a * b and theta == pytest.approx((a + b + a * b) * (1 + _gamma(4)), rel=1e-14)
        s = torch.randn(N, generator=g, dtype=D)
        for j in range(N):
            moved = s - delta
            moved[j] = s[j] + delta
            rel = (torch.softmax(moved, 0) / torch.softmax(s, 0) - 1).abs().max()
            assert float(rel) <= 2 * delta * math.exp(2 * delta) * (1 + 1e-12) + 1e-14
    for score in (0.5 / _gamma(K), 0.75 / _gamma(K), math.inf):
        assert af.softmax_score_error(score, K, N) == math.inf


def test_field_constants_are_lemma_a3_with_ln1s_jacobian():
    """curvature(v) = (the SSoG-form terms + K2 l1(v)^2)(1 + gamma_8), lipschitz(v) = (the same form)(1 + gamma_4),
    with l1(v) = max|gamma_1| / sqrt(v + eps_1) LN1's Jacobian bound (computed here from norm1: its gain is made
    10x LN2's so LN2's would not do); rho1 and R are LN1's image radius sqrt(C) max|gamma_1| + ||beta_1||, which
    holds every LN1 token."""
    blk = attention_block(C=6, heads=2, seed=12, scale=0.8)
    with torch.no_grad():
        blk.norm1.weight.copy_(torch.linspace(-3.0, 2.0, 6, dtype=D))
        blk.norm2.weight.copy_(torch.linspace(-0.3, 0.2, 6, dtype=D))
    k = af.attention_field_constants(blk, 2, 2)
    n1 = blk.norm1
    radius = math.sqrt(6) * 3.0 + float(n1.bias.norm())
    assert k.rho1 == k.R and radius <= k.R <= radius * (1 + _gamma(10))
    x = torch.randn(50, 6, generator=torch.Generator().manual_seed(12), dtype=D) * 100 + 7
    assert float(n1(x).norm(dim=-1).max()) <= k.R
    for v in (0.01, 0.5, 4.0):
        l1 = 3.0 / math.sqrt(v + n1.eps)
        base = lognorm_constants(k)
        want = base.curvature(v) + k.K2 * l1 * l1
        assert want <= k.curvature(v) <= want * (1 + _gamma(8)) * (1 + 4 * U)
        assert base.lipschitz(v) <= k.lipschitz(v) <= base.lipschitz(v) * (1 + _gamma(4)) * (1 + U)


def lognorm_constants(k):
    """The same numbers as a plain `FieldConstants` (the SSoG-form terms, Lipschitz constant T_norm = L_A)."""
    return FieldConstants(**{f.name: getattr(k, f.name) for f in dataclasses.fields(FieldConstants)})


def test_attention_rounding_is_lemma_a4_and_inf_off_the_ball():
    """eps_F, eps_J as Lemma A4 writes them, from the field's constants on R' = R (1 + 2^-10) and the state's
    amplification; where a float LN1 token may leave D_R' (a mean 1e4 times the spread in float32) both are inf."""
    blk = attention_block(C=6, heads=2, seed=13, scale=0.6)
    H, W, N = 1, 3, 3
    f = AttentionField(blk, H, W)
    k, mixer = f.k, blk.mixer
    R1 = k.R * (1 + 2.0 ** -10)
    assert f._mag == af.rounding_magnitudes(mixer, R1, N)
    assert f._L_float == ab.attention_lipschitz_on_ball(mixer, R1, N)
    assert f._K2_float == af.attention_curvature_on_ball(mixer, R1, N)
    y = torch.randn(2, H, W, 6, generator=torch.Generator().manual_seed(13), dtype=D)
    y[1] *= 3.0
    v = float(y.var(-1, unbiased=False).min()) * 0.999
    eps_F, eps_J = f.rounding(y, v)
    Kn = 2 * (6 + k.hidden + N + mixer.head_dim) + 64
    gK = _gamma(Kn)
    amp = (y.norm(dim=-1) / (math.sqrt(6) * y.var(-1, unbiased=False).sqrt())).flatten(1).amax(1)
    e_ln = 4 * gK * (2 + amp)
    theta = af.softmax_score_error(f._mag["score"], Kn, N)
    mlp = k.W2_abs * k.gelu1 * k.W1_abs
    l1, l2 = k.ln_jacobian(1, v), k.ln_jacobian(2, v)
    want_F = math.sqrt(N) * (e_ln * (f._L_float * k.R + mlp * k.rho2 + k.bias_norm) + (4 * gK + theta) * f._mag["out"])
    e = float(e_ln.max())
    want_J = (2 * e * (f._mag["jacobian"] * l1 + f._L_float * l1 + mlp * l2) + 3 * theta * f._mag["jacobian"] * l1
              + e * k.R * f._K2_float * l1)
    assert torch.allclose(eps_F, want_F * (1 + _gamma(8)), rtol=1e-13, atol=0)
    assert eps_J == pytest.approx(want_J * (1 + _gamma(8)), rel=1e-13)
    far = (y[:1] + 1e4).float()
    inf_F, inf_J = f.rounding(far, float(far.double().var(-1, unbiased=False).min()) * 0.999)
    assert inf_F.shape == (1,) and torch.isinf(inf_F).all() and inf_J == math.inf


def test_constants_are_formed_in_the_requested_dtype_and_reported():
    """dtype=float32: K2 and |J|' are those of the head products formed in float32 (their rounding covered, so a
    true bound in either dtype, and visibly not float64's here); the field reports its constants as they are."""
    blk = attention_block(C=6, heads=2, seed=14, scale=0.7)
    R = ab.layernorm_image_radius(blk.norm1)
    k = af.attention_field_constants(blk, 2, 2, dtype=torch.float32)
    for dt, same in ((torch.float32, True), (torch.float64, False)):
        K2 = af.attention_curvature_on_ball(blk.mixer, R, 4, dtype=dt)
        mag = af.rounding_magnitudes(blk.mixer, R, 4, dtype=dt)
        assert (k.K2 == K2, k.T_abs == mag["jacobian"]) == (same, same)
    f, v = AttentionField(blk, 2, 2), 0.4
    assert f.constants(v) == {"mixer": "attention", "mixer_lipschitz": f.k.T_norm, "mixer_curvature": f.k.K2,
                              "token_radius": f.k.R, "lipschitz": f.lipschitz(v), "curvature": f.curvature(v)}
