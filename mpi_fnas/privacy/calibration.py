"""Planning a run's privacy, on rank 0 before any release, from public facts only (shard sizes, B, σ, T): what
the run will release and at what cost. The runtime ledger that charges the releases is
:mod:`mpi_fnas.privacy.federation_ledger`.

* sample rates q = B / N per shard; δ per party (:func:`~mpi_fnas.privacy.shard_ledger.party_deltas`:
  ``privacy.delta`` or min(1e-5, 1/(10·N_k)), N_k the party's LARGER shard);
* with ``privacy.target_epsilon``: one σ for W and A (and the augmentation's, planned in the same job; or the
  search its ``privacy.search_share`` of the target and the augmentation the rest), calibrated so the worst party
  ends the job at the target;
* with ``privacy.max_epsilon``: how many steps the run may take before any party would exceed it.

:func:`plan_privacy` with ``augment`` plans both stages of one job against one budget; :func:`plan_augment`
plans the augment alone against what a ledger has already spent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
from scipy import optimize

from mpi_fnas.privacy.federation_ledger import FederationLedger
from mpi_fnas.privacy.monotone import bisect, gallop
from mpi_fnas.privacy.params import DPParams, PrivacyPlan
from mpi_fnas.privacy.release import AugmentReleases
from mpi_fnas.privacy.shard_ledger import (
    DEFAULT_VALUE_DISCRETIZATION,
    PrivacyLedger,
    Runs,
    calibrate_noise_multiplier,
    party_deltas,
)
from mpi_fnas.secagg.accounting import SecureAccounting


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
    step limit counts them. ``augment``: the augment stage planned in the same job (``steps`` its planned
    iterations, its σ kept unless ``target_epsilon`` calibrates it); the budget then covers both stages, and
    ``max_epsilon`` cuts both to the same fraction of their steps. The plan's ``augment`` is that stage as planned.
    """
    expected_batch_size = params.expected_batch_size
    n_tr, n_val = np.asarray(train_sizes, dtype=np.float64), np.asarray(val_sizes, dtype=np.float64)
    if np.any(n_tr < expected_batch_size) or np.any(n_val < expected_batch_size):
        smallest = int(min(n_tr.min(), n_val.min()))
        raise ValueError(f"search.batch_size {expected_batch_size:g} exceeds the smallest party shard ({smallest} "
                         "examples): the Poisson rate B/N must not exceed 1; set a smaller search.batch_size")
    q_tr, q_val = expected_batch_size / n_tr, expected_batch_size / n_val
    deltas = party_deltas(train_sizes, val_sizes, params.delta)
    r = int(w_releases_per_step)
    if r < 1:
        raise ValueError(f"W releases per step must be >= 1, got {w_releases_per_step}")
    if augment is not None:
        return _plan_job(q_tr, q_val, deltas, params, planned_steps, augment, r)
    sigma_w, sigma_a = float(params.noise_multiplier_w), float(params.noise_multiplier_a)
    secure = params.secure_accounting
    if params.target_epsilon is not None and secure is not None:
        sigma_w = sigma_a = _calibrate(_job_shards(q_tr, q_val, deltas, None, r, secure=secure), planned_steps, 0,
                                       params.target_epsilon)
    elif params.target_epsilon is not None:
        # The worst party has the largest rate and the smallest δ: calibrating there bounds everyone.
        worst_q = float(max(q_tr.max(), q_val.max()))
        # r·T releases at the worst rate bound both ledgers (the validation one has T): exact when q_tr binds.
        sigma_w = sigma_a = calibrate_noise_multiplier(params.target_epsilon, float(deltas.min()), worst_q,
                                                       planned_steps * r)
    steps, reason = planned_steps, "completed"
    if params.max_epsilon is not None:
        shards = _job_shards(q_tr, q_val, deltas, None, r, (sigma_w, sigma_a), secure=secure)
        steps = _steps_within(params.max_epsilon, shards, planned_steps)
        if steps < planned_steps:
            reason = f"max_epsilon reached: {params.max_epsilon:g} allows {steps} of {planned_steps} steps"
    return PrivacyPlan(params.with_noise(sigma_w, sigma_a), q_tr, q_val, deltas, steps, reason,
                       w_releases_per_step=r)


