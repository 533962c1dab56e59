"""Logarithmic norm and second derivative of the SSoG vector field (SPEC S5; proofs/S5.md, Lemmas 1-4).

    F(x) = T LN1(x) + b + MLP(LN2(x)),   J_F(x) = T D1(x) + D2(x)

T is the fixed SSoG operator (linear), D1 = blockdiag_i J_LN1(x_i) and D2 = blockdiag_i J_{MLP o LN2}(x_i)
act token by token. On states whose tokens all have variance >= v (eps the LayerNorm epsilon, C channels):

    ||J_LN(x_i)|| <= g / sqrt(v + eps),          ||D^2 LN(x_i)[u, u]|| <= (2/sqrt(3)) g ||u||^2 / (sqrt(C) (v + eps))
    ||D^2 MLP(z)[w, w]|| <= ||W2|| sup|GELU''| ||W1||^2 ||w||^2,      sup|GELU''| = 2 phi(0) = sqrt(2/pi)

(g = max|gamma|), hence ||J_F(x)|| <= `lipschitz(v)` and ||J_F(x) - J_F(z)|| <= `curvature(v)` max_i ||x_i - z_i||
whenever the segment [x, z] keeps variance >= v (Lemma 2: both parts are block-diagonal per token, T is linear).

The logarithmic norm mu_2(A) = lambda_max((A + A^T) / 2) at a point is bounded in two ways:
- `dense_lognorm`: the whole Jacobian (n = H W C columns by forward mode), its symmetric part's largest eigenvalue
  verified by a floating-point Cholesky factorisation of (mu I - S) (Rump's criterion, Lemma 3);
- `structured_lognorm`: mu_2(T D1 + D2) <= ||T|| max_i ||D1_i|| + max_i mu_2(D2_i), the per-token C x C blocks
  verified the same way; O(N C^3) instead of O(N^3 C^3).
Floating-point errors of evaluating F and its directional derivatives are bounded a priori (`rounding_bounds`).
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..mixers.ssog import truncation_tol
from ..rounding import cholesky_certifies as _cholesky_certifies  # noqa: F401
from ..rounding import gamma, norm2_upper, tiny_subnormal, top_eigenpairs  # noqa: F401
from ..rounding import unit_roundoff, verified_lambda_max  # noqa: F401

U64 = torch.finfo(torch.float64).eps / 2  # unit roundoff of float64
GELU2_SUP = math.sqrt(2 / math.pi)  # sup |GELU''| = |phi(0) (2 - 0)| (proofs/s5_check.py checks it)
# ||D^2 xhat[u, u]|| <= (2 / sqrt(3)) ||u||^2 / (sqrt(C) s^2), s^2 = var + eps, sharp (proofs/S5.md, Lemma 1);
# 2 / sqrt(3) = 1.15470053837925153..., rounded up
LN_CURVATURE = 1.1547005383793


@dataclasses.dataclass
class FieldConstants:
    """Weight-only numbers of F = T LN1 + MLP LN2 from which the state-dependent bounds follow."""
    C: int
    N: int
    T_norm: float  # ||T||_2 upper bound (ssog_lipschitz on this grid)
    T_abs: float  # || |T| ||_2 bound (rounding magnitudes)
    g1: float  # max |gamma| of LN1 (1 for Identity)
    g2: float
    eps1: float  # LN epsilon (inf: Identity, whose Jacobian is I and curvature 0)
    eps2: float
    W1: float  # ||W1||_2, ||W2||_2 of the MLP (0: no MLP)
    W2: float
    W1_abs: float
    W2_abs: float
    gelu1: float  # sup |GELU'|
    bias_norm: float  # ||b_o|| + ||b2|| per token + ||W2|| ||b1||: magnitudes of the affine parts
    rho1: float  # LN1 image radius per token (sqrt(C) g1 + ||beta1||), inf for Identity
    rho2: float
    hidden: int
    W1_row: float = math.inf  # max_j ||row j of W1||_2 (<= ||W1||; inf: unknown, ||W1|| is used)

    @property
    def mlp_lipschitz(self) -> float:
        return self.W2 * self.gelu1 * self.W1

    def _ln(self, which: int) -> tuple[float, float]:
        if which not in (1, 2):
            raise ValueError(f"which must be 1 (LN1, before the mixer) or 2 (LN2, before the MLP), got {which!r}")
        return (self.g1, self.eps1) if which == 1 else (self.g2, self.eps2)

    def ln_jacobian(self, which: int, v) -> float:
        g, e = self._ln(which)
        if math.isinf(e):
            return 1.0
        return g / math.sqrt(v + e) if v + e > 0 else math.inf

    def ln_curvature(self, which: int, v) -> float:
        g, e = self._ln(which)
        if math.isinf(e):
            return 0.0
        return LN_CURVATURE * g / (math.sqrt(self.C) * (v + e)) if v + e > 0 else math.inf

    def lipschitz(self, v: float) -> float:
        """||J_F(x)||_2 at states whose tokens have variance >= v."""
        return self.T_norm * self.ln_jacobian(1, v) + self.mlp_lipschitz * self.ln_jacobian(2, v)

    def curvature(self, v: float) -> float:
        """M2 with ||J_F(x) - J_F(z)|| <= M2 max_i ||x_i - z_i|| (and ||D^2 F[u, u]|| <= M2 ||u||^2) where
        every point of [x, z] has token variance >= v."""
        l2 = self.ln_jacobian(2, v)
        # ||(W1 w) * (W1 w')||_2 <= ||W1 w||_4 ||W1 w'||_4 and ||W1 w||_4^2 <= ||W1 w||_inf ||W1 w||_2
        # <= max_j ||w_j|| ||W1|| ||w||^2 (proofs/S5.md, Lemma 1)
        return (self.T_norm * self.ln_curvature(1, v) + self.mlp_lipschitz * self.ln_curvature(2, v)
                + self.W2 * GELU2_SUP * self.W1 * min(self.W1, self.W1_row) * l2 * l2)


    def _ln_tokens(self, which: int, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Jacobian, curvature) constants of LN `which` per token at token variance floors v (a tensor): the
        tensor forms of ln_jacobian and ln_curvature (inf where v + eps <= 0)."""
        g, e = self._ln(which)
        if math.isinf(e):
            return torch.ones_like(v), torch.zeros_like(v)
        ve = v + e
        inf = torch.full_like(v, math.inf)
        jac = torch.where(ve > 0, g / ve.clamp_min(1e-300).sqrt(), inf)
        return jac, torch.where(ve > 0, LN_CURVATURE * g / (math.sqrt(self.C) * ve.clamp_min(1e-300)), inf)

    def curvature_parts(self, v: torch.Tensor) -> list:
        """Lemma 2 token by token: [(a_k, c_k)] with ||D^2 F(x)[u, u]|| <= sum_k a_k (sum_i c_ki^2 ||u_i||^4)^(1/2)
        wherever token i has variance >= v_i (v: per-token floors, any shape ending in the tokens). With every v_i
        equal to v, sum_k a_k c_ki is curvature(v): each token's block of D^2 F[u, u] is at most its own constant
        times ||u_i||^2 (the mixer part through ||T||, the MLP part token by token). Unrounded: the caller rounds
        the assembled (nonnegative) sum."""
        l2, c2 = self._ln_tokens(2, v)
        _, c1 = self._ln_tokens(1, v)
        mlp = self.mlp_lipschitz * c2 + self.W2 * GELU2_SUP * self.W1 * min(self.W1, self.W1_row) * l2 * l2
        return [(self.T_norm, c1), (1.0, mlp)]


