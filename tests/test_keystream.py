"""A party's secret randomness (docs/privacy.md §2.1): AES-256-CTR keyed with 256 bits from the OS, and nothing
else, for every noise draw, Poisson coin, augmentation and drop-path mask of a DP party.

What is checked:

* the stream is AES-256-CTR (a NIST known-answer test), seekable, resumable from its state, and its numbers have
  the distributions they claim (uniform grid, exact integers, uniform permutations);
* a party's secret streams use all of their OS entropy: entropy that differs only above bit 32 (where torch's
  CPU generator stops looking at a seed) gives different noise, and each key asks the OS for ≥ 128 bits;
* a DP party's releases, in the search and in the augmentation (Poisson batch, crop, flip, cutout, drop-path,
  noise), draw from no seeded generator at all: torch's, numpy's and Python's are booby-trapped while they run.
"""

from __future__ import annotations

import os
import random
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from mpi_fnas.config import load_config
from mpi_fnas.federation.local_model import Party, augment_party, search_party
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.federation.shard import Shard
from mpi_fnas.keystream import KEY_BYTES, Keystream
from mpi_fnas.privacy import DPParams, PrivacyError
from mpi_fnas.privacy.release import Release
from mpi_fnas.space import DARTS_V2, SearchNetwork, search_space

ALPHA = 1e-4  # the suite's level for statistical checks of exact distributions

# NIST SP 800-38A, F.5.5 CTR-AES256.Encrypt: key, initial counter block, first plaintext and ciphertext blocks.
NIST_KEY = bytes.fromhex("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")
NIST_COUNTER = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff")
NIST_PLAIN = bytes.fromhex("6bc1bee22e409f96e93d7e117393172aae2d8a571e03ac9c9eb76fac45af8e51")
NIST_CIPHER = bytes.fromhex("601ec313775789a5b7a7f504bbf3d228f443e3ca4d62b59aca84e990cacaf5c5")


# -- the stream ----------------------------------------------------------------------------------------------------


def test_the_stream_is_aes_256_ctr_from_its_position():
    """Known answer: the stream at position p is AES-256 of the counter blocks p, p + 1, … (plaintext ⊕ ciphertext
    of the NIST vector), across the 2^128 wrap too."""
    start = int.from_bytes(NIST_COUNTER, "big")
    stream = Keystream(NIST_KEY, secret=False, position=start)
    expected = bytes(p ^ c for p, c in zip(NIST_PLAIN, NIST_CIPHER, strict=True))
    assert stream.random_bytes(32) == expected
    assert stream.position == start + 2
    # The counter runs over all 128 bits: block 2^128 - 1 is followed by block 0.
    last = Keystream(NIST_KEY, secret=False, position=2**128 - 1)
    assert last.random_bytes(32)[16:] == Keystream(NIST_KEY, secret=False, position=0).random_bytes(16)
    assert last.position == 1


def test_draws_consume_whole_blocks_and_the_state_resumes_the_stream():
    whole = Keystream.from_labels("test", 1).random_bytes(64)
    pieces = Keystream.from_labels("test", 1)
    assert pieces.random_bytes(5) == whole[:5]  # the rest of block 0 is skipped
    assert pieces.position == 1 and pieces.random_bytes(16) == whole[16:32]
    saved = pieces.state_dict()
    resumed = Keystream.from_labels("something else")
    resumed.load_state_dict(saved)
    assert resumed.random_bytes(32) == pieces.random_bytes(32) == whole[32:64]
    assert Keystream.from_labels("test", 1).words(0).numel() == 0 and pieces.random_bytes(0) == b""


def test_keys_labels_and_repr():
    again = Keystream.from_labels("party", 0, 1).random_bytes(32)
    assert Keystream.from_labels("party", 0, 1).random_bytes(32) == again
    labels = (("party", 0, 1), ("party", 1, 0), ("party", 0, 10), ("party", 1), ("party", "0", 1), ("party", 0))
    assert len({Keystream.from_labels(*label).random_bytes(16) for label in labels}) == len(labels)
    secret = Keystream.from_os()
    assert secret.secret and not Keystream.from_labels("x").secret
    key = secret.state_dict()["key"]
    assert len(key) == KEY_BYTES and key.hex() not in repr(secret) and repr(key) not in repr(secret)
    with pytest.raises(ValueError, match="32 bytes"):
        Keystream(b"short", secret=True)


