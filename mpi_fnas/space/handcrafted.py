"""Hand-designed networks: what a DP practitioner would train instead of a searched cell (``augment.network``).

* ``cnn-tanh`` — Papernot et al. 2021's tanh CNNs ("Tempered sigmoid activations for deep learning with differential
  privacy"): their MNIST net for one channel (:class:`TanhMnistNet`), their CIFAR-10 net for colour
  (:class:`TanhCifarNet`);
* ``cnn-gn`` — a small 3-block GroupNorm + ReLU CNN (:class:`GroupNormNet`; BatchNorm mixes a batch's examples);
* ``scatter-linear`` and ``scatter-cnn`` — Tramèr & Boneh 2021's ScatterNets ("Differentially Private Learning Needs
  Better Features (or Much More Data)"): the fixed scattering stem (:class:`~mpi_fnas.space.scattering.Scattering`,
  computed once per example, no ε), GroupNorm without parameters, then a linear layer (:class:`ScatterLinear`) or
  their small tanh CNN (:class:`ScatterCnn`).

Each is sized to ``in_channels``, ``image_size`` (any side >= 8) and ``num_classes``, and trained by the same
augmentation as a cell's network, with its interface (``weights``, ``main_parameters``, ``num_params``), no
drop-path (``drop_path_prob`` stays 0) and no auxiliary head. Every layer owning parameters is a Conv2d, Linear or
GroupNorm, so the per-example gradients take the ``hooks`` method. How to train one: docs/baseline.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from mpi_fnas.space.scaffold import WholeNetwork
from mpi_fnas.space.scattering import Scattering, scattering_shape

if TYPE_CHECKING:  # the type only: the network never imports the privacy package
    from mpi_fnas.keystream import Keystream

__all__ = ["HANDCRAFTED", "GroupNormNet", "HandcraftedNetwork", "ScatterCnn", "ScatterLinear", "TanhCifarNet",
           "TanhMnistNet", "build_handcrafted", "tanh_cnn"]

MIN_IMAGE_SIZE = 8  # data.image_size's minimum: every network here works from it up
_GROUPS = 4  # GroupNorm groups of cnn-gn: per example, as DP-SGD needs


def _conv_side(side: int, kernel: int, stride: int, padding: int) -> int:
    """Output side of a convolution or pool of `kernel`, `stride`, `padding` on a `side` x `side` map."""
    return (side + 2 * padding - kernel) // stride + 1


class HandcraftedNetwork(WholeNetwork):
    """``features`` (conv blocks) -> flatten -> ``classifier``: ``forward(x)``, ``x`` (N, in_channels, S, S) with S
    the ``image_size`` it was built for -> logits (N, num_classes).

    ``drop_path_prob`` and ``mask_stream`` exist because the augmentation sets them on every network it trains; a
    hand-designed network has no paths to drop, so it refuses a ``drop_path_prob`` other than 0 in training.
    """

    #: The ``augment.network`` name of the design.
    network: str = ""

    def __init__(self, features: nn.Sequential, classifier: nn.Sequential, *, in_channels: int, image_size: int,
                 num_classes: int) -> None:
        super().__init__()
        self.features = features
        self.classifier = classifier
        self.in_channels = in_channels
        self.image_size = image_size
        self.num_classes = num_classes
        self.drop_path_prob: float = 0.0
        self.mask_stream: Keystream | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the batch `x` (refused unless its shape is the one the network was sized for)."""
        if x.dim() != 4 or tuple(x.shape[1:]) != (self.in_channels, self.image_size, self.image_size):
            raise ValueError(f"{type(self).__name__} input: expected (N, {self.in_channels}, {self.image_size}, "
                             f"{self.image_size}), got {tuple(x.shape)}")
        if self.training and self.drop_path_prob != 0.0:
            raise ValueError(f"{type(self).__name__}: a hand-designed network has no paths to drop; drop_path_prob "
                             f"must be 0, got {self.drop_path_prob}")
        return self.classifier(self.features(x).flatten(1))


def _check_sizes(owner: str, in_channels: int, image_size: int, num_classes: int) -> None:
    for name, value, minimum in (("in_channels", in_channels, 1), ("num_classes", num_classes, 1),
                                 ("image_size", image_size, MIN_IMAGE_SIZE)):
        if value < minimum:
            raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}")


