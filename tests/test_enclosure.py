"""lipcheck.wellposed.enclose: the proven tube around a computed trajectory (proofs/S5.md, Theorem 5).

Checked against solutions computed independently inside the tests: the matrix exponential (scipy) for
x' = A x, and mpmath's high-precision Taylor solver (odefun, 20 digits) for a small tanh neural ODE.
Failures must be reported as failures (not proven, with a reason), never as a radius.
"""
import dataclasses
import math

import mpmath
import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lipcheck import wellposed as wp
from lipcheck.bounds import lognorm as ln
from conftest import random_block

D = torch.float64
U = 2.0 ** -53


class LinearField:
    """x' = A x on states (B, 1, 1, n): curvature 0, log-norm lambda_max((A + A^T)/2)."""
    uses_variance = False

    def __init__(self, A):
        self.A = torch.as_tensor(A, dtype=D)
        self.n = self.A.shape[0]

    def __call__(self, x):
        return (x.reshape(x.shape[0], -1) @ self.A.T).reshape(x.shape)

    def lipschitz(self, v):
        return float(np.linalg.norm(self.A.numpy(), 2)) * (1 + 1e-12)

    def curvature(self, v):
        return 0.0

    def rounding(self, y, v):
        g = ln.gamma(self.n + 2)
        yy = y.reshape(y.shape[0], -1).abs()
        return g * (yy @ self.A.abs().T).norm(dim=-1) * 2, g * float(self.A.abs().norm()) * 2

    def jacobian(self, y):
        return self.A.expand(y.shape[0], self.n, self.n), torch.zeros(y.shape[0], dtype=D)

    def lognorm(self, y, v, eps_J):
        S = (self.A + self.A.T) / 2
        return ln.verified_lambda_max(S).expand(y.shape[0]) + eps_J


class TanhField:
    """x' = W2 tanh(W1 x + b): a small neural ODE; sup|tanh'| = 1, sup|tanh''| = 4 / (3 sqrt 3)."""
    uses_variance = False

    def __init__(self, n, hidden, seed=0, scale=1.0):
        g = torch.Generator().manual_seed(seed)
        self.W1 = torch.randn(hidden, n, generator=g, dtype=D) * scale / math.sqrt(n)
        self.W2 = torch.randn(n, hidden, generator=g, dtype=D) * scale / math.sqrt(hidden)
        self.b = torch.randn(hidden, generator=g, dtype=D) * 0.1
        self.n, self.hidden = n, hidden
        self.n1 = float(np.linalg.norm(self.W1.numpy(), 2)) * (1 + 1e-12)
        self.n2 = float(np.linalg.norm(self.W2.numpy(), 2)) * (1 + 1e-12)

    def __call__(self, x):
        z = x.reshape(x.shape[0], -1) @ self.W1.T + self.b
        return (torch.tanh(z) @ self.W2.T).reshape(x.shape)

    def lipschitz(self, v):
        return self.n2 * self.n1

    def curvature(self, v):
        return self.n2 * (4 / (3 * math.sqrt(3))) * self.n1 ** 2 * (1 + 1e-12)

    def rounding(self, y, v):
        g = ln.gamma(2 * (self.n + self.hidden) + 16)
        yy = y.reshape(y.shape[0], -1).abs()
        mag = ((yy @ self.W1.abs().T + self.b.abs()) @ self.W2.abs().T).norm(dim=-1) + float(self.W2.abs().sum())
        return g * mag * 4, g * float(self.W2.abs().norm() * self.W1.abs().norm()) * 4

    def jacobian(self, y):
        z = y.reshape(y.shape[0], -1) @ self.W1.T + self.b
        J = (self.W2 * (1 - torch.tanh(z) ** 2)[:, None, :]) @ self.W1
        return J, torch.full((y.shape[0],), ln.gamma(self.hidden + 8) * float(self.W2.abs().norm() * self.W1.abs().norm()) * 4, dtype=D)

    def lognorm(self, y, v, eps_J):
        J, err = self.jacobian(y)
        return ln.verified_lambda_max((J + J.transpose(-1, -2)) / 2) + err + eps_J


def _linear_case(seed=0, n=6):
    g = np.random.default_rng(seed)
    A = g.standard_normal((n, n)) / math.sqrt(n) - 0.3 * np.eye(n)
    x0 = torch.tensor(g.standard_normal((2, 1, 1, n)), dtype=D)
    return A, x0


def _expm_solution(A, x0, t):
    return np.stack([np.einsum("ij,bj->bi", scipy.linalg.expm(float(s) * A), x0.reshape(x0.shape[0], -1).numpy())
                     for s in t])


def test_linear_enclosure_contains_expm_and_is_tight():
    A, x0 = _linear_case()
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6)
    assert enc.proven.all(), enc.reason
    assert float(enc.t[-1]) == 1.0
    exact = _expm_solution(A, x0, enc.t.tolist())  # (K, B, n)
    err = np.linalg.norm(exact - enc.center.reshape(len(enc.t), 2, -1).numpy(), axis=-1)
    assert (err <= enc.radius.numpy()).all()
    # tight: at t1 within a factor 50 of the actual error of this solve (the stated factor)
    ratio = enc.radius[-1].numpy() / err[-1]
    assert (ratio < 50).all(), ratio
    # the point bound at t1 holds expm too, and sits no higher than the last interval's sup
    assert (err[-1] <= enc.radius_t1.numpy()).all() and (enc.radius_t1 <= enc.radius[-1]).all()
    direct = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, ref_tol=None)
    err_d = np.linalg.norm(exact[-1] - direct.center[-1].reshape(2, -1).numpy(), axis=-1)
    assert (err_d <= direct.radius_t1.numpy()).all() and (direct.radius_t1 <= direct.radius[-1]).all()


def test_linear_lognorm_envelope_is_the_known_bound():
    A, x0 = _linear_case(1)
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6)
    mu = float(np.linalg.eigvalsh((A + A.T) / 2).max())
    G = wp.lognorm_envelope(enc, 1e-3)
    known = np.exp(mu * enc.t.numpy())
    # curvature 0: the envelope is exp(mu t) up to the verification margins (1e-3 relative on the log-norm)
    assert np.allclose(G[:, 0].numpy(), known, rtol=2e-3)
    assert (G[:, 0].numpy() >= known * (1 - 1e-12)).all()
    # and it bounds the true growth ||expm(tA)||_2 (which it equals for normal A only)
    growth = np.array([np.linalg.norm(scipy.linalg.expm(s * A), 2) for s in enc.t.tolist()])
    assert (growth <= G[:, 0].numpy() * (1 + 1e-12)).all()


def test_too_small_tube_is_reported_not_a_radius():
    A, x0 = _linear_case()
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, tube=1e-14)
    assert not enc.proven.any()
    assert all("tube" in r for r in enc.reason)
    assert torch.isinf(enc.radius[-1]).all()


def test_too_small_lognorm_claim_is_refuted():
    A, x0 = _linear_case()
    mu = float(np.linalg.eigvalsh((A + A.T) / 2).max())
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, mu_claim=mu - 0.05)
    assert not enc.proven.any() and all("log-norm" in r for r in enc.reason)
    assert torch.isinf(enc.radius[-1]).all()
    ok = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, mu_claim=mu + 0.05)
    assert ok.proven.all()


def test_inflated_defect_fails_under_a_tube_cap_and_stays_valid_without():
    A, x0 = _linear_case()
    wrong = LinearField(A + 0.5 * np.eye(A.shape[0]))  # the solver integrates a different field: large defect
    capped = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, solver_field=wrong, max_tube=1e-3)
    assert not capped.proven.any() and all("tube" in r for r in capped.reason)
    free = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, solver_field=wrong)
    assert free.proven.all()
    exact = _expm_solution(A, x0, free.t.tolist())
    err = np.linalg.norm(exact - free.center.reshape(len(free.t), 2, -1).numpy(), axis=-1)
    assert (err <= free.radius.numpy()).all() and (err[-1] > 1e-2).all()


def test_bad_input_is_a_typed_error():
    A, x0 = _linear_case()
    with pytest.raises(wp.EnclosureError, match="t1"):
        wp.enclose_field(LinearField(A), x0, 0.0)
    with pytest.raises(wp.EnclosureError, match="t1"):
        wp.enclose_field(LinearField(A), x0, -1.0)
    bad = x0.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(wp.EnclosureError, match="finite"):
        wp.enclose_field(LinearField(A), bad, 1.0)
    with pytest.raises(wp.EnclosureError, match="tube"):
        wp.enclose_field(LinearField(A), x0, 1.0, tube=-1.0)


