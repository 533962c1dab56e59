"""Closed forms with sympy: Z and the 1-D symbol as Jacobi theta functions, sup|GELU'|, LayerNorm's Jacobian.

Each constant the numeric bounds use is computed here from its derivation (a critical point, an
eigen-decomposition), not typed in; tests check them against numerics.

- Poisson summation: Z = sum_j exp(-(j - mu)^2 / (2 s^2)) = sqrt(2 pi) s theta_3(pi mu, q), q = exp(-2 pi^2 s^2),
  theta_3(z, q) = 1 + 2 sum_n q^(n^2) cos(2 n z); the symbol numerator
  sum_k exp(-(k - mu)^2/(2 s^2)) e^{-i k w} = sqrt(2 pi) s sum_n exp(-s^2 (w + 2 pi n)^2 / 2) e^{-i (w + 2 pi n) mu}.
- GELU(x) = x Phi(x): GELU'' = phi(x) (2 - x^2) vanishes at x = +-sqrt(2); sup|GELU'| = Phi(sqrt 2) + sqrt(2) phi(sqrt 2).
- LayerNorm y = gamma * (x - mean) / sqrt(var + eps) + beta: J = diag(gamma) (I - 11^T/C - z z^T/C) / sqrt(var + eps)
  with z the normalised token; the middle factor has eigenvalues 1, 0 and eps / (var + eps), so
  ||J|| <= max|gamma| / sqrt(var + eps) <= max|gamma| / sqrt(eps).
"""
from __future__ import annotations

import functools
import math

import sympy as sp

x, mu, s, w, q = sp.symbols("x mu sigma omega q", real=True)
n, j, k = sp.symbols("n j k", integer=True)


# ---------------------------------------------------------------- Z and the symbol (Poisson / theta)

def normaliser_lattice(terms: int = 30):
    """Z(mu, sigma) as the truncated lattice sum (sympy expression in mu, sigma)."""
    return sp.Sum(sp.exp(-(j - mu) ** 2 / (2 * s ** 2)), (j, -terms, terms))


def normaliser_theta(terms: int = 30):
    """Z(mu, sigma) = sqrt(2 pi) sigma theta_3(pi mu, exp(-2 pi^2 sigma^2)), theta_3(z, q) = 1 + 2 sum q^{n^2} cos 2nz."""
    qq = sp.exp(-2 * sp.pi ** 2 * s ** 2)
    theta3 = 1 + 2 * sp.Sum(qq ** (n ** 2) * sp.cos(2 * n * sp.pi * mu), (n, 1, terms))
    return sp.sqrt(2 * sp.pi) * s * theta3


def symbol_theta(terms: int = 30):
    """ghat(omega) via Poisson summation: sqrt(2 pi) sigma sum_n exp(-sigma^2 nu^2/2) e^{-i nu mu} / Z, nu = omega + 2 pi n."""
    nu = w + 2 * sp.pi * n
    num = sp.sqrt(2 * sp.pi) * s * sp.Sum(sp.exp(-s ** 2 * nu ** 2 / 2) * sp.exp(-sp.I * nu * mu), (n, -terms, terms))
    return num / normaliser_theta(terms)


def symbol_lattice(terms: int = 30):
    """ghat(omega) = sum_k g(k) e^{-i k omega} as the truncated lattice sum."""
    num = sp.Sum(sp.exp(-(k - mu) ** 2 / (2 * s ** 2)) * sp.exp(-sp.I * k * w), (k, -terms, terms))
    return num / normaliser_lattice(terms)


def evaluate(expr, prec: int = 30, **values) -> complex:
    """Numerically evaluate a sympy expression at mu/sigma/omega values (mpmath precision `prec` digits)."""
    subs = {{"mu": mu, "sigma": s, "omega": w}[name]: sp.Float(v, prec) for name, v in values.items()}
    return complex(sp.N(expr.subs(subs).doit(), prec))


# ---------------------------------------------------------------- GELU

def gelu_exact():
    return x * (1 + sp.erf(x / sp.sqrt(2))) / 2


def gelu_tanh():
    return x * (1 + sp.tanh(sp.sqrt(2 / sp.pi) * (x + sp.Rational(44715, 1000000) * x ** 3))) / 2


@functools.lru_cache(maxsize=None)
def gelu_derivative_sup(variant: str = "exact") -> float:
    """sup_x |GELU'(x)| from the critical points of GELU' (GELU'' = 0) and the limits 0 and 1 at -+infinity."""
    if variant not in ("exact", "tanh"):
        raise ValueError(f"variant must be 'exact' or 'tanh', got {variant!r}")
    f = gelu_exact() if variant == "exact" else gelu_tanh()
    d1, d2 = sp.diff(f, x), sp.diff(f, x, 2)
    if variant == "exact":
        crit = sp.solve(sp.simplify(d2 * sp.sqrt(2 * sp.pi) * sp.exp(x ** 2 / 2)), x)  # phi(x)(2 - x^2) = 0
    else:
        crit = set()
        for x0 in [i / 4 for i in range(-16, 17)]:
            try:
                crit.add(round(float(sp.nsolve(d2, x, x0)), 12))
            except (ValueError, ZeroDivisionError):
                pass
        crit = [sp.Float(c) for c in crit]
    values = [abs(float(sp.N(d1.subs(x, c), 30))) for c in crit] + [0.0, 1.0]
    return max(values)


def gelu_critical_point(variant: str = "exact") -> float:
    """The x > 0 where GELU' attains its sup (sqrt(2) for the exact GELU)."""
    f = gelu_exact() if variant == "exact" else gelu_tanh()
    d2 = sp.diff(f, x, 2)
    return float(sp.nsolve(d2, x, 1.5))


# ---------------------------------------------------------------- LayerNorm

@functools.lru_cache(maxsize=None)
def _layernorm_middle_eigenvalues():
    """Eigenvalues of I - 11^T/C - z z^T/C restricted to the three invariant directions (1, z, the rest).

    With z perpendicular to 1 and ||z||^2 = C var / (var + eps), the matrix acts as 0 on 1, as
    1 - ||z||^2 / C = eps / (var + eps) on z and as 1 on their complement; returned as sympy expressions.
    """
    C, var, eps = sp.symbols("C var eps", positive=True)
    znorm2 = C * var / (var + eps)
    return (sp.Integer(0), sp.simplify(1 - znorm2 / C), sp.Integer(1)), (C, var, eps)


def layernorm_jacobian_bound_expr():
    """max|gamma| max(eigenvalues) / sqrt(var + eps) as a sympy expression in gamma_max, var, eps."""
    (e0, ez, e1), (C, var, eps) = _layernorm_middle_eigenvalues()
    g = sp.symbols("gamma_max", positive=True)
    return g * sp.Max(e0, ez, e1) / sp.sqrt(var + eps), (g, var, eps)


def layernorm_lipschitz(gamma_max: float, eps: float, min_variance: float = 0.0) -> float:
    """Bound on ||J_LN|| at tokens of variance >= min_variance (0: the global Lipschitz constant)."""
    if not (math.isfinite(gamma_max) and math.isfinite(eps) and math.isfinite(min_variance)):
        raise ValueError("gamma_max, eps and min_variance must be finite")
    if eps <= 0 or min_variance < 0:
        raise ValueError(f"need eps > 0 and min_variance >= 0, got eps={eps}, min_variance={min_variance}")
    expr, (g, var, e) = layernorm_jacobian_bound_expr()
    # the bound decreases in var, so its sup over var >= v is at var = v
    return float(expr.subs({g: abs(gamma_max), var: min_variance, e: eps}))
