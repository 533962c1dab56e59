"""lipcheck.bounds.lognorm and the verified spectral bounds it reads from lipcheck.rounding (proofs/S2.md,
proofs/S5.md Lemmas 1-4): every constant against a value computed independently here (mpmath singular values
and eigenvalues at 40 digits, autograd Jacobians, the lemmas' formulas), and deliberately wrong guesses
that a verification must refuse."""
import math

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lipcheck import rounding
from lipcheck.bounds import lognorm as ln
from conftest import block_field, layer_norm, random_block

D = torch.float64
mpmath.mp.dps = 40


def _mp_norm2(M) -> mpmath.mpf:
    """||M||_2 at 40 digits: sqrt of the top eigenvalue of M^* M, from the stored entries (exact conversion)."""
    A = mpmath.matrix([[mpmath.mpc(complex(x)) for x in row] for row in M.tolist()])
    G = A.H * A
    return mpmath.sqrt(max(mpmath.re(e) for e in mpmath.eighe(G, eigvals_only=True)))


def _mp_lambda_max(S) -> mpmath.mpf:
    A = mpmath.matrix([[mpmath.mpf(float(x)) for x in row] for row in S.tolist()])
    return max(mpmath.eigsy(A, eigvals_only=True))


# ------------------------------------------------------------------ rounding: gamma_n, verified norms and eigenvalues

def test_gamma_and_unit_roundoff_are_the_shared_constants():
    assert rounding.unit_roundoff(torch.float64) == 2.0 ** -53 and rounding.unit_roundoff(torch.float32) == 2.0 ** -24
    assert rounding.gamma(5, torch.float32) == rounding.gamma(5, 2.0 ** -24) == 5 * 2.0 ** -24 / (1 - 5 * 2.0 ** -24)
    assert rounding.gamma(3) == 3 * 2.0 ** -53 / (1 - 3 * 2.0 ** -53)  # float64 by default
    assert rounding.gamma(2 ** 53, torch.float64) == math.inf
    with pytest.raises(ValueError, match="dtype"):
        rounding.unit_roundoff(torch.int64)
    # lognorm's and gaussian's names are the same objects: one implementation
    from lipcheck import gaussian
    assert ln.gamma is rounding.gamma is gaussian.gamma and ln.unit_roundoff is rounding.unit_roundoff
    assert ln.verified_lambda_max is rounding.verified_lambda_max


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10 ** 6), m=st.integers(1, 7), n=st.integers(1, 7),
       scale=st.sampled_from([1e-300, 1e-150, 1e-20, 1.0, 3e17, 1e150, 1e300]), cplx=st.booleans(),
       f32=st.booleans())
def test_norm2_upper_dominates_the_40_digit_norm_and_is_tight(seed, m, n, scale, cplx, f32):
    """||M||_2 <= norm2_upper(M) <= ||M||_2 (1 + 1e-10) at every scale float64 holds, real and complex,
    rectangular either way, float32 storage included (a float32 scale below its range is skipped)."""
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(m, n, generator=g, dtype=D)
    if cplx:
        M = torch.complex(M, torch.randn(m, n, generator=g, dtype=D))
    M = M * scale
    if f32:
        if not 1e-30 < scale < 1e30:
            return
        M = M.to(torch.complex64 if cplx else torch.float32)
    got = float(rounding.norm2_upper(M))
    ref = _mp_norm2(M)
    assert mpmath.mpf(got) >= ref, (got, ref)
    assert got <= float(ref) * (1 + 1e-10), (got, float(ref))


def test_norm2_upper_batches_and_refuses_nonfinite():
    g = torch.Generator().manual_seed(1)
    M = torch.randn(3, 5, 4, generator=g, dtype=D) * torch.tensor([1e-3, 1.0, 1e3], dtype=D)[:, None, None]
    got = rounding.norm2_upper(M)
    for i in range(3):
        ref = _mp_norm2(M[i])
        assert mpmath.mpf(float(got[i])) >= ref and float(got[i]) <= float(ref) * (1 + 1e-10)
    assert float(rounding.norm2_upper(torch.zeros(3, 2, dtype=D))) == 0.0
    assert rounding.norm2_upper(torch.zeros(2, 0, 3, dtype=D)).shape == (2,)
    bad = M.clone()
    bad[1, 0, 0] = math.nan
    assert torch.isinf(rounding.norm2_upper(bad)).all()  # never a number from NaN
    # a wrong guess (far too small) is not trusted: the bound still dominates
    s = torch.full((3,), 1e-6, dtype=D)
    again = rounding.norm2_upper(M, s=s)
    for i in range(3):
        assert mpmath.mpf(float(again[i])) >= _mp_norm2(M[i])


def test_norm2_upper_of_a_matrix_with_a_known_norm():
    """diag(3, 4) rotated by exact rationals (3/5, 4/5): the norm is 4 exactly (up to the rounding of the
    rotation's entries, which are not binary fractions: the 40-digit reference covers that)."""
    Q = torch.tensor([[0.6, -0.8], [0.8, 0.6]], dtype=D)
    M = Q @ torch.diag(torch.tensor([3.0, 4.0], dtype=D)) @ Q.T
    got = float(rounding.norm2_upper(M))
    assert mpmath.mpf(got) >= _mp_norm2(M) and abs(got - 4.0) < 1e-13
    assert float(rounding.norm2_upper(torch.eye(7, dtype=D) * 2.0 ** -1000)) >= 2.0 ** -1000


