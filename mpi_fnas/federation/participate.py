"""A party's side of a stage (ranks 1..K): its own data, its own randomness, its own state on its own disk.

One loop runs every stage (:func:`participate`); a stage says what the party trains and what each step asks of
it (:class:`SearchSide`, :class:`AugmentSide`). What a party hands to MPI, and nothing else
(tests/mpi/test_release_spy.py checks every call):

* at setup: its device name, its CPU kernels (:mod:`mpi_fnas.cpu_kernels`: the machine's, not the data's) and how
  many iterations of the stage it has ever sent (``sent_steps``, data-independent); to the other parties, the
  digest of the config and stage plan rank 0 sent it (public: :func:`~mpi_fnas.federation.handshake.plan_digest`);
* per iteration: the releases of Algorithm 1 (under DP: clipped and noised, with a zero STATS tail);
* at a checkpoint: an empty acknowledgement once it has saved its own state;
* on failure: a reason (under DP a generic one; the details stay in its own ``error.log``).

Its stream keys never leave its memory: a resumed party keys new streams (a replayed step draws fresh randomness)
and restores only its batch positions, from its own directory
(:class:`~mpi_fnas.federation.party_store.PartyStore`). An unreliable
party holds its corrupted shards here too (:func:`own_examples`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.data import Dataset
from mpi_fnas.data.corruption import corrupt_shard
from mpi_fnas.data.datasets import pixel_statistics
from mpi_fnas.federation.adadp import w_rounds
from mpi_fnas.federation.algorithm import PartyBuffers, party_iteration
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.handshake import (
    agree_masks,
    agree_on_plan,
    party_steps,
    plan_digest,
    receive_assignment,
    receive_last_step,
    report_setup,
)
from mpi_fnas.federation.inventory import report_inventory
from mpi_fnas.federation.party import Party, Shard, augment_party, search_party
from mpi_fnas.federation.party_store import PartyStore, party_dir
from mpi_fnas.federation.plan import (
    Assignment,
    AugmentAssignment,
    SetupError,
    open_split,
    own_shards,
    party_corruption,
    secure_dimension,
    shared_plan,
)
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.federation.schedules import drop_path_probability, path_noise, search_learning_rate
from mpi_fnas.federation.stage import Injections
from mpi_fnas.federation.verify import (
    calibrated,
    check_augment,
    check_checkpoint_step,
    check_corruption,
    check_network,
    check_params,
    check_shards,
    expected_params,
)
from mpi_fnas.privacy.params import DPParams
from mpi_fnas.privacy.release import augment_sample_rates
from mpi_fnas.privacy.trusted_config import AssignmentRefusedError, pin_directory, write_pin
from mpi_fnas.refusal import ReportedRefusalError, refusal_line, refusal_text
from mpi_fnas.secagg.identities import IdentityError, PartyIdentity, load_party_identity
from mpi_fnas.space import augment_network, search_space, trains_cell


def participate(cfg: Config, channel: Channel, run_dir: Path | None, side: StageSide) -> bool:
    """Run party `channel.rank`'s side of a whole stage; True when it stopped as interrupted."""
    report_inventory(cfg, channel)  # data.partition local: its folder's public facts, before the plan
    got, device = receive_assignment(channel, side.assignment, cfg.runtime.device)
    store = PartyStore(party_dir(run_dir, channel.rank), stage=side.name) if run_dir is not None else None
    Injections(channel.rank, side.name).at(0)  # the failure tests' late setup report (step 0: the setup)
    try:
        data = check_assignment(cfg, side, got, channel, store)
        # Its identity now, not at the key round: a key the roster does not name is a refusal like any other, in
        # this setup report (a notice sent later could reach rank 0 before another party's report, and the job
        # would end before its log exists).
        identity = own_identity(cfg, run_dir, channel) if side.secure(cfg) else None
    except (AssignmentRefusedError, IdentityError) as refusal:
        # Its line on its own stderr first, then in its setup report: rank 0 gathers every party's report (so every
        # refusing party has printed before the job ends), opens its log, marks it failed and aborts the job.
        print(refusal_line(channel.rank, refusal), file=sys.stderr, flush=True)
        report_setup(channel, device, store.sent_steps if store and side.private(cfg) else 0,
                     refused=refusal_text(refusal))
        raise ReportedRefusalError(refusal_text(refusal)) from refusal
    if run_dir is not None:
        # The config this party runs, pinned only now that rank 0 has accepted the setup as well (a launch refused as
        # bad input leaves nothing behind): what it trusts on a --resume or --augment without a --config of its own
        # (mpi_fnas.run checked it against its own first; docs/privacy.md §2.10).
        write_pin(pin_directory(run_dir, channel.rank), cfg.to_yaml())
    party = side.build(cfg, got, data, channel.rank, device)
    if got.checkpoint_step > 0:
        if store is None:
            raise SetupError("--resume needs the run directory")
        # Its own batch positions; its secret streams stay the new ones this launch keyed (Party.state_dict).
        party.load_state_dict(store.load_party(got.checkpoint_step, party.randomness.source))
    report_setup(channel, device, store.sent_steps if store and party.private else 0)
    last = got.steps
    if party.private:
        last = receive_last_step(channel, first=got.checkpoint_step + 1, planned=got.steps)
    agree_on_plan(channel, plan_digest(side.name, cfg.to_yaml(), shared_plan(got), last), stage=side.name)
    if party.private:
        keep_own_ledger(cfg, side, got, store, channel.rank, last - got.checkpoint_step)
    if party.secure:
        party.use_secure_aggregation(agree_masks(channel, identity), side.name)

    buf = PartyBuffers(party.num_w, party.num_a)
    channel.bcast(buf.w[:-1])  # the initial W (and A)
    party.load_w(buf.w[:-1])
    if buf.a is not None:
        channel.bcast(buf.a[:-1])
        party.load_a(buf.a[:-1])

    def iterate(step: int) -> int:
        return party_iteration(party, channel, buf, gathered=got.gathered, **side.step(party, step))

    stopped = party_steps(channel, stage=side.name, first=got.checkpoint_step + 1, last=last, store=store,
                          party=party, iterate=iterate)
    if not stopped:
        side.finish(party, channel)
    return stopped


