"""Rank 0's one iteration loop, for any stage (the search, the augmentation): the stage (:class:`LoopStage`, which
:class:`~mpi_fnas.stages.base.ServedStage` implements) says what an iteration, an evaluation, a log row and a
checkpoint are; the loop decides when each happens. No autograd here.

Per step: the control word (continue, checkpoint, or stop on a signal), the stage's iteration, the charge of its
releases on the privacy ledger, the step the parties may be in next (charged if the run fails:
:func:`~mpi_fnas.stages.iteration.charge_in_flight`), the evaluation at epoch ends, a log row every
``runtime.log_every`` steps and at epoch ends, the ε rows the ledger's worker has finished, and the checkpoint
(every party acknowledges its own saved state first).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from mpi_fnas.checkpoint import save_checkpoint
from mpi_fnas.config import Config
from mpi_fnas.federation.comm import Channel
from mpi_fnas.runlog import RunLog, StageLog
from mpi_fnas.stages.iteration import (
    ADAPT_AFTER_STEPS,
    CONTINUE,
    STOP,
    Progress,
    StepControl,
    adaptive_timeout,
    charge_in_flight,
    settle_privacy,
)

if TYPE_CHECKING:  # the ledger (dp_accounting, scipy) is loaded only by a DP stage
    from mpi_fnas.privacy.federation_ledger import EpsilonRow, FederationLedger



class LoopStage(Protocol):
    """What :class:`ServerLoop` needs of a stage. The loop owns this interface and the stages implement it
    (:class:`~mpi_fnas.stages.base.ServedStage`); neither imports the other (:func:`~mpi_fnas.stages.rank0_driver.serve`
    hands the stage to the loop)."""

    name: str  # "search" or "augment": the control word's stage, the log's stage, the checkpoint's
    steps: int  # the last step the stage runs
    steps_per_epoch: int
    epsilon_each_row: bool  # an ε row with every logged row (else at epoch ends only)
    row_at_control: bool  # a log row at checkpoint and stop steps as well
    charging: FederationLedger | None  # the ledger this stage's releases are charged on (None: not DP)

    def iterate(self, step: int, epoch: int, control: int) -> None:
        """One iteration of Algorithm 1 on rank 0, ending with the broadcast that carries `control`."""

    def charge(self) -> None:
        """Charge one iteration's releases of every party on ``charging``."""

    def evaluate(self) -> np.ndarray:
        """At an epoch end: [loss_sum, correct, count] on the server's test split."""

    def row(self, step: int, epoch: int, test: np.ndarray | None) -> dict[str, float]:
        """The metrics row of `step`."""

    def log_privacy(self, row: EpsilonRow) -> None:
        """Write one ε row of the ledger to the stage's log."""

    def checkpoint(self, step: int) -> dict:
        """Rank 0's whole state at `step`, as ``checkpoint.pt`` holds it."""


