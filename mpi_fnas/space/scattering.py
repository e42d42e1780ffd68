"""The scattering transform as a fixed stem: Morlet wavelets at J = 2 scales and L = 8 angles (Oyallon & Mallat; the
features of Tramèr & Boneh's ScatterNet), through kymatio's 2-D torch frontend.

A fixed stem has no parameters and sees no data but the image it transforms, so it costs no ε and is computed once:
a party transforms its own examples when it builds its network, and rank 0 its test split, never per step; a
later stage of the same process takes the features kept from the first (:func:`fixed_stem_of` names a network's).
A C×S×S image becomes 81·C channels at S/4×S/4 (1 + J·L + L²·J(J−1)/2 = 81 per input channel): 81×7×7 for a 28×28
grey image.

Why the frontend module and not ``kymatio.torch``: that package also imports the 3-D transform, whose SciPy call is
gone from SciPy 1.17 (kymatio#1068); the 2-D frontend imports and runs alone. kymatio is imported only when a
scattering stem is built.
"""

from __future__ import annotations

import torch
from torch import nn

J, L = 2, 8
#: Output channels per input channel: 1 + J·L + L²·J(J−1)/2.
CHANNELS_PER_INPUT = 1 + J * L + L * L * J * (J - 1) // 2
#: Images transformed at once: bounds the transform's working memory (about 2 MB an image at 28×28).
CHUNK = 256


def scattering_shape(in_channels: int, image_size: int) -> tuple[int, int]:
    """(channels, side) of the scattering of a (in_channels, image_size, image_size) image."""
    return in_channels * CHANNELS_PER_INPUT, image_size // 2**J


class Scattering:
    """The fixed scattering stem of (in_channels, image_size, image_size) images: ``stem(x)``, x (N, C, S, S) ->
    float32 (N, 81·C, S/4, S/4), on x's device. Not an ``nn.Module`` of the network it feeds: its filters are
    constants, never weights the server federates or a checkpoint keeps. `image_size` None: any square side, the
    filters made for the first one seen (a supernet is built before its data is opened)."""

    def __init__(self, in_channels: int, image_size: int | None = None) -> None:
        self.in_channels, self.image_size = in_channels, image_size
        self.out_channels = in_channels * CHANNELS_PER_INPUT
        self.out_size = image_size // 2**J if image_size is not None else None
        #: What its output depends on besides the image: two stems with the same key transform alike.
        self.key = ("scattering", J, L, in_channels)
        self._transforms: dict[tuple[torch.device, int], nn.Module] = {}

    def output_shape(self, side: int) -> tuple[int, int, int]:
        """(channels, side, side) of the scattering of an image of side `side`."""
        return self.out_channels, side // 2**J, side // 2**J

    def _transform(self, device: torch.device, side: int) -> nn.Module:
        if (device, side) not in self._transforms:
            from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

            self._transforms[device, side] = ScatteringTorch2D(J=J, shape=(side, side), L=L).to(device)
        return self._transforms[device, side]

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        side = self.image_size if self.image_size is not None else (x.shape[-1] if x.dim() == 4 else -1)
        if x.dim() != 4 or tuple(x.shape[1:]) != (self.in_channels, side, side):
            raise ValueError(f"Scattering input: expected (N, {self.in_channels}, {side}, {side}), got "
                             f"{tuple(x.shape)}")
        transform, out_size = self._transform(x.device, side), side // 2**J
        out = [transform(x[i:i + CHUNK].float().contiguous()).reshape(-1, self.out_channels, out_size, out_size)
               for i in range(0, x.shape[0], CHUNK)]
        if not out:
            return x.new_zeros((0, self.out_channels, out_size, out_size))
        return torch.cat(out).contiguous()


def fixed_stem_of(network: nn.Module) -> Scattering | None:
    """The fixed stem a network's inputs go through once, before training (None: it takes images as they are)."""
    return getattr(network, "fixed_stem", None)
