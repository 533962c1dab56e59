"""Vision Transformer on token grids: patch embedding, pre-norm blocks, three depth variants.

- discrete: `depth` distinct blocks;  looped: one block applied `depth` times (shared weights);
- ode: dx/dt = F(x) = Mixer(LN1(x)) + MLP(LN2(x)) on [0, t1], integrated by torchdiffeq (models/ode.py).
The mixer is "ssog" or "attention" and nothing else differs, so comparisons are matched by construction.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..mixers import MIXERS, make_mixer
from ..mixers.ssog import SSoG, plain_linear, prepared_kernels

VARIANTS = ("discrete", "looped", "ode")


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, *, device=None, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden, dim, device=device, dtype=dtype)

    # Tokens per slice when no gradient is recorded: the (rows, hidden) activation of a slice stays
    # in cache instead of streaming four times the input size through memory (about 10% of a CPU
    # forward at 4096 tokens); every row's arithmetic is unchanged. The slicing costs smaller GEMMs,
    # so it is used only where the whole hidden activation would not stay in cache: above
    # `chunk_min_bytes` (at 224x224 that is a batch above about 10 for width 192).
    chunk_tokens = 512
    chunk_min_bytes = 8 * 2**20

    def forward(self, x):
        C = x.shape[-1]
        n = x.numel() // C if C else 0
        hidden_bytes = n * self.fc1.out_features * x.element_size()
        if torch.is_grad_enabled() or n <= self.chunk_tokens or hidden_bytes <= self.chunk_min_bytes:
            return self.fc2(F.gelu(self.fc1(x)))
        flat = x.reshape(n, C)
        if (plain_linear(self.fc1) and plain_linear(self.fc2) and not torch.is_autocast_enabled(x.device.type)
                and self.fc1.weight.dtype == self.fc2.weight.dtype == x.dtype):
            out = self._slices_in_place(flat)
        else:
            out = self._slices(flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _slices_in_place(self, flat):
        """The token slices written straight into one output and one reused hidden buffer: the same products
        as F.linear (addmm with the bias), without a fresh activation and a copy of the output per slice
        (3 % of a width-192 forward at 4096 tokens on a CPU)."""
        n, step = flat.shape[0], self.chunk_tokens
        out = flat.new_empty(n, self.fc2.out_features)
        hidden = flat.new_empty(min(n, step), self.fc1.out_features)
        (w1, b1), (w2, b2) = ((m.weight.t(), m.bias) for m in (self.fc1, self.fc2))
        for s in range(0, n, step):
            e = min(n, s + step)
            h = hidden[:e - s]
            _affine(flat[s:e], w1, b1, h)
            torch.ops.aten.gelu_(h)
            _affine(h, w2, b2, out[s:e])
        return out

    def _slices(self, flat):
        """Token slices through the modules themselves (hooks, autocast, replaced projections)."""
        n, out = flat.shape[0], None
        for s in range(0, n, self.chunk_tokens):
            y = self.fc2(F.gelu(self.fc1(flat[s:s + self.chunk_tokens])))
            if out is None:  # the slice's dtype, which autocast may have changed
                out = y.new_empty(n, y.shape[-1])
            out[s:s + y.shape[0]] = y
        return out


def _affine(a, wt, b, out):
    """out = a @ wt + b in place (F.linear's addmm), b may be None."""
    if b is None:
        torch.mm(a, wt, out=out)
    else:
        torch.addmm(b, a, wt, out=out)


class Block(nn.Module):
    """Pre-norm residual block. `use_norm=False` / `use_mlp=False` drop LN1, LN2 / the MLP branch
    (the linear special case against which the ODE solver is checked exactly)."""

    def __init__(self, dim: int, num_heads: int, mixer: str = "ssog", *, mlp_ratio: float = 4.0,
                 num_components: int = 4, ssog_backend: str = "matmul", attn_backend: str = "sdpa",
                 use_norm: bool = True, use_mlp: bool = True, norm_eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps, **fk) if use_norm else nn.Identity()
        self.mixer = make_mixer(mixer, dim, num_heads, num_components=num_components,
                                ssog_backend=ssog_backend, attn_backend=attn_backend, **fk)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps, **fk) if use_norm and use_mlp else nn.Identity()
        self.mlp = Mlp(dim, int(dim * mlp_ratio), **fk) if use_mlp else None

    def forward(self, x):
        """Discrete (sequential) residual update, timm style."""
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x)) if self.mlp is not None else x

    def vector_field(self, x):
        """Parallel form F(x) = Mixer(LN1(x)) + MLP(LN2(x)): the right-hand side of the ODE."""
        y = self.mixer(self.norm1(x))
        return y + self.mlp(self.norm2(x)) if self.mlp is not None else y


