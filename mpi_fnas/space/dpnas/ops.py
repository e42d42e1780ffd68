"""Candidate operations of the DPNAS search space (Cheng et al. 2021, "DPNAS", §3.2).

Ten ops per edge, in alpha-column order (the order of the authors' released primitive list):

* ``none`` — zeros: "no edge" once derived;
* ``max_pool_3x3``, ``avg_pool_3x3`` — 3x3 pooling, stride 1 (a cell keeps its resolution);
* ``skip_connect`` — identity;
* ``conv_3x3_<activation>`` for relu, selu, tanh, linear (identity activation), hardtanh, sigmoid — a 3x3
  *depthwise* convolution, then ``GroupNorm(gcd(C, 4), C, affine=False)``, then the activation.

Every op maps ``(N, C, H, W)`` to ``(N, C, H, W)``. SELU (as the paper, where the authors' search code has ELU),
depthwise convolutions (C·9 weights per op, so less noise in all) and GroupNorm without affine parameters (per
example, as DP needs, and no parameters) are choices docs/dpnas.md explains ("Design choices").

No op works in place (the per-example gradient hooks refuse in-place changes of a recorded layer output).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from mpi_fnas.op_names import DPNAS_CONV_PREFIX, DPNAS_POOLS, DPNAS_PRIMITIVES
from mpi_fnas.space.depthwise import DepthwiseConv2d
from mpi_fnas.space.ops import Zero, make_norm

#: The activations of the conv ops, one constructor per name of ``mpi_fnas.op_names.DPNAS_ACTIVATIONS``.
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": lambda: nn.ReLU(inplace=False),
    "selu": lambda: nn.SELU(inplace=False),
    "tanh": nn.Tanh,
    "linear": nn.Identity,
    "hardtanh": lambda: nn.Hardtanh(inplace=False),
    "sigmoid": nn.Sigmoid,
}
CONV_PREFIX = DPNAS_CONV_PREFIX
POOLS: tuple[str, ...] = DPNAS_POOLS

#: Candidate ops in alpha-column order (named in the torch-free ``mpi_fnas.op_names``, where the config checks
#: ``space.ops``; every name has a constructor in ``OPS`` below).
PRIMITIVES: tuple[str, ...] = DPNAS_PRIMITIVES


class ConvNormAct(nn.Sequential):
    """3x3 depthwise conv (no bias) -> GroupNorm (no affine) -> activation: ``(N, C, H, W)`` -> ``(N, C, H, W)``."""

    def __init__(self, channels: int, activation: str) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")
        super().__init__(
            DepthwiseConv2d(channels, 3, padding=1),
            make_norm("groupnorm", channels, affine=False),
            ACTIVATIONS[activation](),
        )
        self.activation = activation


def _conv(activation: str) -> Callable[[int], nn.Module]:
    return lambda channels: ConvNormAct(channels, activation)


#: One constructor per op name: ``OPS[name](channels)``.
OPS: dict[str, Callable[[int], nn.Module]] = {
    "none": lambda channels: Zero(1),
    "max_pool_3x3": lambda channels: nn.MaxPool2d(3, stride=1, padding=1),
    # Excluding the padding keeps border averages unbiased (as DARTS' avg pool).
    "avg_pool_3x3": lambda channels: nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False),
    "skip_connect": lambda channels: nn.Identity(),
    **{CONV_PREFIX + name: _conv(name) for name in ACTIVATIONS},
}


def make_dpnas_op(name: str, channels: int) -> nn.Module:
    """DPNAS op ``name`` on ``channels`` channels: ``(N, C, H, W)`` -> ``(N, C, H, W)``."""
    if name not in OPS:
        raise ValueError(f"unknown DPNAS op {name!r}; expected one of {', '.join(PRIMITIVES)}")
    if channels < 1:
        raise ValueError(f"DPNAS op channels must be >= 1, got {channels}")
    return OPS[name](channels)
