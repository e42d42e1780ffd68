"""Tests of what only the augment stage of the run log (``/augment`` in search.h5) does: ``begin_augment`` after the
search in the same job and ``reopen(augment=True)`` in a later one, their refusals, the stage's integer columns,
attempts and cost over begins and resumes, the DP ledger's layout, and a concurrent SWMR reader that must reopen the
file to see ``/augment``. What both stages share (appending, finish, truncate, crash and resume, a killed writer) is
tested once per stage in test_runlog.py."""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
from runlog_helpers import (
    GENOTYPE,
    PARAMS,
    PARTIES,
    SEARCH_COST,
    LineReader,
    augment_privacy,
    augment_row,
    begin_augment,
    cost,
    create_log,
    end,
    python_child,
    searched_log,
)

from mpi_fnas.privacy.release import Release
from mpi_fnas.runlog import AUGMENT_METRICS, RELEASE_FIELDS, RunLog, StagePrivacy, read_run, writer


def _search_part(run: dict) -> dict:
    """What the search recorded, to compare before and after the augment stage."""
    return {key: run[key] for key in ("status", "reason", "attempts", "final_genotype", "cost", "ranks")} | {
        "steps": run["metrics"]["step"].tolist()
    }


# ---------------------------------------------------------------------- lifecycle in one job


def test_full_lifecycle_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "search.h5"
    runlog = searched_log(path)
    searched = read_run(path)
    assert searched["augment"] is None and runlog.augment is None
    with pytest.raises(RuntimeError, match="closed"):
        runlog.heartbeat()  # finish closed the file; begin_augment reopens it

    clock = 2_000_000_000.0  # begin_augment refreshes the heartbeat with writer.time.time()
    monkeypatch.setattr(writer.time, "time", lambda: clock)
    begin_augment(runlog)
    monkeypatch.undo()
    live = read_run(path)
    assert live["writer"]["heartbeat"] == clock and live["writer"]["pid"] == os.getpid()
    assert _search_part(live) == _search_part(searched)  # the search's record is untouched
    augment = live["augment"]
    assert (augment["status"], augment["reason"], augment["stale"], augment["attempts"]) == ("running", "", False, 1)
    assert (augment["genotype"], augment["params"], augment["private"]) == (GENOTYPE, PARAMS, False)
    assert math.isnan(augment["test_acc"]) and math.isnan(augment["test_error"]) and augment["privacy"] is None

    for step in range(4):
        runlog.augment.append_metrics(augment_row(step))
    runlog.heartbeat()
    assert runlog.augment.row_counts() == (4, 0, 0)
    runlog.search.finish("failed", reason="late search failure")  # the search's outcome was recorded: no effect
    runlog.augment.finish("finished", reason="completed", test_acc=0.9725, cost=cost(50.0, 4, 3, 0.04, 0.1))

    run = read_run(path)
    assert _search_part(run) == _search_part(searched)
    augment = run["augment"]
    assert (augment["status"], augment["reason"], augment["attempts"]) == ("finished", "completed", 1)
    assert augment["test_acc"] == 0.9725 and augment["test_error"] == pytest.approx(0.0275)
    assert augment["cost"] == cost(50.0, 4, 3, 0.04, 0.1)
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
            "status", "reason", "network", "genotype", "params", "test_acc", "test_error", "private",
            "privacy_guarantee", "attempts",
        }  # fmt: skip
        for name in ("status", "reason", "network", "genotype", "privacy_guarantee"):
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
        assert set(group["cost"].attrs) == {"wall_seconds", "ranks", "gpus", "gpu_hours", "cpu_core_hours",
                                           "rss_peak_mb_server", "startup_seconds", "party_compute_seconds",
                                           "transfer_seconds", "server_seconds"}
        assert group["cost"].attrs.get_id("ranks").dtype.kind == "i"
        assert f.attrs["status"] == "finished" and f["cost"].attrs["wall_seconds"] == 100.0
        assert group.attrs["privacy_guarantee"] == "none: mode fnas makes no privacy claim"
    assert augment["privacy_guarantee"] == "none: mode fnas makes no privacy claim"
    with h5py.File(path, "r+") as f:  # a log written before the attribute existed still reads
        del f["augment"].attrs["privacy_guarantee"]
    assert read_run(path)["augment"]["privacy_guarantee"] == "not recorded"


