"""Sympy checks of the algebra in proofs/S5.md. Exits non-zero on the first failed check."""
import sys

import sympy as sp

sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), ".."))

failures = []


def check(name, ok):
    print(("ok   " if ok else "FAIL ") + name)
    if not ok:
        failures.append(name)


t, s, tau = sp.symbols("t s tau", nonnegative=True)
L, lam, x0, phi0 = sp.symbols("L lambda x0 phi0", positive=True)

# Step 1: Bielecki contraction factor
integral = sp.integrate(L * sp.exp(2 * L * s), (s, 0, t))
check("int_0^t L exp(2 L s) ds = (exp(2 L t) - 1)/2", sp.simplify(integral - (sp.exp(2 * L * t) - 1) / 2) == 0)
factor = sp.simplify(sp.exp(-2 * L * t) * integral)
check("factor = (1 - exp(-2 L t))/2", sp.simplify(factor - (1 - sp.exp(-2 * L * t)) / 2) == 0)
check("factor is increasing in t with limit 1/2",
      sp.limit(factor, t, sp.oo) == sp.Rational(1, 2) and sp.simplify(sp.diff(factor, t) - L * sp.exp(-2 * L * t)) == 0)

# Step 2: integrating factor and the Gronwall envelope
psi = sp.Function("psi")
lhs = sp.diff(sp.exp(-L * t) * psi(t), t)
check("(exp(-L t) psi)' = exp(-L t)(psi' - L psi)",
      sp.simplify(lhs - sp.exp(-L * t) * (sp.diff(psi(t), t) - L * psi(t))) == 0)
bound_psi = sp.integrate(phi0 * sp.exp(-L * s), (s, 0, t))
check("int_0^t phi0 exp(-L s) ds = phi0 (1 - exp(-L t))/L", sp.simplify(bound_psi - phi0 * (1 - sp.exp(-L * t)) / L) == 0)
envelope = phi0 + L * sp.exp(L * t) * bound_psi
check("phi0 + L psi_max = phi0 exp(L t)", sp.simplify(envelope - phi0 * sp.exp(L * t)) == 0)
u = phi0 * sp.exp(L * t)
check("exp(L t) phi0 solves u' = L u, u(0) = phi0", sp.simplify(sp.diff(u, t) - L * u) == 0 and u.subs(t, 0) == phi0)

# Step 3: E(t) = int_0^t exp(L (t - s)) delta(s) ds solves E' = L E + delta, E(0) = 0
delta = sp.Function("delta")
E = sp.Integral(sp.exp(L * (t - s)) * delta(s), (s, 0, t))
dE = sp.diff(E, t).doit()
check("E' - L E - delta = 0 (Leibniz rule)",
      sp.simplify(sp.expand(dE - L * E.doit() - delta(t))) == 0)
check("E(0) = 0", E.subs(t, 0).doit() == 0)
# the comparison argument on a concrete defect, closed form: delta = exp(-s) gives E in closed form
Ec = sp.integrate(sp.exp(L * (t - s)) * sp.exp(-s), (s, 0, t))
check("closed-form E solves E' = L E + delta", sp.simplify(sp.diff(Ec, t) - L * Ec - sp.exp(-t)) == 0)

# Step 4: tightness on x' = lambda x with y(t) = x0 (1 + lambda t)
y = x0 * (1 + lam * t)
dfct = sp.diff(y, t) - lam * y
check("defect of the Taylor curve is -lambda^2 x0 t", sp.simplify(dfct + lam**2 * x0 * t) == 0)
bound = sp.integrate(sp.exp(lam * (t - s)) * sp.Abs(dfct.subs(t, s)), (s, 0, t))
actual = x0 * sp.exp(lam * t) - y
check("a-posteriori bound equals the actual error", sp.simplify(bound - actual) == 0)

