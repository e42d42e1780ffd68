"""Tests of the HDF5 run log (mpi_fnas.runlog): schema, SWMR live reading, failure, resume, truncation, and the
liveness record that turns a killed writer's ``running`` into ``failed``."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpi_fnas
from mpi_fnas.privacy.release import Release
from mpi_fnas.runlog import (
    HEARTBEAT_SECONDS,
    RELEASE_FIELDS,
    SEARCH_METRICS,
    RunLog,
    StagePrivacy,
    liveness,
    read_run,
    writer,
)
from mpi_fnas.runlog import reader as reader_module

EDGES, OPS = 14, 8
PARTIES = 3
METRICS = SEARCH_METRICS
REPO_ROOT = Path(__file__).resolve().parents[1]


def _privacy(parties: int = PARTIES) -> StagePrivacy:
    """The search's releases: W with σ 1.0 and clip 0.01, A with a σ per party and clip 0.1."""
    return StagePrivacy(
        delta=[1e-5] * parties,
        releases={"W": Release(noise_multiplier=1.0, clip=0.01, expected_batch_size=16.0),
                  "A": Release(noise_multiplier=np.linspace(1.0, 1.5, parties), clip=0.1, expected_batch_size=16.0)},
        sample_rates={"W": np.linspace(0.01, 0.03, parties), "A": np.linspace(0.02, 0.04, parties)},
        accountant="pld",
    )


def _create(path: Path, *, mode: str = "fnas", genotype_length: int = 64, **overrides) -> RunLog:
    arguments = dict(
        mode=mode,
        parties=PARTIES,
        config_text="search:\n  epochs: 2\n",
        metric_names=METRICS,
        alpha_shape=(EDGES, OPS),
        genotype_length=genotype_length,
        privacy_guarantee="holds" if mode == "dpfnas" else f"none: mode {mode} makes no privacy claim",
        privacy=_privacy() if mode == "dpfnas" else None,
    )
    arguments.update(overrides)
    return RunLog.create(path, **arguments)


def _softmax_rows(seed: int) -> np.ndarray:
    """(EDGES, OPS) float32 weights that are a distribution per edge, distinct per seed."""
    logits = np.random.default_rng(seed).normal(size=(EDGES, OPS))
    weights = np.exp(logits)
    return (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)


