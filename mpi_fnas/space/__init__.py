"""Search spaces: DARTS (candidate ops, search cells, the supernet, discrete genotypes, the augment network) and
DPNAS (``mpi_fnas.space.dpnas``), chosen by ``space.kind`` through :func:`search_space`; the hand-designed networks
(``mpi_fnas.space.handcrafted``) and the network the augmentation trains (:func:`augment_network`, by
``augment.network``).

Modules: ``kinds`` (one object per ``space.kind``); DARTS's ``ops``, ``cells`` (the mixed op, the search cell),
``network`` (the supernet), ``genotype`` and ``derived`` (the augment network), with ``scaffold`` (what both
networks share) and ``depthwise`` (a dilated depthwise convolution); ``handcrafted``, ``scattering`` (the fixed
scattering stem) and ``augmented`` (the network by ``augment.network``); the DPNAS package, ``dpnas``.
"""

from mpi_fnas.space.augmented import augment_network, largest_augment_network, trains_cell
from mpi_fnas.space.derived import (
    AugmentNetwork,
    AuxiliaryHead,
    DerivedCell,
    augment_loss,
    build_augment_network,
)
from mpi_fnas.space.genotype import DARTS_V2, Genotype, derive_genotype, max_genotype_length, num_edges
from mpi_fnas.space.handcrafted import HANDCRAFTED, HandcraftedNetwork, build_handcrafted
from mpi_fnas.space.kinds import SPACE_KINDS, search_space
from mpi_fnas.space.network import SearchNetwork, build_supernet
from mpi_fnas.space.ops import PRIMITIVES

__all__ = [
    "DARTS_V2",
    "HANDCRAFTED",
    "PRIMITIVES",
    "SPACE_KINDS",
    "AugmentNetwork",
    "AuxiliaryHead",
    "DerivedCell",
    "Genotype",
    "HandcraftedNetwork",
    "SearchNetwork",
    "augment_loss",
    "augment_network",
    "build_augment_network",
    "build_handcrafted",
    "build_supernet",
    "derive_genotype",
    "largest_augment_network",
    "max_genotype_length",
    "num_edges",
    "search_space",
    "trains_cell",
]
