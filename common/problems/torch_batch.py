"""Batch: rows of one client's data as a PyTorch problem's loss receives them (common/problems/pytorch.py).
Without torch at import, as pytorch.py is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Batch:
    """Rows of one client's data as tensors on the device: all its training rows, a minibatch, or its held-out
    rows. `inputs` as the problem's `inputs` shaped them, in the spec's dtype; `targets` the file's `y` (same
    dtype); `group` its sensitive attribute, if it has one."""

    inputs: torch.Tensor
    targets: torch.Tensor
    group: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.targets.shape[0])

    def take(self, rows: torch.Tensor) -> Batch:
        group = None if self.group is None else self.group[rows]
        return Batch(self.inputs[rows], self.targets[rows], group)
