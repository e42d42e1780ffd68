"""The privacy budget of a whole federation: per party, per dataset (its train and its validation shard).

Rank 0 plans before the first step, from public facts only (shard sizes, B, σ, T):

* sample rates q = B / N per shard;
* δ per party: ``privacy.delta``, refused unless below 1/N_k, or by default min(1e-5, 1/(10·N_k)), where N_k is
  the party's LARGER shard (each ledger needs δ below 1 over its own shard's size: see :func:`party_deltas`);
* with ``privacy.target_epsilon``: one σ for W and A, calibrated so the worst party ends the run at the target;
* with ``privacy.max_epsilon``: how many steps the run may take before any party would exceed it.

During the run :class:`FederationLedger` records every step for every party, charges the releases a party
replays after a resume, and reports, per party, the tight PLD ε (the headline) and Theorem 3.1's μ-GDP (a CLT
approximation, logged for comparison only). A party's guarantee is the larger of its two ledgers', since its
train and validation shards are disjoint (Theorem 3.1). ε depends on public counts only, so the ledger can
compute the log's ε on a background thread (:meth:`FederationLedger.submit`) while the parties train.

The augment stage (training the found architecture on the same parties) releases one DP gradient per party and
iteration (two under ADADP: ``AugmentReleases.releases_per_step``), Poisson-sampled from a pool of the party's
records (:func:`augment_sample_rates`): each record's shard ledger pays for it at that record's rate, so the
party's ε stays the larger of its two *composed* ledgers'.
:func:`plan_privacy` with ``augment`` plans both stages of one job against one budget; :func:`plan_augment`
plans the augment alone against what a ledger has already spent.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
from scipy import optimize

from mpi_fnas.privacy.accountant import (
    DEFAULT_VALUE_DISCRETIZATION,
    PrivacyLedger,
    calibrate_noise_multiplier,
    default_delta,
    party_epsilon,
)
from mpi_fnas.privacy.params import DPParams
from mpi_fnas.privacy.release import Release

AugmentPool = Literal["all", "train"]


@dataclass(frozen=True)
class AugmentReleases:
    """Public constants of the augment stage's releases. Arrays are (K,), party k at index k - 1.

    Each augment iteration, every party releases ``releases_per_step`` gradients of its pool (1; 2 under
    ``augment.optimizer: adadp``, each on a fresh batch): Poisson-sampled, clipped per example at ``clip``, noise
    ``noise_multiplier · clip``, divided by ``expected_batch_size``. A record of party k's train shard is sampled
    with rate ``sample_rate_train[k]``, one of its validation shard with ``sample_rate_val[k]`` (0: the pool leaves
    that shard out, and its ledger is not charged).
    """

    noise_multiplier: float
    clip: float
    expected_batch_size: float
    sample_rate_train: np.ndarray
    sample_rate_val: np.ndarray
    steps: int  # augment iterations planned (≤ the configured ones)
    stop_reason: str = "completed"  # or why fewer augment steps were planned
    releases_per_step: int = 1  # weight releases per augment iteration (2 under ADADP: at W, then at W_half)

    def __post_init__(self) -> None:
        # Frozen: the arrays are normalised through object.__setattr__, once, here.
        rate_train = np.array(self.sample_rate_train, dtype=np.float64)
        rate_val = np.array(self.sample_rate_val, dtype=np.float64)
        if rate_train.ndim != 1 or rate_train.shape != rate_val.shape:
            raise ValueError(f"augment sample rates must be two (K,) arrays, got shapes {rate_train.shape} and "
                             f"{rate_val.shape}")
        if np.any(~((rate_train >= 0) & (rate_train <= 1))) or np.any(~((rate_val >= 0) & (rate_val <= 1))):
            raise ValueError("augment sample rates must be in [0, 1]")
        if not (self.noise_multiplier > 0 and np.isfinite(self.noise_multiplier)):
            raise ValueError(f"augment noise multiplier must be positive and finite, got {self.noise_multiplier}")
        if not (self.clip > 0 and self.expected_batch_size > 0):
            raise ValueError(f"augment clip and batch size must be > 0, got {self.clip:g} and "
                             f"{self.expected_batch_size:g}")
        if int(self.steps) != self.steps or self.steps < 0:
            raise ValueError(f"augment steps must be a non-negative integer, got {self.steps}")
        if int(self.releases_per_step) != self.releases_per_step or self.releases_per_step < 1:
            raise ValueError(f"augment releases per step must be an integer >= 1, got {self.releases_per_step}")
        object.__setattr__(self, "sample_rate_train", rate_train)
        object.__setattr__(self, "sample_rate_val", rate_val)
        object.__setattr__(self, "steps", int(self.steps))
        object.__setattr__(self, "releases_per_step", int(self.releases_per_step))

    @property
    def release(self) -> Release:
        """The release a party makes each time (σ, clip, B, releases per iteration)."""
        return Release(self.noise_multiplier, self.clip, self.expected_batch_size, self.releases_per_step)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (JSON/HDF5-attribute friendly); :meth:`from_state_dict` restores it."""
        return {"noise_multiplier": float(self.noise_multiplier), "clip": float(self.clip),
                "expected_batch_size": float(self.expected_batch_size),
                "sample_rate_train": self.sample_rate_train.tolist(), "sample_rate_val": self.sample_rate_val.tolist(),
                "steps": self.steps, "stop_reason": self.stop_reason, "releases_per_step": self.releases_per_step}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> AugmentReleases:
        return cls(**state)


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
    augment: AugmentReleases | None = None  # the augment stage as planned with the search (σ, steps), if it was
    # W releases per search iteration on the train shard: 2 under ADADP (G1 and G2, each on a fresh Poisson
    # batch), else 1. The validation shard pays one A release per iteration either way.
    w_releases_per_step: int = 1


