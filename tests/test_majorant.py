"""The Toeplitz majorant bound (lipcheck.bounds.majorant) against dense matrices and 1-D norms built here from scratch."""
import math

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipcheck.bounds import majorant as mj
from lipcheck.bounds.spectral import SSoGParams

FAST = dict(max_rounds=6, time_budget=20.0)


def taps(k, mu, sigma):
    """g(k; mu, sigma) = exp(-(k - mu)^2 / (2 sigma^2)) / sum_j exp(-(j - mu)^2 / (2 sigma^2)), from scratch, with the
    largest exponent taken out of both (at the sigma floor every plain term underflows to 0)."""
    j = np.arange(math.floor(mu) - 80 - int(12 * sigma), math.ceil(mu) + 81 + int(12 * sigma))
    e = -(j - mu) ** 2 / (2 * sigma ** 2)
    z = np.exp(e - e.max()).sum()
    return np.exp(-(np.asarray(k, dtype=float) - mu) ** 2 / (2 * sigma ** 2) - e.max()) / z


def axis(n, mu, sigma):
    i = np.arange(n)
    return taps(i[:, None] - i[None, :], mu, sigma)


def dense_norm(alpha, mu, sigma, WV, WO, H, W):
    """||T||_2 of T(X) = sum_h K_h X P_h from the SPEC definition: (N C) x (N C) matrix, numpy SVD."""
    return np.linalg.norm(dense_T(alpha, mu, sigma, WV, WO, H, W), 2)


def dense_T(alpha, mu, sigma, WV, WO, H, W):
    """T(X) = sum_h K_h X P_h from the SPEC definition as an (N C) x (N C) matrix on row-major vec(X)."""
    h, M = alpha.shape
    C = WV.shape[0]
    d = C // h
    N = H * W
    T = np.zeros((N * C, N * C))
    for i in range(h):
        K = sum(alpha[i, m] * np.kron(axis(H, mu[i, m, 0], sigma[i, m, 0]), axis(W, mu[i, m, 1], sigma[i, m, 1]))
                for m in range(M))
        P = WV[:, i * d:(i + 1) * d] @ WO[i * d:(i + 1) * d, :]
        # vec(X) row-major: (K X P)[n, c] = sum K[n, n'] X[n', c'] P[c', c]
        T += np.kron(K, P.T)
    return T


def params(alpha, mu, sigma, WV, WO):
    t = lambda a: torch.tensor(np.asarray(a), dtype=torch.float64)  # noqa: E731
    return SSoGParams(t(alpha), t(mu), t(sigma), t(WV), t(WO))


def random_layer(rng, h, M, d, shift, width):
    C = h * d
    alpha = rng.standard_normal((h, M))
    mu = rng.uniform(-shift, shift, (h, M, 2))
    sigma = rng.uniform(0.3, width, (h, M, 2))
    WV = rng.standard_normal((C, C)) / math.sqrt(C)
    WO = rng.standard_normal((C, C)) / math.sqrt(C)
    return alpha, mu, sigma, WV, WO


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(h=st.integers(1, 3), M=st.integers(1, 3), H=st.integers(1, 6), W=st.integers(1, 6),
       shift=st.floats(0.0, 3.0), width=st.floats(0.5, 4.0), seed=st.integers(0, 10 ** 6))
def test_majorant_above_dense_norm(h, M, H, W, shift, width, seed):
    rng = np.random.default_rng(seed)
    layer = random_layer(rng, h, M, 2, shift, width)
    exact = dense_norm(*layer, H, W)
    p = params(*layer)
    m = mj.toeplitz_majorant(p, H, W, **FAST)
    assert m.upper >= exact * (1 - 1e-12)
    # never looser than the sum of the moduli (Toeplitz majorant <= sup of its envelope <= triangle bound + rounding)
    P = [layer[3][:, i * 2:(i + 1) * 2] @ layer[4][i * 2:(i + 1) * 2, :] for i in range(h)]
    triangle = sum(np.linalg.norm(P[i], 2) * np.abs(layer[0][i]).sum() for i in range(h))
    assert m.upper <= triangle * 1.05 + 1e-12


def test_factorised_single_component():
    """One head, one component: ||T|| = |alpha| ||G_H|| ||G_W|| ||P||. The majorant is >= it for shifted kernels and
    tight (the symbol |alpha ghat_y ghat_x| ||P|| is the modulus of a positive symbol) at mu = 0."""
    rng = np.random.default_rng(3)
    C = 4
    WV, WO = rng.standard_normal((C, C)), rng.standard_normal((C, C))
    Pn = np.linalg.norm(WV @ WO, 2)
    for mu, H, W, tol in (((0.0, 0.0), 3, 4, 2e-3), ((0.0, 0.0), 8, 8, 2e-3), ((1.3, -0.7), 5, 4, None)):
        alpha = np.array([[-0.8]])
        sig = np.array([[[1.1, 0.7]]])
        m3 = np.array([[list(mu)]])
        exact = 0.8 * np.linalg.norm(axis(H, mu[0], 1.1), 2) * np.linalg.norm(axis(W, mu[1], 0.7), 2) * Pn
        b = mj.toeplitz_majorant(params(alpha, m3, sig, WV, WO), H, W, rtol=5e-4, max_rounds=30).upper
        assert b >= exact
        if tol is not None:
            assert b <= exact * (1 + tol)


def test_envelope_covers_and_dominates_the_symbol():
    """Every frequency lies in a cell of the half torus or its mirror, and the bilinear envelope there is >= s(w) =
    ||sum_h c_h(w) P_h||, c_h from the SPEC kernel summed here. Catches a dropped cell or a dropped remainder term
    (near the maximum s is concave, so the bilinear interpolation of the corners alone falls below it)."""
    rng = np.random.default_rng(7)
    alpha, mu, sigma, WV, WO = random_layer(rng, 2, 2, 2, 1.0, 2.0)
    alpha = np.abs(alpha)
    m = mj.toeplitz_majorant(params(alpha, mu, sigma, WV, WO), 5, 5, **FAST)
    cells = m.info["cells"]
    w0, h0, a = (cells[k].numpy() for k in ("centre", "half_width", "coefficients"))
    scale = 2.0 ** cells["log2_scale"]
    pts = rng.uniform(-math.pi, math.pi, (400, 2))
    # add points at the maximum (w = 0 for positive kernels) and at cell corners
    pts = np.concatenate([pts, [[0.0, 0.0], [1e-3, -1e-3]], w0[:50] + 0.999 * h0[:50]])
    k = np.arange(-120, 121)
    d = 2
    for wy, wx in pts:
        c = np.zeros(2, dtype=complex)
        for i in range(2):
            for j in range(2):
                gy = (taps(k, mu[i, j, 0], sigma[i, j, 0]) * np.exp(-1j * k * wy)).sum()
                gx = (taps(k, mu[i, j, 1], sigma[i, j, 1]) * np.exp(-1j * k * wx)).sum()
                c[i] += alpha[i, j] * gy * gx
        S = sum(c[i] * (WV[:, i * d:(i + 1) * d] @ WO[i * d:(i + 1) * d, :]) for i in range(2))
        s = np.linalg.norm(S, 2)
        env = 0.0
        for v in ((wy, wx), (-wy, -wx)):
            v = np.array(v)
            v[1] = (v[1] + math.pi) % (2 * math.pi) - math.pi
            inside = np.all(np.abs(v[None] - w0) <= h0, axis=1)
            for j in np.nonzero(inside)[0]:
                ey, ex = (v - w0[j]) / h0[j]
                env += a[j, 0, 0] + a[j, 1, 0] * ey + a[j, 0, 1] * ex + a[j, 1, 1] * ey * ex
        assert env * scale >= s * (1 - 1e-12), (wy, wx, env * scale, s)


