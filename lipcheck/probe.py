"""Attention growth (SPEC S4): certified lower bounds on L(R) = sup_{||X||_F <= R} ||J_f(X)||_2.

The map probed is the whole multi-head attention layer `DenseAttention` as a map of one token grid,
X (N x C, N = H W) -> f(X) (N x C), with its output projection and all four biases:

    f(X) = sum_h softmax(Q^h K^h^T / sqrt(d)) V^h W_O^h + b_O,  Q^h = X W_Q^h + b_Q^h (K, V alike).

Inputs are measured in the Frobenius norm of X, the Jacobian in the spectral norm. The same probe
runs on a pre-norm block's mixer branch x -> Mixer(LN1 x) and on the Neural-ODE vector field
F(x) = Mixer(LN1 x) + MLP(LN2 x) (`BlockMap`).

Search. For each radius R, all restarts move together as one batched tensor computation
(torch.func.vmap over jvp and grad): each step takes one power-iteration step for the top right
singular vector v of J(X) and one projected ascent step on X along grad_X ||J(X) v|| (the gradient
of the top singular value, by the envelope theorem), onto the ball ||X||_F <= R. Steps that do not
improve are undone with a halved step, so a restart never ends below its start. Starts: the best
input of the previous radius (inside the larger ball) with its certified singular vector, the
structured witnesses below, then random inputs on the sphere. Since L is nondecreasing in R, a radius
whose own certified value falls below the previous one reports the previous input and value.

Certification. Every reported value is ||J(X) v|| / ||v|| re-evaluated in float64 at the returned
X (||X||_F <= R checked in float64) and an actual vector v: a Jacobian norm attained at an actual
input, hence a certified lower bound on L(R). v is the top right singular vector of the dense
Jacobian (jacrev + SVD) where N C is small, else the Rayleigh-Ritz vector of float64 subspace
iteration on J^T J.

Witness (Kim, Papamakarios and Mnih 2021). A query token whose logits are all equal (at 0 for a
bias-free layer) and two key tokens at +-(R / sqrt 2) u: the query's diagonal Jacobian block is
(1/N) sum_h B_h + (R^2 / (N sqrt d)) sum_h A_h u^T u B_h with A_h = W_Q^h W_K^h^T and
B_h = W_V^h W_O^h, so L(R) grows like R^2 (`witness_closed_form` states and proves it exactly).
The focused variant (`attention_witness(..., focus=tau)`) also offsets the keys so that the query
attends to them alone, which raises the R^2 coefficient N/2-fold, to about
max_u ||A_h u^T|| ||u B_h|| / (2 sqrt d).
"""
from __future__ import annotations

import copy
import dataclasses
import math

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, jacrev, jvp, vjp, vmap

from .bounds.attention import head_matrices
from .mixers.attention import DenseAttention

CERTIFY_METHODS = ("auto", "dense", "subspace")
DENSE_MAX = 1024
WITNESS_FOCUS = 15.0  # logit margin of the focused witness: weight e^-15 per token off the two keys  # dense jacrev + SVD up to this many input entries N C, subspace iteration above