def _op(w) -> float:
    """||w||_2 rounded up: verified by Cholesky (lipcheck.rounding.norm2_upper, proofs/S2.md)."""
    return float(norm2_upper(w)) if w.numel() else 0.0


def _ln_numbers(norm, C, fk):
    if isinstance(norm, nn.Identity):
        return 1.0, math.inf, math.inf, 0.0
    if not isinstance(norm, nn.LayerNorm):
        raise TypeError(f"unsupported norm {type(norm).__name__}; expected nn.LayerNorm or nn.Identity")
    g = norm.weight.detach().to(**fk) if norm.weight is not None else torch.ones(C, **fk)
    b = norm.bias.detach().to(**fk) if norm.bias is not None else torch.zeros(C, **fk)
    gm = float(g.abs().max())
    return gm, float(norm.eps), math.sqrt(C) * gm + float(b.norm()), float(b.norm())


def field_constants(block, H: int, W: int, *, dtype=torch.float64, device=None) -> FieldConstants:
    """The constants of `FieldConstants` for an SSoG block on an H x W grid (||T|| from `ssog_lipschitz`)."""
    from ..mixers.ssog import SSoG
    from .lipschitz import ssog_lipschitz
    from .spectral import ssog_params
    if not isinstance(block.mixer, SSoG):
        raise TypeError("the enclosure needs a linear mixer (SSoG, fixed kernel): its second derivative vanishes; "
                        f"got {type(block.mixer).__name__}, whose curvature bound is not implemented")
    fk = dict(dtype=dtype, device=device)
    shared = norm_mlp_numbers(block, fk)
    T = float(ssog_lipschitz(block.mixer, H, W, dtype=dtype, device=device).upper)
    p = ssog_params(block.mixer, dtype=dtype, device=device)
    d = p.head_dim
    T_abs = sum(float(p.alpha[h].abs().sum()) * _op(p.WV[:, h * d:(h + 1) * d].abs() @ p.WO[h * d:(h + 1) * d].abs())
                for h in range(p.num_heads))  # |G_n| = G_n has row and column sums <= 1
    bo = block.mixer.o_proj.bias
    shared["bias_norm"] += float(bo.detach().to(**fk).norm()) if bo is not None else 0.0
    return FieldConstants(N=H * W, T_norm=T, T_abs=T_abs, **shared)


