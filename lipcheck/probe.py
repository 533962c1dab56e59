"""Attention growth (SPEC S4): certified lower bounds on L(R) = sup_{||X||_F <= R} ||J_f(X)||_2.

The map probed is any nn.Module f mapping token grids (B, H, W, C) -> (B, H, W, C) that treats the B
grids independently (eval mode: no batch statistics), as a map of one grid X (N x C, N = H W). For
lipcheck's `DenseAttention` that is the whole multi-head layer with its output projection and biases,

    f(X) = sum_h softmax(Q^h K^h^T / sqrt(d)) V^h W_O^h + b_O,  Q^h = X W_Q^h + b_Q^h (K, V alike);

the same probe runs on a pre-norm block's mixer branch x -> Mixer(LN1 x) and on the Neural-ODE vector
field F(x) = Mixer(LN1 x) + MLP(LN2 x) (`BlockMap`). Inputs are measured in the Frobenius norm of X,
the Jacobian in the spectral norm.

Tangent maps. Everything the probe computes is built from one function, (X, V) -> (f(X), J(X) V) on a
batch (S, N, C). For DenseAttention and for BlockMap / VectorField over a Block whose mixer is a
DenseAttention it is written out with batched matmuls (`attention_tangent`, `layernorm_tangent`,
`mlp_tangent`; the tests check them against autograd). For any other module it is torch.func.jvp of
the batched forward: the grids are independent, so J of the batch is block diagonal and one jvp of
the batch gives every grid's own J V, with no vmap. Gradients come from reverse mode through the
tangent map: grad_V 0.5 ||J V||^2 = J^T J V, grad_X 0.5 ||J V||^2 (the envelope-theorem ascent
direction of the top singular value).

A foreign attention block on (B, N, C) tokens (timm's `Attention`, say) is probed through a wrapper:

    class OnGrid(nn.Module):
        def __init__(self, attn):
            super().__init__()
            self.attn = attn
        def forward(self, x):                      # (B, H, W, C) -> (B, H, W, C)
            B, H, W, C = x.shape
            return self.attn(x.reshape(B, H * W, C)).reshape(B, H, W, C)

    attention_growth(OnGrid(timm_block.attn).double(), radii, grid=(14, 14), dim=C)

(`dim` is needed when the module has no `.dim`, LayerNorm or DenseAttention to read C from; a fused
SDPA kernel without forward-mode AD needs its explicit-softmax path, e.g. timm's `fused_attn=False`.)

Search. All radii and all restarts move together as one batch (S = radii x restarts): each step takes
one power-iteration step for the top right singular vector v of J(X) and one projected ascent step on
X along grad_X ||J(X) v||, onto each sample's own ball ||X||_F <= R. Steps that do not improve are undone
with a halved step, so a restart never ends below its start. Starts per radius: structured witnesses
(below), constant tokens for maps with a LayerNorm, then random inputs on the sphere drawn from a
generator seeded by (seed, R), so a radius draws the same starts alone or among others. Then
`refine_rounds` rounds, again one batch over all radii, continue each radius's best `refine_top`
restarts and start one more from the next smaller radius's best input (it lies inside the larger
ball): a warm-started sweep over the radii, pipelined one radius per round. Every sample keeps its own
step size and the batch only stacks independent computations, so `batch_radii=False` (one radius at a
time) gives the same numbers.

Certification. Every reported value is ||J(X) v|| / ||v|| re-evaluated in float64 at the returned X
(||X||_F <= R checked in float64) and an actual vector v: a Jacobian norm attained at an actual input,
hence a certified lower bound on L(R) whatever the search or the eigensolver did. v is the top Ritz
vector of Lanczos on J^T J (full reorthogonalisation, float64), started from the search's own vector
and stopped once the relative residual ||J^T J y - theta y|| / theta of the top Ritz pair is <= the
stated tolerance (`certify_tol`, or after `certify_steps`); the residual reached is reported. The
float64 evaluation of ||J v|| is not enclosed in intervals: the number may exceed the exact ||J(X) v||
by its rounding error, of order 1e-16 times the depth of the computation (relative). Since the balls
are nested, L is nondecreasing in R: `lower` is the running maximum of the per-radius values
`attained` (a smaller radius's input lies in every larger ball).

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
import hashlib
import itertools
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, jacrev, jvp

from .bounds.attention import head_matrices
from .mixers.attention import DenseAttention

CERTIFY_METHODS = ("auto", "lanczos", "dense", "subspace")  # "subspace": the former name, now Lanczos
WITNESS_FOCUS = 15.0  # logit margin of the focused witness: weight e^-15 per token off the two keys


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
    """A private float-checked copy in eval mode: attention on the explicit-softmax "math" backend
    (SDPA has no forward-mode AD rule on every device); a VectorField (which logs its state) becomes
    its block's field."""
    from .models.ode import VectorField
    if isinstance(layer, VectorField):
        layer = BlockMap(layer.block, "vector_field")
    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer must be an nn.Module mapping (B, H, W, C) -> (B, H, W, C), got {type(layer).__name__}")
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


# ------------------------------------------------------------------------------------ tangent maps

