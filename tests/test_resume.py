"""Checkpoint and resume: an interrupted + resumed run equals an uninterrupted one, bit for bit on CPU.

Real jobs, in the warm ranks (conftest.warm_jobs). `MPI_FNAS_STOP_AFTER=N` makes rank 0 act as if SIGUSR1 arrived
during step N; one test launches a job of its own and sends it the real signal.
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, mpirun_background, rank0_decision, wait_for, warm_job, warm_jobs

from mpi_fnas.checkpoint import load_checkpoint
from mpi_fnas.config import ConfigError, config_from_text
from mpi_fnas.runlog import read_run

pytestmark = pytest.mark.slow  # real MPI jobs


# Bit-identical comparisons under DP need noise that two runs share: reproducible mode (its ε is void, which is
# fine for a test of the resume mechanics; tests/test_privacy_system.py resumes a run with secret noise).
REPRODUCIBLE = ["--set", "privacy.reproducible_noise=true"]


def launch(*args: str, stop_after: int | None = None, ranks: int = 3):
    env = {"MPI_FNAS_STOP_AFTER": str(stop_after)} if stop_after is not None else None
    return warm_job(ranks, *args, env=env)


def assert_same_result(straight: dict, resumed: dict) -> None:
    for kind in ("normal", "reduce"):
        assert np.array_equal(straight["alphas"][kind], resumed["alphas"][kind])  # bit for bit
    assert straight["genotypes"] == resumed["genotypes"]
    assert straight["final_genotype"] == resumed["final_genotype"]
    np.testing.assert_array_equal(straight["metrics"]["step"], resumed["metrics"]["step"])
    np.testing.assert_array_equal(straight["metrics"]["train_loss"], resumed["metrics"]["train_loss"])


# FNAS with one party (its resume is rank 0's and one party's state); DP-FNAS with two, each resuming its own
# noise and sampling streams.
@pytest.mark.parametrize(("mode", "stop_after", "ranks"), [("fnas", 3, 2), ("dpfnas", 5, 3)])
def test_interrupt_and_resume_equals_uninterrupted(tmp_path, mode, stop_after, ranks):
    common = [*TINY, "--set", f"mode={mode}", *(REPRODUCIBLE if mode == "dpfnas" else [])]
    run = tmp_path / "interrupted"
    # The straight run and the first attempt are independent: side by side.
    straight, first = warm_jobs((ranks, [*common, "--out", str(tmp_path / "straight")]),
                                      (ranks, [*common, "--out", str(run)], {"MPI_FNAS_STOP_AFTER": str(stop_after)}))
    assert straight.returncode == 0, straight.stderr
    assert first.returncode == 75, first.stderr
    assert f"resume with: --resume {run}" in first.stderr
    assert read_run(run / "search.h5")["status"] == "interrupted"
    assert load_checkpoint(run)["step"] == stop_after

    second = launch(*common, "--resume", str(run), ranks=ranks)  # same --config/--set as a requeued batch script passes
    assert second.returncode == 0, second.stderr
    a, b = read_run(tmp_path / "straight" / "search.h5"), read_run(run / "search.h5")
    assert b["status"] == "finished" and b["attempts"] == 2
    assert_same_result(a, b)
    if mode == "dpfnas":
        np.testing.assert_array_equal(a["privacy"]["steps"], b["privacy"]["steps"])
        assert np.array_equal(a["privacy"]["epsilon"], b["privacy"]["epsilon"])
    # Costs of both attempts add up.
    assert b["cost"]["wall_seconds"] > 0 and b["cost"]["ranks"] == ranks


def test_sigusr1_checkpoints_and_exits_75(tmp_path):
    run = tmp_path / "run"
    proc = mpirun_background(2, *TINY, "--set", "search.epochs=100", "--out", str(run))  # a server and one party
    try:
        def logged_two_rows() -> bool:
            try:
                return len(read_run(run / "search.h5")["metrics"]["step"]) >= 2
            except OSError:
                return False

        wait_for(logged_two_rows, timeout=120, poll=0.5)
        proc.send_signal(signal.SIGUSR1)  # mpiexec forwards it to every rank
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err
    log = read_run(run / "search.h5")
    assert log["status"] == "interrupted" and "SIGUSR1" in log["reason"]
    state = load_checkpoint(run)
    assert state["step"] == int(log["metrics"]["step"][-1])  # the checkpoint and the last row agree


def test_resume_refusals_and_fresh_start(tmp_path):
    run = tmp_path / "run"
    # A run preempted before its first checkpoint starts afresh and keeps the earlier log (checked below); it is
    # independent of the stopped run, so both start side by side.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "search.h5").write_bytes(b"earlier attempt")
    stopped, out = warm_jobs((2, [*TINY, "--out", str(run)], {"MPI_FNAS_STOP_AFTER": "2"}),
                                   (2, [*TINY, "--resume", str(fresh)]))
    assert stopped.returncode == 75, stopped.stderr
    assert out.returncode == 0, out.stderr
    assert (fresh / "search-attempt1.h5").read_bytes() == b"earlier attempt"
    assert read_run(fresh / "search.h5")["status"] == "finished"

    with pytest.raises(ConfigError, match=r"^--resume: the given config differs from the one .* was started with"):
        rank0_decision(*TINY, "--set", "search.w_lr=0.5", "--resume", str(run))
    # runtime.* may change
    text, where, stage = rank0_decision(*TINY, "--set", "runtime.log_every=3", "--resume", str(run))
    assert (Path(where), stage) == (run, "search")
    assert config_from_text(text, stored=True).runtime.log_every == 3
    with pytest.raises(ConfigError, match=r"^--resume: the run in .* has already finished$"):
        rank0_decision(*TINY, "--resume", str(fresh))
