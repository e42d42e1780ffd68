"""Does the search beat random, and the hand-designed networks? A baseline at equal ε, in one MPI job.

    mpirun -n K+1 python -m mpi_fnas.baseline [--config FILE] [--set key=value ...] --random R --seeds S [S ...]
                                              [--handcrafted cnn-tanh,cnn-gn] [--out DIR]
    python -m mpi_fnas.report DIR        # the baseline table, RI and the searched cell's rank

A NAS product whose search does not beat random cells trained the same way has no reason to exist (Li & Talwalkar
2019; Yu et al., ICLR 2020; Yang et al., ICLR 2020). For every seed this runs:

* the **searched** arm: the configured job, a search then the augmentation of the cell it found;
* R **random** arms: cells drawn uniformly from the same space (``space.kind``, ``space.nodes``) from a public seed,
  each trained by the same augmentation;
* the **hand-designed** arms of ``--handcrafted`` (``augment.network``: ``cnn-tanh``, Papernot et al. 2021's tanh
  CNN; ``cnn-gn``, a GroupNorm CNN): what a DP practitioner would train instead of searching, by the same
  augmentation.

Under ``dpfnas`` every arm is calibrated to the user's ``privacy.target_epsilon`` (required): the searched arm's
search and augmentation together, and the random and hand-designed arms, which spent nothing on a search, their
augmentation alone; every arm ends at the same ε, which ``baseline.csv`` shows for both. Each party derives every
arm's config from its own command line and refuses rank 0's if it differs; it composes its own ε over the arms on
its data, which ``privacy.party_max_epsilon`` caps (docs/privacy.md §2.12).

Every arm is an ordinary run with its own ``search.h5`` (``DIR/seed<S>/<arm>/``), so ``mpi_fnas.run --resume``,
the report and the log readers work on it. After every arm rank 0 rewrites ``DIR/baseline.csv``; at the end it
prints the comparison (:mod:`mpi_fnas.baseline.results`: RI, rank, searched − random mean and searched − best
hand-designed network against their standard errors).

Modules: ``arms`` (the arms, their draws and configs), ``results`` (reading the arms back, baseline.csv, the
comparison) and ``command`` (the command line).
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