# ---------------------------------------------------------------- Theorem 5 (the enclosure)
# Lemma 1: LayerNorm's second derivative. n(x) = P x / s, s = sqrt(|P x|^2 / C + eps). Check the formula
# D^2 n[u, u] = -2 w (z.w)/(C s^3) + z (3 (z.w)^2/(C^2 s^5) - |w|^2/(C s^3)) against sympy's derivative in C = 3,
# and the sharp bound (2/sqrt(3)) |u|^2 / (sqrt(C) s^2): at rational points, and in general through the plane of y and w.
import random  # noqa: E402

C3 = 3
xs = sp.symbols("x0:3", real=True)
us = sp.symbols("u0:3", real=True)
h, eps_ = sp.symbols("h eps", positive=True)
X = sp.Matrix(xs)
Uv = sp.Matrix(us)
P = sp.eye(C3) - sp.ones(C3, C3) / C3


def nvec(v):
    z = P * v
    return z / sp.sqrt((z.T * z)[0] / C3 + eps_)


second = sp.diff(nvec(X + h * Uv), h, 2).subs(h, 0)
z, w = P * X, P * Uv
sv = sp.sqrt((z.T * z)[0] / C3 + eps_)
zw, ww = (z.T * w)[0], (w.T * w)[0]
formula = -2 * w * zw / (C3 * sv ** 3) + z * (3 * zw ** 2 / (C3 ** 2 * sv ** 5) - ww / (C3 * sv ** 3))
rnd = random.Random(0)
ok_formula, ok_bound = True, True
for _ in range(5):
    vals = {**{xi: sp.Rational(rnd.randint(-9, 9), 4) for xi in xs}, **{ui: sp.Rational(rnd.randint(-9, 9), 5) for ui in us},
            eps_: sp.Rational(1, 100)}
    diff = (second - formula).subs(vals)
    ok_formula &= all(abs(float(sp.N(d, 30))) < 1e-20 for d in diff)
    lhs = float(sp.N(sp.sqrt(sum(c ** 2 for c in formula.subs(vals))), 30))
    rhs = float(sp.N(2 / sp.sqrt(3) * sum(vals[ui] ** 2 for ui in us) / (sp.sqrt(C3) * sv.subs(vals) ** 2), 30))
    ok_bound &= lhs <= rhs
check("Lemma 1: D^2 xhat[u, u] formula equals sympy's second derivative (C = 3, 5 rational points)", ok_formula)
check("Lemma 1: ||D^2 xhat[u, u]|| <= (2/sqrt(3)) ||u||^2 / (sqrt(C) s^2) at those points", ok_bound)
# the general case: y = z / s = rho sqrt(C) yhat (q = rho^2 <= 1), w = |w| (c yhat + sn e), a = c^2
Cs, ss, wn, rho, cs = sp.symbols("C s wn rho c", positive=True)
qq, aa = sp.symbols("q a", nonnegative=True)
yv, wv = sp.Matrix([rho * sp.sqrt(Cs), 0]), sp.Matrix([wn * cs, wn * sp.sqrt(1 - cs ** 2)])
yw = (yv.T * wv)[0]
D2 = (-2 * wv * yw - yv * wn ** 2 + 3 * yv * yw ** 2 / Cs) / (Cs * ss ** 2)
f2 = qq * ((4 - 3 * qq) * aa * (2 - 3 * aa * qq) + 1)
check("Lemma 1: ||D^2 xhat[u, u]||^2 = (|w|^2 / (sqrt(C) s^2))^2 q [(4 - 3q) a (2 - 3 a q) + 1]",
      sp.simplify((D2.T * D2)[0] - (wn ** 2 / (sp.sqrt(Cs) * ss ** 2)) ** 2 * f2.subs({qq: rho ** 2, aa: cs ** 2})) == 0)
check("Lemma 1: 4/3 - q [(4 - 3q) a (2 - 3 a q) + 1] = (4 - 3q) (1 - 3 q a)^2 / 3 (>= 0 for q <= 1): the constant "
      "2/sqrt(3), attained at q a = 1/3", sp.expand(sp.Rational(4, 3) - f2 - (4 - 3 * qq) * (1 - 3 * qq * aa) ** 2 / 3) == 0
      and sp.simplify(f2.subs({qq: sp.Rational(1, 3), aa: 1}) - sp.Rational(4, 3)) == 0)

