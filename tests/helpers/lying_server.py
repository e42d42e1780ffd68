"""A modified rank 0 (issue 45): it plans and announces every configured step, whatever ``privacy.max_epsilon``
allows, then runs ``mpi_fnas.run`` unchanged. The parties run the real code. Used by tests/test_party_ledger.py
as ``mpirun -n N python -m lying_server ARGS`` with this directory on PYTHONPATH."""

from __future__ import annotations

import os
import sys

if os.environ.get("PMI_RANK") == "0":  # MPICH's rank, read before mpi4py loads (mpi_fnas.run loads it later)
    from mpi_fnas.federation import serve
    from mpi_fnas.privacy import planning

    planning._steps_within = lambda budget, shards, planned: planned
    serve.last_step_within_cap = lambda ledger, name, first, planned: (planned, None)

from mpi_fnas.run import main

sys.exit(main())
