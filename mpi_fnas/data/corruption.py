"""Simulated unreliable parties (SecProbe, Zhao et al. §VI): a fraction of a party's examples replaced by noise.

Which parties are unreliable is a simulation parameter: drawn from the run's seed on rank 0, public, logged (root
attr ``unreliable``). The corruption itself is applied *inside* the party when it builds its shards
(:func:`corrupt_shard`): the noise images and random labels become that party's data, so nothing new leaves it.
They are drawn from (seed, rank, shard), reproducibly, like the synthetic images themselves: DP protects whatever
data a party holds, so data that a simulation can regenerate weakens no guarantee; the party's *mechanism*
randomness (sampling, noise) is untouched and stays its own (docs/privacy.md, "What SecProbe claims and what we
guarantee").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from mpi_fnas.config import Config

# Mixed into the seeds so these streams differ from any other use of the same user seed.
_CHOICE_TAG = 0x0C0FFE
_CORRUPTION_TAG = 0x0BAD
SHARD_CODES = {"train": 0, "val": 1}


def unreliable_parties(parties: int, count: int, seed: int) -> np.ndarray:
    """(parties,) bool: exactly `count` parties marked unreliable, drawn from `seed` (public)."""
    if not 0 <= count <= parties:
        raise ValueError(f"count must be in [0, {parties}], got {count}")
    marked = np.zeros(parties, dtype=bool)
    marked[np.random.default_rng([_CHOICE_TAG, seed]).choice(parties, size=count, replace=False)] = True
    return marked


def party_corruption(cfg: Config, parties: int, rank: int) -> float:
    """The fraction of party `rank`'s shards replaced by noise: ``federation.corruption`` when the public seed
    marks it unreliable, else 0."""
    unreliable = unreliable_parties(parties, cfg.federation.unreliable_parties, cfg.seed)
    return cfg.federation.corruption if unreliable[rank - 1] else 0.0


def corrupted_count(size: int, fraction: float) -> int:
    """Examples of a shard of `size` that the corruption replaces: round(fraction · size), exactly."""
    return round(fraction * size)


def corrupt_shard(x: torch.Tensor, y: torch.Tensor, fraction: float, *, num_classes: int, pixel_mean: np.ndarray,
                  pixel_std: np.ndarray, seed: int, rank: int, shard: str) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      np.ndarray]:
    """Replace ``corrupted_count(N, fraction)`` examples of a shard by uniform noise images with random labels.

    Args:
        x: (N, C, H, W) float32 normalised images (as the dataset renders them); y: (N,) int64 labels.
        fraction: P in [0, 1].
        num_classes: the labels are drawn uniformly from 0..num_classes-1.
        pixel_mean, pixel_std: (C,) the dataset's normalisation (``pixel_statistics``): the noise pixels are
            uniform in [0, 1] *before* it, as the paper's.
        seed, rank, shard: which stream ("train" or "val" shard of party `rank` in a run of `seed`).
    Returns:
        (x', y', mask): new tensors (the inputs are not modified) and the (N,) bool mask of replaced examples.
    """
    n = int(y.shape[0])
    rng = np.random.default_rng([_CORRUPTION_TAG, seed, rank, SHARD_CODES[shard]])
    mask = np.zeros(n, dtype=bool)
    mask[rng.choice(n, size=corrupted_count(n, fraction), replace=False)] = True
    count = int(mask.sum())
    shape = (count, *x.shape[1:])
    unit = rng.random(shape, dtype=np.float32)
    noise = (unit - pixel_mean.reshape(1, -1, 1, 1)) / pixel_std.reshape(1, -1, 1, 1)
    labels = rng.integers(0, num_classes, size=count)
    rows = torch.from_numpy(np.flatnonzero(mask))
    x_out, y_out = x.clone(), y.clone()
    x_out[rows] = torch.from_numpy(noise.astype(np.float32)).to(x.device)
    y_out[rows] = torch.from_numpy(labels).to(device=y.device, dtype=y.dtype)
    return x_out, y_out, mask
