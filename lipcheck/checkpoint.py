"""Load a model that `lipcheck train` wrote, and images from the data set it was trained on.

    ckpt = lipcheck.load("runs/digits-digits-ode-ssog-s0")       # the run directory or its checkpoint.pt
    ckpt.model, ckpt.variant, ckpt.mixer, ckpt.config, ckpt.data  # the trained ViT (eval mode), its config, data info
    x = images(ckpt, n=8)                                          # normalised test images the model accepts
    init = ckpt.initial_model()                                    # the same architecture at its initial weights

Every failure is a one-line error naming the fix: FileNotFoundError for a missing file, CheckpointError
for a corrupt or incomplete file, a newer format, another architecture or weights that do not fit the
recorded configuration; ValueError for a data set whose channels or image size the model cannot take.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .data import DATASETS, load_dataset
from .models.vit import VARIANTS, ViT
from .mixers import MIXERS
from . import train as T
from .train import CheckpointError

# channels and classes of the data sets training knows, for checkpoints written before FORMAT 1
_DATA_SHAPES = {"digits": (1, 10), "cifar100": (3, 100)}


@dataclasses.dataclass
class Checkpoint:
    """A trained model and what it was trained on."""
    path: Path
    model: ViT
    variant: str
    mixer: str
    config: dict          # ViT configuration (img_size, patch_size, dim, depth, ...)
    data: dict            # name, channels, size, num_classes, mean, std, resize
    spec: dict            # what identifies the training run (preset, seed, overrides, ...)
    train_config: dict
    epoch: int
    history: list
    format: int

    @property
    def grid(self) -> tuple[int, int]:
        """The model's own token grid, img_size / patch_size per axis."""
        g = self.config["img_size"] // self.config["patch_size"]
        return g, g

    def initial_model(self, *, device=None, dtype=None) -> ViT:
        """The same architecture at the weights training started from (the run's seed fixes them)."""
        return _build(self.variant, self.mixer, self.config, seed=int(self.spec.get("seed", 0)),
                      device=device or next(self.model.parameters()).device,
                      dtype=dtype or next(self.model.parameters()).dtype)


def _build(variant: str, mixer: str, config: dict, *, seed: int, device, dtype) -> ViT:
    torch.manual_seed(seed)  # as lipcheck.train.build_model: the seed fixes the initial weights
    return ViT(variant, mixer, device=device, dtype=dtype, **config)


def resolve(path) -> Path:
    """A run directory stands for its checkpoint.pt."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / T.CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}; pass the checkpoint.pt (or the run directory) "
                                f"that `lipcheck train --out DIR` wrote")
    return path


def _record(state: dict, path: Path) -> dict:
    """variant, mixer, model_config, data_info of a checkpoint; rebuilt from the run's spec for format 0."""
    fmt = state.get("format", 0)
    if not isinstance(fmt, int) or fmt > T.FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r} has format {fmt!r}, newer than this lipcheck reads "
                              f"({T.FORMAT}); upgrade lipcheck to read it")
    if fmt >= 1:
        if state.get("arch") != T.ARCH:
            raise CheckpointError(f"checkpoint {str(path)!r} holds a {state.get('arch')!r} model, not a {T.ARCH}; "
                                  f"lipcheck.load reads only what `lipcheck train` wrote (load other models "
                                  f"yourself and pass the nn.Module to the library)")
        return {k: state[k] for k in ("variant", "mixer", "model_config", "data_info")}
    spec = state["spec"]
    preset, data = spec.get("preset"), spec.get("data")
    if preset not in T.TRAIN_PRESETS or data not in _DATA_SHAPES:
        raise CheckpointError(f"checkpoint {str(path)!r} names no known preset/data set ({preset!r}, {data!r}); "
                              f"retrain it with `lipcheck train`")
    in_chans, num_classes = _DATA_SHAPES[data]
    cfg = {**T.TRAIN_PRESETS[preset], "in_chans": in_chans, "num_classes": num_classes}
    if spec.get("variant") == "ode":
        cfg.update(T.ODE_TRAIN_SOLVER)
    cfg.update(spec.get("overrides") or {})
    return {"variant": spec.get("variant"), "mixer": spec.get("mixer"), "model_config": cfg,
            "data_info": {"name": data, "channels": in_chans, "num_classes": num_classes}}


def load(path, *, device="cpu", dtype=None) -> Checkpoint:
    """The model of a `lipcheck train` checkpoint, in eval mode on `device` (dtype: as saved when None)."""
    path = resolve(path)
    state = T.load_checkpoint(path, map_location="cpu")
    rec = _record(state, path)
    variant, mixer, cfg = rec["variant"], rec["mixer"], dict(rec["model_config"])
    if variant not in VARIANTS or mixer not in MIXERS:
        raise CheckpointError(f"checkpoint {str(path)!r} holds variant {variant!r} with mixer {mixer!r}; this "
                              f"lipcheck builds variants {VARIANTS} with mixers {MIXERS}: upgrade lipcheck")
    weights = state["model"]
    saved = next((v.dtype for v in weights.values() if torch.is_floating_point(v)), torch.float32)
    try:
        model = _build(variant, mixer, cfg, seed=int(state["spec"].get("seed", 0)), device="cpu", dtype=saved)
        model.load_state_dict(weights)
    except (RuntimeError, TypeError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:300]
        raise CheckpointError(f"checkpoint {str(path)!r}: the weights do not fit a {variant}/{mixer} ViT with the "
                              f"recorded configuration ({first}); the file was altered or written by another "
                              f"program: retrain with `lipcheck train`") from None
    model = model.to(device=device, dtype=dtype or saved).eval()
    data = dict(rec["data_info"])
    data.setdefault("size", [cfg["img_size"]] * 2)
    return Checkpoint(path=path, model=model, variant=variant, mixer=mixer, config=cfg, data=data,
                      spec=dict(state["spec"]), train_config=dict(state.get("config", {})),
                      epoch=int(state["epoch"]), history=list(state["history"]), format=state.get("format", 0))


def images(ckpt: Checkpoint, *, data: str | None = None, data_dir=None, split: str = "test", n: int = 8,
           dtype=torch.float64, device=None) -> torch.Tensor:
    """The first n images of `split` of `data` (default: the data set the model was trained on), normalised
    and resampled exactly as training fed them, as (n, C, img_size, img_size). ValueError when the model
    cannot take them (channels, or image size without the run's --resize)."""
    name = data or ckpt.data["name"]
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose one of {DATASETS}")
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n must be a positive number of images, got {n!r}")
    train_data, test_data = load_dataset(name, data_dir)
    d = test_data if split == "test" else train_data
    resize = bool(ckpt.data.get("resize", ckpt.train_config.get("resize", False)))
    try:
        T.check_resolution(ckpt.model, d, resize)
    except ValueError as e:
        raise ValueError(f"data set {name!r} does not fit the checkpoint's model ({e}); use --data "
                         f"{ckpt.data['name']} (the data the model was trained on)") from None
    x, _ = d.subset(n).batch(torch.arange(min(n, len(d))), dtype=dtype)
    x = T.prepare(x, d, ckpt.model.img_size)
    return x.to(device) if device is not None else x
