"""Tests of mpi_fnas.data: synthetic-shapes, the CIFAR-10 folder reader, partitions and the registry."""

from __future__ import annotations

import pickle
import shutil
import struct
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mpi_fnas.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DATASETS,
    SCHEMES,
    Cifar10Folder,
    Dataset,
    DatasetNotFoundError,
    SyntheticShapes,
    open_dataset,
    partition_indices,
    read_label_names,
    split_train_val,
)

# ----------------------------------------------------------------------------------------------------
# synthetic-shapes


def test_synthetic_subset_render_equals_full_render_sliced() -> None:
    data = SyntheticShapes("train", 300, image_size=16, seed=3)
    x_all, y_all = data.render(np.arange(300))
    # Unsorted, repeated, and spanning every class: rendering must not depend on the batch composition.
    subset = np.array([299, 5, 17, 5, 0, 123, 250, 64])
    x_sub, y_sub = data.render(subset)
    assert torch.equal(x_sub, x_all[subset])
    assert torch.equal(y_sub, y_all[subset])
    assert torch.equal(y_all, torch.from_numpy(data.labels))


def test_synthetic_is_deterministic_and_independent_of_split_size() -> None:
    # 5000 > one parameter block (4096), so the comparison crosses a block boundary.
    big = SyntheticShapes("train", 5000, image_size=16, seed=7)
    again = SyntheticShapes("train", 5000, image_size=16, seed=7)
    idx = np.array([0, 1, 4095, 4096, 4999])
    assert np.array_equal(big.labels, again.labels)
    assert torch.equal(big.render(idx)[0], again.render(idx)[0])
    small = SyntheticShapes("train", 4100, image_size=16, seed=7)
    assert np.array_equal(small.labels, big.labels[:4100])
    assert torch.equal(small.render(idx[:4])[0], big.render(idx[:4])[0])


def test_synthetic_splits_and_seeds_differ() -> None:
    idx = np.arange(200)
    train = SyntheticShapes("train", 200, seed=0)
    test = SyntheticShapes("test", 200, seed=0)
    other_seed = SyntheticShapes("train", 200, seed=1)
    x_train = train.render(idx)[0]
    for other in (test, other_seed):
        assert not np.array_equal(train.labels, other.labels)
        # Not a single image in common (images of a continuous-parameter renderer never coincide by chance).
        assert (x_train - other.render(idx)[0]).abs().flatten(1).amax(1).min() > 0.1


def test_synthetic_shapes_dtypes_normalisation_and_balance() -> None:
    data = SyntheticShapes("train", 10_000, image_size=16, seed=0)
    counts = np.bincount(data.labels, minlength=10)
    assert data.labels.dtype == np.int64
    assert counts.min() >= 950 and counts.max() <= 1050, counts
    x, y = data.render(np.arange(2000))
    assert x.dtype == torch.float32 and x.shape == (2000, 3, 16, 16)
    assert y.dtype == torch.int64 and y.shape == (2000,)
    assert abs(x.mean().item()) < 0.1 and 0.85 < x.std().item() < 1.15
    x32, _ = SyntheticShapes("test", 50, image_size=32, seed=0).render(np.arange(50))
    assert x32.shape == (50, 3, 32, 32)


def test_synthetic_render_rejects_bad_indices() -> None:
    data = SyntheticShapes("train", 10)
    with pytest.raises(IndexError):
        data.render(np.array([10]))
    with pytest.raises(IndexError):
        data.render(np.array([-1]))
    with pytest.raises(ValueError, match="split"):
        SyntheticShapes("val", 10)


