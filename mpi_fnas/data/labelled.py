"""What every dataset split shares: labels known up front, pixels rendered on request, and one index check."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def checked_indices(indices: np.ndarray, size: int) -> np.ndarray:
    """`indices` as a 1-D int64 array; ValueError unless 1-D integers, IndexError unless all in ``[0, size)``."""
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise ValueError("indices must be a 1-D integer array")
    idx = idx.astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= size):
        raise IndexError(f"indices out of range [0, {size})")
    return idx


class LabelledSplit:
    """Base of a split whose ``_labels`` (int64 (N,)) are set by the subclass; ``render`` is the subclass's."""

    _labels: np.ndarray

    def __len__(self) -> int:
        return int(self._labels.size)

    @property
    def labels(self) -> np.ndarray:
        """Class of every example, int64 (N,)."""
        return self._labels


class HeldOut(LabelledSplit):
    """The examples at `positions` of a `split` (the train split's last ``data.holdout``: what rank 0 evaluates a
    tuning run on instead of the test split), with the split's shape and classes."""

    def __init__(self, split: Any, positions: np.ndarray) -> None:
        self._split, self._positions = split, checked_indices(positions, len(split))
        self._labels = split.labels[self._positions]
        self.num_classes, self.in_channels, self.image_size = split.num_classes, split.in_channels, split.image_size
        self.classes = getattr(split, "classes", None)

    def render(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y of the held-out examples at `indices` (0 .. N − 1)."""
        return self._split.render(self._positions[checked_indices(indices, len(self))])
