"""The DPNAS search space (Cheng et al. 2021): ops with a choice of activation, one dense cell shared by every
stage, derivation by per-edge argmax with ``none`` meaning "no edge". Selected by ``space.kind: dpnas``.

Modules: ``ops`` (the ten candidate ops), ``cells`` (the search cell and the derived cell), ``network`` (the
search network and the derived one) and ``genotype`` (the cell's topology, derivation and string form).
"""

from mpi_fnas.space.dpnas.cells import DerivedDpnasCell, DpnasMixedOp, DpnasSearchCell
from mpi_fnas.space.dpnas.genotype import (
    CHOICES,
    DpnasGenotype,
    check_connected,
    derive_dpnas_genotype,
    edge_endpoints,
    max_dpnas_genotype_length,
    num_edges,
)
from mpi_fnas.space.dpnas.network import SEARCH, DpnasNetwork, DpnasSearchNetwork
from mpi_fnas.space.dpnas.ops import ACTIVATIONS, CONV_PREFIX, PRIMITIVES, make_dpnas_op

__all__ = [
    "ACTIVATIONS",
    "CHOICES",
    "CONV_PREFIX",
    "PRIMITIVES",
    "SEARCH",
    "DerivedDpnasCell",
    "DpnasGenotype",
    "DpnasMixedOp",
    "DpnasNetwork",
    "DpnasSearchCell",
    "DpnasSearchNetwork",
    "check_connected",
    "derive_dpnas_genotype",
    "edge_endpoints",
    "make_dpnas_op",
    "max_dpnas_genotype_length",
    "num_edges",
]
