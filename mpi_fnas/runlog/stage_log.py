"""``StageLog``: one writer for each stage's group of the run log, ``log.search`` (the root) and ``log.augment``
(``/augment``), written the same way for both (the lifecycle: :mod:`mpi_fnas.runlog.writer`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import h5py
import numpy as np

from mpi_fnas.runlog.h5file import open_read_write
from mpi_fnas.runlog.schema import (
    COST_ADDITIVE,
    COST_FIELDS,
    COST_LATEST,
    COST_PEAK,
    FINAL_STATUSES,
    StageLayout,
    common_length,
    per_party,
    stage_families,
)

# Tolerance for "each edge's op weights sum to 1" (float32 softmax over ≤ a few dozen ops).
_SOFTMAX_SUM_ATOL = 1e-3


class LogFile(Protocol):
    """What a :class:`StageLog` needs of the run log it belongs to (:class:`~mpi_fnas.runlog.writer.RunLog`)."""

    parties: int
    path: Path

    def heartbeat(self) -> None:
        """Refresh the writer's liveness record (at most every few seconds)."""

    def _require_open(self) -> None: ...

    def _release_handle(self) -> None: ...

    def _reattach(self, edit: Callable[[h5py.File], None], augment: StageLog | None = None) -> None: ...


class StageLog:
    """The rows and the outcome of one stage (``search``: the root group; ``augment``: ``/augment``), written the
    same way for both (module doc); ``row_counts`` / ``truncate`` restore a checkpoint's rows. Obtain it from
    :class:`~mpi_fnas.runlog.writer.RunLog` (``log.search``, ``log.augment``, ``log.stage(name)``); it writes
    through the log's one handle.
    """

    def __init__(self, log: LogFile, layout: StageLayout) -> None:
        self._log = log
        self.layout = layout
        self._state = "running"  # "running": rows may be appended; "ended": finish() ran (or the stage had ended)
        self._families: dict[str, list[h5py.Dataset]] = {}
        self._rows: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return self.layout.name

    def _attach(self, handle: h5py.File) -> None:
        self._families = stage_families(handle, self.layout)
        self._rows = tuple(common_length(self._families[name]) for name in self.layout.families)

    # ------------------------------------------------------------------ appending

    def append_metrics(self, row: Mapping[str, float]) -> None:
        """Append one row to every metric dataset. ``layout.int_metrics`` (the augmentation's ``step`` and
        ``epoch``) are required integers (KeyError if missing, ValueError if not integral); other missing names
        are stored as NaN. Unknown names raise KeyError before anything is written."""
        self._require_running()
        names = [dataset.name.rsplit("/", 1)[1] for dataset in self._families["metrics"]]
        unknown = sorted(set(row) - set(names))
        missing = [name for name in self.layout.int_metrics if name not in row]
        if unknown or missing:
            raise KeyError(f"unknown metric name(s) {unknown}, missing required {missing}; the {self.name} log has "
                           f"{names}")
        values = [np.int64(integral(name, row[name])) if name in self.layout.int_metrics
                  else float(row.get(name, math.nan)) for name in names]
        self._append("metrics", values)

    def append_epoch(self, alphas_normal: np.ndarray, alphas_reduce: np.ndarray, genotype: str) -> None:
        """The search's epoch-end row: softmax weights (edges, ops) of the normal and reduction cell (CPU arrays)
        and the derived genotype string.

        Raises ValueError for a wrong shape, weights that are not per-edge softmax distributions, or a genotype
        longer than the log's genotype length in UTF-8 (h5py would silently truncate it); RuntimeError for a stage
        without epoch rows.
        """
        self._require_running()
        if not self.layout.epochs:
            raise RuntimeError(f"the {self.name} stage has no epoch-end rows")
        normal_set, reduce_set, genotypes = self._families["epochs"]
        normal = _softmax_weights("alphas_normal", alphas_normal, normal_set.shape[1:])
        reduce = _softmax_weights("alphas_reduce", alphas_reduce, reduce_set.shape[1:])
        encoded = genotype.encode("utf-8")
        if len(encoded) > genotypes.dtype.itemsize:
            raise ValueError(f"genotype is {len(encoded)} bytes in UTF-8 but the log stores at most "
                             f"{genotypes.dtype.itemsize}; create the log with a larger genotype_length")
        self._append("epochs", [normal, reduce, encoded])

    def append_privacy(self, steps: int, charged_steps: np.ndarray, epsilon: np.ndarray, mu_gdp: np.ndarray,
                       epsilon_collusion: np.ndarray | None = None) -> None:
        """Append one ledger row (``PRIVACY_GROWING``). steps: the stage's iterations so far. charged_steps (K,): the
        stage's iterations each party's ledgers have charged (its own plus those replayed after a crash; under
        ADADP each pays two weight releases). epsilon (K,): ε per party against the server after everything the
        job released so far (may be inf). mu_gdp (K,): μ of μ-GDP per party (an approximation, not the guarantee).
        epsilon_collusion (K,): ε per party if K − 1 parties collude with the server (secure aggregation; None:
        local noise, where colluders change nothing and it is `epsilon`)."""
        self._require_running("privacy", "privacy ledger")
        parties = self._log.parties
        values = {"steps": np.int64(integral("steps", steps)),
                  "charged_steps": per_party("charged_steps", charged_steps, parties, np.int64),
                  "epsilon": per_party("epsilon", epsilon, parties, np.float64),
                  "mu_gdp": per_party("mu_gdp", mu_gdp, parties, np.float64),
                  "epsilon_collusion": per_party("epsilon_collusion",
                                                 epsilon if epsilon_collusion is None else epsilon_collusion,
                                                 parties, np.float64)}
        self._append("privacy", [values[d.name.rsplit("/", 1)[1]] for d in self._families["privacy"]])

    def append_selection(self, steps: int, chosen: np.ndarray, score: np.ndarray, epsilon: float) -> None:
        """Append one selection row: steps (the stage's iterations so far), chosen (K,) bool (whose releases were
        averaged), score (K,) the windowed aux-set scores the draw used (NaN unless secprobe), and epsilon, the
        selection's ε on the aux set after this step over every stage's draws (``privacy/selection_epsilon``)."""
        self._require_running("selection", "selection")
        parties = self._log.parties
        self._append("selection", [np.int64(integral("steps", steps)), per_party("chosen", chosen, parties, bool),
                                   per_party("score", score, parties, np.float64), np.float64(epsilon)])

    def _append(self, family: str, values: Sequence[Any]) -> None:
        """Write the next row of each dataset of ``family``, flushing each at once (values are converted beforehand,
        so a bad value cannot leave a half-written row)."""
        index = self.layout.families.index(family)
        row = self._rows[index]
        for dataset, value in zip(self._families[family], values, strict=True):
            dataset.resize(row + 1, axis=0)
            dataset[row] = value
            dataset.flush()
        self._rows = (*self._rows[:index], row + 1, *self._rows[index + 1:])
        self._log.heartbeat()

    # ------------------------------------------------------------------ counts and resume

    def row_counts(self) -> tuple[int, ...]:
        """Rows of each family, in ``layout.families`` order; store it in a checkpoint."""
        return self._rows

    def truncate(self, *counts: int) -> None:
        """Drop rows written after a checkpoint (a crash between checkpoint and log): shrink each family to the
        given count (``layout.families`` order; a missing trailing count is 0, as in checkpoints older than the
        family). Counts above what exists raise ValueError (growing would invent fill-value rows). The shrink
        happens outside SWMR mode (HDF5 only guarantees SWMR readers growing datasets), then the handle returns to
        SWMR mode."""
        self._log._require_open()
        families = self.layout.families
        if len(counts) > len(families):
            raise ValueError(f"truncate takes at most {len(families)} counts ({', '.join(families)})")
        wanted = tuple(int(c) for c in counts) + (0,) * (len(families) - len(counts))
        for name, want, have in zip(families, wanted, self._rows, strict=True):
            if not 0 <= want <= have:
                raise ValueError(f"truncate {name}={want}: must be between 0 and the {have} rows written")

        def shrink(handle: h5py.File) -> None:
            for name, rows in zip(families, wanted, strict=True):
                for dataset in stage_families(handle, self.layout)[name]:
                    dataset.resize(rows, axis=0)

        self._log._reattach(shrink)

    # ------------------------------------------------------------------ ending

    def finish(self, status: str, *, reason: str, cost: Mapping[str, float] | None = None,
               final_genotype: str | None = None, test_acc: float | None = None,
               epsilon_alone: np.ndarray | None = None) -> None:
        """Close the log with this stage's final ``status`` (finished, failed or interrupted) and ``reason``.

        cost: this attempt's ``COST_FIELDS`` for the stage's ``cost`` group (``wall_seconds``, ``gpu_hours``,
        ``cpu_core_hours`` added to earlier attempts'; ``ranks``, ``gpus`` replaced). final_genotype (search): the
        root attr (None keeps it). test_acc (augment): the final test accuracy, a fraction in [0, 1] or NaN;
        ``test_error`` = 1 − test_acc. epsilon_alone (augment, DP): (K,) the stage's ε alone, the ``epsilon_alone``
        attr of its privacy group (None writes none). Idempotent: once the stage has ended further calls do nothing,
        so the first status wins. Rows are never at risk: they were flushed when appended. The other stage is untouched.
        """
        if self._state == "ended":
            return
        if status not in FINAL_STATUSES:
            raise ValueError(f"final status must be one of {FINAL_STATUSES}, got {status!r}")
        cost = cost or {}
        unknown = sorted(set(cost) - set(COST_FIELDS))
        if unknown:  # refused before anything is written
            raise KeyError(f"unknown cost field(s) {unknown}; known: {list(COST_FIELDS)}")
        accuracy = None if test_acc is None else float(test_acc)
        if accuracy is not None and not (math.isnan(accuracy) or 0.0 <= accuracy <= 1.0):
            raise ValueError(f"test_acc is a fraction in [0, 1] (or NaN), got {test_acc}")
        self._log._release_handle()
        handle = open_read_write(self._log.path)
        try:
            group = handle[self.layout.group or "/"]
            group.attrs.update(status=status, reason=reason)
            if final_genotype is not None:
                group.attrs["final_genotype"] = final_genotype
            if accuracy is not None:
                group.attrs["test_acc"] = np.float64(accuracy)
                group.attrs["test_error"] = np.float64(1.0 - accuracy)  # NaN stays NaN
            if epsilon_alone is not None and "privacy" in group:
                group["privacy"].attrs["epsilon_alone"] = np.asarray(epsilon_alone, dtype=np.float64)
            _add_cost(group["cost"], cost)
        finally:
            handle.close()
        self._state = "ended"

    def _require_running(self, family: str = "", what: str = "") -> None:
        """Refuse appends to an ended stage, and (given a `family`) to a stage without that family (no `what`)."""
        self._log._require_open()
        if self._state != "running":
            raise RuntimeError(f"the {self.name} stage of this run log has ended; rows can no longer be appended")
        if family and not self._families[family]:
            raise RuntimeError(f"the {self.name} stage of this run log has no {what}")


