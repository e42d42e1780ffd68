"""Integer encoding of a party's release for secure aggregation, and rank 0's decoding of the sum (after Kairouz, Liu &
Steinke, "The Distributed Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation", ICML 2021,
arXiv 2102.06387, Algorithm 1; docs/privacy.md §8).

The party clips every example's gradient (‖g_i‖₂ ≤ c) and sums them, as on the local path; the *sum* S is encoded
once per release (:func:`encode_sum`): padded to D coordinates (:func:`padded_length`), rotated by a randomized
Hadamard transform block by block (public signs, fresh per step and release, so no coordinate is large and the
modular wrap rarely bites), scaled by 1/γ and rounded at random, y ↦ ⌊y + 1 − u⌋ with u uniform on [0, 1)
(unbiased). For fixed coins the rounding is monotone, so two sums one example apart round to integer vectors at
most c/γ + √D apart (:attr:`Encoding.sensitivity`), a √D kept small by accounting at the run's own largest release
(:attr:`~mpi_fnas.privacy.release.SecureSum.dimension`); :mod:`mpi_fnas.secagg.accounting` covers the coins' mixture.

The party adds its share of the discrete noise and wraps the total into b bits (:func:`wrap`); rank 0 decodes the
sum of the uploads (:func:`decode`): the signed range, ×γ, the inverse rotation. Nothing here is secret (the
rounding coins come from the party's keystream all the same). No MPI, no autograd.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from mpi_fnas.keystream import Keystream

#: The rotation's block length: a release of d > this many coordinates is padded to a multiple of it (77,906 weights:
#: 81,920 coordinates; the next power of two would be 131,072), since the rounding, the noise and the upload all
#: scale with D. Blocks are enough for 32-bit sums: one example's coordinate is at most c/γ (≈ 2^14 integer units at
#: the default config) even unspread, so B·K of them stay near 2^22, and a block spreads its mass over 4,096.
ROTATION_BLOCK = 2**12


#: Relative slack on c/γ in :attr:`Encoding.sensitivity`: float64 clipping, summing and rotating can exceed the
#: exact ‖S − S′‖₂ ≤ c by a few ulps (~1e-16 relative); the bound must hold for the numbers computed.
FLOAT_SLACK = 1e-9


@dataclass(frozen=True)
class Encoding:
    """The public parameters of one release's integer encoding.

    dimension: d, the release's length. clip: c, each example's L2 bound before scaling. scale: γ > 0, the value of
    one integer unit. bits: b, the sum lives mod 2^b (b ≤ 32: the uploads travel as uint32).
    """

    dimension: int
    clip: float
    scale: float
    bits: int = 32

    def __post_init__(self) -> None:
        if self.dimension < 1 or self.clip <= 0 or self.scale <= 0:
            raise ValueError(f"an encoding needs dimension >= 1, clip > 0 and scale > 0, got {self}")
        if not 2 <= self.bits <= 32:
            raise ValueError(f"bits must be in [2, 32], got {self.bits}")

    @property
    def padded(self) -> int:
        """D: the length of the rotated, rounded vector (:func:`padded_length`)."""
        return padded_length(self.dimension)

    @property
    def sensitivity(self) -> float:
        """Δ₂ in integer units: how far apart the encodings of two sums one example apart can be, for the same
        rounding coins (:func:`sensitivity`)."""
        return sensitivity(self.clip / self.scale, self.padded)


def sensitivity(units_per_clip: float, dimension: int) -> float:
    """Δ₂ = c/γ + √D (plus :data:`FLOAT_SLACK` on c/γ): the L2 distance, in integer units, between the roundings
    ⌊y + 1 − u⌋ of two rotated, scaled sums y, y′ with ‖y − y′‖₂ ≤ c/γ, for the same coins u ∈ [0, 1)^D.

    The rounding is monotone in y, so per coordinate |⌊y + 1 − u⌋ − ⌊y′ + 1 − u⌋| ≤ ⌈|y − y′|⌉ < |y − y′| + 1,
    and by the triangle inequality ‖·‖₂ ≤ ‖y − y′‖₂ + ‖(1, …, 1)‖₂ = c/γ + √D (KLS21's unconditional bound)."""
    return units_per_clip * (1.0 + FLOAT_SLACK) + math.sqrt(dimension)


def padded_length(dimension: int) -> int:
    """D: `dimension` rounded up to a power of two up to :data:`ROTATION_BLOCK`, to a multiple of it beyond."""
    if dimension <= ROTATION_BLOCK:
        return 1 << max(0, (dimension - 1).bit_length())
    return -(-dimension // ROTATION_BLOCK) * ROTATION_BLOCK


def rotation_signs(dimension: int, *labels: str | int) -> torch.Tensor:
    """``(D,)`` float64 of ±1: the public signs of the rotation named by `labels` (run, stage, step, release)."""
    bits = Keystream.from_labels("mpi_fnas/secagg/rotation/v1", *labels).integers(2, padded_length(dimension))
    return bits.to(torch.float64).mul_(2).sub_(1)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``(..., D)`` float64: H·diag(s)·x, H block-diagonal Walsh–Hadamard (blocks of min(D, ROTATION_BLOCK))."""
    return _blockwise_hadamard(x.to(torch.float64) * signs)


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``(..., D)`` float64: the inverse of :func:`rotate` (H is its own inverse, then the signs)."""
    return _blockwise_hadamard(y.to(torch.float64)) * signs


def _blockwise_hadamard(x: torch.Tensor) -> torch.Tensor:
    dim = x.shape[-1]
    block = min(dim, ROTATION_BLOCK)
    return hadamard(x.reshape(*x.shape[:-1], dim // block, block)).reshape(x.shape)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh–Hadamard transform H/√D along the last axis (length D, a power of two): ``(..., D)``
    float64. It is its own inverse.

    H_D = H_a ⊗ H_b ⊗ … (Sylvester), so it is applied as a few small dense matrices, one per factor of at most
    2^6, along the axes of x viewed as ``(n, a, b, …)``: a handful of matrix products instead of log₂ D passes.
    """
    *batch, dim = x.shape
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two length, got {dim}")
    y = x.to(torch.float64).reshape(-1, dim)
    rows, remaining = y.shape[0], dim.bit_length() - 1
    while remaining:
        factor = min(_FACTOR_BITS, remaining)
        size = 1 << factor
        # H_size on the leading index of (rows, size, rest), then that index moved last: after every factor has
        # had its turn the indices are back in their order.
        y = torch.matmul(_sylvester(factor), y.reshape(rows, size, dim // size)).transpose(1, 2).reshape(rows, dim)
        remaining -= factor
    return y.reshape(*batch, dim) / math.sqrt(dim)


_FACTOR_BITS = 6


@functools.cache
def _sylvester(bits: int) -> torch.Tensor:
    """``(2^bits, 2^bits)`` float64: the ±1 Sylvester–Hadamard matrix H_2^{⊗bits}."""
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(bits):
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h


def encode_sum(total: torch.Tensor, encoding: Encoding, signs: torch.Tensor, stream: Keystream) -> torch.Tensor:
    """``(..., D)`` int64: a party's clipped sum `total` ``(..., d)`` (Σ_i clip(g_i, c); leading axes: independent
    sums, as the audit's trials) padded, rotated, scaled by 1/γ and rounded at random, ⌊y + 1 − u⌋ with u uniform
    on [0, 1) from `stream` (the party's sampling stream)."""
    if total.shape[-1:] != (encoding.dimension,):
        raise ValueError(f"encode_sum: a sum of shape {tuple(total.shape)}, the encoding has {encoding.dimension} "
                         "coordinates")
    padded = torch.zeros(*total.shape[:-1], encoding.padded, dtype=torch.float64)
    padded[..., : encoding.dimension] = total.to(torch.float64)
    scaled = rotate(padded, signs) / encoding.scale
    # The coin is added before the floor, 1 − u ∈ (0, 1]: for fixed coins the map is then monotone in the value,
    # which the sensitivity's argument needs.
    return torch.floor(scaled + (1.0 - stream.uniform(tuple(scaled.shape)))).to(torch.int64)


def wrap(total: torch.Tensor, bits: int) -> np.ndarray:
    """``(D,)`` uint32: the integers `total` mod 2^bits (two's complement keeps the residue of negative values)."""
    return (total.to(torch.int64) & ((1 << bits) - 1)).numpy().astype(np.uint32)


def decode(total: np.ndarray, encoding: Encoding, signs: torch.Tensor) -> torch.Tensor:
    """``(..., d)`` float64: the real vectors of Σ_k uploads (uint32 ``(..., D)``, summed mod 2^32 by the Reduce):
    reduced mod 2^b into the signed range [−2^(b−1), 2^(b−1)), ×γ, rotated back (H is its own inverse, then the
    signs)."""
    modulus = 1 << encoding.bits
    residue = torch.from_numpy(total.astype(np.int64)) % modulus
    signed = torch.where(residue >= modulus // 2, residue - modulus, residue)
    real = unrotate(signed.to(torch.float64) * encoding.scale, signs)
    return real[..., : encoding.dimension]
