"""Seeded partitions of a split among federated parties, from labels only (rank 0 never needs pixels).

All functions return positions into the array they were given (callers map them to dataset indices) as sorted
int64 arrays, and are deterministic given ``seed``.
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np

SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "pathological")

# Mixed into the seeds so these streams differ from any other use of the same user seed.
_PARTITION_TAG = 0x9A27
_SPLIT_TAG = 0x5B11


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def partition_indices(
    labels: np.ndarray,
    parties: int,
    scheme: str,
    seed: int,
    *,
    dirichlet_alpha: float = 0.5,
    classes_per_party: int = 2,
) -> list[np.ndarray]:
    """Split positions ``0..len(labels)-1`` among ``parties``; every position goes to exactly one party.

    - ``iid``: shuffle, then near-equal contiguous chunks.
    - ``dirichlet``: per class, party shares ~ Dirichlet(``dirichlet_alpha``); an empty party gets one of the largest's.
    - ``pathological`` (McMahan et al. 2017): sorted by label into ``parties * classes_per_party`` near-equal shards,
      ``classes_per_party`` to each party at random: exactly that many classes each if the classes are balanced and
      ``parties * classes_per_party == num_classes`` (ADADP's split), else a shard may straddle a class boundary.

    Args:
        labels: int (N,) class of each example.
    Returns:
        ``parties`` sorted int64 arrays, pairwise disjoint, jointly covering ``0..N-1``, none empty.
    Raises:
        ValueError: unknown scheme, bad parameters, or too few examples to give every party (shard) one.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not (labels.size == 0 or np.issubdtype(labels.dtype, np.integer)):
        raise ValueError(f"labels must be a 1-D integer array, got dtype {labels.dtype} shape {labels.shape}")
    if isinstance(parties, bool) or not isinstance(parties, (int, np.integer)) or parties < 1:
        raise ValueError(f"parties must be a positive integer, got {parties!r}")
    seed = _check_seed(seed)
    n = labels.size
    if n < parties:
        raise ValueError(f"cannot give each of {parties} parties an example: only {n} examples")
    rng = np.random.default_rng([_PARTITION_TAG, seed])

    if scheme == "iid":
        parts = np.array_split(rng.permutation(n), parties)
    elif scheme == "dirichlet":
        if not _is_real(dirichlet_alpha) or not math.isfinite(dirichlet_alpha) or dirichlet_alpha <= 0:
            raise ValueError(f"dirichlet_alpha must be a finite number > 0, got {dirichlet_alpha!r}")
        parts = _dirichlet(labels, parties, float(dirichlet_alpha), rng)
    elif scheme == "pathological":
        if (
            isinstance(classes_per_party, bool)
            or not isinstance(classes_per_party, (int, np.integer))
            or classes_per_party < 1
        ):
            raise ValueError(f"classes_per_party must be a positive integer, got {classes_per_party!r}")
        shards = parties * int(classes_per_party)
        if n < shards:
            raise ValueError(
                f"pathological split needs at least parties*classes_per_party = {shards} examples, got {n}"
            )
        perm = rng.permutation(n)
        by_label = perm[np.argsort(labels[perm], kind="stable")]
        shard_list = np.array_split(by_label, shards)
        owner = rng.permutation(shards).reshape(parties, int(classes_per_party))
        parts = [np.concatenate([shard_list[s] for s in row]) for row in owner]
    else:
        raise ValueError(f"unknown partition scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    return [np.sort(p).astype(np.int64) for p in parts]


def _dirichlet(labels: np.ndarray, parties: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Per-class Dirichlet allocation, then a deterministic repair so that no party is empty."""
    buckets: list[list[np.ndarray]] = [[] for _ in range(parties)]
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        proportions = rng.dirichlet(np.full(parties, alpha))
        # Cut points from cumulative proportions; floor keeps them monotone and the last chunk takes the rest.
        cuts = np.floor(np.cumsum(proportions)[:-1] * members.size).astype(np.int64)
        for k, chunk in enumerate(np.split(members, cuts)):
            buckets[k].append(chunk)
    parts = [np.concatenate(b) for b in buckets]

    # Tiny alpha concentrates each class on few parties; move single examples from the largest party (lowest
    # rank on ties) to each empty one. n >= parties guarantees the donor keeps at least one example.
    for k in range(parties):
        if parts[k].size == 0:
            donor = int(np.argmax([p.size for p in parts]))
            parts[k] = parts[donor][-1:]
            parts[donor] = parts[donor][:-1]
    return parts


def split_train_val(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Divide positions ``0..n-1`` into (search-train, search-val), as DARTS splits CIFAR-10's train 25k/25k.

    ``round(n * val_fraction)`` positions, chosen at random, go to validation. Returns two sorted int64
    arrays, disjoint, covering ``0..n-1``, both non-empty.
    """
    seed = _check_seed(seed)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise ValueError(f"n must be an integer >= 2 to have both a train and a val part, got {n!r}")
    if not (_is_real(val_fraction) and 0.0 < val_fraction < 1.0):
        raise ValueError(f"val_fraction must be strictly between 0 and 1, got {val_fraction!r}")
    n_val = round(n * val_fraction)
    if not 0 < n_val < n:
        raise ValueError(f"val_fraction={val_fraction} of n={n} leaves the train or the val part empty")
    perm = np.random.default_rng([_SPLIT_TAG, seed]).permutation(n)
    return np.sort(perm[n_val:]).astype(np.int64), np.sort(perm[:n_val]).astype(np.int64)
