"""slurm/dpfnas_8.sh, unchanged, across three hosts of the simulated cluster: Slurm's controller
and a slurmd on n0 (the server's node: 1 CPU), a slurmd on n1 and on n2 (the party nodes: 4 CPUs and 4 stand-in
GPUs each), so the job's 9 tasks and 8 GPUs land as rank 0 on n0 and four parties on each other host. n0 declares
one stand-in GPU too: Slurm 22.05 does not put a node without a GPU into a `--gpus` job ("Requested node
configuration is not available"), and cluster nodes that run this job have GPUs anyway.
The ranks run in the image of `make image` (through an `apptainer exec` -> `ch-run` shim, since Apptainer is not
packaged here); without the image (CI) that test skips, saying so, and CI checks the harness alone: a job step's
tasks run on the three hosts. The job is requeued mid-run with `scontrol requeue` and must come back, resume from
its run directory and finish.

Checked: the allocation spans n0, n1 and n2; each party host's link carried the job's traffic both ways; the job
completed after exactly one restart; the log is finished with 2 attempts and metric steps 1..12 exactly once.
Everything the test made (daemons, namespaces, links) is gone afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from slurm_cluster import (
    CLUSTER_SH,
    NamespaceSlurmCluster,
    SlurmUnavailableError,
    ensure_slurm_installed,
    make_cluster_root,
)
from test_cluster import counters, leftovers
from test_image import IMAGE, image_missing
from test_slurm_e2e import FINAL_STATES, RUN_TEST_HOOKS, job_output, try_read_run

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
DPFNAS_8 = REPO / "slurm" / "dpfnas_8.sh"
PREFIX = "mfs"  # not mfc (a user's cluster) nor mft (tests/test_cluster.py, which may run beside this test)
NODES = {"n0": (1, 1), "n1": (4, 4), "n2": (4, 4)}
APPTAINER_SHIM = """#!/bin/sh
# apptainer exec [--nv] [--bind SRC[:DST]]... IMAGE CMD...  as Charliecloud's ch-run (the test's stand-in for Apptainer)
[ "$1" = exec ] || { echo "apptainer shim: only exec" >&2; exit 2; }
shift
binds=""
while :; do
  case $1 in --nv) shift ;; --bind|-B) binds="$binds -b $2"; shift 2 ;; *) break ;; esac
done
image=$1
shift
export USER="${USER:-$(id -un)}"  # ch-run needs it
exec ch-run --set-env --set-env=OMP_NUM_THREADS=1 $binds "$image" -- "$@"
"""


@pytest.fixture(scope="module")
def three_hosts(tmp_path_factory):
    """A 3-host cluster.sh cluster with Slurm on it; both torn down (and checked gone) after the test."""
    if os.geteuid() != 0 or shutil.which("nsenter") is None:
        pytest.skip("the simulated cluster needs root and nsenter (network namespaces); not available here")
    try:
        ensure_slurm_installed()
    except SlurmUnavailableError as exc:
        pytest.skip(str(exc))
    cluster_env = {"MFC_STATE": str(tmp_path_factory.mktemp("cluster") / "hosts"), "MFC_PREFIX": PREFIX}

    def cluster_sh(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(CLUSTER_SH), *args], env={**os.environ, **cluster_env}, capture_output=True,
                              text=True, timeout=120, check=False)

    cluster_sh("down")
    up = cluster_sh("up", str(len(NODES)))
    assert up.returncode == 0, up.stderr
    slurm = None
    try:
        slurm = NamespaceSlurmCluster(root=make_cluster_root(), nodes=NODES, cluster_env=cluster_env)
        slurm.start(timeout=90)
        yield slurm, cluster_env
    finally:
        if slurm is not None:
            slurm.stop()
        down = cluster_sh("down")
        assert down.returncode == 0, down.stderr
        assert not leftovers(PREFIX)


def test_a_job_step_spans_the_three_hosts(three_hosts):
    """What CI checks of the harness: each host's slurmd runs the job's tasks in its own namespace (own hostname)."""
    slurm, _ = three_hosts
    done = slurm.run("srun", "-N", "3", "-n", "3", "--gpus=3", "hostname", timeout=60)
    assert sorted(done.stdout.split()) == ["n0", "n1", "n2"], done.stdout


def test_dpfnas_8_runs_across_three_hosts_in_the_image_and_resumes_after_a_requeue(three_hosts, tmp_path):
    slurm, cluster_env = three_hosts
    reason = image_missing()
    if reason is not None:
        pytest.skip(reason)
    run_dir = tmp_path / "run"
    log = run_dir / "search.h5"
    env = {k: v for k, v in slurm.env.items() if k not in RUN_TEST_HOOKS}
    shim_dir = tmp_path / "bin"
    shim_dir.mkdir()
    (shim_dir / "apptainer").write_text(APPTAINER_SHIM)
    (shim_dir / "apptainer").chmod(0o755)
    # The config inside the image; MPIR_CVAR_CH4_CMA_ENABLE=0: ranks of one host in separate containers cannot
    # attach to each other's memory; UCX_TLS=tcp,self, or UCX finds shared memory across the hosts.
    env.update(RUN_DIR=str(run_dir), MPI_FNAS_INJECT_SLEEP="1:3:8", UCX_TLS="tcp,self", OMP_NUM_THREADS="1",
               IMAGE=str(IMAGE), CONFIG="/opt/mpi_fnas/configs/smoke.yaml", MPIR_CVAR_CH4_CMA_ENABLE="0",
               PATH=f"{shim_dir}:/usr/bin:{env['PATH']}")
    before = counters(Path(cluster_env["MFC_STATE"]), cluster_env)
    started = time.monotonic()
    job = slurm.sbatch(str(DPFNAS_8), env=env, cwd=tmp_path)

    deadline = time.monotonic() + 300
    while True:
        info = slurm.job_info(job)
        assert info.get("JobState") in {"PENDING", "CONFIGURING", "RUNNING"}, (info, job_output(slurm, job)[-3000:])
        seen = try_read_run(log)
        if seen is not None and len(seen["metrics"]["step"]) >= 2:
            break
        assert time.monotonic() < deadline, f"no 2 steps logged in 300 s\n{job_output(slurm, job)[-3000:]}"
        time.sleep(0.5)
    node_list = info.get("NodeList")
    slurm.run("scontrol", "requeue", str(job))

    deadline = time.monotonic() + 480
    while (info := slurm.job_info(job)).get("JobState") not in FINAL_STATES:
        assert time.monotonic() < deadline, f"job not finished in 480 s\n{job_output(slurm, job)[-3000:]}"
        time.sleep(0.5)
    output = job_output(slurm, job)
    after = counters(Path(cluster_env["MFC_STATE"]), cluster_env)
    print(f"dpfnas_8.sh on {node_list}: submit -> resumed job {info['JobState']} in {time.monotonic() - started:.1f} s;"
          f" bytes rx/tx per host: { {h: (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after} }")

    assert node_list == "n[0-2]", (node_list, output[-3000:])
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1" and info["ExitCode"] == "0:0", (
        info, output[-4000:])  # fmt: skip
    assert f"resuming from {run_dir} (restart 1)" in output, output[-4000:]
    for host in ("n1", "n2"):  # four parties' W, A and releases each way, twice over (two attempts)
        assert after[host][0] - before[host][0] > 200_000 and after[host][1] - before[host][1] > 200_000, after
    run = try_read_run(log)
    assert run is not None and (run["status"], run["attempts"], run["parties"]) == ("finished", 2, 8)
    assert run["metrics"]["step"].tolist() == list(range(1, 13))