def test_mpmath_taylor_solution_lies_inside_the_enclosure():
    """Independent validated reference: mpmath.odefun (Taylor series, 20 digits) on an 8-dimensional neural ODE."""
    f = TanhField(8, 8, seed=3, scale=1.5)
    x0 = torch.randn(1, 1, 1, 8, generator=torch.Generator().manual_seed(4), dtype=D)
    enc = wp.enclose_field(f, x0, 1.0, tol=1e-7)
    assert enc.proven.all(), enc.reason
    mpmath.mp.dps = 20
    W1 = [[mpmath.mpf(float(v)) for v in row] for row in f.W1.tolist()]
    W2 = [[mpmath.mpf(float(v)) for v in row] for row in f.W2.tolist()]
    b = [mpmath.mpf(float(v)) for v in f.b.tolist()]

    def F(t, x):
        z = [mpmath.tanh(sum(W1[i][j] * x[j] for j in range(8)) + b[i]) for i in range(8)]
        return [sum(W2[i][j] * z[j] for j in range(8)) for i in range(8)]

    sol = mpmath.odefun(F, 0, [mpmath.mpf(float(v)) for v in x0.flatten().tolist()])
    ts = enc.t.tolist()[:: max(1, len(enc.t) // 6)] + [1.0]
    worst = 0.0
    for s in ts:
        k = int(np.argmin(np.abs(enc.t.numpy() - s)))
        xs = np.array([float(v) for v in sol(mpmath.mpf(enc.t[k].item()))])
        d = float(np.linalg.norm(xs - enc.center[k, 0].flatten().numpy()))
        assert d <= float(enc.radius[k, 0]), (s, d, float(enc.radius[k, 0]))
        worst = max(worst, d / float(enc.radius[k, 0]))
    assert worst > 1e-4  # the radius is not absurdly loose at every sampled time


def test_lognorm_lemmas_against_autograd():
    """Lemma 1 (LayerNorm curvature), Lemma 2 (Jacobian variation) and the closed-form Jacobian on a small block."""
    from lipcheck.models.vit import Block
    torch.manual_seed(0)
    blk = Block(16, 2, "ssog", dtype=D).eval()
    for p in blk.parameters():
        p.requires_grad_(False)
    y = torch.randn(1, 3, 3, 16, dtype=D)
    # closed form J = T D1 + D2 against forward-mode autograd
    dl = ln.DenseLogNorm(blk, 3, 3)
    J, err = dl.jacobian(y)
    Jref = ln.dense_jacobian(blk, y[0])
    assert torch.allclose(J[0], Jref, atol=1e-12, rtol=0)
    S = (Jref + Jref.T) / 2
    lam = float(np.linalg.eigvalsh(S.numpy()).max())
    got = float(dl(y, 0.0)[0])
    assert lam <= got <= lam + 1e-9 + 1e-3 * (1 + abs(lam))
    k = ln.field_constants(blk, 3, 3)
    v = float(y.var(-1, unbiased=False).min())
    # LayerNorm second derivative along random directions, by finite differences of the Jacobian-vector product
    norm = blk.norm1
    for _ in range(5):
        x = y[0, 0, 0] * 0.5 + 0.1 * torch.randn(16, dtype=D)
        u = torch.randn(16, dtype=D)
        vx = float(x.var(unbiased=False))
        h = 1e-4
        jp = torch.func.jvp(norm, (x + h * u,), (u,))[1]
        jm = torch.func.jvp(norm, (x - h * u,), (u,))[1]
        d2 = float(((jp - jm) / (2 * h)).norm())
        assert d2 <= k.ln_curvature(1, vx * 0.999) * float(u.norm()) ** 2
    # Lemma 2: ||J(z) - J(w)|| <= M2 max_i ||z_i - w_i|| on a nearby pair (the variance floor holds on [z, w])
    w = y + 0.01 * torch.randn_like(y)
    vmin = min(v, float(w.var(-1, unbiased=False).min())) * 0.9
    Jw = ln.dense_jacobian(blk, w[0])
    lhs = float(torch.linalg.matrix_norm(Jref - Jw, 2))
    rhs = k.curvature(vmin) * float((y - w).norm(dim=-1).max())
    assert lhs <= rhs


def test_verified_lambda_max_is_an_upper_bound_and_close():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(5, 40, 40, generator=g, dtype=D)
    S = (A + A.transpose(-1, -2)) / 2
    got = ln.verified_lambda_max(S)
    ref = np.linalg.eigvalsh(S.numpy()).max(-1)
    assert (got.numpy() >= ref).all() and (got.numpy() <= ref + 1e-9 * np.abs(ref) + 1e-9).all()
    # a guess below the top eigenvalue must not be certified
    low = torch.tensor(ref - 0.1, dtype=D)
    ok, _ = ln._cholesky_certifies(S, low, U)
    assert not ok.any()


# ------------------------------------------------------------------ field constants against independent values

def _block(C=8, heads=2, seed=0, use_mlp=True, **kw):
    return random_block(C, heads, seed, use_mlp, dtype=D, **kw)


def _gelu1_sup():
    z = torch.linspace(-6, 6, 200001, dtype=D)
    return float((torch.special.ndtr(z) + z * torch.exp(-z * z / 2) / math.sqrt(2 * math.pi)).max())


def test_field_constants_match_independent_norms():
    """Every constant against an SVD / norm taken in the test; LN1 and LN2 differ so that which-LN mix-ups show."""
    blk = _block()
    with torch.no_grad():
        blk.norm1.weight.copy_(torch.linspace(-2.0, 1.0, 8, dtype=D))
        blk.norm2.weight.copy_(torch.linspace(0.1, 0.5, 8, dtype=D))
    blk.norm1.eps, blk.norm2.eps = 1e-6, 0.3
    H, W, C = 2, 3, 8
    k = ln.field_constants(blk, H, W)
    w1, w2 = blk.mlp.fc1.weight, blk.mlp.fc2.weight
    sv = lambda m: float(np.linalg.norm(m.numpy(), 2))
    close = lambda a, b: abs(a - b) <= 1e-12 * (1 + abs(b))
    assert (k.C, k.N, k.hidden) == (C, H * W, w1.shape[0])
    assert close(k.W1, sv(w1)) and close(k.W2, sv(w2)) and close(k.W1_abs, sv(w1.abs())) and close(k.W2_abs, sv(w2.abs()))
    assert k.W1 >= sv(w1) and k.W2_abs >= sv(w2.abs())  # rounded up, never down
    assert (k.g1, k.g2, k.eps1, k.eps2) == (2.0, 0.5, 1e-6, 0.3)
    assert abs(k.gelu1 - _gelu1_sup()) < 1e-9
    bias = float(blk.mixer.o_proj.bias.norm()) + float(blk.mlp.fc2.bias.norm()) + sv(w2.abs()) * float(blk.mlp.fc1.bias.norm())
    assert close(k.bias_norm, bias)
    assert close(k.rho1, math.sqrt(C) * 2.0 + float(blk.norm1.bias.norm()))
    assert close(k.rho2, math.sqrt(C) * 0.5 + float(blk.norm2.bias.norm()))
    # ||T||: the dense operator built here from the kernels and projections, its exact largest singular value
    layer = blk.mixer
    K = layer.operator_matrix(H, W).detach()
    P = layer.head_projections().detach()
    T = sum(torch.kron(K[h].contiguous(), P[h].T.contiguous()) for h in range(layer.num_heads)).numpy()
    sT = float(np.linalg.norm(T, 2))
    assert sT * (1 - 1e-12) <= k.T_norm <= sT * (1 + 1e-6) + 1e-12
    v = 0.05
    l1, l2 = 2.0 / math.sqrt(v + 1e-6), 0.5 / math.sqrt(v + 0.3)
    assert close(k.ln_jacobian(1, v), l1) and close(k.ln_jacobian(2, v), l2)
    c = 2 / math.sqrt(3)  # Lemma 1's sharp constant
    c1, c2 = c * 2.0 / (math.sqrt(C) * (v + 1e-6)), c * 0.5 / (math.sqrt(C) * (v + 0.3))
    assert close(k.ln_curvature(1, v), c1) and close(k.ln_curvature(2, v), c2)
    mlp = k.W2 * k.gelu1 * k.W1
    assert close(k.lipschitz(v), k.T_norm * l1 + mlp * l2)
    rows = float(np.linalg.norm(w1.numpy(), axis=1).max())  # the largest row norm of W1, taken here
    assert close(k.W1_row, rows) and k.W1_row >= rows and k.W1_row < k.W1
    assert close(k.curvature(v), k.T_norm * c1 + mlp * c2 + k.W2 * math.sqrt(2 / math.pi) * k.W1 * rows * l2 * l2)
    # and the Lipschitz constant bounds the exact Jacobian norm at states of token variance >= v
    f = lambda z: blk.vector_field(z.reshape(1, H, W, C)).reshape(-1)
    for s in range(3):
        y = torch.randn(H * W * C, generator=torch.Generator().manual_seed(s), dtype=D)
        vy = float(y.reshape(-1, C).var(-1, unbiased=False).min())
        J = torch.func.jacfwd(f)(y).numpy()
        assert np.linalg.norm(J, 2) <= k.lipschitz(vy)
    # Identity norms: Jacobian 1, curvature 0, radius unknown
    lin = ln.field_constants(_block(use_norm=False, use_mlp=False), H, W)
    assert (lin.ln_jacobian(1, 0.0), lin.ln_curvature(2, 0.0), lin.rho1, lin.hidden) == (1.0, 0.0, math.inf, 0)
    assert lin.W1 == lin.W2 == lin.mlp_lipschitz == 0.0


def test_field_constants_without_biases_and_without_mlp():
    blk = _block(seed=1)
    blk.mlp.fc1.bias = None
    blk.mlp.fc2.bias = None
    blk.norm1.bias = None
    k = ln.field_constants(blk, 2, 2)
    assert abs(k.bias_norm - float(blk.mixer.o_proj.bias.norm())) <= 1e-12  # only b_o is left
    assert abs(k.rho1 - math.sqrt(8) * float(blk.norm1.weight.abs().max())) <= 1e-12
    blk.mlp.fc2.bias = torch.nn.Parameter(torch.ones(8, dtype=D), requires_grad=False)  # b2 alone: ||b2|| = sqrt(8)
    assert abs(ln.field_constants(blk, 2, 2).bias_norm - k.bias_norm - math.sqrt(8)) <= 1e-12
    nomlp = _block(seed=1, use_mlp=False)
    k0 = ln.field_constants(nomlp, 2, 2)
    assert k0.hidden == 0 and k0.W1 == k0.W2 == k0.W1_abs == k0.W2_abs == 0.0
    assert abs(k0.bias_norm - float(nomlp.mixer.o_proj.bias.norm())) <= 1e-12


def test_curvature_bounds_finite_differences_of_the_jacobian():
    """||D^2 F(y)[u, u]|| (central differences of J_F w along u) <= curvature(v) ||u||_max-token^2 for a block
    with bias-free LayerNorms and MLP (curvature is per-token: max_i ||u_i|| enters)."""
    blk = _block(seed=2)
    for m in (blk.norm1, blk.norm2, blk.mlp.fc1, blk.mlp.fc2):
        m.bias = None
    H, W, C = 2, 2, 8
    k = ln.field_constants(blk, H, W)
    f = lambda z: blk.vector_field(z)
    g = torch.Generator().manual_seed(3)
    worst = 0.0
    for _ in range(6):
        y = torch.randn(1, H, W, C, generator=g, dtype=D)
        u = torch.randn(1, H, W, C, generator=g, dtype=D)
        h = 1e-4
        jp = torch.func.jvp(f, (y + h * u,), (u,))[1]
        jm = torch.func.jvp(f, (y - h * u,), (u,))[1]
        d2 = float(((jp - jm) / (2 * h)).norm())
        pts = torch.stack([y + s * u for s in (-h, 0.0, h)])
        v = float(pts.var(-1, unbiased=False).min()) * 0.999
        bound = k.curvature(v) * float(u.norm(dim=-1).max()) ** 2
        assert d2 <= bound, (d2, bound)
        worst = max(worst, d2 / bound)
    assert worst > 1e-3  # the bound is not vacuous by orders of magnitude


def test_mlp_curvature_term_is_attained_by_a_single_row():
    """Lemma 1's MLP term ||W2|| sup|GELU''| R ||W1|| ||w||^2 (R: W1's largest row norm) is an equality when W1 has
    one nonzero row r, w is parallel to r and the pre-activation sits at 0 (where |GELU''| peaks); with a second
    row it still bounds the exact second derivative (autograd); and R, computed row by row with rounding up, stays
    a true bound at 1e-200 (where the squares of the entries underflow)."""
    C, hid = 4, 3
    r = torch.tensor([0.6, -0.8, 0.0, 0.0], dtype=D) * 1.5  # ||r|| = 1.5
    W1 = torch.zeros(hid, C, dtype=D)
    W1[1] = r
    W2 = torch.zeros(C, hid, dtype=D)
    W2[2, 1] = 2.0  # ||W2|| = 2
    gelu = torch.nn.GELU()
    mlp = lambda z: W2 @ gelu(W1 @ z)  # noqa: E731
    w = r / 1.5 * 0.3
    d2 = torch.autograd.functional.hessian(lambda z: mlp(z)[2], torch.zeros(C, dtype=D))
    exact = abs(float(w @ d2 @ w))  # only output 2 is nonzero
    k = ln.FieldConstants(C=C, N=1, T_norm=0.0, T_abs=0.0, g1=1.0, g2=1.0, eps1=math.inf, eps2=math.inf, W1=1.5,
                          W2=2.0, W1_abs=1.5, W2_abs=2.0, gelu1=1.2, bias_norm=0.0, rho1=math.inf, rho2=math.inf,
                          hidden=hid, W1_row=1.5)
    bound = k.curvature(0.0) * float(w.norm()) ** 2
    assert abs(exact - 2.0 * math.sqrt(2 / math.pi) * 1.5 ** 2 * 0.09) < 1e-12
    assert exact <= bound <= exact * (1 + 1e-12)  # attained
    assert dataclasses.replace(k, W1_row=math.inf).curvature(0.0) == k.curvature(0.0)  # unknown R: ||W1|| instead
    # a second row: the bound holds for every w (D^2 MLP(z)[w, w] by nested autograd)
    W1[0] = torch.tensor([0.0, 0.3, 1.0, 0.5], dtype=D)
    W2[0, 0] = 1.0
    k2 = dataclasses.replace(k, W1=float(torch.linalg.matrix_norm(W1, 2)), W2=float(torch.linalg.matrix_norm(W2, 2)),
                             W1_row=float(W1.norm(dim=1).max()))
    assert k2.curvature(0.0) < dataclasses.replace(k2, W1_row=math.inf).curvature(0.0)
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(20):
        z, w = torch.randn(C, generator=g, dtype=D), torch.randn(C, generator=g, dtype=D)
        dd = torch.func.jvp(lambda x: torch.func.jvp(mlp, (x,), (w,))[1], (z,), (w,))[1]
        worst = max(worst, float(dd.norm()) / (k2.curvature(0.0) * float(w.norm()) ** 2))
    assert worst <= 1 + 1e-12
    # R from field_constants: rounded up row by row, true at 1e-200 (squares of 1e-200 underflow to 0)
    blk = _block(seed=5)
    with torch.no_grad():
        blk.mlp.fc1.weight.mul_(1e-200)
    kk = ln.field_constants(blk, 1, 1)
    mpmath.mp.dps = 40
    ref = max(mpmath.sqrt(sum(mpmath.mpf(float(x)) ** 2 for x in row)) for row in blk.mlp.fc1.weight)
    assert mpmath.mpf(kk.W1_row) >= ref and kk.W1_row <= float(ref) * (1 + 1e-12)


def test_rounding_bounds_formula_and_float32_errors():
    """The a-priori formula of proofs/S5.md Lemma 4, evaluated here, and it bounds the actual float32 errors."""
    blk = _block(seed=4)
    H, W, C = 2, 3, 8
    k = ln.field_constants(blk, H, W)
    y = torch.randn(2, H, W, C, generator=torch.Generator().manual_seed(5), dtype=D)
    y[1] *= 3.0
    v = float(y.var(-1, unbiased=False).min())
    y32 = y.float()
    eps_F, eps_J = ln.rounding_bounds(k, y32, v)
    u = 2.0 ** -24
    K = 2 * (C + k.hidden + 4 * (math.isqrt(H * W) + 1) * 8) + 64
    gK = K * u / (1 - K * u)
    yn = y32.double()
    amp = [float((yn[b].norm(dim=-1) / (math.sqrt(C) * yn[b].var(-1, unbiased=False).sqrt())).max()) for b in range(2)]
    mag = math.sqrt(H * W) * (k.T_abs * k.rho1 + k.W2_abs * k.gelu1 * k.W1_abs * k.rho2 + k.bias_norm)
    e = 2.0 ** -23 / 8  # the taps the SSoG module drops: at most truncation_tol / 2 = eps / 8 of each factor's mass
    dropped = (2 * e + e * e) * k.T_abs
    for b in range(2):
        want = gK * (2 + amp[b]) * mag * 4 + dropped * math.sqrt(H * W) * k.rho1
        assert abs(float(eps_F[b]) - want) <= 1e-6 * float(eps_F[b])
    lin = k.T_abs * k.ln_jacobian(1, v) + k.W2_abs * k.gelu1 * k.W1_abs * k.ln_jacobian(2, v)
    assert abs(eps_J - (gK * (2 + max(amp)) * lin * 8 + dropped * k.ln_jacobian(1, v))) <= 1e-6 * eps_J
    b32 = _block(seed=4)
    b32.float()
    with torch.no_grad():
        err = (b32.vector_field(y32).double() - blk.vector_field(y32.double())).flatten(1).norm(dim=-1)
    assert (err <= eps_F.double()).all() and float(err.max()) > 0


def test_structured_lognorm_against_per_token_jacobians():
    """mu_2(J) <= structured bound <= ||T|| max ||D1_i|| + max mu_2(D2_i) + tiny (||D1_i|| by Lemma 1), the per-token blocks taken by
    autograd here; exact mu_2 of the dense Jacobian below it."""
    blk = _block(seed=6)
    H, W, C = 2, 2, 8
    k = ln.field_constants(blk, H, W)
    y = torch.randn(2, H, W, C, generator=torch.Generator().manual_seed(7), dtype=D)
    got = ln.structured_lognorm(blk, k, y, 0.0)
    mlp_ln = lambda z: blk.mlp(blk.norm2(z))
    for b in range(2):
        J = torch.func.jacfwd(lambda z: blk.vector_field(z.reshape(1, H, W, C)).reshape(-1))(y[b].reshape(-1)).numpy()
        mu = float(np.linalg.eigvalsh((J + J.T) / 2).max())
        toks = y[b].reshape(-1, C)
        n1x = max(float(np.linalg.norm(torch.func.jacfwd(blk.norm1)(t).numpy(), 2)) for t in toks)
        # Lemma 1's per-token bound max|gamma| / sqrt(var + eps) (>= the exact norm n1x)
        n1 = float(blk.norm1.weight.abs().max()) / math.sqrt(float(toks.var(-1, unbiased=False).min()) + blk.norm1.eps)
        assert n1x <= n1 * (1 + 1e-12)
        m2 = max(float(np.linalg.eigvalsh(((lambda A: (A + A.T) / 2)(torch.func.jacfwd(mlp_ln)(t).numpy()))).max())
                 for t in toks)
        assert mu <= float(got[b]) <= k.T_norm * n1 * (1 + 1e-9) + m2 + 1e-9 * (1 + abs(m2)), (mu, float(got[b]))


def test_dense_lognorm_batch_independent_and_cached_guess_is_sound():
    blk = _block(seed=8)
    H, W = 2, 2
    y = torch.randn(2, H, W, 8, generator=torch.Generator().manual_seed(9), dtype=D)
    dl = ln.DenseLogNorm(blk, H, W)
    _, err2 = dl.jacobian(y)
    _, err1 = dl.jacobian(y[1:])
    assert torch.allclose(err2[1:], err1, rtol=1e-14, atol=0)  # per-sample rounding bound, not batch-wide
    first = dl(y, 0.0)
    second = dl(y + 1e-3, 0.0)  # the Rayleigh-quotient guess of the first solve is tried here
    assert dl.eigensolves == 1  # and certified without a second eigensolve
    for b, (val, z) in enumerate(((first, y), (second, y + 1e-3))):
        for i in range(2):
            J = ln.dense_jacobian(blk, z[i]).numpy()
            mu = float(np.linalg.eigvalsh((J + J.T) / 2).max())
            assert mu <= float(val[i]) <= mu + 1e-2 * (1 + abs(mu))


def test_verified_lambda_max_needs_a_second_try():
    """A guess lam below the top eigenvalue: the first tries (mu = lam + pad < lambda_max) cannot certify, the pad
    grows tenfold per try; the result must still be a finite upper bound, not inf and not below lambda_max."""
    n = 40
    Q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((n, n)))
    ev = np.linspace(-1.0, 0.25, n)
    S = torch.tensor((Q * ev) @ Q.T, dtype=D)
    S = (S + S.T) / 2
    top = float(np.linalg.eigvalsh(S.numpy()).max())
    got = float(ln.verified_lambda_max(S, lam=torch.tensor(top - 1e-8, dtype=D)))
    assert top <= got <= top + 1e-5
    assert float(ln.verified_lambda_max(S, lam=torch.tensor(top - 1.0, dtype=D), tries=2)) == math.inf  # honest failure


# ------------------------------------------------------------------------ the SSoG ViT field end to end

def _tiny_ode_vit(seed=0):
    from lipcheck import ViT
    torch.manual_seed(seed)
    return ViT("ode", "ssog", dtype=D, img_size=8, patch_size=4, dim=6, num_heads=2, num_components=2, depth=1,
               num_classes=3, mlp_ratio=2.0).eval()


def _tight_solution(model, images, ts):
    """x(ts) by torchdiffeq's dopri8 at rtol = atol = 1e-12 on the model's own vector field, independent of
    lipcheck.wellposed's solver wrappers."""
    import torchdiffeq
    blk = model.vector_field.block
    with torch.no_grad():
        x0 = model.embed(images.to(D))
        return torchdiffeq.odeint(lambda t, x: blk.vector_field(x), x0, ts, method="dopri8", rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method,lognorm", [("dopri5", "dense"), ("bosh3", "structured")])
def test_ssog_vit_enclosure_contains_a_tight_solution(method, lognorm):
    model = _tiny_ode_vit()
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=D)
    enc = wp.enclose(model, images, method=method, tol=1e-4, lognorm=lognorm, progress=False)
    assert enc.proven.all(), enc.reason
    assert enc.center.shape[1:] == (2, 2, 2, 6) and float(enc.t[-1]) == pytest.approx(float(model.t1), abs=1e-15)
    truth = _tight_solution(model, images, enc.t)
    err = (truth - enc.center).flatten(2).norm(dim=-1)  # (K, B)
    assert (err <= enc.radius).all(), (err / enc.radius).max()
    assert float(err[-1].max()) > 0 and float((err[1:] / enc.radius[1:]).max()) > 1e-6  # not vacuous
    s = enc.summary()
    assert s["samples"] == 2 and s["proven"] == [True, True] and s["method"] == method
    assert s["radius"] == enc.radius.T.tolist() and s["radius_t1"] == enc.radius_t1.tolist()
    assert s["radius_last_interval"] == enc.radius[-1].tolist() and (enc.radius_t1 <= enc.radius[-1]).all()
    assert s["t"] == enc.t.tolist() and s["mu_point"] == enc.mu_point.T.tolist()
    assert s["tube_max"] == enc.tube.amax(0).tolist() and s["mu_max"] == enc.mu.amax(0).tolist()
    assert s["defect_max"] == enc.defect.amax(0).tolist()
    assert s["defect_sampled_max"] == enc.defect_sampled.amax(0).tolist()
    assert (enc.defect >= enc.defect_sampled).all()  # the rigorous sup is above the sampled values
    field = enc._envelope_data["field"]  # the eigensolver calls its log-norm needed, as reported
    assert enc.stats["eigensolves"] == (field._dense.eigensolves if lognorm == "dense" else field._cache["eigensolves"])


def test_ssog_field_pieces_against_the_block():
    from lipcheck.wellposed.enclosure import SSoGField
    model = _tiny_ode_vit(seed=3)
    blk = model.vector_field.block
    for p in blk.parameters():
        p.requires_grad_(False)
    f = SSoGField(blk, 2, 2)
    assert f.lognorm_kind == "dense" and f.uses_variance  # LayerNorm: its constants need the variance floor
    assert SSoGField(blk, 2, 2, lognorm="structured").lognorm_kind == "structured"
    with pytest.raises(wp.EnclosureError, match="lognorm"):
        SSoGField(blk, 2, 2, lognorm="exact")
    y = torch.randn(3, 2, 2, 6, generator=torch.Generator().manual_seed(2), dtype=D)
    v = float(y.var(-1, unbiased=False).min())
    assert torch.equal(f(y), blk.vector_field(y))
    eps_F, eps_J = f.rounding(y, v)
    assert eps_F.shape == (3,) and (eps_F > 0).all() and 0 < eps_J < 1e-10
    mu = f.lognorm(y, v, 0.0)
    mu_s = SSoGField(blk, 2, 2, lognorm="structured").lognorm(y, v, 0.0)
    for b in range(3):
        J = ln.dense_jacobian(blk, y[b]).numpy()
        assert np.linalg.eigvalsh((J + J.T) / 2).max() <= float(mu[b])
        assert np.linalg.norm(J, 2) <= f.lipschitz(v)
        # the dense kind is the log-norm itself up to rounding (autograd's Jacobian, formed here); the structured one
        # is a looser bound on this field
        Jr = torch.autograd.functional.jacobian(lambda z: blk.vector_field(z[None])[0], y[b]).reshape(24, 24).numpy()
        ref = np.linalg.eigvalsh((Jr + Jr.T) / 2).max()
        assert ref <= float(mu[b]) <= ref + 1e-9 * (1 + abs(ref)) < float(mu_s[b])


def test_max_per_step_boundary():
    """max_per_step >= 8 is the documented range: 7 is refused, 8 runs and its radius (where proven) holds."""
    A, x0 = _linear_case()
    with pytest.raises(wp.EnclosureError, match="max_per_step"):
        wp.enclose_field(LinearField(A), x0, 1.0, max_per_step=7)
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, max_per_step=8)
    exact = _expm_solution(A, x0, enc.t.tolist())
    err = np.linalg.norm(exact - enc.center.reshape(len(enc.t), 2, -1).numpy(), axis=-1)
    assert (err <= enc.radius.numpy()).all()


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), C=st.sampled_from([4, 6]), scale=st.floats(0.3, 3.0), use_mlp=st.booleans())
def test_lipschitz_and_curvature_hold_on_random_blocks(seed, C, scale, use_mlp):
    """Property over random blocks and states: ||J_F(y)|| <= lipschitz(v) (exact 2-norm of the Jacobian taken by
    autograd) and ||J_F(y) - J_F(z)|| <= curvature(v) max_i ||y_i - z_i|| for a nearby z (v: the variance floor
    of the segment, taken over samples of it with a 10% margin)."""
    blk = _block(C=C, heads=2, seed=seed, use_mlp=use_mlp)
    H, W = 2, 2
    k = ln.field_constants(blk, H, W)
    g = torch.Generator().manual_seed(seed)
    y = scale * torch.randn(1, H, W, C, generator=g, dtype=D)
    z = y + 0.01 * scale * torch.randn(1, H, W, C, generator=g, dtype=D)
    seg = torch.stack([y + s * (z - y) for s in torch.linspace(0, 1, 11, dtype=D)])
    v = float(seg.var(-1, unbiased=False).min()) * 0.9
    f = lambda x: blk.vector_field(x.reshape(1, H, W, C)).reshape(-1)
    Jy, Jz = (torch.func.jacfwd(f)(x.reshape(-1)).numpy() for x in (y, z))
    assert np.linalg.norm(Jy, 2) <= k.lipschitz(v)
    assert np.linalg.norm(Jy - Jz, 2) <= k.curvature(v) * float((y - z).norm(dim=-1).max())


def test_token_jacobians_without_layernorm_are_the_identity_and_the_mlp_jacobian():
    """use_norm=False: D1 is the identity on every token, D2 the MLP's own Jacobian (autograd, per token)."""
    from lipcheck.bounds import lognorm as ln
    from lipcheck.models.vit import Block
    torch.manual_seed(3)
    blk = Block(6, 2, "ssog", use_norm=False, dtype=torch.float64)
    y = torch.randn(2, 2, 3, 6, dtype=torch.float64)
    D1, n1, D2 = ln.token_jacobians(blk, y, full=True)
    assert D1.shape == (2, 6, 6, 6) and torch.equal(D1, torch.eye(6, dtype=torch.float64).expand(2, 6, 6, 6))
    assert torch.equal(n1, torch.ones(2, 6, dtype=torch.float64))
    x = y.reshape(2, 6, 6)
    for b in range(2):
        for i in range(6):
            J = torch.autograd.functional.jacobian(blk.mlp, x[b, i])
            assert torch.allclose(D2[b, i], J, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------ the reference method (Theorem 6) and its pieces

def test_reference_method_is_tight_on_the_linear_ode():
    """x' = A x: with a reference solve the radius is within 1.5x of the actual error at t1 (the stated factor) and
    contains expm at every time; the direct enclosure of the same solve is 10x or more looser."""
    A, x0 = _linear_case()
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6)  # ref_tol="auto"
    direct = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, ref_tol=None)
    assert enc.proven.all() and direct.proven.all()
    assert enc.stats["ref_tol"] == pytest.approx(1e-9) and enc.reference is not None and direct.reference is None
    # the reference's log-norm slack by default: max(mu_slack, 1 / t1) (an e-fold at most on r_ref), the user's
    # solve enclosed directly keeps mu_slack
    assert (enc.stats["mu_slack"], direct.stats["mu_slack"]) == (1.0, 0.25)
    half = wp.enclose_field(LinearField(A), x0, 0.5, tol=1e-6)
    assert half.proven.all() and half.stats["mu_slack"] == 2.0
    err_half = np.linalg.norm(_expm_solution(A, x0, [0.5])[-1] - half.center[-1].reshape(2, -1).numpy(), axis=-1)
    assert (err_half <= half.radius[-1].numpy()).all()
    exact = _expm_solution(A, x0, enc.t.tolist())
    err = np.linalg.norm(exact - enc.center.reshape(len(enc.t), 2, -1).numpy(), axis=-1)
    assert (err <= enc.radius.numpy()).all()
    ratio = enc.radius[-1].numpy() / err[-1]
    assert (ratio < 1.5).all(), ratio
    exact_d = _expm_solution(A, x0, direct.t.tolist())
    err_d = np.linalg.norm(exact_d - direct.center.reshape(len(direct.t), 2, -1).numpy(), axis=-1)
    assert (direct.radius[-1].numpy() / err_d[-1] > 10 * ratio).all()
    # the centre is the user's solve: the same states as the direct run's solve at tol 1e-6 at t1
    assert torch.allclose(enc.center[-1], direct.center[-1], rtol=0, atol=1e-14)
    # radius = distance + reference radius, and the distance is a proven sup, so >= ||y - y_ref|| at the nodes
    ref_exact = _expm_solution(A, x0, enc.reference.t.tolist())
    yr = enc.reference.center.reshape(len(enc.t), 2, -1).numpy()
    assert (np.linalg.norm(enc.center.reshape(len(enc.t), 2, -1).numpy() - yr, axis=-1)
            <= enc.distance.numpy() * (1 + 1e-9) + 1e-15).all()
    assert (np.linalg.norm(ref_exact - yr, axis=-1) <= enc.reference.radius.numpy()).all()


