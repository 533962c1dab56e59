"""Sympy checks of the algebra in proofs/S4.md. Exits non-zero on the first failed check."""
import sys

import sympy as sp

failures = []


def check(name, ok):
    print(("ok   " if ok else "FAIL ") + name)
    if not ok:
        failures.append(name)


N, C = 3, 2  # three tokens (a query and two keys), one head of dimension d = C = 2
d = C
A = sp.Matrix(2, 2, sp.symbols("A0:4", real=True))  # W_Q W_K^T
B = sp.Matrix(2, 2, sp.symbols("B0:4", real=True))  # W_V W_O
X = sp.Matrix(N, C, sp.symbols("x0:6", real=True))
u1, u2, a = sp.symbols("u1 u2 a", real=True)


def f_row(i):
    """y_i = sum_j softmax_j(x_i A x_j^T / sqrt d) x_j B (a row vector)."""
    s = [(X[i, :] * A * X[j, :].T)[0, 0] / sp.sqrt(d) for j in range(N)]
    e = [sp.exp(sj) for sj in s]
    Z = sum(e)
    return sum(((e[j] / Z) * X[j, :] * B for j in range(N)), sp.zeros(1, C))


# Step 1: Jacobian of the query row at the witness X_R = [0; a u; -a u]
witness = {X[0, 0]: 0, X[0, 1]: 0, X[1, 0]: a * u1, X[1, 1]: a * u2, X[2, 0]: -a * u1, X[2, 1]: -a * u2}
y0 = f_row(0)
u = sp.Matrix([[u1, u2]])
R2 = 2 * a**2 * (u1**2 + u2**2)  # ||X_R||_F^2
kappa = R2 / (N * sp.sqrt(d))
for j in range(N):
    Jj = sp.Matrix(C, C, lambda p, q: sp.diff(y0[0, q], X[j, p]).subs(witness))  # d y_0[q] / d x_j[p]
    expect = B / N + (kappa / (u1**2 + u2**2) * A * u.T * u * B if j == 0 else sp.zeros(C, C))
    check(f"d y_query / d x_{j} at the witness = B/N" + (" + kappa A u^T u B / |u|^2" if j == 0 else ""),
          sp.simplify(Jj - expect) == sp.zeros(C, C))

# Step 2: the rank-one term has norm ||A u^T|| ||u B||: (p q^T)^T (p q^T) = |p|^2 q q^T, whose top eigenvalue is |p|^2 |q|^2
p = sp.Matrix(sp.symbols("p0:2", real=True))
q = sp.Matrix(sp.symbols("q0:2", real=True))
G = (p * q.T).T * (p * q.T)
check("(p q^T)^T (p q^T) = |p|^2 q q^T", sp.simplify(G - (p.T * p)[0] * q * q.T) == sp.zeros(2, 2))
ev = list(G.eigenvals().keys())
check("top eigenvalue |p|^2 |q|^2", any(sp.simplify(e - (p.T * p)[0] * (q.T * q)[0]) == 0 for e in ev))

# Step 3: growth. ||J|| >= ||D|| >= kappa ||A u^T|| ||u B|| - ||B||/N with kappa = R^2/(N sqrt d): the lower
# bound over R^2 tends to ||A u^T|| ||u B|| / (N sqrt d) > 0.
R, c, b = sp.symbols("R c b", positive=True)
lower = R**2 / (N * sp.sqrt(d)) * c - b / N
check("lower bound / R^2 -> c / (N sqrt d)", sp.limit(lower / R**2, R, sp.oo) == c / (N * sp.sqrt(d)))
check("lower bound -> infinity", sp.limit(lower, R, sp.oo) == sp.oo)

# Step 4: LayerNorm's image is bounded: z = (x - mean)/sqrt(var + eps) has ||z||^2 = C var/(var + eps) < C
n = 4
xs = sp.symbols("y0:4", real=True)
eps = sp.symbols("epsilon", positive=True)
m = sum(xs) / n
var = sum((xi - m) ** 2 for xi in xs) / n
z2 = sum(((xi - m) / sp.sqrt(var + eps)) ** 2 for xi in xs)
check("||LN_0(x)||^2 = C var / (var + eps)", sp.simplify(z2 - n * var / (var + eps)) == 0)
v = sp.symbols("v", nonnegative=True)
check("C v/(v + eps) < C", sp.simplify(n - n * v / (v + eps) - n * eps / (v + eps)) == 0)