# sup |GELU''| = sqrt(2/pi): GELU'' = phi(x) (2 - x^2), critical points 0 and +-2
xg = sp.symbols("x", real=True)
gelu = xg * (1 + sp.erf(xg / sp.sqrt(2))) / 2
g2 = sp.simplify(sp.diff(gelu, xg, 2))
check("GELU'' = phi(x) (2 - x^2)", sp.simplify(g2 - sp.exp(-xg ** 2 / 2) / sp.sqrt(2 * sp.pi) * (2 - xg ** 2)) == 0)
crit = sp.solve(sp.diff(g2, xg), xg)
gvals = [sp.Abs(g2.subs(xg, c)) for c in crit]
check("sup |GELU''| = 2 phi(0) = sqrt(2/pi) (critical points 0, +-2; limit 0 at infinity)",
      set(crit) == {0, 2, -2} and sp.simplify(max(gvals, key=lambda v: float(v)) - sp.sqrt(2 / sp.pi)) == 0)
from lipcheck.bounds.lognorm import GELU2_SUP, LN_CURVATURE  # noqa: E402
check("the code's constants are those proven here",
      abs(GELU2_SUP - float(sp.sqrt(2 / sp.pi))) < 1e-15
      and 0 <= sp.Rational(LN_CURVATURE) - 2 / sp.sqrt(3) < sp.Rational(1, 10 ** 12))

# Step 5 (one sub-interval): R(s) = r0 e^{mu s} + d (e^{mu s} - 1)/mu solves the comparison equation, and
# R' = e^{mu s} (mu r0 + d) has one sign, so the sup of R over [0, tau] is at an end point.
mu_, d_, r0_ = sp.symbols("mu d r0", real=True)
R = r0_ * sp.exp(mu_ * s) + d_ * (sp.exp(mu_ * s) - 1) / mu_
check("R' = mu R + d, R(0) = r0", sp.simplify(sp.diff(R, s) - mu_ * R - d_) == 0 and sp.simplify(R.subs(s, 0) - r0_) == 0)
check("R' = e^{mu s} (mu r0 + d): one sign on the interval",
      sp.simplify(sp.diff(R, s) - sp.exp(mu_ * s) * (mu_ * r0_ + d_)) == 0)
check("phi(z) = (e^z - 1)/z -> 1 as z -> 0 (the mu = 0 case)", sp.limit((sp.exp(xg) - 1) / xg, xg, 0) == 1)

# Step 6 (defect between samples): delta = y' - f(y) gives delta'' = y''' - f''(y) y'^2 - f'(y) y'' (scalar
# model of D^2F[y', y'] + J y''); Taylor at the nearer end, |theta| <= tau/2, remainder (tau/2)^2/2 sup|delta''|.
yf, ff = sp.Function("y"), sp.Function("f")
dl = sp.diff(yf(t), t) - ff(yf(t))
d2 = sp.diff(dl, t, 2)
yy = sp.Symbol("Y")
f1 = sp.diff(ff(yy), yy).subs(yy, yf(t))
f2 = sp.diff(ff(yy), yy, 2).subs(yy, yf(t))
expect = sp.diff(yf(t), t, 3) - f2 * sp.diff(yf(t), t) ** 2 - f1 * sp.diff(yf(t), t, 2)
check("delta'' = y''' - F''(y)[y', y'] - F'(y) y''", sp.simplify(sp.expand(d2.doit() - expect.doit())) == 0)
th = sp.symbols("theta", real=True)
check("Taylor remainder at |theta| = tau/2 is tau^2/8 M", sp.simplify((th ** 2 / 2).subs(th, tau / 2) - tau ** 2 / 8) == 0)

