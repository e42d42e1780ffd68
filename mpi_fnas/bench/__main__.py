"""``python -m mpi_fnas.bench`` (and, under ``mpirun``, on every rank): see mpi_fnas.bench.command."""

from mpi_fnas.bench.command import main
from mpi_fnas.cli import exit_process

if __name__ == "__main__":
    exit_process(main())
