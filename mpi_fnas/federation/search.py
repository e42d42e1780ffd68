"""The federated search job on every rank: the server/party split, and nothing else.

* rank 0, :func:`mpi_fnas.federation.serve.serve`: plans the run, holds W, A and their optimizers, logs;
* ranks 1..K, :func:`mpi_fnas.federation.participate.participate`: each holds only its own shards;
* one iteration of both, side by side: :mod:`mpi_fnas.federation.algorithm` (Algorithm 1).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mpi_fnas.config import Config
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.participate import SearchSide, participate
from mpi_fnas.federation.plan import Assignment
from mpi_fnas.federation.stage import Progress

if TYPE_CHECKING:
    from mpi_fnas.federation.serve import SearchOutcome


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
    if channel.is_server:
        from mpi_fnas.federation.serve import serve  # rank 0's alone (see mpi_fnas.federation.job.run_job)

        return serve("search", cfg, channel, run_dir, assignments=assignments, progress=progress, resume=resume,
                     stop_requested=stop_requested)
    return participate(cfg, channel, run_dir, SearchSide(cfg))