def test_fourier_coefficients_against_quadrature():
    """t[k, l] of a bilinear envelope on two rectangles, against Gauss-Legendre quadrature of the definition; the
    stated rounding bound covers the difference."""
    w = torch.tensor([[0.7, -1.1], [2.0, 0.4]], dtype=torch.float64)
    h = torch.tensor([[0.3, 0.5], [0.05, 1.2]], dtype=torch.float64)
    a = torch.tensor([[[1.0, 0.3], [-0.2, 0.1]], [[2.0, -0.5], [0.4, 0.25]]], dtype=torch.float64)
    H, W = 4, 5
    t, err = mj.toeplitz_coefficients(a, w, h, H, W)
    x, wt = np.polynomial.legendre.leggauss(200)
    for k in range(-(H - 1), H):
        for l in range(-(W - 1), W):
            tot = 0.0
            for j in range(2):
                m, hh, aa = w[j].numpy(), h[j].numpy(), a[j].numpy()
                Y, X = m[0] + hh[0] * x, m[1] + hh[1] * x
                fy = [wt * hh[0] * np.exp(-1j * k * Y), wt * hh[0] * x * np.exp(-1j * k * Y)]
                fx = [wt * hh[1] * np.exp(-1j * l * X), wt * hh[1] * x * np.exp(-1j * l * X)]
                for p_ in (0, 1):
                    for q_ in (0, 1):
                        tot += 2 * (aa[p_, q_] * fy[p_].sum() * fx[q_].sum()).real
            ref = tot / (2 * math.pi) ** 2
            assert abs(float(t[k + H - 1, l + W - 1]) - ref) <= err + 1e-14, (k, l)
    assert err < 1e-12


def test_psi_series_and_closed_form_agree():
    x = torch.tensor([1e-8, 0.3, 0.999, 1.0, 1.001, 3.0, 40.0, -0.5, -7.0], dtype=torch.float64)
    ref = [(math.sin(v) - v * math.cos(v)) / v ** 2 if abs(v) > 1e-3 else v / 3 - v ** 3 / 30 for v in x.tolist()]
    assert torch.allclose(mj.psi(x), torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_monotone_in_refinement_and_never_below_the_finer_bound_by_much():
    """A coarser envelope is a valid majorant too, so a run with more rounds gives a smaller-or-equal estimate up
    to the certificate's pad, and both stay >= the dense norm."""
    rng = np.random.default_rng(11)
    layer = random_layer(rng, 2, 2, 2, 0.5, 2.0)
    exact = dense_norm(*layer, 4, 4)
    coarse = mj.toeplitz_majorant(params(*layer), 4, 4, max_rounds=2)
    fine = mj.toeplitz_majorant(params(*layer), 4, 4, max_rounds=8, rtol=1e-4)
    assert exact <= fine.upper <= coarse.upper * (1 + 1e-6)


@pytest.mark.parametrize("bad", ["alpha", "mu", "sigma", "W_V", "W_O"])
def test_non_finite_raises(bad):
    """A NaN anywhere in the layer is refused, and the refusal names the parameter that holds it."""
    rng = np.random.default_rng(0)
    layer = list(random_layer(rng, 1, 1, 2, 0.0, 1.0))
    idx = {"alpha": 0, "mu": 1, "sigma": 2, "W_V": 3, "W_O": 4}[bad]
    layer[idx] = layer[idx].copy()
    layer[idx].flat[0] = np.nan
    with pytest.raises(ValueError, match=f"^{bad} has NaN"):
        mj.toeplitz_majorant_bound(params(*layer), 3, 3)


@pytest.mark.parametrize("H,W", [(0, 3), (3, -1), (2.5, 2), (True, 3)])
def test_bad_grid_raises(H, W):
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError):
        mj.toeplitz_majorant_bound(params(*random_layer(rng, 1, 1, 2, 0.0, 1.0)), H, W)


def test_wired_into_ssog_lipschitz_at_any_scale(monkeypatch):
    """ssog_lipschitz(majorant=True) keeps lower <= exact <= upper, with weights far from unit scale (the bound is
    computed on the normalised operator and must be scaled back exactly once)."""
    import lipcheck
    monkeypatch.setitem(mj.toeplitz_majorant.__kwdefaults__, "max_rounds", 6)  # a coarse envelope: still valid
    from lipcheck.bounds.lipschitz import ssog_lipschitz
    torch.manual_seed(0)
    layer = lipcheck.SSoG(6, 3).double()
    with torch.no_grad():
        layer.v_proj.weight.mul_(37.0)
        layer.o_proj.weight.mul_(1 / 1024)
    r = ssog_lipschitz(layer, 3, 4, majorant=True, rf_rtol=1e-2, seed=0)
    assert r.info["majorant"]["value"] >= r.exact * (1 - 1e-12)
    assert r.lower <= r.exact <= r.upper
    assert r.upper <= r.info["majorant"]["value"]


def test_float32_certification_above_dense_norm():
    """The same bound computed in float32 (u = 2^-24, every margin from it) stays >= the float64 dense norm."""
    rng = np.random.default_rng(5)
    layer = random_layer(rng, 2, 2, 2, 1.0, 2.0)
    exact = dense_norm(*layer, 4, 3)
    p32 = SSoGParams(*(torch.tensor(np.asarray(a), dtype=torch.float32) for a in layer))
    # the float32 weights are the layer here: compare against the dense norm of exactly those numbers
    exact32 = dense_norm(*(t.double().numpy() for t in (p32.alpha, p32.mu, p32.sigma, p32.WV, p32.WO)), 4, 3)
    b = mj.toeplitz_majorant_bound(p32, 4, 3, max_rounds=6)
    assert b >= exact32 and abs(exact32 / exact - 1) < 1e-5


def two_level_toeplitz(t, H, W):
    """M[(a, b), (a', b')] = t[a - a', b - b'] by explicit loops over the row-major tokens (t indexed by offsets)."""
    M = np.zeros((H * W, H * W))
    for a in range(H):
        for b in range(W):
            for a2 in range(H):
                for b2 in range(W):
                    M[a * W + b, a2 * W + b2] = t[a - a2 + H - 1, b - b2 + W - 1]
    return M


