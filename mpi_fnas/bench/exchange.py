"""The MPI exchange of one iteration (Reduce G, Bcast W, Reduce H, Bcast A on the search's buffer sizes), timed
with every rank taking part: the one benchmark that talks over the Channel."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the MPI module stays out of the CLI's start-up (argument and config errors)
    from mpi_fnas.federation.comm import Channel


def time_exchange(channel: Channel, num_w: int, num_a: int, repeats: int, lag: float = 0.1) -> float:
    """Median seconds the collectives of one iteration add to a step (all ranks must call this; rank 0 gets it).

    The collectives are those of a first-order iteration on buffers of the search's sizes: Reduce G, Bcast W,
    Reduce H, Bcast A. In the search the ranks wait in the first Reduce for the slowest party, so here the last
    rank joins each iteration `lag` seconds after the others: its time inside the four collectives — from the
    moment the last contribution is there until it holds the new A — is what the exchange costs a step. (The
    others' time also contains the wait; a barrier-started exchange would miss the cost of waking waiters up.)
    """
    from mpi_fnas.federation.flat import STATS

    g = np.ones(num_w + STATS, dtype=np.float32)
    h = np.ones(num_a + STATS, dtype=np.float32)
    g_sum, h_sum = np.zeros_like(g), np.zeros_like(h)
    w, a = np.zeros(num_w, dtype=np.float32), np.zeros(num_a, dtype=np.float32)
    last = channel.size - 1
    times = []
    for i in range(repeats + 1):
        channel.barrier()
        if channel.rank == last:
            time.sleep(lag)  # the others are already waiting in the Reduce
        t0 = time.perf_counter()
        channel.reduce_sum(g, g_sum)
        channel.bcast(w)
        channel.reduce_sum(h, h_sum)
        channel.bcast(a)
        if i:
            times.append(time.perf_counter() - t0)
    medians = channel.gather_objects(statistics.median(times))
    return medians[last] if medians is not None else statistics.median(times)
