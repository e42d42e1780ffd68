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
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpi_fnas.privacy.accountant import PrivacyLedger, calibrate_noise_multiplier, default_delta, party_epsilon
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
    deltas = party_deltas(train_sizes, val_sizes, delta)
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


@dataclass(frozen=True)
class EpsilonRow:
    """The privacy columns of one log row, after ``step`` iterations. Arrays are (K,), party k at index k - 1."""

    step: int
    charged_steps: np.ndarray  # int64: releases charged per shard so far (iterations + replays)
    epsilon: np.ndarray  # float64: tight PLD ε at the party's δ, the larger of its two ledgers'
    mu_gdp: np.ndarray  # float64: Theorem 3.1's μ, the larger of its two ledgers' (an approximation)


class FederationLedger:
    """Two ledgers per party (train → W releases, validation → A releases), stepped together.

    ``epsilons()`` / ``mu_gdp()`` compute on the caller's thread (a new step count costs ~0.25 s per distinct
    party). For the log, ``submit(step)`` instead snapshots the counts and computes the same numbers on one
    background thread; ``ready()`` hands back the finished rows without blocking, ``drain()`` waits for the rest,
    ``close()`` stops the thread. Both paths run the same code on the same counts, so they agree exactly.
    """

    def __init__(self, plan: PrivacyPlan) -> None:
        self.plan = plan
        k = len(plan.delta)
        self.train = [PrivacyLedger() for _ in range(k)]
        self.val = [PrivacyLedger() for _ in range(k)]
        self._replays = np.zeros(k, dtype=np.int64)  # extra releases charged by charge_replays, per party
        self._pending: deque[Future[EpsilonRow]] = deque()
        self._worker: _Worker | None = None

    # -- recording -----------------------------------------------------------------------------------------------
    def record_step(self) -> None:
        """One iteration: every party released one G_k (train) and one H_k (validation)."""
        for k in range(len(self.train)):
            self._charge(k, 1)

    def charge_replays(self, party: int, steps: int) -> None:
        """Charge ``steps`` extra releases to ``party`` (index 0..K-1) on BOTH its train and validation ledgers.

        After a crash and ``--resume``, a party may already have sent releases for steps after the last
        checkpoint. Those steps run again, and each is a second release on the same shards with the same (σ, q)
        and fresh noise: a further composition the guarantee must pay for, not a repeat it may skip.
        """
        if not 0 <= party < len(self.train):
            raise ValueError(f"party index must be in 0..{len(self.train) - 1}, got {party}")
        if int(steps) != steps or steps < 0:
            raise ValueError(f"replayed steps must be a non-negative integer, got {steps}")
        self._charge(party, int(steps))
        self._replays[party] += int(steps)

    def charged_steps(self) -> np.ndarray:
        """(K,) int64: releases charged per shard so far, per party (its iterations plus its replays)."""
        return np.array([ledger.steps for ledger in self.train], dtype=np.int64)

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
        self._pending.append(self._worker.submit(_row, int(step), self.charged_steps(), self._parties()))

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

    def close(self) -> None:
        """Stop the background thread: rows not yet started are dropped (``drain()`` first to keep them)."""
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # -- misc ----------------------------------------------------------------------------------------------------
    def description(self) -> str:
        return self.train[0].description()

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state; the ledgers hold every charged release, ``replays`` how many were replays."""
        return {"train": [t.state_dict() for t in self.train], "val": [v.state_dict() for v in self.val],
                "replays": self._replays.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for ledger, saved in zip(self.train, state["train"], strict=True):
            ledger.load_state_dict(saved)
        for ledger, saved in zip(self.val, state["val"], strict=True):
            ledger.load_state_dict(saved)
        # A state written before replays were charged has none.
        replays = np.asarray(state.get("replays", [0] * len(self.train)), dtype=np.int64)
        if replays.shape != self._replays.shape or np.any(replays < 0):
            raise ValueError(f"invalid replay counts in the privacy ledger state: {state.get('replays')!r}")
        self._replays = replays
        if any(t.steps != v.steps for t, v in zip(self.train, self.val, strict=True)):
            raise ValueError("privacy ledger state: a party's train and validation ledgers disagree on the step count")

    # -- internals -----------------------------------------------------------------------------------------------
    def _charge(self, party: int, steps: int) -> None:
        self.train[party].step(noise_multiplier=self.plan.params.noise_multiplier_w,
                               sample_rate=float(self.plan.sample_rate_train[party]), num_steps=steps)
        self.val[party].step(noise_multiplier=self.plan.params.noise_multiplier_a,
                             sample_rate=float(self.plan.sample_rate_val[party]), num_steps=steps)

    def _parties(self) -> tuple[_Party, ...]:
        """An immutable snapshot of every party's ledgers and δ (what its ε depends on, and nothing else)."""
        return tuple(_Party(_runs(t), _runs(v), float(d), t.value_discretization_interval)
                     for t, v, d in zip(self.train, self.val, self.plan.delta, strict=True))


# -- internals ---------------------------------------------------------------------------------------------------

Runs = tuple[tuple[float, float, int], ...]


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


def _row(step: int, charged_steps: np.ndarray, parties: tuple[_Party, ...]) -> EpsilonRow:
    return EpsilonRow(step, charged_steps, _epsilons(parties), _mu_gdp(parties))


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

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():  # cancelled by close()
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever reads the row
                future.set_exception(exc)
