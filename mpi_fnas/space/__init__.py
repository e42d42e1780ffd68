"""DARTS search space: candidate ops, search cells, the supernet, and discrete genotypes."""

from mpi_fnas.space.genotype import Genotype, derive_genotype, max_genotype_length, num_edges
from mpi_fnas.space.network import SearchNetwork, build_supernet
from mpi_fnas.space.ops import PRIMITIVES

__all__ = [
    "PRIMITIVES",
    "Genotype",
    "SearchNetwork",
    "build_supernet",
    "derive_genotype",
    "max_genotype_length",
    "num_edges",
]