def _metric_row(step: int) -> dict[str, float]:
    return {"step": step, "epoch": step // 2, "train_loss": 2.0 - 0.1 * step, "val_acc": 0.1 * step}


# ---------------------------------------------------------------------- schema


def test_schema_names_shapes_and_dtypes(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path, mode="dpfnas", rank_attrs={"devices": ["cpu", "cuda:0", "cuda:1", "cuda:0"]})
    for step in range(3):
        runlog.search.append_metrics(_metric_row(step))
    runlog.search.append_epoch(_softmax_rows(0), _softmax_rows(1), "normal=[sep_conv_3x3]")
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
        assert list(f["metrics"]) == list(METRICS)  # caller's column order survives
        for name in METRICS:
            dataset = f["metrics"][name]
            assert dataset.dtype == np.float64 and dataset.shape == (3,), name
            assert dataset.maxshape == (None,) and dataset.chunks is not None, name
        np.testing.assert_array_equal(f["metrics/step"][:], [0.0, 1.0, 2.0])

        assert set(f["alphas"]) == {"normal", "reduce"}
        for cell, seed in (("normal", 0), ("reduce", 1)):
            dataset = f["alphas"][cell]
            assert dataset.dtype == np.float32 and dataset.shape == (1, EDGES, OPS)
            assert dataset.maxshape == (None, EDGES, OPS) and dataset.chunks is not None
            np.testing.assert_array_equal(dataset[0], _softmax_rows(seed))

        genotype = f["genotype"]
        assert genotype.dtype == np.dtype("S64") and genotype.maxshape == (None,)
        assert genotype[0] == b"normal=[sep_conv_3x3]"

        cost = f["cost"].attrs
        assert set(cost) == {"wall_seconds", "ranks", "gpus", "gpu_hours", "cpu_core_hours"}
        assert (cost["wall_seconds"], cost["ranks"], cost["gpus"]) == (12.5, 4, 3)
        assert cost.get_id("ranks").dtype.kind == "i" and cost.get_id("wall_seconds").dtype == np.float64

        privacy = f["privacy"]
        assert set(privacy.attrs) == {"delta", "accountant"}
        assert privacy.attrs["delta"].shape == (PARTIES,) and privacy.attrs["accountant"] == "pld"
        # each release's RELEASE_FIELDS (noise_multiplier, clip, …) as <field>_w and <field>_a, each float64
        released = {field + suffix for field in RELEASE_FIELDS for suffix in ("_w", "_a")}
        assert {"noise_multiplier_w", "noise_multiplier_a", "clip_w", "clip_a"} <= released
        assert set(privacy) == {"epsilon", "mu_gdp", "steps", "charged_steps", "sample_rate_train",
                                "sample_rate_val", *released}
        for name in released:
            assert privacy[name].dtype == np.float64 and privacy[name].shape in ((), (PARTIES,)), name
        for name in ("epsilon", "mu_gdp"):
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


def test_privacy_group_only_when_requested(tmp_path: Path) -> None:
    runlog = _create(tmp_path / "fnas.h5", mode="fnas")
    with pytest.raises(RuntimeError, match="has no privacy ledger"):
        runlog.search.append_privacy(1, np.ones(PARTIES), np.zeros(PARTIES), np.zeros(PARTIES))
    runlog.search.finish("finished", reason="completed")
    fnas = read_run(tmp_path / "fnas.h5")
    assert fnas["privacy"] is None and fnas["privacy_guarantee"] == "none: mode fnas makes no privacy claim"
    with h5py.File(tmp_path / "fnas.h5", "r") as f:
        assert "privacy" not in f

    # A DP run without a ledger, or a ledger on a non-DP run, is a configuration mistake.
    with pytest.raises(ValueError, match="privacy schema is required"):
        _create(tmp_path / "dp_without.h5", mode="dpfnas", privacy=None)
    with pytest.raises(ValueError, match="privacy schema is required"):
        _create(tmp_path / "fnas_with.h5", mode="fnas", privacy=_privacy())
    with pytest.raises(ValueError, match=r"delta must have shape \(3,\)"):
        _create(tmp_path / "bad_delta.h5", mode="dpfnas", privacy=_privacy(parties=2))

    dp = _create(tmp_path / "dp.h5", mode="dpfnas")
    with pytest.raises(ValueError, match=r"epsilon must have shape \(3,\)"):
        dp.search.append_privacy(1, np.ones(PARTIES), np.zeros(PARTIES + 1), np.zeros(PARTIES))
    with pytest.raises(ValueError, match=r"charged_steps must have shape \(3,\)"):
        dp.search.append_privacy(1, 1, np.zeros(PARTIES), np.zeros(PARTIES))  # a scalar would be broadcast silently
    dp.search.append_privacy(1, np.ones(PARTIES), np.full(PARTIES, np.inf), np.zeros(PARTIES))  # ε = inf is legitimate
    dp.search.finish("finished", reason="completed")
    dp_privacy = read_run(tmp_path / "dp.h5")["privacy"]
    assert dp_privacy["epsilon"].shape == (1, PARTIES) and dp_privacy["charged_steps"].tolist() == [[1, 1, 1]]


def test_status_and_mode_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        _create(tmp_path / "bad_mode.h5", mode="dp")
    assert not (tmp_path / "bad_mode.h5").exists()

    path = tmp_path / "search.h5"
    runlog = _create(path)
    runlog.search.append_metrics(_metric_row(0))
    for status in ("done", "running", "Finished"):
        with pytest.raises(ValueError, match="final status must be one of"):
            runlog.search.finish(status, reason="x")
    # A rejected finish leaves the log open and running.
    runlog.search.append_metrics(_metric_row(1))
    assert read_run(path)["status"] == "running"
    runlog.search.finish("interrupted", reason="SIGUSR1")
    assert read_run(path)["status"] == "interrupted"


def test_create_never_overwrites_an_existing_log(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    first = _create(path)
    first.search.append_metrics(_metric_row(0))
    first.search.finish("finished", reason="completed")
    with pytest.raises(FileExistsError):
        _create(path)
    assert read_run(path)["metrics"]["step"].tolist() == [0.0]


# ---------------------------------------------------------------------- appending


def test_missing_metrics_are_nan_and_unknown_names_write_nothing(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path)
    runlog.search.append_metrics({"step": 0, "train_loss": 1.5})
    with pytest.raises(KeyError, match="train_los"):
        runlog.search.append_metrics({"step": 1, "train_los": 1.0})
    assert runlog.search.row_counts()[0] == 1  # metrics
    runlog.search.finish("finished", reason="completed")
    run = read_run(path)
    assert {name: values.shape for name, values in run["metrics"].items()} == {name: (1,) for name in METRICS}
    assert run["metrics"]["train_loss"][0] == 1.5
    assert np.isnan(run["metrics"]["val_acc"][0]) and np.isnan(run["metrics"]["test_acc"][0])


def test_genotype_too_long_raises_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path, genotype_length=8)
    alphas = _softmax_rows(0)
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


def test_alphas_must_be_softmax_weights_of_the_declared_shape(tmp_path: Path) -> None:
    runlog = _create(tmp_path / "search.h5")
    raw_alphas = 1e-3 * np.random.default_rng(0).random(size=(EDGES, OPS))  # DARTS init scale, not softmax
    with pytest.raises(ValueError, match="sum to 1"):
        runlog.search.append_epoch(raw_alphas, _softmax_rows(1), "g")
    with pytest.raises(ValueError, match="shape"):
        runlog.search.append_epoch(_softmax_rows(0)[:, :7], _softmax_rows(1), "g")
    assert runlog.search.row_counts()[1] == 0  # epochs
    runlog.search.finish("failed", reason="test")


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


class _LineReader:
    """Reads a child's stdout lines on a thread so the test can wait with a timeout instead of hanging."""

    def __init__(self, process: subprocess.Popen) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(process,), daemon=True)
        self._thread.start()

    def _pump(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self._lines.put(line)

    def json(self, timeout: float = 30.0) -> dict:
        return json.loads(self._lines.get(timeout=timeout))


def _python_child(script: str, path: Path) -> subprocess.Popen:
    """A python subprocess running `script` on the log at `path`, talking over pipes."""
    return subprocess.Popen([sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)


def test_concurrent_swmr_reader_sees_rows_while_the_run_is_going(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path)
    reader = _python_child(_READER, path)
    try:
        lines = _LineReader(reader)
        assert lines.json() == {"opened": True, "status": "running"}
        reports_before_finish = []
        total_rows = 6
        for step in range(total_rows):
            runlog.search.append_metrics(_metric_row(step))
            if step % 2 == 1:
                runlog.search.append_epoch(_softmax_rows(step), _softmax_rows(step + 1), f"genotype-{step}")
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
        if reader.poll() is None:
            reader.kill()
            reader.wait()
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


# ---------------------------------------------------------------------- failure, resume, truncation


def test_failure_keeps_rows_and_sets_status(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path)
    for step in range(4):
        runlog.search.append_metrics(_metric_row(step))
    runlog.search.append_epoch(_softmax_rows(0), _softmax_rows(1), "partial")
    runlog.search.finish("failed", reason="RuntimeError: party 3 diverged")
    run = read_run(path)
    assert (run["status"], run["stale"]) == ("failed", False)  # a recorded failure, not a dead writer
    assert run["reason"] == "RuntimeError: party 3 diverged"
    assert run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert run["genotypes"] == ["partial"]

    # finish is idempotent: the first outcome wins, a later call changes nothing.
    runlog.search.finish("finished", reason="completed")
    after_second_finish = read_run(path)
    assert after_second_finish["status"] == "failed"
    assert after_second_finish["reason"] == "RuntimeError: party 3 diverged"


def test_reopen_continues_rows_and_adds_up_cost(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path, mode="dpfnas", rank_attrs={"devices": ["cpu", "cpu", "cpu", "cpu"]})
    for step in range(3):
        runlog.search.append_metrics(_metric_row(step))
    runlog.search.append_privacy(3, np.full(PARTIES, 3), np.full(PARTIES, 0.3), np.full(PARTIES, 0.03))
    runlog.search.finish(
        "interrupted",
        reason="SIGUSR1",
        cost={"wall_seconds": 10.0, "ranks": 4, "gpus": 0, "gpu_hours": 0.0, "cpu_core_hours": 0.5},
    )

    resumed = RunLog.reopen(path, rank_attrs={"devices": ["cpu", "cuda:0", "cuda:0", "cuda:1"]})
    assert resumed.search.row_counts() == (3, 0, 1, 0)
    live = read_run(path)
    assert (live["status"], live["reason"], live["attempts"]) == ("running", "", 2)
    assert live["ranks"] == {"devices": ["cpu", "cuda:0", "cuda:0", "cuda:1"]}
    for step in range(3, 5):
        resumed.search.append_metrics(_metric_row(step))
    resumed.search.append_privacy(5, np.full(PARTIES, 6), np.full(PARTIES, 0.5), np.full(PARTIES, 0.05))
    resumed.search.finish(
        "finished",
        reason="completed",
        cost={"wall_seconds": 5.0, "ranks": 4, "gpus": 3, "gpu_hours": 0.004, "cpu_core_hours": 0.25},
    )

    run = read_run(path)
    assert run["status"] == "finished"
    assert run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert run["metrics"]["train_loss"].tolist() == pytest.approx([2.0, 1.9, 1.8, 1.7, 1.6])
    assert run["privacy"]["steps"].tolist() == [3, 5]
    assert run["privacy"]["charged_steps"].tolist() == [[3, 3, 3], [6, 6, 6]]  # 5 steps + 1 replayed
    assert run["cost"]["wall_seconds"] == pytest.approx(15.0)
    assert run["cost"]["cpu_core_hours"] == pytest.approx(0.75)
    assert run["cost"]["gpu_hours"] == pytest.approx(0.004)
    assert (run["cost"]["ranks"], run["cost"]["gpus"]) == (4, 3)  # layout of the latest attempt


def test_a_row_caught_mid_append_is_hidden_and_trimmed_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path)
    for step in range(2):
        runlog.search.append_metrics(_metric_row(step))
    runlog.search.finish("interrupted", reason="SIGUSR1")
    # What a crash between two datasets of one append leaves behind: one column a row longer.
    with h5py.File(path, "r+", libver="latest") as f:
        f["metrics/step"].resize((3,))
        f["metrics/step"][2] = 2.0
    assert read_run(path)["metrics"]["step"].tolist() == [0.0, 1.0]

    resumed = RunLog.reopen(path)
    assert resumed.search.row_counts()[0] == 2  # metrics
    # The file itself is consistent again, also for plain h5py readers that do not use read_run.
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        assert {f["metrics"][name].shape for name in METRICS} == {(2,)}
    resumed.search.append_metrics(_metric_row(7))
    resumed.search.finish("finished", reason="completed")
    with h5py.File(path, "r") as f:
        assert {f["metrics"][name].shape for name in METRICS} == {(3,)}
        assert f["metrics/step"][:].tolist() == [0.0, 1.0, 7.0]


def test_truncate_drops_rows_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path, mode="dpfnas")
    for step in range(5):
        runlog.search.append_metrics(_metric_row(step))
    for epoch in range(3):
        runlog.search.append_epoch(_softmax_rows(epoch), _softmax_rows(epoch + 10), f"g{epoch}")
    for row in range(4):
        runlog.search.append_privacy(
            row + 1, np.full(PARTIES, row + 1), np.full(PARTIES, 0.1 * row), np.full(PARTIES, 0.01 * row)
        )
    checkpoint = (3, 1, 2, 0)

    with pytest.raises(ValueError, match="metrics=6"):
        runlog.search.truncate(6, 1, 2)
    with pytest.raises(ValueError, match="privacy=-1"):
        runlog.search.truncate(3, 1, -1)
    assert runlog.search.row_counts() == (5, 3, 4, 0)  # a rejected truncate changes nothing

    runlog.search.truncate(*checkpoint)
    assert runlog.search.row_counts() == checkpoint
    runlog.search.append_metrics(_metric_row(30))
    runlog.search.append_epoch(_softmax_rows(7), _softmax_rows(8), "g-new")
    runlog.search.append_privacy(9, np.full(PARTIES, 9), np.full(PARTIES, 0.9), np.full(PARTIES, 0.09))
    runlog.search.finish("finished", reason="completed")

    run = read_run(path)
    assert run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 30.0]
    assert all(values.shape == (4,) for values in run["metrics"].values())
    assert run["genotypes"] == ["g0", "g-new"]
    np.testing.assert_array_equal(run["alphas"]["normal"][1], _softmax_rows(7))
    assert run["privacy"]["steps"].tolist() == [1, 2, 9]
    assert run["privacy"]["charged_steps"][:, 0].tolist() == [1, 2, 9]
    np.testing.assert_allclose(run["privacy"]["epsilon"][:, 0], [0.0, 0.1, 0.9])


