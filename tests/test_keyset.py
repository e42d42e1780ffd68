"""The server is the adversary: what a party accepts as the relayed key set of secure aggregation
(docs/privacy.md §8, "A server that lies"). Exactly the job's K parties, 32-byte keys, all distinct, its own at its
rank (a singleton set would zero its mask); the parties' confirmations of one set (the hash round; its MPI side is
tests/mpi/test_keyset_round.py); with identities, signatures that every honest party checks, so a substituted key
is found by each of them even if the server also forged the hash round's digests.
"""

from __future__ import annotations

import os
import stat

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.identities import main as identities_main
from mpi_fnas.secagg.identities import (
    IdentityError,
    PartyIdentity,
    identity_key_path,
    load_party_identity,
    make_identities,
    read_roster,
)
from mpi_fnas.secagg.keyset import (
    DIGEST_BYTES,
    KeySetError,
    check_confirmations,
    check_key_set,
    confirmation,
    key_set_digest,
)
from mpi_fnas.secagg.masks import PairwiseMasks

K = 4


def fresh_key() -> bytes:
    return X25519PrivateKey.generate().public_key().public_bytes_raw()


def job_masks(parties: int = K) -> list[PairwiseMasks]:
    return [PairwiseMasks(rank) for rank in range(1, parties + 1)]


def honest_set(masks: list[PairwiseMasks]) -> dict[int, bytes]:
    return {m.rank: m.public_key for m in masks}


# -- 1. a party refuses a key set that is not its job's ----------------------------------------------------------
def test_an_honest_set_is_accepted_and_masks_every_peer():
    masks = job_masks()
    for m in masks:
        m.agree(honest_set(masks), parties=K)
    assert all(len(m._shared) == K - 1 for m in masks)


def test_a_singleton_set_is_refused_it_would_zero_the_mask():
    """The measured attack: ``{i: pk_i}`` alone makes party i's mask zero (ε 3.83 instead of 1.58)."""
    masks = job_masks()
    with pytest.raises(KeySetError, match=r"rank 2 refuses.*holds 1 key where this job has 4 parties.*missing "
                                          r"ranks \[1, 3, 4\]"):
        masks[1].agree({2: masks[1].public_key}, parties=K)
    assert masks[1].run_id is None and not masks[1]._shared  # nothing agreed: no mask can be made


@pytest.mark.parametrize("foreign", ["extra", "substituted_rank", "rank_zero"])
def test_a_set_with_a_foreign_key_is_refused(foreign):
    masks = job_masks()
    relayed = honest_set(masks)
    if foreign == "extra":
        relayed[K + 1] = fresh_key()  # a K+1-th "party" the job does not have
    elif foreign == "substituted_rank":
        relayed[K + 1] = relayed.pop(K)  # a party moved to a rank outside the job
    else:
        relayed[0] = fresh_key()  # the server's own key in the set
    with pytest.raises(KeySetError, match=r"rank 1 refuses.*foreign entries"):
        masks[0].agree(relayed, parties=K)


def test_a_set_whose_key_at_this_partys_rank_is_not_its_own_is_refused():
    masks = job_masks()
    relayed = {**honest_set(masks), 3: fresh_key()}
    with pytest.raises(KeySetError, match="its own public key is not the one at rank 3"):
        masks[2].agree(relayed, parties=K)


def test_duplicate_keys_are_refused():
    """The server's one key at two ranks (or a party's own key repeated) is refused."""
    masks = job_masks()
    relayed = {**honest_set(masks), 4: masks[0].public_key}
    with pytest.raises(KeySetError, match="duplicate keys"):
        masks[0].agree(relayed, parties=K)


@pytest.mark.parametrize("told", [K - 1, K + 1])
def test_a_set_of_another_k_than_the_jobs_is_refused(told):
    """K comes from the party's own communicator: a complete set for a job of another size is refused."""
    masks = job_masks(told)
    with pytest.raises(KeySetError, match=rf"holds {told} keys where this job has {K} parties"):
        masks[0].agree(honest_set(masks), parties=K)


@pytest.mark.parametrize("bad", [b"\x01" * 31, "a" * 32, None])
def test_a_key_that_is_not_32_bytes_is_refused(bad):
    masks = job_masks()
    with pytest.raises(KeySetError, match="party 2's key is not 32 bytes"):
        check_key_set({**honest_set(masks), 2: bad}, parties=K, rank=1, own_key=masks[0].public_key)


def test_a_set_that_is_not_a_dict_is_refused():
    masks = job_masks()
    with pytest.raises(KeySetError, match="a list, not a dict"):
        check_key_set(list(honest_set(masks).values()), parties=K, rank=1, own_key=masks[0].public_key)


# -- 2. the confirmations (the hash round's content) -------------------------------------------------------------
def confirmations_of(views: dict[int, dict[int, bytes]], identities: dict[int, PartyIdentity] | None = None,
                     ) -> dict[int, bytes]:
    """What each party sends in the hash round, from the set it was shown."""
    return {rank: confirmation(view, rank, identities[rank] if identities else None) for rank, view in views.items()}


def received_by(rank: int, sent: dict[int, bytes]) -> dict[int, bytes]:
    return {peer: message for peer, message in sent.items() if peer != rank}


def test_one_set_seen_by_all_is_confirmed_and_its_digest_names_the_set():
    keys = honest_set(job_masks())
    sent = confirmations_of({rank: keys for rank in keys})
    for rank in keys:
        check_confirmations(keys, rank, received_by(rank, sent), None)
    assert len(key_set_digest(keys)) == DIGEST_BYTES
    assert key_set_digest(keys) != key_set_digest({**keys, 2: fresh_key()})
    assert key_set_digest(keys) != key_set_digest(dict(list(keys.items())[:2]))


