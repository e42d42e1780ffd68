"""Tests of the augment stage's part of the run log (``/augment`` in search.h5): lifecycle after the search in
the same job and in a later one, attempts and cost over resumes, truncation, the DP ledger, a concurrent SWMR
reader, a writer killed mid-augment, and rows left ragged by a crash."""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpi_fnas.privacy.release import Release
from mpi_fnas.runlog import (
    AUGMENT_METRICS,
    RELEASE_FIELDS,
    SEARCH_METRICS,
    RunLog,
    StagePrivacy,
    liveness,
    read_run,
    writer,
)

PARTIES = 3
GENOTYPE = "Genotype(normal=[('sep_conv_3x3', 0)], reduce=[('max_pool_3x3', 1)])"
PARAMS = 3_349_342
REPO_ROOT = Path(__file__).resolve().parents[1]
SEARCH_COST = {"wall_seconds": 100.0, "ranks": 4, "gpus": 0, "gpu_hours": 0.0, "cpu_core_hours": 0.5}


def _create(path: Path, *, mode: str = "fnas") -> RunLog:
    privacy = None
    if mode == "dpfnas":
        release = Release(noise_multiplier=1.0, clip=0.1, expected_batch_size=16.0)
        privacy = StagePrivacy(delta=[1e-5] * PARTIES, releases={"W": release, "A": release},
                               sample_rates={"W": [0.01] * PARTIES, "A": [0.02] * PARTIES}, accountant="pld")
    return RunLog.create(
        path, mode=mode, parties=PARTIES, config_text="search:\n  epochs: 2\n", metric_names=SEARCH_METRICS,
        alpha_shape=(14, 8), genotype_length=128, privacy_guarantee="holds" if privacy else "none: not DP",
        privacy=privacy, rank_attrs={"devices": ["cpu"] * (PARTIES + 1)},
    )  # fmt: skip


def _searched(path: Path, *, mode: str = "fnas") -> RunLog:
    """A log whose search logged 3 rows and finished (the writer stays usable for the augment stage)."""
    runlog = _create(path, mode=mode)
    for step in range(3):
        runlog.search.append_metrics({"step": step, "epoch": 0})
    if mode == "dpfnas":
        runlog.search.append_privacy(3, np.full(PARTIES, 3), np.full(PARTIES, 0.5), np.full(PARTIES, 0.05))
    runlog.search.finish("finished", reason="completed", final_genotype=GENOTYPE, cost=SEARCH_COST)
    return runlog


def _augment_privacy(noise_multiplier: float | np.ndarray = 1.1, clip: float | np.ndarray = 0.1) -> StagePrivacy:
    return StagePrivacy(delta=[1e-5] * PARTIES,
                        releases={"W": Release(noise_multiplier=noise_multiplier, clip=clip, expected_batch_size=16.0)},
                        sample_rates={"W": np.linspace(0.01, 0.03, PARTIES)})


def _begin(runlog: RunLog, *, private: bool = False, **overrides) -> None:
    arguments = dict(
        genotype=GENOTYPE,
        params=PARAMS,
        private=private,
        privacy=_augment_privacy() if private else None,
        parties=PARTIES,
        privacy_guarantee="holds" if private else "none: mode fnas makes no privacy claim",
    )
    arguments.update(overrides)
    runlog.begin_augment(**arguments)