def _linear(lin: nn.Linear, device, dtype):
    """(W^T, b) of an nn.Linear as constants: y = x W^T + b."""
    b = lin.bias.detach().to(device, dtype) if lin.bias is not None else None
    return lin.weight.detach().to(device, dtype).T.contiguous(), b


def attention_tangent(p: dict, X: torch.Tensor, V: torch.Tensor, need_y: bool = True):
    """(f(X), J(X) V) of DenseAttention for X, V (S, N, C) with batched matmuls (f(X) is None when not
    `need_y`: the probe's objective reads J V alone, which saves the primal output projection).

    With per-head Q = X W_Q + b_Q (K, V alike), S = Q K^T / sqrt d, P = softmax(S) row-wise:
    dQ = V W_Q, dS = (dQ K^T + Q dK^T) / sqrt d, dP = P o (dS - rowsum(P o dS)) (softmax's Jacobian
    diag(p) - p^T p per row), d(P Vv) = dP Vv + P dVv, dY = d(P Vv) W_O."""
    S, N, C = X.shape
    h = p["heads"]
    d = C // h
    heads = lambda t: t.reshape(S, N, h, d).transpose(1, 2)  # (S, h, N, d)
    # separate products per projection, primal and tangent: splitting one fused product costs more in
    # the backward pass (zero-filled slice gradients or a stack) than the extra calls
    q, k, v = (heads(X @ p[f"W{n}"] + p[f"b{n}"]) for n in "qkv")
    dq, dk, dv = (heads(V @ p[f"W{n}"]) for n in "qkv")
    scale = 1.0 / math.sqrt(d)
    P = torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1)
    dS = (dq @ k.transpose(-2, -1) + q @ dk.transpose(-2, -1)) * scale
    PdS = P * dS
    dP = PdS - P * PdS.sum(-1, keepdim=True)
    merge = lambda t: t.transpose(1, 2).reshape(S, N, C)
    y = merge(P @ v) @ p["Wo"] + p["bo"] if need_y else None
    dy = merge(dP @ v + P @ dv) @ p["Wo"]
    return y, dy


def layernorm_tangent(p: dict, X: torch.Tensor, V: torch.Tensor):
    """(LN(X), J V) per token: xhat = (x - mean) r, r = (var + eps)^-1/2 (biased variance),
    d xhat = r (dxc - xhat mean(xhat dxc)), dxc = dx - mean(dx); LN = gamma xhat + beta."""
    mu = X.mean(-1, keepdim=True)
    xc = X - mu
    r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + p["eps"])
    xhat = xc * r
    dxc = V - V.mean(-1, keepdim=True)
    dxhat = r * (dxc - xhat * (xhat * dxc).mean(-1, keepdim=True))
    g, b = p["gamma"], p["beta"]
    y = xhat if g is None else xhat * g
    return (y if b is None else y + b), (dxhat if g is None else dxhat * g)


_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)


def mlp_tangent(p: dict, X: torch.Tensor, V: torch.Tensor, need_y: bool = True):
    """(MLP(X), J V) for fc2(GELU(fc1 x)) with exact (erf) GELU: GELU'(a) = Phi(a) + a phi(a)."""
    a = X @ p["W1"] + p["b1"]
    da = V @ p["W1"]
    Phi = 0.5 * (1.0 + torch.erf(a * _INV_SQRT2))
    g1 = Phi + a * torch.exp(-0.5 * a * a) * _INV_SQRT2PI
    return ((a * Phi) @ p["W2"] + p["b2"] if need_y else None), (g1 * da) @ p["W2"]


def _attention_params(m: DenseAttention, device, dtype) -> dict:
    zero = torch.zeros(m.dim, device=device, dtype=dtype)
    p = {"heads": m.num_heads}
    for n, lin in (("q", m.q_proj), ("k", m.k_proj), ("v", m.v_proj), ("o", m.o_proj)):
        W, b = _linear(lin, device, dtype)
        p[f"W{n}"], p[f"b{n}"] = W, (b if b is not None else zero)
    return p


def _layernorm_params(m: nn.Module, device, dtype):
    if isinstance(m, nn.Identity):
        return None
    if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
        cv = lambda t: t.detach().to(device, dtype) if t is not None else None
        return {"eps": m.eps, "gamma": cv(m.weight), "beta": cv(m.bias)}
    raise NotImplementedError


def _mlp_params(m: nn.Module, device, dtype):
    from .models.vit import Mlp
    if type(m) is not Mlp:
        raise NotImplementedError
    (W1, b1), (W2, b2) = _linear(m.fc1, device, dtype), _linear(m.fc2, device, dtype)
    z = lambda b, n: b if b is not None else torch.zeros(n, device=device, dtype=dtype)
    return {"W1": W1, "b1": z(b1, W1.shape[1]), "W2": W2, "b2": z(b2, W2.shape[1])}


