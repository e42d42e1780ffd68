"""Planning a run's privacy, on rank 0 before any release, from public facts only (shard sizes, B, σ, T): what
the run will release and at what cost. The runtime ledger that charges the releases is :mod:`mpi_fnas.privacy.ledger`.

* sample rates q = B / N per shard;
* δ per party: ``privacy.delta``, refused unless below 1/N_k, or by default min(1e-5, 1/(10·N_k)), where N_k is
  the party's LARGER shard (each ledger needs δ below 1 over its own shard's size: see :func:`party_deltas`);
* with ``privacy.target_epsilon``: one σ for W and A (and the augmentation's, planned in the same job; or the
  search its ``privacy.search_share`` of the target and the augmentation the rest), calibrated so the worst party
  ends the job at the target;
* with ``privacy.max_epsilon``: how many steps the run may take before any party would exceed it.

:func:`plan_privacy` with ``augment`` plans both stages of one job against one budget; :func:`plan_augment`
plans the augment alone against what a ledger has already spent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import optimize

from mpi_fnas.privacy.accountant import (
    DEFAULT_VALUE_DISCRETIZATION,
    PrivacyLedger,
    Runs,
    calibrate_noise_multiplier,
    default_delta,
)
from mpi_fnas.privacy.ledger import FederationLedger
from mpi_fnas.privacy.params import DPParams
from mpi_fnas.privacy.release import AugmentReleases, PrivacyPlan


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
            spent = shard_ledger.runs()
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
