"""Privacy accounting of a party's releases: one :class:`PrivacyLedger` per (party, dataset).

A party keeps two ledgers: the *train* ledger counts the G_k releases (W gradients on D_k^tr), the *val* ledger
the H_k releases (A gradients on D_k^val). The shards are disjoint, so an individual is in at most one of them and
only that ledger's releases compose on their record (Theorem 3.1's decoupling): the party's epsilon is
``max(train epsilon, val epsilon)`` — :func:`party_epsilon`.

Two numbers per ledger:

* :meth:`PrivacyLedger.get_epsilon` — the guarantee: a rigorous (epsilon, delta) upper bound from the privacy loss
  distribution (PLD) of the Poisson-subsampled Gaussian mechanism composed over the steps, computed by Google's
  ``dp_accounting`` (pessimistic discretisation, add-or-remove-one neighbouring).
* :meth:`PrivacyLedger.mu_gdp` — the paper's Theorem 3.1, ``mu = q sqrt(T (e^{1/sigma^2} - 1))``: the limit of a
  central limit theorem (Bu et al. 2019), not a bound, so :func:`gdp_epsilon` of it can be under the PLD bound. It
  is logged for comparison with the paper, never reported as the guarantee. The sanity case: docs/privacy.md §3.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution
from scipy import optimize, special

from mpi_fnas.privacy.gaussian_pld import ArrayPLDAccountant, gaussian_pld
from mpi_fnas.privacy.transforms import numpy_transforms
from mpi_fnas.secagg.accounting import SecureAccounting

#: dp_accounting's default PLD grid; smaller is tighter and slower. The estimate is pessimistic at any grid.
DEFAULT_VALUE_DISCRETIZATION = 1e-4

_STATE_VERSION = 1


def default_delta(num_examples: int) -> float:
    """The default delta of a dataset of ``num_examples`` examples: ``min(1e-5, 1 / (10 n))``.

    delta must stay well below 1 / n: the mechanism that publishes each record with probability delta is
    (0, delta)-DP and leaks delta * n records in expectation (Dwork & Roth 2014, section 2.3). A tenth of 1 / n
    keeps that expectation at 0.1 for large datasets, where 1e-5 alone would not.
    """
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    return min(1e-5, 0.1 / num_examples)


def party_deltas(train_sizes: Sequence[int], val_sizes: Sequence[int], delta: float | None) -> np.ndarray:
    """(K,) δ per party: the configured ``delta``, refused unless below 1/N_k, or the default per party.

    N_k is the party's larger shard. Each ledger's δ must be below 1 over the size of the shard it covers (the
    mechanism that publishes each record with probability δ is (0, δ)-DP; see ``default_delta``), and one δ
    covers both of a party's ledgers, so the larger shard binds. Raises ValueError, one line naming the party."""
    largest = np.maximum(np.asarray(train_sizes, dtype=np.int64), np.asarray(val_sizes, dtype=np.int64))
    if delta is None:
        return np.array([default_delta(int(n)) for n in largest], dtype=np.float64)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"privacy.delta must be in (0, 1), got {delta:g}")
    for party, n in enumerate(largest.tolist(), start=1):
        if delta * n >= 1.0:
            raise ValueError(f"privacy.delta {delta:g} is not below 1/N_k = {1.0 / n:.3g} for party {party} "
                             f"(N_k = {n}, its larger shard); set a smaller delta, or null for min(1e-5, 1/(10·N_k))")
    return np.full(len(largest), float(delta))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest epsilon such that mu-GDP implies (epsilon, delta)-DP.

    Solves ``delta = Phi(-eps / mu + mu / 2) - e^eps Phi(-eps / mu - mu / 2)`` (Dong, Roth, Su 2019, Corollary 2.13)
    for eps >= 0; the right-hand side decreases in eps. Returns 0 when even eps = 0 meets ``delta``.
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if mu < 0 or math.isnan(mu):
        raise ValueError(f"mu must be >= 0, got {mu}")
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return math.inf

    def delta_of(eps: float) -> float:
        # e^eps Phi(x) in log space: e^eps overflows long before the product does.
        return special.ndtr(-eps / mu + mu / 2) - math.exp(eps + special.log_ndtr(-eps / mu - mu / 2))

    if delta_of(0.0) <= delta:
        return 0.0
    upper = 1.0
    while delta_of(upper) > delta:
        upper *= 2.0
    return float(optimize.brentq(lambda e: delta_of(e) - delta, 0.0, upper, xtol=1e-12, rtol=1e-12))


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION,
    tolerance: float = 1e-3,
) -> float:
    """The smallest noise multiplier (within ``tolerance``) whose PLD epsilon after ``steps`` steps is <= target.

    Uses ``dp_accounting.calibrate_dp_mechanism`` (Brent's method over fresh PLD accountants), which returns a
    value on the feasible side, so the epsilon of the returned sigma never exceeds ``target_epsilon``. The
    accountants build their PLDs on arrays (:class:`~mpi_fnas.privacy.gaussian_pld.ArrayPLDAccountant`: the same
    distributions to the last bit, built faster).
    """
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    _check_step_arguments(1.0, sample_rate, steps)

    def fresh_accountant() -> dp_accounting.PrivacyAccountant:
        return ArrayPLDAccountant(value_discretization_interval=value_discretization_interval)

    def event(noise_multiplier: float) -> dp_accounting.DpEvent:
        return _poisson_gaussian_event(noise_multiplier, sample_rate, steps)

    with numpy_transforms():  # the compositions' FFTs leave no plans behind (mpi_fnas.privacy.transforms)
        return float(
            dp_accounting.calibrate_dp_mechanism(
                fresh_accountant,
                event,
                target_epsilon,
                delta,
                bracket_interval=dp_accounting.LowerEndpointAndGuess(0.0, 1.0),
                tol=tolerance,
            )
        )


