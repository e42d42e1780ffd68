"""HDF5 run log of one search, written by rank 0 only and readable while the run is going (SWMR).

The schema is documented name by name in docs/hdf5.md; this module is its only writer.

Lifecycle of the file:

1. ``RunLog.create`` builds every group, dataset and attribute that will ever exist (HDF5's SWMR mode
   forbids creating objects or attributes later), then switches the handle to SWMR-write mode.
2. ``append_metrics`` / ``append_epoch`` / ``append_privacy`` grow datasets along axis 0 and flush each
   dataset right away, so a reader with ``h5py.File(path, "r", libver="latest", swmr=True)`` sees every
   appended row after ``Dataset.refresh()`` and a crash never loses a row that was appended.
3. ``finish`` closes the SWMR handle (all rows are already on disk), reopens the file in ordinary "r+"
   mode for a few milliseconds and writes the final root and ``/cost`` attributes there. SWMR readers hold
   a shared file lock for as long as they keep the file open (seen with HDF5 2.0), which would make that
   "r+" open fail while a monitor is attached; in that case (and only then) the file is reopened with
   ``locking=False``. This is safe for the file because rank 0 is the only writer; an attached reader
   keeps its cached (old) attributes and must reopen the file to see the final status.
4. ``RunLog.reopen`` continues a log after a requeue. If the previous writer died without closing
   (SIGKILL, node loss), HDF5 leaves the superblock marked "open for SWMR write" and refuses every write
   open; the log is then salvaged through a SWMR read open into a fresh file that replaces it (all flushed
   rows survive).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import h5py
import numpy as np

from mpi_fnas import __version__

_logger = logging.getLogger(__name__)

STATUSES = ("running", "finished", "failed", "interrupted")
FINAL_STATUSES = ("finished", "failed", "interrupted")
MODES = ("vanilla", "fnas", "dpfnas")
REQUIRED_METRICS = (
    "step",
    "epoch",
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "step_seconds",
    "comm_seconds",
)
# Costs of successive attempts (requeues) add up; the layout fields describe the latest attempt.
COST_ADDITIVE = ("wall_seconds", "gpu_hours", "cpu_core_hours")
COST_LAYOUT = ("ranks", "gpus")
COST_FIELDS = COST_ADDITIVE + COST_LAYOUT

# Chunk lengths along the growing axis: big enough that a long run has few chunks, small enough that a
# flush per row rewrites little.
_METRIC_CHUNK_ROWS = 256
_EPOCH_CHUNK_ROWS = 16
_PRIVACY_CHUNK_ROWS = 64
# Tolerance for "each edge's op weights sum to 1" (float32 softmax over ≤ a few dozen ops).
_SOFTMAX_SUM_ATOL = 1e-3


@dataclass(frozen=True)
class PrivacySchema:
    """Fixed privacy facts of a DP run, written once into ``/privacy`` at creation. K = number of parties.

    delta: (K,) target δ per party. accountant: name of the ε accountant (e.g. ``"pld"``).
    sample_rate_train / sample_rate_val: (K,) Poisson rates q_tr = B/N_k^tr, q_val = B/N_k^val.
    noise_multiplier_w / noise_multiplier_a: σ_W, σ_A as a scalar or (K,).
    clip_w / clip_a: R^G, R^H (scalars).
    """

    delta: Sequence[float] | np.ndarray
    accountant: str
    sample_rate_train: Sequence[float] | np.ndarray
    sample_rate_val: Sequence[float] | np.ndarray
    noise_multiplier_w: float | Sequence[float] | np.ndarray
    noise_multiplier_a: float | Sequence[float] | np.ndarray
    clip_w: float
    clip_a: float


class RowCounts(NamedTuple):
    """Rows written per growing family; what a checkpoint records and ``RunLog.truncate`` restores."""

    metric_rows: int
    epoch_rows: int
    privacy_rows: int


def error_reason(exc: BaseException) -> str:
    """One line naming an exception, for the ``reason`` attribute of a failed run."""
    text = f"{type(exc).__name__}: {exc}".strip()
    first_line = text.splitlines()[0] if text else type(exc).__name__
    return first_line[:500]


class RunLog:
    """Rank 0's writer of the HDF5 run log. Not thread-safe; one instance per file.

    Use as ``with RunLog.create(...) as runlog:``; leaving the block through an exception finishes the
    log as ``failed`` (``interrupted`` for KeyboardInterrupt) with the exception as reason, a clean exit
    without an explicit ``finish`` finishes it as ``finished`` / ``"completed"``.
    """

    def __init__(self, path: Path, handle: h5py.File) -> None:
        """Internal: use ``create`` or ``reopen``. ``handle`` is an open SWMR-write handle of ``path``."""
        self._path = path
        self._finished = False
        self._attach(handle)

    def _attach(self, handle: h5py.File) -> None:
        """Take the open SWMR-write ``handle`` and read the layout and row counts back from the file."""
        self._file: h5py.File | None = handle
        metrics = handle["metrics"]
        self._metric_names = tuple(metrics)  # creation order: the group tracks it
        self._metrics = [metrics[name] for name in self._metric_names]
        self._alphas_normal = handle["alphas/normal"]
        self._alphas_reduce = handle["alphas/reduce"]
        self._genotypes = handle["genotype"]
        edges, ops = self._alphas_normal.shape[1:]
        self._alpha_shape = (int(edges), int(ops))
        self._genotype_length = int(self._genotypes.dtype.itemsize)
        self._parties = int(handle.attrs["parties"])
        self._privacy = handle.get("privacy")
        self._metric_rows = _common_length(self._metrics)
        self._epoch_rows = _common_length([self._alphas_normal, self._alphas_reduce, self._genotypes])
        self._privacy_rows = 0 if self._privacy is None else _common_length(self._privacy_growing())

    # ------------------------------------------------------------------ opening

    @classmethod
    def create(
        cls,
        path: str | Path,
        *,
        mode: str,
        parties: int,
        config_text: str,
        metric_names: Sequence[str],
        alpha_shape: tuple[int, int],
        genotype_length: int,
        privacy: PrivacySchema | None = None,
        rank_attrs: Mapping[str, Any] | None = None,
    ) -> RunLog:
        """Create a new log at ``path`` (must not exist) and enter SWMR-write mode.

        metric_names: names of the ``/metrics`` datasets; must include ``REQUIRED_METRICS``.
        alpha_shape: (edges, ops) of one cell's softmax weights. genotype_length: bytes per ``/genotype`` row
        (UTF-8). privacy: required for mode ``dpfnas`` and refused otherwise, so a DP run always has a ledger.
        rank_attrs: per-rank facts for ``/ranks`` attrs (str, numbers, or sequences of either; a sequence is
        indexed by rank).
        """
        path = Path(path)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(parties, bool) or not isinstance(parties, (int, np.integer)) or parties < 1:
            raise ValueError(f"parties must be an int >= 1, got {parties!r}")
        if not isinstance(config_text, str):
            raise TypeError("config_text must be the resolved YAML text (str)")
        names = _validated_metric_names(metric_names)
        edges, ops = _validated_alpha_shape(alpha_shape)
        if isinstance(genotype_length, bool) or not isinstance(genotype_length, (int, np.integer)):
            raise TypeError(f"genotype_length must be an int, got {genotype_length!r}")
        if genotype_length < 1:
            raise ValueError(f"genotype_length must be >= 1, got {genotype_length}")
        if (privacy is not None) != (mode == "dpfnas"):
            raise ValueError("a privacy schema is required for mode 'dpfnas' and only for it")
        privacy_arrays = None if privacy is None else _validated_privacy(privacy, int(parties))
        rank_values = {key: _attr_value(key, value) for key, value in (rank_attrs or {}).items()}

        # "x": never clobber an earlier run's log.
        handle = h5py.File(path, "x", libver="latest")
        try:
            _build_skeleton(
                handle,
                mode=mode,
                parties=int(parties),
                config_text=config_text,
                metric_names=names,
                alpha_shape=(edges, ops),
                genotype_length=int(genotype_length),
                privacy=privacy_arrays,
                rank_values=rank_values,
            )
            handle.swmr_mode = True
        except BaseException:
            handle.close()
            path.unlink(missing_ok=True)
            raise
        return cls(path, handle)

    @classmethod
    def reopen(
        cls, path: str | Path, *, rank_attrs: Mapping[str, Any] | None = None, recover: bool = True
    ) -> RunLog:
        """Continue an existing log (resume after a requeue): rows are kept, status goes back to ``running``.

        ``attempts`` is incremented and ``reason`` cleared. Rows of a family left ragged by a crash
        mid-append are trimmed to the shortest dataset. rank_attrs, when given, replaces the ``/ranks``
        attrs (placement may differ after a requeue). recover: salvage a log whose writer died without
        closing (see module doc). The previous writer must be dead: HDF5 cannot tell a live SWMR writer
        from a crashed one.
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no run log at {path}")
        rank_values = None
        if rank_attrs is not None:
            rank_values = {key: _attr_value(key, value) for key, value in rank_attrs.items()}

        def restart(handle: h5py.File) -> None:
            handle.attrs["status"] = "running"
            handle.attrs["reason"] = ""
            handle.attrs["attempts"] = np.int64(int(handle.attrs.get("attempts", 0)) + 1)
            _trim_ragged(handle)
            if rank_values is not None:
                ranks = handle["ranks"]
                for key in list(ranks.attrs):
                    del ranks.attrs[key]
                for key, value in rank_values.items():
                    ranks.attrs[key] = value

        try:
            handle = _open_swmr_writer(path, restart)
        except OSError as exc:
            if not (recover and _is_left_open_error(exc)):
                raise
            _logger.warning("run log %s was left open by a writer that did not close it; salvaging it", path)
            _salvage(path)
            handle = _open_swmr_writer(path, restart)
        return cls(path, handle)

    # ------------------------------------------------------------------ properties

    @property
    def path(self) -> Path:
        """Path of the HDF5 file."""
        return self._path

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Names of the ``/metrics`` datasets, in creation order."""
        return self._metric_names

    @property
    def parties(self) -> int:
        """K, the number of parties (width of the ``/privacy`` arrays)."""
        return self._parties

    @property
    def closed(self) -> bool:
        """True once ``close`` or ``finish`` has released the writer handle."""
        return self._file is None

    # ------------------------------------------------------------------ appending

    def append_metrics(self, row: Mapping[str, float]) -> None:
        """Append one row to every ``/metrics`` dataset. Missing names are stored as NaN; unknown names raise
        KeyError before anything is written."""
        self._require_open()
        unknown = sorted(set(row) - set(self._metric_names))
        if unknown:
            raise KeyError(f"unknown metric name(s) {unknown}; the log has {list(self._metric_names)}")
        # Convert everything first so a bad value cannot leave a half-written row.
        values = [float(row[name]) if name in row else math.nan for name in self._metric_names]
        index = self._metric_rows
        for dataset, value in zip(self._metrics, values, strict=True):
            dataset.resize((index + 1,))
            dataset[index] = value
            dataset.flush()
        self._metric_rows = index + 1

    def append_epoch(self, alphas_normal: np.ndarray, alphas_reduce: np.ndarray, genotype: str) -> None:
        """Append one epoch-end row: softmax weights (edges, ops) of the normal and reduction cell (CPU
        arrays, e.g. ``tensor.detach().cpu().numpy()``) and the derived genotype string.

        Raises ValueError for a wrong shape, weights that are not per-edge softmax distributions, or a
        genotype longer than ``genotype_length`` bytes in UTF-8 (never truncated).
        """
        self._require_open()
        normal = self._validated_alphas("alphas_normal", alphas_normal)
        reduce = self._validated_alphas("alphas_reduce", alphas_reduce)
        encoded = _encode_genotype(genotype, self._genotype_length)
        index = self._epoch_rows
        for dataset, value in (
            (self._alphas_normal, normal),
            (self._alphas_reduce, reduce),
            (self._genotypes, encoded),
        ):
            dataset.resize(index + 1, axis=0)
            dataset[index] = value
            dataset.flush()
        self._epoch_rows = index + 1

    def append_privacy(self, steps: int, epsilon: np.ndarray, mu_gdp: np.ndarray) -> None:
        """Append one ledger row: iterations so far, tight ε per party (K,) and μ-GDP per party (K,)."""
        self._require_open()
        if self._privacy is None:
            raise RuntimeError("this run log was created without a privacy schema")
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        eps = _per_party_array("epsilon", epsilon, self._parties, allow_inf=True)
        mu = _per_party_array("mu_gdp", mu_gdp, self._parties, allow_inf=True)
        index = self._privacy_rows
        eps_ds, mu_ds, steps_ds = self._privacy_growing()
        for dataset, value in ((eps_ds, eps), (mu_ds, mu), (steps_ds, np.int64(steps))):
            dataset.resize(index + 1, axis=0)
            dataset[index] = value
            dataset.flush()
        self._privacy_rows = index + 1

    # ------------------------------------------------------------------ counts and resume

    def rows(self) -> int:
        """Metric rows written so far."""
        return self._metric_rows

    def row_counts(self) -> RowCounts:
        """Rows of the metric, epoch (alphas + genotype) and privacy families; store it in a checkpoint."""
        return RowCounts(self._metric_rows, self._epoch_rows, self._privacy_rows)

    def truncate(self, metric_rows: int, epoch_rows: int, privacy_rows: int) -> None:
        """Drop rows written after a checkpoint (crash between checkpoint and log): shrink each family to the
        given count. Counts above what exists raise ValueError. The shrink happens outside SWMR mode
        (HDF5 only guarantees SWMR readers growing datasets), then the handle returns to SWMR mode."""
        self._require_open()
        wanted = RowCounts(int(metric_rows), int(epoch_rows), int(privacy_rows))
        for name, want, have in zip(RowCounts._fields, wanted, self.row_counts(), strict=True):
            if not 0 <= want <= have:
                raise ValueError(f"truncate {name}={want}: must be between 0 and the {have} rows written")

        def shrink(handle: h5py.File) -> None:
            for name in self._metric_names:
                handle["metrics"][name].resize(wanted.metric_rows, axis=0)
            for name in ("alphas/normal", "alphas/reduce", "genotype"):
                handle[name].resize(wanted.epoch_rows, axis=0)
            if "privacy" in handle:
                for name in _PRIVACY_GROWING:
                    handle["privacy"][name].resize(wanted.privacy_rows, axis=0)

        self._release_handle()
        self._attach(_open_swmr_writer(self._path, shrink))

    # ------------------------------------------------------------------ ending

    def finish(
        self,
        status: str,
        *,
        reason: str,
        final_genotype: str | None = None,
        cost: Mapping[str, float] | None = None,
    ) -> None:
        """Close the log with a final ``status`` (finished, failed or interrupted) and ``reason``.

        final_genotype: stored in the root attr (None keeps the current value). cost: this attempt's
        ``wall_seconds``, ``gpu_hours``, ``cpu_core_hours`` (added to earlier attempts') and ``ranks``,
        ``gpus`` (replace). Idempotent: after a successful finish further calls do nothing, so the first
        status wins. Rows are never at risk: they were flushed when appended.
        """
        if self._finished:
            return
        if status not in FINAL_STATUSES:
            raise ValueError(f"final status must be one of {FINAL_STATUSES}, got {status!r}")
        if not isinstance(reason, str):
            raise TypeError("reason must be a str")
        if final_genotype is not None and not isinstance(final_genotype, str):
            raise TypeError("final_genotype must be a str or None")
        cost_values = _validated_cost(cost or {})
        self._release_handle()
        handle = _open_read_write(self._path)
        try:
            handle.attrs["status"] = status
            handle.attrs["reason"] = reason
            if final_genotype is not None:
                handle.attrs["final_genotype"] = final_genotype
            cost_attrs = handle["cost"].attrs
            for name, value in cost_values.items():
                if name in COST_ADDITIVE:
                    previous = float(cost_attrs[name])
                    cost_attrs[name] = np.float64((0.0 if math.isnan(previous) else previous) + value)
                else:
                    cost_attrs[name] = np.int64(value)
        finally:
            handle.close()
        self._finished = True

    def close(self) -> None:
        """Flush and release the writer handle without touching status (it stays as it is, normally
        ``running``). Prefer ``finish``; this is for handing the file over, e.g. to a test."""
        self._release_handle()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is None:
            self.finish("finished", reason="completed")
        elif isinstance(exc, KeyboardInterrupt):
            self.finish("interrupted", reason=error_reason(exc))
        else:
            self.finish("failed", reason=error_reason(exc))

    # ------------------------------------------------------------------ internals

    def _require_open(self) -> None:
        if self._file is None:
            raise RuntimeError(f"run log {self._path} is closed")

    def _release_handle(self) -> None:
        handle, self._file = self._file, None
        if handle is None:
            return
        try:
            handle.flush()
        finally:
            handle.close()

    def _privacy_growing(self) -> list[h5py.Dataset]:
        assert self._privacy is not None
        return [self._privacy[name] for name in _PRIVACY_GROWING]

    def _validated_alphas(self, name: str, alphas: np.ndarray) -> np.ndarray:
        array = np.asarray(alphas, dtype=np.float32)
        if array.shape != self._alpha_shape:
            raise ValueError(f"{name} must have shape {self._alpha_shape} (edges, ops), got {array.shape}")
        if not np.all(np.isfinite(array)) or np.any(array < 0):
            raise ValueError(f"{name} must be finite, non-negative softmax weights")
        if not np.allclose(array.sum(axis=1), 1.0, atol=_SOFTMAX_SUM_ATOL):
            raise ValueError(f"{name} rows must sum to 1 (softmax over ops), not raw alphas")
        return array


_PRIVACY_GROWING = ("epsilon", "mu_gdp", "steps")


def read_run(path: str | Path, *, wait_seconds: float = 5.0) -> dict[str, Any]:
    """Read a run log (running, finished or crashed) through a SWMR read open.

    Returns a dict: status, mode, parties, config, version, created, reason, final_genotype, attempts
    (root attrs);
    metrics {name: (rows,) float64}; alphas {"normal", "reduce": (epochs, edges, ops) float32};
    genotypes [str] (one per epoch); cost {field: value}; ranks {attr: value}; privacy None or a dict with
    delta (K,), accountant, epsilon (rows, K), mu_gdp (rows, K), steps (rows,), sample_rate_train (K,),
    sample_rate_val (K,), noise_multiplier_w, noise_multiplier_a, clip_w, clip_a.
    Each growing family is cut to its shortest dataset so a row caught mid-append is not returned half-filled.
    wait_seconds: how long to retry while the writer briefly holds the file outside SWMR mode (finish/reopen).
    """
    handle = _open_swmr_reader(Path(path), wait_seconds)
    try:
        root = handle.attrs
        metrics_group = handle["metrics"]
        metric_names = list(metrics_group)
        metric_sets = [metrics_group[name] for name in metric_names]
        metric_rows = _common_length(metric_sets)
        epoch_sets = [handle["alphas/normal"], handle["alphas/reduce"], handle["genotype"]]
        epoch_rows = _common_length(epoch_sets)
        result: dict[str, Any] = {
            "status": str(root["status"]),
            "mode": str(root["mode"]),
            "parties": int(root["parties"]),
            "config": str(root["config"]),
            "version": str(root["version"]),
            "created": str(root["created"]),
            "reason": str(root["reason"]),
            "final_genotype": str(root["final_genotype"]),
            "attempts": int(root["attempts"]),
            "metrics": {name: ds[:metric_rows] for name, ds in zip(metric_names, metric_sets, strict=True)},
            "alphas": {"normal": epoch_sets[0][:epoch_rows], "reduce": epoch_sets[1][:epoch_rows]},
            "genotypes": [row.decode("utf-8") for row in epoch_sets[2][:epoch_rows]],
            "cost": {name: _plain(handle["cost"].attrs[name]) for name in COST_FIELDS},
            "ranks": {key: _plain(value) for key, value in handle["ranks"].attrs.items()},
            "privacy": None,
        }
        if "privacy" in handle:
            group = handle["privacy"]
            growing = [group[name] for name in _PRIVACY_GROWING]
            privacy_rows = _common_length(growing)
            privacy: dict[str, Any] = {
                "delta": np.asarray(group.attrs["delta"]),
                "accountant": str(group.attrs["accountant"]),
            }
            for name, dataset in zip(_PRIVACY_GROWING, growing, strict=True):
                privacy[name] = dataset[:privacy_rows]
            for name in _PRIVACY_FIXED:
                privacy[name] = _plain(group[name][()])
            result["privacy"] = privacy
        return result
    finally:
        handle.close()


_PRIVACY_FIXED = (
    "sample_rate_train",
    "sample_rate_val",
    "noise_multiplier_w",
    "noise_multiplier_a",
    "clip_w",
    "clip_a",
)


# ---------------------------------------------------------------------- skeleton


def _build_skeleton(
    handle: h5py.File,
    *,
    mode: str,
    parties: int,
    config_text: str,
    metric_names: tuple[str, ...],
    alpha_shape: tuple[int, int],
    genotype_length: int,
    privacy: dict[str, Any] | None,
    rank_values: Mapping[str, Any],
) -> None:
    """Create every object and attribute of the schema (docs/hdf5.md) with empty growing datasets."""
    root = handle.attrs
    root["status"] = "running"
    root["mode"] = mode
    root["parties"] = np.int64(parties)
    root["config"] = config_text
    root["version"] = __version__
    root["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    root["reason"] = ""
    root["final_genotype"] = ""
    root["attempts"] = np.int64(1)

    # track_order keeps the caller's column order when the group is listed (default listing is alphabetical).
    metrics = handle.create_group("metrics", track_order=True)
    for name in metric_names:
        metrics.create_dataset(
            name,
            shape=(0,),
            maxshape=(None,),
            chunks=(_METRIC_CHUNK_ROWS,),
            dtype=np.float64,
            fillvalue=math.nan,  # a row caught half-written reads as NaN, not as a plausible 0
        )

    alphas = handle.create_group("alphas")
    edges, ops = alpha_shape
    for cell in ("normal", "reduce"):
        alphas.create_dataset(
            cell,
            shape=(0, edges, ops),
            maxshape=(None, edges, ops),
            chunks=(1, edges, ops),
            dtype=np.float32,
            fillvalue=math.nan,
        )
    handle.create_dataset(
        "genotype",
        shape=(0,),
        maxshape=(None,),
        chunks=(_EPOCH_CHUNK_ROWS,),
        dtype=f"S{genotype_length}",
    )

    cost = handle.create_group("cost").attrs
    for name in COST_ADDITIVE:
        cost[name] = np.float64(math.nan)  # NaN = no attempt has reported its cost yet
    for name in COST_LAYOUT:
        cost[name] = np.int64(0)

    ranks = handle.create_group("ranks")
    for key, value in rank_values.items():
        ranks.attrs[key] = value

    if privacy is not None:
        group = handle.create_group("privacy")
        group.attrs["delta"] = privacy["delta"]
        group.attrs["accountant"] = privacy["accountant"]
        for name in ("epsilon", "mu_gdp"):
            group.create_dataset(
                name,
                shape=(0, parties),
                maxshape=(None, parties),
                chunks=(_PRIVACY_CHUNK_ROWS, parties),
                dtype=np.float64,
                fillvalue=math.nan,
            )
        group.create_dataset(
            "steps",
            shape=(0,),
            maxshape=(None,),
            chunks=(_PRIVACY_CHUNK_ROWS,),
            dtype=np.int64,
            fillvalue=-1,
        )
        for name in _PRIVACY_FIXED:
            group.create_dataset(name, data=privacy[name])


# ---------------------------------------------------------------------- opening helpers


def _open_read_write(path: Path) -> h5py.File:
    """Open ``path`` in ordinary "r+" mode; bypass the HDF5 file lock only when a reader holds it."""
    try:
        return h5py.File(path, "r+", libver="latest")
    except OSError as exc:
        if not _is_lock_error(exc):
            raise
        # An attached reader (SWMR readers keep a shared lock in HDF5 >= 1.14) must not stop rank 0 from
        # recording the outcome; rank 0 is the only writer, so the lock protects nothing here.
        _logger.debug("run log %s is locked by a reader; reopening without file locking", path)
        return h5py.File(path, "r+", libver="latest", locking=False)


def _open_swmr_writer(path: Path, edit: Callable[[h5py.File], None] | None = None) -> h5py.File:
    """Open ``path`` for writing, apply ``edit(handle)`` (attribute changes, shrinking) while still outside
    SWMR mode, then enter SWMR-write mode."""
    handle = _open_read_write(path)
    try:
        if edit is not None:
            edit(handle)
        handle.swmr_mode = True
    except BaseException:
        handle.close()
        raise
    return handle


def _open_swmr_reader(path: Path, wait_seconds: float) -> h5py.File:
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            return h5py.File(path, "r", libver="latest", swmr=True)
        except OSError as exc:
            # The writer holds the file outside SWMR mode for milliseconds in finish/reopen/truncate.
            busy = _is_lock_error(exc) or "not already open for SWMR" in str(exc)
            if not busy or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def _is_lock_error(exc: OSError) -> bool:
    return exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES) or "unable to lock file" in str(exc)


def _is_left_open_error(exc: OSError) -> bool:
    # HDF5's only signal for "superblock still marked open by a writer" is this message (it suggests h5clear).
    return "already open for write" in str(exc)


def _salvage(path: Path) -> None:
    """Copy a log whose writer died into a fresh file (through a SWMR read open, the only open HDF5 allows on
    it) and atomically replace the original. Flushed rows survive; ragged families are trimmed on reopen."""
    temp = path.with_name(path.name + ".salvage")
    temp.unlink(missing_ok=True)
    with (
        h5py.File(path, "r", libver="latest", swmr=True) as source,
        h5py.File(temp, "x", libver="latest") as copy,
    ):
        for key, value in source.attrs.items():
            copy.attrs[key] = value
        for name in source:
            source.copy(source[name], copy, name=name)
    os.replace(temp, path)


def _trim_ragged(handle: h5py.File) -> None:
    """Cut each growing family to its shortest dataset (a crash may interrupt an append between datasets)."""
    families = [
        [handle["metrics"][name] for name in handle["metrics"]],
        [handle["alphas/normal"], handle["alphas/reduce"], handle["genotype"]],
    ]
    if "privacy" in handle:
        families.append([handle["privacy"][name] for name in _PRIVACY_GROWING])
    for datasets in families:
        rows = _common_length(datasets)
        for dataset in datasets:
            if dataset.shape[0] != rows:
                dataset.resize(rows, axis=0)


def _common_length(datasets: Sequence[h5py.Dataset]) -> int:
    return min((int(dataset.shape[0]) for dataset in datasets), default=0)


# ---------------------------------------------------------------------- validation and conversion


def _validated_metric_names(metric_names: Sequence[str]) -> tuple[str, ...]:
    if isinstance(metric_names, str):
        raise TypeError("metric_names must be a sequence of names, not one string")
    names = tuple(metric_names)
    for name in names:
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise ValueError(f"invalid metric name {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate metric names in {names}")
    missing = [name for name in REQUIRED_METRICS if name not in names]
    if missing:
        raise ValueError(f"metric_names must include {missing}")
    return names


def _validated_alpha_shape(alpha_shape: tuple[int, int]) -> tuple[int, int]:
    shape = tuple(alpha_shape)
    if len(shape) != 2 or not all(isinstance(n, (int, np.integer)) and n >= 1 for n in shape):
        raise ValueError(f"alpha_shape must be (edges, ops) with positive ints, got {alpha_shape!r}")
    return int(shape[0]), int(shape[1])


def _validated_privacy(privacy: PrivacySchema, parties: int) -> dict[str, Any]:
    if not isinstance(privacy.accountant, str) or not privacy.accountant:
        raise ValueError("privacy.accountant must be a non-empty str")
    delta = _per_party_array("delta", privacy.delta, parties)
    if np.any(delta <= 0) or np.any(delta >= 1):
        raise ValueError("privacy.delta must lie in (0, 1)")
    values: dict[str, Any] = {"delta": delta, "accountant": privacy.accountant}
    for name in ("sample_rate_train", "sample_rate_val"):
        rates = _per_party_array(name, getattr(privacy, name), parties)
        if np.any(rates <= 0) or np.any(rates > 1):
            raise ValueError(f"privacy.{name} must lie in (0, 1]")
        values[name] = rates
    for name in ("noise_multiplier_w", "noise_multiplier_a"):
        sigma = np.asarray(getattr(privacy, name), dtype=np.float64)
        if sigma.ndim == 1:
            sigma = _per_party_array(name, sigma, parties)
        elif sigma.ndim != 0:
            raise ValueError(f"privacy.{name} must be a scalar or shape ({parties},)")
        if not np.all(np.isfinite(sigma)) or np.any(sigma < 0):
            raise ValueError(f"privacy.{name} must be finite and >= 0")
        values[name] = sigma
    for name in ("clip_w", "clip_a"):
        clip = np.asarray(getattr(privacy, name), dtype=np.float64)
        if clip.ndim != 0 or not np.isfinite(clip) or clip <= 0:
            raise ValueError(f"privacy.{name} must be a positive finite scalar")
        values[name] = clip
    return values


def _per_party_array(name: str, values: Any, parties: int, *, allow_inf: bool = False) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.shape != (parties,):
        raise ValueError(f"{name} must have shape ({parties},) (one value per party), got {array.shape}")
    if np.any(np.isnan(array)) or (not allow_inf and np.any(np.isinf(array))):
        raise ValueError(f"{name} must not contain NaN" + ("" if allow_inf else " or inf"))
    if np.any(array < 0):
        raise ValueError(f"{name} must be >= 0")
    return array


def _validated_cost(cost: Mapping[str, float]) -> dict[str, float]:
    unknown = sorted(set(cost) - set(COST_FIELDS))
    if unknown:
        raise KeyError(f"unknown cost field(s) {unknown}; known: {list(COST_FIELDS)}")
    values = {}
    for name, value in cost.items():
        number = float(value)
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"cost {name} must be finite and >= 0, got {value!r}")
        if name in COST_LAYOUT and number != int(number):
            raise ValueError(f"cost {name} must be a whole number, got {value!r}")
        values[name] = number
    return values


def _encode_genotype(genotype: str, length: int) -> bytes:
    if not isinstance(genotype, str):
        raise TypeError(f"genotype must be a str, got {type(genotype).__name__}")
    encoded = genotype.encode("utf-8")
    if b"\x00" in encoded:
        # Fixed-length HDF5 strings are NUL-padded; a NUL would not round-trip.
        raise ValueError("genotype must not contain NUL characters")
    if len(encoded) > length:
        raise ValueError(
            f"genotype is {len(encoded)} bytes in UTF-8 but the log stores at most {length}; "
            "create the log with a larger genotype_length"
        )
    return encoded


def _attr_value(key: str, value: Any) -> Any:
    """Convert a per-rank fact to something h5py stores portably (UTF-8 strings, numeric arrays)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"rank attribute names must be non-empty str, got {key!r}")
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float, np.generic)):
        return np.asarray(value)
    if isinstance(value, (Sequence, np.ndarray)):
        items = list(value)
        if items and all(isinstance(item, str) for item in items):
            return np.array(items, dtype=h5py.string_dtype())
        array = np.asarray(items)
        if array.dtype.kind in "biuf":
            return array
    raise TypeError(f"rank attribute {key!r}: store str, numbers or sequences of them, got {value!r}")


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