@pytest.mark.parametrize("H,W", [(1, 1), (1, 4), (3, 1), (3, 5), (6, 4)])
def test_toeplitz_matvec_and_dense_matrix_against_loops(H, W):
    """The FFT matvec (circulant embedding) and the dense two-level Toeplitz matrix, for a non-symmetric coefficient
    array (so that a swapped offset sign or axis shows), against the matrix written out entry by entry."""
    rng = np.random.default_rng(H * 10 + W)
    t = rng.standard_normal((2 * H - 1, 2 * W - 1))
    ref = two_level_toeplitz(t, H, W)
    tt = torch.tensor(t, dtype=torch.float64)
    assert np.array_equal(mj.dense_toeplitz(tt, H, W).numpy(), ref)
    A = mj.ToeplitzMatvec(tt, H, W)
    for _ in range(3):
        x = rng.standard_normal(H * W)
        y = A(torch.tensor(x, dtype=torch.float64))
        assert y.shape == (H * W,)
        assert np.allclose(y.numpy(), ref @ x, rtol=1e-12, atol=1e-12 * np.abs(ref).sum(1).max() * np.abs(x).max())


def test_spectral_mass_against_direct_sums():
    """(2pi)^-2 int_cell |v^|^2 over a cell and its mirror, estimated from v^ at the centre and the 4 corners (mean of
    the 5 values times twice the cell area), with v^(w) = sum_{a,b} v[a, b] e^{-i (a wy + b wx)} summed here. The
    cells have different half widths per axis, so a swapped axis shows; a cell of the whole torus gives Parseval."""
    rng = np.random.default_rng(2)
    H, W = 3, 5
    v = rng.standard_normal(H * W)
    w = np.array([[0.4, -1.2], [2.5, 0.3], [0.1, 2.9]])
    r = np.array([[0.2, 0.05], [0.01, 0.3], [0.07, 0.11]])
    V = v.reshape(H, W)
    a, b = np.arange(H), np.arange(W)

    def vhat(wy, wx):
        return (V * np.exp(-1j * (a[:, None] * wy + b[None, :] * wx))).sum()

    got = mj.spectral_mass(torch.tensor(v), torch.tensor(w), torch.tensor(r), H, W).numpy()
    for j in range(3):
        vals = [abs(vhat(w[j, 0] + oy * r[j, 0], w[j, 1] + ox * r[j, 1])) ** 2
                for oy, ox in ((0, 0), (-1, -1), (-1, 1), (1, -1), (1, 1))]
        ref = np.mean(vals) * 2 * (2 * r[j, 0]) * (2 * r[j, 1]) / (2 * math.pi) ** 2
        assert abs(got[j] - ref) <= 1e-12 * ref, j
    # the constant vector: |v^|^2 is the product of two Fejer kernels, equal to (H W)^2 at w = 0
    one = mj.spectral_mass(torch.ones(H * W, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64),
                           torch.full((1, 2), 1e-9, dtype=torch.float64), H, W)
    assert abs(float(one[0]) - (H * W) ** 2 * 2 * 4e-18 / (2 * math.pi) ** 2) <= 1e-9 * float(one[0])


def _u(dt):
    return mpmath.mpf(2) ** (-53 if dt == torch.float64 else -24)


def _gamma(n, u):
    return n * u / (1 - n * u)


def _phase_error(k, u):
    """proofs/S2.md: the product k m rounds once (u |k| (pi + 1)), cos and sin add 2u each."""
    return abs(k) * u * (mpmath.pi + 1) * (1 + 2 * u) + 4 * u


def _psi_error(u):
    """proofs/S2.md: 16 u beyond |x| = 1, gamma_64 plus the series tail (< 1e-20) within."""
    return 16 * u + _gamma(64, u) + mpmath.mpf("1e-20")


def test_rounding_allowances_against_proofs():
    """centre_error, phase_error, psi_error and the widened half widths against the formulas of proofs/S2.md
    ('Coverage in floating point', 'Rounding of the coefficients') evaluated at 50 digits: each is at least the
    proof's value up to the rounding of evaluating it (a smaller allowance makes the certified bound untrue in the
    worst case), and none is more than a few u above it."""
    mpmath.mp.dps = 50
    for dt in (torch.float64, torch.float32):
        u = _u(dt)
        uf = float(u)
        ec = (2 * 64 + 4) * u * mpmath.pi
        assert ec <= mj.centre_error(uf) <= ec * (1 + 8 * u)
        for k in (0, 1, 2, 5, 31):
            ref = _phase_error(k, u)
            assert abs(mj.phase_error(k, uf) - ref) <= 2 * u * ref if k else mj.phase_error(k, uf) == ref
        ref = _psi_error(u)
        assert abs(mj.psi_error(uf) - ref) <= 2 * u * ref
        r = torch.tensor([[0.1, 0.3], [1e-12, 2.0]], dtype=dt)
        wid = mj._widen(r, uf)
        for x, y in zip(r.flatten().tolist(), wid.flatten().tolist()):
            # the exact cell (half width x (1 +- 2u), centre within ec) lies inside the widened one
            assert y >= x * (1 + 2 * u) + ec
            assert y <= (x + ec) * (1 + 12 * u)  # the widening 4u, centre_error's own 4u, three roundings


@pytest.mark.parametrize("dt", [torch.float64, torch.float32])
@pytest.mark.parametrize("H,W,J", [(2, 2, 1), (2, 1, 1), (1, 2, 3), (4, 5, 2), (7, 3, 5)])
def test_coefficient_rounding_bound_against_proof(dt, H, W, J):
    """The bound on |fl(t) - t| returned by toeplitz_coefficients against proofs/S2.md at 50 digits:
    e_t = V1 ((1 + d_y)(1 + d_x)(1 + gamma_{8J+8}) - 1) + 32 J t_min, V1 = (2/pi^2) sum_j sum|a_j| h_y h_x,
    d = phase_error(n - 1) + gamma_10 + psi_error. Never below it; above it by no more than V1's own rounding."""
    mpmath.mp.dps = 50
    g = torch.Generator().manual_seed(H * 100 + W * 10 + J)
    a = (torch.rand(J, 2, 2, generator=g, dtype=torch.float64) - 0.3).to(dt)
    w = (torch.rand(J, 2, generator=g, dtype=torch.float64) * 2).to(dt)
    h = (torch.rand(J, 2, generator=g, dtype=torch.float64) * 0.5).to(dt)
    _, err = mj.toeplitz_coefficients(a, w, h, H, W)
    u = _u(dt)
    mp = lambda x: mpmath.mpf(float(x))  # noqa: E731
    V1 = 2 / mpmath.pi ** 2 * sum(sum(abs(mp(x)) for x in a[j].flatten()) * mp(h[j, 0]) * mp(h[j, 1])
                                  for j in range(J))
    dy = _phase_error(H - 1, u) + _gamma(10, u) + _psi_error(u)
    dx = _phase_error(W - 1, u) + _gamma(10, u) + _psi_error(u)
    ref = V1 * ((1 + dy) * (1 + dx) * (1 + _gamma(8 * J + 8, u)) - 1) + 32 * J * mp(torch.finfo(dt).smallest_normal)
    assert ref <= err <= ref * (1 + 2 * _gamma(4 * J + 8, u) + _gamma(32, _u(torch.float64)))



