"""A party's own disk: the sent-steps journal, its checkpointed states, its error log (no MPI)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from mpi_fnas.federation.party_disk import PartyStore, party_dir
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.keystream import Keystream


def test_journal_counts_every_send_durably_across_attempts(tmp_path):
    store = PartyStore(party_dir(tmp_path, 3))
    assert store.sent_steps == 0
    for _ in range(5):
        store.record_send()
    store.close()
    again = PartyStore(party_dir(tmp_path, 3))  # a later attempt of the same run reads the same count
    assert again.sent_steps == 5
    again.record_send()
    assert PartyStore(party_dir(tmp_path, 3)).sent_steps == 6
    assert party_dir(tmp_path, 3) == tmp_path / "parties" / "rank3"


def test_states_keep_the_previous_checkpoint_and_drop_stale_future_ones(tmp_path):
    store = PartyStore(tmp_path / "p")
    for step in (10, 20, 30):
        store.save_state(step, {"x": torch.tensor([step])})
    assert sorted(p.name for p in store.directory.glob("state-*.pt")) == ["state-20.pt", "state-30.pt"]
    # A resumed attempt checkpoints again at 25 (< 30): 30 was left by an attempt that died before the server's.
    store.save_state(25, {"x": torch.tensor([25])})
    assert sorted(p.name for p in store.directory.glob("state-*.pt")) == ["state-20.pt", "state-25.pt"]
    assert int(store.load_state(20)["x"]) == 20 and store.load_state(25)["step"] == 25
    with pytest.raises(FileNotFoundError, match="no saved state for checkpoint step 30"):
        store.load_state(30)


def test_error_details_stay_in_the_party_directory(tmp_path):
    store = PartyStore(tmp_path / "p")
    path = store.write_error("Traceback ...\nRuntimeError: CUDA out of memory. Tried to allocate 1234 MiB")
    assert path.parent == store.directory and "1234 MiB" in path.read_text()


def test_secret_randomness_is_keyed_by_the_os_alone(monkeypatch):
    """Each secret stream is keyed by its own 32 bytes of os.urandom and by nothing of the config: with the OS's
    bytes fixed, other seeds, ranks and stages give the same draws, and each stream is AES-CTR under its key."""
    import mpi_fnas.keystream as keystream

    keys = iter(bytes([n]) * 32 for n in range(1, 100))
    monkeypatch.setattr(keystream.os, "urandom", lambda n: next(keys)[:n])
    a = PartyRandomness.create("secret", seed=0, rank=1)
    b = PartyRandomness.create("secret", seed=7, rank=3, stage="augment")
    for stream, key in ((a.sampling, 1), (a.noise, 2)):
        assert torch.equal(stream.words(8), Keystream(bytes([key]) * 32, secret=True).words(8))
    monkeypatch.setattr(keystream.os, "urandom", lambda n: bytes([1]) * n)
    same_os = PartyRandomness.create("secret", seed=7, rank=3, stage="augment")
    assert torch.equal(same_os.sampling.words(8), Keystream(bytes([1]) * 32, secret=True).words(8))
    assert not torch.equal(b.sampling.words(8), b.noise.words(8))  # b's streams: the OS's 3rd and 4th keys
    public = PartyRandomness.create("reproducible", seed=0, rank=1)
    assert not torch.equal(public.sampling.words(8), a.sampling.words(8))  # the config's stream is another
    assert a.sampling.secret and a.noise.secret and not public.noise.secret


def test_reproducible_randomness_follows_the_config():
    a = PartyRandomness.create("reproducible", seed=4, rank=2)
    b = PartyRandomness.create("reproducible", seed=4, rank=2)
    assert torch.equal(a.noise.words(8), b.noise.words(8))
    streams = [PartyRandomness.create("reproducible", seed=seed, rank=rank, stage=stage)
               for seed, rank, stage in ((4, 2, "search"), (5, 2, "search"), (4, 3, "search"), (4, 2, "augment"))]
    words = {tuple(s.sampling.words(4).tolist()) for s in streams} | {tuple(s.noise.words(4).tolist()) for s in streams}
    assert len(words) == 8  # every seed, rank, stage and purpose its own stream
    with pytest.raises(ValueError, match="unknown randomness source 'os'"):
        PartyRandomness.create("os", seed=4, rank=2)


def test_a_party_directory_and_its_files_are_private_to_the_user(tmp_path):
    """0700 and 0600 whatever the umask: the state files hold the party's stream keys (docs/privacy.md §2.2)."""
    old_umask = os.umask(0o022)
    try:
        (tmp_path / "parties" / "rank2").mkdir(parents=True, mode=0o755)  # left by an earlier, looser version
        store = PartyStore(party_dir(tmp_path, 2))
        store.record_send()
        store.save_party(5, "secret", {"noise": PartyRandomness.create("secret", seed=0, rank=2).noise.state_dict()})
        store.write_error("details")
        store.close()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    files = sorted(p.name for p in store.directory.iterdir())
    assert files == ["error.log", "sent_steps", "state-5.pt"]
    for name in files:
        assert stat.S_IMODE((store.directory / name).stat().st_mode) == 0o600, name
