"""Noise sweep (the paper's Table 2 in small): every (noise variance, seed) point of a DP-FNAS run, in one MPI job.

    mpirun -n K+1 python -m mpi_fnas.sweep --config configs/dpfnas_noise_sweep.yaml [--set key=value ...] [--out DIR]
    python -m mpi_fnas.sweep --summarize DIR        # table an existing sweep (e.g. slurm/noise_sweep.sh's output)

The config is a normal run config plus an optional top-level ``sweep:`` section, which this tool strips before
the run config is validated (so ``mpi_fnas.run`` does not accept the file as it is; the rest of it is an ordinary
run config)::

    sweep:
      variances: [0.5, 1, 2, 5, 8, 10]   # the paper's "variance of noise" σ²; each point sets σ_W = σ_A = √σ²
      seeds: [0, 1, 2]

``--set sweep.variances=[1,10]`` / ``--set sweep.seeds=[0]`` override it like any other key. Without the section
the sweep is the paper's six variances with seed 0 (the defaults of ``slurm/noise_sweep.sh``, which runs the same
points as an array job with the same σ and the same directory names).

Every rank loops over the same points in the same order on one :class:`~mpi_fnas.federation.comm.Channel`;
point (v, s) writes ``DIR/var<v>-seed<s>/search.h5`` (DIR default ``runs/<name>-sweep-<timestamp>``). After every
point rank 0 rewrites ``DIR/points.csv`` (one row per run) and ``DIR/summary.csv`` (one row per variance: test
error mean ± std over seeds, worst party's ε), so a crash keeps the finished points' results, and at the end it
prints the table. The error is the supernet's on the server's test split: under DP the parties' validation
accuracy is not released (it would be an unaccounted release), so it stands in for the paper's validation error.

Privacy over the whole sweep. The ε of one point (``epsilon_worst``) is what that run alone spent. But the points
of one seed reuse the same examples on the same parties (the data, its train/validation split and its partition
depend only on the data config, the seed and K, never on σ), so a party's examples were released in every
point of its seed, and what it really spent is the composition of all of them. ``epsilon_sweep_composed`` (in
points.csv, summary.csv and the table's "ε sweep" column) is that composition, computed with the PLD accountant
(:class:`mpi_fnas.privacy.PrivacyLedger`, which mixes different σ and q exactly) from each log's /privacy facts:

* which points share examples (:func:`data_identity`): synthetic-shapes renders image i as a pure function of
  (seed, split, i), so different seeds draw different examples and each seed is its own pool; CIFAR-10 has the
  same images for every seed (only re-partitioned), so all its points form one pool.
* one placement in a pool (synthetic-shapes, or CIFAR-10 with one seed): party k held the same train and the
  same validation shard in every point; its ε is the larger of its composed train and composed validation
  ledgers (disjoint shards), at its δ; the column holds the worst party.
* several placements (CIFAR-10 over several seeds): an image may have been in any party's train or validation
  shard in each seed, so the bound is the worst case, per point the smallest σ, largest rate and largest count
  of any party and shard (dominating every placement), at the smallest δ.
* releases per shard come from ``/privacy/charged_steps`` when the log has it, else ``/privacy/steps``; a
  requeued run without charged_steps and an unfinished run (failed, still running, or an abandoned
  ``search-attempt<n>.h5`` in the point's directory) are charged an upper bound (``exact_sweep_composed`` False).

It covers the points in DIR only: runs outside it on the same data (another sweep, a plain ``mpi_fnas.run``)
compose on top.

Exit codes as ``mpi_fnas.run``: 0 finished · 1 failure (job aborted, that point's log ``failed``) · 2 bad input
(one line from rank 0) · 75 interrupted by SIGTERM/SIGUSR1/SIGINT (the current point checkpointed; resume it with
``mpi_fnas.run --resume DIR/var<v>-seed<s>``, run the points not yet done with ``--set sweep.…`` into the same
``--out`` — a point that already has a log is refused, never overwritten — then ``--summarize DIR``).

Modules: ``points`` (the sweep's points and config: SweepPoint, SweepSpec, load_sweep), ``results`` (reading a
point back from its logs: PointResult, LogReleases, data_identity), ``composition`` (what a party really spent
over the sweep: SweepComposition, compose_sweep), ``summary`` (the table and points.csv / summary.csv) and
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
