"""Per-thread buffers that the SSoG inference forward reuses across calls of one shape."""
from __future__ import annotations

import threading

import torch

# Inference calls of more than FUSE_HEADS_TOKENS tokens on a CPU write the value projection, the mixed values and
# the stacked backend's per-head intermediates into buffers kept per thread (`_Workspace`) while they take at most
# this many bytes (0: never). Fresh tensors of these sizes cost fresh pages on every call in a plain process: glibc
# malloc maps them anew or trims the freed heap back to the OS, and the kernel zeroes each page on first touch
# (measured with one thread, experiments/plain_speed.py: 2,700-4,600 page faults per forward at 64 x 64, C = 192 and
# 384, and at 14 x 14, C = 192, batch 32; the forward 1.15-1.4x slower than with the buffers).
WORKSPACE_MAX_BYTES = 64 << 20


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
