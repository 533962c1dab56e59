"""Constants of the ODE field whose mixer is dense attention, F(x) = Attn(LN1 x) + MLP(LN2 x) (SPEC S5;
proofs/S5.md, "The attention field", Lemmas A1-A4).

Pre-LN puts every token of Z = LN1(x) in the ball of radius R = sqrt(C) max|gamma1| + ||beta1||, so attention
is only ever evaluated on D_R = {Z : ||z_i|| <= R for every token}. Per head (row vectors, A = W_Q W_K^T,
B = W_V W_O, c = b_Q W_K^T, sigma = sqrt(d), p_i = softmax(s_i), s_ij = w_i . z_j / sigma, w_i = z_i A + c):

    Attn(Z)_i = E_{p_i}[z] B + const,      J[U]_i = (E_i[u] + Cov_i(f, z)) B,      f_j = ds_ij[U]
    D^2[U, V]_i = (Cov_i(h, u) + Cov_i(f, v) + Cov_i(e, z) + E_i[(h - h_bar)(f - f_bar)(z - z_bar)]) B

(h = ds_i[V], e = d^2 s_i[U, V]; the covariances are softmax's first and second derivatives written as moments
of p_i). On D_R each moment is bounded by Cauchy-Schwarz in the weights p_ij (`attention_curvature_on_ball`):

    ||D^2 Attn(Z)[U, V]||_F <= K2(R) max_j ||u_j|| ||V||_F,
    ||D^2 Attn(Z)[U, U]||_F <= K2(R) (sum_j ||u_j||^4)^(1/2),

the two forms the enclosure uses (Lemma 2: ||J_F(x) - J_F(z)|| <= M2 max_i ||x_i - z_i||; the defect's
||D^2 F[y', y']|| <= M2 (sum_i sup ||y_i'||^4)^(1/2)). `AttentionFieldConstants` combines them with LayerNorm's
and the MLP's constants; `rounding_magnitudes` gives the absolute-value evaluations the a-priori rounding bounds
need (`lipcheck.wellposed.attention_field`).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..mixers.attention import DenseAttention
from ..rounding import gamma
from .attention import _check_args, _head_norms, attention_lipschitz_on_ball, head_matrices, layernorm_image_radius
from .lognorm import FieldConstants, _op, norm_mlp_numbers

U64 = torch.finfo(torch.float64).eps / 2
# float64 operations per head in the assembly of K2 (below 30, counted in proofs/S5.md Lemma A2) and of the
# rounding magnitudes, with margin; every quantity is >= 0, so k roundings change a result by a factor 1 +- gamma_k
_CURVATURE_OPS = 64


def curvature_terms(nA: float, nB: float, nc: float, sd: float, R: float, N: int) -> dict:
    """One head's four parts of K2 (Lemma A2), unrounded: with a = ||A||, w = a R + ||c|| (>= ||w_i||),
    k = a R + w, the per-row bound is ||B|| max_j ||u_j|| (alpha_i X + beta_i Y) with alpha_i = ||v_i||,
    beta_i = (E_i ||v||^2)^(1/2), ||alpha|| = ||V||_F, ||beta|| <= sqrt(N) ||V||_F:

        X = 2 a R / sigma + 2 a R^2 k / sigma^2,      Y = 2 k / sigma + 2 R w k / sigma^2."""
    aR = nA * R
    w = aR + nc
    k = aR + w
    s2 = sd * sd
    return {"own_first": nB * 2 * aR / sd, "own_second": nB * 2 * aR * R * k / s2,
            "others_first": nB * math.sqrt(N) * 2 * k / sd, "others_second": nB * math.sqrt(N) * 2 * R * w * k / s2}


def attention_curvature_on_ball(layer: DenseAttention, token_radius: float, num_tokens: int, *,
                                dtype=torch.float64, device=None) -> float:
    """K2(R): a certified upper bound on sup ||D^2 Attn(Z)[U, V]||_F / (max_j ||u_j|| ||V||_F) over Z in D_R
    (every token norm <= R), which also bounds ||D^2 Attn(Z)[U, U]||_F / (sum_j ||u_j||^4)^(1/2) (Lemma A2):

        K2 = sum_h ||B_h|| [ 2 a R / sigma + 2 a R^2 k / sigma^2 + sqrt(N) (2 k / sigma + 2 R w k / sigma^2) ]

    with a = ||A_h||, w = a R + ||c_h||, k = a R + w. The norms are `_head_norms`' certified upper bounds (the
    products W_Q W_K^T, W_V W_O formed in `dtype` with their rounding covered, proofs/S4.md 'Rounding'); the
    nonnegative assembly is rounded up by 1 + gamma_{64 h + 8}. Grows like R^3 (the third moment of softmax)."""
    R, N = _check_args(token_radius, num_tokens)
    nA, nB, nc, sd = _head_norms(layer, dtype=dtype, device=device)
    total = sum(sum(curvature_terms(a, b, c, sd, R, N).values()) for a, b, c in zip(nA, nB, nc))
    return _up(total, layer.num_heads, "attention curvature")


def _up(value: float, heads: int, what: str) -> float:
    out = value * (1 + gamma(_CURVATURE_OPS * heads + 8, U64))
    if not math.isfinite(out):
        raise ValueError(f"the {what} bound overflows float64 ({value}): the weights or the token radius are too "
                         f"large for a finite certified bound; rescale them")
    return out


def rounding_magnitudes(layer: DenseAttention, token_radius: float, num_tokens: int, *, dtype=torch.float64,
                        device=None) -> dict:
    """Absolute-value evaluations of attention on D_R (Lemma A4), per token, each rounded up:

    - out: sum_h || |W_O^h| || (|| |W_V^h| || R + ||b_V^h||) + ||b_O|| >= || |W_O|^T sum_j p_ij |v_j| + |b_O| ||;
    - score: max_h (|| |W_Q^h| || R + ||b_Q^h||)(|| |W_K^h| || R + ||b_K^h||) / sqrt(d) >= |q_i|.|k_j| / sqrt(d);
    - jacobian: the Lipschitz formula of `attention_lipschitz_on_ball` on absolute values (||A_h|| ->
      || |W_Q^h| || || |W_K^h| ||, ||B_h|| -> || |W_V^h| || || |W_O^h| ||, ||c_h|| -> ||b_Q^h|| || |W_K^h| ||),
      the magnitude of the closed-form Jacobian's evaluation."""
    R, N = _check_args(token_radius, num_tokens)
    m = head_matrices(layer, dtype=dtype, device=device)
    sd = math.sqrt(layer.head_dim)
    out = float(m["bO"].norm())
    score = jac = 0.0
    for h in range(layer.num_heads):
        q, k, v, o = (_op(m[key][h].abs()) for key in ("WQ", "WK", "WV", "WO"))
        bq, bk, bv = (float(m[key][h].norm()) for key in ("bQ", "bK", "bV"))
        out += o * (v * R + bv)
        score = max(score, (q * R + bq) * (k * R + bk) / sd)
        a, b, c = q * k, v * o, bq * k
        jac += b * (math.sqrt(N) + R * R * a / sd + math.sqrt(N) * R * (R * a + c) / sd)
    return {"out": _up(out, layer.num_heads, "attention magnitude"),
            "score": _up(score, layer.num_heads, "score magnitude"),
            "jacobian": _up(jac, layer.num_heads, "attention Jacobian magnitude")}