def test_reference_method_failures_are_reported_not_a_radius():
    A, x0 = _linear_case()
    small = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, tube=1e-14)
    assert not small.proven.any() and all("reference solve" in r and "tube" in r for r in small.reason)
    assert torch.isinf(small.radius[-1]).all()
    # the work stops at the first failed interval: one closing interval to t1 (radius inf), t still ends on t1
    assert len(small.t) == 3 and float(small.t[-1]) == 1.0 and torch.isinf(small.radius[1:]).all()
    assert small.reference.stats["steps"] > 1 and len(small.reference.stats["stiffness"]) == 1
    mu = float(np.linalg.eigvalsh((A + A.T) / 2).max())
    low = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, mu_claim=mu - 0.05)
    assert not low.proven.any() and all("log-norm" in r for r in low.reason) and torch.isinf(low.radius[-1]).all()
    wrong = LinearField(A + 0.5 * np.eye(A.shape[0]))  # both solves integrate a wrong field: a large defect
    capped = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, solver_field=wrong, max_tube=1e-3)
    assert not capped.proven.any() and torch.isinf(capped.radius[-1]).all()
    with pytest.raises(wp.EnclosureError, match="ref_tol"):
        wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, ref_tol=1e-3)


def test_bernstein_distance_bounds_the_sup_between_nodes():
    """_distance against a dense evaluation of both piecewise quartics (numpy, 2001 points per interval)."""
    from lipcheck.wellposed import distance as E
    g = torch.Generator().manual_seed(5)
    steps = [(0.0, 0.3), (0.3, 0.7), (0.7, 1.0)]
    coefs = [torch.randn(5, 2, 1, 1, 3, generator=g, dtype=D) for _ in steps]
    for k in range(1, len(steps)):  # continuous at y's step ends, as a solver's output is (up to round-off)
        coefs[k][0] = coefs[k - 1].sum(0)
    rsteps = [(0.0, 0.5), (0.5, 1.0)]
    rcoefs = [torch.randn(5, 2, 1, 1, 3, generator=g, dtype=D) for _ in rsteps]
    rcoefs[1][0] = rcoefs[0].sum(0)
    spans = [(0, 0, 4, 8), (0, 4, 8, 8), (1, 0, 8, 8)]
    dist, centers, end = E._distance(steps, coefs, dict(steps=rsteps, coefs=rcoefs, spans=spans), D)

    def ev(st, cf, t):
        k = min(np.searchsorted([b for _, b in st], t, side="right"), len(st) - 1)
        a, b = st[k]
        s = (t - a) / (b - a)
        return sum(cf[k][j].reshape(2, 3).numpy() * s ** j for j in range(5))

    times = [(0.0, 0.0), (0.0, 0.25), (0.25, 0.5), (0.5, 1.0)]
    for p, (ta, tb) in enumerate(times):
        worst = np.max([np.linalg.norm(ev(steps, coefs, t) - ev(rsteps, rcoefs, t), axis=-1)
                        for t in np.linspace(ta, tb, 2001)], axis=0)
        assert (worst <= dist[p].numpy()).all()
        assert (dist[p].numpy() <= worst * 1.02 + 1e-12).all()  # and tight (halving until within 1 %)
    assert np.allclose(centers[-1].reshape(2, 3).numpy(), ev(steps, coefs, 1.0))
    # the point bound at t1: above the value there, within rounding of it, and below the last interval's sup
    at_t1 = np.linalg.norm(ev(steps, coefs, 1.0) - ev(rsteps, rcoefs, 1.0), axis=-1)
    assert (at_t1 <= end.numpy()).all() and (end.numpy() <= at_t1 * (1 + 1e-12) + 1e-13).all()
    assert (end <= dist[-1]).all() and (end < dist[-1]).any()


def test_field_constants_refuse_an_unknown_layernorm():
    k = ln.field_constants(_block(), 2, 2)
    for which in (0, 3, "2"):
        with pytest.raises(ValueError, match="which"):
            k.ln_jacobian(which, 0.5)
        with pytest.raises(ValueError, match="which"):
            k.ln_curvature(which, 0.5)
    assert k.ln_jacobian(2, 0.5) == pytest.approx(k.g2 / math.sqrt(0.5 + k.eps2))


def test_structured_lognorm_cache_gives_a_valid_bound():
    """The cached-eigenvector path (Cholesky at the Rayleigh quotient) bounds every per-token mu_2(D2_i)
    computed by numpy here, with garbage vectors in the cache too."""
    blk = _block(C=6, seed=2)
    for p in blk.parameters():
        p.requires_grad_(False)
    k = ln.field_constants(blk, 2, 2)
    y = torch.randn(2, 2, 2, 6, generator=torch.Generator().manual_seed(3), dtype=D)
    cache = {}
    a = ln.structured_lognorm(blk, k, y, 0.0, cache=cache)
    b = ln.structured_lognorm(blk, k, y * 1.01, 0.0, cache=cache)
    assert cache["eigensolves"] >= 1
    cache["vec"] = torch.randn_like(cache["vec"])
    c = ln.structured_lognorm(blk, k, y * 1.01, 0.0, cache=cache)
    for val, yy in ((a, y), (b, y * 1.01), (c, y * 1.01)):
        n1, D2 = ln.token_jacobians(blk, yy)
        S = ((D2 + D2.transpose(-1, -2)) / 2).numpy()
        top = np.linalg.eigvalsh(S).max(axis=-1).max(axis=-1)
        assert (top + k.T_norm * n1.amax(-1).numpy() <= val.numpy()).all()
    # the eigensolver reruns only for the tokens whose cached vector fails, and the vectors it leaves behind are
    # the top eigenvectors (numpy's, up to sign): the next point then certifies from the cache alone
    n1, D2 = ln.token_jacobians(blk, y * 1.02)
    S = ((D2 + D2.transpose(-1, -2)) / 2).numpy()
    w, V = np.linalg.eigh(S)
    cache["vec"] = torch.from_numpy(V[..., -1].copy())
    cache["vec"][0, 1] = torch.randn(6, generator=torch.Generator().manual_seed(4), dtype=D)  # one bad token
    before = cache["eigensolves"]
    d = ln.structured_lognorm(blk, k, y * 1.02, 0.0, cache=cache)
    assert cache["eigensolves"] == before + 1
    assert np.allclose(np.abs((cache["vec"].numpy() * V[..., -1]).sum(-1)), 1.0, atol=1e-8)
    assert (w.max(axis=-1).max(axis=-1) + k.T_norm * n1.amax(-1).numpy() <= d.numpy()).all()
    hits = cache.get("hits", 0)
    e = ln.structured_lognorm(blk, k, y * 1.02, 0.0, cache=cache)
    assert cache["hits"] == hits + 1 and cache["eigensolves"] == before + 1
    assert (e.numpy() <= d.numpy() + 3e-3 * (1 + np.abs(d.numpy()))).all()  # no looser than Cholesky's 0.2 % slack


def test_time_budget_reports_what_holds_so_far():
    """max_seconds = 0: the first step is done, then the rest is not proven; the finite radii still hold (expm)."""
    A, x0 = _linear_case()
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, max_seconds=0.0)
    assert not enc.proven.any() and all("time budget" in r and "proven on [0," in r for r in enc.reason)
    assert float(enc.t[-1]) == 1.0 and torch.isinf(enc.radius[-1]).all()
    fin = torch.isfinite(enc.radius[:, 0])
    assert fin[:-1].all() and len(enc.t) >= 3
    exact = _expm_solution(A, x0, enc.t.tolist())
    err = np.linalg.norm(exact - enc.center.reshape(len(enc.t), 2, -1).numpy(), axis=-1)
    assert (err[:-1] <= enc.radius[:-1].numpy()).all()


def test_distance_covers_both_neighbouring_quartics_at_a_jump():
    """y with a jump at its step end 0.3 (the float end of one step and the start of the next differ): on a reference
    interval that starts there, the proven distance covers y_ref against both neighbouring quartics (proofs/S5.md,
    Theorem 6: "a piece that ends at one of y's step ends gets that end's jump added"); dense numpy evaluation."""
    from lipcheck.wellposed import distance as E
    g = torch.Generator().manual_seed(5)
    steps = [(0.0, 0.3), (0.3, 0.7), (0.7, 1.0)]
    coefs = [torch.randn(5, 2, 1, 1, 3, generator=g, dtype=D) * 0.1 for _ in steps]
    coefs[2][0] = coefs[1].sum(0)  # continuous at 0.7: only the jump at 0.3 is nonzero
    rsteps = [(0.0, 0.3), (0.3, 1.0)]
    rcoefs = [coefs[0].clone(), torch.zeros(5, 2, 1, 1, 3, dtype=D)]
    rcoefs[1][0] = coefs[1][0]  # y_ref constant on [0.3, 1], equal to y's right neighbour at 0.3
    spans = [(0, 0, 8, 8), (1, 0, 2, 8), (1, 2, 8, 8)]
    dist, _, _ = E._distance(steps, coefs, dict(steps=rsteps, coefs=rcoefs, spans=spans), D)

    def quartic(cf, a, b, t):
        s = (t - a) / (b - a)
        return sum(cf[j].reshape(2, 3).numpy() * s ** j for j in range(5))

    def yref(t):
        k = 0 if t < 0.3 else 1
        return quartic(rcoefs[k], *rsteps[k], t)

    times = [(0.0, 0.0), (0.0, 0.3), (0.3, 0.3 + 0.7 * 2 / 8), (0.3 + 0.7 * 2 / 8, 1.0)]
    for p, (ta, tb) in enumerate(times):
        worst = np.zeros(2)
        for k, (a, b) in enumerate(steps):  # every quartic of y on its own closed step, where it meets [ta, tb]
            lo, hi = max(a, ta), min(b, tb)
            if lo > hi:
                continue
            for t in np.linspace(lo, hi, 401):
                worst = np.maximum(worst, np.linalg.norm(quartic(coefs[k], a, b, t) - yref(t), axis=-1))
        assert (worst <= dist[p].numpy()).all(), (p, worst, dist[p])
    # the interval starting at the jump: y's left quartic ends a whole jump away from y_ref
    left = np.linalg.norm(coefs[0].sum(0).reshape(2, 3).numpy() - coefs[1][0].reshape(2, 3).numpy(), axis=-1)
    assert (left > 0.1).all() and (dist[2].numpy() >= left).all()


def test_envelope_intervals_tile_the_enclosure_times():
    """The per-interval data the envelope integrates over are the enclosure's own intervals: their lengths are the
    differences of enc.t and add up to t1, also with the closing interval after every sample failed; the reference
    enclosure reports the tolerance its solve was made at."""
    A, x0 = _linear_case()
    for kw in (dict(ref_tol=None), dict(tube=1e-14, ref_tol=None), dict(tube=1e-14), dict()):
        enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, **kw)
        taus = [iv["tau"] for iv in enc._envelope_data["intervals"]]
        t = (enc.reference or enc).t.tolist()
        assert len(taus) == len(t) - 1
        assert np.allclose(taus, np.diff(t), rtol=0, atol=1e-14) and abs(sum(taus) - 1.0) <= 1e-13, kw
        # every interval records its log-norm, token std floor, drift, evaluation offset and bend along y per sample
        # (a linear field has no Lemma 7 bound: bend inf); the closing one after a failure has no log-norm (inf), no
        # floor (0) and no drift bound (inf)
        assert all(set(iv) == {"tau", "lam", "std", "drift", "offset", "bend"}
                   for iv in enc._envelope_data["intervals"])
        assert all(b == math.inf for iv in enc._envelope_data["intervals"] for b in iv["bend"])
        if "tube" in kw:
            assert enc._envelope_data["intervals"][-1] == dict(tau=taus[-1], lam=[math.inf] * 2, std=[0.0] * 2,
                                                               drift=[math.inf] * 2, offset=[0.0] * 2,
                                                               bend=[math.inf] * 2)
    assert enc.reference.stats["tol"] == enc.stats["ref_tol"] == pytest.approx(1e-9) and enc.stats["tol"] == 1e-6
    # the pieces kept with the result are the user's solve y: its quartics give the reported centres
    steps, coefs = enc._pieces["steps"], enc._pieces["coefs"]
    ends = np.array([b for _, b in steps])
    for t, c in zip(enc.t.tolist(), enc.center):
        k = min(int(np.searchsorted(ends, t, side="right")), len(steps) - 1)
        a, b = steps[k]
        s = (t - a) / (b - a)
        y = sum(coefs[k][j].numpy() * s ** j for j in range(5))
        assert np.allclose(y, c.numpy(), rtol=0, atol=1e-12)


def _bernstein_from_values():
    """The 5 x 5 rational matrix taking a quartic's values at s = 0, 1/4, 1/2, 3/4, 1 to its Bernstein coefficients
    on [0, 1]: exact inverse Vandermonde (Fractions) then b_j = sum_{k<=j} C(j,k)/C(4,k) a_k."""
    from fractions import Fraction as Fr
    n = 5
    A = [[Fr(i, 4) ** k for k in range(n)] + [Fr(int(i == j)) for j in range(n)] for i in range(n)]
    for c in range(n):
        p = next(r for r in range(c, n) if A[r][c] != 0)
        A[c], A[p] = A[p], A[c]
        A[c] = [x / A[c][c] for x in A[c]]
        for r in range(n):
            if r != c:
                A[r] = [x - A[r][c] * y for x, y in zip(A[r], A[c])]
    Vi = [row[n:] for row in A]
    return [[sum(Fr(math.comb(j, k), math.comb(4, k)) * Vi[k][i] for k in range(j + 1)) for i in range(n)]
            for j in range(n)]


@pytest.mark.parametrize("case,a,window", [("constant", 0.0, 0.1), ("linear_far", 1000.0, 0.02),
                                           ("ref_quartic", 0.0, 0.03)])
def test_distance_margin_is_the_proofs_rounding_allowance(case, a, window):
    """Theorem 6's D on one step [a, a + 1] shared by y and y_ref, re-derived at 50 digits from proofs/S5.md: the
    exact Bernstein bound of y - y_ref plus max_j sum_i |M_ji| (node errors gamma_12 sum|c_k| per polynomial,
    node displacements 8u (reference) and 16u (|a_ref| + h_ref + |a_y| + h_y) / h_y + 4u h_ref / h_y (y) times
    sum_k k ||c_k||, the subtraction u (||y|| + ||y_ref||), and gamma_8 ||y - y_ref||), plus gamma_12 sum|c_k| for the
    reported centre. D exceeds the exact Bernstein bound by that allowance within `window` of it (each case makes a
    different term dominant), at t = 0 and on the step."""
    from fractions import Fraction as Fr
    from lipcheck.wellposed import distance as E
    mpmath.mp.dps = 50
    u = mpmath.mpf(2) ** -53
    gam = lambda n: n * u / (1 - n * u)  # noqa: E731
    MB = _bernstein_from_values()
    Mabs = max(sum(abs(x) for x in row) for row in MB)
    g = torch.Generator().manual_seed(0)
    c, r = torch.zeros(5, 2, 1, 1, 3, dtype=D), torch.zeros(5, 2, 1, 1, 3, dtype=D)
    c[0] = torch.randn(2, 1, 1, 3, generator=g, dtype=D)
    if case == "linear_far":
        c[1] = torch.randn(2, 1, 1, 3, generator=g, dtype=D)
    if case == "ref_quartic":  # y_ref = r_4 s^4 against a small constant y: the reference's displacement dominates
        r[4] = torch.randn(2, 1, 1, 3, generator=g, dtype=D)
        c[0] *= 1e-3
    steps = [(a, a + 1.0)]
    dist, _, _ = E._distance(steps, [c], dict(steps=steps, coefs=[r], spans=[(0, 0, 8, 8)]), D)
    q = lambda x: mpmath.mpf(x.numerator) / x.denominator  # noqa: E731
    nrm = lambda v: mpmath.sqrt(sum(x * x for x in v))  # noqa: E731
    for b in range(2):
        cf = [[mpmath.mpf(float(v)) for v in c[k, b].reshape(-1)] for k in range(5)]
        rf = [[mpmath.mpf(float(v)) for v in r[k, b].reshape(-1)] for k in range(5)]
        absum = lambda p: nrm([sum(abs(p[k][i]) for k in range(5)) for i in range(3)])  # noqa: E731
        dsig = lambda p: sum(k * nrm(p[k]) for k in range(1, 5))  # noqa: E731
        val = lambda p, s: [sum(p[k][i] * q(s) ** k for k in range(5)) for i in range(3)]  # noqa: E731
        dy = 16 * u * (2 * abs(mpmath.mpf(a)) + 2) + 4 * u
        for row, nodes in ((0, [Fr(0)] * 5), (1, [Fr(i, 4) for i in range(5)])):
            yy, yr = [val(cf, s) for s in nodes], [val(rf, s) for s in nodes]
            d = [[p - w for p, w in zip(x, z)] for x, z in zip(yy, yr)]
            bmax = max(nrm([sum(q(MB[j][i]) * d[i][m] for i in range(5)) for m in range(3)]) for j in range(5))
            err_v = (gam(12) * (absum(rf) + absum(cf)) + 8 * u * dsig(rf) * (1 + gam(12))
                     + dy * dsig(cf) * (1 + gam(12)) + u * (max(nrm(x) for x in yr) + max(nrm(x) for x in yy)))
            allowance = q(Mabs) * (err_v + gam(8) * max(nrm(x) for x in d)) + gam(12) * absum(cf)
            ratio = (mpmath.mpf(float(dist[row, b])) - bmax) / allowance
            assert abs(ratio - 1) <= window, (case, row, b, float(ratio))


def test_distance_halves_pieces_where_bernstein_overestimates():
    """y - y_ref = T4(2s - 1) e (Chebyshev): sup 1 but Bernstein coefficients up to 5/3 on the whole step; halving
    the pieces brings the proven distance within a few % of the true sup (dense numpy evaluation)."""
    from lipcheck.wellposed import distance as E
    e = torch.tensor([0.6, 0.0, 0.8], dtype=D)  # unit vector
    # T4(2s - 1) = 128 s^4 - 256 s^3 + 160 s^2 - 32 s + 1
    cheb = [1.0, -32.0, 160.0, -256.0, 128.0]
    c = torch.stack([v * e for v in cheb]).reshape(5, 1, 1, 1, 3)
    r = torch.zeros_like(c)
    steps = [(0.0, 1.0)]
    dist, _, _ = E._distance(steps, [c], dict(steps=steps, coefs=[r], spans=[(0, 0, 8, 8)]), D)
    s = np.linspace(0, 1, 20001)
    sup = np.abs(np.polynomial.chebyshev.chebval(2 * s - 1, [0, 0, 0, 0, 1])).max()
    assert sup <= float(dist[1, 0]) <= 1.02 * sup, float(dist[1, 0])


