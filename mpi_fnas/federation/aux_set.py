"""The server's auxiliary set (SecProbe): a small clean set rank 0 holds, disjoint from every party's data.

* ``synthetic-shapes``: a split of its own (``"aux"``), drawn from the seed like train and test, so the parties'
  partitions do not depend on ``federation.aux_size``.
* ``cifar10``, ``mnist``, ``mnist-5k``, ``imagefolder`` (central partitions): the last ``aux_size`` examples of the
  train split (after ``data.train_size``), a slice held out before the train/validation split and the partition: no
  party is ever given one of them. (``data.partition: local`` has no central train split: refused.)

No MPI, no autograd. The server reads only these examples, never a party's.
"""

from __future__ import annotations

import numpy as np
import torch

from mpi_fnas.config import Config
from mpi_fnas.data import Dataset, open_dataset

# Fewer train examples than this left to the parties cannot be split into train and validation shards.
_MIN_PARTY_EXAMPLES = 2


def held_out_of_train(cfg: Config) -> bool:
    """Whether the aux set is a slice of the train split (real data) rather than a split of its own (synthetic)."""
    return cfg.data.dataset != "synthetic-shapes" and cfg.federation.aux_size > 0


def party_positions(cfg: Config, train_size: int) -> int:
    """How many train-split positions (0..n-1) the parties share: all but the held-out slices at its end, the aux
    slice (``federation.aux_size``) and after it the tuning holdout (``data.holdout``: rank 0's evaluation split
    in place of the test split, :func:`mpi_fnas.federation.job_plan.open_split`).

    Raises ValueError when the slices would leave the parties fewer than 2 examples.
    """
    held = cfg.data.holdout + (cfg.federation.aux_size if held_out_of_train(cfg) else 0)
    left = train_size - held
    if left < _MIN_PARTY_EXAMPLES:
        keys = " and ".join(key for key, value in (("federation.aux_size", held - cfg.data.holdout),
                                                   ("data.holdout", cfg.data.holdout)) if value)
        raise ValueError(f"{keys}: {held} held out leave {left} of the {train_size} train examples to the parties; "
                         "hold out fewer")
    return left


def open_aux_set(cfg: Config, train: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The aux set as rank 0 evaluates it: x float32 (n_aux, C, H, W) normalised, y int64 (n_aux,), on CPU.

    `train` is the run's train split (a real dataset's aux set is its held-out slice).
    """
    n = cfg.federation.aux_size
    if n < 1:
        raise ValueError("federation.aux_size is 0: there is no aux set")
    if held_out_of_train(cfg):
        first = party_positions(cfg, len(train))
        return train.render(np.arange(first, first + n))
    aux = open_dataset(cfg.data.dataset, "aux", root=cfg.data.root, image_size=cfg.data.image_size, size=n,
                       seed=cfg.seed)
    return aux.render(np.arange(n))
