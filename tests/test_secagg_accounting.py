"""The secure path's accountant (mpi_fnas.secagg.accounting): its two bounds against Rényi divergences computed
numerically from the exact distributions, and its sanity checks against the continuous Gaussian."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import special

from mpi_fnas.secagg.accounting import (
    RDP_ORDERS,
    SecureCharge,
    SummedDiscreteGaussian,
    composed_rdp,
    epsilon,
    poisson_subsampled_rdp,
)
from mpi_fnas.secagg.encoding import sensitivity

SUPPORT = 60  # the 1-D distributions below live on [−SUPPORT, SUPPORT]; their mass beyond is below 1e-300


def log_discrete_gaussian(variance: float) -> np.ndarray:
    """log P(x) of N_Z(0, σ²) on x = −SUPPORT..SUPPORT (normalised on it)."""
    x = np.arange(-SUPPORT, SUPPORT + 1, dtype=np.float64)
    logits = -x * x / (2.0 * variance)
    return logits - special.logsumexp(logits)


def log_sum_of(parties: int, variance: float) -> np.ndarray:
    """log P of the sum of `parties` i.i.d. N_Z(0, σ²), by convolution in log space, on the same support."""
    one = log_discrete_gaussian(variance)
    total = one
    for _ in range(parties - 1):
        width = 2 * SUPPORT + 1
        out = np.full(width, -np.inf)
        for z in range(width):  # (a * b)[z] = Σ_x a[x] b[z − x], indices centred on SUPPORT
            lo, hi = max(0, z - SUPPORT), min(width, z + SUPPORT + 1)
            x = np.arange(lo, hi)
            out[z] = special.logsumexp(total[x] + one[z - x + SUPPORT])
        total = out - special.logsumexp(out)
    return total


def renyi(log_p: np.ndarray, log_q: np.ndarray, order: int) -> float:
    """D_α(P ‖ Q) = 1/(α−1)·log Σ P^α Q^(1−α), in log space, over the points both give mass (a shift pushes
    less than 1e-300 of it off the support, where the terms decay as fast as the distributions)."""
    both = np.isfinite(log_p) & np.isfinite(log_q)
    return float(special.logsumexp(order * log_p[both] + (1 - order) * log_q[both])) / (order - 1)


def shifted(log_p: np.ndarray, shift: int) -> np.ndarray:
    """log P(x − shift): the distribution moved by `shift` (the mass pushed off the support is negligible)."""
    out = np.full_like(log_p, -np.inf)
    out[shift:] = log_p[: len(log_p) - shift]
    return out


@pytest.mark.parametrize(("parties", "variance", "shift"), [(2, 0.3, 1), (3, 0.3, 2), (2, 0.6, 1), (4, 1.0, 3)])
def test_sum_of_discrete_gaussians_bound_holds_numerically(parties: int, variance: float, shift: int) -> None:
    """KLS21's bound is above the exact D_α of the summed noise shifted by Δ (1-D: Δ₁ = Δ₂ = |Δ|), in both
    directions; and at σ² = 0.3 the exact divergence exceeds the continuous Gaussian's α·Δ²/(2nσ²), so the τ term
    is needed (a bound without it fails this test)."""
    log_p = log_sum_of(parties, variance)
    bound = SummedDiscreteGaussian(shift, shift, 1, variance, parties)
    exceeds_gaussian = False
    for order in range(2, 21):
        exact = max(renyi(shifted(log_p, shift), log_p, order), renyi(log_p, shifted(log_p, shift), order))
        assert exact <= bound.rdp(order) + 1e-12, (order, exact, bound.rdp(order))
        exceeds_gaussian |= exact > order * shift**2 / (2 * parties * variance) * (1 + 1e-9)
    if variance < 0.5:
        assert exceeds_gaussian


def test_one_discrete_gaussian_is_never_worse_than_the_continuous_one() -> None:
    """n = 1: τ = 0 and the bound is the Gaussian's α·Δ²/(2σ²) (CKS20), which the exact divergence meets."""
    variance = 0.8
    log_p = log_discrete_gaussian(variance)
    bound = SummedDiscreteGaussian(2, 2, 1, variance, 1)
    assert bound.tau == 0
    for order in (2, 5, 10):
        assert bound.rdp(order) == pytest.approx(order * 4 / (2 * variance))
        assert renyi(shifted(log_p, 2), log_p, order) <= bound.rdp(order) + 1e-12