@pytest.mark.parametrize("dt", [torch.float64, torch.float32])
def test_coefficient_rounding_bound_carries_the_sum_allowance(dt):
    """With J = 3000 cells the computed V1 (a sum of 3000 terms) carries the factor 1 + gamma_{4J+8} for its own
    rounding (proofs/S2.md): e_t is at least the 50-digit proof value times 1 + gamma_{4J+8} / 2. The rounding that
    actually occurs in the sum is orders of magnitude below gamma_{4J+8}, so an allowance without that factor would
    land below this line."""
    mpmath.mp.dps = 50
    H, W, J = 4, 3, 3000
    g = torch.Generator().manual_seed(17)
    a = (torch.rand(J, 2, 2, generator=g, dtype=torch.float64) - 0.3).to(dt)
    w = (torch.rand(J, 2, generator=g, dtype=torch.float64) * 2).to(dt)
    h = (torch.rand(J, 2, generator=g, dtype=torch.float64) * 0.5).to(dt)
    _, err = mj.toeplitz_coefficients(a, w, h, H, W)
    u = _u(dt)
    A, hh = a.double().abs().sum((1, 2)).tolist(), h.double().tolist()
    V1 = 2 / mpmath.pi ** 2 * mpmath.fsum(mpmath.mpf(A[j]) * mpmath.mpf(hh[j][0]) * mpmath.mpf(hh[j][1])
                                          for j in range(J))
    dy = _phase_error(H - 1, u) + _gamma(10, u) + _psi_error(u)
    dx = _phase_error(W - 1, u) + _gamma(10, u) + _psi_error(u)
    ref = V1 * ((1 + dy) * (1 + dx) * (1 + _gamma(8 * J + 8, u)) - 1) + 32 * J * mpmath.mpf(torch.finfo(dt).smallest_normal)
    assert ref * (1 + _gamma(4 * J + 8, u) / 2) <= err <= ref * (1 + 2 * _gamma(4 * J + 8, u) + _gamma(32, _u(torch.float64)))

