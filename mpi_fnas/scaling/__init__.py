"""Scaling study of the search: strong and weak scaling over the party count K and the exchange pattern.

    python -m mpi_fnas.scaling run --out DIR [--parties 1 2 4 8] [--exchanges star collective]
                                   [--scaling strong weak] [--seeds 0] [--steps S] [--config FILE] [--set key=value ...]
    python -m mpi_fnas.scaling collect DIR [--link RATE] [--cores N] [--bench JSON ...]
    bash slurm/scaling.sh                     # the same grid as Slurm array jobs; then collect its root

Modules, planning apart from running: ``grid`` (the grid: points, their steps, run arguments and directory names),
``runner`` (one ``mpirun`` per point as a subprocess; no MPI or torch in this process), ``rss`` (each local rank's
peak memory from /proc), ``sizes`` (the released sizes from a config, for the cost model), ``results`` (a point's
row from its log and the cost model, efficiencies), ``table`` (scaling.csv, the markdown table), ``figures`` and
``command`` (the command line). docs/hpc.md, "The scaling study", documents the columns.
"""

from mpi_fnas.scaling.command import build_parser, main
from mpi_fnas.scaling.grid import (
    EXCHANGES,
    GRID_KEYS,
    SCALINGS,
    STRONG,
    WEAK,
    ScalingPoint,
    parse_dirname,
    plan_grid,
    point_steps,
    run_arguments,
)

__all__ = [
    "EXCHANGES",
    "GRID_KEYS",
    "SCALINGS",
    "STRONG",
    "WEAK",
    "ScalingPoint",
    "build_parser",
    "main",
    "parse_dirname",
    "plan_grid",
    "point_steps",
    "run_arguments",
]
