"""Sympy checks of the algebra in proofs/S2.md. Exits non-zero on the first failed check."""
import math
import random
import sys

import sympy as sp

failures = []


def check(name, ok):
    print(("ok   " if ok else "FAIL ") + name)
    if not ok:
        failures.append(name)


t = sp.symbols("t")
# Rayleigh quotient <= largest eigenvalue (2 x 2 symmetric PSD)
a, b, c, x1, x2 = sp.symbols("a b c x1 x2", real=True)
M = sp.Matrix([[a, b], [b, c]])
lam1 = (a + c) / 2 + sp.sqrt(((a - c) / 2) ** 2 + b ** 2)
v = sp.Matrix([x1, x2])
gap = sp.expand(lam1 * (x1 ** 2 + x2 ** 2) - (v.T * M * v)[0])
# lam1 I - M is PSD: its determinant and trace are >= 0
D = (lam1 * sp.eye(2) - M)
check("det(lam1 I - M) = 0", sp.simplify(D.det()) == 0)
check("trace(lam1 I - M) >= 0", sp.simplify(D.trace() - 2 * sp.sqrt(((a - c) / 2) ** 2 + b ** 2)) == 0)

# circulant eigenvalues are the DFT of the first column
n = 5
cs = sp.symbols("c0:5")
Cm = sp.Matrix(n, n, lambda i, j: cs[(i - j) % n])
for jj in range(n):
    wj = sp.exp(2 * sp.pi * sp.I * jj / n)
    vec = sp.Matrix([wj ** i for i in range(n)])
    lam = sum(cs[k] * wj ** (-k) for k in range(n))
    check(f"circulant eigenpair {jj}", sp.simplify(sp.expand(Cm * vec - lam * vec)) == sp.zeros(n, 1))

# compression never increases the norm: ||E^T A E|| <= ||A|| on an exact rational instance
A = sp.Matrix(4, 4, lambda i, j: sp.Rational((3 * i + 5 * j) % 7 - 3, 4))
sub = A[:2, :2]
na = max(sp.re(sp.N(ev, 30)) for ev in (A.T * A).eigenvals(multiple=True))
ns = max(sp.re(sp.N(ev, 30)) for ev in (sub.T * sub).eigenvals(multiple=True))
check("compression: ||A[:2,:2]|| <= ||A||", ns <= na + 1e-25)

# the 2 x 2 nonnegative-matrix norm used by the anchor bound
p, q, r, s_ = sp.symbols("p q r s", nonnegative=True)
N2 = sp.Matrix([[p, q], [r, s_]])
tr = p ** 2 + q ** 2 + r ** 2 + s_ ** 2
det = p * s_ - q * r
closed = (tr + sp.sqrt(tr ** 2 - 4 * det ** 2)) / 2
ev = (N2.T * N2).eigenvals(multiple=True)
check("||[[p,q],[r,s]]||^2 = (tr + sqrt(tr^2 - 4 det^2)) / 2",
      any(sp.simplify(e - closed) == 0 for e in ev) or
      all(abs(float(max(e.subs({p: 1.3, q: .4, r: .7, s_: .2}) for e in ev)) - float(closed.subs({p: 1.3, q: .4, r: .7, s_: .2}))) < 1e-12 for _ in [0]))

# block-norm inequality on random instances (exact rationals, 3 x 3 split as 1 + 2)
rnd = random.Random(0)
ok = True
for _ in range(5):
    B = sp.Matrix(3, 3, lambda i, j: sp.Rational(rnd.randint(-9, 9), rnd.randint(1, 5)))
    nB = math.sqrt(max(float(sp.re(sp.N(e))) for e in (B.T * B).eigenvals(multiple=True)))
    blocks = [[B[:1, :1], B[:1, 1:]], [B[1:, :1], B[1:, 1:]]]
    bn = sp.Matrix(2, 2, lambda i, j: math.sqrt(max([float(sp.re(sp.N(e))) for e in (blocks[i][j].T * blocks[i][j]).eigenvals(multiple=True)] + [0])))
    nbn = math.sqrt(max(float(sp.re(sp.N(e))) for e in (bn.T * bn).eigenvals(multiple=True)))
    ok &= nB <= nbn * (1 + 1e-12)
