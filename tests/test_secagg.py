"""The building blocks of secure aggregation (mpi_fnas/secagg): the exact discrete Gaussian, the integer encoding
and its decoding, the pairwise masks, and a secure release made through :class:`~mpi_fnas.privacy.release.Release`
and opened as rank 0 opens it. The MPI Reduce that sums the uploads is checked in tests/mpi/test_comm.py.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from mpi_fnas.keystream import Keystream
from mpi_fnas.privacy.clipping import clipped_sum
from mpi_fnas.privacy.per_sample import per_sample_gradients
from mpi_fnas.privacy.release import Release, SecureSum
from mpi_fnas.secagg.discrete_gaussian import bernoulli_exp, discrete_gaussian, discrete_laplace
from mpi_fnas.secagg.encoding import (
    Encoding,
    decode,
    encode_sum,
    hadamard,
    padded_length,
    rotate,
    rotation_signs,
    sensitivity,
    unrotate,
    wrap,
)
from mpi_fnas.secagg.masks import PairwiseMasks, launch_id
from mpi_fnas.secagg.series import SecureSeries


def chi_square_p(samples: torch.Tensor, pmf: dict[int, float]) -> float:
    """p-value of Pearson's test of `samples` against `pmf` (support values with expected count < 5 pooled)."""
    values, counts = np.unique(samples.numpy(), return_counts=True)
    observed = dict(zip(values.tolist(), counts.tolist(), strict=True))
    n = len(samples)
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for y, p in pmf.items():
        if n * p >= 5:
            cells.append((observed.get(y, 0), n * p))
        else:
            pooled_obs, pooled_exp = pooled_obs + observed.get(y, 0), pooled_exp + n * p
    pooled_obs += n - sum(observed.get(y, 0) for y in pmf)  # anything outside the listed support
    cells.append((pooled_obs, pooled_exp + n * (1 - sum(pmf.values()))))
    obs, exp = np.array([c[0] for c in cells], float), np.array([c[1] for c in cells], float)
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def gaussian_pmf(variance: float, width: int) -> dict[int, float]:
    weights = {y: math.exp(-y * y / (2 * variance)) for y in range(-width, width + 1)}
    total = sum(weights.values())
    return {y: w / total for y, w in weights.items()}


@pytest.mark.parametrize("variance", [Fraction(1, 4), 4, Fraction(9, 4), 30])
def test_discrete_gaussian_follows_its_pmf(variance):
    """Pearson's test against the exact N_Z(0, σ²) mass (threshold 1e-4: a sound sampler fails 1 run in 10^4)."""
    samples = discrete_gaussian(100_000, variance, Keystream.from_labels("test", "dg", str(variance)))
    assert chi_square_p(samples, gaussian_pmf(float(variance), 60)) > 1e-4


def test_discrete_laplace_follows_its_pmf():
    weights = {y: math.exp(-abs(y) / 3) for y in range(-80, 81)}
    total = sum(weights.values())
    samples = discrete_laplace(100_000, 3, Keystream.from_labels("test", "dlap"))
    assert chi_square_p(samples, {y: w / total for y, w in weights.items()}) > 1e-4


@pytest.mark.parametrize(("numerator", "denominator"), [(0, 1), (1, 3), (1, 1), (7, 2), (13, 5)])
def test_bernoulli_exp_has_probability_exp_minus_gamma(numerator, denominator):
    n = 200_000
    hits = int(bernoulli_exp(torch.full((n,), numerator), denominator, Keystream.from_labels("b", numerator)).sum())
    p = math.exp(-numerator / denominator)
    assert stats.binomtest(hits, n, p).pvalue > 1e-4


def test_discrete_gaussian_refuses_what_it_cannot_draw_exactly():
    with pytest.raises(ValueError, match="too large"):
        discrete_gaussian(3, 10_000**2, Keystream.from_labels("x"))
    with pytest.raises(ValueError, match="> 0"):
        discrete_gaussian(3, 0, Keystream.from_labels("x"))