def _plan_job(q_tr: np.ndarray, q_val: np.ndarray, deltas: np.ndarray, params: DPParams, search_steps: int,
              augment: AugmentReleases, w_releases_per_step: int) -> PrivacyPlan:
    """plan_privacy of a job that runs the search and then the augment (rates and δ already checked)."""
    if augment.sample_rate_train.shape != q_tr.shape:
        raise ValueError(f"the augment releases cover {len(augment.sample_rate_train)} parties, the search "
                         f"{len(q_tr)}")
    target_epsilon, max_epsilon = params.target_epsilon, params.max_epsilon
    sigma_w, sigma_a = float(params.noise_multiplier_w), float(params.noise_multiplier_a)
    sigma_aug, augment_steps = float(augment.noise_multiplier), augment.steps
    shards = partial(_job_shards, q_tr, q_val, deltas, augment, w_releases_per_step,
                     secure=params.secure_accounting)
    if target_epsilon is not None and params.search_share is not None and search_steps > 0:
        # The search alone to its share of the target (σ_W = σ_A), then σ_aug to the whole target after it.
        sigma_w = sigma_a = _calibrate(shards(), search_steps, 0, params.search_share * target_epsilon)
        sigma_aug = _calibrate(shards((sigma_w, sigma_a)), search_steps, augment_steps, target_epsilon)
    elif target_epsilon is not None:
        # One σ for the three releases, the variable of every shard (None), solved on the exact composition.
        sigma_w = sigma_a = sigma_aug = _calibrate(shards(), search_steps, augment_steps, target_epsilon)
    steps, reason, augment_reason = search_steps, "completed", augment.stop_reason
    if max_epsilon is not None:
        pairs, fractions = _proportional_pairs(search_steps, augment_steps)
        chosen = _largest_within(shards((sigma_w, sigma_a), sigma_aug), pairs, max_epsilon,
                                 DEFAULT_VALUE_DISCRETIZATION)
        if chosen < len(pairs) - 1:
            steps, augment_steps = (int(n) for n in pairs[chosen])
            both = f"(search and augment cut to the same fraction of their steps, {fractions[chosen]:.4g})"
            reason = f"max_epsilon reached: {max_epsilon:g} allows {steps} of {search_steps} steps {both}"
            augment_reason = (f"max_epsilon reached: {max_epsilon:g} allows {augment_steps} of {augment.steps} "
                              f"augment steps {both}")
    planned = replace(augment, noise_multiplier=sigma_aug, steps=augment_steps, stop_reason=augment_reason)
    return PrivacyPlan(params.with_noise(sigma_w, sigma_a), q_tr, q_val, deltas, steps, reason, planned,
                       w_releases_per_step)


def plan_augment(ledger: FederationLedger, releases: AugmentReleases, params: DPParams) -> AugmentReleases:
    """Plan the augment stage alone, after ``ledger`` has spent what it holds (the search, its replays...).

    ``releases.steps``: the augment iterations still to come. ``params.target_epsilon`` (the whole job's budget):
    σ_aug calibrated so the worst party's composed ε (the ledger's releases, then the augment's) ends at it;
    refused (ValueError, one line) if a party already spent it. ``params.max_epsilon``: the most augment steps ≤
    ``releases.steps`` keeping every party within it (possibly 0; ``stop_reason`` says why). With neither,
    ``releases`` is returned unchanged."""
    if releases.sample_rate_train.shape != (len(ledger.train),):
        raise ValueError(f"the augment releases cover {len(releases.sample_rate_train)} parties, the ledger "
                         f"{len(ledger.train)}")
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
            try:
                sigma = _calibrate(_ledger_shards(ledger, None, releases), 0, releases.steps, target_epsilon,
                                   start=releases.noise_multiplier, interval=interval)
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
        pairs = _proportional_pairs(0, planned)[0]  # (0, T_a) for T_a = 0..planned: the augment alone
        steps = int(pairs[_largest_within(shards, pairs, max_epsilon, interval)][1])
        if steps < planned:
            releases = replace(releases, steps=steps, stop_reason=(
                f"max_epsilon reached: {max_epsilon:g} allows {steps} of {planned} augment steps after the "
                f"{spent[worst]:.4g} already spent (party {worst + 1})"))
    return releases


def _steps_within(budget: float, shards: set[_Shard], planned: int) -> int:
    """The largest T ≤ planned search steps whose worst ε over every shard (the ledger's grid) is ≤ budget.

    ε grows with T: a binary search. Every shard is searched, not only the non-dominated ones: no slack needed."""
    def within(steps: int) -> bool:
        return _worst(shards, steps, 0, None, DEFAULT_VALUE_DISCRETIZATION) <= budget

    return planned if within(planned) else bisect(within, 0, planned)


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
    secure: SecureAccounting | None = None  # secure aggregation's accountant (None: the local path's PLD)

    def ledger(self, search_steps: int, augment_steps: int, sigma: float | None, interval: float) -> PrivacyLedger:
        """The shard's ledger after the planned releases (σ None: the σ being calibrated, given as `sigma`)."""
        return PrivacyLedger.from_runs(self.runs(search_steps, augment_steps, sigma), interval, self.secure)

    def runs(self, search_steps: int, augment_steps: int, sigma: float | None) -> Runs:
        planned = ((self.search, search_steps * self.search_releases),
                   (self.augment, augment_steps * self.augment_releases))
        return self.spent + tuple((sigma if s is None else s, q, n) for (s, q), n in planned if q > 0 and n > 0)

    def dominates(self, other: _Shard) -> bool:
        """True when ``self``'s ε is at least ``other``'s at every σ and step count (in exact arithmetic).

        A higher rate, less noise, more releases or a smaller δ never lower ε: each is a post-processing
        argument (a rate-q' sample is a rate-q sample thinned; more noise is added noise; a release dropped).
        Secure aggregation's ε is a bound, not the mechanism's exact ε, and is not proven monotone in q: its shards
        never dominate one another (every one is evaluated; K is small).
        """
        if self.secure is not None or other.secure is not None:
            return self == other
        return (self.delta <= other.delta and _runs_dominate(self.spent, other.spent)
                and _release_dominates(self.search, self.search_releases, other.search, other.search_releases)
                and _release_dominates(self.augment, self.augment_releases, other.augment, other.augment_releases))


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