@dataclasses.dataclass
class AttentionFieldConstants(FieldConstants):
    """`FieldConstants` with T_norm = Lip(Attn | D_R) (the mixer's Jacobian norm on the LN1 image, in place of
    ||T||) and the attention curvature K2(R): lipschitz(v) is inherited (Lip(Attn) l1(v) + Lip(MLP) l2(v)),
    curvature(v) adds K2 l1(v)^2 to the inherited Lip(Attn) c1(v) + MLP terms (Lemma A3)."""
    K2: float = 0.0  # attention's curvature constant on D_R
    R: float = 0.0  # the token radius (LN1's image, rounded up)
    heads: int = 1

    def curvature(self, v: float) -> float:
        l1 = self.ln_jacobian(1, v)
        # the inherited part and K2 l1^2, each a few float64 operations: rounded up together by 1 + gamma_8
        return (super().curvature(v) + self.K2 * l1 * l1) * (1 + gamma(8, U64))

    def curvature_parts(self, v: torch.Tensor) -> list:
        """`FieldConstants.curvature_parts` (Lip(Attn) in ||T||'s place) and K2 (sum_j l1(v_j)^4 ||u_j||^4)^(1/2)
        for D^2 Attn[D Lambda u, D Lambda u] (Lemma A3's quadratic form token by token); unrounded."""
        l1, _ = self._ln_tokens(1, v)
        return super().curvature_parts(v) + [(self.K2, l1 * l1)]

    def lipschitz(self, v: float) -> float:
        return super().lipschitz(v) * (1 + gamma(4, U64))


