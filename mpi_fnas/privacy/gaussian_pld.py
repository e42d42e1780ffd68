"""dp_accounting's privacy loss distribution (PLD) of the Poisson-subsampled Gaussian, built with array arithmetic.

``privacy_loss_distribution.from_gaussian_mechanism`` spends ~90 % of its time in one Python loop:
``GaussianPrivacyLoss.get_delta_for_epsilon`` inverts the privacy loss once per point of its ε grid (~10⁴ points
at the default discretisation), through scalar ``math``/``numpy`` calls. :func:`gaussian_pld` builds the same
distribution with that inversion done on the whole grid at once: the same formulas (the subsampled privacy loss
``log(1 + (e^{±ε} − 1)/q)``, the Gaussian's linear inverse, the library's domain checks and its ``isclose``
edges), the rest of the construction the library's own. What it changes is time: ~0.2 s → a few hundredths per
PLD, which every σ calibration pays ~20 times (rank 0's planning at start-up).

The result is the library's to the last bit (tests/test_accountant.py compares δ(ε) on a grid and ε(δ) after
composition, for several σ and q, with ``==``). If a dp_accounting release no longer has the construction helper
used here, :func:`gaussian_pld` falls back to the library's public function: slower, never different. No MPI, no
autograd.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_distribution, privacy_loss_mechanism

_AdjacencyType = privacy_loss_mechanism.AdjacencyType
# The library's construction of one adjacency's PMF from a monotone privacy loss (private, so looked up softly).
_create_pmf = getattr(privacy_loss_distribution, "_create_pld_pmf_from_monotone_privacy_loss", None)


class ArrayGaussianPrivacyLoss(privacy_loss_mechanism.GaussianPrivacyLoss):
    """:class:`GaussianPrivacyLoss` whose ``get_delta_for_epsilon`` inverts the privacy loss on arrays (ADD and
    REMOVE adjacency; anything else, and scalars, go to the library's own method)."""

    def get_delta_for_epsilon(self, epsilon: float | Sequence[float]) -> float | np.ndarray:
        """δ for each ε of `epsilon` (dp_accounting's method, computed on arrays)."""
        if isinstance(epsilon, numbers.Number) or self.adjacency_type not in (_AdjacencyType.ADD,
                                                                              _AdjacencyType.REMOVE):
            return super().get_delta_for_epsilon(epsilon)
        epsilons = np.asarray(epsilon, dtype=float)
        deltas = np.zeros_like(epsilons)
        q = self.sampling_prob
        if self.adjacency_type == _AdjacencyType.ADD:
            # δ = 0 where ε ≥ −log(1 − q) (q < 1); the inverse at ε is the ADD inverse of −log(1 + (e^{−ε} − 1)/q).
            inside = np.full(epsilons.shape, True) if q == 1.0 else epsilons < -math.log1p(-q)
            cutoffs = self.sensitivity + self._inverse_remove(-self._unsubsampled_losses(-epsilons[inside]))
        else:
            # δ = 1 − e^ε where ε ≤ log(1 − q); the inverse at ε is the REMOVE inverse of log(1 + (e^ε − 1)/q).
            inside = np.full(epsilons.shape, True) if q == 1.0 else epsilons > math.log1p(-q)
            deltas[~inside] = -np.expm1(epsilons[~inside])
            cutoffs = self._inverse_remove(self._unsubsampled_losses(epsilons[inside]))
        deltas[inside] = self.mu_upper_cdf(cutoffs) - np.exp(epsilons[inside] + self.mu_lower_log_cdf(cutoffs))
        return np.clip(deltas, 0, 1)

    def _unsubsampled_losses(self, losses: np.ndarray) -> np.ndarray:
        """log(1 + (e^ℓ − 1)/q) for each ℓ (the library's ``log_a_times_exp_b_plus_c(1/q, ℓ, 1 − 1/q)``), and −inf
        where ℓ is close to log(1 − q) (where the library takes the unsubsampled inverse at −inf)."""
        q = self.sampling_prob
        if q == 1.0:
            return losses
        a, c = 1 / q, 1 - 1 / q
        shifted = losses + np.log(a)
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.where(losses == 0, np.log(a + c), shifted + np.log1p(-np.exp(np.log(-c) - shifted)))
        out[np.isclose(losses, math.log(1 - q), rtol=1e-9, atol=0.0)] = -math.inf  # math.isclose's tolerance
        return out

    def _inverse_remove(self, losses: np.ndarray) -> np.ndarray:
        """The Gaussian's REMOVE inverse without subsampling, −s/2 − ℓ·σ²/s, on an array (ADD adds s)."""
        return -0.5 * self.sensitivity - losses * (self._standard_deviation**2) / self.sensitivity


def gaussian_pld(standard_deviation: float, sampling_prob: float,
                 value_discretization_interval: float) -> privacy_loss_distribution.PrivacyLossDistribution:
    """The PLD of one Poisson-subsampled Gaussian release (sensitivity 1, add-or-remove-one, pessimistic,
    connect-the-dots): what ``from_gaussian_mechanism(standard_deviation, sampling_prob=…,
    value_discretization_interval=…, neighboring_relation=ADD_OR_REMOVE_ONE)`` returns."""
    if _create_pmf is None:
        return privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=standard_deviation, value_discretization_interval=value_discretization_interval,
            sampling_prob=sampling_prob, neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)

    def pmf(adjacency: privacy_loss_mechanism.AdjacencyType):
        loss = ArrayGaussianPrivacyLoss(standard_deviation, sampling_prob=sampling_prob, adjacency_type=adjacency)
        return _create_pmf(loss, pessimistic_estimate=True, value_discretization_interval=value_discretization_interval,
                           use_connect_dots=True)

    remove = pmf(_AdjacencyType.REMOVE)
    if sampling_prob == 1.0:
        return privacy_loss_distribution.PrivacyLossDistribution(remove)
    return privacy_loss_distribution.PrivacyLossDistribution(remove, pmf(_AdjacencyType.ADD))


class ArrayPLDAccountant(pld_privacy_accountant.PLDAccountant):
    """dp_accounting's :class:`PLDAccountant` whose Poisson-subsampled Gaussian events (add-or-remove-one) are
    built by :func:`gaussian_pld`; every other event, and everything else, is the library's."""

    def _maybe_compose(self, event: dp_event.DpEvent, count: int, do_compose: bool) -> Any:
        if (isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(event.event, dp_event.GaussianDpEvent)
                and event.sampling_probability > 0 and event.event.noise_multiplier > 0
                and self.neighboring_relation == dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE):
            if do_compose:  # as the library composes it, with the PLD built on arrays
                pld = gaussian_pld(event.event.noise_multiplier, event.sampling_probability,
                                   self._value_discretization_interval)
                self._pld = self._pld.compose(pld.self_compose(count))
            return None
        return super()._maybe_compose(event, count, do_compose)