def norm_mlp_numbers(block, fk) -> dict:
    """The mixer-free fields of `FieldConstants` (LayerNorms, MLP, the MLP's biases in bias_norm) of any block
    F = Mixer(LN1 x) + MLP(LN2 x), after refusing non-finite parameters."""
    from .attention import _frobenius_upper
    for name, p in block.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise ValueError(f"block parameter {name} has non-finite entries; fix the weights before certifying")
    C = block.mixer.dim  # both mixers the constants cover (SSoG, DenseAttention) carry their width
    g1, e1, r1, _ = _ln_numbers(block.norm1, C, fk)
    g2, e2, r2, _ = _ln_numbers(block.norm2, C, fk)
    bias = 0.0
    if block.mlp is not None:
        w1, w2 = block.mlp.fc1.weight.detach().to(**fk), block.mlp.fc2.weight.detach().to(**fk)
        b1 = block.mlp.fc1.bias.detach().to(**fk).norm() if block.mlp.fc1.bias is not None else 0.0
        b2 = block.mlp.fc2.bias.detach().to(**fk).norm() if block.mlp.fc2.bias is not None else 0.0
        W1, W2, W1a, W2a = _op(w1), _op(w2), _op(w1.abs()), _op(w2.abs())
        W1r = max(_frobenius_upper(row, unit_roundoff(w1.dtype)) for row in w1)  # largest row norm, rounded up
        bias += float(b2) + W2a * float(b1)
        hidden = w1.shape[0]
    else:
        W1 = W2 = W1a = W2a = W1r = 0.0
        hidden = 0
    from .. import symbolic
    return dict(C=C, g1=g1, g2=g2, eps1=e1, eps2=e2, W1=W1, W2=W2, W1_abs=W1a, W2_abs=W2a,
                gelu1=symbolic.gelu_derivative_sup("exact"), bias_norm=bias, rho1=r1, rho2=r2, hidden=hidden,
                W1_row=W1r)


