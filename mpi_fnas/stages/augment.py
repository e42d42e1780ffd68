"""The augmentation as one stage: rank 0's side (:class:`AugmentStage`: one weight update per iteration, the
test evaluation at epoch ends, its ``/augment`` log group), the party's (:class:`AugmentSide`: the network of
``augment.network`` on its pool, every example augmented on its own) and the outcome (:class:`AugmentOutcome`).
Under dpfnas it continues the search's privacy ledgers: its ε composes both stages per party."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.data import Dataset
from mpi_fnas.federation.adadp import adadp_settings
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.global_model import augment_server
from mpi_fnas.federation.inventory import gather_inventory
from mpi_fnas.federation.job_plan import (
    AugmentAssignment,
    AugmentPlan,
    PartyView,
    SetupError,
    augment_is_private,
    augment_steps,
    parse_genotype,
    plan_augment_stage,
    plan_run,
)
from mpi_fnas.federation.local_model import Party, augment_party
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.federation.schedules import drop_path_probability
from mpi_fnas.federation.shard import Shard
from mpi_fnas.federation.verify import check_augment, check_gathered, check_network, check_shards, check_steps
from mpi_fnas.privacy.params import DPParams
from mpi_fnas.privacy.release import IterationReleases, augment_sample_rates
from mpi_fnas.privacy.trusted_config import AssignmentRefusedError
from mpi_fnas.space import augment_network, search_space, trains_cell
from mpi_fnas.stages.base import ServedStage, StageOutcome, StageSide, StepTotals
from mpi_fnas.stages.party_data import own_examples, with_fixed_stem
from mpi_fnas.stages.search import open_search_log
from mpi_fnas.stages.setup import StageSetup, job_ledger, selection_schema, stage_setup

if TYPE_CHECKING:  # rank 0's log (h5py): a party never imports it
    from mpi_fnas.privacy.release import Release
    from mpi_fnas.runlog import RunLog


@dataclass(kw_only=True)
class AugmentOutcome(StageOutcome):
    """Rank 0's result of the augmentation (its ``genotype``: "" when ``network`` is hand-designed)."""

    network: str  # augment.network: "cell", or the hand-designed network trained
    params: int  # parameters of the network without the auxiliary head (Table 1's "Params")
    test_loss: float
    private: bool  # the releases were DP (dpfnas with augment.private)
    release: Release | None = None  # the augmentation's releases (σ, clip, B; None: not private)
    composed_with_search: bool = False  # its ε includes a search's releases (the ledger continued one)


class AugmentStage(ServedStage):
    """The augmentation as a stage of :class:`~mpi_fnas.stages.rank0_loop.ServerLoop`: one weight update per
    iteration (with or without the server's selection), the test evaluation at epoch ends, its metrics row, ε rows
    at epoch ends only (each costs rank 0 a PLD composition of both stages per distinct ledger on the background
    thread, CPU the parties need when ranks outnumber cores) and its checkpoint."""

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
        ledger = job_ledger(search_plan.privacy) if search_plan.privacy is not None else None
        if ledger is not None and searched.get("ledger") is not None:
            ledger.load_state_dict(searched["ledger"])
        private = ledger is not None and augment_is_private(cfg)
        params = search_plan.privacy.params if search_plan.privacy is not None else None
        plan = plan_augment_stage(cfg, search_plan.assignments, genotype, ledger if private else None, params)
        if private:
            ledger.start_augment(plan.releases)  # a resume then loads the checkpointed ledgers over this
        return stage_setup(cfg, "augment", plan, ledger, private, search_plan, searched.get("selection"),
                           partial(augment_network, cfg, genotype, seed=cfg.seed))

    @staticmethod
    def open_log(cfg: Config, run_dir: Path, setup: StageSetup, resume: dict | None,
                 ranks: dict[str, list[str]]) -> RunLog:
        """The search's log, reopened for its ``/augment`` group (created first when the job did not search)."""
        from mpi_fnas.runlog import RunLog, StagePrivacy  # rank 0's alone (h5py)

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
        self.acc = StepTotals(train=np.asarray(checkpoint["stats"], dtype=np.float64))
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