def check_assignment(cfg: Config, side: StageSide, got: Any, channel: Channel, store: PartyStore | None) -> Dataset:
    """This party's train split, once it accepts its assignment `got`; AssignmentRefusedError unless it does
    (:mod:`mpi_fnas.federation.verify`): its DP parameters against those it derives (K from its own communicator,
    D recomputed here), its shards against the split it computes itself, and a checkpoint step it must hold its
    own state for."""
    data = open_split(cfg, "train", party=channel.rank)
    side.check(cfg, got, parties=channel.parties, dimension=own_dimension(cfg, data), rank=channel.rank)
    side.check_shards(cfg, got, own_shards(cfg, data, channel.parties, channel.rank), examples=len(data),
                      rank=channel.rank)
    check_corruption(got.corruption, party_corruption(cfg, channel.parties, channel.rank), rank=channel.rank,
                     what=f"{side.name} assignment")
    step = got.checkpoint_step
    saved = store is not None and isinstance(step, int) and store.has_state(step)
    check_checkpoint_step(step, saved, rank=channel.rank, what=f"{side.name} assignment")
    return data


def keep_own_ledger(cfg: Config, side: StageSide, got: Any, store: PartyStore | None, rank: int,
                    requested: int) -> None:
    """This party's own budget (:mod:`mpi_fnas.privacy.party_ledger`), before it sends anything of this launch:
    BudgetRefusedError when the `requested` iterations rank 0 announced would take its ε, composed from its own
    record and journals, past its own cap; then this launch's releases recorded in its directory."""
    train, val, sizes = side.per_iteration(got)
    record = store.release_record() if store is not None else []
    params = side.params(got)
    secure = params.secure_sum
    cap = params.party_cap(cfg.privacy.party_max_epsilon)
    if cap is not None:
        from mpi_fnas.privacy import party_ledger  # rank 0's accountant: loaded only by a party with a cap

        sent = store.sent_by_stage() if store is not None else {}
        party_ledger.check_request(cap, record, sent, party_ledger.IterationReleases.from_lists(train, val),
                                   cfg.privacy.delta, sizes, secure.accounting if secure is not None else None,
                                   requested, rank=rank, stage=side.name)
    if store is not None:
        constants = [secure.parties, secure.local_variance, secure.dimension, secure.colluders] if secure else None
        store.begin_releases(train, val, sizes, constants)


