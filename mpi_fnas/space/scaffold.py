"""What the supernet and the augment network share around their cells: size checks, the stem, where the
reduction cells sit, how the cells are stacked (:class:`CellNetwork`, their common base), and how a cell brings its
two inputs to one shape.

One definition, so that the network a search ran on and the network its genotype is trained in cannot drift
apart (same stem, same reduction positions, same input preprocessing up to ``affine``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from mpi_fnas.space.genotype import NUM_CELL_INPUTS
from mpi_fnas.space.ops import FactorizedReduce, ReLUConvBN, make_norm

__all__ = ["CellNetwork", "CellPlace", "cell_stack", "cell_widths", "check_sizes", "reduction_layers", "stem"]


def check_sizes(owner: str, **sizes: int) -> None:
    """Refuse a size below its minimum: ``channels`` >= 2 (FactorizedReduce splits channels over two convs), every
    other size >= 1. `owner` names the class in the message."""
    for name, value in sizes.items():
        minimum = 2 if name == "channels" else 1
        if value < minimum:
            raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}")


def reduction_layers(layers: int) -> tuple[int, ...]:
    """The reduction cells' positions, DARTS': at 1/3 and 2/3 of the depth (one cell when they coincide)."""
    return tuple(sorted({layers // 3, 2 * layers // 3}))


def cell_widths(layers: int, channels: int) -> list[tuple[int, bool]]:
    """``(cell_channels, reduction)`` of each of the `layers` cells: `channels`, doubled at each reduction cell of
    :func:`reduction_layers` (the widths :func:`cell_stack` builds)."""
    reductions = reduction_layers(layers)
    widths = []
    for layer in range(layers):
        channels *= 2 if layer in reductions else 1
        widths.append((channels, layer in reductions))
    return widths


def stem(in_channels: int, stem_channels: int, norm: str) -> nn.Sequential:
    """3x3 conv (no bias) then norm: ``(N, in_channels, H, W)`` -> ``(N, stem_channels, H, W)``."""
    return nn.Sequential(
        nn.Conv2d(in_channels, stem_channels, 3, padding=1, bias=False),
        make_norm(norm, stem_channels, affine=True),
    )


class CellPlace(NamedTuple):
    """Where a cell stands in a DARTS network, what :func:`cell_stack` hands `make_cell`: the output channels of the
    two cells before it (the stem's for the first), its own channels, and whether it and the previous cell reduce.
    The search cell and the derived cell take their input preprocessing and their edges' strides from it alike."""

    c_prev_prev: int
    c_prev: int
    channels: int
    reduction: bool
    reduction_prev: bool

    def inputs(self, norm: str, affine: bool) -> tuple[nn.Module, nn.Module]:
        """(preprocess0, preprocess1): both cell inputs to ``channels`` at the resolution of ``s1``.

        ``s0`` (N, c_prev_prev, H0, W0) has twice the resolution of ``s1`` when the previous cell reduced, and is
        then halved by a FactorizedReduce; otherwise a 1x1 ReLUConvBN. ``s1`` (N, c_prev, H1, W1) always takes a 1x1
        ReLUConvBN. Built in that order (the seed's initial weights depend on it).
        """
        if self.reduction_prev:
            preprocess0: nn.Module = FactorizedReduce(self.c_prev_prev, self.channels, norm, affine=affine)
        else:
            preprocess0 = ReLUConvBN(self.c_prev_prev, self.channels, norm, affine=affine)
        return preprocess0, ReLUConvBN(self.c_prev, self.channels, norm, affine=affine)

    def stride(self, j: int) -> int:
        """The stride of an edge leaving state `j`: in a reduction cell only the edges leaving the two cell inputs
        are strided."""
        return 2 if self.reduction and j < NUM_CELL_INPUTS else 1


def cell_stack(layers: int, stem_channels: int, channels: int,
               make_cell: Callable[[CellPlace], nn.Module]) -> tuple[nn.ModuleList, list[int]]:
    """The `layers` cells of a DARTS network after a stem of `stem_channels`, and each cell's output channels.

    Cell by cell, ``make_cell(place)`` builds the next cell at its :class:`CellPlace`: the output channels of the
    two before it (the stem's for the first), its own channels (`channels`, doubled at each reduction cell of
    :func:`reduction_layers`) and whether it and the previous cell reduce; a cell outputs
    ``cell.out_channels_multiplier * cell_channels`` channels.
    """
    c_prev_prev, c_prev = stem_channels, stem_channels
    reduction_prev = False
    cells = nn.ModuleList()
    out_channels = []
    for c_cell, reduction in cell_widths(layers, channels):
        cell = make_cell(CellPlace(c_prev_prev, c_prev, c_cell, reduction, reduction_prev))
        cells.append(cell)
        reduction_prev = reduction
        c_prev_prev, c_prev = c_prev, cell.out_channels_multiplier * c_cell
        out_channels.append(c_prev)
    return cells, out_channels


class WholeNetwork(nn.Module):
    """An evaluation network without an auxiliary head (the DPNAS network, the hand-designed ones): every parameter
    is a weight the server federates, and every one is evaluated."""

    def weights(self) -> list[nn.Parameter]:
        """Every parameter, in ``named_parameters`` order: what the server federates."""
        return list(self.parameters())

    def main_parameters(self) -> list[nn.Parameter]:
        """The evaluated model's parameters (all of them: there is no auxiliary head)."""
        return self.weights()

    def num_params(self) -> int:
        """Number of scalar parameters."""
        return sum(p.numel() for p in self.parameters())


class CellNetwork(nn.Module):
    """A DARTS network around its cells: stem, ``layers`` cells of :func:`cell_stack` (built by `make_cell`),
    global average pooling, linear classifier; it records the sizes it was built with. The supernet and the augment
    network add their cells' inputs (alphas, drop-path) and their forward."""

    def __init__(self, channels: int, num_classes: int, layers: int, in_channels: int, stem_multiplier: int,
                 norm: str, make_cell: Callable[[CellPlace], nn.Module]) -> None:
        super().__init__()
        self.channels = channels
        self.num_classes = num_classes
        self.layers = layers
        self.in_channels = in_channels
        self.norm = norm
        self.reduction_layers = reduction_layers(layers)
        stem_channels = stem_multiplier * channels
        self.stem = stem(in_channels, stem_channels, norm)
        # The cells, and each one's output channels.
        self.cells, self.cell_channels = cell_stack(layers, stem_channels, channels, make_cell)
        self.classifier = nn.Linear(self.cell_channels[-1], num_classes)

    def check_input(self, x: torch.Tensor) -> None:
        """ValueError unless `x` is a batch of images (N, in_channels, H, W)."""
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__} input: expected (N, {self.in_channels}, H, W), got {tuple(x.shape)}"
            )
