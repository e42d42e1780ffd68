"""The MPI side of the parameter server: server/party exchanges that never hang and never spin.

With :mod:`mpi_fnas.federation.pending` (what its waits poll), the only module on the hot path that imports
mpi4py; it knows nothing about autograd. Every exchange is non-blocking MPI polled by :meth:`Channel._wait`:

* **Nothing hangs.** Rank 0 also watches for a party's failure notice (:meth:`Channel.notify_failure`), marks the
  log ``failed`` and aborts the job; an exchange longer than ``timeout`` raises :class:`CollectiveTimeoutError`.
* **No spinning.** Waiters sleep between polls (``SPIN_POLLS`` tight polls, then pauses doubling from
  ``FIRST_PAUSE`` up to a cap: :func:`next_pause`), leaving the cores to the parties still computing.
* **A star, or collectives** (``pattern``: :mod:`mpi_fnas.federation.topology`). In the star a party talks only to
  the server (:meth:`Channel.exchange_among_parties` excepted), which sums in rank order, deterministically.
* **Nothing is added or executed.** A party hands MPI exactly its caller's buffers, objects and failure notice;
  objects travel in :mod:`mpi_fnas.wire`'s data-only format (never pickles), at most ``MAX_OBJECT_MESSAGE``.

Why a star rather than MPI's tree collectives, and how the polling caps were chosen: docs/exchange.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from mpi_fnas.federation.pending import (
    FIRST_PAUSE,
    OBJECT_TAG,
    PARTY_MAX_PAUSE,
    PARTY_PAUSE_FRACTION,
    SERVER_MAX_PAUSE,
    SERVER_PAUSE_FRACTION,
    SPIN_POLLS,
    AllOf,
    Incoming,
    Pending,
    Requests,
    check_buffer,
    decoded,
    incoming_object,
    next_pause,
)
from mpi_fnas.federation.topology import COLLECTIVE, STAR, tree_children, tree_parent
from mpi_fnas.wire import encode

SERVER = 0
FAILURE_TAG = 7177  # point-to-point tag of a party's failure notice to the server
BUFFER_TAG = 7178  # float32 contributions (party → server) and broadcasts (server → party)
PEER_TAG = 7180  # party to party, never through the server: secure aggregation's key-set confirmations (raw bytes)
MAX_PEER_MESSAGE = 4096  # bytes of one such message
_MAX_NOTICE = 4096  # bytes of a failure notice

# Seconds a failed party waits for the server to notice its notice, log its last ε rows (up to
# stage.SETTLE_SECONDS), mark the log `failed` and abort the job, before it aborts the job itself (capped by the
# channel's timeout). The server reads notices only while it waits in an exchange, so this also covers its
# stretches of compute between two exchanges (an evaluation, a checkpoint) on a loaded machine: a shorter grace
# loses the race to a slow settle and leaves the log `running`. A server that is itself stuck costs at most this.
FAILURE_GRACE = 60.0


class PartyFailedError(RuntimeError):
    """A party reported that it failed; raised on the server inside a collective wait."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the configured timeout."""