@pytest.mark.parametrize("dim", [1, 2, 64, 128, 2**13])  # 128: two Kronecker factors (6 + 1 bits); 2^13: three
def test_hadamard_is_the_sylvester_matrix_orthonormal_and_its_own_inverse(dim):
    x = torch.randn(4, dim, dtype=torch.float64)
    y = hadamard(x)
    if dim <= 128:  # against the matrix built by its definition, H[i, j] = (-1)^popcount(i & j) / √D
        index = torch.arange(dim)
        signs = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in index.tolist()] for i in index.tolist()],
                             dtype=torch.float64)
        torch.testing.assert_close(y, x @ signs.T / math.sqrt(dim))
    torch.testing.assert_close(y.norm(dim=1), x.norm(dim=1))
    torch.testing.assert_close(hadamard(y), x)


def test_a_long_release_is_padded_to_whole_blocks_and_rotated_block_by_block():
    assert [padded_length(d) for d in (1, 80, 4096, 4097, 77_906)] == [1, 128, 4096, 8192, 81_920]
    dim = padded_length(77_906)
    x = torch.zeros(3, dim, dtype=torch.float64)
    x[:, :77_906] = torch.randn(3, 77_906, dtype=torch.float64)
    signs = rotation_signs(77_906, "run", "search", "W", 1)
    y = rotate(x, signs)
    torch.testing.assert_close(y.norm(dim=1), x.norm(dim=1))  # orthonormal
    torch.testing.assert_close(unrotate(y, signs), x)
    # Block-diagonal: a vector inside one block stays inside it, spread evenly over its 4096 coordinates.
    spike = torch.zeros(dim, dtype=torch.float64)
    spike[5000] = 1.0
    spread = rotate(spike, signs)
    assert torch.count_nonzero(spread[:4096]) == 0 and torch.count_nonzero(spread[8192:]) == 0
    torch.testing.assert_close(spread[4096:8192].abs(), torch.full((4096,), 1 / 64, dtype=torch.float64))


def parties_encode(encoding: Encoding, signs: torch.Tensor, parties: int, batch: int, seed: int):
    """Each party's clipped examples (b, d) and its integer encoding (D,)."""
    gen = torch.Generator().manual_seed(seed)
    grads, encoded = [], []
    for k in range(parties):
        g = torch.randn(batch, encoding.dimension, generator=gen, dtype=torch.float64)
        g = g * (encoding.clip / g.norm(dim=1, keepdim=True)) * torch.rand(batch, 1, generator=gen, dtype=torch.float64)
        grads.append(g)
        encoded.append(encode_sum(g.sum(dim=0), encoding, signs, Keystream.from_labels("round", seed, k)))
    return grads, encoded


def test_decode_error_stays_within_the_rounding_bound():
    """Σ_k decode error ≤ γ·√(K·D/4): each party's rounding of its sum is unbiased with variance ≤ 1/4 per
    coordinate, and the rotation keeps norms. A biased rounding (floor) breaks it by far."""
    encoding = Encoding(dimension=1000, clip=1.0, scale=1 / 300)
    signs = rotation_signs(encoding.dimension, "run", "search", 1, "W")
    grads, encoded = parties_encode(encoding, signs, parties=4, batch=8, seed=0)
    total = np.zeros(encoding.padded, dtype=np.uint32)
    for z in encoded:
        total += wrap(z, encoding.bits)
    error = float((decode(total, encoding, signs) - sum(g.sum(0) for g in grads)).norm())
    assert error <= encoding.scale * math.sqrt(4 * encoding.padded / 4)
    assert error > 0  # it does round


