"""The augmentation's party step on random data, plain and private, interleaved: one weight release of the
augmented network on ``augment.batch_size`` examples."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mpi_fnas.bench.party_step import input_shape, timed
from mpi_fnas.config import Config

if TYPE_CHECKING:  # torch-importing modules stay out of the CLI's start-up (argument and config errors)
    from mpi_fnas.federation.local_model import Party


def make_augment_party(cfg: Config, private: bool) -> Party:
    """An augmentation party on random data: a pool of exactly B = ``augment.batch_size`` examples (so a private
    Poisson batch, at rate 1, is the plain batch), the network of ``augment.network``: a hand-designed one, or the
    cell of ``augment.genotype`` or, if unset, of the genotype the supernet starts from (its near-uniform alphas,
    derived from ``cfg.seed``)."""
    import torch

    from mpi_fnas.federation.local_model import augment_party
    from mpi_fnas.federation.randomness import PartyRandomness
    from mpi_fnas.federation.shard import Shard
    from mpi_fnas.privacy.release import AugmentReleases
    from mpi_fnas.space import augment_network, search_space, trains_cell
    from mpi_fnas.space.scattering import fixed_stem_of

    c, h, w, classes = input_shape(cfg)
    space = search_space(cfg.space.kind)
    genotype = None  # a hand-designed network has none
    if cfg.augment.genotype is not None:
        genotype = space.parse_genotype(cfg.augment.genotype, cfg.space)
    elif trains_cell(cfg):
        genotype = space.build_supernet(cfg.space, seed=cfg.seed, in_channels=c, num_classes=classes).genotype()
    model = augment_network(cfg, genotype, seed=cfg.seed, in_channels=c, num_classes=classes)
    n = cfg.augment.batch_size
    data_gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, w, generator=data_gen)
    stem = fixed_stem_of(model)  # a ScatterNet trains on its examples' scattering, computed once
    pool = Shard(stem(x) if stem is not None else x, torch.randint(0, classes, (n,), generator=data_gen))
    releases = None
    if private:
        one = np.ones(1)
        releases = AugmentReleases(noise_multiplier=cfg.augment.noise_multiplier, clip=cfg.augment.clip,
                                   expected_batch_size=float(n), sample_rate_train=one, sample_rate_val=one,
                                   steps=1, stop_reason="completed")
    streams = PartyRandomness.create("secret" if private else "reproducible", seed=cfg.seed, rank=1, stage="augment")
    party = augment_party(model, pool, cfg.augment, streams, releases.release if releases is not None else None,
                          streams.source if releases is not None else None, cfg.runtime.max_physical_batch)
    party.model.drop_path_prob = cfg.augment.drop_path
    return party


def time_augment_step(cfg: Config, repeats: int) -> dict[str, Any]:
    """Median seconds of one augmentation party step, plain and private, interleaved (same network and batch)."""
    from mpi_fnas.privacy.validators import PrivacyError

    plain = make_augment_party(cfg, private=False)
    jobs: dict[str, Callable[[], Any]] = {"plain": plain.w_release}
    result: dict[str, Any] = {"augment_num_w": plain.num_w}
    try:
        private = make_augment_party(cfg, private=True)
        jobs["private"] = private.w_release
    except PrivacyError as exc:
        result["augment_dp_note"] = f"private augment step not timed: {exc}"
    wall: dict[str, list[float]] = {k: [] for k in jobs}
    for i in range(repeats + 1):
        for key, job in jobs.items():
            seconds, _ = timed(job)
            if i:
                wall[key].append(seconds)
    result["augment_step_seconds"] = statistics.median(wall["plain"])
    if "private" in wall:
        result["augment_dp_step_seconds"] = statistics.median(wall["private"])
        result["augment_dp_step_ratio"] = result["augment_dp_step_seconds"] / result["augment_step_seconds"]
    return result
