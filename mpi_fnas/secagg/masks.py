"""Pairwise masks (Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning", CCS 2017,
§4, without the dropout recovery): every pair of parties agrees a key once, and each release adds, per peer, a mask
stream that the peer subtracts, so the masks cancel in the sum mod 2^32 and only the sum is visible.

* **Key agreement.** Each party draws an X25519 key pair (from the OS, through ``cryptography``) and sends its
  public key to rank 0, which relays all K; parties i and j then share a secret no one else can compute. A party
  accepts only a set of exactly its job's K parties, confirmed among them (:mod:`mpi_fnas.secagg.keyset`).
* **Key derivation.** One mask key per (run, stage, step, release, pair): HKDF-SHA256 of the shared secret with
  those labels as ``info``, so no keystream is ever used twice.
* **Mask stream.** ChaCha20 of zeros under that key: n uniform uint32 words, added by the lower rank of the pair
  and subtracted by the higher, so Σ_k masks_k ≡ 0 (mod 2^32) exactly.

A masked upload is uniform to anyone without a peer's key, whatever the encoding. A party that dies mid-step leaves
its peers' masks uncancelled and the job aborts (no partial sum is ever used). No MPI here: the caller relays the
public keys and reduces the uploads (docs/privacy.md §8).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mpi_fnas.secagg.keyset import PUBLIC_KEY_BYTES, check_key_set

__all__ = ["PUBLIC_KEY_BYTES", "PairwiseMasks", "launch_id", "mask_stream"]
_NONCE = bytes(16)  # each (run, stage, step, release, pair) has its own key: a fixed nonce never repeats a stream


class PairwiseMasks:
    """One party's side of the pairwise masks of a run.

    Args:
        rank: this party's rank (1..K).
        run_id: public bytes naming the run, bound into every key; None (a launch): :func:`launch_id` of the
            relayed public keys, set by :meth:`agree` (fresh keys every launch, so a fresh id every launch).

    Use: send :attr:`public_key` to rank 0; give :meth:`agree` every party's public key and the job's K; then
    :meth:`mask` gives the uint32 words this party adds to a release. The private key and the shared secrets never
    leave the object (and are not saved: a resumed run agrees new keys).
    """

    def __init__(self, rank: int, run_id: bytes | None = None) -> None:
        self.rank = int(rank)
        self.run_id = bytes(run_id) if run_id is not None else None
        self._private = X25519PrivateKey.generate()  # 32 bytes from the OS's CSPRNG
        self.public_key: bytes = self._private.public_key().public_bytes_raw()
        self._shared: dict[int, bytes] = {}

    def __repr__(self) -> str:
        return f"PairwiseMasks(rank={self.rank}, peers={sorted(self._shared)})"

    def agree(self, public_keys: dict[int, bytes], *, parties: int) -> None:
        """Compute the shared secret with every other party from its public key ({rank: 32 bytes}).

        `parties`: the job's K, as this party knows it (its communicator's size − 1), never a number from the
        server. Raises :class:`~mpi_fnas.secagg.keyset.KeySetError` unless `public_keys` is exactly ranks 1..K with
        distinct 32-byte keys, this party's own at its rank: a shorter set would leave peers out of the mask (a
        singleton set, no mask at all).
        """
        check_key_set(public_keys, parties=parties, rank=self.rank, own_key=self.public_key)
        if self.run_id is None:
            self.run_id = launch_id(public_keys)
        for peer, key in public_keys.items():
            if peer != self.rank:
                self._shared[peer] = self._private.exchange(X25519PublicKey.from_public_bytes(key))

    def mask(self, n: int, *, stage: str, step: int, release: str) -> np.ndarray:
        """``(n,)`` uint32: Σ_{j > rank} m_{rank,j} − Σ_{j < rank} m_{j,rank} (mod 2^32) for this release."""
        if self.run_id is None:
            raise RuntimeError("mask() needs agree() first")
        total = np.zeros(n, dtype=np.uint32)
        for peer, secret in self._shared.items():
            low, high = min(self.rank, peer), max(self.rank, peer)
            words = mask_stream(secret, n, run_id=self.run_id, stage=stage, step=step, release=release,
                                pair=(low, high))
            if self.rank == low:
                total += words  # uint32 arithmetic wraps: the sum is mod 2^32
            else:
                total -= words
        return total


def launch_id(public_keys: dict[int, bytes]) -> bytes:
    """16 public bytes naming a launch: SHA-256 of every party's public key in rank order (rank 0 and every party
    compute the same from the relayed keys)."""
    digest = hashlib.sha256(b"mpi_fnas/secagg/launch/v1")
    for rank in sorted(public_keys):
        digest.update(int(rank).to_bytes(4, "big") + public_keys[rank])
    return digest.digest()[:16]


def mask_stream(secret: bytes, n: int, *, run_id: bytes, stage: str, step: int, release: str,
                pair: tuple[int, int]) -> np.ndarray:
    """``(n,)`` uint32: ChaCha20 of zeros under HKDF-SHA256(secret; run, stage, step, release, pair)."""
    info = json.dumps(["mpi_fnas/secagg/mask/v1", run_id.hex(), stage, int(step), release, list(pair)],
                      separators=(",", ":")).encode()
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)
    encryptor = Cipher(algorithms.ChaCha20(key, _NONCE), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(4 * n)), dtype="<u4").astype(np.uint32)