def test_neighbouring_sums_encode_within_the_sensitivity_and_beyond_the_clip_alone():
    """Two sums one example apart (‖S − S′‖₂ = c), encoded with the same coins, land at most Δ₂ = c/γ + √D apart
    (the accountant's sensitivity); and the rounding's √D is needed: with the difference spread thin over D
    coordinates the encodings are often more than c/γ apart."""
    encoding = Encoding(dimension=256, clip=1.0, scale=1 / 4)
    signs = rotation_signs(encoding.dimension, "run", "search", 1, "W")
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(encoding.dimension, generator=gen, dtype=torch.float64) * 3
    example = torch.randn(encoding.dimension, generator=gen, dtype=torch.float64)
    example *= encoding.clip / example.norm()
    gaps = []
    for draw in range(200):
        with_example, without = (encode_sum(s, encoding, signs, Keystream.from_labels("coins", draw))
                                 for s in (base + example, base))
        gaps.append(float((with_example - without).to(torch.float64).norm()))
    assert max(gaps) <= encoding.sensitivity == sensitivity(4.0, 256)
    assert min(gaps) > encoding.clip / encoding.scale  # c/γ alone would not bound it


def agreed_masks(parties: int, run_id: bytes | None = b"run-1") -> list[PairwiseMasks]:
    masks = [PairwiseMasks(rank, run_id) for rank in range(1, parties + 1)]
    public = {m.rank: m.public_key for m in masks}
    for m in masks:
        m.agree(public, parties=parties)
    return masks


def test_masks_cancel_exactly_and_the_decoded_sum_is_the_unmasked_one():
    encoding = Encoding(dimension=300, clip=1.0, scale=1 / 500, bits=20)
    signs = rotation_signs(encoding.dimension, "run", "augment", 7, "W")
    _, encoded = parties_encode(encoding, signs, parties=5, batch=3, seed=1)
    masks = agreed_masks(5)
    masked = np.zeros(encoding.padded, dtype=np.uint32)
    plain = np.zeros(encoding.padded, dtype=np.uint32)
    for m, z in zip(masks, encoded, strict=True):
        upload = wrap(z, encoding.bits) + m.mask(encoding.padded, stage="augment", step=7, release="W")
        masked += upload
        plain += wrap(z, encoding.bits)
    np.testing.assert_array_equal(masked % (1 << encoding.bits), plain % (1 << encoding.bits))
    torch.testing.assert_close(decode(masked, encoding, signs), decode(plain, encoding, signs), rtol=0, atol=0)


def test_a_single_upload_is_indistinguishable_from_uniform():
    """A party's masked upload of a constant encoding: its bytes and its low bits pass Pearson's test for uniformity
    over 2^16 coordinates (the encoding alone would fail at once)."""
    masks = agreed_masks(3)
    n = 1 << 16
    upload = np.full(n, 5, dtype=np.uint32) + masks[1].mask(n, stage="search", step=2, release="A")
    for values, cells in ((upload >> 24, 256), (upload & 0xFF, 256), (upload & 1, 2)):
        counts = np.bincount(values.astype(np.int64), minlength=cells)
        assert stats.chisquare(counts).pvalue > 1e-4


def test_masks_never_repeat_across_steps_stages_releases_or_runs():
    a = agreed_masks(2)
    base = a[0].mask(64, stage="search", step=1, release="W")
    for other in (a[0].mask(64, stage="search", step=2, release="W"),
                  a[0].mask(64, stage="augment", step=1, release="W"),
                  a[0].mask(64, stage="search", step=1, release="A"),
                  agreed_masks(2)[0].mask(64, stage="search", step=1, release="W")):
        assert not np.array_equal(base, other)


def test_agreement_refuses_a_key_set_without_its_own_key():
    m = agreed_masks(2)[0]
    with pytest.raises(ValueError, match="own public key"):
        m.agree({1: bytes(32), 2: bytes(32)}, parties=2)


def test_a_launch_id_is_shared_and_fresh_with_fresh_keys():
    masks = agreed_masks(3, run_id=None)
    assert len({m.run_id for m in masks}) == 1
    assert masks[0].run_id == launch_id({m.rank: m.public_key for m in masks})
    assert agreed_masks(3, run_id=None)[0].run_id != masks[0].run_id