def rounding_bounds(k: FieldConstants, y: torch.Tensor, v: float) -> tuple[torch.Tensor, float]:
    """(eps_F per sample, eps_J): a-priori bounds ||fl(F(y)) - F(y)|| <= eps_F and ||fl(J_F(y) w) - J_F(y) w|| <=
    eps_J ||w|| for float evaluation in y's dtype at states y (B, H, W, C) of token variance >= v.

    Model (proofs/S5.md, Lemma 4): every intermediate is a dot product of length <= K or an elementary function
    within a few ulps, so its error is <= gamma_K times the absolute-value evaluation; LayerNorm divides by the
    token's std, which amplifies the absolute error of centring by a = max_i ||y_i|| / (sqrt(C) std_i)."""
    u = unit_roundoff(y.dtype)
    K = 2 * (k.C + k.hidden + 4 * int(math.isqrt(k.N) + 1) * 8) + 64
    gK = gamma(K, u)
    std = (y.var(dim=-1, unbiased=False) + 0.0).sqrt()
    amp = (y.norm(dim=-1) / (math.sqrt(k.C) * std.clamp_min(1e-300))).flatten(1).amax(1)  # (B,)
    rho1 = k.rho1 if math.isfinite(k.rho1) else float(y.norm(dim=-1).max())
    rho2 = k.rho2 if math.isfinite(k.rho2) else float(y.norm(dim=-1).max())
    mag = math.sqrt(k.N) * (k.T_abs * rho1 + k.W2_abs * k.gelu1 * k.W1_abs * rho2 + k.bias_norm)
    # The SSoG module drops taps below ssog.tap_floor: each axis factor loses at most e = truncation_tol / 2
    # of its mass, so the mixing it applies is within (2 e + e^2) || |T| || of T (proofs/S5.md, Lemma 4).
    e = truncation_tol(y.dtype) / 2
    dropped = (2 * e + e * e) * k.T_abs
    eps_F = gK * (2 + amp) * mag * 4 + dropped * math.sqrt(k.N) * rho1
    lin = k.T_abs * k.ln_jacobian(1, v) + k.W2_abs * k.gelu1 * k.W1_abs * k.ln_jacobian(2, v)
    eps_J = gK * (2 + float(amp.max())) * lin * 8 + dropped * k.ln_jacobian(1, v)
    return eps_F, eps_J


# --------------------------------------------------------------------------------------- verified eigenvalues

# ------------------------------------------------------------------------------------------- point log-norms

def dense_jacobian(block, y: torch.Tensor) -> torch.Tensor:
    """J_F at one state y (H, W, C) as an n x n matrix by forward mode (n evaluations: for checks only)."""
    shape = y.shape
    f = lambda z: block.vector_field(z.reshape(1, *shape)).reshape(-1)
    with torch.enable_grad():  # the MLP's no-grad slicing writes in place, which forward mode cannot trace
        return torch.func.jacfwd(f)(y.reshape(-1)).detach()