def _tiny_cnn() -> nn.Module:
    """About 4k parameters: three 3×3 convs (8, 16, 16 channels), two max-pools, global average pool."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def _train_and_predict(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor, steps: int
) -> torch.Tensor:
    """Adam on random batches of 64 for ``steps`` steps; returns predicted classes (len(x_test),)."""
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(steps):
        batch = torch.randint(0, x.shape[0], (64,), generator=gen)
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return model(x_test).argmax(1)


def test_synthetic_classes_are_learnable_by_a_cnn_but_not_by_a_linear_model() -> None:
    torch.manual_seed(0)
    x, y = SyntheticShapes("train", 6000, seed=0).render(np.arange(6000))
    x_test, y_test = SyntheticShapes("test", 1000, seed=0).render(np.arange(1000))
    cnn_acc = (_train_and_predict(_tiny_cnn(), x, y, x_test, 300) == y_test).float().mean().item()
    linear = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10))
    linear_acc = (_train_and_predict(linear, x, y, x_test, 300) == y_test).float().mean().item()
    # Chance is 0.1. The shape must be learnable from pixels, yet not from position/colour by a linear map.
    assert cnn_acc > 0.5, cnn_acc
    assert linear_acc < 0.3, linear_acc


# ----------------------------------------------------------------------------------------------------
# CIFAR-10 folder reader, on tiny files in the real on-disk format

_PER_TRAIN_BATCH = 3
_TEST_SIZE = 4
_LABEL_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _py2_pickle(obj: object) -> bytes:
    """Pickle ``obj`` the way Python 2 cPickle (protocol 2) wrote the real CIFAR-10 files.

    Python 3 cannot emit Python 2 ``str`` (BINSTRING opcodes), so this writes the opcodes itself for the types
    the files contain: dict, list, str (as Python 2 byte strings), int, and a C-contiguous uint8 numpy array
    (via ``numpy.core.multiarray._reconstruct`` + BUILD, as numpy 1.x on Python 2 did).
    """

    def s(text: str | bytes) -> bytes:
        raw = text.encode("latin1") if isinstance(text, str) else text
        if len(raw) < 256:
            return b"U" + bytes([len(raw)]) + raw  # SHORT_BINSTRING
        return b"T" + struct.pack("<i", len(raw)) + raw  # BINSTRING

    def i(value: int) -> bytes:
        if 0 <= value < 256:
            return b"K" + bytes([value])
        if 0 <= value < 65536:
            return b"M" + struct.pack("<H", value)
        return b"J" + struct.pack("<i", value)

    def emit(o: object) -> bytes:
        if isinstance(o, dict):
            return b"}(" + b"".join(emit(k) + emit(v) for k, v in o.items()) + b"u"
        if isinstance(o, list):
            return b"](" + b"".join(emit(v) for v in o) + b"e"
        if isinstance(o, str | bytes):
            return s(o)
        if isinstance(o, int):
            return i(o)
        if isinstance(o, np.ndarray):
            assert o.dtype == np.uint8 and o.ndim == 2 and o.flags.c_contiguous
            dtype = b"cnumpy\ndtype\n" + s("u1") + i(0) + i(1) + b"\x87R" + b"(" + i(3) + s("|")
            dtype += b"NNN" + b"J\xff\xff\xff\xff" * 2 + i(0) + b"tb"
            head = (
                b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
                + i(0)
                + b"\x85"
                + s("b")
                + b"\x87R"
            )
            shape = i(o.shape[0]) + i(o.shape[1]) + b"\x86"
            return head + b"(" + i(1) + shape + dtype + b"\x89" + s(o.tobytes()) + b"tb"
        raise TypeError(type(o))

    return b"\x80\x02" + emit(obj) + b"."


def _to_bytes(o: object) -> object:
    """Python 3 equivalent of a Python 2 object: str -> bytes, recursively through dicts and lists."""
    if isinstance(o, str):
        return o.encode()
    if isinstance(o, dict):
        return {_to_bytes(k): _to_bytes(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_to_bytes(v) for v in o]
    return o


def _write_cifar(root: Path, style: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Write 5 train batches of 3 images and a test batch of 4.

    Returns train data uint8 (15, 3072), train labels (15,), test data (4, 3072), test labels (4,).
    """
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)

    def dump(name: str, entry: dict[str, object]) -> None:
        if style == "py2":
            (folder / name).write_bytes(_py2_pickle(entry))
        else:  # a Python 3 re-pickling of the files: bytes keys and strings, protocol 2
            (folder / name).write_bytes(pickle.dumps(_to_bytes(entry), protocol=2))

    def batch(label: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, n)
        files = [f"img_{label.replace(' ', '_')}_{k}.png" for k in range(n)]
        dump_name = "test_batch" if label.startswith("testing") else f"data_batch_{label.split()[2]}"
        dump(
            dump_name,
            {"batch_label": label, "labels": [int(v) for v in labels], "data": data, "filenames": files},
        )
        return data, labels

    train = [batch(f"training batch {b} of 5", _PER_TRAIN_BATCH) for b in range(1, 6)]
    test_data, test_labels = batch("testing batch 1 of 1", _TEST_SIZE)
    dump("batches.meta", {"num_cases_per_batch": 10000, "label_names": _LABEL_NAMES, "num_vis": 3072})
    train_data = np.concatenate([d for d, _ in train])
    train_labels = np.concatenate([lab for _, lab in train])
    return train_data, train_labels, test_data, test_labels