def test_rough_distance_is_the_largest_node_distance():
    """_rough_distance: max over y_ref's step nodes (s = 0, 1/4, ..., 1 of each step's own quartic) of ||y - y_ref||,
    y evaluated on its step containing the node (numpy)."""
    from lipcheck.wellposed import distance as E
    g = torch.Generator().manual_seed(7)
    steps = [(0.0, 0.3), (0.3, 0.7), (0.7, 1.0)]
    coefs = [torch.randn(5, 2, 1, 1, 3, generator=g, dtype=D) for _ in steps]
    rsteps = [(0.0, 0.45), (0.45, 1.0)]
    rcoefs = [torch.randn(5, 2, 1, 1, 3, generator=g, dtype=D) for _ in rsteps]

    def ev(st, cf, t):
        k = min(int(np.searchsorted([b for _, b in st], t, side="right")), len(st) - 1)
        a, b = st[k]
        s = (t - a) / (b - a)
        return sum(cf[k][j].reshape(2, 3).numpy() * s ** j for j in range(5))

    def own(k, s):  # y_ref's quartic on its own step k (at a shared end both neighbours' nodes count)
        return sum(rcoefs[k][j].reshape(2, 3).numpy() * s ** j for j in range(5))

    want = max(np.linalg.norm(ev(steps, coefs, a + (b - a) * s) - own(k, s), axis=-1).max()
               for k, (a, b) in enumerate(rsteps) for s in (0.0, 0.25, 0.5, 0.75, 1.0))
    got = E._rough_distance(steps, coefs, rsteps, rcoefs)
    assert abs(got - want) <= 1e-12 * want


def test_resolve_ref_tol_falls_back_to_direct_at_the_floor():
    """"auto": tol * 1e-3 but not below 1e-11, and the direct enclosure (None) when that is not below tol."""
    from lipcheck.wellposed import enclosure as E
    assert E._resolve_ref_tol(1e-6, "auto") == pytest.approx(1e-9)
    assert E._resolve_ref_tol(1e-8, "auto") == pytest.approx(1e-11)
    assert E._resolve_ref_tol(1e-11, "auto") is None and E._resolve_ref_tol(1e-12, "auto") is None
    assert E._resolve_ref_tol(1e-6, None) is None and E._resolve_ref_tol(1e-6, 1e-8) == 1e-8


def test_one_failed_sample_leaves_the_other_proven():
    """A log-norm claim refuted for sample 0 only (callable claim): sample 0 is not proven from its first interval
    on (radius inf, its sampled and rigorous defects still reported), sample 1 is proven and contains expm; every
    reported number is float64."""
    A, x0 = _linear_case()
    mu = float(np.linalg.eigvalsh((A + A.T) / 2).max())
    claim = lambda y: torch.tensor([mu - 0.05, mu + 0.05], dtype=D)  # noqa: E731
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, ref_tol=None, mu_claim=claim)
    assert enc.proven.tolist() == [False, True] and enc.reason[1] is None and "log-norm" in enc.reason[0]
    assert torch.isinf(enc.radius[1:, 0]).all() and torch.isfinite(enc.radius[:, 1]).all()
    assert len(enc.t) > 3 and float(enc.t[-1]) == 1.0
    assert torch.isfinite(enc.defect).all() and (enc.defect >= enc.defect_sampled).all()
    exact = _expm_solution(A, x0, enc.t.tolist())
    err = np.linalg.norm(exact - enc.center.reshape(len(enc.t), 2, -1).numpy(), axis=-1)
    assert (err[:, 1] <= enc.radius[:, 1].numpy()).all()
    for x in (enc.t, enc.radius, enc.tube, enc.mu, enc.mu_point, enc.defect, enc.defect_sampled, enc.center):
        assert x.dtype == D


def test_bern_sup_bounds_the_derivative_and_is_exact_where_it_is_affine():
    """sup over the step of ||y^(d)|| for y(s) = sum_k c_k ((s - a) / h)^k: above the maximum over 2001 points of
    the derivative formed here from the monomials, for d = 1..4; equal to it (up to rounding) where y^(d) is affine
    in s (d = 3, 4), since an affine map attains its largest norm at an end of the step."""
    from lipcheck.wellposed import quartic as E
    g = torch.Generator().manual_seed(11)
    c = torch.randn(5, 2, 2, 2, 3, generator=g, dtype=D) * torch.tensor([1.0, 2.0, 3.0, 0.5, 0.25], dtype=D).reshape(5, 1, 1, 1, 1)
    h = 0.3
    sig = np.linspace(0.0, 1.0, 2001)
    cn = c.reshape(5, 2, -1).numpy()
    for d in (1, 2, 3, 4):
        coef = {k: math.factorial(k) / math.factorial(k - d) / h ** d for k in range(d, 5)}
        deriv = sum(coef[k] * cn[k][None] * sig[:, None, None] ** (k - d) for k in range(d, 5))  # (P, B, n)
        sampled = np.linalg.norm(deriv, axis=-1).max(0)
        got = E._bern_sup(c, h, d).numpy()
        assert (got >= sampled).all(), (d, got, sampled)
        if d >= 3:
            assert np.allclose(got, sampled, rtol=1e-13, atol=0), (d, got, sampled)


# ------------------------------------------------ records, keys and paths that callers read (found by mutation tests)

def _lam_max(A):
    return float(np.linalg.eigvalsh((A + A.T) / 2).max())


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_failed_interval_records_the_tube_and_lognorm_it_checked():
    """Where the tube check fails, .tube and .mu keep the tube radius checked and the log-norm bound over it (the
    failed bootstrap's record), not NaN: for x' = A x that log-norm is lambda_max((A + A^T) / 2) up to the
    verification margin (numpy), and the reason quotes it. A fixed tube (1e-14) and the bootstrap capped at max_tube
    (the largest radius tried is the cap), direct and reference method; the closing interval to t1 records nothing
    but its centre y(t1)."""
    A, x0 = _linear_case()
    lam = _lam_max(A)
    wrong = LinearField(A + 0.5 * np.eye(A.shape[0]))  # the solver integrates another field: no tube <= 1e-3 holds
    for kw, rho in ((dict(tube=1e-14), 1e-14), (dict(solver_field=wrong, max_tube=1e-3), 1e-3)):
        for ref in (dict(ref_tol=None), dict()):
            enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, **kw, **ref)
            assert not enc.proven.any() and len(enc.t) == 3, (kw, ref)  # the first interval fails
            assert enc.tube[0].tolist() == [rho, rho]
            mu = enc.mu[0].numpy()
            assert ((lam <= mu) & (mu <= lam + 1e-9 * (1 + abs(lam)))).all(), (mu, lam)
            assert all(f"(log-norm over the tube {float(m):.4g})" in r for m, r in zip(mu, enc.reason))
            assert torch.isnan(enc.mu[1]).all() and torch.isnan(enc.tube[1]).all()
            # the closing interval's centre is y(t1), the end of the solver's last step (within 10 tol of expm of the
            # field the solver integrated)
            ex = _expm_solution(A + 0.5 * np.eye(A.shape[0]) if "solver_field" in kw else A, x0, [1.0])[0]
            assert np.abs(enc.center[-1].reshape(2, -1).numpy() - ex).max() <= 1e-5


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_point_lognorms_are_those_at_the_reported_centres():
    """.mu_point[p] is the verified mu_2(J_F) at .center[p], the first at y(0): at most 1e-9 above the exact value
    (numpy's eigvalsh of the symmetric part of the Jacobian at that centre) on a tanh neural ODE whose log-norm
    changes along the trajectory. The log-norm over each interval's tube is the larger end value plus curvature times
    (tube + drift), the drift term at most mu_slack."""
    f = TanhField(4, 6, seed=3, scale=1.5)
    x0 = torch.randn(2, 1, 1, 4, generator=torch.Generator().manual_seed(4), dtype=D)
    enc = wp.enclose_field(f, x0, 1.0, tol=1e-5, ref_tol=None)
    assert enc.proven.all() and enc.mu_point.shape == enc.radius.shape == (len(enc.t), 2)
    J, _ = f.jacobian(enc.center.reshape(-1, 1, 1, 4))
    exact = np.linalg.eigvalsh(((J + J.transpose(-1, -2)) / 2).numpy()).max(-1).reshape(len(enc.t), 2)
    got = enc.mu_point.numpy()
    assert (exact <= got).all() and (got <= exact + 1e-9).all(), np.abs(got - exact).max()
    assert np.abs(np.diff(exact, axis=0)).min() > 1e-6  # neighbouring centres have visibly different log-norms
    # over each interval's tube: the larger end value + curvature (tube + token drift), the sub-intervals short enough
    # that the drift term is at most mu_slack (0.25, the default)
    excess = enc.mu.numpy() - np.maximum(got[:-1], got[1:]) - f.curvature(0.0) * enc.tube.numpy()
    assert (excess >= 0).all() and excess.max() <= 0.25 * (1 + 1e-9), excess.max()


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_reference_solves_are_made_at_ref_tol(monkeypatch):
    """Theorem 6's y_ref is a solve at ref_tol (auto: tol * 1e-3): the first solve is y's at tol, every reference
    solve (also the re-solve made to step to extra times, where its defect is above the target) gets ref_tol, and
    the reference centres are within 10 ref_tol of expm (y's error is ~1e-5)."""
    from lipcheck.wellposed import enclosure as E
    calls, real = [], E.piecewise_quartic

    def spy(*args, **kw):
        calls.append((kw.get("tol"), kw.get("step_times")))
        return real(*args, **kw)

    monkeypatch.setattr(E, "piecewise_quartic", spy)
    A, x0 = _linear_case()
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-5)
    rt = enc.stats["ref_tol"]
    assert rt == pytest.approx(1e-8) and calls[0] == (1e-5, None) and len(calls) >= 3  # this case re-solves
    assert all(tol == rt for tol, _ in calls[1:]) and calls[-1][1] is not None
    times = calls[-1][1]
    ends = {b for _, b in enc.reference.steps}
    assert set(times) <= ends and len(enc.reference.steps) >= len(times)  # the re-solve steps to every time given
    ex = _expm_solution(A, x0, enc.t.tolist())
    err_ref = np.linalg.norm(ex - enc.reference.center.reshape(len(enc.t), 2, -1).numpy(), axis=-1)
    err_y = np.linalg.norm(ex - enc.center.reshape(len(enc.t), 2, -1).numpy(), axis=-1)
    assert err_ref.max() <= 10 * rt and err_ref.max() < 1e-3 * err_y.max(), (err_ref.max(), err_y.max())


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_summary_reports_distance_and_reference_radius_at_t1():
    """summary() of the reference method: distance_t1 is the last row of .distance (the proven sup ||y - y_ref||),
    r_ref_t1 the reference radius there, and radius_t1 their sum rounded up (Theorem 6: r = D + r_ref, times
    1 + 4u), method_kind 'reference' with its ref_tol, the step counts of y; the direct method has no distance."""
    A, x0 = _linear_case()
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-4, ref_tol=1e-7)
    s = enc.summary()
    assert s["distance_max"] == enc.distance.amax(0).tolist()
    assert s["radius_last_interval"] == enc.radius[-1].tolist() and s["radius_t1"] == enc.radius_t1.tolist()
    assert s["r_ref_t1"] == enc.reference.radius_t1.tolist()
    want = enc.distance + enc.reference.radius  # rounded to nearest
    assert (enc.radius >= want).all() and (enc.radius <= want * (1 + 8 * U)).all()
    # at t1 itself: point bounds, each no larger than its interval's sup
    want_t1 = torch.tensor(s["distance_t1"], dtype=D) + enc.reference.radius_t1
    assert (enc.radius_t1 >= want_t1).all() and (enc.radius_t1 <= want_t1 * (1 + 8 * U)).all()
    assert (torch.tensor(s["distance_t1"], dtype=D) <= enc.distance[-1]).all()
    assert (enc.reference.radius_t1 <= enc.reference.radius[-1]).all()
    assert all(d > 0 for d in s["distance_t1"])
    yr = enc.reference.center[-1].reshape(2, -1).numpy()
    assert (np.linalg.norm(enc.center[-1].reshape(2, -1).numpy() - yr, axis=-1) <= s["distance_t1"]).all()
    assert s["method_kind"] == "reference" and s["ref_tol"] == 1e-7 and s["tol"] == 1e-4
    # the step counts are y's (the user's solve); the reference's are under "reference"
    assert s["steps"] == s["accepted"] == len(enc.steps) == len(s["step_sizes"]) < s["reference"]["steps"]
    from lipcheck.wellposed import quartic as E
    _, _, mine = E.piecewise_quartic(LinearField(A), x0, 1.0, tol=1e-4)  # the user's solve, repeated here
    assert (s["nfe_forward"], s["nfe_dense_output"]) == (mine["nfe_forward"], mine["nfe_dense_output"])
    assert s["nfe_dense_output"] < s["reference"]["nfe_dense_output"] and s["rejected"] == mine["rejected"]
    ref = enc.reference
    assert s["reference"] == {k: ref.stats[k] for k in ("nfe_forward", "nfe_dense_output", "accepted", "rejected",
                                                         "steps", "fine_points", "lognorm_points")}
    assert s["stiffness"] == ref.stats["stiffness"] and s["reason"] == enc.reason == [None, None]
    # Theorem 6 exactly as written: radius = (D + r_ref) (1 + 4u); the tube, log-norms and defects are y_ref's
    assert torch.equal(enc.radius, (enc.distance + ref.radius) * (1 + 4 * U))
    for name in ("t", "proven", "tube", "mu", "mu_point", "defect", "defect_sampled"):
        assert torch.equal(getattr(enc, name), getattr(ref, name)), name
    sec = s["seconds"]
    assert set(sec) == {"solve", "reference", "reference_parts", "distance", "defect", "lognorm", "total"}
    assert sec["reference_parts"] == ref.stats["seconds"] and (sec["defect"], sec["lognorm"]) == \
        (ref.stats["seconds"]["defect"], ref.stats["seconds"]["lognorm"])
    assert min(sec["solve"], sec["reference"], sec["distance"]) >= 0
    assert sec["solve"] + sec["reference"] + sec["distance"] <= sec["total"]  # disjoint spans of the run
    direct = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-4, ref_tol=None).summary()
    assert "method_kind" not in direct and "ref_tol" not in direct
    assert direct["distance_t1"] is None and direct["radius_t1"] == direct["radius"][0][-1:] + direct["radius"][1][-1:]


def test_distance_keeps_a_whole_piece_whose_bound_is_within_one_percent():
    """proofs/S5.md, Theorem 6: pieces are halved only while the Bernstein bound exceeds the largest node value by
    more than 1 %. y - y_ref = (1 + 0.02 s (1 - s)) e: nodes' largest value 1.005 (at s = 1/2, also the true sup),
    Bernstein coefficients 1 + 0.02 (j/4 - j (j - 1)/12), largest 1 + 0.02/3 (exact rationals): within 1 %, so the
    proven distance is that whole-step bound plus the rounding allowance (< 1e-12), not a halved, tighter one."""
    from fractions import Fraction as Fr
    from lipcheck.wellposed import distance as E
    e = torch.tensor([0.6, 0.0, 0.8], dtype=D)
    pc = [1.0, 0.02, -0.02, 0.0, 0.0]
    c = torch.stack([v * e for v in pc]).reshape(5, 1, 1, 1, 3)
    steps = [(0.0, 1.0)]
    dist, _, _ = E._distance(steps, [c], dict(steps=steps, coefs=[torch.zeros_like(c)], spans=[(0, 0, 8, 8)]), D)
    a = [Fr(x) for x in pc]
    bern = max(sum(Fr(math.comb(j, k), math.comb(4, k)) * a[k] for k in range(j + 1)) for j in range(5))
    bmax = float(bern) * float(e.norm())
    assert 0 <= float(dist[1, 0]) - bmax <= 1e-12, (float(dist[1, 0]), bmax)
    assert float(dist[1, 0]) <= 1.01 * 1.005 and float(dist[0, 0]) == pytest.approx(1.0, abs=1e-12)


def _mp_recurrence(r0, d, tau, mu):
    """Theorem 5's scalar recurrence at 50 digits: r_{i+1} = r_i e^{mu tau} + d_i tau phi(mu tau), phi(z) = (e^z - 1)/z
    (phi(0) = 1); returns every r_i, the start included."""
    with mpmath.workdps(50):
        z = mpmath.mpf(mu) * mpmath.mpf(tau)
        phi = mpmath.expm1(z) / z if mu != 0 else mpmath.mpf(1)
        out = [mpmath.mpf(r0)]
        for di in d:
            out.append(out[-1] * mpmath.exp(z) + mpmath.mpf(di) * mpmath.mpf(tau) * phi)
    return out


def test_propagate_is_the_scalar_recurrence_in_ball_arithmetic():
    """_propagate against the recurrence at 50 digits (mpmath): the end ball contains r_n and the sup is the largest
    r_i, the start included (it is the largest where mu < 0 and the defect is small), rounded up by at most 1e-14."""
    from lipcheck.wellposed import recurrence as E
    flint = E._arb()
    d = [1e-3, 5e-4, 2e-3, 0.0]
    for mu, r0, tau in ((0.7, 1e-6, 0.05), (-3.0, 1e-2, 0.1), (0.0, 1e-6, 0.05), (12.0, 0.0, 0.2)):
        end, sup = E._propagate(flint, flint.arb(r0), d, tau, mu)
        want = _mp_recurrence(r0, d, tau, mu)
        lo, hi = mpmath.mpf(float(end.lower())), mpmath.mpf(float(end.upper()))
        assert lo <= want[-1] * (1 + 1e-15) and want[-1] * (1 - 1e-15) <= hi and hi - lo <= 1e-13 * want[-1]
        top = max(want)
        s = mpmath.mpf(float(sup.upper()))
        assert top <= s <= top * (1 + 1e-14), (mu, float(top), float(s))
    _, sup = E._propagate(flint, flint.arb(1e-2), [1e-6], 0.1, -3.0)
    assert float(sup.upper()) >= 1e-2  # the start counts


class _CurvField:
    """A field object for _mu_bar / _bootstrap: curvature(v) = k0 + k1 / (v + 1), finite also at v = 0."""

    def __init__(self, k0, k1=0.0, uses_variance=False):
        self.k0, self.k1, self.uses_variance = k0, k1, uses_variance

    def curvature(self, v):
        return self.k0 + self.k1 / (v + 1.0)


def test_bootstrap_failure_names_the_smallest_and_the_largest_tube():
    """Where every tube fails, the reason says how the smallest failed (the error bound above it, from the first
    sub-interval end where it left it) as well as the largest (which here leaves the variance region): a reason that
    quotes only the largest hides where the check first failed."""
    from lipcheck.wellposed import recurrence as E
    flint = E._arb()
    d, tau, r0, lam = [1e-3, 2e-3, 1e-3], 0.1, 1e-5, 0.4
    var = _CurvField(5e3, 0.0, uses_variance=True)
    out = E._bootstrap(flint, var, flint.arb(r0), d, tau, lam, 0.05, 1e-4, 4, None, None)
    s0 = float(max(_mp_recurrence(r0, d, tau, lam + 5e3 * 1e-4)))
    assert not out["ok"]
    small, large = out["why"].split(" at the smallest tube tried; at the largest, ")
    assert small.startswith("tube check failed") and f"tube radius {2 * s0:.3g}" in small
    assert "leaves the region of token variance" in large and out["mu"] == math.inf
    ups = _mp_recurrence(r0, d, tau, lam + 5e3 * (2 * s0 + 1e-4))
    assert out["first"] == next(j for j, x in enumerate(ups) if x > 2 * s0)


