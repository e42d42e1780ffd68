"""The privacy budget of a whole federation: per party, per dataset (its train and its validation shard).

Rank 0 plans before the first step, from public facts only (shard sizes, B, σ, T):

* sample rates q = B / N per shard, δ per party (``privacy.delta`` or min(1e-5, 1/N_k), N_k = smaller shard);
* with ``privacy.target_epsilon``: one σ for W and A, calibrated so the worst party ends the run at the target;
* with ``privacy.max_epsilon``: how many steps the run may take before any party would exceed it.

During the run :class:`FederationLedger` records every step for every party and reports, per party, the tight
PLD ε (the headline) and Theorem 3.1's μ-GDP (a CLT approximation, logged for comparison only). A party's
guarantee is the larger of its two ledgers', since its train and validation shards are disjoint (Theorem 3.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpi_fnas.privacy.accountant import PrivacyLedger, calibrate_noise_multiplier, default_delta
from mpi_fnas.privacy.params import DPParams


@dataclass(frozen=True)
class PrivacyPlan:
    """Public constants of a DP run. Arrays are (K,), party k at index k - 1.

    ``params`` is what every party receives (σ calibrated here under ``target_epsilon``).
    """

    params: DPParams
    sample_rate_train: np.ndarray
    sample_rate_val: np.ndarray
    delta: np.ndarray
    steps: int  # iterations the run will take (≤ the configured epochs × steps per epoch)
    stop_reason: str  # "completed" or why fewer steps were planned


def plan_privacy(
    train_sizes: Sequence[int],
    val_sizes: Sequence[int],
    params: DPParams,
    planned_steps: int,
) -> PrivacyPlan:
    """Plan the DP parameters of a run (see the module docstring). Raises ValueError on impossible settings."""
    expected_batch_size = params.expected_batch_size
    delta, target_epsilon, max_epsilon = params.delta, params.target_epsilon, params.max_epsilon
    n_tr = np.asarray(train_sizes, dtype=np.float64)
    n_val = np.asarray(val_sizes, dtype=np.float64)
    if np.any(n_tr < expected_batch_size) or np.any(n_val < expected_batch_size):
        smallest = int(min(n_tr.min(), n_val.min()))
        raise ValueError(f"search.batch_size {expected_batch_size:g} exceeds the smallest party shard ({smallest} "
                         "examples): the Poisson rate B/N must not exceed 1")
    q_tr = expected_batch_size / n_tr
    q_val = expected_batch_size / n_val
    smaller_shard = np.minimum(n_tr, n_val).astype(int)
    deltas = np.array([delta if delta is not None else default_delta(int(n)) for n in smaller_shard])
    sigma_w, sigma_a = float(params.noise_multiplier_w), float(params.noise_multiplier_a)
    if target_epsilon is not None:
        # The worst party has the largest rate and the smallest δ: calibrating there bounds everyone.
        worst_q = float(max(q_tr.max(), q_val.max()))
        sigma_w = sigma_a = calibrate_noise_multiplier(target_epsilon, float(deltas.min()), worst_q, planned_steps)
    steps, reason = planned_steps, "completed"
    if max_epsilon is not None:
        steps = _steps_within(max_epsilon, q_tr, q_val, deltas, sigma_w, sigma_a, planned_steps)
        if steps < planned_steps:
            reason = f"max_epsilon reached: {max_epsilon:g} allows {steps} of {planned_steps} steps"
    return PrivacyPlan(params.with_noise(sigma_w, sigma_a), q_tr, q_val, deltas, steps, reason)


def _worst_epsilon(steps: int, q_tr: np.ndarray, q_val: np.ndarray, deltas: np.ndarray, sigma_w: float,
                   sigma_a: float) -> float:
    if steps == 0:
        return 0.0
    worst = 0.0
    for key in sorted(set(zip(q_tr.tolist(), q_val.tolist(), deltas.tolist(), strict=True))):  # identical parties once
        qt, qv, d = key
        for sigma, q in ((sigma_w, qt), (sigma_a, qv)):
            ledger = PrivacyLedger()
            ledger.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
            worst = max(worst, ledger.get_epsilon(d))
    return worst


def _steps_within(budget: float, q_tr, q_val, deltas, sigma_w, sigma_a, planned: int) -> int:
    """The largest T ≤ planned whose worst-party ε ≤ budget (ε grows with T: binary search)."""
    if _worst_epsilon(planned, q_tr, q_val, deltas, sigma_w, sigma_a) <= budget:
        return planned
    lo, hi = 0, planned  # ε(lo) ≤ budget < ε(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _worst_epsilon(mid, q_tr, q_val, deltas, sigma_w, sigma_a) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


class FederationLedger:
    """Two ledgers per party (train → W releases, validation → A releases), stepped together."""

    def __init__(self, plan: PrivacyPlan) -> None:
        self.plan = plan
        k = len(plan.delta)
        self.train = [PrivacyLedger() for _ in range(k)]
        self.val = [PrivacyLedger() for _ in range(k)]

    @property
    def steps(self) -> int:
        return self.train[0].steps

    def record_step(self) -> None:
        """One iteration: every party released one G_k (train) and one H_k (validation)."""
        for k in range(len(self.train)):
            self.train[k].step(noise_multiplier=self.plan.params.noise_multiplier_w,
                               sample_rate=float(self.plan.sample_rate_train[k]))
            self.val[k].step(noise_multiplier=self.plan.params.noise_multiplier_a,
                             sample_rate=float(self.plan.sample_rate_val[k]))

    def epsilons(self) -> np.ndarray:
        """(K,) tight PLD ε per party at its δ: max over its two ledgers."""
        return np.array([max(t.get_epsilon(d), v.get_epsilon(d))
                         for t, v, d in zip(self.train, self.val, self.plan.delta, strict=True)])

    def mu_gdp(self) -> np.ndarray:
        """(K,) Theorem 3.1's μ per party (max over its two ledgers) — an approximation, not the guarantee."""
        return np.array([max(t.mu_gdp(), v.mu_gdp()) for t, v in zip(self.train, self.val, strict=True)])

    def description(self) -> str:
        return self.train[0].description()

    def state_dict(self) -> dict[str, Any]:
        return {"train": [t.state_dict() for t in self.train], "val": [v.state_dict() for v in self.val]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for ledger, saved in zip(self.train, state["train"], strict=True):
            ledger.load_state_dict(saved)
        for ledger, saved in zip(self.val, state["val"], strict=True):
            ledger.load_state_dict(saved)
