"""Tests of the HDF5 run log (mpi_fnas.runlog): schema, SWMR live reading, failure, resume, truncation, and the
liveness record that turns a killed writer's ``running`` into ``failed``.

What the two stages share -- one ``StageLog`` writes the search (the root group) and the augment stage
(``/augment``) alike -- is tested once, parametrized over ``stage``; what only the search does (its schema,
``create``, the epoch-end rows) stands alone here, and what only the augment stage does in test_runlog_augment.py.
"""

from __future__ import annotations

import os
import socket
import textwrap
import time
from datetime import datetime
from pathlib import Path

import h5py
import numpy as np
import pytest
from runlog_helpers import (
    EDGES,
    KILLED_WRITER_ROWS,
    METRIC_NAMES,
    OPS,
    PARTIES,
    PREFIX,
    STAGES,
    STEP_NOUN,
    LineReader,
    cost,
    create_log,
    end,
    metric_row,
    open_stage,
    python_child,
    record,
    reopen_log,
    resume,
    rows,
    search_privacy,
    search_row,
    sigkill,
    softmax_rows,
    start_writer,
)

import mpi_fnas
from mpi_fnas.runlog import (
    HEARTBEAT_SECONDS,
    RELEASE_FIELDS,
    SEARCH_METRICS,
    RunLog,
    liveness,
    read_run,
    writer,
)
from mpi_fnas.runlog import reader as reader_module

# ---------------------------------------------------------------------- the search's schema and create


