"""Rank 0's side of a search: set the parties up, run the iterations, log, checkpoint, and report.

Setup: plan the run (:mod:`mpi_fnas.federation.plan`) and scatter each party its assignment (or the setup error,
so no party waits for a decision that never comes); agree on devices; learn from every party how many
iterations it has ever sent (non-zero only after a crash) and charge the replays; open the log; broadcast the
initial W and A. Then the iterations of :mod:`mpi_fnas.federation.algorithm`.

What rank 0 writes is public by construction: W, A, its optimizers, the test-split metrics it computes itself,
and ε, which depends only on public quantities and is computed by the ledger's worker thread while the parties
compute. Under DP no per-step timing is logged (a step's duration reveals the realised Poisson batch size).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.federation.adadp import adadp_settings
from mpi_fnas.federation.algorithm import ServerBuffers, StepStats, server_iteration
from mpi_fnas.federation.aux_set import open_aux_set
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.handshake import hand_out, refuse_setup
from mpi_fnas.federation.inventory import gather_inventory
from mpi_fnas.federation.plan import RunPlan, SetupError, attach_resume, open_split, plan_run
from mpi_fnas.federation.selection import Selector, selection_stream
from mpi_fnas.federation.server import Server, search_server
from mpi_fnas.federation.server_loop import ServerLoop, ratio
from mpi_fnas.federation.stage import attempt_cost, settle_privacy
from mpi_fnas.privacy.accountant import PrivacyLedger
from mpi_fnas.privacy.ledger import EpsilonRow, FederationLedger
from mpi_fnas.privacy.release import PrivacyPlan
from mpi_fnas.runlog import SEARCH_METRICS, RunLog, SelectionSchema, StagePrivacy
from mpi_fnas.space import search_space

TIMING_COLUMNS = ("step_seconds", "comm_seconds", "party_seconds")


@dataclass
class SearchOutcome:
    """Rank 0's result of a search."""

    mode: str
    parties: int
    epochs: int
    steps: int
    val_acc: float  # NaN under DP (not released)
    val_loss: float
    test_acc: float
    genotype: str
    wall_seconds: float
    log_path: Path | None
    stop_reason: str
    w: np.ndarray = field(repr=False)
    a: np.ndarray = field(repr=False)
    interrupted: bool = False  # stopped by a signal after writing a checkpoint
    epsilon: np.ndarray | None = None  # (K,) tight ε per party (DP only)
    mu_gdp: np.ndarray | None = None
    delta: np.ndarray | None = None
    privacy_guarantee: str = "holds"
    ledger_state: dict | None = None  # the privacy ledgers at the end (DP only): the augmentation continues them
    selection_state: dict | None = None  # the selection's draws (Selector.summary): the augmentation continues them
    alpha_entropy: float = float("nan")  # mean softmax entropy of A's edges / log(ops): 1 = uniform, not moved
    alpha_margin: float = float("nan")  # mean p_top − p_second over A's edges: 0 = uniform


