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

    - ``root``: the folder of ``cifar10`` (``cifar-10-batches-py/``), ``imagefolder`` (``<split>/<class>/*``) and
      ``fashion-mnist`` (``fashion-mnist/``, else Debian's), and of the parsed copies of ``mnist`` and
      ``fashion-mnist`` (``mnist-cache/``, ``fashion-mnist-cache/``); ``synthetic-shapes`` and ``mnist-5k`` ignore it.
    - ``image_size``: 32 for ``cifar10``; 28 or 14 for the MNIST-format sets. ``size`` keeps the first ``size``
      examples (``synthetic-shapes``: the split size, default ``SYNTHETIC_DEFAULT_SIZES``); ``seed`` selects
      ``synthetic-shapes``' images (the others' are fixed).
    - ``download`` (``cifar10``): fetch the archive into ``root`` if a file is missing (one rank, the others after it).
      ``party`` (``local`` partition): the ``imagefolder`` train split is ``<root>/party-<party>/``. See docs/data.md.

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
