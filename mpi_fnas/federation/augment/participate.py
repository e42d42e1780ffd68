"""A party's side of the augmentation (ranks 1..K): its own pool, its own randomness, its own state on its own disk.

An unreliable party holds its corrupted shards here too (:func:`own_pool`). What a party hands to MPI, as in the
search: at setup its device and how many augment iterations it has ever sent
(data-independent); per iteration its release (under DP clipped and noised, with a zero STATS tail); at a
checkpoint an empty acknowledgement once its own state is saved; on failure a reason (generic under DP).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.data import Dataset
from mpi_fnas.federation.adadp import w_rounds
from mpi_fnas.federation.augment.algorithm import party_augment_iteration
from mpi_fnas.federation.augment.party import AugmentParty
from mpi_fnas.federation.augment.plan import AugmentAssignment
from mpi_fnas.federation.augment.server import drop_path_probability
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.handshake import party_steps, receive_assignment, report_setup
from mpi_fnas.federation.inventory import report_inventory
from mpi_fnas.federation.participate import own_examples
from mpi_fnas.federation.party import Shard
from mpi_fnas.federation.party_store import PartyStore, party_dir
from mpi_fnas.federation.plan import SetupError, open_split
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.space import search_space

STAGE = "augment"


def participate_augment(cfg: Config, channel: Channel, run_dir: Path | None) -> bool:
    """Run party `channel.rank`'s side of the whole augmentation; True when it stopped as interrupted."""
    report_inventory(cfg, channel)  # data.partition local: its folder's public facts, before the plan
    got, device = receive_assignment(channel, AugmentAssignment, cfg.runtime.device)
    store = PartyStore(party_dir(run_dir, channel.rank), stage=STAGE) if run_dir is not None else None
    party = _build_party(cfg, got, channel.rank, device, store)
    private = got.releases is not None
    report_setup(channel, device, store.sent_steps if store and private else 0)

    w_in = np.zeros(party.num_w + 1, dtype=np.float32)  # W and the control word
    channel.bcast(w_in[:-1])
    party.load_w(w_in[:-1])

    rounds = w_rounds(cfg.augment.optimizer)

    def iterate(step: int) -> int:
        return party_augment_iteration(party, channel, w_in,
                                       drop_path_probability(cfg.augment, step, got.steps_per_epoch), rounds,
                                       gathered=got.gathered)

    return party_steps(channel, stage=STAGE, first=got.checkpoint_step + 1, last=got.steps, store=store,
                       journal=private, party=party, randomness=_randomness_source(got), iterate=iterate)


def _build_party(cfg: Config, got: AugmentAssignment, rank: int, device: torch.device,
                 store: PartyStore | None) -> AugmentParty:
    data = open_split(cfg, "train", party=rank)
    x, y = own_pool(cfg, data, got, rank)
    space = search_space(cfg.space.kind)
    model = space.build_augment_network(space.parse_genotype(got.genotype), cfg, seed=cfg.seed,
                                        in_channels=data.in_channels, num_classes=data.num_classes)
    source = _randomness_source(got)
    rng = PartyRandomness.create(source, seed=cfg.seed, rank=rank, stage=STAGE)
    party = AugmentParty(model.to(device), Shard(x.to(device), y.to(device)), cfg.augment, rng,
                         releases=got.releases)
    if got.checkpoint_step > 0:
        if store is None:
            raise SetupError("--resume needs the run directory")
        party.load_state_dict(store.load_party(got.checkpoint_step, source))
    return party


def own_pool(cfg: Config, data: Dataset, got: AugmentAssignment, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The party's augmentation pool as it holds it, x (N, C, H, W), y (N,): its search shards (train, then val),
    an unreliable party's with the same examples replaced by noise as in the search."""
    pieces = [own_examples(cfg, data, got.pool_indices[:got.train_count], got.corruption, rank, "train")]
    if got.train_count < len(got.pool_indices):
        pieces.append(own_examples(cfg, data, got.pool_indices[got.train_count:], got.corruption, rank, "val"))
    return torch.cat([x for x, _ in pieces]), torch.cat([y for _, y in pieces])


def _randomness_source(got: AugmentAssignment) -> str:
    """Under DP releases the plan's choice; exact gradients are reproducible (nothing to hide)."""
    return got.params.randomness if got.releases is not None and got.params is not None else "reproducible"