def test_secure_releases_carry_the_central_noise_where_local_ones_carry_sqrt_k_times_it():
    """K parties release the clipped gradient sum of the same 32 examples (q = 1, so the exact sum is known). The
    secure path's opened sum × B differs from K × the exact sum by noise of std σ·c per coordinate (the central
    mechanism's); the sum of K local releases by √K·σ·c. Each masked upload alone is not its unmasked words."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64))
    params = dict(model.named_parameters())
    x, y = torch.randn(32, 64), torch.randint(0, 64, (32,))
    parties, sigma, clip, batch = 4, 1.0, 1.0, 32.0
    exact = clipped_sum(per_sample_gradients(model, params, x, y), clip).double() * parties
    dimension = exact.numel()

    def examples(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[indices], y[indices]

    secure = Release(sigma, clip, batch, secure=SecureSum(parties, padded_length(dimension)))
    masks = agreed_masks(parties, run_id=None)
    total = np.zeros(secure.encoding(dimension).padded, dtype=np.uint32)
    for k, m in enumerate(masks):
        series = SecureSeries(m.run_id, "search", "W", secure.encoding(dimension))
        upload = secure.make(model, params, 32, examples, Keystream.from_os(), Keystream.from_os(), series=series,
                             masks=m)
        assert upload.dtype == np.uint32 and series.count == 1
        if k == 0:
            first = upload
        total += upload
    opened = SecureSeries(masks[0].run_id, "search", "W", secure.encoding(dimension)).open(total, batch)
    secure_error = torch.from_numpy(opened).double() * batch - exact
    local = Release(sigma, clip, batch)
    local_sum = sum(local.make(model, params, 32, examples, Keystream.from_os(), Keystream.from_os()).double()
                    for _ in range(parties))
    local_error = local_sum * batch - exact
    assert float(secure_error.std()) == pytest.approx(sigma * clip, rel=0.08)
    assert float(local_error.std()) == pytest.approx(math.sqrt(parties) * sigma * clip, rel=0.08)
    assert abs(float(secure_error.mean())) < 5 * sigma * clip / math.sqrt(dimension)
    # An unmasked total is a few thousand units either side of 0 mod 2^32; a masked upload is uniform.
    assert np.mean((first > 2**20) & (first < 2**32 - 2**20)) > 0.99
    with pytest.raises(ValueError, match="series and pairwise masks"):
        secure.make(model, params, 32, examples, Keystream.from_os(), Keystream.from_os())


def test_an_empty_sum_encodes_to_zeros_and_a_sum_of_another_length_is_refused():
    """A Poisson batch may be empty: its sum's encoding is zeros (the release is its noise alone)."""
    encoding = Encoding(dimension=6, clip=1.0, scale=1 / 100)
    signs = rotation_signs(6, "run", "search", 1, "W")
    stream = Keystream.from_labels("empty")
    assert torch.equal(encode_sum(torch.zeros(6), encoding, signs, stream), torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="the encoding has 6 coordinates"):
        encode_sum(torch.zeros(7), encoding, signs, stream)


def test_a_release_longer_than_the_accounted_dimension_is_refused():
    secure = Release(1.0, 1.0, 8.0, secure=SecureSum(2, 1024))
    assert secure.encoding(1024).padded == 1024
    with pytest.raises(ValueError, match="exceeds the 1024 the run's accountant covers"):
        secure.encoding(1025)
    with pytest.raises(ValueError, match="padded dimension"):
        SecureSum(2, 5000)


def test_an_augment_state_of_the_per_example_encoding_is_refused():
    """A ledger state saved before the sum's encoding (its SecureSum had β and no dimension) described releases
    this version's accountant does not: resuming it is refused in one line, not accounted wrongly."""
    from mpi_fnas.privacy.release import AugmentReleases

    releases = AugmentReleases(1.0, 1.0, 8.0, [0.1], [0.0], steps=3, secure=SecureSum(2, 1024))
    state = releases.state_dict()
    assert AugmentReleases.from_state_dict(state) == releases
    old = {**state, "secure": {"parties": 2, "local_variance": 8000**2, "bits": 32, "beta": 0.6}}
    with pytest.raises(ValueError, match="predates the encoding of the clipped sum"):
        AugmentReleases.from_state_dict(old)
