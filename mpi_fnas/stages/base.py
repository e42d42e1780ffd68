"""What every stage of a job shares, on rank 0 and on a party: the interface a stage implements.

A stage (the search, :mod:`mpi_fnas.stages.search`; the augmentation, :mod:`mpi_fnas.stages.augment`) is one
module holding three things: rank 0's side (a :class:`ServedStage`, which :class:`~mpi_fnas.stages.rank0_loop.
ServerLoop` runs), the party's side (a :class:`StageSide`, which :func:`~mpi_fnas.stages.party_driver.participate`
runs) and its outcome (a :class:`StageOutcome`). Both sides of a stage are in one module so that what one side asks
and the other checks is read in one place. A party imports this module too: rank 0's log and ledgers are imported
only where rank 0 uses them.

What rank 0 writes is public by construction: the weights, its optimizers, the test-split metrics it computes
itself, and ε, which depends only on public quantities. Under DP no per-step timing is logged (a step's duration
reveals the realised Poisson batch size).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.data import Dataset
from mpi_fnas.evaluation import ratio
from mpi_fnas.federation.adadp import w_rounds
from mpi_fnas.federation.algorithm import ServerBuffers, StepStats, server_iteration
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.global_model import Server
from mpi_fnas.federation.job_plan import PartyView
from mpi_fnas.federation.local_model import Party
from mpi_fnas.federation.party_disk import PartyStore
from mpi_fnas.moved import moved_name
from mpi_fnas.privacy.params import DPParams
from mpi_fnas.privacy.release import IterationReleases
from mpi_fnas.secagg.series import SecureSeries, rotation_id
from mpi_fnas.stages.iteration import IterationClock

# Under private names: the public ones moved out of this module and are forwarded with a warning (__getattr__).
from mpi_fnas.stages.party_data import with_fixed_stem as _with_fixed_stem
from mpi_fnas.stages.setup import rates as _rates

if TYPE_CHECKING:  # rank 0's log (h5py) and ledgers (dp_accounting, scipy): a party never imports them
    from mpi_fnas.privacy.federation_ledger import EpsilonRow
    from mpi_fnas.runlog import RunLog
    from mpi_fnas.stages.setup import StageSetup


def __getattr__(name: str) -> Any:
    """A name that moved out of this module (:data:`mpi_fnas.moved.MOVED_NAMES`), with a DeprecationWarning."""
    return moved_name(__name__, name)


@dataclass(kw_only=True)
class StageOutcome:
    """Rank 0's result of a stage: what the search's and the augmentation's share."""

    mode: str
    genotype: str
    epochs: int
    steps: int
    test_acc: float
    stop_reason: str
    log_path: Path | None = None
    wall_seconds: float = 0.0
    interrupted: bool = False  # stopped by a signal after writing a checkpoint
    epsilon: np.ndarray | None = None  # (K,) tight ε per party (DP only); the augmentation's composes both stages
    # (K,) under secure aggregation: ε if K − 1 parties collude with the server (None: local noise, = epsilon)
    epsilon_collusion: np.ndarray | None = None
    # (K,) ε against the server alone when `epsilon` lets privacy.colluders parties collude with it (None: t = 0)
    epsilon_server: np.ndarray | None = None
    colluders: int = 0  # privacy.colluders under secure aggregation: `epsilon` holds against the server and any t
    # (K,) ε of this stage's releases alone (the augmentation's: its search not charged, as DPNAS reports); DP only
    epsilon_alone: np.ndarray | None = None
    delta: np.ndarray | None = None
    privacy_guarantee: str = "holds"


