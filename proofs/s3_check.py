"""Sympy checks of the algebra in proofs/S3.md. Exits non-zero on the first failed check."""
import sys

import sympy as sp

failures = []


def check(name, ok):
    print(("ok   " if ok else "FAIL ") + name)
    if not ok:
        failures.append(name)


x = sp.symbols("x", real=True)
# Step 1: chain rule for Jacobians (2-D)
u, v = sp.symbols("u v")
f = sp.Matrix([sp.sin(u) * v, u ** 2 + v])
g = sp.Matrix([u * v, u - v])
comp = f.subs({u: g[0], v: g[1]}, simultaneous=True)
Jc = comp.jacobian([u, v])
Jf = f.jacobian([u, v]).subs({u: g[0], v: g[1]}, simultaneous=True)
check("J(f o g) = J_f(g) J_g", sp.simplify(Jc - Jf * g.jacobian([u, v])) == sp.zeros(2, 2))
check("J(f + g) = J_f + J_g", sp.simplify((f + g).jacobian([u, v]) - f.jacobian([u, v]) - g.jacobian([u, v])) == sp.zeros(2, 2))

# Step 2: GELU
Phi = (1 + sp.erf(x / sp.sqrt(2))) / 2
phi = sp.exp(-x ** 2 / 2) / sp.sqrt(2 * sp.pi)
gelu = x * Phi
d1, d2 = sp.diff(gelu, x), sp.diff(gelu, x, 2)
check("GELU' = Phi + x phi", sp.simplify(d1 - (Phi + x * phi)) == 0)
check("GELU'' = phi (2 - x^2)", sp.simplify(d2 - phi * (2 - x ** 2)) == 0)
crit = sp.solve(sp.simplify(d2 / phi), x)
check("critical points +-sqrt(2)", set(crit) == {sp.sqrt(2), -sp.sqrt(2)})
top = sp.N(d1.subs(x, sp.sqrt(2)), 30)
check("GELU'(sqrt 2) = 1.12890...", abs(top - sp.Float("1.128904145185154", 30)) < 1e-14)
check("GELU'(-sqrt 2) = 1 - GELU'(sqrt 2)", sp.simplify(d1.subs(x, -sp.sqrt(2)) + d1.subs(x, sp.sqrt(2)) - 1) == 0)
check("GELU' -> 1 at +inf, 0 at -inf", sp.limit(d1, x, sp.oo) == 1 and sp.limit(d1, x, -sp.oo) == 0)
from lipcheck import symbolic  # the numeric code's constant is this one
check("lipcheck.symbolic.gelu_derivative_sup agrees", abs(symbolic.gelu_derivative_sup("exact") - float(top)) < 1e-14)

# Step 3: LayerNorm Jacobian for C = 3
C = 3
xs = sp.symbols("x0:3", real=True)
eps = sp.symbols("epsilon", positive=True)
X = sp.Matrix(xs)
mean = sum(xs) / C
var = sum((xi - mean) ** 2 for xi in xs) / C
z = (X - sp.ones(C, 1) * mean) / sp.sqrt(var + eps)
J = z.jacobian(xs)
one = sp.ones(C, 1)
Mid = sp.eye(C) - one * one.T / C - z * z.T / C
check("J_LN = (I - 11^T/C - z z^T/C) / sqrt(var + eps)", sp.simplify(J - Mid / sp.sqrt(var + eps)) == sp.zeros(C, C))
vals = {xs[0]: sp.Rational(1, 3), xs[1]: -2, xs[2]: sp.Rational(5, 2), eps: sp.Rational(1, 10)}
Mv = Mid.subs(vals)
check("middle matrix kills 1", sp.simplify(Mv * one) == sp.zeros(C, 1))
zv = z.subs(vals)
vv = var.subs(vals)
check("eigenvalue eps/(var + eps) on z", sp.simplify(Mv * zv - (vals[eps] / (vv + vals[eps])) * zv) == sp.zeros(C, 1))
ev = [sp.nsimplify(sp.N(e, 30)) for e in Mv.eigenvals(multiple=True)]
check("eigenvalues of the middle matrix are in [0, 1]", all(-1e-25 <= float(e) <= 1 + 1e-25 for e in ev))
vsym, g = sp.symbols("v gamma", positive=True)
bound = g / sp.sqrt(vsym + eps)
check("LN bound decreases in the variance", sp.simplify(sp.diff(bound, vsym)) == -g / (2 * (vsym + eps) ** sp.Rational(3, 2)))
check("lipcheck.symbolic.layernorm_lipschitz = max|gamma|/sqrt(v + eps)",
      abs(symbolic.layernorm_lipschitz(2.0, 1e-6, 0.25) - 2.0 / (0.25 + 1e-6) ** 0.5) < 1e-12)

sys.exit(1 if failures else 0)