def test_different_sets_for_different_parties_are_refused_by_every_party():
    """Rank 0 shows parties 1 and 2 a key of its own at rank 4, parties 3 and 4 the true set: every party finds
    a differing digest, and each refuses in one line."""
    keys = honest_set(job_masks())
    mitm = {**keys, 4: fresh_key()}
    views = {1: mitm, 2: mitm, 3: keys, 4: keys}
    sent = confirmations_of(views)
    for rank, view in views.items():
        with pytest.raises(KeySetError, match=rf"rank {rank} refuses.*were shown another set") as refused:
            check_confirmations(view, rank, received_by(rank, sent), None)
        assert "\n" not in str(refused.value)


def test_a_missing_or_malformed_confirmation_is_refused():
    keys = honest_set(job_masks())
    sent = confirmations_of({rank: keys for rank in keys})
    with pytest.raises(KeySetError, match="confirmations came from ranks"):
        check_confirmations(keys, 1, {2: sent[2], 3: sent[3]}, None)
    with pytest.raises(KeySetError, match=r"parties \[3\] are not 32 bytes"):
        check_confirmations(keys, 1, {**received_by(1, sent), 3: sent[3][:16]}, None)


# -- 3. identities ---------------------------------------------------------------------------------------------------
@pytest.fixture
def identities(tmp_path) -> dict[int, PartyIdentity]:
    roster = make_identities(tmp_path, K, tmp_path / "roster.yaml")
    return {rank: load_party_identity(roster, tmp_path / "parties" / f"rank{rank}", rank, K)
            for rank in range(1, K + 1)}


def test_signed_confirmations_of_the_true_set_verify_everywhere(identities):
    keys = honest_set(job_masks())
    sent = confirmations_of({rank: keys for rank in keys}, identities)
    for rank in keys:
        check_confirmations(keys, rank, received_by(rank, sent), identities[rank])


def test_a_substituted_key_is_found_by_every_honest_party_even_with_forged_digests(identities):
    """The worst case: rank 0 puts a key of its own at rank 3 in the sets of parties 1, 2, 4 and also controls the
    links between the parties, so it hands each party digests equal to its own view. It cannot sign: party 3's
    signature covers party 3's true key and set, the others' signatures their own (other) set. Every party refuses."""
    keys = honest_set(job_masks())
    mitm = {**keys, 3: fresh_key()}
    views = {1: mitm, 2: mitm, 3: keys, 4: mitm}
    honest_sent = confirmations_of(views, identities)  # each party's real message
    for rank, view in views.items():
        # The forger keeps each real signature but swaps the digest for the one this party expects.
        forged = {peer: key_set_digest(view) + message[DIGEST_BYTES:]
                  for peer, message in received_by(rank, honest_sent).items()}
        with pytest.raises(KeySetError, match=rf"rank {rank} refuses.*not signed by those parties' identities"):
            check_confirmations(view, rank, forged, identities[rank])


def test_an_impostor_at_a_partys_rank_is_found_by_every_honest_party(identities):
    """The omission attack: the server runs its own process at rank 2 (the hospital never joins). It is shown the
    same set as everyone, so the digests agree; but it has no identity key of party 2's."""
    keys = honest_set(job_masks())
    sent = confirmations_of({rank: keys for rank in keys}, identities)
    impostor = PartyIdentity(2, Ed25519PrivateKey.generate(), identities[2].roster)
    sent[2] = confirmation(keys, 2, impostor)
    for rank in (1, 3, 4):
        with pytest.raises(KeySetError, match=r"keys at ranks \[2\] are not signed"):
            check_confirmations(keys, rank, received_by(rank, sent), identities[rank])


def test_identity_files_are_private_and_the_roster_must_be_this_jobs(tmp_path):
    roster = make_identities(tmp_path, K, tmp_path / "roster.yaml")
    key_file = identity_key_path(tmp_path / "parties" / "rank1")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    assert key_file.read_bytes().hex() not in roster.read_text()
    with pytest.raises(IdentityError, match=r"this job's parties are ranks 1..5"):
        read_roster(roster, K + 1)
    with pytest.raises(IdentityError, match="holds another key at rank 2"):
        load_party_identity(roster, tmp_path / "parties" / "rank1", 2, K)
    os.chmod(key_file, 0o644)
    with pytest.raises(IdentityError, match="readable by its owner only"):
        load_party_identity(roster, tmp_path / "parties" / "rank1", 1, K)
    with pytest.raises(IdentityError, match="never overwritten"):
        make_identities(tmp_path, K, tmp_path / "other.yaml")


def test_the_identities_command_makes_a_roster_the_config_takes(tmp_path, capsys):
    assert identities_main([str(tmp_path), "--parties", "2"]) == 0
    roster = tmp_path / "party_identities.yaml"
    assert f"privacy.party_identities={roster}" in capsys.readouterr().out
    assert len(read_roster(roster, 2)) == 2
    assert identities_main([str(tmp_path), "--parties", "2"]) == 2  # never overwritten
    cfg = load_config(None, ["mode=dpfnas", "privacy.aggregation=secure", f"privacy.party_identities={roster}"])
    assert cfg.privacy.party_identities == str(roster)
    with pytest.raises(ConfigError, match=r"privacy\.party_identities authenticates secure aggregation"):
        load_config(None, ["mode=dpfnas", "privacy.aggregation=local", f"privacy.party_identities={roster}"])
