"""What :meth:`mpi_fnas.federation.comm.Channel._wait` polls, and how long it sleeps between polls.

Non-blocking requests (with their statuses), probed messages of bounded size, and the pause schedule that lets
ranks outnumbering the cores leave them to the ranks still computing (the measurements: docs/exchange.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from mpi_fnas.wire import WireError, decode

OBJECT_TAG = 7179  # setup objects in the data-only format (mpi_fnas.wire), both directions
# Bytes of one setup object at most (an assignment's index arrays for 60k examples take ~0.5 MB): a larger message is
# refused before it is received, so a hostile peer cannot make a rank allocate without bound.
MAX_OBJECT_MESSAGE = 64 * 2**20

SPIN_POLLS = 32  # polls before the first sleep
FIRST_PAUSE = 2e-5  # seconds of the first sleep; each further sleep doubles, up to the cap
SERVER_MAX_PAUSE = 2.5e-4  # seconds; the server's cap (one process, on every step's critical path)
PARTY_MAX_PAUSE = 1e-3  # seconds; a party's cap
SERVER_PAUSE_FRACTION = 1e-2  # … or this fraction of the time already waited, if larger,
PARTY_PAUSE_FRACTION = 1e-2
PAUSE_CEILING = 0.05  # … but never more than this (seconds)


def next_pause(pause: float, waited: float, max_pause: float, fraction: float,
               ceiling: float = PAUSE_CEILING) -> float:
    """The sleep after one of `pause` seconds, `waited` seconds into a wait: twice as long, up to the cap
    ``max(max_pause, fraction × waited)`` bounded by `ceiling`. A completion is therefore noticed at most one cap
    late: within `max_pause` of a short wait, within `fraction` of a long one."""
    cap = min(max(max_pause, fraction * waited), ceiling)
    return min(pause * 2.0, cap)


class Pending:
    """Something `Channel._wait` can poll: ``test()`` drives MPI progress and returns True once complete."""

    def test(self) -> bool:
        """Drive MPI's progress once; True once complete."""
        raise NotImplementedError


class Requests(Pending):
    """Non-blocking requests, with the status of each once all completed."""

    def __init__(self, requests: list[MPI.Request], keep: tuple = ()) -> None:
        self.requests = requests
        self.statuses = [MPI.Status() for _ in requests]
        self.keep = keep  # the buffers MPI may still read or write until the requests complete

    def test(self) -> bool:
        return MPI.Request.Testall(self.requests, self.statuses)

    def check_count(self, expected: int, dtype: np.dtype) -> None:
        """After completion: every receive must have carried exactly `expected` values of `dtype` (float32 or
        uint32)."""
        datatype, noun = (MPI.UNSIGNED, "uint32 words") if dtype == np.uint32 else (MPI.FLOAT, "floats")
        for status in self.statuses:
            got = status.Get_count(datatype)
            if got != expected:
                raise ValueError(f"rank {status.Get_source()} sent {got} {noun}, expected {expected}")


class Incoming(Pending):
    """One message of at most `limit` bytes from `source` with `tag`: probed first, so the receive buffer has exactly
    the message's size, and a larger message is refused before anything is received (a hostile peer cannot make a
    rank allocate without bound)."""

    def __init__(self, comm: MPI.Comm, source: int, tag: int, limit: int) -> None:
        self.comm, self.source, self.tag, self.limit = comm, source, tag, limit
        self.payload: bytearray | None = None
        self.request: MPI.Request | None = None

    def test(self) -> bool:
        if self.request is None:
            status = MPI.Status()
            message = self.comm.Improbe(source=self.source, tag=self.tag, status=status)
            if message is None:
                return False
            size = status.Get_count(MPI.BYTE)
            if size > self.limit:
                raise ValueError(f"rank {self.source} sent {size} bytes, at most {self.limit} are taken")
            self.payload = bytearray(size)
            self.request = message.Irecv(self.payload)
        return self.request.Test()

    def value(self) -> bytes:
        """The message's bytes, once :meth:`test` returned True."""
        assert self.payload is not None
        return bytes(self.payload)


def incoming_object(comm: MPI.Comm, source: int) -> Incoming:
    """A setup object from `source`, at most ``MAX_OBJECT_MESSAGE`` bytes (decode its value with :func:`decoded`)."""
    return Incoming(comm, source, OBJECT_TAG, MAX_OBJECT_MESSAGE)


def decoded(incoming: Incoming) -> object:
    """The setup object `incoming` carried, decoded as data (:func:`mpi_fnas.wire.decode`: nothing in it is run)."""
    try:
        return decode(incoming.value())
    except WireError as exc:
        raise WireError(f"rank {incoming.source} sent a message that is not data: {exc}") from None


class AllOf(Pending):
    """Several pollable items, complete once every one is."""

    def __init__(self, items: Sequence[Pending]) -> None:
        self.items = items

    def test(self) -> bool:
        return all([item.test() for item in self.items])  # a list, not a generator: drive every item each poll


def check_buffer(buf: np.ndarray, *also: type) -> None:
    """Hot-path buffers are contiguous float32 (or one of the dtypes `also` allows: uint32 in a reduce)."""
    if buf.dtype not in (np.float32, *also) or not buf.flags.c_contiguous:
        allowed = " or ".join(np.dtype(t).name for t in (np.float32, *also))
        raise TypeError(f"collective buffers must be contiguous {allowed} numpy arrays")

