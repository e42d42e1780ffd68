"""A whole job on every rank: the search, then the augmentation of the cell it found, with the same ranks.

* ``stage="search"``: search (fresh or resumed), write ``RUN_DIR/searched.pt``, then augment unless
  ``augment.epochs`` is 0;
* ``stage="augment"``: augment only: a finished search's cell (``--augment RUN_DIR``, or a job resumed after its
  search finished), or ``augment.genotype`` or a hand-designed ``augment.network`` (no search at all).

``searched.pt`` is the search's result as rank 0 owns it: the genotype, the privacy ledgers at the end of the
search, the count of the selection's draws on the aux set and the parties' shard sizes (public counts; the
augmentation refuses shards of other sizes, whose rates the ledgers were not charged at). The augmentation starts
from it, in the same job or in a later one, so both stages' releases compose in one ledger per party and dataset,
and both stages' draws in one selection ε.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mpi_fnas.checkpoint import atomic_load, atomic_save
from mpi_fnas.config import Config
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.memory import return_free_memory
from mpi_fnas.federation.participate import AugmentSide, SearchSide, participate
from mpi_fnas.federation.stage import Progress

if TYPE_CHECKING:
    from mpi_fnas.federation.serve import AugmentOutcome, SearchOutcome

SEARCHED_NAME = "searched.pt"


@dataclass
class JobOutcome:
    """Rank 0's result: the search's (None when the job did not search) and the augmentation's (None without)."""

    search: SearchOutcome | None
    augment: AugmentOutcome | None

    @property
    def interrupted(self) -> bool:
        return any(stage is not None and stage.interrupted for stage in (self.search, self.augment))


def searched_state(run_dir: Path) -> dict | None:
    """The search result saved in `run_dir` (``genotype``, ``ledger``, ``selection``, ``shard_sizes``, ``config``),
    or None. An older ``searched.pt`` has no ``shard_sizes``: its augmentation is not checked against them."""
    path = Path(run_dir) / SEARCHED_NAME
    return atomic_load(path) if path.exists() else None


def run_job(cfg: Config, channel: Channel, run_dir: Path, *, stage: str, resume: dict | None = None,
            progress: Callable[[str], Progress | None] = lambda stage: None,
            stop_requested: Callable[[], str | None] = lambda: None) -> JobOutcome | bool:
    """Run the job on every rank. Rank 0 returns the :class:`JobOutcome`; a party returns True when interrupted.

    `resume` (rank 0): the checkpoint to continue from (its ``stage`` says which). `progress(stage)` gives rank 0's
    display for a stage.
    """
    augment = cfg.augment.epochs > 0
    if not channel.is_server:
        if stage == "search" and participate(cfg, channel, run_dir, SearchSide(cfg)):
            return True
        return participate(cfg, channel, run_dir, AugmentSide(cfg)) if augment else False

    # Rank 0's side alone needs its planner, ledgers and log (dp_accounting, scipy, h5py): a party never imports it.
    from mpi_fnas.federation.serve import serve

    search = None
    if stage == "search":
        search = serve("search", cfg, channel, run_dir, progress=progress("search"), resume=resume,
                       stop_requested=stop_requested)
        if search.interrupted:
            return JobOutcome(search, None)
        searched = {"genotype": search.genotype, "ledger": search.ledger_state, "selection": search.selection_state,
                    "shard_sizes": search.shard_sizes, "config": cfg.to_yaml()}
        atomic_save(run_dir / SEARCHED_NAME, searched)
        resume = None
        return_free_memory()  # the search's supernet and its evaluations are gone: a compact heap for the next stage
    else:
        searched = searched_state(run_dir) or {"genotype": None, "ledger": None}
    if not augment:
        return JobOutcome(search, None)
    return JobOutcome(search, serve("augment", cfg, channel, run_dir, searched=searched, resume=resume,
                                    progress=progress("augment"), stop_requested=stop_requested))
