"""Privacy accounting: the ledger against independent recomputations (dp_accounting used directly, closed forms).

The "independent" side of every comparison calls dp_accounting or scipy directly, never mpi_fnas helpers.
"""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution
from scipy import stats

from mpi_fnas.privacy import (
    PrivacyLedger,
    calibrate_noise_multiplier,
    default_delta,
    gdp_epsilon,
    party_epsilon,
)
from mpi_fnas.privacy.gaussian_pld import gaussian_pld


def direct_pld_epsilon(steps: list[tuple[float, float, int]], delta: float, interval: float = 1e-4) -> float:
    """dp_accounting's own PLD accountant over (sigma, q, count) segments, composed in order."""
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
    for sigma, q, count in steps:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count)
    return accountant.get_epsilon(delta)


def closed_form_mu(q: float, steps: int, sigma: float) -> float:
    return q * math.sqrt(steps * (math.exp(1.0 / sigma**2) - 1.0))


def test_issue_sanity_numbers_gdp_407_pld_426():
    """N_k = 6250, B = 64, 50 epochs, sigma = 1, delta = 1e-5: T = ceil(50 N / B) = 4883 reproduces both."""
    n, batch, epochs = 6250, 64, 50
    steps = math.ceil(epochs * n / batch)
    assert steps == 4883
    ledger = PrivacyLedger()
    ledger.step(noise_multiplier=1.0, sample_rate=batch / n, num_steps=steps)
    assert ledger.mu_gdp() == pytest.approx(closed_form_mu(batch / n, steps, 1.0), rel=1e-12)
    assert round(gdp_epsilon(ledger.mu_gdp(), 1e-5), 2) == 4.07
    assert round(ledger.get_epsilon(1e-5), 2) == 4.26
    assert ledger.get_epsilon(1e-5) > gdp_epsilon(ledger.mu_gdp(), 1e-5)  # the CLT figure under-states the guarantee


def test_ledger_matches_dp_accounting_homogeneous():
    ledger = PrivacyLedger()
    for _ in range(3):
        ledger.step(noise_multiplier=1.1, sample_rate=0.02, num_steps=100)
    ledger.step(noise_multiplier=1.1, sample_rate=0.02)
    assert ledger.steps == 301
    expected = direct_pld_epsilon([(1.1, 0.02, 301)], 1e-5)
    assert ledger.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-6)
    assert ledger.mu_gdp() == pytest.approx(closed_form_mu(0.02, 301, 1.1), rel=1e-12)


def test_ledger_matches_dp_accounting_heterogeneous():
    segments = [(1.0, 0.01, 150), (2.0, 0.05, 40), (1.0, 0.01, 50), (0.8, 0.002, 300)]
    interval = 1e-3  # a coarser grid than the default keeps this test fast; the comparison is like for like
    ledger = PrivacyLedger(value_discretization_interval=interval)
    for sigma, q, count in segments:
        ledger.step(noise_multiplier=sigma, sample_rate=q, num_steps=count)
    for delta in (1e-5, 1e-3):
        assert ledger.get_epsilon(delta) == pytest.approx(direct_pld_epsilon(segments, delta, interval), rel=1e-6)
    # Heterogeneous GDP: mu^2 adds over steps (reduces to Theorem 3.1 for equal steps).
    expected_mu = math.sqrt(sum(closed_form_mu(q, c, s) ** 2 for s, q, c in segments))
    assert ledger.mu_gdp() == pytest.approx(expected_mu, rel=1e-12)


def test_gdp_epsilon_solves_the_exact_conversion():
    for mu in (0.1, 0.5, 0.94, 2.0, 5.0):
        for delta in (1e-5, 1e-3):
            eps = gdp_epsilon(mu, delta)

            def delta_of(e: float, mu: float = mu) -> float:
                return stats.norm.cdf(-e / mu + mu / 2) - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2)

            assert delta_of(eps) == pytest.approx(delta, rel=1e-6)
            # mu-GDP is exactly the Gaussian mechanism with sensitivity 1 and std 1/mu (Balle & Wang's analysis).
            assert eps == pytest.approx(dp_accounting.get_epsilon_gaussian(1.0 / mu, delta), abs=1e-6)
    assert gdp_epsilon(0.0, 1e-5) == 0.0
    assert gdp_epsilon(1e-4, 0.5) == 0.0  # delta(0) = 2 Phi(mu / 2) - 1 < 0.5: eps = 0 already suffices


def test_full_batch_pld_equals_exact_gdp():
    """At q = 1 there is no subsampling: T Gaussian steps are exactly sqrt(T)/sigma-GDP, so the two must agree."""
    ledger = PrivacyLedger()
    ledger.step(noise_multiplier=3.0, sample_rate=1.0, num_steps=4)
    assert ledger.get_epsilon(1e-5) == pytest.approx(dp_accounting.get_epsilon_gaussian(1.5, 1e-5), abs=1e-3)


