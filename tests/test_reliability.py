"""Nothing hangs: a rank-0 error during setup, a stuck party, and periodic checkpoints, in real MPI jobs.

(A SIGKILLed party, the log saying `failed` and the resume from a periodic checkpoint are in
tests/test_privacy_system.py, which also checks the replayed releases are charged.)
"""

from __future__ import annotations

import time

import pytest
from conftest import TINY, mpirun, warm_job

from mpi_fnas.checkpoint import load_checkpoint
from mpi_fnas.federation.party_disk import party_dir
from mpi_fnas.runlog import read_run

pytestmark = pytest.mark.slow  # real MPI jobs


FNAS = [*TINY, "--set", "mode=fnas"]


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_resume_of_a_directory_without_its_log_is_bad_input_not_a_hang(tmp_path):
    """The reported hang: rank 0 raised while deciding, and the party waited in a blocking broadcast for good."""
    run = tmp_path / "run"
    first = warm_job(2, *FNAS, "--out", str(run), env={"MPI_FNAS_STOP_AFTER": "2"})
    assert first.returncode == 75, first.stderr
    (run / "search.h5").unlink()
    start = time.monotonic()
    out = warm_job(2, "--resume", str(run), timeout=120)
    assert out.returncode == 2
    assert "holds checkpoint.pt but no search.h5" in one_line(out.stderr)
    assert time.monotonic() - start < 100  # generous: the point is that it ends at all


def test_a_stuck_party_is_noticed_by_the_adaptive_collective_timeout(tmp_path):
    """Party 1 sleeps for 10 minutes at step 3. The full limit (runtime.comm_timeout) is 240 s, but after 2 steps
    rank 0 allows 10 × the slowest step so far, in whole multiples of comm_timeout_min = 5 s (tiny steps: 5 s
    on an idle machine, 10-20 s on a loaded one): the job ends failed long before 240 s. Steps 1 and 2 run under the
    full limit (a loaded CI machine once took more than 5 s for a genuine step 1)."""
    run = tmp_path / "run"
    start = time.monotonic()
    out = mpirun(3, *FNAS, "--set", "runtime.comm_timeout=240", "--set", "runtime.comm_timeout_min=5",
                 "--out", str(run), env={"MPI_FNAS_INJECT_SLEEP": "1:3:600"}, timeout=400)
    assert out.returncode != 0
    assert time.monotonic() - start < 150  # launch, 2 steps, the adapted limit; not the 240 s one
    log = read_run(run / "search.h5")
    assert log["status"] == "failed" and "comm_timeout" in log["reason"], log["reason"]
    assert list(log["metrics"]["step"]) == [1, 2]  # the rows before the stall are kept


def test_periodic_checkpoints_are_written_by_the_server_and_by_each_party(tmp_path):
    run = tmp_path / "run"
    out = warm_job(3, *FNAS, "--set", "checkpoint.every_steps=3", "--out", str(run))
    assert out.returncode == 0, out.stderr
    assert load_checkpoint(run)["step"] == 6  # steps 3 and 6 of 8 (none at the last step: the run is over)
    for rank in (1, 2):
        saved = sorted(p.name for p in party_dir(run, rank).glob("state-*.pt"))
        assert saved == ["state-3.pt", "state-6.pt"], saved
    assert read_run(run / "search.h5")["status"] == "finished"