class AugmentSide(StageSide):
    """The augmentation on a party: the network of ``augment.network`` (the found cell's, or a hand-designed one) on
    its pool, every example augmented on its own."""

    name = "augment"
    assignment = AugmentAssignment

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg, cfg.augment.optimizer)

    def check(self, cfg: Config, got: AugmentAssignment, own: PartyView, *, parties: int, rank: int) -> None:
        check_network(cfg, got.network, rank=rank)
        check_augment(cfg, got.releases, got.params, parties=parties, dimension=own.dimension, rank=rank)
        pool, count = got.pool_indices, got.train_count
        if not 0 <= count <= len(pool):
            raise AssignmentRefusedError(f"rank {rank} refuses the augmentation assignment rank 0 sent: train_count "
                                         f"{count} of a pool of {len(pool)}; nothing was computed or sent")
        train, val = own.shards
        check_shards([("pool's train part", pool[:count]), ("pool's validation part", pool[count:])],
                     [train, val if cfg.augment.pool == "all" else val[:0]], examples=own.examples,
                     partition=cfg.data.partition, rank=rank, what="augmentation assignment")
        check_gathered(got.gathered, cfg, rank=rank, what="augmentation assignment")
        if self.private(cfg):
            pools = [n_train + (n_val if cfg.augment.pool == "all" else 0) for n_train, n_val in own.sizes]
            check_steps(got.steps_per_epoch, got.steps, augment_steps(cfg, pools)[0], cfg.augment.epochs, rank=rank,
                        what="augmentation assignment")

    def private(self, cfg: Config) -> bool:
        return cfg.mode == "dpfnas" and cfg.augment.private

    def needs_sizes(self, cfg: Config) -> bool:
        return cfg.augment.steps_per_epoch is None

    def params(self, got: AugmentAssignment) -> DPParams:
        return got.params

    def per_iteration(self, got: AugmentAssignment) -> tuple[IterationReleases, list[int]]:
        sizes = [got.train_count, len(got.pool_indices) - got.train_count]
        release = got.releases.release
        rates = augment_sample_rates([sizes[0]], [sizes[1]], release.expected_batch_size, self.cfg.augment.pool)
        return IterationReleases.of(release, rates[0][0], release, rates[1][0]), sizes

    def build(self, cfg: Config, got: AugmentAssignment, data: Dataset, rank: int, device: torch.device) -> Party:
        x, y = own_pool(cfg, data, got, rank)
        # Its own config's network (check_network made rank 0's agree); a cell's genotype is rank 0's to choose.
        genotype = search_space(cfg.space.kind).parse_genotype(got.genotype, cfg.space) if trains_cell(cfg) else None
        model = augment_network(cfg, genotype, seed=cfg.seed, in_channels=data.in_channels,
                                num_classes=data.num_classes)
        private = got.releases is not None and got.params is not None
        source = got.params.randomness if private else "reproducible"  # exact gradients: nothing to hide
        self.steps_per_epoch = got.steps_per_epoch
        # A fixed stem (a ScatterNet's scattering) transforms the party's own examples once, here, on its device.
        x, y = with_fixed_stem(model, x.to(device), y.to(device), reuse=True)
        return augment_party(model.to(device), Shard(x, y), cfg.augment,
                             PartyRandomness.create(source, seed=cfg.seed, rank=rank, stage=self.name),
                             got.releases.release if private else None,
                             got.params.randomness if private else None, cfg.runtime.max_physical_batch)

    def step(self, party: Party, step: int) -> dict[str, Any]:
        party.model.drop_path_prob = drop_path_probability(self.cfg.augment, step, self.steps_per_epoch)
        return {"w_rounds": self.rounds}


def own_pool(cfg: Config, data: Dataset, got: AugmentAssignment, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The party's augmentation pool as it holds it, x (N, C, H, W), y (N,): its search shards (train, then val),
    an unreliable party's with the same examples replaced by noise as in the search."""
    pieces = [own_examples(cfg, data, got.pool_indices[:got.train_count], got.corruption, rank, "train")]
    if got.train_count < len(got.pool_indices):
        pieces.append(own_examples(cfg, data, got.pool_indices[got.train_count:], got.corruption, rank, "val"))
    return torch.cat([x for x, _ in pieces]), torch.cat([y for _, y in pieces])
