"""Nothing from the server is unpickled: rank 0 plays the adversary and sends every party, where it
expects its assignment, a pickle whose loading would run a command. Each party refuses the message as not data,
and the command never runs. The format itself, without MPI: tests/test_wire.py.

Run with: mpirun -n 5 python -m pytest --with-mpi --only-mpi tests/mpi/test_wire_from_server.py (any size >= 2).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
from mpi4py import MPI
from mpi_waits import quiet_barrier

from mpi_fnas.federation.comm import OBJECT_TAG
from mpi_fnas.federation.handshake import receive_assignment
from mpi_fnas.federation.job_plan import Assignment
from mpi_fnas.wire import WireError


class Exploit:
    """A pickle that runs ``touch MARKER`` when loaded (as any crafted payload could run anything)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.mpi(min_size=2)
def test_a_pickled_assignment_from_rank_0_is_refused_and_never_executed(channel, shared_dir):
    where = shared_dir("wire-pickle-")
    markers = [where / f"pwned-{rank}" for rank in range(channel.size)]
    outcome = ""
    if channel.is_server:
        payloads = [pickle.dumps(Exploit(markers[rank])) for rank in range(1, channel.size)]
        requests = [channel.comm.Isend(payload, dest=rank, tag=OBJECT_TAG)
                    for rank, payload in enumerate(payloads, start=1)]
        MPI.Request.Waitall(requests)
    else:
        # The outcome is checked after the barrier, so that every rank reaches it whatever happens here.
        try:
            outcome = f"accepted {receive_assignment(channel, Assignment, 'cpu')!r}"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    quiet_barrier(channel.comm)
    assert not any(marker.exists() for marker in markers), "the pickle ran"
    if not channel.is_server:
        assert outcome.startswith(f"{WireError.__name__}: rank 0 sent a message that is not data"), outcome