def test_cholesky_certifies_exactly_at_known_eigenvalues():
    """S = diag(1, 2, 5) (exact): certified at mu slightly above 5, never at or below 5."""
    S = torch.diag(torch.tensor([1.0, 2.0, 5.0], dtype=D))
    u = 2.0 ** -53
    for mu, want in ((5.0 + 1e-9, True), (5.0 * (1 + 1e-13), True), (5.0, False), (4.999, False), (2.0, False)):
        ok, up = rounding.cholesky_certifies(S.clone(), torch.tensor(mu, dtype=D), u)
        assert bool(ok) is want, mu
        assert float(up) >= mu
    # the margin: a shift smaller than Rump's c is refused even though mu I - S is positive definite
    ok, _ = rounding.cholesky_certifies(S.clone(), torch.tensor(5.0 + 1e-17 * 5, dtype=D), u)
    assert not bool(ok)
    # a coarser u passed in is the one used (a matrix stored in float64 but rounded through float32 upstream): Rump's
    # shift grows to ~ 4 gamma_4 tr|A| ~ 2e-6 relative, so a gap of 1e-13 that float64's u certifies is refused
    ok, _ = rounding.cholesky_certifies(S.clone(), torch.tensor(5.0 * (1 + 1e-13), dtype=D), 2.0 ** -24)
    assert not bool(ok)
    # S is not modified
    ok, _ = rounding.cholesky_certifies(S, torch.tensor(6.0, dtype=D), u)
    assert torch.equal(S, torch.diag(torch.tensor([1.0, 2.0, 5.0], dtype=D)))


def test_rump_shift_formula():
    """c = gamma_{n+1} / (1 - 2 gamma_{n+1}) tr|A| + 4 (2n + 1) eta, inf once gamma_{n+1} >= 1/2."""
    u = 2.0 ** -53
    gn = 6 * u / (1 - 6 * u)
    eta = 2.0 ** -1074
    c = float(rounding.rump_shift(torch.tensor(10.0, dtype=D), 5, u, D))
    assert c == pytest.approx(gn / (1 - 2 * gn) * 10 + 44 * eta, rel=1e-15, abs=0)
    assert math.isinf(float(rounding.rump_shift(torch.tensor(1.0, dtype=D), 2 ** 52, u, D)))