def _augment_row(step: int, *, private: bool = False) -> dict[str, float]:
    """One augment metric row; under DP the caller passes NaN for train_*, and test_* only every 2nd step."""
    row = {"step": step, "epoch": step // 2, "lr": 0.025 * (1 - step / 100)}
    row.update(train_loss=math.nan, train_acc=math.nan) if private else row.update(train_loss=2.0 - 0.1 * step)
    if step % 2 == 1:
        row.update(test_loss=1.5, test_acc=0.1 * step)
    return row


def _search_part(run: dict) -> dict:
    """What the search recorded, to compare before and after the augment stage."""
    return {key: run[key] for key in ("status", "reason", "attempts", "final_genotype", "cost", "ranks")} | {
        "steps": run["metrics"]["step"].tolist()
    }


# ---------------------------------------------------------------------- lifecycle in one job


def test_full_lifecycle_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "search.h5"
    runlog = _searched(path)
    searched = read_run(path)
    assert searched["augment"] is None and runlog.augment is None
    with pytest.raises(RuntimeError, match="closed"):
        runlog.heartbeat()  # finish closed the file; begin_augment reopens it

    clock = 2_000_000_000.0  # begin_augment refreshes the heartbeat with writer.time.time()
    monkeypatch.setattr(writer.time, "time", lambda: clock)
    _begin(runlog)
    monkeypatch.undo()
    live = read_run(path)
    assert live["writer"]["heartbeat"] == clock and live["writer"]["pid"] == os.getpid()
    assert _search_part(live) == _search_part(searched)  # the search's record is untouched
    augment = live["augment"]
    assert (augment["status"], augment["reason"], augment["stale"], augment["attempts"]) == ("running", "", False, 1)
    assert (augment["genotype"], augment["params"], augment["private"]) == (GENOTYPE, PARAMS, False)
    assert math.isnan(augment["test_acc"]) and math.isnan(augment["test_error"]) and augment["privacy"] is None

    for step in range(4):
        runlog.augment.append_metrics(_augment_row(step))
    runlog.heartbeat()
    assert runlog.augment.row_counts() == (4, 0, 0)
    runlog.search.finish("failed", reason="late search failure")  # the search's outcome was recorded: no effect
    runlog.augment.finish(
        "finished", reason="completed", test_acc=0.9725,
        cost={"wall_seconds": 50.0, "ranks": 4, "gpus": 3, "gpu_hours": 0.04, "cpu_core_hours": 0.1},
    )  # fmt: skip
    runlog.augment.finish("failed", reason="ignored", cost={})  # idempotent: the first outcome wins
    with pytest.raises(RuntimeError, match="closed"):
        runlog.augment.append_metrics(_augment_row(4))
    runlog.close()
    runlog.close()

    run = read_run(path)
    assert _search_part(run) == _search_part(searched)
    augment = run["augment"]
    assert (augment["status"], augment["reason"], augment["attempts"]) == ("finished", "completed", 1)
    assert augment["test_acc"] == 0.9725 and augment["test_error"] == pytest.approx(0.0275)
    assert augment["cost"] == {"wall_seconds": 50.0, "ranks": 4, "gpus": 3, "gpu_hours": 0.04, "cpu_core_hours": 0.1}
    metrics = augment["metrics"]
    assert list(metrics) == list(AUGMENT_METRICS)
    assert metrics["step"].tolist() == [0, 1, 2, 3] and metrics["epoch"].tolist() == [0, 0, 1, 1]
    assert metrics["train_loss"].tolist() == pytest.approx([2.0, 1.9, 1.8, 1.7])
    assert np.isnan(metrics["train_acc"]).all()  # not supplied
    assert np.isnan(metrics["test_acc"][[0, 2]]).all()  # rows without an evaluation
    assert metrics["test_acc"][[1, 3]].tolist() == pytest.approx([0.1, 0.3])

    with h5py.File(path, "r") as f:  # a plain open works: the writer closed the file properly
        group = f["augment"]
        assert set(group) == {"metrics", "cost"}
        assert set(group.attrs) == {
            "status", "reason", "genotype", "params", "test_acc", "test_error", "private", "privacy_guarantee",
            "attempts",
        }  # fmt: skip
        for name in ("status", "reason", "genotype", "privacy_guarantee"):
            string_info = h5py.check_string_dtype(group.attrs.get_id(name).dtype)
            assert string_info is not None and string_info.encoding == "utf-8", name
        assert group.attrs.get_id("params").dtype == np.int64 and group.attrs["params"] == PARAMS
        assert group.attrs.get_id("attempts").dtype == np.int64
        assert group.attrs.get_id("test_acc").dtype == np.float64 == group.attrs.get_id("test_error").dtype
        assert isinstance(group.attrs["private"], np.bool_) and not group.attrs["private"]
        assert list(group["metrics"]) == list(AUGMENT_METRICS)
        for name in AUGMENT_METRICS:
            dataset = group["metrics"][name]
            expected = np.int64 if name in ("step", "epoch") else np.float64
            assert dataset.dtype == expected and dataset.shape == (4,) and dataset.maxshape == (None,), name
        assert set(group["cost"].attrs) == {"wall_seconds", "ranks", "gpus", "gpu_hours", "cpu_core_hours"}
        assert group["cost"].attrs.get_id("ranks").dtype.kind == "i"
        assert f.attrs["status"] == "finished" and f["cost"].attrs["wall_seconds"] == 100.0
        assert group.attrs["privacy_guarantee"] == "none: mode fnas makes no privacy claim"
    assert augment["privacy_guarantee"] == "none: mode fnas makes no privacy claim"
    with h5py.File(path, "r+") as f:  # a log written before the attribute existed still reads
        del f["augment"].attrs["privacy_guarantee"]
    assert read_run(path)["augment"]["privacy_guarantee"] == "not recorded"


def test_augment_calls_are_checked_before_anything_is_written(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path)
    runlog.search.append_metrics({"step": 0})
    with pytest.raises(RuntimeError, match="finish\\(\\) it before begin_augment"):
        _begin(runlog)
    runlog.search.append_metrics({"step": 1})  # a refused begin leaves the search running and writable
    with pytest.raises(KeyError, match="begin_augment\\(\\) first"):
        runlog.stage("augment").append_metrics({"step": 0, "epoch": 0})
    with pytest.raises(KeyError, match="begin_augment\\(\\) first"):
        runlog.stage("augment").finish("failed", reason="x", cost={})
    runlog.search.finish("finished", reason="completed")

    with pytest.raises(ValueError, match="privacy schema is required when private=True"):
        _begin(runlog, private=True, privacy=None)
    with pytest.raises(ValueError, match="privacy schema is required when private=True"):
        _begin(runlog, private=False, privacy=_augment_privacy())
    with pytest.raises(ValueError, match="3 parties, got parties=2"):
        _begin(runlog, parties=2)
    with pytest.raises(ValueError, match="params must be an integer"):
        _begin(runlog, params=1.5)
    with pytest.raises(ValueError, match=r"sample_rate must have shape \(3,\)"):
        release = Release(noise_multiplier=1.0, clip=0.1, expected_batch_size=16.0)
        _begin(runlog, private=True, privacy=StagePrivacy([1e-5] * PARTIES, {"W": release}, {"W": [0.1]}))
    with pytest.raises(ValueError, match="noise_multiplier must be a scalar or have shape"):
        _begin(runlog, private=True, privacy=_augment_privacy(noise_multiplier=np.ones(PARTIES + 1)))
    assert read_run(path)["augment"] is None  # nothing was created by the refused calls

    _begin(runlog)
    with pytest.raises(RuntimeError, match="already running"):
        _begin(runlog)
    with pytest.raises(KeyError, match=r"unknown metric name\(s\) \['val_acc'\]"):
        runlog.augment.append_metrics({"step": 0, "epoch": 0, "val_acc": 0.5})
    with pytest.raises(KeyError, match=r"missing required \['epoch'\]"):
        runlog.augment.append_metrics({"step": 0, "lr": 0.1})  # int64 columns have no NaN
    with pytest.raises(ValueError, match="step must be an integer"):
        runlog.augment.append_metrics({"step": 0.5, "epoch": 0})
    with pytest.raises(RuntimeError, match="has no privacy ledger"):
        runlog.augment.append_privacy(1, np.zeros(PARTIES, np.int64), np.zeros(PARTIES), np.zeros(PARTIES))
    assert runlog.augment.row_counts() == (0, 0, 0)
    runlog.augment.append_metrics({"step": np.int64(7), "epoch": 0.0})

    with pytest.raises(ValueError, match="final status must be one of"):
        runlog.augment.finish("done", reason="x", cost={})
    with pytest.raises(ValueError, match="test_acc is a fraction"):
        runlog.augment.finish("finished", reason="x", test_acc=97.25, cost={})
    with pytest.raises(KeyError, match="unknown cost field"):
        runlog.augment.finish("finished", reason="x", cost={"seconds": 1.0})
    runlog.augment.append_metrics({"step": 8, "epoch": 0})  # still running and writable
    runlog.augment.finish("failed", reason="RuntimeError: diverged", cost={})
    augment = read_run(path)["augment"]
    assert (augment["status"], augment["reason"]) == ("failed", "RuntimeError: diverged")
    assert augment["metrics"]["step"].tolist() == [7, 8] and math.isnan(augment["test_error"])


# ---------------------------------------------------------------------- later jobs: attempts, cost, truncation


def test_reopen_for_augment_counts_attempts_and_truncates(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _searched(path, mode="dpfnas")
    searched = read_run(path)
    _begin(runlog, private=True)
    for step in range(5):
        runlog.augment.append_metrics(_augment_row(step, private=True))
        if step % 2 == 0:
            runlog.augment.append_privacy(step + 1, np.zeros(PARTIES, np.int64), np.full(PARTIES, 0.6 + 0.01 * step),
                                          np.zeros(PARTIES))
    checkpoint = (3, 2)  # what an augment checkpoint taken after step 2 recorded
    runlog.close()  # the job ends without an outcome (like a crash, with the file closed properly)

    with pytest.raises(ValueError, match="keeps the search's /ranks"):
        RunLog.reopen(path, augment=True, rank_attrs={"devices": ["cpu"]})
    resumed = RunLog.reopen(path, augment=True)
    assert resumed.augment.row_counts() == (5, 3, 0)
    with pytest.raises(ValueError, match="a resumed augment must train the same network"):
        _begin(resumed, private=True, genotype="another genotype")
    assert read_run(path)["augment"]["attempts"] == 1  # the refused resume changed nothing
    _begin(resumed, private=True)
    with pytest.raises(ValueError, match="metrics=6"):
        resumed.augment.truncate(6, 2)
    resumed.augment.truncate(*checkpoint)
    assert resumed.augment.row_counts() == (*checkpoint, 0)  # no selection rows
    resumed.augment.append_metrics(_augment_row(3, private=True))
    resumed.augment.append_privacy(4, np.zeros(PARTIES, np.int64), np.full(PARTIES, 0.7), np.zeros(PARTIES))
    live = read_run(path)
    assert (live["augment"]["status"], live["augment"]["attempts"]) == ("running", 2)
    assert _search_part(live) == _search_part(searched)  # reopen(augment=True) leaves the search's record
    resumed.augment.finish("finished", reason="completed", test_acc=0.5, cost={})

    run = read_run(path)
    assert _search_part(run) == _search_part(searched) and run["status"] == "finished"
    augment = run["augment"]
    assert (augment["status"], augment["attempts"]) == ("finished", 2)
    assert augment["metrics"]["step"].tolist() == [0, 1, 2, 3]
    assert np.isnan(augment["metrics"]["train_loss"]).all()  # under DP the caller passed NaN
    assert augment["privacy"]["steps"].tolist() == [1, 3, 4]
    np.testing.assert_allclose(augment["privacy"]["epsilon"][:, 0], [0.6, 0.62, 0.7])
    assert run["privacy"]["steps"].tolist() == [3]  # the search's ledger is its own


def test_reopen_for_augment_refuses_a_search_still_marked_running(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path)
    runlog.search.append_metrics({"step": 0})
    runlog.close()  # no finish: the search never recorded an outcome
    with pytest.raises(RuntimeError, match="has not ended \\(status 'running'\\); resume it"):
        RunLog.reopen(path, augment=True)
    resumed = RunLog.reopen(path)  # the search itself can still be resumed
    resumed.search.finish("finished", reason="completed")
    assert read_run(path)["status"] == "finished"


def test_augment_cost_adds_up_over_attempts_and_the_search_cost_stays(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _searched(path)
    _begin(runlog)
    runlog.augment.append_metrics(_augment_row(0))
    first = {"wall_seconds": 10.0, "ranks": 4, "gpus": 0, "gpu_hours": 0.0, "cpu_core_hours": 0.25}
    runlog.augment.finish("interrupted", reason="SIGUSR1", cost=first)
    _begin(runlog)  # the same writer may begin again: a second attempt
    second = {"wall_seconds": 20.0, "ranks": 4, "gpus": 3, "gpu_hours": 0.5, "cpu_core_hours": 0.5}
    runlog.augment.finish("interrupted", reason="SIGUSR1", cost=second)

    resumed = RunLog.reopen(path, augment=True)
    _begin(resumed)
    third = {"wall_seconds": 30.0, "ranks": 2, "gpus": 1, "gpu_hours": 1.0, "cpu_core_hours": 0.75}
    resumed.augment.finish("finished", reason="completed", test_acc=0.8, cost=third)

    run = read_run(path)
    assert run["cost"] == SEARCH_COST and (run["status"], run["attempts"]) == ("finished", 1)
    augment = run["augment"]
    assert (augment["status"], augment["attempts"]) == ("finished", 3)
    assert augment["cost"]["wall_seconds"] == pytest.approx(60.0)
    assert augment["cost"]["gpu_hours"] == pytest.approx(1.5)
    assert augment["cost"]["cpu_core_hours"] == pytest.approx(1.5)
    assert (augment["cost"]["ranks"], augment["cost"]["gpus"]) == (2, 1)  # layout of the latest attempt


# ---------------------------------------------------------------------- DP ledger


def test_private_augment_ledger_names_shapes_and_dtypes(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _searched(path, mode="dpfnas")
    _begin(runlog, private=True, privacy=_augment_privacy(noise_multiplier=np.linspace(1.0, 1.2, PARTIES)))
    with pytest.raises(ValueError, match=r"epsilon must have shape \(3,\)"):
        runlog.augment.append_privacy(1, np.zeros(PARTIES, np.int64), np.zeros(PARTIES + 1), np.zeros(PARTIES))
    with pytest.raises(ValueError, match=r"epsilon must have shape \(3,\)"):
        runlog.augment.append_privacy(1, np.zeros(PARTIES, np.int64), 0.5, np.zeros(PARTIES))  # a scalar: broadcast
    runlog.augment.append_privacy(10, np.zeros(PARTIES, np.int64), np.array([0.8, 0.9, np.inf]), np.zeros(PARTIES))
    runlog.augment.append_privacy(20, np.zeros(PARTIES, np.int64), np.array([1.0, 1.1, np.inf]), np.zeros(PARTIES))
    runlog.augment.finish("finished", reason="completed", test_acc=0.6, cost={})

    with h5py.File(path, "r") as f:
        group = f["augment"]
        assert group.attrs["private"] and set(group) == {"metrics", "cost", "privacy"}
        ledger = group["privacy"]
        assert {"noise_multiplier", "clip"} <= set(RELEASE_FIELDS)  # the release's fields by their own names
        assert set(ledger) == {"sample_rate", *RELEASE_FIELDS, "delta", "steps", "charged_steps", "epsilon", "mu_gdp"}
        for name in RELEASE_FIELDS:
            assert ledger[name].dtype == np.float64 and ledger[name].shape in ((), (PARTIES,)), name
        assert not ledger.attrs.keys()
        for name, shape in (("sample_rate", (PARTIES,)), ("noise_multiplier", (PARTIES,)), ("clip", ()),
                            ("delta", (PARTIES,))):  # fmt: skip
            assert ledger[name].dtype == np.float64 and ledger[name].shape == shape, name
        assert ledger["steps"].dtype == np.int64 and ledger["steps"].shape == (2,)
        assert ledger["steps"].maxshape == (None,)
        assert ledger["epsilon"].dtype == np.float64 and ledger["epsilon"].shape == (2, PARTIES)
        assert ledger["epsilon"].maxshape == (None, PARTIES)

    privacy = read_run(path)["augment"]["privacy"]
    assert privacy["clip"] == 0.1 and privacy["noise_multiplier"].tolist() == pytest.approx([1.0, 1.1, 1.2])
    assert privacy["sample_rate"].shape == (PARTIES,) and privacy["delta"].tolist() == [1e-5] * PARTIES
    assert privacy["steps"].tolist() == [10, 20]
    assert privacy["epsilon"].tolist() == [[0.8, 0.9, np.inf], [1.0, 1.1, np.inf]]

    scalar = tmp_path / "scalar.h5"
    scalar_log = _searched(scalar, mode="dpfnas")
    _begin(scalar_log, private=True)  # noise_multiplier given once for every party
    scalar_log.augment.finish("finished", reason="completed", cost={})
    assert read_run(scalar)["augment"]["privacy"]["noise_multiplier"] == 1.1
    with h5py.File(scalar, "r") as f:
        assert f["augment/privacy/noise_multiplier"].shape == ()


# ---------------------------------------------------------------------- crash safety


def test_a_ragged_augment_row_is_hidden_and_trimmed_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _searched(path, mode="dpfnas")
    _begin(runlog, private=True)
    for step in range(2):
        runlog.augment.append_metrics(_augment_row(step, private=True))
    runlog.augment.append_privacy(2, np.zeros(PARTIES, np.int64), np.full(PARTIES, 0.7), np.zeros(PARTIES))
    runlog.close()
    # What a crash between two datasets of one append leaves behind: one column of each family a row longer.
    with h5py.File(path, "r+", libver="latest") as f:
        f["augment/metrics/step"].resize((3,))
        f["augment/metrics/step"][2] = 2
        f["augment/privacy/steps"].resize((2,))
        f["augment/privacy/steps"][1] = 3
    augment = read_run(path)["augment"]
    assert {name: len(values) for name, values in augment["metrics"].items()} == dict.fromkeys(AUGMENT_METRICS, 2)
    assert augment["privacy"]["steps"].tolist() == [2]

    resumed = RunLog.reopen(path, augment=True)
    assert resumed.augment.row_counts() == (2, 1, 0)
    with h5py.File(path, "r", libver="latest", swmr=True) as f:  # the file itself is consistent again
        assert {f["augment/metrics"][name].shape for name in AUGMENT_METRICS} == {(2,)}
        assert f["augment/privacy/steps"].shape == (1,)
    _begin(resumed, private=True)
    resumed.augment.append_metrics(_augment_row(9, private=True))
    resumed.augment.append_privacy(9, np.zeros(PARTIES, np.int64), np.full(PARTIES, 0.9), np.zeros(PARTIES))
    resumed.augment.finish("finished", reason="completed", cost={})
    augment = read_run(path)["augment"]
    assert augment["metrics"]["step"].tolist() == [0, 1, 9] and augment["privacy"]["steps"].tolist() == [2, 9]


# A real writer process: a finished search, then an augment stage with 5 rows; reports its PID, then waits
# (alive) until the test kills it.
_WRITER = textwrap.dedent(
    """
    import json, os, sys
    from mpi_fnas.runlog import SEARCH_METRICS, RunLog

    runlog = RunLog.create(sys.argv[1], mode="fnas", parties=2, config_text="x: 1", metric_names=SEARCH_METRICS,
                           alpha_shape=(2, 3), genotype_length=16, privacy_guarantee="none: not DP")
    runlog.search.append_metrics({"step": 0})
    runlog.search.finish("finished", reason="completed", final_genotype="g")
    runlog.begin_augment(genotype="g", params=100, private=False, privacy=None, parties=2,
                           privacy_guarantee="none: not private")
    for step in range(5):
        runlog.augment.append_metrics({"step": step, "epoch": 0, "train_loss": 1.0 / (step + 1)})
        runlog.heartbeat()
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.readline()  # alive until killed
    """
)


def _python_child(script: str, path: Path) -> subprocess.Popen:
    """A python subprocess running `script` on the log at `path`, talking over pipes."""
    return subprocess.Popen([sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)  # fmt: skip


class _LineReader:
    """Reads a child's stdout lines on a thread so the test can wait with a timeout instead of hanging."""

    def __init__(self, process: subprocess.Popen) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(process,), daemon=True).start()

    def _pump(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self._lines.put(line)

    def json(self, timeout: float = 60.0) -> dict:
        return json.loads(self._lines.get(timeout=timeout))


def _end(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def test_a_writer_killed_mid_augment_fails_the_augment_not_the_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "search.h5"
    process = _python_child(_WRITER, path)
    try:
        pid = _LineReader(process).json()["pid"]
        live = read_run(path, stale_after=0.0)  # alive on this machine: the PID decides, not the heartbeat
        os.kill(pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        _end(process)
    assert (live["status"], live["augment"]["status"], live["augment"]["stale"]) == ("finished", "running", False)

    dead = read_run(path)
    assert (dead["status"], dead["reason"], dead["stale"]) == ("finished", "completed", False)
    augment = dead["augment"]
    assert (augment["status"], augment["stale"]) == ("failed", True)
    host = socket.gethostname()
    assert augment["reason"] == f"writer died: process {pid} on {host} is gone; last logged augment step 4"
    assert augment["metrics"]["step"].tolist() == [0, 1, 2, 3, 4]

    with monkeypatch.context() as patch:  # a reader on another machine judges the heartbeat's age
        patch.setattr(liveness, "machine_scope", lambda: "")
        assert read_run(path, stale_after=3600.0)["augment"]["status"] == "running"
        stale = read_run(path, stale_after=0.0)
    assert stale["status"] == "finished" and stale["augment"]["status"] == "failed"
    assert stale["augment"]["reason"].startswith(f"writer stopped heartbeating: process {pid}")
    assert stale["augment"]["reason"].endswith("(stale after 0 s); last logged augment step 4")

    resumed = RunLog.reopen(path, augment=True)  # salvages the file the killed writer left open
    assert resumed.augment.row_counts() == (5, 0, 0)
    resumed.begin_augment(genotype="g", params=100, private=False, privacy=None, parties=2,
                           privacy_guarantee="none: not private")
    resumed.augment.append_metrics({"step": 5, "epoch": 1})
    resumed.augment.finish("finished", reason="completed", test_acc=0.75, cost={"wall_seconds": 1.0})
    run = read_run(path)
    assert (run["status"], run["attempts"]) == ("finished", 1)
    assert (run["augment"]["status"], run["augment"]["stale"], run["augment"]["attempts"]) == ("finished", False, 2)
    assert run["augment"]["metrics"]["step"].tolist() == [0, 1, 2, 3, 4, 5]
    assert sorted(os.listdir(tmp_path)) == ["search.h5"]


# ---------------------------------------------------------------------- a concurrent SWMR reader

# A reader process that opened the file during the search and keeps that handle: on "look" it reports the search
# rows it sees after Dataset.refresh(). /augment appears after its handle was opened, and HDF5 shares one open file
# (with its cached metadata) among all handles of a process, so on "reopen" it closes the old handle and opens the
# file again; from then on it also reports the augment rows. "quit" closes the handle and runs read_run.
_READER = textwrap.dedent(
    """
    import json, sys, time
    import h5py
    from mpi_fnas.runlog import read_run

    path = sys.argv[1]
    handle = h5py.File(path, "r", libver="latest", swmr=True)
    search_step, augment_step = handle["metrics/step"], None
    print(json.dumps({"opened": True}), flush=True)
    for line in sys.stdin:
        command, *arguments = line.split()
        if command == "reopen":
            handle.close()
            handle = h5py.File(path, "r", libver="latest", swmr=True)
            search_step, augment_step = handle["metrics/step"], handle["augment/metrics/step"]
        if command == "quit":
            handle.close()
            run = read_run(path)
            print(json.dumps({"status": run["status"], "augment_status": run["augment"]["status"],
                              "augment_steps": run["augment"]["metrics"]["step"].tolist()}), flush=True)
            break
        want = int(arguments[0]) if arguments else 0
        deadline = time.monotonic() + 10
        while True:
            search_step.refresh()
            report = {"search_steps": search_step[:].tolist()}
            if augment_step is not None:
                augment_step.refresh()
                report["augment_steps"] = augment_step[:].tolist()
            if len(report.get("augment_steps", [])) >= want or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        print(json.dumps(report), flush=True)
    """
)


def test_a_concurrent_swmr_reader_keeps_reading_through_begin_augment(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path)
    runlog.search.append_metrics({"step": 0})
    reader = _python_child(_READER, path)
    try:
        lines = _LineReader(reader)
        assert lines.json() == {"opened": True}

        def ask(command: str) -> dict:
            reader.stdin.write(command + "\n")
            reader.stdin.flush()
            return lines.json()

        runlog.search.append_metrics({"step": 1})
        assert ask("look") == {"search_steps": [0.0, 1.0]}
        # finish and begin_augment reopen the file outside SWMR mode while the reader holds it (and its lock).
        runlog.search.finish("finished", reason="completed", final_genotype=GENOTYPE)
        _begin(runlog)
        during = read_run(path)  # in the writer's own process, which now bypasses file locking
        assert (during["status"], during["augment"]["status"]) == ("finished", "running")
        assert ask("look") == {"search_steps": [0.0, 1.0]}  # the old handle still reads the search

        reports = [ask("reopen")]  # a handle opened after begin_augment sees /augment
        for step in range(3):
            runlog.augment.append_metrics(_augment_row(step))
            reports.append(ask(f"look {step + 1}"))
        assert read_run(path)["augment"]["metrics"]["step"].tolist() == [0, 1, 2]
        runlog.augment.finish("finished", reason="completed", test_acc=0.9, cost={})
        after = read_run(path)
        final = ask("quit")
        reader.wait(timeout=30)
    finally:
        _end(reader)
    assert reader.returncode == 0, reader.stderr.read()

    # The reopened handle saw the augment rows appear one at a time, and the search's rows throughout.
    assert [report["augment_steps"] for report in reports] == [[], [0], [0, 1], [0, 1, 2]]
    assert all(report["search_steps"] == [0.0, 1.0] for report in reports)
    assert (after["status"], after["augment"]["status"], after["augment"]["test_acc"]) == ("finished", "finished", 0.9)
    assert final == {"status": "finished", "augment_status": "finished", "augment_steps": [0, 1, 2]}
