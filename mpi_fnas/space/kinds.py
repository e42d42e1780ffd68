"""The search spaces by ``space.kind``: one object per kind, each answering the same few questions, so the
federation, the log and the report ask ``search_space(cfg.space.kind)`` instead of testing which space they run.

* ``darts`` — DARTS' normal and reduction cells (``mpi_fnas.space``), the default;
* ``dpnas`` — DPNAS' one dense cell with a choice of activations (``mpi_fnas.space.dpnas``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from mpi_fnas.space import dpnas
from mpi_fnas.space.derived import build_augment_network
from mpi_fnas.space.genotype import EDGES_PER_NODE, NUM_CELL_INPUTS, Genotype, max_genotype_length, num_edges
from mpi_fnas.space.network import build_supernet
from mpi_fnas.space.ops import PRIMITIVES

if TYPE_CHECKING:  # the config module needs no torch; only the annotations name it
    from mpi_fnas.config import Config, SpaceConfig

__all__ = ["SPACE_KINDS", "DartsSpace", "DpnasSpace", "search_space"]


@dataclass(frozen=True)
class DartsSpace:
    """DARTS: a normal and a reduction cell, each with its own alpha ``(num_edges(nodes), 8)``."""

    kind: str = "darts"
    primitives: tuple[str, ...] = PRIMITIVES

    def build_supernet(self, space: SpaceConfig, *, seed: int, in_channels: int, num_classes: int) -> nn.Module:
        """The supernet of the ``space`` section, initialised from ``seed`` (bit-identical on every rank)."""
        return build_supernet(space, seed=seed, in_channels=in_channels, num_classes=num_classes)

    def alpha_shapes(self, space: SpaceConfig) -> tuple[tuple[int, int], tuple[int, int]]:
        """(edges, ops) of the normal and of the reduction cell's softmax weights, as the log stores them."""
        shape = (num_edges(space.nodes), len(self.primitives))
        return shape, shape

    def max_genotype_length(self, space: SpaceConfig) -> int:
        """Bytes any genotype string of this space can take (the log's fixed string length)."""
        return max_genotype_length(space.nodes, self.primitives)

    def parse_genotype(self, text: str) -> Genotype:
        """A ``Genotype.to_string`` text; ValueError when it does not parse."""
        return Genotype.from_string(text)

    def check_trainable(self, genotype: Genotype) -> None:
        """Every parsed DARTS genotype can be built (``from_string`` refuses ``none``): nothing to check."""

    def random_genotype(self, space: SpaceConfig, rng: np.random.Generator) -> Genotype:
        """A genotype drawn uniformly from those the search can derive (Li & Talwalkar's random baseline): for every
        node of each cell, independently, 2 distinct inputs uniformly among its ``i + 2`` states and for each a
        non-``none`` op uniformly; concat = every intermediate node, as ``derive_genotype`` does."""
        ops = [p for p in self.primitives if p != "none"]
        cells = []
        for _ in ("normal", "reduce"):
            edges: list[tuple[str, int]] = []
            for node in range(space.nodes):
                inputs = sorted(int(j) for j in rng.choice(node + NUM_CELL_INPUTS, EDGES_PER_NODE, replace=False))
                edges += [(ops[int(rng.integers(len(ops)))], j) for j in inputs]
            cells.append(tuple(edges))
        concat = tuple(range(NUM_CELL_INPUTS, NUM_CELL_INPUTS + space.nodes))
        return Genotype(normal=cells[0], normal_concat=concat, reduce=cells[1], reduce_concat=concat)

    def largest_genotype(self, space: SpaceConfig) -> Genotype:
        """The genotype whose evaluation network has the most parameters: every edge ``sep_conv_5x5`` (the op
        with the most parameters at any width and stride), from inputs 0 and 1. Secure aggregation accounts every
        release of a run at this network's size (``mpi_fnas.federation.plan.secure_dimension``), before the
        search has picked a cell."""
        edges = tuple(("sep_conv_5x5", j) for _ in range(space.nodes) for j in range(EDGES_PER_NODE))
        concat = tuple(range(NUM_CELL_INPUTS, NUM_CELL_INPUTS + space.nodes))
        return Genotype(normal=edges, normal_concat=concat, reduce=edges, reduce_concat=concat)

    def build_augment_network(self, genotype: Any, cfg: Config, *, seed: int, in_channels: int,
                              num_classes: int) -> nn.Module:
        """The DARTS evaluation network of ``genotype`` (``augment.layers`` cells of ``augment.channels``)."""
        return build_augment_network(
            genotype, channels=cfg.augment.channels, layers=cfg.augment.layers, seed=seed, in_channels=in_channels,
            num_classes=num_classes, stem_multiplier=cfg.space.stem_multiplier, norm=cfg.space.norm,
            auxiliary=cfg.augment.auxiliary_weight > 0,
        )