# Step 6b (linear interpolation of delta on [0, tau]): the Green's function of -d^2/ds^2 with zero end values,
# G(s, r) = r (tau - s)/tau for r <= s and s (tau - r)/tau for r >= s, is >= 0 and integrates to s (tau - s)/2,
# whose maximum over s is tau^2/8: ||delta - l|| <= tau^2/8 sup ||delta''||.
r_ = sp.symbols("r", nonnegative=True)
G_int = sp.integrate(r_ * (tau - s) / tau, (r_, 0, s)) + sp.integrate(s * (tau - r_) / tau, (r_, s, tau))
check("int_0^tau G(s, r) dr = s (tau - s)/2", sp.simplify(G_int - s * (tau - s) / 2) == 0)
check("max_s s (tau - s)/2 = tau^2/8 at s = tau/2",
      sp.solve(sp.diff(s * (tau - s) / 2, s), s) == [tau / 2]
      and sp.simplify((s * (tau - s) / 2).subs(s, tau / 2) - tau ** 2 / 8) == 0)
f_ = sp.Function("f")
lin = f_(0) + (f_(tau) - f_(0)) * s / tau
# the representation f - l = -int G f'' holds for f = polynomials up to degree 3 (checked on a generic cubic)
c0, c1, c2, c3 = sp.symbols("c0:4", real=True)
cub = c0 + c1 * s + c2 * s ** 2 + c3 * s ** 3
cub_r = cub.subs(s, r_)
rep = -(sp.integrate(r_ * (tau - s) / tau * sp.diff(cub_r, r_, 2), (r_, 0, s))
        + sp.integrate(s * (tau - r_) / tau * sp.diff(cub_r, r_, 2), (r_, s, tau)))
lin_c = cub.subs(s, 0) + (cub.subs(s, tau) - cub.subs(s, 0)) * s / tau
check("f - l = -int G f'' (generic cubic)", sp.simplify(sp.expand(cub - lin_c - rep)) == 0)

# Step 7 (Lemma 6): Bernstein coefficients of a quartic from its values at 0, 1/4, 1/2, 3/4, 1, computed here
# independently (sympy: interpolate, then expand in the Bernstein basis), equal the code's exact matrix; the
# basis is a nonnegative partition of unity; and b_j = sum_{k<=j} C(j,k)/C(n,k) a_k for the power basis.
sg = sp.symbols("sigma")
vs = sp.symbols("v0:5")
pq = sp.interpolate(list(zip([sp.Rational(i, 4) for i in range(5)], vs)), sg)
Bq = [sp.binomial(4, j) * sg ** j * (1 - sg) ** (4 - j) for j in range(5)]
bs = sp.symbols("b0:5")
sol = sp.solve(sp.Poly(sp.expand(sum(b * B for b, B in zip(bs, Bq)) - pq), sg).all_coeffs(), bs, dict=True)[0]
M_sym = [[sp.expand(sol[bs[j]]).coeff(vs[i]) for i in range(5)] for j in range(5)]
from lipcheck.wellposed.enclosure import _bernstein_matrix  # noqa: E402
check("values -> Bernstein matrix equals the code's", M_sym == [[sp.Rational(x.numerator, x.denominator) for x in row]
                                                             for row in _bernstein_matrix()])
check("Bernstein basis sums to 1", sp.simplify(sum(Bq) - 1) == 0)
a_s = sp.symbols("a0:4")
n3 = 3
B3 = [sp.binomial(n3, j) * sg ** j * (1 - sg) ** (n3 - j) for j in range(n3 + 1)]
b3 = [sum(sp.binomial(j, k) / sp.binomial(n3, k) * a_s[k] for k in range(j + 1)) for j in range(n3 + 1)]
check("power -> Bernstein: b_j = sum_k C(j,k)/C(n,k) a_k (cubic)",
      sp.expand(sum(b * B for b, B in zip(b3, B3)) - sum(a * sg ** k for k, a in enumerate(a_s))) == 0)