@pytest.mark.parametrize(("parties", "variance", "rate"), [(1, 0.5, 0.1), (2, 0.4, 0.3), (1, 2.0, 0.02), (3, 0.3, 0.6)])
def test_poisson_subsampled_bound_holds_numerically(parties: int, variance: float, rate: float) -> None:
    """The subsampled bound is above the exact D_α between the Poisson mixture (1−q)·Q + q·P and Q, in both
    directions (add and remove), P the noise shifted by one record (Δ = 1); and the add direction is never the
    larger one (the symmetric pair of step 2)."""
    log_q = log_sum_of(parties, variance)
    log_p = shifted(log_q, 1)
    log_mix = np.logaddexp(math.log1p(-rate) + log_q, math.log(rate) + log_p)
    mechanism = SummedDiscreteGaussian(1, 1, 1, variance, parties)
    for order in (2, 3, 4, 8, 16, 32):
        remove, add = renyi(log_mix, log_q, order), renyi(log_q, log_mix, order)
        bound = poisson_subsampled_rdp(order, rate, mechanism)
        assert max(remove, add) <= bound + 1e-12, (order, remove, add, bound)
        assert add <= remove + 1e-12, (order, remove, add)
        assert bound < mechanism.rdp(order)  # sampling amplifies


def test_poisson_subsampled_bound_holds_on_a_two_dimensional_lattice() -> None:
    """The same in D = 2, where the shift (2, 1) is no multiple of a lattice axis: the symmetry argument is the
    lattice's (x ↦ v − x), not a 1-D one. The summed noise is the product of its coordinates' 1-D sums."""
    parties, variance, rate, shift = 2, 0.4, 0.3, (2, 1)
    one = log_sum_of(parties, variance)
    log_q = one[:, None] + one[None, :]
    log_p = shifted(shifted(log_q, shift[0]).T, shift[1]).T
    log_mix = np.logaddexp(math.log1p(-rate) + log_q, math.log(rate) + log_p)
    mechanism = SummedDiscreteGaussian.of_record(math.hypot(*shift), 2, variance, parties)
    assert mechanism.l1_sensitivity >= sum(shift)
    for order in (2, 3, 4, 8, 16):
        remove, add = renyi(log_mix.ravel(), log_q.ravel(), order), renyi(log_q.ravel(), log_mix.ravel(), order)
        assert add <= remove + 1e-12, (order, remove, add)
        assert remove <= poisson_subsampled_rdp(order, rate, mechanism) + 1e-12


def test_an_asymmetric_pair_can_make_the_add_direction_the_larger() -> None:
    """Why step 2 needs the symmetry: for two-point distributions P = (½, ½), Q = (0.01, 0.99) the add direction
    D_α(P ‖ (1−q)·P + q·Q) exceeds the remove one, so a bound on the remove direction alone would not hold."""
    log_p, log_q, rate = np.log([0.5, 0.5]), np.log([0.01, 0.99]), 0.5
    log_mix = np.logaddexp(math.log1p(-rate) + log_p, math.log(rate) + log_q)
    assert renyi(log_p, log_mix, 2) > 1.2 * renyi(log_mix, log_p, 2)


def test_one_party_without_rounding_is_the_subsampled_gaussian_exactly() -> None:
    """n = 1 and Δ = 1 in clip units: ε(ℓ) = ℓ/(2σ²) and the curve is the Poisson-subsampled Gaussian's RDP at
    integer orders (Mironov, Talwar & Zhang 2019) as dp_accounting computes it, to rounding: the bound is tight
    there (Zhu & Wang's general bound, coefficients 3, is up to 2.7× above it at these settings)."""
    from dp_accounting.rdp.rdp_privacy_accountant import _compute_rdp_poisson_subsampled_gaussian

    for sigma, rate in ((1.0, 0.01), (2.0, 0.125), (0.8, 0.5)):
        mechanism = SummedDiscreteGaussian(1.0, 1.0, 1, sigma**2, 1)
        ours = [poisson_subsampled_rdp(order, rate, mechanism) for order in (2, 3, 8, 32, 128)]
        theirs = _compute_rdp_poisson_subsampled_gaussian(rate, sigma, [2, 3, 8, 32, 128])
        np.testing.assert_allclose(ours, theirs, rtol=1e-9)


def test_subsampling_edges_and_refusals() -> None:
    mechanism = SummedDiscreteGaussian(1, 1, 1, 1.0, 3)
    assert poisson_subsampled_rdp(4, 0.0, mechanism) == 0.0
    assert poisson_subsampled_rdp(4, 1.0, mechanism) == mechanism.rdp(4)
    with pytest.raises(ValueError, match="integer order"):
        poisson_subsampled_rdp(2.5, 0.1, mechanism)
    with pytest.raises(ValueError, match="rate"):
        poisson_subsampled_rdp(2, 1.5, mechanism)
    with pytest.raises(ValueError, match="> 0"):
        SummedDiscreteGaussian(1, 1, 1, 0.0, 3)
    assert epsilon(np.zeros(len(RDP_ORDERS)), 1e-5) == 0.0


# The sanity case of mpi_fnas.privacy.shard_ledger, shortened: q = 0.01024, σ = 1, δ = 1e-5.
RATE, SIGMA, DELTA, STEPS, PARTIES, DIMENSION = 0.01024, 1.0, 1e-5, 500, 8, 32768


