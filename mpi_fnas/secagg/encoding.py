"""Integer encoding of a party's release for secure aggregation, and rank 0's decoding of the sum (Kairouz, Liu &
Steinke, "The Distributed Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation", ICML 2021,
arXiv 2102.06387, Algorithm 1 and Theorem 1).

Per example (record-level DP: the sensitivity is one example's rounded vector), in this order:

1. **Rotate.** Pad the clipped gradient (‖g‖₂ ≤ c) to D coordinates (:func:`padded_length`: the next power of two
   up to :data:`ROTATION_BLOCK`, a multiple of it beyond) and apply the randomized Hadamard transform, block by
   block: H·diag(s) with H block-diagonal, each block the orthonormal Walsh–Hadamard matrix of the block's length
   (s ∈ {±1}^D public, fresh per step and release). The mass of a block is spread evenly over it, so no coordinate
   is large and the modular wrap rarely bites.
2. **Scale** by 1/γ (γ: the value of one integer unit) and **round at random, conditionally**: each coordinate goes
   to ⌊z⌋ + Bernoulli(z − ⌊z⌋) (unbiased), redrawn until ‖ẑ‖₂ ≤ :attr:`Encoding.norm_bound` (KLS21 Theorem 1:
   with probability ≥ 1 − β a draw passes, so the bound holds for every example that is released).

The party sums its examples' integer vectors, adds its share of the discrete noise and wraps the total into b bits
(:func:`wrap`); rank 0 decodes Σ_k of the uploads (:func:`decode`): the signed range, ×γ, the inverse rotation.
Nothing here is secret but the rounding coins, which come from the party's keystream; no MPI, no autograd.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from mpi_fnas.privacy.keystream import Keystream

#: The dimension every secure release is accounted at (:mod:`mpi_fnas.secagg.accounting`): a release of D ≤ this
#: many (padded) coordinates is covered, since the bound only grows with D (through the rounding's Δ₂ and τ·D).
#: One public constant keeps a ledger's ε a function of its (σ, q, count) runs alone, whatever network each stage
#: trains; larger releases are refused. Its cost is the rounding's D/4 in Δ₂² next to (c/γ)² = K·8000²/σ²: ~0.2 %
#: of ε(α) at K = 8 and σ = 1, ~1.6 % at K = 1.
ACCOUNTED_DIMENSION = 2**22
#: The rotation's block length: a release of d > this many coordinates is padded to a multiple of it (77,906 weights:
#: 81,920 coordinates; the next power of two would be 131,072), since the rounding, the noise and the upload all
#: scale with D. Blocks are enough for 32-bit sums: one example's coordinate is at most c/γ (≈ 2^14 integer units at
#: the default config) even unspread, so B·K of them stay near 2^22, and a block spreads its mass over 4,096.
ROTATION_BLOCK = 2**12


@dataclass(frozen=True)
class Encoding:
    """The public parameters of one release's integer encoding.

    dimension: d, the release's length. clip: c, each example's L2 bound before scaling. scale: γ > 0, the value of
    one integer unit. beta: β ∈ [0, 1) of the conditional rounding (0: no condition, the worst-case bound). bits: b,
    the sum lives mod 2^b (b ≤ 32: the uploads travel as uint32).
    """

    dimension: int
    clip: float
    scale: float
    beta: float = math.exp(-0.5)
    bits: int = 32

    def __post_init__(self) -> None:
        if self.dimension < 1 or self.clip <= 0 or self.scale <= 0:
            raise ValueError(f"an encoding needs dimension >= 1, clip > 0 and scale > 0, got {self}")
        if not 0 <= self.beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {self.beta}")
        if not 2 <= self.bits <= 32:
            raise ValueError(f"bits must be in [2, 32], got {self.bits}")

    @property
    def padded(self) -> int:
        """D: the length of the rotated, rounded vector (:func:`padded_length`)."""
        return padded_length(self.dimension)

    @property
    def norm_bound(self) -> float:
        """The L2 bound of one example's rounded vector, in integer units (KLS21 Theorem 1): the smaller of
        c/γ + √D (any rounding) and √((c/γ)² + D/4 + √(2 log(1/β))·(c/γ + √D/2)) (the condition, β > 0)."""
        c, dim = self.clip / self.scale, self.padded
        worst = c + math.sqrt(dim)
        if self.beta == 0:
            return worst
        conditional = c * c + dim / 4 + math.sqrt(2 * math.log(1 / self.beta)) * (c + math.sqrt(dim) / 2)
        return min(worst, math.sqrt(conditional))


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


def encode_examples(grads: torch.Tensor, encoding: Encoding, signs: torch.Tensor, stream: Keystream) -> torch.Tensor:
    """``(D,)`` int64: Σ over the rows of `grads` ``(b, d)`` (clipped examples, ‖row‖₂ ≤ c) of each row rotated,
    scaled and rounded conditionally (:func:`round_examples`)."""
    return round_examples(grads, encoding, signs, stream).sum(dim=0)


def round_examples(grads: torch.Tensor, encoding: Encoding, signs: torch.Tensor, stream: Keystream) -> torch.Tensor:
    """``(b, D)`` int64: each row of `grads` ``(b, d)`` (‖row‖₂ ≤ c) rotated, scaled and rounded conditionally; the
    rounding coins come from `stream` (the party's secret sampling stream). A row whose rounding exceeds the norm
    bound is redrawn (KLS21 Algorithm 1), never clipped."""
    b, d = grads.shape
    if d != encoding.dimension:
        raise ValueError(f"encode_examples: rows of {d} coordinates, the encoding has {encoding.dimension}")
    if b == 0:  # an empty Poisson batch: the release is its noise alone
        return torch.zeros(0, encoding.padded, dtype=torch.int64)
    norms = torch.linalg.vector_norm(grads.to(torch.float64), dim=1)
    if bool((norms > encoding.clip * (1 + 1e-9)).any()):  # the rounding's bound assumes it; redraws never end else
        # (no norm in the text: a row's norm is data, and error texts may travel)
        raise ValueError(f"encode_examples: a row exceeds the clip {encoding.clip:g}; clip the examples first")
    padded = torch.zeros(b, encoding.padded, dtype=torch.float64)
    padded[:, :d] = grads.to(torch.float64)
    scaled = rotate(padded, signs) / encoding.scale
    floor = torch.floor(scaled)
    fraction = scaled - floor
    rounded = torch.zeros(b, encoding.padded, dtype=torch.int64)
    pending = torch.arange(b)
    bound_squared = encoding.norm_bound**2
    while pending.numel():
        up = stream.uniform((pending.numel(), encoding.padded)) < fraction[pending]
        draw = floor[pending].to(torch.int64) + up
        passed = draw.to(torch.float64).square().sum(dim=1) <= bound_squared
        rounded[pending[passed]] = draw[passed]
        pending = pending[~passed]
    return rounded


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