class TanhMnistNet(HandcraftedNetwork):
    """Papernot et al.'s MNIST net: conv 16@8x8 stride 2 padding 3, tanh, max pool 2 stride 1, conv 32@4x4 stride 2,
    tanh, max pool 2 stride 1, fc 32, tanh, fc ``num_classes``.

    Shapes at 28x28: (N, 1, 28, 28) -> (N, 16, 14, 14) -> (N, 16, 13, 13) -> (N, 32, 5, 5) -> (N, 32, 4, 4) -> 512
    -> 32 -> 10: 26,010 parameters, the paper's. At 14x14 and 16x16 the maps end at (N, 32, 1, 1). Below 14 the
    second conv's map would vanish (8x8: 3x3 after the first pool, under its 4x4 kernel), so it gets the least zero
    padding that leaves its pool a 2x2 map (8x8: padding 2; 14 and up: 0, as the paper); the first fc takes
    ``32 * S2 * S2`` inputs, S2 the final side.
    """

    network = "cnn-tanh"

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        _check_sizes(type(self).__name__, in_channels, image_size, num_classes)
        side = _conv_side(_conv_side(image_size, 8, 2, 3), 2, 1, 0)
        # (side + 2p - 4) // 2 + 1 >= 2 for the last pool to see a 2x2 map: p >= (6 - side) / 2.
        padding = max(0, math.ceil((6 - side) / 2))
        side = _conv_side(_conv_side(side, 4, 2, padding), 2, 1, 0)
        features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 8, stride=2, padding=3), nn.Tanh(), nn.MaxPool2d(2, stride=1),
            nn.Conv2d(16, 32, 4, stride=2, padding=padding), nn.Tanh(), nn.MaxPool2d(2, stride=1),
        )
        classifier = nn.Sequential(nn.Linear(32 * side * side, 32), nn.Tanh(), nn.Linear(32, num_classes))
        super().__init__(features, classifier, in_channels=in_channels, image_size=image_size,
                         num_classes=num_classes)


class TanhCifarNet(HandcraftedNetwork):
    """Papernot et al.'s CIFAR-10 net: three blocks of [conv 3x3 padding 1, tanh, conv 3x3 padding 1, tanh, max pool
    2 stride 2] of 32, 64 and 128 channels, then fc 128, tanh, fc ``num_classes``.

    Shapes at 32x32: (N, 3, 32, 32) -> (N, 32, 16, 16) -> (N, 64, 8, 8) -> (N, 128, 4, 4) -> 2048 -> 128 -> 10:
    550,570 parameters, the paper's. Each block halves the side (floored), so S >= 8 ends at least at 1x1 (8x8:
    (N, 128, 1, 1); 16x16: (N, 128, 2, 2)); the first fc takes ``128 * (S // 8)^2`` inputs.
    """

    network = "cnn-tanh"

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        _check_sizes(type(self).__name__, in_channels, image_size, num_classes)
        layers: list[nn.Module] = []
        channels, side = in_channels, image_size
        for width in (32, 64, 128):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.Tanh(),
                       nn.Conv2d(width, width, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2, stride=2)]
            channels, side = width, side // 2
        classifier = nn.Sequential(nn.Linear(channels * side * side, 128), nn.Tanh(), nn.Linear(128, num_classes))
        super().__init__(nn.Sequential(*layers), classifier, in_channels=in_channels, image_size=image_size,
                         num_classes=num_classes)


class GroupNormNet(HandcraftedNetwork):
    """``cnn-gn``: three blocks of [conv 3x3 padding 1 (no bias: the GroupNorm shift replaces it), GroupNorm of 4
    groups, ReLU, max pool 2 stride 2] of 16, 32 and 64 channels, global average pooling, fc ``num_classes``.

    Shapes at 28x28: (N, 1, 28, 28) -> (N, 16, 14, 14) -> (N, 32, 7, 7) -> (N, 64, 3, 3) -> (N, 64, 1, 1) -> 64 ->
    10: 24,058 parameters (24,346 for 3 input channels), at any S >= 8 (8x8 ends at (N, 64, 1, 1) before the
    pooling): the global pooling makes the size independent of S.
    """

    network = "cnn-gn"

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        _check_sizes(type(self).__name__, in_channels, image_size, num_classes)
        layers: list[nn.Module] = []
        channels = in_channels
        for width in (16, 32, 64):
            layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.GroupNorm(_GROUPS, width), nn.ReLU(),
                       nn.MaxPool2d(2, stride=2)]
            channels = width
        layers.append(nn.AdaptiveAvgPool2d(1))
        super().__init__(nn.Sequential(*layers), nn.Sequential(nn.Linear(channels, num_classes)),
                         in_channels=in_channels, image_size=image_size, num_classes=num_classes)


