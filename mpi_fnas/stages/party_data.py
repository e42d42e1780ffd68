"""The examples a stage trains and evaluates on, as they enter its network: a party's own shards
(:func:`own_examples`, with an unreliable party's corrupted fraction) and any split through a network's fixed stem
(:func:`with_fixed_stem`, which rank 0's test and aux sets go through too)."""

from __future__ import annotations

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.data import Dataset
from mpi_fnas.data.corruption import corrupt_shard
from mpi_fnas.data.datasets import pixel_statistics
from mpi_fnas.space.scattering import fixed_stem_of


def with_fixed_stem(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x through `model`'s fixed stem, y): the features it trains on, computed once (a ScatterNet's scattering:
    :mod:`mpi_fnas.space.scattering`); x as it is for a network without one."""
    stem = fixed_stem_of(model)
    return (stem(x) if stem is not None else x), y


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
