"""Does the search beat random, and the hand-designed networks? A baseline at equal ε, in one MPI job.

    mpirun -n K+1 python -m mpi_fnas.baseline [--config FILE] [--set key=value ...] --random R --seeds S [S ...]
                                              [--handcrafted cnn-tanh,cnn-gn] [--out DIR]
    python -m mpi_fnas.report DIR        # the baseline table, RI and the searched cell's rank

For every seed: the **searched** arm (the configured search, then the augmentation of its cell), R **random**
cells of the same space and the **hand-designed** networks of ``--handcrafted``, each trained by the same
augmentation. Under ``dpfnas`` every arm ends at the user's ``privacy.target_epsilon``; each party derives every
arm's config itself and composes its own ε over the arms on its data (``privacy.party_max_epsilon``). Every arm is
an ordinary run with its own ``search.h5`` (``DIR/seed<S>/<arm>/``); after every arm rank 0 rewrites
``DIR/baseline.csv``, and at the end prints the comparison. Why, and how to run it: docs/baseline.md.

Modules: ``arms`` (the arms, their draws and configs), ``results`` (baseline.csv, the comparison) and ``command``
(the command line).
"""

from mpi_fnas.baseline.arms import (
    RANDOM_TAG,
    SEARCHED,
    Arm,
    arm_config,
    arms,
    check_base,
    parse_handcrafted,
    random_genotype_text,
)
from mpi_fnas.baseline.command import build_parser, main
from mpi_fnas.baseline.results import (
    CSV_NAME,
    EPSILON_TOLERANCE,
    ArmResult,
    Comparison,
    SeedComparison,
    compare,
    format_comparison,
    read_arm,
    read_csv,
    verdict,
    write_csv,
)

__all__ = [
    "CSV_NAME",
    "EPSILON_TOLERANCE",
    "RANDOM_TAG",
    "SEARCHED",
    "Arm",
    "ArmResult",
    "Comparison",
    "SeedComparison",
    "arm_config",
    "arms",
    "build_parser",
    "check_base",
    "compare",
    "format_comparison",
    "main",
    "parse_handcrafted",
    "random_genotype_text",
    "read_arm",
    "read_csv",
    "verdict",
    "write_csv",
]