check("||B|| <= ||matrix of block norms||", ok)

# ||G||_F^2 = sum lambda_i^2 for symmetric G
G = sp.Matrix([[2, 1, 0], [1, 3, 1], [0, 1, 4]])
check("||G||_F^2 = sum lambda_i^2", sp.simplify(sum(e ** 2 for e in G.eigenvals(multiple=True)) - sum(x ** 2 for x in G)) == 0)

# KW: the solved epsilon reaches the failure probability exactly
nn, qq, dd = sp.symbols("n q delta", positive=True)
eps = (sp.log(sp.Rational(1648, 1000) * sp.sqrt(nn) / dd) / (2 * qq - 1)) ** 2
check("1.648 sqrt(n) exp(-sqrt(eps)(2q-1)) = delta",
      sp.simplify(sp.Rational(1648, 1000) * sp.sqrt(nn) * sp.exp(-sp.sqrt(eps) * (2 * qq - 1)) - dd).subs({nn: 1000, qq: 50, dd: sp.Rational(1, 10 ** 6)}) == 0)

# Szego example: tridiagonal Toeplitz with symbol cos(w) and the sine window
w = sp.symbols("w")
for m in (3, 4, 7):
    T = sp.Matrix(m, m, lambda i, j: sp.Rational(1, 2) if abs(i - j) == 1 else 0)
    xv = sp.Matrix([sp.sin(sp.pi * (i + 1) / (m + 1)) for i in range(m)])
    rq = sp.nsimplify(sp.N((xv.T * T * xv)[0] / (xv.T * xv)[0], 40), [sp.cos(sp.pi / (m + 1))])
    check(f"sine window Rayleigh quotient = cos(pi/(n+1)), n={m}",
          abs(float(sp.N((xv.T * T * xv)[0] / (xv.T * xv)[0] - sp.cos(sp.pi / (m + 1)), 40))) < 1e-30)


# ---------------------------------------------------------------- adaptive stopping: e_q decreases, the split sums to delta
qs = sp.symbols("q", positive=True)
e_q = (sp.log(sp.Rational(1648, 1000) * sp.sqrt(nn) / dd) / (2 * qs - 1)) ** 2
de = sp.diff(e_q, qs).subs({nn: 10 ** 5, dd: sp.Rational(1, 10 ** 6)})
check("KW epsilon decreases in the number of steps (breakdown argument)",
      all(float(de.subs(qs, qq0)) < 0 for qq0 in (1, 2, 5, 10, 100, 1000)))
schedule = sorted(set(range(10, 301, 10)) | {300})
check("union bound: |Q| checks at delta/|Q| sum to delta",
      sum(sp.Rational(1, 10 ** 6) / len(schedule) for _ in schedule) == sp.Rational(1, 10 ** 6))

# ---------------------------------------------------------------- normalisation: powers of two are exact, powers of ten are not
rnd2 = random.Random(1)
xs = [rnd2.uniform(0.5, 1) * 2.0 ** rnd2.randint(-1000, 1000) for _ in range(2000)]
check("x * 2^k / 2^k == x on random floats (exact rescaling)",
      all(math.ldexp(math.ldexp(x, k), -k) == x for x in xs for k in (-300, -17, 40, 300)
          if -1000 < math.frexp(x)[1] + k < 1000))
check("x * 10^k / 10^k != x for some random floats (why powers of two)",
      any((x * 10.0 ** 17) / 10.0 ** 17 != x for x in xs))