class ServedStage:
    """A stage on rank 0, as :class:`~mpi_fnas.stages.rank0_loop.ServerLoop` runs it (its
    :class:`~mpi_fnas.stages.rank0_loop.LoopStage`), and what both stage definitions share: the planned steps,
    the ledger the releases are charged on, the server's selection, the accumulated statistics and rows of the
    stage's log group, the checkpoint's common keys and the outcome's."""

    lr_column: str  # the metrics column of W's learning rate
    warmup_epochs = 0  # epochs whose iterations train W only

    def __init__(self, cfg: Config, channel: Channel, setup: StageSetup, log: RunLog | None, server: Server) -> None:
        self.cfg, self.channel, self.setup, self.server = cfg, channel, setup, server
        self.log = log.stage(self.name) if log is not None else None
        self.log_path = log.path if log is not None else None
        self.plan = setup.plan
        self.steps, self.steps_per_epoch = self.plan.steps, self.plan.steps_per_epoch
        self.stop_reason = self.plan.stop_reason  # or why a resumed stage ends before its plan (its ε cap)
        self.charging = setup.ledger if setup.private else None  # the ledger of this stage's releases (None: not DP)
        self.test = _with_fixed_stem(setup.model, *setup.test.render(np.arange(len(setup.test.labels))),
                                     reuse=True)  # rank 0's own split: the search's features
        self.test_loss = self.test_acc = math.nan  # of the last evaluation
        self.acc = StepTotals()
        self.clock = IterationClock()  # this attempt's iterations, for its cost
        # With the server's selection (federation.selection random, secprobe or oracle) it gathers every release.
        gathered = self.plan.assignments[0].gathered
        self.selector = setup.selector if gathered else None
        self.aux = _with_fixed_stem(setup.model, *setup.aux) if gathered and setup.aux[0] is not None else (None, None)
        a_size = server.a.numel() if server.a is not None else None
        secure = None
        if setup.secure:  # rank 0's labels of each release kind, counted in lockstep with the parties'
            sizes = {"W": server.w.numel(), "A": a_size}
            rotation = rotation_id(setup.launch_id, cfg.seed if cfg.privacy.reproducible_noise else None)
            secure = {name: (SecureSeries(setup.launch_id, self.name, name, release.encoding(sizes[name]), rotation),
                             release.expected_batch_size) for name, release in setup.releases.items()}
        self.buffers = ServerBuffers(server.w.numel(), a_size, gathered_parties=channel.parties if gathered else None,
                                     second_order=cfg.search.order == "second_order" and a_size is not None,
                                     secure=secure)

    def iterate(self, step: int, epoch: int, control: int) -> None:
        """One iteration of Algorithm 1 on rank 0 (its selection row logged), ending with the broadcast that carries
        `control`; its statistics go to the accumulator."""
        t0, c0, b0 = time.perf_counter(), self.channel.comm_seconds, self.channel.bcast_seconds
        self.server.begin_step(step)
        stats = server_iteration(self.server, self.channel, self.buffers, control, selector=self.selector,
                                 aux=self.aux, train_a=epoch >= self.warmup_epochs)
        if self.selector is not None and self.log is not None:
            self.log.append_selection(step, stats.chosen, stats.score, self.selector.epsilon_spent())
        wall, mpi = time.perf_counter() - t0, self.channel.comm_seconds - c0
        self.acc.add(stats, wall, mpi)
        self.clock.add(wall, mpi, self.channel.bcast_seconds - b0)

    def charge(self) -> None:
        """Charge one iteration's releases of every party on ``charging``."""
        self.charging.record_step(self.name)

    def evaluate(self) -> np.ndarray:
        """At an epoch end: [loss_sum, correct, count] on the server's test split (and the stage's epoch rows)."""
        test = self.server.evaluate(*self.test)
        self.test_loss, self.test_acc = ratio(test[0], test[2]), ratio(test[1], test[2])
        return test

    def row(self, step: int, epoch: int, test: np.ndarray | None) -> dict[str, float]:
        """The metrics row of `step` (the accumulator restarts after it)."""
        # Under DP the parties send no statistics: counts stay 0 and the train (and val) columns are NaN.
        row = {"step": step, "epoch": epoch, **_rates("train", self.acc.train), **_rates("test", test)}
        row[self.lr_column], row["adadp_err"] = self.server.log_values()
        self.acc = StepTotals()
        return row

    def log_privacy(self, row: EpsilonRow) -> None:
        """Write one ε row of the ledger to the stage's log."""
        steps = row.charged_steps if self.name == "search" else row.augment_steps
        self.log.append_privacy(row.step, steps, row.epsilon, row.mu_gdp, row.epsilon_collusion)

    def checkpoint(self, step: int) -> dict:
        """Rank 0's whole state at `step`, as ``checkpoint.pt`` holds it: here the keys of both stages."""
        ledger = self.setup.ledger  # under dpfnas: the search's, continued (saved even where this stage charges none)
        return {"stage": self.name, "step": step, "plan_steps": self.plan.steps, "config": self.cfg.to_yaml(),
                "server": self.server.state_dict(), "ledger": ledger.state_dict() if ledger is not None else None,
                "selection": self.selector.state_dict() if self.selector is not None else None,
                "log_rows": list(self.log.row_counts()) if self.log is not None else None}

    def outcome(self, step: int, stopped: str | None, test: np.ndarray) -> StageOutcome:
        """The stage's result once its loop ended at `step` (`stopped`: the signal that stopped it, or None;
        `test`: the last evaluation's [loss_sum, correct, count])."""
        plan, ledger = self.plan, self.setup.ledger
        stop_reason = self.stop_reason if stopped is None else f"interrupted by {stopped}: checkpointed at step {step}"
        outcome = self.result(stopped, test, mode=self.cfg.mode, epochs=math.ceil(plan.steps / plan.steps_per_epoch),
                              steps=step, stop_reason=stop_reason, interrupted=stopped is not None,
                              log_path=self.log_path)
        if ledger is not None:
            outcome.epsilon, outcome.delta = ledger.epsilons(), ledger.plan.delta
            outcome.epsilon_collusion, outcome.epsilon_server = ledger.epsilons_collusion(), ledger.epsilons_server()
            outcome.colluders = ledger.secure.colluders if ledger.secure is not None else 0
            if self.name == "augment" and self.setup.private:  # what DPNAS reports; the search's is its ε
                outcome.epsilon_alone = ledger.epsilons_alone(self.name)
            ledger.close()
        return outcome

    def result(self, stopped: str | None, test: np.ndarray, **common: Any) -> StageOutcome:
        """The stage's outcome with the `common` fields (its ε is added after)."""
        raise NotImplementedError


