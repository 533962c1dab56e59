"""SSoG: separable sum-of-Gaussians token mixing (SPEC section 1).

    SSoG(X) = sum_h K_h X P_h + b,   K_h = sum_m alpha[h, m] G_H(mu_y, sigma_y) kron G_W(mu_x, sigma_x)

The pure function `ssog_mix` applies sum_m alpha G_H V G_W^T per head without ever building the
N x N matrix; the backends in `BACKENDS` are interchangeable implementations of it. The module
`SSoG` is a thin shell: value projection (no bias, so that the affine part is exactly b), the
mixing, the output projection.
"""
from __future__ import annotations

import collections
import contextlib
import math
import statistics
import threading
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import gaussian

SIGMA_FLOOR = 1e-3  # sigma = softplus(raw) + floor keeps every width strictly positive
CHOICE_REFRESH = 32  # builds of one grid's factors between two evaluations of the backend cost model
# The stacked backend runs all heads in one GEMM call per axis when a call holds at most this many tokens
# (batch x grid): 14 x 14 and 16 x 16 at batch 1 (measured on 2 CPU cores, see _stacked_all_heads).
FUSE_HEADS_TOKENS = 400
# Above that and up to this many tokens, with more than one thread and no autograd, the x coordinate goes
# outermost instead (_stacked_transposed): 28 x 28 and 24 x 24 at batch 1 (measured on 2 CPU cores). Above it,
# batch 1 keeps the per-head products but runs the y axis as a batch of column blocks (_stacked_column_blocks).
TRANSPOSED_MAX_TOKENS = 1024
Y_COLUMN_BLOCKS = 8  # at most this many blocks (gcd with the grid width: each block holds whole x coordinates)
STACKED_CHUNK_BYTES = 2 << 20
# Inference calls of more than FUSE_HEADS_TOKENS tokens on a CPU write the value projection, the mixed values and
# the stacked backend's per-head intermediates into buffers kept per thread (`_Workspace`) while they take at most
# this many bytes (0: never). Fresh tensors of these sizes cost fresh pages on every call in a plain process: glibc
# malloc maps them anew or trims the freed heap back to the OS, and the kernel zeroes each page on first touch
# (measured with one thread, experiments/plain_speed.py: 2,700-4,600 page faults per forward at 64 x 64, C = 192 and
# 384, and at 14 x 14, C = 192, batch 32; the forward 1.15-1.4x slower than with the buffers).
WORKSPACE_MAX_BYTES = 64 << 20


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


def _prepare_matmul(H, W, alpha, mu, sigma, ty, tx):
    return _toeplitz_from_taps(H, ty) * alpha[..., None, None], _toeplitz_from_taps(W, tx)


def _apply_matmul(v, GH, GW):
    """Dense axis factors: O(B C M (H^2 W + H W^2)) multiply-adds."""
    t = torch.einsum("hmjl,bilhd->bhmijd", GW, v)  # along x
    return torch.einsum("hmik,bhmkjd->bijhd", GH, t)  # along y, summed over components


# ---------------------------------------------------------------------------------------------
# Backends. All read the taps g(k; mu, sigma) from lipcheck.gaussian.kernel at the integer offsets
# k = i - i' (the same numbers axis_matrix puts in G_n), computed once per grid by `_axis_taps`, and
# differ only in how they apply them: dense factors (matmul), stacked GEMMs (dense factors, components stacked so each axis is one batched GEMM),
# truncated depthwise convolution (taps beyond a radius cut, error bound below), FFT (exact
# linear convolution by zero padding to >= 2n - 1).


