"""``data.dataset: fashion-mnist``: Zalando's FashionMNIST, offline: 60,000 train and 10,000 test images of clothes,
28×28 grey, 10 classes (6,000 and 1,000 of each), the published splits in their original order.

The four official IDX files (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``, each gzipped or not) are read from ``<data.root>/fashion-mnist/`` when that folder
exists, else from Debian's package ``dataset-fashion-mnist`` (:data:`DEBIAN_FOLDER`), which ``scripts/install.sh``
installs where it runs as root on a Debian-like machine. Nothing is downloaded at run time.

Each split is checked once: its IDX headers (magic number, count, 28×28), its class counts and label range, and the
SHA-256 of both files' uncompressed bytes, which pins them to the published data (:data:`SHA256`: the same bytes
whichever gzip wrapped them; Debian's archives are recompressed, so the publisher's MD5 of the ``.gz`` files does not
apply). The checked split is kept as a ``.npy`` in ``<data.root>/fashion-mnist-cache/`` (the layout of
:mod:`mpi_fnas.data.mnist_full`: labels, then pixels) and memory-mapped by every rank: a party reads only the images
of its own shard. A missing or damaged file is refused in one line that names it, before anything is written.
"""

from __future__ import annotations

import gzip
import hashlib
from functools import lru_cache
from pathlib import Path

import numpy as np

from mpi_fnas.data.array_cache import cached_array
from mpi_fnas.data.cifar10 import DatasetNotFoundError
from mpi_fnas.data.digits import NATIVE_SIZE, NUM_CLASSES, PIXELS, DigitsSplit, first_rows
from mpi_fnas.data.mnist_csv import DatasetDamagedError
from mpi_fnas.data.mnist_full import pack, unpack

#: Where Debian's ``dataset-fashion-mnist`` puts the four files.
DEBIAN_FOLDER = Path("/usr/share/datasets/fashion-mnist")
#: The folder under ``data.root`` that takes precedence over Debian's, and where the checked splits are kept.
FOLDER, CACHE_FOLDER = "fashion-mnist", "fashion-mnist-cache"
#: Each split's (images, labels) file names, without ``.gz``.
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
ROWS = {"train": 60_000, "test": 10_000}
#: SHA-256 of each file's uncompressed bytes, as published (zalandoresearch/fashion-mnist).
SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
_MAGIC = {"images": 0x0803, "labels": 0x0801}  # IDX: unsigned bytes, 3 and 1 dimensions
#: The train split's pixel mean and std in [0, 1] (its statistics, as MNIST's 0.1307 and 0.3081 are MNIST's).
FASHION_MEAN = (0.2860,)
FASHION_STD = (0.3530,)
HOW_TO_GET = (f"install Debian's package (apt-get install dataset-fashion-mnist: the files go to {DEBIAN_FOLDER}/), "
              "or put the four official files, gzipped or not, in <data.root>/fashion-mnist/")


def fashion_files(root: str | Path, split: str) -> tuple[Path, Path]:
    """(images, labels) of `split` ("train" or "test"): ``<root>/fashion-mnist/`` if that folder exists, else Debian's;
    each name as it is, or with ``.gz``. DatasetNotFoundError (one line: what is missing, how to get it)."""
    if split not in FILES:
        raise ValueError(f"fashion-mnist has the splits train and test, got {split!r}")
    own = Path(root) / FOLDER
    folder = own if own.is_dir() else DEBIAN_FOLDER
    found, missing = [], []
    for name in FILES[split]:
        path = next((p for p in (folder / f"{name}.gz", folder / name) if p.is_file()), None)
        (found if path is not None else missing).append(path or name)
    if missing:
        raise DatasetNotFoundError(f"data.dataset fashion-mnist: {', '.join(map(str, missing))} (or .gz) not in "
                                   f"{folder}/; {HOW_TO_GET}")
    return found[0], found[1]


