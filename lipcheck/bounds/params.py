"""The fixed-kernel SSoG layer as numbers (SSoGParams), read from a module, normalised by powers of two, and the
guards every bound shares: finite values, grid sizes, outward rescaling, one LAPACK thread."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys

import torch

from .. import gaussian, rounding


def _finite(x: float, what: str) -> float:
    """NaN/inf is never a bound: refuse with the quantity's name."""
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{what} came out {x}: not certified. Its inputs are finite, so the layer's scale is "
                         f"outside what the dtype can bound; rescale the weights or certify in float64")
    return x


def require_finite(q: "SSoGParams", what: str) -> None:
    """NaN/inf in any of the numbers a bound reads: refuse, naming the parameter."""
    for name, t in (("alpha", q.alpha), ("mu", q.mu), ("sigma", q.sigma), ("W_V", q.WV), ("W_O", q.WO)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} has NaN/inf entries: the {what} is not certified; fix the layer")


def _scale_back(v: float, e: int, *, up: bool) -> float:
    """v 2^e, rounded outward (up for an upper bound, down for a lower one) where it leaves the normal range."""
    if math.isnan(v) or (math.isinf(v) and not up):
        raise ValueError(f"a bound came out {v}: not certified")
    if v == 0.0:
        return 0.0
    try:
        r = math.ldexp(v, e)
    except OverflowError:
        r = math.inf
    if math.isinf(r):
        if up:
            raise ValueError(f"the Lipschitz bound {v:.6g} * 2^{e} exceeds the float64 range: not certified; "
                             f"rescale the layer's weights (alpha, v_proj, o_proj)")
        return math.nextafter(math.inf, 0.0)
    if r < sys.float_info.min:  # subnormal: ldexp rounded to nearest
        r = math.nextafter(r, math.inf if up else 0.0)
    return r


@contextlib.contextmanager
def single_thread():
    """Dense LAPACK calls on small matrices run far faster on one thread when the cores are shared
    (measured: a 384 x 384 complex SVD 0.15 s on one thread, over 10 s on two busy ones)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@dataclasses.dataclass
class SSoGParams:
    """Fixed-kernel SSoG as numbers: alpha (h, M), mu, sigma (h, M, 2), W_V, W_O (C, C), P_h via heads.

    The layer's operator is 2^log2_scale times the operator of these numbers (see `normalised`);
    conversion_error bounds the relative rounding of reading the layer's weights into this dtype."""
    alpha: torch.Tensor
    mu: torch.Tensor
    sigma: torch.Tensor
    WV: torch.Tensor  # X @ WV is the value projection
    WO: torch.Tensor  # Y @ WO is the output projection (without bias)
    log2_scale: int = 0
    conversion_error: float = 0.0

    @property
    def num_heads(self) -> int:
        return self.alpha.shape[0]

    @property
    def dim(self) -> int:
        return self.WV.shape[0]

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def u(self) -> float:
        return rounding.unit_roundoff(self.WV.dtype)

    def gamma(self, n: float) -> float:
        return rounding.gamma(n, self.WV.dtype)

    def head_projections(self) -> torch.Tensor:
        d = self.head_dim
        return torch.stack([self.WV[:, i * d:(i + 1) * d] @ self.WO[i * d:(i + 1) * d, :]
                            for i in range(self.num_heads)])

    def head_frobenius(self) -> torch.Tensor:
        """F_h >= ||W_V,h||_F ||W_O,h||_F >= || |W_V,h| |W_O,h| ||_2: the scale of every rounding error in P_h."""
        d, h = self.head_dim, self.num_heads
        fv = self.WV.reshape(self.dim, h, d).square().sum((0, 2)).sqrt()
        fo = self.WO.reshape(h, d, self.dim).square().sum((1, 2)).sqrt()
        return fv * fo * (1 + self.gamma(2 * self.dim * d + 4))

    def magnitude(self) -> float:
        """B = sum_h F_h sum_m |alpha[h, m]| >= ||T|| and >= the norm of T with every entry replaced by its
        modulus: every rounding error below is a multiple of B (proofs/S2.md, 'rounding margins')."""
        return float((self.head_frobenius() * self.alpha.abs().sum(1)).sum()) * (1 + self.gamma(self.alpha.shape[1] + self.num_heads + 2))


