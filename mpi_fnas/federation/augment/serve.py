"""Rank 0's side of the augmentation: set the parties up, run the iterations, log, checkpoint and report.

Setup mirrors the search's: plan (:mod:`.plan`) and scatter each party its assignment (or the setup error), agree
on devices, charge the augment iterations a party sent beyond the ledger's count (replays after a crash), open the
log's ``/augment`` group and broadcast the initial weights. Then :mod:`.algorithm`'s iterations.

The privacy ledgers are the search's, continued: every augment release is charged on the ledgers of the records
it may touch, so the ε logged in ``/augment/privacy/epsilon`` is the composition of both stages per party. With a
selection the server gathers every release and averages the K′ it chooses (docs/secprobe.md); the selection's ε
on the aux set continues the search's draws (``/augment/privacy/selection_epsilon``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.federation.adadp import adadp_settings
from mpi_fnas.federation.algorithm import ServerBuffers, server_iteration
from mpi_fnas.federation.augment.plan import AugmentPlan, parse_genotype, plan_augment_stage
from mpi_fnas.federation.aux_set import open_aux_set
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.handshake import hand_out, refuse_setup
from mpi_fnas.federation.inventory import gather_inventory
from mpi_fnas.federation.plan import RunPlan, SetupError, augment_is_private, open_split, plan_run
from mpi_fnas.federation.selection import Selector, selection_stream
from mpi_fnas.federation.serve import open_search_log, selection_schema
from mpi_fnas.federation.server import Server, augment_server
from mpi_fnas.federation.server_loop import ServerLoop, ratio
from mpi_fnas.federation.stage import attempt_cost, settle_privacy
from mpi_fnas.privacy.ledger import EpsilonRow, FederationLedger
from mpi_fnas.runlog import RunLog, StagePrivacy
from mpi_fnas.space import search_space

STAGE = "augment"


@dataclass
class AugmentOutcome:
    """Rank 0's result of the augmentation."""

    genotype: str
    params: int  # parameters of the network without the auxiliary head (Table 1's "Params")
    epochs: int
    steps: int
    test_acc: float
    test_loss: float
    wall_seconds: float
    stop_reason: str
    private: bool  # the releases were DP (dpfnas with augment.private)
    mode: str
    interrupted: bool = False
    epsilon: np.ndarray | None = None  # (K,) ε of search + augmentation composed (DP only)
    delta: np.ndarray | None = None
    privacy_guarantee: str = "holds"
    log_path: Path | None = None