class ServerLoop:
    """The iterations of one stage on rank 0, with their logging, privacy rows and checkpoints."""

    def __init__(self, stage: LoopStage, cfg: Config, channel: Channel, log: RunLog | None,
                 progress: Progress | None, run_dir: Path | None, stop_requested: Callable[[], str | None]) -> None:
        self.stage, self.cfg, self.channel, self.progress, self.run_dir = stage, cfg, channel, progress, run_dir
        self.log: StageLog | None = log.stage(stage.name) if log is not None else None
        self.heartbeat = log.heartbeat if log is not None else (lambda: None)
        self.control = StepControl(stage.name, stage.steps, cfg.checkpoint.every_steps, stop_requested)
        self.epsilon_so_far = math.nan
        self.recorded_step = 0  # the last iteration the ledger has recorded (a failure's last ε row is labelled so)
        self.in_flight_step: int | None = None  # the iteration whose releases the parties may be sending now
        self.in_flight_after_broadcast: int | None = None  # the next one, while this step's broadcast may be out
        self.test = np.full(3, np.nan)  # the last epoch end's [loss_sum, correct, count]
        self.slowest_step = 0.0  # seconds: the slowest iteration of this stage so far (the adaptive comm timeout)
        channel.timeout = cfg.runtime.comm_timeout  # a stage starts under the full limit

    def run(self, first: int) -> tuple[int, str | None]:
        """Steps `first`.. of the stage: (the last step run, the signal that stopped it or None)."""
        stage = self.stage
        step, self.recorded_step = first - 1, first - 1
        self.in_flight_step = first if first <= stage.steps else None  # the parties start once W is broadcast
        stopped = None
        for step in range(first, stage.steps + 1):
            epoch = (step - 1) // stage.steps_per_epoch
            control, signal_name = self.control.at(step)
            # Until iterate returns, rank 0 cannot tell whether this step's broadcast (its last collective) has
            # reached a party that then sent step + 1 (none after the last step or a STOP): a failure then charges both.
            self.in_flight_step = step
            self.in_flight_after_broadcast = step + 1 if step < stage.steps and control != STOP else None
            started = time.perf_counter()
            stage.iterate(step, epoch, control)
            self._adapt_timeout(step - first + 1, time.perf_counter() - started)
            if stage.charging is not None:
                stage.charge()
            self.recorded_step = step
            self.in_flight_step, self.in_flight_after_broadcast = self.in_flight_after_broadcast, None
            epoch_end = step % stage.steps_per_epoch == 0 or step == stage.steps
            if epoch_end:
                self.test = stage.evaluate()
            if step % self.cfg.runtime.log_every == 0 or epoch_end or (stage.row_at_control and control != CONTINUE):
                self._log_row(step, epoch, self.test if epoch_end else None,
                              epsilon=stage.epsilon_each_row or epoch_end)
            else:
                self.heartbeat()
            self._write_privacy_rows(wait=False)
            if control != CONTINUE:
                self._checkpoint(step)
                if control == STOP:
                    stopped = signal_name
                    break
        self._write_privacy_rows(wait=True)
        self.channel.timeout = self.cfg.runtime.comm_timeout  # the stage's end (the parties' final sums) is no step
        return step, stopped

    def settle_failure(self) -> None:
        """A failing stage: charge the step in flight and log the last ε rows (bounded in time)."""
        ledger = self.stage.charging
        if ledger is None:
            return
        # The step the parties were in may have been sent by some of them: charge it (docs/privacy.md §2.5), and
        # the next one when the failure came before this step's broadcast was known to be complete.
        last = charge_in_flight(self.stage.charge, self.recorded_step, self.in_flight_step)
        last = charge_in_flight(self.stage.charge, last, self.in_flight_after_broadcast)
        settle_privacy(ledger, last, self.stage.log_privacy if self.log is not None else None)

    def _log_row(self, step: int, epoch: int, test: np.ndarray | None, *, epsilon: bool) -> None:
        row = self.stage.row(step, epoch, test)
        if self.stage.charging is not None and epsilon:
            self.stage.charging.submit(step)
        if self.log is not None:
            self.log.append_metrics(row)
        if self.progress is not None:
            self._write_privacy_rows(wait=step == self.stage.steps)  # the last line shows the final ε
            shown = dict(row)
            if self.stage.charging is not None:
                shown["epsilon"] = self.epsilon_so_far
            self.progress(step, self.stage.steps, shown)

    def _write_privacy_rows(self, wait: bool) -> None:
        """Log the ε rows the ledger's worker has finished (all of them with `wait`)."""
        ledger = self.stage.charging
        if ledger is None:
            return
        for row in ledger.drain() if wait else ledger.ready():
            self.epsilon_so_far = float(np.max(row.epsilon))
            if self.log is not None:
                self.stage.log_privacy(row)

    def _adapt_timeout(self, steps_run: int, seconds: float) -> None:
        """After ``ADAPT_AFTER_STEPS`` steps, limit the next exchanges to a multiple of the slowest step so far."""
        self.slowest_step = max(self.slowest_step, seconds)
        if steps_run >= ADAPT_AFTER_STEPS:
            runtime = self.cfg.runtime
            self.channel.timeout = adaptive_timeout(runtime.comm_timeout, runtime.comm_timeout_min,
                                                    runtime.comm_timeout_factor, self.slowest_step)

    def _checkpoint(self, step: int) -> None:
        """Every party has saved its own state of this step (the gather is its acknowledgement); then rank 0's.
        The parties' saves may take longer than a step: the acknowledgement waits under the full limit."""
        adapted, self.channel.timeout = self.channel.timeout, self.cfg.runtime.comm_timeout
        self.channel.gather_objects(None)
        self.channel.timeout = adapted
        self._write_privacy_rows(wait=True)
        if self.run_dir is not None:
            save_checkpoint(self.run_dir, self.stage.checkpoint(step))
