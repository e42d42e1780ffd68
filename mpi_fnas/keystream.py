"""Where every secret random number of a party comes from: AES-256 in counter mode, keyed with 256 OS bits.

A party's noise and its Poisson coins protect its data only from someone who cannot predict them; a seeded
simulation generator can be searched (torch's CPU generator keeps 32 bits of its seed), a 256-bit key cannot (why:
docs/privacy.md §2.1). :class:`Keystream` is the one source of a party's randomness: the Gaussian noise (through
:func:`mpi_fnas.privacy.mechanism.gaussian_noise`), the Poisson coins, and the augmentation's per-example crops,
flips, cutouts and drop-path masks. Its bytes are AES-256-CTR of zeros under the key: a pseudo-random function of
the counter, indistinguishable from uniform without the key (with ≤ 2^40 blocks drawn, the PRP/PRF switching term
is ≤ 2^-48). Its state is the key and the number of blocks drawn, so seeking is exact.

* :meth:`Keystream.from_os`: 32 bytes of ``os.urandom``; the key never leaves the party's memory.
* :meth:`Keystream.from_labels`: a public key, SHA-256 of public labels (seed, rank, purpose), for runs that make
  no privacy claim and for ``privacy.reproducible_noise`` (which voids ε); the same code path draws from it.

Every draw is made on the CPU (the caller moves it to its device): the same bytes on every machine. No MPI, no autograd.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

#: Bytes of a key (AES-256).
KEY_BYTES = 32
#: Bytes of one AES block: the unit of the stream's position.
BLOCK_BYTES = 16
#: Random bits per uniform (the float64 mantissa); a uniform is ``k · 2^-53`` for a uniform integer k < 2^53.
UNIFORM_BITS = 53
_COUNTER_SPACE = 1 << 128


class Keystream:
    """A seekable stream of uniform random bytes: AES-256-CTR of zeros under ``key``, from block ``position``.

    Args:
        key: 32 bytes.
        secret: True when the key came from the OS (:meth:`from_os`); False for a public key (:meth:`from_labels`).
        position: blocks already drawn (a resumed stream continues there).

    Every method consumes whole blocks: a draw of n bytes advances ``position`` by ⌈n / 16⌉, so the position
    after any sequence of draws depends only on their sizes. ``repr`` never shows the key.
    """

    def __init__(self, key: bytes, *, secret: bool, position: int = 0) -> None:
        if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
            raise ValueError(f"a Keystream key is {KEY_BYTES} bytes")
        if not 0 <= position < _COUNTER_SPACE:
            raise ValueError(f"position must be in [0, 2^128), got {position}")
        self._key = bytes(key)
        self._cipher = algorithms.AES(self._key)
        self.secret = bool(secret)
        self.position = int(position)

    @classmethod
    def from_os(cls) -> Keystream:
        """A secret stream: the key is 256 bits of the operating system's CSPRNG."""
        return cls(os.urandom(KEY_BYTES), secret=True)

    @classmethod
    def from_labels(cls, *labels: str | int) -> Keystream:
        """A public, reproducible stream keyed by SHA-256 of `labels` (e.g. ``("party", seed, rank, "noise")``).

        Distinct label tuples give independent-looking streams; anyone who knows the labels has the stream.
        """
        text = json.dumps(["mpi_fnas/keystream/v1", *labels], separators=(",", ":"))
        return cls(hashlib.sha256(text.encode()).digest(), secret=False)

    def __repr__(self) -> str:
        return f"Keystream(secret={self.secret}, position={self.position})"

    # -- raw bytes -------------------------------------------------------------------------------------------------
    def random_bytes(self, nbytes: int) -> bytes:
        """The next `nbytes` bytes of the stream (the rest of the last block is skipped)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes == 0:
            return b""
        blocks = -(-nbytes // BLOCK_BYTES)
        # The initial counter block is the position, big-endian; AES-CTR increments all 128 bits.
        counter = self.position.to_bytes(BLOCK_BYTES, "big")
        encryptor = Cipher(self._cipher, modes.CTR(counter)).encryptor()
        out = encryptor.update(bytes(blocks * BLOCK_BYTES))
        self.position = (self.position + blocks) % _COUNTER_SPACE
        return out[:nbytes]

    def words(self, n: int) -> torch.Tensor:
        """``(n,)`` int64: n uniform 64-bit words (two's complement, so half are negative)."""
        if n == 0:
            return torch.zeros(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(self.random_bytes(8 * n)), dtype=torch.int64)

    # -- numbers ---------------------------------------------------------------------------------------------------
    def bits(self, n: int) -> torch.Tensor:
        """``(n,)`` int64, i.i.d. uniform on ``[0, 2^53)``: the top 53 bits of each word."""
        return torch.from_numpy(self.bits_array(n))

    def bits_array(self, n: int) -> np.ndarray:
        """:meth:`bits` as a numpy ``(n,)`` int64 (the discrete Gaussian's samplers draw in numpy)."""
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        words = np.frombuffer(self.random_bytes(8 * n), dtype=np.uint64)
        return (words >> np.uint64(64 - UNIFORM_BITS)).view(np.int64)  # < 2^53: the same values as int64

    def uniform(self, shape: int | tuple[int, ...]) -> torch.Tensor:
        """float64 of `shape`, i.i.d. uniform on the grid ``{k · 2^-53 : 0 ≤ k < 2^53}`` ⊂ [0, 1).

        ``u < q`` then holds with probability exactly q for any q on that grid (every float64 in [2^-53, 1] is),
        which is what the Poisson coins need.
        """
        size = (shape,) if isinstance(shape, int) else tuple(shape)
        return self.bits(math.prod(size)).to(torch.float64).mul_(2.0**-UNIFORM_BITS).reshape(size)

    def integers(self, high: int | torch.Tensor, shape: int | tuple[int, ...] | None = None) -> torch.Tensor:
        """int64, i.i.d. uniform on ``0 .. high - 1``, exactly (1 ≤ high ≤ 2^53).

        `high` is an int (then `shape` gives the shape) or an int64 tensor of bounds, one per value drawn (then the
        result has its shape). A 53-bit draw k is kept only below the largest multiple of its bound (rejection,
        redrawn until none is left; probability < high / 2^53 per value), then ``k % high``.
        """
        if not isinstance(high, torch.Tensor):  # one bound for all
            size = (shape,) if isinstance(shape, int) else tuple(shape or ())
            return torch.from_numpy(self.integers_array(int(high), math.prod(size))).reshape(size)
        highs = high.to(torch.int64).reshape(-1).numpy()
        return torch.from_numpy(self.integers_array(highs, highs.size)).reshape(high.shape)

    def integers_array(self, high: int | np.ndarray, n: int) -> np.ndarray:
        """``(n,)`` int64 numpy, i.i.d. uniform on ``0 .. high - 1`` (1 ≤ high ≤ 2^53; `high` one bound or ``(n,)``
        bounds): a 53-bit k kept below the largest multiple of its bound, rejected ones redrawn in order."""
        highs = np.asarray(high, dtype=np.int64)
        if highs.size and not (int(highs.min()) >= 1 and int(highs.max()) <= 2**UNIFORM_BITS):
            raise ValueError("integers: every bound must be in [1, 2^53]")
        limits = (2**UNIFORM_BITS // highs) * highs
        draw = self.bits_array(n)
        rejected = np.flatnonzero(draw >= limits)
        while rejected.size:
            draw[rejected] = self.bits_array(rejected.size)
            rejected = rejected[draw[rejected] >= (limits if limits.ndim == 0 else limits[rejected])]
        return draw % highs

    def permutation(self, n: int) -> torch.Tensor:
        """``(n,)`` int64: a uniform random permutation of ``0 .. n - 1`` (Fisher–Yates with :meth:`integers`)."""
        if n < 2:
            return torch.arange(n, dtype=torch.int64)
        # Swap partner j_i uniform on 0..i for i = n-1 .. 1: every partner in one draw, then the swaps in order.
        partners = self.integers(torch.arange(n, 1, -1, dtype=torch.int64)).tolist()
        values = list(range(n))
        for i, j in zip(range(n - 1, 0, -1), partners, strict=True):
            values[i], values[j] = values[j], values[i]
        return torch.tensor(values, dtype=torch.int64)

    # -- state -----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"key", "secret", "position"}``: everything that determines the rest of the stream. Under
        :meth:`from_os` the key is the party's secret: this state belongs in the party's own 0600 file only."""
        return {"key": self._key, "secret": self.secret, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream saved by :meth:`state_dict`."""
        restored = Keystream(state["key"], secret=state["secret"], position=int(state["position"]))
        self._key, self._cipher = restored._key, restored._cipher
        self.secret, self.position = restored.secret, restored.position
