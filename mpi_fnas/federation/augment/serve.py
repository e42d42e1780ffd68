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

from mpi_fnas.checkpoint import save_checkpoint
from mpi_fnas.config import Config
from mpi_fnas.federation.adadp import adadp_settings
from mpi_fnas.federation.augment.algorithm import (
    AugmentBuffers,
    AugmentGatherBuffers,
    server_augment_iteration,
    server_augment_iteration_selecting,
)
from mpi_fnas.federation.augment.plan import AugmentPlan, parse_genotype, plan_augment_stage
from mpi_fnas.federation.augment.server import AugmentServer
from mpi_fnas.federation.aux_set import open_aux_set
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.handshake import hand_out, refuse_setup
from mpi_fnas.federation.inventory import gather_inventory
from mpi_fnas.federation.plan import RunPlan, SetupError, augment_is_private, open_split, plan_run
from mpi_fnas.federation.selection import Selector, selection_stream
from mpi_fnas.federation.serve import open_search_log, selection_schema
from mpi_fnas.federation.stage import (
    CONTINUE,
    STOP,
    StepControl,
    attempt_cost,
    charge_in_flight,
    in_flight_after,
    settle_privacy,
)
from mpi_fnas.privacy.budget import FederationLedger
from mpi_fnas.runlog import AugmentPrivacySchema, RunLog
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
    loop: _AugmentLoop | None = None
    try:
        server = AugmentServer(model, cfg.augment, selector.select if selector is not None else channel.parties,
                               plan.steps,
                               adadp_settings(cfg, private=private) if cfg.augment.optimizer == "adadp" else None)
        if resume is not None:
            server.load_state_dict(resume["server"])
            if selector is not None and resume.get("selection") is not None:
                selector.load_state_dict(resume["selection"])  # its window, draw count (both stages) and coins
        channel.bcast(server.w_buffer)
        x_test, y_test = test.render(np.arange(len(test.labels)))
        loop = _AugmentLoop(cfg, channel, server, plan, ledger, private, log, progress, run_dir, stop_requested)
        if selector is not None:
            loop.selecting(selector, *aux)
        loop.run(x_test, y_test, resume, outcome)
    except BaseException as exc:
        if ledger is not None and private:
            recorded = loop.recorded_step if loop is not None else int(resume["step"]) if resume is not None else 0
            # The step the parties were in may have been sent by some of them: charge it (docs/privacy.md §2.5).
            last = charge_in_flight(ledger.record_augment_step, recorded,
                                    loop.in_flight_step if loop is not None else None)
            settle_privacy(ledger, last, lambda row: log.augment.append_privacy(row.step, row.augment_steps,
                                                                               row.epsilon, row.mu_gdp))
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
        privacy = AugmentPrivacySchema(
            sample_rate=plan.releases.sample_rate_train, noise_multiplier=plan.releases.noise_multiplier,
            clip=plan.releases.clip, delta=ledger.plan.delta,
        )
    log.begin_augment(genotype=plan.genotype.to_string(), params=params, private=ledger is not None,
                      privacy=privacy, parties=len(plan.assignments), privacy_guarantee=guarantee,
                      selection=selection_schema(cfg, search_plan) if selecting else None)
    if resume is not None:
        log.augment.truncate(*resume["log_rows"])
    return log


