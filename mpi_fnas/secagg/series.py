"""One kind of secure release in one stage, as a party seals it and rank 0 opens the sum (docs/privacy.md §8).

A party's n-th release of a kind (``W`` or ``A``) in a stage is labelled ``(run id, stage, name, n)``; the party and
rank 0 count their releases in lockstep, so both derive the same public rotation and the masks of that label, and
no label is ever used twice in a run. The run id is the launch id (:func:`~mpi_fnas.secagg.masks.launch_id`:
SHA-256 of the relayed public keys, fresh every launch), so a resumed run reuses neither. Under
``privacy.reproducible_noise`` (ε void) the rotations are labelled by the seed instead (:func:`rotation_id`), so a
secure run repeats bit for bit: the masks still differ, but they cancel in the sum.

* party: :meth:`SecureSeries.next_signs` (the rotation of the next release), the release's integer total (encoded
  examples plus the party's noise share), then :meth:`SecureSeries.seal`: the total mod 2^bits plus its pairwise
  masks, as uint32 words (D,);
* rank 0: :meth:`SecureSeries.open` the words' sum (mod 2^32, from the Reduce): decode, ÷ B.

No MPI, no autograd.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from mpi_fnas.secagg.encoding import Encoding, decode, rotation_signs, wrap
from mpi_fnas.secagg.masks import PairwiseMasks


def rotation_id(run_id: bytes, reproducible_seed: int | None = None) -> bytes:
    """What a run's rotations are labelled by: its launch id, or with ``privacy.reproducible_noise`` the public
    `reproducible_seed` (the rotation is public either way, and any fixed one keeps the accounting's bound, which
    holds for every rounding: docs/privacy.md §8)."""
    if reproducible_seed is None:
        return bytes(run_id)
    return hashlib.sha256(f"mpi_fnas/secagg/reproducible-rotation/{int(reproducible_seed)}".encode()).digest()


class SecureSeries:
    """The releases named `name` of `stage` under the public `encoding`, labelled by the launch's `run_id` (the
    rotations by `rotation` when given: :func:`rotation_id`)."""

    def __init__(self, run_id: bytes, stage: str, name: str, encoding: Encoding, rotation: bytes | None = None) -> None:
        self.run_id, self.stage, self.name, self.encoding = bytes(run_id), stage, name, encoding
        self.rotation = bytes(rotation) if rotation is not None else self.run_id
        self.count = 0  # releases labelled so far

    def next_signs(self) -> torch.Tensor:
        """``(D,)`` ±1: the rotation of the next release (advances the count)."""
        self.count += 1
        return rotation_signs(self.encoding.dimension, self.rotation.hex(), self.stage, self.name, self.count)

    def seal(self, total: torch.Tensor, masks: PairwiseMasks) -> np.ndarray:
        """``(D,)`` uint32: a party's integer `total` ``(D,)`` of the current release mod 2^bits, plus its masks."""
        if self.count < 1:
            raise RuntimeError("seal() needs next_signs() first: the release has no label yet")
        words = wrap(total, self.encoding.bits)
        return words + masks.mask(words.size, stage=self.stage, step=self.count, release=self.name)

    def open(self, words: np.ndarray, expected_batch_size: float) -> np.ndarray:
        """Rank 0: ``(d,)`` float32, the real sum of the K releases (uint32 ``(D,)``, summed mod 2^32) ÷ B, the
        quantity the local path's sum of releases estimates (advances the count)."""
        signs = self.next_signs()
        return (decode(words, self.encoding, signs) / expected_batch_size).to(torch.float32).numpy()