# ---------------------------------------------------------------- kernel taps: the exponent without cancellation
kk_, f_, c_ = sp.symbols("kk f c", real=True)
check("(k - mu)^2 - f^2 = kk (kk - 2 f) with mu = c + f, kk = k - c",
      sp.expand(((kk_ + c_) - (c_ + f_)) ** 2 - f_ ** 2 - kk_ * (kk_ - 2 * f_)) == 0)
check("kk (kk - 2f) >= 0 for integers kk and |f| <= 1/2 (linear in f: the ends f = +-1/2 decide)",
      all(j * (j - 2 * ff) >= 0 for j in range(-50, 51) for ff in (sp.Rational(-1, 2), sp.Rational(1, 2))))
# the first term left out of S at |j| = 8, worst case f = +-1/2, sigma -> 1/2: exp(-8 * 7 / (2 sigma^2)) <= exp(-84)
check("direct sum truncation at |j| <= 7 drops < exp(-84) relative for sigma < 1/2",
      sp.Rational(8 * 7, 2) / sp.Rational(1, 4) * sp.Rational(1, 1) >= 84 and
      float(sum(sp.exp(-j * (j - 1) / (2 * sp.Rational(1, 4))) for j in range(8, 40))) < math.exp(-84))

# ---------------------------------------------------------------- the stable 2 x 2 norm
pp_, qq_, rr_, ss_ = sp.symbols("p q r s", real=True)
A2 = sp.sqrt((pp_ + ss_) ** 2 + (qq_ - rr_) ** 2)
B2 = sp.sqrt((pp_ - ss_) ** 2 + (qq_ + rr_) ** 2)
s1_, s2_ = (A2 + B2) / 2, (A2 - B2) / 2
check("sigma1^2 + sigma2^2 = ||N||_F^2 for the hypot formula",
      sp.simplify(sp.expand(s1_ ** 2 + s2_ ** 2) - (pp_ ** 2 + qq_ ** 2 + rr_ ** 2 + ss_ ** 2)) == 0)
check("sigma1 * sigma2 = det N (up to sign) for the hypot formula",
      sp.simplify(sp.expand((A2 ** 2 - B2 ** 2) / 4) - (pp_ * ss_ - qq_ * rr_)) == 0)
u64 = 2.0 ** -53
g6 = 6 * u64 / (1 - 6 * u64)
worst, worst_old = 0.0, 0.0
rnd3 = random.Random(2)
cases = [(1.0, 1e-9, 1e-9, 1.0), (1.0, 0.0, 0.0, 1 - 1e-12), (3.0, 2.0, 2.0, 4 / 3)]
cases += [tuple(rnd3.uniform(0, 1) * 10 ** rnd3.randint(-5, 5) for _ in range(4)) for _ in range(60)]
for P_, Q_, R_, S_ in cases:
    Nq = sp.Matrix([[sp.Rational(P_), sp.Rational(Q_)], [sp.Rational(R_), sp.Rational(S_)]])
    ex = max(sp.N(sp.sqrt(e), 40) for e in (Nq.T * Nq).eigenvals(multiple=True))
    val = (math.hypot(P_ + S_, Q_ - R_) + math.hypot(P_ - S_, Q_ + R_)) / 2
    tr = P_ ** 2 + Q_ ** 2 + R_ ** 2 + S_ ** 2
    old = math.sqrt((tr + math.sqrt(max(tr * tr - 4 * (P_ * S_ - Q_ * R_) ** 2, 0))) / 2)
    worst = max(worst, abs(float((val - ex) / ex)))
    worst_old = max(worst_old, abs(float((old - ex) / ex)))
check(f"hypot 2x2 norm within gamma_6 of the exact value (worst {worst:.2e})", worst <= g6)
check(f"the trace formula it replaces is not (worst {worst_old:.2e})", worst_old > 1e3 * g6)