def read_idx(path: Path, kind: str, rows: int) -> np.ndarray:
    """The bytes after the header of IDX file `path` (``kind`` "images": (rows, 784); "labels": (rows,)), checked:
    its magic number, its count and 28×28 shape, its length, and the SHA-256 of its uncompressed bytes.
    DatasetDamagedError (one line, naming the file) otherwise."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise DatasetDamagedError(f"{path}: cannot be read as {'gzip' if path.suffix == '.gz' else 'IDX'} "
                                  f"({exc})") from None
    dims = (rows, NATIVE_SIZE, NATIVE_SIZE) if kind == "images" else (rows,)
    header = 4 + 4 * len(dims)
    got = [int.from_bytes(data[i:i + 4], "big") for i in range(0, header, 4)] if len(data) >= header else []
    if got[:1] != [_MAGIC[kind]] or tuple(got[1:]) != dims:
        raise DatasetDamagedError(f"{path}: not FashionMNIST's {kind} (IDX header {got or 'too short'}; expected "
                                  f"magic {_MAGIC[kind]:#06x} and shape {dims})")
    if len(data) != header + int(np.prod(dims)):
        raise DatasetDamagedError(f"{path}: {len(data) - header} bytes of {kind} where the header says "
                                  f"{int(np.prod(dims))} (a truncated file?)")
    name = path.name.removesuffix(".gz")
    if hashlib.sha256(data).hexdigest() != SHA256.get(name):
        raise DatasetDamagedError(f"{path}: its content is not the published {name} (SHA-256 differs: an edited or "
                                  "other file?)")
    values = np.frombuffer(data, dtype=np.uint8, offset=header)
    return values.reshape(rows, PIXELS) if kind == "images" else values


def check_labels(labels: np.ndarray, rows: int, source: Path) -> None:
    """DatasetDamagedError (one line) unless `labels` are `rows` classes 0..9, rows/10 of each."""
    if labels.shape != (rows,) or (labels.size and int(labels.max()) >= NUM_CLASSES):
        raise DatasetDamagedError(f"{source}: {labels.shape[0]} labels up to {int(labels.max(initial=0))}; the split "
                                  f"has {rows} of 0..{NUM_CLASSES - 1}")
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    if set(counts.tolist()) != {rows // NUM_CLASSES}:
        raise DatasetDamagedError(f"{source}: images per class {counts.tolist()}; the split has {rows // NUM_CLASSES} "
                                  "of each")


@lru_cache(maxsize=4)
def split_images(images: Path, labels: Path, cache_dir: Path, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels uint8 (N,), pixels uint8 (N, 784)) of one split's files, checked, memory-mapped from the cache in
    `cache_dir` (built on the first open; keyed by the images file, the labels compared at every open)."""
    def build(source: Path) -> np.ndarray:
        pixels, classes = read_idx(source, "images", rows), read_idx(labels, "labels", rows)
        check_labels(classes, rows, labels)
        return pack(np.concatenate([classes[:, None], pixels], axis=1))

    def check(packed: np.ndarray) -> None:  # at every open: the shape, and the labels file's classes (10 KB-60 KB)
        cached = unpack(packed, rows)[0]
        if not np.array_equal(cached, read_idx(labels, "labels", rows)):
            raise ValueError("the labels file differs from the cached split's")

    return unpack(cached_array(images, cache_dir, build=build, check=check), rows)


class FashionMnist(DigitsSplit):
    """One split of FashionMNIST: 1×``image_size``×``image_size`` grey images (28, or 14 average-pooled), 10
    classes, normalised with the train split's statistics. `root`: ``data.root`` (its ``fashion-mnist/`` if
    present; the cache under it)."""

    name = "fashion-mnist"
    mean, std = FASHION_MEAN, FASHION_STD

    def __init__(self, split: str, *, root: str | Path, size: int | None = None,
                 image_size: int = NATIVE_SIZE) -> None:
        if split not in FILES:
            raise ValueError(f"fashion-mnist has the splits train and test, got {split!r}")
        images, labels = fashion_files(root, split)
        classes, pixels = split_images(images, labels, Path(root) / CACHE_FOLDER, ROWS[split])
        rows = first_rows(np.arange(classes.size, dtype=np.int64), size)
        super().__init__(split, pixels, rows, classes[rows].astype(np.int64), image_size=image_size)