def test_mu_bar_is_lemma_2_rounded_up():
    """mu over the tube = lam_hat + M2(v) (rho + drift) (Lemma 2), rounded up (by at most 1e-14), v = s^2 the token
    variance floor of the tube, s = std floor - (rho + drift) / sqrt(C); no bound (inf) once s <= 0 (s = 0 exactly
    here); -inf stays -inf (a refuted claim); a field without LayerNorm takes v = 0."""
    from lipcheck.wellposed import recurrence as E
    f = _CurvField(2.0, 1.0, uses_variance=True)
    mu, v = E._mu_bar(f, 0.3, 0.5, 0.25, 0.375, 4)  # s = 0.5 - 0.625 / 2 = 0.1875
    assert v == 0.1875 ** 2
    with mpmath.workdps(50):
        want = 0.3 + (2 + 1 / (mpmath.mpf(v) + 1)) * mpmath.mpf(0.625)
    assert want <= mu <= want * (1 + 1e-14)
    assert E._mu_bar(f, 0.3, 0.3125, 0.25, 0.375, 4) == (math.inf, 0.0)  # s = 0: no variance floor
    assert E._mu_bar(f, 0.3, 0.3, 0.25, 0.375, 4) == (math.inf, 0.0)
    assert E._mu_bar(f, -math.inf, 0.5, 0.25, 0.375, 4)[0] == -math.inf
    mu0, v0 = E._mu_bar(_CurvField(2.0, 1.0), -0.5, 0.0, 0.25, 0.375, 4)
    assert v0 == 0.0 and -0.5 + 3.0 * 0.625 <= mu0 <= (-0.5 + 3.0 * 0.625) * (1 + 1e-14)


def test_bootstrap_accepts_the_first_tube_that_holds_and_records_the_last_it_tried():
    """_bootstrap (mu = lam + K (rho + drift) over the tube): the first tube of its ladder is twice the sup of the
    error bound at rho = 0; with K = 0 it holds (accepted: rho, mu = lam rounded up, the end ball and sup of the
    recurrence at 50 digits); where no tube of the ladder 2 s0 4^i (i < 8) holds, the record keeps the largest one
    and the log-norm over it; max_tube caps the ladder; a given tube is the only one tried; a non-finite start and a
    lost variance floor are refused with the reason."""
    from lipcheck.wellposed import recurrence as E
    flint = E._arb()
    d, tau, r0, lam = [1e-3, 2e-3, 1e-3], 0.1, 1e-5, 0.4
    ok = E._bootstrap(flint, _CurvField(0.0), flint.arb(r0), d, tau, lam, 1.0, 0.0, 4, None, None)
    rec = _mp_recurrence(r0, d, tau, ok["mu"])
    assert ok["ok"] and lam <= ok["mu"] <= lam * (1 + 1e-14)
    assert ok["rho"] == pytest.approx(2 * float(max(rec)), rel=1e-14) and ok["sup"] <= ok["rho"]
    assert ok["sup"] == pytest.approx(float(max(rec)), rel=1e-14)
    assert float(ok["r_end"].lower()) <= float(rec[-1]) * (1 + 1e-15) <= float(ok["r_end"].upper()) * (1 + 2e-15)
    # a large curvature: every tube of the ladder fails, the record is the last one tried
    K, drift = 5e3, 1e-4
    bad = E._bootstrap(flint, _CurvField(K), flint.arb(r0), d, tau, lam, 1.0, drift, 4, None, None)
    s0 = float(max(_mp_recurrence(r0, d, tau, lam + K * drift)))
    assert not bad["ok"] and "tube check failed" in bad["why"]
    assert bad["rho"] == pytest.approx(2 * s0 * 4 ** 7, rel=1e-12)
    assert bad["mu"] == pytest.approx(lam + K * (bad["rho"] + drift), rel=1e-14)
    assert bad["mu"] >= lam + K * (bad["rho"] + drift)
    capped = E._bootstrap(flint, _CurvField(K), flint.arb(r0), d, tau, lam, 1.0, drift, 4, None, 1e-3)
    assert not capped["ok"] and capped["rho"] == 1e-3
    assert capped["mu"] == pytest.approx(lam + K * (1e-3 + drift), rel=1e-14)
    # a cap above the first tube changes nothing
    same = E._bootstrap(flint, _CurvField(0.0), flint.arb(r0), d, tau, lam, 1.0, 0.0, 4, None, 1.0)
    assert same["ok"] and same["rho"] == ok["rho"]
    fixed = E._bootstrap(flint, _CurvField(0.0), flint.arb(r0), d, tau, lam, 1.0, 0.0, 4, 1e-6, None)
    assert not fixed["ok"] and fixed["rho"] == 1e-6  # below the error bound (~2e-4): the given tube fails
    assert E._bootstrap(flint, _CurvField(0.0), flint.arb(r0), d, tau, lam, 1.0, 0.0, 4, 1e-2, None)["rho"] == 1e-2
    inf = E._bootstrap(flint, _CurvField(0.0), flint.arb(math.inf), d, tau, lam, 1.0, 0.0, 4, None, None)
    assert not inf["ok"] and "not finite" in inf["why"]
    var = _CurvField(1.0, 1.0, uses_variance=True)
    lost = E._bootstrap(flint, var, flint.arb(r0), d, tau, lam, 0.1, 0.2, 4, None, None)  # 0.1 - 0.2 / 2 = 0
    assert not lost["ok"] and "variance floor lost" in lost["why"] and "rho" not in lost
    # the floor holds at rho = 0 but a tube of radius 0.5 leaves it: recorded with an infinite log-norm
    out = E._bootstrap(flint, var, flint.arb(r0), d, tau, lam, 0.3, 0.1, 4, 0.5, None)
    assert not out["ok"] and "token variance" in out["why"] and out["rho"] == 0.5 and out["mu"] == math.inf


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_piecewise_quartic_takes_the_dense_output_at_the_quarter_nodes():
    """piecewise_quartic on x' = A x: the steps tile [0, t1]; with grid_steps = 8 each is at most t1 / 8 long and every
    multiple of t1 / 8 is a step end; each step's quartic takes the solver's dense output (lipcheck's integrate
    asked here for the times a + h (0, 1/4, 1/2, 3/4, 1)) at its nodes and is within 10 tol of expm between them;
    the counts are the solver's (both passes take the same steps)."""
    from lipcheck.models.ode import integrate
    from lipcheck.wellposed import quartic as E
    A, x0 = _linear_case()
    f = LinearField(A)
    tol = 1e-6
    free, _, st0 = E.piecewise_quartic(f, x0, 1.0, tol=tol)
    steps, coefs, st = E.piecewise_quartic(f, x0, 1.0, tol=tol, grid_steps=8)
    for ss in (free, steps):
        assert ss[0][0] == 0.0 and ss[-1][1] == 1.0 and all(b == a for (_, b), (a, _) in zip(ss, ss[1:]))
    assert len(free) < 8 <= len(steps) and max(b - a for a, b in steps) <= 1 / 8 + 1e-15
    ends = np.array([b for _, b in steps])
    assert all(np.abs(ends - j / 8).min() <= 1e-15 for j in range(1, 9))
    assert st["steps"] == st["accepted"] == len(steps) and st0["steps"] == len(free)
    assert st["nfe_forward"] == st["nfe_dense_output"] >= 6 * st["accepted"] and st["rejected"] >= 0
    nodes = np.array([0.0, 0.25, 0.5, 0.75, 1.0])
    times = torch.tensor(np.unique(np.concatenate([a + (b - a) * nodes for a, b in steps])), dtype=D)
    with torch.no_grad():
        dense = integrate(lambda t, x: f(x), x0, times, method="dopri5", rtol=tol, atol=tol,
                          options={"step_t": torch.linspace(0.0, 1.0, 9, dtype=D)[1:]})
    for (a, b), c in zip(steps, coefs):
        for sg in nodes:
            k = int(torch.argmin((times - (a + (b - a) * sg)).abs()))
            q = sum(c[j] * sg ** j for j in range(5))
            assert torch.allclose(q, dense[k], rtol=0, atol=1e-13)
        s = np.linspace(0.0, 1.0, 7)
        q = np.stack([sum(c[j].reshape(2, -1).numpy() * v ** j for j in range(5)) for v in s])
        ex = _expm_solution(A, x0, (a + (b - a) * s).tolist())
        assert np.abs(q - ex).max() <= 10 * tol


def test_quartic_helpers_against_numpy():
    """_poly (d-th derivative in t of the step's quartic), _coef_sup (sum_k k!/(k-d)! ||c_k|| / h^d, the bound
    _bern_sup never exceeds), _token_speed (per token sup ||y_i'||: at least the sampled speed, and exact where y' is
    affine in s), _sampled_defect (max ||y' - F(y)|| at s = 1/8, 3/8, 5/8, 7/8 of every step), numpy's polynomials."""
    from lipcheck.wellposed import quartic as E
    g = torch.Generator().manual_seed(21)
    h = 0.4
    c = torch.randn(5, 2, 1, 2, 3, generator=g, dtype=D)
    cn = c.reshape(5, 2, -1).numpy()
    s = np.linspace(0.0, 1.0, 11)
    for d in range(5):
        got = E._poly(c, torch.tensor(s, dtype=D), h, d).reshape(11, 2, -1).numpy()
        want = np.stack([np.stack([np.polynomial.polynomial.polyval(s, np.polynomial.polynomial.polyder(cn[:, b, i], d))
                                   for i in range(6)], -1) for b in range(2)], 1) / h ** d
        assert np.allclose(got, want, rtol=1e-13, atol=1e-12), d
        norms = [np.linalg.norm(cn[k], axis=-1) for k in range(5)]
        cs = sum(math.factorial(k) // math.factorial(k - d) * norms[k] for k in range(d, 5)) / h ** d
        assert np.allclose(E._coef_sup([torch.tensor(x) for x in norms], h, d).numpy(), cs, rtol=1e-14)
    fine = np.linspace(0.0, 1.0, 2001)
    d1 = E._poly(c, torch.tensor(fine, dtype=D), h, 1).reshape(2001, 2, 2, 3).norm(dim=-1).amax(0)  # (B, N)
    sp = E._token_speed(c, h)
    assert sp.shape == (2, 2) and (sp >= d1).all()
    lin = c.clone()
    lin[3:] = 0  # y' affine in s: its norm is largest at an end of the step
    ends = E._poly(lin, torch.tensor([0.0, 1.0], dtype=D), h, 1).norm(dim=-1).flatten(2).amax(0)
    assert torch.allclose(E._token_speed(lin, h), ends, rtol=1e-13, atol=0)
    A, _ = _linear_case(n=6)
    f = LinearField(A)
    steps = [(0.0, h), (h, 1.0)]
    coefs = [c.reshape(5, 2, 1, 1, 6), torch.randn(5, 2, 1, 1, 6, generator=g, dtype=D)]
    want = 0.0
    for (a, b), cf in zip(steps, coefs):
        for sg in (0.125, 0.375, 0.625, 0.875):
            p = cf.reshape(5, 2, 6).numpy()
            y = sum(p[k] * sg ** k for k in range(5))
            dy = sum(k * p[k] * sg ** (k - 1) for k in range(1, 5)) / (b - a)
            want = max(want, np.linalg.norm(dy - y @ A.T, axis=-1).max())
    assert E._sampled_defect(f, steps, coefs) == pytest.approx(want, rel=1e-12)


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_bad_enclosure_settings_are_refused():
    """Every documented range of _check_inputs: a 4-d finite x0, a positive finite t1, positive finite tube and
    max_tube (or None), positive finite defect_ratio and mu_slack, 0 < ref_tol < tol; the boundary values themselves
    are refused."""
    A, x0 = _linear_case()
    f = LinearField(A)
    bad = [(dict(x0=x0[0]), "x0"), (dict(t1=math.inf), "t1"), (dict(t1="1"), "t1"), (dict(tube=0.0), "tube"),
           (dict(max_tube=0.0), "max_tube"), (dict(max_tube=math.inf), "max_tube"), (dict(tube=math.nan), "tube"),
           (dict(defect_ratio=0.0), "defect_ratio"), (dict(defect_ratio=math.inf), "defect_ratio"),
           (dict(mu_slack=0.0), "mu_slack"), (dict(mu_slack=math.nan), "mu_slack"), (dict(tol=0.0), "tol")]
    for kw, name in bad:
        args = dict(x0=x0, t1=1.0) | kw
        with pytest.raises(ValueError, match=name):
            wp.enclose_field(f, args.pop("x0"), args.pop("t1"), **args)
    for rt in (0.0, -1e-9, 1e-6, math.nan, "1e-9"):  # ref_tol: 'auto', None or 0 < ref_tol < tol
        with pytest.raises(wp.EnclosureError, match="ref_tol"):
            wp.enclose_field(f, x0, 1.0, tol=1e-6, ref_tol=rt)
    ok = wp.enclose_field(f, x0, 1, tol=1e-4, ref_tol=None, max_per_step=8)  # an int t1, the smallest max_per_step
    assert ok.proven.all() and float(ok.t[-1]) == 1.0


def test_bernstein_matrix_is_the_exact_rational_one():
    """_bernstein_matrix() (also when called again, not only the copy made at import) equals the matrix built here
    in exact rationals: values at s = 0, 1/4, 1/2, 3/4, 1 -> Bernstein coefficients; rows sum to 1 (a constant's
    coefficients are that constant) and its end rows pick the end values."""
    from fractions import Fraction as Fr
    from lipcheck.wellposed import quartic as E
    want = _bernstein_from_values()
    for M in (E._bernstein_matrix(), E._M):
        assert M == want and all(isinstance(x, Fr) for row in M for x in row)
    assert all(sum(row) == 1 for row in want) and want[0] == [1, 0, 0, 0, 0] and want[4] == [0, 0, 0, 0, 1]


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_lognorm_envelope_after_a_failure_and_per_sample_perturbations():
    """lognorm_envelope: G(0) = 1; where the enclosure failed (radius inf) there is no envelope (inf), sample by
    sample (a refuted log-norm claim for sample 0 only); for the proven sample of x' = A x it is exp(mu t) within the
    verification margin, for every perturbation size (curvature 0), given per sample."""
    A, x0 = _linear_case()
    mu = _lam_max(A)
    claim = lambda y: torch.tensor([mu - 0.05, mu + 0.05], dtype=D)  # noqa: E731
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-5, ref_tol=None, mu_claim=claim)
    assert enc.proven.tolist() == [False, True]
    G = wp.lognorm_envelope(enc, torch.tensor([1e-3, 1e-1], dtype=D))
    assert G.shape == enc.radius.shape and G[0].tolist() == [1.0, 1.0]
    assert torch.isinf(G[1:, 0]).all()
    t = enc.t.numpy()
    known = np.exp((mu + 0.05) * t)  # the claimed log-norm is the one the envelope integrates
    assert (G[:, 1].numpy() >= known * (1 - 1e-12)).all() and np.allclose(G[:, 1].numpy(), known, rtol=1e-6)
    small = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-5, ref_tol=None, tube=1e-14)
    Gs = wp.lognorm_envelope(small, 1e-3)
    assert Gs[0].tolist() == [1.0, 1.0] and torch.isinf(Gs[1:]).all()


def _model_f32(t1=0.25):
    from lipcheck import ViT
    torch.manual_seed(0)
    return ViT("ode", "ssog", dtype=torch.float32, img_size=8, patch_size=4, dim=6, num_heads=2, num_components=2,
               depth=1, num_classes=3, mlp_ratio=2.0, t1=t1).eval()


