"""The channel-resolved envelope (Lemma G4) and Theorem D5 (lipcheck.bounds.channel_envelope, ritz_deflation)
against the block circulant written here from its taps, dense Gram matrices and dense SVDs of the operator."""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipcheck.bounds import channel_envelope as ce
from lipcheck.bounds import deflation as df
from lipcheck.bounds import ritz_deflation as rd
from lipcheck.bounds import spectral as sp
from lipcheck.bounds.approx import _deflect, _Normed
from lipcheck.bounds.gram_lowrank import _level_plus_norm2
from test_majorant import axis, dense_T, params, random_layer


def layer(rng, h, M, d, family, shift=3.0):
    alpha, mu, sigma, WV, WO = random_layer(rng, h, M, d, shift, 4.0)
    if family == "floor":  # every component a shift of the grid
        sigma = np.full_like(sigma, 1e-3 * (1 + 1e-9))
    return alpha, mu, sigma, WV, WO


def circulant_embedding(alpha, mu, sigma, WV, WO, H, W):
    """Cb E ((L1 L2 C) x (N C)): the block circulant on the (2H-1) x (2W-1) torus whose taps are T's (offsets |k| <=
    n - 1, read off the dense axis matrices), applied to box-supported vectors, row-major (token, channel)."""
    h, M = alpha.shape
    C = WV.shape[0]
    d = C // h

    def circ(n, m, s):
        G, L = axis(n, m, s), 2 * n - 1
        tap = {i - j: G[i, j] for i in range(n) for j in range(n)}
        return np.array([[tap.get(((p - j + n - 1) % L) - (n - 1), 0.0) for j in range(n)] for p in range(L)])

    out = 0
    for i in range(h):
        K = sum(alpha[i, m] * np.kron(circ(H, mu[i, m, 0], sigma[i, m, 0]), circ(W, mu[i, m, 1], sigma[i, m, 1]))
                for m in range(M))
        P = WV[:, i * d:(i + 1) * d] @ WO[i * d:(i + 1) * d, :]
        out = out + np.kron(K, P.T)
    return out


def box_rows(H, W, C):
    """Indices of the box's (token, channel) rows inside the torus's row-major (token, channel) order."""
    L2 = 2 * W - 1
    return np.array([(y * L2 + x) * C + c for y in range(H) for x in range(W) for c in range(C)])


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(h=st.integers(1, 3), M=st.integers(1, 3), d=st.integers(1, 3), H=st.integers(1, 5), W=st.integers(1, 5),
       family=st.sampled_from(["broad", "floor"]), share=st.floats(0.05, 1.2), k=st.integers(0, 12),
       seed=st.integers(0, 10 ** 6))
def test_channel_envelope_majorises_the_gram_matrix(h, M, d, H, W, family, share, k, seed):
    """Lemma G4 on random layers: T = E^T Cb E for Cb built here, T^T T <= R_F = (Cb E)^T (Cb E) <= d I + A^T A (the
    library's A^T within its declared error), and m22 >= lambda_max(T^T T on span(Q)^perp) for random Q."""
    rng = np.random.default_rng(seed)
    L = layer(rng, h, M, d, family)
    C, N = h * d, H * W
    T = dense_T(*L, H, W)
    CbE = circulant_embedding(*L, H, W)
    np.testing.assert_allclose(CbE[box_rows(H, W, C)], T, atol=1e-12 * (1 + np.abs(T).max()))
    Mg, RF = T.T @ T, CbE.T @ CbE
    scale = np.linalg.eigvalsh(RF)[-1] + 1e-300
    assert np.linalg.eigvalsh(RF - Mg)[0] >= -1e-11 * scale
    p = params(*L)
    level = share * scale
    env = ce.channel_envelope(p, H, W, sp.SymbolNorm(p), level)
    assert env.level >= level
    A = env.At.val.numpy().T
    slack = 2 * np.linalg.norm(A, 2) * env.At.err + env.At.err ** 2 + 1e-11 * scale
    assert np.linalg.eigvalsh(env.level * np.eye(N * C) + A.T @ A - RF)[0] >= -slack
    k = min(k, N * C - 1)
    Q = np.linalg.qr(rng.standard_normal((N * C, max(k, 1))))[0][:, :k]
    Qt = torch.tensor(Q) if k else torch.zeros(N * C, 0, dtype=torch.float64)
    eta = df.orthonormality_defect(Qt) if k else 0.0
    m22 = _level_plus_norm2(env.level, _deflect(_Normed(Qt, eta, bound=1.0), env.At)) if env.rows else env.level
    Pm = np.eye(N * C) - Q @ Q.T
    assert m22 >= np.linalg.eigvalsh(Pm @ RF @ Pm)[-1] * (1 - 1e-12) - 1e-300


