"""The network the augmentation trains, by ``augment.network``: one entry for rank 0, the parties and the planners,
so that every one of them builds the same network (and the same secure-aggregation dimension) from the config.

* ``cell`` — the evaluation network of a genotype of the space ``space.kind`` (:func:`search_space`);
* a hand-designed name (``cnn-tanh``, ``cnn-gn``) — :func:`~mpi_fnas.space.handcrafted.build_handcrafted`, sized to
  ``data.image_size``; no genotype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from mpi_fnas.config import CELL_NETWORK
from mpi_fnas.space.handcrafted import build_handcrafted
from mpi_fnas.space.kinds import search_space

if TYPE_CHECKING:  # the config module needs no torch; only the annotations name it
    from mpi_fnas.config import Config

__all__ = ["augment_network", "largest_augment_network", "trains_cell"]


def trains_cell(cfg: Config) -> bool:
    """Whether the augmentation of `cfg` trains a cell (``augment.network: cell``) rather than a hand-designed net."""
    return cfg.augment.network == CELL_NETWORK


def augment_network(cfg: Config, genotype: Any, *, seed: int, in_channels: int, num_classes: int) -> nn.Module:
    """The network ``augment.network`` names for ``(N, in_channels, S, S)`` inputs (S = ``data.image_size``) and
    `num_classes`, initialised from `seed`: under ``cell`` the space's network of `genotype`, else the hand-designed
    one (`genotype` must then be None: nothing of a cell is used)."""
    if trains_cell(cfg):
        if genotype is None:
            raise ValueError("augment.network cell: the augmentation needs a genotype to build its network")
        return search_space(cfg.space.kind).build_augment_network(genotype, cfg, seed=seed, in_channels=in_channels,
                                                                  num_classes=num_classes)
    if genotype is not None:
        raise ValueError(f"augment.network {cfg.augment.network}: a hand-designed network takes no genotype")
    return build_handcrafted(cfg.augment.network, seed=seed, in_channels=in_channels, num_classes=num_classes,
                             image_size=cfg.data.image_size)


def largest_augment_network(cfg: Config, *, seed: int, in_channels: int, num_classes: int) -> nn.Module:
    """The largest network the augmentation of `cfg` may train, before any cell is known: the network of the space's
    largest genotype under ``cell`` (:meth:`~mpi_fnas.space.kinds.DartsSpace.largest_genotype`), else the
    hand-designed network itself."""
    genotype = search_space(cfg.space.kind).largest_genotype(cfg) if trains_cell(cfg) else None
    return augment_network(cfg, genotype, seed=seed, in_channels=in_channels, num_classes=num_classes)
