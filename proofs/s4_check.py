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

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("all checks passed")
