"""``python -m mpi_fnas.sweep``: see mpi_fnas.sweep.command."""

from mpi_fnas.cli import exit_process
from mpi_fnas.sweep.command import main

if __name__ == "__main__":
    exit_process(main())