def secure_epsilon(units_per_clip: float, parties: int = PARTIES, noisy: int | None = None) -> float:
    """ε against an observer of the sum, each party adding 1/K of the central variance (σ·c/γ)² in integer units,
    c/γ = `units_per_clip`; `noisy`: the parties whose noise the observer cannot subtract (default all)."""
    release = SummedDiscreteGaussian.of_record(sensitivity(units_per_clip, DIMENSION), DIMENSION,
                                               (SIGMA * units_per_clip) ** 2 / parties, noisy or parties)
    return epsilon(composed_rdp([SecureCharge(release, RATE, STEPS)]), DELTA)


def continuous_epsilon_same_bound() -> float:
    """The same accountant on the continuous Gaussian (Δ₂ = c/γ exactly, one noise: τ = 0): the fine limit."""
    release = SummedDiscreteGaussian(1.0, 1.0, DIMENSION, SIGMA**2, 1)
    return epsilon(composed_rdp([SecureCharge(release, RATE, STEPS)]), DELTA)


def continuous_pld_epsilon() -> float:
    import dp_accounting

    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(RATE, dp_accounting.GaussianDpEvent(SIGMA)), STEPS)
    return accountant.get_epsilon(DELTA)


def test_fine_discretisation_approaches_the_continuous_gaussian_from_above() -> None:
    """As c/γ grows, ε falls monotonically towards the same bound's continuous value, and is never below the
    continuous mechanism's PLD ε (the tight truth for the central Gaussian)."""
    coarse_to_fine = [secure_epsilon(units) for units in (30, 100, 1000, 10_000, 1_000_000)]
    limit, pld = continuous_epsilon_same_bound(), continuous_pld_epsilon()
    assert all(a > b for a, b in itertools.pairwise(coarse_to_fine))
    assert all(eps >= limit >= pld for eps in coarse_to_fine)
    assert coarse_to_fine[-1] == pytest.approx(limit, rel=1e-3)
    assert coarse_to_fine[0] > 1.2 * limit  # coarse rounding costs visibly: the test sees the discretisation


def test_one_party_matches_the_local_mechanism_within_the_rounding_term() -> None:
    """K = 1: the release is one discrete Gaussian; its unsampled RDP exceeds the continuous one by exactly the
    rounding's factor (Δ₂ / (c/γ))², and its composed ε is the continuous Gaussian's at σ shrunk by that term,
    Δ₂ / (c/γ) = 1 + √D·γ/c: above the continuous ε, the rounding's term its only excess."""
    units = 1000.0
    inflation = (sensitivity(units, DIMENSION) / units) ** 2
    release = SummedDiscreteGaussian.of_record(sensitivity(units, DIMENSION), DIMENSION, (SIGMA * units) ** 2, 1)
    assert release.rdp(7) == pytest.approx(7 / (2 * SIGMA**2) * inflation, rel=1e-12)
    shrunk = SummedDiscreteGaussian(1.0, 1.0, DIMENSION, SIGMA**2 / inflation, 1)
    one_party, limit = secure_epsilon(units, parties=1), continuous_epsilon_same_bound()
    assert limit < one_party == pytest.approx(epsilon(composed_rdp([SecureCharge(shrunk, RATE, STEPS)]), DELTA),
                                              rel=1e-9)


def test_collusion_leaves_the_noise_of_the_others() -> None:
    """ε rises as colluders subtract their noise; with t = K − 1 it is one party's discrete Gaussian with 1/K of
    the central variance: the local mechanism with 1/K of the noise."""
    units = 1000.0
    against_server = secure_epsilon(units)
    colluding = [secure_epsilon(units, noisy=PARTIES - t) for t in (1, 4, PARTIES - 1)]
    assert against_server < colluding[0] < colluding[1] < colluding[2]
    local_with_share = SummedDiscreteGaussian.of_record(
        sensitivity(units, DIMENSION), DIMENSION,
        (SIGMA * units) ** 2 / PARTIES, 1)
    assert colluding[2] == epsilon(composed_rdp([SecureCharge(local_with_share, RATE, STEPS)]), DELTA)


def test_the_guarantee_with_colluders_is_the_accountant_default() -> None:
    """``privacy.colluders`` t: the accountant's ε (what the log, the caps and the party's own ledger use) is the
    one with t colluders; the server alone (0) and K − 1 stay available by name."""
    from mpi_fnas.privacy.shard_ledger import PrivacyLedger
    from mpi_fnas.secagg.accounting import SecureAccounting

    runs = [(1.2, 0.05, 40)]
    alone = SecureAccounting(PARTIES, 4096, 1024)
    for t in (1, PARTIES // 2, PARTIES - 1):
        with_t = SecureAccounting(PARTIES, 4096, 1024, colluders=t)
        assert with_t.epsilon(runs, DELTA) == alone.epsilon(runs, DELTA, colluders=t) > alone.epsilon(runs, DELTA)
        ledger = PrivacyLedger.from_runs(runs, secure=with_t)
        assert ledger.get_epsilon(DELTA) == with_t.epsilon(runs, DELTA)
        assert ledger.get_epsilon_server(DELTA) == alone.epsilon(runs, DELTA)
        assert ledger.get_epsilon_collusion(DELTA) == alone.epsilon(runs, DELTA, colluders=PARTIES - 1)
