"""What the enclosure needs from F = Attn(LN1 x) + MLP(LN2 x) (dense attention, SPEC S5's contrast): the same
interface as `SSoGField`, with the constants of `bounds.attention_field` (proofs/S5.md, "The attention field").

`make_field` picks the field class by the block's mixer."""
from __future__ import annotations

import math

import torch

from ..bounds import attention_field as af
from ..bounds import lognorm as ln
from ..bounds.network import token_variance_lower
from .field import BlockField, SSoGField

ROUNDING_SLACK = 2.0 ** -10  # the float LN1 tokens lie in the ball of radius R (1 + this) (checked in `rounding`)


class AttentionField(BlockField):
    """F = Attn(LN1 x) + MLP(LN2 x): values, constants (`AttentionFieldConstants`), a-priori rounding bounds
    (Lemma A4) and point log-norms: "dense" (mu_2 of the n x n Jacobian formed in closed form, verified by
    Cholesky) or "structured" (mu_2 <= Lip(Attn | D_R) max_i ||D1_i|| + max_i mu_2(D2_i), Lemma 2's bound with
    the attention's Lipschitz constant on the LN1 image in place of ||T||)."""

    def __init__(self, block, H: int, W: int, *, lognorm: str = "auto", dtype=torch.float64, device=None):
        self.block = block
        self.k = af.attention_field_constants(block, H, W, dtype=dtype, device=device)
        dense = self._choose(lognorm, H * W * self.k.C) == "dense"
        # the rounding bounds' constants on the slightly larger ball the float LN1 tokens lie in
        mixer, N = block.mixer, H * W
        self._R_float = self.k.R * (1 + ROUNDING_SLACK)
        self._L_float = af.attention_lipschitz_on_ball(mixer, self._R_float, N, dtype=dtype, device=device)
        self._K2_float = af.attention_curvature_on_ball(mixer, self._R_float, N, dtype=dtype, device=device)
        self._mag = af.rounding_magnitudes(mixer, self._R_float, N, dtype=dtype, device=device)
        self._dense = _DenseLogNorm(self) if dense else None

    def constants(self, v: float) -> dict:
        """The field's constants at token-variance floor v, for reports."""
        return {"mixer": "attention", "mixer_lipschitz": self.k.T_norm, "mixer_curvature": self.k.K2,
                "token_radius": self.k.R, "lipschitz": self.lipschitz(v), "curvature": self.curvature(v)}

    def rounding(self, y: torch.Tensor, v: float):
        """(eps_F per sample, eps_J) with ||fl(F(y)) - F(y)|| <= eps_F and ||fl(J_F(y) w) - J_F(y) w|| <= eps_J ||w||
        at states y (B, H, W, C) of token variance >= v (Lemma A4):

            e_LN = 4 gamma_K (2 + a)   (a LN1 token errs by <= e_LN R; `lognorm.rounding_bounds`' model)
            eps_F = sqrt(N) [ e_LN (L' R + |MLP| rho2 + biases) + (4 gamma_K + theta) out' ]
            eps_J = 2 e_LN (|J_Attn|' l1 + L' l1 + |MLP| l2) + 3 theta |J_Attn|' l1 + e_LN R K2' l1

        L', K2', out', |J_Attn|' on the ball of radius R' = R (1 + 2^-10) (the float tokens stay in it: checked,
        else inf), theta the softmax's relative error (`softmax_score_error`), K = 2 (C + hidden + N + d) + 64."""
        k = self.k
        u = ln.unit_roundoff(y.dtype)
        d = self.block.mixer.head_dim
        K = 2 * (k.C + k.hidden + k.N + d) + 64
        gK = ln.gamma(K, u)
        std = y.var(dim=-1, unbiased=False).sqrt()
        amp = (y.norm(dim=-1) / (math.sqrt(k.C) * std.clamp_min(1e-300))).flatten(1).amax(1)  # (B,)
        e_ln = 4 * gK * (2 + amp)
        if not bool((e_ln * k.R <= self._R_float - k.R).all()):
            inf = torch.full_like(amp, math.inf)
            return inf, math.inf
        theta = af.softmax_score_error(self._mag["score"], K, k.N, u)
        mlp_abs = k.W2_abs * k.gelu1 * k.W1_abs
        eps_F = math.sqrt(k.N) * (e_ln * (self._L_float * k.R + mlp_abs * k.rho2 + k.bias_norm)
                                  + (4 * gK + theta) * self._mag["out"])
        l1, l2 = k.ln_jacobian(1, v), k.ln_jacobian(2, v)
        e = float(e_ln.max())
        eps_J = (2 * e * (self._mag["jacobian"] * l1 + self._L_float * l1 + mlp_abs * l2)
                 + 3 * theta * self._mag["jacobian"] * l1 + e * k.R * self._K2_float * l1)
        return eps_F * (1 + ln.gamma(8, u)), eps_J * (1 + ln.gamma(8, u))

    def jacobian(self, y: torch.Tensor):
        """(J_F (B, n, n) in closed form: J_Attn(LN1 y) D1 + D2, its forming error sqrt(n) eps_J per sample) at
        states y (B, H, W, C); eps_J from `rounding` at y's own proven token-variance floor (each column of J
        is an evaluation of J_F e_k, so ||fl(J) - J||_F <= sqrt(n) eps_J)."""
        B, C = y.shape[0], y.shape[-1]
        x = y.reshape(B, -1, C)
        N = x.shape[1]
        D1, _, D2 = ln.token_jacobians(self.block, y, full=True)  # (B, N, C, C)
        JA = af.attention_jacobian(self.block.mixer, self.block.norm1(x))  # (B, N, C, N, C)
        J = torch.einsum("bickd,bkde->bicke", JA, D1)
        if D2 is not None:
            idx = torch.arange(N, device=y.device)
            J[:, idx, :, idx, :] += D2.transpose(0, 1)
        n = N * C
        v = float(token_variance_lower(y).clamp_min(0).min())
        _, eps_J = self.rounding(y, v)
        return J.reshape(B, n, n), torch.full((B,), math.sqrt(n) * eps_J, dtype=y.dtype, device=y.device)


class _DenseLogNorm(ln.DenseLogNorm):
    """`DenseLogNorm`'s verified top eigenvalue (a Cholesky certificate at the Rayleigh quotient of the nearest
    earlier state's eigenvector, an eigensolver where it fails) on the attention field's closed-form Jacobian."""

    def __init__(self, field: AttentionField):
        self.block, self.field = field.block, field
        self.vec, self.states, self.pad, self.eigensolves = None, None, 2e-3, 0

    def jacobian(self, y: torch.Tensor):
        return self.field.jacobian(y)

    def symmetric(self, y: torch.Tensor, *, reuse: bool = False):
        return ln.symmetric_part(*self.field.jacobian(y))


def make_field(block, H: int, W: int, **kw):
    """The enclosure's field object for this block: `SSoGField` (SSoG mixer) or `AttentionField` (dense
    attention); keyword arguments go to the class (lognorm, dtype, device)."""
    from ..mixers.attention import DenseAttention
    from ..mixers.ssog import SSoG
    if isinstance(block.mixer, SSoG):
        return SSoGField(block, H, W, **kw)
    if isinstance(block.mixer, DenseAttention):
        return AttentionField(block, H, W, **kw)
    raise TypeError(f"the enclosure has fields for the SSoG and DenseAttention mixers; got "
                    f"{type(block.mixer).__name__}, whose constants are not implemented")
