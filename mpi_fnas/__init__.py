"""mpi_fnas: differentially-private federated neural architecture search over MPI."""

__version__ = "0.1.0"