@pytest.mark.usefixtures("one_thread")
def test_enclose_passes_its_settings_on():
    """enclose(model, ...) with settings off their defaults: the statistics report the tolerance, defect_ratio,
    mu_slack (the reference's own when ref_mu_slack is given), log-norm kind and ref_tol it ran with; a float32 model
    is enclosed in float64 (the default dtype) from input_scale * embed(images), and the enclosure contains a dopri8
    solution at 1e-12 of the float64 model (torchdiffeq), whose token variances stay above the reported floor (and
    within 1% of it: the floor is a standard deviation floor squared)."""
    import torchdiffeq
    model = _model_f32()
    images = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    direct = wp.enclose(model, images, tol=1e-4, ref_tol=None, defect_ratio=0.5, mu_slack=0.5, lognorm="structured",
                        input_scale=0.5, progress=False)
    ref = wp.enclose(model, images, tol=1e-4, ref_tol=1e-7, mu_slack=0.125, ref_mu_slack=0.5, progress=False)
    st = direct.stats
    assert (st["tol"], st["defect_ratio"], st["mu_slack"], st["lognorm"], st["method"]) == \
        (1e-4, 0.5, 0.5, "structured", "dopri5")
    st = ref.stats
    assert (st["tol"], st["ref_tol"], st["mu_slack"], st["lognorm"], st["defect_ratio"]) == \
        (1e-4, 1e-7, 0.5, "dense", 0.25)
    m64 = _model_f32()
    m64.double()
    blk = m64.vector_field.block
    for enc, scale in ((direct, 0.5), (ref, 1.0)):
        assert enc.proven.all() and enc.center.dtype == D
        with torch.no_grad():
            x0 = m64.embed(images.double()) * scale
            truth = torchdiffeq.odeint(lambda t, x: blk.vector_field(x), x0, enc.t, method="dopri8", rtol=1e-12,
                                       atol=1e-12)
        err = (truth - enc.center).flatten(2).norm(dim=-1)
        assert (err <= enc.radius).all() and float(err[0].max()) <= 1e-15 * float(x0.norm())
        # the certified token-variance floor (LayerNorm) is below every token variance along the trajectory
        # and tight: the floor is the squared token-std floor, within 1% of the smallest variance here (~1e-6 measured)
        v_min = float(truth.var(-1, unbiased=False).min())
        assert 0.99 * v_min <= enc.stats["variance_floor"] <= v_min


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_direct_enclosure_statistics_of_a_linear_field():
    """The statistics of a direct enclosure of x' = A x (around a solve of another field), from what they name: step sizes (they add up to t1), the
    Lipschitz constant ||A||_2 and curvature 0 of the field, no variance floor (no LayerNorm), stiffness = max(mu, 0) h
    per step with mu the verified log-norm lambda_max((A + A^T) / 2) (numpy, 1e-9), the fine and log-norm points
    (at least 8 and 2 per step), the solver's counts (dopri5: 6 evaluations per attempted step), the log-norm
    kind 'given' for a field object that is not an SSoGField, and timings (nonnegative parts within the total). The
    sampled defect of each interval is the largest ||y' - A y|| at its sample points, both ends included (numpy on
    the kept quartics)."""
    A, x0 = _linear_case()
    f = LinearField(A)
    # y from x' = (A + I/2) x: a defect ~ ||y||/2 that is largest at an end of the intervals, far above its rounding
    wrong = LinearField(A + 0.5 * np.eye(A.shape[0]))
    enc = wp.enclose_field(f, x0, 1.0, tol=1e-5, ref_tol=None, defect_ratio=0.5, mu_slack=0.125, solver_field=wrong)
    st = enc.stats
    h = np.diff(np.array(enc.steps), axis=1)[:, 0]
    assert st["steps"] == len(enc.steps) == len(st["step_sizes"]) == len(st["stiffness"]) == st["accepted"]
    assert np.allclose(st["step_sizes"], h, rtol=0, atol=0) and abs(sum(st["step_sizes"]) - 1.0) <= 1e-14
    assert st["lipschitz_max"] == f.lipschitz(0.0) and st["curvature_max"] == 0.0 and st["variance_floor"] == 0.0
    lam = max(_lam_max(A), 0.0)
    assert np.allclose(st["stiffness"], lam * h, rtol=1e-9, atol=0) and st["stiffness_max"] == max(st["stiffness"])
    # each step's start log-norm after the first is carried over from the previous step's end (curvature 0 here)
    assert st["lognorm_carried"] == st["steps"] - 1
    assert st["fine_points"] >= 8 * st["steps"] and st["lognorm_points"] + st["lognorm_carried"] >= 2 * st["steps"]
    assert st["nfe_forward"] >= 6 * (st["accepted"] + st["rejected"]) and st["nfe_dense_output"] > 0
    assert (st["method"], st["tol"], st["defect_ratio"], st["mu_slack"], st["lognorm"], st["eigensolves"]) == \
        ("dopri5", 1e-5, 0.5, 0.125, "given", None)
    pieces = enc._pieces
    assert len(pieces["spans"]) == len(enc.t) - 1
    for p, (k, j0, j1, m) in enumerate(pieces["spans"]):
        (a, b), c = pieces["steps"][k], pieces["coefs"][k].reshape(5, 2, -1).numpy()
        s = np.arange(j0, j1 + 1) / m
        y = sum(c[i][None] * s[:, None, None] ** i for i in range(5))
        dy = sum(i * c[i][None] * s[:, None, None] ** (i - 1) for i in range(1, 5)) / (b - a)
        want = np.linalg.norm(dy - y @ A.T, axis=-1).max(0)
        assert np.allclose(enc.defect_sampled[p].numpy(), want, rtol=1e-12, atol=0), p
    sec = st["seconds"]
    assert set(sec) == {"solve", "defect", "lognorm", "total"} and min(sec.values()) >= 0
    assert sec["total"] >= sec["solve"] + sec["defect"] + sec["lognorm"]  # the parts are disjoint spans of the run


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_time_budget_reason_names_the_last_proven_time_and_radius():
    """max_seconds = 0: the reason says up to which time the enclosure holds and with which radius there: the last
    reported time with a finite radius (formatted as in the message), the end of the first step, which the tanh field's
    curvature splits into several log-norm intervals. A budget that is not used up changes nothing."""
    f = TanhField(4, 6, seed=3, scale=1.5)
    x0 = torch.randn(2, 1, 1, 4, generator=torch.Generator().manual_seed(4), dtype=D)
    enc = wp.enclose_field(f, x0, 1.0, tol=1e-5, ref_tol=None, max_seconds=0.0)
    k = int(torch.isfinite(enc.radius[:, 0]).sum()) - 1  # the last finite row
    assert 1 < k < len(enc.t) - 1 and float(enc.t[k]) == enc.steps[0][1]
    for b in range(2):
        assert f"proven on [0, {float(enc.t[k]):.6g}] with radius {float(enc.radius[k, b]):.3g} there" in enc.reason[b]
    # a budget of an hour is not used up by this second-long proof: the whole horizon is proven
    full = wp.enclose_field(f, x0, 1.0, tol=1e-5, ref_tol=None, max_seconds=3600.0)
    assert full.proven.all() and full.reason == [None, None] and torch.isfinite(full.radius).all()


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_time_budget_counts_from_the_call_and_stops_the_reference_refinement(monkeypatch):
    """max_seconds covers the whole call: with max_seconds = 0 no refinement round of the reference solve starts (the
    defect measurement that opens each round is patched to fail the test) and the enclosure loop stops after its
    first step; without a budget the same call does measure. The loop's clock starts where the caller says
    (`DirectOptions.clock_start`): a budget already used up before the loop stops it after its first step."""
    import time

    from lipcheck.wellposed import enclosure as E
    from lipcheck.wellposed.direct import enclose_direct
    from lipcheck.wellposed.options import DirectOptions
    f = TanhField(4, 6, seed=3, scale=1.5)
    x0 = torch.randn(2, 1, 1, 4, generator=torch.Generator().manual_seed(4), dtype=D)

    def measured(*a, **k):
        raise AssertionError("a refinement round started")
    monkeypatch.setattr(E, "_step_defects", measured)
    enc = wp.enclose_field(f, x0, 1.0, tol=1e-4, ref_tol=1e-7, max_seconds=0.0)
    assert not enc.proven.any() and all("time budget of 0 s used up after step 0" in r for r in enc.reason)
    with pytest.raises(AssertionError, match="a refinement round started"):
        wp.enclose_field(f, x0, 1.0, tol=1e-4, ref_tol=1e-7)
    late = DirectOptions(tol=1e-5, max_seconds=50.0, clock_start=time.perf_counter() - 100.0)
    one = enclose_direct(f, x0, 1.0, late)
    assert not one.proven.any() and all("time budget of 50 s used up after step 0" in r for r in one.reason)
    assert enclose_direct(f, x0, 1.0, dataclasses.replace(late, clock_start=None)).proven.all()


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_enclosure_loop_budget_and_lognorm_slack_come_from_the_call(monkeypatch):
    """enclose_field hands the enclosure loop its own start as `clock_start` (direct and reference paths alike), and
    prices the reference's point log-norms (`_lognorm_points`) at the slack that loop uses: ref_mu_slack where
    given, else max(mu_slack, 1 / t1)."""
    import time

    from lipcheck.wellposed import enclosure as E
    f = TanhField(4, 6, seed=3, scale=1.5)
    x0 = torch.randn(2, 1, 1, 4, generator=torch.Generator().manual_seed(4), dtype=D)
    seen = {}

    class Stop(Exception):
        pass

    def loop(field, x0, t1, opts, pieces=None):
        seen["opts"], seen["at"] = opts, time.perf_counter()
        raise Stop
    real_points = E._lognorm_points

    def points(field, steps, coefs, slack):
        seen["slack"] = slack
        return real_points(field, steps, coefs, slack)
    monkeypatch.setattr(E, "enclose_direct", loop)
    monkeypatch.setattr(E, "_lognorm_points", points)
    for kw, slack in ((dict(ref_tol=None), None), (dict(ref_tol=1e-7, ref_mu_slack=0.125), 0.125),
                      (dict(ref_tol=1e-7, mu_slack=0.25), 2.0)):
        seen.clear()
        before = time.perf_counter()
        with pytest.raises(Stop):
            wp.enclose_field(f, x0, 0.5, tol=1e-4, max_seconds=5.0, **kw)
        assert before <= seen["opts"].clock_start <= seen["at"] and seen["opts"].max_seconds == 5.0
        assert seen.get("slack") == slack and (slack is None or seen["opts"].mu_slack == slack)


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_reference_subintervals_follow_ref_defect_abs():
    """ref_defect_abs: the reference enclosure refines its defect sub-intervals until the remainder is below it; at a
    generous 1.0 no step is refined (8 sub-intervals each: fine_points = 8 steps), at the default target (a fraction
    of the rough distance) they are."""
    A, x0 = _linear_case()
    loose = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-4, ref_tol=1e-7, ref_defect_abs=1.0)
    r = loose.stats["reference"]
    assert loose.proven.all() and r["fine_points"] == 8 * r["steps"]
    tight = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-4, ref_tol=1e-7)
    assert tight.stats["reference"]["fine_points"] > 8 * tight.stats["reference"]["steps"]


def test_ssog_field_auto_lognorm_is_dense_up_to_4096_numbers(monkeypatch):
    """lognorm='auto' (enclose's docstring): the dense log-norm when n = H W C <= 4096, the structured one above. The
    field's constants and the dense Jacobian machinery are stubbed here (only the choice is under test: building
    them at n = 4096 takes seconds)."""
    from types import SimpleNamespace
    from lipcheck.wellposed import field as E
    monkeypatch.setattr(E.ln, "field_constants", lambda block, H, W, **kw: SimpleNamespace(C=16))
    monkeypatch.setattr(E.ln, "DenseLogNorm", lambda block, H, W, **kw: ("dense", H * W))
    for H, W, kind in ((16, 16, "dense"), (16, 17, "structured"), (2, 2, "dense")):
        f = E.SSoGField(None, H, W)
        assert f.lognorm_kind == kind and (f._dense is None) == (kind == "structured"), (H, W)
    assert E.SSoGField(None, 2, 2, lognorm="structured")._dense is None


def test_piecewise_quartic_refuses_steps_that_stop_short_of_t1(monkeypatch):
    """If the solver's recorded steps do not reach t1 (the last accepted step lost here, in both passes), there is no
    piecewise quartic on [0, t1]: an EnclosureError that says so, not a shorter y."""
    import lipcheck.models.ode as ode
    from lipcheck.wellposed import quartic as E
    real = ode.integrate

    def short(field, *args, **kw):
        out = real(field, *args, **kw)
        field.steps.pop()
        return out

    monkeypatch.setattr(ode, "integrate", short)
    A, x0 = _linear_case()
    with pytest.raises(wp.EnclosureError, match="do not end on t1"):
        E.piecewise_quartic(LinearField(A), x0, 1.0, tol=1e-4)


def test_rayleigh_lower_without_a_jacobian_method_uses_the_dense_jacobian():
    """SSoGField has no jacobian(): rayleigh_lower takes the block's dense Jacobian. Its value is an attained
    Rayleigh quotient of the symmetric part less the rounding allowance, so below lambda_max((J + J^T) / 2) of the
    autograd Jacobian and within 1e-10 of it."""
    from lipcheck import ViT
    from lipcheck.wellposed import field as E
    torch.manual_seed(4)
    model = ViT("ode", "ssog", dtype=D, img_size=8, patch_size=4, dim=8, num_heads=2, num_components=2, depth=1)
    block = model.vector_field.block
    field = E.SSoGField(block, 2, 2)
    assert not hasattr(field, "jacobian")
    y = torch.randn(2, 2, 2, 8, dtype=D, generator=torch.Generator().manual_seed(1))
    lo = E.rayleigh_lower(field, y, 0.0)
    for b in range(2):
        J = torch.autograd.functional.jacobian(lambda z: block.vector_field(z[None])[0], y[b]).reshape(32, 32)
        top = float(torch.linalg.eigvalsh((J + J.T) / 2).max())
        assert top - 1e-10 * (1 + abs(top)) <= float(lo[b]) <= top


# ------------------------------------------------ the direct proof on hand-made pieces, pass-through of settings

class _StubField:
    """F = 0 with chosen constants: Lipschitz constant L, curvature K, evaluation error eps_F per sample (largest at
    the sample point 3 of every step, half that elsewhere) and point log-norms lam per sample. On piecewise-constant
    y the sampled defect is 0, so Theorem 5's defect is the rounding terms alone: eps_F + L gamma_10 sum_k |c_k|."""

    def __init__(self, L, eps_F, lam, K=0.0, uses_variance=False):
        self.L, self.K, self.uses_variance = L, K, uses_variance
        self.eps_F, self.lam = torch.tensor(eps_F, dtype=D), torch.tensor(lam, dtype=D)

    def __call__(self, x):
        return torch.zeros_like(x)

    def lipschitz(self, v):
        return self.L

    def curvature(self, v):
        return self.K

    def rounding(self, y, v):
        B = len(self.eps_F)
        scale = torch.full((y.shape[0] // B, 1), 0.5, dtype=D)
        scale[3] = 1.0
        return (scale * self.eps_F).reshape(-1), 0.0

    def lognorm(self, y, v, eps_J):
        return self.lam.clone()


def _constant_pieces(values, steps):
    """Piecewise-constant y: on step k the quartic with c_0 = values[k] and c_1..c_4 = 0; solver counts as given."""
    coefs = []
    for v in values:
        c = torch.zeros(5, *v.shape, dtype=D)
        c[0] = v
        coefs.append(c)
    return steps, coefs, dict(nfe_forward=17, nfe_dense_output=5, accepted=len(steps), rejected=1)


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_direct_enclosure_of_hand_made_pieces_is_theorem_5_to_the_last_term():
    """_enclose_direct (at its default settings) on a piecewise-constant y of the field F = 0, re-derived at 50 digits:
    r(0) = ||x0 - y(0)|| + gamma_10 sum|c_k| (the evaluation error of y, proofs/S5.md Lemma 4; here x0 = y(0)); each
    sub-interval's defect is (eps_F + L gamma_10 sum|c_k|) (1 + gamma_16) (no sampled defect, no remainder); at a
    step end r grows by the jump ||c_{k+1,0} - sum_j c_{k,j}|| plus both steps' evaluation errors; on each step
    (one log-norm interval: curvature 0) r follows R_{j+1} = R_j e^{mu tau} + d tau phi(mu tau) over the 8
    sub-intervals with mu = the point log-norm rounded up by 1 + gamma_8, the tube is twice the interval's sup.
    A token of sample 0 loses all variance on the last step: not proven from there, with the reason naming the
    check, its numbers and the interval. The statistics echo the pieces' solver counts and the defaults."""
    from lipcheck.wellposed import direct as E
    flint = E._arb()
    mpmath.mp.dps = 50
    u = mpmath.mpf(2) ** -53
    gam = lambda n: n * u / (1 - n * u)  # noqa: E731
    v = torch.tensor([[0.5, -1.25, 2.0], [1.5, 0.75, -0.5]], dtype=D).reshape(2, 1, 1, 3)
    w = torch.tensor([[0.0, 0.0, 0.0], [0.25, -0.5, 0.75]], dtype=D).reshape(2, 1, 1, 3) / 1024  # a jump, exact
    last = v + w
    last[0] = 1.0  # sample 0: one token of variance 0 on the last step
    steps = [(0.0, 0.25), (0.25, 0.5), (0.5, 1.0)]
    pieces = _constant_pieces([v, v, last], steps)
    L, eps_F, lam = 2.0, [0.0, 1e-14], [0.0, 0.75]
    enc = E._enclose_direct(_StubField(L, eps_F, lam, uses_variance=True), v.clone(), 1.0, pieces=pieces)
    assert enc.t.tolist() == [0.0, 0.25, 0.5, 1.0]
    assert torch.equal(enc.center, torch.stack([v, v, v, last]))
    nrm = lambda x: mpmath.sqrt(mpmath.fsum(mpmath.mpf(float(a)) ** 2 for a in x.reshape(-1)))  # noqa: E731
    ev = gam(10)
    for b in range(2):
        vals = [v[b], v[b], last[b]]
        d = [(eps_F[b] + L * ev * nrm(x)) * (1 + gam(16)) for x in vals]  # per sub-interval, constant on a step
        r = ev * nrm(v[b])
        assert abs(mpmath.mpf(float(enc.radius[0, b])) - r) <= 1e-15 * r
        for k, (a, bk) in enumerate(steps):
            if b == 0 and k == 2:
                break
            if k > 0:
                r += nrm(vals[k] - vals[k - 1]) * (1 + gam(8)) + ev * (nrm(vals[k - 1]) + nrm(vals[k]))
            mu = float(enc.mu[k, b])
            # after the first step the start's log-norm is the previous end's carried over (rounded up once more)
            twice = 2 if k else 1
            assert lam[b] <= mu and abs(mu - lam[b] * (1 + gam(8)) ** twice) <= twice * 1.2e-16 * (1 + lam[b])
            R = _mp_recurrence(r, [d[k]] * 8, (bk - a) / 8, mu)
            got = mpmath.mpf(float(enc.radius[k + 1, b]))
            assert max(R) <= got <= max(R) * (1 + 1e-14), (b, k, float(got), float(max(R)))
            assert float(enc.tube[k, b]) == 2 * float(enc.radius[k + 1, b])
            assert abs(mpmath.mpf(float(enc.defect[k, b])) - d[k]) <= 2e-16 * d[k], (b, k)
            r = R[-1]
    assert enc.proven.tolist() == [False, True] and enc.reason[1] is None
    assert enc.reason[0] == ("token variance floor lost: std floor 0 - drift 0/sqrt(C) <= 0, no curvature bound "
                             "(interval [0.5, 1], step 2)")
    assert math.isinf(enc.radius[3, 0]) and math.isnan(enc.tube[2, 0]) and math.isnan(enc.mu[2, 0])
    assert (enc.defect_sampled == 0).all() and enc.mu_point.tolist() == [lam] * 4
    st = enc.stats
    assert (st["method"], st["tol"], st["defect_ratio"], st["mu_slack"], st["lognorm"], st["eigensolves"]) == \
        ("dopri5", 1e-3, 0.25, 0.25, "given", None)
    assert (st["nfe_forward"], st["nfe_dense_output"], st["accepted"], st["rejected"], st["steps"]) == (17, 5, 3, 1, 3)
    assert (st["fine_points"], st["lognorm_points"], st["lognorm_carried"], st["lipschitz_max"], st["curvature_max"]) \
        == (24, 4, 2, L, 0.0)
    # (the later steps' start log-norms are the carried ones, rounded up once more)
    assert st["stiffness"] == pytest.approx([0.75 * 0.25, 0.75 * 0.25, 0.75 * 0.5], rel=3e-15, abs=0)
    assert st["stiffness_max"] == max(st["stiffness"])
    assert st["step_sizes"] == [0.25, 0.25, 0.5] and st["variance_floor"] == 0.0
    # the envelope integrates the same log-norms: exp(sum mu tau), each factor rounded up
    G = wp.lognorm_envelope(enc, 1e-3)
    assert G.dtype == D and G[:, 0].tolist()[:1] == [1.0] and torch.isinf(G[3, 0])
    want = np.exp(np.cumsum([0.0] + [float(enc.mu[k, 1]) * (b - a) for k, (a, b) in enumerate(steps)]))
    assert (G[:, 1].numpy() >= want).all() and np.allclose(G[:, 1].numpy(), want, rtol=1e-14, atol=0)
    assert 1.0 < float(G[1, 0]) < float(G[2, 0]) <= 1 + 4e-15  # mu = 0: only the rounding up


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_direct_enclosure_log_norm_intervals_and_a_last_step_past_the_budget():
    """The log-norm grid of a step has P = 2^ceil(log2 ceil(M2 speed h / (2 mu_slack))) intervals (Theorem 5: the
    drift term M2 * drift stays below mu_slack): a straight piece y = v + s w at token speed ||w_i|| / h and curvature
    K with K max||w_i|| h / (2 mu_slack) = 2.5 gets 4. A time budget used up on the last step stops nothing: the
    whole horizon is proven."""
    from lipcheck.wellposed import direct as E
    v = torch.tensor([[0.5, -1.25, 2.0], [1.5, 0.75, -0.5]], dtype=D).reshape(2, 1, 1, 3)
    wv = torch.tensor([[1.0, 2.0, 2.0], [0.0, 0.6, 0.8]], dtype=D).reshape(2, 1, 1, 3) / 64  # token speeds 3/64, 1/64
    c = torch.zeros(5, 2, 1, 1, 3, dtype=D)
    c[0], c[1] = v, wv
    K = 2.5 * 2 * 0.25 / (3 / 64)
    pieces = ([(0.0, 1.0)], [c], dict(nfe_forward=1, nfe_dense_output=1, accepted=1, rejected=0))
    enc = E._enclose_direct(_StubField(0.0, [0.0, 0.0], [0.0, 0.0], K=K), v.clone(), 1.0, pieces=pieces)
    assert bool(enc.proven[1]), enc.reason  # (sample 0's defect 3/64 outgrows its tube on the last interval)
    assert len(enc.t) == 5 and np.allclose(enc.t.numpy(), np.linspace(0, 1, 5), rtol=0, atol=1e-15)
    assert enc.stats["lognorm_points"] == 5
    # the envelope with curvature: on each interval the perturbed trajectory stays in the tube of radius
    # r + eps G(end) around y, over which mu <= lam + K (r + eps G(end) + drift); G grows at least by exp(mu tau)
    eps = 1e-2
    G = wp.lognorm_envelope(enc, eps)[:, 1].tolist()
    for p, iv in enumerate(enc._envelope_data["intervals"]):
        rho = float(enc.radius[p + 1, 1]) + eps * G[p + 1]
        mu = iv["lam"][1] + K * (rho + iv["drift"][1])
        assert G[p + 1] >= G[p] * math.exp(mu * iv["tau"]), p
        assert G[p + 1] <= G[p] * math.exp(mu * iv["tau"]) * 1.05, p  # and not far above it
    # exactly on an integer: K speed h / (2 mu_slack) = (5/64) / (2 * 5/256) = 2 with the per-token speed the
    # coefficient sum sum_k k ||c_k,i|| / h (exact here: ||(0, 3, 4) / 64|| = 5/64), so P = 2 intervals, not 4
    c[1] = torch.tensor([0.0, 3.0, 4.0], dtype=D) / 64
    two = E._enclose_direct(_StubField(0.0, [0.0, 0.0], [0.0, 0.0], K=1.0), v.clone(), 1.0, pieces=pieces,
                            mu_slack=5 / 256)
    assert len(two.t) == 3 and two.stats["lognorm_points"] == 3
    one = E._enclose_direct(_StubField(0.0, [0.0, 0.0], [0.0, 0.0]), v.clone(), 1.0, max_seconds=0.0,
                            pieces=_constant_pieces([v], [(0.0, 1.0)]))
    assert one.proven.all() and one.reason == [None, None] and torch.isfinite(one.radius).all()


def test_enclose_hands_every_setting_to_the_field_and_the_proof(monkeypatch):
    """enclose(model, ...) = enclose_field(make_field(block, H, W, lognorm, dtype), input_scale * embed(images), t1, ...)
    with every setting passed on unchanged (both stubbed here: only the hand-over is under test)."""
    from lipcheck.wellposed import enclosure as E
    seen = {}
    monkeypatch.setattr(E, "make_field", lambda block, H, W, **kw: seen.update(field=(block, H, W, kw)) or "field")
    monkeypatch.setattr(E, "enclose_field", lambda *args, **kw: seen.update(args=args, kw=kw) or "enclosure")
    model = _tiny_ode_vit()
    images = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=D)
    settings = dict(method="bosh3", tol=1e-4, ref_tol=1e-7, defect_ratio=0.5, mu_slack=0.125, max_per_step=64,
                    tube=1e-3, max_tube=1e-2, ref_defect_ratio=0.05, ref_mu_slack=0.375, ref_max_per_step=16,
                    ref_defect_abs=1e-9, max_seconds=30.0, max_work=12345.0)
    assert wp.enclose(model, images, lognorm="structured", input_scale=0.5, progress=False, **settings) == "enclosure"
    block, H, W, kw = seen["field"]
    assert (H, W, kw["lognorm"], kw["dtype"]) == (2, 2, "structured", D) and block.norm1.weight.dtype == D
    field, x0, t1 = seen["args"]
    assert field == "field" and t1 == float(model.t1)
    assert torch.allclose(x0, 0.5 * model.embed(images).detach(), rtol=1e-15, atol=0)
    assert seen["kw"] == dict(settings, progress=False)


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_direct_enclosure_solves_with_the_given_method_and_tolerance():
    """ref_tol=None: y is the solve with the given method and tol (bosh3 here: its steps and NFE, repeated here)."""
    from lipcheck.wellposed import quartic as E
    A, x0 = _linear_case()
    f = LinearField(A)
    enc = wp.enclose_field(f, x0, 1.0, method="bosh3", tol=1e-5, ref_tol=None, tube=1e-14)
    steps, _, sol = E.piecewise_quartic(f, x0, 1.0, method="bosh3", tol=1e-5)
    assert enc.steps == steps and (enc.stats["nfe_forward"], enc.stats["method"]) == (sol["nfe_forward"], "bosh3")


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_reference_enclosure_refines_up_to_eight_times_max_per_step_by_default():
    """ref_max_per_step=None: the reference enclosure may refine a step up to 8 max_per_step sub-intervals (64 here,
    forced by a tiny defect_ratio and ref_defect_abs; the time budget stops after its first step, and there is no work
    budget: that target's predicted work is far above the default one)."""
    A, x0 = _linear_case()
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-4, ref_tol=1e-7, max_per_step=8, defect_ratio=1e-12,
                           ref_defect_abs=1e-300, max_seconds=0.0, max_work=None)
    assert enc.reference.stats["fine_points"] == 64 and not enc.proven.any()