def augment_sample_rates(
    train_sizes: Sequence[int],
    val_sizes: Sequence[int],
    expected_batch_size: float,
    pool: AugmentPool,
) -> tuple[np.ndarray, np.ndarray]:
    """(K,) Poisson rate of a party's train records and (K,) of its validation records in one augment release.

    ``pool="all"``: the party samples its train and validation shards together, so every record of either has
    rate B / (N_tr + N_val). ``pool="train"``: only the train shard, rate B / N_tr; validation records have rate 0
    (never touched). Raises ValueError, one line, when B exceeds a party's pool.
    """
    n_tr = np.asarray(train_sizes, dtype=np.float64)
    n_val = np.asarray(val_sizes, dtype=np.float64)
    if pool == "all":
        n_pool = n_tr + n_val
    elif pool == "train":
        n_pool = n_tr
    else:
        raise ValueError(f"augment pool must be 'all' or 'train', got {pool!r}")
    if not expected_batch_size > 0:
        raise ValueError(f"augment batch size must be > 0, got {expected_batch_size:g}")
    if np.any(n_pool < expected_batch_size):
        party = int(np.argmin(n_pool))
        raise ValueError(f"augment batch size {expected_batch_size:g} exceeds party {party + 1}'s pool "
                         f"({int(n_pool[party])} examples, pool {pool!r}): the Poisson rate B/N must not exceed 1")
    rate = expected_batch_size / n_pool
    return rate, (rate.copy() if pool == "all" else np.zeros_like(rate))


def plan_privacy(
    train_sizes: Sequence[int],
    val_sizes: Sequence[int],
    params: DPParams,
    planned_steps: int,
    *,
    augment: AugmentReleases | None = None,
    w_releases_per_step: int = 1,
) -> PrivacyPlan:
    """Plan the DP parameters of a run (see the module docstring). Raises ValueError on impossible settings.

    ``w_releases_per_step``: W releases each iteration makes on the train shard (2 under ADADP); every ε, σ and
    step limit below counts them, so ``planned_steps`` iterations charge the train ledger that many times over.

    ``augment``: the augment stage planned in the same job (its ``steps`` = the planned augment iterations, its
    σ used unless ``target_epsilon`` calibrates it). The budget then covers the whole job: ``target_epsilon``
    calibrates ONE σ for σ_W = σ_A = σ_aug so the worst party's composed ε after both stages meets the target;
    ``max_epsilon`` shortens both stages to the same fraction of their planned steps. The plan's ``augment`` is
    the augment stage as planned. Without ``augment`` the search alone is planned, as before.
    """
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
    deltas = party_deltas(train_sizes, val_sizes, delta)
    r = int(w_releases_per_step)
    if r < 1:
        raise ValueError(f"W releases per step must be >= 1, got {w_releases_per_step}")
    if augment is not None:
        return replace(_plan_job(q_tr, q_val, deltas, params, planned_steps, augment, r), w_releases_per_step=r)
    sigma_w, sigma_a = float(params.noise_multiplier_w), float(params.noise_multiplier_a)
    if target_epsilon is not None:
        # The worst party has the largest rate and the smallest δ: calibrating there bounds everyone.
        worst_q = float(max(q_tr.max(), q_val.max()))
        # r·T releases at the worst rate bound both ledgers (the validation one has T): exact when q_tr binds.
        sigma_w = sigma_a = calibrate_noise_multiplier(target_epsilon, float(deltas.min()), worst_q,
                                                       planned_steps * r)
    steps, reason = planned_steps, "completed"
    if max_epsilon is not None:
        steps = _steps_within(max_epsilon, q_tr, q_val, deltas, sigma_w, sigma_a, planned_steps, r)
        if steps < planned_steps:
            reason = f"max_epsilon reached: {max_epsilon:g} allows {steps} of {planned_steps} steps"
    return PrivacyPlan(params.with_noise(sigma_w, sigma_a), q_tr, q_val, deltas, steps, reason,
                       w_releases_per_step=r)


def _plan_job(q_tr: np.ndarray, q_val: np.ndarray, deltas: np.ndarray, params: DPParams, search_steps: int,
              augment: AugmentReleases, w_releases_per_step: int = 1) -> PrivacyPlan:
    """plan_privacy of a job that runs the search and then the augment (rates and δ already checked)."""
    if augment.sample_rate_train.shape != q_tr.shape:
        raise ValueError(f"the augment releases cover {len(augment.sample_rate_train)} parties, the search "
                         f"{len(q_tr)}")
    target_epsilon, max_epsilon = params.target_epsilon, params.max_epsilon
    sigma_w, sigma_a = float(params.noise_multiplier_w), float(params.noise_multiplier_a)
    sigma_aug, augment_steps = float(augment.noise_multiplier), augment.steps
    if target_epsilon is not None and params.search_share is not None and search_steps > 0:
        # The search alone to its share of the target (σ_W = σ_A), then σ_aug to the whole target after it.
        shards = _job_shards(q_tr, q_val, deltas, None, None, augment, w_releases_per_step)
        sigma_w = sigma_a = _calibrate(shards, search_steps, 0, params.search_share * target_epsilon, start=1.0,
                                       interval=DEFAULT_VALUE_DISCRETIZATION)
        shards = _job_shards(q_tr, q_val, deltas, (sigma_w, sigma_a), None, augment, w_releases_per_step)
        sigma_aug = _calibrate(shards, search_steps, augment_steps, target_epsilon, start=1.0,
                               interval=DEFAULT_VALUE_DISCRETIZATION)
    elif target_epsilon is not None:
        # One σ for the three releases, the variable of every shard (None), solved on the exact composition.
        shards = _job_shards(q_tr, q_val, deltas, None, None, augment, w_releases_per_step)
        sigma_w = sigma_a = sigma_aug = _calibrate(shards, search_steps, augment_steps, target_epsilon,
                                                   start=1.0, interval=DEFAULT_VALUE_DISCRETIZATION)
    steps, reason, augment_reason = search_steps, "completed", augment.stop_reason
    if max_epsilon is not None:
        shards = _job_shards(q_tr, q_val, deltas, (sigma_w, sigma_a), sigma_aug, augment, w_releases_per_step)
        pairs, fractions = _proportional_pairs(search_steps, augment_steps)
        chosen = _largest_within(shards, pairs, max_epsilon, DEFAULT_VALUE_DISCRETIZATION)
        if chosen < len(pairs) - 1:
            steps, augment_steps = (int(n) for n in pairs[chosen])
            both = f"(search and augment cut to the same fraction of their steps, {fractions[chosen]:.4g})"
            reason = f"max_epsilon reached: {max_epsilon:g} allows {steps} of {search_steps} steps {both}"
            augment_reason = (f"max_epsilon reached: {max_epsilon:g} allows {augment_steps} of {augment.steps} "
                              f"augment steps {both}")
    planned = replace(augment, noise_multiplier=sigma_aug, steps=augment_steps, stop_reason=augment_reason)
    return PrivacyPlan(params.with_noise(sigma_w, sigma_a), q_tr, q_val, deltas, steps, reason, planned)


