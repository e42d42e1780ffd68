"""The channel's collective pattern (``runtime.exchange``) against its star: the same sums and broadcasts, and what a
party hands MPI in the tree of secure aggregation's words. Run under `make test-mpi` (4 ranks: the tree 0 ← 1,
0 ← 2 ← 3; any size >= 2 works)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_waits import quiet_barrier

from mpi_fnas.federation.comm import BUFFER_TAG, SERVER, Channel
from mpi_fnas.federation.topology import COLLECTIVE, tree_children, tree_parent


def contribution(rank: int, n: int, call: int) -> np.ndarray:
    rng = np.random.default_rng([rank, call, 7])
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)


def words(rank: int, n: int) -> np.ndarray:
    return np.random.default_rng([rank, 11]).integers(0, 2**32, n, dtype=np.uint32)


def both_patterns(channel: Channel, send: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """reduce_sum of `send` under the star, then under collectives: the server's two sums (parties: None)."""
    sums = []
    for pattern in ("star", COLLECTIVE):
        channel.pattern = pattern
        recv = np.zeros_like(send) if channel.is_server else None
        channel.reduce_sum(send, recv)
        sums.append(recv)
    channel.pattern = "star"
    return sums[0], sums[1]


@pytest.mark.mpi(min_size=2)
def test_collective_sums_equal_the_stars(channel):
    """uint32 words (secure aggregation) bit for bit; float32 up to the summation order."""
    n = 200_000  # past MPICH's eager limit
    star, collective = both_patterns(channel, words(channel.rank, n))
    if channel.is_server:
        np.testing.assert_array_equal(collective, star)
    for call in range(2):
        send = contribution(channel.rank, n, call)
        star, collective = both_patterns(channel, send)
        if channel.is_server:
            exact = sum(contribution(r, n, call).astype(np.float64) for r in range(channel.size))
            scale = sum(np.abs(contribution(r, n, call).astype(np.float64)) for r in range(channel.size))
            assert np.all(np.abs(collective - exact) <= 1e-6 * scale)
            assert np.all(np.abs(star - exact) <= 1e-6 * scale)


@pytest.mark.mpi(min_size=2)
def test_collective_bcast_gives_every_party_the_servers_buffer(channel):
    channel.pattern = COLLECTIVE
    n = 200_000
    buf = contribution(0, n, 5) if channel.is_server else np.full(n, np.nan, dtype=np.float32)
    channel.bcast(buf)
    np.testing.assert_array_equal(buf, contribution(0, n, 5))


class SpyComm:
    """A party's communicator that records its point-to-point traffic (the tree is built from it)."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm, self.sent, self.sources = comm, [], []

    def Isend(self, buf, dest: int, tag: int = 0) -> MPI.Request:  # noqa: N802 (the mpi4py name)
        self.sent.append((np.array(buf, copy=True), dest, tag))
        return self.comm.Isend(buf, dest, tag)

    def Irecv(self, buf, source: int, tag: int = 0) -> MPI.Request:  # noqa: N802
        self.sources.append((source, tag))
        return self.comm.Irecv(buf, source, tag)

    def __getattr__(self, name: str):
        if name in ("Ireduce", "Reduce", "Gather", "Igather", "Allreduce", "Iallreduce"):
            raise AssertionError(f"secure words must not go through comm.{name} (the MPI library's own algorithm)")
        return getattr(self.comm, name)


@pytest.mark.mpi(min_size=2)
def test_in_the_tree_a_party_sends_its_words_plus_its_subtrees_once_to_its_parent():
    """Secure aggregation's masked words under collectives: a party receives only from its children in the binomial
    tree rooted at rank 0 (computed from its own rank, never told), sends exactly once, to its parent, its own words
    plus what its children sent (mod 2^32), and never through MPI's reduce (whose algorithm the library picks)."""
    world = MPI.COMM_WORLD.Dup()
    spy = SpyComm(world)
    channel = Channel(spy if world.Get_rank() != SERVER else world, timeout=60.0)
    channel.pattern = COLLECTIVE
    n = 1000
    mine = words(channel.rank, n)
    total = np.zeros(n, dtype=np.uint32) if channel.is_server else None
    channel.reduce_sum(mine, total)
    below = MPI.COMM_WORLD.allgather(mine)  # the test's view of every rank's words
    quiet_barrier(world)
    world.Free()
    size = len(below)

    def subtree_sum(rank: int) -> np.ndarray:
        out = below[rank].copy()
        for child in tree_children(rank, size):
            out += subtree_sum(child)
        return out

    if channel.is_server:
        np.testing.assert_array_equal(total, sum(below[1:], start=below[0].copy()))
        return
    assert spy.sources == [(child, BUFFER_TAG) for child in tree_children(channel.rank, size)]
    assert len(spy.sent) == 1
    sent, dest, tag = spy.sent[0]
    assert (dest, tag) == (tree_parent(channel.rank), BUFFER_TAG)
    np.testing.assert_array_equal(sent, subtree_sum(channel.rank))