# ---------------------------------------------------------------- Ostrowski for the Ritz values of a nonorthogonal basis
import numpy as np  # noqa: E402
rng = np.random.default_rng(3)
ok = True
for _ in range(20):
    n0, m0 = 8, 4
    X = rng.standard_normal((n0, n0))
    A0 = X + X.T
    V = np.linalg.qr(rng.standard_normal((n0, m0)))[0] + 1e-3 * rng.standard_normal((n0, m0))
    eta = np.linalg.norm(V.T @ V - np.eye(m0), 2)
    Wq = V @ np.linalg.inv(np.linalg.cholesky(V.T @ V)).T  # exactly orthonormal up to float64
    mu_V = np.sort(np.linalg.eigvalsh(V.T @ A0 @ V))[::-1]
    mu_W = np.sort(np.linalg.eigvalsh(Wq.T @ A0 @ Wq))[::-1]
    ok &= all(mw >= mv / (1 + eta) - 1e-12 for mv, mw in zip(mu_V, mu_W) if mv > 0)
check("Ostrowski: Ritz values on an orthonormalised basis >= those of V / (1 + ||V^T V - I||)", ok)

# ---------------------------------------------------------------- the Gram recursion, executed in float32, stays above the norm
def gram32(T, K=4):
    u = 2.0 ** -24
    g = lambda k: k * u / (1 - k * u)  # noqa: E731
    T = T.astype(np.float32)
    m_, n_ = T.shape
    tF = float(np.linalg.norm(T.astype(np.float64))) * (1 + g(m_ * n_ + 2))
    G = T.T @ T
    G = (G + G.T) / 2
    f, F = [], []
    for k in range(K + 1):
        fk = float(np.linalg.norm(G))
        N = (G / np.float32(fk)).astype(np.float32)
        f.append(fk)
        F.append(float(np.linalg.norm(N)) * (1 + g(n_ * n_ + 2)))
        G = N @ N
        G = (G + G.T) / 2
    best = math.inf
    for K0 in range(K + 1):
        b = F[K0]
        for k in range(K0 - 1, -1, -1):
            b = math.sqrt(f[k + 1] * (b + u / (1 - u) * F[k + 1]) + (g(n_) + 2 * u) * F[k] ** 2)
        best = min(best, math.sqrt(f[0] * (b + u / (1 - u) * F[0]) + (g(m_) + 2 * u) * tF ** 2))
    return best


ok, tight = True, 0.0
for trial in range(12):
    n0 = 30 + 10 * trial
    T0 = rng.standard_normal((n0, n0)).astype(np.float32)
    T0[:, 0] *= 1 + trial  # separated or clustered top singular values
    exact_norm = np.linalg.norm(T0.astype(np.float64), 2)
    b = gram32(T0)
    ok &= b >= exact_norm
    tight = max(tight, b / exact_norm - 1)
check(f"float32 Gram recursion >= exact norm on 12 matrices (loosest {tight:.1e} relative)", ok and tight < 0.5)

# ---------------------------------------------------------------- verified norms: what the Cholesky certificate rests on
# the complex Gram matrix through its real embedding: [[A, -B], [B, A]] has the eigenvalues of A + iB, each twice
a11, a22, b12r, b12i = sp.symbols("a11 a22 b12r b12i", real=True)
lam_ = sp.symbols("lam")
Gc = sp.Matrix([[a11, b12r + sp.I * b12i], [b12r - sp.I * b12i, a22]])
Ar, Bi = Gc.applyfunc(sp.re), Gc.applyfunc(sp.im)
R = sp.BlockMatrix([[Ar, -Bi], [Bi, Ar]]).as_explicit()
check("real embedding: charpoly([[A,-B],[B,A]]) = charpoly(A + iB)^2",
      sp.expand(R.charpoly(lam_).as_expr() - sp.expand(Gc.charpoly(lam_).as_expr() ** 2)) == 0)