class DenseLogNorm:
    """Point log-norms mu_2(J_F(y)) from the closed form J_F = T D1 + D2 (T dense once, D1, D2 per token):
    n x n matrices without n evaluations of F. Each state's certificate is tried first by Cholesky at the Rayleigh
    quotient of the eigenvector of the nearest state of the last call, plus a pad (one factorisation instead of an
    eigensolver, valid whatever the guess); an eigensolver serves the states where that fails."""

    def __init__(self, block, H: int, W: int, *, dtype=torch.float64, device=None):
        from .spectral import dense_operator, ssog_params
        p = ssog_params(block.mixer, dtype=dtype, device=device)
        T = dense_operator(p, H, W)
        n, C = T.shape[0], block.mixer.dim
        self.block = block
        self.T_cols = T.reshape(n, n // C, C).permute(1, 0, 2).contiguous()  # (N, n, C): T's columns, token by token
        self.T_abs_norm = float(norm2_upper(T.abs()))  # verified by Cholesky
        self.mlp_abs = _mlp_abs_product(block, dict(dtype=dtype, device=device))  # || |W2| || sup|GELU'| || |W1| ||
        self.vec = None  # top eigenvectors (B, n) at the states of the last call: Rayleigh quotients guess the next
        self.states = None
        self.pad = 2e-3  # relative pad above the Rayleigh quotient at which the Cholesky certificate is tried
        self.eigensolves = 0
        self._buffers = {}  # `_space`'s work arrays

    @property
    def T(self) -> torch.Tensor:
        """The mixer's dense n x n operator."""
        N, n, C = self.T_cols.shape
        return self.T_cols.permute(1, 0, 2).reshape(n, n)

    def _forming_error(self, y: torch.Tensor, D1: torch.Tensor) -> torch.Tensor:
        """Per sample a bound on ||fl(J) - J||_F for J = T D1 + D2 formed in y's dtype."""
        B, C = y.shape[0], y.shape[-1]
        # T D1: products of length C plus the kernel's own evaluation (exp, normaliser): gamma_{C + 64} |T| |D1| in
        # Frobenius norm, ||(|T| |D1|)||_F <= || |T| ||_2 ||blockdiag |D1| ||_F
        err = gamma(C + 64, unit_roundoff(y.dtype)) * self.T_abs_norm * D1.flatten(1).norm(dim=-1) * 4
        if self.block.mlp is not None:  # D2 = W2 diag(GELU') W1 J2: sums of length hidden, then C (Lemma 3)
            err = err + _mlp_forming_error(self.block, self.mlp_abs, y.reshape(B, -1, C)).flatten(1).norm(dim=-1)
        return err

    def jacobian(self, y: torch.Tensor):
        """(J (B, n, n), rounding bound on ||fl(J) - J||_2 per sample) at states y (B, H, W, C)."""
        B, C = y.shape[0], y.shape[-1]
        D1, _, D2 = token_jacobians(self.block, y, full=True)  # (B, N, C, C)
        N = D1.shape[1]
        n = N * C
        J = torch.einsum("anc,bncd->band", self.T_cols.permute(1, 0, 2), D1).reshape(B, n, n)
        if D2 is not None:
            idx = torch.arange(N, device=y.device)
            J.view(B, N, C, N, C)[:, idx, :, idx, :] += D2.transpose(0, 1)
        return J, self._forming_error(y, D1)

    def _space(self, name: str, shape, like: torch.Tensor) -> torch.Tensor:
        """A work array of `shape` kept between calls: a fresh n x n buffer per call costs its page faults, about
        as much as filling it (2 ms at n = 768)."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)

    def symmetric(self, y: torch.Tensor, *, reuse: bool = False):
        """(S (B, n, n), err): S = fl(sym(J)) formed without J itself (one product and one transposed sum, no
        other n x n pass) and err >= ||S - sym(J_exact)||_2 per sample: J's forming error plus the sum's.
        The sum: S = fl(P/2 + (P/2)^T) with P/2 = fl(T (D1 / 2)) (halving is exact), then fl(sym(D2)) added on the
        diagonal blocks; three roundings of at most u each entrywise, so ||S - sym(fl(J))||_F <= 3u (||P||_F +
        ||D2||_F) with ||P||_F <= || |T| || ||D1||_F + J's forming error, plus (C + 8) eta per entry for
        underflow (proofs/S5.md, Lemma 3). reuse: S lives in a work array that the next call overwrites."""
        B, C = y.shape[0], y.shape[-1]
        D1, _, D2 = token_jacobians(self.block, y, full=True)  # (B, N, C, C)
        N = D1.shape[1]
        n = N * C
        # G[i] = T's token-i columns times D1_{b,i} / 2, every b at once: (i, token, channel, b, c)
        G = self._space("G", (N, n, B * C), y)
        torch.bmm(self.T_cols, (D1 * 0.5).permute(1, 2, 0, 3).reshape(N, C, B * C), out=G)
        G = G.view(N, N, C, B, C)
        S = self._space("S", (B, N, C, N, C), y) if reuse else y.new_empty(B, N, C, N, C)
        # S[b, i', c', i, c] = J[(i', c'), (i, c)] / 2 + J[(i, c), (i', c')] / 2
        torch.add(G.permute(3, 1, 2, 0, 4), G.permute(3, 0, 4, 1, 2), out=S)
        err = self._forming_error(y, D1)
        u = unit_roundoff(y.dtype)
        size = self.T_abs_norm * D1.flatten(1).norm(dim=-1) + err
        if D2 is not None:
            idx = torch.arange(N, device=y.device)
            S[:, idx, :, idx, :] += ((D2 + D2.transpose(-1, -2)) * 0.5).transpose(0, 1)
            size = size + D2.flatten(1).norm(dim=-1)
        err = err + 3 * u * size * (1 + gamma(n * n + 4, u)) + n * (C + 8) * tiny_subnormal(y.dtype)
        return S.view(B, n, n), err

    def _guesses(self, y: torch.Tensor) -> torch.Tensor | None:
        """For each state of y, the cached eigenvector of the nearest state certified before (batches of points of
        several samples come in varying sizes and orders: the nearest state is the best guess whatever the order)."""
        if self.vec is None:
            return None
        idx = torch.cdist(y.reshape(y.shape[0], -1), self.states).argmin(1)
        return self.vec[idx]

    def __call__(self, y: torch.Tensor, eps_J: float) -> torch.Tensor:
        S, err = self.symmetric(y, reuse=True)
        m = S.shape[0]
        u = unit_roundoff(S.dtype)
        guess = self._guesses(y)
        out = torch.full((m,), math.inf, dtype=S.dtype, device=S.device)
        ok = torch.zeros(m, dtype=torch.bool, device=S.device)
        vec = None
        if guess is not None:
            q = torch.einsum("bi,bij,bj->b", guess, S, guess)  # <= lambda_max: the certificate is tight
            ok, val = _cholesky_certifies(S, q + self.pad * (1 + q.abs()), u, overwrite=True)  # S is used up
            out = torch.where(ok, val, out)
            vec = guess.clone()
        todo = ~ok
        if bool(todo.any()):  # an eigensolver only where the guess's Cholesky certificate failed
            # formed again (into the same work array): the certificate factorised S
            St = S if guess is None else self.symmetric(y[todo], reuse=True)[0]
            w, v = top_eigenpairs(St)
            out[todo] = verified_lambda_max(St, lam=w)
            if vec is None:
                vec = v
            else:
                vec[todo] = v
            self.eigensolves += 1
        self.vec, self.states = vec, y.reshape(m, -1).clone()
        return out + err


def symmetric_part(J: torch.Tensor, err: torch.Tensor):
    """(fl((J + J^T) / 2), err + u ||J||_F): the symmetric part of formed Jacobians J (B, n, n) whose forming error
    is err; the sum and the halving add at most u |J_ij + J_ji| / 2 per entry."""
    return (J + J.transpose(-1, -2)) / 2, err + unit_roundoff(J.dtype) * torch.linalg.matrix_norm(J)


def dense_lognorm(block, y: torch.Tensor, eps_J: float) -> torch.Tensor:
    """Upper bounds on mu_2(J_F(y_b)) for every sample of y (B, H, W, C): exact up to verified rounding."""
    return DenseLogNorm(block, y.shape[1], y.shape[2], dtype=y.dtype, device=y.device)(y, eps_J)


def ln_scale(norm, x: torch.Tensor) -> torch.Tensor:
    """max|gamma| / sqrt(var_i + eps) per token of x (..., C): the bound on ||J_LN(x_i)||_2 (1 for Identity)."""
    if isinstance(norm, nn.Identity):
        return torch.ones(x.shape[:-1], dtype=x.dtype, device=x.device)
    g = norm.weight.abs().max() if norm.weight is not None else 1.0
    return g / (x.var(dim=-1, unbiased=False) + norm.eps).sqrt()


def _mlp_abs_product(block, fk) -> float:
    """|| |W2| ||_2 sup|GELU'| || |W1| ||_2 (rounded up), 0 without an MLP."""
    if block.mlp is None:
        return 0.0
    from .. import symbolic
    w1, w2 = block.mlp.fc1.weight.detach().to(**fk), block.mlp.fc2.weight.detach().to(**fk)
    return _op(w2.abs()) * symbolic.gelu_derivative_sup("exact") * _op(w1.abs())


def _mlp_forming_error(block, mlp_abs: float, x: torch.Tensor) -> torch.Tensor:
    """Per token (..., N) a bound on ||fl(D2_i) - D2_i||_F for D2_i = W2 diag(GELU'(z_i)) W1 J2_i: elementwise
    <= gamma_{hidden + 2C + 16} |W2| |diag GELU'| |W1| |J2_i| (sums of length hidden, then C, and J2_i's own
    centring and scaling), with || |J2_i| ||_F <= ||J_LN2(x_i)|| (sqrt(C) + 2) (|P| <= I + 1 1^T / C + |xh||xh|^T / C,
    ||xh||^2 <= C), times 4 for the elementary functions (erf, exp) in GELU'."""
    C = x.shape[-1]
    hidden = block.mlp.fc1.weight.shape[0]
    K = hidden + 2 * C + 16
    return gamma(K, unit_roundoff(x.dtype)) * mlp_abs * ln_scale(block.norm2, x) * (math.sqrt(C) + 2) * 4


def token_jacobians(block, y: torch.Tensor, full: bool = False):
    """Per-token ||D1_i|| bounds (B, N) and D2_i = J_{MLP o LN2}(y_i) (B, N, C, C), in closed form
    (full=True: (D1 (B, N, C, C), ||D1_i|| bounds, D2)). LayerNorm's Jacobian is diag(g) (I - 1 1^T / C - xh xh^T /
    C) / s: D1 is formed only when asked for, and D2 = A (I - 1 1^T / C - xh xh^T / C) with A = W2 diag(GELU') W1
    diag(g) / s as A minus its two rank-one corrections (row sums and A xh: sums of length C, the same lengths and
    absolute values as the product with the formed Jacobian, without its C^3 product and C x C matrices)."""
    B = y.shape[0]
    C = y.shape[-1]
    x = y.reshape(B, -1, C)

    def ln_parts(norm, x):  # (g, s, xh), or None for no LayerNorm
        if isinstance(norm, nn.Identity):
            return None
        s = (x.var(dim=-1, unbiased=False) + norm.eps).sqrt()
        xh = (x - x.mean(-1, keepdim=True)) / s[..., None]
        g = norm.weight if norm.weight is not None else torch.ones(C, dtype=x.dtype, device=x.device)
        return g, s, xh

    one = torch.ones(x.shape[:-1], dtype=x.dtype, device=x.device)
    p1 = ln_parts(block.norm1, x)
    n1 = one if p1 is None else p1[0].abs().max() / p1[1]
    D1 = None
    if full:
        if p1 is None:
            D1 = torch.eye(C, dtype=x.dtype, device=x.device).expand(*x.shape[:-1], C, C)
        else:
            g, s, xh = p1
            P = torch.eye(C, dtype=x.dtype, device=x.device) - 1.0 / C - xh[..., :, None] * xh[..., None, :] / C
            D1 = g[:, None] * P / s[..., None, None]
    if block.mlp is None:
        return (D1, n1, None) if full else (n1, None)
    p2 = ln_parts(block.norm2, x)
    u = block.norm2(x)
    z = block.mlp.fc1(u)
    dg = torch.special.ndtr(z) + z * torch.exp(-z * z / 2) / math.sqrt(2 * math.pi)  # GELU'(z), exact GELU
    M = (block.mlp.fc2.weight * dg[..., None, :]) @ block.mlp.fc1.weight  # W2 diag(GELU') W1
    if p2 is None:
        D2 = M
    else:
        g, s, xh = p2
        A = M * (g / s[..., None])[..., None, :]  # M diag(g) / s
        D2 = A - A.sum(-1, keepdim=True) / C - (A @ xh[..., :, None]) * xh[..., None, :] / C
    return (D1, n1, D2) if full else (n1, D2)


def _top_vectors(S: torch.Tensor, w: torch.Tensor, v: torch.Tensor, iterations: int = 2) -> torch.Tensor:
    """Approximate top eigenvectors of the symmetric S (..., n, n) with top eigenvalues w, by inverse iteration
    shifted just above w from v: a few batched solves instead of a full eigendecomposition (about 20x the cost of
    the eigenvalues alone at n = 192). Only a guess for the next point's Cholesky certificate: never a bound."""
    n = S.shape[-1]
    shift = w + 1e-9 * (1 + torch.linalg.matrix_norm(S))
    # shift I - S is positive definite (shift > lambda_max): a Cholesky solve amplifies the top eigenvector most
    L, info = torch.linalg.cholesky_ex(shift[..., None, None] * torch.eye(n, dtype=S.dtype, device=S.device) - S)
    good = info == 0
    L = torch.where(good[..., None, None], L, torch.eye(n, dtype=S.dtype, device=S.device))
    v = v + 1.0 / math.sqrt(n)  # a component along every direction, whatever the start
    for _ in range(iterations):
        x = torch.cholesky_solve(v[..., None], L)[..., 0]
        v = torch.where((good & torch.isfinite(x).all(-1))[..., None], x, v)
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(S.dtype).tiny)
    return v


