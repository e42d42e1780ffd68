"""Shared test setup: one torch thread per process so parallel MPI ranks on a 2-core box do not thrash."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)
