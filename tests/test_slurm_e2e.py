"""slurm/dpfnas_2.sh running the real `mpi_fnas.run` on the loopback Slurm cluster (tests/slurm_cluster.py).

Two parties (3 ranks), not the 8 of slurm/dpfnas_8.sh: what is checked here (sbatch -> batch script -> launch.sh ->
srun + PMI2 -> the real run, the forwarded signal, the requeue and the resume) does not depend on the party count,
and 9 torch ranks on 2 cores cost about three times the CPU. That dpfnas_8.sh asks for 9 tasks and 8 GPUs and
starts 9 ranks under srun is checked with a stand-in module (tests/test_slurm_scripts.py,
test_dpfnas_8_starts_nine_ranks_with_eight_gpus), and every batch script execs the same launch.sh
(test_batch_scripts_share_one_locator).

(a) The smoke config (configs/smoke.yaml: DP-FNAS, 12 tiny steps) submitted with sbatch finishes, its HDF5 log says
    so, and it is the log a direct `mpirun -n 3` run of the same config writes (the reference).
(b) `scontrol requeue` in the middle of a run: the batch script forwards the signal, the run checkpoints and exits
    75, Slurm brings the job back (SLURM_RESTART_COUNT=1), the script resumes from the run dir, and the finished
    log equals the reference: same alphas and ε bit for bit, metric steps 1..N exactly once, two attempts whose
    costs add up.

The reference run starts with the first test that needs it and runs concurrently with that test's job (it would
otherwise add a cold start of its own).

The wall times are printed (`pytest -s` shows them); nothing asserts on them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from slurm_cluster import mpich_segment, slurm_cluster  # noqa: F401  (slurm_cluster is the fixture)

from mpi_fnas.checkpoint import load_checkpoint
from mpi_fnas.runlog import read_run

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "configs" / "smoke.yaml"
DPFNAS_2 = REPO / "slurm" / "dpfnas_2.sh"
MPIRUN = str(Path(sys.executable).parent / "mpirun")
PARTIES = 2
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
# Test hooks of the run that must not leak into these jobs from the caller's environment.
RUN_TEST_HOOKS = ("MPI_FNAS_STOP_AFTER", "MPI_FNAS_INJECT_FAULT", "MPI_FNAS_INJECT_SLEEP")
REQUEUE_WINDOW = 8  # seconds party 1 pauses at search step 3 in the requeue test (see there)


def submit_env(slurm_cluster, **extra: str) -> dict[str, str]:  # noqa: F811
    env = {k: v for k, v in slurm_cluster.env.items() if k not in RUN_TEST_HOOKS}
    env.update(CONFIG=str(SMOKE), **extra)
    return env


def job_output(slurm_cluster, job: int) -> str:  # noqa: F811
    path = Path(slurm_cluster.job_info(job).get("StdOut", "/nonexistent"))
    return path.read_text(errors="replace") if path.exists() else "<no output file>"


def try_read_run(log: Path) -> dict | None:
    """read_run while the job runs: None until the log exists and holds its skeleton."""
    if not log.exists():
        return None
    try:
        return read_run(log, wait_seconds=1.0)
    except (OSError, KeyError):  # being created, or briefly outside SWMR mode
        return None


def wait_for_end(slurm_cluster, job: int, timeout: float, on_poll=None) -> dict[str, str]:  # noqa: F811
    """Poll until the job reaches a final state (a requeued job passes through REQUEUED/PENDING first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = slurm_cluster.job_info(job)
        if on_poll is not None:
            on_poll(info)
        if info.get("JobState") in FINAL_STATES:
            return info
        time.sleep(0.5)
    raise AssertionError(f"job {job} not finished after {timeout:.0f} s: {slurm_cluster.job_info(job)}\n"
                         f"{job_output(slurm_cluster, job)[-3000:]}\n{slurm_cluster.diagnostics()}")


class ReferenceRun:
    """`mpirun -n 3 python -m mpi_fnas.run --config configs/smoke.yaml --out DIR`, started in the background."""

    def __init__(self, out: Path) -> None:
        self.out = out
        cmd = [MPIRUN, "-n", str(PARTIES + 1), sys.executable, "-m", "mpi_fnas.run", "--config", str(SMOKE),
               "--out", str(out)]
        env = {k: v for k, v in os.environ.items() if k not in RUN_TEST_HOOKS and not k.startswith("SLURM_")}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._log: dict | None = None

    def log(self) -> dict:
        """Wait for the run to end; its read_run() dict (the run must have finished with exit code 0)."""
        if self._log is None:
            output, _ = self.proc.communicate(timeout=600)
            assert self.proc.returncode == 0, output[-3000:]
            self._log = read_run(self.out / "search.h5")
            assert self._log["status"] == "finished"
        return self._log

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = ReferenceRun(tmp_path_factory.mktemp("reference") / "run")
    try:
        yield run
    finally:
        run.stop()


def assert_same_search(run: dict, straight: dict) -> None:
    """Same search bit for bit: alphas of every epoch, ε after every step, genotypes, test accuracy."""
    for cell in ("normal", "reduce"):
        assert np.array_equal(run["alphas"][cell], straight["alphas"][cell]), cell
    assert np.array_equal(run["privacy"]["epsilon"], straight["privacy"]["epsilon"])
    assert np.array_equal(run["privacy"]["steps"], straight["privacy"]["steps"])
    assert run["genotypes"] == straight["genotypes"] and run["final_genotype"] == straight["final_genotype"]
    np.testing.assert_array_equal(run["metrics"]["test_acc"], straight["metrics"]["test_acc"])


def summary_wall_seconds(output: str) -> list[float]:
    """Every 'wall time  XmY.Ys' line of the run's final summary in the job output (one per finished attempt)."""
    return [int(m) * 60 + float(s) for m, s in re.findall(r"^wall time\s+(\d+)m([\d.]+)s$", output, flags=re.M)]


def test_smoke_sbatch_dpfnas_2_finishes(slurm_cluster, reference, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    started = time.monotonic()
    job = slurm_cluster.sbatch(str(DPFNAS_2), env=submit_env(slurm_cluster, RUN_DIR=str(run_dir)), cwd=tmp_path)
    info = wait_for_end(slurm_cluster, job, timeout=480)
    wall = time.monotonic() - started
    output = job_output(slurm_cluster, job)
    print(f"\nsmoke sbatch slurm/dpfnas_2.sh (configs/smoke.yaml): submit -> COMPLETED in {wall:.1f} s")
    assert info["JobState"] == "COMPLETED", output[-3000:]
    assert info["ExitCode"] == "0:0", info
    assert info["Restarts"] == "0", info

    run = read_run(run_dir / "search.h5")
    print(f"  run's own wall (cost/wall_seconds): {run['cost']['wall_seconds']:.1f} s")
    assert (run["status"], run["mode"], run["parties"], run["attempts"]) == ("finished", "dpfnas", PARTIES, 1)
    steps = run["metrics"]["step"]
    assert steps.tolist() == list(range(1, len(steps) + 1)) and len(steps) == 12  # 2 epochs x 6 steps
    epsilon = run["privacy"]["epsilon"]
    assert epsilon.shape == (len(steps), PARTIES)
    assert np.all(np.isfinite(epsilon)) and np.all(epsilon > 0)
    assert np.all(np.diff(epsilon, axis=0) > 0)  # every step is a release: ε grows
    assert len(run["ranks"]["devices"]) == PARTIES + 1  # one placement entry per rank
    assert run["cost"]["ranks"] == PARTIES + 1
    assert run["cost"]["wall_seconds"] > 0
    # The job ran the real module through srun, with the run dir the test chose.
    assert "srun --mpi=pmi2" in output and f"--out {run_dir}" in output
    assert "== mpi_fnas search finished ==" in output
    # srun + PMI2 under Slurm and mpirun + hydra give the same search.
    assert_same_search(run, reference.log())


def test_scontrol_requeue_resumes_to_the_uninterrupted_result(slurm_cluster, reference, tmp_path):  # noqa: F811
    # The requeue must land before the last step (a stop request during the last step is ignored: the run would
    # finish and the requeued attempt find nothing to resume). Two parties take a fraction of a second per step, so
    # party 1 holds step 3 for REQUEUE_WINDOW seconds: the test sees 2 logged rows and requeues while step 3 waits,
    # leaving >= 9 steps to run. The pause changes no number (the reference pauses nowhere, and the results must
    # be equal bit for bit); the resumed attempt starts after step 3, so it does not pause again.
    run_dir = tmp_path / "run"
    log = run_dir / "search.h5"
    started = time.monotonic()
    env = submit_env(slurm_cluster, RUN_DIR=str(run_dir), MPI_FNAS_INJECT_SLEEP=f"1:3:{REQUEUE_WINDOW}")
    job = slurm_cluster.sbatch(str(DPFNAS_2), env=env, cwd=tmp_path)
    deadline = time.monotonic() + 300
    while True:
        info = slurm_cluster.job_info(job)
        assert info.get("JobState") in {"PENDING", "CONFIGURING", "RUNNING"}, (
            info, job_output(slurm_cluster, job)[-3000:])  # fmt: skip
        seen = try_read_run(log)
        if seen is not None and len(seen["metrics"]["step"]) >= 2:
            break
        assert time.monotonic() < deadline, "the job logged no 2 steps in 300 s"
        time.sleep(0.5)
    rows_at_requeue = len(seen["metrics"]["step"])
    slurm_cluster.run("scontrol", "requeue", str(job))

    # Between the attempts the log says "interrupted" and /cost holds the first attempt's cost alone.
    first_attempt: dict = {}
    # The second attempt's run is step 1 (step 0 removes stale MPICH segments); seeing MPICH's segment under the
    # name launch.sh computes shows that the cleanup targets the right file.
    second_attempt_segment: list[bool] = []

    def watch(info: dict[str, str]) -> None:
        if info.get("Restarts") == "1" and info.get("JobState") == "RUNNING":
            second_attempt_segment.append(mpich_segment(f"{job}.1").exists())
            return  # the second attempt may be rewriting the log
        state = try_read_run(log)
        if state is not None and state["status"] == "interrupted" and state["attempts"] == 1:
            first_attempt.update(cost=state["cost"], steps=state["metrics"]["step"].tolist())

    info = wait_for_end(slurm_cluster, job, timeout=480, on_poll=watch)
    wall = time.monotonic() - started
    output = job_output(slurm_cluster, job)
    print(f"\nrequeue test: submit -> resumed job COMPLETED in {wall:.1f} s (requeued after {rows_at_requeue} "
          "logged steps)")

    # The job came back once, resumed from the checkpoint the forwarded signal produced, and finished.
    assert info["JobState"] == "COMPLETED", output[-4000:]
    assert info["Restarts"] == "1", info
    assert info["ExitCode"] == "0:0", info
    assert "got SIGTERM" in output or "got SIGUSR1" in output, output[-4000:]
    assert f"resuming from {run_dir} (restart 1)" in output, output[-4000:]
    checkpoint_step = int(load_checkpoint(run_dir)["step"])
    assert f"resuming at step {checkpoint_step + 1}" in output, output[-4000:]
    assert first_attempt, "never saw the log in state 'interrupted' between the attempts"
    assert first_attempt["steps"] == list(range(1, checkpoint_step + 1))
    assert any(second_attempt_segment), f"/dev/shm has no {mpich_segment(f'{job}.1')} during the second attempt"
    assert not mpich_segment(f"{job}.0").exists() and not mpich_segment(f"{job}.1").exists()

    run, straight = read_run(log), reference.log()
    total = len(straight["metrics"]["step"])
    assert total == 12 and rows_at_requeue <= checkpoint_step < total
    assert (run["status"], run["attempts"], run["parties"]) == ("finished", 2, PARTIES)
    assert run["metrics"]["step"].tolist() == list(range(1, total + 1))  # no duplicate, no gap
    assert_same_search(run, straight)

    # /cost adds the attempts up: first attempt (read between the attempts) + second (its printed summary).
    cost = run["cost"]
    first_wall = first_attempt["cost"]["wall_seconds"]
    (second_wall,) = summary_wall_seconds(output)  # only the attempt that finished prints a summary
    print(f"  cost/wall_seconds {cost['wall_seconds']:.1f} s = attempt 1 {first_wall:.1f} s + attempt 2 "
          f"{second_wall:.1f} s")
    assert cost["wall_seconds"] > first_wall > 0 and cost["wall_seconds"] > second_wall > 0
    assert cost["wall_seconds"] == pytest.approx(first_wall + second_wall, abs=0.06)  # summary rounds to 0.1 s
    assert cost["cpu_core_hours"] == pytest.approx(cost["wall_seconds"] * (PARTIES + 1) / 3600.0)
    assert cost["cpu_core_hours"] > first_attempt["cost"]["cpu_core_hours"]
    assert cost["ranks"] == PARTIES + 1