class Channel:
    """Server/party exchange over one communicator (rank 0 is the server, ranks 1..K the parties).

    Every exchange (``reduce_sum`` … ``gather_objects``, ``barrier``) is collective: all ranks of the communicator
    call it, in the same order. After one raised, the channel refuses further exchanges. The channel reserves
    the point-to-point tags ``FAILURE_TAG``, ``BUFFER_TAG`` and ``OBJECT_TAG`` on `comm`.

    Args:
        comm: the communicator.
        timeout: seconds a single collective may take before :class:`CollectiveTimeoutError` (it includes waiting
            for the slowest party to finish its compute, so it must exceed the longest party step).
    """

    def __init__(self, comm: MPI.Comm, timeout: float = 1800.0) -> None:
        self.comm, self.timeout = comm, timeout
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.comm_seconds = 0.0  # wall time spent inside collectives on this rank (cumulative)
        # ... of which in `bcast`: on rank 0 the parties already wait there, so it is the transfer alone
        self.bcast_seconds = 0.0
        self.max_pause = SERVER_MAX_PAUSE if self.rank == SERVER else PARTY_MAX_PAUSE
        self.pause_fraction = SERVER_PAUSE_FRACTION if self.rank == SERVER else PARTY_PAUSE_FRACTION
        self._notice = np.zeros(_MAX_NOTICE, dtype=np.uint8)
        self.pattern = STAR  # or COLLECTIVE: the per-step exchanges' pattern (mpi_fnas.federation.topology) ...
        self.pattern_reason = "the channel's default"  # ... and why rank 0 chose it
        self._parts: dict[tuple[int, int, str], np.ndarray] = {}  # (rows, n) receive buffers by shape and dtype
        # Requests (and their buffers) of an exchange abandoned by an exception: kept alive so that MPI never
        # writes into freed memory before the caller aborts the job. Their receives stay posted and would match
        # later messages, so the channel refuses any further exchange.
        self._abandoned: list[object] = []

    @property
    def is_server(self) -> bool:
        return self.rank == SERVER

    @property
    def parties(self) -> int:
        return self.size - 1

    # -- float32 buffers (the hot path) ------------------------------------------------------------------------
    def reduce_sum(self, send: np.ndarray, recv: np.ndarray | None = None) -> None:
        """Server: ``recv = send + Σ_k send_k`` (k = 1..K in rank order). Party: contribute `send`.

        Args:
            send: (n,) contiguous float32, or uint32 (secure aggregation's masked words: their sum wraps mod
                2^32, as numpy's and MPI's unsigned sums do), same n and dtype on every rank (the server usually
                contributes zeros).
            recv: server only, (n,) contiguous, of `send`'s dtype; parties pass None.
        """
        check_buffer(send, np.uint32)
        if self.is_server:
            if recv is None:
                raise ValueError("the server must pass a receive buffer")
            check_buffer(recv, send.dtype.type)
            if recv.size != send.size or recv.dtype != send.dtype:
                raise ValueError(f"reduce: receive buffer has {recv.size} {recv.dtype}, send buffer {send.size} "
                                 f"{send.dtype}")
        if self.pattern == COLLECTIVE and send.dtype == np.float32:
            # Each float32 contribution is a noised, accounted release (or plain FNAS by the user's explicit
            # choice): MPI's own algorithm may route it through other parties.
            out = recv if self.is_server else None
            self._wait(Requests([self.comm.Ireduce(send, out, op=MPI.SUM, root=SERVER)], keep=(send, out)),
                       "reduce")
            return
        senders = tree_children(self.rank, self.size) if self.pattern == COLLECTIVE else (
            list(range(1, self.size)) if self.is_server else [])
        parts = self._receive_parts(senders, send)
        if self.is_server:
            np.copyto(recv, send)
            for part in parts:  # rank (or child) order: the sum does not depend on who arrived first
                np.add(recv, part, out=recv)
            return
        total = send
        if len(parts):  # a tree's inner party: its own words plus its subtree's partial sums (mod 2^32)
            total = send.copy()
            for part in parts:
                np.add(total, part, out=total)
        to = tree_parent(self.rank) if self.pattern == COLLECTIVE else SERVER
        self._wait(Requests([self.comm.Isend(total, dest=to, tag=BUFFER_TAG)], keep=(total,)), "reduce")

    def _receive_parts(self, senders: list[int], send: np.ndarray) -> np.ndarray:
        """Each sender's (n,) buffer of `send`'s size and dtype, as the rows of a reused array (no sender: no row)."""
        if not senders:
            return np.empty((0, send.size), dtype=send.dtype)
        key = (len(senders), send.size, send.dtype.str)
        parts = self._parts.get(key)
        if parts is None:
            parts = self._parts[key] = np.zeros((len(senders), send.size), dtype=send.dtype)
        pending = Requests([self.comm.Irecv(parts[i], source=k, tag=BUFFER_TAG) for i, k in enumerate(senders)])
        self._wait(pending, "reduce")
        pending.check_count(send.size, send.dtype)
        return parts

    def gather(self, send: np.ndarray, recv: np.ndarray | None = None) -> None:
        """Server: ``recv[k - 1] = send_k`` for every party k (the server's own `send` is not kept). Party: send.

        A party sends exactly what it would send to a Reduce (one point-to-point message to the server), so the
        two exchanges release the same to the same peer; only what the server does with the rows differs.

        Args:
            send: (n,) contiguous float32, same n on every rank.
            recv: server only, (K, n) contiguous float32; parties pass None.
        """
        check_buffer(send)
        if not self.is_server:
            self._wait(Requests([self.comm.Isend(send, dest=SERVER, tag=BUFFER_TAG)]), "gather")
            return
        if recv is None:
            raise ValueError("the server must pass a receive buffer")
        check_buffer(recv)
        if recv.shape != (self.size - 1, send.size):
            raise ValueError(f"gather: receive buffer has shape {recv.shape}, expected ({self.size - 1}, {send.size})")
        pending = Requests([self.comm.Irecv(recv[k - 1], source=k, tag=BUFFER_TAG) for k in range(1, self.size)])
        try:
            self._wait(pending, "gather")
        except BaseException:
            self._abandoned.append(recv)  # MPI may still write into it
            raise
        pending.check_count(send.size, send.dtype)

    def bcast(self, buf: np.ndarray) -> None:
        """Overwrite `buf` ((n,) contiguous float32, same n everywhere) on every party with the server's `buf`."""
        check_buffer(buf)
        start = time.perf_counter()
        try:
            if self.pattern == COLLECTIVE:  # W and A are what every party gets: any route is fine
                self._wait(Requests([self.comm.Ibcast(buf, root=SERVER)], keep=(buf,)), "bcast")
                return
            if self.is_server:
                # Synchronous sends: each completes once its party has the data, not once it sits in a socket
                # buffer, so `bcast_seconds` is the transfer itself, also over a slow link (the parties already
                # wait; the extra acknowledgement is one small message per party).
                self._wait(Requests([self.comm.Issend(buf, dest=k, tag=BUFFER_TAG) for k in range(1, self.size)]),
                           "bcast")
                return
            pending = Requests([self.comm.Irecv(buf, source=SERVER, tag=BUFFER_TAG)])
            self._wait(pending, "bcast")
            pending.check_count(buf.size, buf.dtype)
        finally:
            self.bcast_seconds += time.perf_counter() - start

    def barrier(self) -> None:
        """Wait until every rank reached this point (polled, under the channel's time limit)."""
        self._wait(Requests([self.comm.Ibarrier()]), "barrier")

    # -- setup objects: plain data and registered dataclasses (mpi_fnas.wire), never pickles ------------------------
    def bcast_object(self, obj: object = None) -> object:
        """The server's `obj` on every rank (parties pass nothing; they get a decoded copy)."""
        if not self.is_server:
            return self._receive_object("bcast_object")
        payload = encode(obj)
        self._wait(Requests([self.comm.Isend(payload, dest=k, tag=OBJECT_TAG) for k in range(1, self.size)]),
                   "bcast_object")
        return obj

    def scatter_objects(self, objs: Sequence[object] | None = None) -> object:
        """Rank r gets ``objs[r]``; `objs` (one per rank, the server's own first) is given by the server only.

        Each party receives only its own object: nothing meant for one party passes through another.
        """
        if not self.is_server:
            return self._receive_object("scatter_objects")
        if objs is None or len(objs) != self.size:
            raise ValueError(f"scatter_objects: the server must pass {self.size} objects (one per rank)")
        requests = [self.comm.Isend(encode(objs[k]), dest=k, tag=OBJECT_TAG) for k in range(1, self.size)]
        self._wait(Requests(requests), "scatter_objects")
        return objs[SERVER]

    def gather_objects(self, obj: object) -> list | None:
        """Server: ``[obj of rank 0, obj of rank 1, …]``; parties send `obj` and get None."""
        if not self.is_server:
            self._wait(Requests([self.comm.Isend(encode(obj), dest=SERVER, tag=OBJECT_TAG)]), "gather_objects")
            return None
        incoming = [incoming_object(self.comm, k) for k in range(1, self.size)]
        self._wait(AllOf(incoming), "gather_objects")
        return [obj, *(decoded(item) for item in incoming)]

    # -- among the parties, never through the server ----------------------------------------------------------
    def exchange_among_parties(self, message: bytes) -> dict[int, bytes]:
        """Party: send `message` (raw bytes, at most ``MAX_PEER_MESSAGE``) to every other party and return
        ``{rank: its message}`` from each. Every party calls it; the server does not.

        Point to point between the parties, never relayed by rank 0: MPI stamps every message with its sender and
        the receives name their source, so rank 0 can neither alter a party's message nor send one in its name.
        Secure aggregation's key-set confirmation rests on this (:mod:`mpi_fnas.secagg.keyset`). Polled like every
        exchange, so a party that never answers ends in :class:`CollectiveTimeoutError`, not a hang.
        """
        if self.is_server:
            raise RuntimeError("exchange_among_parties: the server takes no part in it")
        if len(message) > MAX_PEER_MESSAGE:
            raise ValueError(f"exchange_among_parties: {len(message)} bytes, at most {MAX_PEER_MESSAGE}")
        payload = np.frombuffer(bytes(message), dtype=np.uint8).copy()  # a buffer MPI may read until the send ends
        peers = [k for k in range(1, self.size) if k != self.rank]
        incoming = [Incoming(self.comm, k, PEER_TAG, MAX_PEER_MESSAGE) for k in peers]
        sends = Requests([self.comm.Isend(payload, dest=k, tag=PEER_TAG) for k in peers])
        self._wait(AllOf([sends, *incoming]), "exchange_among_parties")
        return {k: item.value() for k, item in zip(peers, incoming, strict=True)}

    def _receive_object(self, what: str) -> object:
        incoming = incoming_object(self.comm, SERVER)
        self._wait(incoming, what)
        return decoded(incoming)

    # -- failure handling --------------------------------------------------------------------------------------
    def notify_failure(self, message: str, grace: float | None = None) -> None:
        """Best effort: tell the server this party failed (the caller then aborts the job).

        Sends exactly the UTF-8 bytes of `message` (truncated to 4095) in a fixed-size zero-padded buffer, then
        waits `grace` seconds (default: ``min(FAILURE_GRACE, timeout)``) for the server to abort the job; the
        server normally does so within milliseconds of its next poll, so the wait is rarely spent in full.
        """
        if grace is None:
            grace = min(FAILURE_GRACE, self.timeout)
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

    def _wait(self, pending: Pending, what: str) -> None:
        """Poll `pending` until done (schedule: module docstring); the server also checks for failure notices."""
        if self._abandoned:
            self._abandoned.append(pending)
            raise RuntimeError(f"{what}: an earlier exchange on this channel failed; the job must be aborted")
        start = time.perf_counter()
        polls, pause = 0, FIRST_PAUSE
        try:
            while not pending.test():
                polls += 1
                if self.is_server and (polls > SPIN_POLLS or polls % 8 == 0):
                    self._check_notice()
                waited = time.perf_counter() - start
                if waited > self.timeout:
                    raise CollectiveTimeoutError(
                        f"{what} did not complete within {self.timeout:g} s (runtime.comm_timeout; after a stage's "
                        "first steps, its adaptive limit: runtime.comm_timeout_factor)"
                    )
                if polls > SPIN_POLLS:
                    time.sleep(pause)
                    pause = next_pause(pause, waited, self.max_pause, self.pause_fraction)
        except BaseException:
            self._abandoned.append(pending)
            self._parts = {}  # a receive may still land in the old buffers
            raise
        finally:
            self.comm_seconds += time.perf_counter() - start