@pytest.mark.parametrize("seed", [0, 1])
def test_verified_lambda_max_against_40_digits(seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(3, 9, 9, generator=g, dtype=D)
    S = (A + A.transpose(-1, -2)) / 2
    got = rounding.verified_lambda_max(S)
    for i in range(3):
        ref = _mp_lambda_max(S[i])
        assert mpmath.mpf(float(got[i])) >= ref and float(got[i]) <= float(ref) + 1e-9 * (1 + abs(float(ref)))
    # a guess below the top eigenvalue: the pad grows tenfold per try until certified (here within 6 tries),
    # still above and still close; too few tries: inf, not a number
    low = torch.linalg.eigvalsh(S)[..., -1] - 1e-9
    got2 = rounding.verified_lambda_max(S, lam=low)
    for i in range(3):
        ref = _mp_lambda_max(S[i])
        assert math.isfinite(float(got2[i])) and mpmath.mpf(float(got2[i])) >= ref
        assert float(got2[i]) <= float(ref) + 1e-6
    assert torch.isinf(rounding.verified_lambda_max(S, lam=low - 10, tries=1)).all()


# ------------------------------------------------------------------ lognorm: constants of the field

def _consts(**kw):
    base = dict(C=4, N=9, T_norm=2.0, T_abs=3.0, g1=1.5, g2=0.5, eps1=1e-2, eps2=4e-2, W1=1.25, W2=0.75,
                W1_abs=2.0, W2_abs=1.0, gelu1=1.1, bias_norm=0.3, rho1=5.0, rho2=2.0, hidden=6)
    base.update(kw)
    return ln.FieldConstants(**base)


def test_field_constants_lemmas_one_and_two():
    """Lemma 1: ||J_LN|| <= g / sqrt(v + eps), curvature (2/sqrt(3)) g / (sqrt(C) (v + eps)); Identity: 1 and 0;
    lipschitz = ||T|| l1 + Lip(MLP) l2, curvature = ||T|| k1 + Lip(MLP) k2 + ||W2|| sup|GELU''| ||W1||^2 l2^2.
    LN1 and LN2 differ in every number, so a mix-up shows."""
    k = _consts()
    v = 0.09
    l1, l2 = 1.5 / math.sqrt(v + 1e-2), 0.5 / math.sqrt(v + 4e-2)
    c = 2 / math.sqrt(3)
    k1, k2 = c * 1.5 / (2 * (v + 1e-2)), c * 0.5 / (2 * (v + 4e-2))
    assert k.ln_jacobian(1, v) == pytest.approx(l1, rel=1e-15) and k.ln_jacobian(2, v) == pytest.approx(l2, rel=1e-15)
    # the code's constant is 2/sqrt(3) rounded up, never below it
    assert k1 <= k.ln_curvature(1, v) == pytest.approx(k1, rel=1e-12)
    assert k2 <= k.ln_curvature(2, v) == pytest.approx(k2, rel=1e-12)
    mlp = 0.75 * 1.1 * 1.25
    assert k.mlp_lipschitz == pytest.approx(mlp, rel=1e-15)
    assert k.lipschitz(v) == pytest.approx(2.0 * l1 + mlp * l2, rel=1e-14)
    gelu2 = 2 / math.sqrt(2 * math.pi)  # sup |GELU''| = 2 phi(0)
    assert ln.GELU2_SUP == pytest.approx(gelu2, rel=1e-15)
    assert k.curvature(v) == pytest.approx(2.0 * k1 + mlp * k2 + 0.75 * gelu2 * 1.25 ** 2 * l2 ** 2, rel=1e-12)
    # Identity norms (eps = inf): Jacobian I, no curvature
    ki = _consts(eps1=math.inf, eps2=math.inf)
    assert ki.ln_jacobian(1, v) == ki.ln_jacobian(2, v) == 1.0 and ki.ln_curvature(1, v) == ki.ln_curvature(2, v) == 0.0
    assert ki.curvature(v) == pytest.approx(0.75 * gelu2 * 1.25 ** 2, rel=1e-14)
    # eps = 0 at a zero variance floor: no finite constant (the Jacobian of LN is unbounded there)
    k0 = _consts(eps1=0.0, eps2=0.0)
    for which in (1, 2):
        assert k0.ln_jacobian(which, 0.0) == math.inf and k0.ln_curvature(which, 0.0) == math.inf
    assert k0.lipschitz(0.0) == math.inf and k0.curvature(0.0) == math.inf
    assert k0.ln_curvature(1, 0.25) == pytest.approx(c * 1.5 / (2 * 0.25), rel=1e-12)


def test_op_is_a_verified_upper_bound():
    g = torch.Generator().manual_seed(3)
    for shape in ((5, 3), (3, 5), (6, 6)):
        w = torch.randn(*shape, generator=g, dtype=D)
        got = ln._op(w)
        ref = _mp_norm2(w)
        assert mpmath.mpf(got) >= ref and got <= float(ref) * (1 + 1e-12)
    assert ln._op(torch.zeros(0, 4, dtype=D)) == 0.0


def _block(C=4, heads=2, seed=0, use_mlp=True, **kw):
    return random_block(C, heads, seed, use_mlp, dtype=D, **kw)


def _dense_T(block, H, W):
    """The mixer without its bias is linear: its matrix by autograd, independent of lipcheck's dense operator."""
    C = block.mixer.v_proj.in_features
    f = lambda x: (block.mixer(x.reshape(1, H, W, C)) - block.mixer(torch.zeros(1, H, W, C, dtype=D))).reshape(-1)
    return torch.func.jacfwd(f)(torch.zeros(H * W * C, dtype=D)).detach()


def test_field_constants_norms_against_40_digits():
    blk = _block(seed=2)
    H, W = 2, 1
    k = ln.field_constants(blk, H, W)
    T = _dense_T(blk, H, W)
    assert mpmath.mpf(k.T_norm) >= _mp_norm2(T)
    assert mpmath.mpf(k.T_abs) >= _mp_norm2(T.abs())
    w1, w2 = blk.mlp.fc1.weight.detach(), blk.mlp.fc2.weight.detach()
    for got, ref in ((k.W1, w1), (k.W2, w2), (k.W1_abs, w1.abs()), (k.W2_abs, w2.abs())):
        r = _mp_norm2(ref)
        assert mpmath.mpf(got) >= r and got <= float(r) * (1 + 1e-12)
    dense = ln.DenseLogNorm(blk, H, W)
    r = _mp_norm2(dense.T.abs())
    assert mpmath.mpf(dense.T_abs_norm) >= r and dense.T_abs_norm <= float(r) * (1 + 1e-12)
    assert torch.allclose(dense.T, T, rtol=0, atol=1e-13)


def test_dense_lognorm_jacobian_and_its_rounding_bound():
    """J from the closed form equals the autograd Jacobian; its float32 evaluation differs from the float64 one
    by less than the a-priori bound err; the point log-norm dominates the 40-digit eigenvalue."""
    blk = _block(seed=4)
    H, W, C = 2, 1, 4
    y = torch.randn(2, H, W, C, generator=torch.Generator().manual_seed(5), dtype=D)
    dense = ln.DenseLogNorm(blk, H, W)
    J, err = dense.jacobian(y)
    for b in range(2):
        ref = torch.func.jacfwd(lambda z: blk.vector_field(z.reshape(1, H, W, C)).reshape(-1))(y[b].reshape(-1))
        assert torch.allclose(J[b], ref, rtol=0, atol=1e-12)
    got = dense(y, 0.0)
    for b in range(2):
        S = (J[b] + J[b].T) / 2
        lam = _mp_lambda_max(S)
        assert mpmath.mpf(float(got[b])) >= lam and float(got[b]) <= float(lam) + 1e-6 * (1 + abs(float(lam)))
    # float32: J computed in float32 against the float64 value, within err (computed for float32)
    blk32 = _block(seed=4).float()
    d32 = ln.DenseLogNorm(blk32, H, W, dtype=torch.float32)
    J32, err32 = d32.jacobian(y.float())
    for b in range(2):
        assert float(torch.linalg.matrix_norm(J32[b].double() - J[b], 2)) <= float(err32[b])
    assert (err32 > 0).all() and (err > 0).all() and (err < err32).all()
    # the symmetric part formed without J, in float32, against sym(J) in float64: within its own allowance
    S32, errS32 = d32.symmetric(y.float())
    for b in range(2):
        sym = (J[b] + J[b].T) / 2
        assert float(torch.linalg.matrix_norm(S32[b].double() - sym, 2)) <= float(errS32[b])
    assert (errS32 > err32).all()


def test_dense_lognorm_at_lapack_order_against_autograd():
    """n = 4 x 4 x 16 = 256 (LAPACK's potrf and syevx called directly): the first call has no guesses (an
    eigensolver for every state), the second mixes a state near a certified one (its guess certifies) with a far
    one (the eigensolver again, its S formed anew after the certificate used it up); every value dominates the
    top eigenvalue of the symmetric part of autograd's Jacobian, within the 2e-3 pad."""
    blk = random_block(16, heads=2, seed=8)
    H, W, C = 4, 4, 16
    g = torch.Generator().manual_seed(9)
    y = torch.randn(2, H, W, C, generator=g, dtype=D)
    dense = ln.DenseLogNorm(blk, H, W)
    assert H * W * C >= rounding.LAPACK_MIN_N

    def ref(z):
        Jr = torch.autograd.functional.jacobian(lambda x: blk.vector_field(x[None])[0], z).reshape(256, 256)
        return float(np.linalg.eigvalsh(((Jr + Jr.T) / 2).numpy()).max())
    first = dense(y, 0.0)
    assert dense.eigensolves == 1
    for b in range(2):
        r = ref(y[b])
        assert r <= float(first[b]) <= r + 1e-9 * (1 + abs(r))
    z = torch.stack([y[0] + 1e-4 * torch.randn(H, W, C, generator=g, dtype=D),
                     3 * torch.randn(H, W, C, generator=g, dtype=D)])
    second = dense(z, 0.0)
    assert dense.eigensolves == 2
    r0, r1 = ref(z[0]), ref(z[1])
    assert r0 <= float(second[0]) <= r0 + 2.1e-3 * (1 + abs(r0))  # the guess's certificate: within the pad
    assert r1 <= float(second[1]) <= r1 + 1e-9 * (1 + abs(r1))  # the eigensolver's: tight
    # the far state's new eigenvector is cached: the same states again need no eigensolver, and stay bounds
    third = dense(z, 0.0)
    assert dense.eigensolves == 2 and float(third[1]) >= r1 and float(third[0]) >= r0


def test_dense_lognorm_guesses_from_the_nearest_state_of_any_earlier_batch():
    """Point log-norms in batches of changing size and order (as an enclosure step hands them over): each state's
    Cholesky certificate is tried at the eigenvector of the nearest state certified before, so a second batch of
    shuffled nearby states needs no eigensolver; every value dominates the 40-digit top eigenvalue of the autograd
    Jacobian's symmetric part, within the 2e-3 pad of it, and a state far from all cached ones still gets a bound
    (by the eigensolver where its guess fails)."""
    blk = _block(seed=4)
    H, W, C = 2, 1, 4
    g = torch.Generator().manual_seed(7)
    y = torch.randn(3, H, W, C, generator=g, dtype=D)
    dense = ln.DenseLogNorm(blk, H, W)
    dense(y, 0.0)
    solves = dense.eigensolves
    y2 = torch.cat([y, y])[[4, 0, 2, 5, 1, 3]] + 1e-6 * torch.randn(6, H, W, C, generator=g, dtype=D)
    got = dense(y2, 0.0)
    assert dense.eigensolves == solves  # every guess certified
    far = torch.cat([y2, 5 * torch.randn(1, H, W, C, generator=g, dtype=D)])
    got_far = dense(far, 0.0)
    J, err = dense.jacobian(far)
    for b in range(7):
        ref = torch.func.jacfwd(lambda z: blk.vector_field(z.reshape(1, H, W, C)).reshape(-1))(far[b].reshape(-1))
        lam = _mp_lambda_max((ref + ref.T) / 2)
        value = got[b] if b < 6 else got_far[b]
        assert mpmath.mpf(float(value)) >= lam
        assert float(value) <= float(lam) + 2e-3 * (1 + abs(float(lam))) + float(err[b]) + 1e-12


def test_structured_lognorm_margin_is_lemma_four():
    """The margin added to the per-token eigenvalues: gamma_{hidden + 2C + 16} ||W2||_abs ||W1||_abs sup|GELU'|
    max ||D1_i|| C (proofs/S5.md, Lemma 4), on top of ||T|| max ||D1_i|| (1 + 8 u C) and eps_J."""
    blk = _block(seed=6)
    H, W, C = 2, 2, 4
    k = ln.field_constants(blk, H, W)
    y = torch.randn(1, H, W, C, generator=torch.Generator().manual_seed(7), dtype=D)
    n1, D2 = ln.token_jacobians(blk, y)
    u = 2.0 ** -53
    lam = max(float(_mp_lambda_max((D2[0, i] + D2[0, i].T) / 2)) for i in range(H * W))
    first = k.T_norm * float(n1.max()) * (1 + 8 * u * C)
    form = (k.hidden + 2 * C + 16) * u / (1 - (k.hidden + 2 * C + 16) * u) * k.W2_abs * k.W1_abs * k.gelu1 * float(n1.max()) * C
    got = float(ln.structured_lognorm(blk, k, y, 0.5))
    assert got >= first + lam + form + 0.5
    assert got == pytest.approx(first + lam + form + 0.5, rel=1e-9)
    # no MLP: ||T|| max ||D1_i|| (1 + 8 u C) + eps_J only
    blk0 = _block(seed=6, use_mlp=False)
    k0 = ln.field_constants(blk0, H, W)
    n10, _ = ln.token_jacobians(blk0, y)
    # the margin (1 + 8 u C) is O(u): compared bit for bit, the float64 expression evaluated in the same order
    assert float(ln.structured_lognorm(blk0, k0, y, 0.25)) == k0.T_norm * float(n10.max()) * (1 + 8 * u * C) + 0.25


def test_ln_numbers_and_bad_norms():
    C = 4
    fk = dict(dtype=D, device=None)
    assert ln._ln_numbers(torch.nn.Identity(), C, fk) == (1.0, math.inf, math.inf, 0.0)
    norm = torch.nn.LayerNorm(C, eps=1e-3, dtype=D)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.5, -2.0, 1.0, 0.25], dtype=D))
        norm.bias.copy_(torch.tensor([3.0, 0.0, 4.0, 0.0], dtype=D))
    g, eps, rho, bn = ln._ln_numbers(norm, C, fk)
    assert (g, eps, bn) == (2.0, 1e-3, 5.0) and rho == pytest.approx(2 * 2.0 + 5.0, rel=1e-15)
    plain = torch.nn.LayerNorm(C, elementwise_affine=False, dtype=D)
    assert ln._ln_numbers(plain, C, fk)[::2] == (1.0, 2.0)
    with pytest.raises(TypeError, match="LayerNorm"):
        ln._ln_numbers(torch.nn.BatchNorm1d(C), C, fk)


