"""Continuous-relaxation building blocks of the DARTS supernet: the mixed op and the search cell."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mpi_fnas.space.genotype import NUM_CELL_INPUTS, edge_endpoints, num_edges
from mpi_fnas.space.ops import PRIMITIVES, ReluFirst, make_op
from mpi_fnas.space.scaffold import CellPlace


def weighted_sum(ops: Sequence[nn.Module], x: torch.Tensor, weights: torch.Tensor,
                 only: int | None = None) -> torch.Tensor:
    """``sum_k weights[k] · ops[k](x)``: one edge of a continuous relaxation, ``x`` (N, C, H, W), ``weights``
    (len(ops),) shared by the batch, or (N, len(ops)) one row per example (per-example gradients of the alphas).
    ``only``: the one op of a sampled path, ``weights[only] · ops[only](x)`` (the other ops are not run)."""
    if weights.dim() == 2:  # (ops, N, 1, 1, 1): weights[k] scales example n's map by its own weight
        weights = weights.t().reshape(len(ops), -1, 1, 1, 1)
    relu_x = None  # one ReLU of x for every op that starts with one (ReluFirst)
    out = None
    for k, op in enumerate(ops):
        if only is not None and k != only:
            continue
        if isinstance(op, ReluFirst):
            relu_x = F.relu(x) if relu_x is None else relu_x
            term = weights[k] * op.forward_from_relu(relu_x)
        else:
            term = weights[k] * op(x)
        # Out-of-place accumulation: in-place adds would break autograd/vmap over the shared inputs.
        out = term if out is None else out + term
    return out


def check_weights(owner: str, weights: torch.Tensor, shape: tuple[int, ...], batch: int) -> None:
    """Refuse op weights of a shape other than `shape` (shared) or ``(batch, *shape)`` (one row per example)."""
    if tuple(weights.shape) not in (shape, (batch, *shape)):
        raise ValueError(f"{owner} weights: expected shape {shape} or {(batch, *shape)}, got {tuple(weights.shape)}")


def dense_nodes(states: list[torch.Tensor], edges: Sequence[nn.Module], weights: torch.Tensor,
                nodes: int, path: Sequence[int] | None = None) -> list[torch.Tensor]:
    """``states`` (the cell's inputs) followed by ``nodes`` intermediate nodes, each the sum of one mixed edge from
    every earlier state: ``edges[e](state, weights[..., e, :])`` in alpha-row order (node by node, then by input
    state); ``weights`` (edges, ops) or (N, edges, ops). ``path``: one op index per edge, the only op each edge
    runs (``edges[e](state, weights[..., e, :], path[e])``); None: every op."""
    states = list(states)
    edge = 0
    for _ in range(nodes):
        node = None
        for state in list(states):
            contribution = (edges[edge](state, weights[..., edge, :]) if path is None else
                            edges[edge](state, weights[..., edge, :], path[edge]))
            node = contribution if node is None else node + contribution
            edge += 1
        states.append(node)
    return states


class MixedOp(nn.Module):
    """All candidate ops of one edge, combined as a weighted sum.

    ``forward(x, weights)``: ``x`` (N, C, H, W), ``weights`` (len(primitives),) or (N, len(primitives))
    -> (N, C, ceil(H / stride), ceil(W / stride)).
    """

    def __init__(self, channels: int, stride: int, norm: str, primitives: Sequence[str] = PRIMITIVES) -> None:
        super().__init__()
        # affine=False inside the supernet (DARTS): a learnable scale per op would compete with the alphas.
        self.ops = nn.ModuleList(make_op(name, channels, stride, norm, affine=False) for name in primitives)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The ops on `x`, mixed by `weights` (one per op, or one row per example)."""
        check_weights("MixedOp", weights, (len(self.ops),), x.shape[0])
        return weighted_sum(self.ops, x, weights)


class SearchCell(nn.Module):
    """DARTS search cell (edge order: see ``mpi_fnas.space.genotype``).

    ``forward(s0, s1, weights)``: ``s0`` (N, place.c_prev_prev, H0, W0), ``s1`` (N, place.c_prev, H1, W1),
    ``weights`` (num_edges(nodes), len(primitives)) softmax weights, or (N, ...) one set per example,
    -> (N, nodes * place.channels, ceil(H1 / r), ceil(W1 / r)) with r = 2 for a reduction cell, else 1.
    ``s0`` has twice the resolution of ``s1`` when the previous cell reduced (``place.reduction_prev``),
    otherwise the same.
    """

    def __init__(self, nodes: int, place: CellPlace, norm: str, primitives: Sequence[str] = PRIMITIVES) -> None:
        super().__init__()
        self.nodes = nodes
        self.reduction = place.reduction
        self.num_ops = len(primitives)
        # Bring both inputs to (channels, resolution of s1); affine=False as in the DARTS supernet.
        self.preprocess0, self.preprocess1 = place.inputs(norm, affine=False)
        self.edges = nn.ModuleList(
            MixedOp(place.channels, place.stride(j), norm, primitives) for _, j in edge_endpoints(nodes)
        )

    @property
    def out_channels_multiplier(self) -> int:
        """Output channels per cell channel: the number of concatenated states (every intermediate node)."""
        return self.nodes

    def forward(self, s0: torch.Tensor, s1: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The cell's output from the two previous states, every edge mixed by `weights`."""
        check_weights("SearchCell", weights, (num_edges(self.nodes), self.num_ops), s1.shape[0])
        states = dense_nodes([self.preprocess0(s0), self.preprocess1(s1)], self.edges, weights, self.nodes)
        return torch.cat(states[NUM_CELL_INPUTS:], dim=1)
