"""``python -m mpi_fnas.scaling``: see mpi_fnas.scaling.command."""

from mpi_fnas.cli import exit_process
from mpi_fnas.scaling.command import main

if __name__ == "__main__":
    exit_process(main())
