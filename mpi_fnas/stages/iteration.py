"""What the two stages of a job (search, augmentation) share around their iterations. No MPI, no autograd.

* rank 0's decision at a step's end, the control word of its last broadcast (:class:`StepControl`);
* the cost of an attempt (the log adds the attempts of a requeued run up);
* on a failure, the charge of the step in flight (:func:`charge_in_flight`) and the last ε rows of what the
  privacy ledgers charged (:func:`settle_privacy`);
* the test hooks that stop a run, fail a party or slow it down at a given step (environment variables, off by
  default): ``MPI_FNAS_STOP_AFTER=STEP`` acts as if SIGUSR1 arrived during that step, ``MPI_FNAS_INJECT_FAULT=
  RANK:STEP`` makes that party raise, ``MPI_FNAS_INJECT_SLEEP=RANK:STEP:SECONDS`` makes it sleep. A STEP written
  ``augment:N`` means step N of the augmentation, a plain number a step of the search; step 0 is the party's
  setup, before its setup report (a party that reports late).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpi_fnas.federation.algorithm import CHECKPOINT, CONTINUE, STOP
from mpi_fnas.federation.memory import peak_rss_mb

if TYPE_CHECKING:  # the ledger (dp_accounting) is rank 0's; parties import this module too
    from mpi_fnas.privacy.federation_ledger import EpsilonRow, FederationLedger

STOP_ENV = "MPI_FNAS_STOP_AFTER"
FAULT_ENV = "MPI_FNAS_INJECT_FAULT"
SLEEP_ENV = "MPI_FNAS_INJECT_SLEEP"
#: Rank 0's display of a stage: progress(step, steps, row) after each logged row.
Progress = Callable[[int, int, dict[str, float]], None]
SETTLE_SECONDS = 10.0  # how long a failing stage may spend logging its last ε rows before the job is torn down


def _stage_step(text: str, stage: str) -> int:
    """The step of `stage` named by `text` ("N" = search step N, "augment:N" = augment step N), else -1."""
    named, _, number = text.rpartition(":")
    if (named or "search") != stage or not number:
        return -1
    return int(number)


class StepControl:
    """Rank 0's decision at the end of each step: continue, checkpoint (every N steps) or stop (a signal)."""

    def __init__(self, stage: str, steps: int, every_steps: int, stop_requested: Callable[[], str | None]) -> None:
        self.steps, self.every_steps, self.stop_requested = steps, every_steps, stop_requested
        self.stop_after = _stage_step(os.environ.get(STOP_ENV, ""), stage)

    def at(self, step: int) -> tuple[int, str | None]:
        """(control word, the reason to stop or None) for `step`. The last step never stops: it finishes."""
        signal_name = self.stop_requested() or (f"{STOP_ENV}={step}" if step == self.stop_after else None)
        if signal_name is not None and step < self.steps:
            return STOP, signal_name
        if self.every_steps and step % self.every_steps == 0 and step < self.steps:
            return CHECKPOINT, None
        return CONTINUE, None


@dataclass
class IterationClock:
    """Rank 0's time in a stage's iterations, as it sees them, split three ways for the attempt's cost (``/cost``).

    - ``transfer_seconds``: moving the releases and broadcasts, counted as twice rank 0's broadcasts (where the
      parties already wait, so that time is the transfer alone; the reductions move the same bytes over the same
      links). Where early releases arrive while later parties still compute (slow links), part of the inbound half
      overlaps compute: this is then an upper bound on the exposed transfer, ``party_compute_seconds`` a lower one.
    - ``party_compute_seconds``: the rest of rank 0's time inside MPI, waiting for the parties' releases (their
      passes and, under DP, clipping and noise: ``python -m mpi_fnas.bench`` splits those, ``dp_work_seconds``).
    - ``server_seconds``: rank 0's own work in the iterations (its W and A steps, the sums).

    Totals over an attempt, never per step: under DP a step's duration follows the realised Poisson batches, which
    ``party_compute_seconds`` follows more sharply than ``wall_seconds`` (the rest is data-independent): an attempt
    of one step shows that step's wait. docs/privacy.md lists it with the other timings rank 0 sees.
    """

    wall_seconds: float = 0.0  # the iterations' wall time on rank 0
    mpi_seconds: float = 0.0  # ... of which inside MPI calls
    bcast_seconds: float = 0.0  # ... of which in its broadcasts

    def add(self, wall: float, mpi: float, bcast: float) -> None:
        """Add one iteration's wall, MPI and broadcast seconds."""
        self.wall_seconds += wall
        self.mpi_seconds += mpi
        self.bcast_seconds += bcast

    def split(self) -> dict[str, float]:
        """The attempt's seconds for ``/cost``: the parties' compute, the transfers (bounded by twice the broadcasts'),
        and rank 0's own."""
        transfer = min(2.0 * self.bcast_seconds, self.mpi_seconds)
        return {"party_compute_seconds": self.mpi_seconds - transfer, "transfer_seconds": transfer,
                "server_seconds": max(self.wall_seconds - self.mpi_seconds, 0.0)}