def test_bern_sup_is_the_bernstein_bound_for_every_derivative():
    """_bern_sup(c, h, d) = min(max_j ||b_j|| + gamma_16 sum_k ||a_k||, coefficient sum) (1 + gamma_16) with the
    Bernstein coefficients b_j = sum_{k<=j} C(j,k)/C(n,k) a_k of y^(d) = sum_k a_k s^k, n = 4 - d (proofs/S5.md,
    Lemma 6), formed here in exact rationals; never above the coefficient sum (1 + gamma_16), and strictly tighter
    than it for these coefficients."""
    from fractions import Fraction as Fr
    from lipcheck.wellposed import quartic as E
    mpmath.mp.dps = 50
    g16 = 16 * mpmath.mpf(2) ** -53 / (1 - 16 * mpmath.mpf(2) ** -53)
    c = torch.randn(5, 2, 1, 2, 3, generator=torch.Generator().manual_seed(13), dtype=D)
    h = 0.375
    for d in range(5):
        n = 4 - d
        got = E._bern_sup(c, h, d)
        for b in range(2):
            a = [[Fr(math.factorial(k + d), math.factorial(k)) * Fr(float(x)) / Fr(h) ** d for x in c[k + d, b].reshape(-1)]
                 for k in range(n + 1)]
            nrm = lambda v: mpmath.sqrt(sum((mpmath.mpf(x.numerator) / x.denominator) ** 2 for x in v))  # noqa: E731
            bern = max(nrm([sum(Fr(math.comb(j, k), math.comb(n, k)) * a[k][i] for k in range(j + 1))
                            for i in range(6)]) for j in range(n + 1))
            coef = sum(nrm(x) for x in a)
            want = min(bern + g16 * coef, coef) * (1 + g16)
            assert abs(mpmath.mpf(float(got[b])) - want) <= 1e-15 * want, (d, b, float(got[b]), float(want))
            if d < 4:
                assert bern + g16 * coef < coef


def test_piecewise_quartic_stops_at_a_non_finite_state_with_where_and_when():
    """A field that turns NaN once the state passes 1.5 (x' = 1 from x0 = 1: at t = 0.5): piecewise_quartic raises
    IntegrationError carrying the time and the NFE of the call that saw the non-finite state (counted here) and its
    non-finite norm, never a quartic."""
    from lipcheck import IntegrationError
    from lipcheck.wellposed import quartic as E
    calls = []

    def field(x):
        calls.append(1)
        return torch.where(x > 1.5, torch.full_like(x, math.nan), torch.ones_like(x))

    with pytest.raises(IntegrationError, match="non-finite") as e:
        E.piecewise_quartic(field, torch.ones(1, 1, 1, 1, dtype=D), 2.0, tol=1e-6)
    assert 0.5 <= e.value.t <= 2.0 and e.value.nfe == len(calls) + 1 and math.isnan(e.value.state_norm)


def test_eval_works_in_chunks_of_about_the_given_number_of_tokens():
    """_eval: F on every sample, called on at most max(1, tokens // (H W)) samples at a time (memory), the default
    16384 tokens: 5 samples of 64 x 64 tokens go in chunks of 4 and 1."""
    from lipcheck.wellposed import quartic as E
    sizes = []

    def field(x):
        sizes.append(x.shape[0])
        return 2 * x

    y = torch.randn(5, 64, 64, 1, generator=torch.Generator().manual_seed(0), dtype=D)
    assert torch.equal(E._eval(field, y), 2 * y) and sizes == [4, 1]
    sizes.clear()
    small = y[:, :2, :2]
    assert torch.equal(E._eval(field, small, tokens=9), 2 * small) and sizes == [2, 2, 1]


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_reference_method_reports_the_users_solve_counts():
    """Theorem 6 on the tanh ODE: the step counts reported are those of the user's solve y at tol (its rejected steps
    too, repeated here), the reference solve's under "reference" (another number here)."""
    from lipcheck.wellposed import quartic as E
    f = TanhField(4, 6, seed=3, scale=1.5)
    x0 = torch.randn(2, 1, 1, 4, generator=torch.Generator().manual_seed(4), dtype=D)
    enc = wp.enclose_field(f, x0, 1.0, tol=1e-3, ref_tol=1e-5, ref_defect_abs=1.0)
    _, _, mine = E.piecewise_quartic(f, x0, 1.0, tol=1e-3)
    st = enc.stats
    assert (st["accepted"], st["rejected"], st["steps"]) == (mine["accepted"], mine["rejected"], mine["steps"])
    assert st["rejected"] >= 1 and st["reference"]["rejected"] == enc.reference.stats["rejected"] != st["rejected"]


def test_rayleigh_lower_subtracts_the_jacobians_error():
    """rayleigh_lower: the Rayleigh quotient of the top eigenvector of (J + J^T) / 2, less its rounding and less
    sqrt(n) eps_J (a Jacobian whose products J w are each within eps_J ||w|| (Lemma 4) is within sqrt(n) eps_J in
    Frobenius norm). A diagonal A with top eigenvalue 0: the quotient is exactly 0, the value a small negative
    rounding allowance (below 0, above -1e-11 at ||A||_F ~ 1e3), and eps_J lowers it by exactly sqrt(n) eps_J."""
    from lipcheck.wellposed import field as E
    A = np.diag([0.0, -1000.0, -3.0, -0.5, -2.0, -7.0])
    y = torch.randn(2, 1, 1, 6, generator=torch.Generator().manual_seed(0), dtype=D)
    lo = E.rayleigh_lower(LinearField(A), y, 0.0)
    assert lo.dtype == D and lo.shape == (2,) and (lo < 0).all() and (lo > -1e-11).all()
    lo_e = E.rayleigh_lower(LinearField(A), y, 1e-9)
    assert torch.allclose(lo_e, lo - math.sqrt(6) * 1e-9, rtol=1e-12, atol=0)


@pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)
def test_direct_enclosure_defect_of_a_straight_piece_is_theorem_5_condition_1():
    """Theorem 5, condition 1, at 50 digits on y = v + (t / h) w (4 tokens) for F = 0 with curvature K, L = 0: the
    sampled defect ||y'|| = ||w|| / h is the same at every node and the second and third derivatives vanish, so on
    each of the 8 sub-intervals dbar = (||w|| / h + gamma_10 ||w|| / h + (tau^2 / 8) K (sum_i ||w_i||^4)^(1/2) / h^2
    (1 + gamma_{N + 4C + 64})) (1 + gamma_16): the rounding of y' (Lemma 4) and the remainder with the per-token
    speeds (smaller here than ||y'||^2, which the bound may also use)."""
    from lipcheck.wellposed import direct as E
    mpmath.mp.dps = 50
    u = mpmath.mpf(2) ** -53
    gam = lambda n: n * u / (1 - n * u)  # noqa: E731
    g = torch.Generator().manual_seed(3)
    v = torch.randn(1, 2, 2, 3, generator=g, dtype=D)
    w = torch.randn(1, 2, 2, 3, generator=g, dtype=D) * torch.tensor([0.02, 0.05, 0.03, 0.04], dtype=D).reshape(1, 2, 2, 1)
    c = torch.zeros(5, 1, 2, 2, 3, dtype=D)
    c[0], c[1] = v, w
    h, K = 0.5, 20.0
    pieces = ([(0.0, h)], [c], dict(nfe_forward=1, nfe_dense_output=1, accepted=1, rejected=0))
    enc = E._enclose_direct(_StubField(0.0, [0.0], [0.0], K=K), v.clone(), h, pieces=pieces)
    assert enc.stats["fine_points"] == 8
    tok = [mpmath.sqrt(mpmath.fsum(mpmath.mpf(float(a)) ** 2 for a in w[0, i, j])) for i in range(2) for j in range(2)]
    wn = mpmath.sqrt(mpmath.fsum(t ** 2 for t in tok))
    tau = mpmath.mpf(h) / 8
    sq4 = mpmath.sqrt(mpmath.fsum(t ** 4 for t in tok)) / h ** 2 * (1 + gam(4 + 4 * 3 + 64))
    assert sq4 < (wn / h) ** 2
    want = (wn / h * (1 + gam(10)) + tau ** 2 / 8 * K * sq4) * (1 + gam(16))
    for d in enc.defect[:, 0].tolist():
        assert abs(mpmath.mpf(d) - want) <= 4e-16 * want, (d, float(want))  # the float64 evaluation: ~2e-17 here
    assert np.allclose(enc.defect_sampled[:, 0].numpy(), float(wn / h), rtol=1e-14, atol=0)


# ------------------------------------------------------------------ rounding in the safe direction (proofs/S5.md)

def test_mu_bar_and_envelope_round_up_negative_log_norms():
    """A negative log-norm rounded 'up' by a factor 1 + gamma moves down: _mu_bar and lognorm_envelope must stay
    above the exact values (50 digits) whatever the sign, also where lam_hat and the curvature term cancel."""
    from lipcheck.wellposed import recurrence as R
    mu, _ = R._mu_bar(_CurvField(0.0), -0.5, 1.0, 0.0, 0.0, 4)
    assert mu >= -0.5
    mu, _ = R._mu_bar(_CurvField(3.0), -1.0, 1.0, 0.1, 0.2333333333333333, 4)
    with mpmath.workdps(50):
        assert mpmath.mpf(mu) >= -1 + 3 * (mpmath.mpf(0.1) + mpmath.mpf(0.2333333333333333))
    from types import SimpleNamespace
    iv = dict(tau=1.0, lam=[-3.0], std=[1.0], drift=[0.0], offset=[0.0], bend=[math.inf])
    enc = SimpleNamespace(proven=torch.tensor([True]), _envelope_data=dict(
        intervals=[iv], field=_CurvField(0.0), radius=torch.zeros(2, 1, dtype=D), C=4))
    G = wp.lognorm_envelope(enc, 0.0)
    with mpmath.workdps(50):
        assert mpmath.mpf(float(G[1, 0])) >= mpmath.exp(-3)


def test_upper_ends_of_balls_are_rounded_up():
    """float() of an arb ball's upper end rounds to nearest, which can land below it (here at 200 bits, 1/3): the
    recurrence's sup must be at or above the ball's upper end."""
    from lipcheck.wellposed import recurrence as R
    flint = R._arb()
    prec = flint.ctx.prec
    try:
        flint.ctx.prec = 200
        r = flint.arb(1) / 3
        _, sup = R._propagate(flint, r, [], 0.1, 0.0)
        assert sup >= r.upper()
        assert flint.arb(R.upper(r)) >= r.upper() and R.upper(-r) >= float(-r.upper())
    finally:
        flint.ctx.prec = prec
    assert R.upper(flint.arb(0.5)) == 0.5 and R.upper(flint.arb(math.inf)) == math.inf


def test_point_log_norms_at_rounded_states_cover_the_exact_centre():
    """The point log-norms are taken at fl(y(s_j)), within gamma_10 sum|c_k| of y(s_j): the log-norm over the tube
    adds the curvature times that distance (here it dominates the rest of the curvature term)."""
    from lipcheck.wellposed import direct as E
    mpmath.mp.dps = 50
    u = mpmath.mpf(2) ** -53
    v = torch.full((1, 1, 1, 3), 1e3, dtype=D) * torch.tensor([1.0, -2.0, 3.0], dtype=D)
    pieces = _constant_pieces([v], [(0.0, 1.0)])
    K, lam = 100.0, 0.5
    enc = E._enclose_direct(_StubField(0.0, [0.0], [lam], K=K), v.clone(), 1.0, pieces=pieces)
    assert enc.proven.all(), enc.reason
    err_y = 10 * u / (1 - 10 * u) * mpmath.sqrt(mpmath.fsum(mpmath.mpf(float(a)) ** 2 for a in v.reshape(-1)))
    for k in range(len(enc.mu)):
        assert mpmath.mpf(float(enc.mu[k, 0])) >= lam + K * (mpmath.mpf(float(enc.tube[k, 0])) + err_y)


def test_dense_forming_allowance_covers_a_cancelling_mlp():
    """D2 = W2 diag(GELU') W1 J2 with W2 = [A, -A] and W1 = [B; B]: exactly 0, but its float32 evaluation is not.
    The allowance from the sums' lengths and the absolute values covers the float32 Jacobian's error (one scaled
    by ||D2||_F would be ~0); the mixer is scaled down so that its share does not hide the MLP's."""
    from conftest import random_block as block
    C = 6
    blk = block(C, heads=2, seed=3)
    with torch.no_grad():
        blk.mixer.o_proj.weight.mul_(1e-6)
        w1, w2, b1 = blk.mlp.fc1.weight, blk.mlp.fc2.weight, blk.mlp.fc1.bias
        half = w1.shape[0] // 2
        w1[half:2 * half], b1[half:2 * half] = w1[:half], b1[:half]
        w2[:, half:2 * half] = -w2[:, :half]
        w2[:, 2 * half:] = 0
        w1.mul_(8), w2.mul_(8)
    blk32 = block(C, heads=2, seed=3, dtype=torch.float32)
    blk32.load_state_dict({k: x.float() for k, x in blk.state_dict().items()})
    y = torch.randn(2, 2, 2, C, generator=torch.Generator().manual_seed(1), dtype=D).float()
    J64, _ = ln.DenseLogNorm(blk, 2, 2).jacobian(y.double())
    J32, err32 = ln.DenseLogNorm(blk32, 2, 2, dtype=torch.float32).jacobian(y)
    for b in range(2):
        assert float(torch.linalg.matrix_norm(J32[b].double() - J64[b], 2)) <= float(err32[b])


def test_structured_forming_allowance_uses_layernorm_two(monkeypatch):
    """The allowance for forming D2 = W2 diag(GELU') W1 J2 scales with ||J_LN2||, not ||J_LN1||: with LN1's eps
    large and LN2's tiny on tokens of small variance, J_LN2 is ~1e4 times larger. The per-token eigenvalues are
    taken unverified here (the verification's slack would hide the allowance), so the sum is checked term by term."""
    from conftest import random_block as block
    C = 4
    blk = block(C, heads=2, seed=6)
    blk.norm1.eps, blk.norm2.eps = 1.0, 1e-12
    k = ln.field_constants(blk, 2, 2)
    y = 1.0 + 1e-4 * torch.randn(1, 2, 2, C, generator=torch.Generator().manual_seed(7), dtype=D)
    n1, _ = ln.token_jacobians(blk, y)
    n2 = ln.ln_scale(blk.norm2, y.reshape(1, -1, C))
    assert float(n2.max()) > 1e3 * float(n1.max())
    seen = {}
    monkeypatch.setattr(ln, "verified_lambda_max", lambda S, lam: seen.setdefault("lam", lam))
    got = float(ln.structured_lognorm(blk, k, y, 0.0))
    first = k.T_norm * float(n1.max()) * (1 + 8 * U * C)
    form = ln.gamma(k.hidden + 2 * C + 16) * k.W2_abs * k.W1_abs * k.gelu1 * float(n2.max()) * C
    lam = float(seen["lam"].max())
    assert form > 1e3 * abs(lam) * U  # far above the rounding of the sum checked next
    assert got == pytest.approx(first + lam + form, rel=0, abs=16 * U * (first + abs(lam)))


