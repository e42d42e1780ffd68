"""Candidate operations of the DARTS search space.

Every op maps ``(N, C, H, W)`` to ``(N, C, ceil(H / stride), ceil(W / stride))`` for stride 1 or 2 (odd
spatial sizes included), so all candidates on one edge can be summed.

Constraints that shape this module:

* No in-place ops (``ReLU(inplace=False)``, no ``add_``/``mul_``): the DP layer computes per-sample
  gradients with ``torch.func.vmap(torch.func.grad(...))`` over ``functional_call``, which cannot
  differentiate through in-place mutation of inputs, and an in-place ReLU would also corrupt the edge input
  that the other candidate ops of the same edge read.
* No normalisation buffers: BatchNorm uses batch statistics only, GroupNorm has none, so the state of the
  network is exactly its parameters (what the parameter server federates).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mpi_fnas.op_names import DARTS_PRIMITIVES
from mpi_fnas.space.depthwise import DepthwiseConv2d

#: Candidate operations in DARTS order; an alpha column index refers to this order (named in the torch-free
#: ``mpi_fnas.op_names``, where the config checks ``space.ops``).
PRIMITIVES: tuple[str, ...] = DARTS_PRIMITIVES

NORM_KINDS: tuple[str, ...] = ("batchnorm", "groupnorm")

# GroupNorm group count is gcd(channels, 4): four groups where possible (close to the GroupNorm paper's
# advice of several channels per group at DARTS' small widths) and always a divisor of ``channels``.
_GROUPNORM_MAX_GROUPS = 4


def make_norm(kind: str, channels: int, affine: bool) -> nn.Module:
    """Normalisation layer over ``(N, channels, H, W)``.

    ``batchnorm``: ``BatchNorm2d(track_running_stats=False)`` — always normalises with the statistics of the
    current batch (training and eval), because every party normalises with its own batches and the server
    evaluates with batch statistics; there are therefore no running-stat buffers to federate. It mixes the
    examples of a batch, so it is not usable under per-example DP.

    ``groupnorm``: ``GroupNorm(gcd(channels, 4), channels)`` — per-sample, which DP-SGD requires.
    """
    if channels < 1:
        raise ValueError(f"norm channels must be >= 1, got {channels}")
    if kind == "batchnorm":
        return nn.BatchNorm2d(channels, affine=affine, track_running_stats=False)
    if kind == "groupnorm":
        return nn.GroupNorm(math.gcd(channels, _GROUPNORM_MAX_GROUPS), channels, affine=affine)
    raise ValueError(f"unknown norm {kind!r}; expected one of {', '.join(NORM_KINDS)}")


class Zero(nn.Module):
    """The ``none`` op: zeros of the output shape ``(N, C, ceil(H / stride), ceil(W / stride))``."""

    def __init__(self, stride: int) -> None:
        super().__init__()
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Zeros of the op's output shape: the edge is absent."""
        # Strided slicing gives exactly ceil(H / stride), matching the other ops' output size.
        return torch.zeros_like(x[:, :, :: self.stride, :: self.stride])


class ReluFirst(nn.Module):
    """An op whose first layer is a ReLU of its input: ``forward(x) == forward_from_relu(relu(x))``.

    The MixedOp of an edge applies its ops to the same x, so it computes ``relu(x)`` once for all of them
    (:func:`mpi_fnas.space.cells.weighted_sum`): one ReLU and one saved activation per edge instead of one per op
    (docs/log/benchmarks.md, "One ReLU per edge").
    """

    def forward_from_relu(self, relu_x: torch.Tensor) -> torch.Tensor:
        """The op on an input that has been through ReLU already (ops on one edge share that ReLU)."""
        raise NotImplementedError


class ReLUConvBN(nn.Sequential):
    """ReLU -> 1x1 Conv2d (no bias) -> norm: ``(N, c_in, H, W)`` -> ``(N, c_out, H, W)``.

    A cell's input preprocessing (:meth:`~mpi_fnas.space.scaffold.CellPlace.inputs`), its only use: DARTS'
    ReLUConvBN with kernel 1, stride 1 and no padding.
    """

    def __init__(self, c_in: int, c_out: int, norm: str, affine: bool) -> None:
        super().__init__(
            nn.ReLU(inplace=False),
            nn.Conv2d(c_in, c_out, 1, bias=False),
            make_norm(norm, c_out, affine),
        )


class DilConv(nn.Sequential, ReluFirst):
    """ReLU -> (dilated) depthwise conv -> pointwise conv -> norm.

    ``(N, c_in, H, W)`` -> ``(N, c_out, ceil(H / stride), ceil(W / stride))`` with "same" padding.
    """

    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel_size: int,
        stride: int,
        padding: int,
        dilation: int,
        norm: str,
        affine: bool,
    ) -> None:
        super().__init__(
            nn.ReLU(inplace=False),
            DepthwiseConv2d(c_in, kernel_size, stride=stride, padding=padding, dilation=dilation),
            nn.Conv2d(c_in, c_out, 1, bias=False),
            make_norm(norm, c_out, affine),
        )

    def forward_from_relu(self, relu_x: torch.Tensor) -> torch.Tensor:
        """The op on an input that has been through ReLU already."""
        _, depthwise, pointwise, norm = self
        return norm(pointwise(depthwise(relu_x)))


