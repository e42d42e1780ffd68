"""Rank 0's side of a stage (the search or the augmentation): plan it, hand out, iterate, log, checkpoint, report.

One entry, :func:`serve`, runs either stage in the same order: plan (:mod:`mpi_fnas.federation.plan`) and hand out
the assignments (:mod:`mpi_fnas.federation.handshake`); charge the iterations a party sent beyond the ledger's count
(replays after a crash); open the stage's log group; broadcast the initial weights; run
:class:`~mpi_fnas.federation.server_loop.ServerLoop`; finish the log with the outcome, or with the failure.

:class:`ServedStage` holds what both stages share; :class:`SearchStage` and :class:`AugmentStage` say what differs.
Under dpfnas the augmentation continues the search's privacy ledgers: an augment ε composes both stages per party.

What rank 0 writes is public by construction: the weights, its optimizers, the test-split metrics it computes
itself, and ε, which depends only on public quantities and is computed by the ledger's worker thread while the
parties compute. Under DP no per-step timing is logged (a step's duration reveals the realised Poisson batch size).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.federation.adadp import adadp_settings
from mpi_fnas.federation.algorithm import ServerBuffers, StepStats, server_iteration
from mpi_fnas.federation.aux_set import open_aux_set
from mpi_fnas.federation.comm import Channel, PartyFailedError
from mpi_fnas.federation.handshake import announce_last_step, hand_out, refuse_setup, relay_public_keys
from mpi_fnas.federation.inventory import gather_inventory
from mpi_fnas.federation.plan import (
    AugmentPlan,
    RunPlan,
    SetupError,
    attach_resume,
    augment_is_private,
    open_split,
    parse_genotype,
    plan_augment_stage,
    plan_run,
)
from mpi_fnas.federation.selection import Selector, selection_stream
from mpi_fnas.federation.server import Server, augment_server, search_server
from mpi_fnas.federation.server_loop import LoopStage, Progress, ServerLoop, ratio
from mpi_fnas.federation.stage import IterationClock, attempt_cost, process_age, settle_privacy
from mpi_fnas.privacy.release import securely_aggregated
from mpi_fnas.runlog import SEARCH_METRICS, RunLog, SelectionSchema, StagePrivacy
from mpi_fnas.secagg.series import SecureSeries
from mpi_fnas.space import augment_network, search_space, trains_cell

if TYPE_CHECKING:  # the ledgers import dp_accounting and scipy (~1 s): only a DP stage imports them (_ledger)
    from mpi_fnas.privacy.ledger import EpsilonRow, FederationLedger
    from mpi_fnas.privacy.params import PrivacyPlan
    from mpi_fnas.privacy.release import Release


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


@dataclass(kw_only=True)
class SearchOutcome(StageOutcome):
    """Rank 0's result of a search."""

    parties: int
    val_acc: float  # NaN under DP (not released)
    val_loss: float
    w: np.ndarray = field(repr=False)
    a: np.ndarray = field(repr=False)
    mu_gdp: np.ndarray | None = None
    ledger_state: dict | None = None  # the privacy ledgers at the end (DP only): the augmentation continues them
    shard_sizes: list[list[int]] | None = None  # [[N_k^train, N_k^val], ...]: the augmentation must find the same
    selection_state: dict | None = None  # the selection's draws (Selector.summary): the augmentation continues them
    alpha_entropy: float = float("nan")  # mean softmax entropy of A's edges / log(ops): 1 = uniform, not moved
    alpha_margin: float = float("nan")  # mean p_top − p_second over A's edges: 0 = uniform


@dataclass(kw_only=True)
class AugmentOutcome(StageOutcome):
    """Rank 0's result of the augmentation (its ``genotype``: "" when ``network`` is hand-designed)."""

    network: str  # augment.network: "cell", or the hand-designed network trained
    params: int  # parameters of the network without the auxiliary head (Table 1's "Params")
    test_loss: float
    private: bool  # the releases were DP (dpfnas with augment.private)
    release: Release | None = None  # the augmentation's releases (σ, clip, B; None: not private)
    composed_with_search: bool = False  # its ε includes a search's releases (the ledger continued one)