def plan_augment(ledger: FederationLedger, releases: AugmentReleases, params: DPParams) -> AugmentReleases:
    """Plan the augment stage alone, after ``ledger`` has spent what it holds (the search, its replays...).

    ``releases.steps`` are the augment iterations still to come. With ``params.target_epsilon`` (the budget of
    the whole job): σ_aug calibrated so the worst party's composed ε, the ledger's releases plus the augment's,
    ends at the target; refused (ValueError, one line) when a party already spent the target. With
    ``params.max_epsilon``: the largest number of augment steps ≤ ``releases.steps`` keeping every party within
    it (possibly 0; ``stop_reason`` says why). With neither, ``releases`` is returned unchanged.
    """
    parties = len(ledger.train)
    if releases.sample_rate_train.shape != (parties,):
        raise ValueError(f"the augment releases cover {len(releases.sample_rate_train)} parties, the ledger "
                         f"{parties}")
    target_epsilon, max_epsilon = params.target_epsilon, params.max_epsilon
    if target_epsilon is None and max_epsilon is None:
        return releases
    interval = ledger.train[0].value_discretization_interval
    spent = ledger.epsilons()
    worst = int(np.argmax(spent))
    if target_epsilon is not None:
        if spent[worst] >= target_epsilon:
            raise ValueError(f"privacy.target_epsilon {target_epsilon:g} is already spent: party {worst + 1} is at "
                             f"ε = {spent[worst]:.4g} before the augment, so no augment release fits in the budget")
        if releases.steps > 0:
            shards = _ledger_shards(ledger, None, releases)
            try:
                sigma = _calibrate(shards, 0, releases.steps, target_epsilon, start=releases.noise_multiplier,
                                   interval=interval)
            except ValueError as exc:
                raise ValueError(f"privacy.target_epsilon {target_epsilon:g}: party {worst + 1} is at ε = "
                                 f"{spent[worst]:.4g} before the augment, and {exc}") from None
            releases = replace(releases, noise_multiplier=sigma)
    if max_epsilon is not None:
        planned = releases.steps
        if spent[worst] > max_epsilon:
            return replace(releases, steps=0, stop_reason=(
                f"max_epsilon reached before the augment: party {worst + 1} is at ε = {spent[worst]:.4g} > "
                f"{max_epsilon:g}, so 0 of {planned} augment steps"))
        shards = _ledger_shards(ledger, releases.noise_multiplier, releases)
        pairs = np.stack([np.zeros(planned + 1, dtype=np.int64), np.arange(planned + 1, dtype=np.int64)], axis=1)
        steps = int(pairs[_largest_within(shards, pairs, max_epsilon, interval)][1])
        if steps < planned:
            releases = replace(releases, steps=steps, stop_reason=(
                f"max_epsilon reached: {max_epsilon:g} allows {steps} of {planned} augment steps after the "
                f"{spent[worst]:.4g} already spent (party {worst + 1})"))
    return releases


def party_deltas(train_sizes: Sequence[int], val_sizes: Sequence[int], delta: float | None) -> np.ndarray:
    """(K,) δ per party: the configured ``delta``, refused unless below 1/N_k, or the default per party.

    N_k is the party's larger shard. Each ledger's δ must be below 1 over the size of the shard it covers (the
    mechanism that publishes each record with probability δ is (0, δ)-DP; see ``default_delta``), and one δ
    covers both of a party's ledgers, so the larger shard binds. Raises ValueError, one line naming the party.
    """
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


def _worst_epsilon(steps: int, q_tr: np.ndarray, q_val: np.ndarray, deltas: np.ndarray, sigma_w: float,
                   sigma_a: float, w_releases_per_step: int = 1) -> float:
    if steps == 0:
        return 0.0
    worst = 0.0
    for key in sorted(set(zip(q_tr.tolist(), q_val.tolist(), deltas.tolist(), strict=True))):  # identical parties once
        qt, qv, d = key
        for sigma, q, count in ((sigma_w, qt, steps * w_releases_per_step), (sigma_a, qv, steps)):
            ledger = PrivacyLedger()
            ledger.step(noise_multiplier=sigma, sample_rate=q, num_steps=count)
            worst = max(worst, ledger.get_epsilon(d))
    return worst