def test_envelope_rows_are_the_split_quadratic_form():
    """One pair of rows per (w, j): their squares sum to kappa beta |xhat(w) u|^2 / (L1 L2) for a random x, with xhat
    the DFT computed here, at a generic frequency (kappa = 2) and at w = 0 (kappa = 1)."""
    rng = np.random.default_rng(3)
    H, W, C = 3, 4, 5
    L1, L2 = 2 * H - 1, 2 * W - 1
    from lipcheck.bounds.gram_envelope import torus_pairs
    _, mirror = torus_pairs(L1, L2, "cpu")
    u = torch.tensor(rng.standard_normal(C) + 1j * rng.standard_normal(C))
    x = rng.standard_normal((H, W, C))
    for a, b in ((2, 3), (0, 0)):
        fi = torch.tensor([a * L2 + b])
        At = ce.envelope_rows(fi, u[None], torch.tensor([0.7], dtype=torch.float64), mirror, L1, L2, H, W)
        got = float(((At.val.numpy().T @ x.reshape(-1)) ** 2).sum())
        n = np.stack(np.meshgrid(np.arange(H), np.arange(W), indexing="ij"), -1)
        ph = np.exp(-2j * np.pi * (a * n[..., 0] / L1 + b * n[..., 1] / L2))
        xhat = (ph[..., None] * x).sum((0, 1))
        kappa = 1 if (a, b) == (0, 0) else 2
        assert got == pytest.approx(kappa * 0.7 * abs(xhat @ u.numpy()) ** 2 / (L1 * L2), rel=1e-12)
        assert At.err < 1e-13
        # the proof's rows bound: et sqrt(2 N kappa beta / (L1 L2) sum_c (|Re u_c| + |Im u_c|)^2) at least
        u0, e = 2.0 ** -53, 2 * math.pi * 3.01 * 2.0 ** -53 + 2 * 2.0 ** -53
        et = 2 * (2 * e + e * e) + 4 * u0 * (1 + e) ** 2
        mass = kappa * 0.7 / (L1 * L2) * float(((u.real.abs() + u.imag.abs()) ** 2).sum())
        assert At.err >= et * math.sqrt(2 * H * W * mass)


@pytest.mark.parametrize("drop", [0.0, 0.3, 1.0])
def test_split_certificate_bounds_the_remainder(drop):
    """certify_split's value is >= lambda_max(S S^* - U diag(beta) U^*) computed here, also where beta is smaller than
    the split needs (drop of the eigenvalue above the level kept) or the vectors are perturbed."""
    rng = np.random.default_rng(1)
    C = 6
    S = torch.tensor(rng.standard_normal((2, C, C)) + 1j * rng.standard_normal((2, C, C)))
    F, lam, U = ce.split_frequency(S, 1.0)
    level = float(lam[:, -3].min())
    beta = ((lam - level).clamp_min(0) * (1 - drop)).to(torch.float64)
    U = U + 1e-3 * torch.tensor(rng.standard_normal(U.shape))
    got = ce.certify_split(F, (S.abs() ** 2).sum((-2, -1)), U, beta)
    Sn, Un = S.numpy(), U.numpy()
    for i in range(2):
        G = Sn[i] @ Sn[i].conj().T - (Un[i] * beta[i].numpy()) @ Un[i].conj().T
        assert float(got[i]) >= np.linalg.eigvalsh((G + G.conj().T) / 2)[-1]
        assert float(got[i]) <= np.linalg.eigvalsh((G + G.conj().T) / 2)[-1] + 1e-9 * float(lam[i, -1])


def operator_margins(p, H, W):
    B = p.magnitude()
    apply_err = sp.dense_error(p, H * W) + p.gamma(2 * p.dim + H * p.alpha.shape[1] + W + 8) * B
    return apply_err, B


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(h=st.integers(1, 3), d=st.integers(2, 4), H=st.integers(3, 7), W=st.integers(3, 7),
       family=st.sampled_from(["broad", "floor"]), seed=st.integers(0, 10 ** 6))
