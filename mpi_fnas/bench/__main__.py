"""``python -m mpi_fnas.bench`` (and, under ``mpirun``, on every rank): see mpi_fnas.bench.command."""

import sys

from mpi_fnas.bench.command import main

if __name__ == "__main__":
    sys.exit(main())
