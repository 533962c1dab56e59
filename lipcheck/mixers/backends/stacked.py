"""The stacked backend: dense axis factors as batched GEMMs with the M components stacked, in the layout that
suits the call (all heads at once, per head in batch chunks, x coordinate outermost, y axis in column blocks),
and `_StackedFactors`, its factors' autograd node with a closed-form backward."""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..tap_grad import _autograd_of, _taps_vjp
from ..taps import _axis_taps, _effective_sigma, _split_taps, _toeplitz_from_taps

# The stacked backend runs all heads in one GEMM call per axis when a call holds at most this many tokens
# (batch x grid): 14 x 14 and 16 x 16 at batch 1 (measured on 2 CPU cores, see _stacked_all_heads).
FUSE_HEADS_TOKENS = 400
# Above that and up to this many tokens, with more than one thread and no autograd, the x coordinate goes
# outermost instead (_stacked_transposed): 28 x 28 and 24 x 24 at batch 1 (measured on 2 CPU cores). Above it,
# batch 1 keeps the per-head products but runs the y axis as a batch of column blocks (_stacked_column_blocks).
TRANSPOSED_MAX_TOKENS = 1024
Y_COLUMN_BLOCKS = 8  # at most this many blocks (gcd with the grid width: each block holds whole x coordinates)
STACKED_CHUNK_BYTES = 2 << 20


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