def default_device() -> torch.device:
    """cuda when available, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ----------------------------------------------------------------------------------------------- maps

class BlockMap(nn.Module):
    """A pre-norm Block as a map of (B, H, W, C): branch "mixer" is x -> Mixer(LN1 x) (the residual
    branch; the block's update adds the identity, i.e. at most +1 on the constant), "vector_field" is
    F(x) = Mixer(LN1 x) + MLP(LN2 x), the Neural-ODE right-hand side."""

    BRANCHES = ("mixer", "vector_field")

    def __init__(self, block: nn.Module, branch: str = "mixer"):
        super().__init__()
        if branch not in self.BRANCHES:
            raise ValueError(f"unknown branch {branch!r}; choose one of {self.BRANCHES}")
        self.block, self.branch = block, branch

    def forward(self, x):
        if self.branch == "mixer":
            return self.block.mixer(self.block.norm1(x))
        return self.block.vector_field(x)


def _as_map(layer: nn.Module) -> nn.Module:
    """A private copy that batches under vmap: attention on the explicit-softmax "math" backend
    (SDPA's CPU backward has no vmap rule); a VectorField (which logs its state) becomes its block's field."""
    from .models.ode import VectorField
    if isinstance(layer, VectorField):
        layer = BlockMap(layer.block, "vector_field")
    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer must be an nn.Module mapping (1, H, W, C) -> (1, H, W, C), got {type(layer).__name__}")
    m = copy.deepcopy(layer)
    for sub in m.modules():
        if isinstance(sub, DenseAttention):
            sub.backend = "math"
    for name, p in m.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise ValueError(f"layer parameter {name!r} has non-finite entries (NaN or inf); probe a layer with "
                             f"finite weights")
    return m.eval()


def _functional(module: nn.Module, H: int, W: int, *, device, dtype):
    """f(X) on one grid X (N, C) -> (N, C), with the module's weights as constants in (device, dtype)."""
    module = module.to(device=device, dtype=dtype)
    state = {k: v.detach() for k, v in module.named_parameters()}
    state.update({k: v.detach() for k, v in module.named_buffers()})

    def f(X):
        return functional_call(module, state, (X.reshape(1, H, W, X.shape[-1]),)).reshape(X.shape)
    return f


# ------------------------------------------------------------------------------------------- witness

def witness_directions(layer: DenseAttention, *, dtype=torch.float64, device=None) -> dict:
    """Unit directions u (C,) for the keys, per head h: top right singular vector of A_h (maximises
    ||A_h u^T||), top left singular vector of B_h (maximises ||u B_h||), and the maximiser of
    ||A_h u^T|| ||u B_h|| (fixed point of u <- A^T A u / ||A u||^2 + B B^T u / ||u B||^2, started at the better
    of the two)."""
    m = head_matrices(layer, dtype=dtype, device=device)
    out = {}
    for h in range(m["A"].shape[0]):
        A, B = m["A"][h], m["B"][h]
        uA = torch.linalg.svd(A)[2][0]  # row of Vh: right singular vector
        uB = torch.linalg.svd(B)[0][:, 0]  # left singular vector
        score = lambda u: float(torch.linalg.vector_norm(A @ u) * torch.linalg.vector_norm(u @ B))
        u = uA if score(uA) >= score(uB) else uB
        for _ in range(100):  # stationarity of log||A u|| + log||u B|| on the sphere
            w = A.T @ (A @ u) / (A @ u).pow(2).sum() + B @ (u @ B) / (u @ B).pow(2).sum()
            u = w / w.norm()
        out[f"AB{h}"], out[f"A{h}"], out[f"B{h}"] = u, uA, uB
    return dict(sorted(out.items(), key=lambda kv: ("AB", "A", "B").index(kv[0].rstrip("0123456789"))))


def attention_witness(layer: DenseAttention, radius: float, grid: tuple[int, int], u: torch.Tensor, *,
                      focus: float | None = None, query: int = 0, keys: tuple[int, int] = (1, 2),
                      dtype=torch.float64, device=None) -> torch.Tensor:
    """A structured input X (H, W, C) with ||X||_F <= radius: a query token x_q and two keys m +- a u.

    x_q makes the query's logits towards the two keys equal in every head (q^h orthogonal to u W_K^h, a
    linear condition x_q A_h u^T = -c_h u^T; x_q = 0 when b_Q = 0 and focus is None), so the query's
    attention covariance holds a^2 u^T u times the weight on the keys.
    focus=None: m = 0, all other tokens 0; the query attends uniformly (weight 2/N on the keys), which is
    the configuration of `witness_closed_form`.
    focus=tau: x_q gets an extra component s zeta (zeta orthogonal to u and to every A_h u^T, so the balance
    holds) and the keys a common offset m orthogonal to u, sized so that the dominant head's logits to
    the keys exceed those to every other token by tau: the query then puts weight ~1/2 on each key and the
    covariance is ~a^2 u^T u, N/2 times the uniform one. s minimises the norm spent on x_q and m.
    a = sqrt((radius^2 - ||x_q||^2 - 2 ||m||^2) / 2); if the radius is too small for the focus, the uniform
    witness is returned."""
    H, W = _check_grid(grid)
    N = H * W
    if N < 3:
        raise ValueError(f"the witness needs at least 3 tokens (a query and two keys); grid={grid} has {N}")
    m = head_matrices(layer, dtype=dtype, device=device)
    A, Bh, c = m["A"], m["B"], m["c"]
    h, C = A.shape[0], A.shape[1]
    d = C // h
    u = u.to(dtype=dtype, device=A.device)
    u = u / u.norm()
    M = torch.einsum("hcd,d->hc", A, u)  # rows A_h u^T
    xq = torch.linalg.pinv(M) @ (-(c @ u))
    mk = torch.zeros(C, dtype=dtype, device=A.device)
    if focus is not None:
        hs = int(torch.argmax(M.norm(dim=1) * torch.einsum("c,hcd->hd", u, Bh).norm(dim=1)))  # dominant head
        # null space of the balance constraints and of u: directions the query may move in freely
        Qc = torch.linalg.qr(torch.cat([M, u[None]]).T).Q  # (C, h+1)
        Pn = torch.eye(C, dtype=dtype, device=A.device) - Qc @ Qc.T
        Pu = torch.eye(C, dtype=dtype, device=A.device) - torch.outer(u, u)
        zeta = torch.linalg.svd(Pn @ A[hs] @ Pu)[0][:, 0]  # moves q^hs the most within u's complement
        best = None
        for s in torch.logspace(-2, 3, 41).tolist():
            x0 = xq + s * zeta
            g = x0 @ A[hs] + c[hs]  # q^hs W_K^hs^T: the query's logit direction in input space
            gm = Pu @ g
            if float(gm.norm()) == 0.0:
                continue
            mhat = gm / gm.norm()
            gamma = (focus * math.sqrt(d) + max(0.0, float(g @ x0))) / float(g @ mhat)
            cost = float(x0 @ x0) + 2 * gamma ** 2
            if best is None or cost < best[0]:
                best = (cost, x0, gamma * mhat)
        if best is not None and best[0] < radius ** 2:
            xq, mk = best[1], best[2]
    if float(xq.norm()) > radius:  # the balance correction alone leaves the ball: shrink it, keys get nothing
        xq = xq * (radius / float(xq.norm()))
    a = math.sqrt(max(radius ** 2 - float(xq @ xq) - 2 * float(mk @ mk), 0.0) / 2)
    X = torch.zeros(N, C, dtype=dtype, device=A.device)
    X[query] = xq
    X[keys[0]], X[keys[1]] = mk + a * u, mk - a * u
    return X.reshape(H, W, C)


def witness_closed_form(layer: DenseAttention, radius: float, grid: tuple[int, int], u: torch.Tensor, *,
                        keys: tuple[int, int] = (1, 2), dtype=torch.float64, device=None) -> dict:
    """Exact Jacobian of a bias-free attention layer at the witness X_R (keys +-a u, a = R/sqrt 2, others 0).

    Notation: N tokens, head dim d, A_h = W_Q^h W_K^h^T, B_h = W_V^h W_O^h, B = sum_h B_h,
    kappa = R^2 / (N sqrt d), ||u|| = 1; Jacobians act on row vectors (dy_i = sum_j dx_j J_ij).

    Claim 1 (every u). For every token i other than the two keys ("zero tokens"),
        dy_i = (1/N) sum_j dx_j B + kappa dx_i sum_h A_h u^T u B_h,
    so the diagonal block is D = B / N + kappa sum_h A_h u^T u B_h and ||J(X_R)||_2 >= ||D||_2.
    Proof. x_i = 0 makes row i's logits s_ij = x_i A_h x_j^T / sqrt d all zero: p_ij = 1/N. Softmax
    gives (dP V)_i = sum_j p_ij ds_ij (v_j - vbar_i) with v_j - vbar_i = (x_j - xbar) W_V^h, xbar = 0 (the
    keys cancel), and ds_ij = (dx_i A_h x_j^T + x_i A_h dx_j^T)/sqrt d = dx_i A_h x_j^T / sqrt d. Hence
    (dP V)_i W_O = dx_i A_h [(1/N) sum_j x_j^T x_j] B_h / sqrt d = kappa dx_i A_h u^T u B_h, since
    sum_j x_j^T x_j = 2 a^2 u^T u = R^2 u^T u. The value path adds (1/N) sum_j dx_j B_h.

    Claim 2 (balanced u: u A_h u^T = 0 for every head). Then every row's logits are 0 (the keys' logits are
    +-a^2 u A_h u^T / sqrt d), all of P is 11^T / N, and with e = (e_k+ - e_k-)/sqrt 2,
        J(dX) = (1/N) 1 1^T dX B + kappa sum_h [ dX A_h u^T u B_h + e e^T dX A_h^T u^T u B_h ].
    Proof: as above, plus the key rows' second term: for x_i = +-a u,
    (1/N) sum_j (x_i A_h dx_j^T) x_j = +-(a^2/N)(dx_+ - dx_-) A_h^T u^T u = (R^2/N) e_i (e^T dX) A_h^T u^T u.
    For one head write p = A u^T, q = A^T u^T (columns), T(dX) = [dX p + e (e^T dX q)] (u B). Split
    dX = e w^T + Y with e^T Y = 0: ||T dX||^2 = ||u B||^2 [(w.(p+q))^2 + ||Y p||^2], so (N >= 3)
        ||kappa T||_2 = kappa ||u B|| max(||p + q||, ||p||),
    and ||J(X_R)||_2 lies within ||(1/N) 1 1^T (x) B||_2 = ||B||_2 of it (triangle inequality): the
    R^2 coefficient is exact, the O(1) remainder bounded.

    Returns X (H, W, C), the zero tokens' rows "rows" (list of (token, (N*C, C) matrix)), "D", "D_norm",
    "leading" = kappa ||sum_h A_h u^T u B_h||_2 (one head: kappa ||A u^T|| ||u B||), "balanced", and when
    balanced "jacobian" (N C, N C) and, for one head, "norm_R2" = kappa ||u B|| max(||p+q||, ||p||) and
    "remainder_bound" = ||B||_2. Matrices use J[(j, a), (i, b)] = d y_i[b] / d x_j[a] (rows index inputs).
    """
    H, W = _check_grid(grid)
    N = H * W
    m = head_matrices(layer, dtype=dtype, device=device)
    for name in ("bQ", "bK", "bV"):
        if float(m[name].abs().max()) != 0.0:
            raise ValueError("witness_closed_form covers bias-free q/k/v projections; zero layer.q_proj/k_proj/"
                             "v_proj biases first (the output bias does not enter the Jacobian)")
    A, Bh = m["A"], m["B"]
    h, C = A.shape[0], A.shape[1]
    d = C // h
    dev = A.device
    u = u.to(dtype=dtype, device=dev)
    u = u / u.norm()
    kappa = radius ** 2 / (N * math.sqrt(d))
    B = Bh.sum(0)
    Au = torch.einsum("hcd,d->hc", A, u)      # p_h = A_h u^T
    AtU = torch.einsum("hdc,d->hc", A, u)     # q_h = A_h^T u^T
    uB = torch.einsum("c,hcd->hd", u, Bh)     # u B_h
    R2 = torch.einsum("hc,hd->cd", Au, uB)    # sum_h A_h u^T u B_h
    D = B / N + kappa * R2
    X = torch.zeros(N, C, dtype=dtype, device=dev)
    a = radius / math.sqrt(2)
    X[keys[0]], X[keys[1]] = a * u, -a * u
    zero_tokens = [i for i in range(N) if i not in keys]
    rows = []
    for i in zero_tokens:
        Ji = (B / N).repeat(N, 1)             # (N*C, C): d y_i / d x_j for every j, stacked
        Ji[i * C:(i + 1) * C] += kappa * R2
        rows.append((i, Ji))
    out = dict(X=X.reshape(H, W, C), rows=rows, D=D, D_norm=float(torch.linalg.matrix_norm(D, 2)),
               leading=kappa * float(torch.linalg.matrix_norm(R2, 2)), kappa=kappa)
    balanced = bool((torch.einsum("c,hc->h", u, Au).abs() <= 1e-12 * (1 + A.abs().max())).all())
    out["balanced"] = balanced
    if balanced:
        e = torch.zeros(N, dtype=dtype, device=dev)
        e[keys[0]], e[keys[1]] = 1 / math.sqrt(2), -1 / math.sqrt(2)
        ones = torch.ones(N, N, dtype=dtype, device=dev) / N
        Qt = torch.einsum("hc,hd->cd", AtU, uB)  # sum_h A_h^T u^T u B_h
        J = torch.kron(ones, B) + kappa * (torch.kron(torch.eye(N, dtype=dtype, device=dev), R2)
                                           + torch.kron(torch.outer(e, e), Qt))
        out["jacobian"] = J
        if h == 1:
            p, q = Au[0], AtU[0]
            out["norm_R2"] = kappa * float(uB[0].norm()) * max(float((p + q).norm()), float(p.norm()))
            out["remainder_bound"] = float(torch.linalg.matrix_norm(B, 2))
    return out


# -------------------------------------------------------------------------------------- certification

def _jtj(f):
    def jtj(X, v):
        _, Jv = jvp(f, (X,), (v,))
        return vjp(f, X)[1](Jv)[0]
    return jtj


def _jv_norm(f):
    return lambda X, v: jvp(f, (X,), (v,))[1].norm()


def certify(f, X: torch.Tensor, v0: torch.Tensor | None = None, *, method: str = "auto", steps: int = 300,
            block: int = 6, generator: torch.Generator | None = None):
    """Certified ||J_f(X)||_2 lower bounds for a batch X (S, N, C) (float64 in, float64 out).

    Returns (value (S,), v (S, N, C) unit): value = ||J v|| for that actual v. "dense": v is the top
    right singular vector of jacrev's Jacobian (value equals its largest singular value to rounding);
    "subspace": Rayleigh-Ritz vector after `steps` of subspace iteration on J^T J with `block` vectors
    (started from v0 where given)."""
    if method not in CERTIFY_METHODS:
        raise ValueError(f"unknown certify method {method!r}; choose one of {CERTIFY_METHODS}")
    S, N, C = X.shape
    n = N * C
    if method == "auto":
        method = "dense" if n <= DENSE_MAX else "subspace"
    if method == "dense":
        vs = []
        for s in range(S):  # one dense Jacobian at a time keeps memory at n^2
            J = jacrev(f)(X[s]).reshape(n, n)  # [out, in]
            vs.append(torch.linalg.svd(J)[2][0].reshape(N, C))
        v = torch.stack(vs)
    else:
        k = min(block, n)
        V = torch.randn(S, k, N, C, dtype=torch.float64, generator=generator).to(X)  # CPU generator, any device
        if v0 is not None:
            V[:, 0] = v0
        jtj = vmap(vmap(_jtj(f), in_dims=(None, 0)), in_dims=(0, 0))
        Q = torch.linalg.qr(V.reshape(S, k, n).transpose(1, 2)).Q  # (S, n, k)
        for _ in range(steps):
            Wm = jtj(X, Q.transpose(1, 2).reshape(S, k, N, C)).reshape(S, k, n).transpose(1, 2)
            Q = torch.linalg.qr(Wm).Q
        jv = vmap(vmap(lambda X_, v_: jvp(f, (X_,), (v_,))[1], in_dims=(None, 0)), in_dims=(0, 0))
        JQ = jv(X, Q.transpose(1, 2).reshape(S, k, N, C)).reshape(S, k, n)  # rows J q_r
        Z = torch.linalg.svd(JQ.transpose(1, 2))[2][:, 0]  # (S, k): top right singular vector of J Q
        v = torch.einsum("snk,sk->sn", Q, Z).reshape(S, N, C)
    v = v / v.flatten(1).norm(dim=1).reshape(S, 1, 1)
    value = vmap(_jv_norm(f))(X, v)  # the certified number: ||J v|| at an actual (X, v), recomputed
    return value, v


# ------------------------------------------------------------------------------------------ the probe

@dataclasses.dataclass
class GrowthResult:
    """Per-radius certified lower bounds on L(R) and the fitted growth exponent.

    lower[r] = ||J(X[r]) v[r]|| in float64 with ||X[r]||_F <= radii[r]; search[r] is the best value the
    search saw (in its dtype); witness[r] the best certified value among the structured witnesses alone
    (nan if none). exponent is the least-squares slope of log lower on log R over R >= fit_min_radius, with
    a 95% t-interval exponent_ci."""
    radii: list
    lower: list
    search: list
    witness: list
    X: torch.Tensor
    v: torch.Tensor
    exponent: float
    exponent_ci: tuple
    fit_min_radius: float
    intercept: float
    grid: tuple
    restarts: int
    steps: int
    certify_method: str
    map: str

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("X"), d.pop("v")
        d["X_norms"] = self.X.flatten(1).norm(dim=1).tolist()
        return d


def fit_exponent(radii, values, min_radius: float) -> tuple[float, tuple[float, float], float]:
    """Least squares log L = k log R + b over R >= min_radius; returns (k, 95% CI of k, b)."""
    import numpy as np
    from scipy import stats
    R, L = np.asarray(radii, float), np.asarray(values, float)
    sel = R >= min_radius
    if sel.sum() < 2:
        raise ValueError(f"fitting an exponent needs at least 2 radii >= fit_min_radius={min_radius}; "
                         f"got {int(sel.sum())}")
    x, y = np.log(R[sel]), np.log(L[sel])
    k, b = np.polyfit(x, y, 1)
    n = len(x)
    if n < 3:
        return float(k), (float("nan"), float("nan")), float(b)
    resid = y - (k * x + b)
    se = math.sqrt(float(resid @ resid) / (n - 2) / float(((x - x.mean()) ** 2).sum()))
    t = float(stats.t.ppf(0.975, n - 2))
    return float(k), (float(k - t * se), float(k + t * se)), float(b)


def _check_grid(grid):
    try:
        H, W = (int(g) for g in grid)
    except (TypeError, ValueError):
        raise ValueError(f"grid must be a pair (H, W) of positive integers, got {grid!r}") from None
    if H <= 0 or W <= 0 or (H, W) != tuple(grid):
        raise ValueError(f"grid must be a pair (H, W) of positive integers, got {grid!r}")
    return H, W


def _check_radii(radii) -> list:
    try:
        radii = [float(r) for r in radii]
    except (TypeError, ValueError):
        raise ValueError(f"radii must be a sequence of positive numbers, got {radii!r}") from None
    if not radii:
        raise ValueError("radii is empty; pass at least one positive radius, e.g. [1, 2, 4]")
    bad = [r for r in radii if not (math.isfinite(r) and r > 0)]
    if bad:
        raise ValueError(f"radii must be positive and finite (L(R) is a sup over ||X||_F <= R); bad values: {bad}")
    if any(b <= a for a, b in zip(radii, radii[1:])):
        raise ValueError(f"radii must be strictly increasing, got {radii}; sort them")
    return radii


def _sphere(X, R):
    n = X.flatten(1).norm(dim=1).clamp_min(1e-300).reshape(-1, 1, 1)
    return X * (R / n)


def _ball(X, R):
    n = X.flatten(1).norm(dim=1).reshape(-1, 1, 1)
    return torch.where(n > R, X * (R / n.clamp_min(1e-300)), X)


def _unit(t):
    return t / t.flatten(1).norm(dim=1).clamp_min(1e-300).reshape(-1, 1, 1)


def ascend(f, X: torch.Tensor, R: float, *, steps: int, lr: float = 0.05, power_warmup: int = 10,
           generator: torch.Generator | None = None, v0: torch.Tensor | None = None):
    """Batched projected ascent of ||J_f(X)||_2 over ||X||_F <= R from the starts X (S, N, C).

    One vmapped call per step returns, for every restart, 0.5 ||J(X) v||^2 and its gradients in X and v:
    the v-gradient J^T J v is the power-iteration step for the top right singular vector, the X-gradient
    (envelope theorem) the ascent direction. A step that does not raise ||J v|| is undone and the step
    halved, one that does grows it 1.5x; all restarts share the tensors, none is looped over.
    Returns (best (S,), bestX (S, N, C), bestv (S, N, C)) with best[s] = ||J(bestX[s]) v|| for an actual v.
    """
    S = X.shape[0]
    value_grad = vmap(grad_and_value(lambda X_, v_: 0.5 * jvp(f, (X_,), (v_,))[1].pow(2).sum(), argnums=(0, 1)))
    jtj = vmap(_jtj(f))
    v = _unit(v0.to(X) if v0 is not None else torch.randn(X.shape, generator=generator, dtype=torch.float64).to(X))
    for _ in range(power_warmup):
        v = _unit(jtj(X, v))
    best = torch.full((S,), -math.inf, dtype=X.dtype, device=X.device)
    bestX, bestv, bestg = X.clone(), v.clone(), torch.zeros_like(X)
    step = torch.full((S, 1, 1), lr * R, dtype=X.dtype, device=X.device)
    for _ in range(steps + 1):
        (gX, gv), val = value_grad(X, v)
        sigma = (2 * val).clamp_min(0).sqrt()
        ok = (sigma > best) & torch.isfinite(sigma) & torch.isfinite(gX.flatten(1)).all(1)
        okb = ok.reshape(S, 1, 1)
        best = torch.where(ok, sigma, best)
        bestX = torch.where(okb, X, bestX)
        bestv = torch.where(okb, _unit(gv), bestv)
        bestg = torch.where(okb, _unit(gX), bestg)
        step = torch.where(okb, step * 1.5, step * 0.5)
        X = _ball(bestX + step * bestg, R)
        v = bestv
    return best, bestX, bestv


def benchmark_batched_vs_loop(layer: nn.Module, radius: float, grid: tuple[int, int] = (4, 4), *,
                              restarts: int = 64, steps: int = 10, power_warmup: int = 10, device=None,
                              dtype=torch.float64, seed: int = 0) -> dict:
    """Wall time of `ascend` on `restarts` random starts as one batch vs a Python loop over them (same
    starts and power-iteration vectors, same steps). Returns seconds for both, the ratio, and the best value
    of each run (the same computation, so they agree up to rounding)."""
    import time
    H, W = _check_grid(grid)
    device = torch.device(device) if device is not None else default_device()
    module = _as_map(layer)
    C = _infer_channels(module)
    f = _functional(module, H, W, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    X0 = _sphere(torch.randn(restarts, H * W, C, generator=g, dtype=torch.float64), radius).to(device, dtype)
    V0 = torch.randn(restarts, H * W, C, generator=g, dtype=torch.float64).to(device, dtype)
    ascend(f, X0[:2], radius, steps=1, power_warmup=1)  # warm-up: first-call overheads out of the timing
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync(); t0 = time.perf_counter()
    b_batch = ascend(f, X0, radius, steps=steps, power_warmup=power_warmup, v0=V0)[0]
    sync(); t_batch = time.perf_counter() - t0
    t0 = time.perf_counter()
    b_loop = torch.cat([ascend(f, X0[s:s + 1], radius, steps=steps, power_warmup=power_warmup, v0=V0[s:s + 1])[0]
                        for s in range(restarts)])
    sync(); t_loop = time.perf_counter() - t0
    return {"restarts": restarts, "steps": steps, "power_warmup": power_warmup, "radius": radius,
            "batched_s": t_batch, "loop_s": t_loop, "speedup": t_loop / t_batch,
            "best_batched": float(b_batch.max()), "best_loop": float(b_loop.max()),
            "dtype": str(dtype).replace("torch.", ""), "device": str(device)}


def attention_growth(layer: nn.Module, radii, grid: tuple[int, int] = (4, 4), *, restarts: int = 16,
                     steps: int = 60, lr: float = 0.05, power_warmup: int = 10, certify_method: str = "auto",
                     certify_steps: int = 300, certify_top: int = 2, fit_min_radius: float | None = None,
                     witnesses: bool = True, device=None, dtype=torch.float64, seed: int = 0,
                     progress: bool = False) -> GrowthResult:
    """Certified lower bounds on L(R) = sup_{||X||_F <= R} ||J_f(X)||_2 for each R in `radii`.

    layer: a DenseAttention (the whole layer, output projection and biases included), a `BlockMap`,
    a VectorField, or any module mapping (1, H, W, C) -> (1, H, W, C). restarts: starting points per
    radius, searched together in one batch (previous best, witnesses, then random). steps: projected
    ascent steps. lr: initial step as a fraction of R (adapted per restart). certify_top: how many of the
    best restarts are re-evaluated in float64 (certify_method "auto": dense jacrev + SVD when N C <= 1024,
    else subspace iteration with certify_steps). fit_min_radius: default the upper half of the radii.
    device: default cuda when available, else cpu. dtype: of the search (certification is float64).
    """
    radii = _check_radii(radii)
    H, W = _check_grid(grid)
    if not (isinstance(restarts, int) and restarts >= 1):
        raise ValueError(f"restarts must be an integer >= 1 (the number of starting points per radius), got {restarts!r}")
    if not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    if not (isinstance(certify_top, int) and certify_top >= 1):
        raise ValueError(f"certify_top must be an integer >= 1, got {certify_top!r}")
    if certify_method not in CERTIFY_METHODS:
        raise ValueError(f"unknown certify_method {certify_method!r}; choose one of {CERTIFY_METHODS}")
    device = torch.device(device) if device is not None else default_device()
    if fit_min_radius is None:
        fit_min_radius = radii[len(radii) // 2]
    module = _as_map(layer)
    map_name = type(layer).__name__ + (f"[{layer.branch}]" if isinstance(layer, BlockMap) else "")
    N = H * W
    if next(module.parameters(), None) is None:
        raise ValueError("layer has no parameters; nothing to probe")
    C = _infer_channels(module)
    f64 = _functional(copy.deepcopy(module), H, W, device=device, dtype=torch.float64)  # before any downcast
    f = _functional(module, H, W, device=device, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    dirs = []
    if witnesses and isinstance(layer, DenseAttention) and N >= 3:
        dirs = list(witness_directions(layer, device=device).values())
    is_ln_map = any(isinstance(m, nn.LayerNorm) for m in module.modules())

    lower, search, wit_vals, Xs, vs = [], [], [], [], []
    prev = prev_v = None
    it = radii
    if progress:
        from tqdm import tqdm
        it = tqdm(radii, desc="attention_growth", unit="radius")
    for R in it:
        starts, kinds = [], []
        if prev is not None:
            starts.append(prev.to(dtype)); kinds.append("previous")
        for focus in (WITNESS_FOCUS, None):
            for u in dirs:
                starts.append(attention_witness(layer, R, (H, W), u, focus=focus, device=device)
                              .reshape(N, C).to(dtype))
                kinds.append("witness")
        if is_ln_map:  # constant tokens: zero variance, where LayerNorm's Jacobian is largest
            starts.append(torch.full((N, C), R / math.sqrt(N * C), dtype=dtype, device=device))
            kinds.append("constant")
        starts, kinds = starts[:restarts], kinds[:restarts]
        n_rand = restarts - len(starts)
        X = torch.stack(starts) if starts else torch.empty(0, N, C, dtype=dtype, device=device)
        if n_rand:
            X = torch.cat([X, _sphere(rand(n_rand, N, C), R)])
            kinds += ["random"] * n_rand
        V0 = rand(X.shape[0], N, C)
        if prev is not None:  # the previous radius's certified singular vector: its value is known, keep it
            V0[0] = prev_v.to(dtype)
        best, bestX, bestv = ascend(f, X, R, steps=steps, lr=lr, power_warmup=power_warmup, v0=V0)
        # float64 re-evaluation of the most promising restarts
        top = torch.argsort(best, descending=True)[:certify_top]
        if prev is not None and 0 not in top.tolist():  # always re-certify the previous radius's input
            top = torch.cat([top, torch.zeros(1, dtype=top.dtype, device=top.device)])
        wit_idx = [i for i, k in enumerate(kinds) if k == "witness"]
        if wit_idx:  # also certify the best witness-started restart, to report what the witnesses reach
            wi = max(wit_idx, key=lambda i: float(best[i]))
            if wi not in top.tolist():
                top = torch.cat([top, torch.tensor([wi], device=top.device)])
        X64 = bestX[top].to(torch.float64)
        n64 = X64.flatten(1).norm(dim=1).reshape(-1, 1, 1)
        X64 = torch.where(n64 > R * (1 - 1e-13), X64 * (R * (1 - 1e-12) / n64), X64)  # strictly inside, in float64
        if not bool((X64.flatten(1).norm(dim=1) <= R).all()):
            raise RuntimeError(f"internal error: a certified input left the ball ||X||_F <= {R}")
        val64, v64 = certify(f64, X64, bestv[top].to(torch.float64), method=certify_method, steps=certify_steps,
                             generator=gen)
        j = int(torch.argmax(val64))
        Xj, vj, Lj = X64[j].detach().clone(), v64[j].detach().clone(), float(val64[j])
        if lower and lower[-1] > Lj:  # L is nondecreasing in R: the previous input, inside this ball, is better
            Xj, vj, Lj = Xs[-1].clone(), vs[-1].clone(), lower[-1]
        lower.append(Lj); search.append(float(best.max()))
        Xs.append(Xj); vs.append(vj)
        w = [float(val64[i]) for i, t in enumerate(top.tolist()) if kinds[t] == "witness"]
        wit_vals.append(max(w) if w else float("nan"))
        prev, prev_v = Xj, vj
    k, ci, b = fit_exponent(radii, lower, fit_min_radius) if sum(r >= fit_min_radius for r in radii) >= 2 \
        else (float("nan"), (float("nan"), float("nan")), float("nan"))
    return GrowthResult(radii=radii, lower=lower, search=search, witness=wit_vals,
                        X=torch.stack(Xs).reshape(len(radii), H, W, C).cpu(),
                        v=torch.stack(vs).reshape(len(radii), H, W, C).cpu(), exponent=k, exponent_ci=ci,
                        fit_min_radius=float(fit_min_radius), intercept=b, grid=(H, W), restarts=restarts,
                        steps=steps, certify_method=certify_method, map=map_name)


def _infer_channels(module: nn.Module) -> int:
    for m in module.modules():
        if isinstance(m, DenseAttention):
            return m.dim
        if isinstance(m, nn.LayerNorm):
            return m.normalized_shape[-1]
        if hasattr(m, "dim") and isinstance(m.dim, int):
            return m.dim
    raise ValueError("cannot infer the channel count C of layer; pass a DenseAttention, a BlockMap or a module "
                     "with a .dim attribute")


def exact_jacobian_norm(layer: nn.Module, X: torch.Tensor) -> float:
    """Reference: ||J_f(X)||_2 by dense jacrev + SVD in float64, X (H, W, C). For small grids only."""
    H, W, C = X.shape
    f = _functional(_as_map(layer), H, W, device=X.device, dtype=torch.float64)
    J = jacrev(f)(X.reshape(H * W, C).to(torch.float64)).reshape(H * W * C, H * W * C)
    return float(torch.linalg.matrix_norm(J, 2))