class PatchEmbed(nn.Module):
    """p x p convolution with stride p, plus a learned position embedding resampled to other grids."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, dim: int, *, device=None, dtype=None):
        super().__init__()
        if img_size % patch_size != 0:
            raise ValueError(f"img_size ({img_size}) must be a multiple of patch_size ({patch_size})")
        self.img_size, self.patch_size = img_size, patch_size
        self.grid = img_size // patch_size
        self.proj = nn.Conv2d(in_chans, dim, patch_size, stride=patch_size, device=device, dtype=dtype)
        self.pos = nn.Parameter(torch.zeros(1, self.grid, self.grid, dim, device=device, dtype=dtype))
        if not self.pos.is_meta:
            nn.init.trunc_normal_(self.pos, std=0.02)

    def resampled_pos(self, H: int, W: int) -> torch.Tensor:
        if (H, W) == (self.grid, self.grid):
            return self.pos
        pos = F.interpolate(self.pos.permute(0, 3, 1, 2), size=(H, W), mode="bicubic", align_corners=False)
        return pos.permute(0, 2, 3, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4:
            raise ValueError(f"images must have shape (B, C, H, W), got {tuple(images.shape)}")
        if images.shape[1] != self.proj.in_channels:
            raise ValueError(f"images have {images.shape[1]} channels, the model expects in_chans="
                             f"{self.proj.in_channels}")
        ih, iw = images.shape[-2:]
        if ih % self.patch_size or iw % self.patch_size:
            raise ValueError(f"image size {ih}x{iw} must be a multiple of the patch size {self.patch_size}; "
                             f"resize or crop to a multiple of {self.patch_size}")
        x = self.proj(images).permute(0, 2, 3, 1)  # (B, H, W, C), channels-first strides
        # Token-major memory from here on: otherwise every residual add keeps the convolution's
        # strides and each LayerNorm copies its input to contiguous form.
        return (x + self.resampled_pos(*x.shape[1:3])).contiguous()


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    img_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 100
    dim: int = 192
    depth: int = 12
    num_heads: int = 3
    num_components: int = 4
    mlp_ratio: float = 4.0
    use_norm: bool = True
    use_mlp: bool = True
    ssog_backend: str = "matmul"
    attn_backend: str = "sdpa"
    # ode variant only
    t1: float = 1.0
    method: str = "dopri5"
    rtol: float = 1e-3
    atol: float = 1e-3
    options: dict | None = None
    adjoint: bool = False


class ViT(nn.Module):
    """ViT(variant, mixer, **config): patch embed -> blocks (or ODE flow) -> LN -> mean pool -> head."""

    def __init__(self, variant: str = "discrete", mixer: str = "ssog", *, device=None, dtype=None, **config):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
        if mixer not in MIXERS:
            raise ValueError(f"unknown mixer {mixer!r}; choose one of {MIXERS}")
        try:
            cfg = ViTConfig(**config)
        except TypeError as e:
            raise TypeError(f"{e}; valid options are {[f.name for f in dataclasses.fields(ViTConfig)]}") from None
        if cfg.dim % cfg.num_heads != 0:
            raise ValueError(f"dim ({cfg.dim}) must be divisible by num_heads ({cfg.num_heads})")
        fk = dict(device=device, dtype=dtype)
        self.variant, self.mixer_name, self.config = variant, mixer, cfg
        self.img_size = cfg.img_size
        self.patch_embed = PatchEmbed(cfg.img_size, cfg.patch_size, cfg.in_chans, cfg.dim, **fk)
        block = lambda: Block(cfg.dim, cfg.num_heads, mixer, mlp_ratio=cfg.mlp_ratio,
                              num_components=cfg.num_components, ssog_backend=cfg.ssog_backend,
                              attn_backend=cfg.attn_backend, use_norm=cfg.use_norm, use_mlp=cfg.use_mlp, **fk)
        if variant == "discrete":
            self.blocks = nn.ModuleList([block() for _ in range(cfg.depth)])
        elif variant == "looped":
            self.blocks = nn.ModuleList([block()])
        else:
            from .ode import ODEFlow, VectorField
            self.vector_field = VectorField(block())
            self.flow = ODEFlow(self.vector_field, t1=cfg.t1, method=cfg.method, rtol=cfg.rtol, atol=cfg.atol,
                                options=cfg.options, adjoint=cfg.adjoint)
        self.norm = nn.LayerNorm(cfg.dim, eps=1e-6, **fk)
        self.head = nn.Linear(cfg.dim, cfg.num_classes, **fk)
        if not self.head.weight.is_meta:
            self.apply(_init_weights)
            for m in self.modules():
                if hasattr(m, "reset_kernels"):
                    m.reset_kernels()

    @property
    def t1(self) -> float:
        if self.variant != "ode":
            raise AttributeError("t1 exists only for the ode variant")
        return self.flow.t1

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Patch + position embedding: images (B, C, H, W) -> x0 (B, H/p, W/p, dim)."""
        return self.patch_embed(images)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        # every SSoG block's kernels from one evaluation, its factors made once per forward (ssog.prepared_kernels)
        with prepared_kernels([m for m in self.modules() if isinstance(m, SSoG)], x.shape[1], x.shape[2]):
            if self.variant == "discrete":
                for blk in self.blocks:
                    x = blk(x)
            elif self.variant == "looped":
                for _ in range(self.config.depth):
                    x = self.blocks[0](x)
            else:
                x = self.flow(x)
        return x

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x).mean(dim=(1, 2)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(self.embed(images)))


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


PRESETS = {
    "tiny": dict(img_size=32, patch_size=8, dim=48, depth=2, num_heads=3, num_classes=10),
    "ti": dict(dim=192, num_heads=3),
    "s": dict(dim=384, num_heads=6),
    "b": dict(dim=768, num_heads=12),
}


def vit_from_preset(name: str, variant: str = "discrete", mixer: str = "ssog", *, device=None, dtype=None,
                    **overrides) -> ViT:
    """Named presets: ti/s/b (widths 192/384/768, heads 3/6/12, depth 12, patch 16, 224x224, 100 classes)
    and `tiny` (32x32 input, 4x4 grid, width 48, depth 2) that runs in seconds on a CPU."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return ViT(variant, mixer, device=device, dtype=dtype, **{**PRESETS[name], **overrides})
