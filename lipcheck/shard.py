"""Many images over torchrun processes: the batches of a run, which of them each process proves, and every
process's rows gathered in image order (`lipcheck wellposed --checkpoint RUN --all-test-images`).

The batches depend on the number of images and the batch size alone, never on the number of processes: an
enclosure shares its solver steps and constants over its batch, so an image's numbers depend on its batch mates,
and fixed batches make a sharded run's numbers those of one process. Process r of w proves batches r, r + w, ...
(contiguous runs of images, dealt round-robin, so a slow stretch of the data set is split too).
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist

from .train import DistInfo, setup_distributed


def batches(n: int, batch: int) -> list[list[int]]:
    """Images 0..n-1 in consecutive runs of `batch` (the last one shorter)."""
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n must be a positive number of images, got {n!r}")
    if not (isinstance(batch, int) and batch >= 1):
        raise ValueError(f"batch must be a positive number of images per enclosure, got {batch!r}: pass --batch N "
                         f"with N >= 1")
    return [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]


def share(plan: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """The batches process `rank` of `world` proves: rank, rank + world, ..."""
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"rank must be in [0, world) and world >= 1, got rank {rank!r}, world {world!r}")
    return plan[rank::world]


def merge(parts: list[list[dict]], n: int) -> list[dict]:
    """Every process's rows (dicts with an "image" index) as one list in image order; ValueError unless each of
    the n images is there exactly once (a lost or doubled shard would otherwise pass as a smaller run)."""
    rows = sorted((r for part in parts for r in part), key=lambda r: r["image"])
    got = [r["image"] for r in rows]
    if got != list(range(n)):
        missing = sorted(set(range(n)) - set(got))
        doubled = sorted({i for i in got if got.count(i) > 1})
        raise ValueError(f"the shards do not cover images 0..{n - 1} once each: missing {missing[:8]}, "
                         f"doubled {doubled[:8]}")
    return rows


def gather(rows: list[dict], info: DistInfo, n: int) -> list[dict]:
    """This process's rows joined with every other's (all_gather_object), in image order, on every process."""
    if info.world_size == 1:
        return merge([rows], n)
    parts = [None] * info.world_size
    dist.all_gather_object(parts, rows)
    return merge(parts, n)


@contextlib.contextmanager
def processes(device="cpu"):
    """The process group torchrun describes (gloo on CPU, nccl on CUDA; `train.setup_distributed`), or one process
    without a group; yields its DistInfo and leaves the group once every process is done."""
    info = setup_distributed(device)
    try:
        yield info
    finally:
        if info.owns_group:
            dist.barrier()  # no process closes its connections while another still gathers
            dist.destroy_process_group()
