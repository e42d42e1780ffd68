"""``data.dataset: fashion-mnist``: the four official files (Debian's dataset-fashion-mnist, which scripts/install.sh
installs as root, or a folder of the user's), checked once into a cache every rank maps; each kind of damage refused
in one line with nothing written; a whole job with a damaged file ends with rank 0's one line and exit 2."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, warm_job

from mpi_fnas.config import SetupError, load_config
from mpi_fnas.data import DatasetDamagedError, DatasetNotFoundError, open_dataset
from mpi_fnas.data import fashion_mnist as fm
from mpi_fnas.federation.job_plan import open_split

CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


@pytest.fixture(autouse=True)
def fresh_opens():
    fm.split_images.cache_clear()
    yield
    fm.split_images.cache_clear()


def official(name: str) -> Path:
    path = fm.DEBIAN_FOLDER / f"{name}.gz"
    if not path.is_file():
        pytest.fail(f"{path} is missing: scripts/install.sh installs Debian's dataset-fashion-mnist as root")
    return path


def own_folder(root: Path, change: dict[str, bytes | None] | None = None, gz: bool = True,
               splits: tuple[str, ...] = ("test",)) -> Path:
    """``root/fashion-mnist/`` holding the official files of `splits` (gzipped, or not), with `change`'s files
    replaced by its bytes (uncompressed; None: left out)."""
    folder = root / fm.FOLDER
    folder.mkdir(parents=True)
    for name in (name for split in splits for name in fm.FILES[split]):
        data = (change or {}).get(name, gzip.decompress(official(name).read_bytes()))
        if data is None:
            continue
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data, compresslevel=1, mtime=0))
        else:
            (folder / name).write_bytes(data)
    return folder


def test_the_official_files_are_the_published_splits(tmp_path):
    for split, rows, first in (("train", 60_000, [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]),
                               ("test", 10_000, [9, 2, 1, 1, 6, 1, 4, 6, 5, 7])):
        data = open_dataset("fashion-mnist", split, root=tmp_path, image_size=28, size=None, seed=0)
        assert len(data) == rows and data.labels[:10].tolist() == first
        assert np.bincount(data.labels).tolist() == [rows // 10] * 10
        x, y = data.render(np.arange(2000))
        assert x.shape == (2000, 1, 28, 28) and y.tolist() == data.labels[:2000].tolist()
        assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05  # its own statistics, not MNIST's
    assert sorted(p.suffix for p in (tmp_path / fm.CACHE_FOLDER).glob("*.npy")) == [".npy", ".npy"]
    pooled = open_dataset("fashion-mnist", "test", root=tmp_path, image_size=14, size=100, seed=0)
    assert len(pooled) == 100 and pooled.render(np.arange(3))[0].shape == (3, 1, 14, 14)
    assert len(CLASSES) == pooled.num_classes


def test_the_cache_is_mapped_and_a_users_folder_takes_precedence(tmp_path):
    first = open_dataset("fashion-mnist", "test", root=tmp_path, image_size=28, size=None, seed=0)
    fm.split_images.cache_clear()
    again = open_dataset("fashion-mnist", "test", root=tmp_path, image_size=28, size=None, seed=0)
    assert isinstance(again._pixels.base, np.memmap) or isinstance(again._pixels, np.memmap)
    np.testing.assert_array_equal(first.labels, again.labels)
    own = own_folder(tmp_path / "mine", gz=False)  # the same data, uncompressed, in the user's folder
    assert fm.fashion_files(tmp_path / "mine", "test")[0] == own / "t10k-images-idx3-ubyte"
    mine = open_dataset("fashion-mnist", "test", root=tmp_path / "mine", image_size=28, size=None, seed=0)
    np.testing.assert_array_equal(mine.render(np.arange(50))[0], first.render(np.arange(50))[0])


def _damaged_images(data: bytes) -> dict[str, bytes]:
    edited = bytearray(data)
    edited[1000] ^= 0xFF
    return {
        "truncated": data[:-784],
        "wrong magic": b"\x00\x00\x08\x01" + data[4:],
        "wrong count": data[:4] + (9_999).to_bytes(4, "big") + data[8:],
        "edited pixel": bytes(edited),
    }


def test_each_kind_of_damage_is_one_line_naming_the_file_and_nothing_is_written(tmp_path):
    images = gzip.decompress(official("t10k-images-idx3-ubyte").read_bytes())
    labels = gzip.decompress(official("t10k-labels-idx1-ubyte").read_bytes())
    train_labels = gzip.decompress(official("train-labels-idx1-ubyte").read_bytes())
    cases = {**{name: ({"t10k-images-idx3-ubyte": data}, "t10k-images-idx3-ubyte.gz", reason)
                for (name, data), reason in zip(_damaged_images(images).items(),
                                                ("a truncated file", "not FashionMNIST's images",
                                                 "not FashionMNIST's images", "SHA-256 differs"), strict=True)},
             "labels of another split": ({"t10k-labels-idx1-ubyte": train_labels}, "t10k-labels-idx1-ubyte.gz",
                                         "not FashionMNIST's labels"),
             "edited label": ({"t10k-labels-idx1-ubyte": labels[:-1] + bytes([labels[-1] ^ 1])},
                              "t10k-labels-idx1-ubyte.gz", "SHA-256 differs")}
    for number, (case, (change, name, reason)) in enumerate(cases.items()):
        root = tmp_path / f"case{number}"
        own_folder(root, change)
        with pytest.raises(DatasetDamagedError) as info:
            open_dataset("fashion-mnist", "test", root=root, image_size=28, size=None, seed=0)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"{root / fm.FOLDER / name}: ") and reason in message, \
            (case, message)
        assert not list((root / fm.CACHE_FOLDER).glob("*.np*")), case  # no .npy, no .part
    not_gzip = tmp_path / "not-gzip"
    (own_folder(not_gzip) / "t10k-images-idx3-ubyte.gz").write_bytes(b"not a gzip stream")
    with pytest.raises(DatasetDamagedError, match=r"t10k-images-idx3-ubyte\.gz: cannot be read as gzip"):
        open_dataset("fashion-mnist", "test", root=not_gzip, image_size=28, size=None, seed=0)


def test_a_missing_file_is_one_line_saying_how_to_get_it(tmp_path):
    own_folder(tmp_path, {"t10k-labels-idx1-ubyte": None})
    with pytest.raises(DatasetNotFoundError) as info:
        open_dataset("fashion-mnist", "test", root=tmp_path, image_size=28, size=None, seed=0)
    message = str(info.value)
    assert "\n" not in message and "t10k-labels-idx1-ubyte (or .gz) not in" in message
    assert "apt-get install dataset-fashion-mnist" in message and "<data.root>/fashion-mnist/" in message
    assert not (tmp_path / fm.CACHE_FOLDER).exists()
    cfg = load_config(None, ["data.dataset=fashion-mnist", "data.image_size=28", f"data.root={tmp_path}"])
    with pytest.raises(SetupError, match="t10k-labels-idx1-ubyte"):  # what rank 0 prints once, exit 2
        open_split(cfg, "test")


def test_a_changed_labels_file_is_checked_though_the_split_is_cached(tmp_path):
    folder = own_folder(tmp_path)
    open_dataset("fashion-mnist", "test", root=tmp_path, image_size=28, size=None, seed=0)
    fm.split_images.cache_clear()
    labels = gzip.decompress(official("t10k-labels-idx1-ubyte").read_bytes())
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(labels[:-1] + bytes([labels[-1] ^ 1])))
    with pytest.raises(DatasetDamagedError, match="SHA-256 differs"):
        open_dataset("fashion-mnist", "test", root=tmp_path, image_size=28, size=None, seed=0)


def test_a_scatter_network_refuses_per_step_image_augmentation():
    from mpi_fnas.config import ConfigError

    base = ["data.dataset=fashion-mnist", "data.image_size=28", "augment.network=scatter-linear"]
    load_config(None, base)
    for key in ("augment.cutout=4", "augment.crop_padding=2", "augment.flip=true"):
        with pytest.raises(ConfigError, match=rf"^{key.split('=')[0]}: augment.network scatter-linear computes"):
            load_config(None, [*base, key])


@pytest.mark.slow
def test_a_job_on_a_damaged_folder_is_one_line_from_rank_0_and_exit_2(tmp_path):
    images = gzip.decompress(official("train-images-idx3-ubyte").read_bytes())
    own_folder(tmp_path / "root", {"train-images-idx3-ubyte": images[:-784]}, splits=("train", "test"))
    out = warm_job(3, *TINY, "--set", "data.dataset=fashion-mnist", "--set", "data.image_size=14", "--set",
                   f"data.root={tmp_path / 'root'}", "--out", str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"mpi_fnas: error: {tmp_path / 'root' / fm.FOLDER}"), out.stderr
    assert "a truncated file" in lines[0]
    assert not (tmp_path / "run").exists() and not list((tmp_path / "root" / fm.CACHE_FOLDER).glob("train-*.npy"))
    shutil.rmtree(tmp_path / "root")
