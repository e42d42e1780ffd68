"""A party's side of a search (ranks 1..K): its own data, its own randomness, its own state on its own disk.

What a party hands to MPI, and nothing else (tests/mpi/test_release_spy.py checks every call):

* at setup: its device name and how many iterations it has ever sent (``sent_steps``, data-independent);
* per iteration: the releases of Algorithm 1 (under DP: clipped and noised, with a zero STATS tail);
* at a checkpoint: an empty acknowledgement once it has saved its own state;
* on failure: a reason (under DP a generic one; the details stay in its own ``error.log``).

Its stream keys and positions never leave it: they are saved in its own directory
(:class:`~mpi_fnas.federation.party_store.PartyStore`), restored by the party itself on a resume.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.data import Dataset
from mpi_fnas.data.corruption import corrupt_shard
from mpi_fnas.data.datasets import pixel_statistics
from mpi_fnas.federation.adadp import w_rounds
from mpi_fnas.federation.algorithm import party_iteration
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.handshake import party_steps, receive_assignment, report_setup
from mpi_fnas.federation.inventory import report_inventory
from mpi_fnas.federation.party import Party, Shard
from mpi_fnas.federation.party_store import PartyStore, party_dir
from mpi_fnas.federation.plan import Assignment, SetupError, open_split
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.federation.server import w_learning_rate
from mpi_fnas.space import search_space


def participate(cfg: Config, channel: Channel, run_dir: Path | None) -> bool:
    """Run party `channel.rank`'s side of the whole search; True when the run stopped as interrupted."""
    report_inventory(cfg, channel)  # data.partition local: its folder's public facts, before the plan
    got, device = receive_assignment(channel, Assignment, cfg.runtime.device)
    store = PartyStore(party_dir(run_dir, channel.rank)) if run_dir is not None else None
    party = _build_party(cfg, got, channel.rank, device, store)
    report_setup(channel, device, store.sent_steps if store and got.dp else 0)

    w_in = np.zeros(party.num_w, dtype=np.float32)
    a_in = np.zeros(party.num_a + 1, dtype=np.float32)  # A and the control word
    v_in = np.zeros(party.num_w, dtype=np.float32)
    channel.bcast(w_in)
    channel.bcast(a_in[:-1])
    party.load_w(w_in)
    party.load_a(a_in[:-1])

    second_order = cfg.search.order == "second_order"
    rounds = w_rounds(cfg.search.w_optimizer)

    def iterate(step: int) -> int:
        epoch = (step - 1) // got.steps_per_epoch
        xi = w_learning_rate(cfg.search, epoch)
        return party_iteration(party, channel, w_in, a_in, v_in, second_order, xi, rounds, gathered=got.gathered,
                               train_a=epoch >= cfg.search.warmup_epochs)

    stopped = party_steps(channel, stage="search", first=got.checkpoint_step + 1, last=got.steps, store=store,
                          journal=got.dp is not None, party=party, randomness=_randomness_source(got),
                          iterate=iterate)
    if not stopped and got.dp is None:
        channel.reduce_sum(party.evaluate_val())
    return stopped


def _build_party(cfg: Config, got: Assignment, rank: int, device: torch.device, store: PartyStore | None) -> Party:
    data = open_split(cfg, "train", party=rank)
    x_tr, y_tr = own_shard(cfg, data, got, rank, "train")
    x_val, y_val = own_shard(cfg, data, got, rank, "val")
    model = search_space(cfg.space.kind).build_supernet(cfg.space, seed=cfg.seed, in_channels=data.in_channels,
                                                        num_classes=data.num_classes)
    source = _randomness_source(got)
    rng = PartyRandomness.create(source, seed=cfg.seed, rank=rank)
    party = Party(model.to(device), Shard(x_tr.to(device), y_tr.to(device)), Shard(x_val.to(device), y_val.to(device)),
                  cfg.search.batch_size, rng, dp=got.dp)
    if got.checkpoint_step > 0:
        if store is None:
            raise SetupError("--resume needs the run directory")
        # Its own stream keys and positions: the resumed run continues its streams.
        party.load_state_dict(store.load_party(got.checkpoint_step, source))
    return party


def own_shard(cfg: Config, data: Dataset, got: Assignment, rank: int, shard: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The party's `shard` ("train" or "val") as it holds it: an unreliable party's with noise in place of the
    stated fraction of its examples (simulated here, inside the party: these images are its data)."""
    indices = got.train_indices if shard == "train" else got.val_indices
    return own_examples(cfg, data, indices, got.corruption, rank, shard)


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


def _randomness_source(got: Assignment) -> str:
    """Where this party's noise and sampling come from: the DP plan's choice; non-DP runs are reproducible."""
    return got.dp.randomness if got.dp is not None else "reproducible"
