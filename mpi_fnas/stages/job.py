"""A whole job on every rank, the server/party split at the top: the search, then the augmentation of the cell it
found, with the same ranks (:func:`run_job`); or the search alone (:func:`run_search`).

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpi_fnas.checkpoint import atomic_load, atomic_save
from mpi_fnas.config import Config
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.job_plan import Assignment
from mpi_fnas.federation.memory import return_free_memory
from mpi_fnas.federation.party_disk import EarlierRun
from mpi_fnas.stages.augment import AugmentOutcome, AugmentSide
from mpi_fnas.stages.iteration import Progress
from mpi_fnas.stages.party_data import start_job
from mpi_fnas.stages.party_driver import participate
from mpi_fnas.stages.search import SearchOutcome, SearchSide

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
            stop_requested: Callable[[], str | None] = lambda: None, earlier: Sequence[EarlierRun] = (),
            refusal: Exception | None = None) -> JobOutcome | bool:
    """Run the job on every rank. Rank 0 returns the :class:`JobOutcome`; a party returns True when interrupted.

    `resume` (rank 0): the checkpoint to continue from (its ``stage`` says which). `progress(stage)` gives rank 0's
    display for a stage. `earlier` (a party): its own directories of earlier runs on the same data, whose releases
    its ``privacy.party_max_epsilon`` composes with this job's (a baseline's other arms; remembered in its directory,
    so a resume composes them too). `refusal` (a party): what
    it refused at the launch, which it reports in its first setup report instead of taking part.
    """
    start_job()  # a series' fixed-stem features: those of an older job on other shards are dropped
    augment = cfg.augment.epochs > 0
    if not channel.is_server:
        if stage == "search" and participate(cfg, channel, run_dir, SearchSide(cfg), earlier=earlier, refusal=refusal):
            return True
        if augment or refusal is not None:  # a refusal goes in the stage's setup report, whatever this config says
            return participate(cfg, channel, run_dir, AugmentSide(cfg), earlier=earlier, refusal=refusal)
        return False

    # Rank 0's side alone needs its planner, ledgers and log (dp_accounting, scipy, h5py): a party never imports it.
    from mpi_fnas.stages.rank0_driver import serve

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


def run_search(cfg: Config, channel: Channel, run_dir: Path | None, *, assignments: list[Assignment] | None = None,
               progress: Progress | None = None, resume: dict | None = None,
               stop_requested: Callable[[], str | None] = lambda: None) -> SearchOutcome | bool:
    """Run the whole search on every rank.

    Rank 0 returns the :class:`SearchOutcome`; a party returns True when the run stopped as interrupted.
    `assignments` (rank 0 only) replaces the planned partition: tests use it to compare K parties with one party
    holding their union. `progress(step, total, row)` is called on rank 0 after each logged row. `resume` (rank 0
    only) is the server's checkpoint to continue from. `stop_requested()` (rank 0) returns a reason to checkpoint
    and stop at the next step boundary, or None (``MPI_FNAS_STOP_AFTER=STEP`` does the same at that step: tests).
    """
    start_job()  # as in run_job
    if channel.is_server:
        from mpi_fnas.stages.rank0_driver import serve  # rank 0's alone (see run_job)

        return serve("search", cfg, channel, run_dir, assignments=assignments, progress=progress, resume=resume,
                     stop_requested=stop_requested)
    return participate(cfg, channel, run_dir, SearchSide(cfg))