def serve(cfg: Config, channel: Channel, run_dir: Path | None, *, assignments=None,
          progress: Callable[[int, int, dict[str, float]], None] | None = None, resume: dict | None = None,
          stop_requested: Callable[[], str | None] = lambda: None) -> SearchOutcome:
    """Run the server's side of the whole search (see :func:`mpi_fnas.federation.search.run_search`)."""
    start = time.perf_counter()
    try:
        plan = plan_run(cfg, channel.parties, assignments, local_sizes=gather_inventory(cfg, channel))
        test = open_split(cfg, "test")
        if resume is not None:
            attach_resume(plan, resume)
    except SetupError as exc:
        refuse_setup(channel, str(exc))
        raise
    reports = hand_out(channel, plan.assignments)
    devices, gpus = reports.devices, reports.gpus

    ledger = FederationLedger(plan.privacy) if plan.privacy is not None else None
    if ledger is not None:
        if resume is not None:
            ledger.load_state_dict(resume["ledger"])
        ledger.charge_sent(reports.sent_steps)
    guarantee = plan.privacy.params.guarantee if plan.privacy is not None else \
        f"none: mode {cfg.mode} makes no privacy claim"
    log = open_search_log(cfg, run_dir, plan, resume, devices, guarantee) if run_dir is not None else None
    loop: ServerLoop | None = None
    try:
        selector = Selector(cfg.federation, channel.parties, selection_stream(cfg, "search"),
                            plan.unreliable)
        supernet = search_space(cfg.space.kind).build_supernet(cfg.space, seed=cfg.seed, in_channels=test.in_channels,
                                                               num_classes=test.num_classes)
        server = search_server(supernet, cfg.search, selector.select, plan.steps_per_epoch,
                               adadp_settings(cfg) if cfg.search.w_optimizer == "adadp" else None)
        if resume is not None:
            server.load_state_dict(resume["server"])
            if resume.get("selection") is not None:
                selector.load_state_dict(resume["selection"])
        channel.bcast(server.w_buffer)
        channel.bcast(server.a_buffer)
        stage = SearchStage(cfg, channel, server, plan, ledger, log, test.render(np.arange(len(test.labels))))
        if plan.assignments[0].gathered:
            stage.selecting(selector, *(open_aux_set(cfg, open_split(cfg, "train")) if selector.scores_needed
                                        else (None, None)))
        first = 1
        if resume is not None:
            first = int(resume["step"]) + 1
            stage.acc.load_state_dict(resume["accumulator"])
        loop = ServerLoop(stage, cfg, channel, log, progress, run_dir, stop_requested)
        step, stopped = loop.run(first)
        outcome = _outcome(stage, loop.test, step, stopped, start)
        outcome.privacy_guarantee = guarantee
    except BaseException as exc:
        if loop is not None:
            loop.settle_failure()
        elif ledger is not None:
            settle_privacy(ledger, int(resume["step"]) if resume is not None else 0, None)
        if log is not None:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            cost = attempt_cost(time.perf_counter() - start, channel.size, gpus)
            log.search.finish(status, reason=f"{type(exc).__name__}: {exc}".splitlines()[0], cost=cost)
        raise
    # One clock reading serves both the printed summary and the log's /cost, so the two agree exactly.
    outcome.wall_seconds = time.perf_counter() - start
    if log is not None:
        log.search.finish("interrupted" if outcome.interrupted else "finished", reason=outcome.stop_reason,
                   final_genotype=None if outcome.interrupted else outcome.genotype,
                   cost=attempt_cost(outcome.wall_seconds, channel.size, gpus))
    if outcome.interrupted:
        channel.barrier()  # the parties exit only once the checkpoint and the log are on disk
    return outcome


def _outcome(stage: SearchStage, test: np.ndarray, step: int, stopped: str | None, start: float) -> SearchOutcome:
    """The search's result once its loop ended at `step` (`stopped`: the signal that stopped it, or None)."""
    cfg, channel, server, plan, ledger = stage.cfg, stage.channel, stage.server, stage.plan, stage.charging
    val = np.full(3, np.nan, dtype=np.float32)
    if ledger is None and stopped is None:  # under DP the parties' validation accuracy is not released
        val[:] = 0
        channel.reduce_sum(np.zeros(3, dtype=np.float32), val)  # Σ_k [loss_sum, correct, count] on D_k^val
    outcome = SearchOutcome(
        mode=cfg.mode, parties=channel.parties, epochs=math.ceil(plan.steps / plan.steps_per_epoch),
        steps=step, val_acc=ratio(val[1], val[2]), val_loss=ratio(val[0], val[2]),
        test_acc=ratio(test[1], test[2]), genotype=server.genotype().to_string(),
        wall_seconds=time.perf_counter() - start, log_path=stage.log.path if stage.log is not None else None,
        stop_reason=plan.stop_reason if stopped is None else f"interrupted by {stopped}: checkpointed at step {step}",
        w=server.w_buffer.copy(), a=server.a_buffer.copy(), interrupted=stopped is not None,
    )
    outcome.alpha_entropy, outcome.alpha_margin = server.alpha_movement()
    if ledger is not None:
        outcome.epsilon, outcome.mu_gdp = ledger.epsilons(), ledger.mu_gdp()
        outcome.delta = plan.privacy.delta
        outcome.ledger_state = ledger.state_dict()
    if stage.selector is not None:
        outcome.selection_state = stage.selector.summary()
        ledger.close()
    return outcome


