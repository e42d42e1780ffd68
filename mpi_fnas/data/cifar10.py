"""CIFAR-10 read from a local folder in the python-version on-disk format.

Layout: ``<root>/cifar-10-batches-py/{data_batch_1..data_batch_5, test_batch, batches.meta}``. Each batch is a
pickle (written by Python 2, so its string keys load as ``bytes`` under ``encoding="bytes"``) of a dict with
``b"data"`` (uint8 (N, 3072): per row the 1024 red, then green, then blue values, each plane row-major 32×32),
``b"labels"`` (N ints), ``b"batch_label"`` and ``b"filenames"``. It is read by an unpickler that builds only
those values (:class:`_BatchUnpickler`): a pickle naming any other global is refused before it runs.

We read the files ourselves rather than through ``torchvision.datasets.CIFAR10`` because that class verifies
MD5 sums, which small test fixtures in the same format cannot pass, and ``download_cifar10`` fetches the archive
with the standard library: the project needs no torchvision (which has no build for the CPU-only torch wheel).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpi_fnas.data.labelled import LabelledSplit, checked_indices

FOLDER = "cifar-10-batches-py"
TRAIN_FILES: tuple[str, ...] = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES: tuple[str, ...] = ("test_batch",)
META_FILE = "batches.meta"
IMAGE_SIZE = 32
NUM_CLASSES = 10
#: The archive ``data.download: true`` fetches, and its published MD5 (https://www.cs.toronto.edu/~kriz/cifar.html).
ARCHIVE = "cifar-10-python.tar.gz"
ARCHIVE_URL = f"https://www.cs.toronto.edu/~kriz/{ARCHIVE}"
ARCHIVE_MD5 = "c58f30108f718f92721af3b95e74349a"
DOWNLOAD_TIMEOUT_SECONDS = 60.0  # per blocking socket operation: a dead network fails in a minute, not never

# Per-channel mean and std of the CIFAR-10 training pixels scaled to [0, 1] (the values DARTS uses).
CIFAR10_MEAN = (0.49139968, 0.48215827, 0.44653124)
CIFAR10_STD = (0.24703233, 0.24348505, 0.26158768)


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are not where the configuration says they are."""


def _not_found(root: Path, missing: Path) -> DatasetNotFoundError:
    return DatasetNotFoundError(
        f"CIFAR-10 not found: {missing} does not exist. Fetch cifar-10-python.tar.gz from "
        f"https://www.cs.toronto.edu/~kriz/cifar.html and extract it so that {root / FOLDER}/ holds "
        f"data_batch_1..5, test_batch and batches.meta (set data.root to the folder containing "
        f"{FOLDER}/), or set data.download: true to download it."
    )


#: The only globals a CIFAR-10 batch refers to: numpy's array rebuilding (numpy 1 and 2 module names) and the
#: codec a Python 3 pickle of bytes at protocol 2 calls. A pickle naming anything else is refused unloaded.
_CIFAR_GLOBALS = frozenset({
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
})


class _BatchUnpickler(pickle.Unpickler):
    """Builds only what a CIFAR-10 batch holds (dicts, lists, bytes, str, ints and uint8 arrays): unpickling a file
    may otherwise run any code its writer chose."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _CIFAR_GLOBALS:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which a CIFAR-10 batch never holds")
        return super().find_class(module, name)


def _load_pickle(path: Path) -> dict[str, Any]:
    """Load one CIFAR pickle; keys come back as ``str`` whether the file stored Python 2 str or bytes keys."""
    with path.open("rb") as f:
        # "bytes" keeps Python 2 str values (keys, raw array buffers) as bytes rather than guessing a codec.
        try:
            entry = _BatchUnpickler(f, encoding="bytes").load()
        except pickle.UnpicklingError as exc:
            raise ValueError(f"{path} is not a CIFAR-10 batch: {exc}") from None
    if not isinstance(entry, dict):
        raise ValueError(f"{path} is not a CIFAR-10 batch: expected a dict, got {type(entry).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 (N, 3, 32, 32) and labels int64 (N,) of one batch file."""
    entry = _load_pickle(path)
    try:
        data, labels = entry["data"], entry["labels"]
    except KeyError as err:
        raise ValueError(f"{path} lacks key {err.args[0]!r}; is it a CIFAR-10 python batch?") from None
    data = np.asarray(data, dtype=np.uint8)
    labels = np.asarray(labels, dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * IMAGE_SIZE * IMAGE_SIZE or data.shape[0] != labels.shape[0]:
        raise ValueError(f"{path}: data shape {data.shape} for {labels.shape[0]} labels; expected (N, 3072)")
    return data.reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE), labels


