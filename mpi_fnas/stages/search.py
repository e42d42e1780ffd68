"""The search as one stage: rank 0's side (:class:`SearchStage`: W and A of the supernet, its log), the party's
(:class:`SearchSide`: the supernet on its train shard for W and its validation shard for A) and the outcome
(:class:`SearchOutcome`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.data import Dataset
from mpi_fnas.evaluation import ratio
from mpi_fnas.federation.adadp import adadp_settings
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.global_model import search_server
from mpi_fnas.federation.inventory import gather_inventory
from mpi_fnas.federation.job_plan import Assignment, PartyView, plan_run, search_steps_per_epoch
from mpi_fnas.federation.local_model import Party, search_party
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.federation.schedules import gdas_temperature, path_noise, search_learning_rate
from mpi_fnas.federation.shard import Shard
from mpi_fnas.federation.verify import (
    calibrated,
    check_gathered,
    check_params,
    check_shards,
    check_steps,
    expected_params,
)
from mpi_fnas.privacy.params import DPParams
from mpi_fnas.privacy.release import IterationReleases
from mpi_fnas.space import search_space
from mpi_fnas.space.dpnas import CHOICES
from mpi_fnas.stages.base import ServedStage, StageOutcome, StageSide, StepTotals
from mpi_fnas.stages.party_data import own_examples, with_fixed_stem
from mpi_fnas.stages.setup import StageSetup, job_ledger, rates, selection_schema, stage_setup

if TYPE_CHECKING:  # rank 0's log (h5py): a party never imports it
    from mpi_fnas.runlog import RunLog


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


def open_search_log(cfg: Config, run_dir: Path, setup: StageSetup, resume: dict | None,
                    ranks: dict[str, list[str]]) -> RunLog:
    """The run log: created, or reopened for a resumed search (rows after the checkpoint dropped). ranks: its
    ``/ranks`` attributes (:attr:`~mpi_fnas.federation.handshake.SetupReports.rank_attrs`)."""
    from mpi_fnas.runlog import SEARCH_METRICS, RunLog, StagePrivacy  # rank 0's alone (h5py)

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


class SearchStage(ServedStage):
    """The search as a stage of :class:`~mpi_fnas.stages.rank0_loop.ServerLoop`: W and A of the supernet, the
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
        ledger = job_ledger(plan.privacy) if plan.privacy is not None else None
        return stage_setup(cfg, "search", plan, ledger, ledger is not None, plan, None,
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
        self.acc = StepTotals.from_state(checkpoint["accumulator"])

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
        return {**super().row(step, epoch, test), **rates("val", acc.val), **timings}

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
        outcome = SearchOutcome(parties=self.channel.parties, **rates("val", val),
                                test_acc=ratio(test[1], test[2]), genotype=server.genotype().to_string(),
                                w=server.w_buffer.copy(), a=server.a_buffer.copy(), shard_sizes=self.plan.shard_sizes,
                                selection_state=self.selector.summary() if self.selector is not None else None,
                                **common)
        outcome.alpha_entropy, outcome.alpha_margin = server.alpha_movement()
        if ledger is not None:
            outcome.mu_gdp, outcome.ledger_state = ledger.mu_gdp(), ledger.state_dict()
        return outcome


class SearchSide(StageSide):
    """The search on a party: the supernet on its train shard (W) and validation shard (A)."""

    name = "search"
    assignment = Assignment
    later_stages = ("augment",)

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg, cfg.search.w_optimizer)

    def check(self, cfg: Config, got: Assignment, own: PartyView, *, parties: int, rank: int) -> None:
        check_params(expected_params(cfg, parties, own.dimension), got.dp, calibrated=calibrated(cfg), rank=rank,
                     what="search assignment")
        check_shards([("train indices", got.train_indices), ("validation indices", got.val_indices)], own.shards,
                     examples=own.examples, partition=cfg.data.partition, rank=rank, what="search assignment")
        check_gathered(got.gathered, cfg, rank=rank, what="search assignment")
        if self.private(cfg):
            check_steps(got.steps_per_epoch, got.steps, search_steps_per_epoch(cfg, [n for n, _ in own.sizes]),
                        cfg.search.epochs, rank=rank, what="search assignment")

    def private(self, cfg: Config) -> bool:
        return cfg.mode == "dpfnas"

    def needs_sizes(self, cfg: Config) -> bool:
        return cfg.search.steps_per_epoch is None

    def params(self, got: Assignment) -> DPParams:
        return got.dp

    def per_iteration(self, got: Assignment) -> tuple[IterationReleases, list[int]]:
        sizes = [len(got.train_indices), len(got.val_indices)]
        w, a = (got.dp.search_releases(self.rounds)[name] for name in ("W", "A"))
        return IterationReleases.of(w, w.sample_rate(sizes[0]), a, a.sample_rate(sizes[1])), sizes

    def build(self, cfg: Config, got: Assignment, data: Dataset, rank: int, device: torch.device) -> Party:
        model = search_space(cfg.space.kind).build_supernet(cfg.space, seed=cfg.seed, in_channels=data.in_channels,
                                                            num_classes=data.num_classes)
        # A fixed stem (space.stem: scattering) transforms the party's own examples once, here, on its device.
        x_tr, y_tr = with_fixed_stem(model, *(t.to(device) for t in own_shard(cfg, data, got, rank, "train")))
        x_val, y_val = with_fixed_stem(model, *(t.to(device) for t in own_shard(cfg, data, got, rank, "val")))
        source = got.dp.randomness if got.dp is not None else "reproducible"  # non-DP: nothing to hide
        self.steps_per_epoch = got.steps_per_epoch
        return search_party(model.to(device), Shard(x_tr.to(device), y_tr.to(device)),
                            Shard(x_val.to(device), y_val.to(device)), cfg.search.batch_size,
                            PartyRandomness.create(source, seed=cfg.seed, rank=rank), got.dp, self.rounds,
                            cfg.runtime.max_physical_batch)

    def step(self, party: Party, step: int) -> dict[str, Any]:
        epoch = (step - 1) // self.steps_per_epoch
        if self.cfg.search.method == "gdas":  # this iteration's path, the same on every party
            party.model.path_noise = path_noise(self.cfg.seed, step, tuple(party.model.alpha.shape))
            party.model.choice_noise = {name: path_noise(self.cfg.seed, step, (1, len(CHOICES[name])), label=name)
                                        for name in getattr(party.model, "choices", ())}
            party.model.path_temperature = gdas_temperature(self.cfg.search, epoch)
        return {"w_rounds": self.rounds, "train_a": epoch >= self.cfg.search.warmup_epochs,  # the warm-up: W only
                "second_order": self.cfg.search.order == "second_order",
                "xi": search_learning_rate(self.cfg.search, epoch)}

    def finish(self, party: Party, channel: Channel) -> None:
        if not party.private:  # the summary's validation accuracy: Σ_k [loss_sum, correct, count] on D_k^val
            if self.cfg.search.method == "gdas":  # on the argmax path, as rank 0 evaluates, not the last draw's
                party.model.argmax_path()
            channel.reduce_sum(party.evaluate_val())


def own_shard(cfg: Config, data: Dataset, got: Assignment, rank: int, shard: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The party's `shard` ("train" or "val") as it holds it: an unreliable party's with noise in place of the
    stated fraction of its examples (simulated here, inside the party: these images are its data)."""
    indices = got.train_indices if shard == "train" else got.val_indices
    return own_examples(cfg, data, indices, got.corruption, rank, shard)