@dataclass
class StageSetup:
    """A stage as rank 0 planned it before handing out the assignments."""

    plan: RunPlan | AugmentPlan
    ledger: FederationLedger | None  # the job's privacy ledgers (dpfnas): the augmentation continues the search's
    private: bool  # this stage's releases are DP and charged on `ledger`
    guarantee: str  # what the stage's result may claim: "holds", or one line saying why not
    selector: Selector
    aux: tuple[torch.Tensor | None, torch.Tensor | None]  # the server's aux set (secprobe), else (None, None)
    test: Any  # the test split (rank 0 evaluates on it)
    model: torch.nn.Module  # the network the stage trains (the supernet; the augmentation's network of its cell)
    search_plan: RunPlan  # the search's partition (the augmentation's: its log when it did not search)
    releases: dict[str, Release] | None = None  # the stage's DP releases by name (None: not private)
    launch_id: bytes | None = None  # secure aggregation: the launch's id, from the relayed public keys

    @property
    def secure(self) -> bool:
        """Whether the stage's releases are securely aggregated (rank 0 relays keys and opens sums)."""
        return securely_aggregated(self.releases)


def serve(name: str, cfg: Config, channel: Channel, run_dir: Path | None, *, searched: dict | None = None,
          assignments=None, resume: dict | None = None, progress: Progress | None = None,
          stop_requested: Callable[[], str | None] = lambda: None) -> StageOutcome:
    """Run rank 0's side of the stage `name` ("search" or "augment") to its end and return its outcome.

    `searched` (augment): the search's result (``genotype``, its final ``ledger`` state or None, ``selection``;
    see :func:`mpi_fnas.federation.job.searched_state`). `assignments` (search): replaces the planned partition.
    `resume`: the stage's own checkpoint to continue from. See :func:`mpi_fnas.federation.job.run_job`.
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


def _ledger(privacy: PrivacyPlan) -> FederationLedger:
    """The job's privacy ledgers for its privacy plan (imported here: a non-DP job never loads the accountant)."""
    from mpi_fnas.privacy.ledger import FederationLedger
    return FederationLedger(privacy)


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


def guarantee(cfg: Config, private: bool, ledger: FederationLedger | None) -> str:
    """What a stage's result may claim: the privacy parameters' guarantee, or one line saying why not."""
    if private:
        return ledger.plan.params.guarantee
    if cfg.mode == "dpfnas":
        return ("none: augment.private is false, so the augmentation used exact gradients and the final weights are "
                "NOT private; ε covers the search only")
    return f"none: mode {cfg.mode} makes no privacy claim"


def selection_schema(cfg: Config, selector: Selector) -> SelectionSchema | None:
    """The log's fixed facts of the selection (``/selection`` and ``/augment/selection`` attrs); None for ``all``."""
    fed = cfg.federation
    if fed.selection == "all":
        return None
    return SelectionSchema(selection=fed.selection, select=selector.select, epsilon_per_step=fed.selection_epsilon,
                           score_window=fed.score_window, aux_size=fed.aux_size, sensitivity=selector.sensitivity,
                           delta=selector.delta)


def _rates(name: str, sums: np.ndarray | None) -> dict[str, float]:
    """``<name>_loss`` and ``<name>_acc`` of the sums [loss_sum, correct, count, …] (NaN without sums or examples)."""
    loss, correct, count = sums[:3] if sums is not None else (math.nan,) * 3
    return {f"{name}_loss": ratio(loss, count), f"{name}_acc": ratio(correct, count)}


def _setup(cfg: Config, name: str, plan: RunPlan | AugmentPlan, ledger: FederationLedger | None, private: bool,
           search_plan: RunPlan, earlier: dict | None, build: Callable[..., torch.nn.Module]) -> StageSetup:
    """The stage's setup around its `plan`: the test split, the network ``build(in_channels=, num_classes=)``, and
    the selector continuing an earlier stage's draws (`earlier`: its ``Selector.summary``) with the aux set it
    scores on ((None, None) unless secprobe). SetupError when the earlier stage drew at another ε_EM or K′."""
    test = open_split(cfg, "test")
    selector = Selector(cfg.federation, len(search_plan.assignments), selection_stream(cfg, name),
                        search_plan.unreliable)
    try:
        selector.continue_after(earlier)
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    aux = open_aux_set(cfg, open_split(cfg, "train")) if selector.scores_needed else (None, None)
    model = build(in_channels=test.in_channels, num_classes=test.num_classes)
    releases = None
    if private and name == "search":
        releases = plan.privacy.params.search_releases(plan.privacy.w_releases_per_step)
    elif private:
        releases = {"W": plan.releases.release}
    return StageSetup(plan, ledger, private, guarantee(cfg, private, ledger), selector, aux, test, model, search_plan,
                      releases)