def _release_dominates(mine: tuple[float | None, float], my_count: int, other: tuple[float | None, float],
                       other_count: int) -> bool:
    """Whether ``my_count`` releases (σ, q) per iteration dominate ``other_count`` of ``other`` (q = 0: none)."""
    (my_sigma, my_rate), (other_sigma, other_rate) = mine, other
    if other_rate == 0.0:
        return True
    if my_rate < other_rate or my_count < other_count:
        return False
    if my_sigma is None or other_sigma is None:
        return my_sigma is None and other_sigma is None
    return my_sigma <= other_sigma


def _canonical_runs(runs: Sequence[Sequence[float]]) -> Runs:
    """Runs merged by (σ, q), sorted, without q = 0: composition is commutative, so equal ledgers compare equal."""
    return PrivacyLedger.from_runs(tuple(runs)).runs()


def _job_shards(q_tr: np.ndarray, q_val: np.ndarray, deltas: np.ndarray, augment: AugmentReleases | None,
                w_releases_per_step: int, search_sigmas: tuple[float, float] | None = None,
                augment_sigma: float | None = None, *, secure: SecureAccounting | None = None) -> set[_Shard]:
    """Every party's two shards before the job: nothing spent; (σ_W | σ_A, q) then (σ_aug, its augment rate).

    The train shard pays ``w_releases_per_step`` W releases per search iteration, the validation shard one."""
    sigma_w, sigma_a = search_sigmas if search_sigmas is not None else (None, None)
    if augment is None:  # the search alone: an augment stage that touches no shard
        augment = AugmentReleases(1.0, 1.0, 1.0, np.zeros_like(q_tr), np.zeros_like(q_val), steps=0)
    return {_Shard((), (sigma, float(q[k])), (augment_sigma, float(augment_q[k])), delta, releases,
                   augment.releases_per_step, secure)
            for k, delta in enumerate(deltas.tolist())
            for sigma, q, augment_q, releases in ((sigma_w, q_tr, augment.sample_rate_train, w_releases_per_step),
                                                  (sigma_a, q_val, augment.sample_rate_val, 1))}


def _ledger_shards(ledger: FederationLedger, augment_sigma: float | None, augment: AugmentReleases) -> set[_Shard]:
    """Every party's two shards as ``ledger`` holds them, followed by the augment releases (no search left)."""
    return {_Shard(shard_ledger.runs(), (None, 0.0), (augment_sigma, float(rate)), delta,
                   augment_releases=augment.releases_per_step, secure=ledger.secure)
            for k, delta in enumerate(ledger.plan.delta.tolist())
            for shard_ledger, rate in ((ledger.train[k], augment.sample_rate_train[k]),
                                       (ledger.val[k], augment.sample_rate_val[k]))}


def _front(shards: set[_Shard]) -> list[_Shard]:
    """The shards no other shard dominates: the worst party is always among them, so searches look at these."""
    ordered = sorted(shards, key=repr)  # a fixed order: the same plan on every rank and every run
    return [s for s in ordered if not any(o != s and o.dominates(s) for o in ordered)]


def _worst(shards: Iterable[_Shard], search_steps: int, augment_steps: int, sigma: float | None,
           interval: float) -> float:
    """The largest composed PLD ε over ``shards`` (each at its own δ)."""
    worst = 0.0
    for shard in shards:  # (the accountant caches ε per (runs, δ, grid): equal runs cost once)
        worst = max(worst, shard.ledger(search_steps, augment_steps, sigma, interval).get_epsilon(shard.delta))
    return worst


def _calibrate(shards: set[_Shard], search_steps: int, augment_steps: int, target: float, *, start: float = 1.0,
               interval: float = DEFAULT_VALUE_DISCRETIZATION) -> float:
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

    ``pairs`` grow in both coordinates, so ε grows with i; ``pairs[0]`` must be within the budget. As in
    :func:`_calibrate`: a coarse-grid binary search, then a fine-grid gallop from its answer.
    """
    front, slackened = _front(shards), budget * (1.0 - _DOMINATION_SLACK)

    def within(grid: float) -> Callable[[int], bool]:
        return lambda i: _worst(front, int(pairs[i][0]), int(pairs[i][1]), None, grid) <= slackened

    last = len(pairs) - 1
    coarse = within(interval * _COARSE_FACTOR)
    return gallop(within(interval), last if coarse(last) else bisect(coarse, 0, last), last)
