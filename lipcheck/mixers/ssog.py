"""SSoG: separable sum-of-Gaussians token mixing (SPEC section 1).

    SSoG(X) = sum_h K_h X P_h + b,   K_h = sum_m alpha[h, m] G_H(mu_y, sigma_y) kron G_W(mu_x, sigma_x)

The pure function `ssog_mix` applies sum_m alpha G_H V G_W^T per head without ever building the
N x N matrix; the backends in `BACKENDS` are interchangeable implementations of it. The module
`SSoG` is a thin shell: value projection (no bias, so that the affine part is exactly b), the
mixing, the output projection.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import gaussian

SIGMA_FLOOR = 1e-3  # sigma = softplus(raw) + floor keeps every width strictly positive
CHOICE_REFRESH = 32  # builds of one grid's factors between two evaluations of the backend cost model


def _check_grid(x: torch.Tensor, num_heads: int) -> None:
    if x.dim() != 5:
        raise ValueError(f"values must have shape (B, H, W, heads, head_dim), got {tuple(x.shape)}")
    if x.shape[3] != num_heads:
        raise ValueError(f"values have {x.shape[3]} heads, the kernels {num_heads}")


def axis_factors(H: int, W: int, alpha, mu, sigma):
    """alpha-weighted G_H and plain G_W, shapes (h, M, H, H) and (h, M, W, W)."""
    GH = gaussian.axis_matrix(H, mu[..., 0], sigma[..., 0]) * alpha[..., None, None]
    GW = gaussian.axis_matrix(W, mu[..., 1], sigma[..., 1])
    return GH, GW


def _prepare_matmul(H, W, alpha, mu, sigma):
    return axis_factors(H, W, alpha, mu, sigma)


def _apply_matmul(v, GH, GW):
    """Dense axis factors: O(B C M (H^2 W + H W^2)) multiply-adds."""
    t = torch.einsum("hmjl,bilhd->bhmijd", GW, v)  # along x
    return torch.einsum("hmik,bhmkjd->bijhd", GH, t)  # along y, summed over components


# ---------------------------------------------------------------------------------------------
# Fast backends. All read the taps g(k; mu, sigma) from lipcheck.gaussian.kernel at the integer
# offsets k = i - i' (the same numbers axis_matrix puts in G_n) and differ only in how they apply
# them: stacked GEMMs (dense factors, components stacked so each axis is one batched GEMM),
# truncated depthwise convolution (taps beyond a radius cut, error bound below), FFT (exact
# linear convolution by zero padding to >= 2n - 1).


def _taps(r: int, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """g(k; mu, sigma) for k = -r..r, shape mu.shape + (2r + 1,).

    Values below the dtype's smallest normal number are set to zero: subnormal floats slow every
    later multiply by an order of magnitude on x86 and change nothing above 1e-308 (float64) or
    1e-38 (float32) absolute.
    """
    k = torch.arange(-r, r + 1, dtype=mu.dtype, device=mu.device)
    g = gaussian.kernel(k, mu[..., None], sigma[..., None])
    return torch.where(g < torch.finfo(g.dtype).tiny, torch.zeros((), dtype=g.dtype, device=g.device), g)


def _toeplitz(n: int, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """G_n(mu, sigma) built from its 2n - 1 distinct taps (equal to gaussian.axis_matrix entry by entry)."""
    return _toeplitz_from_taps(n, _taps(n - 1, mu, sigma))


def _axis_taps(H: int, W: int, mu: torch.Tensor, sigma: torch.Tensor):
    """Taps of both axes from one kernel evaluation: g(k) for |k| <= max(H, W) - 1, shape (h, M, 2, 2r+1);
    returns (y taps for |k| <= H - 1, x taps for |k| <= W - 1). One call instead of two halves the
    small operations (and their backward) that building the factors costs."""
    r = max(H, W) - 1
    taps = _taps(r, mu, sigma)
    return taps[..., 0, r - (H - 1):r + H], taps[..., 1, r - (W - 1):r + W]


def _toeplitz_from_taps(n: int, taps: torch.Tensor) -> torch.Tensor:
    """G_n[i, i'] = taps[i - i' + n - 1] for taps over k = -(n-1)..n-1."""
    idx = torch.arange(n, device=taps.device)
    return taps[..., (idx[:, None] - idx[None, :]) + (n - 1)]


def _prepare_stacked(H, W, alpha, mu, sigma):
    """[G_W^1; ...; G_W^M] (h, M W, W) with rows (m, j), and [alpha_m G_H^m[i, k]] (h, H, H M) with
    columns (k, m)."""
    h, M = alpha.shape
    ty, tx = _axis_taps(H, W, mu, sigma)
    GW = _toeplitz_from_taps(W, tx).reshape(h, M * W, W)  # rows (m, j)
    GH = _toeplitz_from_taps(H, ty * alpha[..., None])  # (h, M, H, H) [m, i, k]
    return GW, GH.permute(0, 2, 3, 1).reshape(h, H, H * M)  # [i, (k, m)]


def _apply_stacked(v, GW, GH):
    """Dense axis factors as GEMMs with the M components stacked.

    x axis: [G_W^1; ...; G_W^M] (M W x W) times every (W x d) slab v[b, k, :, h, :], giving
    T[b, k, m, j, e]; y axis: [alpha_m G_H^m[i, k]] with columns ordered (k, m) (H x H M) times T
    viewed as (H M x W d), so the sum over components happens inside the GEMM's contraction. Same
    multiply-adds as "matmul", fewer and larger GEMMs.

    Two layouts of the same products, chosen by what follows:
    - no autograd: per head, straight on the strided slabs of v (no copy in; one stack out);
    - autograd: head-major, one batched GEMM per axis over all heads (one copy in, one out). Its
      backward is two batched GEMMs per axis instead of a dozen small ones over strided slices and the
      stack's slicing, 1.4-2x faster for a training step on a CPU.
    """
    if torch.is_grad_enabled() and (v.requires_grad or GW.requires_grad or GH.requires_grad):
        return _apply_stacked_heads(v.permute(3, 0, 1, 2, 4), GW, GH).permute(1, 2, 3, 0, 4)
    B, H, W, h, d = v.shape
    M = GW.shape[1] // W
    outs = []
    for i in range(h):
        t = torch.matmul(GW[i], v[:, :, :, i, :].reshape(B * H, W, d))  # (B H, M W, d) = [b, k, m, j, e]
        outs.append(torch.matmul(GH[i], t.view(B, H * M, W * d)).view(B, H, W, d))
    return torch.stack(outs, 3)


def _apply_stacked_heads(vh, GW, GH):
    """The stacked products on head-major values vh (h, B, H, W, d), returning (h, B, H, W, d)."""
    h, B, H, W, d = vh.shape
    M = GW.shape[1] // W
    T = torch.matmul(GW[:, None], vh.reshape(h, B * H, W, d))  # (h, B H, M W, d) = [h, b, k, m, j, e]
    return torch.matmul(GH[:, None], T.view(h, B, H * M, W * d)).view(h, B, H, W, d)


def truncation_tol(dtype: torch.dtype) -> float:
    """Largest mass of one normalised 1-D factor the truncated backend may drop: eps(dtype) / 4
    (5.6e-17 in float64, 3.0e-8 in float32), below the rounding of the kept sum."""
    return torch.finfo(dtype).eps / 4


def truncation_radius(n: int, mu: torch.Tensor, sigma: torch.Tensor, tol: float) -> int:
    """Smallest common radius r <= n - 1 such that every component drops at most `tol` of its mass.

    Bound. Take r >= |mu| + t sigma. The lattice point nearest mu is kept, so Z >= exp(-1/(8 sigma^2));
    the dropped offsets lie at distance D >= t sigma + 1 from mu, at most one per unit step on each
    side, so the dropped mass is
        sum_drop g <= 2 exp(-(D^2 - 1/4) / (2 sigma^2)) / (1 - exp(-D / sigma^2))
                   <= 2 exp(-t^2 / 2) (1 + sigma / t).
    t = sqrt(2 ln(2 (1 + sigma / t0) / tol)) with t0 = sqrt(2 ln(2 / tol)) <= t makes this <= tol.
    r = n - 1 keeps every offset of an n-point axis: then the cut is exact.
    """
    if not 0 < tol < 1:
        raise ValueError(f"tol must lie in (0, 1), got {tol}")
    mu, sigma = mu.detach().double(), sigma.detach().double()
    t0 = math.sqrt(2 * math.log(2 / tol))
    t = torch.sqrt(2 * torch.log(2 * (1 + sigma / t0) / tol))
    r = math.ceil(float((mu.abs() + t * sigma).max()))
    return max(0, min(int(n) - 1, r))


def _prepare_truncated(H, W, alpha, mu, sigma, tol=None):
    """Per component m: (r_y, r_x, y taps alpha_m g_y,m flipped, x taps g_x,m flipped), each
    component with its own radii (the largest over heads), so narrow components cost few taps."""
    M = alpha.shape[1]
    tol = truncation_tol(mu.dtype) if tol is None else tol
    out = []
    for m in range(M):
        ry = truncation_radius(H, mu[:, m, 0], sigma[:, m, 0], tol)
        rx = truncation_radius(W, mu[:, m, 1], sigma[:, m, 1], tol)
        # conv2d is a cross-correlation, out[i] = sum_t w[t] x[i + t - r], so w[t] = g(r - t): flip the taps.
        gx = _taps(rx, mu[:, m, 1], sigma[:, m, 1]).flip(-1)  # (h, 2rx+1)
        gy = (_taps(ry, mu[:, m, 0], sigma[:, m, 0]) * alpha[:, m, None]).flip(-1)  # (h, 2ry+1)
        out.append((ry, rx, gy, gx))
    return tuple(out)


def _apply_truncated(v, *components):
    """Truncated depthwise convolution along each axis: O(B C N sum_m (r_x,m + r_y,m)) multiply-adds.

    Per component m: a depthwise convolution along x with g_x,m, then one along y with alpha_m g_y,m,
    summed over m. The convolution's zero padding is exactly the zero padding of the Toeplitz
    factors. Error per output entry <= sum_m |alpha_m| (eps_y + eps_x + eps_y eps_x) max|v| with
    eps <= tol (see truncation_radius): below float rounding at the default tol.
    """
    B, H, W, h, d = v.shape
    C = h * d
    # (B, H, W, C) viewed as (B, C, H, W) is the channels_last layout the depthwise kernels like best.
    x = v.reshape(B, H, W, C).permute(0, 3, 1, 2)
    out = None
    for ry, rx, gy, gx in components:
        wx = gx[:, None].expand(h, d, 2 * rx + 1).reshape(C, 1, 1, 2 * rx + 1)
        wy = gy[:, None].expand(h, d, 2 * ry + 1).reshape(C, 1, 2 * ry + 1, 1)
        y = F.conv2d(F.conv2d(x, wx, padding=(0, rx), groups=C), wy, padding=(ry, 0), groups=C)
        out = y if out is None else out + y
    return out.permute(0, 2, 3, 1).reshape(B, H, W, h, d)


def _mix_truncated(v, alpha, mu, sigma, tol=None):
    """Truncated backend in one call (prepare + apply), with an explicit truncation tolerance."""
    return _apply_truncated(v, *_prepare_truncated(v.shape[1], v.shape[2], alpha, mu, sigma, tol))


def fft_size(n: int) -> int:
    """Smallest 2^a 3^b 5^c >= 2n - 1: linear (not circular) convolution of an n-point axis."""
    m = max(1, 2 * int(n) - 1)
    while True:
        k = m
        for p in (2, 3, 5):
            while k % p == 0:
                k //= p
        if k == 1:
            return m
        m += 1


def _prepare_fft(H, W, alpha, mu, sigma):
    """rfft2 of the summed kernel k_h[a, b] = sum_m alpha g_y(a) g_x(b), |a| < H, |b| < W, zero padded."""
    Lh, Lw = fft_size(H), fft_size(W)
    gy, gx = _axis_taps(H, W, mu, sigma)  # (h, M, 2H-1), (h, M, 2W-1)
    gy = gy * alpha[..., None]
    k2 = torch.einsum("hma,hmb->hab", gy, gx)  # offsets a = -(H-1)..H-1, b likewise
    kpad = F.pad(k2, (0, Lw - (2 * W - 1), 0, Lh - (2 * H - 1)))
    kpad = torch.roll(kpad, shifts=(-(H - 1), -(W - 1)), dims=(1, 2))  # offset 0 at index 0, negatives wrap
    return (torch.fft.rfft2(kpad).permute(1, 2, 0)[..., None],)  # (Lh, Lw//2+1, h, 1)


def _apply_fft(v, khat):
    """2-D FFT convolution with the summed kernel.

    Zero padding to L >= 2n - 1 per axis makes the circular convolution equal the Toeplitz one on the
    n x n output window. O(B C L_H L_W log(L_H L_W)), independent of M and sigma.
    """
    B, H, W, h, d = v.shape
    Lh, Lw = fft_size(H), fft_size(W)
    vhat = torch.fft.rfft2(v, s=(Lh, Lw), dim=(1, 2))  # (B, Lh, Lw//2+1, h, d)
    out = torch.fft.irfft2(vhat * khat, s=(Lh, Lw), dim=(1, 2))
    return out[:, :H, :W]


# Every backend is a pair: prepare(H, W, alpha, mu, sigma) -> factors, which depends on the kernel
# parameters only (the module caches it while they do not change), and apply(v, *factors).
BACKEND_PARTS: dict[str, tuple[Callable, Callable]] = {
    "matmul": (_prepare_matmul, _apply_matmul),
    "stacked": (_prepare_stacked, _apply_stacked),
    "truncated": (_prepare_truncated, _apply_truncated),
    "fft": (_prepare_fft, _apply_fft),
}


def _one_call(prepare, apply):
    def mix(v, alpha, mu, sigma):
        return apply(v, *prepare(v.shape[1], v.shape[2], alpha, mu, sigma))
    return mix


BACKENDS: dict[str, Callable] = {name: _one_call(*parts) for name, parts in BACKEND_PARTS.items()}
BACKENDS["truncated"] = _mix_truncated  # takes an explicit tol as well


def ssog_mix(v: torch.Tensor, alpha: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor,
             backend: str = "matmul") -> torch.Tensor:
    """Per-head spatial mixing: out[:, :, :, h] = sum_m alpha[h, m] G_H v[:, :, :, h] G_W^T.

    v: (B, H, W, h, d); alpha: (h, M); mu, sigma: (h, M, 2) with [..., 0] the y axis, [..., 1] x.
    """
    _check_grid(v, alpha.shape[0])
    try:
        fn = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown SSoG backend {backend!r}; choose one of {sorted(BACKENDS)}") from None
    return fn(v, alpha, mu, sigma)


def operator_matrices(H: int, W: int, alpha, mu, sigma) -> torch.Tensor:
    """Dense K_h = sum_m alpha G_H kron G_W, shape (h, H*W, H*W), row-major tokens. Reference only."""
    GH, GW = axis_factors(H, W, alpha, mu, sigma)
    h, M = alpha.shape
    K = torch.einsum("hmac,hmbd->habcd", GH, GW)  # [a, b] = (i, j), [c, d] = (i', j')
    return K.reshape(h, H * W, H * W)


def _functorch_wrapped(t: torch.Tensor) -> bool:
    try:
        return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))
    except AttributeError:  # older torch: no functorch wrappers to worry about
        return False


def _functorch_active() -> bool:
    try:
        return torch._C._functorch.peek_interpreter_stack() is not None
    except AttributeError:
        return False


def _tensors(obj):
    """Every tensor inside nested tuples (the prepared factors of any backend)."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)