def structured_lognorm(block, k: FieldConstants, y: torch.Tensor, eps_J: float, cache: dict | None = None
                       ) -> torch.Tensor:
    """mu_2(J_F(y_b)) <= ||T|| max_i ||D1_i|| + max_i mu_2(D2_i), per sample (B,), rounding included.
    `cache` (a dict kept by the caller): the per-token top eigenvectors of the last eigen-solved point; the
    Cholesky certificate (Lemma 3) is tried at their Rayleigh quotients + 0.2 % first, so that an eigensolver runs
    only for the tokens where it fails (valid whatever the cached vectors are)."""
    n1, D2 = token_jacobians(block, y)
    u = unit_roundoff(y.dtype)
    first = k.T_norm * n1.amax(-1) * (1 + 8 * u * k.C)
    if D2 is None:
        return first + eps_J
    S = (D2 + D2.transpose(-1, -2)) / 2
    ok = torch.zeros(S.shape[:-2], dtype=torch.bool, device=S.device)
    lam = torch.full(S.shape[:-2], math.inf, dtype=S.dtype, device=S.device)
    if cache is not None and cache.get("vec") is not None and cache["vec"].shape == S.shape[:-1]:
        v = cache["vec"]
        q = torch.einsum("...i,...ij,...j->...", v, S, v)  # <= lambda_max: the certificate is tight when v is good
        ok, lam = _cholesky_certifies(S, q + 2e-3 * (1 + q.abs()), u)
        if bool(ok.all()):
            cache["hits"] = cache.get("hits", 0) + 1
    if not bool(ok.all()):  # the eigensolver only for the tokens whose cached vector did not certify
        Sf = S[~ok]
        w = torch.linalg.eigvalsh(Sf)[..., -1]
        lam = lam.clone()
        lam[~ok] = verified_lambda_max(Sf, lam=w)
        if cache is not None:
            vec = cache["vec"] if cache.get("vec") is not None and cache["vec"].shape == S.shape[:-1] \
                else torch.ones(S.shape[:-1], dtype=S.dtype, device=S.device)
            vec = vec.clone()
            vec[~ok] = _top_vectors(Sf, w, vec[~ok])
            cache["vec"], cache["eigensolves"] = vec, cache.get("eigensolves", 0) + 1
    # forming D2 = W2 diag(GELU') W1 J2: products of length <= hidden + C, a-priori bound with LN2's Jacobian
    n2 = ln_scale(block.norm2, y.reshape(y.shape[0], -1, k.C))
    form = gamma(k.hidden + 2 * k.C + 16, u) * k.W2_abs * k.W1_abs * k.gelu1 * float(n2.max()) * k.C
    return first + lam.amax(-1) + form + eps_J