def own_dimension(cfg: Config, data: Dataset) -> int | None:
    """D of secure aggregation as this party computes it (the planner's :func:`secure_dimension`, from the shape
    of its own train split `data`: < 1 s, docs/privacy.md §2.10), or None when its releases are not securely
    aggregated."""
    if cfg.mode != "dpfnas" or cfg.privacy.aggregation != "secure":
        return None
    return secure_dimension(cfg, data.in_channels, data.num_classes)


def own_identity(cfg: Config, run_dir: Path | None, channel: Channel) -> PartyIdentity | None:
    """This party's identity under ``privacy.party_identities`` (its private key from its own directory, the
    roster checked against this job's K), or None when the setting is off."""
    if not cfg.privacy.party_identities:
        return None
    if run_dir is None:
        raise SetupError("privacy.party_identities needs the run directory (the party's identity.key is there)")
    return load_party_identity(Path(cfg.privacy.party_identities), party_dir(run_dir, channel.rank), channel.rank,
                               channel.parties)


class StageSide:
    """A stage on a party: its assignment's type, its party, and what each step asks of it. Both sides share the
    config, the weight releases per iteration (2 under ADADP) and the epoch length (known from the assignment)."""

    name: str
    assignment: type

    def __init__(self, cfg: Config, optimizer: str) -> None:
        self.cfg = cfg
        self.rounds = w_rounds(optimizer)
        self.steps_per_epoch = 1

    def build(self, cfg: Config, got: Any, data: Dataset, rank: int, device: torch.device) -> Party:
        """The stage's party of `rank` on `device`, from its assignment `got` and its train split `data` (each side
        says how)."""

    def check(self, cfg: Config, got: Any, *, parties: int, dimension: int | None, rank: int) -> None:
        """Raise AssignmentRefusedError unless `got`'s DP parameters are those this party derives (each side)."""

    def check_shards(self, cfg: Config, got: Any, own: tuple[np.ndarray, np.ndarray], *, examples: int,
                     rank: int) -> None:
        """Raise AssignmentRefusedError unless `got`'s indices are this party's `own` (train, val) shards of its
        `examples` (:func:`~mpi_fnas.federation.verify.check_shards`; each side says which indices it holds)."""

    def private(self, cfg: Config) -> bool:
        """Whether this stage's releases are DP under `cfg` (each side)."""
        return False

    def params(self, got: Any) -> DPParams:
        """The run's DP parameters in a private stage's assignment `got` (checked by :meth:`check`)."""
        raise NotImplementedError

    def per_iteration(self, got: Any) -> tuple[list[float], list[float], list[int]]:
        """A private stage's ``[σ, q, releases]`` per iteration on the train and on the validation shard (q from
        the shards this party samples: B / N), and its search shards' sizes (N_tr, N_val)."""
        raise NotImplementedError

    def secure(self, cfg: Config) -> bool:
        """Whether this stage's releases are securely aggregated under `cfg` (a key round, an identity to use)."""
        return self.private(cfg) and cfg.privacy.aggregation == "secure"

    def step(self, party: Party, step: int) -> dict[str, Any]:
        """Prepare `party` for iteration `step`; the keyword arguments of its :func:`party_iteration`."""

    def finish(self, party: Party, channel: Channel) -> None:
        """After the last step (not after a stop): the stage's closing exchange, if any (none by default)."""


