"""Batched training-time augmentation of the DARTS evaluation protocol: random crop, horizontal flip, cutout.

Applied to a whole ``(N, C, H, W)`` batch at once with one gather and one ``where``, each example with its own
random offsets, flip and cutout square, all drawn from an explicit :class:`~mpi_fnas.keystream.Keystream`
(the party's secret sampling stream: under DP these draws must be as unpredictable as its Poisson coins; the
global RNG is never touched). Order as in DARTS: crop, then flip, then cutout.

Differences from DARTS' per-image torchvision pipeline, on purpose:

* it runs on already normalised tensors, so the crop's zero padding and the cutout's zeros are the dataset mean
  rather than black;
* the cutout square is exactly ``size x size`` before clipping (rows ``cy - size // 2 .. cy - size // 2 + size -
  1``); DARTS' ``Cutout`` spans ``cy - size // 2 .. cy + size // 2 - 1``, one pixel less for odd sizes and the
  same for even ones (16 on CIFAR-10).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # the type only: data never imports the privacy package
    from mpi_fnas.keystream import Keystream


def augment_images(
    x: torch.Tensor,
    *,
    stream: Keystream,
    cutout: int = 0,
    crop_padding: int = 0,
    flip: bool = False,
) -> torch.Tensor:
    """Augmented copy of ``x`` (N, C, H, W) float -> (N, C, H, W), same device and dtype; ``x`` is not modified.

    Per example, independently:

    * ``crop_padding`` > 0: zero-pad by ``crop_padding`` on every side, then crop an H x W window at a uniform
      random offset in ``0 .. 2 * crop_padding`` along each axis;
    * ``flip``: mirror left-right with probability 1/2;
    * ``cutout`` > 0: set a ``cutout x cutout`` square centred at a uniform random pixel, clipped at the
      borders, to 0 in every channel.

    Random numbers are drawn from ``stream`` (on the CPU; results are moved to ``x``'s device) only for the
    enabled options, in the order crop offsets, flips, cutout centres. With every option off, ``x`` itself is
    returned.
    """
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"augment_images: expected a float (N, C, H, W) batch, got {x.dtype} {tuple(x.shape)}")
    for name, value in (("cutout", cutout), ("crop_padding", crop_padding)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"augment_images: {name} must be a non-negative int, got {value!r}")
    if crop_padding == 0 and not flip and cutout == 0:
        return x
    batch, _, height, width = x.shape
    out = x
    if crop_padding > 0 or flip:
        out = _crop_and_flip(x, crop_padding, flip, stream)
    if cutout > 0:
        centre_y = stream.integers(height, batch).to(x.device)
        centre_x = stream.integers(width, batch).to(x.device)
        inside_y = _window(centre_y - cutout // 2, cutout, height)  # (N, H)
        inside_x = _window(centre_x - cutout // 2, cutout, width)  # (N, W)
        square = (inside_y[:, :, None] & inside_x[:, None, :])[:, None]  # (N, 1, H, W)
        out = torch.where(square, torch.zeros((), dtype=x.dtype, device=x.device), out)
    return out


def _crop_and_flip(x: torch.Tensor, padding: int, flip: bool, stream: Keystream) -> torch.Tensor:
    """One gather from the padded batch: source pixel of output (h, w) is (dy + h, dx + w), or (dy + h,
    dx + W - 1 - w) for a flipped example (crop first, then mirror the crop)."""
    batch, channels, height, width = x.shape
    if padding > 0:
        offsets = stream.integers(2 * padding + 1, (batch, 2)).to(x.device)
        padded = F.pad(x, (padding, padding, padding, padding))
    else:
        offsets = torch.zeros(batch, 2, dtype=torch.long, device=x.device)
        padded = x
    rows = offsets[:, :1] + torch.arange(height, device=x.device)  # (N, H)
    cols = torch.arange(width, device=x.device).expand(batch, width)  # (N, W)
    if flip:
        mirrored = stream.integers(2, (batch, 1)).to(x.device).bool()
        cols = torch.where(mirrored, width - 1 - cols, cols)
    cols = offsets[:, 1:] + cols
    padded_height, padded_width = padded.shape[2:]
    index = (rows[:, :, None] * padded_width + cols[:, None, :]).reshape(batch, 1, height * width)
    flat = padded.reshape(batch, channels, padded_height * padded_width)
    gathered = flat.gather(2, index.expand(batch, channels, height * width))
    return gathered.reshape(batch, channels, height, width)


def _window(start: torch.Tensor, size: int, length: int) -> torch.Tensor:
    """``(N, length)`` bool: positions ``start_i .. start_i + size - 1`` of each row (clipped to the axis)."""
    positions = torch.arange(length, device=start.device)
    return (positions >= start[:, None]) & (positions < start[:, None] + size)