def test_token_jacobians_of_layernorms_without_affine():
    """LayerNorm(elementwise_affine=False): D1_i and D2_i against per-token autograd Jacobians, ||D1_i|| bound
    1 / sqrt(var_i + eps) (max|gamma| = 1)."""
    blk = _block(seed=8)
    C = 4
    blk.norm1 = torch.nn.LayerNorm(C, eps=1e-3, elementwise_affine=False, dtype=D)
    blk.norm2 = torch.nn.LayerNorm(C, eps=2e-3, elementwise_affine=False, dtype=D)
    y = torch.randn(1, 2, 1, C, generator=torch.Generator().manual_seed(9), dtype=D)
    D1, n1, D2 = ln.token_jacobians(blk, y, full=True)
    toks = y.reshape(-1, C)
    for i, t in enumerate(toks):
        assert torch.allclose(D1[0, i], torch.func.jacfwd(blk.norm1)(t), rtol=0, atol=1e-13)
        assert torch.allclose(D2[0, i], torch.func.jacfwd(lambda z: blk.mlp(blk.norm2(z)))(t), rtol=0, atol=1e-12)
        assert float(n1[0, i]) == pytest.approx(1 / math.sqrt(float(t.var(unbiased=False)) + 1e-3), rel=1e-14)


def test_token_jacobians_with_affine_layernorms_against_autograd():
    """D2_i = J_{MLP o LN2}(y_i) with LN2's weights drawn (its Jacobian applied as A minus two rank-one corrections)
    against per-token autograd Jacobians; D1 formed only with full=True, the same D2 either way; ||D1_i|| bound
    max|gamma_1| / sqrt(var_i + eps)."""
    blk = _block(seed=10)
    C = 4
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for norm in (blk.norm1, blk.norm2):
            norm.weight.copy_(torch.randn(C, generator=g, dtype=D) * 2)
            norm.bias.copy_(torch.randn(C, generator=g, dtype=D))
    y = torch.randn(2, 3, 1, C, generator=g, dtype=D)
    n1, D2 = ln.token_jacobians(blk, y)
    D1, n1f, D2f = ln.token_jacobians(blk, y, full=True)
    assert torch.equal(D2, D2f) and torch.equal(n1, n1f) and D2.shape == (2, 3, C, C)
    for b in range(2):
        for i, t in enumerate(y[b].reshape(-1, C)):
            want = torch.func.jacfwd(lambda z: blk.mlp(blk.norm2(z)))(t)
            assert torch.allclose(D2[b, i], want, rtol=0, atol=1e-12 * (1 + float(want.abs().max())))
            assert torch.allclose(D1[b, i], torch.func.jacfwd(blk.norm1)(t), rtol=0, atol=1e-13)
            sd = math.sqrt(float(t.var(unbiased=False)) + blk.norm1.eps)
            assert float(n1[b, i]) == pytest.approx(float(blk.norm1.weight.abs().max()) / sd, rel=1e-14)


