"""The search spaces by ``space.kind``: one object per kind, each answering the same few questions, so the
federation, the log and the report ask ``search_space(cfg.space.kind)`` instead of testing which space they run.

* ``darts`` — DARTS' normal and reduction cells (``mpi_fnas.space``), the default;
* ``dpnas`` — DPNAS' one dense cell with a choice of activations (``mpi_fnas.space.dpnas``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from mpi_fnas.op_names import candidate_ops
from mpi_fnas.space import dpnas
from mpi_fnas.space.derived import build_augment_network
from mpi_fnas.space.genotype import EDGES_PER_NODE, NUM_CELL_INPUTS, Genotype, max_genotype_length, num_edges
from mpi_fnas.space.network import build_supernet
from mpi_fnas.space.ops import PRIMITIVES, make_op
from mpi_fnas.space.scaffold import cell_widths

if TYPE_CHECKING:  # the config module needs no torch; only the annotations name it
    from mpi_fnas.config import Config, SpaceConfig

__all__ = ["SPACE_KINDS", "DartsSpace", "DpnasSpace", "search_space"]


def check_candidates(ops: Iterable[str], candidates: tuple[str, ...]) -> None:
    """ValueError naming the first of a genotype's `ops` that is not a candidate (``space.ops``): its network
    could be larger than the one the run's ε was accounted at."""
    for op in ops:
        if op not in candidates:
            raise ValueError(f"op {op!r} is not among space.ops ({', '.join(candidates)})")


