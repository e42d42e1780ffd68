"""Shared setup of the MPI tests (run under `mpirun -n 4 python -m pytest --with-mpi --only-mpi tests/mpi`)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mpi_waits import CHANNEL_TIMEOUT, quiet_barrier


@pytest.fixture
def shared_dir() -> Iterator[Callable[[str], Path]]:
    """``make(prefix)``: a fresh directory that rank 0 creates and every rank of COMM_WORLD is given (a run
    directory all ranks write into). At teardown, once every rank is done, rank 0 removes it: each `make test`
    used to leave one such directory per spy test in /tmp."""
    from mpi4py import MPI

    world, made = MPI.COMM_WORLD, []

    def make(prefix: str) -> Path:
        path = Path(world.bcast(tempfile.mkdtemp(prefix=prefix) if world.Get_rank() == 0 else None, root=0))
        made.append(path)
        return path

    yield make
    quiet_barrier(world)  # no rank may still be writing into a directory rank 0 removes
    if world.Get_rank() == 0:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def channel():
    """A :class:`~mpi_fnas.federation.comm.Channel` on a communicator of its own (every rank of COMM_WORLD), so
    that nothing a test leaves behind reaches another test; freed once every rank is done with it."""
    from mpi4py import MPI

    from mpi_fnas.federation.comm import Channel

    comm = MPI.COMM_WORLD.Dup()
    yield Channel(comm, timeout=CHANNEL_TIMEOUT)
    quiet_barrier(comm)
    comm.Free()
