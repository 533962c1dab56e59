"""`attention_growth`, the probe's entry point: search every radius, certify the best inputs in float64,
fit the growth exponent."""
from __future__ import annotations

import itertools
import time
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..mixers.attention import DenseAttention
from .certification import candidates, certify_candidates
from .maps import BlockMap, as_map, check_grid, default_device, infer_channels
from .options import ProbeOptions, check_radii, probe_options
from .result import GrowthResult, fit_or_nan, per_radius, running_max
from .search import search_radii
from .tangents import analytic_tangent, tangent_map
from .witness import WITNESS_FOCUS, witness_directions, witness_parts


class _Target(NamedTuple):
    """The map as the probe sees it: its private copy, name, channels, tangent maps and starting material."""
    module: nn.Module
    name: str
    C: int
    tangent: Callable  # in the search dtype
    tangent64: Callable
    analytic: bool  # whether the batched-matmul tangent map is used
    dirs: list  # radius-free witness parts, as many as there are restarts at most
    is_ln_map: bool


def _target(layer: nn.Module, grid: tuple[int, int], options: ProbeOptions, dim, device) -> _Target:
    """Checks the layer (finite weights, parameters, C) and builds what the search and certification need."""
    module = as_map(layer)
    name = type(layer).__name__ + (f"[{layer.branch}]" if isinstance(layer, BlockMap) else "")
    if next(module.parameters(), None) is None:
        raise ValueError("layer has no parameters; nothing to probe")
    C = int(dim) if dim is not None else infer_channels(module)
    tan = tangent_map(layer, grid, device=device, dtype=options.dtype, analytic=options.analytic)
    tan64 = tangent_map(layer, grid, device=device, dtype=torch.float64, analytic=options.analytic)
    analytic_used = options.analytic and analytic_tangent(module, device, torch.float64) is not None
    dirs = []
    if options.witnesses and isinstance(layer, DenseAttention) and grid[0] * grid[1] >= 3:
        us = list(witness_directions(layer, device=device).values())
        dirs = list(itertools.islice((witness_parts(layer, u, focus, device=device)  # only those used
                                      for focus in (WITNESS_FOCUS, None) for u in us), options.restarts))
    is_ln_map = any(isinstance(m, nn.LayerNorm) for m in module.modules())
    return _Target(module, name, C, tan, tan64, analytic_used, dirs, is_ln_map)


def attention_growth(layer: nn.Module, radii, grid: tuple[int, int] = (4, 4), *, options: ProbeOptions | None = None,
                     dim: int | None = None, device=None, progress: bool = False, **knobs) -> GrowthResult:
    """Certified lower bounds on L(R) = sup_{||X||_F <= R} ||J_f(X)||_2 for each R in `radii`.

    layer: a DenseAttention (the whole layer, output projection and biases included), a `BlockMap`,
    a VectorField, or any module mapping (B, H, W, C) -> (B, H, W, C) with independent grids (see the
    package docstring for a (B, N, C) attention block). options: a `ProbeOptions` (search effort,
    certification, fit; default ProbeOptions()); each of its fields may also be passed as a keyword
    (restarts=, steps=, lr=, power_warmup=, certify_method=, certify_steps=, certify_tol=, certify_top=,
    refine_rounds=, refine_steps=, refine_top=, fit_min_radius=, witnesses=, analytic=, batch_radii=,
    dtype=, seed=), which takes the place of the field in `options`. dim: C, when the module does not
    tell it. device: default cuda when available, else cpu.
    Returns a `GrowthResult`; result.tolerance holds the Lanczos residual reached per radius.
    """
    radii = check_radii(radii)
    H, W = check_grid(grid)
    opts = probe_options(options, knobs)
    device = torch.device(device) if device is not None else default_device()
    fit_min_radius = radii[len(radii) // 2] if opts.fit_min_radius is None else opts.fit_min_radius
    t = _target(layer, (H, W), opts, dim, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    t0 = time.perf_counter()
    best, bestX, bestv, kinds = search_radii(t.tangent, radii, (H, W), t.C, t.dirs, t.is_ln_map, opts,
                                             device=device, progress=progress)
    sync(); t_search = time.perf_counter() - t0

    # float64 certification of each radius's most promising restarts, all radii in one batch
    t0 = time.perf_counter()
    cand = candidates(best, kinds, opts.certify_top)
    X64, val64, v64, rel, nst = certify_candidates(t.tangent64, t.module, (H, W), cand, bestX, bestv, radii, opts,
                                                   device=device, progress=progress)
    sync(); t_cert = time.perf_counter() - t0

    per = per_radius(cand, val64, X64, v64, rel, nst, best, kinds)
    low = running_max(per)
    k, ci, b = fit_or_nan(radii, low["lower"], fit_min_radius)
    grids = lambda xs: torch.stack(xs).reshape(len(radii), H, W, t.C).cpu()
    return GrowthResult(radii=radii, lower=low["lower"], attained=per["attained"], search=per["search"],
                        witness=per["witness"], tolerance=low["tolerance"], lanczos_steps=low["lanczos_steps"],
                        X=grids(low["X"]), v=grids(low["v"]), exponent=k, exponent_ci=ci,
                        fit_min_radius=float(fit_min_radius), intercept=b, grid=(H, W), restarts=opts.restarts,
                        steps=opts.steps, certify_method=opts.certify_method, certify_tol=float(opts.certify_tol),
                        map=t.name, tangent="analytic (batched matmuls)" if t.analytic else "torch.func.jvp",
                        device=str(device), dtype=str(opts.dtype).replace("torch.", ""),
                        seconds={"search": t_search, "certify": t_cert, "total": t_search + t_cert})
