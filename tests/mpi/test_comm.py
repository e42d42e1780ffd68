"""Channel's exchanges deliver the right data, and a party hands MPI nothing but its caller's payloads.

Run with: mpirun -n 5 python -m pytest --with-mpi --only-mpi tests/mpi (any size >= 2 works). The failure paths
(failure notices, a party that never joins) live in tests/test_comm.py, each in its own mpirun.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpi_fnas.federation.comm import SERVER, Channel
from mpi_fnas.wire import encode

BIG = 300_000  # bytes: well above MPICH's eager limit, so the large-message path is exercised too


def world_channel() -> Channel:
    return Channel(MPI.COMM_WORLD, timeout=120.0)


def payload_of(rank: int) -> tuple:
    """A rank-specific picklable object of ~BIG bytes."""
    return ("rank", rank, np.full(BIG // 8 + rank, rank, dtype=np.int64), {"nested": [rank, (rank, "x" * rank)]})


def assert_payload(got: object, rank: int) -> None:
    assert isinstance(got, tuple) and got[:2] == ("rank", rank)
    np.testing.assert_array_equal(got[2], np.full(BIG // 8 + rank, rank, dtype=np.int64))
    assert got[3] == {"nested": [rank, (rank, "x" * rank)]}


@pytest.mark.mpi(min_size=2)
def test_bcast_object_gives_every_rank_the_servers_object():
    channel = world_channel()
    got = channel.bcast_object(payload_of(7) if channel.is_server else None)
    assert_payload(got, 7)


@pytest.mark.mpi(min_size=2)
def test_scatter_objects_gives_each_rank_its_own_object():
    channel = world_channel()
    objs = [payload_of(r) for r in range(channel.size)] if channel.is_server else None
    assert_payload(channel.scatter_objects(objs), channel.rank)


@pytest.mark.mpi(min_size=2)
def test_gather_objects_collects_every_rank_in_rank_order():
    channel = world_channel()
    got = channel.gather_objects(payload_of(channel.rank))
    if not channel.is_server:
        assert got is None
        return
    assert len(got) == channel.size
    for rank, item in enumerate(got):
        assert_payload(item, rank)


@pytest.mark.mpi(min_size=2)
def test_server_rejects_a_scatter_list_of_the_wrong_length():
    channel = world_channel()
    if channel.is_server:
        with pytest.raises(ValueError, match="one per rank"):
            channel.scatter_objects([None])
    channel.barrier()


def contribution(rank: int, n: int, call: int) -> np.ndarray:
    """Values spanning many magnitudes, so that float32 sums in a different order differ."""
    rng = np.random.default_rng([rank, call])
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 6, n)).astype(np.float32)


@pytest.mark.mpi(min_size=2)
def test_reduce_sum_adds_the_contributions_in_rank_order():
    channel = world_channel()
    n = 150_000
    recv = np.zeros(n, dtype=np.float32) if channel.is_server else None
    for call in range(3):  # the server reuses its receive buffers: later calls must not see earlier data
        channel.reduce_sum(contribution(channel.rank, n, call), recv)
        if channel.is_server:
            expected = contribution(0, n, call)
            for rank in range(1, channel.size):
                expected += contribution(rank, n, call)
            np.testing.assert_array_equal(recv, expected)  # bit for bit: the same order every run


@pytest.mark.mpi(min_size=2)
def test_bcast_overwrites_every_party_buffer():
    channel = world_channel()
    n = 150_000
    buf = contribution(0, n, 0) if channel.is_server else np.full(n, np.nan, dtype=np.float32)
    channel.bcast(buf)
    np.testing.assert_array_equal(buf, contribution(0, n, 0))


@pytest.mark.mpi(min_size=2)
def test_reduce_sum_rejects_a_contribution_of_the_wrong_size():
    channel = world_channel()
    n = 1000
    if channel.is_server:
        with pytest.raises(ValueError, match=f"sent {n - 1} floats, expected {n}"):
            channel.reduce_sum(np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.float32))
    else:
        channel.reduce_sum(np.ones(n - 1, dtype=np.float32))
    channel.barrier()


class RecordingComm:
    """A party's communicator that records every outgoing message and refuses any other way to hand MPI data."""

    ALLOWED = frozenset({"Get_rank", "Get_size", "Isend", "Irecv", "Ibarrier", "Improbe", "Iprobe"})

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.sent: list[tuple[bytes, int, int]] = []

    def Isend(self, buf, dest: int, tag: int = 0) -> MPI.Request:  # noqa: N802 (the mpi4py name)
        self.sent.append((bytes(memoryview(buf).cast("B")), dest, tag))
        return self.comm.Isend(buf, dest, tag)

    def __getattr__(self, name: str):
        if name not in self.ALLOWED:
            raise AssertionError(f"a party called comm.{name}")
        return getattr(self.comm, name)


