"""Sympy checks of the algebra in proofs/S1.md. Exits non-zero on the first failed check."""
import sys

import sympy as sp

failures = []


def check(name, ok):
    print(("ok   " if ok else "FAIL ") + name)
    if not ok:
        failures.append(name)


x, mu, w, t = sp.symbols("x mu omega t", real=True)
s = sp.symbols("sigma", positive=True)
k, n, j = sp.symbols("k n j", integer=True)

# Step 1: truncated lattice sums at 40 digits: sum g = 1 and |ghat(w)| <= 1, ghat(0) = 1
for mu0, s0 in [(sp.Rational(3, 10), sp.Rational(1, 2)), (sp.Rational(-7, 4), sp.Rational(3, 2)), (2, sp.Rational(1, 5))]:
    terms = [sp.N(sp.exp(-(kk - mu0) ** 2 / (2 * s0 ** 2)), 40) for kk in range(-25, 26)]
    Z = sum(terms)
    g = [tt / Z for tt in terms]
    check(f"sum_k g(k) = 1 (mu={mu0}, sigma={s0})", abs(sum(g) - 1) < 1e-35)
    for w0 in [0, sp.Rational(1, 3), 1, sp.pi / 2, sp.pi]:
        ghat = sum(gk * sp.N(sp.exp(-sp.I * kk * w0), 40) for gk, kk in zip(g, range(-25, 26)))
        check(f"|ghat({w0})| <= 1 (mu={mu0}, sigma={s0})", sp.N(sp.Abs(ghat), 35) <= 1 + sp.Float(1e-33))

# Step 2: Poisson summation. Fourier transform of the Gaussian, then both sides numerically
# the Fourier transform of exp(-x^2/2) is sqrt(2 pi) exp(-t^2/2): both solve y' = -t y with the same y(0)
ft0 = sp.sqrt(2 * sp.pi) * sp.exp(-t ** 2 / 2)
check("Gaussian transform: y(0) = int exp(-x^2/2) dx", sp.simplify(sp.integrate(sp.exp(-x ** 2 / 2), (x, -sp.oo, sp.oo)) - ft0.subs(t, 0)) == 0)
# d/dt int e^{-x^2/2} e^{-ixt} dx = int -ix e^{-x^2/2} e^{-ixt} dx = (integrate by parts) -t * transform
check("Gaussian transform: integration by parts gives y' = -t y",
      sp.simplify(sp.diff(sp.exp(-x ** 2 / 2), x) + x * sp.exp(-x ** 2 / 2)) == 0 and sp.simplify(sp.diff(ft0, t) + t * ft0) == 0)
# shift and scale: x -> (x - mu)/sigma multiplies by sigma e^{-i t mu} and evaluates at sigma t
expected = sp.sqrt(2 * sp.pi) * s * sp.exp(-s ** 2 * t ** 2 / 2) * sp.exp(-sp.I * t * mu)
check("shift/scale rule", sp.simplify(s * sp.exp(-sp.I * t * mu) * ft0.subs(t, s * t) - expected) == 0)
for mu0, s0, w0 in [(0.3, 0.7, 0.9), (-1.2, 1.8, 2.5), (2.5, 0.45, -3.0)]:
    lattice = sum(sp.exp(-(kk - sp.Float(mu0, 40)) ** 2 / (2 * sp.Float(s0, 40) ** 2)) * sp.exp(-sp.I * kk * sp.Float(w0, 40))
                  for kk in range(-60, 61))
    pois = sp.sqrt(2 * sp.pi) * sp.Float(s0, 40) * sum(
        sp.exp(-sp.Float(s0, 40) ** 2 * (sp.Float(w0, 40) + 2 * sp.pi * nn) ** 2 / 2)
        * sp.exp(-sp.I * (sp.Float(w0, 40) + 2 * sp.pi * nn) * sp.Float(mu0, 40)) for nn in range(-12, 13))
    check(f"Poisson summation of the symbol (mu={mu0}, sigma={s0}, w={w0})", abs(complex(sp.N(lattice - pois, 30))) < 1e-22)
    Zl = sum(sp.exp(-(kk - sp.Float(mu0, 40)) ** 2 / (2 * sp.Float(s0, 40) ** 2)) for kk in range(-60, 61))
    q = sp.exp(-2 * sp.pi ** 2 * sp.Float(s0, 40) ** 2)
    theta3 = 1 + 2 * sum(q ** (nn ** 2) * sp.cos(2 * nn * sp.pi * sp.Float(mu0, 40)) for nn in range(1, 13))
    check(f"Z = sqrt(2 pi) sigma theta_3(pi mu, q) (mu={mu0}, sigma={s0})",
          abs(float(sp.N(Zl - sp.sqrt(2 * sp.pi) * sp.Float(s0, 40) * theta3, 30))) < 1e-22)

# Step 3: Toeplitz entries are Fourier coefficients of the symbol; plane waves are eigenvectors of the Laurent operator
a = sp.symbols("a_-3:4")  # coefficients a_k for k = -3..3, a 1-D kernel of width 3
coef = dict(zip(range(-3, 4), a))
symb = sum(coef[kk] * sp.exp(-sp.I * kk * w) for kk in coef)
for kk in coef:
    c_k = sp.integrate(sp.expand(symb * sp.exp(sp.I * kk * w)), (w, -sp.pi, sp.pi)) / (2 * sp.pi)
    check(f"Fourier coefficient {kk} of the symbol is the Toeplitz entry", sp.simplify(c_k - coef[kk]) == 0)
