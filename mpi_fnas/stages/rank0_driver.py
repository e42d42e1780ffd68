"""Rank 0's side of a stage (the search or the augmentation): plan it, hand out, iterate, log, checkpoint, report.

One entry, :func:`serve`, runs either stage in the same order, a fresh one or a resumed one: plan
(:mod:`mpi_fnas.federation.job_plan`) and hand out the assignments (:mod:`mpi_fnas.federation.handshake`); charge the
iterations a party sent beyond the ledger's count (replays after a crash); open the stage's log group; restore a
resumed stage's state; broadcast the initial weights; run :class:`~mpi_fnas.stages.rank0_loop.ServerLoop`; finish
the log with the outcome, or with the failure.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mpi_fnas.config import Config
from mpi_fnas.federation.comm import Channel, PartyFailedError
from mpi_fnas.federation.handshake import announce_last_step, hand_out, refuse_setup, relay_public_keys
from mpi_fnas.federation.job_plan import SetupError, attach_resume
from mpi_fnas.stages.augment import AugmentStage
from mpi_fnas.stages.base import ServedStage, StageOutcome
from mpi_fnas.stages.iteration import Progress, attempt_cost, process_age, settle_privacy
from mpi_fnas.stages.rank0_loop import ServerLoop
from mpi_fnas.stages.search import SearchStage

if TYPE_CHECKING:  # the ledgers (dp_accounting, scipy): only a DP stage imports them
    from mpi_fnas.privacy.federation_ledger import FederationLedger


def serve(name: str, cfg: Config, channel: Channel, run_dir: Path | None, *, searched: dict | None = None,
          assignments=None, resume: dict | None = None, progress: Progress | None = None,
          stop_requested: Callable[[], str | None] = lambda: None) -> StageOutcome:
    """Run rank 0's side of the stage `name` ("search" or "augment") to its end and return its outcome.

    `searched` (augment): the search's result (``genotype``, its final ``ledger`` state or None, ``selection``;
    see :func:`mpi_fnas.stages.job.searched_state`). `assignments` (search): replaces the planned partition.
    `resume`: the stage's own checkpoint to continue from. See :func:`mpi_fnas.stages.job.run_job`.
    """
    definition = STAGES[name]
    start = time.perf_counter()
    try:
        setup = definition.plan(cfg, channel, searched or {}, assignments)
        if resume is not None:
            attach_resume(setup.plan, resume)
    except SetupError as exc:
        refuse_setup(channel, str(exc))
        raise
    reports = hand_out(channel, setup.plan.assignments)
    ledger = setup.ledger
    if ledger is not None and resume is not None:
        ledger.load_state_dict(resume["ledger"])
    if setup.private:
        ledger.charge_sent(reports.sent_steps, stage=name)
    log = definition.open_log(cfg, run_dir, setup, resume, reports.rank_attrs) if run_dir is not None else None
    loop: ServerLoop | None = None
    stage: ServedStage | None = None
    startup = math.nan
    try:
        if reports.refusals:  # once the log is open: a party refused its assignment, the log says failed
            rank, line = min(reports.refusals.items())
            raise PartyFailedError(f"party rank {rank} failed: {line} (refused by parties {sorted(reports.refusals)})")
        first = int(resume["step"]) + 1 if resume is not None else 1
        last, cut = setup.plan.steps, None
        if setup.private:  # every party checks it against its own ledger and cap before it sends anything
            last, cut = last_step_within_cap(ledger, name, first, last)
            announce_last_step(channel, last)
        if setup.secure:  # once the log is open: a party that refuses the key set (docs/privacy.md §8) fails the log
            setup.launch_id = relay_public_keys(channel)
        stage = definition(cfg, channel, setup, log)
        if cut is not None:
            stage.steps, stage.stop_reason = last, cut
        if resume is not None:
            stage.server.load_state_dict(resume["server"])
            if resume.get("selection") is not None:
                setup.selector.load_state_dict(resume["selection"])  # its window, draw count (both stages), coins
            stage.load_state_dict(resume)
        for buffer in (stage.server.w_buffer, stage.server.a_buffer):
            if buffer is not None:
                channel.bcast(buffer)
        loop = ServerLoop(stage, cfg, channel, log, progress, run_dir, stop_requested)
        startup = process_age()  # launch -> this stage's first step (public: rank 0's own clock)
        step, stopped = loop.run(first)
        outcome = stage.outcome(step, stopped, loop.test)
    except BaseException as exc:
        if loop is not None and setup.private:
            loop.settle_failure()
        elif setup.private:
            settle_privacy(ledger, int(resume["step"]) if resume is not None else 0, None)
        elif ledger is not None:
            ledger.close()
        if log is not None:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            log.stage(name).finish(status, reason=f"{type(exc).__name__}: {exc}".splitlines()[0],
                                   cost=attempt_cost(time.perf_counter() - start, channel.size, reports.gpus,
                                                     startup, stage.clock if stage is not None else None),
                                   **definition.final_attrs(None))
        raise
    outcome.privacy_guarantee = setup.guarantee
    # One clock reading serves both the printed summary and the log's cost group, so the two agree exactly.
    outcome.wall_seconds = time.perf_counter() - start
    if log is not None:
        log.stage(name).finish("interrupted" if outcome.interrupted else "finished", reason=outcome.stop_reason,
                               cost=attempt_cost(outcome.wall_seconds, channel.size, reports.gpus, startup,
                                                 stage.clock),
                               **definition.final_attrs(outcome))
    if outcome.interrupted:
        channel.barrier()  # the parties exit only once the checkpoint and the log are on disk
    return outcome


def last_step_within_cap(ledger: FederationLedger, name: str, first: int, planned: int) -> tuple[int, str | None]:
    """(the stage's last step, why it is before the plan's `planned` or None). Under ``privacy.target_epsilon`` or
    ``max_epsilon`` (:attr:`~mpi_fnas.privacy.params.DPParams.cap`) it is the last step from `first` every party's
    ε stays within, after the replays of a resume charged: the plan keeps a fresh run within the cap, and this
    keeps a resumed one there too. The parties check it with the same function on their own records."""
    cap = ledger.plan.params.cap
    if cap is None or planned < first:
        return planned, None
    allowed = ledger.iterations_within(cap[0], name, planned - first + 1)
    last = first - 1 + int(allowed.min())
    if last >= planned:
        return planned, None
    worst = int(np.argmin(allowed)) + 1
    return last, (f"{cap[1]} reached: {cap[0]:g} allows {last} of {planned} {name} steps after what the parties "
                  f"had sent (party {worst})")


#: The stage definitions :func:`serve` runs, by name.
STAGES: dict[str, type[SearchStage] | type[AugmentStage]] = {"search": SearchStage, "augment": AugmentStage}