def serve_augment(cfg: Config, channel: Channel, run_dir: Path, *, searched: dict, resume: dict | None = None,
                  progress: Callable[[int, int, dict[str, float]], None] | None = None,
                  stop_requested: Callable[[], str | None] = lambda: None) -> AugmentOutcome:
    """Run the server's side of the augmentation.

    `searched`: the search's result (``genotype``, its final ``ledger`` state or None; see
    :func:`mpi_fnas.federation.job.searched_state`). `resume`: the augmentation's own checkpoint to continue from.
    """
    start = time.perf_counter()
    try:
        search_plan = plan_run(cfg, channel.parties, search=cfg.augment.genotype is None,
                               local_sizes=gather_inventory(cfg, channel))
        where = "augment.genotype" if cfg.augment.genotype else "the searched genotype"
        genotype = parse_genotype(cfg.augment.genotype or searched["genotype"], where, cfg.space.kind)
        # Under dpfnas the search's ledgers continue (with augment.private: false they only report the search's ε).
        ledger = None
        if search_plan.privacy is not None:
            ledger = FederationLedger(search_plan.privacy)
            if searched.get("ledger") is not None:
                ledger.load_state_dict(searched["ledger"])
        private = ledger is not None and augment_is_private(cfg)
        params = search_plan.privacy.params if search_plan.privacy is not None else None
        plan = plan_augment_stage(cfg, search_plan.assignments, genotype, ledger if private else None, params)
        test = open_split(cfg, "test")
        selector, aux = _selection(cfg, search_plan, searched.get("selection"))
        if resume is not None:
            _attach_resume(plan, resume)
    except SetupError as exc:
        refuse_setup(channel, str(exc))
        raise
    reports = hand_out(channel, plan.assignments)
    devices, gpus = reports.devices, reports.gpus
    if ledger is not None and resume is not None:
        ledger.load_state_dict(resume["ledger"])
    if private:
        assert ledger is not None and plan.releases is not None
        if resume is None:
            ledger.start_augment(plan.releases)
        ledger.charge_sent(reports.sent_steps, stage="augment")
    model = search_space(cfg.space.kind).build_augment_network(genotype, cfg, seed=cfg.seed,
                                                               in_channels=test.in_channels,
                                                               num_classes=test.num_classes)
    guarantee = search_plan.privacy.params.guarantee if private else _no_guarantee(cfg)
    log = _open_log(cfg, run_dir, search_plan, plan, model.num_params(), ledger if private else None, resume, devices,
                    guarantee, selector is not None)
    outcome = AugmentOutcome(
        genotype=genotype.to_string(), params=model.num_params(), epochs=math.ceil(plan.steps / plan.steps_per_epoch),
        steps=plan.steps, test_acc=math.nan, test_loss=math.nan, wall_seconds=0.0, stop_reason=plan.stop_reason,
        private=private, mode=cfg.mode, privacy_guarantee=guarantee, log_path=log.path,
    )
    loop: ServerLoop | None = None
    try:
        server = augment_server(model, cfg.augment, selector.select if selector is not None else channel.parties,
                                plan.steps,
                                adadp_settings(cfg, private=private) if cfg.augment.optimizer == "adadp" else None)
        if resume is not None:
            server.load_state_dict(resume["server"])
            if selector is not None and resume.get("selection") is not None:
                selector.load_state_dict(resume["selection"])  # its window, draw count (both stages) and coins
        channel.bcast(server.w_buffer)
        stage = AugmentStage(cfg, channel, server, plan, ledger, private, log, outcome,
                             test.render(np.arange(len(test.labels))))
        if selector is not None:
            stage.selecting(selector, *aux)
        first = 1
        if resume is not None:
            first = int(resume["step"]) + 1
            stage.stats = np.asarray(resume["stats"], dtype=np.float64)
            outcome.test_acc, outcome.test_loss = resume["test_acc"], resume["test_loss"]
        loop = ServerLoop(stage, cfg, channel, log, progress, run_dir, stop_requested)
        step, stopped = loop.run(first)
        if stopped is not None:
            outcome.stop_reason = f"interrupted by {stopped}: checkpointed at step {step}"
            outcome.interrupted, outcome.steps = True, step
    except BaseException as exc:
        if loop is not None and private:
            loop.settle_failure()
        elif ledger is not None and private:
            settle_privacy(ledger, int(resume["step"]) if resume is not None else 0, None)
        elif ledger is not None:
            ledger.close()
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        log.augment.finish(status, reason=f"{type(exc).__name__}: {exc}".splitlines()[0],
                           cost=attempt_cost(time.perf_counter() - start, channel.size, gpus), test_acc=math.nan)
        raise
    if ledger is not None:
        outcome.epsilon, outcome.delta = ledger.epsilons(), search_plan.privacy.delta
        ledger.close()
    outcome.wall_seconds = time.perf_counter() - start  # one reading for the summary and /augment/cost
    log.augment.finish("interrupted" if outcome.interrupted else "finished", reason=outcome.stop_reason,
                       test_acc=outcome.test_acc, cost=attempt_cost(outcome.wall_seconds, channel.size, gpus))
    if outcome.interrupted:
        channel.barrier()  # the parties exit only once the checkpoint and the log are on disk
    return outcome


