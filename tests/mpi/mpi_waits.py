"""Waits of the MPI tests that leave the cores to the ranks still working."""

from __future__ import annotations

#: Seconds one exchange of a `channel` may take: a round that does not complete fails the test instead of hanging it.
CHANNEL_TIMEOUT = 60.0


def quiet_barrier(comm) -> None:
    """A barrier over `comm` through the package's polled :meth:`Channel.barrier`: it sleeps while it waits and
    fails after ``CHANNEL_TIMEOUT``. Why not ``comm.Barrier()``: MPICH's blocking calls spin, and with 4 ranks on
    2 cores a rank waiting there takes a core from one that still works (the MPI tests took ~2x their CPU)."""
    from mpi_fnas.federation.comm import Channel

    Channel(comm, timeout=CHANNEL_TIMEOUT).barrier()