def test_bilinear_coefficients_against_exact_interpolation():
    """a[p, q] against the bilinear interpolant of the corner values in exact rationals (proofs/S2.md, 'Envelope'):
    a10, a01, a11 are the exact differences (dyadic inputs: no rounding), the envelope takes the corner values
    kappa + rho at the corners, and a00 is (mean(kappa) + rho)(1 + gamma_4) + 3 gamma_4 max kappa (the allowance for
    the three other coefficients' rounding) up to its own rounding."""
    from fractions import Fraction as Fr
    kb = torch.tensor([[1.0, 1.25, 1.5, 8.0], [3.0, 0.5, 2.0, 0.75], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    rho = torch.tensor([0.125, 0.0, 2.0], dtype=torch.float64)
    a = mj.bilinear_coefficients(kb, rho)
    u = Fr(1, 2 ** 53)
    g4 = 4 * u / (1 - 4 * u)
    for j in range(3):
        mm, mp, pm, pp = (Fr(float(x)) for x in kb[j])  # corners (wy, wx) = (-,-), (-,+), (+,-), (+,+)
        rj = Fr(float(rho[j]))
        for (ey, ex), kap in (((-1, -1), mm), ((-1, 1), mp), ((1, -1), pm), ((1, 1), pp)):
            # the exact interpolant at the corners: kappa + rho
            val = (mm + mp + pm + pp) / 4 + rj + Fr(float(a[j, 1, 0])) * ey + Fr(float(a[j, 0, 1])) * ex \
                + Fr(float(a[j, 1, 1])) * ey * ex
            assert val == kap + rj
        a00 = (mm + mp + pm + pp) / 4 * (1 + g4) + rj * (1 + g4) + 3 * g4 * max(mm, mp, pm, pp)
        assert abs(Fr(float(a[j, 0, 0])) - a00) <= 2 * u * a00


@pytest.mark.parametrize("dt", [torch.float64, torch.float32])
def test_interval_transforms_against_integrals(dt):
    """I(k) = (1/2pi) int_{m-h}^{m+h} e^{-ikw} dw and L(k) = (1/2pi) int ((w - m)/h) e^{-ikw} dw by mpmath quadrature,
    for small and large k h (the series and the closed form of psi) and k = 0; the error is within the allowance of
    proofs/S2.md, (h/pi)(phase_error + gamma_10 + psi_error)."""
    mpmath.mp.dps = 30
    k = torch.arange(-6, 7, dtype=dt)
    m = torch.tensor([0.3, -2.9, 1.7], dtype=dt)
    h = torch.tensor([0.05, 0.4, 1.3], dtype=dt)
    I, L = mj.interval_transforms(k, m, h)
    u = _u(dt)
    for j in range(3):
        mj_, hj = mpmath.mpf(float(m[j])), mpmath.mpf(float(h[j]))
        allow = hj / mpmath.pi * (_phase_error(6, u) + _gamma(10, u) + _psi_error(u))
        for i, kk in enumerate(range(-6, 7)):
            e = lambda w: mpmath.exp(-1j * kk * w) / (2 * mpmath.pi)  # noqa: E731
            ri = mpmath.quad(e, [mj_ - hj, mj_ + hj])
            rl = mpmath.quad(lambda w: (w - mj_) / hj * e(w), [mj_ - hj, mj_ + hj])
            assert abs(complex(I[j, i]) - ri) <= allow, (j, kk)
            assert abs(complex(L[j, i]) - rl) <= allow, (j, kk)


def _one_head_positive(C=4, seed=3):
    """One head, one centred component: the symbol -0.8 ghat_y ghat_x P has modulus 0.8 ghat_y ghat_x ||P|| (ghat > 0),
    so the majorant is tight and ||T|| = 0.8 ||G_H|| ||G_W|| ||P|| exactly (T = K kron P^T, K = G_H kron G_W)."""
    rng = np.random.default_rng(seed)
    WV, WO = rng.standard_normal((C, C)), rng.standard_normal((C, C))
    p = params([[-0.8]], [[[0.0, 0.0]]], [[[1.1, 0.7]]], WV, WO)
    return p, lambda H, W: 0.8 * np.linalg.norm(axis(H, 0, 1.1), 2) * np.linalg.norm(axis(W, 0, 0.7), 2) \
        * np.linalg.norm(WV @ WO, 2)


def test_tight_on_a_positive_symbol_and_margin_assembled_as_in_proof():
    """On the factorised positive case the bound is within rtol of the exact norm (product of 1-D Toeplitz norms
    times ||P||) and the envelope's own lambda_max is between them. The final margin is the proof's
    ||E||_2 <= (2H - 1)(2W - 1) e_t for the coefficient allowance e_t of the stored cells (pinned to the proof in
    test_coefficient_rounding_bound_against_proof), checked in exact rationals: never below it, and the certificate
    adds little (the pad of the Cholesky check starts at 1e-10)."""
    from fractions import Fraction as Fr
    H, W, rtol = 3, 4, 1e-2
    p, exact_of = _one_head_positive()
    exact = exact_of(H, W)
    m = mj.toeplitz_majorant(p, H, W, rtol=rtol, max_rounds=40)
    assert exact * (1 - 1e-12) <= m.estimate <= m.upper <= exact * (1 + rtol)
    assert m.upper - m.estimate <= 1e-8 * m.upper
    assert m.info["excess_estimate"] <= rtol * m.estimate  # the stopping rule it ran to
    cells = m.info["cells"]
    _, e_t = mj.toeplitz_coefficients(cells["coefficients"], cells["centre"], cells["half_width"], H, W)
    e = cells["log2_scale"]
    assert Fr(m.margin) >= (2 * H - 1) * (2 * W - 1) * Fr(e_t) * Fr(2) ** e > 0
    assert m.margin <= (2 * H - 1) * (2 * W - 1) * e_t * 2.0 ** e * (1 + 1e-14)
    # max_w s(w) = 0.8 ||P|| at w = 0 (positive taps summing to 1): the envelope's maximum is above it, and close
    smax = 0.8 * np.linalg.norm(p.WV.numpy() @ p.WO.numpy(), 2)
    assert smax <= m.info["symbol_max_upper"] <= smax * (1 + 0.05)


@pytest.mark.parametrize("H,W,rounds", [(3, 4, 0), (3, 4, 3), (8, 8, 1)])
def test_excess_estimate_tracks_the_true_excess(H, W, rounds):
    """info['excess_estimate'] (mass-weighted envelope slack over s(w), remainder included) estimates how far the
    envelope's lambda_max lies above ||T||. On the factorised positive case, where ||T|| is known exactly (1-D
    Toeplitz norms times ||P||), it is within a factor 1.5 of estimate - ||T|| from the coarse start (excess ~0.3)
    to a refined envelope (excess ~0.006); measured 0.83-0.94 of it."""
    p, exact_of = _one_head_positive()
    m = mj.toeplitz_majorant(p, H, W, max_rounds=rounds, rtol=1e-4)
    true_excess = m.estimate - exact_of(H, W)
    assert true_excess > 0
    assert true_excess / 1.5 <= m.info["excess_estimate"] <= true_excess * 1.5

def test_stalled_refinement_returns_a_certified_bound():
    """In float32 a requested rtol of 1e-6 is below what the envelope's rounding floor allows: lambda stops moving
    while the excess estimate stays above rtol, and the stall rule ends the refinement well before max_rounds.
    That exit still returns the full certificate: above the exact norm (by 5% here, float32's margins)."""
    p, exact_of = _one_head_positive()
    p32 = SSoGParams(*(x.float() for x in (p.alpha, p.mu, p.sigma, p.WV, p.WO)))
    m = mj.toeplitz_majorant(p32, 3, 4, rtol=1e-6, max_rounds=80)
    assert isinstance(m, mj.MajorantBound) and m.rounds < 80 and m.info["excess_estimate"] > 1e-6 * m.estimate
    exact = exact_of(3, 4) * (1 + 1e-6)  # p32's weights are p's rounded to float32: ||T|| moves by < 1e-6
    assert exact_of(3, 4) * (1 - 1e-6) <= m.upper <= exact * 1.1

def test_scale_moved_out_and_back():
    """Weights far from unit scale (alpha * 37, W_O / 1024, not powers of two): the operator scales by 37/1024 and
    so do the exact norm and the bound, which stays above it and within rtol."""
    H, W, rtol = 3, 4, 1e-2
    p, exact_of = _one_head_positive()
    exact = exact_of(H, W) * 37 / 1024
    q = SSoGParams(p.alpha * 37, p.mu, p.sigma, p.WV, p.WO / 1024)
    m = mj.toeplitz_majorant(q, H, W, rtol=rtol, max_rounds=40)
    assert exact * (1 - 1e-12) <= m.estimate <= m.upper <= exact * (1 + rtol)
    assert 0 < m.margin <= 1e-10 * m.upper


def test_refinement_stops_once_the_excess_is_below_rtol():
    """The documented stopping rule: refinement ends at the first round whose excess estimate is below rtol lambda
    with no anchor added, so the last round only confirms (one round fewer gives the same bound) and every earlier
    round changed the envelope (two rounds fewer gives a looser one)."""
    H, W, rtol = 3, 4, 1e-2
    p, _ = _one_head_positive()
    m = mj.toeplitz_majorant(p, H, W, rtol=rtol, max_rounds=40)
    assert 2 <= m.rounds < 40
    one_less = mj.toeplitz_majorant(p, H, W, rtol=rtol, max_rounds=m.rounds - 1)
    two_less = mj.toeplitz_majorant(p, H, W, rtol=rtol, max_rounds=m.rounds - 2)
    assert one_less.upper == m.upper and one_less.cells == m.cells
    assert two_less.upper > m.upper


def test_beat_stops_refinement_only_when_the_callers_bound_cannot_be_beaten():
    """T_N(s_up) >= T_N(s) for every envelope, so once v^T T_N(s) v (estimated from the spectral mass) exceeds the
    caller's bound, refining further cannot help. A bound below ||T|| (half of it) stops the refinement after its
    first round, still certified; a bound far above it changes nothing."""
    H, W, rtol = 3, 4, 1e-2
    p, exact_of = _one_head_positive()
    exact = exact_of(H, W)
    free = mj.toeplitz_majorant(p, H, W, rtol=rtol, max_rounds=40)
    assert free.rounds >= 2
    low = mj.toeplitz_majorant(p, H, W, rtol=rtol, max_rounds=40, beat=0.5 * exact)
    assert low.rounds == 1 and low.upper >= exact * (1 - 1e-12)
    high = mj.toeplitz_majorant(p, H, W, rtol=rtol, max_rounds=40, beat=1.01 * free.estimate)
    assert (high.upper, high.rounds, high.cells) == (free.upper, free.rounds, free.cells)


def test_corner_bounds_tight_at_anchored_cells():
    """Corner bounds of small linearised cells whose centres carry anchors (exact SVDs) are within 1e-6 of
    ||sum_h c_h P_h|| at the four corners c(w0) + J (corner - w0), computed here with numpy's SVD from
    P_h = W_V,h W_O,h; the triangle bound alone (what is left without anchors) is far above it for two heads. One
    cell alone, several together, and the anchors passed explicitly must all be tight."""
    from lipcheck.bounds import spectral as sp
    rng = np.random.default_rng(4)
    alpha, mu, sigma, WV, WO = random_layer(rng, 2, 2, 2, 1.0, 2.0)
    q = sp.normalised(params(alpha, mu, sigma, WV, WO))
    sn = sp.SymbolNorm(q)
    model = mj.CellModel(q, sn)
    w = torch.tensor([[0.3, -0.4], [1.9, 2.2], [0.05, 0.8]], dtype=torch.float64)
    r = torch.full((3, 2), 1e-5, dtype=torch.float64)
    c, J = sp.symbol_and_gradient(q, w[:, 0], w[:, 1])
    sn.add_anchors(c)
    P = [q.WV[:, i * 2:(i + 1) * 2].numpy() @ q.WO[i * 2:(i + 1) * 2, :].numpy() for i in range(2)]
    cn, Jn, rn = c.numpy(), J.numpy(), r.numpy()
    corners = [(-1, -1), (-1, 1), (1, -1), (1, 1)]
    ref = np.array([[np.linalg.norm(sum((cn[n, i] + Jn[n, i, 0] * sy * rn[n, 0] + Jn[n, i, 1] * sx * rn[n, 1]) * P[i]
                                        for i in range(2)), 2) for sy, sx in corners] for n in range(3)])
    tri = np.array([[sum(abs(cn[n, i]) * np.linalg.norm(P[i], 2) for i in range(2))] * 4 for n in range(3)])
    assert (tri > ref * 1.01).all()  # the anchors must do the work
    for kb in (model.corner_bounds(c[:1], J[:1], r[:1]).numpy(), model.corner_bounds(c, J, r).numpy(),
               model.corner_bounds(c, J, r, nearest=1, batch=1).numpy(),
               model.corner_bounds(c, J, r, sn.all_anchors()).numpy()):
        n = kb.shape[0]
        assert kb.shape == (n, 4)
        assert (kb >= ref[:n] * (1 - 1e-12)).all() and (kb <= ref[:n] * (1 + 1e-6)).all(), (kb, ref[:n])
    assert model.corner_bounds(c[:0], J[:0], r[:0]).shape == (0, 4)


def test_cell_remainder_bounds_and_matches_taylor():
    """The cell model's remainder against the Taylor remainder of c(w) = alpha ghat_y(wy) ghat_x(wx) summed here from
    the taps: at w0 = 0 (mu = 0, so J = 0) on a cell thin in x, |c(w) - c(w0) - J (w - w0)| reaches
    (1/2)|alpha| ghat_y''(0) ry^2 = (1/2)|alpha| sum_k k^2 g(k) ry^2 at wy = +-ry, which is the bound's leading term:
    the bound holds and is within 1% of it. On square and off-centre cells it still holds."""
    from lipcheck.bounds import spectral as sp
    rng = np.random.default_rng(6)
    WV, WO = rng.standard_normal((2, 2)), rng.standard_normal((2, 2))
    alpha, sy, sx = -0.8, 1.7, 0.9
    q = sp.normalised(params([[alpha]], [[[0.0, 0.0]]], [[[sy, sx]]], WV, WO))
    model = mj.CellModel(q, sp.SymbolNorm(q))
    k = np.arange(-60, 61)
    gy, gx = taps(k, 0.0, sy), taps(k, 0.0, sx)

    def c_and_grad(wy, wx):
        ey, ex = np.exp(-1j * k * wy), np.exp(-1j * k * wx)
        Gy, Gx = (gy * ey).sum(), (gx * ex).sum()
        dGy, dGx = (-1j * k * gy * ey).sum(), (-1j * k * gx * ex).sum()
        return alpha * Gy * Gx, alpha * np.array([dGy * Gx, Gy * dGx])

    cells = [((0.0, 0.0), (0.02, 1e-9)), ((0.0, 0.0), (0.05, 0.05)), ((1.1, -0.6), (0.1, 0.04)),
             ((2.8, 3.0), (0.3, 0.3))]
    rem = model.remainder(torch.tensor([r for _, r in cells], dtype=torch.float64))[:, 0].numpy()
    s = np.linspace(-1, 1, 9)
    for (w0, r), bound in zip(cells, rem):
        c0, J0 = c_and_grad(*w0)
        worst = max(abs(c_and_grad(w0[0] + a * r[0], w0[1] + b * r[1])[0] - c0 - J0 @ np.array([a * r[0], b * r[1]]))
                    for a in s for b in s)
        assert worst <= bound, (w0, r, worst, bound)
    leading = 0.5 * abs(alpha) * (k ** 2 * gy).sum() * 0.02 ** 2
    assert leading * (1 - 1e-3) <= rem[0] <= leading * 1.01
    # a cell of radius 0 keeps only the rounding of c(w0) and J: a positive allowance of at least gamma_6 |c(w0)|
    # (|c(w0)| = |alpha| at w0 = 0), added to (never taken from) the Taylor term
    u = np.finfo(np.float64).eps / 2
    r0 = float(model.remainder(torch.zeros(1, 2, dtype=torch.float64))[0, 0])
    assert 6 * u * abs(alpha) <= r0 < 1e-10
    # pinned to the proof's allowance eta_c + gamma_6 (|c| + eta_c) at 50 digits, to within the rounding of forming it
    mpmath.mp.dps = 50
    ec, ca = mpmath.mpf(float(model.eta_c[0])), mpmath.mpf(float(model.c_abs[0]))
    assert ca == mpmath.mpf(float(q.alpha.abs().sum()))  # |c(w)| <= sum_m |alpha_m| (ghat <= 1)
    ref = ec + _gamma(6, _u(torch.float64)) * (ca + ec)
    assert abs(r0 - ref) <= 2 * u * ref
    # and at a cell of half widths (0.3, 0.2): the Taylor term 1/2 sum_m |alpha_m| q_m (1 + gamma_{M+8}) plus the
    # roundings, with q = D2y ry^2 + 2 D1y D1x ry rx + D2x rx^2 (proofs/S2.md), at 50 digits
    ry, rx = mpmath.mpf(0.3), mpmath.mpf(0.2)
    got = float(model.remainder(torch.tensor([[0.3, 0.2]], dtype=torch.float64))[0, 0])
    mp = lambda t: mpmath.mpf(float(t))  # noqa: E731
    D1y, D1x, D2y, D2x = mp(model.D1[0, 0, 0]), mp(model.D1[0, 0, 1]), mp(model.D2[0, 0, 0]), mp(model.D2[0, 0, 1])
    quad = D2y * ry ** 2 + 2 * D1y * D1x * ry * rx + D2x * rx ** 2
    U = _u(torch.float64)
    taylor = mpmath.mpf(0.5) * abs(mp(q.alpha[0, 0])) * quad * (1 + _gamma(1 + 8, U))
    ed = mp(model.eta_d[0, 0]) * ry + mp(model.eta_d[0, 1]) * rx
    jr = (mp(model.J_abs[0, 0]) + mp(model.eta_d[0, 0])) * ry + (mp(model.J_abs[0, 1]) + mp(model.eta_d[0, 1])) * rx
    ref = taylor + ec + ed + _gamma(6, U) * (ca + ec + jr)
    assert abs(got - ref) <= 4 * u * ref


def test_cell_remainder_cross_term_with_shifted_kernels():
    """Shifted kernels (mu = (3, 1), sigma = 0.5) make c(w) nearly alpha e^{-i(3 wy + wx)}: on the cell of half
    widths (0.01, 0.03) both axes move the phase equally, so the mixed derivative carries a third of the Taylor
    remainder. The bound (1/2) sum |alpha| (D2y ry^2 + 2 D1y D1x ry rx + D2x rx^2) holds against the remainder summed
    here from the taps on a 21 x 21 sample of the cell, and is within 0.1% of it."""
    from lipcheck.bounds import spectral as sp
    rng = np.random.default_rng(6)
    WV, WO = rng.standard_normal((2, 2)), rng.standard_normal((2, 2))
    alpha, (my, mx), sig, r = -0.8, (3.0, 1.0), 0.5, (0.01, 0.03)
    q = sp.normalised(params([[alpha]], [[[my, mx]]], [[[sig, sig]]], WV, WO))
    rem = float(mj.CellModel(q, sp.SymbolNorm(q)).remainder(torch.tensor([r], dtype=torch.float64))[0, 0])
    k = np.arange(-60, 61)
    gy, gx = taps(k, my, sig), taps(k, mx, sig)
    G = lambda g, w: (g * np.exp(-1j * k * w)).sum()  # noqa: E731
    dG = lambda g, w: (-1j * k * g * np.exp(-1j * k * w)).sum()  # noqa: E731
    c0, J0 = alpha * G(gy, 0) * G(gx, 0), alpha * np.array([dG(gy, 0) * G(gx, 0), G(gy, 0) * dG(gx, 0)])
    s = np.linspace(-1, 1, 21)
    worst = max(abs(alpha * G(gy, a * r[0]) * G(gx, b * r[1]) - c0 - J0 @ np.array([a * r[0], b * r[1]]))
                for a in s for b in s)
    assert worst <= rem <= worst * 1.001

@pytest.mark.parametrize("H,W", [(5, 7), (33, 32)])
def test_top_eigenpair_against_numpy(H, W):
    """lambda_max of T_N(t) for the coefficients of a positive symbol (a separated top eigenvalue), by the dense
    eigensolver (N <= 1024) and by Lanczos with the FFT matvec (N > 1024), against numpy's eigvalsh of the matrix
    built here; the returned vector is a unit eigenvector up to the Lanczos accuracy."""
    ky = np.arange(-(H - 1), H)[:, None]
    kx = np.arange(-(W - 1), W)[None, :]
    t = np.exp(-0.5 * (ky ** 2 / 1.5 ** 2 + kx ** 2 / 0.8 ** 2)) + 0.1 * np.exp(-np.abs(ky - kx) / 2)
    t = (t + t[::-1, ::-1]) / 2
    a, b = np.arange(H), np.arange(W)
    M = t[(a[:, None] - a[None, :] + H - 1)[:, None, :, None], (b[:, None] - b[None, :] + W - 1)[None, :, None, :]]
    M = M.reshape(H * W, H * W)
    ref = np.linalg.eigvalsh(M)[-1]
    lam, v = mj._top_eigen(torch.tensor(t), H, W, None, 120)
    v = v.numpy()
    assert abs(lam - ref) <= 1e-9 * ref
    assert abs(np.linalg.norm(v) - 1) <= 1e-8 and np.linalg.norm(M @ v - ref * v) <= 1e-4 * ref


def test_zero_layer_bound_is_zero_without_anchors():
    """alpha = 0: the operator is zero, the symbol vanishes, and the bound is 0 up to the smallest-normal-number
    allowances; no exact SVD is spent on a symbol whose triangle bound is already 0 (tie of 0 with 0 in the anchor
    rule)."""
    rng = np.random.default_rng(1)
    alpha, mu, sigma, WV, WO = random_layer(rng, 2, 2, 2, 1.0, 2.0)
    m = mj.toeplitz_majorant(params(0 * alpha, mu, sigma, WV, WO), 3, 3, max_rounds=2)
    assert 0 <= m.upper <= 1e-290
    assert m.anchors == 0


def test_corner_bounds_pick_the_anchor_nearest_in_the_symbol():
    """With one anchor per cell (nearest=1) the anchor must be the nearest in the size of the change of S(c)
    (sum_h |dc_h| F_h), not of the coefficients: head 1's projection is ~100 times heavier than head 2's, anchor a
    moves c by 0.01 in head 1 (a change of S as large as S), anchor b by 0.1 in head 2 (a tenth of S). Only b gives a
    bound within 1% of ||0.01 P_1 + P_2|| (numpy's SVD); a gives no better than the triangle bound."""
    from lipcheck.bounds import spectral as sp
    rng = np.random.default_rng(0)
    C = 4
    WV, WO = rng.standard_normal((C, C)), rng.standard_normal((C, C))
    WV[:, 2:] *= 0.01
    q = sp.normalised(params([[0.7], [0.7]], np.zeros((2, 1, 2)), np.ones((2, 1, 2)), WV, WO))
    sn = sp.SymbolNorm(q)
    model = mj.CellModel(q, sn)
    c = torch.tensor([[0.01, 1.0]], dtype=torch.complex128)
    sn.add_anchors(torch.cat([c + torch.tensor([[0.01, 0.0]], dtype=torch.complex128),
                              c + torch.tensor([[0.0, 0.1]], dtype=torch.complex128)]))
    P = [q.WV[:, i * 2:(i + 1) * 2].numpy() @ q.WO[i * 2:(i + 1) * 2, :].numpy() for i in range(2)]
    exact = np.linalg.norm(0.01 * P[0] + P[1], 2)
    assert 0.01 * np.linalg.norm(P[0], 2) > 0.5 * exact > 0.1 * np.linalg.norm(P[1], 2)
    kb = model.corner_bounds(c, torch.zeros(1, 2, 2, dtype=torch.complex128),
                             torch.full((1, 2), 1e-12, dtype=torch.float64), nearest=1).numpy()
    assert (kb >= exact * (1 - 1e-12)).all() and (kb <= exact * 1.01).all(), (kb, exact)


def test_final_bound_covers_its_certified_parts_exactly():
    """upper is the real sum mu + margin rounded up: in exact rationals it is never below that sum (a final
    rounding to nearest, or downward, loses up to an ulp and with it the certificate), and mu is at least the
    stored Toeplitz matrix's top eigenvalue computed densely here."""
    from fractions import Fraction as Fr
    H, W = 3, 4
    p, _ = _one_head_positive()
    m = mj.toeplitz_majorant(p, H, W, rtol=1e-2, max_rounds=40)
    mu = m.info["certified_eigenvalue"]
    assert Fr(m.upper) >= Fr(mu) + Fr(m.margin)
    assert m.upper <= (mu + m.margin) * (1 + 1e-15)
    cells = m.info["cells"]
    t, _ = mj.toeplitz_coefficients(cells["coefficients"], cells["centre"], cells["half_width"], H, W)
    lam = float(np.linalg.eigvalsh(mj.dense_toeplitz(t, H, W).numpy()).max()) * 2.0 ** cells["log2_scale"]
    assert lam <= mu <= lam * (1 + 1e-6)


def test_scale_back_rounds_outward_in_the_subnormal_range():
    """W_V and W_O times 2^-530 each (exact): the normalised operator is the same, so the bound is the unscaled
    one times 2^-1060, a subnormal. It must be rounded outward there: upper never below, estimate never above,
    the exact rational product, and within two subnormal steps of it."""
    from fractions import Fraction as Fr
    H, W = 3, 4
    p, _ = _one_head_positive()
    q = SSoGParams(p.alpha, p.mu, p.sigma, p.WV * 2.0 ** -530, p.WO * 2.0 ** -530)
    mb = mj.toeplitz_majorant(p, H, W, rtol=1e-2, max_rounds=40)
    ms = mj.toeplitz_majorant(q, H, W, rtol=1e-2, max_rounds=40)
    scale, tiny = Fr(2) ** -1060, Fr(2) ** -1074
    assert 0 < ms.upper < 2.2250738585072014e-308
    assert Fr(mb.upper) * scale <= Fr(ms.upper) <= Fr(mb.upper) * scale + 2 * tiny
    assert Fr(mb.estimate) * scale - 2 * tiny <= Fr(ms.estimate) <= Fr(mb.estimate) * scale
    assert Fr(ms.margin) >= Fr(mb.margin) * scale


def test_large_grid_final_estimate_and_certificate():
    """Past N = 1024 tokens the final estimate is a long Lanczos run on the FFT matvec (not a dense eigh) before the
    Cholesky certificate: on the factorised positive case (||T|| = 0.8 ||G_H|| ||G_W|| ||P||, 1-D norms here) at
    33 x 32 the bound is >= the exact norm and within 1% of it."""
    H, W = 33, 32
    p, exact_of = _one_head_positive()
    exact = exact_of(H, W)
    m = mj.toeplitz_majorant(p, H, W, rtol=1e-3, max_rounds=4)
    assert exact * (1 - 1e-12) <= m.upper <= exact * 1.01


def test_cell_model_gradient_bounds_cover_each_axis():
    """CellModel.J_abs[h, axis] bounds |d c_h / d w_axis| over the torus (it scales the rounding of the linearised
    corners). With mu = (3, 0) the y-derivative at w = 0 is alpha sum_k k g_y(k) ~ 3 alpha, five times the x-axis
    bound: each axis needs its own. Derivatives from the SPEC taps here."""
    rng = np.random.default_rng(4)
    WV, WO = rng.standard_normal((2, 2)), rng.standard_normal((2, 2))
    for mu in ((3.0, 0.0), (0.0, -3.0)):
        p = params([[0.9]], [[list(mu)]], [[[0.7, 0.7]]], WV, WO)
        q = mj.sp.normalised(p)
        model = mj.CellModel(q, mj.sp.SymbolNorm(q))
        alpha = float(q.alpha[0, 0])
        k = np.arange(-60, 61)
        for axis in (0, 1):
            other = 1 - axis
            d = abs((k * taps(k, mu[axis], 0.7)).sum()) * taps(k, mu[other], 0.7).sum() * abs(alpha)
            assert float(model.J_abs[0, axis]) >= d * (1 - 1e-12)


def test_cell_budget_initial_layout_and_a_callers_anchors():
    """The documented controls: the first envelope has (init_cells / 2) x init_cells cells on the half torus; no
    refinement round may take the cell count past max_cells (the round that would is not made); a SymbolNorm passed
    in is used as it is, so anchors it already holds count (and help) without being recomputed."""
    p, exact_of = _one_head_positive()
    assert mj.toeplitz_majorant(p, 3, 4, max_rounds=0).cells == 24 * 48
    assert mj.toeplitz_majorant(p, 3, 4, max_rounds=0, init_cells=6).cells == 3 * 6
    capped = mj.toeplitz_majorant(p, 3, 4, rtol=1e-6, max_rounds=6, max_cells=600, split_per_round=64, init_cells=16)
    assert capped.cells <= 600 and capped.upper >= exact_of(3, 4) * (1 - 1e-12)
    free = mj.toeplitz_majorant(p, 3, 4, rtol=1e-6, max_rounds=6, split_per_round=64, init_cells=16)
    assert free.cells > 600
    q = mj.sp.normalised(p)
    sn = mj.sp.SymbolNorm(q)
    w = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    sn.add_anchors(mj.sp.symbol_coefficients(q, w, -w))
    m = mj.toeplitz_majorant(p, 3, 4, max_rounds=0, sn=sn)
    assert m.anchors == 3 and sn.num_svd == 3


def test_envelope_coefficients_are_exactly_even():
    """The envelope s_up(w) is even, so its Fourier coefficients must satisfy t[k, l] = t[-k, -l] bit for bit: each
    pair is computed once (the half k > 0 or k = 0, l >= 0) and mirrored, so the stored T_N(s_up) is exactly
    symmetric, which the Cholesky certificate needs."""
    rng = np.random.default_rng(7)
    p = params(*random_layer(rng, 2, 2, 2, 2.0, 3.0))
    H, W = 4, 5
    mb = mj.toeplitz_majorant(p, H, W, max_rounds=1)
    cells = mb.info["cells"]
    t, _ = mj.toeplitz_coefficients(cells["coefficients"], cells["centre"], cells["half_width"], H, W)
    assert t.shape == (2 * H - 1, 2 * W - 1) and torch.equal(t, t.flip(0, 1))
    assert float((t - t.flip(0, 1)).abs().max()) == 0.0 and float(t.abs().max()) > 0


def test_the_default_round_budget_is_the_planned_one(monkeypatch):
    """max_rounds=None: the refinement runs the rounds `planned_rounds` gives for the channel count (rtol = 0 so that
    nothing but the budget stops it), and a count, not a clock, stops it."""
    rng = np.random.default_rng(3)
    p = params(*random_layer(rng, 2, 2, 2, 2.0, 3.0))
    seen = []
    monkeypatch.setattr(mj, "planned_rounds", lambda C, scale=1.0: seen.append(C) or 3)
    mb = mj.toeplitz_majorant(p, 5, 5, rtol=0.0)
    assert seen == [4] and mb.rounds == 3 and not mb.cut_short