# Step 8 (Lemma 7): LayerNorm's Jacobian-vector product J u = gamma (u_c - xh <xh, u_c> / C) / s, u_c = u - mean(u),
# xh = (x - mean(x)) / s, s^2 = var(x) + eps, against sympy's directional derivative (C = 3, symbolic gamma and eps)
xs8, us8, gs8 = sp.symbols("x0:3"), sp.symbols("u0:3"), sp.symbols("g0:3")
ep8, h8 = sp.symbols("epsilon h", positive=True)


def _ln8(x):
    m = sum(x) / 3
    sd = sp.sqrt(sum((xi - m) ** 2 for xi in x) / 3 + ep8)
    return [g * (xi - m) / sd for g, xi in zip(gs8, x)]


dir8 = [sp.diff(o, h8).subs(h8, 0) for o in _ln8([xi + h8 * ui for xi, ui in zip(xs8, us8)])]
m8, mu8 = sum(xs8) / 3, sum(us8) / 3
sd8 = sp.sqrt(sum((xi - m8) ** 2 for xi in xs8) / 3 + ep8)
xh8 = [(xi - m8) / sd8 for xi in xs8]
uc8 = [ui - mu8 for ui in us8]
dot8 = sum(a * b for a, b in zip(xh8, uc8)) / 3
jvp8 = [g * (uc - xh * dot8) / sd8 for g, uc, xh in zip(gs8, uc8, xh8)]
check("Lemma 7: J_LN u = gamma (u_c - xh <xh, u_c> / C) / s", all(sp.simplify(a - b) == 0 for a, b in zip(dir8, jvp8)))

# Step A1 ("The attention field", Lemma A1): softmax's derivatives as moments. For p = softmax(s) on 3 entries,
# d E_p[g][a] = Cov_p(a, g) and d^2 E_p[g][a, b] = E_p[(a - a_bar)(b - b_bar)(g - g_bar)]; then the attention
# output y_i = sum_j p_ij z_j with s_ij = (a z_i + c) z_j / sigma (2 tokens, C = 1) has
# D^2 y_i[U, V] = Cov_i(h, u) + Cov_i(f, v) + Cov_i(e, z) + E_i[(h - h_bar)(f - f_bar)(z - z_bar)].
ss, gg, aa, bb = (sp.symbols(f"{n}0:3") for n in ("s", "g", "a", "b"))
ep, et = sp.symbols("epsilon eta")
pexp = [sp.exp(ss[j] + ep * aa[j] + et * bb[j]) for j in range(3)]
Eg = sum(pexp[j] * gg[j] for j in range(3)) / sum(pexp)
p0 = [sp.exp(ss[j]) / sum(sp.exp(x) for x in ss) for j in range(3)]
E0 = lambda f: sum(p0[j] * f[j] for j in range(3))  # noqa: E731
cen = lambda f: [f[j] - E0(f) for j in range(3)]  # noqa: E731
num = {**{ss[j]: sp.Rational(j + 1, 3) for j in range(3)}, **{gg[j]: sp.Rational(2 - j, 5) for j in range(3)},
       **{aa[j]: sp.Rational(3 * j - 1, 7) for j in range(3)}, **{bb[j]: sp.Rational(j * j - 2, 4) for j in range(3)}}