def open_search_log(cfg: Config, run_dir: Path, setup: StageSetup, resume: dict | None,
                    ranks: dict[str, list[str]]) -> RunLog:
    """The run log: created, or reopened for a resumed search (rows after the checkpoint dropped). ranks: its
    ``/ranks`` attributes (:attr:`~mpi_fnas.federation.handshake.SetupReports.rank_attrs`)."""
    if resume is not None:
        log = RunLog.reopen(run_dir / "search.h5", rank_attrs=ranks)
        log.search.truncate(*resume["log_rows"])
        return log
    plan = setup.search_plan
    space = search_space(cfg.space.kind)
    normal_shape, reduce_shape = space.alpha_shapes(cfg.space)
    privacy = None
    if plan.privacy is not None:
        privacy = StagePrivacy(delta=plan.privacy.delta,
                               releases=plan.privacy.params.search_releases(plan.privacy.w_releases_per_step),
                               sample_rates={"W": plan.privacy.sample_rate_train, "A": plan.privacy.sample_rate_val},
                               accountant=setup.ledger.description())
    return RunLog.create(
        run_dir / "search.h5", mode=cfg.mode, parties=len(plan.assignments), config_text=cfg.to_yaml(),
        metric_names=SEARCH_METRICS, alpha_shape=normal_shape, reduce_alpha_shape=reduce_shape, space=space.kind,
        alpha_ops=space.candidates(cfg.space), genotype_length=space.max_genotype_length(cfg.space), privacy=privacy,
        rank_attrs=ranks,
        privacy_guarantee=setup.guarantee, unreliable=plan.unreliable, corruption=cfg.federation.corruption,
        selection=selection_schema(cfg, setup.selector),
    )


class ServedStage(LoopStage):
    """A stage on rank 0, as :class:`~mpi_fnas.federation.server_loop.ServerLoop` runs it (its
    :class:`~mpi_fnas.federation.server_loop.LoopStage`), and what both stage definitions share: the planned steps,
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
        self.test = setup.test.render(np.arange(len(setup.test.labels)))
        self.test_loss = self.test_acc = math.nan  # of the last evaluation
        self.acc = _Accumulator()
        self.clock = IterationClock()  # this attempt's iterations, for its cost
        # With the server's selection (federation.selection random, secprobe or oracle) it gathers every release.
        gathered = self.plan.assignments[0].gathered
        self.selector = setup.selector if gathered else None
        self.aux = setup.aux if gathered else (None, None)
        a_size = server.a.numel() if server.a is not None else None
        secure = None
        if setup.secure:  # rank 0's labels of each release kind, counted in lockstep with the parties'
            sizes = {"W": server.w.numel(), "A": a_size}
            secure = {name: (SecureSeries(setup.launch_id, self.name, name, release.encoding(sizes[name])),
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
        self.acc = _Accumulator()
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


class SearchStage(ServedStage):
    """The search as a stage of :class:`~mpi_fnas.federation.server_loop.ServerLoop`: W and A of the supernet, the
    epoch rows (alphas, genotype), the validation and timing columns (no timings under DP) and the accumulator."""

    name = "search"
    lr_column = "w_lr"
    epsilon_each_row = True
    row_at_control = True
    open_log = staticmethod(open_search_log)

    @staticmethod
    def plan(cfg: Config, channel: Channel, searched: dict, assignments) -> StageSetup:
        """Plan the search on rank 0: partitions, steps, the privacy plan and its ledger."""
        plan = plan_run(cfg, channel.parties, assignments, local_sizes=gather_inventory(cfg, channel))
        ledger = _ledger(plan.privacy) if plan.privacy is not None else None
        return _setup(cfg, "search", plan, ledger, ledger is not None, plan, None,
                      partial(search_space(cfg.space.kind).build_supernet, cfg.space, seed=cfg.seed))

    @staticmethod
    def final_attrs(outcome: SearchOutcome | None) -> dict[str, Any]:
        """The root attrs the search's end writes: its final genotype (none on a failure or an interruption)."""
        return {"final_genotype": None if outcome is None or outcome.interrupted else outcome.genotype}

    def __init__(self, cfg: Config, channel: Channel, setup: StageSetup, log: RunLog | None) -> None:
        super().__init__(cfg, channel, setup, log,
                         search_server(setup.model, cfg.search, setup.selector.select, setup.plan.steps_per_epoch,
                                       adadp_settings(cfg) if cfg.search.w_optimizer == "adadp" else None))
        self.warmup_epochs = cfg.search.warmup_epochs

    def load_state_dict(self, checkpoint: dict) -> None:
        """Restore the stage's accumulated statistics from rank 0's checkpoint."""
        self.acc = _Accumulator.from_state(checkpoint["accumulator"])

    def evaluate(self) -> np.ndarray:
        test = super().evaluate()
        if self.log is not None:
            soft = self.server.alpha_softmax()
            self.log.append_epoch(soft["normal"], soft["reduce"], self.server.genotype().to_string())
        return test

    def row(self, step: int, epoch: int, test: np.ndarray | None) -> dict[str, float]:
        acc = self.acc  # the row's steps (the base row starts a new accumulator)
        timings = {"step_seconds": acc.wall / acc.steps, "comm_seconds": acc.comm / acc.steps,
                   "party_seconds": (acc.train[3] + acc.val[3]) / self.channel.parties / acc.steps
                   if acc.train[2] > 0 else math.nan}
        if self.charging is not None:  # a step's duration tracks its realised Poisson batch size: not released
            timings = dict.fromkeys(timings, math.nan)
        return {**super().row(step, epoch, test), **_rates("val", acc.val), **timings}

    def checkpoint(self, step: int) -> dict:
        state = super().checkpoint(step)
        return {**state, "shard_sizes": self.plan.shard_sizes, "accumulator": self.acc.state_dict(),
                "log_rows": state["log_rows"] or [0, 0, 0, 0]}

    def result(self, stopped: str | None, test: np.ndarray, **common: Any) -> SearchOutcome:
        server, ledger = self.server, self.charging
        val = np.full(3, np.nan, dtype=np.float32)
        if ledger is None and stopped is None:  # under DP the parties' validation accuracy is not released
            val[:] = 0
            self.channel.reduce_sum(np.zeros(3, dtype=np.float32), val)  # Σ_k [loss_sum, correct, count] on D_k^val
        outcome = SearchOutcome(parties=self.channel.parties, **_rates("val", val), test_acc=ratio(test[1], test[2]),
                                genotype=server.genotype().to_string(), w=server.w_buffer.copy(),
                                a=server.a_buffer.copy(), shard_sizes=self.plan.shard_sizes,
                                selection_state=self.selector.summary() if self.selector is not None else None,
                                **common)
        outcome.alpha_entropy, outcome.alpha_margin = server.alpha_movement()
        if ledger is not None:
            outcome.mu_gdp, outcome.ledger_state = ledger.mu_gdp(), ledger.state_dict()
        return outcome