class SearchSide(StageSide):
    """The search on a party: the supernet on its train shard (W) and validation shard (A)."""

    name = "search"
    assignment = Assignment

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg, cfg.search.w_optimizer)

    def check(self, cfg: Config, got: Assignment, *, parties: int, dimension: int | None, rank: int) -> None:
        check_params(expected_params(cfg, parties, dimension), got.dp, calibrated=calibrated(cfg), rank=rank,
                     what="search assignment")

    def check_shards(self, cfg: Config, got: Assignment, own: tuple[np.ndarray, np.ndarray], *, examples: int,
                     rank: int) -> None:
        check_shards([("train indices", got.train_indices), ("validation indices", got.val_indices)], own,
                     examples=examples, partition=cfg.data.partition, rank=rank, what="search assignment")

    def private(self, cfg: Config) -> bool:
        return cfg.mode == "dpfnas"

    def params(self, got: Assignment) -> DPParams:
        return got.dp

    def per_iteration(self, got: Assignment) -> tuple[list[float], list[float], list[int]]:
        sizes = [len(got.train_indices), len(got.val_indices)]
        releases = got.dp.search_releases(self.rounds)
        return ([releases["W"].noise_multiplier, releases["W"].sample_rate(sizes[0]), releases["W"].per_step],
                [releases["A"].noise_multiplier, releases["A"].sample_rate(sizes[1]), releases["A"].per_step], sizes)

    def build(self, cfg: Config, got: Assignment, data: Dataset, rank: int, device: torch.device) -> Party:
        x_tr, y_tr = own_shard(cfg, data, got, rank, "train")
        x_val, y_val = own_shard(cfg, data, got, rank, "val")
        model = search_space(cfg.space.kind).build_supernet(cfg.space, seed=cfg.seed, in_channels=data.in_channels,
                                                            num_classes=data.num_classes)
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
            party.model.path_temperature = self.cfg.search.gdas_temperature
        return {"w_rounds": self.rounds, "train_a": epoch >= self.cfg.search.warmup_epochs,  # the warm-up: W only
                "second_order": self.cfg.search.order == "second_order",
                "xi": search_learning_rate(self.cfg.search, epoch)}

    def finish(self, party: Party, channel: Channel) -> None:
        if not party.private:  # the summary's validation accuracy: Σ_k [loss_sum, correct, count] on D_k^val
            if self.cfg.search.method == "gdas":  # on the argmax path, as rank 0 evaluates, not the last draw's
                party.model.path_noise = torch.zeros_like(party.model.path_noise)
            channel.reduce_sum(party.evaluate_val())


