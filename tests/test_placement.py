"""GPU placement: the pure rank -> device rule, and the node-local rank under mpirun (mpi_fnas.federation.placement)."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mpi_fnas.federation.placement import select_device

MPIRUN = Path(sys.executable).with_name("mpirun")


def place(ranks_on_nodes: list[list[int]], gpus: int, **kwargs) -> dict[int, tuple[int, str]]:
    """{world rank: (node index, device)} for ranks laid out as `ranks_on_nodes[node] = [world ranks...]`."""
    return {
        rank: (node, select_device(rank, local_rank=local, visible_gpus=gpus, **kwargs))
        for node, ranks in enumerate(ranks_on_nodes)
        for local, rank in enumerate(ranks)
    }


def party_devices_per_node(placement: dict[int, tuple[int, str]]) -> dict[int, list[str]]:
    per_node: dict[int, list[str]] = collections.defaultdict(list)
    for rank, (node, device) in sorted(placement.items()):
        if rank != 0:
            per_node[node].append(device)
    return per_node


def test_one_node_server_cpu_parties_on_gpus_in_order():
    placement = place([list(range(9))], gpus=8)
    assert placement[0] == (0, "cpu")
    assert [placement[r][1] for r in range(1, 9)] == [f"cuda:{i}" for i in range(8)]


@pytest.mark.parametrize(
    "layout",
    [
        # block: node 0 holds the server and 8 parties, node 1 the next 8 parties (its local rank 0 is a party)
        [list(range(9)), list(range(9, 17))],
        # cyclic (srun --distribution=cyclic): even ranks on node 0, odd ranks on node 1
        [list(range(0, 17, 2)), list(range(1, 17, 2))],
        # server alone on a node, 8 parties on each of two GPU nodes
        [[0], list(range(1, 9)), list(range(9, 17))],
    ],
    ids=["block", "cyclic", "server-alone"],
)
def test_multi_node_each_party_gets_its_own_gpu(layout):
    per_node = party_devices_per_node(place(layout, gpus=8))
    for node, devices in per_node.items():
        assert len(set(devices)) == len(devices), (node, devices)
        assert all(d.startswith("cuda:") and 0 <= int(d.split(":")[1]) < 8 for d in devices)


def test_more_parties_than_gpus_share_round_robin():
    per_node = party_devices_per_node(place([list(range(17))], gpus=8))
    uses = collections.Counter(per_node[0])
    assert sorted(uses) == [f"cuda:{i}" for i in range(8)]
    assert set(uses.values()) == {2}


def test_server_uses_gpu_takes_the_last_device():
    placement = place([list(range(5))], gpus=8, server_uses_gpu=True)
    assert placement[0][1] == "cuda:7"
    assert [placement[r][1] for r in range(1, 5)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_one_gpu_per_task_binding_means_cuda_0_everywhere():
    # srun --gpus-per-task=1: each task sees exactly its own device as index 0.
    assert {select_device(r, local_rank=r, visible_gpus=1) for r in range(1, 9)} == {"cuda:0"}


def test_cpu_preference_and_cpu_fallback():
    assert select_device(3, local_rank=3, visible_gpus=8, preference="cpu") == "cpu"
    assert select_device(0, local_rank=0, visible_gpus=8, server_uses_gpu=True, preference="cpu") == "cpu"
    assert select_device(3, local_rank=3, visible_gpus=0) == "cpu"
    assert select_device(0, local_rank=0, visible_gpus=0, server_uses_gpu=True) == "cpu"


def test_cuda_preference_without_gpu_is_an_error_only_where_a_gpu_is_needed():
    with pytest.raises(ValueError, match="no CUDA device"):
        select_device(2, local_rank=2, visible_gpus=0, preference="cuda")
    with pytest.raises(ValueError, match="no CUDA device"):
        select_device(0, local_rank=0, visible_gpus=0, server_uses_gpu=True, preference="cuda")
    # A CPU-only server node is fine: the server does not need a GPU.
    assert select_device(0, local_rank=0, visible_gpus=0, preference="cuda") == "cpu"
    assert select_device(2, local_rank=2, visible_gpus=2, preference="cuda") == "cuda:1"


def test_unknown_local_rank_means_single_node():
    assert select_device(5, local_rank=None, visible_gpus=8) == "cuda:4"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rank": 1, "local_rank": 1, "visible_gpus": 1, "preference": "gpu"},
        {"rank": -1, "local_rank": 0, "visible_gpus": 1},
        {"rank": 1, "local_rank": -1, "visible_gpus": 1},
        {"rank": 1, "local_rank": 1, "visible_gpus": -1},
    ],
)
def test_bad_arguments_raise(kwargs):
    rank = kwargs.pop("rank")
    with pytest.raises(ValueError):
        select_device(rank, **kwargs)


# --- node_local_rank under a real launcher ---------------------------------------------------------------------

LOCAL_RANK_PROGRAM = """
from mpi4py import MPI
from mpi_fnas.federation.placement import node_local_rank
comm = MPI.COMM_WORLD
local_ranks = comm.gather(node_local_rank(comm), root=0)
if comm.Get_rank() == 0:
    print(" ".join(map(str, local_ranks)), flush=True)
"""


def run_local_ranks(extra_env: dict[str, str]) -> dict[int, int]:
    """{world rank: node_local_rank} from `mpirun -n 3` on this one node."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_"))}
    env.update(extra_env, OMP_NUM_THREADS="1")
    # Own process group, so a hang (the bug this guards against) is killed with all its ranks.
    with subprocess.Popen(
        [str(MPIRUN), "-n", "3", sys.executable, "-c", LOCAL_RANK_PROGRAM],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    assert proc.returncode == 0, stderr
    return dict(enumerate(map(int, stdout.split())))


@pytest.mark.skipif(not MPIRUN.exists(), reason="no mpirun next to the venv python")
def test_node_local_rank_from_shared_memory_split():
    assert run_local_ranks({}) == {0: 0, 1: 1, 2: 2}


@pytest.mark.skipif(not MPIRUN.exists(), reason="no mpirun next to the venv python")
def test_node_local_rank_ignores_slurm_vars_inherited_by_mpirun_ranks():
    # mpirun inside an sbatch job: every rank inherits the batch shell's SLURM_LOCALID=0 and SLURM_PROCID=0.
    # Rank 0's variables look consistent, the others' do not; all ranks must still agree to use the split.
    inherited = {"SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "3"}
    assert run_local_ranks(inherited) == {0: 0, 1: 1, 2: 2}
