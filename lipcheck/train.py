"""Training: AdamW, linear warmup + cosine decay, label smoothing, random crop/flip, gradient clipping,
mixed precision on GPU, per-epoch JSON-lines metrics, atomic checkpoints and exact resume, and
DistributedDataParallel when launched by torchrun (nccl on GPU, gloo on CPU).

Randomness that decides *what* a step sees (the shuffle and every example's crop offset and flip)
is a function of (seed, epoch) alone, drawn for the whole data set at the start of each epoch and
looked up by example index. So the data a global batch holds, and the augmentation of each of its
examples, is the same whether the batch is processed by one process or split over N, and the same
after a resume; the global RNG states are checkpointed as well, for anything else that draws.

`--batch-size` is the global batch: each of N processes takes batch_size / N examples, and DDP's
gradient average over processes then equals the gradient of the mean loss over the global batch.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from .data import ImageData, load_dataset
from .models.vit import PRESETS, VARIANTS, ViT
from .mixers import MIXERS
from .files import atomic_write

# Digits are 8x8 grey: patch 2 gives a 4x4 token grid. Width/depth/heads shared by both mixers.
DIGITS_PRESET = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, dim=48, depth=4, num_heads=3)
TRAIN_PRESETS = {**PRESETS, "digits": DIGITS_PRESET}
# The ODE variant trains with a cheap fixed-step solver: classical RK4, step 0.5 on [0, 1]
# (2 steps, 8 vector-field evaluations per forward), backpropagated through the solver steps.
ODE_TRAIN_SOLVER = dict(method="rk4", options={"step_size": 0.5})

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
# What a checkpoint holds beyond what resume needs: the model's architecture and configuration and the
# data it was trained on, so that `lipcheck.load` rebuilds the model without the training options.
# Bump FORMAT when the layout changes; a reader refuses formats newer than its own.
FORMAT = 1
ARCH = "lipcheck.ViT"


class CheckpointError(RuntimeError):
    """A checkpoint file exists but cannot be used (corrupt, truncated, or from a different run)."""


@dataclasses.dataclass
class TrainConfig:
    epochs: int = 30
    batch_size: int = 64          # global batch, split evenly over processes
    lr: float = 2e-3              # peak learning rate, reached at the end of warmup
    weight_decay: float = 0.05
    warmup_epochs: float = 2.0
    min_lr_ratio: float = 0.01    # cosine decays to lr * min_lr_ratio
    label_smoothing: float = 0.1
    clip_grad: float = 1.0        # max global gradient 2-norm (0 disables)
    crop_padding: int = 1         # random crop of the zero-padded image (0 disables)
    flip: bool = False            # random horizontal flip (off for digits: mirrored digits are other symbols)
    resize: bool = False          # resample images to the model's resolution (CIFAR-100 -> 224)
    amp: bool = True              # autocast + grad scaling; only ever used on CUDA
    seed: int = 0

    def __post_init__(self):
        for name in ("epochs", "batch_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.crop_padding < 0:
            raise ValueError(f"crop_padding must be >= 0, got {self.crop_padding}")


# --------------------------------------------------------------------------------- model and data
def build_model(preset: str, variant: str, mixer: str, *, in_chans: int, num_classes: int, seed: int = 0,
                device=None, dtype=None, **overrides) -> ViT:
    """ViT from a training preset; in_chans/num_classes come from the data, the ODE variant gets
    ODE_TRAIN_SOLVER unless overridden. The seed fixes the initial weights."""
    if preset not in TRAIN_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(TRAIN_PRESETS)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
    if mixer not in MIXERS:
        raise ValueError(f"unknown mixer {mixer!r}; choose one of {MIXERS}")
    cfg = {**TRAIN_PRESETS[preset], "in_chans": in_chans, "num_classes": num_classes}
    if variant == "ode":
        cfg.update(ODE_TRAIN_SOLVER)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return ViT(variant, mixer, device=device, dtype=dtype, **cfg)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def preset_param_counts(presets=("tiny", "ti", "s", "b")) -> list[dict]:
    """Parameter counts of every preset x variant for both mixers, built on the meta device (no memory)."""
    rows = []
    for preset in presets:
        for variant in VARIANTS:
            n = {m: count_params(ViT(variant, m, device="meta", **TRAIN_PRESETS[preset])) for m in MIXERS}
            rows.append(dict(preset=preset, variant=variant, ssog=n["ssog"], attention=n["attention"],
                             saved=n["attention"] - n["ssog"], saved_pct=100.0 * (1 - n["ssog"] / n["attention"])))
    return rows


def check_resolution(model: ViT, data: ImageData, resize: bool) -> None:
    """Images must match the model's input resolution unless they are resampled to it."""
    if data.channels != model.patch_embed.proj.in_channels:
        raise ValueError(f"{data.name} images have {data.channels} channels but the model expects "
                         f"{model.patch_embed.proj.in_channels}; build it with in_chans={data.channels}")
    H, W = data.size
    if not resize and (H, W) != (model.img_size, model.img_size):
        raise ValueError(f"{data.name} images are {H}x{W} but the model was built for {model.img_size}x"
                         f"{model.img_size} (img_size); pick a preset built for {H}x{W} (e.g. --preset digits "
                         f"for digits) or pass --resize to resample the images to {model.img_size}x{model.img_size}")