# ---------------------------------------------------------------------- a writer that dies says so

# A real writer process: logs 5 metric rows, 2 epochs and 2 ledger rows, heartbeats, reports its PID, then
# waits (alive) until the test kills it.
_WRITER = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from mpi_fnas.runlog import SEARCH_METRICS, RunLog, StagePrivacy
    from mpi_fnas.privacy.release import Release

    release = Release(noise_multiplier=1.0, clip=0.1, expected_batch_size=8.0)
    privacy = StagePrivacy(delta=[1e-5, 1e-5], releases={"W": release, "A": release},
                           sample_rates={"W": [0.1, 0.1], "A": [0.1, 0.1]}, accountant="pld")
    runlog = RunLog.create(sys.argv[1], mode="dpfnas", parties=2, config_text="x: 1",
                           metric_names=SEARCH_METRICS, alpha_shape=(2, 3), genotype_length=16,
                           privacy_guarantee="holds", privacy=privacy)
    for step in range(5):
        runlog.search.append_metrics({"step": step, "train_loss": 1.0 / (step + 1)})
        runlog.heartbeat()
        if step % 2 == 1:
            runlog.search.append_epoch(np.full((2, 3), 1 / 3), np.full((2, 3), 1 / 3), f"g{step}")
            runlog.search.append_privacy(step + 1, np.array([step + 1, step + 2]), np.full(2, 0.1 * step),
                                         np.full(2, 0.01))
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.readline()  # alive until killed (or told to go)
    """
)


def _start_writer(path: Path) -> tuple[subprocess.Popen, int]:
    """A writer subprocess that has logged everything and is now idle; returns it and its PID."""
    process = _python_child(_WRITER, path)
    try:
        pid = _LineReader(process).json(timeout=60)["pid"]
    except BaseException:
        process.kill()
        process.wait()
        raise
    assert pid == process.pid
    return process, pid


def _sigkill(process: subprocess.Popen, pid: int, *, reap: bool) -> None:
    """SIGKILL the writer by PID, as mpirun does; without reap it is left a zombie (exited, not yet waited for)."""
    os.kill(pid, signal.SIGKILL)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # wait for the death, but keep the zombie
    if reap:
        process.wait(timeout=30)


def _assert_every_row_of_the_killed_writer(run: dict) -> None:
    assert run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert run["metrics"]["train_loss"].tolist() == pytest.approx([1.0, 1 / 2, 1 / 3, 1 / 4, 1 / 5])
    assert run["genotypes"] == ["g1", "g3"] and run["alphas"]["normal"].shape == (2, 2, 3)
    assert run["privacy"]["steps"].tolist() == [2, 4]
    assert run["privacy"]["charged_steps"].tolist() == [[2, 3], [4, 5]]


def test_a_killed_writer_is_reported_failed_with_every_row(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    process, pid = _start_writer(path)
    try:
        live = read_run(path)
        # A live writer on this machine is never failed, however old its heartbeat (stale_after=0).
        silent = read_run(path, stale_after=0.0)
        _sigkill(process, pid, reap=False)
        zombie = read_run(path)
        process.wait(timeout=30)
        dead = read_run(path)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    assert (live["status"], live["reason"], live["stale"]) == ("running", "", False)
    assert live["writer"]["pid"] == pid and live["writer"]["host"] == socket.gethostname()
    assert (silent["status"], silent["stale"]) == ("running", False)
    for run in (zombie, dead):
        assert (run["status"], run["stale"], run["last_step"]) == ("failed", True, 4)
        assert run["reason"] == f"writer died: process {pid} on {socket.gethostname()} is gone; last logged step 4"
        _assert_every_row_of_the_killed_writer(run)


def test_a_cut_log_is_refused_quickly_not_retried_for_minutes(tmp_path: Path) -> None:
    """A copy cut short (an interrupted transfer, a full disk): a SWMR open alone would retry its unreadable
    metadata for minutes. Both a finished log and a killed writer's are refused within the wait."""
    finished = tmp_path / "finished.h5"
    runlog = _create(finished)
    for step in range(4):
        runlog.search.append_metrics(_metric_row(step))
    runlog.search.finish("finished", reason="completed")
    killed = tmp_path / "killed.h5"
    process, pid = _start_writer(killed)
    _sigkill(process, pid, reap=True)
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
    runlog = _create(path)
    runlog.search.append_metrics(_metric_row(0))
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
    process, pid = _start_writer(path)
    _sigkill(process, pid, reap=True)
    for options in ({}, {"locking": False}, {"libver": "latest"}):
        with pytest.raises(OSError, match="already open for write"):
            h5py.File(path, "r", **options)
    with h5py.File(path, "r", swmr=True) as f:
        assert f.attrs["status"] == "running"  # what the file itself says; read_run judges the writer
        assert f["metrics/step"][:].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert f["writer/pid"][()] == pid


