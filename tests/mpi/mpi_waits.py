"""Waits of the MPI tests that leave the cores to the ranks still working."""

from __future__ import annotations

import time


def quiet_barrier(comm) -> None:
    """``comm.Barrier()`` that sleeps while it waits. Why: MPICH's blocking calls spin, and with 4 ranks on 2 cores
    a rank that waits there takes a core from one that still works (the MPI tests took ~2x their CPU)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)