def augment(x: torch.Tensor, shifts: torch.Tensor, flips: torch.Tensor, pad: int) -> torch.Tensor:
    """Random crop of the zero-padded image at offset shifts[b] = (dy, dx) in [0, 2 pad], then a
    horizontal flip where flips[b]; x (B, C, H, W). With dy = dx = pad the crop is the identity."""
    B, C, H, W = x.shape
    if pad > 0:
        xp = F.pad(x, (pad, pad, pad, pad))
        rows = torch.arange(H, device=x.device)[None, :] + shifts[:, 0:1].to(x.device)  # (B, H)
        cols = torch.arange(W, device=x.device)[None, :] + shifts[:, 1:2].to(x.device)  # (B, W)
        b = torch.arange(B, device=x.device)[:, None, None]
        x = xp.permute(0, 2, 3, 1)[b, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
    if flips.any():
        x = torch.where(flips.to(x.device)[:, None, None, None], x.flip(-1), x)
    return x


def prepare(x: torch.Tensor, data: ImageData, size: int) -> torch.Tensor:
    """Normalise with the training split's channel statistics and resample to size x size."""
    mean = data.mean.to(x.device, x.dtype)[None, :, None, None]
    std = data.std.to(x.device, x.dtype)[None, :, None, None]
    x = (x - mean) / std
    if tuple(x.shape[-2:]) != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    return x


def epoch_draws(n: int, epoch: int, seed: int, pad: int, flip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every example's crop offset (n, 2) and flip (n,) for this epoch: a function of (seed, epoch) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch + 1)
    shifts = torch.randint(0, 2 * pad + 1, (n, 2), generator=g)
    flips = torch.rand(n, generator=g) < 0.5 if flip else torch.zeros(n, dtype=torch.bool)
    return shifts, flips


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1 over warmup_steps (step s uses (s + 1) / warmup), then cosine to min_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------ distributed
@dataclasses.dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False   # this code created the process group and must destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device) -> DistInfo:
    """Join the process group torchrun describes in the environment (WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR/PORT): nccl on CUDA, gloo on CPU. A single process gets world_size 1 and no group."""
    device = torch.device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo(device=device)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
        owns = True
    return DistInfo(rank, world, local, device, owns)


def _all_sum(values: list[float], info: DistInfo) -> list[float]:
    if info.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return t.tolist()


# ------------------------------------------------------------------------------------ checkpoints
def rng_states() -> dict:
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"name": np_state[0], "key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "python": {"version": py_state[0], "state": list(py_state[1]), "gauss": py_state[2]},
    }


def set_rng_states(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    n = s["numpy"]
    np.random.set_state((n["name"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    p = s["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


def save_checkpoint(state: dict, path) -> Path:
    """torch.save through files.atomic_write (temporary file, fsync, rename): an interrupted write
    leaves the previous checkpoint untouched (rename is atomic on POSIX)."""
    return atomic_write(path, lambda f: torch.save(state, f))


CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "rng", "spec", "history")


def load_checkpoint(path, map_location="cpu") -> dict:
    """Read a checkpoint written by save_checkpoint; CheckpointError if it is corrupt or incomplete."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}; run without --resume to start a new run, "
                                f"or point --out at the directory of the run to resume")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        # torch's own text is left out: it suggests loading with weights_only=False, which runs code in the file
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt or unreadable ({type(e).__name__}): it is not a "
                              f"complete file written by `lipcheck train`; use the run's checkpoint.pt, or write a new "
                              f"one with `lipcheck train --out DIR`") from None
    if not isinstance(state, dict) or any(k not in state for k in CHECKPOINT_KEYS):
        have = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: expected keys {CHECKPOINT_KEYS}, found "
                              f"{have}; delete it to start the run over")
    return state


def model_record(model: ViT, data: ImageData | None = None, resize: bool = False) -> dict:
    """The architecture, ViT configuration and data description that `lipcheck.load` rebuilds from."""
    rec = {"format": FORMAT, "arch": ARCH, "variant": model.variant, "mixer": model.mixer_name,
           "model_config": dataclasses.asdict(model.config)}
    if data is not None:
        rec["data_info"] = {"name": data.name, "channels": data.channels, "size": list(data.size),
                            "num_classes": data.num_classes, "mean": data.mean.tolist(), "std": data.std.tolist(),
                            "resize": bool(resize)}
    return rec


def _write_metrics(path: Path, history: list[dict]) -> None:
    atomic_write(path, "".join(json.dumps(h) + "\n" for h in history))


# ----------------------------------------------------------------------------------------- training
def evaluate(model: nn.Module, data: ImageData, info: DistInfo, *, batch_size: int, size: int, dtype,
             amp_dtype=None) -> dict:
    """Mean cross-entropy (no smoothing) and accuracy on `data`, each process taking every world_size-th example."""
    model.eval()
    idx = torch.arange(info.rank, len(data), info.world_size)
    loss_sum = correct = 0.0
    with torch.no_grad():
        for b in idx.split(batch_size):
            x, y = data.batch(b, device=info.device, dtype=dtype)
            with torch.autocast(info.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(prepare(x, data, size))
            logits = logits.float() if amp_dtype is not None else logits
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += float((logits.argmax(-1) == y).sum())
    loss_sum, correct, n = _all_sum([loss_sum, correct, float(len(idx))], info)
    return {"loss": loss_sum / n, "acc": correct / n}


def train(model: ViT, train_data: ImageData, test_data: ImageData, cfg: TrainConfig, out_dir=None, *,
          resume: bool = False, spec: dict | None = None, info: DistInfo | None = None, dtype=torch.float32,
          progress: bool = True, on_epoch_end=None, monitor=None) -> dict:
    """Train `model` (already on its device) for cfg.epochs; checkpoint and log to out_dir (rank 0).

    resume: continue from out_dir/checkpoint.pt (model, optimiser, scheduler, scaler, RNG states, epoch).
    spec: what identifies the run (preset, variant, ...); a resumed checkpoint must carry the same.
    on_epoch_end(epoch, record): called after each epoch's checkpoint, on every process.
    monitor(model) -> dict: called after each epoch's evaluation on rank 0, stored as record["monitor"]
    (so it is checkpointed and logged); the global RNG states are restored around it, so a monitored run
    trains exactly as an unmonitored one.
    Returns {"history": [...per-epoch records...], "test_acc", "test_loss", "wall_s", "params"}.
    """
    info = info or DistInfo(device=next(model.parameters()).device)
    device = info.device
    check_resolution(model, train_data, cfg.resize)
    check_resolution(model, test_data, cfg.resize)
    if cfg.batch_size % info.world_size:
        raise ValueError(f"batch_size ({cfg.batch_size}) is the global batch and must be divisible by the number "
                         f"of processes ({info.world_size})")
    local_bs = cfg.batch_size // info.world_size
    out_dir = Path(out_dir) if out_dir is not None else None
    spec = dict(spec or {})
    use_amp = cfg.amp and device.type == "cuda" and dtype == torch.float32  # float64 runs stay float64
    amp_dtype = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if use_amp else None
    steps_per_epoch = math.ceil(math.ceil(len(train_data) / info.world_size) / local_bs)
    opt = _Optimisation.of(model, cfg, steps_per_epoch, amp_dtype)
    start_epoch, history = 0, []
    ckpt_path = out_dir / CHECKPOINT if out_dir is not None else None
    if resume:
        start_epoch, history = _resume(model, opt, ckpt_path, spec, device)
        if info.is_main:  # drop metrics of epochs after the checkpoint (written before an interruption)
            _write_metrics(out_dir / METRICS, history)

    net = model
    if info.world_size > 1:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = DistributedSampler(range(len(train_data)), num_replicas=info.world_size, rank=info.rank, shuffle=True,
                                 seed=cfg.seed, drop_last=False)
    wall_before = history[-1]["wall_s"] if history else 0.0
    for epoch in range(start_epoch, cfg.epochs):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        batches = torch.tensor(list(sampler), dtype=torch.int64).split(local_bs)
        sums, nfe = _train_epoch(net, model, train_data, batches, cfg, opt, epoch, device=device, dtype=dtype,
                                 show=progress and info.is_main)
        loss_sum, correct, seen = _all_sum(sums, info)
        test = evaluate(model, test_data, info, batch_size=max(local_bs, 256), size=model.img_size, dtype=dtype,
                        amp_dtype=opt.amp_dtype)
        epoch_s = time.perf_counter() - t0
        record = {"epoch": epoch + 1, "train_loss": loss_sum / seen, "train_acc": correct / seen,
                  "test_loss": test["loss"], "test_acc": test["acc"], "lr": opt.optimizer.param_groups[0]["lr"],
                  "epoch_s": epoch_s, "wall_s": wall_before + epoch_s}
        if nfe is not None:
            record["nfe_forward"] = nfe
        if monitor is not None and info.is_main:
            _monitor(model, monitor, record)
        wall_before = record["wall_s"]
        history.append(record)
        if info.is_main and out_dir is not None:
            _save(model, opt, epoch, spec, history, cfg, train_data, out_dir)
        if on_epoch_end is not None:
            on_epoch_end(epoch + 1, record)

    last = history[-1] if history else {}
    return {"history": history, "test_acc": last.get("test_acc"), "test_loss": last.get("test_loss"),
            "wall_s": last.get("wall_s", 0.0), "params": count_params(model)}


@dataclasses.dataclass
class _Optimisation:
    """AdamW with warmup then cosine, the gradient scaler and the autocast dtype (None: no autocast; float16 is
    the one that scales gradients)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None

    @classmethod
    def of(cls, model: ViT, cfg: TrainConfig, steps_per_epoch: int, amp_dtype) -> "_Optimisation":
        total_steps = cfg.epochs * steps_per_epoch
        warmup_steps = min(total_steps, max(1, round(cfg.warmup_epochs * steps_per_epoch)))
        # no weight decay on biases, norms, position embeddings and the Gaussian parameters (timm convention)
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not n.endswith("pos")
                 and not n.split(".")[-1] in ("mu", "sigma_raw", "alpha")]
        decay_ids = {id(p) for p in decay}
        no_decay = [p for p in model.parameters() if id(p) not in decay_ids]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, warmup_steps, total_steps, cfg.min_lr_ratio))
        scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
        return cls(optimizer, scheduler, scaler, amp_dtype)


def _resume(model: ViT, opt: _Optimisation, ckpt_path, spec: dict, device) -> tuple[int, list[dict]]:
    """Model, optimiser, scheduler, scaler and RNG states from the checkpoint; (its epoch, its history)."""
    if ckpt_path is None:
        raise ValueError("resume=True needs out_dir (the directory holding checkpoint.pt)")
    state = load_checkpoint(ckpt_path, map_location=device)
    if state["spec"] != spec:
        raise CheckpointError(f"checkpoint {str(ckpt_path)!r} belongs to a different run: it was written for "
                              f"{state['spec']}, this run is {spec}; use another --out or the same options")
    try:
        model.load_state_dict(state["model"])
        opt.optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {str(ckpt_path)!r} does not fit this model: {e}") from e
    opt.scheduler.load_state_dict(state["scheduler"])
    opt.scaler.load_state_dict(state["scaler"])
    set_rng_states(state["rng"])
    return int(state["epoch"]), list(state["history"])


def _train_epoch(net: nn.Module, model: ViT, train_data: ImageData, batches, cfg: TrainConfig, opt: _Optimisation,
                 epoch: int, *, device, dtype, show: bool) -> tuple[list[float], int | None]:
    """One pass over this process's batches: ([loss sum, correct, seen], the ODE's NFE of the last forward or
    None for other variants)."""
    from tqdm.auto import tqdm

    use_amp = opt.amp_dtype is not None
    is_ode = getattr(model, "variant", None) == "ode"
    net.train()
    shifts, flips = epoch_draws(len(train_data), epoch, cfg.seed, cfg.crop_padding, cfg.flip)
    loss_sum = correct = seen = 0.0
    nfe = 0
    bar = tqdm(batches, desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False, disable=not show)
    for idx in bar:
        x, y = train_data.batch(idx, device=device, dtype=dtype)
        x = prepare(augment(x, shifts[idx], flips[idx], cfg.crop_padding), train_data, model.img_size)
        with torch.autocast(device.type, dtype=opt.amp_dtype, enabled=use_amp):
            logits = net(x)
        logits = logits.float() if use_amp else logits  # autocast may leave half-precision logits
        loss = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite training loss at epoch {epoch + 1}; lower --lr "
                                     f"(now {cfg.lr}) or keep gradient clipping on")
        opt.optimizer.zero_grad(set_to_none=True)
        opt.scaler.scale(loss).backward()
        if cfg.clip_grad > 0:
            opt.scaler.unscale_(opt.optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.scaler.step(opt.optimizer)
        opt.scaler.update()
        opt.scheduler.step()
        loss_sum += float(loss.detach()) * len(idx)
        correct += float((logits.detach().argmax(-1) == y).sum())
        seen += len(idx)
        if is_ode:
            nfe = model.flow.last_nfe
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
    return [loss_sum, correct, seen], nfe if is_ode else None


def _monitor(model: ViT, monitor, record: dict) -> None:
    """record["monitor"] = monitor(model), with the global RNG states and the model's mode restored after it, so
    that a monitored run trains exactly as an unmonitored one; record["monitor_s"] its seconds."""
    states, t_mon = rng_states(), time.perf_counter()
    was_training = model.training
    try:
        record["monitor"] = monitor(model)
    finally:
        set_rng_states(states)
        model.train(was_training)
    record["monitor_s"] = time.perf_counter() - t_mon


def _save(model: ViT, opt: _Optimisation, epoch: int, spec: dict, history: list[dict], cfg: TrainConfig,
          train_data: ImageData, out_dir: Path) -> None:
    """The checkpoint after `epoch`, then the epoch's line of the metrics log (a resume rewrites it from there)."""
    save_checkpoint({"model": model.state_dict(), "optimizer": opt.optimizer.state_dict(),
                     "scheduler": opt.scheduler.state_dict(), "scaler": opt.scaler.state_dict(),
                     "epoch": epoch + 1, "rng": rng_states(), "spec": spec, "history": history,
                     "config": dataclasses.asdict(cfg), **model_record(model, train_data, cfg.resize)},
                    out_dir / CHECKPOINT)
    with open(out_dir / METRICS, "a") as f:
        f.write(json.dumps(history[-1]) + "\n")


def run(preset: str, variant: str, mixer: str, *, data: str = "digits", data_dir=None, cfg: TrainConfig,
        out_dir=None, resume: bool = False, device="cpu", dtype=torch.float32, progress: bool = True,
        limit_train: int | None = None, limit_test: int | None = None, on_epoch_end=None, monitor=None,
        **overrides) -> dict:
    """Load data, build the model, train it; the one code path for single-process and torchrun runs.

    monitor: None, or a callable (model, test_data) -> dict run after every epoch (see `train`), e.g.
    `lipcheck.verdicts.Monitor`."""
    info = setup_distributed(device)
    try:
        train_data, test_data = load_dataset(data, data_dir)
        train_data, test_data = train_data.subset(limit_train), test_data.subset(limit_test)
        model = build_model(preset, variant, mixer, in_chans=train_data.channels,
                            num_classes=train_data.num_classes, seed=cfg.seed, device=info.device, dtype=dtype,
                            **overrides)
        spec = {"preset": preset, "variant": variant, "mixer": mixer, "data": data, "seed": cfg.seed,
                "dtype": str(dtype), "overrides": {k: v for k, v in overrides.items()},
                "limit_train": limit_train, "limit_test": limit_test}
        result = train(model, train_data, test_data, cfg, out_dir, resume=resume, spec=spec, info=info,
                       dtype=dtype, progress=progress, on_epoch_end=on_epoch_end,
                       monitor=None if monitor is None else (lambda m: monitor(m, test_data)))
        result.update(spec=spec, world_size=info.world_size, rank=info.rank, model=model)
        if info.owns_group:
            # every rank (rank 0 last writes the checkpoint) reaches the teardown before any closes its gloo pairs:
            # a rank that destroyed its group while another still held the connection aborted at exit
            # ("terminate called without an active exception") in 2 of about 30 CI runs
            dist.barrier()
        return result
    finally:
        if info.owns_group:
            dist.destroy_process_group()