def test_py2_fixture_has_the_real_files_key_encoding(tmp_path: Path) -> None:
    # The real files load with bytes keys under encoding="bytes", str keys under "latin1" (torchvision's way).
    _write_cifar(tmp_path, "py2")
    raw = (tmp_path / "cifar-10-batches-py" / "data_batch_1").read_bytes()
    as_bytes = pickle.loads(raw, encoding="bytes")
    assert set(as_bytes) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert as_bytes[b"batch_label"] == b"training batch 1 of 5"
    assert as_bytes[b"data"].dtype == np.uint8 and as_bytes[b"data"].shape == (3, 3072)
    as_latin1 = pickle.loads(raw, encoding="latin1")
    assert set(as_latin1) == {"batch_label", "labels", "data", "filenames"}
    assert np.array_equal(as_latin1["data"], as_bytes[b"data"])


@pytest.mark.parametrize("style", ["py2", "py3"])
def test_cifar_reader_layout_labels_and_normalisation(tmp_path: Path, style: str) -> None:
    train_data, train_labels, test_data, test_labels = _write_cifar(tmp_path, style)
    # A known pixel value in batch 4, row 1 (global index 10): channel 2 (blue), row 5, column 17.
    path = tmp_path / "cifar-10-batches-py" / "data_batch_4"
    entry = pickle.loads(path.read_bytes(), encoding="bytes")
    data = entry[b"data"].copy()
    data[1] = 0
    data[1, 2 * 1024 + 5 * 32 + 17] = 200
    entry[b"data"] = data
    if style == "py2":
        path.write_bytes(_py2_pickle({k.decode(): v for k, v in entry.items()}))
    else:
        path.write_bytes(pickle.dumps(entry, protocol=2))

    train = Cifar10Folder(tmp_path, "train")
    assert np.array_equal(train.labels, train_labels) and train.labels.dtype == np.int64
    x, y = train.render(np.array([10, 0]))
    assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32
    assert torch.equal(y, torch.from_numpy(train_labels[[10, 0]]))
    mean = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(3, 1, 1)
    raw = x[0] * std + mean  # back to [0, 1]
    hot = (raw > 0.5).nonzero().tolist()
    assert hot == [[2, 5, 17]]
    assert raw[2, 5, 17].item() == pytest.approx(200 / 255, abs=1e-5)
    assert raw.abs().sum().item() == pytest.approx(200 / 255, abs=1e-3)
    # Normalisation of an untouched image: (value/255 - mean_c) / std_c for the stored row-major planes.
    expected = (torch.from_numpy(train_data[0].reshape(3, 32, 32)).float() / 255 - mean) / std
    assert torch.allclose(x[1], expected, atol=1e-6)

    test = Cifar10Folder(tmp_path, "test")
    assert np.array_equal(test.labels, test_labels)
    x_test, _ = test.render(np.arange(_TEST_SIZE))
    assert torch.allclose(
        x_test[3], (torch.from_numpy(test_data[3].reshape(3, 32, 32)).float() / 255 - mean) / std
    )
    assert read_label_names(tmp_path) == _LABEL_NAMES


def test_cifar_truncation_through_the_registry(tmp_path: Path) -> None:
    train_data, train_labels, _, _ = _write_cifar(tmp_path, "py2")
    data = open_dataset("cifar10", "train", root=tmp_path, image_size=32, size=7, seed=0)
    assert isinstance(data, Dataset)
    assert len(data) == 7 and np.array_equal(data.labels, train_labels[:7])
    assert (data.num_classes, data.in_channels, data.image_size) == (10, 3, 32)
    x, _ = data.render(np.array([6]))  # first image of data_batch_3
    mean = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(3, 1, 1)
    assert torch.allclose(
        x[0] * std + mean, torch.from_numpy(train_data[6].reshape(3, 32, 32)).float() / 255, atol=1e-6
    )
    with pytest.raises(IndexError):
        data.render(np.array([7]))
    with pytest.raises(ValueError, match="image_size"):
        open_dataset("cifar10", "train", root=tmp_path, image_size=16, size=None, seed=0)