def test_dense_jacobian_rounding_bound_is_lemma_four():
    """err = 4 gamma_{C+64} || |T| ||_2 ||blockdiag D1||_F + ||(e_i)_i||_2 with, per token, the MLP's forming error
    e_i = 4 gamma_{hidden+2C+16} || |W2| ||_2 sup|GELU'| || |W1| ||_2 (max|gamma_2| / sd_i) (sqrt(C) + 2): sums of length
    hidden and C, not C + 64 (proofs/S5.md, Lemma 3's forming error). D1's blocks taken by autograd, the absolute
    weights' norms by numpy's SVD, GELU' at its maximiser sqrt(2), all here."""
    blk = _block(seed=10)
    H, W, C = 2, 1, 4
    y = torch.randn(2, H, W, C, generator=torch.Generator().manual_seed(11), dtype=D)
    dense = ln.DenseLogNorm(blk, H, W)
    _, err = dense.jacobian(y)
    u = 2.0 ** -53

    def gam(k):
        return k * u / (1 - k * u)

    hidden = blk.mlp.fc1.weight.shape[0]
    gelu_sup = 0.5 * (1 + math.erf(1.0)) + math.sqrt(2) * math.exp(-1.0) / math.sqrt(2 * math.pi)  # GELU'(sqrt 2)
    mlp_abs = (np.linalg.norm(blk.mlp.fc2.weight.detach().abs().double().numpy(), 2) * gelu_sup
               * np.linalg.norm(blk.mlp.fc1.weight.detach().abs().double().numpy(), 2))
    g2 = float(blk.norm2.weight.detach().abs().max())
    for b in range(2):
        toks = y[b].reshape(-1, C)
        f1 = math.sqrt(sum(float(torch.func.jacfwd(blk.norm1)(t).square().sum()) for t in toks))
        e = [4 * gam(hidden + 2 * C + 16) * mlp_abs * g2 / math.sqrt(float(t.var(unbiased=False)) + blk.norm2.eps)
             * (math.sqrt(C) + 2) for t in toks]
        want = 4 * gam(C + 64) * dense.T_abs_norm * f1 + math.sqrt(sum(x * x for x in e))
        assert float(err[b]) == pytest.approx(want, rel=1e-9, abs=0)
        assert float(err[b]) >= want * (1 - 1e-9)