def test_schema_names_shapes_and_dtypes(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = create_log(path, mode="dpfnas", rank_attrs={"devices": ["cpu", "cuda:0", "cuda:1", "cuda:0"]})
    for step in range(3):
        runlog.search.append_metrics(search_row(step))
    runlog.search.append_epoch(softmax_rows(0), softmax_rows(1), "normal=[sep_conv_3x3]")
    runlog.search.append_privacy(3, np.array([3, 4, 3]), np.array([0.5, 0.6, 0.7]), np.array([0.05, 0.06, 0.07]))
    runlog.search.finish(
        "finished",
        reason="completed",
        final_genotype="normal=[sep_conv_3x3]",
        cost={"wall_seconds": 12.5, "ranks": 4, "gpus": 3, "gpu_hours": 0.01, "cpu_core_hours": 0.02},
    )

    with h5py.File(path, "r") as f:
        root = f.attrs
        assert set(root) == {
            "status", "mode", "space", "parties", "config", "version", "final_genotype", "created", "reason",
            "attempts", "privacy_guarantee", "unreliable", "corruption",
        }  # fmt: skip
        assert not root["unreliable"].any() and root["unreliable"].shape == (root["parties"],)
        assert root["corruption"] == 0.0
        assert root["space"] == "darts"  # the default: DARTS' two cells
        for name in ("status", "mode", "space", "config", "version", "final_genotype", "created", "reason",
                     "privacy_guarantee"):
            string_info = h5py.check_string_dtype(root.get_id(name).dtype)
            assert string_info is not None and string_info.encoding == "utf-8", name
        assert (root["status"], root["mode"], root["reason"]) == ("finished", "dpfnas", "completed")
        assert root.get_id("parties").dtype.kind == "i" and root["parties"] == PARTIES
        assert root["config"] == "search:\n  epochs: 2\n" and root["privacy_guarantee"] == "holds"
        assert root["version"] == mpi_fnas.__version__
        assert root["final_genotype"] == "normal=[sep_conv_3x3]"
        assert datetime.fromisoformat(root["created"]).tzinfo is not None

        assert set(f) == {"metrics", "alphas", "genotype", "cost", "privacy", "ranks", "writer"}
        assert list(f["metrics"]) == list(SEARCH_METRICS)  # caller's column order survives
        for name in SEARCH_METRICS:
            dataset = f["metrics"][name]
            assert dataset.dtype == np.float64 and dataset.shape == (3,), name
            assert dataset.maxshape == (None,) and dataset.chunks is not None, name
        np.testing.assert_array_equal(f["metrics/step"][:], [0.0, 1.0, 2.0])

        assert set(f["alphas"]) == {"normal", "reduce"}
        for cell, seed in (("normal", 0), ("reduce", 1)):
            dataset = f["alphas"][cell]
            assert dataset.dtype == np.float32 and dataset.shape == (1, EDGES, OPS)
            assert dataset.maxshape == (None, EDGES, OPS) and dataset.chunks is not None
            np.testing.assert_array_equal(dataset[0], softmax_rows(seed))

        genotype = f["genotype"]
        assert genotype.dtype == np.dtype("S64") and genotype.maxshape == (None,)
        assert genotype[0] == b"normal=[sep_conv_3x3]"

        cost = f["cost"].attrs
        assert set(cost) == {"wall_seconds", "ranks", "gpus", "gpu_hours", "cpu_core_hours", "rss_peak_mb_server",
                             "startup_seconds", "party_compute_seconds", "transfer_seconds", "server_seconds"}
        assert (cost["wall_seconds"], cost["ranks"], cost["gpus"]) == (12.5, 4, 3)
        assert cost.get_id("ranks").dtype.kind == "i" and cost.get_id("wall_seconds").dtype == np.float64

        privacy = f["privacy"]
        assert set(privacy.attrs) == {"delta", "accountant", "aggregation", "colluders"}
        assert privacy.attrs["delta"].shape == (PARTIES,) and privacy.attrs["accountant"] == "pld"
        assert privacy.attrs["aggregation"] == "local"
        # each release's RELEASE_FIELDS (noise_multiplier, clip, …) as <field>_w and <field>_a, each float64
        released = {field + suffix for field in RELEASE_FIELDS for suffix in ("_w", "_a")}
        assert {"noise_multiplier_w", "noise_multiplier_a", "clip_w", "clip_a"} <= released
        assert set(privacy) == {"epsilon", "mu_gdp", "epsilon_collusion", "steps", "charged_steps",
                                "sample_rate_train", "sample_rate_val", *released}
        for name in released:
            assert privacy[name].dtype == np.float64 and privacy[name].shape in ((), (PARTIES,)), name
        # under local noise colluders subtract nothing: the collusion ε is the ε (append_privacy without it)
        np.testing.assert_array_equal(privacy["epsilon_collusion"][0], privacy["epsilon"][0])
        for name in ("epsilon", "mu_gdp", "epsilon_collusion"):
            assert privacy[name].shape == (1, PARTIES) and privacy[name].maxshape == (None, PARTIES)
            assert privacy[name].dtype == np.float64
        assert privacy["steps"].shape == (1,) and privacy["steps"].maxshape == (None,)
        assert privacy["steps"].dtype.kind == "i" and privacy["steps"][0] == 3
        np.testing.assert_array_equal(privacy["epsilon"][0], [0.5, 0.6, 0.7])
        charged = privacy["charged_steps"]
        assert charged.dtype == np.int64 and charged.shape == (1, PARTIES) and charged.maxshape == (None, PARTIES)
        np.testing.assert_array_equal(charged[0], [3, 4, 3])
        assert privacy["sample_rate_train"].shape == (PARTIES,) == privacy["sample_rate_val"].shape
        assert privacy["noise_multiplier_w"].shape == () and privacy["noise_multiplier_a"].shape == (PARTIES,)
        assert privacy["clip_w"][()] == 0.01 and privacy["clip_a"][()] == 0.1

        devices = f["ranks"].attrs["devices"]
        assert [str(device) for device in devices] == ["cpu", "cuda:0", "cuda:1", "cuda:0"]

        record = f["writer"]
        assert set(record) == {"host", "pid", "process", "started", "heartbeat"}
        assert record["host"][()].decode() == socket.gethostname() and record["pid"][()] == os.getpid()
        assert record["heartbeat"][()] >= record["started"][()] > 0


def test_create_refuses_a_bad_mode_or_privacy_schema(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        create_log(tmp_path / "bad_mode.h5", mode="dp")
    assert not (tmp_path / "bad_mode.h5").exists()
    # A DP run without a ledger, or a ledger on a non-DP run, is a configuration mistake.
    with pytest.raises(ValueError, match="privacy schema is required"):
        create_log(tmp_path / "dp_without.h5", mode="dpfnas", privacy=None)
    with pytest.raises(ValueError, match="privacy schema is required"):
        create_log(tmp_path / "fnas_with.h5", mode="fnas", privacy=search_privacy())
    with pytest.raises(ValueError, match=r"delta must have shape \(3,\)"):
        create_log(tmp_path / "bad_delta.h5", mode="dpfnas", privacy=search_privacy(parties=2))


def test_create_never_overwrites_an_existing_log(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    first = create_log(path)
    first.search.append_metrics(search_row(0))
    first.search.finish("finished", reason="completed")
    with pytest.raises(FileExistsError):
        create_log(path)
    assert read_run(path)["metrics"]["step"].tolist() == [0.0]


# ---------------------------------------------------------------------- appending (either stage)


@pytest.mark.parametrize("stage", STAGES)
def test_missing_metrics_are_nan_and_unknown_names_write_nothing(tmp_path: Path, stage: str) -> None:
    path = tmp_path / "search.h5"
    log = open_stage(path, stage).stage(stage)
    row = {"step": 0, "epoch": 0, "train_loss": 1.5}
    log.append_metrics(row)
    with pytest.raises(KeyError, match=r"unknown metric name\(s\) \['train_los'\]"):
        log.append_metrics({"step": 1, "epoch": 0, "train_los": 1.0})
    assert log.row_counts() == rows(stage, metrics=1)
    log.finish("finished", reason="completed")
    metrics = record(read_run(path), stage)["metrics"]
    assert {name: values.shape for name, values in metrics.items()} == dict.fromkeys(METRIC_NAMES[stage], (1,))
    assert metrics["train_loss"][0] == 1.5
    missing = [name for name in metrics if name not in row]
    assert "test_acc" in missing and all(np.isnan(metrics[name][0]) for name in missing), missing


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_without_privacy_has_no_ledger_and_no_selection(tmp_path: Path, stage: str) -> None:
    path = tmp_path / "search.h5"
    log = open_stage(path, stage).stage(stage)
    with pytest.raises(RuntimeError, match=f"the {stage} stage of this run log has no privacy ledger"):
        log.append_privacy(1, np.ones(PARTIES, np.int64), np.zeros(PARTIES), np.zeros(PARTIES))
    with pytest.raises(RuntimeError, match=f"the {stage} stage of this run log has no selection"):
        log.append_selection(1, np.ones(PARTIES, bool), np.zeros(PARTIES), 0.0)
    assert log.row_counts() == rows(stage)
    log.finish("finished", reason="completed")
    stage_run = record(read_run(path), stage)
    assert stage_run["metrics"]["step"].tolist() == []  # the refused appends wrote nothing
    assert stage_run["privacy"] is None and stage_run["selection"] is None
    assert stage_run["privacy_guarantee"] == "none: mode fnas makes no privacy claim"
    with h5py.File(path, "r") as f:
        assert f"{PREFIX[stage]}privacy" not in f


@pytest.mark.parametrize("stage", STAGES)
def test_append_privacy_refuses_wrong_shapes_and_takes_infinite_epsilon(tmp_path: Path, stage: str) -> None:
    path = tmp_path / "search.h5"
    log = open_stage(path, stage, private=True).stage(stage)
    with pytest.raises(ValueError, match=r"epsilon must have shape \(3,\)"):
        log.append_privacy(1, np.ones(PARTIES), np.zeros(PARTIES + 1), np.zeros(PARTIES))
    with pytest.raises(ValueError, match=r"epsilon must have shape \(3,\)"):
        log.append_privacy(1, np.ones(PARTIES), 0.5, np.zeros(PARTIES))  # a scalar would be broadcast silently
    with pytest.raises(ValueError, match=r"charged_steps must have shape \(3,\)"):
        log.append_privacy(1, 1, np.zeros(PARTIES), np.zeros(PARTIES))
    assert log.row_counts() == rows(stage)
    log.append_privacy(10, np.ones(PARTIES), np.full(PARTIES, np.inf), np.zeros(PARTIES))  # ε = inf is legitimate
    log.append_privacy(20, np.full(PARTIES, 2), np.array([1.0, 1.1, np.inf]), np.zeros(PARTIES))
    log.finish("finished", reason="completed")
    privacy = record(read_run(path), stage)["privacy"]
    assert privacy["epsilon"].shape == (2, PARTIES) and privacy["charged_steps"].tolist() == [[1, 1, 1], [2, 2, 2]]
    assert privacy["steps"].tolist() == [10, 20]
    assert privacy["epsilon"].tolist() == [[np.inf] * PARTIES, [1.0, 1.1, np.inf]]


# ---------------------------------------------------------------------- the search's epoch-end rows


def test_genotype_too_long_raises_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = create_log(path, genotype_length=8)
    alphas = softmax_rows(0)
    runlog.search.append_epoch(alphas, alphas, "a" * 8)  # exactly the limit fits
    with pytest.raises(ValueError, match="9 bytes"):
        runlog.search.append_epoch(alphas, alphas, "a" * 9)
    with pytest.raises(ValueError, match="10 bytes"):
        runlog.search.append_epoch(alphas, alphas, "é" * 5)  # 5 characters, 10 bytes in UTF-8
    runlog.search.append_epoch(alphas, alphas, "é" * 4)
    runlog.search.finish("finished", reason="completed")
    run = read_run(path)
    assert run["genotypes"] == ["a" * 8, "é" * 4]
    assert run["alphas"]["normal"].shape == (2, EDGES, OPS)


def test_alphas_must_be_softmax_weights_and_a_failed_search_keeps_its_epochs(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = create_log(path)
    raw_alphas = 1e-3 * np.random.default_rng(0).random(size=(EDGES, OPS))  # DARTS init scale, not softmax
    with pytest.raises(ValueError, match="sum to 1"):
        runlog.search.append_epoch(raw_alphas, softmax_rows(1), "g")
    with pytest.raises(ValueError, match="shape"):
        runlog.search.append_epoch(softmax_rows(0)[:, :7], softmax_rows(1), "g")
    assert runlog.search.row_counts()[1] == 0  # epochs
    runlog.search.append_epoch(softmax_rows(0), softmax_rows(1), "partial")
    runlog.search.finish("failed", reason="test")
    assert read_run(path)["genotypes"] == ["partial"]


def test_the_augment_stage_has_no_epoch_rows(tmp_path: Path) -> None:
    log = open_stage(tmp_path / "search.h5", "augment").stage("augment")
    with pytest.raises(RuntimeError, match="the augment stage has no epoch-end rows"):
        log.append_epoch(softmax_rows(0), softmax_rows(1), "g")


def test_truncate_drops_the_searchs_epochs_too(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = create_log(path)
    for epoch in range(3):
        runlog.search.append_metrics(search_row(epoch))
        runlog.search.append_epoch(softmax_rows(epoch), softmax_rows(epoch + 10), f"g{epoch}")
    runlog.search.truncate(2, 1)  # a checkpoint older than the ledger and the selection: their counts are 0
    assert runlog.search.row_counts() == (2, 1, 0, 0)
    runlog.search.append_epoch(softmax_rows(7), softmax_rows(8), "g-new")
    runlog.search.finish("finished", reason="completed")
    run = read_run(path)
    assert run["metrics"]["step"].tolist() == [0.0, 1.0]
    assert run["genotypes"] == ["g0", "g-new"]
    np.testing.assert_array_equal(run["alphas"]["normal"][1], softmax_rows(7))


# ---------------------------------------------------------------------- live reading (SWMR)

# A separate process that keeps one SWMR read handle open for the whole run and answers each
# "expect <rows> <epochs>" with what it sees after Dataset.refresh().
_READER = textwrap.dedent(
    """
    import json, sys, time
    import h5py
    from mpi_fnas.runlog import read_run

    path = sys.argv[1]
    handle = h5py.File(path, "r", libver="latest", swmr=True)
    step, normal, genotype = handle["metrics/step"], handle["alphas/normal"], handle["genotype"]

    def seen():
        for dataset in (step, normal, genotype):
            dataset.refresh()
        return {"rows": step.shape[0], "steps": step[:].tolist(), "epochs": normal.shape[0],
                "genotypes": [row.decode() for row in genotype[:]]}

    print(json.dumps({"opened": True, "status": handle.attrs["status"]}), flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "expect":
            rows, epochs = int(command[1]), int(command[2])
            deadline = time.monotonic() + 10
            report = seen()
            while (report["rows"] < rows or report["epochs"] < epochs) and time.monotonic() < deadline:
                time.sleep(0.02)
                report = seen()
            print(json.dumps(report), flush=True)
        elif command[0] == "finished":
            report = seen()  # the same handle, still open while the writer finished
            handle.close()
            final = read_run(path)  # a fresh open sees the attributes written by finish
            report.update(status=final["status"], reason=final["reason"],
                          final_rows=len(final["metrics"]["step"]))
            print(json.dumps(report), flush=True)
            break
    """
)


def test_concurrent_swmr_reader_sees_rows_while_the_run_is_going(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = create_log(path)
    reader = python_child(_READER, path)
    try:
        lines = LineReader(reader)
        assert lines.json() == {"opened": True, "status": "running"}
        reports_before_finish = []
        total_rows = 6
        for step in range(total_rows):
            runlog.search.append_metrics(search_row(step))
            if step % 2 == 1:
                runlog.search.append_epoch(softmax_rows(step), softmax_rows(step + 1), f"genotype-{step}")
            epochs = (step + 1) // 2
            reader.stdin.write(f"expect {step + 1} {epochs}\n")
            reader.stdin.flush()
            reports_before_finish.append(lines.json())

        runlog.search.finish("finished", reason="completed", final_genotype="genotype-5")
        reader.stdin.write("finished\n")
        reader.stdin.flush()
        after = lines.json()
        reader.wait(timeout=30)
    finally:
        end(reader)
    assert reader.returncode == 0, reader.stderr.read()

    # While the writer was still appending, the reader saw every row appear, one at a time.
    assert reports_before_finish[0]["rows"] == 1 > 0
    assert [report["rows"] for report in reports_before_finish] == list(range(1, total_rows + 1))
    assert reports_before_finish[-1]["steps"] == [float(step) for step in range(total_rows)]
    assert [report["epochs"] for report in reports_before_finish] == [0, 1, 1, 2, 2, 3]
    # After finish: all rows through the old handle, and the final status through a fresh open.
    assert after["rows"] == total_rows and after["final_rows"] == total_rows
    assert after["genotypes"] == ["genotype-1", "genotype-3", "genotype-5"]
    assert (after["status"], after["reason"]) == ("finished", "completed")


# ---------------------------------------------------------------------- failure, resume, truncation (either stage)


@pytest.mark.parametrize("stage", STAGES)
def test_a_refused_finish_leaves_the_stage_running(tmp_path: Path, stage: str) -> None:
    path = tmp_path / "search.h5"
    log = open_stage(path, stage, steps=1).stage(stage)
    for status in ("done", "running", "Finished"):
        with pytest.raises(ValueError, match="final status must be one of"):
            log.finish(status, reason="x")
    with pytest.raises(KeyError, match="unknown cost field"):
        log.finish("finished", reason="x", cost={"seconds": 1.0})
    log.append_metrics(metric_row(stage, 1))  # still running and writable
    assert record(read_run(path), stage)["status"] == "running"
    log.finish("interrupted", reason="SIGUSR1")
    stage_run = record(read_run(path), stage)
    assert (stage_run["status"], stage_run["reason"]) == ("interrupted", "SIGUSR1")
    assert stage_run["metrics"]["step"].tolist() == [0, 1]


@pytest.mark.parametrize("stage", STAGES)
def test_a_failed_stage_keeps_its_rows_and_the_first_outcome_wins(tmp_path: Path, stage: str) -> None:
    path = tmp_path / "search.h5"
    runlog = open_stage(path, stage, steps=4)
    log = runlog.stage(stage)
    first = cost(50.0, 4, 3, 0.04, 0.1)
    log.finish("failed", reason="RuntimeError: party 3 diverged", cost=first)
    failed = record(read_run(path), stage)
    assert (failed["status"], failed["stale"]) == ("failed", False)  # a recorded failure, not a dead writer
    assert failed["reason"] == "RuntimeError: party 3 diverged"
    assert failed["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert failed["cost"] == first

    # finish is idempotent: the first outcome wins, a later call changes nothing.
    log.finish("finished", reason="completed", cost=cost(1.0, 1, 1, 1.0, 1.0))
    after_second_finish = record(read_run(path), stage)
    assert after_second_finish["status"] == "failed"
    assert after_second_finish["reason"] == "RuntimeError: party 3 diverged"
    assert after_second_finish["cost"] == first
    with pytest.raises(RuntimeError, match="closed"):
        log.append_metrics(metric_row(stage, 4))
    runlog.close()
    runlog.close()


@pytest.mark.parametrize("stage", STAGES)
def test_a_resumed_stage_continues_its_rows_and_adds_up_cost(tmp_path: Path, stage: str) -> None:
    path = tmp_path / "search.h5"
    log = open_stage(path, stage, private=True, steps=3).stage(stage)
    log.append_privacy(3, np.full(PARTIES, 3), np.full(PARTIES, 0.3), np.full(PARTIES, 0.03))
    log.finish("interrupted", reason="SIGUSR1", cost=cost(10.0, 4, 0, 0.0, 0.5, rss_peak_mb_server=410.0,
                                                                  startup_seconds=7.0))

    resumed = reopen_log(path, stage)
    assert resumed.stage(stage).row_counts() == rows(stage, metrics=3, privacy=1)
    log = resume(resumed, stage, private=True)
    live = record(read_run(path), stage)
    assert (live["status"], live["reason"], live["attempts"]) == ("running", "", 2)
    for step in range(3, 5):
        log.append_metrics(metric_row(stage, step))
    log.append_privacy(5, np.full(PARTIES, 6), np.full(PARTIES, 0.5), np.full(PARTIES, 0.05))
    log.finish("finished", reason="completed", cost=cost(5.0, 4, 3, 0.004, 0.25, rss_peak_mb_server=380.0,
                                                                startup_seconds=4.0))

    stage_run = record(read_run(path), stage)
    assert stage_run["status"] == "finished"
    assert stage_run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert stage_run["metrics"]["train_loss"].tolist() == pytest.approx([2.0, 1.9, 1.8, 1.7, 1.6])
    assert stage_run["privacy"]["steps"].tolist() == [3, 5]
    assert stage_run["privacy"]["charged_steps"].tolist() == [[3, 3, 3], [6, 6, 6]]  # 5 steps + 1 replayed
    # wall_seconds, gpu_hours and cpu_core_hours add up over the attempts; ranks and gpus are the latest attempt's;
    # rank 0's peak memory is the largest of the attempts', the start-up time the latest's
    assert stage_run["cost"] == pytest.approx(cost(15.0, 4, 3, 0.004, 0.75, rss_peak_mb_server=410.0,
                                                   startup_seconds=4.0))


def test_the_iteration_split_stays_unknown_in_an_older_log_and_a_nan_attempt_keeps_its_total(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    log = open_stage(path, "search", steps=1).stage("search")
    log.finish("interrupted", reason="SIGUSR1", cost=cost(10.0, 4, 0, 0.0, 0.5))
    with h5py.File(path, "r+") as f:  # as a log written before the split was: no such attribute
        del f["cost"].attrs["transfer_seconds"]
    log = resume(reopen_log(path, "search"), "search")
    log.finish("finished", reason="completed", cost=cost(5.0, 4, 0, 0.0, 0.25) | {"party_compute_seconds": np.nan})
    total = read_run(path)["cost"]
    assert np.isnan(total["transfer_seconds"])  # its first attempt is unknown: no total would be true
    assert total["party_compute_seconds"] == pytest.approx(6.0)  # the first attempt's; NaN added nothing
    assert total["server_seconds"] == pytest.approx(0.75) and total["wall_seconds"] == pytest.approx(15.0)


def test_reopen_replaces_the_rank_attrs(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = create_log(path, rank_attrs={"devices": ["cpu", "cpu", "cpu", "cpu"]})
    runlog.search.finish("interrupted", reason="SIGUSR1")
    resumed = RunLog.reopen(path, rank_attrs={"devices": ["cpu", "cuda:0", "cuda:0", "cuda:1"]})
    assert read_run(path)["ranks"] == {"devices": ["cpu", "cuda:0", "cuda:0", "cuda:1"]}
    resumed.search.finish("finished", reason="completed")


@pytest.mark.parametrize("stage", STAGES)
def test_a_row_caught_mid_append_is_hidden_and_trimmed_on_reopen(tmp_path: Path, stage: str) -> None:
    path, prefix, names = tmp_path / "search.h5", PREFIX[stage], METRIC_NAMES[stage]
    log = open_stage(path, stage, private=True, steps=2).stage(stage)
    log.append_privacy(2, np.zeros(PARTIES, np.int64), np.full(PARTIES, 0.7), np.zeros(PARTIES))
    log.finish("interrupted", reason="SIGUSR1")
    # What a crash between two datasets of one append leaves behind: one column of each family a row longer.
    with h5py.File(path, "r+", libver="latest") as f:
        f[f"{prefix}metrics/step"].resize((3,))
        f[f"{prefix}metrics/step"][2] = 2
        f[f"{prefix}privacy/steps"].resize((2,))
        f[f"{prefix}privacy/steps"][1] = 3
    hidden = record(read_run(path), stage)
    assert {name: len(values) for name, values in hidden["metrics"].items()} == dict.fromkeys(names, 2)
    assert hidden["metrics"]["step"].tolist() == [0.0, 1.0] and hidden["privacy"]["steps"].tolist() == [2]

    resumed = reopen_log(path, stage)
    assert resumed.stage(stage).row_counts() == rows(stage, metrics=2, privacy=1)
    # The file itself is consistent again, also for plain h5py readers that do not use read_run.
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        assert {f[f"{prefix}metrics"][name].shape for name in names} == {(2,)}
        assert f[f"{prefix}privacy/steps"].shape == (1,)
    log = resume(resumed, stage, private=True)
    log.append_metrics(metric_row(stage, 7))
    log.append_privacy(9, np.zeros(PARTIES, np.int64), np.full(PARTIES, 0.9), np.zeros(PARTIES))
    log.finish("finished", reason="completed")
    with h5py.File(path, "r") as f:
        assert {f[f"{prefix}metrics"][name].shape for name in names} == {(3,)}
        assert f[f"{prefix}metrics/step"][:].tolist() == [0.0, 1.0, 7.0]
    stage_run = record(read_run(path), stage)
    assert stage_run["metrics"]["step"].tolist() == [0, 1, 7] and stage_run["privacy"]["steps"].tolist() == [2, 9]


@pytest.mark.parametrize("stage", STAGES)
def test_truncate_drops_rows_after_the_checkpoint(tmp_path: Path, stage: str) -> None:
    path = tmp_path / "search.h5"
    log = open_stage(path, stage, private=True, steps=5).stage(stage)
    for row in range(4):
        log.append_privacy(
            row + 1, np.full(PARTIES, row + 1), np.full(PARTIES, 0.1 * row), np.full(PARTIES, 0.01 * row)
        )
    written, checkpoint = rows(stage, metrics=5, privacy=4), rows(stage, metrics=3, privacy=2)

    with pytest.raises(ValueError, match="metrics=6"):
        log.truncate(*rows(stage, metrics=6, privacy=2))
    with pytest.raises(ValueError, match="privacy=-1"):
        log.truncate(*rows(stage, metrics=3, privacy=-1))
    with pytest.raises(ValueError, match=f"truncate takes at most {len(written)} counts"):
        log.truncate(*checkpoint, 0)
    assert log.row_counts() == written  # a rejected truncate changes nothing

    log.truncate(*checkpoint)
    assert log.row_counts() == checkpoint
    log.append_metrics(metric_row(stage, 30))
    log.append_privacy(9, np.full(PARTIES, 9), np.full(PARTIES, 0.9), np.full(PARTIES, 0.09))
    log.finish("finished", reason="completed")

    stage_run = record(read_run(path), stage)
    assert stage_run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 30.0]
    assert all(values.shape == (4,) for values in stage_run["metrics"].values())
    assert stage_run["privacy"]["steps"].tolist() == [1, 2, 9]
    assert stage_run["privacy"]["charged_steps"][:, 0].tolist() == [1, 2, 9]
    np.testing.assert_allclose(stage_run["privacy"]["epsilon"][:, 0], [0.0, 0.1, 0.9])


# ---------------------------------------------------------------------- a writer that dies says so


def _assert_the_killed_writers_rows(run: dict, stage: str) -> None:
    """Every row the writer of ``start_writer`` logged in `stage`; for the augment stage also the search's outcome,
    which that writer recorded before it began the augment and which its death leaves as it was."""
    stage_run = record(run, stage)
    assert stage_run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert stage_run["metrics"]["train_loss"].tolist() == pytest.approx([2.0, 1.9, 1.8, 1.7, 1.6])
    assert stage_run["privacy"]["steps"].tolist() == [2, 4]
    assert stage_run["privacy"]["charged_steps"].tolist() == [[2, 3, 4], [4, 5, 6]]
    if stage == "search":
        assert run["last_step"] == 4
        assert run["genotypes"] == ["g1", "g3"] and run["alphas"]["normal"].shape == (2, EDGES, OPS)
    else:
        assert (run["status"], run["reason"], run["stale"]) == ("finished", "completed", False)


@pytest.mark.parametrize("stage", STAGES)
def test_a_killed_writer_is_reported_failed_with_every_row(tmp_path: Path, stage: str) -> None:
    path = tmp_path / "search.h5"
    process, pid = start_writer(path, stage)
    try:
        live = read_run(path)
        # A live writer on this machine is never failed, however old its heartbeat (stale_after=0).
        silent = read_run(path, stale_after=0.0)
        sigkill(process, pid, reap=False)
        zombie = read_run(path)
        process.wait(timeout=30)
        dead = read_run(path)
    finally:
        end(process)

    live_stage = record(live, stage)
    assert (live_stage["status"], live_stage["reason"], live_stage["stale"]) == ("running", "", False)
    assert live["writer"]["pid"] == pid and live["writer"]["host"] == socket.gethostname()
    assert (record(silent, stage)["status"], record(silent, stage)["stale"]) == ("running", False)
    for run in (live, silent, zombie, dead):
        _assert_the_killed_writers_rows(run, stage)
    for run in (zombie, dead):
        assert (record(run, stage)["status"], record(run, stage)["stale"]) == ("failed", True)
        assert record(run, stage)["reason"] == (
            f"writer died: process {pid} on {socket.gethostname()} is gone; last logged {STEP_NOUN[stage]} 4"
        )


@pytest.mark.parametrize("stage", STAGES)
def test_without_a_pid_check_the_heartbeat_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    """A reader on another machine (simulated: no machine scope) can only judge the heartbeat's age."""
    path = tmp_path / "search.h5"
    process, pid = start_writer(path, stage)
    sigkill(process, pid, reap=True)
    monkeypatch.setattr(liveness, "machine_scope", lambda: "")
    recent = record(read_run(path, stale_after=3600.0), stage)
    assert (recent["status"], recent["stale"]) == ("running", False)  # silent for < 1 h: may be alive
    stale = read_run(path, stale_after=0.0)
    stale_stage = record(stale, stage)
    assert (stale_stage["status"], stale_stage["stale"]) == ("failed", True)
    assert stale_stage["reason"].startswith(f"writer stopped heartbeating: process {pid} on {socket.gethostname()}")
    assert stale_stage["reason"].endswith(f"(stale after 0 s); last logged {STEP_NOUN[stage]} 4")
    _assert_the_killed_writers_rows(stale, stage)


@pytest.mark.parametrize("stage", STAGES)
def test_reopen_refuses_a_live_writer_and_salvages_a_killed_one(tmp_path: Path, stage: str) -> None:
    path = tmp_path / "search.h5"
    process, pid = start_writer(path, stage)
    try:
        with pytest.raises(RuntimeError, match=f"still being written by process {pid}"):
            reopen_log(path, stage)
        sigkill(process, pid, reap=True)
    finally:
        end(process)
    killed_writer = read_run(path)["writer"]

    resumed = reopen_log(path, stage)  # salvages the file the killed writer left open
    assert resumed.stage(stage).row_counts() == KILLED_WRITER_ROWS[stage]
    log = resume(resumed, stage, private=True)
    live = read_run(path)
    live_stage = record(live, stage)
    assert (live_stage["status"], live_stage["stale"], live_stage["attempts"]) == ("running", False, 2)
    assert live["writer"]["pid"] == os.getpid() != killed_writer["pid"]  # owner reset
    assert live["writer"]["started"] >= killed_writer["started"]
    assert live["writer"]["heartbeat"] >= killed_writer["heartbeat"]
    log.append_metrics(metric_row(stage, 5))
    log.append_privacy(6, np.array([6, 7, 8]), np.full(PARTIES, 0.6), np.full(PARTIES, 0.01))
    log.finish("finished", reason="completed")
    run = read_run(path)
    stage_run = record(run, stage)
    assert (stage_run["status"], stage_run["stale"], stage_run["attempts"]) == ("finished", False, 2)
    assert stage_run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert stage_run["privacy"]["charged_steps"].tolist() == [[2, 3, 4], [4, 5, 6], [6, 7, 8]]
    if stage == "search":
        assert run["last_step"] == 5
    else:  # the augment's attempts are its own: the search's record stays as the search finished it
        assert (run["status"], run["attempts"]) == ("finished", 1)
    assert sorted(os.listdir(tmp_path)) == ["search.h5"]  # the salvage copy replaced the original


def test_a_cut_log_is_refused_quickly_not_retried_for_minutes(tmp_path: Path) -> None:
    """A copy cut short (an interrupted transfer, a full disk): a SWMR open alone would retry its unreadable
    metadata for minutes. Both a finished log and a killed writer's are refused within the wait."""
    finished = tmp_path / "finished.h5"
    runlog = create_log(finished)
    for step in range(4):
        runlog.search.append_metrics(search_row(step))
    runlog.search.finish("finished", reason="completed")
    killed = tmp_path / "killed.h5"
    process, pid = start_writer(killed, "search")
    sigkill(process, pid, reap=True)
    for path in (finished, killed):
        data = path.read_bytes()
        cut = tmp_path / f"cut-{path.name}"
        cut.write_bytes(data[: len(data) // 3])
        start = time.monotonic()
        with pytest.raises(OSError, match="truncated HDF5 file"):
            read_run(cut, wait_seconds=0.5)
        assert time.monotonic() - start < 30, path.name  # seconds, where the SWMR retries alone took minutes
        assert read_run(path)["metrics"]["step"].tolist()[:4] == [0.0, 1.0, 2.0, 3.0]  # the whole file still reads


def test_a_read_that_fails_half_way_is_retried_within_the_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SWMR reader can meet metadata a live writer is still extending (seen in CI while --follow watched a run:
    "address of object past end of allocation"): read_run reads again, and raises only once its wait is over."""
    path = tmp_path / "search.h5"
    runlog = create_log(path)
    runlog.search.append_metrics(search_row(0))
    runlog.search.finish("finished", reason="completed")
    real, failures = reader_module.stage_families, []

    def flaky(handle, layout):
        if len(failures) < 2:
            failures.append(1)
            raise OSError("Can't synchronously read data (address of object past end of allocation)")
        return real(handle, layout)

    monkeypatch.setattr(reader_module, "stage_families", flaky)
    assert read_run(path)["metrics"]["step"].tolist() == [0.0] and len(failures) == 2
    failures.clear()
    monkeypatch.setattr(reader_module, "stage_families",
                        lambda handle, layout: (_ for _ in ()).throw(OSError("broken")))
    start = time.monotonic()
    with pytest.raises(OSError, match="broken"):
        read_run(path, wait_seconds=0.3)
    assert time.monotonic() - start >= 0.3


def test_plain_h5py_opens_a_dead_writers_log_only_with_swmr(tmp_path: Path) -> None:
    """Pins the recipe of docs/hdf5.md ("Reading a run whose writer died") on this machine's HDF5."""
    path = tmp_path / "search.h5"
    process, pid = start_writer(path, "search")
    sigkill(process, pid, reap=True)
    for options in ({}, {"locking": False}, {"libver": "latest"}):
        with pytest.raises(OSError, match="already open for write"):
            h5py.File(path, "r", **options)
    with h5py.File(path, "r", swmr=True) as f:
        assert f.attrs["status"] == "running"  # what the file itself says; read_run judges the writer
        assert f["metrics/step"][:].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert f["writer/pid"][()] == pid


class _FakeClock:
    """Stands in for the ``time`` module inside the writer so the throttle can be tested without sleeping."""

    def __init__(self) -> None:
        self.now = 2_000_000_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def test_heartbeat_is_throttled_and_appends_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _FakeClock()
    monkeypatch.setattr(writer, "time", clock)
    path = tmp_path / "search.h5"
    runlog = create_log(path)
    created = read_run(path)["writer"]["heartbeat"]  # real wall time, written by create

    clock.now += HEARTBEAT_SECONDS / 2
    runlog.heartbeat()
    assert read_run(path)["writer"]["heartbeat"] == created  # too soon: not written
    clock.now += HEARTBEAT_SECONDS / 2
    runlog.heartbeat()
    assert read_run(path)["writer"]["heartbeat"] == clock.now
    clock.now += HEARTBEAT_SECONDS
    runlog.search.append_metrics(search_row(0))
    assert read_run(path)["writer"]["heartbeat"] == clock.now
    runlog.search.finish("finished", reason="completed")


def test_the_dead_writer_rule() -> None:
    here = liveness.current_writer()
    now = here.heartbeat
    ancient = liveness.WriterRecord(here.host, here.pid, here.process, now - 1e6, now - 1e6)
    assert liveness.writer_gone_reason(ancient, now=now, stale_after=1.0) is None  # alive here: PID decides

    scope, start_tick = here.process.rsplit("/", 1)
    reused = liveness.WriterRecord(here.host, here.pid, f"{scope}/{int(start_tick) + 1}", now, now)
    assert liveness.writer_gone_reason(reused, now=now, stale_after=1e9) == (
        f"writer died: process {here.pid} on {here.host} is gone"
    )  # our PID, but not the process that took the file

    for process in ("", "another-boot/pid:[1]/42"):  # no /proc there, or another machine or container
        remote = liveness.WriterRecord("node-7", 123, process, now - 300, now - 300)
        assert liveness.writer_gone_reason(remote, now=now, stale_after=301) is None
        assert liveness.writer_gone_reason(remote, now=now, stale_after=120) == (
            "writer stopped heartbeating: process 123 on node-7 last heartbeat 300 s ago (stale after 120 s)"
        )