def test_cifar_missing_folder_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as missing_folder:
        Cifar10Folder(tmp_path / "nowhere", "train")
    message = str(missing_folder.value)
    assert isinstance(missing_folder.value, FileNotFoundError)
    assert "\n" not in message
    for needle in (
        "cifar-10-python.tar.gz",
        "https://www.cs.toronto.edu/~kriz/cifar.html",
        str(tmp_path / "nowhere" / "cifar-10-batches-py"),
        "data.root",
        "data.download: true",
    ):
        assert needle in message
    _write_cifar(tmp_path / "partial", "py2")
    (tmp_path / "partial" / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DatasetNotFoundError, match="data_batch_3"):
        open_dataset("cifar10", "train", root=tmp_path / "partial", image_size=32, size=None, seed=0)
    # The test split does not need the train files.
    assert len(Cifar10Folder(tmp_path / "partial", "test")) == _TEST_SIZE


# ----------------------------------------------------------------------------------------------------
# data.download (no network here: the fetch is replaced, or pointed at a local server / dead port)


def _cifar_archive(folder: Path, source: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """A ``cifar-10-python.tar.gz`` of the py2 fixture in `folder`: (archive, train labels, test labels)."""
    _, train_labels, _, test_labels = _write_cifar(source, "py2")
    archive = folder / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return archive, train_labels, test_labels


class _FakeFetch:
    """Stands in for ``mpi_fnas.data.cifar10.fetch_archive``: records its arguments, then writes the fixture's
    archive where the real one would land (or raises `error`)."""

    def __init__(self, source: Path, error: Exception | None = None) -> None:
        self.calls: list[dict[str, object]] = []
        self.source, self.error = source, error

    def __call__(self, url: str, path: Path, md5: str) -> None:
        self.calls.append({"url": url, "path": path, "md5": md5})
        if self.error is not None:
            raise self.error
        built, _, _ = _cifar_archive(self.source, self.source / f"fixture-{len(self.calls)}")
        shutil.copy(built, path)


def test_download_fetches_into_root_when_files_are_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mpi_fnas.data import cifar10

    fake = _FakeFetch(tmp_path)
    monkeypatch.setattr(cifar10, "fetch_archive", fake)
    root = tmp_path / "nested" / "data"  # not there yet: created
    data = open_dataset("cifar10", "train", root=root, image_size=32, size=None, seed=0, download=True)
    assert len(data) == 5 * _PER_TRAIN_BATCH
    assert fake.calls == [{"url": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                           "path": root / "cifar-10-python.tar.gz", "md5": "c58f30108f718f92721af3b95e74349a"}]
    # Present now: neither split downloads again (a cluster node without network may run with download: true).
    assert len(open_dataset("cifar10", "test", root=root, image_size=32, size=None, seed=0, download=True)) == 4
    assert len(fake.calls) == 1
    # A missing file of the other split is enough to fetch the archive again (the one in root fails the real MD5).
    (root / "cifar-10-batches-py" / "test_batch").unlink()
    open_dataset("cifar10", "train", root=root, image_size=32, size=None, seed=0, download=True)
    assert len(fake.calls) == 2 and (root / "cifar-10-batches-py" / "test_batch").is_file()


def test_no_download_unless_asked_and_never_for_synthetic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mpi_fnas.data import cifar10

    fake = _FakeFetch(tmp_path / "fixture")
    monkeypatch.setattr(cifar10, "fetch_archive", fake)
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(DatasetNotFoundError, match=r"data\.download: true"):
        open_dataset("cifar10", "train", root=root, image_size=32, size=None, seed=0)
    data = open_dataset("synthetic-shapes", "test", root=root, image_size=16, size=5, seed=0, download=True)
    assert len(data) == 5
    assert fake.calls == [] and list(root.iterdir()) == []


def test_offline_download_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.error

    from mpi_fnas.data import cifar10

    offline = urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))
    monkeypatch.setattr(cifar10, "fetch_archive", _FakeFetch(tmp_path, offline))
    with pytest.raises(DatasetNotFoundError) as info:
        open_dataset("cifar10", "train", root=tmp_path / "data", image_size=32, size=None, seed=0, download=True)
    message = str(info.value)
    assert "\n" not in message and info.value.__cause__ is offline
    for needle in (f"CIFAR-10 download into {tmp_path / 'data'} failed", "URLError",
                   "Temporary failure in name resolution", "https://www.cs.toronto.edu/~kriz/cifar.html",
                   "data.download: false"):
        assert needle in message


