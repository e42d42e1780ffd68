"""DPNAS cells: the search cell (every op on every edge, weighted by the alphas) and the derived cell (one op per
kept edge). Both: a 1x1 conv + GroupNorm brings the input to the cell's channels (state 0), then the intermediate
nodes of :mod:`mpi_fnas.space.dpnas.genotype`, concatenated. A cell keeps the resolution; the network pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from mpi_fnas.space.cells import check_weights, dense_nodes, weighted_sum
from mpi_fnas.space.derived import drop_path
from mpi_fnas.space.dpnas.genotype import (
    NUM_CELL_INPUTS,
    DpnasGenotype,
    check_connected,
    edge_endpoints,
    num_edges,
)
from mpi_fnas.space.dpnas.ops import PRIMITIVES, make_dpnas_op
from mpi_fnas.space.ops import make_norm

if TYPE_CHECKING:  # the type only: the network never imports the privacy package
    from mpi_fnas.keystream import Keystream


def cell_input(c_in: int, channels: int) -> nn.Sequential:
    """State 0: 1x1 conv (no bias) -> GroupNorm (no affine): ``(N, c_in, H, W)`` -> ``(N, channels, H, W)``."""
    return nn.Sequential(nn.Conv2d(c_in, channels, 1, bias=False), make_norm("groupnorm", channels, affine=False))


class DpnasMixedOp(nn.Module):
    """Every DPNAS op of one edge, summed with weights: ``forward(x (N, C, H, W), weights (ops,) or (N, ops),
    only=None)`` -> (N, C, H, W); ``only``: run that op alone (a sampled path)."""

    def __init__(self, channels: int, primitives: Sequence[str] = PRIMITIVES) -> None:
        super().__init__()
        self.ops = nn.ModuleList(make_dpnas_op(name, channels) for name in primitives)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, only: int | None = None) -> torch.Tensor:
        """The ops on `x`, mixed by `weights` (one per op, or one row per example)."""
        check_weights("DpnasMixedOp", weights, (len(self.ops),), x.shape[0])
        return weighted_sum(self.ops, x, weights, only)


class DpnasSearchCell(nn.Module):
    """``forward(x, weights, path=None)``: ``x`` (N, c_in, H, W), ``weights`` (num_edges(nodes), len(primitives))
    softmax weights, or (N, ...) one set per example -> (N, nodes · channels, H, W); ``path``: one op per edge, the
    only one run."""

    def __init__(self, nodes: int, c_in: int, channels: int, primitives: Sequence[str] = PRIMITIVES) -> None:
        super().__init__()
        self.nodes = nodes
        self.num_ops = len(primitives)
        self.preprocess = cell_input(c_in, channels)
        self.edges = nn.ModuleList(DpnasMixedOp(channels, primitives) for _ in edge_endpoints(nodes))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, path: Sequence[int] | None = None) -> torch.Tensor:
        """The dense cell's output, every edge mixed by `weights` (or running its op of `path` alone)."""
        check_weights("DpnasSearchCell", weights, (num_edges(self.nodes), self.num_ops), x.shape[0])
        states = dense_nodes([self.preprocess(x)], self.edges, weights, self.nodes, path)
        return torch.cat(states[NUM_CELL_INPUTS:], dim=1)


class DerivedDpnasCell(nn.Module):
    """The discrete cell of ``genotype``: ``forward(x, drop_prob=0.0, stream=None)``, ``x`` (N, c_in, H, W) ->
    (N, nodes · channels, H, W).

    ``none`` edges are left out; a node without kept edges is a zero map. Drop-path (training mode only) zeroes
    an op's output per example, never an identity's (as the DARTS augment cell). A genotype that is not
    ``connected`` (no intermediate node depends on the input, e.g. every edge ``none``) is refused: its network
    would output a constant, with nothing to train.
    """

    def __init__(self, genotype: DpnasGenotype, c_in: int, channels: int) -> None:
        super().__init__()
        if not isinstance(genotype, DpnasGenotype):
            raise TypeError(f"DerivedDpnasCell: genotype must be a DpnasGenotype, got {type(genotype).__name__}")
        check_connected(genotype)
        self.nodes = genotype.nodes
        self.preprocess = cell_input(c_in, channels)
        # Kept edges in genotype order: (node, input state) and the op, side by side.
        self.endpoints = tuple((node, j) for node in range(self.nodes) for _, j in genotype.node_edges(node))
        self.ops = nn.ModuleList(make_dpnas_op(op, channels) for node in range(self.nodes)
                                 for op, _ in genotype.node_edges(node))

    def forward(self, x: torch.Tensor, drop_prob: float = 0.0,
                stream: Keystream | None = None) -> torch.Tensor:
        """The derived cell's output, with per-example drop-path at `drop_prob` drawn from `stream`."""
        states = [self.preprocess(x)]
        sums: list[torch.Tensor | None] = [None] * self.nodes
        use_drop_path = self.training and drop_prob > 0.0
        k = 0
        for node in range(self.nodes):
            while k < len(self.endpoints) and self.endpoints[k][0] == node:
                op = self.ops[k]
                out = op(states[self.endpoints[k][1]])
                if use_drop_path and not isinstance(op, nn.Identity):
                    out = drop_path(out, drop_prob, stream)
                sums[node] = out if sums[node] is None else sums[node] + out
                k += 1
            states.append(sums[node] if sums[node] is not None else torch.zeros_like(states[0]))
        return torch.cat(states[NUM_CELL_INPUTS:], dim=1)