class ThreadPolicy:
    """Thread count for one SSoG call on a CPU, chosen by measurement: torch's count or one thread.

    A call is a dozen parallel regions or more (the projections, two axis products per head). On a machine whose other
    cores are busy, every region waits for its slowest thread, which the scheduler may have parked
    for a whole time slice: more threads can then be many times slower than one. The policy times
    the mixing under both settings (one call each at first, then one probe call of the other setting
    every `probe_every` calls), keeps an exponential average per grid and uses the faster. On a quiet
    machine it settles on torch's count; under load on one thread. The result is the same number
    either way: only the thread count changes.
    """

    def __init__(self, probe_every: int = 16, decay: float = 0.5):
        self.probe_every, self.decay = probe_every, decay
        self.stats: dict = {}

    def choose(self, key) -> int:
        n = torch.get_num_threads()
        if n <= 1:
            return n
        st = self.stats.setdefault((key, n), {"calls": 0, n: None, 1: None})
        st["calls"] += 1
        if st[n] is None:
            return n
        if st[1] is None:
            return 1
        best = n if st[n] <= st[1] else 1
        return (1 if best == n else n) if st["calls"] % self.probe_every == 0 else best

    def record(self, key, threads: int, seconds: float) -> None:
        n = torch.get_num_threads() if threads == 1 else threads
        st = self.stats.get((key, n))
        if st is None:
            return
        old = st[threads]
        st[threads] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds


def _effective_sigma(sigma_raw: torch.Tensor) -> torch.Tensor:
    return F.softplus(sigma_raw) + SIGMA_FLOOR


class _FactorGrad(torch.autograd.Function):
    """Identity on cached (graph-free) factors whose backward pulls the incoming gradients back to
    alpha, mu, sigma_raw: through the factors' own autograd graph when the cache holds one for these
    very parameter tensors (retained, so every use of the cached factors can go through it),
    otherwise (and for double backward) by rebuilding the factors with autograd."""

    @staticmethod
    def forward(ctx, H, W, backend, graph, alpha, mu, sigma_raw, *flat):
        ctx.grid, ctx.backend, ctx.graph = (H, W), backend, graph
        ctx.save_for_backward(alpha, mu, sigma_raw)
        return tuple(f.detach() for f in flat)

    @staticmethod
    def backward(ctx, *grads):
        alpha, mu, sigma_raw = ctx.saved_tensors
        double = torch.is_grad_enabled()  # create_graph: keep the path to the parameters themselves
        need = ctx.needs_input_grad[4:7]
        # The retained graph serves first-order backward passes; a double backward rebuilds, so that
        # no second-order pass can free buffers the retained graph still needs.
        use_graph = ctx.graph is not None and not double
        with torch.enable_grad():
            if use_graph:
                leaves = [alpha, mu, sigma_raw]
                outs = ctx.graph
            else:
                leaves = [t if double and t.requires_grad else t.detach().requires_grad_(True)
                          for t in (alpha, mu, sigma_raw)]
                factors = BACKEND_PARTS[ctx.backend][0](*ctx.grid, leaves[0], leaves[1],
                                                        _effective_sigma(leaves[2]))
                outs = list(_tensors(factors))
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            wanted = [i for i in range(3) if need[i] and leaves[i].requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in wanted], [g for _, g in pairs],
                                      allow_unused=True, retain_graph=use_graph or double,
                                      create_graph=double) if pairs and wanted else ()
        gp = [None, None, None]
        for i, g in zip(wanted, got):
            gp[i] = g
        return (None, None, None, None, *gp, *([None] * len(grads)))