def _steps_within(budget: float, q_tr, q_val, deltas, sigma_w, sigma_a, planned: int, w_releases: int = 1) -> int:
    """The largest T ≤ planned whose worst-party ε ≤ budget (ε grows with T: binary search)."""
    if _worst_epsilon(planned, q_tr, q_val, deltas, sigma_w, sigma_a, w_releases) <= budget:
        return planned
    lo, hi = 0, planned  # ε(lo) ≤ budget < ε(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _worst_epsilon(mid, q_tr, q_val, deltas, sigma_w, sigma_a, w_releases) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


# -- planning both stages: shards, σ calibration, step budgets ----------------------------------------------------

#: The grid of the planners' first pass: ~10x faster than the default, and its ε sits slightly above the fine
#: grid's, so its answer is a close starting point for the fine pass (which alone decides).
_COARSE_FACTOR = 10.0
#: σ is calibrated within this absolute tolerance, never below _MIN_SIGMA (where ε is already in the hundreds
#: for any useful run, and a PLD at the fine grid costs seconds) and never above _MAX_SIGMA.
_SIGMA_TOLERANCE = 1e-3
_MIN_SIGMA = 0.25
_MAX_SIGMA = 1024.0
#: The planners search the non-dominated shards only (see _Shard.dominates), against the budget less this
#: relative slack. Domination is exact in theory and holds for the PLD the ledger computes (connect-the-dots
#: pairs of ordered mechanisms are ordered; composition keeps the order) up to floating-point noise: measured,
#: a dominated shard's ε came out above its dominator's only when their rates differed by ~1e-10 relative, and
#: then by < 1e-9. The slack keeps every party's reported ε within the budget, not just the searched ones'.
_DOMINATION_SLACK = 1e-8

Runs = tuple[tuple[float, float, int], ...]


@dataclass(frozen=True)
class _Shard:
    """One ledger (a party's train or validation shard) as a planner sees it. Hashable: equal shards count once.

    ``spent``: canonical (σ, q, count) runs already charged. ``search`` / ``augment``: (σ, q) of each release
    still to come in that stage; σ None is the σ being calibrated, q = 0 a stage that never touches the shard.
    """

    spent: Runs
    search: tuple[float | None, float]
    augment: tuple[float | None, float]
    delta: float
    search_releases: int = 1  # releases per search iteration on this shard (2 on the train shard under ADADP)
    augment_releases: int = 1  # releases per augment iteration (2 under augment.optimizer: adadp)

    def runs(self, search_steps: int, augment_steps: int, sigma: float | None) -> Runs:
        planned = ((self.search, search_steps * self.search_releases),
                   (self.augment, augment_steps * self.augment_releases))
        return self.spent + tuple((sigma if s is None else s, q, n) for (s, q), n in planned if q > 0 and n > 0)

    def dominates(self, other: _Shard) -> bool:
        """True when ``self``'s ε is at least ``other``'s at every σ and step count (in exact arithmetic).

        A higher rate, less noise, more releases or a smaller δ never lower ε: each is a post-processing
        argument (a rate-q' sample is a rate-q sample thinned; more noise is added noise; a release dropped).
        """
        return (self.delta <= other.delta
                and _runs_dominate(self.spent, other.spent)
                and _release_dominates(self.search, other.search)
                and (self.search_releases >= other.search_releases or other.search[1] == 0.0)
                and _release_dominates(self.augment, other.augment)
                and (self.augment_releases >= other.augment_releases or other.augment[1] == 0.0))


def _runs_dominate(mine: Runs, other: Runs) -> bool:
    """True when every release of ``other`` can be paired with its own release of ``mine`` that dominates it.

    Greedy (the most demanding of ``other``'s runs first, each served by the least rate that suffices): a
    pairing found proves domination; one missed only makes the planner look at one more shard.
    """
    left = [[s, q, n] for s, q, n in sorted(mine, key=lambda run: (run[1], -run[0]))]  # weakest first
    for s, q, n in sorted(other, key=lambda run: (-run[1], run[0])):  # most demanding first
        for run in left:
            if n == 0:
                break
            if run[1] >= q and run[0] <= s and run[2] > 0:
                used = min(n, run[2])
                run[2] -= used
                n -= used
        if n > 0:
            return False
    return True


def _release_dominates(mine: tuple[float | None, float], other: tuple[float | None, float]) -> bool:
    (my_sigma, my_rate), (other_sigma, other_rate) = mine, other
    if other_rate == 0.0:
        return True
    if my_rate < other_rate:
        return False
    if my_sigma is None or other_sigma is None:
        return my_sigma is None and other_sigma is None
    return my_sigma <= other_sigma


def _canonical_runs(runs: Sequence[Sequence[float]]) -> Runs:
    """Runs merged by (σ, q), sorted, without q = 0: composition is commutative, so equal ledgers compare equal."""
    counts: dict[tuple[float, float], int] = {}
    for s, q, n in runs:
        if q > 0 and n > 0:
            counts[(float(s), float(q))] = counts.get((float(s), float(q)), 0) + int(n)
    return tuple(sorted((s, q, n) for (s, q), n in counts.items()))


def _job_shards(q_tr: np.ndarray, q_val: np.ndarray, deltas: np.ndarray, search_sigmas: tuple[float, float] | None,
                augment_sigma: float | None, augment: AugmentReleases, w_releases_per_step: int = 1) -> set[_Shard]:
    """Every party's two shards before the job: nothing spent; (σ_W | σ_A, q) then (σ_aug, its augment rate).

    The train shard pays ``w_releases_per_step`` W releases per search iteration, the validation shard one."""
    sigma_w, sigma_a = search_sigmas if search_sigmas is not None else (None, None)
    shards = set()
    for k, delta in enumerate(deltas.tolist()):
        shards.add(_Shard((), (sigma_w, float(q_tr[k])), (augment_sigma, float(augment.sample_rate_train[k])), delta,
                          w_releases_per_step, augment.releases_per_step))
        shards.add(_Shard((), (sigma_a, float(q_val[k])), (augment_sigma, float(augment.sample_rate_val[k])), delta,
                          1, augment.releases_per_step))
    return shards