class ScatterNetwork(HandcraftedNetwork):
    """A ScatterNet: the fixed scattering stem (``fixed_stem``, applied once to the data, outside the network: its
    ``forward`` takes the scattering, (N, 81·C, S/4, S/4)), then GroupNorm of :data:`SCATTER_GROUPS` groups without
    affine parameters, then `body` (layers after the normalisation) and `classifier`."""

    def __init__(self, body: list[nn.Module], classifier: nn.Sequential, *, in_channels: int, image_size: int,
                 num_classes: int) -> None:
        _check_sizes(type(self).__name__, in_channels, image_size, num_classes)
        stem = Scattering(in_channels, image_size)
        features = nn.Sequential(nn.GroupNorm(SCATTER_GROUPS, stem.out_channels, affine=False), *body)
        super().__init__(features, classifier, in_channels=stem.out_channels, image_size=stem.out_size,
                         num_classes=num_classes)
        self.fixed_stem = stem


#: GroupNorm groups over the scattering's channels (Tramèr & Boneh's 27 for 81 channels: 3 a group).
SCATTER_GROUPS = 27


class ScatterLinear(ScatterNetwork):
    """``scatter-linear``: scattering (81·C×S/4×S/4), GroupNorm, fc ``num_classes``. At 28×28 grey: 81×7×7 = 3,969
    features, 39,700 parameters (Tramèr & Boneh's linear ScatterNet)."""

    network = "scatter-linear"

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        channels, side = scattering_shape(in_channels, image_size)
        super().__init__([], nn.Sequential(nn.Linear(channels * side * side, num_classes)), in_channels=in_channels,
                         image_size=image_size, num_classes=num_classes)


class ScatterCnn(ScatterNetwork):
    """``scatter-cnn``: scattering, GroupNorm, conv 16@3x3 stride 2 padding 1, tanh, conv 32@3x3 padding 1, tanh, fc
    32, tanh, fc ``num_classes`` (Tramèr & Boneh's CNN on MNIST's scattering). At 28×28 grey: (N, 81, 7, 7) ->
    (N, 16, 4, 4) -> (N, 32, 4, 4) -> 512 -> 32 -> 10: 33,066 parameters."""

    network = "scatter-cnn"

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        channels, side = scattering_shape(in_channels, image_size)
        side = _conv_side(side, 3, 2, 1)
        body: list[nn.Module] = [nn.Conv2d(channels, 16, 3, stride=2, padding=1), nn.Tanh(),
                                 nn.Conv2d(16, 32, 3, padding=1), nn.Tanh()]
        classifier = nn.Sequential(nn.Linear(32 * side * side, 32), nn.Tanh(), nn.Linear(32, num_classes))
        super().__init__(body, classifier, in_channels=in_channels, image_size=image_size, num_classes=num_classes)


def tanh_cnn(in_channels: int, num_classes: int, image_size: int) -> HandcraftedNetwork:
    """``cnn-tanh`` for the input: :class:`TanhMnistNet` for one-channel images, :class:`TanhCifarNet` for colour
    (the paper's net for each kind of image)."""
    net = TanhMnistNet if in_channels == 1 else TanhCifarNet
    return net(in_channels, num_classes, image_size)


#: The builders by ``augment.network`` name (the config's ``HANDCRAFTED_NETWORKS``).
HANDCRAFTED: dict[str, Callable[[int, int, int], HandcraftedNetwork]] = {
    "cnn-tanh": tanh_cnn, "cnn-gn": GroupNormNet, "scatter-linear": ScatterLinear, "scatter-cnn": ScatterCnn}


def build_handcrafted(name: str, *, seed: int, in_channels: int, num_classes: int,
                      image_size: int) -> HandcraftedNetwork:
    """The hand-designed network `name` for (in_channels, image_size, image_size) inputs, initialised from `seed`:
    every rank calling it with the same arguments gets bit-identical weights. ValueError for an unknown name."""
    if name not in HANDCRAFTED:
        raise ValueError(f"unknown hand-designed network {name!r}; expected one of {', '.join(HANDCRAFTED)}")
    torch.manual_seed(seed)
    return HANDCRAFTED[name](in_channels, num_classes, image_size)
