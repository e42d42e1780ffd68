"""A source file's parsed form, kept as a ``.npy`` and memory-mapped by every process that opens it.

Why: parsing a large text file in each of 9 MPI ranks costs 9 parses at once on a node's cores and 9 private copies.
Instead the first process to open the source parses and checks it and writes the ``.npy``; every process then maps
it read-only, so the node's page cache holds one copy for all its ranks, each reading only the rows it renders.

* Named after the source's size and SHA-256 (``<stem>-<size>-<16 hex digits>.npy``, the source hashed at every
  open): a changed source is parsed and checked afresh (and refused if it fails), never served from an older parse.
* Written atomically (a temporary file in the same folder, renamed into place): no process maps half of one, and
  one that already mapped an older file keeps reading that file.
* A ``.npy`` that fails its cheap check when opened (truncated, another shape) is built again.
* Builders of one ``.npy`` take turns (an exclusive ``flock`` on ``<name>.lock`` beside it; the second finds the
  first's file and does not parse again). Opening a ``.npy`` that exists needs no write access to its folder.

Only ``numpy.save``/``numpy.load`` without pickles: a ``.npy`` holds one plain array.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

KEY_HEX_DIGITS = 16  # of the SHA-256: 64 bits tell apart any two sources one folder will see


class CacheNotWritableError(ValueError):
    """A parsed cache that is missing (or damaged) cannot be written into its folder."""


def source_key(path: Path) -> str:
    """``<size>-<first 16 hex digits of the SHA-256>`` of the bytes of file `path`."""
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return f"{path.stat().st_size}-{digest[:KEY_HEX_DIGITS]}"


def cache_path(source: Path, cache_dir: Path) -> Path:
    """Where the parsed form of `source`, as it is now, is kept in `cache_dir`."""
    return cache_dir / f"{source.stem}-{source_key(source)}.npy"


def cached_array(source: Path, cache_dir: Path, *, build: Callable[[Path], np.ndarray],
                 check: Callable[[np.ndarray], None]) -> np.ndarray:
    """``build(source)``'s array, memory-mapped read-only from its ``.npy`` in `cache_dir` (written first if missing
    or failing `check`).

    `build`: parses `source` and checks all of it, raising its own one-line error for a bad source (nothing is
    written then). `check`: raises ValueError for an array `build` would not have made; run at every open, so it
    should be cheap on a memory map (shapes, a small part). CacheNotWritableError (one line) when a missing ``.npy``
    cannot be written into `cache_dir`.
    """
    path = cache_path(source, cache_dir)
    cached = _open_checked(path, check)
    if cached is not None:
        return cached
    with _turn(path, source):
        if _open_checked(path, check) is None:  # else another process wrote it while this one waited
            array = build(source)
            _write_atomically(path, array, source)
    array = _open(path)
    check(array)
    return array


def _open(path: Path) -> np.ndarray:
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _open_checked(path: Path, check: Callable[[np.ndarray], None]) -> np.ndarray | None:
    """The memory-mapped array of `path` if it opens and passes `check`, else None (missing, truncated, wrong)."""
    try:
        array = _open(path)
        check(array)
    except (OSError, ValueError, EOFError):
        return None
    return array


@contextmanager
def _turn(path: Path, source: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` (created, with its folder, if missing) for the block: one builder
    of `path` at a time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.with_suffix(".lock").open("a")
    except OSError as exc:
        raise _not_writable(source, path.parent, exc) from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _write_atomically(path: Path, array: np.ndarray, source: Path) -> None:
    """Save `array` as `path`: to a temporary file beside it, flushed to disk, then renamed over `path`."""
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # a public dataset: other users of a shared data.root may map it too
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _not_writable(source, path.parent, exc) from None
        raise


def _not_writable(source: Path, folder: Path, exc: OSError) -> CacheNotWritableError:
    return CacheNotWritableError(f"cannot write the parsed copy of {source} into {folder}/ ({type(exc).__name__}: "
                                 f"{exc.strerror or exc}); set data.root to a folder this job can write")
