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

from mpi_fnas.checkpoint import save_checkpoint
from mpi_fnas.config import Config
from mpi_fnas.federation.adadp import adadp_settings
from mpi_fnas.federation.algorithm import (
    GatherBuffers,
    SelectedStepStats,
    ServerBuffers,
    StepStats,
    server_iteration,
    server_iteration_selecting,
)
from mpi_fnas.federation.aux_set import open_aux_set
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.handshake import hand_out, refuse_setup
from mpi_fnas.federation.inventory import gather_inventory
from mpi_fnas.federation.plan import RunPlan, SetupError, attach_resume, open_split, plan_run
from mpi_fnas.federation.selection import Selector, selection_stream
from mpi_fnas.federation.server import Server
from mpi_fnas.federation.stage import (
    CONTINUE,
    STOP,
    StepControl,
    attempt_cost,
    charge_in_flight,
    in_flight_after,
    settle_privacy,
)
from mpi_fnas.privacy.accountant import PrivacyLedger
from mpi_fnas.privacy.budget import FederationLedger, PrivacyPlan
from mpi_fnas.runlog import SEARCH_METRICS, PrivacySchema, RunLog, SelectionSchema
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
    loop: _ServerLoop | None = None
    try:
        selector = Selector(cfg.federation, channel.parties, selection_stream(cfg, "search"),
                            plan.unreliable)
        supernet = search_space(cfg.space.kind).build_supernet(cfg.space, seed=cfg.seed, in_channels=test.in_channels,
                                                               num_classes=test.num_classes)
        server = Server(supernet, cfg.search, selector.select,
                        adadp_settings(cfg) if cfg.search.w_optimizer == "adadp" else None)
        if resume is not None:
            server.load_state_dict(resume["server"])
            if resume.get("selection") is not None:
                selector.load_state_dict(resume["selection"])
        channel.bcast(server.w_buffer)
        channel.bcast(server.a_buffer)
        x_test, y_test = test.render(np.arange(len(test.labels)))
        loop = _ServerLoop(cfg, channel, server, plan, ledger, log, progress, run_dir, stop_requested)
        if plan.assignments[0].gathered:
            loop.selecting(selector, *(open_aux_set(cfg, open_split(cfg, "train")) if selector.scores_needed
                                       else (None, None)))
        outcome = loop.run(x_test, y_test, resume, start)
        outcome.privacy_guarantee = guarantee
    except BaseException as exc:
        if ledger is not None:
            recorded = loop.recorded_step if loop is not None else int(resume["step"]) if resume is not None else 0
            # The step the parties were in may have been sent by some of them: charge it (docs/privacy.md §2.5).
            last = charge_in_flight(ledger.record_step, recorded, loop.in_flight_step if loop is not None else None)
            settle_privacy(ledger, last, None if log is None else lambda row: log.search.append_privacy(
                row.step, row.charged_steps, row.epsilon, row.mu_gdp))
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


def _privacy_schema(plan: PrivacyPlan) -> PrivacySchema:
    return PrivacySchema(
        delta=plan.delta, accountant=PrivacyLedger().description(),
        sample_rate_train=plan.sample_rate_train, sample_rate_val=plan.sample_rate_val,
        noise_multiplier_w=plan.params.noise_multiplier_w, noise_multiplier_a=plan.params.noise_multiplier_a,
        clip_w=plan.params.clip_w, clip_a=plan.params.clip_a,
    )