# ----------------------------------------------------------------------------- Claim 4: biases and heads
sig = lambda z: 1 / (1 + sp.exp(-z))

# Step 5: b_K shifts row i of the logits by a j-independent amount, and softmax ignores row shifts;
# rows of P summing to one turn b_V into a constant.
WQ, WK = sp.Matrix(2, 2, sp.symbols("q0:4", real=True)), sp.Matrix(2, 2, sp.symbols("k0:4", real=True))
bQ, bK = sp.Matrix([sp.symbols("bq0:2", real=True)]), sp.Matrix([sp.symbols("bk0:2", real=True)])
logit = lambda i, j, kb: ((X[i, :] * WQ + bQ) * (X[j, :] * WK + kb).T)[0, 0]
shift_ok = all(sp.expand((logit(i, j, bK) - logit(i, j, sp.zeros(1, 2))) - (logit(i, 0, bK) - logit(i, 0, sp.zeros(1, 2))))
               == 0 for i in range(N) for j in range(N))
check("b_K adds a j-independent constant to row i of the logits", shift_ok)
s3, k0 = sp.symbols("s0:3", real=True), sp.symbols("kappa0", real=True)
soft = lambda v: [sp.exp(t) / sum(sp.exp(r) for r in v) for t in v]
check("softmax is invariant under a row shift",
      all(sp.simplify(p1 - p2) == 0 for p1, p2 in zip(soft([t + k0 for t in s3]), soft(list(s3)))))
Pq = sp.symbols("P0:2", real=True)
Pfull = [Pq[0], Pq[1], 1 - Pq[0] - Pq[1]]
WV, WO = sp.Matrix(2, 2, sp.symbols("v0:4", real=True)), sp.Matrix(2, 2, sp.symbols("o0:4", real=True))
bV = sp.Matrix([sp.symbols("bv0:2", real=True)])
lhs = sum(((Pfull[j] * (X[j, :] * WV + bV)) for j in range(N)), sp.zeros(1, 2)) * WO
rhs = sum((Pfull[j] * X[j, :] for j in range(N)), sp.zeros(1, 2)) * WV * WO + bV * WO
check("rows summing to 1: sum_j P_ij (x_j W_V + b_V) W_O = sum_j P_ij x_j B + b_V W_O",
      sp.expand(lhs - rhs) == sp.zeros(1, 2))

# Step 6: two heads with the same score map and B_2 = -B_1 cancel: the Jacobian of the sum is 0.
def head_row(i, Am, cm, Bm, Xm, n):
    s = [((Xm[i, :] * Am * Xm[j, :].T)[0, 0] + (cm * Xm[j, :].T)[0, 0]) / sp.sqrt(d) for j in range(n)]
    e = [sp.exp(t) for t in s]
    return sum(((e[j] / sum(e)) * Xm[j, :] * Bm for j in range(n)), sp.zeros(1, C))
cvec = sp.Matrix([sp.symbols("c0:2", real=True)])
fsum = head_row(0, A, cvec, B, X, N) + head_row(0, A, cvec, -B, X, N)
check("identical score maps, B_2 = -B_1: the two heads cancel (zero Jacobian)",
      all(sp.simplify(sp.diff(fsum[0, q], X[j, p])) == 0 for q in range(C) for j in range(N) for p in range(C)))

# Step 7: scores s and 2 s with B_2 = -B_1/2 do NOT cancel next to a tie. One dimension (C = d = 1),
# query y = delta / a, keys +-a: key logits +-delta (head 1), +-2 delta (head 2); self logit -> 0.
a_, dl, yq = sp.symbols("a delta y", real=True)
def head_1d(lam, beta):
    xs = [yq, a_, -a_]
    e = [sp.exp(lam * yq * x) for x in xs]
    return sum(e[j] / sum(e) * xs[j] for j in range(3)) * beta
