"""What a party really spent over the sweep: its ε composed (PLD) over every run that released its examples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mpi_fnas.sweep.results import LogReleases, PointResult


@dataclass(frozen=True)
class SweepComposition:
    """The privacy of the examples of one data pool, composed over every log of the sweep that released them.

    ``per_party`` is set when every log gave party k the same shards (one placement): then party k's ε is the
    PLD composition of its train ledgers over the logs, and of its validation ledgers, the larger of the two (the
    shards are disjoint), at its own δ (the smallest over the logs). Otherwise (CIFAR-10 over several seeds: an
    image may have been in any party's train or validation shard in each placement) ``per_party`` is None and
    ``epsilon`` is the worst case over placements: per log one release sequence with the smallest σ, the largest
    rate and the largest count of any party and shard, at the smallest δ. A larger rate, a smaller σ and more
    releases each dominate (the subsampled Gaussian's privacy profile grows with q, shrinks with σ), and
    composition keeps dominance, so this bounds every placement and is exact when all shards had the same rate.
    """

    data_pool: str
    logs: tuple[str, ...]
    epsilon: float  # the worst party (or the worst-case placement): what the pool's most exposed example spent
    delta: float  # the δ `epsilon` holds at (the largest of the parties' δ when per party)
    per_party: tuple[float, ...] | None
    exact: bool  # False: some log's releases are an upper bound (see log_releases), so is `epsilon`

    @property
    def runs(self) -> int:
        """Number of sweep points (run directories) composed."""
        return len({name.split("/")[0] for name in self.logs})

    def describe(self) -> str:
        """One line saying how the sweep's ε was composed."""
        how = ("per party: same shards in every run" if self.per_party is not None
               else "worst case over placements: the seeds re-partition the same examples")
        bound = "" if self.exact else "; upper bound: unfinished runs or requeues counted at their plan"
        return (f"{self.data_pool}: {self.runs} run{'s' if self.runs != 1 else ''}, {how} → ε = {self.epsilon:.4g} "
                f"at δ = {self.delta:.3g}{bound}")


def compose_sweep(results: Sequence[PointResult]) -> list[SweepComposition]:
    """One composition per data pool over every log of `results` (finished or not: an unfinished run released
    data too), sorted by pool. Empty when any result lacks its release facts (built by hand, not read)."""
    if not results or any(not r.releases for r in results):
        return []
    pools: dict[str, list[LogReleases]] = {}
    for r in results:
        for released in r.releases:
            pools.setdefault(released.data_pool, []).append(released)
    return [compose_pool(pool, pools[pool]) for pool in sorted(pools)]


def compose_pool(pool: str, logs: Sequence[LogReleases]) -> SweepComposition:
    """Compose the releases of `logs` (all of data pool `pool`) with the PLD accountant; see SweepComposition."""
    from mpi_fnas.privacy import PrivacyLedger

    exact = all(r.exact for r in logs)
    names = tuple(r.log for r in logs)
    if len({r.placement for r in logs}) == 1:
        per_party = []
        deltas = []
        for k in range(len(logs[0].releases)):
            train, val = PrivacyLedger(), PrivacyLedger()
            for r in logs:
                train.step(noise_multiplier=r.noise_multiplier_w[k], sample_rate=r.sample_rate_train[k],
                           num_steps=r.releases[k] * r.w_releases_per_step)
                val.step(noise_multiplier=r.noise_multiplier_a[k], sample_rate=r.sample_rate_val[k],
                         num_steps=r.releases[k])
            delta = min(r.delta[k] for r in logs)  # a bound at the smallest δ holds at every larger one
            per_party.append(max(train.get_epsilon(delta), val.get_epsilon(delta)))
            deltas.append(delta)
        return SweepComposition(pool, names, max(per_party), max(deltas), tuple(per_party), exact)
    worst = PrivacyLedger()
    for r in logs:
        worst.step(noise_multiplier=min(*r.noise_multiplier_w, *r.noise_multiplier_a),
                   sample_rate=max(*r.sample_rate_train, *r.sample_rate_val),
                   num_steps=max(r.releases) * r.w_releases_per_step)
    delta = min(min(r.delta) for r in logs)
    return SweepComposition(pool, names, worst.get_epsilon(delta), delta, None, exact)


def worst_of(compositions: Sequence[SweepComposition]) -> SweepComposition | None:
    """The composition with the largest ε (None if there is none)."""
    return max(compositions, key=lambda c: c.epsilon, default=None)


def touched_by(result: PointResult, compositions: Sequence[SweepComposition]) -> list[SweepComposition]:
    """The compositions of the data pools `result`'s logs released."""
    pools = {released.data_pool for released in result.releases}
    return [c for c in compositions if c.data_pool in pools]
