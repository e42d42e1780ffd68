"""A party's own privacy ledger and the cap no assignment can change (docs/privacy.md §2.12).

Rank 0's :class:`~mpi_fnas.privacy.federation_ledger.FederationLedger` counts every party's ε, but rank 0 may be the
adversary. So each DP party keeps its own account, from what only it knows: what one iteration of each launch of
a stage released on its two shards (σ, q = B / N of the shard it really samples, the count), written before that
launch's first send (:meth:`~mpi_fnas.federation.party_disk.PartyStore.begin_releases`), and its journals of the
iterations sent. Composed with rank 0's accountant (:class:`~mpi_fnas.privacy.shard_ledger.PrivacyLedger`, or the
secure RDP bound, at the same δ), that is the party's ε, equal to the log's in an honest run.

Before a stage's first iteration rank 0 announces how many iterations it will ask for; the party refuses, in one
line and before it sends anything, iterations that would take its ε past a cap of a config it verified itself
(:meth:`~mpi_fnas.privacy.params.DPParams.party_caps`): ``privacy.target_epsilon`` and ``privacy.max_epsilon``
over this run, ``privacy.party_max_epsilon`` over this run and its earlier runs on the same data
(:func:`with_earlier`). Rank 0 announces with the same function (:func:`iterations_within`), so an honest run
is never refused unless ``party_max_epsilon`` is below what it spends. No MPI, no autograd.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mpi_fnas.privacy.release import IterationReleases
from mpi_fnas.privacy.shard_ledger import PrivacyLedger, Runs, party_deltas, party_epsilon
from mpi_fnas.privacy.trusted_config import BudgetRefusedError

if TYPE_CHECKING:
    from mpi_fnas.secagg.accounting import SecureAccounting


def own_delta(delta: float | None, record: Sequence[Mapping[str, Any]], sizes: Sequence[int]) -> float:
    """The party's δ as rank 0's planner gives it (:func:`~mpi_fnas.privacy.shard_ledger.party_deltas`:
    ``privacy.delta``, or the default of its larger search shard), from its first search launch's shard sizes in
    its `record`, else from `sizes` (an augmentation without a search)."""
    searched = [segment["sizes"] for segment in record if segment["stage"] == "search"]
    n_train, n_val = searched[0] if searched else sizes
    return float(party_deltas([int(n_train)], [int(n_val)], delta)[0])


def spent_runs(segments: Sequence[Mapping[str, Any]], sent: Mapping[str, int]) -> tuple[Runs, Runs]:
    """A party's releases so far on (its train shard, its validation shard), from its own record.

    `segments`: every launch's ``{"stage", "from", "train", "val"}`` in the order written (``from``: the stage's
    journal count when that launch began sending); `sent`: each stage's journal count now. A segment's
    iterations run from its ``from`` to the next segment's of its stage, the last one's to the journal."""
    train: list[tuple[float, float, int]] = []
    val: list[tuple[float, float, int]] = []
    for index, segment in enumerate(segments):
        later = [s["from"] for s in segments[index + 1:] if s["stage"] == segment["stage"]]
        end = later[0] if later else int(sent.get(segment["stage"], 0))
        iterations = end - int(segment["from"])
        if iterations < 0:
            raise ValueError(f"the party's release record runs past its {segment['stage']} journal")
        on_train, on_val = IterationReleases.from_lists(segment["train"], segment["val"]).runs(iterations)
        train.extend(on_train)
        val.extend(on_val)
    return PrivacyLedger.from_runs(tuple(train)).runs(), PrivacyLedger.from_runs(tuple(val)).runs()


def epsilon_after(spent: tuple[Runs, Runs], per_iteration: IterationReleases, iterations: int, delta: float,
                  secure: SecureAccounting | None) -> float:
    """The party's ε at `delta` once `iterations` more iterations of `per_iteration` follow `spent`: the larger
    of its two shards' composed ε (as :meth:`~mpi_fnas.privacy.federation_ledger.FederationLedger.epsilons`)."""
    more = per_iteration.runs(iterations)
    return epsilon_of((spent[0] + more[0], spent[1] + more[1]), delta, secure)