fy = sp.diff(head_1d(1, 1) + head_1d(2, -sp.Rational(1, 2)), yq)  # d f_q / d y
lead = sp.limit((fy / a_**2).subs(yq, dl / a_).subs(dl, 1), a_, sp.oo)
check("scores s and 2s, B_2 = -B_1/2: d f_q/dy / a^2 -> nonzero at key gap delta = 1 (no cancellation)",
      lead.is_nonzero is True or (sp.N(lead) != 0 and abs(complex(sp.N(lead))) > 1e-12))
lead0 = sp.limit((fy / a_**2).subs(yq, 0), a_, sp.oo)
check("... while at the exact tie (delta = 0) the a^2 terms cancel", sp.simplify(lead0) == 0)

# Step 8: sufficiency for A = 0, B reading only the score direction: p_k p_j (y_k - y_j) = p_k^2 e^{-(y_k-y_j)} (y_k-y_j)
# and max_{x >= 0} x e^{-x} = 1/e, so |dm/dt_k| <= 1 + (N - 1)/e for m = sum_j softmax(t)_j t_j (d = 1).
y3 = sp.symbols("y0:3", real=True)
p3 = soft(list(y3))
check("p_k p_j = p_k^2 e^{-(y_k - y_j)}", sp.simplify(p3[0] * p3[1] - p3[0]**2 * sp.exp(-(y3[0] - y3[1]))) == 0)
xx = sp.symbols("x", nonnegative=True)
g = xx * sp.exp(-xx)
check("x e^{-x} is maximal at x = 1 with value 1/e",
      sp.solve(sp.diff(g, xx), xx) == [1] and sp.diff(g, xx, 2).subs(xx, 1) < 0 and g.subs(xx, 1) == sp.exp(-1))
m = sum(p3[j] * y3[j] for j in range(3))
dm = [sp.diff(m, y3[k]) for k in range(3)]
check("dm/dy_k = p_k + p_k (y_k - m)", all(sp.simplify(dm[k] - (p3[k] + p3[k] * (y3[k] - m))) == 0 for k in range(3)))
import random as _r
_r.seed(0)
worst = 0.0
for _ in range(300):
    pt = {y3[i]: _r.uniform(-12, 12) * _r.choice([1, 0.1, 3]) for i in range(3)}
    worst = max(worst, max(abs(float(dk.subs(pt))) for dk in dm))
check(f"|dm/dy_k| <= 1 + (N-1)/e at 300 random points (worst {worst:.4f})", worst <= 1 + 2 / float(sp.E))

# Step 9: A != 0 with a query bias: move the query to y with y A u^T = -c.u; the query block grows like
# 2 a^2 w(y) A u^T u B / sqrt(d), w(y) the weight of each key (concrete rational weights, N = 3, d = C = 2).
A9 = sp.Matrix([[1, 2], [0, 1]]); B9 = sp.Matrix([[1, 0], [1, 3]]); c9 = sp.Matrix([[1, 1]])
u9 = sp.Matrix([[1, 0]])
yv = sp.Matrix([[sp.Symbol("y0", real=True), sp.Symbol("y1", real=True)]])
X9 = sp.Matrix.vstack(yv, a_ * u9, -a_ * u9)
f9 = head_row(0, A9, c9, B9, X9, 3)
J9 = sp.Matrix(C, C, lambda p, q: sp.diff(f9[0, q], yv[0, p]))
ystar = {yv[0, 1]: 0}
ystar[yv[0, 0]] = sp.solve((yv * A9 * u9.T + c9 * u9.T)[0, 0].subs(ystar), yv[0, 0])[0]  # logits of the keys balanced
self_logit = ((yv * A9 * yv.T)[0, 0] + (c9 * yv.T)[0, 0]).subs(ystar) / sp.sqrt(d)
w = 1 / (2 + sp.exp(self_logit))
pred = 2 * w * A9 * u9.T * u9 * B9 / sp.sqrt(d)
lim9 = (J9.subs(ystar) / a_**2).applyfunc(lambda e: sp.limit(e, a_, sp.oo))
check("A != 0, c != 0: query block / a^2 -> 2 w(y) A u^T u B / sqrt(d) (nonzero)",
      sp.simplify(lim9 - pred) == sp.zeros(C, C) and pred != sp.zeros(C, C))

