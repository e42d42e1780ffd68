"""``read_run``: the whole run log as a dict, for a running, finished or crashed run (layout in docs/hdf5.md)."""

from __future__ import annotations

import dataclasses
import errno
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpi_fnas.runlog.liveness import read_writer_record, writer_gone_reason
from mpi_fnas.runlog.schema import COST_FIELDS, PRIVACY_FIXED, PRIVACY_GROWING, common_length, growing_families

# A writer silent for this long counts as dead when this machine cannot check its PID (another node). Must
# exceed the longest gap between two heartbeats, i.e. one search step plus setup.
DEFAULT_STALE_SECONDS = 120.0


def read_run(
    path: str | Path, *, wait_seconds: float = 5.0, stale_after: float = DEFAULT_STALE_SECONDS
) -> dict[str, Any]:
    """Read a run log through a SWMR read open (the only open HDF5 allows while, or after, a writer held it).

    Returns a dict: status, reason, mode, parties, config, privacy_guarantee, version, created, final_genotype,
    attempts (root attrs); stale (bool), last_step (int | None), writer (the ``/writer`` record as a dict);
    metrics {name: (rows,) float64}; alphas {"normal", "reduce": (epochs, edges, ops) float32};
    genotypes [str] (one per epoch); cost {field: value}; ranks {attr: value}; privacy None or a dict with
    delta (K,), accountant, steps (rows,), charged_steps (rows, K), epsilon (rows, K), mu_gdp (rows, K),
    sample_rate_train (K,), sample_rate_val (K,), noise_multiplier_w, noise_multiplier_a, clip_w, clip_a.

    A log still marked ``running`` whose writer is dead (see ``liveness``) is reported with status
    ``failed``, ``stale`` True and a reason naming the writer and the last logged step; its rows are all
    there. stale_after: seconds without heartbeat after which a writer on another machine counts as dead.
    Each growing family is cut to its shortest dataset so a row caught mid-append is not returned
    half-filled. wait_seconds: how long to retry while the writer briefly holds the file outside SWMR mode.
    """
    handle = _open_swmr_reader(Path(path), wait_seconds)
    try:
        root = handle.attrs
        metric_sets, epoch_sets, privacy_sets = growing_families(handle)
        metric_rows = common_length(metric_sets)
        epoch_rows = common_length(epoch_sets)
        metrics = {dataset.name.rsplit("/", 1)[1]: dataset[:metric_rows] for dataset in metric_sets}
        steps = metrics.get("step", np.empty(0))
        writer = read_writer_record(handle)
        result: dict[str, Any] = {
            "status": str(root["status"]),
            "reason": str(root["reason"]),
            "stale": False,
            "last_step": int(steps[-1]) if len(steps) else None,
            "writer": dataclasses.asdict(writer),
            "mode": str(root["mode"]),
            "parties": int(root["parties"]),
            "config": str(root["config"]),
            "privacy_guarantee": str(root["privacy_guarantee"]),
            "version": str(root["version"]),
            "created": str(root["created"]),
            "final_genotype": str(root["final_genotype"]),
            "attempts": int(root["attempts"]),
            "metrics": metrics,
            "alphas": {"normal": epoch_sets[0][:epoch_rows], "reduce": epoch_sets[1][:epoch_rows]},
            "genotypes": [row.decode("utf-8") for row in epoch_sets[2][:epoch_rows]],
            "cost": {name: _plain(handle["cost"].attrs[name]) for name in COST_FIELDS},
            "ranks": {key: _plain(value) for key, value in handle["ranks"].attrs.items()},
            "privacy": None,
        }
        if "privacy" in handle:
            group = handle["privacy"]
            privacy_rows = common_length(privacy_sets)
            privacy: dict[str, Any] = {
                "delta": np.asarray(group.attrs["delta"]),
                "accountant": str(group.attrs["accountant"]),
            }
            for name, dataset in zip(PRIVACY_GROWING, privacy_sets, strict=True):
                privacy[name] = dataset[:privacy_rows]
            for name in PRIVACY_FIXED:
                privacy[name] = _plain(group[name][()])
            result["privacy"] = privacy
    finally:
        handle.close()

    if result["status"] == "running":
        gone = writer_gone_reason(writer, now=time.time(), stale_after=stale_after)
        if gone is not None:
            last = "no step logged" if result["last_step"] is None else f"last logged step {result['last_step']}"
            result.update(status="failed", reason=f"{gone}; {last}", stale=True)
    return result


def _open_swmr_reader(path: Path, wait_seconds: float) -> h5py.File:
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            return h5py.File(path, "r", libver="latest", swmr=True)
        except OSError as exc:
            # The writer holds the file outside SWMR mode for milliseconds in finish/reopen/truncate.
            locked = exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES) or "unable to lock" in str(exc)
            if not (locked or "not already open for SWMR" in str(exc)) or time.monotonic() >= deadline:
                raise
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
