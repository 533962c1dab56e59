"""Structured starting inputs for dense attention (Kim, Papamakarios and Mnih 2021).

A query token whose logits are all equal (at 0 for a bias-free layer) and two key tokens at +-(R / sqrt 2) u:
the query's diagonal Jacobian block is (1/N) sum_h B_h + (R^2 / (N sqrt d)) sum_h A_h u^T u B_h with
A_h = W_Q^h W_K^h^T and B_h = W_V^h W_O^h, so L(R) grows like R^2 (`witness_closed_form` states and proves
it exactly). The focused variant (`attention_witness(..., focus=tau)`) also offsets the keys so that the
query attends to them alone, which raises the R^2 coefficient N/2-fold, to about
max_u ||A_h u^T|| ||u B_h|| / (2 sqrt d).
"""
from __future__ import annotations

import math

import torch

from ..bounds.attention import head_matrices
from ..mixers.attention import DenseAttention
from .maps import check_grid

WITNESS_FOCUS = 15.0  # logit margin of the focused witness: weight e^-15 per token off the two keys


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
    H, W = check_grid(grid)
    N = H * W
    if N < 3:
        raise ValueError(f"the witness needs at least 3 tokens (a query and two keys); grid={grid} has {N}")
    return assemble_witness(witness_parts(layer, u, focus, dtype=dtype, device=device), radius, (H, W),
                            query=query, keys=keys)


def witness_parts(layer: DenseAttention, u: torch.Tensor, focus: float | None, *, dtype=torch.float64,
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


def assemble_witness(parts: tuple, radius: float, grid: tuple[int, int], *, query: int = 0,
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
    H, W = check_grid(grid)
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

