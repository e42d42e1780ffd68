"""``RunLog``: rank 0's writer of the HDF5 run log (the only writer; layout in ``schema``, docs/hdf5.md), and
``StageLog``, one writer for each stage's group: ``log.search`` (the root) and ``log.augment`` (``/augment``).

Lifecycle of the file:

1. ``RunLog.create`` builds every group, dataset and attribute of the search that will ever exist (HDF5's SWMR
   mode forbids creating objects or attributes later), records the writer (``/writer``), then switches the handle
   to SWMR-write mode.
2. A stage's ``append_metrics`` / ``append_privacy`` / ``append_selection`` (and the search's ``append_epoch``)
   grow its datasets along axis 0 and flush each dataset right away, so a SWMR reader sees every appended row
   after ``Dataset.refresh()`` and a crash never loses a row that was appended. ``heartbeat`` (and every append)
   overwrites ``/writer/heartbeat`` in place, at most once every ``HEARTBEAT_SECONDS``.
3. A stage's ``finish`` closes the SWMR handle (all rows are already on disk), reopens the file in ordinary "r+"
   mode for a few milliseconds and writes the stage's final attributes and its ``cost`` group there. SWMR readers
   hold a shared file lock for as long as they keep the file open (HDF5 2.0), which would make that "r+" open
   fail while a monitor is attached; in that case (and only then) the file is reopened with ``locking=False``.
   This is safe for the file because rank 0 is the only writer; an attached reader keeps its cached (old)
   attributes and must reopen the file to see the final status.
4. ``RunLog.reopen`` continues a log after a requeue and takes over ``/writer``. If the previous writer died
   without closing (SIGKILL, node loss), HDF5 leaves the superblock marked "open for SWMR write" and refuses
   every write open; the log is then salvaged through a SWMR read open into a fresh file that replaces it
   (all flushed rows survive) -- unless the liveness record shows the previous writer is still alive.
5. The augment stage appends to the same file once the search has ended: ``begin_augment`` (after the search's
   ``finish`` in the same job, or after ``reopen(path, augment=True)`` in a later one) reopens the file outside
   SWMR mode, creates ``/augment`` -- or, on a resume, counts another attempt -- and returns to SWMR mode with
   ``log.augment``, which writes exactly as the search's stage does, into ``/augment``; its ``finish`` leaves the
   search's root attributes and ``/cost`` alone. The heartbeat keeps ``/writer`` fresh meanwhile, so a dead
   writer turns a ``running`` augment into ``failed`` for readers exactly as it does the search.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpi_fnas.config import CELL_NETWORK, MODES
from mpi_fnas.runlog.liveness import WRITER_GROUP, alive_here, current_writer, read_writer_record, store_writer_record
from mpi_fnas.runlog.schema import (
    AUGMENT_GROUP,
    AUGMENT_LAYOUT,
    COST_ADDITIVE,
    COST_FIELDS,
    COST_LATEST,
    COST_PEAK,
    FINAL_STATUSES,
    SEARCH_LAYOUT,
    STAGE_LAYOUTS,
    SelectionSchema,
    StageLayout,
    StagePrivacy,
    build_augment,
    build_skeleton,
    common_length,
    per_party,
    privacy_arrays,
    stage_families,
)

_logger = logging.getLogger(__name__)

# Minimum wall time between two heartbeat writes: a write is a flush (a few syscalls), the reader's staleness
# threshold is minutes, and the server may call heartbeat() many times per second.
HEARTBEAT_SECONDS = 5.0
# Tolerance for "each edge's op weights sum to 1" (float32 softmax over ≤ a few dozen ops).
_SOFTMAX_SUM_ATOL = 1e-3


class StageLog:
    """The rows and the outcome of one stage (``search``: the root group; ``augment``: ``/augment``), written the
    same way for both (module doc); ``row_counts`` / ``truncate`` restore a checkpoint's rows. Obtain it from
    :class:`RunLog` (``log.search``, ``log.augment``, ``log.stage(name)``); it writes through the log's one handle.
    """

    def __init__(self, log: RunLog, layout: StageLayout) -> None:
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
        values = [np.int64(_integral(name, row[name])) if name in self.layout.int_metrics
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
        values = {"steps": np.int64(_integral("steps", steps)),
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
        self._append("selection", [np.int64(_integral("steps", steps)), per_party("chosen", chosen, parties, bool),
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
        handle = _open_read_write(self._log.path)
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


class RunLog:
    """Rank 0's writer of the HDF5 run log: the file, its SWMR handle and its liveness record, and one
    :class:`StageLog` per stage (``search``, and ``augment`` once ``begin_augment`` has run). Not thread-safe; one
    instance per file."""

    def __init__(self, path: Path, handle: h5py.File) -> None:
        """Internal: use ``create`` or ``reopen``. ``handle`` is an open SWMR-write handle of ``path``."""
        self._path = path
        self._file: h5py.File | None = None
        self.search = StageLog(self, SEARCH_LAYOUT)
        self.augment: StageLog | None = None  # /augment's, once it exists (writable after begin_augment)
        self._attach(handle)

    def _attach(self, handle: h5py.File) -> None:
        """Take the open SWMR-write ``handle`` and read the layout and row counts back from the file."""
        self._file = handle
        self.parties = int(handle.attrs["parties"])
        self._heartbeat = handle[WRITER_GROUP]["heartbeat"]
        self._last_beat = time.monotonic()  # create/reopen has just written the heartbeat
        if self.augment is None and AUGMENT_GROUP in handle:  # an earlier attempt's: its rows, until begin_augment
            self.augment = StageLog(self, AUGMENT_LAYOUT)
            self.augment._state = "ended"
        for stage in (self.search, self.augment):
            if stage is not None:
                stage._attach(handle)

    def _reattach(self, edit: Callable[[h5py.File], None], augment: StageLog | None = None) -> None:
        """Apply ``edit`` to the file outside SWMR mode, then continue in SWMR-write mode (with ``augment`` as the
        augment stage, when given). A refused ``edit`` leaves the log as it was: open in SWMR mode, or closed."""
        was_open = self._file is not None
        self._release_handle()
        try:
            handle = _open_swmr_writer(self._path, edit)
        except BaseException:
            if was_open:
                self._attach(_open_swmr_writer(self._path, lambda handle: None))
            raise
        self.augment = augment or self.augment
        self._attach(handle)

    def stage(self, name: str) -> StageLog:
        """The stage named ``name`` (``search`` or ``augment``); KeyError when this writer has not begun it."""
        stage = {"search": self.search, "augment": self.augment}.get(name)
        if stage is None:
            raise KeyError(f"this run log has no {name!r} stage open (begin_augment() first)")
        return stage

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
        privacy_guarantee: str,
        privacy: StagePrivacy | None = None,
        rank_attrs: Mapping[str, Any] | None = None,
        unreliable: Sequence[bool] | np.ndarray | None = None,
        corruption: float = 0.0,
        selection: SelectionSchema | None = None,
        space: str = "darts",
        reduce_alpha_shape: tuple[int, int] | None = None,
        alpha_ops: Sequence[str] = (),
    ) -> RunLog:
        """Create a new log at ``path`` (must not exist) and enter SWMR-write mode; its search stage is running.

        metric_names: names of the ``/metrics`` datasets (normally ``SEARCH_METRICS``), in column order.
        alpha_shape: (edges, ops) of one cell's softmax weights; reduce_alpha_shape: the reduction cell's when it
        differs (``(0, ops)`` under ``space`` dpnas, which has one cell). alpha_ops: the op of each alpha column
        (``/alphas`` attr ``ops``; the space's candidates, ``space.ops``). space: the search space's kind (root
        attr). genotype_length: bytes per ``/genotype`` row (UTF-8). privacy_guarantee: ``"holds"``, or one line
        saying why there is no DP guarantee. privacy: required for mode ``dpfnas`` and refused otherwise, so a DP
        run always has a ledger. rank_attrs: per-rank facts for ``/ranks`` attrs (str, numbers, or sequences of
        either indexed by rank). unreliable: (K,) bool, the parties simulated as unreliable (None: none),
        corruption: their fraction P of noise. selection: the server's selection (``random``/``secprobe``, dpfnas
        only), or None for ``all``.
        """
        path = Path(path)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if (privacy is not None) != (mode == "dpfnas"):
            raise ValueError("a privacy schema is required for mode 'dpfnas' and only for it")
        handle = h5py.File(path, "x", libver="latest")  # "x": never clobber an earlier run's log
        try:
            build_skeleton(
                handle, mode=mode, parties=parties, config_text=config_text, privacy_guarantee=privacy_guarantee,
                metric_names=metric_names, alpha_shape=alpha_shape, reduce_alpha_shape=reduce_alpha_shape, space=space,
                alpha_ops=tuple(alpha_ops),
                genotype_length=genotype_length,
                privacy=None if privacy is None else privacy_arrays(SEARCH_LAYOUT, privacy, parties),
                rank_values={key: _attr_value(value) for key, value in (rank_attrs or {}).items()},
                unreliable=np.zeros(parties, dtype=bool) if unreliable is None
                else per_party("unreliable", unreliable, parties, bool),
                corruption=float(corruption), selection=selection,
            )
            store_writer_record(handle, current_writer())
            handle.swmr_mode = True
        except BaseException:
            handle.close()
            path.unlink(missing_ok=True)
            raise
        return cls(path, handle)

    @classmethod
    def reopen(cls, path: str | Path, *, rank_attrs: Mapping[str, Any] | None = None, augment: bool = False) -> RunLog:
        """Continue an existing log (resume after a requeue): rows are kept, the search's status goes back to
        ``running``, ``attempts`` is incremented, ``reason`` cleared and ``/writer`` taken over by this process.

        Families left ragged by a crash mid-append are trimmed to their shortest dataset. rank_attrs, when given,
        replaces the ``/ranks`` attrs (placement may differ after a requeue). A log left open by a dead writer is
        salvaged (module doc); one whose writer is provably still alive raises RuntimeError.

        augment=True opens the log of an ended search for its augment stage (``--augment RUN_DIR``, or resuming a
        crashed augment): only ``/writer`` is taken over and ragged rows trimmed, so rank_attrs is refused
        (ValueError), and the search stage is ended; call ``begin_augment`` next. A search still marked
        ``running`` raises RuntimeError (resume it instead).
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no run log at {path}")
        if augment and rank_attrs is not None:
            raise ValueError("reopen(augment=True) keeps the search's /ranks; rank_attrs must be None")

        def restart(handle: h5py.File) -> None:
            status = str(handle.attrs["status"])
            if augment and status not in FINAL_STATUSES:
                raise RuntimeError(f"the search in {path} has not ended (status {status!r}); "
                                   "resume it before augmenting")
            if not augment:
                _begin_attempt(handle)
            _trim_ragged(handle)
            if rank_attrs is not None:  # never with augment
                ranks = handle["ranks"].attrs
                ranks.clear()
                ranks.update({key: _attr_value(value) for key, value in rank_attrs.items()})
            store_writer_record(handle, current_writer())

        try:
            handle = _open_swmr_writer(path, restart)
        except OSError as exc:
            # HDF5's only signal for "superblock still marked open by a writer" is this message.
            if "already open for write" not in str(exc):
                raise
            with h5py.File(path, "r", swmr=True) as previous:
                writer = read_writer_record(previous)
            if alive_here(writer):
                message = f"run log {path} is still being written by process {writer.pid} on {writer.host}"
                raise RuntimeError(message) from exc
            _logger.warning("run log %s was left open by a writer that died; salvaging it", path)
            _salvage(path)
            handle = _open_swmr_writer(path, restart)
        runlog = cls(path, handle)
        if augment:  # the search's outcome is already in the file; its finish() must not touch it
            runlog.search._state = "ended"
        return runlog

    @property
    def path(self) -> Path:
        """Path of the HDF5 file."""
        return self._path

    # ------------------------------------------------------------------ liveness

    def heartbeat(self) -> None:
        """Record that the writer is alive (``/writer/heartbeat`` = now, Unix seconds). Cheap enough to call
        every step: writes at most once every ``HEARTBEAT_SECONDS``. Appends heartbeat too. Raises RuntimeError
        while the log is closed (after a stage's ``finish`` until ``begin_augment``, or after ``close``)."""
        self._require_open()
        now = time.monotonic()
        if now - self._last_beat < HEARTBEAT_SECONDS:
            return
        self._heartbeat[()] = time.time()
        self._heartbeat.flush()
        self._last_beat = now

    # ------------------------------------------------------------------ augment stage

    def begin_augment(self, *, genotype: str, params: int, private: bool, privacy: StagePrivacy | None, parties: int,
                      privacy_guarantee: str, selection: SelectionSchema | None = None,
                      network: str = CELL_NETWORK) -> StageLog:
        """Start (or resume) the augment stage: training ``network`` (``genotype``'s cell, or a hand-designed one)
        from scratch across the search's parties; returns its :class:`StageLog` (also ``self.augment``).

        Creates ``/augment`` (with ``privacy`` and ``selection`` when given) with status ``running`` and attempts 1;
        on a resume (after a crash or requeue) increments its ``attempts``, sets status ``running``, clears
        ``reason`` and keeps every row (``truncate`` drops those written after the checkpoint). Refreshes
        ``/writer/heartbeat``. Runs outside SWMR mode: a SWMR reader attached before keeps reading the search's
        datasets but must reopen the file to see ``/augment`` (docs/hdf5.md).

        network: ``augment.network``, ``cell`` or the hand-designed network's name. genotype: the derived
        genotype's text ("" for a hand-designed network). params: exact parameter count of the augment network. private:
        whether the stage's releases are DP; privacy is required exactly when it is. parties: K, must equal the
        search's. privacy_guarantee: what the final weights may claim, ``"holds"`` or one line saying why not (e.g.
        exact gradients under dpfnas: ε covers the search only); rewritten on resume. selection: the server's
        selection in this stage (needs privacy), or None. The search must have ended first (its ``finish``, or
        ``reopen(augment=True)``), else RuntimeError. A resume must repeat the stored network, genotype, params and
        private (ValueError otherwise).
        """
        if self.search._state != "ended":
            raise RuntimeError("the search is still running: finish() it before begin_augment")
        if self.augment is not None and self.augment._state == "running":
            raise RuntimeError("the augment stage is already running; finish() it first")
        if bool(private) != (privacy is not None):
            raise ValueError("an augment privacy schema is required when private=True and only then")
        if int(parties) != self.parties:
            raise ValueError(f"the augment runs across the search's {self.parties} parties, got parties={parties}")
        count = _integral("params", params)
        if count < 0:
            raise ValueError(f"params must be a parameter count >= 0, got {params}")
        if not network or (network == CELL_NETWORK) == (genotype == ""):
            raise ValueError(f"network {network!r} with genotype {genotype!r}: a cell has a genotype, a hand-designed "
                             "network none")
        arrays = None if privacy is None else privacy_arrays(AUGMENT_LAYOUT, privacy, self.parties)

        def start(handle: h5py.File) -> None:
            group = handle.get(AUGMENT_GROUP)
            if group is None:
                build_augment(
                    handle, genotype=genotype, params=count, private=bool(private), parties=self.parties,
                    privacy=arrays, privacy_guarantee=privacy_guarantee, selection=selection, network=network,
                )  # fmt: skip
            else:
                stored = (str(group.attrs.get("network", CELL_NETWORK)), str(group.attrs["genotype"]),
                          int(group.attrs["params"]), bool(group.attrs["private"]))
                if stored != (network, genotype, count, bool(private)):
                    raise ValueError(
                        f"{self._path} holds an augment of (network, genotype, params, private) = {stored}; "
                        "a resumed augment must train the same network"
                    )
                _begin_attempt(group, privacy_guarantee=privacy_guarantee)
                _trim_ragged(handle)
            handle[WRITER_GROUP]["heartbeat"][()] = time.time()

        self._reattach(start, StageLog(self, AUGMENT_LAYOUT))  # a fresh writer: an earlier attempt's stays ended
        return self.augment

    # ------------------------------------------------------------------ ending

    def close(self) -> None:
        """Close the file without recording any outcome (a stage's ``finish`` already closes it). Idempotent. A
        stage still marked ``running`` reads as ``failed`` once this process has exited."""
        self._release_handle()

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