@dataclass(frozen=True)
class DartsSpace:
    """DARTS: a normal and a reduction cell, each with its own alpha ``(num_edges(nodes), 8)``."""

    kind: str = "darts"
    primitives: tuple[str, ...] = PRIMITIVES

    def candidates(self, space: SpaceConfig) -> tuple[str, ...]:
        """The ops of ``space.ops`` (every primitive when empty), in ``PRIMITIVES`` order: the alpha's columns."""
        return candidate_ops(self.primitives, space.ops)

    def build_supernet(self, space: SpaceConfig, *, seed: int, in_channels: int, num_classes: int) -> nn.Module:
        """The supernet of the ``space`` section, initialised from ``seed`` (bit-identical on every rank)."""
        return build_supernet(space, seed=seed, in_channels=in_channels, num_classes=num_classes,
                              primitives=self.candidates(space))

    def alpha_shapes(self, space: SpaceConfig) -> tuple[tuple[int, int], tuple[int, int]]:
        """(edges, ops) of the normal and of the reduction cell's softmax weights, as the log stores them."""
        shape = (num_edges(space.nodes), len(self.candidates(space)))
        return shape, shape

    def max_genotype_length(self, space: SpaceConfig) -> int:
        """Bytes any genotype string of this space can take (the log's fixed string length)."""
        return max_genotype_length(space.nodes, self.primitives)

    def parse_genotype(self, text: str, space: SpaceConfig | None = None) -> Genotype:
        """A ``Genotype.to_string`` text; ValueError when it does not parse, or when an op is not among
        `space`'s candidates (None: any op of the kind)."""
        ops = self.candidates(space) if space is not None else self.primitives
        return Genotype.from_string(text, primitives=ops)

    def check_trainable(self, genotype: Genotype) -> None:
        """Every parsed DARTS genotype can be built (``from_string`` refuses ``none``): nothing to check."""

    def random_genotype(self, space: SpaceConfig, rng: np.random.Generator) -> Genotype:
        """A genotype drawn uniformly from those the search can derive (Li & Talwalkar's random baseline): for every
        node of each cell, independently, 2 distinct inputs uniformly among its ``i + 2`` states and for each a
        non-``none`` op uniformly; concat = every intermediate node, as ``derive_genotype`` does."""
        ops = [p for p in self.candidates(space) if p != "none"]
        cells = []
        for _ in ("normal", "reduce"):
            edges: list[tuple[str, int]] = []
            for node in range(space.nodes):
                inputs = sorted(int(j) for j in rng.choice(node + NUM_CELL_INPUTS, EDGES_PER_NODE, replace=False))
                edges += [(ops[int(rng.integers(len(ops)))], j) for j in inputs]
            cells.append(tuple(edges))
        concat = tuple(range(NUM_CELL_INPUTS, NUM_CELL_INPUTS + space.nodes))
        return Genotype(normal=cells[0], normal_concat=concat, reduce=cells[1], reduce_concat=concat)

    def largest_genotype(self, cfg: Config) -> Genotype:
        """The genotype whose evaluation network (``augment.channels``, ``augment.layers``) has the most parameters:
        every edge from inputs 0 and 1, each cell's edges the candidate op with the most parameters summed over
        that cell's widths and strides (``sep_conv_5x5`` whenever it is a candidate). Secure aggregation accounts
        every release of a run at this network's size (``mpi_fnas.federation.job_plan.secure_dimension``), before the
        search has picked a cell. Exact: an op's parameters do not depend on the other edges, and an edge from an
        input has at least as many as one from a node (it is the strided one in a reduction cell)."""
        space = cfg.space
        ops = [op for op in self.candidates(space) if op != "none"]
        widths = cell_widths(cfg.augment.layers, cfg.augment.channels)

        def weights(op: str, reduction: bool) -> int:
            return sum(sum(p.numel() for p in make_op(op, c, 2 if reduction else 1, space.norm, affine=True,
                                                      pool_norm=False).parameters())
                       for c, reduces in widths if reduces == reduction)

        normal, reduce = (max(ops, key=lambda op, r=r: weights(op, r)) for r in (False, True))
        concat = tuple(range(NUM_CELL_INPUTS, NUM_CELL_INPUTS + space.nodes))
        return Genotype(normal=tuple((normal, j) for _ in range(space.nodes) for j in range(EDGES_PER_NODE)),
                        normal_concat=concat,
                        reduce=tuple((reduce, j) for _ in range(space.nodes) for j in range(EDGES_PER_NODE)),
                        reduce_concat=concat)

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

    def candidates(self, space: SpaceConfig) -> tuple[str, ...]:
        """The ops of ``space.ops`` (all 10 when empty), in ``dpnas.PRIMITIVES`` order: the alpha's columns."""
        return candidate_ops(self.primitives, space.ops)

    def build_supernet(self, space: SpaceConfig, *, seed: int, in_channels: int, num_classes: int) -> nn.Module:
        """The DPNAS supernet (``space.stage_channels``, ``space.nodes``, ``space.ops``, ``space.stem``,
        ``space.stem_stride``, ``space.head``, ``space.head_pool``), initialised from ``seed``."""
        torch.manual_seed(seed)
        return dpnas.DpnasSearchNetwork(space.stage_channels, num_classes, nodes=space.nodes, in_channels=in_channels,
                                        primitives=self.candidates(space), stem_stride=space.stem_stride,
                                        head_pool=space.head_pool, stem_kind=space.stem, head_kind=space.head)

    def alpha_shapes(self, space: SpaceConfig) -> tuple[tuple[int, int], tuple[int, int]]:
        """The one cell's (edges, ops) as the normal cell's; the reduction cell's has no edge: (0, ops)."""
        ops = len(self.candidates(space))
        return (dpnas.num_edges(space.nodes), ops), (0, ops)

    def max_genotype_length(self, space: SpaceConfig) -> int:
        """The longest genotype text of the space at `space.nodes`, in bytes (the log's fixed width)."""
        return dpnas.max_dpnas_genotype_length(space.nodes)

    def parse_genotype(self, text: str, space: SpaceConfig | None = None) -> dpnas.DpnasGenotype:
        """A ``DpnasGenotype.to_string`` text; ValueError when it does not parse, or when an edge's op is not
        among `space`'s candidates (``none`` included: without it in ``space.ops`` every edge is kept; None: any
        op of the kind)."""
        genotype = dpnas.DpnasGenotype.from_string(text)
        if space is not None:
            check_candidates(genotype.ops, self.candidates(space))
            for name in dpnas.CHOICES:  # a choice the space searched must be named; one it fixes, not another
                configured, chosen = getattr(space, name), getattr(genotype, name)
                if chosen is not None and configured not in (dpnas.SEARCH, chosen):
                    raise ValueError(f"the genotype's {name} {chosen!r} is not space.{name} {configured!r}")
        return genotype

    def check_trainable(self, genotype: dpnas.DpnasGenotype) -> None:
        """ValueError for a cell whose output does not depend on its input (the all-``none`` cell is one): no
        network is built from it (``DerivedDpnasCell`` refuses it with the same message)."""
        dpnas.check_connected(genotype)

    def random_genotype(self, space: SpaceConfig, rng: np.random.Generator) -> dpnas.DpnasGenotype:
        """A cell drawn uniformly from the trainable ones: every edge's op uniformly among the candidates (all 10
        primitives unless ``space.ops``; ``none`` = no edge, as the argmax derivation allows), redrawn until the
        cell is connected; then each choice the space searches (``space.stem``, ``space.head``: search) uniformly
        among its candidates, as the search could have derived it. A fixed choice is left to the space."""
        candidates = self.candidates(space)
        while True:
            ops = tuple(candidates[int(k)] for k in rng.integers(len(candidates), size=dpnas.num_edges(space.nodes)))
            if dpnas.DpnasGenotype(ops).connected:
                break
        # Drawn after the cell, so a space without a searched choice draws the cells it always drew.
        chosen = {name: values[int(rng.integers(len(values)))] for name, values in dpnas.CHOICES.items()
                  if getattr(space, name) == dpnas.SEARCH}
        return dpnas.DpnasGenotype(ops, **chosen)

    def largest_genotype(self, cfg: Config) -> dpnas.DpnasGenotype:
        """The cell whose network has the most parameters: every edge a candidate convolution (they all have the
        same parameters), else every edge the first candidate other than ``none`` (pools and skips have none), as
        :meth:`DartsSpace.largest_genotype`; of a searched stem or head, the candidate with more parameters (the
        scattering stem, whose 81 channels a colour channel feed the first cell; the dpnas head)."""
        kept = [op for op in self.candidates(cfg.space) if op != "none"]
        op = next((name for name in kept if name.startswith(dpnas.CONV_PREFIX)), kept[0])
        larger = {"stem": "scattering", "head": "dpnas"}
        return dpnas.DpnasGenotype((op,) * dpnas.num_edges(cfg.space.nodes),
                                   **{name: larger[name] for name in dpnas.CHOICES
                                      if getattr(cfg.space, name) == dpnas.SEARCH})

    def build_augment_network(self, genotype: Any, cfg: Config, *, seed: int, in_channels: int,
                              num_classes: int) -> nn.Module:
        """``DpnasNetwork`` of ``genotype`` with the searched widths (``space.stage_channels``: the paper trains
        DPNASNet at the size it searched), initialised from ``seed``. ValueError for a cell that is not
        connected."""
        kinds = {name: getattr(genotype, name) or getattr(cfg.space, name) for name in dpnas.CHOICES}
        searched = [name for name, kind in kinds.items() if kind == dpnas.SEARCH]
        if searched:
            raise ValueError(f"space.{searched[0]}: search, but the genotype names no {searched[0]} (a genotype of a "
                             f"search that chose it ends in ';{searched[0]}=...')")
        torch.manual_seed(seed)
        return dpnas.DpnasNetwork(genotype, cfg.space.stage_channels, num_classes, in_channels=in_channels,
                                  stem_stride=cfg.space.stem_stride, head_pool=cfg.space.head_pool,
                                  stem_kind=kinds["stem"], head_kind=kinds["head"])


#: Every space, by ``space.kind``.
SPACE_KINDS: dict[str, DartsSpace | DpnasSpace] = {"darts": DartsSpace(), "dpnas": DpnasSpace()}


def search_space(kind: str) -> DartsSpace | DpnasSpace:
    """The space named ``kind`` (``space.kind``); ValueError for an unknown one."""
    if kind not in SPACE_KINDS:
        raise ValueError(f"unknown space kind {kind!r}; expected one of {', '.join(SPACE_KINDS)}")
    return SPACE_KINDS[kind]