def _attach_gradient(H, W, backend, factors, alpha, mu, sigma_raw, graph=None):
    flat = list(_tensors(factors))
    live = iter(_FactorGrad.apply(H, W, backend, graph, alpha, mu, sigma_raw, *flat))
    return _rebuild(factors, live)


def _rebuild(obj, it):
    if torch.is_tensor(obj):
        return next(it)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_rebuild(o, it) for o in obj)
    return obj


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return torch.where(y > 20, y, torch.log(torch.expm1(y)))


class SSoG(nn.Module):
    """Separable sum-of-Gaussians mixer on (B, H, W, C) token grids.

    Parameters: `alpha` (h, M), `mu` (h, M, 2), `sigma_raw` (h, M, 2) with
    sigma = softplus(sigma_raw) + SIGMA_FLOOR. `freeze_kernels()` fixes alpha, mu, sigma.
    """

    def __init__(self, dim: int, num_heads: int, num_components: int = 4, *, backend: str = "matmul",
                 init_sigma: tuple[float, float] = (0.5, 4.0), init_mu: float = 2.0,
                 device=None, dtype=None):
        super().__init__()
        if dim <= 0 or num_heads <= 0 or num_components <= 0:
            raise ValueError("dim, num_heads and num_components must be positive")
        if dim % num_heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}); "
                             f"pick num_heads among the divisors of dim")
        if backend not in BACKENDS and backend != "auto":
            raise ValueError(f"unknown SSoG backend {backend!r}; choose one of {sorted(BACKENDS)}")
        fk = dict(device=device, dtype=dtype)
        self.dim, self.num_heads, self.num_components = dim, num_heads, num_components
        self.head_dim = dim // num_heads
        self.backend = backend
        self.v_proj = nn.Linear(dim, dim, bias=False, **fk)
        self.o_proj = nn.Linear(dim, dim, **fk)
        h, M = num_heads, num_components
        self.alpha = nn.Parameter(torch.empty(h, M, **fk))
        self.mu = nn.Parameter(torch.empty(h, M, 2, **fk))
        self.sigma_raw = nn.Parameter(torch.empty(h, M, 2, **fk))
        self._init_sigma, self._init_mu = init_sigma, init_mu
        # CPU only: on other devices the mixing is one stream of kernels with no thread count to choose
        self.thread_policy = ThreadPolicy() if torch.device(device or "cpu").type == "cpu" else None
        self.reset_kernels()

    @torch.no_grad()
    def reset_kernels(self) -> None:
        """alpha = 1/M (a smoothing average at start), offsets uniform in +-init_mu, widths log-uniform."""
        if self.alpha.is_meta:
            return
        M = self.num_components
        self.alpha.fill_(1.0 / M)
        self.mu.uniform_(-self._init_mu, self._init_mu)
        lo, hi = (math.log(s) for s in self._init_sigma)
        sig = torch.empty_like(self.sigma_raw).uniform_(lo, hi).exp()
        self.sigma_raw.copy_(_inverse_softplus(sig - SIGMA_FLOOR))

    def gaussian_params(self):
        """Effective (alpha, mu, sigma), shapes (h, M), (h, M, 2), (h, M, 2); [..., 0] is y, [..., 1] is x."""
        return self.alpha, self.mu, _effective_sigma(self.sigma_raw)

    @torch.no_grad()
    def set_gaussian_params(self, alpha=None, mu=None, sigma=None) -> None:
        """Set effective values; each may be omitted. sigma must exceed SIGMA_FLOOR."""
        h, M = self.num_heads, self.num_components
        for name, val, shape in (("alpha", alpha, (h, M)), ("mu", mu, (h, M, 2)), ("sigma", sigma, (h, M, 2))):
            if val is None:
                continue
            val = torch.as_tensor(val, dtype=self.alpha.dtype, device=self.alpha.device)
            if tuple(val.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(val.shape)}")
            if not torch.isfinite(val).all():
                raise ValueError(f"{name} must be finite")
            if name == "sigma":
                if not bool((val > 0).all()):
                    raise ValueError("sigma must be > 0 (every Gaussian width is positive); "
                                     f"got min {float(val.min()):.3g}")
                if not bool((val > SIGMA_FLOOR).all()):
                    raise ValueError(f"sigma must exceed the floor {SIGMA_FLOOR} of its softplus "
                                     f"parametrisation; got min {float(val.min()):.3g}")
                gaussian.check_representable(self.mu, val, self.alpha.dtype, name="SSoG kernel")
                self.sigma_raw.copy_(_inverse_softplus(val - SIGMA_FLOOR))
            else:
                getattr(self, name).copy_(val)

    def freeze_kernels(self, frozen: bool = True) -> "SSoG":
        """Fixed-kernel SSoG: alpha, mu, sigma stop training; the map becomes affine in X."""
        for p in (self.alpha, self.mu, self.sigma_raw):
            p.requires_grad_(not frozen)
        return self

    def head_projections(self) -> torch.Tensor:
        """P_h = W_V[:, head h] @ W_O[head h, :], shape (h, C, C), right-multiplying X (N, C)."""
        d = self.head_dim
        WV = self.v_proj.weight.T  # (C_in, C): X @ WV is the value projection
        WO = self.o_proj.weight.T  # (C, C_out)
        return torch.stack([WV[:, i * d:(i + 1) * d] @ WO[i * d:(i + 1) * d, :] for i in range(self.num_heads)])

    def operator_matrix(self, H: int, W: int) -> torch.Tensor:
        """Dense K_h for every head, shape (h, H*W, H*W). For verification on small grids only."""
        return operator_matrices(H, W, *self.gaussian_params())

    # ----- kernel cache ------------------------------------------------------------------------
    # The axis factors depend on alpha, mu, sigma_raw and the grid only. Building them (the
    # normaliser, the taps, the representability check, the backend choice) costs a few hundred
    # small operations: at 14x14 tokens as much as the mixing itself. They are kept per grid, dtype,
    # device, backend and inference mode, together with a copy of the parameter values they were built
    # from, and served only while the parameters still hold exactly those values (torch.equal on
    # 5 h M numbers). Version counters alone would miss writes through `.data` (which gradcheck and
    # older optimiser code use); the values see every change: optimizer steps, copy_ under no_grad,
    # set_gaussian_params, load_state_dict, .to(). The cached factors carry no autograd graph; where
    # the kernel parameters need gradients, `_FactorGrad` attaches a fresh node per forward whose
    # backward rebuilds the factors with autograd (so no cached factor is tied to a graph that a
    # backward pass has already freed).

    def _cache_key(self, H: int, W: int):
        ps = (self.alpha, self.mu, self.sigma_raw)
        if _functorch_active() or any(_functorch_wrapped(p) for p in ps):
            # inside a torch.func transform (jvp, vmap, jacfwd, ...): plain autograd operations only,
            # built afresh, so the transform sees every dependence on the parameters
            return None
        return (H, W, self.backend, torch.is_inference_mode_enabled(), self.alpha.dtype, self.alpha.device)

    def clear_kernel_cache(self) -> None:
        self.__dict__["_kernel_cache"] = {}

    def kernel_factors(self, H: int, W: int):
        """(backend, factors) for an H x W grid: the backend chosen (for backend='auto') and its
        prepared factors, refusing kernels the dtype cannot carry. Cached while the parameters do not change."""
        key = self._cache_key(H, W)
        if key is None:
            return self._build_factors(H, W, *self.gaussian_params())
        ps = (self.alpha, self.mu, self.sigma_raw)
        graph_needed = torch.is_grad_enabled() and any(p.requires_grad for p in ps)
        cache = self.__dict__.setdefault("_kernel_cache", {})
        entry = cache.get(key)
        if entry is None or not all(a.dtype == p.dtype and torch.equal(a, p) for a, p in zip(entry["snapshot"], ps)):
            snapshot = tuple(p.detach().clone() for p in ps)
            if graph_needed:
                # Built once with autograd; the graph serves the backward of every use until the
                # parameters change (so a training step builds the factors once, not once per use).
                backend, built = self._build_factors(H, W, *self.gaussian_params())
                factors = _rebuild(built, iter([t.detach() for t in _tensors(built)]))
                graph = (ps, tuple(p._version for p in ps), list(_tensors(built)))
            else:
                with torch.no_grad():
                    backend, factors = self._build_factors(H, W, *self.gaussian_params())
                graph = None
            if len(cache) >= 8:  # a handful of grids at most (one per resolution in use)
                cache.clear()
            entry = cache[key] = dict(snapshot=snapshot, backend=backend, factors=factors, graph=graph)
        backend, factors = entry["backend"], entry["factors"]
        if graph_needed:
            g = entry["graph"]
            usable = (g is not None and all(a is b for a, b in zip(g[0], ps))
                      and all(v == p._version for v, p in zip(g[1], ps)))
            factors = _attach_gradient(H, W, backend, factors, *ps, graph=g[2] if usable else None)
        return backend, factors

    def _build_factors(self, H, W, alpha, mu, sigma):
        # a kernel the dtype cannot carry would come out as NaN: refuse instead
        gaussian.check_representable(mu, sigma, alpha.dtype, name="SSoG kernel")
        if self.backend == "auto":
            # The choice changes speed only (every backend is exact to float rounding), so it is
            # re-evaluated every CHOICE_REFRESH builds of a grid rather than at each parameter update.
            choices = self.__dict__.setdefault("_backend_choice", {})
            backend, uses = choices.get((H, W), (None, 0))
            if backend is None or uses >= CHOICE_REFRESH:
                backend, uses = choose_backend(H, W, alpha, mu, sigma), 0
            choices[(H, W)] = (backend, uses + 1)
        else:
            backend = self.backend
        return backend, BACKEND_PARTS[backend][0](H, W, alpha, mu, sigma)

    def _apply(self, fn, *args, **kwargs):
        self.clear_kernel_cache()  # .to(), .float(), .cuda(): never serve factors of the old tensors
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_kernel_cache"] = {}
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"SSoG expects (B, H, W, C={self.dim}), got {tuple(x.shape)}")
        policy = self.thread_policy
        if policy is None or x.device.type != "cpu" or torch.get_num_threads() <= 1:
            return self._mix(x)
        B, H, W, _ = x.shape
        key = (B, H, W, self.backend, x.dtype, torch.is_grad_enabled())
        n = torch.get_num_threads()
        k = policy.choose(key)
        if k != n:
            torch.set_num_threads(k)
        t0 = time.perf_counter()
        try:
            y = self._mix(x)
        finally:
            if k != n:
                torch.set_num_threads(n)
        policy.record(key, k, time.perf_counter() - t0)
        return y

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        """Value projection, per-head spatial mixing with the (cached) factors, output projection."""
        B, H, W, C = x.shape
        v = self.v_proj(x).reshape(B, H, W, self.num_heads, self.head_dim)
        backend, factors = self.kernel_factors(H, W)
        y = BACKEND_PARTS[backend][1](v, *factors)
        return self.o_proj(y.reshape(B, H, W, C))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.num_heads}, components={self.num_components}, backend={self.backend}"