def test_ritz_bound_is_above_and_near_the_dense_norm(h, d, H, W, family, seed):
    """Theorem D5 on random layers: sqrt(tau) >= ||T||_2 from a dense SVD computed here, and within 1e-6 of it where
    the complement m22 is below 0.97 of the top Ritz value (the case it is built for; shifts of 3 tokens on these small
    grids can leave R_F above ||T||^2, and then the bound is near sqrt(m22)); its top Ritz vector a near-top
    singular vector."""
    rng = np.random.default_rng(seed)
    L = layer(rng, h, 3, d, family)
    T = dense_T(*L, H, W)
    s1 = np.linalg.norm(T, 2)
    p = params(*L)
    apply_err, B = operator_margins(p, H, W)
    rb = rd.ritz_bound(p, H, W, sp.SymbolNorm(p), apply_err=apply_err, t_up=B)
    upper = math.sqrt(rb.tau)
    assert upper >= s1
    theta1 = rb.info["tries"][-1]["theta1"]
    assert upper <= max(s1 * (1 + 1e-6), math.sqrt(rb.m22) * (1 + 1e-6))
    if rb.m22 <= 0.97 * theta1:
        assert upper <= s1 * (1 + 1e-6)
    v = rb.top.numpy()
    assert np.linalg.norm(T @ v) / np.linalg.norm(v) >= s1 * (1 - 1e-6)


def test_ritz_bound_rises_with_the_operator_error():
    """The certified tau grows with the declared error of the fast operator and of t (mutants that drop them fail),
    and a non-finite margin is refused."""
    rng = np.random.default_rng(5)
    L = layer(rng, 2, 2, 3, "floor")
    p = params(*L)
    apply_err, B = operator_margins(p, 5, 5)
    base = rd.ritz_bound(p, 5, 5, sp.SymbolNorm(p), apply_err=apply_err, t_up=B, K=20).tau
    more = rd.ritz_bound(p, 5, 5, sp.SymbolNorm(p), apply_err=1e-6 * B, t_up=B, K=20).tau
    assert more > base * (1 + 1e-9)
    with pytest.raises(ValueError, match="not certified"):
        rd.ritz_bound(p, 5, 5, sp.SymbolNorm(p), apply_err=math.nan, t_up=B)


def test_gram_blocks_match_dense_products():
    """M11 and X from the fast operator equal Q^T M Q and the Gram of (I - Q Q^T) M Q formed here from the dense T,
    within their declared errors."""
    rng = np.random.default_rng(2)
    L = layer(rng, 3, 2, 2, "broad")
    H, W = 4, 5
    T = dense_T(*L, H, W)
    Mg = T.T @ T
    n = Mg.shape[0]
    Q = np.linalg.qr(rng.standard_normal((n, 7)))[0]
    p = params(*L)
    apply_err, B = operator_margins(p, H, W)
    Qt = torch.tensor(Q)
    M11, X = rd.gram_blocks(p, H, W, Qt, df.orthonormality_defect(Qt), apply_err, B)
    Z = (np.eye(n) - Q @ Q.T) @ Mg @ Q
    assert np.linalg.norm(M11.val.numpy() - Q.T @ Mg @ Q, 2) <= M11.err
    assert np.linalg.norm(X.val.numpy() - Z.T @ Z, 2) <= X.err
    assert M11.err < 1e-9 * np.linalg.norm(Mg, 2)


def test_default_call_runs_the_ritz_stage_where_asked():
    """ssog_lipschitz(..., ritz=True): the stage runs, its bound is >= the dense SVD's norm computed here and within
    1e-6 of it, and best_method names it where it is the smallest; ritz=False leaves it out."""
    from lipcheck.bounds import ssog_lipschitz
    from lipcheck.mixers.ssog import SSoG
    torch.manual_seed(0)
    lay = SSoG(12, 3, 3).double()
    rng = np.random.default_rng(7)
    alpha, mu, sigma, WV, WO = layer(rng, 3, 3, 4, "floor", shift=1.0)
    with torch.no_grad():
        lay.set_gaussian_params(alpha=torch.tensor(alpha), mu=torch.tensor(mu), sigma=torch.tensor(sigma))
    p = sp.ssog_params(lay)
    H = W = 8
    s1 = np.linalg.norm(sp.dense_operator(p, H, W).numpy(), 2)
    kw = dict(exact_max=0, gram_max=0, probabilistic=False, deflated=False, majorant=False, dense_gram=False)
    r = ssog_lipschitz(lay, H, W, ritz=True, **kw)
    assert "ritz" in r.info and r.info["ritz"]["value"] >= s1
    assert r.info["ritz"]["value"] <= s1 * (1 + 1e-6)
    assert r.best_method == "ritz" and r.upper == r.info["ritz"]["value"]
    off = ssog_lipschitz(lay, H, W, ritz=False, **kw)
    assert "ritz" not in off.info


