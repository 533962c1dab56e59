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

sys.exit(1 if failures else 0)
