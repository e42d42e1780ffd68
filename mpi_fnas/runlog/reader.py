"""``read_run``: the whole run log as a dict, for a running, finished or crashed run (layout in docs/hdf5.md)."""

from __future__ import annotations

import dataclasses
import errno
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpi_fnas.runlog.liveness import WriterRecord, read_writer_record, writer_gone_reason
from mpi_fnas.runlog.schema import (
    AUGMENT_GROUP,
    AUGMENT_LAYOUT,
    COST_FIELDS,
    SEARCH_LAYOUT,
    SELECTION_GROUP,
    StageLayout,
    common_length,
    stage_families,
)

# A writer silent for this long counts as dead when this machine cannot check its PID (another node). Must
# exceed the longest gap between two heartbeats, i.e. one search step plus setup.
DEFAULT_STALE_SECONDS = 120.0


def read_run(
    path: str | Path, *, wait_seconds: float = 5.0, stale_after: float = DEFAULT_STALE_SECONDS
) -> dict[str, Any]:
    """Read a run log through a SWMR read open (the only open HDF5 allows while, or after, a writer held it).

    Returns a dict: the root attrs (status, reason, mode, ...), stale, last_step, writer, metrics, alphas, alpha_ops,
    genotypes, cost, ranks, unreliable, corruption, privacy, selection and augment (None, or the same of ``/augment``);
    every key with its shape: docs/hdf5.md, "The whole log as a dict". What an older log never wrote is absent.

    A ``running`` log or augment stage whose writer is dead (see ``liveness``) reads as ``failed``, ``stale`` True,
    with a reason naming the writer and its last logged step; the search's status stays what the search recorded.
    Each growing family is cut to its shortest dataset, so a row caught mid-append is not returned half-filled.

    stale_after: seconds without heartbeat after which a writer on another machine counts as dead. wait_seconds: how
    long to retry while the writer briefly holds the file outside SWMR mode, or a read that failed half-way (a live
    writer may still be extending its metadata); a file that still fails after that raises.
    """
    deadline = time.monotonic() + wait_seconds
    while True:
        handle = _open_swmr_reader(Path(path), max(0.0, deadline - time.monotonic()))
        try:
            result, writer = _read_open_log(handle)
            break
        except (OSError, KeyError, RuntimeError):
            if time.monotonic() >= deadline:
                raise
        finally:
            handle.close()
        time.sleep(0.05)
    return _judge_writer(result, writer, stale_after)


def _read_open_log(handle: h5py.File) -> tuple[dict[str, Any], WriterRecord]:
    """The log's contents as read_run returns them (statuses as stored), and its writer record."""
    root = handle.attrs
    writer = read_writer_record(handle)
    result = _read_stage(handle, SEARCH_LAYOUT, {
        "writer": dataclasses.asdict(writer),
        "mode": str(root["mode"]),
        # Logs written before the DPNAS space record no space: they are DARTS searches.
        "space": str(root.get("space", "darts")),
        "parties": int(root["parties"]),
        "config": str(root["config"]),
        "privacy_guarantee": str(root["privacy_guarantee"]),
        "version": str(root["version"]),
        "created": str(root["created"]),
        "final_genotype": str(root["final_genotype"]),
        "attempts": int(root["attempts"]),
    })
    result.update(
        ranks={key: _plain(value) for key, value in handle["ranks"].attrs.items()},
        unreliable=np.asarray(root["unreliable"], dtype=bool) if "unreliable" in root else None,
        corruption=float(root["corruption"]) if "corruption" in root else 0.0,
        augment=_read_augment(handle) if AUGMENT_GROUP in handle else None,
    )
    return result, writer


def _judge_writer(result: dict[str, Any], writer: WriterRecord, stale_after: float) -> dict[str, Any]:
    """A stage still marked running whose writer is gone becomes failed (stale), with a reason naming the writer."""
    augment = result["augment"]
    stages = [(result, "step")] + ([(augment, "augment step")] if augment is not None else [])
    running = [(stage, noun) for stage, noun in stages if stage["status"] == "running"]
    gone = writer_gone_reason(writer, now=time.time(), stale_after=stale_after) if running else None
    if gone is not None:
        for stage, noun in running:
            last = f"no {noun} logged" if stage["last_step"] is None else f"last logged {noun} {stage['last_step']}"
            stage.update(status="failed", reason=f"{gone}; {last}", stale=True)
    if augment is not None:
        del augment["last_step"]  # only needed for the reason; the metrics hold every step
    return result


def _read_augment(handle: h5py.File) -> dict[str, Any]:
    """``/augment`` as stored (status not yet judged against the writer), with ``last_step`` for the reason."""
    attrs = handle[AUGMENT_GROUP].attrs
    return _read_stage(handle, AUGMENT_LAYOUT, {
        "network": str(attrs.get("network", "cell")),  # logs from before augment.network trained a cell
        "genotype": str(attrs["genotype"]),
        "params": int(attrs["params"]),
        "test_acc": float(attrs["test_acc"]),
        "test_error": float(attrs["test_error"]),
        "private": bool(attrs["private"]),
        # Logs written before the attribute existed do not say.
        "privacy_guarantee": str(attrs.get("privacy_guarantee", "not recorded")),
        "attempts": int(attrs["attempts"]),
    })