#: A ledger's releases as (noise multiplier σ, Poisson rate q, count) runs.
Runs = tuple[tuple[float, float, int], ...]


class PrivacyLedger:
    """The releases made on one dataset (one party's train or val shard) and their privacy cost.

    Every release is a Poisson-subsampled Gaussian mechanism with sample rate q and noise multiplier sigma
    (std sigma * R on a sum of sensitivity R). Steps with different (sigma, q) may be mixed: the PLD composes
    them exactly, and :meth:`mu_gdp` uses ``mu^2 = sum_t q_t^2 (e^{1/sigma_t^2} - 1)``, the heterogeneous form of
    the same central limit theorem (it reduces to Theorem 3.1 when all steps are equal).

    ``get_epsilon`` is cached per composition and delta, and the one-step PLD per (sigma, q), so calling it after
    every logged step is cheap when nothing changed and costs one ``self_compose`` otherwise.

    ``secure``: the releases were securely aggregated (``privacy.aggregation: secure``); ε is then the securely
    summed discrete Gaussian's RDP bound (:class:`~mpi_fnas.secagg.accounting.SecureAccounting`) against the
    server, and :meth:`get_epsilon_collusion` the same with K − 1 parties colluding with it.
    """

    def __init__(self, *, value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION,
                 secure: SecureAccounting | None = None) -> None:
        if not value_discretization_interval > 0:
            raise ValueError("value_discretization_interval must be > 0")
        self.value_discretization_interval = float(value_discretization_interval)
        self.secure = secure
        # [noise_multiplier, sample_rate, count] runs, in order; consecutive equal steps share a run.
        self._runs: list[list[float]] = []

    # -- recording ---------------------------------------------------------------------------------------------
    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` releases with noise multiplier sigma and Poisson sample rate q."""
        _check_step_arguments(noise_multiplier, sample_rate, num_steps)
        if num_steps == 0:
            return
        if self._runs and self._runs[-1][0] == noise_multiplier and self._runs[-1][1] == sample_rate:
            self._runs[-1][2] += num_steps
        else:
            self._runs.append([float(noise_multiplier), float(sample_rate), int(num_steps)])

    def runs(self) -> Runs:
        """The releases as (σ, q, count) runs, merged by (σ, q) and sorted (composition commutes), without empty
        ones: equal ledgers give equal runs, and :meth:`from_runs` rebuilds an equal ledger."""
        return _canonical(self._runs)

    @classmethod
    def from_runs(cls, runs: Runs, interval: float = DEFAULT_VALUE_DISCRETIZATION,
                  secure: SecureAccounting | None = None) -> PrivacyLedger:
        """A ledger holding `runs` ((σ, q, count) releases), on the grid `interval` (`secure`: as in the class)."""
        ledger = cls(value_discretization_interval=interval, secure=secure)
        for noise_multiplier, sample_rate, count in runs:
            ledger.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=count)
        return ledger

    @property
    def steps(self) -> int:
        """Number of releases recorded."""
        return sum(int(count) for _, _, count in self._runs)

    # -- privacy -------------------------------------------------------------------------------------------------
    def get_epsilon(self, delta: float) -> float:
        """Tight (PLD) epsilon upper bound at ``delta`` of all releases so far (0 before any step); under secure
        aggregation the RDP bound against the server and its ``privacy.colluders`` (0 by default)."""
        if self.secure is not None:
            return self.secure.epsilon(_canonical(self._runs), float(delta))
        return _pld_epsilon(_canonical(self._runs), float(delta), self.value_discretization_interval)

    def get_epsilon_server(self, delta: float) -> float:
        """ε at ``delta`` against the server alone (no colluders): :meth:`get_epsilon` unless the guarantee lets
        ``privacy.colluders`` parties collude with it."""
        if self.secure is None or self.secure.colluders == 0:
            return self.get_epsilon(delta)
        return self.secure.epsilon(_canonical(self._runs), float(delta), colluders=0)

    def get_epsilon_collusion(self, delta: float) -> float:
        """ε at ``delta`` if K − 1 parties collude with the server (they subtract their noise). Under local
        aggregation every party adds the full noise, so colluders change nothing: :meth:`get_epsilon`."""
        if self.secure is None or self.secure.parties == 1:
            return self.get_epsilon(delta)
        return self.secure.epsilon(_canonical(self._runs), float(delta), colluders=self.secure.parties - 1)

    def mu_gdp(self) -> float:
        """Theorem 3.1's mu (a CLT approximation, not a bound); 0 before any step."""
        return math.sqrt(sum(_mu_squared_of_steps(s, q, int(c)) for s, q, c in self._runs))

    def description(self) -> str:
        """What computed ``get_epsilon`` (for logs and the HDF5 ``accountant`` attribute)."""
        if self.secure is not None:
            return f"dp_accounting {_dp_accounting_version()} RDP conversion; {self.secure.description()}"
        return (
            f"dp_accounting {_dp_accounting_version()} PLD, Poisson-subsampled Gaussian, add-or-remove-one, "
            f"pessimistic, value_discretization_interval={self.value_discretization_interval:g}"
        )

    # -- checkpointing -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (JSON/HDF5-attribute friendly) from which :meth:`load_state_dict` restores."""
        return {
            "version": _STATE_VERSION,
            "value_discretization_interval": self.value_discretization_interval,
            "runs": [[float(s), float(q), int(c)] for s, q, c in self._runs],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace this ledger's contents with ``state`` (from :meth:`state_dict`), validating it."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported privacy ledger state version {state.get('version')!r}")
        runs = []
        for run in state["runs"]:
            noise_multiplier, sample_rate, count = float(run[0]), float(run[1]), int(run[2])
            _check_step_arguments(noise_multiplier, sample_rate, count)
            runs.append([noise_multiplier, sample_rate, count])
        self.value_discretization_interval = float(state["value_discretization_interval"])
        self._runs = runs

    def __repr__(self) -> str:
        return f"PrivacyLedger(steps={self.steps}, runs={len(self._runs)})"


def party_epsilon(train_ledger: PrivacyLedger, val_ledger: PrivacyLedger, delta: float) -> float:
    """A party's epsilon at ``delta``: the larger of its two ledgers' (the shards are disjoint)."""
    return max(train_ledger.get_epsilon(delta), val_ledger.get_epsilon(delta))


# -- internals ---------------------------------------------------------------------------------------------------


def _check_step_arguments(noise_multiplier: float, sample_rate: float, steps: int) -> None:
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be positive and finite, got {noise_multiplier}")
    if not 0.0 <= sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"number of steps must be a non-negative integer, got {steps}")


def _mu_squared_of_steps(noise_multiplier: float, sample_rate: float, steps: int) -> float:
    return sample_rate**2 * steps * math.expm1(noise_multiplier**-2)


def _poisson_gaussian_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), steps
    )


def _canonical(runs: Iterable[list[float]]) -> tuple[tuple[float, float, int], ...]:
    """Runs merged by (sigma, q) and sorted: composition is commutative, so equal ledgers share a cache entry."""
    counts: dict[tuple[float, float], int] = {}
    for s, q, c in runs:
        if q > 0 and c > 0:  # q = 0 never touches the data: a no-op
            counts[(s, q)] = counts.get((s, q), 0) + int(c)
    return tuple(sorted((s, q, c) for (s, q), c in counts.items()))


@functools.lru_cache(maxsize=128)
def _one_step_pld(
    noise_multiplier: float, sample_rate: float, interval: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    # dp_accounting's PLD of a PoissonSampledDpEvent of a GaussianDpEvent, built on arrays (gaussian_pld);
    # building it is still the larger cost, so it is built once per (sigma, q). A federation needs 2 K of them
    # (each party's train and val rate), ~1 MB each: 128 serves 64 unequal parties without rebuilding every one at
    # every logged step.
    return gaussian_pld(noise_multiplier, sample_rate, interval)


@functools.lru_cache(maxsize=256)
def _pld_epsilon(runs: tuple[tuple[float, float, int], ...], delta: float, interval: float) -> float:
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not runs:
        return 0.0
    composed = None
    with numpy_transforms():  # the compositions' FFTs leave no plans behind (mpi_fnas.privacy.transforms)
        for noise_multiplier, sample_rate, count in runs:
            pld = _one_step_pld(noise_multiplier, sample_rate, interval).self_compose(count)
            composed = pld if composed is None else composed.compose(pld)
    return float(composed.get_epsilon_for_delta(delta))


@functools.cache
def _dp_accounting_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dp-accounting")
    except PackageNotFoundError:
        return "unknown"
