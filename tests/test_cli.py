"""The command line as users run it: real MPI jobs in subprocesses (the runs whose launch adds nothing to what
a test checks run in the warm ranks: conftest.warm_jobs).

Covers bad input (one line from rank 0, exit 2, nothing overwritten), a complete small run and its HDF5 log,
vanilla NAS, and failures (an exception in a party, a killed party) ending the whole job quickly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import ROOT, mpirun, mpirun_background, rank_pid, side_by_side, warm_job, warm_jobs
from pre_recipe import PRE_RECIPE_ARGS, TINY_DARTS_OPS, as_args, tiny

from mpi_fnas.config import Config
from mpi_fnas.runlog import read_run
from mpi_fnas.space import Genotype

TINY = [*PRE_RECIPE_ARGS,
        *as_args(tiny(TINY_DARTS_OPS, "data.train_size=240", "runtime.progress=off", "runtime.log_every=1"))]


def launch(ranks: int, *args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return mpirun(ranks, *args, env=env, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_help_documents_launch_and_keys():
    out = subprocess.run([sys.executable, "-m", "mpi_fnas.run", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0
    for needle in ("mpirun -n 9", "--config", "--set", "--out", "exit codes", "docs/hdf5.md"):
        assert needle in out.stdout
    for key in _all_keys(Config()):  # every config key is documented, with its default
        assert f"  {key} " in out.stdout, key


def _all_keys(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _all_keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_outside_mpirun_says_how_to_launch():
    out = subprocess.run([sys.executable, "-m", "mpi_fnas.run"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 2
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and "mpirun -n 9 python -m mpi_fnas.run" in lines[0]


#: Bad inputs: (arguments, the one line's needle, whether the user made --out beforehand: theirs, it stays even empty).
BAD_INPUTS = {
    "unknown-key": (["--set", "search.epoch=1"], "search.epoch: unknown key", False),
    "party-count": (["--set", "federation.parties=4"], "federation.parties: config says 4 but the MPI world has 2",
                    True),
    "vanilla-ranks": (["--config", "configs/vanilla_nas.yaml"], "config says 1 but the MPI world has 2 parties", False),
    "missing-cifar": (["--set", "data.dataset=cifar10", "--set", "data.root=/nonexistent/cifar",
                       "--set", "data.image_size=32"], "cifar-10-python.tar.gz", False),
    "too-few-examples": (["--set", "data.train_size=2"], "data.partition", False),
    "too-little-memory": (["--set", "runtime.node_memory_mb=500"], "memory: node", False),
}


@pytest.fixture(scope="module")
def bad_input_launches(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every job of BAD_INPUTS: its result and its --out. In the warm ranks but one: party-count, which every
    rank finds, is a launch of its own (mpiexec's exit status and the output of all its ranks)."""
    root = tmp_path_factory.mktemp("bad")
    runs = {name: root / name for name in BAD_INPUTS}
    for name, (_, _, user_made) in BAD_INPUTS.items():
        if user_made:
            runs[name].mkdir()
    launched = "party-count"
    warm = [name for name in BAD_INPUTS if name != launched]
    warm_done, launched_done = side_by_side(
        [(3, [*BAD_INPUTS[name][0], "--out", str(runs[name])]) for name in warm],
        [(3, [*BAD_INPUTS[launched][0], "--out", str(runs[launched])])], timeout=240)
    return {name: (out, runs[name]) for name, out in [*zip(warm, warm_done, strict=True), (launched, launched_done[0])]}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_from_rank_0_and_exit_2(case, bad_input_launches):
    (out, run), (_, needle, user_made) = bad_input_launches[case], BAD_INPUTS[case]
    assert out.returncode == 2, out.stderr
    lines = error_lines(out.stderr)
    assert len(lines) == 1, out.stderr  # printed once, by rank 0, no traceback
    assert lines[0].startswith("mpi_fnas: error: ") and needle in lines[0]
    # The refused launch leaves no empty run directory of its own behind (the checks after rank 0 made it: the
    # world size, the data).
    assert run.is_dir() == user_made