@pytest.fixture
def local_http_server(tmp_path: Path) -> Iterator[tuple[str, Path, list[str]]]:
    """A plain HTTP server on 127.0.0.1 serving a temporary folder: (base URL, folder, paths requested so far).
    Stopped afterwards."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    requested: list[str] = []

    class QuietHandler(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # keep pytest's output clean
            requested.append(self.path)

    served = tmp_path / "served"
    served.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", served, requested
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_download_over_http_checks_md5_and_extracts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_http_server: tuple[str, Path, list[str]]
) -> None:
    """The real fetch, MD5 check and extraction, with the archive served from 127.0.0.1."""
    import hashlib
    import socket

    from mpi_fnas.data import cifar10

    base_url, served, requested = local_http_server
    archive, train_labels, test_labels = _cifar_archive(served, tmp_path / "source")
    monkeypatch.setattr(cifar10, "ARCHIVE_URL", f"{base_url}/cifar-10-python.tar.gz")
    monkeypatch.setattr(cifar10, "ARCHIVE_MD5", hashlib.md5(archive.read_bytes()).hexdigest())

    root = tmp_path / "data"
    train = open_dataset("cifar10", "train", root=root, image_size=32, size=None, seed=0, download=True)
    assert np.array_equal(train.labels, train_labels)
    test = open_dataset("cifar10", "test", root=root, image_size=32, size=None, seed=0)
    assert np.array_equal(test.labels, test_labels)
    assert len(requested) == 1 and not list(root.glob("*.part"))

    # An archive already in root with the right MD5 is extracted again, not fetched again.
    (root / "cifar-10-batches-py" / "batches.meta").unlink()
    open_dataset("cifar10", "test", root=root, image_size=32, size=None, seed=0, download=True)
    assert len(requested) == 1 and (root / "cifar-10-batches-py" / "batches.meta").is_file()

    # A corrupted download fails the MD5 check: one line, not a traceback, and nothing left that looks complete.
    (root / "cifar-10-python.tar.gz").unlink()
    (root / "cifar-10-batches-py" / "batches.meta").unlink()
    archive.write_bytes(b"truncated")
    with pytest.raises(DatasetNotFoundError, match=r"^CIFAR-10 download into .* failed \(RuntimeError: .*MD5") as info:
        open_dataset("cifar10", "test", root=root, image_size=32, size=None, seed=0, download=True)
    assert "\n" not in str(info.value)
    assert not (root / "cifar-10-python.tar.gz").exists() and not list(root.glob("*.part"))

    # Nobody listening (a port just released by the OS) stands for "no network".
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    monkeypatch.setattr(cifar10, "ARCHIVE_URL", f"http://127.0.0.1:{dead_port}/cifar-10-python.tar.gz")
    with pytest.raises(DatasetNotFoundError, match=r"^CIFAR-10 download into .* failed \(URLError: ") as info:
        open_dataset("cifar10", "test", root=root, image_size=32, size=None, seed=0, download=True)
    assert "\n" not in str(info.value) and "Connection refused" in str(info.value)


# ----------------------------------------------------------------------------------------------------
# registry


def test_open_dataset_synthetic_and_errors() -> None:
    assert DATASETS == ("synthetic-shapes", "cifar10", "mnist", "mnist-5k", "fashion-mnist", "imagefolder")
    data = open_dataset("synthetic-shapes", "test", root="unused", image_size=32, size=40, seed=5)
    assert isinstance(data, Dataset)
    assert len(data) == 40 and (data.num_classes, data.in_channels, data.image_size) == (10, 3, 32)
    direct = SyntheticShapes("test", 40, image_size=32, seed=5)
    assert torch.equal(data.render(np.arange(3))[0], direct.render(np.arange(3))[0])
    assert (
        len(open_dataset("synthetic-shapes", "train", root=".", image_size=16, size=None, seed=0)) == 50_000
    )
    with pytest.raises(ValueError, match="unknown dataset"):
        open_dataset("svhn", "train", root=".", image_size=16, size=None, seed=0)


# ----------------------------------------------------------------------------------------------------
# partitions


def _balanced_labels(n_per_class: int, classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(classes), n_per_class))


def _assert_is_partition(parts: list[np.ndarray], n: int, parties: int) -> None:
    assert len(parts) == parties
    for p in parts:
        assert p.dtype == np.int64 and p.size >= 1
        assert np.all(np.diff(p) > 0)  # sorted, no repeats
    union = np.concatenate(parts)
    assert union.size == n  # pairwise disjoint given the cover below
    assert np.array_equal(np.sort(union), np.arange(n))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partition_is_disjoint_cover_deterministic_and_seeded(scheme: str) -> None:
    labels = _balanced_labels(100)
    parts = partition_indices(labels, 5, scheme, seed=11)
    _assert_is_partition(parts, labels.size, 5)
    again = partition_indices(labels, 5, scheme, seed=11)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition_indices(labels, 5, scheme, seed=12)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_iid_sizes_and_mixture() -> None:
    labels = _balanced_labels(103)  # 1030 examples over 8 parties: sizes 129 or 128
    parts = partition_indices(labels, 8, "iid", seed=0)
    assert sorted({p.size for p in parts}) == [128, 129]
    assert all(np.unique(labels[p]).size == 10 for p in parts)


def test_dirichlet_tiny_alpha_many_parties_gives_everyone_an_example() -> None:
    labels = _balanced_labels(30)  # 300 examples, 10 classes
    parts = partition_indices(labels, 60, "dirichlet", seed=0, dirichlet_alpha=1e-3)
    _assert_is_partition(parts, labels.size, 60)
    # With alpha this small each class lands (almost) entirely on one party: strongly non-IID.
    assert max(p.size for p in parts) >= 25


def test_dirichlet_alpha_controls_heterogeneity() -> None:
    labels = _balanced_labels(200)

    def mean_classes_per_party(alpha: float) -> float:
        parts = partition_indices(labels, 10, "dirichlet", seed=1, dirichlet_alpha=alpha)
        return float(np.mean([np.unique(labels[p]).size for p in parts]))

    assert mean_classes_per_party(1000.0) == 10.0
    assert mean_classes_per_party(0.05) < 6.0


def test_dirichlet_needs_as_many_examples_as_parties() -> None:
    partition_indices(np.zeros(4, dtype=np.int64), 4, "dirichlet", seed=0, dirichlet_alpha=0.01)
    with pytest.raises(ValueError, match="only 3 examples"):
        partition_indices(np.zeros(3, dtype=np.int64), 4, "dirichlet", seed=0)


@pytest.mark.parametrize(("parties", "classes_per_party"), [(5, 2), (10, 1), (2, 5)])
def test_pathological_gives_each_party_exactly_its_classes(parties: int, classes_per_party: int) -> None:
    labels = _balanced_labels(40)
    parts = partition_indices(labels, parties, "pathological", seed=4, classes_per_party=classes_per_party)
    _assert_is_partition(parts, labels.size, parties)
    for p in parts:
        assert p.size == 400 // parties
        assert np.unique(labels[p]).size == classes_per_party
        # Whole classes: a party holding a class holds all of its examples (shards are exactly the classes).
        assert np.all(np.bincount(labels[p], minlength=10)[np.unique(labels[p])] == 40)


def test_pathological_with_more_shards_than_classes() -> None:
    labels = _balanced_labels(60)  # 600 examples, 20 shards of 30: each shard lies inside one class
    parts = partition_indices(labels, 10, "pathological", seed=2, classes_per_party=2)
    _assert_is_partition(parts, labels.size, 10)
    assert all(p.size == 60 and np.unique(labels[p]).size <= 2 for p in parts)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scheme": "random"}, "unknown partition scheme"),
        ({"parties": 0}, "parties"),
        ({"scheme": "dirichlet", "dirichlet_alpha": 0.0}, "dirichlet_alpha"),
        ({"scheme": "dirichlet", "dirichlet_alpha": float("nan")}, "dirichlet_alpha"),
        ({"scheme": "pathological", "classes_per_party": 0}, "classes_per_party"),
        ({"scheme": "pathological", "parties": 6, "classes_per_party": 4}, "at least"),
        ({"seed": -1}, "seed"),
        ({"labels": np.zeros((4, 5), dtype=np.int64)}, "1-D integer"),
        ({"labels": np.linspace(0, 1, 20)}, "1-D integer"),
    ],
)
def test_partition_rejects_bad_input(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"labels": _balanced_labels(2), "parties": 3, "scheme": "iid", "seed": 0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        partition_indices(**args)  # type: ignore[arg-type]


def test_split_train_val() -> None:
    train, val = split_train_val(1001, 0.5, seed=3)
    assert val.size == 500 and train.size == 501
    assert np.intersect1d(train, val).size == 0
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(1001))
    assert np.all(np.diff(train) > 0) and train.dtype == np.int64
    again = split_train_val(1001, 0.5, seed=3)
    assert np.array_equal(again[1], val)
    assert not np.array_equal(split_train_val(1001, 0.5, seed=4)[1], val)
    for bad in (0.0, 1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="val_fraction"):
            split_train_val(100, bad, seed=0)
    with pytest.raises(ValueError, match="empty"):
        split_train_val(3, 0.1, seed=0)
    with pytest.raises(ValueError, match="n must be"):
        split_train_val(1, 0.5, seed=0)


class _Exploit:
    """A pickle whose loading would run ``touch MARKER`` (as a crafted batch could run anything)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_cifar_batch_that_would_run_code_is_refused_unloaded(tmp_path: Path) -> None:
    _write_cifar(tmp_path, "py3")
    marker = tmp_path / "pwned"
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    path.write_bytes(pickle.dumps({b"data": _Exploit(marker), b"labels": [0]}, protocol=2))
    with pytest.raises(ValueError, match=r"data_batch_2 is not a CIFAR-10 batch: refers to posix\.system"):
        Cifar10Folder(tmp_path, "train")
    assert not marker.exists()


