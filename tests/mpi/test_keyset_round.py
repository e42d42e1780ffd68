"""The parties' hash round over MPI (docs/privacy.md §8): rank 0 plays the adversary. When it shows
different parties different key sets, every party refuses, in one line, before any masked upload, and no rank
hangs; with identities, an impostor at a party's rank is refused by every honest party. The same checks without
MPI: tests/test_keyset.py.

Run with: mpirun -n 5 python -m pytest --with-mpi --only-mpi tests/mpi/test_keyset_round.py (any size >= 3).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from mpi_waits import quiet_barrier

from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.handshake import agree_masks, relay_public_keys
from mpi_fnas.secagg.identities import PartyIdentity, load_party_identity, make_identities
from mpi_fnas.secagg.keyset import KeySetError
from mpi_fnas.secagg.masks import mask_stream


def mitm_relay(channel: Channel, fooled: set[int]) -> None:
    """Rank 0 as the adversary: a key of its own at the last rank in the sets of the `fooled` parties, the true set
    for the others."""
    keys = {rank: key for rank, key in enumerate(channel.gather_objects(None)[1:], start=1)}
    own = X25519PrivateKey.generate().public_key().public_bytes_raw()
    mitm = {**keys, channel.parties: own}
    channel.scatter_objects([None, *(mitm if rank in fooled else keys for rank in range(1, channel.size))])


#: Words of the mask of one release, and the release, that the honest-relay case draws.
MASK_WORDS = 16
RELEASE = {"stage": "search", "step": 3, "release": "W"}


@pytest.mark.mpi(min_size=3)
def test_an_honest_relay_is_confirmed_by_every_party(channel):
    """Every party accepts the set, and every pair of parties then holds one secret: the mask stream party i
    derives (:func:`~mpi_fnas.secagg.masks.mask_stream`) for the pair {i, j} is the one party j derives, the
    K(K−1)/2 pairs' streams all differ, every party names the launch by rank 0's launch id, and the K masks
    (:meth:`~mpi_fnas.secagg.masks.PairwiseMasks.mask`) sum to zero mod 2^32 at rank 0, none of them zero. Every
    exchange is made before any rank asserts, so a failing rank leaves none waiting."""
    if channel.is_server:
        run_id = relay_public_keys(channel)
        uploads = channel.gather_objects(None)[1:]  # each party's (run id, mask): what the test, not a run, sends
        masks = [np.asarray(mask, dtype=np.uint32) for _, mask in uploads]
        assert [bytes(party_run) for party_run, _ in uploads] == [run_id] * channel.parties
        assert not np.any(np.sum(masks, axis=0, dtype=np.uint32)), "the parties' masks do not cancel in the sum"
        assert all(mask.any() for mask in masks) and len({mask.tobytes() for mask in masks}) == channel.parties
        return
    masks = agree_masks(channel)
    parties = range(1, channel.size)
    streams = {peer: mask_stream(secret, MASK_WORDS, run_id=masks.run_id, pair=(min(channel.rank, peer),
                                                                                 max(channel.rank, peer)), **RELEASE)
               for peer, secret in masks._shared.items()}
    # Slot k of a party's message: its stream with rank k (zeros at its own rank).
    own = b"".join(streams[k].tobytes() if k in streams else bytes(4 * MASK_WORDS) for k in parties)
    received = channel.exchange_among_parties(own)
    channel.gather_objects((masks.run_id, masks.mask(MASK_WORDS, **RELEASE)))

    assert sorted(masks._shared) == [k for k in parties if k != channel.rank]
    slot = {sender: {k: message[4 * MASK_WORDS * (k - 1):4 * MASK_WORDS * k] for k in parties}
            for sender, message in {**received, channel.rank: own}.items()}
    differing = [peer for peer in received if slot[peer][channel.rank] != slot[channel.rank][peer]]
    assert not differing, f"rank {channel.rank} and ranks {differing} derived different masks for their pairs"
    pairs = {(i, j): slot[i][j] for i in parties for j in parties if i < j}
    assert len(set(pairs.values())) == len(pairs) == channel.parties * (channel.parties - 1) // 2
    assert bytes(4 * MASK_WORDS) not in pairs.values()


@pytest.mark.mpi(min_size=3)
def test_different_sets_for_different_parties_are_refused_by_every_party(channel):
    """Parties 1..K-1 see rank 0's key at rank K; party K sees the true set (its own key must be there). Each
    party finds that another party saw another set."""
    if channel.is_server:
        mitm_relay(channel, fooled=set(range(1, channel.parties)))
        return
    with pytest.raises(KeySetError, match=rf"^rank {channel.rank} refuses the key set rank 0 relayed: parties "
                                          r"\[.*\] were shown another set") as refused:
        agree_masks(channel)
    assert "\n" not in str(refused.value)


@pytest.mark.mpi(min_size=3)
def test_with_identities_an_impostor_at_a_partys_rank_is_refused_by_every_honest_party(channel, shared_dir):
    """Rank 0 runs its own process at rank 2 (the omission attack: the hospital never joins). It is shown the same
    set as everyone, so the digests agree, but it cannot sign as party 2: every other party refuses."""
    directory = identities(channel, shared_dir("keyset-identities-"))
    if channel.is_server:
        relay_public_keys(channel)
        return
    identity = own_identity(directory, channel)
    if channel.rank == 2:
        agree_masks(channel, PartyIdentity(2, Ed25519PrivateKey.generate(), identity.roster))  # the impostor
        return
    with pytest.raises(KeySetError, match=rf"^rank {channel.rank} refuses.*keys at ranks \[2\] are not signed"):
        agree_masks(channel, identity)


@pytest.mark.mpi(min_size=3)
def test_with_identities_an_honest_relay_is_confirmed(channel, shared_dir):
    directory = identities(channel, shared_dir("keyset-honest-identities-"))
    if channel.is_server:
        relay_public_keys(channel)
        return
    agree_masks(channel, own_identity(directory, channel))


def identities(channel: Channel, directory: Path) -> Path:
    """`directory`, where rank 0 has made every party's identity and the roster before any rank goes on."""
    if channel.is_server:
        make_identities(directory, channel.parties, directory / "roster.yaml")
    quiet_barrier(channel.comm)
    return directory


def own_identity(directory: Path, channel: Channel) -> PartyIdentity:
    return load_party_identity(directory / "roster.yaml", directory / "parties" / f"rank{channel.rank}",
                               channel.rank, channel.parties)