class StageSide:
    """A stage on a party: its assignment's type, its party, and what each step asks of it. Both sides share the
    config, the weight releases per iteration (2 under ADADP) and the epoch length (known from the assignment)."""

    name: str
    assignment: type
    #: The stages that come after this one: once a party has sent one of theirs, this stage is over on it.
    later_stages: tuple[str, ...] = ()

    def __init__(self, cfg: Config, optimizer: str) -> None:
        self.cfg = cfg
        self.rounds = w_rounds(optimizer)
        self.steps_per_epoch = 1

    def build(self, cfg: Config, got: Any, data: Dataset, rank: int, device: torch.device) -> Party:
        """The stage's party of `rank` on `device`, from its assignment `got` and its train split `data` (each side
        says how)."""

    def check(self, cfg: Config, got: Any, own: PartyView, *, parties: int, rank: int) -> None:
        """Raise AssignmentRefusedError unless `got`'s DP parameters and indices are those this party derives
        itself (`own`; :mod:`~mpi_fnas.federation.verify`; each side says which indices it holds)."""

    def private(self, cfg: Config) -> bool:
        """Whether this stage's releases are DP under `cfg` (each side)."""
        return False

    def needs_sizes(self, cfg: Config) -> bool:
        """Whether this stage's steps per epoch follow from every party's shard sizes (its ``steps_per_epoch``
        unset), which under ``data.partition: local`` the parties tell each other."""
        return False

    def params(self, got: Any) -> DPParams:
        """The run's DP parameters in a private stage's assignment `got` (checked by :meth:`check`)."""
        raise NotImplementedError

    def per_iteration(self, got: Any) -> tuple[IterationReleases, list[int]]:
        """What one iteration of a private stage releases on this party's train and validation shards (q from the
        shards it samples: B / N), and its search shards' sizes (N_tr, N_val)."""
        raise NotImplementedError

    def keep_own_ledger(self, cfg: Config, got: Any, store: PartyStore | None, rank: int, *, requested: int,
                        earlier: Sequence[tuple[PartyStore, bool]] = ()) -> None:
        """This party's own budget (:mod:`mpi_fnas.privacy.party_ledger`), before it sends anything of this launch:
        BudgetRefusedError when the `requested` iterations rank 0 announced would take its ε, composed from its own
        record and journals, past the run's cap (``privacy.target_epsilon``, ``privacy.max_epsilon``), or, composed
        with its `earlier` runs on the same data too (each its store and whether it split the data alike), past its
        own ``privacy.party_max_epsilon``; then this launch's releases recorded in its directory."""
        per_iteration, sizes = self.per_iteration(got)
        record = store.release_record() if store is not None else []
        params = self.params(got)
        secure = params.secure_sum
        caps = params.party_caps(cfg.privacy.party_max_epsilon)
        if caps:
            from mpi_fnas.privacy import party_ledger  # rank 0's accountant: loaded only by a party with a cap

            sent = store.sent_by_stage() if store is not None else {}
            before = [(other.release_record(), other.sent_by_stage(), same) for other, same in earlier]
            for cap, total in caps:
                party_ledger.check_request(cap, record, sent, per_iteration, cfg.privacy.delta, sizes,
                                           secure.accounting if secure is not None else None, requested, rank=rank,
                                           stage=self.name, earlier=before if total else ())
        if store is not None:
            constants = [secure.parties, secure.local_variance, secure.dimension, secure.colluders] if secure else None
            store.begin_releases(list(per_iteration.train), list(per_iteration.val), sizes, constants)

    def secure(self, cfg: Config) -> bool:
        """Whether this stage's releases are securely aggregated under `cfg` (a key round, an identity to use)."""
        return self.private(cfg) and cfg.privacy.aggregation == "secure"

    def step(self, party: Party, step: int) -> dict[str, Any]:
        """Prepare `party` for iteration `step`; the keyword arguments of its
        :func:`~mpi_fnas.federation.algorithm.party_iteration`."""

    def finish(self, party: Party, channel: Channel) -> None:
        """After the last step (not after a stop): the stage's closing exchange, if any (none by default)."""


@dataclass
class StepTotals:
    """Sums StepStats between two logged rows: [loss_sum, correct, count, compute_seconds] of the W rounds (train)
    and of the A round (val), the steps, and rank 0's wall and communication seconds."""

    train: np.ndarray = field(default_factory=lambda: np.zeros(4))
    val: np.ndarray = field(default_factory=lambda: np.zeros(4))
    steps: int = 0
    wall: float = 0.0
    comm: float = 0.0

    def add(self, stats: StepStats, wall: float, comm: float) -> None:
        """Add one iteration's statistics and rank 0's `wall` and `comm` seconds of it."""
        self.train += stats.train
        self.val += stats.val
        self.steps += 1
        self.wall += wall
        self.comm += comm

    def state_dict(self) -> dict:
        """The sums as plain values, for rank 0's checkpoint."""
        return {"train": self.train.tolist(), "val": self.val.tolist(), "steps": self.steps, "wall": self.wall,
                "comm": self.comm}

    @classmethod
    def from_state(cls, state: dict) -> StepTotals:
        """The totals a :meth:`state_dict` holds."""
        return cls(np.array(state["train"]), np.array(state["val"]), int(state["steps"]), float(state["wall"]),
                   float(state["comm"]))