def _read_stage(handle: h5py.File, layout: StageLayout, facts: dict[str, Any]) -> dict[str, Any]:
    """What read_run returns of every stage, read the same way for the search and ``/augment``: status and reason
    as stored, ``last_step`` (for the reason of a dead writer), `facts` (its other attrs), its rows (each family
    cut to its shortest dataset), cost, and privacy and selection (None where the stage has no such group)."""
    group = handle[layout.group or "/"]
    families = stage_families(handle, layout)
    metrics = _rows(families["metrics"])
    steps = metrics.get("step", ())
    stage: dict[str, Any] = {
        "status": str(group.attrs["status"]),
        "reason": str(group.attrs["reason"]),
        "stale": False,
        "last_step": int(steps[-1]) if len(steps) else None,
        **facts,
        "metrics": metrics,
    }
    if layout.epochs:
        rows = common_length(families["epochs"])
        normal, reduce, genotypes = (dataset[:rows] for dataset in families["epochs"])
        ops = group["alphas"].attrs.get("ops")  # logs written before space.ops name no columns: the kind's
        stage.update(alphas={"normal": normal, "reduce": reduce}, genotypes=[row.decode("utf-8") for row in genotypes],
                     alpha_ops=str(ops).split(",") if ops is not None else None)
    privacy, selection = group.get("privacy"), group.get(SELECTION_GROUP)
    stage.update(
        cost={name: _plain(group["cost"].attrs.get(name, np.nan)) for name in COST_FIELDS},
        privacy=None if privacy is None else _read_privacy(privacy, layout, families["privacy"]),
        selection=None if selection is None else {
            **{name: _plain(value) for name, value in selection.attrs.items()}, **_rows(families["selection"])},
    )
    return stage


def _read_privacy(group: h5py.Group, layout: StageLayout, datasets: list[h5py.Dataset]) -> dict[str, Any]:
    """A stage's privacy group: its fixed datasets (``layout.privacy_fixed``), δ and the accountant where the
    search keeps them (attrs), and its ledger rows. What an older log never recorded is absent from the dict, not
    invented: a release field added to ``RELEASE_FIELDS`` later, ``charged_steps`` and ``mu_gdp`` of an
    ``/augment/privacy`` written before the stages shared one writer, and ``aggregation`` and ``epsilon_collusion``
    of a log written before secure aggregation."""
    privacy: dict[str, Any] = {name: _plain(group[name][()]) for name in layout.privacy_fixed if name in group}
    if layout.delta_attr:
        privacy.update(delta=np.asarray(group.attrs["delta"]), accountant=str(group.attrs["accountant"]))
    if "aggregation" in group.attrs:
        privacy["aggregation"] = str(group.attrs["aggregation"])
    privacy["colluders"] = int(group.attrs.get("colluders", 0))  # 0 in logs written before privacy.colluders
    if "epsilon_alone" in group.attrs:  # written at the augmentation's end (not by a failed one, nor older logs)
        privacy["epsilon_alone"] = np.asarray(group.attrs["epsilon_alone"], dtype=np.float64)
    return privacy | _rows(datasets)


def _rows(datasets: list[h5py.Dataset]) -> dict[str, np.ndarray]:
    """{name: rows} of a family's datasets, each cut to the rows all of them have (``common_length``)."""
    rows = common_length(datasets)
    return {dataset.name.rsplit("/", 1)[1]: dataset[:rows] for dataset in datasets}


def _open_swmr_reader(path: Path, wait_seconds: float) -> h5py.File:
    deadline = time.monotonic() + wait_seconds
    _refuse_truncated(path, deadline)
    locking: bool | None = None  # HDF5's default (on, unless HDF5_USE_FILE_LOCKING says otherwise)
    while True:
        try:
            return h5py.File(path, "r", libver="latest", swmr=True, locking=locking)
        except OSError as exc:
            # Within the writer's own process HDF5 shares one open file, and insists on the writer's locking
            # flag: the writer bypasses locking when an outside reader held the lock (h5file.open_read_write).
            if "file locking flag values don't match" in str(exc) and locking is None:
                locking = False
                continue
            # The writer holds the file outside SWMR mode for milliseconds in a stage's finish and truncate, in
            # reopen and in begin_augment.
            locked = exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES) or "unable to lock" in str(exc)
            if not (locked or "not already open for SWMR" in str(exc)) or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def _refuse_truncated(path: Path, deadline: float) -> None:
    """Raise OSError for a file shorter than the end of file its superblock records (a cut copy, a full disk).

    A SWMR read open skips that check and then retries every unreadable metadata block for minutes, so a cut log
    would hang its reader. A plain read open (no lock: a live writer is not disturbed) makes the check first and
    fails within a millisecond; any other outcome (a live or crashed writer's file, which a plain open refuses as
    open for write) is left to the SWMR open. A writer's file can look short for a moment (at its creation, seen
    in a 3-rank run), so only a file still short at ``deadline`` is refused.
    """
    while True:
        try:
            h5py.File(path, "r", locking=False).close()
            return
        except OSError as exc:
            if "truncated file" not in str(exc):
                return
            if time.monotonic() >= deadline:
                sizes = str(exc).split("truncated file:", 1)[1].strip(" )")  # "eof = …, stored_eof = …"
                raise OSError(errno.EIO, f"truncated HDF5 file: {sizes}", str(path)) from None
        time.sleep(0.05)


def _plain(value: Any) -> Any:
    """HDF5 attribute/dataset values as plain Python (str, int, float) or numpy arrays."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "O":
            return [item.decode("utf-8") if isinstance(item, bytes) else str(item) for item in value]
        return value if value.ndim else value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value