def test_work_budget_refuses_before_any_ritz_vector(monkeypatch):
    """A split that exceeds max_work (hot frequencies times C^2) is refused with the count named, before the Ritz
    vectors are computed where a lower bound is given; within the budget the bound is certified as before."""
    rng = np.random.default_rng(5)
    L = layer(rng, 2, 2, 3, "floor", shift=1.0)
    p = params(*L)
    apply_err, B = operator_margins(p, 5, 5)
    called = []
    real = rd.ritz_vectors
    monkeypatch.setattr(rd, "ritz_vectors", lambda *a, **k: called.append(1) or real(*a, **k))
    s1 = np.linalg.norm(dense_T(*L, 5, 5), 2)
    with pytest.raises(ValueError, match="work budget"):
        rd.ritz_bound(p, 5, 5, sp.SymbolNorm(p), apply_err=apply_err, t_up=B, max_work=36.0, lower=0.9 * s1)
    assert not called
    ok = rd.ritz_bound(p, 5, 5, sp.SymbolNorm(p), apply_err=apply_err, t_up=B, max_work=1e12, lower=0.9 * s1)
    assert math.sqrt(ok.tau) >= s1 and called


def test_split_certificate_adds_its_rounding_terms(monkeypatch):
    """With the Cholesky check replaced by the exact top eigenvalue, certify_split returns that plus the proof's
    rounding terms gamma_{2C+4} (||S||_F^2 + sum beta ||u||^2) + 3u (...), recomputed here."""
    from lipcheck import rounding
    rng = np.random.default_rng(4)
    C = 5
    S = torch.tensor(rng.standard_normal((1, C, C)) + 1j * rng.standard_normal((1, C, C)))
    F, lam, U = ce.split_frequency(S, 0.0)
    beta = (lam - lam[:, -3:-2]).clamp_min(0)
    monkeypatch.setattr(rounding, "verified_lambda_max", lambda A, **k: torch.linalg.eigvalsh(A)[..., -1])
    S_fro2 = (S.abs() ** 2).sum((-2, -1))
    got = float(ce.certify_split(F, S_fro2, U, beta)[0])
    G = F - (U * beta[:, None, :]) @ U.conj().transpose(-1, -2)
    top = float(torch.linalg.eigvalsh((G + G.conj().transpose(-1, -2)) / 2)[0, -1])
    g = rounding.gamma(2 * C + 4)
    want = top + g * float(S_fro2[0]) + g * float((beta * U.abs().square().sum(-2)).sum())
    assert got >= want * (1 - 1e-15)


def test_symbol_error_enters_the_level(monkeypatch):
    """The level d covers l~ + 2 e_S (s + e_S) + e_S^2 at every hot frequency (l~ replaced by 0 here): the symbol's
    rounding is not dropped."""
    rng = np.random.default_rng(6)
    L = layer(rng, 2, 2, 3, "floor", shift=1.0)
    p = params(*L)
    sn = sp.SymbolNorm(p)
    monkeypatch.setattr(ce, "certify_split", lambda F, *a, **k: torch.zeros(F.shape[0], dtype=torch.float64))
    ck, _, _, s_up, err_c, _ = ce.symbol_bounds(p, 4, 4, sn)
    level = 1e-30
    env = ce.channel_envelope(p, 4, 4, sn, level)
    eS = sn.matrix_error(ck) + err_c
    assert env.level >= float((2 * eS * (s_up + eS) + eS * eS).max())


def test_bound_holds_on_a_poor_basis(monkeypatch):
    """Theorem D5 is sound for any vectors: with random ones in place of the Ritz vectors, m22 >= lambda_max(R_F on
    span(Q)^perp) (R_F built here) and sqrt(tau) >= the dense SVD's norm."""
    rng = np.random.default_rng(8)
    L = layer(rng, 2, 2, 3, "floor", shift=1.0)
    H = W = 4
    T = dense_T(*L, H, W)
    CbE = circulant_embedding(*L, H, W)
    n = T.shape[0]
    Q = np.linalg.qr(rng.standard_normal((n, 6)))[0]
    monkeypatch.setattr(rd, "ritz_vectors", lambda *a, **k: (torch.ones(6, dtype=torch.float64), torch.tensor(Q)))
    p = params(*L)
    apply_err, B = operator_margins(p, H, W)
    rb = rd.ritz_bound(p, H, W, sp.SymbolNorm(p), apply_err=apply_err, t_up=B, K=6)
    Pm = np.eye(n) - Q @ Q.T
    assert rb.m22 >= np.linalg.eigvalsh(Pm @ CbE.T @ CbE @ Pm)[-1] * (1 - 1e-12)
    assert math.sqrt(rb.tau) >= np.linalg.norm(T, 2)
