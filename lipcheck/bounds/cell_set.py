"""Cells of a branch and bound over the torus held as parallel tensors, one row per cell (the resolution-free bound
in spectral.py, the Toeplitz majorant's envelope in majorant.py)."""
from __future__ import annotations

import dataclasses

import torch


class CellSet:
    """Mixin for a dataclass whose fields are tensors with one row per cell: subsets and unions keep rows together."""

    def take(self, mask: torch.Tensor):
        return type(self)(*(getattr(self, f.name)[mask] for f in dataclasses.fields(self)))

    def cat(self, other):
        return type(self)(*(torch.cat([getattr(self, f.name), getattr(other, f.name)]) for f in dataclasses.fields(self)))
