"""``RunLog``: rank 0's writer of the HDF5 run log (the only writer; layout in ``schema``), with one
:class:`~mpi_fnas.runlog.stage_log.StageLog` per stage's group: ``log.search`` (root), ``log.augment`` (``/augment``).

Lifecycle of the file (in full: docs/hdf5.md, "How the writer keeps the file readable and safe"):

1. ``RunLog.create`` builds every object and attribute of the search that will ever exist (SWMR mode cannot create
   any later), records the writer (``/writer``) and switches to SWMR-write mode.
2. A stage's appends grow its datasets by one row and flush each at once, so a SWMR reader sees every row after
   ``Dataset.refresh()`` and a crash loses none; ``heartbeat`` overwrites ``/writer/heartbeat``, throttled.
3. A stage's ``finish`` closes the SWMR handle and writes its final attributes and ``cost`` in "r+" mode
   (``locking=False`` only while a reader holds the lock: rank 0 is the only writer).
4. ``RunLog.reopen`` continues a log after a requeue and takes over ``/writer``; a dead writer's log is salvaged
   into a fresh file, unless ``/writer`` shows that writer still alive.
5. ``begin_augment`` creates ``/augment`` (or counts another attempt) outside SWMR mode, then returns to it;
   ``log.augment`` writes as the search's stage does and never touches the root attributes or ``/cost``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpi_fnas.config import CELL_NETWORK, MODES
from mpi_fnas.runlog.h5file import open_swmr_writer, salvage, trim_ragged
from mpi_fnas.runlog.liveness import WRITER_GROUP, alive_here, current_writer, read_writer_record, store_writer_record
from mpi_fnas.runlog.schema import (
    AUGMENT_GROUP,
    AUGMENT_LAYOUT,
    FINAL_STATUSES,
    SEARCH_LAYOUT,
    SelectionSchema,
    StagePrivacy,
    build_augment,
    build_skeleton,
    per_party,
    privacy_arrays,
)
from mpi_fnas.runlog.stage_log import StageLog, integral

_logger = logging.getLogger(__name__)

# Minimum wall time between two heartbeat writes: a write is a flush (a few syscalls), the reader's staleness
# threshold is minutes, and the server may call heartbeat() many times per second.
HEARTBEAT_SECONDS = 5.0


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
            handle = open_swmr_writer(self._path, edit)
        except BaseException:
            if was_open:
                self._attach(open_swmr_writer(self._path, lambda handle: None))
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
            trim_ragged(handle)
            if rank_attrs is not None:  # never with augment
                ranks = handle["ranks"].attrs
                ranks.clear()
                ranks.update({key: _attr_value(value) for key, value in rank_attrs.items()})
            store_writer_record(handle, current_writer())

        try:
            handle = open_swmr_writer(path, restart)
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
            salvage(path)
            handle = open_swmr_writer(path, restart)
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

        Creates ``/augment`` (with ``privacy`` and ``selection`` when given), status ``running``, attempts 1; a resume
        adds an attempt, sets ``running``, clears ``reason`` and keeps every row (``truncate`` drops those after the
        checkpoint). Runs outside SWMR mode: an attached reader must reopen the file to see ``/augment`` (docs/hdf5.md).

        network: ``augment.network``, ``cell`` or the hand-designed network's name. genotype: the derived genotype's
        text ("" for a hand-designed network). params: exact parameter count. private: whether the releases are DP;
        privacy is required exactly when it is. parties: K, the search's. privacy_guarantee: ``"holds"`` or one line
        saying why not (e.g. exact gradients under dpfnas); rewritten on resume. selection: the server's selection
        in this stage (needs privacy), or None. The search must have ended first (its ``finish``, or
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
        count = integral("params", params)
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
                trim_ragged(handle)
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


def _begin_attempt(group: h5py.Group, **attrs: Any) -> None:
    """Mark a stage's group ``running`` again for one more attempt: ``reason`` cleared, ``attrs`` set, ``attempts``
    incremented."""
    group.attrs.update({"status": "running", "reason": "", **attrs})
    group.attrs["attempts"] = np.int64(int(group.attrs["attempts"]) + 1)
    if "privacy" in group:  # an earlier attempt's ε alone no longer covers what this one will charge
        group["privacy"].attrs.pop("epsilon_alone", None)


def _attr_value(value: Any) -> Any:
    """A per-rank fact as something h5py stores portably: a list of str becomes a UTF-8 string array."""
    if isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, str):
        items = list(value)
        if items and all(isinstance(item, str) for item in items):
            return np.array(items, dtype=h5py.string_dtype())
        return np.asarray(items)
    return value
