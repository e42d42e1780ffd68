"""What the supernet and the augment network share around their cells: size checks, the stem, where the
reduction cells sit, and how a cell brings its two inputs to one shape.

One definition, so that the network a search ran on and the network its genotype is trained in cannot drift
apart (same stem, same reduction positions, same input preprocessing up to ``affine``).
"""

from __future__ import annotations

from torch import nn

from mpi_fnas.space.ops import FactorizedReduce, ReLUConvBN, make_norm

__all__ = ["cell_inputs", "check_sizes", "reduction_layers", "stem"]


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


def stem(in_channels: int, stem_channels: int, norm: str) -> nn.Sequential:
    """3x3 conv (no bias) then norm: ``(N, in_channels, H, W)`` -> ``(N, stem_channels, H, W)``."""
    return nn.Sequential(
        nn.Conv2d(in_channels, stem_channels, 3, padding=1, bias=False),
        make_norm(norm, stem_channels, affine=True),
    )


def cell_inputs(c_prev_prev: int, c_prev: int, channels: int, reduction_prev: bool, norm: str,
                affine: bool) -> tuple[nn.Module, nn.Module]:
    """(preprocess0, preprocess1): both cell inputs to ``channels`` at the resolution of ``s1``.

    ``s0`` (N, c_prev_prev, H0, W0) has twice the resolution of ``s1`` when the previous cell reduced, and is then
    halved by a FactorizedReduce; otherwise a 1x1 ReLUConvBN. ``s1`` (N, c_prev, H1, W1) always takes a 1x1
    ReLUConvBN. Built in that order (the seed's initial weights depend on it).
    """
    if reduction_prev:
        preprocess0: nn.Module = FactorizedReduce(c_prev_prev, channels, norm, affine=affine)
    else:
        preprocess0 = ReLUConvBN(c_prev_prev, channels, 1, 1, 0, norm, affine=affine)
    return preprocess0, ReLUConvBN(c_prev, channels, 1, 1, 0, norm, affine=affine)