def _ledger_shards(ledger: FederationLedger, augment_sigma: float | None, augment: AugmentReleases) -> set[_Shard]:
    """Every party's two shards as ``ledger`` holds them, followed by the augment releases (no search left)."""
    shards = set()
    for k, delta in enumerate(ledger.plan.delta.tolist()):
        for shard_ledger, rate in ((ledger.train[k], augment.sample_rate_train[k]),
                                   (ledger.val[k], augment.sample_rate_val[k])):
            spent = _canonical_runs(_runs(shard_ledger))
            shards.add(_Shard(spent, (None, 0.0), (augment_sigma, float(rate)), delta,
                              augment_releases=augment.releases_per_step))
    return shards


def _front(shards: set[_Shard]) -> list[_Shard]:
    """The shards no other shard dominates: the worst party is always among them, so searches look at these."""
    ordered = sorted(shards, key=repr)  # a fixed order: the same plan on every rank and every run
    return [s for s in ordered if not any(o != s and o.dominates(s) for o in ordered)]


def _worst(shards: Sequence[_Shard], search_steps: int, augment_steps: int, sigma: float | None,
           interval: float) -> float:
    """The largest composed PLD ε over ``shards`` (each at its own δ)."""
    worst = 0.0
    for shard in shards:
        ledger = PrivacyLedger(value_discretization_interval=interval)  # cached per (runs, δ, grid) below it
        for s, q, n in shard.runs(search_steps, augment_steps, sigma):
            ledger.step(noise_multiplier=s, sample_rate=q, num_steps=n)
        worst = max(worst, ledger.get_epsilon(shard.delta))
    return worst


def _calibrate(shards: set[_Shard], search_steps: int, augment_steps: int, target: float, *, start: float,
               interval: float) -> float:
    """The smallest σ (within _SIGMA_TOLERANCE) whose worst composed ε is ≤ ``target``; never one above it.

    Over the non-dominated shards: a coarse-grid pass finds σ roughly, a fine-grid pass (the ledger's grid,
    which alone decides) refines it from there. Raises ValueError when even _MAX_SIGMA exceeds the target.
    """
    front, budget = _front(shards), target * (1.0 - _DOMINATION_SLACK)

    def on(grid: float) -> Callable[[float], float]:
        return lambda sigma: _worst(front, search_steps, augment_steps, sigma, grid)

    coarse = _smallest_sigma(on(interval * _COARSE_FACTOR), budget, start, step=None)
    # The grids usually agree to far less than the tolerance: one probe a tolerance below usually settles it.
    return _smallest_sigma(on(interval), budget, coarse, step=_SIGMA_TOLERANCE)


def _smallest_sigma(epsilon_of: Callable[[float], float], target: float, start: float, *,
                    step: float | None) -> float:
    """The smallest evaluated σ with ε(σ) ≤ target, within _SIGMA_TOLERANCE of the crossing (ε falls with σ).

    The crossing is bracketed from ``start`` (by factors of 2 when ``step`` is None, else by ``step``, growing
    4x) and solved by Brent's method. Returning an *evaluated* feasible σ keeps the result on the safe side.
    """
    seen: dict[float, float] = {}

    def excess(sigma: float) -> float:
        if sigma not in seen:
            seen[sigma] = epsilon_of(sigma)
        return seen[sigma] - target

    def further(sigma: float, up: bool) -> float:
        nonlocal step
        if step is None:
            return sigma * 2.0 if up else sigma / 2.0
        moved, step = (sigma + step if up else sigma - step), step * 4.0
        return moved

    start = min(max(float(start), _MIN_SIGMA), _MAX_SIGMA)
    lo = hi = start
    if excess(start) <= 0:
        while lo > _MIN_SIGMA and excess(lo) <= 0:
            hi, lo = lo, max(further(lo, up=False), _MIN_SIGMA)
        if excess(lo) <= 0:  # the target is met with the least noise planned
            return lo
    else:
        while hi < _MAX_SIGMA and excess(hi) > 0:
            lo, hi = hi, min(further(hi, up=True), _MAX_SIGMA)
        if excess(hi) > 0:
            raise ValueError(f"no noise multiplier up to {_MAX_SIGMA:g} keeps ε within {target:g}")
    if hi - lo > _SIGMA_TOLERANCE * (1.0 + 1e-9):  # (a bracket of one step is within it, rounding aside)
        optimize.brentq(excess, lo, hi, xtol=_SIGMA_TOLERANCE / 2)
    return min(sigma for sigma, epsilon in seen.items() if epsilon <= target)


