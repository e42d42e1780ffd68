"""The runtime privacy ledger of a federation: every release every party has made, per party and per dataset
(its train and its validation shard), and the ε it has cost.

:class:`FederationLedger` records every iteration of every party (the releases its plan says one makes) and the
releases a party replays after a resume, and reports per party the tight PLD ε (the headline) and Theorem 3.1's
μ-GDP (a CLT approximation, logged for comparison only). A party's guarantee is the larger of its two ledgers',
since its train and validation shards are disjoint (Theorem 3.1). What the run will release is planned before it,
in :mod:`mpi_fnas.privacy.calibration`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from mpi_fnas.privacy.params import PrivacyPlan
from mpi_fnas.privacy.party_ledger import iterations_within
from mpi_fnas.privacy.release import AugmentReleases, IterationReleases
from mpi_fnas.privacy.shard_ledger import PrivacyLedger, Runs, party_epsilon
from mpi_fnas.privacy.worker import OrderedWorker
from mpi_fnas.secagg.accounting import SecureAccounting

Stage = Literal["search", "augment"]
STAGES: tuple[Stage, ...] = ("search", "augment")


@dataclass(frozen=True)
class EpsilonRow:
    """The privacy columns of one log row, after ``step`` iterations. Arrays are (K,), party k at index k - 1."""

    step: int
    charged_steps: np.ndarray  # int64: search releases charged per shard so far (iterations + replays)
    epsilon: np.ndarray  # float64: tight PLD ε at the party's δ, the larger of its two composed ledgers'
    mu_gdp: np.ndarray  # float64: Theorem 3.1's μ, the larger of its two ledgers' (an approximation)
    augment_steps: np.ndarray | None = None  # int64: augment iterations charged so far (plus replays)
    # float64: under secure aggregation, ε if K − 1 parties collude with the server (None under local: the same)
    epsilon_collusion: np.ndarray | None = None


class FederationLedger:
    """Two ledgers per party (train → W releases, validation → A releases), stepped together.

    After the search, ``start_augment`` then ``record_step("augment")`` charge the augment stage's releases on the
    same ledgers: they sample a pool of the party's records, so each shard's ledger pays at its records' rate
    (nothing for a shard outside the pool), and the party's ε stays the larger of its two *composed* ledgers'.
    ``charged_steps(stage)`` counts each stage's iterations apart.

    ε depends on public counts only: ``epsilons()`` / ``mu_gdp()`` compute it on the caller's thread (a new step
    count costs ~0.25 s per distinct party), ``submit(step)`` on one background thread while the parties train,
    its rows handed back by ``ready()``, ``drain()`` and ``settle()``. Both paths run the same code on the same
    counts, so they agree.
    """

    def __init__(self, plan: PrivacyPlan) -> None:
        self.plan = plan
        k = len(plan.delta)
        self.secure = plan.params.secure_accounting  # None: local noise, PLD
        self.train = [PrivacyLedger(secure=self.secure) for _ in range(k)]
        self.val = [PrivacyLedger(secure=self.secure) for _ in range(k)]
        # Each stage's releases alone, beside the composed ledgers: what DPNAS reports (its search not charged).
        self._alone = {stage: ([PrivacyLedger(secure=self.secure) for _ in range(k)],
                               [PrivacyLedger(secure=self.secure) for _ in range(k)]) for stage in STAGES}
        # The ledgers hold both stages' releases; these count each stage's iterations and replays, per party.
        self._steps = {stage: np.zeros(k, dtype=np.int64) for stage in STAGES}
        self._replays = {stage: np.zeros(k, dtype=np.int64) for stage in STAGES}
        self.augment: AugmentReleases | None = None  # set by start_augment
        self._pending: deque[Future[EpsilonRow]] = deque()
        self._worker: OrderedWorker | None = None
        self._last_submitted: tuple[list[int], list[int]] | None = None  # the counts of the last row submitted

    # -- recording -----------------------------------------------------------------------------------------------
    def record_step(self, stage: Stage = "search") -> None:
        """One iteration of `stage` by every party: a search iteration releases ``plan.w_releases_per_step`` G_k
        (train; 2 under ADADP) and one H_k (validation); an augment iteration ``augment.releases_per_step``
        gradients of the party's pool (2 under ADADP; :meth:`start_augment` first). The counts are iterations."""
        for k in range(len(self.train)):
            self._charge(k, 1, stage)

    def charge_replays(self, party: int, steps: int, *, stage: Stage = "search") -> None:
        """Charge ``steps`` extra iterations of `stage` to ``party`` (index 0..K-1).

        After a crash and ``--resume``, a party may already have sent releases for steps after the last
        checkpoint. Those steps run again, and each is a second release on the same shards with the same (σ, q)
        and fresh noise: a further composition the guarantee must pay for, not a repeat it may skip.
        """
        if not 0 <= party < len(self.train):
            raise ValueError(f"party index must be in 0..{len(self.train) - 1}, got {party}")
        if int(steps) != steps or steps < 0:
            raise ValueError(f"replayed steps must be a non-negative integer, got {steps}")
        self._charge(party, int(steps), stage)
        self._replays[stage][party] += int(steps)

    def charge_sent(self, sent_steps: Sequence[int], *, stage: Stage = "search") -> None:
        """Charge every party, as replays, the ``stage`` iterations it says it sent beyond what the ledger counts.

        ``sent_steps[k]`` is party k+1's own count, from its journal (written before each send)."""
        for k, (sent, counted) in enumerate(zip(sent_steps, self._steps[stage], strict=True)):
            if sent > counted:
                self.charge_replays(k, int(sent) - int(counted), stage=stage)

    def charged_steps(self, stage: Stage = "search") -> np.ndarray:
        """(K,) int64: iterations of `stage` charged so far, per party (its iterations plus its replays; each pays
        the stage's releases per iteration). The search's are the log's ``/privacy/charged_steps``, the
        augmentation's its ``/augment/privacy/charged_steps``: neither counts the other stage's."""
        return self._steps[stage].copy()

    def start_augment(self, releases: AugmentReleases) -> None:
        """From now on, ``record_step("augment")`` charges ``releases`` (σ_aug and each party's two augment rates).

        May be called again (a resume, a re-planned σ_aug): releases already charged keep the σ they were
        charged with. The rates, public facts of the pool, may not change once augment releases were charged.
        """
        if releases.sample_rate_train.shape != (len(self.train),):
            raise ValueError(f"the augment releases cover {len(releases.sample_rate_train)} parties, the ledger "
                             f"{len(self.train)}")
        if self.augment is not None and self._steps["augment"].any():
            if not (np.array_equal(self.augment.sample_rate_train, releases.sample_rate_train)
                    and np.array_equal(self.augment.sample_rate_val, releases.sample_rate_val)):
                raise ValueError("the augment sample rates changed after augment releases were charged")
            if self.augment.releases_per_step != releases.releases_per_step:
                raise ValueError("the augment releases per step changed after augment releases were charged")
        self.augment = releases

    # -- privacy (caller's thread) -------------------------------------------------------------------------------
    def epsilons(self) -> np.ndarray:
        """(K,) tight PLD ε per party at its δ: max over its two ledgers."""
        return _epsilons(self._parties())

    def mu_gdp(self) -> np.ndarray:
        """(K,) Theorem 3.1's μ per party (max over its two ledgers) — an approximation, not the guarantee."""
        return _mu_gdp(self._parties())

    def epsilons_server(self) -> np.ndarray | None:
        """(K,) ε per party against the server alone, when the guarantee lets ``privacy.colluders`` parties
        collude with it (secure aggregation, t > 0); else None (then it is :meth:`epsilons`)."""
        return _server(self._parties())

    def epsilons_collusion(self) -> np.ndarray | None:
        """(K,) ε per party if K − 1 parties collude with the server (secure aggregation), else None."""
        return _collusion(self._parties())

    def epsilons_alone(self, stage: Stage) -> np.ndarray:
        """(K,) ε per party of `stage`'s releases alone, as if the other stage had released nothing: the
        augmentation's is what DPNAS reports (its search not charged). Not the guarantee: :meth:`epsilons`."""
        train, val = self._alone[stage]
        return _epsilons(self._parties(train, val))

    # -- privacy (background thread) -----------------------------------------------------------------------------
    def submit(self, step: int) -> None:
        """Compute the log row of ``step`` on the background thread, from the counts as they are now."""
        if self._worker is None:
            self._worker = OrderedWorker()
        step, parties = int(step), self._parties()
        charged, augment = self.charged_steps(), self.charged_steps("augment")
        self._last_submitted = (charged.tolist(), augment.tolist())
        self._pending.append(self._worker.submit(
            lambda: EpsilonRow(step, charged, _epsilons(parties), _mu_gdp(parties), augment, _collusion(parties))))

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
        if self._last_submitted != (self._steps["search"].tolist(), self._steps["augment"].tolist()):
            self.submit(step)
        deadline, rows = time.monotonic() + timeout, []
        with suppress(Exception):  # a timeout or a failed computation: keep the rows before it
            while self._pending:
                rows.append(self._pending[0].result(timeout=max(0.0, deadline - time.monotonic())))
                self._pending.popleft()
        self.close(timeout=max(0.0, deadline - time.monotonic()))
        return rows

    def close(self, timeout: float | None = None) -> None:
        """Stop the background thread, dropping rows not yet started (``drain()`` first to keep them); with
        ``timeout``, wait at most that long for a computation in progress (the thread is a daemon)."""
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        if self._worker is not None:
            self._worker.close(timeout)
            self._worker = None

    # -- what an iteration releases, and how many fit under a cap ------------------------------------------------
    def iteration_releases(self, party: int, stage: Stage) -> IterationReleases:
        """What one iteration of `stage` releases on party ``party``'s (index 0..K-1) two shards: the search's
        ``w_releases_per_step`` W releases (train) and one A release (validation); the augmentation's releases
        of its pool (:meth:`start_augment` first)."""
        if stage == "search":
            releases = self.plan.params.search_releases(self.plan.w_releases_per_step)
            return IterationReleases.of(releases["W"], self.plan.sample_rate_train[party], releases["A"],
                                        self.plan.sample_rate_val[party])
        augment = self.augment
        if augment is None:
            raise RuntimeError("augment releases asked for before start_augment")
        return IterationReleases.of(augment.release, augment.sample_rate_train[party], augment.release,
                                    augment.sample_rate_val[party])

    def iterations_within(self, cap: float, stage: Stage, requested: int) -> np.ndarray:
        """(K,) for each party, the most iterations ≤ `requested` of `stage` after what it was charged that keep
        its ε ≤ `cap`: :func:`~mpi_fnas.privacy.party_ledger.iterations_within`, the function each party checks
        rank 0's announcement with, on its own record."""
        return np.array([iterations_within(cap, (self.train[k].runs(), self.val[k].runs()),
                                           self.iteration_releases(k, stage), float(self.plan.delta[k]), self.secure,
                                           requested) for k in range(len(self.train))], dtype=np.int64)

    # -- misc ----------------------------------------------------------------------------------------------------
    def description(self) -> str:
        """One line naming the accountant and mechanism behind the ledger's ε."""
        return self.train[0].description()

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state: the ledgers hold every charged release, ``replays`` how many were replays;
        ``augment`` (once started) the releases being charged and per party the iterations charged and replayed."""
        state: dict[str, Any] = {"train": [ledger.state_dict() for ledger in self.train],
                                 "val": [ledger.state_dict() for ledger in self.val],
                                 "replays": self._replays["search"].tolist()}
        if self.augment is not None:
            state["augment"] = {"releases": self.augment.state_dict(), "steps": self._steps["augment"].tolist(),
                                "replays": self._replays["augment"].tolist()}
        state["alone"] = {stage: {"train": [ledger.state_dict() for ledger in train],
                                  "val": [ledger.state_dict() for ledger in val]}
                          for stage, (train, val) in self._alone.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state written by :meth:`state_dict`."""
        for ledgers, key in ((self.train, "train"), (self.val, "val")):
            for ledger, saved in zip(ledgers, state[key], strict=True):
                ledger.load_state_dict(saved)
        zeros = [0] * len(self.train)
        # A state written before replays were charged has none, one written before the augment no augment.
        self._replays["search"] = self._counts(state.get("replays", zeros), "replay")
        saved_augment = state.get("augment") or {"steps": zeros, "replays": zeros}
        self.augment = AugmentReleases.from_state_dict(saved_augment["releases"]) if "releases" in saved_augment \
            else None
        self._steps["augment"] = self._counts(saved_augment["steps"], "augment step")
        self._replays["augment"] = self._counts(saved_augment["replays"], "augment replay")
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
        self._steps["search"] = search_train
        self._load_alone(state.get("alone"))

    def _load_alone(self, saved: dict[str, Any] | None) -> None:
        """Each stage's releases alone, as saved; a state written before they were kept rebuilds them from the
        stages' counts at the releases the ledger now charges (exact unless σ_aug was re-planned mid-stage)."""
        for stage, (train, val) in self._alone.items():
            fresh = [PrivacyLedger(secure=self.secure) for _ in range(len(self.train))], \
                [PrivacyLedger(secure=self.secure) for _ in range(len(self.train))]
            if saved is not None:
                for ledgers, key in zip(fresh, ("train", "val"), strict=True):
                    for ledger, one in zip(ledgers, saved[stage][key], strict=True):
                        ledger.load_state_dict(one)
            elif stage == "search" or self.augment is not None:
                for party in range(len(self.train)):
                    _pay(fresh[0][party], fresh[1][party], self.iteration_releases(party, stage),
                         int(self._steps[stage][party]))
            train[:], val[:] = fresh

    # -- internals -----------------------------------------------------------------------------------------------
    def _charge(self, party: int, steps: int, stage: Stage) -> None:
        if stage == "augment" and self.augment is None:
            raise RuntimeError("augment releases charged before start_augment")
        releases = self.iteration_releases(party, stage)
        _pay(self.train[party], self.val[party], releases, steps)
        _pay(self._alone[stage][0][party], self._alone[stage][1][party], releases, steps)
        self._steps[stage][party] += steps

    def _augment_charged(self, shard: Literal["train", "val"]) -> np.ndarray:
        """(K,) augment releases each party's ``shard`` ledger holds (0 where its rate is 0)."""
        if self.augment is None:
            return np.zeros(len(self.train), dtype=np.int64)
        rates = self.augment.sample_rate_train if shard == "train" else self.augment.sample_rate_val
        return np.where(rates > 0, self._steps["augment"] * self.augment.releases_per_step, 0)

    def _counts(self, saved: Any, what: str) -> np.ndarray:
        counts = np.asarray(saved, dtype=np.int64)
        if counts.shape != (len(self.train),) or np.any(counts < 0):
            raise ValueError(f"invalid {what} counts in the privacy ledger state: {saved!r}")
        return counts

    def _parties(self, train: Sequence[PrivacyLedger] | None = None,
                 val: Sequence[PrivacyLedger] | None = None) -> tuple[_Party, ...]:
        """An immutable snapshot of every party's ledgers (the composed ones unless `train` and `val` are given)
        and δ: what its ε depends on, and nothing else."""
        train, val = (self.train, self.val) if train is None or val is None else (train, val)
        return tuple(_Party(_runs(t), _runs(v), float(d), t.value_discretization_interval, self.secure)
                     for t, v, d in zip(train, val, self.plan.delta, strict=True))