# Step 10: A = 0, c != 0. Keys at +-a v with v orthogonal to c: d f_q / d x_key grows like a when v B != 0,
# and stays bounded when B reads only the c direction (B = c^T c B / |c|^2).
c10 = sp.Matrix([[1, 0]]); v10 = sp.Matrix([[0, 1]])
k1 = sp.Matrix([[sp.Symbol("z0", real=True), sp.Symbol("z1", real=True)]])
def f10(Bm):
    X10 = sp.Matrix.vstack(sp.zeros(1, 2), k1, -a_ * v10)
    return head_row(0, sp.zeros(2, 2), c10, Bm, X10, 3)
at = {k1[0, 0]: 0, k1[0, 1]: a_}
for Bm, grows in ((sp.Matrix([[1, 0], [2, 1]]), True), (sp.Matrix([[1, 2], [0, 0]]), False)):
    fk = f10(Bm)
    Jk = sp.Matrix(C, C, lambda p, q: sp.diff(fk[0, q], k1[0, p])).subs(at)
    lim10 = (Jk / a_).applyfunc(lambda e: sp.limit(e, a_, sp.oo))
    check(f"A = 0, c != 0, B = {Bm.tolist()}: d f_q/d x_key / a -> " + ("nonzero (linear growth)" if grows else "0"),
          (lim10 != sp.zeros(2, 2)) if grows else (lim10 == sp.zeros(2, 2)))

# Step 11: the rounding lemmas behind the margins of lipcheck.bounds.attention.
uu, kk = sp.symbols("u k", positive=True)
gam = lambda n_: n_ * uu / (1 - n_ * uu)
diff11 = sp.factor(sp.together((1 + gam(kk + 1)) - (1 + uu) * (1 + gam(kk))))
check("(1 + u)(1 + gamma_k) <= 1 + gamma_{k+1}: the difference is (k+1) u^2 / ((1 - k u)(1 - (k+1) u))",
      sp.simplify(diff11 - (kk + 1) * uu**2 / ((1 - kk * uu) * (1 - (kk + 1) * uu))) == 0)
xg = sp.symbols("x_g", positive=True)
check("1/(1 - x) - (1 + x) = x^2/(1 - x) >= 0 on [0, 1)", sp.simplify(1 / (1 - xg) - (1 + xg) - xg**2 / (1 - xg)) == 0)

# The verified norm of A_hat: lambda_max(G) < mu and ||G - A^T A||_2 <= e_G give ||A||_2^2 < mu + e_G (Weyl);
# exact rational instance: G = A^T A + E with a symmetric rational E, e_G = ||E||_F >= ||E||_2.
A11 = sp.Matrix([[sp.Rational(3, 2), -1, 2], [sp.Rational(1, 3), 4, 0], [1, sp.Rational(-5, 4), sp.Rational(1, 7)]])
E11 = sp.Matrix([[sp.Rational(1, 1000), sp.Rational(-1, 500), 0], [sp.Rational(-1, 500), 0, sp.Rational(1, 800)],
                 [0, sp.Rational(1, 800), sp.Rational(-1, 900)]])
G11 = A11.T * A11 + E11
lmax = lambda M_: max(sp.re(sp.N(e_, 40)) for e_ in M_.eigenvals(multiple=True))  # noqa: E731
mu11 = sp.Rational(int(lmax(G11) * 10 ** 6) + 1, 10 ** 6)  # a certified-looking mu just above lambda_max(G)
eG11 = sp.sqrt(sum(x_**2 for x_ in E11))
check("Weyl: lambda_max(G) < mu and ||G - A^T A|| <= e_G give ||A||^2 < mu + e_G (exact rational instance)",
      lmax(A11.T * A11) < sp.N(mu11 + eG11, 40))

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("all checks passed")