def _analytic_tangent(module: nn.Module, device, dtype):
    """The batched-matmul tangent map for DenseAttention and pre-norm blocks around one; None otherwise."""
    if type(module) is DenseAttention:
        p = _attention_params(module, device, dtype)
        return lambda X, V, need_y=True: attention_tangent(p, X, V, need_y)
    if not isinstance(module, BlockMap) or type(module.block.mixer) is not DenseAttention:
        return None
    b = module.block
    try:
        ln1 = _layernorm_params(b.norm1, device, dtype)
        pa = _attention_params(b.mixer, device, dtype)
        use_mlp = module.branch == "vector_field" and b.mlp is not None
        ln2 = _layernorm_params(b.norm2, device, dtype) if use_mlp else None
        pm = _mlp_params(b.mlp, device, dtype) if use_mlp else None
    except NotImplementedError:
        return None
    ident = lambda X, V: (X, V)
    lt1 = (lambda X, V: layernorm_tangent(ln1, X, V)) if ln1 is not None else ident
    lt2 = (lambda X, V: layernorm_tangent(ln2, X, V)) if ln2 is not None else ident

    def tangent(X, V, need_y=True):
        y, dy = attention_tangent(pa, *lt1(X, V), need_y)
        if pm is None:
            return y, dy
        ym, dym = mlp_tangent(pm, *lt2(X, V), need_y)
        return (y + ym if need_y else None), dy + dym
    return tangent


def tangent_map(layer: nn.Module, grid: tuple[int, int], *, device=None, dtype=torch.float64,
                analytic: bool = True):
    """T(X, V) = (f(X), J_f(X) V) for batches X, V (S, N, C) of grids, in (device, dtype).

    Analytic (batched matmuls) for DenseAttention and BlockMap / VectorField over a DenseAttention
    block when `analytic`; otherwise torch.func.jvp of the module's batched forward."""
    H, W = _check_grid(grid)
    device = torch.device(device) if device is not None else default_device()
    module = _as_map(layer).to(device=device, dtype=dtype)
    t = _analytic_tangent(module, device, dtype) if analytic else None
    if t is not None:
        return t
    state = {k: v.detach() for k, v in module.named_parameters()}
    state.update({k: v.detach() for k, v in module.named_buffers()})

    def f(X):
        S, N, C = X.shape
        return functional_call(module, state, (X.reshape(S, H, W, C),)).reshape(S, N, C)
    return lambda X, V, need_y=True: jvp(f, (X,), (V,))


def _half_sq(tangent):
    """(X, V) -> (sum_s 0.5 ||J_s V_s||^2, per-sample 0.5 ||J_s V_s||^2): the probe's one objective."""
    def obj(X, V):
        val = 0.5 * tangent(X, V, False)[1].pow(2).flatten(1).sum(1)
        return val.sum(), val.detach()
    return obj


def _jtj(tangent):
    """V -> (J^T J V, ||J V||^2) per sample: the gradient in V of 0.5 ||J V||^2."""
    g = grad_and_value(_half_sq(tangent), argnums=1, has_aux=True)

    def jtj(X, V):
        gV, (_, val) = g(X, V)
        return gV, 2 * val
    return jtj


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
    return _assemble_witness(_witness_parts(layer, u, focus, dtype=dtype, device=device), radius, (H, W),
                             query=query, keys=keys)


def _witness_parts(layer: DenseAttention, u: torch.Tensor, focus: float | None, *, dtype=torch.float64,
                   device=None) -> tuple:
    """The radius-free part of `attention_witness`: (u, balanced query x_q, focused (cost, x_q, m) or None)."""
    m = head_matrices(layer, dtype=dtype, device=device)
    A, Bh, c = m["A"], m["B"], m["c"]
    h, C = A.shape[0], A.shape[1]
    d = C // h
    u = u.to(dtype=dtype, device=A.device)
    u = u / u.norm()
    M = torch.einsum("hcd,d->hc", A, u)  # rows A_h u^T
    xq = torch.linalg.pinv(M) @ (-(c @ u))
    best = None
    if focus is not None:
        hs = int(torch.argmax(M.norm(dim=1) * torch.einsum("c,hcd->hd", u, Bh).norm(dim=1)))  # dominant head
        # null space of the balance constraints and of u: directions the query may move in freely
        Qc = torch.linalg.qr(torch.cat([M, u[None]]).T).Q  # (C, h+1)
        Pn = torch.eye(C, dtype=dtype, device=A.device) - Qc @ Qc.T
        Pu = torch.eye(C, dtype=dtype, device=A.device) - torch.outer(u, u)
        zeta = torch.linalg.svd(Pn @ A[hs] @ Pu)[0][:, 0]  # moves q^hs the most within u's complement
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
    return u, xq, best


def _assemble_witness(parts: tuple, radius: float, grid: tuple[int, int], *, query: int = 0,
                      keys: tuple[int, int] = (1, 2)) -> torch.Tensor:
    """`attention_witness` at one radius from its radius-free parts."""
    u, xq, best = parts
    H, W = grid
    C = u.shape[0]
    mk = torch.zeros_like(u)
    if best is not None and best[0] < radius ** 2:
        xq, mk = best[1], best[2]
    if float(xq.norm()) > radius:  # the balance correction alone leaves the ball: shrink it, keys get nothing
        xq = xq * (radius / float(xq.norm()))
    a = math.sqrt(max(radius ** 2 - float(xq @ xq) - 2 * float(mk @ mk), 0.0) / 2)
    X = torch.zeros(H * W, C, dtype=u.dtype, device=u.device)
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

def _unit(t):
    return t / t.flatten(1).norm(dim=1).clamp_min(1e-300).reshape(-1, *([1] * (t.dim() - 1)))