def test_dense_lognorm_adds_the_jacobian_rounding_allowance(monkeypatch):
    """DenseLogNorm(y, 0) = lambda + err_S: the verified top eigenvalue lambda of S = fl(sym(J)) (formed without J,
    `symmetric`), then the allowance err_S = err + 3u (|| |T| || ||D1||_F + err + ||D2||_F)(1 + gamma_{n^2+4}) +
    n (C + 8) eta for J's forming (jacobian()'s err) and the transposed sum, added on top, never subtracted or
    shrunk; S lies within that sum's part of sym(J) formed from J, and err_S is at least the allowance of the plain
    sym(fl(J)) (err + u ||J||_F). The verification is replaced by the eigensolver's own value here, so that the sum
    can be checked to the last bit (with the verification its slack, ~1e-12, hides terms of 1e-13); that lambda
    itself is >= the numpy eigenvalue of autograd's Jacobian."""
    blk = random_block(6, heads=2, seed=5)
    y = torch.randn(3, 2, 2, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    u = torch.finfo(torch.float64).eps / 2
    eta = torch.finfo(torch.float64).smallest_normal * torch.finfo(torch.float64).eps
    honest = ln.DenseLogNorm(blk, 2, 2)(y, 0.0)
    assert torch.equal(ln.dense_lognorm(blk, y, 0.0), honest)  # the one-call form: the same certified number
    seen = {}
    monkeypatch.setattr(ln, "verified_lambda_max", lambda S, lam: seen.setdefault("lam", lam))
    dl = ln.DenseLogNorm(blk, 2, 2)
    got = dl(y, 0.0)
    J, err = dl.jacobian(y)
    S, err_S = dl.symmetric(y)
    D1, _, D2 = ln.token_jacobians(blk, y, full=True)
    n = 24
    g = n * n + 4
    size = dl.T_abs_norm * D1.flatten(1).norm(dim=-1) + err + D2.flatten(1).norm(dim=-1)
    assert torch.equal(err_S, err + 3 * u * size * (1 + g * u / (1 - g * u)) + n * 14 * eta)
    assert torch.equal(got, seen["lam"] + err_S) and (err > 0).all()
    assert (err_S >= err + u * torch.linalg.matrix_norm(J)).all()
    sym = (J + J.transpose(-1, -2)) / 2
    assert (torch.linalg.matrix_norm(S - sym) <= err_S - err).all() and not torch.equal(S, torch.zeros_like(S))
    for b in range(3):
        Jr = torch.autograd.functional.jacobian(lambda z: blk.vector_field(z[None])[0], y[b]).reshape(24, 24).numpy()
        ref = np.linalg.eigvalsh((Jr + Jr.T) / 2).max()
        assert float(honest[b]) >= ref + float(err[b]) + u * np.linalg.norm(Jr)


def test_norm2_upper_gram_allowance_is_the_formula_and_zero_results_are_float64():
    """_real_gram's e_G = gamma_{m+4} F2 + 8 (m + 2) n eta with F2 = fl(sum |M_ij|^2) (1 + gamma_{2mn+4}) (proofs/S2.md;
    2mn squares for complex M, the same count allowed for real M), F2 also evaluated in the code's order,
    re-evaluated at 50 digits; and norm2_upper's early answers (no entries, all zero, NaN) are float64 like every
    other answer."""
    mpmath.mp.dps = 50
    u = mpmath.mpf(2) ** -53
    eta = mpmath.mpf(2) ** -1074
    gam = lambda k: k * u / (1 - k * u)  # noqa: E731
    g = torch.Generator().manual_seed(8)
    for M in (torch.randn(5, 3, generator=g, dtype=torch.float64),
              torch.complex(torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64))):
        m, n = M.shape
        _, _, eG, F2 = rounding._real_gram(M)
        f2 = mpmath.fsum(mpmath.mpf(float(x)) ** 2 for x in M.abs().reshape(-1)) * (1 + gam(2 * m * n + 4))
        assert abs(mpmath.mpf(float(F2)) / f2 - 1) < 1e-14
        assert float(F2) == float(rounding.sum_of_squares(M)) * (1 + rounding.gamma(2 * m * n + 4))
        ref = gam(m + 4) * mpmath.mpf(float(F2)) + 8 * (m + 2) * n * eta
        assert abs(mpmath.mpf(float(eG)) / ref - 1) < 1e-14
    for M, want in ((torch.zeros(2, 0, 3, dtype=torch.float32), torch.zeros(2)), (torch.zeros(3, 2, 2), torch.zeros(3)),
                    (torch.full((1, 2, 2), float("nan")), torch.full((1,), math.inf))):
        got = rounding.norm2_upper(M)
        assert got.dtype == torch.float64 and torch.equal(got, want.double())


def test_norm2_upper_is_the_documented_certificate():
    """norm2_upper(M, s=guess) on matrices already scaled (largest entry in [1/2, 1): no power of two) is, to the
    last bit, sqrt(mu + e_G) (1 + gamma_6) with mu from cholesky_certifies(fl(M^T M), s^2 + pad), pad = 4 (gamma_{n+1}
    n + 2 n u) max(s^2, u F2) + 16 (2n + 1) eta (proofs/S2.md, the verified norm): nothing shaved off the root."""
    u = 2.0 ** -53
    g = torch.Generator().manual_seed(11)
    for shape in ((5, 3), (3, 6)):
        M = torch.rand(shape, generator=g, dtype=torch.float64) * 0.9
        M[0, 0] = 0.75
        X = M if shape[0] >= shape[1] else M.T
        G, n, eG, F2 = rounding._real_gram(X)
        s = float(torch.linalg.matrix_norm(M, 2)) * (1 + 1e-6)
        lam = torch.tensor(s * s, dtype=torch.float64)
        pad = 4 * (rounding.gamma(n + 1, u) * n + 2 * n * u) * torch.maximum(lam, u * F2) \
            + 16 * (2 * n + 1) * 2.0 ** -1074
        ok, mu = rounding.cholesky_certifies(G.clone(), lam + pad, u)
        assert bool(ok)
        want = float((mu + eG).sqrt() * (1 + rounding.gamma(6, u)))
        assert float(rounding.norm2_upper(M, s=torch.tensor(s, dtype=torch.float64))) == want