# the reported sqrt(mu + e_G) (1 + gamma_6) survives four roundings down: (1 + gamma_6)(1 - u)^4 >= 1
for bits in (24, 53):
    uu = sp.Rational(1, 2 ** bits)
    check(f"(1 + gamma_6)(1 - u)^4 >= 1 at u = 2^-{bits}", (1 + 6 * uu / (1 - 6 * uu)) * (1 - uu) ** 4 >= 1)

# anchor residuals: S v^ - s1 u^ = (S v1 - s1 u1)/||v1|| + s1 u1 (1/||v1|| - 1/||u1||)  (componentwise, any vectors)
x_, u_, s1_, nu_, nv_ = sp.symbols("x u s1 nu nv", positive=True)
check("anchor residual decomposition",
      sp.simplify((x_ / nv_ - s1_ * u_ / nu_) - ((x_ - s1_ * u_) / nv_ + s1_ * u_ * (1 / nv_ - 1 / nu_))) == 0)
# ||u^* Delta||^2 - |u^* Delta v^|^2 from the unnormalised forms bu = nu^2 P, aa = nu^2 nv^2 Q
P_, Q_ = sp.symbols("P Q", nonnegative=True)
bu_, aa_ = nu_ ** 2 * P_, nu_ ** 2 * nv_ ** 2 * Q_
check("anchor off-diagonal: P - Q = (bu - aa)/nu^2 + aa (1 - 1/nv^2)/nu^2",
      sp.simplify((P_ - Q_) - ((bu_ - aa_) / nu_ ** 2 + aa_ * (1 - 1 / nv_ ** 2) / nu_ ** 2)) == 0)
# |1 - nv^2| <= delta (2 + delta) when |1 - nv| <= delta
dl = sp.symbols("delta", positive=True)
check("|1 - nv^2| <= delta (2 + delta) at nv = 1 + delta (equality) and nv = 1 - delta (slack 2 delta^2)",
      sp.expand((1 + dl) ** 2 - 1 - dl * (2 + dl)) == 0 and sp.expand(dl * (2 + dl) - (1 - (1 - dl) ** 2)) == 2 * dl ** 2)


# Gram-Ritz tail without an eigensolver, on exact rational symmetric matrices with known spectra
def cayley(n0, rr):
    K = sp.Matrix(n0, n0, lambda i, j: 0)
    for i in range(n0):
        for j in range(i + 1, n0):
            K[i, j] = sp.Rational(rr.randint(-3, 3), rr.randint(1, 3))
            K[j, i] = -K[i, j]
    return (sp.eye(n0) - K) * (sp.eye(n0) + K).inv()  # rational orthogonal


rr = random.Random(7)
ok_tail, ok_top = True, True
for _ in range(6):
    m0 = 4
    lam_s = [sp.Rational(rr.randint(-9, 30), rr.randint(1, 5)) for _ in range(m0)]
    Qo = cayley(m0, rr)
    Bm = Qo * sp.diag(*lam_s) * Qo.T
    ev_sorted = sorted(lam_s, reverse=True)
    L, nu0 = max(lam_s), max(0, -min(lam_s))
    fro2 = sum(x ** 2 for x in Bm)
    tail = sum(max(x, 0) ** 2 for x in ev_sorted[1:])
    ok_tail &= tail >= fro2 - max(L, nu0) ** 2 - (m0 - 1) * nu0 ** 2
    # ||N||^2 <= ||N||_F^2 - sum_{i>=2} max(lambda_i, 0)^2, whether the top |eigenvalue| is positive or negative
    ok_top &= max(x ** 2 for x in lam_s) <= fro2 - tail
check("interlacing tail: sum_{i>=2} max(l_i,0)^2 >= ||B||_F^2 - max(L,nu)^2 - (m-1) nu^2 (exact rationals)", ok_tail)
check("||N||_2^2 <= ||N||_F^2 - sum_{i>=2} max(l_i,0)^2 with negative eigenvalues present (exact rationals)", ok_top)