class AugmentStage(ServedStage):
    """The augmentation as a stage of :class:`~mpi_fnas.federation.server_loop.ServerLoop`: one weight update per
    iteration (with or without the server's selection), the test evaluation at epoch ends, its metrics row, ε rows
    at epoch ends only (each costs rank 0 a PLD composition of both stages per distinct ledger, ~0.5 s of CPU on the
    background thread, CPU the parties need when ranks outnumber cores) and its checkpoint."""

    name = "augment"
    lr_column = "lr"
    epsilon_each_row = False
    row_at_control = False

    @staticmethod
    def plan(cfg: Config, channel: Channel, searched: dict, assignments=None) -> StageSetup:
        """Plan the augmentation on rank 0: the network, its pool, steps and releases (continuing the search's
        ledgers)."""
        # The job's privacy plan covers a search exactly when one ran: the same job's, or --augment's finished one
        # (none for augment.genotype, or for a hand-designed augment.network, which needs no cell).
        search_plan = plan_run(cfg, channel.parties, search=searched.get("genotype") is not None,
                               local_sizes=gather_inventory(cfg, channel))
        if searched.get("shard_sizes") not in (None, search_plan.shard_sizes):
            # The search's ledgers were charged at the rates of its shards; a pool of other shards would be
            # charged at rates that are not its own (a party's folder changed between the two jobs, say).
            raise SetupError("--augment: the parties' shards differ from the search's (shard sizes "
                             f"{search_plan.shard_sizes}, the search had {searched['shard_sizes']}): the ledgers it "
                             "left cannot be continued; augment with the data the search used")
        genotype = None  # a hand-designed network: no cell (a search's, if any, is not used)
        if trains_cell(cfg):
            where = "augment.genotype" if cfg.augment.genotype else "the searched genotype"
            genotype = parse_genotype(cfg.augment.genotype or searched.get("genotype"), where, cfg.space)
        # Under dpfnas the search's ledgers continue (with augment.private: false they only report the search's ε).
        ledger = _ledger(search_plan.privacy) if search_plan.privacy is not None else None
        if ledger is not None and searched.get("ledger") is not None:
            ledger.load_state_dict(searched["ledger"])
        private = ledger is not None and augment_is_private(cfg)
        params = search_plan.privacy.params if search_plan.privacy is not None else None
        plan = plan_augment_stage(cfg, search_plan.assignments, genotype, ledger if private else None, params)
        if private:
            ledger.start_augment(plan.releases)  # a resume then loads the checkpointed ledgers over this
        return _setup(cfg, "augment", plan, ledger, private, search_plan, searched.get("selection"),
                      partial(augment_network, cfg, genotype, seed=cfg.seed))

    @staticmethod
    def open_log(cfg: Config, run_dir: Path, setup: StageSetup, resume: dict | None,
                 ranks: dict[str, list[str]]) -> RunLog:
        """The search's log, reopened for its ``/augment`` group (created first when the job did not search)."""
        plan: AugmentPlan = setup.plan
        path = run_dir / "search.h5"
        if not path.exists():  # no search; the log still says so, and where the genotype came from
            log = open_search_log(cfg, run_dir, setup, None, ranks)
            reason = ("no search: augment.genotype was given" if plan.genotype is not None else
                      f"no search: augment.network {plan.network} is hand-designed (no cell)")
            log.search.finish("finished", reason=reason, final_genotype=plan.genotype_text)
        log = RunLog.reopen(path, augment=True)
        # the pool's rate (its train records'; its validation records' are the same or 0: augment.pool)
        privacy = StagePrivacy(delta=setup.ledger.plan.delta, releases={"W": plan.releases.release},
                               sample_rates={"W": plan.releases.sample_rate_train}) if setup.private else None
        log.begin_augment(network=plan.network, genotype=plan.genotype_text, params=setup.model.num_params(),
                          private=setup.private, privacy=privacy, parties=len(plan.assignments),
                          privacy_guarantee=setup.guarantee, selection=selection_schema(cfg, setup.selector))
        if resume is not None:
            log.augment.truncate(*resume["log_rows"])
        return log

    @staticmethod
    def final_attrs(outcome: AugmentOutcome | None) -> dict[str, Any]:
        """The ``/augment`` attrs its end writes: the final test accuracy (NaN on a failure) and, under DP, the
        augmentation's ε alone."""
        return {"test_acc": math.nan if outcome is None else outcome.test_acc,
                "epsilon_alone": None if outcome is None else outcome.epsilon_alone}

    def __init__(self, cfg: Config, channel: Channel, setup: StageSetup, log: RunLog | None) -> None:
        super().__init__(cfg, channel, setup, log,
                         augment_server(setup.model, cfg.augment, setup.selector.select, setup.plan.steps,
                                        adadp_settings(cfg, private=setup.private)
                                        if cfg.augment.optimizer == "adadp" else None))

    def load_state_dict(self, checkpoint: dict) -> None:
        """Restore the stage's accumulated statistics from rank 0's checkpoint."""
        self.acc = _Accumulator(train=np.asarray(checkpoint["stats"], dtype=np.float64))
        self.test_acc, self.test_loss = checkpoint["test_acc"], checkpoint["test_loss"]

    def checkpoint(self, step: int) -> dict:
        return {**super().checkpoint(step), "network": self.plan.network, "genotype": self.plan.genotype_text,
                "stats": self.acc.train.tolist(), "test_acc": self.test_acc, "test_loss": self.test_loss}

    def result(self, stopped: str | None, test: np.ndarray, **common: Any) -> AugmentOutcome:
        ledger = self.setup.ledger
        return AugmentOutcome(network=self.plan.network, genotype=self.plan.genotype_text,
                              params=self.setup.model.num_params(),
                              test_acc=self.test_acc, test_loss=self.test_loss, private=self.setup.private,
                              release=self.plan.releases.release if self.setup.private else None,
                              composed_with_search=ledger is not None and bool(ledger.charged_steps("search").any()),
                              **common)


#: The stage definitions :func:`serve` runs, by name.
STAGES: dict[str, type[SearchStage] | type[AugmentStage]] = {"search": SearchStage, "augment": AugmentStage}


@dataclass
class _Accumulator:
    """Sums StepStats between two logged rows: [loss_sum, correct, count, compute_seconds] of the W rounds (train)
    and of the A round (val), the steps, and rank 0's wall and communication seconds."""

    train: np.ndarray = field(default_factory=lambda: np.zeros(4))
    val: np.ndarray = field(default_factory=lambda: np.zeros(4))
    steps: int = 0
    wall: float = 0.0
    comm: float = 0.0

    def add(self, stats: StepStats, wall: float, comm: float) -> None:
        self.train += stats.train
        self.val += stats.val
        self.steps += 1
        self.wall += wall
        self.comm += comm

    def state_dict(self) -> dict:
        return {"train": self.train.tolist(), "val": self.val.tolist(), "steps": self.steps, "wall": self.wall,
                "comm": self.comm}

    @classmethod
    def from_state(cls, state: dict) -> _Accumulator:
        return cls(np.array(state["train"]), np.array(state["val"]), int(state["steps"]), float(state["wall"]),
                   float(state["comm"]))