class _AugmentLoop:
    """The iterations on rank 0, with their logging and checkpoints."""

    def __init__(self, cfg: Config, channel: Channel, server: AugmentServer, plan: AugmentPlan,
                 ledger: FederationLedger | None, private: bool, log: RunLog, progress, run_dir: Path,
                 stop_requested: Callable[[], str | None]) -> None:
        self.cfg, self.channel, self.server, self.plan = cfg, channel, server, plan
        self.log, self.progress, self.run_dir = log, progress, run_dir
        self.ledger = ledger  # checkpointed as it is (under dpfnas: the search's, continued)
        self.charging = ledger if private else None  # the ledger the augment releases are charged on
        self.control = StepControl(STAGE, plan.steps, cfg.checkpoint.every_steps, stop_requested)
        self.stats = np.zeros(4)
        self.epsilon_so_far = math.nan
        self.recorded_step = 0  # the last augment iteration the ledger has recorded (labels a failure's ε row)
        self.in_flight_step: int | None = None  # the iteration whose releases the parties may be sending now
        self.selector: Selector | None = None
        self.aux: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def selecting(self, selector: Selector, x_aux: torch.Tensor | None, y_aux: torch.Tensor | None) -> None:
        """Run the iterations with the server's selection (federation.selection random, secprobe or oracle)."""
        self.selector, self.aux = selector, (x_aux, y_aux)

    def _iteration(self, step: int, control: int, buffers: AugmentBuffers,
                   gathered: AugmentGatherBuffers | None) -> np.ndarray:
        """One iteration on rank 0 (Reduce, or Gather and select); its STATS; logs the selection row."""
        if self.selector is None:
            return server_augment_iteration(self.server, self.channel, buffers, step, control)
        assert gathered is not None
        out = server_augment_iteration_selecting(self.server, self.channel, gathered, self.selector, *self.aux, step,
                                                 control)
        self.log.augment.append_selection(step, out.chosen, out.score, self.selector.epsilon_spent())
        return out.stats

    def run(self, x_test: torch.Tensor, y_test: torch.Tensor, resume: dict | None, outcome: AugmentOutcome) -> None:
        plan, buffers = self.plan, AugmentBuffers(self.server.w.numel())
        gathered = AugmentGatherBuffers(self.channel.parties, self.server.w.numel()) if self.selector else None
        first = 1
        if resume is not None:
            first = int(resume["step"]) + 1
            self.recorded_step = first - 1
            self.stats = np.asarray(resume["stats"], dtype=np.float64)
            outcome.test_acc, outcome.test_loss = resume["test_acc"], resume["test_loss"]
        self.in_flight_step = first if first <= plan.steps else None  # the parties start once W is broadcast
        for step in range(first, plan.steps + 1):
            control, signal_name = self.control.at(step)
            self.stats += self._iteration(step, control, buffers, gathered)
            if self.charging is not None:
                self.charging.record_augment_step()
            self.recorded_step = step
            self.in_flight_step = in_flight_after(step, plan.steps, control)
            epoch_end = step % plan.steps_per_epoch == 0 or step == plan.steps
            test = None
            if epoch_end:
                test = self.server.evaluate(x_test, y_test)
                outcome.test_loss, outcome.test_acc = _ratio(test[0], test[2]), _ratio(test[1], test[2])
            if epoch_end or step % self.cfg.runtime.log_every == 0:
                self._log_row(step, test, epsilon_row=epoch_end)
            self._write_privacy_rows(wait=False)
            if control != CONTINUE:
                self._checkpoint(step, outcome)
                if control == STOP:
                    outcome.stop_reason = f"interrupted by {signal_name}: checkpointed at step {step}"
                    outcome.interrupted = True
                    outcome.steps = step
                    break
        self._write_privacy_rows(wait=True)

    def _log_row(self, step: int, test: np.ndarray | None, epsilon_row: bool) -> None:
        """One /augment/metrics row; with `epsilon_row` (epoch ends) also an /augment/privacy row.

        ε rows only at epoch ends: each costs rank 0 a PLD composition of both stages per distinct ledger (~0.5 s of
        CPU on the background thread), CPU the parties need when ranks outnumber cores.
        """
        # Under DP the parties send no statistics: counts stay 0 and the train columns are NaN.
        row = {
            "step": step, "epoch": (step - 1) // self.plan.steps_per_epoch,
            "train_loss": _ratio(self.stats[0], self.stats[2]), "train_acc": _ratio(self.stats[1], self.stats[2]),
            "test_loss": _ratio(test[0], test[2]) if test is not None else math.nan,
            "test_acc": _ratio(test[1], test[2]) if test is not None else math.nan,
            "lr": self.server.lr, "adadp_err": self.server.adadp_err,
        }
        self.stats[:] = 0
        if self.charging is not None and epsilon_row:
            self.charging.submit(step)
        self.log.augment.append_metrics(row)
        if self.progress is not None:
            self._write_privacy_rows(wait=step == self.plan.steps)
            shown = dict(row)
            if self.charging is not None:
                shown["epsilon"] = self.epsilon_so_far
            self.progress(step, self.plan.steps, shown)

    def _write_privacy_rows(self, wait: bool) -> None:
        if self.charging is None:
            return
        for row in self.charging.drain() if wait else self.charging.ready():
            self.epsilon_so_far = float(np.max(row.epsilon))
            self.log.augment.append_privacy(row.step, row.augment_steps, row.epsilon, row.mu_gdp)

    def _checkpoint(self, step: int, outcome: AugmentOutcome) -> None:
        """Every party has saved its own state of this step (the gather is its acknowledgement); then rank 0's."""
        self.channel.gather_objects(None)
        self._write_privacy_rows(wait=True)
        save_checkpoint(self.run_dir, {
            "stage": STAGE, "step": step, "plan_steps": self.plan.steps, "genotype": self.plan.genotype.to_string(),
            "config": self.cfg.to_yaml(), "server": self.server.state_dict(),
            "ledger": self.ledger.state_dict() if self.ledger is not None else None,
            "stats": self.stats.tolist(), "test_acc": outcome.test_acc, "test_loss": outcome.test_loss,
            "selection": self.selector.state_dict() if self.selector is not None else None,
            "log_rows": list(self.log.augment.row_counts()),
        })


def _ratio(a: float, b: float) -> float:
    return float(a / b) if b > 0 else float("nan")