def _begin_attempt(group: h5py.Group, **attrs: Any) -> None:
    """Mark a stage's group ``running`` again for one more attempt: ``reason`` cleared, ``attrs`` set, ``attempts``
    incremented."""
    group.attrs.update({"status": "running", "reason": "", **attrs})
    group.attrs["attempts"] = np.int64(int(group.attrs["attempts"]) + 1)
    if "privacy" in group:  # an earlier attempt's ε alone no longer covers what this one will charge
        group["privacy"].attrs.pop("epsilon_alone", None)


# ---------------------------------------------------------------------- opening helpers


def _open_read_write(path: Path) -> h5py.File:
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


def _open_swmr_writer(path: Path, edit: Callable[[h5py.File], None]) -> h5py.File:
    """Open ``path`` for writing, apply ``edit(handle)`` (attribute changes, shrinking, new objects) while
    still outside SWMR mode, then enter SWMR-write mode."""
    handle = _open_read_write(path)
    try:
        edit(handle)
        handle.swmr_mode = True
    except BaseException:
        handle.close()
        raise
    return handle


def _salvage(path: Path) -> None:
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


def _trim_ragged(handle: h5py.File) -> None:
    """Cut each growing family (the search's and ``/augment``'s) to its shortest dataset (a crash may interrupt
    an append between datasets)."""
    for datasets in (d for layout in STAGE_LAYOUTS.values() for d in stage_families(handle, layout).values()):
        rows = common_length(datasets)
        for dataset in datasets:
            if dataset.shape[0] != rows:
                dataset.resize(rows, axis=0)


# ---------------------------------------------------------------------- conversion


def _integral(name: str, value: Any) -> int:
    """``value`` as an int; a float with a fractional part (or NaN) raises ValueError instead of being cut."""
    if isinstance(value, (int, np.integer)):
        return int(value)
    number = float(value)
    if not number.is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(number)


def _attr_value(value: Any) -> Any:
    """A per-rank fact as something h5py stores portably: a list of str becomes a UTF-8 string array."""
    if isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, str):
        items = list(value)
        if items and all(isinstance(item, str) for item in items):
            return np.array(items, dtype=h5py.string_dtype())
        return np.asarray(items)
    return value
