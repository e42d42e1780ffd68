"""Atomic checkpoints of a search (rank 0 writes, every rank's state inside).

A checkpoint is one ``torch.save`` file, ``RUN_DIR/checkpoint.pt``, written to a temporary file in the same
directory, flushed to disk and moved over the old one with ``os.replace`` — so a crash or a preemption at any
moment leaves either the previous checkpoint or the new one, never half a file.

It holds everything a resumed run needs to continue exactly where the interrupted one stopped (same results bit
for bit on CPU): the step, W, A and both optimizer states, every party's random-number-generator states (batch
order / Poisson sampling and noise) and batch-stream positions, the privacy ledgers, the log's row counts, the
metric accumulator, and the resolved config. Loading uses ``weights_only=True``: only tensors and plain Python
containers, no arbitrary pickled objects.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 1


def checkpoint_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_NAME


def save_checkpoint(run_dir: str | Path, state: dict[str, Any]) -> Path:
    """Write `state` atomically to ``run_dir/checkpoint.pt`` and return the path."""
    path = checkpoint_path(run_dir)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
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


def load_checkpoint(run_dir: str | Path) -> dict[str, Any] | None:
    """The checkpoint in `run_dir`, or None if there is none. Raises ValueError on an unknown format."""
    path = checkpoint_path(run_dir)
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint format {state.get('format_version')!r}")
    return state
