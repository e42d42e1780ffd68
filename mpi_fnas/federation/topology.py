"""Which pattern a job's per-step exchanges take (``runtime.exchange``): the star or collectives.

* ``star``: every party sends its release to rank 0 and rank 0 sends W and A to each party in turn
  (:class:`~mpi_fnas.federation.comm.Channel`'s point-to-point exchange).
* ``collective``: W and A by ``MPI_Ibcast``. The releases by ``MPI_Ireduce`` (float32), or under secure
  aggregation through a binomial tree rooted at rank 0 that the channel builds itself from point-to-point messages
  (:func:`tree_children`), never left to the MPI library's choice. A party ``r`` then receives the partial sums of
  the subtrees below it. Party 1 is a leaf under rank 0, so no such subtree holds party 1, and each of their partial
  sums keeps the pair masks with party 1, which ``r`` does not hold.
* ``auto``: ``star`` where a node runs more ranks than it has cores (a tree's hops would wait for sleeping ranks),
  else ``collective``.

Rank 0 chooses (:func:`choose_exchange`); every party checks the choice against its own config
(:func:`collective_refusal`), since a tree hands its release, or a sum holding it, to another party. Why, and what
each pattern exposes to whom: docs/privacy.md, "The exchange pattern"; measured: docs/log/benchmarks.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi_fnas.config import Config
    from mpi_fnas.federation.memory import NodeFacts

STAR, COLLECTIVE, AUTO = "star", "collective", "auto"


def collective_refusal(cfg: Config) -> str | None:
    """Why a job of `cfg` must keep the star (None: collectives are allowed), as one line.

    What each party asks of its own config before it takes part in a collective exchange rank 0 chose."""
    exchange = cfg.runtime.exchange
    if exchange == STAR:
        return "runtime.exchange is star"
    if cfg.federation.selection != "all":
        return f"federation.selection {cfg.federation.selection} gathers each party's own release"
    if cfg.mode != "dpfnas" and exchange == AUTO:
        return (f"mode {cfg.mode}: a reduction tree would hand raw gradient sums to other parties "
                "(runtime.exchange=collective allows it)")
    if cfg.mode == "dpfnas" and cfg.augment.epochs > 0 and not cfg.augment.private and exchange == AUTO:
        return ("augment.private false: a reduction tree would hand the augmentation's exact gradient sums to other "
                "parties (runtime.exchange=collective allows it)")
    if cfg.mode == "dpfnas" and cfg.privacy.aggregation == "secure" and cfg.privacy.colluders > 0:
        return (f"privacy.colluders {cfg.privacy.colluders}: parties colluding with each other could remove the "
                "masks of a partial sum in a reduction tree")
    return None


def choose_exchange(cfg: Config, facts: Sequence[NodeFacts]) -> tuple[str, str]:
    """Rank 0: (the pattern, why) for a world whose rank r reported ``facts[r]`` (its host and its cores)."""
    refusal = collective_refusal(cfg)
    if refusal is not None:
        return STAR, refusal
    if cfg.runtime.exchange == COLLECTIVE:
        return COLLECTIVE, "runtime.exchange is collective"
    ranks = Counter(fact.host for fact in facts)
    cores = {fact.host: fact.cores for fact in facts}
    crowded = sorted(host for host, count in ranks.items() if count > cores[host])
    if crowded:
        host = crowded[0]
        return STAR, (f"auto: node {host} runs {ranks[host]} ranks on {cores[host]} cores (a tree's hops would wait "
                      "for sleeping ranks)")
    return COLLECTIVE, "auto: every node has a core for each of its ranks"


def tree_parent(rank: int) -> int:
    """The rank a party ``rank >= 1`` sends its partial sum to in the binomial tree rooted at rank 0."""
    return rank - (rank & -rank)


def tree_children(rank: int, size: int) -> list[int]:
    """The ranks whose partial sums ``rank`` receives in the binomial tree rooted at 0 over `size` ranks, lowest
    first: ``rank + 2^j`` for every ``2^j`` below the lowest set bit of `rank` (rank 0: every power of two below
    `size`). Rank 0 has ⌈log₂ size⌉ children; party 1 has none."""
    limit = rank & -rank if rank else 1 << max(size - 1, 0).bit_length()
    children, step = [], 1
    while step < limit and rank + step < size:
        children.append(rank + step)
        step *= 2
    return children