def _flush(g: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """Taps below max(floor, the dtype's smallest normal number) set to zero: subnormal floats slow every
    later multiply by an order of magnitude on x86 and change nothing above 1e-308 (float64) or 1e-38
    (float32) absolute."""
    return torch.where(g < max(floor, torch.finfo(g.dtype).tiny), torch.zeros((), dtype=g.dtype, device=g.device), g)


def tap_floor(n: int, dtype: torch.dtype) -> float:
    """Smallest tap the SSoG module keeps on an axis of n <= `n` points: truncation_tol(dtype) / (2 (2n - 1)).

    A tap of 1e-30 is a normal float32, but its products with ordinary activations and gradients
    (1e-9 and below) are subnormal, and a GEMM meeting subnormal products runs several times slower
    (measured: the 64x64 mixer's forward 1.5x, its training step 1.4x). At most 2n - 1 taps per
    component and axis fall below the floor, so they drop at most truncation_tol / 2 of the mass: the
    error statement of the truncated backend (eps <= tol per factor) holds with eps <= tol / 2 for the
    dense backends and eps <= 1.5 tol for the truncated one, below the rounding of the kept sums. The
    functional `ssog_mix` (the bounds' operator) flushes only below the smallest normal number.
    """
    return truncation_tol(dtype) / (2 * (2 * max(int(n), 1) - 1))


def _taps(r: int, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """g(k; mu, sigma) for k = -r..r, shape mu.shape + (2r + 1,), subnormal values flushed to zero."""
    return _flush(gaussian.lattice_taps(r, mu, sigma))


def _toeplitz(n: int, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """G_n(mu, sigma) built from its 2n - 1 distinct taps (equal to gaussian.axis_matrix entry by entry)."""
    return _toeplitz_from_taps(n, _taps(n - 1, mu, sigma))


def _full_taps(H: int, W: int, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Taps of both axes from one kernel evaluation: g(k) for |k| <= max(H, W) - 1, shape (h, M, 2, 2r+1)."""
    return _taps(max(H, W) - 1, mu, sigma)


def _split_taps(H: int, W: int, taps: torch.Tensor):
    """(y taps for |k| <= H - 1, x taps for |k| <= W - 1) out of `_full_taps`."""
    r = (taps.shape[-1] - 1) // 2
    return taps[..., 0, r - (H - 1):r + H], taps[..., 1, r - (W - 1):r + W]


def _axis_taps(H: int, W: int, mu: torch.Tensor, sigma: torch.Tensor):
    """(y taps, x taps) of an H x W grid: one kernel evaluation for both axes."""
    return _split_taps(H, W, _full_taps(H, W, mu, sigma))


def _toeplitz_from_taps(n: int, taps: torch.Tensor) -> torch.Tensor:
    """G_n[i, i'] = taps[i - i' + n - 1] for taps over k = -(n-1)..n-1: row i is the window of the reversed
    taps that starts at n - 1 - i (two flips and a strided view: a third of the time of a gather)."""
    return taps.flip(-1).unfold(-1, n, 1).flip(-2)


def _prepare_stacked(H, W, alpha, mu, sigma, ty, tx):
    """[G_W^1; ...; G_W^M] (h, M W, W) with rows (m, j), and [alpha_m G_H^m[i, k]] (h, H, H M) with
    columns (k, m)."""
    h, M = alpha.shape
    GW = _toeplitz_from_taps(W, tx).reshape(h, M * W, W)  # rows (m, j)
    GH = _toeplitz_from_taps(H, ty * alpha[..., None])  # (h, M, H, H) [m, i, k]
    return GW, GH.permute(0, 2, 3, 1).reshape(h, H, H * M)  # [i, (k, m)]


def _apply_stacked(v, GW, GH, ws=None):
    """Dense axis factors as GEMMs with the M components stacked.

    x axis: [G_W^1; ...; G_W^M] (M W x W) times every (W x d) slab v[b, k, :, h, :], giving
    T[b, k, m, j, e]; y axis: [alpha_m G_H^m[i, k]] with columns ordered (k, m) (H x H M) times T
    viewed as (H M x W d), so the sum over components happens inside the GEMM's contraction. Same
    multiply-adds as "matmul", fewer and larger GEMMs.

    Per head, each axis is one batched GEMM whose factor is broadcast as a stride-0 view: `bmm` reads
    it in place, where `matmul`'s broadcasting first copies the factor once per slab (as large as T:
    12 MB per layer at 64x64, C=192) and then runs 2-4x slower. Two layouts of the same products,
    chosen by what follows:
    - no autograd: straight on the strided slabs of v (no copy in; one stack out);
    - autograd: on a head-major copy (one copy in, one out), so that the backward's GEMMs read
      contiguous slabs instead of strided slices and the stack's slicing, 1.4-2x faster for a training
      step on a CPU.
    Small problems run all heads at once (`_stacked_all_heads`); without autograd and with more than one
    thread, mid-sized ones put the x coordinate outermost (`_stacked_transposed`) and batch 1 above that
    runs the y axis in blocks of columns (`_stacked_column_blocks`): layouts whose calls split across the threads.
    `ws` (a `_Workspace`, inference only): the output and the per-head intermediates of the per-head layouts are
    written into its buffers (the output is then valid until the thread's next call with it).
    """
    B, H, W, h, d = v.shape
    M = GW.shape[1] // W
    if B * H * W <= FUSE_HEADS_TOKENS:
        return _stacked_all_heads(v, GW, GH)
    graph = torch.is_grad_enabled() and (v.requires_grad or GW.requires_grad or GH.requires_grad)
    if not graph and torch.get_num_threads() > 1:
        if B * H * W <= TRANSPOSED_MAX_TOKENS:
            return _stacked_transposed(v, GW, GH)
        if B == 1:
            return _stacked_column_blocks(v, GW, GH) if ws is None else _stacked_column_blocks(v, GW, GH, ws)
    if graph:
        vh = v.permute(3, 0, 1, 2, 4).reshape(h, B * H, W, d)
        # unbind: one autograd node per tensor for all heads (indexing would add a zero-filled copy per head)
        out = torch.stack([_stacked_head(a, g, k, B) for a, g, k in zip(vh.unbind(0), GW.unbind(0), GH.unbind(0))])
        return out.view(h, B, H, W, d).permute(1, 2, 3, 0, 4)
    # Batch chunks whose intermediate T stays in cache between the two axis products (measured at 14 x 14,
    # C = 192, batch 32, one thread: the axis products 1.3x faster, the whole mixer 5 %); the output is
    # written per chunk and head, the copy a stack of the heads would make anyway.
    b = max(1, STACKED_CHUNK_BYTES // (H * W * M * d * v.element_size()))
    if ws is None:
        out, bufs = v.new_empty(B, H, W, h, d), None
    else:
        b = min(b, B)
        out = ws.get("out", (B, H, W, h, d), v)
        bufs = ws.get("T", (b * H, M * W, d), v), ws.get("r", (b, H, W * d), v)
    for s in range(0, B, b):
        n = min(b, B - s)
        into = None if bufs is None else (bufs[0][:n * H], bufs[1][:n])
        for i in range(h):
            out[s:s + n, :, :, i] = _stacked_head(v[s:s + n, :, :, i, :].reshape(n * H, W, d), GW[i], GH[i], n,
                                                  into).view(n, H, W, d)
    return out


def _stacked_all_heads(v, GW, GH):
    """Both axis products of every head in one batched GEMM each, the factors repeated per slab: on a
    small problem (batch 1 at 14 x 14 tokens) the per-head calls are too small to keep two threads busy
    (measured: 0.12 ms per C=192 layer with one thread or two, 0.07 ms fused); on larger ones the
    repeated factors cost more memory traffic than the calls save."""
    B, H, W, h, d = v.shape
    HM = GH.shape[2]
    vh = v.permute(3, 0, 1, 2, 4).reshape(h * B * H, W, d)
    T = torch.bmm(_repeated(GW, B * H), vh)  # (h B H, M W, d) = [h, b, k, m, j, e]
    out = torch.bmm(_repeated(GH, B), T.view(h * B, HM, W * d))  # (h B, H, W d)
    return out.view(h, B, H, W, d).permute(1, 2, 3, 0, 4)


def _stacked_transposed(v, GW, GH):
    """Both axis products of every head with the tokens' x coordinate outermost: v copied once to
    [head, l, (k, b, e)], the x axis as one GEMM per head, [G_W^m[j, l]] with rows (j, m) times
    (W x H B d), giving T[head, j, m, k, b, e]; the y axis per (head, j), [alpha_m G_H^m[i, k]] with
    columns (m, k) times T[head, j] viewed as (M H x B d). Same multiply-adds as the other layouts; with
    two threads at batch 1 on 24 x 24 to 28 x 28 tokens (too many for `_stacked_all_heads`) its calls
    split evenly across the threads where the per-head calls do not (measured 1.2-1.4x faster for the
    axis products, and no faster with one thread)."""
    B, H, W, h, d = v.shape
    GWt, GHt = _transposed_factors(GW, GH, H, W)
    vT = v.permute(3, 2, 1, 0, 4).reshape(h, W, H * B * d)
    T = torch.bmm(GWt, vT)  # (h, W M, H B d)
    out = torch.bmm(GHt, T.view(h * W, GHt.shape[2], B * d))  # (h W, H, B d) = [head, j, i, b, e]
    return out.view(h, W, H, B, d).permute(3, 2, 1, 0, 4)


def _stacked_column_blocks(v, GW, GH, ws=None):
    """Batch 1 on grids above TRANSPOSED_MAX_TOKENS with more than one thread: the per-head products of
    `_stacked_head`, with the y axis (an H x H M times H M x W d GEMM) run as a batch of p = gcd(W, Y_COLUMN_BLOCKS)
    GEMMs, each over the columns of W / p whole x coordinates. The BLAS splits one GEMM of so few rows poorly
    across threads (measured with 64 rows, depth 256, 2048 columns: no faster with two threads than with one),
    and a batch goes to the threads whole. Each block is copied straight into the output; the arithmetic of every
    entry is unchanged.
    Measured on the whole mixer with two threads, alternating with the single GEMM in one process (two
    processes per grid): 64 x 64, C = 192 (3 heads) 1.13 and 1.30x as fast, C = 384 (6 heads) 1.03 and 1.08x,
    48 x 48, C = 192 1.09 and 1.12x; a transposed form (a GEMM with W d rows, then a copy back to token order) came
    between the two. On a quiet spell of the machine all three were within 5 % of each other, and with one thread
    the blocks were no faster, so that case keeps the single GEMM."""
    _, H, W, h, d = v.shape
    HM = GH.shape[2]
    p = math.gcd(W, Y_COLUMN_BLOCKS)
    if ws is None:
        out, T_out, r_out = v.new_empty(1, H, W, h, d), None, None
    else:
        out = ws.get("out", (1, H, W, h, d), v)
        T_out, r_out = ws.get("T", (H, GW.shape[1], d), v), ws.get("blocks", (p, H, W * d // p), v)
    for i in range(h):
        T = _x_axis(v[0, :, :, i, :], GW[i], T_out)  # (H, M W, d) = [k, m, j, e]
        # (p, H, (W / p) d)
        r = torch.bmm(GH[i].expand(p, H, HM), T.view(HM, p, W * d // p).transpose(0, 1), out=r_out)
        out[0, :, :, i].view(H, p, W // p, d).copy_(r.view(p, H, W // p, d).transpose(0, 1))
    return out


def _transposed_factors(GW: torch.Tensor, GH: torch.Tensor, H: int, W: int):
    """The stacked factors reordered for `_stacked_transposed`: GW (h, M W, W) with rows (m, j) -> rows
    (j, m); GH (h, H, H M) with columns (k, m) -> columns (m, k), repeated once per x coordinate j,
    (h W, H, M H)."""
    h, MW, _ = GW.shape
    M = MW // W
    GWt = _kept(GW, "transposed", M, lambda: GW.view(h, M, W, W).transpose(1, 2).reshape(h, W * M, W))
    GHt = _kept(GH, "transposed", (M, W), lambda: GH.view(h, H, H, M).transpose(2, 3).reshape(h, H, M * H)
                .repeat_interleave(W, 0))
    return GWt, GHt


def _repeated(G: torch.Tensor, r: int) -> torch.Tensor:
    """G (h, a, b) with every head's matrix repeated r times, (h r, a, b)."""
    return G if r == 1 else _kept(G, "repeated", r, lambda: G.repeat_interleave(r, 0))


def _kept(G: torch.Tensor, name: str, key, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """make(), a form of G derived from G alone, kept on G's tensor object under (name, key) when G has no graph
    (the module's cached inference factors), so that a forward does not build it again; one key per name at a
    time (one batch size in use)."""
    if G.requires_grad:
        return make()
    kept = G.__dict__.get("_lipcheck_kept")
    if kept is None:
        kept = G.__dict__["_lipcheck_kept"] = {}
    memo = kept.get(name)
    if memo is not None and memo[0] == key:
        return memo[1]
    made = make()
    kept[name] = (key, made)
    return made


class _Workspace:
    """Buffers one thread reuses across inference calls of one shape (`WORKSPACE_MAX_BYTES`): named tensors made
    on first use and made again only when a call asks for another shape. Never used where autograd may save a
    tensor (grad mode on), so no graph holds one; created outside inference mode, so that calls with and without
    it may write them."""

    __slots__ = ("key", "bufs")

    def __init__(self, key):
        self.key, self.bufs = key, {}

    def get(self, name: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        t = self.bufs.get(name)
        if t is None or t.shape != shape:
            self.bufs.pop(name, None)  # the old buffer's memory back first
            with torch.inference_mode(False):
                t = self.bufs[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return t


# Per thread: one _Workspace (the last shape used), taken out of the slot while a call uses it, so that another
# call on the same thread meanwhile (a hook calling another SSoG) gets none rather than the same buffers.
_WORKSPACE = threading.local()


def _take_workspace(key, nbytes: int):
    """The calling thread's workspace for `key` (emptied if it held another key), or None where the buffers would
    exceed WORKSPACE_MAX_BYTES or the thread's workspace is in use; hand it back with `_give_workspace`."""
    if nbytes > WORKSPACE_MAX_BYTES:
        return None
    ws = _WORKSPACE.__dict__.get("ws")
    if ws is None:
        if _WORKSPACE.__dict__.get("busy"):
            return None
        ws = _Workspace(key)
    elif ws.key != key:
        ws.bufs.clear()  # shape, dtype or device changed: drop the old buffers before the new ones are made
        ws.key = key
    _WORKSPACE.ws, _WORKSPACE.busy = None, True
    return ws


def _give_workspace(ws) -> None:
    _WORKSPACE.ws, _WORKSPACE.busy = ws, False


def clear_workspace() -> None:
    """Free the calling thread's reused inference buffers (they are made again on the next large call)."""
    if not _WORKSPACE.__dict__.get("busy"):
        _WORKSPACE.ws = None


def _x_axis(vs, GW, out=None):
    """One head's x-axis product: [G_W^1; ...; G_W^M] (M W, W) times every slab of vs (n, W, d) -> (n, M W, d)
    (into `out`, of that shape, where given)."""
    return torch.bmm(GW.expand(vs.shape[0], *GW.shape), vs, out=out)


def _stacked_head(vs, GW, GH, B, into=None):
    """One head: vs (B H, W, d) slabs -> (B, H, W d); `into`: buffers (B H, M W, d) and (B, H, W d) for the
    intermediate and the result."""
    BH, W, d = vs.shape
    H, HM = GH.shape
    T_out, r_out = (None, None) if into is None else into
    T = _x_axis(vs, GW, T_out)  # (B H, M W, d) = [b, k, m, j, e]
    return torch.bmm(GH.expand(B, H, HM), T.view(B, HM, W * d), out=r_out)


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


def _prepare_truncated(H, W, alpha, mu, sigma, ty, tx, tol=None):
    """Per component m: (r_y, r_x, y taps alpha_m g_y,m flipped, x taps g_x,m flipped), each
    component with its own radii (the largest over heads), so narrow components cost few taps."""
    M = alpha.shape[1]
    tol = truncation_tol(mu.dtype) if tol is None else tol
    out = []
    for m in range(M):
        ry = truncation_radius(H, mu[:, m, 0], sigma[:, m, 0], tol)
        rx = truncation_radius(W, mu[:, m, 1], sigma[:, m, 1], tol)
        # conv2d is a cross-correlation, out[i] = sum_t w[t] x[i + t - r], so w[t] = g(r - t): flip the taps.
        gx = tx[:, m, W - 1 - rx:W + rx].flip(-1)  # (h, 2rx+1): offsets -rx..rx
        gy = (ty[:, m, H - 1 - ry:H + ry] * alpha[:, m, None]).flip(-1)  # (h, 2ry+1)
        out.append((ry, rx, gy, gx))
    return tuple(out)


def _apply_truncated(v, *components):
    """Truncated depthwise convolution along each axis: O(B C N sum_m (r_x,m + r_y,m)) multiply-adds.

    Per component m: a depthwise convolution along x with g_x,m, then one along y with alpha_m g_y,m,
    summed over m. The convolution's zero padding is exactly the zero padding of the Toeplitz
    factors. Error per output entry <= sum_m |alpha_m| (eps_y + eps_x + eps_y eps_x) max|v| with
    eps <= tol (see truncation_radius; 1.5 tol in the SSoG module, see tap_floor): below float rounding
    at the default tol.
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
    H, W = v.shape[1], v.shape[2]
    return _apply_truncated(v, *_prepare_truncated(H, W, alpha, mu, sigma, *_axis_taps(H, W, mu, sigma), tol))


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


def _prepare_fft(H, W, alpha, mu, sigma, ty, tx):
    """rfft2 of the summed kernel k_h[a, b] = sum_m alpha g_y(a) g_x(b), |a| < H, |b| < W, zero padded."""
    Lh, Lw = fft_size(H), fft_size(W)
    gy, gx = ty * alpha[..., None], tx  # (h, M, 2H-1), (h, M, 2W-1)
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


# Every backend is a pair: prepare(H, W, alpha, mu, sigma, ty, tx) -> factors, which depends on the
# kernel parameters only (the module caches it while they do not change), and apply(v, *factors).
# ty, tx are the taps of `_axis_taps`; mu and sigma serve only choices that take no gradient (the
# truncation radii), so the factors depend on mu and sigma through the taps alone.
BACKEND_PARTS: dict[str, tuple[Callable, Callable]] = {
    "matmul": (_prepare_matmul, _apply_matmul),
    "stacked": (_prepare_stacked, _apply_stacked),
    "truncated": (_prepare_truncated, _apply_truncated),
    "fft": (_prepare_fft, _apply_fft),
}


def _one_call(prepare, apply):
    def mix(v, alpha, mu, sigma):
        H, W = v.shape[1], v.shape[2]
        return apply(v, *prepare(H, W, alpha, mu, sigma, *_axis_taps(H, W, mu, sigma)))
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


# bound once: these run on every forward (older torch: no functorch wrappers to worry about)
_IS_WRAPPED = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
_PEEK_STACK = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
_FUNCTORCH = _IS_WRAPPED is not None and _PEEK_STACK is not None


_HOOK_TABLES = tuple(getattr(torch.nn.modules.module, n, None) for n in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))


def plain_linear(mod: nn.Module) -> bool:
    """mod is a plain nn.Linear with no hooks of its own and none global: calling its weight and bias directly
    is then exactly mod(x). Anything else (hooks, a quantised, parametrised or otherwise replaced projection)
    must be called as the module it is."""
    return (type(mod) is nn.Linear and not (mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks
                                            or mod._backward_pre_hooks)
            and None not in _HOOK_TABLES and not any(_HOOK_TABLES))


def _linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """mod(x), as F.linear where `plain_linear(mod)`: nn.Module's call machinery costs about 7 microseconds per
    call, 5 % of a C = 192 layer at 14 x 14, batch 1."""
    if plain_linear(mod):
        p = mod._parameters
        return F.linear(x, p["weight"], p["bias"])
    return mod(x)


class ThreadPolicy:
    """Thread count for one SSoG call on a CPU, chosen by measurement: torch's count or one thread.

    A call is a handful of parallel regions (the projections, the axis products). On a machine whose other
    cores are busy, every region waits for its slowest thread, which the scheduler may have parked
    for a whole time slice: more threads can then be many times slower than one. The policy times
    the mixing under both settings and uses the faster; now and then (a probe, see below) it runs `burst`
    calls of the other setting. The first call after any change of the thread count is never timed: it wakes
    the parked threads (or parks them) and meets cold caches, tens of microseconds that once made a
    0.2 ms call look slower at two threads than at one, so that a probe of torch's count after a stretch
    of one-thread calls never won it back. Before its first choice it times each setting `burst - 1` times,
    one thread first: the first calls of a process run cold (up to twice the steady time at 14 x 14), and
    such a time at torch's count once sent the policy to one thread on a quiet machine for a whole probe
    period. Each setting's time is the median of its last `window` timed calls per grid: not a minimum (under
    load a lucky fast call at torch's count would win) and not an average, which one slow call (a time slice
    lost to another process) turns over: with an exponential average (weight 0.5) 16 % of a quiet machine's
    3000 calls at 14 x 14, C=192, batch 1 ran at one thread, each stray slow call at torch's count sending the
    policy to one thread until the next probe; with the median of 5, 1-2 % (the initial samples and the probes).
    A setting in use that slows down for good loses after three calls; on a quiet machine the policy settles on
    torch's count, under load on one thread.
    A probe costs `burst` calls at the slower setting (measured: 5-11 % of a quiet machine's mixer time at
    14 x 14 and 28 x 28 with a probe every 32 calls), so each probe that confirms the choice doubles the
    period to the next, up to `max_period`; a probe or a median that changes the choice resets it to
    `probe_every`. A machine that gets busy needs no probe to be noticed (the setting in use slows down and
    its own median overtakes the other's); one that gets quiet again is found by the second probe (each adds
    burst - 1 timed calls to the other setting's window).
    The result is the same number either way: only the thread count changes.
    """

    def __init__(self, probe_every: int = 32, burst: int = 3, window: int = 5, max_period: int = 1024):
        if not 2 <= burst < probe_every <= max_period:
            raise ValueError(f"need 2 <= burst < probe_every <= max_period, got burst={burst}, "
                             f"probe_every={probe_every}, max_period={max_period}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.probe_every, self.burst, self.window, self.max_period = probe_every, burst, window, max_period
        self.stats: dict = {}

    def choose(self, key) -> int:
        n = torch.get_num_threads()
        if n <= 1:
            return n
        st = self.stats.get((key, n))
        if st is None:  # (not setdefault: its default, two deques and three dicts, would be built on every call)
            st = self.stats[key, n] = {"calls": 0, "last": None, n: None, 1: None, "timed": {n: 0, 1: 0},
                                       "recent": {n: collections.deque(maxlen=self.window),
                                                  1: collections.deque(maxlen=self.window)},
                                       "best": None, "probe_at": 0, "period": self.probe_every}
        st["calls"] += 1
        for k in (1, n):  # the initial samples: one thread first (the coldest calls of a process fall on it,
            # so that on a quiet machine the policy starts on torch's count, where it stays), then torch's count
            if st["timed"][k] < self.burst - 1:
                return k
        c, best = st["calls"], (n if st[n] <= st[1] else 1)
        if st["probe_at"] <= c < st["probe_at"] + self.burst:  # a probe of the other setting
            return 1 if st["best"] == n else n
        if best == st["best"]:
            if c == st["probe_at"] + self.burst:  # a probe has just confirmed the choice: probe less often
                st["period"] = min(self.max_period, 2 * st["period"])
                st["probe_at"] = c + st["period"]
        else:  # the first choice, or a changed one: probe at the base period again
            st["best"], st["period"], st["probe_at"] = best, self.probe_every, c + self.probe_every
        return best

    def record(self, key, threads: int, seconds: float) -> None:
        n = torch.get_num_threads() if threads == 1 else threads
        st = self.stats.get((key, n))
        if st is None:
            return
        switched, st["last"] = st["last"] != threads, threads
        if switched:  # the first call at a thread count (of the key, or after a change): not representative
            return
        st["timed"][threads] += 1
        recent = st["recent"][threads]
        recent.append(seconds)
        st[threads] = statistics.median(recent)


def _effective_sigma(sigma_raw: torch.Tensor) -> torch.Tensor:
    return F.softplus(sigma_raw) + SIGMA_FLOOR


class _TapGrad(torch.autograd.Function):
    """Identity on cached (graph-free) taps of `_full_taps` whose backward pulls their gradient back to
    mu and sigma_raw through the kernel's log-derivatives, computed in closed form with the taps
    (`gaussian.lattice_taps`): d g / d mu = g d log g / d mu, a handful of operations per use instead
    of differentiating through the kernel's evaluation, which cost more than the mixing itself at
    14x14 tokens. A double backward (create_graph) differentiates the kernel's own evaluation instead,
    so second derivatives come from the same definition."""

    @staticmethod
    def forward(ctx, mu, sigma_raw, taps, d_mu, d_sigma):
        ctx.save_for_backward(mu, sigma_raw, taps, d_mu, d_sigma)
        return taps.detach()

    @staticmethod
    def backward(ctx, grad):
        mu, sigma_raw, taps, d_mu, d_sigma = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():  # create_graph: keep the path to the parameters themselves
            r = (taps.shape[-1] - 1) // 2
            return (*_autograd_of([_taps(r, mu, _effective_sigma(sigma_raw))], [grad], (mu, sigma_raw), need),
                    None, None, None)
        return (*_taps_vjp(grad, taps, d_mu, d_sigma, sigma_raw, need), None, None, None)


def _taps_vjp(grad, taps, d_mu, d_sigma, sigma_raw, need):
    """(grad mu, grad sigma_raw) from a gradient on the cached taps: d g = g d log g with the log-derivatives
    cached beside the taps (gaussian.lattice_taps), and d sigma / d sigma_raw = sigmoid(sigma_raw). Flushed
    taps are zero, so no gradient flows through them."""
    w = grad * taps
    return ((w * d_mu).sum(-1) if need[0] else None,
            (w * d_sigma).sum(-1) * torch.sigmoid(sigma_raw) if need[1] else None)


def _autograd_of(outs, grads, inputs, need):
    """Gradients of the plain differentiable composition `outs` (a double backward's path), None where not needed."""
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    wanted = [t for t, n in zip(inputs, need) if n]
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                   create_graph=True, allow_unused=True))
    return tuple(next(got) if n else None for n in need)


def _diagonal_sums(G: torch.Tensor) -> torch.Tensor:
    """out[..., t] = sum over i - i' = t - (n - 1) of G[..., i, i']: the adjoint of `_toeplitz_from_taps`."""
    n = G.shape[-1]
    idx = torch.arange(n, device=G.device)
    flat = ((idx[:, None] - idx[None, :]) + (n - 1)).reshape(-1)
    out = G.new_zeros(*G.shape[:-2], 2 * n - 1)
    return out.index_add_(-1, flat, G.reshape(*G.shape[:-2], n * n))


def _grad_taps(taps: torch.Tensor, dty: torch.Tensor, dtx: torch.Tensor) -> torch.Tensor:
    """Gradient on the full taps (h, M, 2, 2r+1) from gradients on the y and x windows of `_split_taps`."""
    H, W = (dty.shape[-1] + 1) // 2, (dtx.shape[-1] + 1) // 2
    r = (taps.shape[-1] - 1) // 2
    if H == W == r + 1:
        return torch.stack((dty, dtx), -2)
    out = taps.new_zeros(taps.shape)
    out[..., 0, r - (H - 1):r + H] = dty
    out[..., 1, r - (W - 1):r + W] = dtx
    return out


class _StackedFactors(torch.autograd.Function):
    """The stacked backend's factors (GW, GH) for one layer's kernels or several layers' concatenated
    over heads, from the cached taps, with a backward in closed form: the factor gradients folded onto
    the taps (sums along diagonals, the adjoint of building a Toeplitz matrix), then onto alpha and,
    through the taps' log-derivatives (as in _TapGrad), onto mu and sigma_raw. Differentiated piece by
    piece the same assembly is a dozen small autograd nodes per layer (slices, gathers, a permuted
    copy, scatter-adds); here it is one node for all layers of a model (`prepared_kernels`). A double
    backward (create_graph) differentiates the plain composition instead."""

    @staticmethod
    def forward(ctx, H, W, alpha, mu, sigma_raw, taps, d_mu, d_sigma):
        ctx.grid = (H, W)
        ctx.save_for_backward(alpha, mu, sigma_raw, taps, d_mu, d_sigma)
        return _prepare_stacked(H, W, alpha, None, None, *_split_taps(H, W, taps))

    @staticmethod
    def backward(ctx, dGW, dGH):
        alpha, mu, sigma_raw, taps, d_mu, d_sigma = ctx.saved_tensors
        (H, W), need = ctx.grid, ctx.needs_input_grad[2:5]
        if torch.is_grad_enabled():  # create_graph: keep the path to the parameters themselves
            sigma = _effective_sigma(sigma_raw)
            outs = _prepare_stacked(H, W, alpha, mu, sigma, *_axis_taps(H, W, mu, sigma))
            return (None, None, *_autograd_of(outs, (dGW, dGH), (alpha, mu, sigma_raw), need), None, None, None)
        n, M = alpha.shape
        dGW = torch.zeros(n, M * W, W, dtype=taps.dtype, device=taps.device) if dGW is None else dGW
        dGH = torch.zeros(n, H, H * M, dtype=taps.dtype, device=taps.device) if dGH is None else dGH
        dty_alpha = _diagonal_sums(dGH.view(n, H, H, M).permute(0, 3, 1, 2))  # on alpha_m g_y,m: (n, M, 2H-1)
        dtx = _diagonal_sums(dGW.view(n, M, W, W))
        dalpha = dmu = dsigma_raw = None
        if need[0]:
            dalpha = (dty_alpha * _split_taps(H, W, taps)[0]).sum(-1)
        if need[1] or need[2]:
            dmu, dsigma_raw = _taps_vjp(_grad_taps(taps, dty_alpha * alpha[..., None], dtx), taps, d_mu, d_sigma,
                                        sigma_raw, need[1:])
        return None, None, dalpha, dmu, dsigma_raw, None, None, None


def _cat(ts):
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def _needs_taps(entry: dict, tap_grad: bool) -> bool:
    return entry["taps"] is None or (tap_grad and entry["dlog"] is None)


def _tap_bank(H: int, W: int, mu: torch.Tensor, sigma: torch.Tensor, tap_grad: bool) -> tuple:
    """(taps, d log g / d mu, d log g / d sigma) of the (h, M, 2) kernels on an H x W grid, flushed below
    `tap_floor`, from one evaluation of the kernel series (the log-derivatives None unless tap_grad): the
    evaluation is a few hundred small operations whatever its size, so a dozen layers' kernels concatenated
    cost about what one layer's do."""
    with torch.no_grad():
        out = gaussian.lattice_taps(max(H, W) - 1, mu, sigma, derivatives=tap_grad)
        g, dlog = (out[0], out[1:]) if tap_grad else (out, (None, None))
        return (_flush(g, tap_floor(max(H, W), g.dtype)), *dlog)


def _fill_taps(items, H: int, W: int, tap_grad: bool) -> None:
    """Taps (and, for tap_grad, their log-derivatives) of every (entry, mu, sigma) in `items`, from one
    `_tap_bank` over the concatenated parameters."""
    mus = [m for _, m, _ in items]
    taps, d_mu, d_sigma = _tap_bank(H, W, _cat(mus), _cat([s for _, _, s in items]), tap_grad)
    sizes = [m.shape[0] for m in mus]
    parts = zip(taps.split(sizes), *((d_mu.split(sizes), d_sigma.split(sizes)) if tap_grad else ()))
    for (entry, _, _), (t, *dlog) in zip(items, parts):
        entry["taps"] = t
        if tap_grad:
            entry["dlog"] = tuple(dlog)


@contextlib.contextmanager
def prepared_kernels(layers, H: int, W: int):
    """Within the block: the kernels of several SSoG layers made ready for an H x W grid with one evaluation
    of the kernel series and one representability check for all of them.

    - Layers whose kernels train (autograd on, stacked backend): their factors, from one autograd node
      (`_StackedFactors`) for all of them, straight from the current parameters, for every use inside the
      block (a looped or ODE model applies its layer a dozen times per forward). Nothing of them is cached
      across blocks: a training step changes every kernel, so a cache would only be written, never served,
      and its bookkeeping (snapshots, comparisons, entries) cost a quarter of the refresh (measured for 12
      layers at 14x14 tokens: 0.5 of 2.3 ms).
    - Other layers (inference, frozen kernels, other backends): their kernel caches brought up to date.

    A training step changes every layer's kernels; evaluated layer by layer the series costs a few
    hundred small operations per layer, about as much as the layer's mixing at 224x224. The ViT wraps
    its blocks in this once per forward. Every number is the same as layer by layer; layers inside
    torch.func transforms are left alone. On leaving the block the factors are dropped, so no later use
    (after a backward has freed their graph) can reach them; inside it a layer serves them only while its
    kernel parameters are the same tensors at the same versions (`SSoG._live_factors`).
    """
    layers = list(layers)
    _refresh(layers, H, W)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("_live", None)


def _versions(ps: tuple) -> tuple:
    return ps[0]._version, ps[1]._version, ps[2]._version


def _refresh(layers, H: int, W: int) -> None:
    groups: dict = {}
    banks: dict = {}
    for layer in layers:
        key = layer._cache_key(H, W)
        if key is None:
            continue
        graph, tap_grad = layer._grad_needs()
        if graph and layer._choose_backend(H, W) == "stacked":
            ps = layer._kernel_params()
            bk = (tuple(ps[1].shape[1:]), ps[1].dtype, ps[1].device, tuple(p.requires_grad for p in ps))
            banks.setdefault(bk, []).append(layer)
            continue
        entry = layer._cache().get(key)
        if not layer._is_current(entry):
            entry = None
        elif not _needs_taps(entry, tap_grad):
            continue
        alpha, mu, sigma = layer.gaussian_params()
        gk = (tuple(mu.shape[1:]), mu.dtype, mu.device, tap_grad)
        groups.setdefault(gk, []).append((layer, key, entry, alpha, mu.detach(), sigma.detach()))
    for (_, dtype, _, tap_grad), todo in groups.items():
        fresh = [t for t in todo if t[2] is None]
        if fresh:
            gaussian.check_representable(torch.cat([t[4] for t in fresh]), torch.cat([t[5] for t in fresh]),
                                         dtype, name="SSoG kernel")
        items = [(entry if entry is not None else layer._new_entry(key, H, W, alpha, mu, sigma, checked=True),
                  mu, sigma) for layer, key, entry, alpha, mu, sigma in todo]
        _fill_taps(items, H, W, tap_grad)
    for (_, dtype, _, need), members in banks.items():
        params = [layer._kernel_params() for layer in members]
        alpha, mu, sigma_raw = (_cat([ps[i] for ps in params]) for i in range(3))
        sigma = _effective_sigma(sigma_raw.detach())  # elementwise: the same numbers as layer by layer
        gaussian.check_representable(mu.detach(), sigma, dtype, name="SSoG kernel")
        taps, d_mu, d_sigma = _tap_bank(H, W, mu.detach(), sigma, need[1] or need[2])
        GW, GH = _StackedFactors.apply(H, W, alpha, mu, sigma_raw, taps, d_mu, d_sigma)
        sizes = [layer.num_heads for layer in members]
        for layer, ps, gw, gh in zip(members, params, GW.split(sizes), GH.split(sizes)):
            layer.__dict__["_live"] = ((H, W), ps, _versions(ps), gw, gh)


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
    # set_gaussian_params, load_state_dict, .to(). The taps (flushed below `tap_floor`) and, for
    # training, their log-derivatives are cached; nothing cached carries an autograd graph. Where the
    # kernel parameters need gradients, each forward (or, inside `prepared_kernels`, each model
    # forward) builds the factors from the cached taps through `_StackedFactors` or `_TapGrad`, whose
    # backward is the kernel's derivative in closed form (so no cached tensor is tied to a graph that a
    # backward pass has already freed).

    def _kernel_params(self) -> tuple:
        """(alpha, mu, sigma_raw), read from the parameter dict directly: nn.Module's attribute lookup costs
        about half a microsecond per name, and a forward at 14 x 14 reads them a dozen times."""
        ps = self._parameters
        return ps["alpha"], ps["mu"], ps["sigma_raw"]

    def _cache_key(self, H: int, W: int, ps: tuple | None = None):
        ps = ps if ps is not None else self._kernel_params()
        # spelled out (no generator): this runs on every forward
        if _FUNCTORCH and (_PEEK_STACK() is not None
                           or _IS_WRAPPED(ps[0]) or _IS_WRAPPED(ps[1]) or _IS_WRAPPED(ps[2])):
            # inside a torch.func transform (jvp, vmap, jacfwd, ...): plain autograd operations only,
            # built afresh, so the transform sees every dependence on the parameters
            return None
        return (H, W, self.backend, torch.is_inference_mode_enabled(), ps[0].dtype, ps[0].device)

    def clear_kernel_cache(self) -> None:
        self.__dict__["_kernel_cache"] = {}

    def mix_values(self, v: torch.Tensor, _ws=None) -> torch.Tensor:
        """sum_m alpha G_H v G_W^T per head on values v (B, H, W, h, d), with this forward's factors inside
        `prepared_kernels`, else with the kernels of the cache: the backend chosen (for backend='auto'), kernels
        the dtype cannot carry refused. `_ws` (from `_mix` only): a `_Workspace` the stacked backend may write
        its result into."""
        H, W = v.shape[1], v.shape[2]
        live = self._live_factors(H, W)
        if live is not None:  # training inside prepared_kernels: this forward's factors
            return _apply_stacked(v, *live)
        ps = self._kernel_params()
        key = self._cache_key(H, W, ps)
        graph, tap_grad = self._grad_needs(ps)
        entry = self._cache().get(key) if key is not None else None
        if not graph and entry is not None and entry["factors"] is not None and self._is_current(entry, ps):
            if _ws is not None and entry["backend"] == "stacked":
                return _apply_stacked(v, *entry["factors"], _ws)
            return BACKEND_PARTS[entry["backend"]][1](v, *entry["factors"])  # inference: nothing to build
        alpha, mu, sigma = self.gaussian_params()
        if key is None:
            backend, factors = self._build_factors(H, W, alpha, mu, sigma)
            return BACKEND_PARTS[backend][1](v, *factors)
        if not self._is_current(entry, ps):
            entry = self._new_entry(key, H, W, alpha, mu, sigma)
        if _needs_taps(entry, tap_grad):
            _fill_taps([(entry, mu, sigma)], H, W, tap_grad)
        backend, taps = entry["backend"], entry["taps"]
        prepare, apply = BACKEND_PARTS[backend]
        if not graph:
            if entry["factors"] is None:
                with torch.no_grad():
                    entry["factors"] = prepare(H, W, alpha, mu, sigma, *_split_taps(H, W, taps))
            if _ws is not None and backend == "stacked":
                return _apply_stacked(v, *entry["factors"], _ws)
            return apply(v, *entry["factors"])
        dlog = entry["dlog"] if tap_grad else (None, None)
        if backend == "stacked":  # factors from one node with a closed-form backward
            return apply(v, *_StackedFactors.apply(H, W, *ps, taps, *dlog))
        # Other backends: the factors are assembled from the cached taps on every forward (a few cheap
        # operations, differentiated by autograd; alpha enters here), the taps' own gradient comes
        # from _TapGrad in closed form.
        if tap_grad:
            taps = _TapGrad.apply(self.mu, self.sigma_raw, taps, *dlog)
        return apply(v, *prepare(H, W, alpha, mu.detach(), sigma.detach(), *_split_taps(H, W, taps)))

    def _live_factors(self, H: int, W: int):
        """The stacked factors `prepared_kernels` made for this forward, if they are for an H x W grid, no
        torch.func transform is active, and the kernel parameters are the tensors they were made from at the
        same versions (any in-place write since, an optimizer step or copy_, bumps a version); else None."""
        live = self.__dict__.get("_live")
        if live is None or live[0] != (H, W) or (_FUNCTORCH and _PEEK_STACK() is not None):
            return None
        ps = self._kernel_params()
        made = live[1]
        if made[0] is not ps[0] or made[1] is not ps[1] or made[2] is not ps[2] or live[2] != _versions(ps):
            return None
        return live[3], live[4]

    def _cache(self) -> dict:
        return self.__dict__.setdefault("_kernel_cache", {})

    def _grad_needs(self, ps: tuple | None = None) -> tuple[bool, bool]:
        """(factors need an autograd path, the taps need one to mu / sigma_raw)."""
        alpha, mu, sigma_raw = ps if ps is not None else self._kernel_params()
        graph = torch.is_grad_enabled() and (alpha.requires_grad or mu.requires_grad or sigma_raw.requires_grad)
        return graph, graph and (mu.requires_grad or sigma_raw.requires_grad)

    def _is_current(self, entry, ps: tuple | None = None) -> bool:
        ps = ps if ps is not None else self._kernel_params()
        if entry is None:
            return False
        a, m, s = entry["snapshot"]  # equal values, not only an unchanged version: an edit through .data bumps none
        return (a.dtype == ps[0].dtype and m.dtype == ps[1].dtype and s.dtype == ps[2].dtype
                and torch.equal(a, ps[0]) and torch.equal(m, ps[1]) and torch.equal(s, ps[2]))

    def _new_entry(self, key, H, W, alpha, mu, sigma, checked: bool = False) -> dict:
        """A fresh cache entry for the current parameters: checked, backend chosen, no taps yet."""
        with torch.no_grad():
            if not checked:
                gaussian.check_representable(mu, sigma, alpha.dtype, name="SSoG kernel")
            backend = self._choose_backend(H, W, alpha, mu, sigma)
        cache = self._cache()
        if len(cache) >= 8:  # a handful of grids at most (one per resolution in use)
            cache.clear()
        cache[key] = entry = dict(snapshot=tuple(p.detach().clone() for p in (self.alpha, self.mu, self.sigma_raw)),
                                  backend=backend, taps=None, dlog=None, factors=None)
        return entry

    def _choose_backend(self, H, W, alpha=None, mu=None, sigma=None) -> str:
        """The backend for an H x W grid: self.backend, or for "auto" the cost model's choice on the kernels
        (alpha, mu, sigma), by default the layer's own."""
        if self.backend != "auto":
            return self.backend
        # The choice changes speed only (every backend is exact to float rounding), so it is
        # re-evaluated every CHOICE_REFRESH builds of a grid rather than at each parameter update.
        choices = self.__dict__.setdefault("_backend_choice", {})
        backend, uses = choices.get((H, W), (None, 0))
        if backend is None or uses >= CHOICE_REFRESH:
            if alpha is None:
                with torch.no_grad():
                    alpha, mu, sigma = self.gaussian_params()
            backend, uses = choose_backend(H, W, alpha, mu, sigma), 0
        choices[(H, W)] = (backend, uses + 1)
        return backend

    def _build_factors(self, H, W, alpha, mu, sigma):
        """Backend and factors built afresh with plain autograd operations (inside torch.func transforms)."""
        # a kernel the dtype cannot carry would come out as NaN: refuse instead
        gaussian.check_representable(mu, sigma, alpha.dtype, name="SSoG kernel")
        backend = self._choose_backend(H, W, alpha, mu, sigma)
        return backend, BACKEND_PARTS[backend][0](H, W, alpha, mu, sigma, *_axis_taps(H, W, mu, sigma))

    def _apply(self, fn, *args, **kwargs):
        self.clear_kernel_cache()  # .to(), .float(), .cuda(): never serve factors of the old tensors
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_kernel_cache"] = {}
        state.pop("_live", None)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"SSoG expects (B, H, W, C={self.dim}), got {tuple(x.shape)}")
        policy = self.thread_policy
        if policy is None or not x.is_cpu or torch.get_num_threads() <= 1:
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
        mods = self._modules
        ws = self._workspace(x)
        if ws is None:
            v = _linear(mods["v_proj"], x).reshape(B, H, W, self.num_heads, self.head_dim)
            return _linear(mods["o_proj"], self.mix_values(v).reshape(B, H, W, C))
        try:
            # the value projection as F.linear computes it without a bias (one GEMM on the flattened tokens)
            v = torch.mm(x.reshape(B * H * W, C), mods["v_proj"]._parameters["weight"].t(),
                         out=ws.get("v", (B * H * W, C), x))
            mixed = self.mix_values(v.view(B, H, W, self.num_heads, self.head_dim), ws)
            return _linear(mods["o_proj"], mixed.reshape(B, H, W, C))  # fresh: the caller keeps it
        finally:
            _give_workspace(ws)

    def _workspace(self, x: torch.Tensor):
        """The thread's `_Workspace` for this call, or None: only for calls above FUSE_HEADS_TOKENS tokens (below,
        glibc's heap serves the small tensors without fresh pages) on a CPU, with grad mode off (nothing may save a
        buffer for a backward), no torch.func transform, plain projections and x of the weights' dtype."""
        B, H, W, C = x.shape
        if (WORKSPACE_MAX_BYTES <= 0 or B * H * W <= FUSE_HEADS_TOKENS or torch.is_grad_enabled()
                or type(x) is not torch.Tensor or not x.is_cpu or x.layout is not torch.strided):
            return None
        mods = self._modules
        weight = mods["v_proj"]._parameters["weight"]
        if (x.dtype is not weight.dtype or not weight.is_cpu or not plain_linear(mods["v_proj"])
                or not plain_linear(mods["o_proj"]) or (_FUNCTORCH and _PEEK_STACK() is not None)):
            return None
        # v and the mixed values, plus the per-head intermediate (at most M times one head's values)
        nbytes = x.numel() * x.element_size() * (2 + (self.num_components + 1) / self.num_heads)
        return _take_workspace((B, H, W, C, self.num_heads, self.num_components, x.dtype), nbytes)

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