# ---------------------------------------------------------------------------------------------------------------
# Toeplitz majorant (proofs/S2.md, last section)
w_, m_ = sp.symbols("w m", real=True)
h_ = sp.symbols("h", positive=True)
k_ = sp.symbols("k", integer=True, nonzero=True)
I_sym = sp.integrate(sp.exp(-sp.I * k_ * w_), (w_, m_ - h_, m_ + h_)) / (2 * sp.pi)
I_cf = sp.exp(-sp.I * k_ * m_) * sp.sin(k_ * h_) / (sp.pi * k_)
check("I(k) = e^{-ikm} sin(kh)/(pi k)", sp.simplify((I_sym - I_cf).rewrite(sp.exp)) == 0)
L_sym = sp.integrate((w_ - m_) / h_ * sp.exp(-sp.I * k_ * w_), (w_, m_ - h_, m_ + h_)) / (2 * sp.pi)
x_ = sp.symbols("x", real=True)
psi_cf = (sp.sin(x_) - x_ * sp.cos(x_)) / x_ ** 2
L_cf = -sp.I * sp.exp(-sp.I * k_ * m_) * h_ * psi_cf.subs(x_, k_ * h_) / sp.pi
check("L(k) = -i e^{-ikm} h psi(kh)/pi",
      sp.simplify(sp.expand(sp.simplify((L_sym - L_cf) * sp.exp(sp.I * k_ * m_)).rewrite(sp.exp))) == 0)
ser = sp.series(psi_cf, x_, 0, 16).removeO()
ok = all(sp.simplify(ser.coeff(x_, 2 * n - 1) - (-1) ** (n + 1) * 2 * n / sp.factorial(2 * n + 1)) == 0
         for n in range(1, 8))
check("psi(x) = sum (-1)^(n+1) 2n x^(2n-1)/(2n+1)!", ok)
# the series step term_{n+1} = -term_n x^2 (n+1) / (n (2n+2)(2n+3))
ok = all(sp.simplify((-1) ** (n + 2) * 2 * (n + 1) / sp.factorial(2 * n + 3)
                     / ((-1) ** (n + 1) * 2 * n / sp.factorial(2 * n + 1)) + sp.Integer(n + 1) / (n * (2 * n + 2) * (2 * n + 3))) == 0
         for n in range(1, 10))
check("psi series recurrence", ok)
# bilinear coefficients reproduce the corner values
kmm, kmp, kpm, kpp, rho_ = sp.symbols("kmm kmp kpm kpp rho")
a00 = (kmm + kmp + kpm + kpp) / 4 + rho_
a10 = ((kpm + kpp) - (kmm + kmp)) / 4
a01 = ((kmp + kpp) - (kmm + kpm)) / 4
a11 = ((kpp - kpm) - (kmp - kmm)) / 4
E = lambda ey, ex: a00 + a10 * ey + a01 * ex + a11 * ey * ex  # noqa: E731
check("bilinear envelope = kappa + rho at the four corners",
      all(sp.simplify(E(sy, sx) - (kv + rho_)) == 0
          for (sy, sx), kv in (((-1, -1), kmm), ((-1, 1), kmp), ((1, -1), kpm), ((1, 1), kpp))))
import numpy as np  # noqa: E402
rng2 = np.random.default_rng(5)
ok = True
for trial in range(20):  # convex f(c) = ||sum c_h P_h|| on a linear image of a rectangle <= bilinear interpolant
    P = rng2.standard_normal((3, 4, 4))
    c0, J0 = rng2.standard_normal(3), rng2.standard_normal((3, 2))
    f = lambda e: np.linalg.norm(np.tensordot(c0 + J0 @ e, P, 1), 2)  # noqa: E731
    kap = {(sy, sx): f(np.array([sy, sx])) for sy in (-1, 1) for sx in (-1, 1)}
    for ey, ex in rng2.uniform(-1, 1, (50, 2)):
        bil = sum(kap[(sy, sx)] * (1 + sy * ey) / 2 * (1 + sx * ex) / 2 for sy in (-1, 1) for sx in (-1, 1))
        ok &= f(np.array([ey, ex])) <= bil * (1 + 1e-12)