def lanczos_top(jtj, X: torch.Tensor, v0: torch.Tensor, *, tol: float = 1e-6, max_steps: int = 60,
                progress: bool = False):
    """Top Ritz pair of J^T J per sample by Lanczos with full reorthogonalisation, batched over X (S, N, C).

    Started from v0 (the search's own vector); sample s stops at the first step where the relative
    residual rel = beta_k |y_k| / theta = ||J^T J y - theta y|| / theta of its top Ritz pair (theta, y)
    is <= tol, on breakdown (an invariant subspace: rel ~ 0), or after max_steps. Converged samples
    leave the batch, so each sample's result is that of a run on it alone.
    Returns (y (S, N, C) unit Ritz vectors, theta (S,), rel (S,), steps (S,) int)."""
    S, shape = X.shape[0], X.shape[1:]
    n = X[0].numel()
    dev, dt = X.device, X.dtype
    out_y = torch.zeros(S, n, dtype=dt, device=dev)
    out_theta = torch.zeros(S, dtype=dt, device=dev)
    out_rel = torch.full((S,), math.inf, dtype=dt, device=dev)
    out_steps = torch.zeros(S, dtype=torch.long, device=dev)
    idx = torch.arange(S, device=dev)
    q = _unit(v0.to(X).reshape(S, n))
    Xa, Q, alphas, betas = X, [q], [], []
    q_prev, b_prev = torch.zeros_like(q), torch.zeros(S, dtype=dt, device=dev)
    max_steps = max(1, min(int(max_steps), n))
    it = range(max_steps)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="certify (Lanczos)", unit="step", leave=False)
    for j in it:
        w = jtj(Xa, q.reshape(-1, *shape))[0].reshape(-1, n)
        a = (q * w).sum(1)
        w = w - a[:, None] * q - b_prev[:, None] * q_prev
        Qm = torch.stack(Q, 1)  # (Sa, j + 1, n)
        for _ in range(2):  # full reorthogonalisation, twice is enough (Kahan)
            w = w - torch.einsum("skn,sk->sn", Qm, torch.einsum("skn,sn->sk", Qm, w))
        b = w.norm(dim=1)
        alphas.append(a)
        T = torch.diag_embed(torch.stack(alphas, 1))
        if betas:
            off = torch.diag_embed(torch.stack(betas, 1), offset=1)
            T = T + off + off.transpose(1, 2)
        evals, evecs = torch.linalg.eigh(T)
        theta, s = evals[:, -1], evecs[:, :, -1]
        rel = b * s[:, -1].abs() / theta.abs().clamp_min(torch.finfo(dt).tiny)
        done = (rel <= tol) | (b <= 64 * torch.finfo(dt).eps * theta.abs()) | torch.tensor(j == max_steps - 1, device=dev)
        if bool(done.any()):
            i = idx[done]
            out_y[i] = torch.einsum("skn,sk->sn", Qm[done], s[done])
            out_theta[i], out_rel[i], out_steps[i] = theta[done], rel[done], j + 1
        keep = ~done
        if not bool(keep.any()):
            break
        idx, Xa = idx[keep], Xa[keep]
        Q = [t[keep] for t in Q]
        alphas = [t[keep] for t in alphas]
        betas = [t[keep] for t in betas] + [b[keep]]
        q_prev, b_prev = q[keep], b[keep]
        q = w[keep] / b[keep][:, None]
        Q.append(q)
    return _unit(out_y).reshape(S, *shape), out_theta, out_rel, out_steps


def certify(tangent, X: torch.Tensor, v0: torch.Tensor | None = None, *, method: str = "auto", steps: int = 60,
            tol: float = 1e-6, f=None, generator: torch.Generator | None = None, progress: bool = False):
    """Certified ||J_f(X)||_2 lower bounds for a batch X (S, N, C) (float64 in, float64 out).

    tangent: the float64 tangent map (X, V) -> (f(X), J V) on batches. Returns (value (S,), v (S, N, C) unit,
    rel (S,), steps (S,)): value = ||J v|| for that actual v, recomputed in float64 after the eigensolver.
    "lanczos" ("auto", "subspace"): v is the top Ritz vector of `lanczos_top` from v0 (random where None),
    rel the relative residual it reached. "dense": v is the top right singular vector of the dense
    Jacobian (jacrev of the single-grid map f + SVD; small grids only), rel 0."""
    if method not in CERTIFY_METHODS:
        raise ValueError(f"unknown certify method {method!r}; choose one of {CERTIFY_METHODS}")
    S, N, C = X.shape
    n = N * C
    if method == "dense":
        if f is None:
            raise ValueError("certify(method='dense') needs the single-grid map f (X (N, C) -> (N, C))")
        vs = []
        for s in range(S):  # one dense Jacobian at a time keeps memory at n^2
            J = jacrev(f)(X[s]).reshape(n, n)  # [out, in]
            vs.append(torch.linalg.svd(J)[2][0].reshape(N, C))
        v = torch.stack(vs)
        rel = torch.zeros(S, dtype=X.dtype, device=X.device)
        nsteps = torch.zeros(S, dtype=torch.long, device=X.device)
    else:
        if v0 is None:
            v0 = torch.randn(X.shape, dtype=torch.float64, generator=generator).to(X)  # CPU generator, any device
        v, _, rel, nsteps = lanczos_top(_jtj(tangent), X, v0, tol=tol, max_steps=steps, progress=progress)
    v = _unit(v)
    value = tangent(X, v, False)[1].flatten(1).norm(dim=1)  # the certified number: ||J v|| at an actual (X, v)
    return value, v, rel, nsteps