def read_label_names(root: str | Path) -> list[str]:
    """Class names from ``batches.meta`` (index = label)."""
    root = Path(root)
    path = root / FOLDER / META_FILE
    if not path.is_file():
        raise _not_found(root, path)
    return [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in _load_pickle(path)["label_names"]]


class Cifar10Folder(LabelledSplit):
    """One CIFAR-10 split from ``<root>/cifar-10-batches-py/``, optionally cut to its first ``limit`` images.

    Only the labels are kept in memory; ``render`` re-reads the batch files that hold the requested examples.
    """

    name = "cifar10"
    num_classes = NUM_CLASSES
    in_channels = 3
    image_size = IMAGE_SIZE

    def __init__(self, root: str | Path, split: str, *, limit: int | None = None) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit}")
        self.root = Path(root)
        self.split = split
        folder = self.root / FOLDER
        if not folder.is_dir():
            raise _not_found(self.root, folder)
        self._files = [folder / n for n in (TRAIN_FILES if split == "train" else TEST_FILES)]
        for path in self._files:
            if not path.is_file():
                raise _not_found(self.root, path)

        # Labels of each file in order; the images are dropped right after reading.
        per_file: list[np.ndarray] = []
        total = 0
        for path in self._files:
            if limit is not None and total >= limit:
                break
            per_file.append(_read_batch(path)[1])
            total += per_file[-1].size
        labels = np.concatenate(per_file)
        if limit is not None:
            labels = labels[:limit]
        self._labels = labels
        # offsets[i] = global index of the first example of file i.
        self._offsets = np.cumsum([0] + [a.size for a in per_file])

    def render(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Images of ``indices`` as x float32 (N, 3, 32, 32) normalised per channel, y int64 (N,), on CPU."""
        idx = checked_indices(indices, len(self))
        images = np.empty((idx.size, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.uint8)
        file_of = np.searchsorted(self._offsets, idx, side="right") - 1
        for f in np.unique(file_of):
            rows = np.flatnonzero(file_of == f)
            data, _ = _read_batch(self._files[f])
            images[rows] = data[idx[rows] - self._offsets[f]]
        x = torch.from_numpy(images).float().div_(255.0)
        mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
        x = (x - mean) / std
        return x, torch.from_numpy(self._labels[idx])


def missing_cifar10_files(root: str | Path) -> list[Path]:
    """The files of ``<root>/cifar-10-batches-py/`` (both splits and the metadata) that do not exist."""
    folder = Path(root) / FOLDER
    return [folder / name for name in (*TRAIN_FILES, *TEST_FILES, META_FILE) if not (folder / name).is_file()]


def download_cifar10(root: str | Path) -> Path:
    """Download ``cifar-10-python.tar.gz`` (``ARCHIVE_URL``) into ``root`` and extract it to
    ``<root>/cifar-10-batches-py/``.

    Needs network; an archive already in ``root`` with the right MD5 is reused. The download goes to a ``.part``
    file renamed once its MD5 (``ARCHIVE_MD5``) is checked, so an interrupted fetch never looks complete. Called for
    ``data.download: true`` on rank 0 only. Returns the batches folder.

    Raises:
        DatasetNotFoundError: the download or the extraction failed (no network, proxy, disk full, bad archive);
            the message is one line, the original exception is chained.
    """
    root = Path(root)
    archive = root / ARCHIVE
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not (archive.is_file() and _md5(archive) == ARCHIVE_MD5):
            fetch_archive(ARCHIVE_URL, archive, ARCHIVE_MD5)
        with tarfile.open(archive, "r:gz") as tar:
            shutil.rmtree(root / FOLDER, ignore_errors=True)  # extraction replaces the folder, as a fresh copy
            tar.extractall(root, filter="data")  # "data": no absolute paths, links or devices out of the archive
    except Exception as exc:  # no network, a proxy, a full disk or a bad archive: the user can only fetch it by hand
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise DatasetNotFoundError(
            f"CIFAR-10 download into {root} failed ({reason}); on a machine without internet fetch "
            f"cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html, extract it into {root}/ "
            f"and set data.download: false"
        ) from exc
    return root / FOLDER


def fetch_archive(url: str, path: Path, md5: str) -> None:
    """Download `url` to `path` through ``path.part``; RuntimeError (and no `path`) when its MD5 is not `md5`."""
    part = path.with_name(path.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_SECONDS) as response, part.open("wb") as out:
            shutil.copyfileobj(response, out, length=1 << 20)
        got = _md5(part)
        if got != md5:
            raise RuntimeError(f"the file from {url} has MD5 {got}, expected {md5} (truncated or altered)")
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
