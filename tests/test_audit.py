"""Empirical privacy audit: the real release stays under its claimed epsilon; broken releases are caught.

Setting: q = 1, 2 steps, sigma = 3, R = 0.1 (not 1, so that a noise scaled by the wrong bound is visible),
delta = 1e-5, 2000 trials per hypothesis. The claim (about 1.87) comes from the accountant at q = 1.
Roughly 15 s of CPU for the three audits. The secure aggregate is audited the same way (K = 8, 12,000 trials per
hypothesis, vectorised: ~10 s each).
"""

from __future__ import annotations

import math

import pytest

from mpi_fnas.privacy import PrivacyLedger, audit_mechanism, clipped_sum, per_sample_gradients
from mpi_fnas.privacy.audit import AuditDesign, audit_secure_sum, canary_loss, clopper_pearson_upper, epsilon_from_rates
from mpi_fnas.privacy.mechanism import gaussian_noise
from mpi_fnas.privacy.release import Release, SecureSum
from mpi_fnas.secagg.discrete_gaussian import discrete_gaussian

CLIP, SIGMA, STEPS, TRIALS, DELTA = 0.1, 3.0, 2, 2000, 1e-5
MUTANT_TRIALS = 500  # a broken release is caught far above its claim with a quarter of the trials
EXPECTED_BATCH = 4.0  # the audit's default dataset with the canary: 3 ordinary examples + 1


@pytest.fixture(scope="module")
def claimed_epsilon() -> float:
    ledger = PrivacyLedger()
    ledger.step(noise_multiplier=SIGMA, sample_rate=1.0, num_steps=STEPS)
    return ledger.get_epsilon(DELTA)


def audit(release_fn=None, trials: int = TRIALS):
    return audit_mechanism(release_fn, clip_bound=CLIP, noise_multiplier=SIGMA,
                           design=AuditDesign(steps=STEPS, trials=trials, delta=DELTA, seed=0))


def release_without_clipping(model, params, inputs, targets, noise_stream):
    """Broken on purpose: the per-example gradients are summed unclipped."""
    grads = per_sample_gradients(model, params, inputs, targets, canary_loss)
    noise = gaussian_noise(grads.shape[1], std=SIGMA * CLIP, stream=noise_stream)
    return (grads.sum(dim=0) + noise) / EXPECTED_BATCH


def release_with_noise_of_wrong_bound(model, params, inputs, targets, noise_stream):
    """Broken on purpose: clipped to R but the noise is scaled to R / 10 (e.g. R^G = 0.01 used for R^H = 0.1)."""
    grads = per_sample_gradients(model, params, inputs, targets, canary_loss)
    noise = gaussian_noise(grads.shape[1], std=SIGMA * CLIP / 10, stream=noise_stream)
    return (clipped_sum(grads, CLIP) + noise) / EXPECTED_BATCH


def test_real_release_is_consistent_with_its_claim(claimed_epsilon):
    result = audit()  # the real party_release
    assert result.epsilon_lower_bound <= claimed_epsilon
    # Not vacuous: the canary is detected somewhat, just not beyond what the accountant allows.
    assert result.epsilon_lower_bound > 0.0


def test_audit_catches_missing_clipping(claimed_epsilon):
    result = audit(release_without_clipping, trials=MUTANT_TRIALS)
    assert result.epsilon_lower_bound > claimed_epsilon


def test_audit_catches_noise_scaled_by_the_wrong_bound(claimed_epsilon):
    result = audit(release_with_noise_of_wrong_bound, trials=MUTANT_TRIALS)
    assert result.epsilon_lower_bound > claimed_epsilon


def test_clopper_pearson_upper_bound_closed_forms():
    # 0 errors in n: the bound solves (1 - p)^n = alpha.
    assert clopper_pearson_upper(0, 100, 0.05) == pytest.approx(1 - 0.05 ** (1 / 100), rel=1e-9)
    # n errors in n: no information.
    assert clopper_pearson_upper(100, 100, 0.05) == 1.0
    # k errors: above the point estimate k / n.
    assert clopper_pearson_upper(10, 100, 0.05) > 0.10


def test_epsilon_from_rates():
    # FPR 0.01, FNR 0.5: (1 - 0.5) / 0.01 = 50 is the binding ratio.
    assert epsilon_from_rates(0.01, 0.5, 0.0) == pytest.approx(math.log(50))
    assert epsilon_from_rates(0.5, 0.5, 1e-5) == 0.0  # a coin flip proves nothing


# -- secure aggregation: the canary in party 1 of K = 8, seen only through the sum rank 0 opens -------------------
SECURE_PARTIES, SECURE_TRIALS = 8, 12_000


@pytest.fixture(scope="module")
def secure_release() -> Release:
    return Release(SIGMA, CLIP, EXPECTED_BATCH, secure=SecureSum(SECURE_PARTIES, 4))


def secure_claim(release: Release) -> float:
    """ε against the server of STEPS secure releases at q = 1 (2.03: the secure accountant's bound is looser than
    the Gaussian's PLD, 1.87)."""
    return release.secure.accounting.epsilon([(SIGMA, 1.0, STEPS)], DELTA)


def audit_secure(release: Release, noise_fn=discrete_gaussian, trials: int = SECURE_TRIALS, seed: int = 0):
    return audit_secure_sum(release, design=AuditDesign(steps=STEPS, trials=trials, delta=DELTA, seed=seed),
                            noise_fn=noise_fn)


def test_the_secure_aggregate_is_consistent_with_its_claim(secure_release):
    """The real pieces (clip, encoding, noise shares, masks, sum, open), audited twice with independent draws: every
    bound within the claim, and one above 0, so the audit is not vacuous. (One audit's bound is noisy: seeds 0–3
    gave 0.0, 0.56, 0.62 and 0.72 against the claim 2.03.)"""
    bounds = [audit_secure(secure_release, seed=seed).epsilon_lower_bound for seed in (0, 1)]
    assert all(bound <= secure_claim(secure_release) for bound in bounds) and max(bounds) > 0.0


def test_the_secure_audit_catches_a_variance_taken_for_a_std(secure_release):
    """Broken on purpose: each party draws N_Z(0, σ_k) instead of N_Z(0, σ_k²), a noise ~90x too small."""
    def noise_of_std_for_variance(n, local_variance, stream):
        return discrete_gaussian(n, math.isqrt(local_variance), stream)

    result = audit_secure(secure_release, noise_of_std_for_variance, trials=MUTANT_TRIALS)
    assert result.epsilon_lower_bound > secure_claim(secure_release)


def test_the_secure_audit_catches_shares_split_k_times_too_thin(secure_release):
    """Broken on purpose: each party adds 1/K of its share (σ_k²/K), so the sum carries σ/√K: what a party would add
    if the central variance were divided by K twice."""
    def thin_share(n, local_variance, stream):
        return discrete_gaussian(n, local_variance // SECURE_PARTIES, stream)

    result = audit_secure(secure_release, thin_share)
    assert result.epsilon_lower_bound > secure_claim(secure_release)