def _selection(cfg: Config, search_plan: RunPlan,
               searched: dict | None) -> tuple[Selector | None, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """The augmentation's selector (None for ``all``), continuing the search's draws (`searched`: its
    ``Selector.summary``), and the aux set it scores on ((None, None) unless secprobe). SetupError when the
    search drew at another ε_EM or K′."""
    if cfg.federation.selection == "all":
        return None, (None, None)
    selector = Selector(cfg.federation, len(search_plan.assignments), selection_stream(cfg, STAGE),
                        search_plan.unreliable)
    try:
        selector.continue_after(searched)
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    if not selector.scores_needed:
        return selector, (None, None)
    return selector, open_aux_set(cfg, open_split(cfg, "train"))


def _no_guarantee(cfg: Config) -> str:
    if cfg.mode == "dpfnas":
        return ("none: augment.private is false, so the augmentation used exact gradients and the final weights are "
                "NOT private; ε covers the search only")
    return f"none: mode {cfg.mode} makes no privacy claim"


def _attach_resume(plan: AugmentPlan, checkpoint: dict) -> None:
    if checkpoint["plan_steps"] != plan.steps or checkpoint["genotype"] != plan.genotype.to_string():
        raise SetupError("--resume: the augmentation checkpoint was written by a run with a different plan "
                         f"({checkpoint['plan_steps']} steps, genotype {checkpoint['genotype']})")
    for assignment in plan.assignments:
        assignment.checkpoint_step = int(checkpoint["step"])


def _open_log(cfg: Config, run_dir: Path, search_plan: RunPlan, plan: AugmentPlan, params: int,
              ledger: FederationLedger | None, resume: dict | None, devices: list[str], guarantee: str,
              selecting: bool) -> RunLog:
    """The search's log, reopened for its ``/augment`` group (created first when the job did not search);
    `selecting`: with ``/augment/selection``."""
    path = run_dir / "search.h5"
    if not path.exists():  # augment.genotype: no search; the log still says so, and where the genotype came from
        log = open_search_log(cfg, run_dir, search_plan, None, devices, guarantee)
        log.search.finish("finished", reason="no search: augment.genotype was given",
                          final_genotype=plan.genotype.to_string())
    log = RunLog.reopen(path, augment=True)
    privacy = None
    if ledger is not None and plan.releases is not None:
        # the pool's rate (its train records'; its validation records' are the same or 0: augment.pool)
        privacy = StagePrivacy(delta=ledger.plan.delta, releases={"W": plan.releases.release},
                               sample_rates={"W": plan.releases.sample_rate_train})
    log.begin_augment(genotype=plan.genotype.to_string(), params=params, private=ledger is not None,
                      privacy=privacy, parties=len(plan.assignments), privacy_guarantee=guarantee,
                      selection=selection_schema(cfg, search_plan) if selecting else None)
    if resume is not None:
        log.augment.truncate(*resume["log_rows"])
    return log


class AugmentStage:
    """The augmentation as a stage of :class:`~mpi_fnas.federation.server_loop.ServerLoop`: one weight update per
    iteration (with or without the server's selection), the test evaluation at epoch ends, its metrics row, ε rows
    at epoch ends only (each costs rank 0 a PLD composition of both stages per distinct ledger, ~0.5 s of CPU on the
    background thread, CPU the parties need when ranks outnumber cores) and its checkpoint."""

    name = STAGE
    epsilon_each_row = False
    row_at_control = False

    def __init__(self, cfg: Config, channel: Channel, server: Server, plan: AugmentPlan,
                 ledger: FederationLedger | None, private: bool, log: RunLog, outcome: AugmentOutcome,
                 test: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.cfg, self.channel, self.server, self.plan, self.log = cfg, channel, server, plan, log
        self.outcome, self.test = outcome, test
        self.steps, self.steps_per_epoch = plan.steps, plan.steps_per_epoch
        self.ledger = ledger  # checkpointed as it is (under dpfnas: the search's, continued)
        self.charging = ledger if private else None  # the ledger the augment releases are charged on
        self.stats = np.zeros(4)
        self.buffers = ServerBuffers(server.w.numel(), None)
        self.selector: Selector | None = None
        self.aux: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def selecting(self, selector: Selector, x_aux: torch.Tensor | None, y_aux: torch.Tensor | None) -> None:
        """Run the iterations with the server's selection (federation.selection random, secprobe or oracle)."""
        self.selector, self.aux = selector, (x_aux, y_aux)
        self.buffers = ServerBuffers(self.server.w.numel(), None, gathered_parties=self.channel.parties)

    def iterate(self, step: int, epoch: int, control: int) -> None:
        self.server.begin_step(step)
        out = server_iteration(self.server, self.channel, self.buffers, control, selector=self.selector,
                               aux=self.aux)
        if self.selector is not None:
            self.log.augment.append_selection(step, out.chosen, out.score, self.selector.epsilon_spent())
        self.stats += out.train

    def charge(self) -> None:
        self.charging.record_augment_step()

    def evaluate(self) -> np.ndarray:
        test = self.server.evaluate(*self.test)
        self.outcome.test_loss, self.outcome.test_acc = ratio(test[0], test[2]), ratio(test[1], test[2])
        return test

    def row(self, step: int, epoch: int, test: np.ndarray | None) -> dict[str, float]:
        # Under DP the parties send no statistics: counts stay 0 and the train columns are NaN.
        lr, adadp_err = self.server.log_values()
        row = {
            "step": step, "epoch": epoch,
            "train_loss": ratio(self.stats[0], self.stats[2]), "train_acc": ratio(self.stats[1], self.stats[2]),
            "test_loss": ratio(test[0], test[2]) if test is not None else math.nan,
            "test_acc": ratio(test[1], test[2]) if test is not None else math.nan,
            "lr": lr, "adadp_err": adadp_err,
        }
        self.stats[:] = 0
        return row

    def log_privacy(self, row: EpsilonRow) -> None:
        self.log.augment.append_privacy(row.step, row.augment_steps, row.epsilon, row.mu_gdp)

    def checkpoint(self, step: int) -> dict:
        return {
            "stage": STAGE, "step": step, "plan_steps": self.plan.steps, "genotype": self.plan.genotype.to_string(),
            "config": self.cfg.to_yaml(), "server": self.server.state_dict(),
            "ledger": self.ledger.state_dict() if self.ledger is not None else None,
            "stats": self.stats.tolist(), "test_acc": self.outcome.test_acc, "test_loss": self.outcome.test_loss,
            "selection": self.selector.state_dict() if self.selector is not None else None,
            "log_rows": list(self.log.augment.row_counts()),
        }