def test_uniforms_are_on_the_53_bit_grid_and_uniform():
    u = Keystream.from_labels("test", 2).uniform((500, 400))
    assert u.shape == (500, 400) and u.dtype == torch.float64
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    k = u * 2.0**53
    assert torch.equal(k, k.floor())  # exactly k · 2^-53
    assert stats.kstest(u.flatten()[:50_000].numpy(), "uniform").pvalue > ALPHA


@pytest.mark.parametrize("high", [2, 3, 7, 33, 2**52 + 1])
def test_integers_are_exactly_uniform_below_their_bound(high):
    """2^52 + 1 rejects almost half of its 53-bit draws: the redraw loop runs, and every value is still in range."""
    values = Keystream.from_labels("test", high).integers(high, (60_000,))
    assert values.dtype == torch.int64 and int(values.min()) >= 0 and int(values.max()) < high
    if high <= 33:
        counts = torch.bincount(values, minlength=high).numpy()
        assert stats.chisquare(counts).pvalue > ALPHA
    else:
        assert stats.kstest(values.double().numpy() / high, "uniform").pvalue > ALPHA


def test_integers_take_one_bound_per_value():
    highs = torch.tensor([[1, 2], [3, 1000]])
    values = Keystream.from_labels("test", 3).integers(highs)
    assert values.shape == (2, 2) and bool((values < highs).all()) and int(values[0, 0]) == 0
    with pytest.raises(ValueError, match="bound"):
        Keystream.from_labels("test").integers(0, 3)


def test_permutations_are_uniform():
    stream = Keystream.from_labels("test", 4)
    counts = Counter(tuple(stream.permutation(4).tolist()) for _ in range(12_000))
    assert len(counts) == 24 and stats.chisquare(list(counts.values())).pvalue > ALPHA
    big = stream.permutation(1000)
    assert sorted(big.tolist()) == list(range(1000)) and big.tolist() != list(range(1000))
    assert stream.permutation(1).tolist() == [0] and stream.permutation(0).numel() == 0


# -- a party's secret streams use all of their OS entropy --------------------------------------------------------


def _party_noise_with_entropy(monkeypatch, entropy: bytes, requested: list[int]) -> torch.Tensor:
    """The first noise draws of a secret party whose OS entropy is `entropy` (os.urandom replaced)."""

    def fake_urandom(n: int) -> bytes:
        requested.append(n)
        assert n <= len(entropy)
        return entropy[:n]

    monkeypatch.setattr(os, "urandom", fake_urandom)
    rng = PartyRandomness.create("secret", seed=0, rank=1)
    monkeypatch.undo()
    return rng.noise.words(64)


def test_a_secret_party_stream_depends_on_every_bit_of_its_os_entropy(monkeypatch):
    """torch's CPU generator keeps 32 bits of a seed, so seeds that differ only above bit 32 gave the same noise,
    and the whole seed space could be searched. Every bit of the key must matter."""
    base = bytes(range(64))
    requested: list[int] = []
    reference = _party_noise_with_entropy(monkeypatch, base, requested)
    assert requested and min(requested) >= 16, f"a key asked the OS for {requested} bytes: fewer than 128 bits"
    for bit in (0, 31, 32, 40, 63, 64, 127, 200, 8 * KEY_BYTES - 1):
        flipped = bytearray(base)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert not torch.equal(_party_noise_with_entropy(monkeypatch, bytes(flipped), []), reference), bit


# -- no seeded generator in a DP party's releases ---------------------------------------------------------------


class SeededGeneratorUsedError(AssertionError):
    pass


def _trap(name: str):
    """A stand-in for `name` that raises when called; a class, so that annotations like ``Generator | None`` that
    torch evaluates on import still work."""

    class Trapped:
        def __new__(cls, *args, **kwargs):
            raise SeededGeneratorUsedError(f"{name} was called during a DP party's release")

    return Trapped


@pytest.fixture
def no_seeded_generators(monkeypatch):
    """Every seeded (non-cryptographic) generator of torch, numpy and Python raises while the test body runs
    (creating a torch.Generator too: the default generator is then the only one left, and its draws are trapped)."""
    for module, names in ((torch, ("rand", "randn", "randint", "randperm", "bernoulli", "normal", "multinomial",
                                   "poisson", "rand_like", "randn_like", "randint_like", "manual_seed", "seed",
                                   "Generator")),
                          (torch.Tensor, ("random_", "uniform_", "normal_", "bernoulli_", "exponential_",
                                          "geometric_", "cauchy_", "log_normal_")),
                          (np.random, ("default_rng", "seed", "rand", "randn", "randint", "random", "choice",
                                       "permutation", "shuffle", "normal", "uniform")),
                          (random, ("random", "randint", "randrange", "choice", "shuffle", "getrandbits", "seed"))):
        for name in names:
            monkeypatch.setattr(module, name, _trap(f"{getattr(module, '__name__', module)}.{name}"))
    yield
    monkeypatch.undo()