@pytest.mark.parametrize("dt", [torch.float64, torch.float32])
def test_cholesky_check_through_lapack_matches_known_eigenvalues_and_refuses_nan(dt):
    """Order 300 (LAPACK's potrf called directly, from rounding.LAPACK_MIN_N on): S = Q diag(lam) Q^T with
    lam_max = 1 exactly known; cholesky_certifies proves lambda_max < mu for mu = 1 + gap and refuses mu = 1 - gap,
    in agreement with torch's cholesky_ex path on the same matrices; a NaN off the diagonal is refused."""
    n = 300
    assert n >= rounding.LAPACK_MIN_N
    g = torch.Generator().manual_seed(3)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    lam = torch.linspace(-2.0, 1.0, n, dtype=torch.float64)
    S = ((Q * lam) @ Q.T).to(dt)
    S = (S + S.T) / 2
    gap = 1e-3 if dt == torch.float64 else 5e-2  # above Rump's shift (~ n^2 u: 8e-3 in float32 at n = 300)
    mus = torch.tensor([1 + gap, 1 - gap], dtype=dt)
    ok, _ = rounding.cholesky_certifies(torch.stack([S, S]), mus)
    assert ok.tolist() == [True, False]
    A = -torch.stack([S, S])
    A.diagonal(dim1=-2, dim2=-1).add_(mus[:, None])
    assert torch.linalg.cholesky_ex(A).info.eq(0).tolist() == [True, False]
    bad = S.clone()
    bad[7, 3] = bad[3, 7] = float("nan")
    ok, _ = rounding.cholesky_certifies(bad[None], mus[:1])
    assert ok.tolist() == [False]
    # +inf and -inf off the diagonal, and one inf alone, are refused too
    for vals in ((math.inf, -math.inf), (math.inf, 0.0), (-math.inf, 0.0)):
        bad = S.clone()
        bad[7, 3], bad[100, 5] = vals
        bad[3, 7], bad[5, 100] = vals
        assert rounding.cholesky_certifies(bad[None], mus[:1])[0].tolist() == [False]
    # overwrite=True: the same answers, and S itself is the factorised matrix (its lower triangle changed)
    SS = torch.stack([S, S])
    ok, _ = rounding.cholesky_certifies(SS, mus, overwrite=True)
    assert ok.tolist() == [True, False] and not torch.equal(SS[0], S)
    # the same matrix scaled by 2^1000 (2^100 in float32), exactly: certified as before
    big = 2.0 ** 1000 if dt == torch.float64 else 2.0 ** 100
    ok, _ = rounding.cholesky_certifies((S * big)[None], mus[:1] * big)
    assert ok.tolist() == [True]
    # the top eigenpair through LAPACK's syevx: lambda_max = 1 and Q's last column (up to sign)
    w, v = rounding.top_eigenpairs(torch.stack([S, 2 * S]))
    tol = 1e-12 if dt == torch.float64 else 1e-5
    assert torch.allclose(w.double(), torch.tensor([1.0, 2.0], dtype=torch.float64), rtol=0, atol=10 * tol)
    for k in range(2):
        assert abs(abs(float(v[k].double() @ Q[:, -1])) - 1) < 1e3 * tol
    w, v = rounding.top_eigenpairs(bad[None])  # no eigensolver on non-finite entries: a NaN guess
    assert math.isnan(float(w[0]))


def test_cholesky_check_beyond_lapack_max_order_stays_with_torch(monkeypatch):
    """scipy's bundled OpenBLAS segfaulted in dpotrf from order 16000 on: above rounding.LAPACK_MAX_N the check must
    not call it (here the bound is lowered to 299 and scipy's potrf made to fail loudly), and torch's path gives the
    answer known from the eigenvalues (lambda_max = 1)."""
    from scipy.linalg import lapack

    def refuse(*a, **k):
        raise AssertionError("scipy potrf called above LAPACK_MAX_N")
    monkeypatch.setattr(rounding, "LAPACK_MAX_N", 299)
    monkeypatch.setattr(lapack, "dpotrf", refuse)
    n = 300
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(4), dtype=torch.float64))
    S = (Q * torch.linspace(-1.0, 1.0, n, dtype=torch.float64)) @ Q.T
    S = (S + S.T) / 2
    ok, _ = rounding.cholesky_certifies(torch.stack([S, S]), torch.tensor([1 + 1e-3, 1 - 1e-3], dtype=torch.float64))
    assert ok.tolist() == [True, False]
    monkeypatch.setattr(rounding, "LAPACK_MAX_N", 300)  # the same matrices through scipy: the spy must fire
    with pytest.raises(AssertionError, match="scipy potrf"):
        rounding.cholesky_certifies(S[None], torch.tensor([1.5], dtype=torch.float64))


def test_norm2_upper_and_the_anchor_guess_on_subnormal_matrices():
    """Subnormal matrices (a symbol whose kernels' taps underflow): norm2_upper scales by up to 2^1074, in two exact
    steps (one float 2^1074 overflows: it raised OverflowError with a guess s), and bounds the exact norm from
    above; the anchor guess divides by a subnormal norm as real numbers (a complex division gave inf)."""
    from lipcheck.bounds import spectral
    M = torch.tensor([[3e-320, 0.0], [1e-321, 2e-322]], dtype=torch.float64)
    exact = 3e-320 * (1 + 1e-3)  # >= ||M||: the subnormal entries are the exact stored values
    for s in (None, torch.tensor(3e-320, dtype=torch.float64)):
        got = float(rounding.norm2_upper(M, s=s))
        assert math.isfinite(got) and got >= float(torch.linalg.matrix_norm(M, 2)) and got <= 10 * exact
    S = torch.tensor([[[3e-320 + 1e-321j]]], dtype=torch.complex128)
    s1, u1, v1, s2 = spectral.top_singular_guess(S)
    assert torch.isfinite(torch.view_as_real(u1)).all() and abs(float(u1.abs().square().sum()) - 1) < 1e-2
    v = spectral.anchor_verification(S, s1, u1, v1, s2)
    top = spectral.two_by_two_norm(s1 + v["rho_r"], v["rho_b"], v["rho_r"], v["tau2"])
    assert all(bool(torch.isfinite(x).all()) for x in v.values()) and float(top) >= abs(3e-320 + 1e-321j)