def _softmax_weights(name: str, alphas: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Refuse raw alphas: the file promises per-edge distributions (docs/hdf5.md)."""
    array = np.asarray(alphas, dtype=np.float32)
    if array.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (edges, ops), got {array.shape}")
    if np.any(array < 0) or not np.allclose(array.sum(axis=1), 1.0, atol=_SOFTMAX_SUM_ATOL):
        raise ValueError(f"{name} rows must be non-negative and sum to 1 (softmax over ops), not raw alphas")
    return array


def _add_cost(group: h5py.Group, cost: Mapping[str, float]) -> None:
    """Record one attempt's cost in a cost group (``/cost`` or ``/augment/cost``): the ``COST_ADDITIVE`` fields
    are added to earlier attempts' (NaN = none reported yet), the ``COST_PEAK`` ones keep the largest, the layout and
    ``COST_LATEST`` fields are replaced by this attempt's.

    An additive field this attempt reports as NaN leaves the total as it is. One a log written before the field
    existed does not hold stays absent (read as NaN): its earlier attempts are unknown, so no total would be true."""
    for name, value in cost.items():
        previous = float(group.attrs.get(name, math.nan))
        if name in COST_ADDITIVE:
            if name not in group.attrs or math.isnan(float(value)):
                continue
            group.attrs[name] = np.float64((0.0 if math.isnan(previous) else previous) + float(value))
        elif name in COST_PEAK:
            group.attrs[name] = np.float64(float(value) if math.isnan(previous) else max(previous, float(value)))
        elif name in COST_LATEST:
            group.attrs[name] = np.float64(value)
        else:
            group.attrs[name] = np.int64(value)


def integral(name: str, value: Any) -> int:
    """``value`` as an int; a float with a fractional part (or NaN) raises ValueError instead of being cut."""
    if isinstance(value, (int, np.integer)):
        return int(value)
    number = float(value)
    if not number.is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(number)
