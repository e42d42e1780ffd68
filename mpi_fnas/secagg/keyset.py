"""What a party accepts as the relayed key set of secure aggregation, and how the parties confirm they saw one set.

Rank 0 relays the parties' X25519 public keys (:mod:`mpi_fnas.secagg.masks`), and rank 0 is the adversary the masks
hide the releases from (docs/privacy.md §8, "A server that lies"). What stops it:

* **A short set** (party i shown ``{i: pk_i}`` alone gets a zero mask): :func:`check_key_set` refuses any set that
  is not exactly the K parties of the job (ranks 1..K, K from the party's own communicator, not from the server),
  with 32-byte keys, all distinct, its own key at its own rank.
* **Different sets for different parties**: each party hashes its set (:func:`key_set_digest`) and the parties
  compare the digests directly, never through rank 0, before any masked upload (:func:`check_confirmations`).

Without identities this only shows that the K ranks of this job saw one set: a rank 0 that also runs a process at
a party's rank, or controls the links between parties, can still substitute keys. With
``privacy.party_identities`` (:mod:`mpi_fnas.secagg.identities`) every party also checks every other party's
signature of its key and the digest. No MPI here: :mod:`mpi_fnas.federation.handshake` moves the bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from mpi_fnas.secagg.identities import SIGNATURE_BYTES, PartyIdentity, verify_key_signature

#: Bytes of an X25519 public key as it travels to rank 0 and back.
PUBLIC_KEY_BYTES = 32
#: Bytes of a key-set digest (SHA-256).
DIGEST_BYTES = 32
_DIGEST_LABEL = b"mpi_fnas/secagg/keyset/v1"


class KeySetError(ValueError):
    """A party refuses the relayed key set (one line, public facts only: ranks and what is wrong, never a key)."""


def check_key_set(public_keys: object, *, parties: int, rank: int, own_key: bytes) -> None:
    """Raise :class:`KeySetError` unless `public_keys` is ``{1: key, …, K: key}`` for exactly this job's K = `parties`
    ranks, every key 32 bytes and distinct, and this party's `own_key` at its `rank`."""
    where = f"rank {rank} refuses the key set rank 0 relayed"
    if not isinstance(public_keys, dict):
        raise KeySetError(f"{where}: a {type(public_keys).__name__}, not a dict of rank to key")
    expected = set(range(1, parties + 1))
    ranks = {r for r in public_keys if isinstance(r, int) and not isinstance(r, bool)}
    if ranks != expected or len(public_keys) != parties:
        missing, extra = sorted(expected - ranks), sorted(map(repr, set(public_keys) - expected))
        held = f"{len(public_keys)} key" + ("" if len(public_keys) == 1 else "s")
        raise KeySetError(f"{where}: it holds {held} where this job has {parties} parties "
                          f"(ranks 1..{parties}); missing ranks {missing}, foreign entries {extra}")
    for peer in sorted(expected):
        key = public_keys[peer]
        if not isinstance(key, bytes) or len(key) != PUBLIC_KEY_BYTES:
            raise KeySetError(f"{where}: party {peer}'s key is not {PUBLIC_KEY_BYTES} bytes")
    if public_keys[rank] != own_key:
        raise KeySetError(f"{where}: its own public key is not the one at rank {rank}")
    if len(set(public_keys.values())) != parties:
        raise KeySetError(f"{where}: it holds the same key at several ranks (duplicate keys)")


def key_set_digest(public_keys: Mapping[int, bytes]) -> bytes:
    """32 bytes naming a key set: SHA-256 of its size and of every (rank, key) in rank order. Two parties hold the
    same digest exactly when rank 0 showed them the same set."""
    digest = hashlib.sha256(_DIGEST_LABEL + len(public_keys).to_bytes(4, "big"))
    for rank in sorted(public_keys):
        digest.update(int(rank).to_bytes(4, "big") + public_keys[rank])
    return digest.digest()


def confirmation(public_keys: Mapping[int, bytes], rank: int, identity: PartyIdentity | None) -> bytes:
    """What party `rank` sends every other party: the digest of the set it was shown, and with an `identity` its
    signature of its own key with that digest (:func:`~mpi_fnas.secagg.identities.PartyIdentity.sign_key`)."""
    digest = key_set_digest(public_keys)
    if identity is None:
        return digest
    return digest + identity.sign_key(rank, public_keys[rank], digest)


def check_confirmations(public_keys: Mapping[int, bytes], rank: int, received: Mapping[int, bytes],
                        identity: PartyIdentity | None) -> None:
    """Raise :class:`KeySetError` unless every other party confirmed the set party `rank` was shown.

    `received`: ``{peer: its confirmation}`` from every other party. A peer with another digest saw another set;
    with an `identity`, a peer whose signature does not verify, against its identity and the key at its rank in
    *this* party's set, holds another key than the one this party would mask with (a substitution).
    """
    own = key_set_digest(public_keys)
    size = DIGEST_BYTES + (SIGNATURE_BYTES if identity is not None else 0)
    peers = set(public_keys) - {rank}
    if set(received) != peers:
        raise KeySetError(f"rank {rank}: confirmations came from ranks {sorted(received)}, expected {sorted(peers)}")
    malformed = sorted(peer for peer, message in received.items() if len(message) != size)
    if malformed:
        raise KeySetError(f"rank {rank}: the key-set confirmations of parties {malformed} are not {size} bytes")
    differing = sorted(peer for peer, message in received.items() if message[:DIGEST_BYTES] != own)
    if differing:
        raise KeySetError(f"rank {rank} refuses the key set rank 0 relayed: parties {differing} were shown another "
                          "set (their key-set digests differ from this party's); no masked upload was made")
    if identity is None:
        return
    forged = sorted(peer for peer, message in received.items()
                    if not verify_key_signature(identity.roster[peer], peer, public_keys[peer], own,
                                                message[DIGEST_BYTES:]))
    if forged:
        raise KeySetError(f"rank {rank} refuses the key set rank 0 relayed: the keys at ranks {forged} are not "
                          "signed by those parties' identities (privacy.party_identities): a substituted key; no "
                          "masked upload was made")
