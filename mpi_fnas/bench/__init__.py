"""Benchmark: one party step (non-private and private) of the search and of the augmentation, and the MPI
exchange, for a given config.

    python -m mpi_fnas.bench [--config FILE] [--set key=value ...] [--repeats N] [--no-memory] [--json]
    mpirun -n K+1 python -m mpi_fnas.bench ...     # the exchange over K+1 real ranks

The party step (G_k then H_k, first order, on random inputs of the configured shape) is timed on one rank while
the others wait (in a sleeping poll, so they do not steal its core); the exchange (Reduce G, Bcast W, Reduce H,
Bcast A — the collectives of one iteration, same buffers as the search) is timed with every rank taking part.
Medians over `--repeats`. ``comm_fraction = comm_seconds / (step_seconds + comm_seconds)``. A private step is also
split three ways: the plain step's compute, the DP work (``dp_work_seconds = dp_step_seconds - step_seconds``:
per-example gradients, clipping, noise) and the exchange (``split_*_fraction``, summing to 1).

The same step is also timed privately (DP-FNAS, ``search_party(..., dp=DPParams(...))``): same network and initial
weights, same inputs, same batch size B. The private party's shard holds exactly B examples, so its Poisson rate
is q = B / N = 1 and every Poisson batch is exactly those B examples, the batch the non-private party uses.
The two variants are timed in alternation so that load changes on a shared machine hit both alike.
The augmentation's party step (one weight release of the augmented network, ``augment.batch_size`` examples) is
timed the same way, plain and private, interleaved.
Peak memory of each variant is the peak RSS of a fresh subprocess during one step (see docs/benchmarks.md).
Secure against local aggregation of the W release (K = 8, equal ε against the server) is compared on the same
party: the noise in the server's sum, the cost of sealing and opening, the bits the sum needs.
The private step of the hand-designed ``cnn-tanh`` (one party, one batch) is timed beside Opacus's
(``GradSampleModule`` + ``DPOptimizer``, noise included) on the same network, weights, inputs and threads:
``dp_step_vs_opacus`` = CPU seconds ours / theirs (:func:`compare_opacus`).

Speed and memory targets are checked here, never in timed tests.

One module per benchmark: :mod:`~mpi_fnas.bench.party_step` (the search's step, its GFLOP, the core's peak),
:mod:`~mpi_fnas.bench.augment_step`, :mod:`~mpi_fnas.bench.opacus_comparison`, :mod:`~mpi_fnas.bench.aggregation`
(secure against local), :mod:`~mpi_fnas.bench.memory` (the peak-memory subprocesses),
:mod:`~mpi_fnas.bench.exchange` (the only one on MPI); :mod:`~mpi_fnas.bench.command` is the command line.
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
