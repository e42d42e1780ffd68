"""A party's own disk: the sent-steps journal, its checkpointed states, its error log (no MPI)."""

from __future__ import annotations

import pytest
import torch

from mpi_fnas.federation.party_store import PartyStore, party_dir
from mpi_fnas.federation.randomness import PartyRandomness, reproducible_seed


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


def test_secret_randomness_is_not_derived_from_the_config():
    a = PartyRandomness.create("secret", seed=0, rank=1, device=torch.device("cpu"))
    b = PartyRandomness.create("secret", seed=0, rank=1, device=torch.device("cpu"))
    public = torch.Generator().manual_seed(reproducible_seed(0, 1, "batches"))
    draws = [torch.rand(8, generator=g) for g in (a.sampling, b.sampling, public)]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert not torch.equal(torch.rand(8, generator=a.noise), torch.rand(8, generator=b.noise))


def test_reproducible_randomness_follows_the_config():
    a = PartyRandomness.create("reproducible", seed=4, rank=2, device=torch.device("cpu"))
    b = PartyRandomness.create("reproducible", seed=4, rank=2, device=torch.device("cpu"))
    assert torch.equal(torch.rand(8, generator=a.noise), torch.rand(8, generator=b.noise))
    assert PartyRandomness.create("os", seed=4, rank=2, device=torch.device("cpu")).noise is None
