"""The privacy guarantee of the whole system, as an honest-but-curious server or a log reader would test it.

Real jobs of 3 ranks (2 parties), in the warm ranks (conftest.warm_jobs) unless a test kills or fails one. Each
test names the leak it closes, by its number here: secret noise by default (1), party RNG state that never
leaves the party (2), replays charged (4), no per-step timing in the log (5), generic failure reasons from a DP
party (6), δ checked (8).
"""

from __future__ import annotations

import math
import os
import shutil
import signal

import numpy as np
import pytest
from conftest import TINY, mpirun, mpirun_background, rank_pid, wait_for, warm_job, warm_jobs

from mpi_fnas.checkpoint import load_checkpoint
from mpi_fnas.federation.party_disk import PartyStore, party_dir
from mpi_fnas.privacy import PrivacyLedger
from mpi_fnas.runlog import read_run

pytestmark = pytest.mark.slow  # real MPI jobs


DP = [*TINY, "--set", "mode=dpfnas"]
REPRODUCIBLE = ["--set", "privacy.reproducible_noise=true"]


def alphas(run) -> np.ndarray:
    log = read_run(run / "search.h5")
    return np.concatenate([log["alphas"]["normal"][-1].ravel(), log["alphas"]["reduce"][-1].ravel()])


@pytest.fixture(scope="module")
def same_seed_runs(tmp_path_factory):
    """Four DP runs of one config and seed, side by side: s1, s2 with secret noise (the default), r1, r2 with
    reproducible noise. s2 also prints its progress lines (as into a Slurm .out file: not a terminal). Each
    searches 2 epochs of 2 steps. Returns (their directory, {name: result}). Concurrency changes no number of a
    run."""
    root = tmp_path_factory.mktemp("same_seed")
    plans = {"s1": [], "s2": ["--set", "runtime.progress=auto"], "r1": REPRODUCIBLE, "r2": REPRODUCIBLE}
    short = [*DP, "--set", "search.steps_per_epoch=2"]
    outs = warm_jobs(*((3, [*short, *extra, "--out", str(root / name)]) for name, extra in plans.items()))
    return root, dict(zip(plans, outs, strict=True))