check("convex function on a rectangle <= bilinear interpolant of its corners (1000 points)", ok)


def _taps(k, mu, sig):
    j = np.arange(-80, 81)
    return np.exp(-(k - mu) ** 2 / (2 * sig ** 2)) / np.exp(-(j - mu) ** 2 / (2 * sig ** 2)).sum()


def _random_layer(Hn, Wn, C, hh, shift, sig_range):
    """(alpha, mu, sigma, [P_h], dense T) of a random 2-component layer on an Hn x Wn grid, T from the definition."""
    d = C // hh
    alpha = rng2.standard_normal((hh, 2))
    mu = rng2.uniform(-shift, shift, (hh, 2, 2))
    sig = rng2.uniform(*sig_range, (hh, 2, 2))
    WV, WO = rng2.standard_normal((C, C)), rng2.standard_normal((C, C))
    Ps = [WV[:, i * d:(i + 1) * d] @ WO[i * d:(i + 1) * d, :] for i in range(hh)]
    ax = lambda n, m0, s0: _taps(np.arange(n)[:, None] - np.arange(n)[None, :], m0, s0)  # noqa: E731
    T = sum(np.kron(sum(alpha[i, m] * np.kron(ax(Hn, mu[i, m, 0], sig[i, m, 0]), ax(Wn, mu[i, m, 1], sig[i, m, 1]))
                        for m in range(2)), Ps[i].T) for i in range(hh))
    return alpha, mu, sig, Ps, T


ok, worst = True, 0.0
for trial in range(4):  # ||T|| <= lambda_max(T_N(s)) with T_N(s) by periodic trapezoid quadrature (spectral accuracy)
    Hn, Wn, C, hh = 3, 3, 4, 2
    alpha, mu, sig, Ps, T = _random_layer(Hn, Wn, C, hh, 1.5, (0.6, 1.5))
    exact = np.linalg.norm(T, 2)
    L = 256
    wq = 2 * np.pi * np.arange(L) / L
    kk = np.arange(-60, 61)
    gh = lambda m0, s0: (_taps(kk, m0, s0)[None] * np.exp(-1j * wq[:, None] * kk[None])).sum(1)  # noqa: E731
    c = np.zeros((L, L, hh), dtype=complex)
    for i in range(hh):
        for m in range(2):
            c[:, :, i] += alpha[i, m] * gh(mu[i, m, 0], sig[i, m, 0])[:, None] * gh(mu[i, m, 1], sig[i, m, 1])[None, :]
    s_ = np.linalg.norm(np.einsum("abh,hij->abij", c, np.array(Ps)), ord=2, axis=(2, 3))
    tk = np.fft.fft2(s_) / L ** 2  # t[k] = mean s e^{-i k w}
    Tn = np.array([[tk[(a - a2) % L, (b - b2) % L] for a2 in range(Hn) for b2 in range(Wn)]
                   for a in range(Hn) for b in range(Wn)])
    lam = np.linalg.eigvalsh((Tn + Tn.conj().T) / 2)[-1]
    ok &= lam >= exact * (1 - 1e-9)
    worst = max(worst, lam / exact - 1)
check(f"||T|| <= lambda_max(T_N(||S||)) on 4 random 3x3 layers (loosest {worst:.2f} relative)", ok)

