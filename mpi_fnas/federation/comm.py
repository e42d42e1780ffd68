"""The MPI side of the parameter server: buffer collectives that never hang.

This is the only module on the hot path that imports mpi4py; it knows nothing about autograd.

Why non-blocking collectives polled with short sleeps instead of plain ``Reduce``/``Bcast``:

* **Nothing hangs.** While rank 0 waits for a collective it also watches for a failure notice from any party
  (:meth:`Channel.notify_failure`), so it can mark the run log ``failed`` and ``MPI_Abort`` the job within
  milliseconds instead of blocking forever in a collective a dead party will never join. A collective that takes
  longer than ``timeout`` seconds raises :class:`CollectiveTimeoutError` (the caller aborts the job).
* **No thrashing.** MPICH spins at 100 % CPU inside blocking calls. With 9 ranks on 2 cores, 8 spinning waiters
  would steal the cores from the party doing real work; a polling loop that sleeps yields them.

All buffers are contiguous float32 numpy arrays (uppercase mpi4py methods: no pickling on the hot path).
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

SERVER = 0
FAILURE_TAG = 7177  # point-to-point tag of a party's failure notice to the server
_MAX_NOTICE = 4096  # bytes of a failure notice


class PartyFailedError(RuntimeError):
    """A party reported that it failed; raised on the server inside a collective wait."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the configured timeout."""


class Channel:
    """Server/party exchange over one communicator.

    Args:
        comm: the communicator (rank 0 is the server).
        timeout: seconds a single collective may take before :class:`CollectiveTimeoutError` (it includes waiting
            for the slowest party to finish its compute, so it must exceed the longest party step).
    """

    def __init__(self, comm: MPI.Comm, timeout: float = 1800.0) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout
        self.comm_seconds = 0.0  # wall time spent inside collectives on this rank (cumulative)
        self._notice = np.zeros(_MAX_NOTICE, dtype=np.uint8)

    @property
    def is_server(self) -> bool:
        return self.rank == SERVER

    @property
    def parties(self) -> int:
        return self.size - 1

    # -- collectives -------------------------------------------------------------------------------------------
    def reduce_sum(self, send: np.ndarray, recv: np.ndarray | None = None) -> None:
        """Element-wise sum of every rank's `send` into `recv` on the server (float32, same shape everywhere)."""
        _check_buffer(send)
        if self.is_server:
            if recv is None:
                raise ValueError("the server must pass a receive buffer")
            _check_buffer(recv)
        req = self.comm.Ireduce(send, recv if self.is_server else None, op=MPI.SUM, root=SERVER)
        self._wait(req, "reduce")

    def bcast(self, buf: np.ndarray) -> None:
        """Overwrite `buf` on every party with the server's `buf`."""
        _check_buffer(buf)
        req = self.comm.Ibcast(buf, root=SERVER)
        self._wait(req, "bcast")

    def scatter_setup(self, payloads: list | None) -> object:
        """Setup only (not the hot path): the server hands each rank one picklable object."""
        return self.comm.scatter(payloads if self.is_server else None, root=SERVER)

    def gather_setup(self, obj: object) -> list | None:
        """Setup only: every rank sends one picklable object; the server gets the list (others None)."""
        return self.comm.gather(obj, root=SERVER)

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier(), "barrier")

    # -- failure handling --------------------------------------------------------------------------------------
    def notify_failure(self, message: str, grace: float = 3.0) -> None:
        """Best effort: tell the server this party failed (the caller then aborts the job)."""
        if self.is_server:
            return
        data = message.encode("utf-8", "replace")[: _MAX_NOTICE - 1]
        buf = np.zeros(_MAX_NOTICE, dtype=np.uint8)
        buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        req = self.comm.Isend(buf, dest=SERVER, tag=FAILURE_TAG)
        # Give the server a moment to receive it, mark the log `failed` and abort the job itself; the caller
        # aborts anyway afterwards, so a server that is itself stuck cannot make this party hang.
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            req.Test()
            time.sleep(0.01)

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (MPI_Abort)."""
        self.comm.Abort(code)

    def _check_notice(self) -> None:
        status = MPI.Status()
        if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=FAILURE_TAG, status=status):
            source = status.Get_source()
            self.comm.Recv(self._notice, source=source, tag=FAILURE_TAG)
            text = bytes(self._notice).rstrip(b"\0").decode("utf-8", "replace")
            raise PartyFailedError(f"party rank {source} failed: {text}")

    def _wait(self, req: MPI.Request, what: str) -> None:
        start = time.perf_counter()
        spins = 0
        pause = 2e-5
        try:
            while not req.Test():
                spins += 1
                if self.is_server and spins % 8 == 0:
                    self._check_notice()
                if spins > 64:  # short spin for latency, then back off to free the core
                    time.sleep(pause)
                    pause = min(pause * 2.0, 1e-3)
                if time.perf_counter() - start > self.timeout:
                    raise CollectiveTimeoutError(
                        f"{what} did not complete within {self.timeout:.0f} s (runtime.comm_timeout)"
                    )
        finally:
            self.comm_seconds += time.perf_counter() - start


def _check_buffer(buf: np.ndarray) -> None:
    if buf.dtype != np.float32 or not buf.flags.c_contiguous:
        raise TypeError("collective buffers must be contiguous float32 numpy arrays")
