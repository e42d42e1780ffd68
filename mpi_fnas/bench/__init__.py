"""Benchmark: one party step (non-private and private) of the search and of the augmentation, and the MPI
exchange, for a given config.

    python -m mpi_fnas.bench [--config FILE] [--set key=value ...] [--repeats N] [--no-memory] [--json]
    mpirun -n K+1 python -m mpi_fnas.bench ...     # the exchange over K+1 real ranks

The party step (G_k then H_k, first order) is timed on one rank while the others sleep; the exchange (one
iteration's four collectives) with every rank. The private step runs on the same network, weights and B inputs
(Poisson rate 1), interleaved with the plain one, and is split into compute, DP work and exchange (docs/hpc.md);
also measured: peak memory, secure against local aggregation, the private ``cnn-tanh`` step against Opacus's.
Targets are checked here, never in timed tests. How each number is made fair, every field: docs/benchmarks.md.

Modules: ``party_step`` (the search's step), ``augment_step``, ``opacus_comparison``, ``aggregation``, ``memory``,
``devices`` (the step on several devices), ``scattering`` (a ScatterNet's fixed stem), ``exchange`` (the only one
on MPI) and ``command`` (the command line).
"""

from mpi_fnas.bench.aggregation import compare_aggregation, equal_epsilon_sigmas
from mpi_fnas.bench.augment_step import make_augment_party, time_augment_step
from mpi_fnas.bench.command import REPORT_KEYS_FROM_STEP, main
from mpi_fnas.bench.exchange import time_exchange
from mpi_fnas.bench.memory import (
    SERVER_VARIANT,
    VARIANTS,
    measure_memory,
    measure_server_memory,
    measure_variant_memory,
)
from mpi_fnas.bench.memory import _reset_peak_rss as _reset_peak_rss  # tests/test_bench.py probes it as bench.*
from mpi_fnas.bench.opacus_comparison import compare_opacus
from mpi_fnas.bench.party_step import make_party, time_party_step

__all__ = [
    "REPORT_KEYS_FROM_STEP",
    "SERVER_VARIANT",
    "VARIANTS",
    "compare_aggregation",
    "compare_opacus",
    "equal_epsilon_sigmas",
    "main",
    "make_augment_party",
    "make_party",
    "measure_memory",
    "measure_server_memory",
    "measure_variant_memory",
    "time_augment_step",
    "time_exchange",
    "time_party_step",
]
