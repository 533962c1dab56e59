"""lipcheck.wellposed.enclose: the proven tube around a computed trajectory (proofs/S5.md, Theorem 5).

Checked against solutions computed independently inside the tests: the matrix exponential (scipy) for
x' = A x, and mpmath's high-precision Taylor solver (odefun, 20 digits) for a small tanh neural ODE.
Failures must be reported as failures (not proven, with a reason), never as a radius.
"""
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
    c1, c2 = 6 * 2.0 / (math.sqrt(C) * (v + 1e-6)), 6 * 0.5 / (math.sqrt(C) * (v + 0.3))
    assert close(k.ln_curvature(1, v), c1) and close(k.ln_curvature(2, v), c2)
    mlp = k.W2 * k.gelu1 * k.W1
    assert close(k.lipschitz(v), k.T_norm * l1 + mlp * l2)
    assert close(k.curvature(v), k.T_norm * c1 + mlp * c2 + k.W2 * math.sqrt(2 / math.pi) * k.W1 ** 2 * l2 * l2)
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
    for b in range(2):
        assert abs(float(eps_F[b]) - gK * (2 + amp[b]) * mag * 4) <= 1e-6 * float(eps_F[b])
    lin = k.T_abs * k.ln_jacobian(1, v) + k.W2_abs * k.gelu1 * k.W1_abs * k.ln_jacobian(2, v)
    assert abs(eps_J - gK * (2 + max(amp)) * lin * 8) <= 1e-6 * eps_J
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
    assert s["radius"] == enc.radius.T.tolist() and s["radius_t1"] == enc.radius[-1].tolist()
    assert s["t"] == enc.t.tolist() and s["mu_point"] == enc.mu_point.T.tolist()
    assert s["tube_max"] == enc.tube.amax(0).tolist() and s["mu_max"] == enc.mu.amax(0).tolist()
    assert s["defect_max"] == enc.defect.amax(0).tolist()
    assert s["defect_sampled_max"] == enc.defect_sampled.amax(0).tolist()
    assert (enc.defect >= enc.defect_sampled).all()  # the rigorous sup is above the sampled values


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
    from lipcheck.wellposed import enclosure as E
    g = torch.Generator().manual_seed(5)
    steps = [(0.0, 0.3), (0.3, 0.7), (0.7, 1.0)]
    coefs = [torch.randn(5, 2, 1, 1, 3, generator=g, dtype=D) for _ in steps]
    for k in range(1, len(steps)):  # continuous at y's step ends, as a solver's output is (up to round-off)
        coefs[k][0] = coefs[k - 1].sum(0)
    rsteps = [(0.0, 0.5), (0.5, 1.0)]
    rcoefs = [torch.randn(5, 2, 1, 1, 3, generator=g, dtype=D) for _ in rsteps]
    rcoefs[1][0] = rcoefs[0].sum(0)
    spans = [(0, 0, 4, 8), (0, 4, 8, 8), (1, 0, 8, 8)]
    dist, centers = E._distance(steps, coefs, dict(steps=rsteps, coefs=rcoefs, spans=spans), D)

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
    from lipcheck.wellposed import enclosure as E
    g = torch.Generator().manual_seed(5)
    steps = [(0.0, 0.3), (0.3, 0.7), (0.7, 1.0)]
    coefs = [torch.randn(5, 2, 1, 1, 3, generator=g, dtype=D) * 0.1 for _ in steps]
    coefs[2][0] = coefs[1].sum(0)  # continuous at 0.7: only the jump at 0.3 is nonzero
    rsteps = [(0.0, 0.3), (0.3, 1.0)]
    rcoefs = [coefs[0].clone(), torch.zeros(5, 2, 1, 1, 3, dtype=D)]
    rcoefs[1][0] = coefs[1][0]  # y_ref constant on [0.3, 1], equal to y's right neighbour at 0.3
    spans = [(0, 0, 8, 8), (1, 0, 2, 8), (1, 2, 8, 8)]
    dist, _ = E._distance(steps, coefs, dict(steps=rsteps, coefs=rcoefs, spans=spans), D)

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
    from lipcheck.wellposed import enclosure as E
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
    dist, _ = E._distance(steps, [c], dict(steps=steps, coefs=[r], spans=[(0, 0, 8, 8)]), D)
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
    from lipcheck.wellposed import enclosure as E
    e = torch.tensor([0.6, 0.0, 0.8], dtype=D)  # unit vector
    # T4(2s - 1) = 128 s^4 - 256 s^3 + 160 s^2 - 32 s + 1
    cheb = [1.0, -32.0, 160.0, -256.0, 128.0]
    c = torch.stack([v * e for v in cheb]).reshape(5, 1, 1, 1, 3)
    r = torch.zeros_like(c)
    steps = [(0.0, 1.0)]
    dist, _ = E._distance(steps, [c], dict(steps=steps, coefs=[r], spans=[(0, 0, 8, 8)]), D)
    s = np.linspace(0, 1, 20001)
    sup = np.abs(np.polynomial.chebyshev.chebval(2 * s - 1, [0, 0, 0, 0, 1])).max()
    assert sup <= float(dist[1, 0]) <= 1.02 * sup, float(dist[1, 0])


def test_rough_distance_is_the_largest_node_distance():
    """_rough_distance: max over y_ref's step nodes (s = 0, 1/4, ..., 1 of each step's own quartic) of ||y - y_ref||,
    y evaluated on its step containing the node (numpy)."""
    from lipcheck.wellposed import enclosure as E
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
    from lipcheck.wellposed import enclosure as E
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