# -- internals ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Party:
    """Hashable: equal parties (same σ, q, counts, δ) are computed once."""

    train_runs: Runs
    val_runs: Runs
    delta: float
    interval: float
    secure: SecureAccounting | None = None

    def ledgers(self) -> tuple[PrivacyLedger, ...]:
        return tuple(PrivacyLedger.from_runs(runs, self.interval, self.secure)
                     for runs in (self.train_runs, self.val_runs))


def _pay(train: PrivacyLedger, val: PrivacyLedger, releases: IterationReleases, iterations: int) -> None:
    """Charge `iterations` iterations of `releases` to a party's train and validation ledgers (a shard outside the
    augment pool, rate 0, is never touched: nothing to pay)."""
    for ledger, (sigma, rate, per_iteration) in ((train, releases.train), (val, releases.val)):
        if rate > 0 and iterations:
            ledger.step(noise_multiplier=sigma, sample_rate=rate, num_steps=iterations * per_iteration)


def _runs(ledger: PrivacyLedger) -> Runs:
    return tuple((float(s), float(q), int(c)) for s, q, c in ledger.state_dict()["runs"])


def _epsilons(parties: tuple[_Party, ...]) -> np.ndarray:
    computed = {party: party_epsilon(*party.ledgers(), party.delta) for party in dict.fromkeys(parties)}  # once each
    return np.array([computed[party] for party in parties], dtype=np.float64)


def _collusion(parties: tuple[_Party, ...]) -> np.ndarray | None:
    if not parties or parties[0].secure is None:
        return None
    return _per_party(parties, PrivacyLedger.get_epsilon_collusion)


def _server(parties: tuple[_Party, ...]) -> np.ndarray | None:
    if not parties or parties[0].secure is None or parties[0].secure.colluders == 0:
        return None
    return _per_party(parties, PrivacyLedger.get_epsilon_server)


def _per_party(parties: tuple[_Party, ...], epsilon: Callable[[PrivacyLedger, float], float]) -> np.ndarray:
    """(K,) the larger of `epsilon` over each party's two ledgers at its δ (computed once per distinct party)."""
    computed = {party: max(epsilon(ledger, party.delta) for ledger in party.ledgers())
                for party in dict.fromkeys(parties)}
    return np.array([computed[party] for party in parties], dtype=np.float64)


def _mu_gdp(parties: tuple[_Party, ...]) -> np.ndarray:
    return np.array([max(ledger.mu_gdp() for ledger in party.ledgers()) for party in parties], dtype=np.float64)