def epsilon_of(runs: tuple[Runs, Runs], delta: float, secure: SecureAccounting | None) -> float:
    """ε at `delta` of a party whose (train, validation) shards released `runs`: the larger of the two."""
    train, val = (PrivacyLedger.from_runs(shard, secure=secure) for shard in runs)
    return party_epsilon(train, val, delta)


def iterations_within(cap: float, spent: tuple[Runs, Runs], per_iteration: IterationReleases, delta: float,
                      secure: SecureAccounting | None, requested: int) -> int:
    """The most iterations n ≤ `requested` whose releases after `spent` keep the party's ε ≤ `cap` (ε grows with
    n: one evaluation when all fit, else a bisection). Rank 0 announces with it, the party checks with it."""
    def within(n: int) -> bool:
        return epsilon_after(spent, per_iteration, n, delta, secure) <= cap

    if requested <= 0 or within(requested):
        return max(int(requested), 0)
    if not within(0):
        return 0
    lo, hi = 0, int(requested)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if within(mid) else (lo, mid)
    return lo


def recorded_epsilon(record: Sequence[Mapping[str, Any]], sent: Mapping[str, int], delta: float | None) -> float:
    """A party's ε from its own directory alone: its `record` (``releases.pt``), its journals' counts `sent` and
    ``privacy.delta`` (None: the default); secure aggregation's constants are its last launch's."""
    if not record:
        return 0.0
    secure = record[-1]["secure"]
    accounting = None
    if secure is not None:
        from mpi_fnas.secagg.accounting import SecureAccounting

        accounting = SecureAccounting(*(int(value) for value in secure))
    return epsilon_of(spent_runs(record, sent), own_delta(delta, record, record[-1]["sizes"]), accounting)


Earlier = Sequence[tuple[Sequence[Mapping[str, Any]], Mapping[str, int], bool]]


def with_earlier(spent: tuple[Runs, Runs], secure: SecureAccounting | None, earlier: Earlier,
                 ) -> tuple[tuple[Runs, Runs], SecureAccounting | None]:
    """`spent` with the releases of the party's `earlier` runs on the same data (each its ``(record, sent,
    same_split)``), and the accounting that bounds them all: secure aggregation's bound grows with D, so the largest
    D of any of them (:class:`~mpi_fnas.secagg.accounting.SecureAccounting`). A run that split the data otherwise
    (another seed) may have held any example in either shard, so both of its shards' releases count on both."""
    train, val = spent
    for record, sent, same_split in earlier:
        more = spent_runs(record, sent)
        if same_split:
            train, val = train + more[0], val + more[1]
        else:
            both = more[0] + more[1]
            train, val = train + both, val + both
        constants = record[-1]["secure"] if record else None
        if secure is not None and constants is not None and int(constants[2]) > secure.dimension:
            secure = dataclasses.replace(secure, dimension=int(constants[2]))
    return (train, val), secure


def check_request(cap: tuple[float, str], record: Sequence[Mapping[str, Any]], sent: Mapping[str, int],
                  per_iteration: IterationReleases, delta: float | None, sizes: Sequence[int],
                  secure: SecureAccounting | None, requested: int, *, rank: int, stage: str,
                  earlier: Earlier = ()) -> None:
    """Raise :class:`~mpi_fnas.privacy.trusted_config.BudgetRefusedError` when the `requested` iterations of
    `stage` rank 0 announced, after what the party's `record` and journals (`sent`) say it released, and what its
    `earlier` runs on the same data released (:func:`with_earlier`), would take its ε past
    `cap` (``(ε, its config key)``). `delta`: ``privacy.delta``; `sizes`: this launch's search shard sizes
    (:func:`own_delta`)."""
    spent, secure = with_earlier(spent_runs(record, sent), secure, earlier)
    at = own_delta(delta, record, sizes)
    allowed = iterations_within(cap[0], spent, per_iteration, at, secure, requested)
    if allowed < requested:
        now = epsilon_of(spent, at, secure)
        runs = f", and {len(earlier)} earlier run(s) on the same data" if earlier else ""
        raise BudgetRefusedError(
            f"rank {rank} refuses the {requested} {stage} iterations rank 0 asks for: its own cap {cap[1]} "
            f"{cap[0]:g} allows {allowed} after what it has sent (ε = {now:.4g}, {sent.get(stage, 0)} {stage} "
            f"iterations{runs}); nothing more was sent")