@dataclass(frozen=True)
class DpnasSpace:
    """DPNAS: one cell for every stage, one alpha ``(num_edges(nodes), 10)``; the log's reduction alpha has 0 edges."""

    kind: str = "dpnas"
    primitives: tuple[str, ...] = dpnas.PRIMITIVES

    def build_supernet(self, space: SpaceConfig, *, seed: int, in_channels: int, num_classes: int) -> nn.Module:
        """The DPNAS supernet (``space.stage_channels``, ``space.nodes``), initialised from ``seed``."""
        torch.manual_seed(seed)
        return dpnas.DpnasSearchNetwork(space.stage_channels, num_classes, nodes=space.nodes, in_channels=in_channels)

    def alpha_shapes(self, space: SpaceConfig) -> tuple[tuple[int, int], tuple[int, int]]:
        """The one cell's (edges, ops) as the normal cell's; the reduction cell's has no edge: (0, ops)."""
        return (dpnas.num_edges(space.nodes), len(self.primitives)), (0, len(self.primitives))

    def max_genotype_length(self, space: SpaceConfig) -> int:
        """The longest genotype text of the space at `space.nodes`, in bytes (the log's fixed width)."""
        return dpnas.max_dpnas_genotype_length(space.nodes)

    def parse_genotype(self, text: str) -> dpnas.DpnasGenotype:
        """A ``DpnasGenotype.to_string`` text; ValueError when it does not parse."""
        return dpnas.DpnasGenotype.from_string(text)

    def check_trainable(self, genotype: dpnas.DpnasGenotype) -> None:
        """ValueError for a cell whose output does not depend on its input (the all-``none`` cell is one): no
        network is built from it (``DerivedDpnasCell`` refuses it with the same message)."""
        dpnas.check_connected(genotype)

    def random_genotype(self, space: SpaceConfig, rng: np.random.Generator) -> dpnas.DpnasGenotype:
        """A cell drawn uniformly from the trainable ones: every edge's op uniformly among the 10 primitives
        (``none`` = no edge, as the argmax derivation allows), redrawn until the cell is connected."""
        while True:
            ops = tuple(self.primitives[int(k)] for k in rng.integers(len(self.primitives),
                                                                        size=dpnas.num_edges(space.nodes)))
            genotype = dpnas.DpnasGenotype(ops)
            if genotype.connected:
                return genotype

    def largest_genotype(self, space: SpaceConfig) -> dpnas.DpnasGenotype:
        """The cell whose network has the most parameters: every edge a convolution (they all have the same
        parameters; pools, skips and ``none`` have none), as :meth:`DartsSpace.largest_genotype`."""
        return dpnas.DpnasGenotype((dpnas.CONV_PREFIX + "relu",) * dpnas.num_edges(space.nodes))

    def build_augment_network(self, genotype: Any, cfg: Config, *, seed: int, in_channels: int,
                              num_classes: int) -> nn.Module:
        """``DpnasNetwork`` of ``genotype`` with the searched widths (``space.stage_channels``: the paper trains
        DPNASNet at the size it searched), initialised from ``seed``. ValueError for a cell that is not
        connected."""
        torch.manual_seed(seed)
        return dpnas.DpnasNetwork(genotype, cfg.space.stage_channels, num_classes, in_channels=in_channels)


#: Every space, by ``space.kind``.
SPACE_KINDS: dict[str, DartsSpace | DpnasSpace] = {"darts": DartsSpace(), "dpnas": DpnasSpace()}


def search_space(kind: str) -> DartsSpace | DpnasSpace:
    """The space named ``kind`` (``space.kind``); ValueError for an unknown one."""
    if kind not in SPACE_KINDS:
        raise ValueError(f"unknown space kind {kind!r}; expected one of {', '.join(SPACE_KINDS)}")
    return SPACE_KINDS[kind]