def attention_field_constants(block, H: int, W: int, *, dtype=torch.float64, device=None) -> AttentionFieldConstants:
    """The constants of F = Attn(LN1 x) + MLP(LN2 x) on an H x W grid. Needs LN1 (a LayerNorm): without it the
    tokens attention sees are unbounded and no finite constant exists (S4)."""
    if not isinstance(block.mixer, DenseAttention):
        raise TypeError(f"block.mixer must be a DenseAttention, got {type(block.mixer).__name__}")
    if not isinstance(block.norm1, torch.nn.LayerNorm):
        raise ValueError("block has no LayerNorm before its attention (use_norm=False): the tokens attention sees "
                         "are unbounded and its Jacobian has no finite bound (S4); use a pre-LN block")
    fk = dict(dtype=dtype, device=device)
    shared = norm_mlp_numbers(block, fk)
    N = H * W
    R = layernorm_image_radius(block.norm1)
    L = attention_lipschitz_on_ball(block.mixer, R, N, dtype=dtype, device=device)
    K2 = attention_curvature_on_ball(block.mixer, R, N, dtype=dtype, device=device)
    mag = rounding_magnitudes(block.mixer, R, N, dtype=dtype, device=device)
    shared["rho1"] = R
    return AttentionFieldConstants(N=N, T_norm=L, T_abs=mag["jacobian"], K2=K2, R=R, heads=block.mixer.num_heads,
                                   **shared)


def softmax_score_error(score: float, K: int, N: int, u: float = U64) -> float:
    """theta >= the relative error of every computed softmax weight (Lemma A4): the scores err by at most
    delta = gamma_K score in absolute value, which moves each weight by a factor within exp(+-2 delta) (relative
    error a = 2 delta e^{2 delta}), and exp, the sum of N terms and the division add b = gamma_{N+8}; composed,
    (1 + a)(1 + b) - 1 = a + b + a b, rounded up by 1 + gamma_4 (four float operations on nonnegative numbers)."""
    delta = gamma(K, u) * score
    if not 2 * delta < 1:
        return math.inf
    a, b = 2 * delta * math.exp(2 * delta), gamma(N + 8, u)
    return (a + b + a * b) * (1 + gamma(4, u))


def attention_jacobian(layer: DenseAttention, z: torch.Tensor) -> torch.Tensor:
    """J_Attn(Z) in closed form, (B, N, C, N, C) for tokens z (B, N, C): entry [b, i, c, k, e] is
    d Attn(Z)_{i c} / d z_{k e}. Per head, as a map of row vectors t -> J[t]_i = sum_k t_k M_ik,

        M_ik = [ p_ik (I + w_i^T (z_k - zbar_i) / sigma) + [i = k] A Sigma_i / sigma ] B

    (the value path, the keys' and the query's perturbation; Sigma_i = Cov_{p_i}(z), proofs/S4.md)."""
    m = head_matrices(layer, dtype=z.dtype, device=z.device)
    Bn, N, C = z.shape
    sd = math.sqrt(layer.head_dim)
    eye = torch.eye(C, dtype=z.dtype, device=z.device)
    idx = torch.arange(N, device=z.device)
    J = torch.zeros(Bn, N, C, N, C, dtype=z.dtype, device=z.device)
    for h in range(layer.num_heads):
        q = z @ m["WQ"][h] + m["bQ"][h]
        k = z @ m["WK"][h] + m["bK"][h]
        p = torch.softmax(q @ k.transpose(-1, -2) / sd, dim=-1)  # (B, N, N)
        w = q @ m["WK"][h].T  # w_i = z_i A + c (+ b_Q W_K^T): the key-side gradient of s_ij
        dz = z[:, None, :, :] - (p @ z)[:, :, None, :]  # (B, N_i, N_k, C): z_k - zbar_i
        sigma = torch.einsum("bik,bikc,bikd->bicd", p, dz, dz)
        M = p[..., None, None] * (eye + torch.einsum("bic,bikd->bikcd", w, dz) / sd)
        M[:, idx, idx] += (m["A"][h] @ sigma) / sd
        J += (M @ m["B"][h]).permute(0, 1, 4, 2, 3)
    return J


__all__ = ["attention_curvature_on_ball", "attention_field_constants", "attention_jacobian", "AttentionFieldConstants",
           "curvature_terms", "rounding_magnitudes", "softmax_score_error"]