def test_a_log_norm_claim_between_the_certified_values_is_not_accepted():
    """mu_claim = mu_2(A) exactly: above the certified lower value, below the verified upper bound (which carries
    eps_J): not verified, so not proven (it used to be accepted unchecked); a claim above the upper bound is used."""
    A, x0 = _linear_case()
    mu = float(np.linalg.eigvalsh((A + A.T) / 2).max())
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, ref_tol=None, mu_claim=mu)
    assert not enc.proven.any() and all("not verified" in r and "step 0" in r for r in enc.reason)
    ok = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, ref_tol=None, mu_claim=mu + 1e-6)
    assert ok.proven.all() and float(ok.mu_point.min()) == mu + 1e-6


def test_bad_input_is_refused_with_the_argument_named():
    """An empty batch, tol outside (0, 1), a negative or NaN max_seconds, a max_work that is not a positive number
    and a method the enclosure cannot follow
    (fixed-step, scipy_solver, unknown) are refused by name; the method message lists the valid ones."""
    A, x0 = _linear_case()
    f = LinearField(A)
    with pytest.raises(ValueError, match="empty"):
        wp.enclose_field(f, x0[:0], 1.0)
    with pytest.raises(ValueError, match="empty"):
        wp.enclose(_tiny_ode_vit(), torch.zeros(0, 3, 8, 8, dtype=D))
    for tol in (1.0, 2.0, -1e-3, math.nan):
        with pytest.raises(ValueError, match="tol"):
            wp.enclose_field(f, x0, 1.0, tol=tol)
    for s in (-1.0, math.nan):
        with pytest.raises(ValueError, match="max_seconds"):
            wp.enclose_field(f, x0, 1.0, max_seconds=s)
    for w in (0, -1.0, math.nan, True, "1e6"):
        with pytest.raises(ValueError, match="max_work"):
            wp.enclose_field(f, x0, 1.0, max_work=w)
        with pytest.raises(ValueError, match="max_work"):
            wp.enclose(_tiny_ode_vit(), torch.zeros(1, 3, 8, 8, dtype=D), max_work=w)
    for method in ("scipy_solver", "rk4", "nope"):
        with pytest.raises(ValueError, match="dopri5") as e:
            wp.enclose_field(f, x0, 1.0, method=method)
        assert method in str(e.value)
        with pytest.raises(ValueError, match="bosh3"):
            wp.enclose(_tiny_ode_vit(), torch.zeros(1, 3, 8, 8, dtype=D), method=method)


def test_a_failed_tube_check_says_where_the_bound_first_left_the_tube():
    """The reason of a failed tube check names the first time at which the error bound exceeded the last tube
    tried, inside the interval it reports."""
    A, x0 = _linear_case()
    enc = wp.enclose_field(LinearField(A), x0, 1.0, tol=1e-6, ref_tol=None, tube=1e-14)
    import re
    for r in enc.reason:
        m = re.search(r"first above it at t=([0-9.e-]+); interval ending t=([0-9.e-]+), step 0", r)
        assert m and 0 <= float(m.group(1)) <= float(m.group(2)), r


def test_direct_options_are_frozen_and_the_log_norm_grid_follows_mu_slack():
    """DirectOptions is a frozen record (the defaults of enclose_field); lognorm_grid takes P = 2^ceil(log2(M2 *
    speed * h / (2 mu_slack))) log-norm intervals of the step's m sub-intervals, at most m, all of them without a
    finite curvature bound."""
    from lipcheck.wellposed import direct, options
    opts = options.DirectOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.tol = 1e-6
    assert (opts.method, opts.tol, opts.defect_ratio, opts.mu_slack, opts.max_per_step) == ("dopri5", 1e-3, 0.25,
                                                                                           0.25, 1024)
    inf = dict(speed=torch.tensor([1.0, 0.5], dtype=D), h=0.5)
    assert direct.lognorm_grid(dict(m=16, M2=3.0), inf, 0.25) == [0, 4, 8, 12, 16]  # 3 * 0.5 / 0.5 = 3 -> P = 4
    assert direct.lognorm_grid(dict(m=16, M2=0.0), inf, 0.25) == [0, 16]
    assert direct.lognorm_grid(dict(m=8, M2=1e9), inf, 0.25) == list(range(9))
    assert direct.lognorm_grid(dict(m=8, M2=math.inf), inf, 0.25) == list(range(9))


def test_the_reference_keeps_the_callers_method_when_it_refines(monkeypatch):
    """_reference_pieces: where a reference step's sampled defect is above its target the reference is solved again
    with that step cut into ceil(1.25 (defect / target)^(1/4)) equal pieces (the interpolant's defect falls like
    h^4), with the same method and tolerance as the first solve (a refinement must not switch solvers)."""
    from lipcheck.wellposed import enclosure as E
    calls, defects = [], iter([torch.tensor([[1.0], [1e-4], [1.0], [1e-4]]), torch.full((30, 1), 1e-9)])

    def fake_quartic(sf, x0, t1, method=None, tol=None, step_times=None):
        calls.append((method, tol, step_times))
        n = 4 if step_times is None else len(step_times)
        return [(k / n, (k + 1) / n) for k in range(n)], ["coef"] * n

    monkeypatch.setattr(E, "piecewise_quartic", fake_quartic)
    monkeypatch.setattr(E, "_rough_distance", lambda *a: 1.0)
    monkeypatch.setattr(E, "_step_defects", lambda sf, steps, coefs: next(defects))
    (steps, _), target = E._reference_pieces(None, None, 1.0, ([], []), 1e-9, "bosh3", 0.1, 1e-3, 10 ** 6)
    assert target == 1e-3 and [c[:2] for c in calls] == [("bosh3", 1e-9)] * 2
    n = math.ceil(1.25 * (1.0 / 1e-3) ** 0.25)  # 8 pieces for the steps with defect 1.0, none for 1e-4
    want = [k / n * 0.25 for k in range(1, n)] + [0.5 + k / n * 0.25 for k in range(1, n)] + [1.0]
    assert calls[0][2] is None and calls[1][2] == pytest.approx(want, abs=1e-15) and len(steps) == len(want)


def test_ssog_field_constants_are_those_of_a_linear_mixer():
    """The report of the SSoG field: its mixer T is linear, so D^2 T = 0 (nested forward mode, exactly) and its
    curvature is 0; ||J_T|| (autograd) <= the reported ||T||; the token radius is LN1's sqrt(C) max|gamma| +
    ||beta||; lipschitz and curvature are the field's own at the same floor."""
    model = _tiny_ode_vit(seed=4)
    blk = model.vector_field.block.requires_grad_(False)
    f = wp.SSoGField(blk, 2, 2)
    v = 0.3
    got = f.constants(v)
    assert got == {"mixer": "ssog", "mixer_lipschitz": f.k.T_norm, "mixer_curvature": 0.0, "token_radius": f.k.rho1,
                   "lipschitz": f.lipschitz(v), "curvature": f.curvature(v)}
    g = torch.Generator().manual_seed(4)
    z, u = (torch.randn(1, 2, 2, 6, generator=g, dtype=D) for _ in range(2))
    d2 = torch.func.jvp(lambda w: torch.func.jvp(blk.mixer, (w,), (u,))[1], (z,), (u,))[1]
    assert float(d2.abs().max()) == 0.0
    J = torch.autograd.functional.jacobian(lambda w: blk.mixer(w.reshape(z.shape)).reshape(-1), z.reshape(-1))
    assert float(torch.linalg.matrix_norm(J, 2)) <= got["mixer_lipschitz"]
    n1 = blk.norm1
    radius = math.sqrt(6) * float(n1.weight.abs().max()) + float(n1.bias.norm())
    assert radius <= got["token_radius"] <= radius * (1 + 16 * torch.finfo(D).eps)  # rounded up by gamma_{C+4}


def test_the_reference_is_cut_where_its_remainder_needs_many_sub_intervals(monkeypatch):
    """_reference_pieces with a field: a reference step whose remainder would need more than half of max_per_step
    defect sub-intervals (`_sub_intervals`: 20 against max_per_step 8) is cut into ceil(20 / 4) = 5 equal pieces,
    though its sampled defect is below the target; the re-solve's steps need no more cuts."""
    from lipcheck.wellposed import enclosure as E
    calls = []

    def fake_quartic(sf, x0, t1, method=None, tol=None, step_times=None):
        calls.append(step_times)
        n = 4 if step_times is None else len(step_times)
        return [(k / n, (k + 1) / n) for k in range(n)], ["coef"] * n

    monkeypatch.setattr(E, "piecewise_quartic", fake_quartic)
    monkeypatch.setattr(E, "_growth", lambda *a: None)
    monkeypatch.setattr(E, "_out_of_reach", lambda *a, **k: None)
    monkeypatch.setattr(E, "_defect_target", lambda *a, **k: (torch.tensor([1e-3], dtype=D), False))
    monkeypatch.setattr(E, "_step_defects", lambda sf, steps, coefs: torch.full((len(steps), 1), 1e-9, dtype=D))
    monkeypatch.setattr(E, "_sub_intervals", lambda field, steps, coefs, target: torch.tensor(
        [20.0 if len(steps) == 4 and k == 1 else 1.0 for k in range(len(steps))], dtype=D))
    (steps, _), _ = E._reference_pieces(None, None, 1.0, ([], []), 1e-9, "dopri5", 0.02, None, 10 ** 6,
                                        field="field", max_per_step=8)
    want = [0.25 + 0.25 * j / 5 for j in range(1, 5)] + [1.0]
    assert len(calls) == 2 and calls[1] == pytest.approx(want, abs=1e-15) and len(steps) == len(want)
    # without a field nothing is cut for the remainder, and the target is ref_defect_ratio * (the rough distance
    # from y to this reference) / t1
    seen = []
    monkeypatch.setattr(E, "_rough_distance", lambda *a: seen.append(a) or 2.0)
    (steps, coefs), target = E._reference_pieces(None, None, 0.5, (["ys"], ["yc"]), 1e-9, "dopri5", 0.02, None, 10)
    assert target == pytest.approx(0.08) and seen == [(["ys"], ["yc"], steps, coefs)] and len(steps) == 4


def test_the_defect_remainder_uses_each_tokens_own_curvature():
    """defect.token_curvature bounds sup ||D^2 F(y(s))[y'(s), y'(s)]|| on a step (nested autograd at 33 points,
    LayerNorm written out), and sample_step's remainder with it is below the one with the scalar M2 alone (tokens
    of different stds)."""
    import lipcheck.wellposed.defect as dm
    from conftest import block_field
    from lipcheck.wellposed.quartic import _poly, piecewise_quartic
    blk = random_block(8, heads=2, seed=5)
    field = wp.SSoGField(blk, 3, 3)
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(1, 3, 3, 8, dtype=D, generator=g) * torch.linspace(0.4, 2.5, 9, dtype=D).reshape(1, 3, 3, 1)
    steps, coefs, _ = piecewise_quartic(blk.vector_field, x0, 0.3, method="dopri5", tol=1e-6)
    info = dm.step_bounds(steps, coefs, 8)
    F = block_field(blk)
    c, inf = coefs[0], info[0]
    s = torch.linspace(0, 1, 33, dtype=D)
    y, d1 = _poly(c, s, inf["h"], 0), _poly(c, s, inf["h"], 1)
    actual = max(float(torch.func.jvp(lambda z: torch.func.jvp(F, (z,), (d1[j],))[1], (y[j],), (d1[j],))[1].norm())
                 for j in range(33))
    floor = (y.var(-1, unbiased=False).sqrt().flatten(2) - 1e-3)  # (33, B, N): below every sampled std
    got = float(dm.token_curvature(field, floor, inf["speed_tok"], 8)[0])
    assert actual <= got

    class Without:  # the same field without some of its bounds (Lemma 7's `directional` hidden in both)
        uses_variance = True

        def __init__(self, *names):
            self.names = names + ("directional",)

        def __getattr__(self, name):
            if name in self.names:
                raise AttributeError(name)
            return getattr(field, name)

        def __call__(self, x):
            return field(x)
    per_token = dm.sample_step(Without(), c, inf, 16)["remainder"]
    scalar = dm.sample_step(Without("curvature_parts"), c, inf, 16)["remainder"]
    assert bool((per_token <= scalar).all()) and float(per_token.max()) < 0.95 * float(scalar.max())


def test_sample_step_in_chunks_equals_one_evaluation_of_all_samples(monkeypatch):
    """sample_step with every sample in its own chunk (SAMPLE_TOKENS = 1) against one chunk for all: the same token
    stds, sampled defects, rounding bounds (eps_J the largest over the chunks) and defect bounds, two samples of
    different scales; step_states gives fl(y) at the asked points, y(s_j) by numpy's polynomial within 1e-14."""
    import lipcheck.wellposed.defect as dm
    from lipcheck.wellposed.quartic import piecewise_quartic
    blk = random_block(8, heads=2, seed=5)
    field = wp.SSoGField(blk, 3, 3)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 3, 3, 8, dtype=D, generator=g) * torch.tensor([0.5, 3.0], dtype=D).reshape(2, 1, 1, 1)
    steps, coefs, _ = piecewise_quartic(blk.vector_field, x0, 0.3, method="dopri5", tol=1e-6)
    c, inf = coefs[0], dm.step_bounds(steps, coefs, 8)[0]
    monkeypatch.setattr(dm, "SAMPLE_TOKENS", 10 ** 9)
    one = dm.sample_step(field, c, inf, 16)
    monkeypatch.setattr(dm, "SAMPLE_TOKENS", 1)
    assert len(dm._chunks(16, 2, 9)) == 17
    many = dm.sample_step(field, c, inf, 16)
    for key in ("std", "sampled", "defect", "remainder", "floor"):  # the sampled defects cancel: F's rounding shows
        assert torch.allclose(one[key], many[key], rtol=1e-12, atol=1e-9 * float(one[key].abs().max())), key
    assert many["eps_J"] == pytest.approx(one["eps_J"], rel=1e-12) and many["v_y"] == pytest.approx(one["v_y"], rel=1e-12)

    class Loud:  # rounding bounds that vary along the step and decide the defect: the maxima over chunks matter
        def __getattr__(self, name):
            return getattr(field, name)

        def __call__(self, x):
            return field(x)

        def rounding(self, y, v):  # eps_J largest (1) at the step's start, in the first chunk only
            start = (y.reshape(-1, *c.shape[1:]) - c[0]).flatten(2).norm(dim=-1).min()
            return y.flatten(1).norm(dim=1), float(1 / (1 + start))
    monkeypatch.setattr(dm, "SAMPLE_TOKENS", 10 ** 9)
    one = dm.sample_step(Loud(), c, inf, 16)
    monkeypatch.setattr(dm, "SAMPLE_TOKENS", 1)
    many = dm.sample_step(Loud(), c, inf, 16)
    assert many["eps_J"] == one["eps_J"] == 1.0
    assert torch.allclose(one["defect"], many["defect"], rtol=1e-14, atol=0)
    ys = dm.step_states(c, many, inf["h"], [0, 5, 16]).reshape(3, 2, -1).numpy()
    cn = c.reshape(5, 2, -1).numpy()
    for r, j in enumerate((0, 5, 16)):
        want = sum(cn[k] * (j / 16) ** k for k in range(5))
        assert np.allclose(ys[r], want, rtol=1e-14, atol=1e-14 * np.abs(cn).sum(0).max())


def test_bernstein_sup_margin_follows_the_coefficients_dtype():
    """_bern_sup's rounding margin is gamma_16 of the coefficients' own dtype: float32 coefficients get a margin
    about 1e-6 relative above the float64 evaluation of the same numbers (float64's 1e-15 would not cover float32's
    rounding), and both stay above the sup sampled densely in float64."""
    from lipcheck.wellposed.quartic import _bern_sup, _poly
    g = torch.Generator().manual_seed(7)
    c32 = torch.randn(5, 3, 2, 2, 4, generator=g).float()
    c64 = c32.double()
    s = torch.linspace(0, 1, 2001, dtype=D)
    for d in (1, 2, 3):
        b32, b64 = _bern_sup(c32, 0.5, d).double(), _bern_sup(c64, 0.5, d)
        sampled = _poly(c64, s, 0.5, d).flatten(2).norm(dim=-1).amax(0)
        assert bool((b64 >= sampled).all()) and bool((b32 >= b64 * (1 + 5e-7)).all())


@settings(max_examples=60, deadline=None)
@given(x=st.floats(0.0, 5e4))
def test_sub_interval_counts_are_the_next_of_their_family(x):
    """A step's sub-interval count is the smallest m >= max(x, 8) of the form q 2^a (q = 4..7, a >= 1): brute force
    over that family here; consecutive members are at most 25 % apart."""
    from lipcheck.wellposed.defect import sub_interval_count
    family = sorted(q << a for a in range(1, 16) for q in (4, 5, 6, 7))
    m = sub_interval_count(x)
    assert m == min(f for f in family if f >= x) and m >= 8
    assert all(b <= 1.25 * a for a, b in zip(family, family[1:]))


@pytest.mark.parametrize("m, need, want", [(448, 100, 112), (448, 1, 1), (448, 500, 448), (512, 100, 128),
                                           (320, 3, 4), (320, 33, 40), (8, 3, 4), (56, 9, 14)])
def test_lognorm_grid_takes_the_smallest_divisor_at_or_above_the_count(m, need, want):
    """P log-norm intervals: the smallest divisor of m at or above ceil(M2 speed h / (2 mu_slack)) (here M2 speed h
    / (2 mu_slack) = need exactly), so that every interval spans m / P whole sub-intervals and ends on m."""
    from lipcheck.wellposed.direct import lognorm_grid
    idx = lognorm_grid(dict(m=m, M2=2.0 * need), dict(speed=torch.tensor([0.5]), h=1.0), 0.5)
    assert len(idx) - 1 == want and idx[0] == 0 and idx[-1] == m
    assert len({b - a for a, b in zip(idx, idx[1:])}) == 1


def test_refined_step_refines_until_the_remainder_meets_its_target():
    """x' = A x (no curvature: the remainder tau^2/8 (sup||y^(3)|| + L sup||y''||) falls exactly like 1/m^2): with
    the absolute target at 1/1.5 of the remainder on 8 sub-intervals, the step is refined (not accepted at 1.5x its
    target) to the first count of the family at or above 1.001 * 8 * sqrt(1.5), and its remainder is then below the
    target; a target the 8 sub-intervals already meet keeps 8."""
    from lipcheck.wellposed.defect import refined_step, step_bounds, sub_interval_count
    from lipcheck.wellposed.options import DirectOptions
    from lipcheck.wellposed.quartic import piecewise_quartic
    A, x0 = _linear_case()
    f = LinearField(A)
    steps, coefs, _ = piecewise_quartic(f, x0, 1.0, method="dopri5", tol=1e-6)
    info = step_bounds(steps, coefs, x0.shape[-1])
    rem8 = float(refined_step(f, coefs[0], info[0], DirectOptions(defect_ratio=1e-30, max_per_step=8))
                 ["remainder"].max())
    smp = refined_step(f, coefs[0], info[0], DirectOptions(defect_ratio=1e-30, defect_abs=rem8 / 1.5))
    assert smp["m"] == sub_interval_count(1.001 * 8 * math.sqrt(1.5)) == 10
    assert float(smp["remainder"].max()) <= rem8 / 1.5
    assert refined_step(f, coefs[0], info[0], DirectOptions(defect_ratio=1e-30, defect_abs=rem8 * 1.01))["m"] == 8