def test_without_a_pid_check_the_heartbeat_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader on another machine (simulated: no machine scope) can only judge the heartbeat's age."""
    path = tmp_path / "search.h5"
    process, pid = _start_writer(path)
    _sigkill(process, pid, reap=True)
    monkeypatch.setattr(liveness, "machine_scope", lambda: "")
    recent = read_run(path, stale_after=3600.0)
    assert (recent["status"], recent["stale"]) == ("running", False)  # silent for < 1 h: may be alive
    stale = read_run(path, stale_after=0.0)
    assert (stale["status"], stale["stale"]) == ("failed", True)
    assert stale["reason"].startswith(f"writer stopped heartbeating: process {pid} on {socket.gethostname()}")
    assert stale["reason"].endswith("(stale after 0 s); last logged step 4")
    _assert_every_row_of_the_killed_writer(stale)


def test_reopen_refuses_a_live_writer_and_salvages_a_killed_one(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    process, pid = _start_writer(path)
    try:
        with pytest.raises(RuntimeError, match=f"still being written by process {pid}"):
            RunLog.reopen(path)
        _sigkill(process, pid, reap=True)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    killed_writer = read_run(path)["writer"]

    resumed = RunLog.reopen(path)
    assert resumed.search.row_counts() == (5, 2, 2, 0)
    live = read_run(path)
    assert (live["status"], live["stale"], live["attempts"]) == ("running", False, 2)
    assert live["writer"]["pid"] == os.getpid() != killed_writer["pid"]  # owner reset
    assert live["writer"]["started"] >= killed_writer["started"]
    assert live["writer"]["heartbeat"] >= killed_writer["heartbeat"]
    resumed.search.append_metrics({"step": 5, "train_loss": 0.1})
    resumed.search.append_privacy(6, np.array([6, 7]), np.full(2, 0.6), np.full(2, 0.01))
    resumed.search.finish("finished", reason="completed")
    run = read_run(path)
    assert (run["status"], run["stale"], run["last_step"]) == ("finished", False, 5)
    assert run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert run["privacy"]["charged_steps"].tolist() == [[2, 3], [4, 5], [6, 7]]
    assert sorted(os.listdir(tmp_path)) == ["search.h5"]  # the salvage copy replaced the original


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
    runlog = _create(path)
    created = read_run(path)["writer"]["heartbeat"]  # real wall time, written by create

    clock.now += HEARTBEAT_SECONDS / 2
    runlog.heartbeat()
    assert read_run(path)["writer"]["heartbeat"] == created  # too soon: not written
    clock.now += HEARTBEAT_SECONDS / 2
    runlog.heartbeat()
    assert read_run(path)["writer"]["heartbeat"] == clock.now
    clock.now += HEARTBEAT_SECONDS
    runlog.search.append_metrics(_metric_row(0))
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
