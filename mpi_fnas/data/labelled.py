"""What every dataset split shares: labels known up front, pixels rendered on request, and one index check."""

from __future__ import annotations

import numpy as np


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