def selection_schema(cfg: Config, plan: RunPlan) -> SelectionSchema | None:
    """The log's fixed facts of the selection (``/selection`` and ``/augment/selection`` attrs); None for ``all``."""
    fed = cfg.federation
    if fed.selection == "all":
        return None
    # Its constants only: the stream is never drawn from.
    selector = Selector(fed, len(plan.assignments), selection_stream(cfg, "search"), plan.unreliable)
    return SelectionSchema(selection=fed.selection, select=selector.select, epsilon_per_step=fed.selection_epsilon,
                           score_window=fed.score_window, aux_size=fed.aux_size, sensitivity=selector.sensitivity,
                           delta=selector.delta)


def open_search_log(cfg: Config, run_dir: Path, plan: RunPlan, resume: dict | None, devices: list[str],
                    guarantee: str) -> RunLog:
    """The run log: created, or reopened for a resumed search (rows after the checkpoint dropped)."""
    if resume is not None:
        log = RunLog.reopen(run_dir / "search.h5", rank_attrs={"devices": devices})
        log.search.truncate(*resume["log_rows"])
        return log
    space = search_space(cfg.space.kind)
    normal_shape, reduce_shape = space.alpha_shapes(cfg.space)
    return RunLog.create(
        run_dir / "search.h5", mode=cfg.mode, parties=len(plan.assignments), config_text=cfg.to_yaml(),
        metric_names=SEARCH_METRICS, alpha_shape=normal_shape, reduce_alpha_shape=reduce_shape, space=space.kind,
        genotype_length=space.max_genotype_length(cfg.space),
        privacy=_privacy_schema(plan.privacy) if plan.privacy is not None else None,
        rank_attrs={"devices": devices}, privacy_guarantee=guarantee,
        unreliable=plan.unreliable, corruption=cfg.federation.corruption, selection=selection_schema(cfg, plan),
    )


def _privacy_schema(plan: PrivacyPlan) -> StagePrivacy:
    """What ``/privacy`` records: the search's releases as the parties make them, and their shards' rates."""
    return StagePrivacy(delta=plan.delta, releases=plan.params.search_releases(plan.w_releases_per_step),
                        sample_rates={"W": plan.sample_rate_train, "A": plan.sample_rate_val},
                        accountant=PrivacyLedger().description())