# Relative cost of one multiply-add (or of one L log2 L FFT unit) per backend, in units of a GEMM
# multiply-add. Measured on a 2-core AVX2 CPU (torch 2.13, MKL/oneDNN): depthwise convolutions run
# at about a quarter of GEMM throughput; a real 2-D FFT costs about 20 GEMM multiply-adds per
# L log2 L point and channel (forward + inverse + product).
COST_WEIGHTS = {"stacked": 1.0, "truncated": 4.0, "fft": 20.0}


def backend_costs(H: int, W: int, alpha, mu, sigma, tol: float | None = None) -> dict[str, float]:
    """Modelled cost per channel and batch element of each fast backend, GEMM-multiply-add units."""
    M = alpha.shape[1]
    N = H * W
    tol = truncation_tol(mu.dtype) if tol is None else tol
    taps = sum(2 * truncation_radius(H, mu[:, m, 0], sigma[:, m, 0], tol) + 1
               + 2 * truncation_radius(W, mu[:, m, 1], sigma[:, m, 1], tol) + 1 for m in range(M))
    L = fft_size(H) * fft_size(W)
    return {
        "stacked": COST_WEIGHTS["stacked"] * M * N * (H + W),
        "truncated": COST_WEIGHTS["truncated"] * N * taps,
        "fft": COST_WEIGHTS["fft"] * L * math.log2(max(L, 2)),
    }


def choose_backend(H: int, W: int, alpha, mu, sigma) -> str:
    """Cost model for backend='auto': the cheapest of backend_costs (stacked GEMMs, truncated
    depthwise convolution, FFT). All are exact to float rounding, so the choice changes only speed."""
    costs = backend_costs(H, W, alpha, mu, sigma)
    return min(costs, key=costs.get)
