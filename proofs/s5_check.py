"""Sympy checks of the algebra in proofs/S5.md. Exits non-zero on the first failed check."""
import sys

import sympy as sp

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

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("all checks passed")