def test_float32_cholesky_check_keeps_float32s_rump_shift_and_4d_batches():
    """Rump's shift is gamma_{n+1} of the matrix's own dtype times the trace: for a 300 x 300 float32 diagonal S with
    lambda_max = 1 and trace(mu I - S) ~ 150 the shift is about 2.7e-3, so mu = 1 + 1e-4 is refused (float64's gamma
    would have passed it) and mu = 1 + 1e-2 certified; a (2, 1, n, n) batch through LAPACK gives the same answers as
    the matrices one by one."""
    n = 300
    assert n >= rounding.LAPACK_MIN_N
    S = torch.diag(torch.linspace(0.0, 1.0, n, dtype=torch.float32))
    ok_near, _ = rounding.cholesky_certifies(S, torch.tensor(1 + 1e-4, dtype=torch.float32))
    ok_far, _ = rounding.cholesky_certifies(S, torch.tensor(1 + 1e-2, dtype=torch.float32))
    assert not bool(ok_near) and bool(ok_far)
    S64 = torch.diag(torch.linspace(0.0, 1.0, n, dtype=torch.float64))
    batch = torch.stack([S64, 3 * S64])[:, None]  # (2, 1, n, n)
    ok, _ = rounding.cholesky_certifies(batch, torch.tensor([[1.5], [1.5]], dtype=torch.float64))
    assert ok.shape == (2, 1) and ok.tolist() == [[True], [False]]


def _second(f, x, u, w=None):
    """D^2 f(x)[u, w] by nested forward-mode autograd (w = u by default)."""
    w = u if w is None else w
    return torch.func.jvp(lambda z: torch.func.jvp(f, (z,), (u,))[1], (x,), (w,))[1]


@pytest.mark.parametrize("C", [3, 16, 64])
def test_layernorm_curvature_constant_is_sharp(C):
    """Lemma 1: ||D^2 xhat[u, u]|| <= LN_CURVATURE |u|^2 / (sqrt(C) s^2) with LN_CURVATURE = 2/sqrt(3), attained
    at var = eps / 2 with u along the centred x (q a = 1/3): 0.1 % less would be a false bound."""
    eps = 0.3
    norm = torch.nn.LayerNorm(C, eps=eps, elementwise_affine=False).double()
    f = lambda z: layer_norm(z, norm)  # noqa: E731  (nested forward mode through native layer_norm is wrong)
    g = torch.Generator().manual_seed(C)
    x = torch.randn(C, dtype=torch.float64, generator=g)
    x = x - x.mean()
    x = x * math.sqrt(eps / 2 / float(x.var(unbiased=False)))  # var = eps / 2
    u = x / x.norm()
    got = float(_second(f, x, u).norm())
    bound = ln.LN_CURVATURE / (math.sqrt(C) * (eps / 2 + eps))
    assert 0.999 * bound < got <= bound * (1 + 1e-12)
    assert abs(ln.LN_CURVATURE - 2 / math.sqrt(3)) < 1e-12


@settings(max_examples=30, deadline=None)
@given(C=st.integers(2, 24), seed=st.integers(0, 10 ** 6), log_eps=st.floats(-8, 1), scale=st.floats(1e-3, 1e2))
def test_layernorm_curvature_bounds_the_bilinear_form(C, seed, log_eps, scale):
    """The constant bounds D^2 xhat[u, u'] for u != u' too (the mean value steps of Lemma 2)."""
    eps = 10.0 ** log_eps
    norm = torch.nn.LayerNorm(C, eps=eps, elementwise_affine=False).double()
    f = lambda z: layer_norm(z, norm)  # noqa: E731
    g = torch.Generator().manual_seed(seed)
    x, u, w = (torch.randn(C, dtype=torch.float64, generator=g) for _ in range(3))
    x = x * scale
    s2 = float(x.var(unbiased=False)) + eps
    got = float(_second(f, x, u, w).norm())
    assert got <= ln.LN_CURVATURE * float(u.norm() * w.norm()) / (math.sqrt(C) * s2) * (1 + 1e-9)


def test_per_token_curvature_bounds_the_fields_second_derivative():
    """FieldConstants.curvature_parts at each token's own variance bounds ||D^2 F(x)[u, u]|| (nested autograd on the
    block's field), is never above curvature(min variance) (sum_i ||u_i||^4)^(1/2), and is below it where the
    token variances differ."""
    from lipcheck.wellposed.attention_field import make_field
    blk = random_block(8, heads=2, seed=3)
    H = W = 3
    k = ln.field_constants(blk, H, W)
    g = torch.Generator().manual_seed(1)
    scales = torch.linspace(0.3, 3.0, H * W, dtype=torch.float64).reshape(1, H, W, 1)
    for trial in range(4):
        x = torch.randn(1, H, W, 8, dtype=torch.float64, generator=g) * scales
        u = torch.randn(1, H, W, 8, dtype=torch.float64, generator=g)
        assert torch.allclose(block_field(blk)(x), blk.vector_field(x), rtol=0, atol=1e-13)
        got = float(_second(block_field(blk), x, u).norm())
        v = x.var(-1, unbiased=False).flatten(1) * (1 - 1e-9)  # (1, N)
        un4 = u.norm(dim=-1).flatten(1) ** 4
        bound = sum(a * float((c * c * un4).sum().sqrt()) for a, c in k.curvature_parts(v))
        scalar = k.curvature(float(v.min())) * float(un4.sum().sqrt())
        assert got <= bound <= scalar * (1 + 1e-12)
        assert bound < 0.9 * scalar
    # the field object hands the same parts on
    parts = make_field(blk, H, W).curvature_parts(v)
    assert [a for a, _ in parts] == [a for a, _ in k.curvature_parts(v)]