class SearchStage:
    """The search as a stage of :class:`~mpi_fnas.federation.server_loop.ServerLoop`: Algorithm 1's iteration on
    rank 0 (with or without the server's selection), the epoch rows (alphas, genotype), the metrics row (timings
    NaN under DP: a step's duration tracks its realised Poisson batch size) and the checkpoint."""

    name = "search"
    epsilon_each_row = True
    row_at_control = True

    def __init__(self, cfg: Config, channel: Channel, server: Server, plan: RunPlan, ledger: FederationLedger | None,
                 log: RunLog | None, test: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.cfg, self.channel, self.server, self.plan, self.log, self.test = cfg, channel, server, plan, log, test
        self.steps, self.steps_per_epoch = plan.steps, plan.steps_per_epoch
        self.charging = ledger
        self.acc = _Accumulator()
        self.buffers = ServerBuffers(server.w.numel(), server.a.numel(),
                                     second_order=cfg.search.order == "second_order")
        self.selector: Selector | None = None
        self.aux: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def selecting(self, selector: Selector, x_aux: torch.Tensor | None, y_aux: torch.Tensor | None) -> None:
        """Run the iterations with the server's selection (federation.selection random, secprobe or oracle)."""
        self.selector, self.aux = selector, (x_aux, y_aux)
        self.buffers = ServerBuffers(self.server.w.numel(), self.server.a.numel(),
                                     gathered_parties=self.channel.parties)

    def iterate(self, step: int, epoch: int, control: int) -> None:
        t0, c0 = time.perf_counter(), self.channel.comm_seconds
        self.server.begin_step(step)
        stats = server_iteration(self.server, self.channel, self.buffers, control,
                                 train_a=epoch >= self.cfg.search.warmup_epochs,  # the warm-up trains W only
                                 selector=self.selector, aux=self.aux)
        if self.selector is not None and self.log is not None:
            self.log.search.append_selection(step, stats.chosen, stats.score, self.selector.epsilon_spent())
        self.acc.add(stats, time.perf_counter() - t0, self.channel.comm_seconds - c0)

    def charge(self) -> None:
        self.charging.record_step()

    def evaluate(self) -> np.ndarray:
        test = self.server.evaluate(*self.test)
        if self.log is not None:
            soft = self.server.alpha_softmax()
            self.log.search.append_epoch(soft["normal"], soft["reduce"], self.server.genotype().to_string())
        return test

    def row(self, step: int, epoch: int, test: np.ndarray | None) -> dict[str, float]:
        row = self.acc.row(step, epoch, self.channel.parties, *self.server.log_values())
        if self.charging is not None:  # a step's duration tracks its realised Poisson batch size: not released
            for column in TIMING_COLUMNS:
                row[column] = math.nan
        if test is not None:
            row["test_loss"], row["test_acc"] = ratio(test[0], test[2]), ratio(test[1], test[2])
        return row

    def log_privacy(self, row: EpsilonRow) -> None:
        self.log.search.append_privacy(row.step, row.charged_steps, row.epsilon, row.mu_gdp)

    def checkpoint(self, step: int) -> dict:
        return {
            "stage": "search", "step": step, "plan_steps": self.plan.steps, "config": self.cfg.to_yaml(),
            "server": self.server.state_dict(), "shard_sizes": self.plan.shard_sizes,
            "ledger": self.charging.state_dict() if self.charging is not None else None,
            "accumulator": self.acc.state_dict(),
            "selection": self.selector.state_dict() if self.selector is not None else None,
            "log_rows": list(self.log.search.row_counts()) if self.log is not None else [0, 0, 0, 0],
        }


class _Accumulator:
    """Sums StepStats between two logged rows."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.train = np.zeros(4)
        self.val = np.zeros(4)
        self.steps = 0
        self.wall = 0.0
        self.comm = 0.0

    def add(self, stats: StepStats, wall: float, comm: float) -> None:
        self.train += stats.train
        self.val += stats.val
        self.steps += 1
        self.wall += wall
        self.comm += comm

    def row(self, step: int, epoch: int, parties: int, w_lr: float, adadp_err: float) -> dict[str, float]:
        # Under DP the parties send no statistics: counts are 0 and the loss/accuracy columns are NaN.
        row = {
            "step": step, "epoch": epoch,
            "train_loss": ratio(self.train[0], self.train[2]), "train_acc": ratio(self.train[1], self.train[2]),
            "val_loss": ratio(self.val[0], self.val[2]), "val_acc": ratio(self.val[1], self.val[2]),
            "step_seconds": self.wall / self.steps, "comm_seconds": self.comm / self.steps,
            "party_seconds": (self.train[3] + self.val[3]) / parties / self.steps if self.train[2] > 0
            else float("nan"),
            "w_lr": w_lr, "adadp_err": adadp_err,
        }
        self.reset()
        return row

    def state_dict(self) -> dict:
        return {"train": self.train.tolist(), "val": self.val.tolist(), "steps": self.steps, "wall": self.wall,
                "comm": self.comm}

    def load_state_dict(self, state: dict) -> None:
        self.train, self.val = np.array(state["train"]), np.array(state["val"])
        self.steps, self.wall, self.comm = int(state["steps"]), float(state["wall"]), float(state["comm"])
