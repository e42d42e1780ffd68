"""Which device each MPI rank computes on.

The rule (pure, in :func:`select_device`):

- ``preference="cpu"`` puts every rank on the CPU.
- Rank 0 (the parameter server) does no heavy compute, so it uses the CPU unless ``server_uses_gpu``.
- A rank that wants a GPU and sees none: ``preference="auto"`` falls back to the CPU, ``"cuda"`` is an error.
- Otherwise the rank takes device ``(local_rank - 1) mod visible_gpus``, where ``local_rank`` is its index
  among the ranks on its own node (``SLURM_LOCALID`` or MPI's shared-memory split, see :func:`node_local_rank`).

Why ``local_rank - 1``: on rank 0's node the server is local rank 0, so parties 1..n get devices 0..n-1; on other
nodes the parties get G-1, 0, 1, ... (G = visible GPUs), still all different. So the rule needs no knowledge of
where the server runs, and a node with no more parties than GPUs gives each its own (more share round-robin). A
server that does use a GPU takes device G-1, the one a party needs only on a full node. docs/hpc.md, "GPU placement".
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # mpi4py is only needed by node_local_rank; keep the pure rule importable without MPI
    from mpi4py import MPI

PREFERENCES = ("auto", "cpu", "cuda")


def select_device(rank: int, *, local_rank: int | None, visible_gpus: int, server_uses_gpu: bool = False,
                  preference: str = "auto") -> str:
    """The torch device string ("cpu" or "cuda:N") for world rank `rank`.

    Args:
        rank: world rank (0 = server, 1..K = parties).
        local_rank: index of this rank among the ranks on its node; None when unknown, which is taken to
            mean a single node (local rank = world rank).
        visible_gpus: number of CUDA devices this process can see (``torch.cuda.device_count()``).
        server_uses_gpu: let rank 0 use a GPU too.
        preference: "auto" (GPU when visible, else CPU), "cpu", or "cuda" (a GPU or an error).

    Raises:
        ValueError: unknown preference, negative counts/ranks, or "cuda" requested where no GPU is visible.
    """
    if preference not in PREFERENCES:
        raise ValueError(f"device preference must be one of {', '.join(PREFERENCES)}, got {preference!r}")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if local_rank is not None and local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    if visible_gpus < 0:
        raise ValueError(f"visible_gpus must be >= 0, got {visible_gpus}")
    if preference == "cpu" or (rank == 0 and not server_uses_gpu):
        return "cpu"
    if visible_gpus == 0:
        if preference == "cuda":
            raise ValueError(f"rank {rank}: device 'cuda' requested but no CUDA device is visible")
        return "cpu"
    slot = rank if local_rank is None else local_rank
    return f"cuda:{(slot - 1) % visible_gpus}"


def node_local_rank(comm: MPI.Comm) -> int:
    """This process's index among the ranks of `comm` that share its node. Collective over `comm`.

    ``SLURM_LOCALID`` is used only when every rank is itself a task of the current Slurm step (srun launched
    each rank: ``SLURM_PROCID`` equals the rank and ``SLURM_STEP_NUM_TASKS`` the size). Under ``mpirun``
    inside an allocation every rank inherits the batch shell's ``SLURM_LOCALID=0``/``SLURM_PROCID=0`` (or
    those of hydra's per-node proxy), which would put all parties on one GPU; MPI's shared-memory split
    decides then. The ranks agree on the source first, so no rank skips the split the others enter.
    """
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    localid = os.environ.get("SLURM_LOCALID", "")
    srun_task = (localid.isdigit() and os.environ.get("SLURM_PROCID") == str(rank)
                 and os.environ.get("SLURM_STEP_NUM_TASKS") == str(size))
    # A numpy buffer, not mpi4py's pickling allreduce: nothing a rank receives is unpickled (docs/privacy.md §2.11).
    agreed = np.array([1 if srun_task else 0], dtype=np.int32)
    comm.Allreduce(MPI.IN_PLACE, agreed, op=MPI.MIN)
    if agreed[0]:
        return int(localid)
    # key=rank keeps world order inside the node, so local ranks are consecutive like SLURM_LOCALID's.
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        return node_comm.Get_rank()
    finally:
        node_comm.Free()


def visible_gpu_count() -> int:
    """CUDA devices this process can see (0 without a CUDA build or driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_for_rank(comm: MPI.Comm, *, server_uses_gpu: bool = False, preference: str = "auto") -> str:
    """:func:`select_device` for the calling rank of `comm` (collective: every rank must call it)."""
    return select_device(comm.Get_rank(), local_rank=node_local_rank(comm), visible_gpus=visible_gpu_count(),
                         server_uses_gpu=server_uses_gpu, preference=preference)