def test_augment_calls_are_checked_before_anything_is_written(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = create_log(path)
    runlog.search.append_metrics({"step": 0})
    with pytest.raises(RuntimeError, match="finish\\(\\) it before begin_augment"):
        begin_augment(runlog)
    runlog.search.append_metrics({"step": 1})  # a refused begin leaves the search running and writable
    with pytest.raises(KeyError, match="begin_augment\\(\\) first"):
        runlog.stage("augment").append_metrics({"step": 0, "epoch": 0})
    with pytest.raises(KeyError, match="begin_augment\\(\\) first"):
        runlog.stage("augment").finish("failed", reason="x", cost={})
    runlog.search.finish("finished", reason="completed")

    with pytest.raises(ValueError, match="privacy schema is required when private=True"):
        begin_augment(runlog, private=True, privacy=None)
    with pytest.raises(ValueError, match="privacy schema is required when private=True"):
        begin_augment(runlog, private=False, privacy=augment_privacy())
    with pytest.raises(ValueError, match="3 parties, got parties=2"):
        begin_augment(runlog, parties=2)
    with pytest.raises(ValueError, match="params must be an integer"):
        begin_augment(runlog, params=1.5)
    with pytest.raises(ValueError, match=r"sample_rate must have shape \(3,\)"):
        release = Release(noise_multiplier=1.0, clip=0.1, expected_batch_size=16.0)
        begin_augment(runlog, private=True, privacy=StagePrivacy([1e-5] * PARTIES, {"W": release}, {"W": [0.1]}))
    with pytest.raises(ValueError, match="noise_multiplier must be a scalar or have shape"):
        begin_augment(runlog, private=True, privacy=augment_privacy(noise_multiplier=np.ones(PARTIES + 1)))
    for network, genotype in (("cnn-tanh", GENOTYPE), ("cell", "")):  # a cell has a genotype, a hand-designed none
        with pytest.raises(ValueError, match="a cell has a genotype, a hand-designed network none"):
            begin_augment(runlog, network=network, genotype=genotype)
    assert read_run(path)["augment"] is None  # nothing was created by the refused calls

    begin_augment(runlog)
    with pytest.raises(RuntimeError, match="already running"):
        begin_augment(runlog)
    with pytest.raises(KeyError, match=r"unknown metric name\(s\) \['val_acc'\]"):
        runlog.augment.append_metrics({"step": 0, "epoch": 0, "val_acc": 0.5})
    with pytest.raises(KeyError, match=r"missing required \['epoch'\]"):
        runlog.augment.append_metrics({"step": 0, "lr": 0.1})  # int64 columns have no NaN
    with pytest.raises(ValueError, match="step must be an integer"):
        runlog.augment.append_metrics({"step": 0.5, "epoch": 0})
    assert runlog.augment.row_counts() == (0, 0, 0)
    runlog.augment.append_metrics({"step": np.int64(7), "epoch": 0.0})

    with pytest.raises(ValueError, match="test_acc is a fraction"):
        runlog.augment.finish("finished", reason="x", test_acc=97.25, cost={})
    runlog.augment.append_metrics({"step": 8, "epoch": 0})  # still running and writable
    runlog.augment.finish("failed", reason="RuntimeError: diverged", cost={})
    augment = read_run(path)["augment"]
    assert (augment["status"], augment["reason"]) == ("failed", "RuntimeError: diverged")
    assert augment["metrics"]["step"].tolist() == [7, 8] and math.isnan(augment["test_error"])


# ---------------------------------------------------------------------- later jobs: attempts, cost, truncation


def test_reopen_for_augment_counts_attempts_and_truncates(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = searched_log(path, mode="dpfnas")
    searched = read_run(path)
    begin_augment(runlog, private=True)
    for step in range(5):
        runlog.augment.append_metrics(augment_row(step, private=True))
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
        begin_augment(resumed, private=True, genotype="another genotype")
    with pytest.raises(ValueError, match="a resumed augment must train the same network"):
        begin_augment(resumed, private=True, network="cnn-gn", genotype="")
    assert read_run(path)["augment"]["attempts"] == 1  # the refused resume changed nothing
    begin_augment(resumed, private=True)
    resumed.augment.truncate(*checkpoint)
    assert resumed.augment.row_counts() == (*checkpoint, 0)  # no selection rows
    resumed.augment.append_metrics(augment_row(3, private=True))
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
    runlog = create_log(path)
    runlog.search.append_metrics({"step": 0})
    runlog.close()  # no finish: the search never recorded an outcome
    with pytest.raises(RuntimeError, match="has not ended \\(status 'running'\\); resume it"):
        RunLog.reopen(path, augment=True)
    resumed = RunLog.reopen(path)  # the search itself can still be resumed
    resumed.search.finish("finished", reason="completed")
    assert read_run(path)["status"] == "finished"


def test_augment_cost_adds_up_over_attempts_and_the_search_cost_stays(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = searched_log(path)
    begin_augment(runlog)
    runlog.augment.append_metrics(augment_row(0))
    first = cost(10.0, 4, 0, 0.0, 0.25)
    runlog.augment.finish("interrupted", reason="SIGUSR1", cost=first)
    begin_augment(runlog)  # the same writer may begin again: a second attempt
    second = cost(20.0, 4, 3, 0.5, 0.5)
    runlog.augment.finish("interrupted", reason="SIGUSR1", cost=second)

    resumed = RunLog.reopen(path, augment=True)
    begin_augment(resumed)
    third = cost(30.0, 2, 1, 1.0, 0.75)
    resumed.augment.finish("finished", reason="completed", test_acc=0.8, cost=third)

    run = read_run(path)
    assert run["cost"] == SEARCH_COST and (run["status"], run["attempts"]) == ("finished", 1)
    augment = run["augment"]
    assert (augment["status"], augment["attempts"]) == ("finished", 3)
    assert augment["cost"] == pytest.approx(cost(60.0, 2, 1, 1.5, 1.5))  # ranks and gpus: the latest attempt's


# ---------------------------------------------------------------------- DP ledger


def test_private_augment_ledger_names_shapes_and_dtypes(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = searched_log(path, mode="dpfnas")
    begin_augment(runlog, private=True, privacy=augment_privacy(noise_multiplier=np.linspace(1.0, 1.2, PARTIES)))
    runlog.augment.append_privacy(10, np.zeros(PARTIES, np.int64), np.array([0.8, 0.9, np.inf]), np.zeros(PARTIES))
    runlog.augment.append_privacy(20, np.zeros(PARTIES, np.int64), np.array([1.0, 1.1, np.inf]), np.zeros(PARTIES))
    runlog.augment.finish("finished", reason="completed", test_acc=0.6, cost={})

    with h5py.File(path, "r") as f:
        group = f["augment"]
        assert group.attrs["private"] and set(group) == {"metrics", "cost", "privacy"}
        ledger = group["privacy"]
        assert {"noise_multiplier", "clip"} <= set(RELEASE_FIELDS)  # the release's fields by their own names
        assert set(ledger) == {"sample_rate", *RELEASE_FIELDS, "delta", "steps", "charged_steps", "epsilon", "mu_gdp",
                               "epsilon_collusion"}
        for name in RELEASE_FIELDS:
            assert ledger[name].dtype == np.float64 and ledger[name].shape in ((), (PARTIES,)), name
        assert dict(ledger.attrs) == {"aggregation": "local", "colluders": 0}
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
    scalar_log = searched_log(scalar, mode="dpfnas")
    begin_augment(scalar_log, private=True)  # noise_multiplier given once for every party
    scalar_log.augment.finish("finished", reason="completed", cost={})
    assert read_run(scalar)["augment"]["privacy"]["noise_multiplier"] == 1.1
    with h5py.File(scalar, "r") as f:
        assert f["augment/privacy/noise_multiplier"].shape == ()


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
    runlog = create_log(path)
    runlog.search.append_metrics({"step": 0})
    reader = python_child(_READER, path)
    try:
        lines = LineReader(reader)
        assert lines.json() == {"opened": True}

        def ask(command: str) -> dict:
            reader.stdin.write(command + "\n")
            reader.stdin.flush()
            return lines.json()

        runlog.search.append_metrics({"step": 1})
        assert ask("look") == {"search_steps": [0.0, 1.0]}
        # finish and begin_augment reopen the file outside SWMR mode while the reader holds it (and its lock).
        runlog.search.finish("finished", reason="completed", final_genotype=GENOTYPE)
        begin_augment(runlog)
        during = read_run(path)  # in the writer's own process, which now bypasses file locking
        assert (during["status"], during["augment"]["status"]) == ("finished", "running")
        assert ask("look") == {"search_steps": [0.0, 1.0]}  # the old handle still reads the search

        reports = [ask("reopen")]  # a handle opened after begin_augment sees /augment
        for step in range(3):
            runlog.augment.append_metrics(augment_row(step))
            reports.append(ask(f"look {step + 1}"))
        assert read_run(path)["augment"]["metrics"]["step"].tolist() == [0, 1, 2]
        runlog.augment.finish("finished", reason="completed", test_acc=0.9, cost={})
        after = read_run(path)
        final = ask("quit")
        reader.wait(timeout=30)
    finally:
        end(reader)
    assert reader.returncode == 0, reader.stderr.read()

    # The reopened handle saw the augment rows appear one at a time, and the search's rows throughout.
    assert [report["augment_steps"] for report in reports] == [[], [0], [0, 1], [0, 1, 2]]
    assert all(report["search_steps"] == [0.0, 1.0] for report in reports)
    assert (after["status"], after["augment"]["status"], after["augment"]["test_acc"]) == ("finished", "finished", 0.9)
    assert final == {"status": "finished", "augment_status": "finished", "augment_steps": [0, 1, 2]}


def test_a_hand_designed_network_is_logged_and_an_older_log_reads_as_a_cell(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = searched_log(path)
    begin_augment(runlog, network="cnn-tanh", genotype="")
    runlog.augment.finish("finished", reason="completed", test_acc=0.5, cost={})
    assert (read_run(path)["augment"]["network"], read_run(path)["augment"]["genotype"]) == ("cnn-tanh", "")
    with h5py.File(path, "r+") as f:  # as a log written before /augment had the attribute
        del f["augment"].attrs["network"]
    assert read_run(path)["augment"]["network"] == "cell"
