"""``python -m mpi_fnas.baseline``: see mpi_fnas.baseline.command."""

from mpi_fnas.baseline.command import main
from mpi_fnas.cli import exit_process

if __name__ == "__main__":
    exit_process(main())