@pytest.mark.mpi(min_size=2)
def test_a_party_sends_only_its_callers_payloads_to_the_server():
    world = MPI.COMM_WORLD
    recorder = RecordingComm(world) if world.Get_rank() != SERVER else None
    channel = Channel(recorder if recorder is not None else world, timeout=120.0)
    n = 5000
    g = contribution(channel.rank, n, 0)
    obj = {"state": np.arange(10) * channel.rank}
    w = np.zeros(n, dtype=np.float32)
    channel.reduce_sum(g, np.zeros(n, dtype=np.float32) if channel.is_server else None)
    channel.bcast(w)
    channel.bcast_object("config" if channel.is_server else None)
    channel.scatter_objects(list(range(channel.size)) if channel.is_server else None)
    channel.gather_objects(obj)
    channel.barrier()
    if recorder is None:
        return
    assert [(dest, data) for data, dest, _ in recorder.sent] == [
        (SERVER, g.tobytes()),  # exactly the contribution: no timing, size or statistic appended
        (SERVER, encode(obj)),  # exactly the object, as data (mpi_fnas.wire)
    ]


@pytest.mark.mpi(min_size=2)
def test_a_uint32_sum_reduce_wraps_mod_2_to_the_32():
    """Secure aggregation (mpi_fnas/secagg) sums masked uint32 uploads with one Reduce: MPICH's SUM on uint32 must
    wrap mod 2^32 (masks cancel only then), never saturate or widen."""
    comm = MPI.COMM_WORLD
    mine = np.array([2**32 - 1, 2**31 + comm.rank, 7], dtype=np.uint32)
    total = np.zeros(3, dtype=np.uint32) if comm.rank == 0 else None
    comm.Reduce(mine, total, op=MPI.SUM, root=0)
    if comm.rank == 0:
        ranks = range(comm.size)
        expected = [sum(2**32 - 1 for _ in ranks), sum(2**31 + r for r in ranks), 7 * comm.size]
        np.testing.assert_array_equal(total, np.array([v % 2**32 for v in expected], dtype=np.uint32))


@pytest.mark.mpi(min_size=2)
def test_the_channel_reduce_of_uint32_words_wraps_like_the_mpi_reduce():
    """The stage loop sums secure uploads through Channel.reduce_sum (point to point, rank order): uint32 words
    wrap mod 2^32 there too, the server receives exactly the words, and a float32 receive buffer is refused."""
    channel = Channel(MPI.COMM_WORLD, timeout=60.0)
    mine = np.array([2**32 - 1, 2**31 + channel.rank, 7], dtype=np.uint32)
    if not channel.is_server:
        channel.reduce_sum(mine)
        return
    total = np.zeros(3, dtype=np.uint32)
    channel.reduce_sum(mine, total)
    ranks = range(channel.size)
    expected = [sum(2**32 - 1 for _ in ranks), sum(2**31 + r for r in ranks), 7 * channel.size]
    np.testing.assert_array_equal(total, np.array([v % 2**32 for v in expected], dtype=np.uint32))
    with pytest.raises(ValueError, match="receive buffer"):
        channel.reduce_sum(mine, np.zeros(3, dtype=np.float32))


@pytest.mark.mpi(min_size=3)
def test_the_parties_tell_each_other_their_shard_sizes_directly():
    """Under a local partition each party derives its steps per epoch from every party's shard sizes, which the
    parties send each other, not through rank 0 (rank 0 takes no part: it only waits). Sizes that are no
    val_fraction split of a folder are refused; a party that refuses its setup says so, and the others refuse at
    once rather than wait for it."""
    from mpi_fnas.federation.handshake import exchange_shard_sizes
    from mpi_fnas.privacy.trusted_config import AssignmentRefusedError

    channel = world_channel()
    if channel.is_server:
        for _ in range(3):
            channel.barrier()
        return
    sizes = exchange_shard_sizes(channel, (50 + channel.rank, 50 + channel.rank), 0.5)
    assert sizes == [(50 + rank, 50 + rank) for rank in range(1, channel.size)]
    channel.barrier()
    lying = (50, 10) if channel.rank == 1 else (50 + channel.rank, 50 + channel.rank)
    if channel.rank == 1:
        exchange_shard_sizes(channel, lying, 0.5)
    else:
        with pytest.raises(AssignmentRefusedError, match=r"refuses party 1's shard sizes \(50, 10\): not the split"):
            exchange_shard_sizes(channel, lying, 0.5)
    channel.barrier()
    if channel.rank == 1:
        assert exchange_shard_sizes(channel, None, 0.5) == []
    else:
        with pytest.raises(AssignmentRefusedError, match="refuses its setup: party 1 refused its own"):
            exchange_shard_sizes(channel, (50, 50), 0.5)
    channel.barrier()