class AugmentSide(StageSide):
    """The augmentation on a party: the network of ``augment.network`` (the found cell's, or a hand-designed one) on
    its pool, every example augmented on its own."""

    name = "augment"
    assignment = AugmentAssignment

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg, cfg.augment.optimizer)

    def check(self, cfg: Config, got: AugmentAssignment, *, parties: int, dimension: int | None, rank: int) -> None:
        check_network(cfg, got.network, rank=rank)
        check_augment(cfg, got.releases, got.params, parties=parties, dimension=dimension, rank=rank)

    def check_shards(self, cfg: Config, got: AugmentAssignment, own: tuple[np.ndarray, np.ndarray], *,
                     examples: int, rank: int) -> None:
        pool, count = got.pool_indices, got.train_count
        if not 0 <= count <= len(pool):
            raise AssignmentRefusedError(f"rank {rank} refuses the augmentation assignment rank 0 sent: train_count "
                                         f"{count} of a pool of {len(pool)}; nothing was computed or sent")
        train, val = own
        check_shards([("pool's train part", pool[:count]), ("pool's validation part", pool[count:])],
                     [train, val if cfg.augment.pool == "all" else val[:0]], examples=examples,
                     partition=cfg.data.partition, rank=rank, what="augmentation assignment")

    def private(self, cfg: Config) -> bool:
        return cfg.mode == "dpfnas" and cfg.augment.private

    def params(self, got: AugmentAssignment) -> DPParams:
        return got.params

    def per_iteration(self, got: AugmentAssignment) -> tuple[list[float], list[float], list[int]]:
        sizes = [got.train_count, len(got.pool_indices) - got.train_count]
        release = got.releases.release
        rates = augment_sample_rates([sizes[0]], [sizes[1]], release.expected_batch_size, self.cfg.augment.pool)
        return ([release.noise_multiplier, float(rates[0][0]), release.per_step],
                [release.noise_multiplier, float(rates[1][0]), release.per_step], sizes)

    def build(self, cfg: Config, got: AugmentAssignment, data: Dataset, rank: int, device: torch.device) -> Party:
        x, y = own_pool(cfg, data, got, rank)
        # Its own config's network (check_network made rank 0's agree); a cell's genotype is rank 0's to choose.
        genotype = search_space(cfg.space.kind).parse_genotype(got.genotype, cfg.space) if trains_cell(cfg) else None
        model = augment_network(cfg, genotype, seed=cfg.seed, in_channels=data.in_channels,
                                num_classes=data.num_classes)
        private = got.releases is not None and got.params is not None
        source = got.params.randomness if private else "reproducible"  # exact gradients: nothing to hide
        self.steps_per_epoch = got.steps_per_epoch
        return augment_party(model.to(device), Shard(x.to(device), y.to(device)), cfg.augment,
                             PartyRandomness.create(source, seed=cfg.seed, rank=rank, stage=self.name),
                             got.releases.release if private else None,
                             got.params.randomness if private else None, cfg.runtime.max_physical_batch)

    def step(self, party: Party, step: int) -> dict[str, Any]:
        party.model.drop_path_prob = drop_path_probability(self.cfg.augment, step, self.steps_per_epoch)
        return {"w_rounds": self.rounds}


def own_shard(cfg: Config, data: Dataset, got: Assignment, rank: int, shard: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The party's `shard` ("train" or "val") as it holds it: an unreliable party's with noise in place of the
    stated fraction of its examples (simulated here, inside the party: these images are its data)."""
    indices = got.train_indices if shard == "train" else got.val_indices
    return own_examples(cfg, data, indices, got.corruption, rank, shard)


def own_pool(cfg: Config, data: Dataset, got: AugmentAssignment, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The party's augmentation pool as it holds it, x (N, C, H, W), y (N,): its search shards (train, then val),
    an unreliable party's with the same examples replaced by noise as in the search."""
    pieces = [own_examples(cfg, data, got.pool_indices[:got.train_count], got.corruption, rank, "train")]
    if got.train_count < len(got.pool_indices):
        pieces.append(own_examples(cfg, data, got.pool_indices[got.train_count:], got.corruption, rank, "val"))
    return torch.cat([x for x, _ in pieces]), torch.cat([y for _, y in pieces])


def own_examples(cfg: Config, data: Dataset, indices: np.ndarray, corruption: float, rank: int,
                 shard: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Party `rank`'s examples of its `shard` ("train" or "val") at `indices` (the whole shard, in the plan's
    order): x (N, C, H, W), y (N,), with ``corrupt_shard``'s noise in place of the fraction `corruption` of them.
    The noise is a function of (seed, rank, shard, N), so the search and the augmentation corrupt the same
    examples of a shard."""
    x, y = data.render(indices)
    if corruption > 0:
        mean, std = pixel_statistics(cfg.data.dataset, x.shape[1])
        x, y, _ = corrupt_shard(x, y, corruption, num_classes=data.num_classes, pixel_mean=mean, pixel_std=std,
                                seed=cfg.seed, rank=rank, shard=shard)
    return x, y