i = sp.symbols("i", integer=True)
laurent = sum(coef[kk] * sp.exp(sp.I * w * (i - kk)) for kk in coef)  # (L e)(i) = sum_k a_k e(i - k)
check("plane wave e^{i w i} is an eigenvector of the Laurent operator with eigenvalue ghat(w)",
      sp.simplify(laurent - symb * sp.exp(sp.I * w * i)) == 0)

# Step 4: |sum_h c_h P_h| <= sum_h |c_h| |P_h| uses |a b| = |a||b| and |ghat| <= 1
ay, ax, al = sp.symbols("g_y g_x alpha", complex=True)
check("|alpha g_y g_x| = |alpha| |g_y| |g_x|", sp.simplify(sp.Abs(al * ay * ax) - sp.Abs(al) * sp.Abs(ay) * sp.Abs(ax)) == 0)

# Step 5: singular values of a Kronecker product are products of singular values (2 x 2, symbolic)
A = sp.Matrix(2, 2, sp.symbols("p0:4", real=True))
B = sp.Matrix(2, 2, sp.symbols("r0:4", real=True))
KP = sp.kronecker_product(A, B)
check("(A kron B)^T (A kron B) = (A^T A) kron (B^T B)",
      sp.simplify(KP.T * KP - sp.kronecker_product(A.T * A, B.T * B)) == sp.zeros(4, 4))
vals = {sym: sp.Rational(v, 7) for sym, v in zip(list(A) + list(B), [3, -2, 5, 1, 4, 6, -1, 2])}
ea = sorted(float(sp.re(sp.N(e))) for e in (A.T * A).subs(vals).eigenvals(multiple=True))
eb = sorted(float(sp.re(sp.N(e))) for e in (B.T * B).subs(vals).eigenvals(multiple=True))
ek = sorted(float(sp.re(sp.N(e))) for e in (KP.T * KP).subs(vals).eigenvals(multiple=True))
check("eig((A kron B)^T (A kron B)) = products of eig(A^T A), eig(B^T B)",
      all(abs(u - v) < 1e-12 for u, v in zip(ek, sorted(p * r for p in ea for r in eb))))

# Certification: the bilinear interpolation remainder. Linear interpolation on [a, b] (length h = 2r) has the Peano
# kernel K(t, s) >= 0 with integral (t - a)(b - t)/2 <= h^2/8 = r^2/2 (symbolic), and f - I f = -int K f''.
ta, tb, tt = sp.symbols("a b t", real=True)
check("max_t (t - a)(b - t)/2 = (b - a)^2/8 at t = (a + b)/2",
      sp.simplify(((tt - ta) * (tb - tt) / 2).subs(tt, (ta + tb) / 2) - (tb - ta) ** 2 / 8) == 0
      and sp.simplify(sp.diff((tt - ta) * (tb - tt) / 2, tt).subs(tt, (ta + tb) / 2)) == 0)
# numerically: for c(w) = sum_m alpha gy(y) gx(x) (complex, Gaussian symbols), |c - I c| <= r^2/2 sum |alpha| (D2y + D2x)
import cmath  # noqa: E402
import math  # noqa: E402
import random as _random  # noqa: E402
rng1 = _random.Random(1)


def ghat(w, mu, sg, K=40):
    z = sum(math.exp(-(k - mu) ** 2 / (2 * sg * sg)) for k in range(-K, K + 1))
    return sum(math.exp(-(k - mu) ** 2 / (2 * sg * sg)) / z * cmath.exp(-1j * k * w) for k in range(-K, K + 1))


def d2(mu, sg, K=40):
    z = sum(math.exp(-(k - mu) ** 2 / (2 * sg * sg)) for k in range(-K, K + 1))
    return sum(k * k * math.exp(-(k - mu) ** 2 / (2 * sg * sg)) / z for k in range(-K, K + 1))


ok_i, worst_i = True, 0.0
for _ in range(20):
    comps = [(rng1.uniform(-2, 2), rng1.uniform(-3, 3), rng1.uniform(0.3, 2), rng1.uniform(-3, 3), rng1.uniform(0.3, 2))
             for _ in range(2)]
    f = lambda y, x: sum(al * ghat(y, my, sy) * ghat(x, mx, sx) for al, my, sy, mx, sx in comps)  # noqa: E731
    R = sum(abs(al) * (d2(my, sy) + d2(mx, sx)) for al, my, sy, mx, sx in comps)
    y0, x0, r = rng1.uniform(-3, 3), rng1.uniform(-3, 3), rng1.uniform(0.01, 0.5)
    cs = {(sy_, sx_): f(y0 + sy_ * r, x0 + sx_ * r) for sy_ in (-1, 1) for sx_ in (-1, 1)}
    for _ in range(10):
        s_, t_ = rng1.random(), rng1.random()
        interp = ((1 - s_) * (1 - t_) * cs[(-1, -1)] + (1 - s_) * t_ * cs[(-1, 1)] + s_ * (1 - t_) * cs[(1, -1)]
                  + s_ * t_ * cs[(1, 1)])
        err = abs(f(y0 + (2 * s_ - 1) * r, x0 + (2 * t_ - 1) * r) - interp)
        bound = r * r / 2 * R
        ok_i &= err <= bound * (1 + 1e-9) + 1e-14
        worst_i = max(worst_i, err / bound)
check(f"bilinear interpolation of a Gaussian symbol sum within r^2/2 sum|alpha| (D2y + D2x) (worst {worst_i:.2f} of it)",
      ok_i)

sys.exit(1 if failures else 0)
