"""``python -m mpi_fnas.report``: see mpi_fnas.report.command."""

import sys

from mpi_fnas.report.command import main

if __name__ == "__main__":
    sys.exit(main())