def _counting(monkeypatch) -> dict[str, int]:
    """Count the bytes drawn from secret and from public keystreams."""
    drawn = {"secret": 0, "public": 0}
    original = Keystream.random_bytes

    def counted(self, nbytes):
        drawn["secret" if self.secret else "public"] += nbytes
        return original(self, nbytes)

    monkeypatch.setattr(Keystream, "random_bytes", counted)
    return drawn


def _dp_party(stage: str) -> tuple[Party, int]:
    """A DP party of `stage` on 24 random examples (search: 12 + 12 shards; augment: a pool of 16) and the fewest
    secret bytes one iteration draws: 8 per Poisson coin and per noise coordinate."""
    torch.manual_seed(0)
    if stage == "search":
        model = SearchNetwork(channels=4, num_classes=3, layers=3, nodes=2, in_channels=3, norm="groupnorm")
        x, y = torch.randn(24, 3, 8, 8), torch.randint(0, 3, (24,))
        dp = DPParams(noise_multiplier_w=1.0, noise_multiplier_a=1.0, clip_w=1.0, clip_a=0.1, expected_batch_size=4.0)
        party = search_party(model, Shard(x[:12], y[:12]), Shard(x[12:], y[12:]), 4,
                             PartyRandomness.create("secret", seed=0, rank=1), dp=dp)
        return party, 8 * (24 + party.num_w + party.num_a)
    cfg = load_config(None, ["augment.layers=3", "augment.channels=4", "augment.cutout=4",
                             "augment.crop_padding=2", "augment.flip=true"])
    model = search_space("darts").build_augment_network(DARTS_V2, cfg, seed=0, in_channels=3, num_classes=10)
    pool = Shard(torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,)))
    party = augment_party(model, pool, cfg.augment, PartyRandomness.create("secret", seed=0, rank=1, stage="augment"),
                          Release(noise_multiplier=1.0, clip=1.0, expected_batch_size=8.0), "secret")
    model.drop_path_prob = 0.3
    return party, 8 * (len(pool) + party.num_w)


@pytest.mark.parametrize("stage", ["search", "augment"])
def test_a_dp_party_draws_only_from_its_secret_keystreams(stage: str, monkeypatch, request):
    """Coins, noise, and in the augmentation every crop, flip, cutout and drop-path mask: all secret."""
    party, floor = _dp_party(stage)
    masks_drawn = []
    original_uniform = Keystream.uniform

    def recording_uniform(self, shape):
        if self is party.randomness.sampling and isinstance(shape, tuple) and shape[1:] == (1, 1, 1):
            masks_drawn.append(shape[0])  # a drop-path mask of the batch
        return original_uniform(self, shape)

    monkeypatch.setattr(Keystream, "uniform", recording_uniform)
    drawn = _counting(monkeypatch)
    request.getfixturevalue("no_seeded_generators")
    out = party.w_release()
    if party.val is not None:
        party.a_release()
    assert np.isfinite(out).all() and drawn["public"] == 0
    assert drawn["secret"] >= floor
    assert bool(masks_drawn) == (stage == "augment")


def test_a_dp_party_refuses_streams_that_do_not_match_its_plan():
    """A DP plan asks for secret streams; a party handed public ones (keyed from the config) refuses to exist, in
    the search and in the augmentation."""
    model = SearchNetwork(channels=4, num_classes=3, layers=1, nodes=1, in_channels=3, norm="groupnorm")
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))
    dp = DPParams(noise_multiplier_w=1.0, noise_multiplier_a=1.0, clip_w=1.0, clip_a=0.1, expected_batch_size=2.0)
    with pytest.raises(PrivacyError, match="asks for secret randomness"):
        search_party(model, Shard(x[:4], y[:4]), Shard(x[4:], y[4:]), 2,
                     PartyRandomness.create("reproducible", seed=0, rank=1), dp=dp)
    cfg = load_config(None, ["augment.layers=3", "augment.channels=4"])
    network = search_space("darts").build_augment_network(DARTS_V2, cfg, seed=0, in_channels=3, num_classes=3)
    with pytest.raises(PrivacyError, match="asks for secret randomness"):
        augment_party(network, Shard(x, y), cfg.augment,
                      PartyRandomness.create("reproducible", seed=0, rank=1, stage="augment"),
                      Release(noise_multiplier=1.0, clip=1.0, expected_batch_size=2.0), "secret")
