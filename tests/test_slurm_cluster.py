"""The loopback Slurm harness really schedules MPI jobs, fake GPUs and requeues (tests/slurm_cluster.py).

These tests pin the facts the batch scripts in slurm/ rely on: `srun --mpi=pmi2` wires mpi4py (MPICH wheel)
ranks into one world, `--gpus=8` is schedulable on a GPU-less host, `scontrol requeue` brings a job back with
SLURM_RESTART_COUNT=1, and the harness leaves no process behind.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import (  # noqa: F401  (slurm_cluster is the fixture)
    SlurmCluster,
    SlurmUnavailableError,
    ensure_slurm_installed,
    make_cluster_root,
    slurm_cluster,
)

pytestmark = pytest.mark.slurm

PYTHON = sys.executable


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\nset -euo pipefail\n" + body)
    path.chmod(0o755)
    return path


def wait_for_file(path: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.2)
    raise AssertionError(f"{path} not written within {timeout:.0f} s")


def test_srun_pmi2_wires_nine_mpi_ranks(slurm_cluster, tmp_path):  # noqa: F811
    out = tmp_path / "ranks"
    out.mkdir()
    # Every rank takes part in an allreduce, so a rank that started as a singleton (PMI not wired) would
    # report size 1 and its own rank as the sum. Each rank also places itself as the run will (8 fake GPUs).
    program = (
        "import os; from mpi4py import MPI; "
        "from mpi_fnas.federation.placement import node_local_rank, select_device; "
        "c = MPI.COMM_WORLD; total = c.allreduce(c.Get_rank()); local = node_local_rank(c); "
        "device = select_device(c.Get_rank(), local_rank=local, visible_gpus=8); "
        f"open(os.path.join({str(out)!r}, 'rank%d' % c.Get_rank()), 'w')"
        ".write('%d %d %d %s %d %s' % (c.Get_rank(), c.Get_size(), total, os.environ['SLURM_PROCID'], local, device))"
    )
    script = write_script(tmp_path / "mpi.sh", f'srun --mpi=pmi2 -n 9 {PYTHON} -c "{program}"\n')
    job = slurm_cluster.sbatch("--wait", "-n", "9", f"--output={tmp_path}/%j.out", str(script))
    info = slurm_cluster.job_info(job)
    assert info["JobState"] == "COMPLETED", (info, (tmp_path / f"{job}.out").read_text())
    rows = sorted(tuple(p.read_text().split()) for p in out.iterdir())
    assert [int(r[0]) for r in rows] == list(range(9))
    assert {int(r[1]) for r in rows} == {9}
    assert {int(r[2]) for r in rows} == {sum(range(9))}
    # MPI rank == Slurm task id: PMI2 handed the ranks over from srun; one node, so local rank == rank too.
    assert all(r[0] == r[3] == r[4] for r in rows)
    assert [r[5] for r in rows] == ["cpu"] + [f"cuda:{i}" for i in range(8)]


def test_gpus_8_schedules_on_fake_gres(slurm_cluster, tmp_path):  # noqa: F811
    env_file = tmp_path / "env.txt"
    script = write_script(tmp_path / "gpu.sh", f"env | sort > {env_file}\n")
    job = slurm_cluster.sbatch(
        "--wait", "-n", "1", "--gpus=8", f"--output={tmp_path}/%j.out", str(script)
    )
    assert slurm_cluster.job_info(job)["JobState"] == "COMPLETED"
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    gpu_vars = {k: v for k, v in env.items() if "GPU" in k or k == "CUDA_VISIBLE_DEVICES"}
    print("GPU-related variables seen by the job:", gpu_vars)
    assert env.get("SLURM_GPUS") == "8", gpu_vars
    assert env.get("SLURM_GPUS_ON_NODE") == "8", gpu_vars
    assert sorted(env["SLURM_JOB_GPUS"].split(",")) == [str(i) for i in range(8)], gpu_vars
    if slurm_cluster.gpu_files_are_devices:
        # gres/gpu names the allocated devices by their index in gres.conf's File= list.
        assert sorted(env["CUDA_VISIBLE_DEVICES"].split(",")) == [str(i) for i in range(8)], gpu_vars


def test_scontrol_requeue_restarts_job_with_restart_count(slurm_cluster, tmp_path):  # noqa: F811
    marks = tmp_path / "marks"
    marks.mkdir()
    # Attempt 0 records itself and waits to be requeued; attempt 1 records itself and finishes.
    script = write_script(
        tmp_path / "requeue.sh",
        f'count="${{SLURM_RESTART_COUNT:-0}}"\n'
        f'echo "$count $SLURM_JOB_ID" > {marks}/attempt-"$count"\n'
        f'if [ "$count" = 0 ]; then sleep 120; fi\n',
    )
    job = slurm_cluster.sbatch(
        "--requeue", "--open-mode=append", "-n", "1", f"--output={tmp_path}/%j.out", str(script)
    )
    wait_for_file(marks / "attempt-0")
    slurm_cluster.run("scontrol", "requeue", str(job))
    info = slurm_cluster.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=90)
    assert info["JobState"] == "COMPLETED", info
    assert info["Restarts"] == "1", info
    assert (marks / "attempt-1").read_text().split() == ["1", str(job)]
    assert sorted(p.name for p in marks.iterdir()) == ["attempt-0", "attempt-1"]


def test_stop_ends_every_daemon_and_running_job():
    """A second, private cluster: stop() must leave none of its daemons nor a running job's process alive."""
    try:
        ensure_slurm_installed()
    except SlurmUnavailableError as exc:
        pytest.skip(str(exc))
    cluster = SlurmCluster(root=make_cluster_root())
    try:
        cluster.start()
        pid_file = cluster.root / "job.pid"
        script = write_script(cluster.root / "sleep.sh", f"sleep 300 & echo $! > {pid_file}; wait\n")
        cluster.sbatch("-n", "1", f"--output={cluster.root}/%j.out", str(script))
        job_pid = int(wait_for_file(pid_file))
        daemon_pids = dict(cluster.pids)
        assert set(daemon_pids) == {"munged", "slurmctld", "slurmd"}
    finally:
        cluster.stop()
    for pid in [*daemon_pids.values(), job_pid]:
        assert not pid_alive(pid), f"pid {pid} still running after stop() ({daemon_pids}, job {job_pid})"
    assert not cluster.root.exists()


def pid_alive(pid: int) -> bool:
    """True when pid exists and is not a zombie (a zombie has exited; it only awaits its parent's wait)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
