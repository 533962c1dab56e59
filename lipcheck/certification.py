"""`lipcheck.certify`: the tightest certified Lipschitz bound of an SSoG layer, or of every SSoG layer of a model.

(A module of its own name: a submodule called `certify` would replace the function `lipcheck.certify` on the
package the first time it was imported.)
"""
from __future__ import annotations

import dataclasses
import math

from torch import nn

from .bounds.lipschitz import DEFAULT_BUDGET_S, CertifyOptions, SSoGBound, certify_options, ssog_lipschitz
from .bounds.spectral import ssog_params
from .mixers import SSoG


@dataclasses.dataclass
class LayerCertificate:
    """lower <= Lip(layer) = ||T||_2 <= upper on an H x W grid (both certified; T is the layer without its bias).

    name: the layer's name in the model ('(layer)' for a layer passed alone); method: the stage whose bound is
    `upper` ('exact', 'gram', 'dense_gram', 'ritz', 'deflated', 'majorant', 'circulant', 'resolution_free' or
    'closed_form'); detail: how that stage certified it; cut_short: a wall-clock deadline stopped some stage (the
    bounds are certified all the same, only less tight); bound: the full lipcheck.bounds.SSoGBound."""
    name: str
    H: int
    W: int
    lower: float
    upper: float
    method: str
    detail: str
    seconds: float
    cut_short: bool
    bound: SSoGBound = dataclasses.field(repr=False)

    @property
    def gap(self) -> float:
        """upper / lower - 1, rounded up: the certified relative gap (inf where the lower bound is 0)."""
        if not self.lower > 0:
            return math.inf
        return math.nextafter(math.nextafter(self.upper / self.lower, math.inf) - 1.0, math.inf)

    @property
    def resolution_free(self) -> float:
        return self.bound.resolution_free

    def as_dict(self) -> dict:
        return dict(name=self.name, H=self.H, W=self.W, lower=self.lower, upper=self.upper, gap=self.gap,
                    method=self.method, detail=self.detail, seconds=self.seconds, cut_short=self.cut_short,
                    resolution_free=self.resolution_free, plan=self.bound.budget.get("rule"))


def _grid(grid) -> tuple[int, int]:
    """(H, W) from (H, W) or one int n (n x n); anything else refused, naming the argument."""
    if isinstance(grid, int) and not isinstance(grid, bool):
        grid = (grid, grid)
    try:
        H, W = grid
    except (TypeError, ValueError):
        raise ValueError(f"grid must be (H, W) or one positive int, got {grid!r}") from None
    for v in (H, W):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"grid must hold positive integers (H, W), got {grid!r}")
    return H, W


def model_grid(model: nn.Module) -> tuple[int, int]:
    """The token grid a model works on: img_size // patch_size of a lipcheck ViT (its patch embedding's grid)."""
    pe = getattr(model, "patch_embed", None)
    g = getattr(pe, "grid", None)
    if g is None:
        raise ValueError(f"cannot tell the token grid of a {type(model).__name__} (no lipcheck patch embedding); "
                         f"pass grid=(H, W)")
    return _grid(g)


def ssog_layers(model: nn.Module) -> list[tuple[str, SSoG]]:
    """Every lipcheck.SSoG in the model, once each (a weight-shared block appears once), by name."""
    return [(n or "(model)", m) for n, m in model.named_modules() if isinstance(m, SSoG)]


def _one(name: str, layer: SSoG, H: int, W: int, opts: CertifyOptions) -> LayerCertificate:
    try:
        r = ssog_lipschitz(layer, H, W, options=opts)
    except ValueError as err:  # name the layer: a model has many
        raise ValueError(f"SSoG layer {name}: {err}") from err
    return LayerCertificate(name=name, H=H, W=W, lower=r.lower, upper=r.upper, method=r.best_method,
                            detail=r.method.get(r.best_method, ""), seconds=r.budget.get("seconds", math.nan),
                            cut_short=r.cut_short, bound=r)


def certify(layer_or_model, grid=None, budget_s: float = DEFAULT_BUDGET_S, *, options: CertifyOptions | None = None,
            **kw):
    """The tightest certified bounds on Lip(SSoG) that fit budget_s seconds (2 cores) per layer.

    layer_or_model: a lipcheck.SSoG (then grid=(H, W) is required; returns one LayerCertificate), or any nn.Module
    or a checkpoint from lipcheck.load (returns a list of LayerCertificate, one per SSoG layer found, in the order of
    model.named_modules()). grid: (H, W) or n for n x n; for a model the default is its own token grid (img_size //
    patch_size of a lipcheck ViT). budget_s: planned in units of work from the sizes (the same call gives the same
    bound on a busy and on a quiet machine); options / keyword arguments: lipcheck.bounds.CertifyOptions fields
    (deadline_s for a wall-clock stop, dtype, device, ...). Each result has .lower .upper .gap .method.
    NaN/inf weights, a model without SSoG layers or an unknown grid raise ValueError."""
    opts = certify_options(options, budget_s=budget_s, **kw)
    if isinstance(layer_or_model, SSoG):
        if grid is None:
            raise ValueError("certify(layer) needs grid=(H, W): a single layer has no token grid of its own")
        H, W = _grid(grid)
        return _one("(layer)", layer_or_model, H, W, opts)
    model = layer_or_model
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "model", None), nn.Module):
        model = model.model  # a checkpoint (lipcheck.load): its model
    if not isinstance(model, nn.Module):
        raise TypeError(f"certify takes a lipcheck.SSoG layer, an nn.Module or a checkpoint, got "
                        f"{type(layer_or_model).__name__}")
    layers = ssog_layers(model)
    if not layers:
        raise ValueError(f"the model ({type(model).__name__}) has no lipcheck.SSoG layer to certify")
    H, W = _grid(grid) if grid is not None else model_grid(model)
    for name, layer in layers:  # every layer's weights checked before any is certified (minutes, for a large model)
        try:
            ssog_params(layer, dtype=opts.dtype, device=opts.device)
        except ValueError as err:
            raise ValueError(f"SSoG layer {name}: {err}") from err
    return [_one(name, layer, H, W, opts) for name, layer in layers]
