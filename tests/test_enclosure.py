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

from lipcheck import wellposed as wp
from lipcheck.bounds import lognorm as ln

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