@pytest.mark.slow
def test_existing_run_is_never_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    log = run / "search.h5"
    log.write_bytes(b"precious results")
    digest = hashlib.sha256(log.read_bytes()).hexdigest()
    out = warm_job(2, *TINY, "--out", str(run))
    assert out.returncode == 2
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and lines[0].startswith("mpi_fnas: error: ") and "already holds a run log" in lines[0]
    assert hashlib.sha256(log.read_bytes()).hexdigest() == digest


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Three small jobs side by side: FNAS (2 epochs of 3 steps: a launch of its own, whose log says how long rank
    0's process took to start), the default mode (DP-FNAS, 2 steps) and vanilla NAS with one party (2 steps), both in
    the warm ranks; each one's result and run directory."""
    root = tmp_path_factory.mktemp("small")
    short = ["--set", "search.epochs=1", "--set", "search.steps_per_epoch=2"]
    jobs = {"fnas": (3, [*TINY, "--set", "mode=fnas", "--set", "search.epochs=2", "--set", "search.steps_per_epoch=3"]),
            "default": (3, [*TINY, *short]),
            "vanilla": (2, ["--config", "configs/vanilla_nas.yaml", *TINY, *short])}
    runs = {name: root / name for name in jobs}
    ranks, args = jobs.pop("fnas")
    launched = mpirun_background(ranks, *args, "--out", str(runs["fnas"]))
    try:
        done = warm_jobs(*((ranks, [*args, "--out", str(runs[name])]) for name, (ranks, args) in jobs.items()),
                         timeout=300)
        out, err = launched.communicate(timeout=300)
    finally:
        if launched.poll() is None:
            launched.kill()
            launched.communicate()
    results = {"fnas": subprocess.CompletedProcess(launched.args, launched.returncode, out, err),
               **dict(zip(jobs, done, strict=True))}
    return {name: (out, runs[name]) for name, out in results.items()}


@pytest.mark.slow
def test_small_federated_run_writes_the_documented_log(small_runs):
    out, run = small_runs["fnas"]
    assert out.returncode == 0, out.stderr
    for needle in ("mode            fnas", "parties         2", "final val acc", "genotype", "wall time",
                   str(run / "search.h5")):
        assert needle in out.stdout
    log = read_run(run / "search.h5")
    assert log["status"] == "finished" and log["mode"] == "fnas" and log["parties"] == 2
    assert "search:" in log["config"] and "steps_per_epoch: 3" in log["config"]
    metrics = log["metrics"]
    np.testing.assert_array_equal(metrics["step"], np.arange(1, 7))
    np.testing.assert_array_equal(metrics["epoch"], [0, 0, 0, 1, 1, 1])
    assert np.all((metrics["val_acc"] >= 0) & (metrics["val_acc"] <= 1))
    assert np.all(metrics["comm_seconds"] <= metrics["step_seconds"] + 1e-9)
    assert np.all(np.isfinite(metrics["train_loss"]))
    assert log["alphas"]["normal"].shape == (2, 5, 4)  # (epochs, edges for 2 nodes, TINY's 4 ops)
    np.testing.assert_allclose(log["alphas"]["normal"].sum(-1), 1.0, rtol=1e-5)
    final = Genotype.from_string(log["final_genotype"])
    assert final == Genotype.from_string(log["genotypes"][-1])
    assert log["cost"]["ranks"] == 3 and log["cost"]["wall_seconds"] > 0
    # rank 0's own: its peak memory (at least torch's) and its time from launch to the first step
    assert log["cost"]["rss_peak_mb_server"] > 100 and 0 < log["cost"]["startup_seconds"] < 300
    # rank 0's iteration time, split: the parts add up to the logged steps (one row a step here), the transfer is
    # part of its time in MPI, and the parties' compute is what it waited for beyond that
    parts = [log["cost"][name] for name in ("party_compute_seconds", "transfer_seconds", "server_seconds")]
    assert all(part >= 0 for part in parts) and parts[1] > 0
    assert sum(parts) == pytest.approx(float(np.sum(metrics["step_seconds"])), rel=1e-9)
    assert parts[0] + parts[1] == pytest.approx(float(np.sum(metrics["comm_seconds"])), rel=1e-9)
    with h5py.File(run / "search.h5", "r") as f:
        assert f.attrs["version"]


@pytest.mark.slow
def test_default_mode_is_dpfnas_and_reports_privacy(small_runs):
    out, run = small_runs["default"]
    assert out.returncode == 0, out.stderr
    # The default aggregation is secure: the summary says so, and gives ε against the server.
    assert "mode            dpfnas" in out.stdout and "against the server (secure aggregation" in out.stdout
    log = read_run(run / "search.h5")
    assert log["mode"] == "dpfnas" and log["privacy"]["epsilon"].shape == (2, 2)
    # Parties send no statistics under DP, so the party-side metric columns are NaN; the server's test split is not.
    assert np.all(np.isnan(log["metrics"]["train_loss"])) and np.all(np.isnan(log["metrics"]["val_acc"]))
    assert np.isfinite(log["metrics"]["test_acc"][-1])


@pytest.mark.slow
def test_vanilla_nas_runs_with_one_party(small_runs):
    out, run = small_runs["vanilla"]
    assert out.returncode == 0, out.stderr
    log = read_run(run / "search.h5")
    assert log["mode"] == "vanilla" and log["parties"] == 1 and log["status"] == "finished"


@pytest.mark.slow
def test_an_exception_in_a_party_ends_the_job_quickly_and_marks_the_log(tmp_path):
    run = tmp_path / "run"
    out = launch(4, *TINY, "--set", "mode=fnas", "--set", "search.epochs=50", "--out", str(run),
                 env={"MPI_FNAS_INJECT_FAULT": "2:3"}, timeout=180)
    ended = time.time()
    assert out.returncode != 0
    assert "injected fault at step 3" in out.stderr
    log = read_run(run / "search.h5")
    assert log["status"] == "failed"
    assert "party rank 2 failed" in log["reason"]
    # The rows written before the failure are kept: step 1's always; step 2's only if rank 0 saw step 2's broadcast
    # complete before the notice (party 2 can take A, start step 3 and fail while another party has yet to take it,
    # and then step 2 never completed on rank 0).
    assert log["metrics"]["step"].tolist() in ([1.0], [1.0, 2.0])
    # Measured from the log's creation (after the slow torch imports): 3 tiny steps, the fault, the abort.
    started = datetime.fromisoformat(log["created"]).timestamp()
    assert ended - started < 30, f"job took {ended - started:.1f} s to end after the search started"


@pytest.mark.slow
def test_a_killed_party_ends_the_whole_job(tmp_path):
    run = tmp_path / "run"
    proc = mpirun_background(3, *TINY, "--set", "search.epochs=200", "--out", str(run))
    try:
        victim = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and victim is None:  # wait until the search is under way
            if (run / "search.h5").exists():
                victim = rank_pid(proc, 2)
            time.sleep(0.5)
        assert victim is not None, "party rank 2 never started"
        time.sleep(2)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=60)
        assert proc.returncode != 0
        assert time.monotonic() - killed < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