class SepConv(nn.Sequential, ReluFirst):
    """Two stacked DilConv blocks with dilation 1; only the first is strided (DARTS ``sep_conv``).

    ``(N, c_in, H, W)`` -> ``(N, c_out, ceil(H / stride), ceil(W / stride))``.
    """

    def __init__(
        self, c_in: int, c_out: int, kernel_size: int, stride: int, padding: int, norm: str, affine: bool
    ) -> None:
        super().__init__(
            DilConv(c_in, c_in, kernel_size, stride, padding, 1, norm, affine),
            DilConv(c_in, c_out, kernel_size, 1, padding, 1, norm, affine),
        )

    def forward_from_relu(self, relu_x: torch.Tensor) -> torch.Tensor:
        """The op on an input that has been through ReLU already."""
        first, second = self
        return second(first.forward_from_relu(relu_x))


class FactorizedReduce(ReluFirst):
    """Halve the resolution without losing every other pixel: ReLU, two 1x1 convs, one on the input's even pixels
    and one on its odd pixels (the input shifted by one), concatenated on channels, then norm.

    ``(N, c_in, H, W)`` -> ``(N, c_out, ceil(H / 2), ceil(W / 2))``.

    DARTS writes each branch as a 1x1 convolution of stride 2. Here the stride is a slice and the convolutions have
    stride 1: the same sums, but never oneDNN's strided 1x1 weight gradient, which in oneDNN 3.12 (torch 2.13/2.14)
    writes past its workspace for a channels-last input of fewer channels than its block, 8 on AVX2 and 16 on AVX-512
    (uxlfoundation/oneDNN#6035; docs/benchmarks.md, "heap corruption on AVX2 CPUs"). That corrupted the heap of every
    party on an AVX2 CPU.
    """

    def __init__(self, c_in: int, c_out: int, norm: str, affine: bool) -> None:
        super().__init__()
        if c_out < 2:
            raise ValueError(f"FactorizedReduce needs c_out >= 2, got {c_out}")
        half = c_out // 2
        self.relu = nn.ReLU(inplace=False)
        self.conv_even = nn.Conv2d(c_in, half, 1, bias=False)
        self.conv_odd = nn.Conv2d(c_in, c_out - half, 1, bias=False)
        self.norm = make_norm(norm, c_out, affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """ReLU, then the 1x1 convolutions of the even and the odd pixels, concatenated, then norm."""
        return self.forward_from_relu(self.relu(x))

    def forward_from_relu(self, x: torch.Tensor) -> torch.Tensor:
        """The op on an input that has been through ReLU already."""
        # Zero-pad right/bottom before taking the odd pixels so both branches give ceil(H / 2) rows/cols even
        # when H or W is odd.
        even = x[:, :, ::2, ::2]
        odd = F.pad(x, (0, 1, 0, 1))[:, :, 1::2, 1::2]
        return self.norm(torch.cat([self.conv_even(even), self.conv_odd(odd)], dim=1))


def make_op(
    name: str, channels: int, stride: int, norm: str, affine: bool, *, pool_norm: bool = True
) -> nn.Module:
    """Candidate op ``name`` on ``channels`` channels: ``(N, C, H, W)`` -> ``(N, C, ceil(H/s), ceil(W/s))``.

    ``pool_norm`` (default True, the search setting) appends a norm after the pools as DARTS' MixedOp
    does, so that the parameter-free pools are on the scale of the normalised conv outputs they are summed
    with.
    """
    if stride not in (1, 2):
        raise ValueError(f"stride must be 1 or 2, got {stride}")
    if name == "none":
        return Zero(stride)
    if name in ("max_pool_3x3", "avg_pool_3x3"):
        pool: nn.Module
        if name == "max_pool_3x3":
            pool = nn.MaxPool2d(3, stride=stride, padding=1)
        else:
            # Excluding the padding keeps border averages unbiased (DARTS' choice).
            pool = nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)
        return nn.Sequential(pool, make_norm(norm, channels, affine)) if pool_norm else pool
    if name == "skip_connect":
        return nn.Identity() if stride == 1 else FactorizedReduce(channels, channels, norm, affine)
    if name == "sep_conv_3x3":
        return SepConv(channels, channels, 3, stride, 1, norm, affine)
    if name == "sep_conv_5x5":
        return SepConv(channels, channels, 5, stride, 2, norm, affine)
    if name == "dil_conv_3x3":
        return DilConv(channels, channels, 3, stride, 2, 2, norm, affine)
    if name == "dil_conv_5x5":
        return DilConv(channels, channels, 5, stride, 4, 2, norm, affine)
    raise ValueError(f"unknown op {name!r}; expected one of {', '.join(PRIMITIVES)}")
