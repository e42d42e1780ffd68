"""Noise sweep (the paper's Table 2 in small): every (noise variance, seed) point of a DP-FNAS run, in one MPI job.

    mpirun -n K+1 python -m mpi_fnas.sweep --config configs/dpfnas_noise_sweep.yaml [--set key=value ...] [--out DIR]
    python -m mpi_fnas.sweep --summarize DIR        # table an existing sweep (e.g. slurm/noise_sweep.sh's output)

The config is a run config plus an optional top-level ``sweep:`` section (``variances``, ``seeds``). Point (v, s)
writes ``DIR/var<v>-seed<s>/search.h5``; after every point rank 0 rewrites ``DIR/points.csv`` (one row per run) and
``DIR/summary.csv`` (one row per variance). ``epsilon_worst`` is one run alone; ``epsilon_sweep_composed`` is what
a party really spent over the sweep (the points of a seed reuse its examples), composed with
:class:`mpi_fnas.privacy.PrivacyLedger`. Exit codes as ``mpi_fnas.run``. The manual: docs/sweep.md.

Modules: ``points`` (the sweep's points and config), ``results`` (reading a point back from its logs),
``composition`` (what a party really spent over the sweep), ``summary`` (the table and the CSV files) and
``command`` (the command line, ``main``; run by ``__main__``).
"""

from mpi_fnas.sweep.command import build_parser, main
from mpi_fnas.sweep.composition import SweepComposition, compose_pool, compose_sweep, touched_by, worst_of
from mpi_fnas.sweep.points import (
    DEFAULT_SEEDS,
    NOISE_KEYS,
    PAPER_VARIANCES,
    POINT_DIR,
    SWEEP_KEY,
    SweepPoint,
    SweepSpec,
    load_sweep,
    noise_multiplier,
    parse_sweep_section,
    point_config,
    sweep_yaml,
    variance_label,
)
from mpi_fnas.sweep.results import (
    ABANDONED_LOG_GLOB,
    LOG_NAME,
    SETTLED_STATUSES,
    LogReleases,
    PointResult,
    data_identity,
    log_releases,
    planned_steps_bound,
    read_point,
)
from mpi_fnas.sweep.summary import (
    POINTS_CSV,
    SUMMARY_CSV,
    SummaryRow,
    format_table,
    summarize,
    summarize_dir,
    write_results,
)

__all__ = [
    "ABANDONED_LOG_GLOB",
    "DEFAULT_SEEDS",
    "LOG_NAME",
    "NOISE_KEYS",
    "PAPER_VARIANCES",
    "POINTS_CSV",
    "POINT_DIR",
    "SETTLED_STATUSES",
    "SUMMARY_CSV",
    "SWEEP_KEY",
    "LogReleases",
    "PointResult",
    "SummaryRow",
    "SweepComposition",
    "SweepPoint",
    "SweepSpec",
    "build_parser",
    "compose_pool",
    "compose_sweep",
    "data_identity",
    "format_table",
    "load_sweep",
    "log_releases",
    "main",
    "noise_multiplier",
    "parse_sweep_section",
    "planned_steps_bound",
    "point_config",
    "read_point",
    "summarize",
    "summarize_dir",
    "sweep_yaml",
    "touched_by",
    "variance_label",
    "worst_of",
    "write_results",
]