def test_a_tuning_holdout_is_no_partys_and_replaces_the_test_split(monkeypatch):
    """data.holdout N: the train split's last N examples go to no party (after the aux slice) and are what rank 0
    evaluates on; the test split is never opened."""
    import mpi_fnas.federation.job_plan as plan_module
    from mpi_fnas.config import ConfigError, load_config
    from mpi_fnas.federation.aux_set import open_aux_set

    cfg = load_config(None, ["data.dataset=mnist-5k", "data.image_size=14", "data.train_size=null", "mode=fnas",
                             "data.holdout=500", "federation.aux_size=100"])
    real = plan_module.open_dataset

    def no_test(name, split, **kwargs):
        assert split != "test", "a tuning run read the test split"
        return real(name, split, **kwargs)

    monkeypatch.setattr(plan_module, "open_dataset", no_test)
    train = plan_module.open_split(cfg, "train")
    held = plan_module.open_split(cfg, "test")
    assert len(train) == 4000 and len(held) == 500
    np.testing.assert_array_equal(held.labels, train.labels[3500:])
    np.testing.assert_array_equal(held.render(np.arange(3))[0], train.render(np.arange(3500, 3503))[0])
    given = np.concatenate([np.concatenate([a.train_indices, a.val_indices])
                            for a in plan_module.plan_run(cfg, 4).assignments])
    assert given.max() < 3400 and len(given) == 3400  # the aux slice (3400..3499) and the holdout go to no party
    np.testing.assert_array_equal(open_aux_set(cfg, train)[1], train.labels[3400:3500])
    with pytest.raises(ConfigError, match=r"data\.holdout: -1 must be >= 0"):
        load_config(None, ["data.holdout=-1"])
    with pytest.raises(ValueError, match=r"data\.holdout: 4000 held out leave 0"):
        plan_module.central_shards(load_config(None, ["data.dataset=mnist-5k", "data.image_size=14",
                                                      "data.train_size=null", "data.holdout=4000"]),
                                   train.labels, 4)
