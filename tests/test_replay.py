"""Every release draws fresh randomness, a replay after a resume included.

A resumed DP party restores its batch positions from its own state file, but never its stream keys: it draws new
ones from the OS, so the replay of a step it may have sent before has new Poisson coins, rounding coins and noise.
Here one party's release of one step is made twice, as by the launch that first sent it and by the launch that
resumed from the checkpoint before it (a new party restoring the first one's saved state), at the same W: what an
honest-but-curious server holds after a crash and a ``--resume``.

* ``secure``: subtracting the two integer uploads (the sum of the parties' uploads opens to the sum of their
  totals, and the masks cancel) would cancel a replayed noise and leave the clipped sum, rotated two different ways:
  ``H·(s₁ − s₂)·p/γ``, readable wherever the two launches' public signs differ (half the coordinates). With fresh
  noise that difference is noise: the attack recovers nothing an honest decode does not.
* ``local``: a replayed release differs from its first attempt by fresh noise.
* ``reproducible`` noise (tests only, ε void) keeps bit-identical replays.
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
import torch
from pre_recipe import PRE_RECIPE

import mpi_fnas.privacy.mechanism as mechanism
from mpi_fnas.bench import make_party
from mpi_fnas.config import load_config
from mpi_fnas.federation.job_plan import secure_dimension
from mpi_fnas.federation.local_model import search_party
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.keystream import Keystream
from mpi_fnas.privacy import DPParams
from mpi_fnas.secagg.encoding import unrotate
from mpi_fnas.secagg.masks import PairwiseMasks


@pytest.fixture(autouse=True)
def pinned_secret_keys(monkeypatch):
    """Every ``Keystream.from_os`` gets its own fixed key (SHA-256 of a call count), still marked secret: each launch
    still keys new streams, as from the OS, but on one fixed draw, so the statistics below cannot change from one
    run to the next (the attack's correlation on fresh noise is ~0.06 with a spread of ~0.02)."""
    calls = itertools.count()

    def from_os(cls) -> Keystream:
        return cls(hashlib.sha256(f"test_replay/{next(calls)}".encode()).digest(), secret=True)

    monkeypatch.setattr(Keystream, "from_os", classmethod(from_os))


SMALL = ["mode=dpfnas", "space.channels=4", "space.layers=3", "space.nodes=1", "data.image_size=8",
         "search.batch_size=16", "privacy.aggregation=local"]  # the secure test asks for secure itself


def secure_party(cfg, state: dict | None):
    """A secure party of a fresh launch (new process: new secret streams, new X25519 keys), K = 2, restored from
    `state` when given."""
    base = make_party(cfg, private=False)  # the same network, shards and W in every launch
    dp = DPParams.from_config(cfg.privacy, len(base.train), parties=2, secure_dimension=secure_dimension(cfg))
    party = search_party(base.model, base.train, base.val, len(base.train),
                         PartyRandomness.create(dp.randomness, seed=cfg.seed, rank=1), dp=dp)
    if state is not None:
        party.load_state_dict(state)
    masks, peer = PairwiseMasks(1), PairwiseMasks(2)
    masks.agree({1: masks.public_key, 2: peer.public_key}, parties=2)
    party.use_secure_aggregation(masks, "search")
    return party


def test_a_replayed_secure_upload_minus_its_first_attempt_reveals_no_clipped_sum(monkeypatch):
    cfg = load_config(None, [*PRE_RECIPE, *SMALL, "privacy.aggregation=secure"])
    encoded: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (clipped sum p, signs, integer total)
    real_encode, real_noise = mechanism.encode_sum, mechanism.discrete_gaussian
    noises: list[torch.Tensor] = []

    def recording_encode(total, encoding, signs, stream):
        out = real_encode(total, encoding, signs, stream)
        encoded.append((total.clone(), signs.clone(), out))
        return out

    def recording_noise(*args):
        noise = real_noise(*args)
        noises.append(noise)
        return noise

    monkeypatch.setattr(mechanism, "encode_sum", recording_encode)
    monkeypatch.setattr(mechanism, "discrete_gaussian", recording_noise)
    first = secure_party(cfg, None)
    checkpoint = first.state_dict()  # the party's own state file of the checkpoint before the replayed step
    first.w_release()
    replay = secure_party(cfg, checkpoint)
    replay.w_release()

    (p, s1, enc1), (p2, s2, enc2) = encoded
    torch.testing.assert_close(p, p2, rtol=0, atol=0)  # honest server: same W, same (q = 1) batch, same clipped sum
    total1, total2 = enc1 + noises[0], enc2 + noises[1]
    gamma, d = first.releases["W"].encoding(first.num_w).scale, p.shape[-1]
    # The attack: H·(total₁ − total₂)·γ = (s₁ − s₂)·p + noise; read p where the launches' signs differ.
    difference = unrotate((total1 - total2).to(torch.float64), torch.ones_like(s1)) * gamma
    differ = (s1 != s2)[:d]
    recovered = (difference[:d] / (s1 - s2)[:d])[differ]
    attack = np.corrcoef(recovered.numpy(), p[differ].numpy())[0, 1]
    honest = np.corrcoef((unrotate(total1.to(torch.float64), s1) * gamma)[:d].numpy(), p.numpy())[0, 1]
    assert differ.sum() > d / 3
    assert abs(attack) < 0.1, (attack, honest)
    assert not torch.equal(noises[0], noises[1])


@pytest.mark.parametrize("source", ["secret", "reproducible"])
def test_a_replayed_local_release_draws_fresh_noise_unless_reproducible(source):
    cfg = load_config(None, [*PRE_RECIPE, *SMALL, f"privacy.reproducible_noise={source == 'reproducible'}"])
    first = make_party(cfg, private=True)
    checkpoint = first.state_dict()
    r1 = first.w_release()[:first.num_w].copy()
    replay = make_party(cfg, private=True)
    replay.load_state_dict(checkpoint)
    r2 = replay.w_release()[:replay.num_w].copy()
    if source == "reproducible":
        np.testing.assert_array_equal(r1, r2)  # bit-identical resumes; the run's ε is void anyway
        return
    release = first.releases["W"]
    std = np.std((r1.astype(np.float64) - r2) * release.expected_batch_size)
    # Two independent noises N(0, (σR)²) per coordinate (the clipped sums are equal: same W, same q = 1 batch).
    assert std == pytest.approx(np.sqrt(2) * release.noise_multiplier * release.clip, rel=0.05)
    assert set(checkpoint) == {"train_stream", "val_stream"}  # no stream key on the party's disk
