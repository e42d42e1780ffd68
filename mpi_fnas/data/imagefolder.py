"""Images a user brings: a torchvision-style ``ImageFolder`` tree, one sub-folder per class.

Layouts under ``data.root``:

* central partitions (``iid``, ``dirichlet``, ``pathological``): ``train/<class>/*`` and ``test/<class>/*``;
* ``data.partition: local``: ``party-<k>/<class>/*`` for each party k = 1..K (only party k reads it) and
  ``test/<class>/*`` (only rank 0 reads it). This is how a federation is deployed: nothing about a party's data is
  read centrally (docs/privacy.md, "Data that stays with its party").

Every folder must have the same class sub-folders (the class names are the labels, in sorted order, so they must
be public and agreed); a class folder may be empty, a whole folder may not. All images must share one size, square,
equal to ``data.image_size``; grey images (mode ``L``) give one channel, everything else is converted to RGB. The
files are listed and their headers read when a split is opened (no pixels); ``render`` decodes only what it is asked.
Pixels in [0, 1] are normalised with the fixed public constants 0.5 and 0.25 for every channel: statistics computed
from the data would be one more release of it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mpi_fnas.data.cifar10 import DatasetNotFoundError
from mpi_fnas.data.labelled import LabelledSplit, checked_indices

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
PIXEL_MEAN = 0.5
PIXEL_STD = 0.25


class ImageFolderError(ValueError):
    """A folder that cannot be used as it is (one line naming the folder and the problem)."""


def party_folder(root: str | Path, rank: int) -> Path:
    """Party `rank`'s own folder under ``data.root`` with ``data.partition: local``."""
    return Path(root) / f"party-{rank}"


def split_folder(root: str | Path, split: str) -> Path:
    """The central folder of `split` ("train" or "test") under ``data.root``."""
    return Path(root) / split


def class_names(folder: Path) -> tuple[str, ...]:
    """The class sub-folders of `folder`, sorted. DatasetNotFoundError when `folder` is missing."""
    if not folder.is_dir():
        raise DatasetNotFoundError(f"data.dataset imagefolder: {folder} does not exist (expected one sub-folder "
                                   "per class)")
    names = tuple(sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")))
    if not names:
        raise ImageFolderError(f"data.dataset imagefolder: {folder} has no class sub-folders")
    return names


class ImageFolderSplit(LabelledSplit):
    """The images of one folder: labels from the class sub-folders (``classes``, sorted), pixels on request.

    Args:
        folder: the folder holding one sub-folder per class.
        classes: the agreed class names (None: this folder's); the folder must have exactly these.
        image_size: the side every image must have.
        limit: keep the first `limit` examples (in the order class, then file name); None: all.
    """

    name = "imagefolder"

    def __init__(self, folder: str | Path, *, image_size: int, classes: tuple[str, ...] | None = None,
                 limit: int | None = None) -> None:
        from PIL import Image  # deferred: only this dataset decodes image files

        self.folder = Path(folder)
        found = class_names(self.folder)
        if classes is not None and found != tuple(classes):
            missing, extra = sorted(set(classes) - set(found)), sorted(set(found) - set(classes))
            raise ImageFolderError(f"data.dataset imagefolder: {self.folder} has other classes than the rest of the "
                                   f"federation (missing {missing or 'none'}, extra {extra or 'none'}); every folder "
                                   "must have the same class sub-folders")
        self.classes = found
        self.num_classes = len(found)
        files, labels = [], []
        for label, name in enumerate(found):
            members = sorted(p for p in (self.folder / name).iterdir() if p.suffix.lower() in EXTENSIONS)
            files += members
            labels += [label] * len(members)
        if not files:
            raise ImageFolderError(f"data.dataset imagefolder: {self.folder} holds no images ({', '.join(EXTENSIONS)})")
        if limit is not None:
            files, labels = files[:limit], labels[:limit]
        sizes, modes = set(), set()
        for path in files:
            try:
                with Image.open(path) as image:  # reads the header only
                    sizes.add(image.size)
                    modes.add(image.mode)
            except OSError:
                raise ImageFolderError(f"data.dataset imagefolder: {path} is not a readable image") from None
        if len(sizes) > 1:
            shown = ", ".join(f"{w}x{h}" for w, h in sorted(sizes)[:3])
            raise ImageFolderError(f"data.dataset imagefolder: {self.folder} has images of mixed sizes ({shown}); "
                                   "all images must have one size")
        (width, height), = sizes
        if width != height or width != image_size:
            raise ImageFolderError(f"data.dataset imagefolder: {self.folder} holds {width}x{height} images; "
                                   f"data.image_size must be their side and they must be square (it is "
                                   f"{image_size})")
        self.image_size = image_size
        self._mode = "L" if modes == {"L"} else "RGB"
        self.in_channels = 1 if self._mode == "L" else 3
        self._files = files
        self._labels = np.asarray(labels, dtype=np.int64)

    def render(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """x float32 (N, in_channels, image_size, image_size) normalised, y int64 (N,), on CPU."""
        from PIL import Image

        idx = checked_indices(indices, len(self))
        side = self.image_size
        pixels = np.empty((idx.size, side, side, self.in_channels), dtype=np.uint8)
        for row, i in enumerate(idx):
            with Image.open(self._files[i]) as image:
                pixels[row] = np.asarray(image.convert(self._mode), dtype=np.uint8).reshape(side, side, -1)
        x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float().div_(255.0)
        return (x - PIXEL_MEAN) / PIXEL_STD, torch.from_numpy(self._labels[idx])