def attempt_cost(wall_seconds: float, ranks: int, gpus: int, startup_seconds: float = math.nan,
                 clock: IterationClock | None = None) -> dict[str, float]:
    """This attempt's cost. Core-hours count one core a rank; the peak memory is rank 0's own (this process's);
    `startup_seconds`: rank 0's :func:`process_age` at the stage's first step (NaN: it failed before); `clock`: the
    attempt's iterations (None: it ran none)."""
    return {"wall_seconds": wall_seconds, "ranks": ranks, "gpus": gpus, "gpu_hours": wall_seconds * gpus / 3600.0,
            "cpu_core_hours": wall_seconds * ranks / 3600.0, "rss_peak_mb_server": peak_rss_mb(),
            "startup_seconds": startup_seconds, **(clock or IterationClock()).split()}


ADAPT_AFTER_STEPS = 2  # a stage's first steps run under the full runtime.comm_timeout (warm-up, lazy kernel loads)


def adaptive_timeout(cap: float, floor: float, factor: float, slowest: float) -> float:
    """Rank 0's limit for a step's exchanges once a stage has run ``ADAPT_AFTER_STEPS`` steps: `factor` times the
    `slowest` step so far, rounded up to a whole multiple of `floor` (at least `floor`), at most `cap`; `cap` when
    `factor` is 0. Whole multiples: a timeout's message then tells at most the slowest step to within floor/factor
    seconds (rank 0 observes step times anyway; under DP they vary with the realised Poisson batches)."""
    if factor <= 0:
        return cap
    return min(cap, floor * max(1, math.ceil(factor * slowest / floor)))


def process_age() -> float:
    """Seconds since this process was launched (Linux /proc; NaN elsewhere)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            return float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return math.nan


def charge_in_flight(record_step: Callable[[], None], recorded: int, in_flight: int | None) -> int:
    """A failing stage: charge the iteration in flight, whose releases some parties may already have handed to MPI.

    A party journals and sends its step's releases as soon as it holds the previous broadcast; when another party
    (or rank 0) fails, the survivors' releases of that step may be on the wire before rank 0 notices. Their ε
    must be reported even if the run is never resumed (a resume charges them anyway, from the parties' journals).
    `record_step` charges one iteration of every party; `recorded` is the last iteration the ledger had recorded,
    `in_flight` the one the parties were in (None: none). Returns the last iteration now charged.
    """
    if in_flight is None or in_flight <= recorded:
        return recorded
    record_step()
    return in_flight


def settle_privacy(ledger: FederationLedger, step: int, write: Callable[[EpsilonRow], None] | None) -> None:
    """A failing stage: log (``write``) the ε rows of everything its ledgers charged up to the failure.

    Bounded by SETTLE_SECONDS, and never in the way of the failure being reported: a row that cannot be computed
    or written is skipped, since the failure itself is what the log must say (a resume charges everything).
    """
    try:
        rows = ledger.settle(step, timeout=SETTLE_SECONDS)
        if write is not None:
            for row in rows:
                write(row)
    except Exception:  # see the docstring
        ledger.close(timeout=0.0)


class Injections:
    """Fault and delay injection for the failure tests, for one party and one stage."""

    def __init__(self, rank: int, stage: str = "search") -> None:
        self.stage = stage
        self.fault_step = self.sleep_step = -1
        self.sleep_seconds = 0.0
        fault = os.environ.get(FAULT_ENV, "")
        fault_rank, _, step_text = fault.partition(":")
        if fault and int(fault_rank) == rank:
            self.fault_step = _stage_step(step_text, stage)
        sleep = os.environ.get(SLEEP_ENV, "")
        sleep_rank, _, rest = sleep.partition(":")
        if sleep and int(sleep_rank) == rank:
            step_text, _, seconds = rest.rpartition(":")
            self.sleep_step, self.sleep_seconds = _stage_step(step_text, stage), float(seconds)

    def at(self, step: int) -> None:
        """At `step`: raise or sleep if a test hook asks this party to."""
        if step == self.fault_step:
            where = "step" if self.stage == "search" else f"{self.stage} step"
            raise RuntimeError(f"injected fault at {where} {step} ({FAULT_ENV})")
        if step == self.sleep_step:
            time.sleep(self.sleep_seconds)
