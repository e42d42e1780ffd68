"""The DARTS supernet: weights W (all conv/norm/linear parameters) and architecture variables A (alphas)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mpi_fnas.space.cells import SearchCell
from mpi_fnas.space.genotype import Genotype, derive_genotype, num_edges
from mpi_fnas.space.ops import PRIMITIVES
from mpi_fnas.space.scaffold import CellNetwork, check_sizes

__all__ = ["SearchNetwork", "num_edges"]

ALPHA_INIT_SCALE = 1e-3  # DARTS: near-uniform op weights at the start of the search


class SearchNetwork(CellNetwork):
    """DARTS search network: stem, ``layers`` search cells, global average pooling, linear classifier.

    Cells at ``layers // 3`` and ``2 * layers // 3`` are reduction cells (halve H and W, double the channels);
    with ``layers`` <= 2 every cell is a reduction cell, so ``alpha_normal`` is unused and its ``.grad`` stays
    ``None`` after ``backward`` (callers flattening gradients must treat that as zeros). Every normal cell
    shares ``alpha_normal`` and every reduction cell shares ``alpha_reduce``, each of shape
    ``(num_edges(nodes), len(primitives))``; the op weights of an edge are the row softmax.

    ``forward(x)``: ``x`` (N, in_channels, H, W) float -> logits (N, num_classes). The alphas may be replaced
    (``functional_call``) by per-example copies ``(N, edges, ops)``, example n using row n
    (:attr:`per_example_parameters`: how per-example DP takes their gradients in one backward).

    Normalisation layers keep no buffers (see ``make_norm``), so ``state_dict`` equals the parameters. With
    ``norm="groupnorm"`` no layer mixes examples of a batch, which per-example DP relies on.
    """

    #: Parameters the forward also takes with a leading batch dimension, one copy per example.
    per_example_parameters = ("alpha_normal", "alpha_reduce")

    def __init__(
        self,
        channels: int,
        num_classes: int,
        layers: int,
        nodes: int = 4,
        stem_multiplier: int = 3,
        in_channels: int = 3,
        norm: str = "batchnorm",
        primitives: Sequence[str] = PRIMITIVES,
    ) -> None:
        check_sizes("SearchNetwork", channels=channels, num_classes=num_classes, layers=layers, nodes=nodes,
                    stem_multiplier=stem_multiplier, in_channels=in_channels)
        primitives = tuple(primitives)
        unknown = [p for p in primitives if p not in PRIMITIVES]
        if unknown:
            raise ValueError(
                f"SearchNetwork: unknown primitives {unknown}; expected a subset of {PRIMITIVES}"
            )
        if len(set(primitives)) != len(primitives):
            raise ValueError(f"SearchNetwork: duplicate primitives in {primitives}")
        if all(p == "none" for p in primitives):
            raise ValueError("SearchNetwork: primitives need at least one op other than 'none'")

        super().__init__(channels, num_classes, layers, in_channels, stem_multiplier, norm,
                         lambda place: SearchCell(nodes, place, norm, primitives))
        self.nodes = nodes
        self.primitives = primitives

        # Created last so that, for a given seed, weight initialisation does not depend on the alpha shape.
        shape = (num_edges(nodes), len(primitives))
        self.alpha_normal = nn.Parameter(ALPHA_INIT_SCALE * torch.randn(shape))
        self.alpha_reduce = nn.Parameter(ALPHA_INIT_SCALE * torch.randn(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (N, in_channels, H, W) -> logits (N, num_classes)."""
        self.check_input(x)
        # One softmax per cell type per forward, shared by all cells of that type.
        weights_normal = F.softmax(self.alpha_normal, dim=-1)
        weights_reduce = F.softmax(self.alpha_reduce, dim=-1)
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            weights = weights_reduce if cell.reduction else weights_normal
            s0, s1 = s1, cell(s0, s1, weights)
        pooled = F.adaptive_avg_pool2d(s1, 1).flatten(1)  # (N, nodes * final cell channels)
        return self.classifier(pooled)

    def _is_alpha(self, param: nn.Parameter) -> bool:
        return param is self.alpha_normal or param is self.alpha_reduce

    def named_weights(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` for every parameter except the alphas, in ``named_parameters`` order."""
        return ((name, p) for name, p in self.named_parameters() if not self._is_alpha(p))

    def weights(self) -> list[nn.Parameter]:
        """Network weights W: every parameter except the alphas, in ``named_parameters`` order."""
        return [p for _, p in self.named_weights()]

    def named_alphas(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``("alpha_normal", (edges, ops))`` then ``("alpha_reduce", (edges, ops))``."""
        return iter((("alpha_normal", self.alpha_normal), ("alpha_reduce", self.alpha_reduce)))

    def alphas(self) -> list[nn.Parameter]:
        """Architecture variables A: ``[alpha_normal, alpha_reduce]``, each (edges, ops)."""
        return [self.alpha_normal, self.alpha_reduce]

    def alpha_softmax(self) -> dict[str, torch.Tensor]:
        """Detached row-softmax op weights: ``{"normal": (edges, ops), "reduce": (edges, ops)}``."""
        with torch.no_grad():
            return {
                "normal": F.softmax(self.alpha_normal, dim=-1).detach(),
                "reduce": F.softmax(self.alpha_reduce, dim=-1).detach(),
            }

    def genotype(self) -> Genotype:
        """Discrete architecture from the current alphas (``derive_genotype`` rule)."""
        weights = self.alpha_softmax()
        return derive_genotype(weights["normal"], weights["reduce"], self.nodes, self.primitives)


def build_supernet(space, *, seed: int, in_channels: int, num_classes: int,
                   primitives: Sequence[str] = PRIMITIVES) -> SearchNetwork:
    """The supernet described by the ``space`` config section, initialised from ``seed``, with the candidate
    ops `primitives` (``DartsSpace.candidates``: ``space.ops``).

    Every rank calls it with the same arguments and gets bit-identical W and A, so the copies start equal.
    """
    torch.manual_seed(seed)
    return SearchNetwork(
        channels=space.channels, num_classes=num_classes, layers=space.layers, nodes=space.nodes,
        stem_multiplier=space.stem_multiplier, in_channels=in_channels, norm=space.norm, primitives=primitives,
    )
