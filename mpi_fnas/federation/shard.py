"""A party's examples as its stage holds them (:class:`Shard`: images and labels on its device, the stage's
per-example transform) and the exact (non-DP) batches it draws from them (:class:`BatchStream`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mpi_fnas.cpu_kernels import images_to_channels_last
from mpi_fnas.keystream import Keystream

#: ``transform(x, y) -> (x, y)``: what a stage does to a W batch's examples, each on its own (the augmentation).
Transform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Shard:
    """A party's examples: x (N, C, H, W) float32, y (N,) int64, on the party's device."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def examples(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) at `indices` (CPU or device), on the shard's device."""
        indices = indices.to(self.y.device)
        return self.x[indices], self.y[indices]


def channels_last(shard: Shard) -> Shard:
    """`shard` with its images ``(N, C, H, W)`` stored channels-last (other shapes as they are)."""
    return Shard(images_to_channels_last(shard.x), shard.y)


class BatchStream:
    """Shuffled mini-batches of a shard, reshuffled whenever fewer than `batch_size` unseen examples remain; a batch
    size at least the shard size gives the whole shard every time (full-batch gradients)."""

    def __init__(self, size: int, batch_size: int, stream: Keystream) -> None:
        if size < 1:
            raise ValueError("a party shard must hold at least one example")
        self.size = size
        self.batch_size = min(batch_size, size)
        self.stream = stream
        self._order = torch.empty(0, dtype=torch.long)
        self._pos = 0

    def next(self) -> torch.Tensor:
        """Indices (batch_size,) int64 into the shard."""
        if self._pos + self.batch_size > self._order.numel():
            self._order = self.stream.permutation(self.size)
            self._pos = 0
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return idx

    def state_dict(self) -> dict:
        """The stream's order and position, for the party's own state file."""
        return {"order": self._order.clone(), "pos": self._pos}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state written by :meth:`state_dict`."""
        self._order = state["order"].clone()
        self._pos = int(state["pos"])