def _pow2_exponent(t: torch.Tensor) -> int:
    """e with max|t| 2^-e in [1/2, 1) (0 for an all-zero tensor)."""
    m = float(t.abs().max()) if t.numel() else 0.0
    return math.frexp(m)[1] if m > 0 else 0


def _ldexp(t: torch.Tensor, e: int) -> torch.Tensor:
    """t 2^e in two exact halves (2^e alone may overflow a double); exact unless an entry leaves the normal range."""
    a = e // 2
    return t * (2.0 ** a) * (2.0 ** (e - a))


def normalised(p: SSoGParams) -> SSoGParams:
    """The same operator with max|alpha|, max|W_V|, max|W_O| in [1/2, 1), the power of two moved to
    log2_scale. Scaling by powers of two is exact (up to entries that underflow, covered by the
    margins through the smallest normal number), so every bound of the normalised operator times
    2^log2_scale bounds the layer, at any scale of alpha and weights the dtype can hold."""
    ea, ev, eo = _pow2_exponent(p.alpha), _pow2_exponent(p.WV), _pow2_exponent(p.WO)
    if ea == ev == eo == 0:
        return p
    return dataclasses.replace(p, alpha=_ldexp(p.alpha, -ea), WV=_ldexp(p.WV, -ev), WO=_ldexp(p.WO, -eo),
                               log2_scale=p.log2_scale + ea + ev + eo)


def check_layer_dtype(layer) -> None:
    """Half-precision layers are refused: their kernel exponents overflow at ordinary widths."""
    dt = layer.alpha.dtype
    if dt not in (torch.float32, torch.float64):
        raise ValueError(f"layer parameters are {dt}: a {dt} SSoG layer is not certified (its kernel exponents "
                         f"-(k - mu)^2 / (2 sigma^2) overflow at ordinary widths); convert it with layer.float() "
                         f"or layer.double() and certify that")


def ssog_params(layer, *, dtype=torch.float64, device=None) -> SSoGParams:
    """Read alpha, mu, sigma, W_V, W_O from an SSoG module in `dtype`; non-finite values raise.

    The kernel must be representable both in the layer's own dtype (else its forward pass is NaN)
    and in `dtype` (else its bound is)."""
    if not all(hasattr(layer, a) for a in ("gaussian_params", "v_proj", "o_proj")):
        raise TypeError(f"layer must be a lipcheck SSoG module, got {type(layer).__name__}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"certification dtype must be torch.float32 or torch.float64, got {dtype}")
    check_layer_dtype(layer)
    device = torch.device(device) if device is not None else layer.alpha.device
    with torch.no_grad():
        raw = [t.detach() for t in layer.gaussian_params()]
        raw += [layer.v_proj.weight.detach().T, layer.o_proj.weight.detach().T]
    for name, t in zip(("alpha", "mu", "sigma", "v_proj.weight", "o_proj.weight"), raw):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"layer parameter {name} has non-finite entries; a Lipschitz bound of a layer "
                             f"with NaN/inf weights is meaningless: reinitialise or fix the weights first")
    gaussian.check_representable(raw[1], raw[2], raw[2].dtype, name="the layer's kernel (its own dtype)")
    alpha, mu, sigma, WV, WO = (t.to(device=device, dtype=dtype) for t in raw)
    gaussian.check_representable(mu, sigma, dtype, name=f"the kernel in the certification dtype {dtype}")
    for name, t0, t in zip(("alpha", "mu", "sigma", "v_proj.weight", "o_proj.weight"), raw, (alpha, mu, sigma, WV, WO)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"layer parameter {name} overflows {dtype}; certify in float64")
    # reading float64 weights into float32 rounds each entry once (relative u): a perturbation of the operator
    conv = 3 * rounding.gamma(3, dtype) if torch.finfo(raw[0].dtype).bits > torch.finfo(dtype).bits else 0.0
    return SSoGParams(alpha, mu, sigma, WV, WO, conversion_error=conv)


def _no_nan(t: torch.Tensor, what: str) -> torch.Tensor:
    if bool(torch.isnan(t).any()) or bool(torch.isinf(t).any()):
        raise ValueError(f"{what} has NaN/inf entries: not certified (a non-finite symbol or SVD); "
                         f"check the layer's kernel (sigma, mu) and weights, or certify in float64")
    return t


def _check_grid_size(H, W):
    for name, v in (("H", H), ("W", W)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer grid size, got {v!r}")
