"""Planning the augmentation on rank 0: each party's pool, the step counts, and the privacy of its releases.

No MPI and no autograd here. The pools follow from the search's partition (the same pure function of the config),
so the augmentation trains on exactly the shards the search used and the privacy ledgers of the search continue.
An unreliable party corrupts its pool as it corrupted its shards (the same examples: ``train_count`` tells it
where its train shard ends), and a selection gathers the releases here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mpi_fnas.config import Config
from mpi_fnas.federation.plan import Assignment, SetupError, augment_demand, augment_pools, augment_steps
from mpi_fnas.privacy import DPParams
from mpi_fnas.privacy.ledger import FederationLedger
from mpi_fnas.privacy.planning import plan_augment
from mpi_fnas.privacy.release import AugmentReleases
from mpi_fnas.space import search_space


@dataclass
class AugmentAssignment:
    """What the server tells a party at the start of the augmentation."""

    pool_indices: np.ndarray  # global indices into the train split: the party's train shard (then its val shard)
    genotype: str
    steps_per_epoch: int
    steps: int
    releases: AugmentReleases | None  # the DP releases' public constants (None: exact gradients)
    params: DPParams | None  # the run's privacy parameters (where the party's randomness comes from)
    checkpoint_step: int = 0  # > 0 when resuming: the party restores its own state of that step
    train_count: int = 0  # the first train_count pool indices are the search's train shard, the rest its val shard
    corruption: float = 0.0  # the fraction of each shard the party replaces by noise, as in the search
    gathered: bool = False  # the server gathers every release (a selection) instead of a Reduce


@dataclass
class AugmentPlan:
    """Rank 0's plan of the augmentation."""

    assignments: list[AugmentAssignment]
    genotype: Any  # the space's genotype (mpi_fnas.space.Genotype, mpi_fnas.space.dpnas.DpnasGenotype)
    steps_per_epoch: int
    steps: int
    releases: AugmentReleases | None
    stop_reason: str

    @property
    def pool_sizes(self) -> list[int]:
        return [len(a.pool_indices) for a in self.assignments]


def parse_genotype(text: str, where: str, kind: str = "darts") -> Any:
    """A genotype string of space `kind` (its genotype's ``to_string``) that a network can be built from; SetupError
    naming `where` when it does not parse or cannot be trained (a DPNAS cell cut off from its input)."""
    space = search_space(kind)
    try:
        genotype = space.parse_genotype(text)
        space.check_trainable(genotype)
    except ValueError as exc:
        raise SetupError(f"{where}: {exc}") from None
    return genotype


def plan_augment_stage(cfg: Config, search: list[Assignment], genotype: Any,
                       ledger: FederationLedger | None, params: DPParams | None) -> AugmentPlan:
    """The augmentation's plan, its privacy planned against what the search has spent (``ledger``).

    Under DP the ledger holds every release the search made (replays included), so ``privacy.target_epsilon`` and
    ``privacy.max_epsilon`` bound the whole job: see docs/privacy.md, "Privacy across the search and the
    augmentation".
    """
    party_pools = augment_pools(cfg, search)
    per_epoch, steps = augment_steps(cfg, [len(p) for p in party_pools])
    releases, reason = None, "completed"
    demand = augment_demand(cfg, search)
    if demand is not None:
        assert ledger is not None and params is not None
        try:
            releases = plan_augment(ledger, demand, params)
        except ValueError as exc:
            raise SetupError(f"privacy: {exc}") from None
        steps, reason = releases.steps, releases.stop_reason
    assignments = [
        AugmentAssignment(pool, genotype.to_string(), per_epoch, steps, releases,
                          params if releases is not None else None, train_count=len(shards.train_indices),
                          corruption=shards.corruption, gathered=shards.gathered)
        for pool, shards in zip(party_pools, search, strict=True)
    ]
    return AugmentPlan(assignments, genotype, per_epoch, steps, releases, reason)