def test_calibration_hits_target_epsilon():
    target, delta, q, steps, interval = 2.0, 1e-5, 0.05, 60, 1e-3
    sigma = calibrate_noise_multiplier(target, delta, q, steps, value_discretization_interval=interval)
    achieved = direct_pld_epsilon([(sigma, q, steps)], delta, interval)
    assert achieved <= target  # never over budget
    assert achieved >= target - 0.02  # and not needlessly noisy (sigma tolerance 1e-3)
    assert direct_pld_epsilon([(sigma - 0.01, q, steps)], delta, interval) > target


@pytest.mark.parametrize(("sigma", "q", "interval"),
                         [(0.97, 0.04, 1e-4), (0.25, 0.5, 1e-3), (1.0, 1.0, 1e-3), (3.0, 0.001, 1e-4),
                          (0.6, 0.02, 1e-3)])
def test_array_pld_is_dp_accountings_pld_to_the_last_bit(sigma, q, interval):
    """gaussian_pld runs the library's per-ε inversion on arrays: δ(ε) on a grid, and ε(δ) after composition, are
    the library's exactly."""
    library = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=interval, sampling_prob=q,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    ours = gaussian_pld(sigma, q, interval)
    epsilons = np.linspace(-2.0, 40.0, 4001)
    assert np.array_equal(ours.get_delta_for_epsilon(epsilons), library.get_delta_for_epsilon(epsilons))
    for steps in (1, 50):
        for delta in (1e-5, 1e-3):
            assert (ours.self_compose(steps).get_epsilon_for_delta(delta)
                    == library.self_compose(steps).get_epsilon_for_delta(delta))


def test_calibration_is_dp_accountings_calibration():
    target, delta, q, steps, interval = 2.0, 1e-5, 0.05, 60, 1e-3

    def event(sigma: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)

    library = dp_accounting.calibrate_dp_mechanism(
        lambda: dp_accounting.pld.PLDAccountant(value_discretization_interval=interval), event, target, delta,
        bracket_interval=dp_accounting.LowerEndpointAndGuess(0.0, 1.0), tol=1e-3)
    # Ours composes with numpy.fft's transforms, the library with scipy.fft's (mpi_fnas.privacy.transforms): the
    # same pocketfft, rounded differently, so Brent's method ends 2e-12 apart here.
    assert calibrate_noise_multiplier(target, delta, q, steps,
                                      value_discretization_interval=interval) == pytest.approx(library, rel=1e-9)


def test_state_round_trip_through_json():
    ledger = PrivacyLedger(value_discretization_interval=1e-3)
    ledger.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=200)
    ledger.step(noise_multiplier=1.5, sample_rate=0.02, num_steps=30)
    restored = PrivacyLedger()  # the grid comes from the state
    restored.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.steps == 230
    assert restored.get_epsilon(1e-5) == ledger.get_epsilon(1e-5)
    assert restored.mu_gdp() == ledger.mu_gdp()
    # Restored ledgers keep counting from where they were.
    restored.step(noise_multiplier=1.5, sample_rate=0.02, num_steps=10)
    assert restored.get_epsilon(1e-5) == pytest.approx(
        direct_pld_epsilon([(1.0, 0.01, 200), (1.5, 0.02, 40)], 1e-5, 1e-3), rel=1e-6
    )
    with pytest.raises(ValueError, match="version"):
        restored.load_state_dict({**ledger.state_dict(), "version": 99})
    with pytest.raises(ValueError):
        restored.load_state_dict({**ledger.state_dict(), "runs": [[1.0, 0.01, -5]]})


def test_empty_and_trivial_ledgers():
    ledger = PrivacyLedger()
    assert ledger.get_epsilon(1e-5) == 0.0 and ledger.mu_gdp() == 0.0
    ledger.step(noise_multiplier=1.0, sample_rate=0.0, num_steps=1000)  # q = 0 never reads the data
    assert ledger.get_epsilon(1e-5) == 0.0
    with pytest.raises(ValueError):
        ledger.step(noise_multiplier=0.0, sample_rate=0.1)
    with pytest.raises(ValueError):
        ledger.step(noise_multiplier=1.0, sample_rate=1.5)


def test_party_epsilon_is_the_larger_ledger():
    train, val = PrivacyLedger(), PrivacyLedger()
    train.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=100)
    val.step(noise_multiplier=1.0, sample_rate=0.02, num_steps=100)
    assert party_epsilon(train, val, 1e-5) == val.get_epsilon(1e-5) > train.get_epsilon(1e-5)


def test_default_delta_is_min_of_1e5_and_a_tenth_of_1_over_n():
    assert default_delta(6250) == 1e-5  # the paper's shard size: 1e-5 binds
    assert default_delta(10_000) == 1e-5
    assert default_delta(20_000) == pytest.approx(5e-6)  # 1 / (10 N) binds from N = 10^4
    assert default_delta(1_000_000) == pytest.approx(1e-7)
    for n in (1, 7, 6250, 123_457, 10**8):
        assert default_delta(n) * n <= 0.1 + 1e-12  # never the old exactly-1/N
    with pytest.raises(ValueError):
        default_delta(0)