class _ServerLoop:
    """The iterations on rank 0, with their logging and checkpoints."""

    def __init__(self, cfg: Config, channel: Channel, server: Server, plan: RunPlan, ledger: FederationLedger | None,
                 log: RunLog | None, progress, run_dir: Path | None, stop_requested: Callable[[], str | None]) -> None:
        self.cfg, self.channel, self.server, self.plan = cfg, channel, server, plan
        self.ledger, self.log, self.progress, self.run_dir = ledger, log, progress, run_dir
        self.control = StepControl("search", plan.steps, cfg.checkpoint.every_steps, stop_requested)
        self.acc = _Accumulator()
        self.epsilon_so_far = math.nan
        self.recorded_step = 0  # the last iteration the ledger has recorded (a failure's last ε row is labelled so)
        self.in_flight_step: int | None = None  # the iteration whose releases the parties may be sending now
        self.selector: Selector | None = None
        self.aux: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def selecting(self, selector: Selector, x_aux: torch.Tensor | None, y_aux: torch.Tensor | None) -> None:
        """Run the iterations with the server's selection (federation.selection random or secprobe)."""
        self.selector, self.aux = selector, (x_aux, y_aux)

    def run(self, x_test: torch.Tensor, y_test: torch.Tensor, resume: dict | None, start: float) -> SearchOutcome:
        cfg, channel, server, plan = self.cfg, self.channel, self.server, self.plan
        buffers = ServerBuffers(server.w.numel(), server.a.numel())
        gathered = GatherBuffers(channel.parties, server.w.numel(), server.a.numel()) if self.selector else None
        second_order = cfg.search.order == "second_order"
        first = 1
        if resume is not None:
            first = int(resume["step"]) + 1
            self.acc.load_state_dict(resume["accumulator"])
        test_stats = np.full(3, np.nan)
        stop_reason, interrupted, step = plan.stop_reason, False, first - 1
        self.recorded_step = step
        self.in_flight_step = first if first <= plan.steps else None  # the parties start once W and A are broadcast
        for step in range(first, plan.steps + 1):
            epoch = (step - 1) // plan.steps_per_epoch
            if (step - 1) % plan.steps_per_epoch == 0:
                server.start_epoch(epoch)
            control, signal_name = self.control.at(step)
            t0, c0 = time.perf_counter(), channel.comm_seconds
            train_a = epoch >= cfg.search.warmup_epochs  # the warm-up trains W only
            if self.selector is not None:
                stats = server_iteration_selecting(server, channel, gathered, self.selector, *self.aux, control,
                                                   train_a)
                self._log_selection(step, stats)
            else:
                stats = server_iteration(server, channel, buffers, second_order, control, train_a)
            if self.ledger is not None:
                self.ledger.record_step()
            self.recorded_step = step
            self.in_flight_step = in_flight_after(step, plan.steps, control)
            self.acc.add(stats, time.perf_counter() - t0, channel.comm_seconds - c0)
            epoch_end = step % plan.steps_per_epoch == 0 or step == plan.steps
            if epoch_end:
                test_stats = server.evaluate(x_test, y_test)
                if self.log is not None:
                    soft = server.alpha_softmax()
                    self.log.search.append_epoch(soft["normal"], soft["reduce"], server.genotype().to_string())
            if step % cfg.runtime.log_every == 0 or epoch_end or control != CONTINUE:
                self._log_row(step, epoch, test_stats if epoch_end else None)
            elif self.log is not None:
                self.log.heartbeat()
            self._write_privacy_rows(wait=False)
            if control != CONTINUE:
                self._checkpoint(step)
                if control == STOP:
                    stop_reason, interrupted = f"interrupted by {signal_name}: checkpointed at step {step}", True
                    break
        self._write_privacy_rows(wait=True)
        val = np.full(3, np.nan, dtype=np.float32)
        if self.ledger is None and not interrupted:  # under DP the parties' validation accuracy is not released
            val[:] = 0
            channel.reduce_sum(np.zeros(3, dtype=np.float32), val)  # Σ_k [loss_sum, correct, count] on D_k^val
        outcome = SearchOutcome(
            mode=cfg.mode, parties=channel.parties, epochs=math.ceil(plan.steps / plan.steps_per_epoch),
            steps=step, val_acc=_ratio(val[1], val[2]), val_loss=_ratio(val[0], val[2]),
            test_acc=_ratio(test_stats[1], test_stats[2]), genotype=server.genotype().to_string(),
            wall_seconds=time.perf_counter() - start, log_path=self.log.path if self.log is not None else None,
            stop_reason=stop_reason, w=server.w_buffer.copy(), a=server.a_buffer.copy(), interrupted=interrupted,
        )
        outcome.alpha_entropy, outcome.alpha_margin = server.alpha_movement()
        if self.ledger is not None:
            outcome.epsilon, outcome.mu_gdp = self.ledger.epsilons(), self.ledger.mu_gdp()
            outcome.delta = plan.privacy.delta
            outcome.ledger_state = self.ledger.state_dict()
        if self.selector is not None:
            outcome.selection_state = self.selector.summary()
            self.ledger.close()
        return outcome

    def _log_row(self, step: int, epoch: int, test_stats: np.ndarray | None) -> None:
        row = self.acc.row(step, epoch, self.channel.parties, *self.server.w_log_values())
        if self.ledger is not None:  # a step's duration tracks its realised Poisson batch size: not released
            for column in TIMING_COLUMNS:
                row[column] = math.nan
            self.ledger.submit(step)
        if test_stats is not None:
            row["test_loss"] = _ratio(test_stats[0], test_stats[2])
            row["test_acc"] = _ratio(test_stats[1], test_stats[2])
        if self.log is not None:
            self.log.search.append_metrics(row)
        if self.progress is not None:
            self._write_privacy_rows(wait=step == self.plan.steps)  # the last line shows the final ε
            shown = dict(row)
            if self.ledger is not None:
                shown["epsilon"] = self.epsilon_so_far
            self.progress(step, self.plan.steps, shown)

    def _log_selection(self, step: int, stats: SelectedStepStats) -> None:
        if self.log is not None:
            self.log.search.append_selection(step, stats.chosen, stats.score, self.selector.epsilon_spent())

    def _write_privacy_rows(self, wait: bool) -> None:
        """Log the ε rows the ledger's worker has finished (all of them with `wait`)."""
        if self.ledger is None:
            return
        for row in self.ledger.drain() if wait else self.ledger.ready():
            self.epsilon_so_far = float(np.max(row.epsilon))
            if self.log is not None:
                self.log.search.append_privacy(row.step, row.charged_steps, row.epsilon, row.mu_gdp)

    def _checkpoint(self, step: int) -> None:
        """Every party has saved its own state of this step (the gather is its acknowledgement); then rank 0's."""
        self.channel.gather_objects(None)
        self._write_privacy_rows(wait=True)
        if self.run_dir is None:
            return
        save_checkpoint(self.run_dir, {
            "stage": "search", "step": step, "plan_steps": self.plan.steps, "config": self.cfg.to_yaml(),
            "server": self.server.state_dict(), "shard_sizes": self.plan.shard_sizes,
            "ledger": self.ledger.state_dict() if self.ledger is not None else None,
            "accumulator": self.acc.state_dict(),
            "selection": self.selector.state_dict() if self.selector is not None else None,
            "log_rows": list(self.log.search.row_counts()) if self.log is not None else [0, 0, 0, 0],
        })


def _ratio(a: float, b: float) -> float:
    return float(a / b) if b > 0 else float("nan")


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
            "train_loss": _ratio(self.train[0], self.train[2]), "train_acc": _ratio(self.train[1], self.train[2]),
            "val_loss": _ratio(self.val[0], self.val[2]), "val_acc": _ratio(self.val[1], self.val[2]),
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