def _proportional_pairs(search_steps: int, augment_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, 2) (floor(f·T_s), floor(f·T_a)) for every distinct value as f grows over [0, 1], and (n,) those f.

    The pair changes only where f·T_s or f·T_a crosses an integer, i.e. at f = i/T_s or j/T_a; over the common
    denominator T_s·T_a those are the numerators i·T_a and j·T_s, and the pair at numerator m is
    (m // T_a, m // T_s), exactly, in integers.
    """
    t_s, t_a = int(search_steps), int(augment_steps)
    if t_s == 0 or t_a == 0:  # one stage alone: its step count is the only coordinate that moves
        count = np.arange(max(t_s, t_a) + 1, dtype=np.int64)
        zeros = np.zeros_like(count)
        pairs = np.stack([count, zeros] if t_a == 0 else [zeros, count], axis=1)
        return pairs, count / max(t_s, t_a, 1)
    numerators = np.union1d(np.arange(t_s + 1, dtype=np.int64) * t_a, np.arange(t_a + 1, dtype=np.int64) * t_s)
    return np.stack([numerators // t_a, numerators // t_s], axis=1), numerators / (t_s * t_a)


def _largest_within(shards: set[_Shard], pairs: np.ndarray, budget: float, interval: float) -> int:
    """The largest index i such that every shard's ε after ``pairs[i]`` (search, augment) steps is ≤ budget.

    ``pairs`` grow in both coordinates, so ε grows with i; ``pairs[0]`` must be within the budget. Over the
    non-dominated shards: a coarse-grid binary search, then a fine-grid gallop from its answer (the fine grid,
    the ledger's, alone decides).
    """
    front, slackened = _front(shards), budget * (1.0 - _DOMINATION_SLACK)

    def within(grid: float) -> Callable[[int], bool]:
        return lambda i: _worst(front, int(pairs[i][0]), int(pairs[i][1]), None, grid) <= slackened

    last = len(pairs) - 1
    coarse = within(interval * _COARSE_FACTOR)
    return _gallop(within(interval), last if coarse(last) else _bisect(coarse, 0, last), last)


def _bisect(within: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest i in [lo, hi) with within(i), given within(lo) and not within(hi) (monotone)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if within(mid) else (lo, mid)
    return lo


def _gallop(within: Callable[[int], bool], guess: int, last: int) -> int:
    """The largest i ≤ last with within(i) (true at 0, monotone), searched outwards from ``guess``."""
    if not within(guess):
        return _bisect(within, 0, guess)
    lo, step = guess, 1
    while lo + step <= last and within(lo + step):
        lo, step = lo + step, step * 2
    return _bisect(within, lo, min(lo + step, last + 1))


@dataclass(frozen=True)
class EpsilonRow:
    """The privacy columns of one log row, after ``step`` iterations. Arrays are (K,), party k at index k - 1."""

    step: int
    charged_steps: np.ndarray  # int64: search releases charged per shard so far (iterations + replays)
    epsilon: np.ndarray  # float64: tight PLD ε at the party's δ, the larger of its two composed ledgers'
    mu_gdp: np.ndarray  # float64: Theorem 3.1's μ, the larger of its two ledgers' (an approximation)
    augment_steps: np.ndarray | None = None  # int64: augment iterations charged so far (plus replays)


class FederationLedger:
    """Two ledgers per party (train → W releases, validation → A releases), stepped together.

    After the search, ``start_augment`` then ``record_augment_step`` charge the augment stage's releases on the
    same ledgers (each at its shard's augment rate; a rate 0 charges nothing), so every ε is the composition of
    both stages. ``charged_steps()`` keeps counting the search releases only; ``augment_steps()`` the augment's.

    ``epsilons()`` / ``mu_gdp()`` compute on the caller's thread (a new step count costs ~0.25 s per distinct
    party). For the log, ``submit(step)`` instead snapshots the counts and computes the same numbers on one
    background thread; ``ready()`` hands back the finished rows without blocking, ``drain()`` waits for the rest,
    ``close()`` stops the thread; ``settle(step, timeout=)`` (a failing run) adds a row for what was charged since
    the last one and returns what finishes in time. Both paths run the same code on the same counts, so they agree.
    """

    def __init__(self, plan: PrivacyPlan) -> None:
        self.plan = plan
        k = len(plan.delta)
        self.train = [PrivacyLedger() for _ in range(k)]
        self.val = [PrivacyLedger() for _ in range(k)]
        self._replays = np.zeros(k, dtype=np.int64)  # extra releases charged by charge_replays, per party
        # The ledgers hold both stages' releases; these count each stage's, per party.
        self._search_steps = np.zeros(k, dtype=np.int64)
        self.augment: AugmentReleases | None = None  # set by start_augment
        self._augment_steps = np.zeros(k, dtype=np.int64)
        self._augment_replays = np.zeros(k, dtype=np.int64)
        self._pending: deque[Future[EpsilonRow]] = deque()
        self._worker: _Worker | None = None
        self._last_submitted: tuple[np.ndarray, np.ndarray] | None = None  # the counts of the last row submitted

    # -- recording -----------------------------------------------------------------------------------------------
    def record_step(self) -> None:
        """One iteration: every party released ``plan.w_releases_per_step`` G_k (train; 2 under ADADP) and one H_k
        (validation). ``charged_steps()`` counts iterations."""
        for k in range(len(self.train)):
            self._charge(k, 1)

    def charge_replays(self, party: int, steps: int) -> None:
        """Charge ``steps`` extra releases to ``party`` (index 0..K-1) on BOTH its train and validation ledgers.

        After a crash and ``--resume``, a party may already have sent releases for steps after the last
        checkpoint. Those steps run again, and each is a second release on the same shards with the same (σ, q)
        and fresh noise: a further composition the guarantee must pay for, not a repeat it may skip.
        """
        self._check_replay(party, steps)
        self._charge(party, int(steps))
        self._replays[party] += int(steps)

    def charge_sent(self, sent_steps: Sequence[int], *, stage: Literal["search", "augment"] = "search") -> None:
        """Charge every party the ``stage`` iterations it says it sent beyond what the ledger counts.

        ``sent_steps[k]`` is party k+1's own count (from its journal, written before each send): after a crash
        and ``--resume`` the steps past the last checkpoint run again, and each is a further release.
        """
        charged = self.charged_steps() if stage == "search" else self.augment_steps()
        charge = self.charge_replays if stage == "search" else self.charge_augment_replays
        for k, (sent, counted) in enumerate(zip(sent_steps, charged, strict=True)):
            if sent > counted:
                charge(k, int(sent) - int(counted))

    def charged_steps(self) -> np.ndarray:
        """(K,) int64: search releases charged per shard so far, per party (its iterations plus its replays).

        The log's ``/privacy/charged_steps``: augment releases are not in it (see :meth:`augment_steps`).
        """
        return self._search_steps.copy()

    def start_augment(self, releases: AugmentReleases) -> None:
        """From now on, ``record_augment_step`` charges ``releases`` (σ_aug and each party's two augment rates).

        May be called again (a resume, a re-planned σ_aug): releases already charged keep the σ they were
        charged with. The rates, public facts of the pool, may not change once augment releases were charged.
        """
        if releases.sample_rate_train.shape != (len(self.train),):
            raise ValueError(f"the augment releases cover {len(releases.sample_rate_train)} parties, the ledger "
                             f"{len(self.train)}")
        if self.augment is not None and self._augment_steps.any():
            if not (np.array_equal(self.augment.sample_rate_train, releases.sample_rate_train)
                    and np.array_equal(self.augment.sample_rate_val, releases.sample_rate_val)):
                raise ValueError("the augment sample rates changed after augment releases were charged")
            if self.augment.releases_per_step != releases.releases_per_step:
                raise ValueError("the augment releases per step changed after augment releases were charged")
        self.augment = releases

    def record_augment_step(self) -> None:
        """One augment iteration: every party released ``augment.releases_per_step`` gradients of its pool (2 under
        ADADP). ``augment_steps()`` counts iterations."""
        for k in range(len(self.train)):
            self._charge_augment(k, 1)

    def charge_augment_replays(self, party: int, steps: int) -> None:
        """Charge ``steps`` replayed augment iterations to ``party`` (index 0..K-1), like :meth:`charge_replays`."""
        self._check_replay(party, steps)
        self._charge_augment(party, int(steps))
        self._augment_replays[party] += int(steps)

    def augment_steps(self) -> np.ndarray:
        """(K,) int64: augment iterations charged so far, per party (its iterations plus their replays; each pays
        ``augment.releases_per_step`` releases)."""
        return self._augment_steps.copy()

    # -- privacy (caller's thread) -------------------------------------------------------------------------------
    def epsilons(self) -> np.ndarray:
        """(K,) tight PLD ε per party at its δ: max over its two ledgers."""
        return _epsilons(self._parties())

    def mu_gdp(self) -> np.ndarray:
        """(K,) Theorem 3.1's μ per party (max over its two ledgers) — an approximation, not the guarantee."""
        return _mu_gdp(self._parties())

    # -- privacy (background thread) -----------------------------------------------------------------------------
    def submit(self, step: int) -> None:
        """Compute the log row of ``step`` on the background thread, from the counts as they are now."""
        if self._worker is None:
            self._worker = _Worker()
        charged, augment = self.charged_steps(), self.augment_steps()
        self._last_submitted = (charged, augment)
        self._pending.append(self._worker.submit(_row, int(step), charged, self._parties(), augment))

    def ready(self) -> list[EpsilonRow]:
        """The finished rows, in submission order, without blocking (a failed computation raises here)."""
        rows = []
        while self._pending and self._pending[0].done():
            rows.append(self._pending.popleft().result())
        return rows

    def drain(self) -> list[EpsilonRow]:
        """All submitted rows not yet returned, in submission order, waiting for the computation."""
        rows = [future.result() for future in self._pending]
        self._pending.clear()
        return rows

    def settle(self, step: int, *, timeout: float) -> list[EpsilonRow]:
        """On a failure: the rows submitted so far plus one for the counts as they are now (labelled ``step``, the
        last iteration recorded), as many as finish within ``timeout`` seconds, in order; then the thread stops.

        A failed run's log then shows the ε its ledgers charged up to the failure, not only what the worker
        happened to have finished. Rows that do not finish in time, or whose computation fails, are dropped with
        everything after them: the run is ending, and a resume charges everything anyway.
        """
        counts = (self.charged_steps(), self.augment_steps())
        if self._last_submitted is None or not all(
                np.array_equal(a, b) for a, b in zip(counts, self._last_submitted, strict=True)):
            self.submit(step)
        deadline, rows = time.monotonic() + timeout, []
        try:
            while self._pending:
                rows.append(self._pending[0].result(timeout=max(0.0, deadline - time.monotonic())))
                self._pending.popleft()
        except Exception:  # a timeout or a failed computation: keep the rows before it
            pass
        self.close(timeout=max(0.0, deadline - time.monotonic()))
        return rows

    def close(self, timeout: float | None = None) -> None:
        """Stop the background thread: rows not yet started are dropped (``drain()`` first to keep them).

        With ``timeout``, waits at most that long for a computation in progress (the thread is a daemon).
        """
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        if self._worker is not None:
            self._worker.close(timeout)
            self._worker = None

    # -- misc ----------------------------------------------------------------------------------------------------
    def description(self) -> str:
        return self.train[0].description()

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state; the ledgers hold every charged release, ``replays`` how many were replays.

        ``augment`` (once started): the releases being charged, and per party how many were charged and how
        many of those were replays.
        """
        state: dict[str, Any] = {"train": [t.state_dict() for t in self.train],
                                 "val": [v.state_dict() for v in self.val], "replays": self._replays.tolist()}
        if self.augment is not None:
            state["augment"] = {"releases": self.augment.state_dict(), "steps": self._augment_steps.tolist(),
                                "replays": self._augment_replays.tolist()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for ledger, saved in zip(self.train, state["train"], strict=True):
            ledger.load_state_dict(saved)
        for ledger, saved in zip(self.val, state["val"], strict=True):
            ledger.load_state_dict(saved)
        zeros = [0] * len(self.train)
        # A state written before replays were charged has none, one written before the augment no augment.
        self._replays = self._counts(state.get("replays", zeros), "replay")
        saved_augment = state.get("augment")
        self.augment = None if saved_augment is None else AugmentReleases.from_state_dict(saved_augment["releases"])
        self._augment_steps = self._counts(zeros if saved_augment is None else saved_augment["steps"], "augment step")
        self._augment_replays = self._counts(zeros if saved_augment is None else saved_augment["replays"],
                                             "augment replay")
        if self.augment is not None and self.augment.sample_rate_train.shape != (len(self.train),):
            raise ValueError("privacy ledger state: the augment releases cover a different number of parties")
        # What the ledgers hold minus the augment releases each one was charged is the search's release count:
        # w_releases_per_step per iteration on the train shard, one on the validation shard.
        releases_train, search_val = (np.array([ledger.steps for ledger in ledgers], dtype=np.int64) - charged
                                      for ledgers, charged in ((self.train, self._augment_charged("train")),
                                                               (self.val, self._augment_charged("val"))))
        search_train = releases_train // self.plan.w_releases_per_step
        if (np.any(search_train != search_val) or np.any(search_train < 0)
                or np.any(releases_train % self.plan.w_releases_per_step)):
            raise ValueError("privacy ledger state: a party's train and validation ledgers disagree on the step count")
        self._search_steps = search_train

    # -- internals -----------------------------------------------------------------------------------------------
    def _charge(self, party: int, steps: int) -> None:
        self.train[party].step(noise_multiplier=self.plan.params.noise_multiplier_w,
                               sample_rate=float(self.plan.sample_rate_train[party]),
                               num_steps=steps * self.plan.w_releases_per_step)
        self.val[party].step(noise_multiplier=self.plan.params.noise_multiplier_a,
                             sample_rate=float(self.plan.sample_rate_val[party]), num_steps=steps)
        self._search_steps[party] += steps

    def _charge_augment(self, party: int, steps: int) -> None:
        if self.augment is None:
            raise RuntimeError("augment releases charged before start_augment")
        for ledger, rate in ((self.train[party], float(self.augment.sample_rate_train[party])),
                             (self.val[party], float(self.augment.sample_rate_val[party]))):
            if rate > 0:  # a shard outside the pool is never touched: nothing to pay
                ledger.step(noise_multiplier=self.augment.noise_multiplier, sample_rate=rate,
                            num_steps=steps * self.augment.releases_per_step)
        self._augment_steps[party] += steps

    def _augment_charged(self, shard: Literal["train", "val"]) -> np.ndarray:
        """(K,) augment releases each party's ``shard`` ledger holds (0 where its rate is 0)."""
        if self.augment is None:
            return np.zeros(len(self.train), dtype=np.int64)
        rates = self.augment.sample_rate_train if shard == "train" else self.augment.sample_rate_val
        return np.where(rates > 0, self._augment_steps * self.augment.releases_per_step, 0)

    def _check_replay(self, party: int, steps: int) -> None:
        if not 0 <= party < len(self.train):
            raise ValueError(f"party index must be in 0..{len(self.train) - 1}, got {party}")
        if int(steps) != steps or steps < 0:
            raise ValueError(f"replayed steps must be a non-negative integer, got {steps}")

    def _counts(self, saved: Any, what: str) -> np.ndarray:
        counts = np.asarray(saved, dtype=np.int64)
        if counts.shape != (len(self.train),) or np.any(counts < 0):
            raise ValueError(f"invalid {what} counts in the privacy ledger state: {saved!r}")
        return counts

    def _parties(self) -> tuple[_Party, ...]:
        """An immutable snapshot of every party's ledgers and δ (what its ε depends on, and nothing else)."""
        return tuple(_Party(_runs(t), _runs(v), float(d), t.value_discretization_interval)
                     for t, v, d in zip(self.train, self.val, self.plan.delta, strict=True))


# -- internals ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Party:
    """Hashable: equal parties (same σ, q, counts, δ) are computed once."""

    train_runs: Runs
    val_runs: Runs
    delta: float
    interval: float

    def ledgers(self) -> tuple[PrivacyLedger, PrivacyLedger]:
        return _ledger(self.train_runs, self.interval), _ledger(self.val_runs, self.interval)


def _runs(ledger: PrivacyLedger) -> Runs:
    return tuple((float(s), float(q), int(c)) for s, q, c in ledger.state_dict()["runs"])


def _ledger(runs: Runs, interval: float) -> PrivacyLedger:
    ledger = PrivacyLedger(value_discretization_interval=interval)
    for noise_multiplier, sample_rate, count in runs:
        ledger.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=count)
    return ledger


def _epsilons(parties: tuple[_Party, ...]) -> np.ndarray:
    computed: dict[_Party, float] = {}
    for party in parties:
        if party not in computed:
            computed[party] = party_epsilon(*party.ledgers(), party.delta)
    return np.array([computed[party] for party in parties], dtype=np.float64)


def _mu_gdp(parties: tuple[_Party, ...]) -> np.ndarray:
    return np.array([max(ledger.mu_gdp() for ledger in party.ledgers()) for party in parties], dtype=np.float64)


def _row(step: int, charged_steps: np.ndarray, parties: tuple[_Party, ...], augment_steps: np.ndarray) -> EpsilonRow:
    return EpsilonRow(step, charged_steps, _epsilons(parties), _mu_gdp(parties), augment_steps)


class _Worker:
    """One daemon thread running submitted calls in order. Daemon: a crashing run does not wait for it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name="privacy-epsilon", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((future, fn, args))
        return future

    def close(self, timeout: float | None = None) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():  # cancelled by close()
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever reads the row
                future.set_exception(exc)