# ---------------------------------------------------------------------------------------------------------------
# Circulant Gram envelope (proofs/S2.md, 'Circulant Gram envelope')
# Parseval with weights: (1/L) sum_w f(w) |x^(w)|^2 = x^T R_f x, R_f[j, j'] = (1/L) sum_w f(w) e^{-i w (j - j')}, for x
# supported on n = 2 points of the L = 3 torus, f symbolic and even (f(w_1) = f(w_2))
xs = sp.symbols("x0:2", real=True)
f0, f1 = sp.symbols("f0 f1", positive=True)
Lt = 3
fw = [f0, f1, f1]
ws = [2 * sp.pi * a / Lt for a in range(Lt)]
lhs = sum(fw[a] * sp.Abs(sum(xs[j] * sp.exp(-sp.I * ws[a] * j) for j in range(2))) ** 2 for a in range(Lt)) / Lt
Rf = sp.Matrix(2, 2, lambda j, jp: sum(fw[a] * sp.exp(-sp.I * ws[a] * (j - jp)) for a in range(Lt)) / Lt)
rhs = (sp.Matrix([xs]) * Rf * sp.Matrix(xs))[0]
check("weighted Parseval on the torus: (1/L) sum f |x^|^2 = x^T R_f x",
      sp.simplify(sp.expand_complex(sp.expand(lhs - rhs))) == 0)
check("R_f is real for even f", sp.simplify(sp.im(sp.expand_complex(Rf[0, 1]))) == 0)
# the angle 2 pi m / L from fl(2 pi) (relative u), one product and one division: (1 + u)^3 - 1 <= 3.01 u for u <= 2^-24
uu = sp.symbols("u", positive=True)
check("trig_error: (1 + u)^3 - 1 <= 3.01 u (u <= 2^-24)",
      sp.simplify(((1 + uu) ** 3 - 1 - sp.Rational(301, 100) * uu).subs(uu, sp.Rational(1, 2 ** 24))) < 0
      and sp.diff((1 + uu) ** 3 - 1 - sp.Rational(301, 100) * uu, uu).subs(uu, sp.Rational(1, 2 ** 24)) < 0)
# Lemma G1 numerically: T^T T <= R_f kron I on random 2-D layers (f = ||S_L||^2 at the (2H-1) x (2W-1) torus)
ok, worst = True, 0.0
for trial in range(4):
    Hn, Wn, C, hh = 3, 4, 4, 2
    alpha, mu, sig, Ps, T = _random_layer(Hn, Wn, C, hh, 2.5, (0.3, 1.5))
    L1, L2 = 2 * Hn - 1, 2 * Wn - 1
    ky, kx = np.arange(-(Hn - 1), Hn), np.arange(-(Wn - 1), Wn)
    wy, wx = 2 * np.pi * np.arange(L1) / L1, 2 * np.pi * np.arange(L2) / L2
    gh = lambda w, k, m0, s0: np.exp(-1j * w[:, None] * k[None]) @ _taps(k, m0, s0)  # noqa: E731
    c = np.zeros((L1, L2, hh), dtype=complex)
    for i in range(hh):
        for m in range(2):
            c[:, :, i] += alpha[i, m] * np.outer(gh(wy, ky, mu[i, m, 0], sig[i, m, 0]), gh(wx, kx, mu[i, m, 1], sig[i, m, 1]))
    f2 = np.linalg.norm(np.einsum("abh,hij->abij", c, np.array(Ps)), ord=2, axis=(2, 3)) ** 2
    y, x = np.meshgrid(np.arange(Hn), np.arange(Wn), indexing="ij")
    E = np.exp(-1j * (wy[:, None, None] * y.reshape(-1) + wx[None, :, None] * x.reshape(-1))).reshape(L1 * L2, -1)
    R = ((E.conj().T * f2.reshape(-1)) @ E / (L1 * L2)).real
    G = T.T @ T
    low = np.linalg.eigvalsh(np.kron(R, np.eye(C)) - G)[0]
    ok &= low >= -1e-10 * np.linalg.norm(G, 2)
    worst = max(worst, math.sqrt(np.linalg.eigvalsh(R)[-1] / np.linalg.norm(G, 2)) - 1)
check(f"T^T T <= R_f kron I on 4 random 3x4 layers (lambda_max(R_f)^(1/2) at most {worst:.2f} above ||T||)", ok)

sys.exit(1 if failures else 0)
