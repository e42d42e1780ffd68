"""``python -m mpi_fnas.baseline``: see mpi_fnas.baseline.command."""

import sys

from mpi_fnas.baseline.command import main

if __name__ == "__main__":
    sys.exit(main())