# ------------------------------------------------------------------------------------------ the probe

@dataclasses.dataclass
class GrowthResult:
    """Per-radius certified lower bounds on L(R) and the fitted growth exponent.

    attained[r] = ||J(X) v|| in float64 at the best certified input the search found for radius r itself
    (||X||_F <= radii[r]); lower[r] = max(attained[:r + 1]) (nested balls: L is nondecreasing), with X[r],
    v[r] the input and vector attaining it. tolerance[r] is the relative Lanczos residual reached for that
    v (0 for dense SVD), lanczos_steps[r] the steps it took. search[r] is the best value the search saw
    (in its dtype); witness[r] the best certified value among the witness-started restarts (nan if none).
    exponent is the least-squares slope of log lower on log R over R >= fit_min_radius, with a 95%
    t-interval exponent_ci. seconds: wall time of the search and of the certification."""
    radii: list
    lower: list
    attained: list
    search: list
    witness: list
    tolerance: list
    lanczos_steps: list
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
    certify_tol: float
    map: str
    tangent: str
    device: str
    dtype: str
    seconds: dict

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


def _col(R, X):
    """R as a (S, 1, 1) tensor beside X (S, N, C): one radius per sample."""
    return torch.as_tensor(R, dtype=X.dtype, device=X.device).reshape(-1, 1, 1).expand(X.shape[0], 1, 1)


def _sphere(X, R):
    n = X.flatten(1).norm(dim=1).clamp_min(1e-300).reshape(-1, 1, 1)
    return X * (_col(R, X) / n)


def _ball(X, R):
    R = _col(R, X)
    n = X.flatten(1).norm(dim=1).reshape(-1, 1, 1)
    return torch.where(n > R, X * (R / n.clamp_min(1e-300)), X)


def ascend(tangent, X: torch.Tensor, R, *, steps: int, lr: float = 0.05, power_warmup: int = 10,
           generator: torch.Generator | None = None, v0: torch.Tensor | None = None, progress: bool = False):
    """Batched projected ascent of ||J(X)||_2 over ||X||_F <= R from the starts X (S, N, C).

    tangent: (X, V) -> (f(X), J V) on batches. R: one radius, or one per sample (S,). One call per step
    returns, for every sample, 0.5 ||J(X) v||^2 and its gradients in X and v (reverse mode through the
    tangent map): the v-gradient J^T J v is the power-iteration step for the top right singular vector, the
    X-gradient (envelope theorem) the ascent direction. A step that does not raise ||J v|| is undone and
    the step halved, one that does grows it 1.5x; every sample keeps its own step, so its path does not
    depend on the others in the batch. Returns (best (S,), bestX (S, N, C), bestv (S, N, C)) with
    best[s] = ||J(bestX[s]) v|| for an actual v."""
    S = X.shape[0]
    Rc = _col(R, X)
    value_grad = grad_and_value(_half_sq(tangent), argnums=(0, 1), has_aux=True)
    jtj = _jtj(tangent)
    v = _unit(v0.to(X) if v0 is not None else torch.randn(X.shape, generator=generator, dtype=torch.float64).to(X))
    for _ in range(power_warmup):
        v = _unit(jtj(X, v)[0])
    best = torch.full((S,), -math.inf, dtype=X.dtype, device=X.device)
    bestX, bestv, bestg = X.clone(), v.clone(), torch.zeros_like(X)
    step = lr * Rc.clone()
    it = range(steps + 1)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=f"search ({S} starts)", unit="step", leave=False)
    for _ in it:
        (gX, gv), (_, val) = value_grad(X, v)
        sigma = (2 * val).clamp_min(0).sqrt()
        ok = (sigma > best) & torch.isfinite(sigma) & torch.isfinite(gX.flatten(1).sum(1))  # a finite sum: all finite
        okb = ok.reshape(S, 1, 1)
        best = torch.where(ok, sigma, best)
        bestX = torch.where(okb, X, bestX)
        bestv = torch.where(okb, _unit(gv), bestv)
        bestg = torch.where(okb, _unit(gX), bestg)
        step = torch.where(okb, step * 1.5, step * 0.5)
        X = _ball(bestX + step * bestg, Rc)
        v = bestv
    return best, bestX, bestv


