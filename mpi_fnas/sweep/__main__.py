"""``python -m mpi_fnas.sweep``: see mpi_fnas.sweep.command."""

import sys

from mpi_fnas.sweep.command import main

if __name__ == "__main__":
    sys.exit(main())
