"""MPI test session: ranks > 0 write their pytest output to .pytest-rank<r>.log so the console shows rank 0 only."""

import os
import sys

from mpi4py import MPI

_rank = MPI.COMM_WORLD.Get_rank()
if _rank > 0:
    _log = open(f".pytest-rank{_rank}.log", "w")  # noqa: SIM115 — lives as long as the process
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(_log.fileno(), 1)
    os.dup2(_log.fileno(), 2)