def benchmark_batched_vs_loop(layer: nn.Module, radius: float, grid: tuple[int, int] = (4, 4), *,
                              restarts: int = 64, steps: int = 10, power_warmup: int = 10, device=None,
                              dtype=torch.float64, seed: int = 0) -> dict:
    """Wall time of `ascend` on `restarts` random starts as one batch vs a Python loop over them (same
    starts and power-iteration vectors, same steps). Returns seconds for both, the ratio, and the best value
    of each run (the same computation, so they agree up to rounding)."""
    H, W = _check_grid(grid)
    device = torch.device(device) if device is not None else default_device()
    module = _as_map(layer)
    C = _infer_channels(module)
    tan = tangent_map(layer, (H, W), device=device, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    X0 = _sphere(torch.randn(restarts, H * W, C, generator=g, dtype=torch.float64), radius).to(device, dtype)
    V0 = torch.randn(restarts, H * W, C, generator=g, dtype=torch.float64).to(device, dtype)
    ascend(tan, X0[:2], radius, steps=1, power_warmup=1)  # warm-up: first-call overheads out of the timing
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync(); t0 = time.perf_counter()
    b_batch = ascend(tan, X0, radius, steps=steps, power_warmup=power_warmup, v0=V0)[0]
    sync(); t_batch = time.perf_counter() - t0
    t0 = time.perf_counter()
    b_loop = torch.cat([ascend(tan, X0[s:s + 1], radius, steps=steps, power_warmup=power_warmup, v0=V0[s:s + 1])[0]
                        for s in range(restarts)])
    sync(); t_loop = time.perf_counter() - t0
    return {"restarts": restarts, "steps": steps, "power_warmup": power_warmup, "radius": radius,
            "batched_s": t_batch, "loop_s": t_loop, "speedup": t_loop / t_batch,
            "best_batched": float(b_batch.max()), "best_loop": float(b_loop.max()),
            "dtype": str(dtype).replace("torch.", ""), "device": str(device)}


def _radius_generator(seed: int, R: float) -> torch.Generator:
    """A CPU generator seeded by (seed, R) alone: a radius draws the same starts in any batch."""
    h = hashlib.sha256(f"{int(seed)}:{float(R).hex()}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(h[:8], "little") & (2 ** 63 - 1))


def _starts(layer, R: float, H: int, W: int, C: int, restarts: int, dirs: list, is_ln_map: bool, seed: int,
            device, dtype):
    """Starting inputs (restarts, N, C), power-iteration vectors and their kinds for one radius."""
    N = H * W
    starts, kinds = [], []
    for parts in dirs[:restarts]:  # radius-free witness parts, focused first
        starts.append(_assemble_witness(parts, R, (H, W)).reshape(N, C))
        kinds.append("witness")
    if is_ln_map and len(starts) < restarts:  # constant tokens: zero variance, where LayerNorm's Jacobian is largest
        starts.append(torch.full((N, C), R / math.sqrt(N * C), dtype=torch.float64, device=device))
        kinds.append("constant")
    gen = _radius_generator(seed, R)
    n_rand = restarts - len(starts)
    X = torch.stack(starts).to(dtype) if starts else torch.empty(0, N, C, dtype=dtype, device=device)
    if n_rand:
        Z = torch.randn(n_rand, N, C, generator=gen, dtype=torch.float64).to(device)
        X = torch.cat([X, _sphere(Z, R).to(dtype)])
        kinds += ["random"] * n_rand
    V0 = torch.randn(restarts, N, C, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    return X, V0, kinds


def attention_growth(layer: nn.Module, radii, grid: tuple[int, int] = (4, 4), *, restarts: int = 16,
                     steps: int = 60, lr: float = 0.05, power_warmup: int = 10, certify_method: str = "auto",
                     certify_steps: int = 60, certify_tol: float = 1e-6, certify_top: int = 2,
                     refine_rounds: int = 2, refine_steps: int | None = None, refine_top: int = 4,
                     fit_min_radius: float | None = None, witnesses: bool = True, dim: int | None = None,
                     analytic: bool = True, batch_radii: bool = True, device=None, dtype=torch.float64, seed: int = 0,
                     progress: bool = False) -> GrowthResult:
    """Certified lower bounds on L(R) = sup_{||X||_F <= R} ||J_f(X)||_2 for each R in `radii`.

    layer: a DenseAttention (the whole layer, output projection and biases included), a `BlockMap`,
    a VectorField, or any module mapping (B, H, W, C) -> (B, H, W, C) with independent grids (see the
    module docstring for a (B, N, C) attention block). restarts: starting points per radius; all radii's
    restarts are searched together as one batch (witnesses, constant tokens, random). steps: projected
    ascent steps. lr: initial step as a fraction of R (adapted per restart). certify_top: how many of the
    best restarts per radius are certified in float64 (plus the best witness-started one), by Lanczos
    ("auto") stopped at relative residual certify_tol or after certify_steps, or by dense jacrev + SVD
    ("dense", small grids). refine_rounds, refine_steps (default: steps), refine_top: the batched
    refinement rounds (continue the best refine_top restarts per radius, plus one from the next smaller
    radius's best input). fit_min_radius: default the upper half of the radii. dim: C, when the module
    does not tell it. analytic: use the batched-matmul tangent map where one exists (else torch.func.jvp).
    batch_radii: False runs each radius's ascent and certification on its own (same numbers, slower; for
    checking). device: default cuda when available, else cpu. dtype: of the search (certification is float64).
    Returns a `GrowthResult`; result.tolerance holds the Lanczos residual reached per radius.
    """
    radii = _check_radii(radii)
    H, W = _check_grid(grid)
    if not (isinstance(restarts, int) and restarts >= 1):
        raise ValueError(f"restarts must be an integer >= 1 (the number of starting points per radius), got {restarts!r}")
    if not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    if not (isinstance(certify_top, int) and certify_top >= 1):
        raise ValueError(f"certify_top must be an integer >= 1, got {certify_top!r}")
    if not (isinstance(certify_steps, int) and certify_steps >= 1):
        raise ValueError(f"certify_steps must be an integer >= 1 (the most Lanczos steps), got {certify_steps!r}")
    if not (isinstance(certify_tol, (int, float)) and math.isfinite(certify_tol) and certify_tol > 0):
        raise ValueError(f"certify_tol must be a positive relative tolerance such as 1e-6, got {certify_tol!r}")
    if certify_method not in CERTIFY_METHODS:
        raise ValueError(f"unknown certify_method {certify_method!r}; choose one of {CERTIFY_METHODS}")
    if not (isinstance(refine_rounds, int) and refine_rounds >= 0):
        raise ValueError(f"refine_rounds must be an integer >= 0, got {refine_rounds!r}")
    refine_steps = steps if refine_steps is None else refine_steps
    if not (isinstance(refine_steps, int) and refine_steps >= 0):
        raise ValueError(f"refine_steps must be an integer >= 0, got {refine_steps!r}")
    if not (isinstance(refine_top, int) and refine_top >= 1):
        raise ValueError(f"refine_top must be an integer >= 1, got {refine_top!r}")
    device = torch.device(device) if device is not None else default_device()
    if fit_min_radius is None:
        fit_min_radius = radii[len(radii) // 2]
    module = _as_map(layer)
    map_name = type(layer).__name__ + (f"[{layer.branch}]" if isinstance(layer, BlockMap) else "")
    N = H * W
    if next(module.parameters(), None) is None:
        raise ValueError("layer has no parameters; nothing to probe")
    C = int(dim) if dim is not None else _infer_channels(module)
    tan = tangent_map(layer, (H, W), device=device, dtype=dtype, analytic=analytic)
    tan64 = tangent_map(layer, (H, W), device=device, dtype=torch.float64, analytic=analytic)
    analytic_used = analytic and _analytic_tangent(module, device, torch.float64) is not None
    dirs = []
    if witnesses and isinstance(layer, DenseAttention) and N >= 3:
        us = list(witness_directions(layer, device=device).values())
        dirs = list(itertools.islice((_witness_parts(layer, u, focus, device=device)  # only those used
                                      for focus in (WITNESS_FOCUS, None) for u in us), restarts))
    is_ln_map = any(isinstance(m, nn.LayerNorm) for m in module.modules())

    nR = len(radii)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(X, V, Rs, steps_):  # one ascent over samples grouped by radius, (nR, P, ...) in and out
        P = X.shape[1]
        if batch_radii:
            out = ascend(tan, X.flatten(0, 1), Rs.repeat_interleave(P), steps=steps_, lr=lr,
                         power_warmup=power_warmup, v0=V.flatten(0, 1), progress=progress)
            return tuple(t.reshape(nR, P, *t.shape[1:]) for t in out)
        outs = [ascend(tan, X[r], Rs[r:r + 1], steps=steps_, lr=lr, power_warmup=power_warmup, v0=V[r])
                for r in range(nR)]
        return tuple(torch.stack([o[i] for o in outs]) for i in range(3))

    # 1. one batched search over every (radius, restart)
    t0 = time.perf_counter()
    per = [_starts(layer, R, H, W, C, restarts, dirs, is_ln_map, seed, device, dtype) for R in radii]
    kinds = [p[2] for p in per]
    Rs = torch.tensor(radii, dtype=torch.float64).to(device=device, dtype=dtype)
    best, bestX, bestv = run(torch.stack([p[0] for p in per]), torch.stack([p[1] for p in per]), Rs, steps)
    # 2. refinement rounds, again one batch over radii: each radius continues its best restarts and also
    # starts from the smaller radius's best input (inside its ball), so good inputs travel up the radii
    # as in a sequential warm-started sweep, pipelined one radius per round
    for _ in range(refine_rounds):
        k = min(refine_top, best.shape[1])
        top = torch.argsort(best, dim=1, descending=True)[:, :k]  # (nR, k)
        ar = torch.arange(nR, device=top.device)[:, None]
        pidx = (torch.arange(nR, device=top.device) - 1).clamp_min(0)  # radius 0: its own best once more
        prevX = bestX[pidx, top[pidx, 0]][:, None]
        prevv = bestv[pidx, top[pidx, 0]][:, None]
        Xr = torch.cat([bestX[ar, top], prevX], 1)
        Vr = torch.cat([bestv[ar, top], prevv], 1)
        b2, X2, v2 = run(Xr, Vr, Rs, refine_steps)
        # refined samples replace their origins (an ascent never ends below its start); the carried input joins
        best, bestX, bestv = best.clone(), bestX.clone(), bestv.clone()
        best[ar, top], bestX[ar, top], bestv[ar, top] = b2[:, :k], X2[:, :k], v2[:, :k]
        best = torch.cat([best, b2[:, k:]], 1)
        bestX, bestv = torch.cat([bestX, X2[:, k:]], 1), torch.cat([bestv, v2[:, k:]], 1)
        kinds = [kd + ["previous"] for kd in kinds]
    sync(); t_search = time.perf_counter() - t0

    # 3. float64 certification of each radius's most promising restarts, all radii in one batch
    t0 = time.perf_counter()
    cand = []  # (radius index, restart index)
    for r in range(nR):
        top = torch.argsort(best[r], descending=True)[:certify_top].tolist()
        wit = [i for i, kd in enumerate(kinds[r]) if kd == "witness"]
        if wit:  # also the best witness-started restart: to report what the witnesses reach
            wi = max(wit, key=lambda i: float(best[r, i]))
            top += [wi] if wi not in top else []
        cand += [(r, i) for i in top]
    ri = torch.tensor([c[0] for c in cand], device=device)
    si = torch.tensor([c[1] for c in cand], device=device)
    X64 = bestX[ri, si].to(torch.float64)
    Rc = torch.tensor([radii[r] for r, _ in cand], dtype=torch.float64, device=device).reshape(-1, 1, 1)
    n64 = X64.flatten(1).norm(dim=1).reshape(-1, 1, 1)
    X64 = torch.where(n64 > Rc * (1 - 1e-13), X64 * (Rc * (1 - 1e-12) / n64), X64)  # strictly inside, in float64
    if not bool((X64.flatten(1).norm(dim=1).reshape(-1, 1, 1) <= Rc).all()):
        raise RuntimeError("internal error: a certified input left its ball ||X||_F <= R")
    f64 = _functional(copy.deepcopy(module), H, W, device=device, dtype=torch.float64) \
        if certify_method == "dense" else None
    V64 = bestv[ri, si].to(torch.float64)
    if batch_radii:
        val64, v64, rel, nst = certify(tan64, X64, V64, method=certify_method, steps=certify_steps, tol=certify_tol,
                                       f=f64, progress=progress)
    else:
        parts = [certify(tan64, X64[ri == r], V64[ri == r], method=certify_method, steps=certify_steps,
                         tol=certify_tol, f=f64) for r in range(nR)]
        val64, v64, rel, nst = (torch.cat([p[i] for p in parts]) for i in range(4))
    sync(); t_cert = time.perf_counter() - t0

    attained, search, wit_vals, Xs, vs, tols, its = [], [], [], [], [], [], []
    for r in range(len(radii)):
        mine = [j for j, c in enumerate(cand) if c[0] == r]
        j = max(mine, key=lambda j: float(val64[j]))
        attained.append(float(val64[j])); Xs.append(X64[j]); vs.append(v64[j])
        tols.append(float(rel[j])); its.append(int(nst[j]))
        search.append(float(best[r].max()))
        w = [float(val64[j]) for j in mine if kinds[r][cand[j][1]] == "witness"]
        wit_vals.append(max(w) if w else float("nan"))
    lower, Xl, vl, tl, il = [], [], [], [], []
    for r in range(len(radii)):  # nested balls: a smaller radius's input is admissible here
        k = r if not lower or attained[r] >= lower[-1] else None
        if k is None:
            lower.append(lower[-1]); Xl.append(Xl[-1]); vl.append(vl[-1]); tl.append(tl[-1]); il.append(il[-1])
        else:
            lower.append(attained[r]); Xl.append(Xs[r]); vl.append(vs[r]); tl.append(tols[r]); il.append(its[r])
    k, ci, b = fit_exponent(radii, lower, fit_min_radius) if sum(r >= fit_min_radius for r in radii) >= 2 \
        else (float("nan"), (float("nan"), float("nan")), float("nan"))
    return GrowthResult(radii=radii, lower=lower, attained=attained, search=search, witness=wit_vals,
                        tolerance=tl, lanczos_steps=il,
                        X=torch.stack(Xl).reshape(len(radii), H, W, C).cpu(),
                        v=torch.stack(vl).reshape(len(radii), H, W, C).cpu(), exponent=k, exponent_ci=ci,
                        fit_min_radius=float(fit_min_radius), intercept=b, grid=(H, W), restarts=restarts,
                        steps=steps, certify_method=certify_method, certify_tol=float(certify_tol), map=map_name,
                        tangent="analytic (batched matmuls)" if analytic_used else "torch.func.jvp",
                        device=str(device), dtype=str(dtype).replace("torch.", ""),
                        seconds={"search": t_search, "certify": t_cert, "total": t_search + t_cert})


def _infer_channels(module: nn.Module) -> int:
    for m in module.modules():
        if isinstance(m, DenseAttention):
            return m.dim
        if isinstance(m, nn.LayerNorm):
            return m.normalized_shape[-1]
        if hasattr(m, "dim") and isinstance(m.dim, int):
            return m.dim
    raise ValueError("cannot infer the channel count C of layer; pass dim=C, or a DenseAttention, a BlockMap or a "
                     "module with a .dim attribute")


def exact_jacobian_norm(layer: nn.Module, X: torch.Tensor) -> float:
    """Reference: ||J_f(X)||_2 by dense jacrev + SVD in float64, X (H, W, C). For small grids only."""
    H, W, C = X.shape
    f = _functional(_as_map(layer), H, W, device=X.device, dtype=torch.float64)
    J = jacrev(f)(X.reshape(H * W, C).to(torch.float64)).reshape(H * W * C, H * W * C)
    return float(torch.linalg.matrix_norm(J, 2))
