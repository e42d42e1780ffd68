"""Atomic checkpoint files: the server's ``RUN_DIR/checkpoint.pt`` and each party's own state files.

Every file is written to a temporary file in the same directory, flushed to disk and moved over the old one with
``os.replace``, so a crash or a preemption at any moment leaves either the previous file or the new one, never half
a file. Loading uses ``weights_only=True``: only tensors and plain Python containers, no arbitrary pickled objects.

The server's checkpoint holds what rank 0 owns and nothing else: the step, W, A and both optimizer states, the
privacy ledgers, the log's row counts, the metric accumulator and the resolved config. A party's random-number
generator states never leave the party: each party saves them in its own directory
(:mod:`mpi_fnas.federation.party_disk`), and a resumed run equals an uninterrupted one bit for bit on CPU because
every party restores its own state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 2  # 2: party states left the server's checkpoint


def checkpoint_path(run_dir: str | Path) -> Path:
    """Where rank 0's checkpoint of the run in `run_dir` is written."""
    return Path(run_dir) / CHECKPOINT_NAME


#: Permissions of every file written here: private to the user. A party's state holds its stream keys, the
#: server's its selection stream key; neither is for anyone else on the machine (docs/privacy.md §2.2).
PRIVATE_FILE_MODE = 0o600


def atomic_save(path: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` (tensors and plain containers) to ``path`` atomically and durably, readable by the user only
    (mode 0600 whatever the umask; the file is never visible with wider permissions)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    os.fchmod(fd, PRIVATE_FILE_MODE)  # an existing temporary file keeps its mode through O_CREAT
    with os.fdopen(fd, "wb") as f:
        torch.save({"format_version": FORMAT_VERSION, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def atomic_load(path: Path) -> dict[str, Any]:
    """Read a file written by :func:`atomic_save`. Raises ValueError on an unknown format."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint format {state.get('format_version')!r}")
    return state


def save_checkpoint(run_dir: str | Path, state: dict[str, Any]) -> Path:
    """Write the server's ``state`` atomically to ``run_dir/checkpoint.pt`` and return the path."""
    return atomic_save(checkpoint_path(run_dir), state)


def load_checkpoint(run_dir: str | Path) -> dict[str, Any] | None:
    """The server's checkpoint in `run_dir`, or None if there is none. Raises ValueError on an unknown format."""
    path = checkpoint_path(run_dir)
    if not path.exists():
        return None
    return atomic_load(path)