d1 = sp.diff(Eg, ep).subs({ep: 0, et: 0})
cov = E0([x * y for x, y in zip(cen(aa), cen(gg))])
check("d E_p[g][a] = Cov_p(a, g)", abs(sp.N((d1 - cov).subs(num), 30)) < 1e-25)
d2 = sp.diff(Eg, ep, et).subs({ep: 0, et: 0})
third = E0([x * y * w for x, y, w in zip(cen(aa), cen(bb), cen(gg))])
check("d^2 E_p[g][a, b] = E_p[(a - a_bar)(b - b_bar)(g - g_bar)]", abs(sp.N((d2 - third).subs(num), 30)) < 1e-25)
A_, c_, sig = sp.symbols("A c sigma", positive=True)
zs, us, vs2 = sp.symbols("z0:2"), sp.symbols("u0:2"), sp.symbols("w0:2")
Zt = [zs[j] + ep * us[j] + et * vs2[j] for j in range(2)]
ok = True
for i in range(2):
    sc = [(A_ * Zt[i] + c_) * Zt[j] / sig for j in range(2)]
    yi = sum(sp.exp(sc[j]) * Zt[j] for j in range(2)) / sum(sp.exp(x) for x in sc)
    D2y = sp.diff(yi, ep, et).subs({ep: 0, et: 0})
    s0 = [(A_ * zs[i] + c_) * zs[j] / sig for j in range(2)]
    q = [sp.exp(x) / sum(sp.exp(y) for y in s0) for x in s0]
    E = lambda f: sum(q[j] * f[j] for j in range(2))  # noqa: E731
    C_ = lambda f: [f[j] - E(f) for j in range(2)]  # noqa: E731
    Cov = lambda f, g: E([x * y for x, y in zip(C_(f), C_(g))])  # noqa: E731
    f_ = [(us[i] * A_ * zs[j] + (A_ * zs[i] + c_) * us[j]) / sig for j in range(2)]
    h_ = [(vs2[i] * A_ * zs[j] + (A_ * zs[i] + c_) * vs2[j]) / sig for j in range(2)]
    e_ = [(us[i] * A_ * vs2[j] + vs2[i] * A_ * us[j]) / sig for j in range(2)]
    formula = (Cov(h_, list(us)) + Cov(f_, list(vs2)) + Cov(e_, list(zs))
               + E([x * y * w for x, y, w in zip(C_(h_), C_(f_), C_(list(zs)))]))
    vals = {A_: sp.Rational(3, 2), c_: sp.Rational(-1, 3), sig: sp.Rational(7, 5), zs[0]: sp.Rational(1, 2),
            zs[1]: sp.Rational(-6, 5), us[0]: sp.Rational(2, 3), us[1]: sp.Rational(1, 4), vs2[0]: sp.Rational(-1, 2),
            vs2[1]: sp.Rational(5, 4)}
    ok = ok and abs(sp.N((D2y - formula).subs(vals), 30)) < 1e-25
check("D^2 Attn[U, V]_i = Cov(h, u) + Cov(f, v) + Cov(e, z) + E[(h-h_bar)(f-f_bar)(z-z_bar)] (2 tokens)", ok)

# Step A2 (Lemma A2): the four moment bounds collect into K2's two coefficients, in both forms.
aR, om, R_, sg2, al, be, qi, Pq = sp.symbols("aR omega R sigma alpha beta q Pq", positive=True)
k_ = aR + om
X = 2 * aR / sg2 + 2 * aR * R_ * k_ / sg2 ** 2
Y = 2 * k_ / sg2 + 2 * R_ * om * k_ / sg2 ** 2
T1 = (aR * al + om * be) / sg2
T2 = k_ * be / sg2
T3 = aR * (be + al) / sg2
T4 = 2 * R_ * k_ * (aR * al + om * be) / sg2 ** 2
check("(a): T1 + T2 + T3 + T4 = alpha X + beta Y (per unit max_j ||u_j||)",
      sp.expand(T1 + T2 + T3 + T4 - al * X - be * Y) == 0)
check("weighted Cauchy-Schwarz: (aR al + om be)^2 <= (aR + om)(aR al^2 + om be^2), gap aR om (al - be)^2",
      sp.expand(k_ * (aR * al ** 2 + om * be ** 2) - (aR * al + om * be) ** 2 - aR * om * (al - be) ** 2) == 0)
amgm = (qi + Pq) / 2  # alpha beta <= (alpha^2 + beta^2) / 2 with alpha^2 = q_i, beta^2 = (P q)_i
T12b = 2 * (aR * amgm + om * Pq) / sg2
T3b = 2 * aR * amgm / sg2
T4b = 2 * R_ * k_ * (aR * qi + om * Pq) / sg2 ** 2
check("(b): T1 + T2 + T3 + T4 <= q_i X + (P q)_i Y (V = U)", sp.expand(T12b + T3b + T4b - qi * X - Pq * Y) == 0)

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("all checks passed")