def test_noise_is_secret_by_default_and_reproducible_only_on_request(same_seed_runs):
    """Item 1: the same config and seed must not give the same noise, or the config holder subtracts it."""
    root, runs = same_seed_runs
    for out in runs.values():
        assert out.returncode == 0, out.stderr
    assert not np.array_equal(alphas(root / "s1"), alphas(root / "s2"))
    np.testing.assert_array_equal(alphas(root / "r1"), alphas(root / "r2"))
    assert read_run(root / "s1" / "search.h5")["privacy_guarantee"] == "holds"
    void = read_run(root / "r1" / "search.h5")["privacy_guarantee"]
    assert void.startswith("void:") and "reproducible_noise" in void
    assert "ε VOID" in runs["r1"].stdout and "tight PLD bound" not in runs["r1"].stdout
    warnings = [line for line in runs["r1"].stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "reproducible_noise" in warnings[0]
    assert "tight PLD bound" in runs["s1"].stdout and "WARNING" not in runs["s1"].stderr


def test_secret_resume_draws_fresh_randomness_from_each_party_own_state(tmp_path):
    """Item 2, against a server that replays: the server's checkpoint holds no party state, the parties' own states
    hold no stream key, and a resume keys new streams: two copies of one interrupted run, resumed side by side, end
    different (a replay of a step sent before is a fresh release, as the ledger charges it), each charged every
    step."""
    run = tmp_path / "run"
    first = warm_job(3, *DP, "--out", str(run), env={"MPI_FNAS_STOP_AFTER": "3"})
    assert first.returncode == 75, first.stderr
    server_state = load_checkpoint(run)
    assert "parties" not in server_state
    for rank in (1, 2):
        own = PartyStore(party_dir(run, rank)).load_state(3)
        assert own["randomness"] == "secret" and set(own["party"]) == {"train_stream", "val_stream"}
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    for out in warm_jobs(*((3, [*DP, "--resume", str(d)]) for d in (run, copy))):  # independent copies
        assert out.returncode == 0, out.stderr
    assert not np.array_equal(alphas(run), alphas(copy))
    np.testing.assert_array_equal(read_run(run / "search.h5")["privacy"]["charged_steps"][-1], [8, 8])


def independent_epsilon(log: dict, party: int, charged: int) -> float:
    """ε of `party` after `charged` releases on each shard, straight from the logged public facts."""
    p = log["privacy"]
    worst = 0.0
    for sigma, q in ((p["noise_multiplier_w"], p["sample_rate_train"][party]),
                     (p["noise_multiplier_a"], p["sample_rate_val"][party])):
        ledger = PrivacyLedger()
        ledger.step(noise_multiplier=float(np.ravel(sigma)[0]), sample_rate=float(q), num_steps=charged)
        worst = max(worst, ledger.get_epsilon(float(p["delta"][party])))
    return worst


def test_a_killed_party_fails_the_run_and_its_replayed_steps_are_charged(tmp_path):
    """Item 4, and no hang when a party dies: SIGKILL a party mid-run → the log says failed with every row →
    --resume continues from the last periodic checkpoint, finishes, and charges every release that was sent.

    Party 2 sleeps at step 6 so the job stalls there deterministically: party 1 has then sent 6 steps and party 2
    five, while the last periodic checkpoint is step 4. The resumed run replays steps 5 and 6, so the ledger must
    charge party 1 two and party 2 one extra release per shard."""
    run = tmp_path / "run"
    args = [*DP, *REPRODUCIBLE, "--set", "checkpoint.every_steps=2"]
    proc = mpirun_background(3, *args, "--out", str(run), env={"MPI_FNAS_INJECT_SLEEP": "2:6:600"})
    try:
        stalled = wait_for(lambda: PartyStore(party_dir(run, 1)).sent_steps == 6
                           and PartyStore(party_dir(run, 2)).sent_steps == 5, timeout=240)
        assert stalled, "the run never reached the stall at step 6"
        victim = rank_pid(proc, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=60)
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    dead = read_run(run / "search.h5")
    assert dead["status"] == "failed", dead["status"]
    np.testing.assert_array_equal(dead["metrics"]["step"], [1, 2, 3, 4, 5])
    assert load_checkpoint(run)["step"] == 4

    out = warm_job(3, *args, "--resume", str(run))
    assert out.returncode == 0, out.stderr
    log = read_run(run / "search.h5")
    assert log["status"] == "finished" and log["attempts"] == 2
    np.testing.assert_array_equal(log["metrics"]["step"], np.arange(1, 9))
    charged = log["privacy"]["charged_steps"][-1]
    np.testing.assert_array_equal(charged, [8 + 2, 8 + 1])
    for party in (0, 1):
        expected = independent_epsilon(log, party, int(charged[party]))
        assert math.isclose(log["privacy"]["epsilon"][-1][party], expected, rel_tol=1e-9)


def test_no_per_step_timing_under_dp(same_seed_runs):
    """Item 5: a step's duration tracks its realised Poisson batch size; only the whole run's cost is logged,
    and the progress line times whole epochs only."""
    root, runs = same_seed_runs  # s2: a plain DP run (TINY in 2 epochs of 2 steps, secret noise)
    assert runs["s2"].returncode == 0, runs["s2"].stderr
    log = read_run(root / "s2" / "search.h5")
    for column in ("step_seconds", "comm_seconds", "party_seconds"):
        assert np.all(np.isnan(log["metrics"][column])), column
    assert log["cost"]["wall_seconds"] > 0
    assert np.isfinite(log["metrics"]["test_acc"][-1])
    # Nor on the console (a Slurm .out file keeps every line): a rate appears only from whole epochs, i.e. from
    # the second epoch end (2 epochs of 2 steps, a line every step).
    frames = [line.strip() for line in runs["s2"].stderr.splitlines() if line.startswith("search [")]
    assert [f.split()[2] for f in frames] == [f"{step}/4" for step in range(1, 5)], frames
    assert not any("s/step" in f or "eta" in f for f in frames[:-1]), frames
    assert "s/step" in frames[-1]


def test_a_dp_party_failure_sends_only_a_generic_reason(tmp_path):
    """Item 6: an error text can carry data (an allocation size); under DP it stays in the party's error.log."""
    run = tmp_path / "run"
    out = mpirun(3, *DP, "--out", str(run), env={"MPI_FNAS_INJECT_FAULT": "2:3"}, timeout=180)
    assert out.returncode != 0
    log = read_run(run / "search.h5")
    assert log["status"] == "failed" and "party rank 2 failed" in log["reason"]
    assert "injected fault" not in log["reason"] and "injected fault" not in out.stderr
    assert "injected fault at step 3" in (party_dir(run, 2) / "error.log").read_text()
    # The ε the failed run reports covers every release a party may have sent: steps 1 and 2 completed, and party 1
    # sent step 3 before party 2 failed in it. That in-flight step is charged even though no resume follows; so is
    # step 4 when the notice reached rank 0 inside step 3 (before it knew its broadcast of 3 was out: an upper
    # bound), or step 3 as the one after step 2 when it came while step 2's broadcast was still going out.
    privacy = log["privacy"]
    charged = int(privacy["steps"][-1])
    assert log["metrics"]["step"][-1] in (1, 2) and charged in (3, 4), (privacy["steps"], log["metrics"]["step"])
    assert PartyStore(party_dir(run, 1)).sent_steps == 3
    np.testing.assert_array_equal(privacy["charged_steps"][-1], [charged, charged])
    for party in (0, 1):
        assert math.isclose(privacy["epsilon"][-1][party], independent_epsilon(log, party, charged), rel_tol=1e-9)


def test_a_delta_not_below_one_over_n_is_refused(tmp_path):
    """δ ≥ 1/N_k lets a mechanism publish a whole record with probability δ and still 'satisfy' (ε, δ): one line
    from rank 0, exit 2 (every δ of that branch and its boundary: tests/test_budget.py, in-process)."""
    out = warm_job(3, *DP, "--set", "privacy.delta=0.01", "--out", str(tmp_path / "d"))
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "privacy:" in lines[0] and ("δ" in lines[0] or "delta" in lines[0]), lines
