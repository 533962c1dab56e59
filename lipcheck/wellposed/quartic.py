"""The computed solution y as a piecewise quartic, and proven sups of its derivatives (proofs/S5.md, Lemma 6).

On each accepted solver step [a, b], y(t) = sum_k c_k ((t - a)/h)^k, h = b - a: the quartic through the solver's
dense output at a + h (0, 1/4, 1/2, 3/4, 1). The coefficients are floats, so y is known exactly.
"""
from __future__ import annotations

import math

import torch

from ..bounds import lognorm as ln
from .options import EnclosureError
from .solve import CountingField, sample_norm

NODES = (0.0, 0.25, 0.5, 0.75, 1.0)


def _poly(c: torch.Tensor, s: torch.Tensor, h: float, d: int) -> torch.Tensor:
    """d-th derivative in t of sum_k c_k ((t - a)/h)^k at sigma = s; c (5, ...), s (m,) -> (m, ...).

    One product V c with V[j, k] = k!/(k-d)! s_j^(k-d): each term is rounded as often as in the term-by-term sum
    (the power, the factor, the coefficient), the sum of at most 5 terms in any order, then the division by h^d
    (Lemma 4's gamma_10 sum |c_k|); a single pass over the m x n result instead of one per term (ti, m = 512: 36 ms
    instead of 540)."""
    V = torch.zeros(s.shape[0], 5, dtype=c.dtype, device=c.device)
    for k in range(d, 5):
        V[:, k] = (math.factorial(k) // math.factorial(k - d)) * s ** (k - d)
    out = (V @ c.reshape(5, -1)).reshape(s.shape[0], *c.shape[1:])
    return out.div_(h ** d) if d else out


def _eval(field, y: torch.Tensor, tokens: int = 16384):
    """F(y) in chunks of about `tokens` tokens (memory)."""
    per = max(1, tokens // max(1, y[0, ..., 0].numel()))
    with torch.no_grad():
        return torch.cat([field(y[i:i + per]) for i in range(0, y.shape[0], per)])


def _sampled_defect(field, steps, coefs) -> float:
    """max ||y' - F(y)|| at the midpoints of y's quarter steps (all samples): a scale for tuning, not a bound."""
    return float(_sampled_defects(field, steps, coefs).max())


def _sampled_defects(field, steps, coefs) -> torch.Tensor:
    """(B,) per sample: max ||y' - F(y)|| at the midpoints of y's quarter steps (tuning, not a bound)."""
    return _step_defects(field, steps, coefs).amax(0)


def _step_defects(field, steps, coefs) -> torch.Tensor:
    """(K, B) per step and sample: max ||y' - F(y)|| at the midpoints of the step's quarters (tuning, not a bound)."""
    c0 = coefs[0]
    s = torch.tensor([0.125, 0.375, 0.625, 0.875], dtype=c0.dtype, device=c0.device)
    y = torch.stack([_poly(c, s, b - a, 0) for (a, b), c in zip(steps, coefs)])  # (K, 4, B, H, W, C)
    d1 = torch.stack([_poly(c, s, b - a, 1) for (a, b), c in zip(steps, coefs)])
    Fy = _eval(field, y.reshape(-1, *y.shape[3:])).reshape(y.shape)
    return sample_norm(d1 - Fy).amax(1)


def _coef_sup(cn: list, h: float, d: int):
    """sup over the step of ||y^(d)|| <= sum_k k!/(k-d)! ||c_k|| / h^d (cn: norms of c_k)."""
    return sum(math.factorial(k) // math.factorial(k - d) * cn[k] for k in range(d, 5)) / h ** d


def _bern_sup(c: torch.Tensor, h: float, d: int) -> torch.Tensor:
    """sup over the step of ||y^(d)|| per sample (B,), no larger than `_coef_sup`: y^(d) = sum_k a_k sigma^k with
    a_k = (k+d)!/k! c_{k+d} / h^d has Bernstein coefficients b_j = sum_{k<=j} C(j,k)/C(n,k) a_k on [0, 1] and
    ||y^(d)|| <= max_j ||b_j|| (convexity); float rounding of the weights and sums <= gamma_16 sum_k ||a_k||."""
    n = 4 - d
    a = [math.factorial(k + d) // math.factorial(k) * c[k + d] / h ** d for k in range(n + 1)]
    an = [sample_norm(x) for x in a]
    best = torch.stack([sample_norm(sum(math.comb(j, k) / math.comb(n, k) * a[k] for k in range(j + 1)))
                        for j in range(n + 1)]).amax(0)
    g = ln.gamma(16, ln.unit_roundoff(c.dtype))
    return torch.minimum(best + g * sum(an), _coef_sup([sample_norm(x) for x in c], h, d)) \
        * (1 + g)


def _token_speed(c: torch.Tensor, h: float) -> torch.Tensor:
    """Per token sup over the step of ||y_i'|| (B, N) (`_token_sup`, d = 1)."""
    return _token_sup(c, h, 1)


def _token_sup(c: torch.Tensor, h: float, d: int) -> torch.Tensor:
    """Per token sup over the step of ||y_i^(d)|| (B, N) from the Bernstein coefficients of the polynomial y^(d)
    (Lemma 6), rounded up by gamma_{16 + C} times the coefficient sums."""
    n = 4 - d
    a = [math.factorial(k + d) // math.factorial(k) * c[k + d] / h ** d for k in range(n + 1)]
    b = torch.stack([sum(math.comb(j, k) / math.comb(n, k) * a[k] for k in range(j + 1)) for j in range(n + 1)])
    g = ln.gamma(16 + c.shape[-1], ln.unit_roundoff(c.dtype))
    tok = lambda x: x.norm(dim=-1).flatten(1)  # noqa: E731  (B, H, W, C) -> (B, N)
    return (b.norm(dim=-1).flatten(2).amax(0) + g * sum(tok(x) for x in a)) * (1 + g)


class _StepField(CountingField):
    """The field the solver integrates, with its steps counted and a non-finite state refused."""

    def __init__(self, field):
        torch.nn.Module.__init__(self)
        self.field = field
        self.reset()
        self.last_t, self.last_norm = 0.0, 0.0

    def forward(self, t, x):
        self.nfe += 1
        self.last_t = float(t)
        self.last_norm = float(x.detach().norm())
        if not math.isfinite(self.last_norm):
            from ..models.ode import IntegrationError
            raise IntegrationError("non-finite state", t=self.last_t, nfe=self.nfe, state_norm=self.last_norm)
        return self.field(x)


def piecewise_quartic(field, x0: torch.Tensor, t1: float, *, method: str = "dopri5", tol: float = 1e-3,
                      grid_steps: int | None = None, step_times=None):
    """The computed solution y of x' = field(x) as a piecewise quartic: (steps [(a, b)], coefficients (5, B, H, W, C)
    per step, solver counts). On [a, b], y(t) = sum_k c_k ((t - a)/h)^k, h = b - a, is the quartic through the
    solver's dense output at a + h (0, 1/4, 1/2, 3/4, 1); the coefficients are floats, so y is known exactly.
    `grid_steps`: the solver must also step to every multiple of t1 / grid_steps (steps <= t1 / grid_steps: the
    interpolant's defect falls like h^4, the solver's own error control does not see it); `step_times`: the same
    with any increasing times in (0, t1] (finer where the defect is larger)."""
    from ..models.ode import integrate
    B, H, W, C = x0.shape
    fk = dict(dtype=x0.dtype, device=x0.device)
    u = ln.unit_roundoff(x0.dtype)
    cf = _StepField(field)
    with torch.no_grad():
        tt = torch.tensor([0.0, t1], **fk)
        step_t = tt[-1:] if not grid_steps else torch.linspace(0.0, t1, grid_steps + 1, **fk)[1:]
        if step_times is not None:
            step_t = torch.unique(torch.cat([step_t, torch.as_tensor(step_times, **fk).reshape(-1)]))
        integrate(cf, x0, tt, method=method, rtol=tol, atol=tol, options={"step_t": step_t})
        steps = [(a, min(a + h, t1)) for a, h in cf.steps if a < t1]
        if not steps or abs(steps[-1][1] - t1) > 8 * u * t1:
            raise EnclosureError(f"the solver's steps do not end on t1 = {t1} (last {steps[-1] if steps else None})")
        nodes = torch.tensor(NODES, **fk)
        grid = torch.unique(torch.cat([a + (b - a) * nodes for a, b in steps]))
        cf2 = _StepField(field)
        ys = integrate(cf2, x0, grid, method=method, rtol=tol, atol=tol, options={"step_t": step_t})
        if cf2.steps != cf.steps:
            raise EnclosureError("the solver took different steps when asked for dense output; cannot enclose")
    V = torch.stack([nodes ** k for k in range(5)], dim=1)  # (5, 5): samples = V @ coefficients
    coefs = []
    for a, b in steps:
        idx = torch.searchsorted(grid, a + (b - a) * nodes)
        idx = idx.clamp_max(len(grid) - 1)
        Y = ys[idx].reshape(5, -1)
        coefs.append(torch.linalg.solve(V, Y).reshape(5, B, H, W, C))
    return steps, coefs, dict(nfe_forward=cf.nfe, nfe_dense_output=cf2.nfe, accepted=cf.accepted,
                              rejected=cf.rejected, steps=len(steps))


def _bernstein_matrix() -> list:
    """M (5 x 5, exact rationals) with b = M v: the Bernstein coefficients on [0, 1] of the quartic whose values at
    s = 0, 1/4, 1/2, 3/4, 1 are v. sup_[0,1] ||p|| <= max_j ||b_j|| (convex combination, proofs/S5.md, Lemma 6)."""
    from fractions import Fraction as Fr
    n = 5
    A = [[Fr(i, 4) ** k for k in range(n)] + [Fr(int(i == r)) for r in range(n)] for i in range(n)]
    for c in range(n):  # Gauss-Jordan in exact arithmetic: A = [V | I] -> [I | V^-1]
        piv = next(r for r in range(c, n) if A[r][c] != 0)
        A[c], A[piv] = A[piv], A[c]
        A[c] = [x / A[c][c] for x in A[c]]
        for r in range(n):
            if r != c and A[r][c] != 0:
                A[r] = [x - A[r][c] * y for x, y in zip(A[r], A[c])]
    Vinv = [row[n:] for row in A]  # power coefficients a = Vinv v
    binom = math.comb
    return [[sum(Fr(binom(j, k), binom(4, k)) * Vinv[k][i] for k in range(j + 1)) for i in range(n)]
            for j in range(n)]


_M = _bernstein_matrix()
