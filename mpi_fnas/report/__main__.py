"""``python -m mpi_fnas.report``: see mpi_fnas.report.command."""

from mpi_fnas.cli import exit_process
from mpi_fnas.report.command import main

if __name__ == "__main__":
    exit_process(main())
