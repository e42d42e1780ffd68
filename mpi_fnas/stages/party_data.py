"""The examples a stage trains and evaluates on, as they enter its network: a party's own shards
(:func:`own_examples`, with an unreliable party's corrupted fraction) and any split through a network's fixed stem
(:func:`with_fixed_stem`, which rank 0's test and aux sets go through too)."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.cpu_kernels import images_to_channels_last
from mpi_fnas.data import Dataset
from mpi_fnas.data.corruption import corrupt_shard
from mpi_fnas.data.datasets import pixel_statistics
from mpi_fnas.space.scattering import fixed_stem_of

#: The fixed stem's features of every example this process has transformed, by (stem, shape, digest): the
#: augmentation's pool is the search's two shards, and rank 0 tests on the same split in both stages, so a later
#: stage (or a later job of a series on the same split) takes them here instead of transforming its examples again.
#: Each row is a view of the features its stage holds (no second copy), with the job that last used it; it stays in
#: this process, and a new job drops what neither it nor the job before used (:func:`start_job`).
_KEPT: dict[tuple, tuple[torch.Tensor, int]] = {}
_job = 0  # the job this process runs now: 0 until the first start_job


def with_fixed_stem(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                    reuse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x through `model`'s fixed stem, y): the features it trains on (a ScatterNet's scattering:
    :mod:`mpi_fnas.space.scattering`); x as it is for a network without one. The features are kept; with `reuse`
    (a later stage's call), they are taken from what this process kept when every example of `x` is there, and
    otherwise all transformed: what a call transforms never depends on which of a party's images repeat (a setup's
    time would tell the server)."""
    stem = fixed_stem_of(model)
    if stem is None:
        return x, y
    keys = [(stem.key, x.dtype, tuple(x.shape[1:]), digest) for digest in _digests(x)]
    # On the CPU, the layout a party stores its shard in (federation.shard.channels_last): the party then holds these
    # very features, and the rows kept are views of them rather than of a second copy.
    on_cpu = x.device.type == "cpu"
    if reuse and keys and all(key in _KEPT for key in keys):
        rows = [_KEPT[key][0].to(x.device) for key in keys]
        features = torch.empty((len(rows), *rows[0].shape), dtype=rows[0].dtype, device=x.device,
                               memory_format=torch.channels_last if on_cpu else torch.contiguous_format)
        torch.stack(rows, out=features)  # straight into that layout: one copy of the pool, not two
    else:
        features = images_to_channels_last(stem(x)) if on_cpu else stem(x)
    for key, row in zip(keys, features, strict=True):  # the newest rows: an earlier stage's copy may be freed
        _KEPT[key] = (row, _job)
    return features, y


def start_job() -> None:
    """A job begins: the features kept that neither the job before nor this one used are dropped. A series of
    jobs on one split (a baseline's arms, a sweep's points of a seed) reuses them; one on other shards (another
    seed) holds at most two jobs' features."""
    global _job
    _job += 1
    for key in [key for key, (_, job) in _KEPT.items() if job < _job - 1]:
        del _KEPT[key]


def forget_kept_features() -> None:
    """Drop every feature this process kept (each test starts without; a run drops them by :func:`start_job`)."""
    _KEPT.clear()


def _digests(x: torch.Tensor) -> list[bytes]:
    """One BLAKE2b digest of each example's values (N small images: milliseconds)."""
    flat = x.detach().reshape(len(x), -1).cpu().contiguous().numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in flat]


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
