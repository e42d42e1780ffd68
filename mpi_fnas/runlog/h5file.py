"""Opening the run log's file for rank 0's writes: ordinary "r+" opens that a reader's lock cannot stop, edits
outside SWMR mode before returning to it, and the salvage of a log whose writer died (docs/hdf5.md)."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

import h5py

from mpi_fnas.runlog.schema import STAGE_LAYOUTS, common_length, stage_families

_logger = logging.getLogger(__name__)


def open_read_write(path: Path) -> h5py.File:
    """Open ``path`` in ordinary "r+" mode; bypass the HDF5 file lock only when a reader holds it."""
    try:
        return h5py.File(path, "r+", libver="latest")
    except OSError as exc:
        if not (exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES) or "unable to lock file" in str(exc)):
            raise
        # An attached reader (SWMR readers keep a shared lock in HDF5 >= 1.14) must not stop rank 0 from
        # recording the outcome; rank 0 is the only writer, so the lock protects nothing here.
        _logger.debug("run log %s is locked by a reader; reopening without file locking", path)
        return h5py.File(path, "r+", libver="latest", locking=False)


def open_swmr_writer(path: Path, edit: Callable[[h5py.File], None]) -> h5py.File:
    """Open ``path`` for writing, apply ``edit(handle)`` (attribute changes, shrinking, new objects) while
    still outside SWMR mode, then enter SWMR-write mode."""
    handle = open_read_write(path)
    try:
        edit(handle)
        handle.swmr_mode = True
    except BaseException:
        handle.close()
        raise
    return handle


def salvage(path: Path) -> None:
    """Copy a log whose writer died into a fresh file (through a SWMR read open, the only open HDF5 allows on
    it) and atomically replace the original. Flushed rows survive; ragged families are trimmed on reopen."""
    temp = path.with_name(path.name + ".salvage")
    temp.unlink(missing_ok=True)
    with (
        h5py.File(path, "r", libver="latest", swmr=True) as source,
        h5py.File(temp, "x", libver="latest") as copy,
    ):
        copy.attrs.update(source.attrs)
        for name in source:
            source.copy(source[name], copy, name=name)
    os.replace(temp, path)


def trim_ragged(handle: h5py.File) -> None:
    """Cut each growing family (the search's and ``/augment``'s) to its shortest dataset (a crash may interrupt
    an append between datasets)."""
    for datasets in (d for layout in STAGE_LAYOUTS.values() for d in stage_families(handle, layout).values()):
        rows = common_length(datasets)
        for dataset in datasets:
            if dataset.shape[0] != rows:
                dataset.resize(rows, axis=0)


# ---------------------------------------------------------------------- conversion
