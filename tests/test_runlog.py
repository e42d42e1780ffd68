"""Tests of the HDF5 run log (mpi_fnas.runlog): schema, SWMR live reading, failure, resume, truncation."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
from datetime import datetime
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpi_fnas
from mpi_fnas.runlog import REQUIRED_METRICS, PrivacySchema, RunLog, read_run

EDGES, OPS = 14, 8
PARTIES = 3
METRICS = (*REQUIRED_METRICS, "lr")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _privacy(parties: int = PARTIES) -> PrivacySchema:
    return PrivacySchema(
        delta=[1e-5] * parties,
        accountant="pld",
        sample_rate_train=np.linspace(0.01, 0.03, parties),
        sample_rate_val=np.linspace(0.02, 0.04, parties),
        noise_multiplier_w=1.0,
        noise_multiplier_a=np.linspace(1.0, 1.5, parties),
        clip_w=0.01,
        clip_a=0.1,
    )


def _create(path: Path, *, mode: str = "fnas", genotype_length: int = 64, **overrides) -> RunLog:
    arguments = dict(
        mode=mode,
        parties=PARTIES,
        config_text="search:\n  epochs: 2\n",
        metric_names=METRICS,
        alpha_shape=(EDGES, OPS),
        genotype_length=genotype_length,
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
    runlog = _create(path, mode="dpfnas", rank_attrs={"device": ["cpu", "cuda:0", "cuda:1", "cuda:0"]})
    for step in range(3):
        runlog.append_metrics(_metric_row(step))
    runlog.append_epoch(_softmax_rows(0), _softmax_rows(1), "normal=[sep_conv_3x3]")
    runlog.append_privacy(3, np.array([0.5, 0.6, 0.7]), np.array([0.05, 0.06, 0.07]))
    runlog.finish(
        "finished",
        reason="completed",
        final_genotype="normal=[sep_conv_3x3]",
        cost={"wall_seconds": 12.5, "ranks": 4, "gpus": 3, "gpu_hours": 0.01, "cpu_core_hours": 0.02},
    )

    with h5py.File(path, "r") as f:
        root = f.attrs
        assert set(root) == {
            "status", "mode", "parties", "config", "version", "final_genotype", "created", "reason",
            "attempts",
        }  # fmt: skip
        for name in ("status", "mode", "config", "version", "final_genotype", "created", "reason"):
            string_info = h5py.check_string_dtype(root.get_id(name).dtype)
            assert string_info is not None and string_info.encoding == "utf-8", name
        assert (root["status"], root["mode"], root["reason"]) == ("finished", "dpfnas", "completed")
        assert root.get_id("parties").dtype.kind == "i" and root["parties"] == PARTIES
        assert root["config"] == "search:\n  epochs: 2\n"
        assert root["version"] == mpi_fnas.__version__
        assert root["final_genotype"] == "normal=[sep_conv_3x3]"
        assert datetime.fromisoformat(root["created"]).tzinfo is not None

        assert set(f) == {"metrics", "alphas", "genotype", "cost", "privacy", "ranks"}
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
        assert set(privacy) == {
            "epsilon", "mu_gdp", "steps", "sample_rate_train", "sample_rate_val",
            "noise_multiplier_w", "noise_multiplier_a", "clip_w", "clip_a",
        }  # fmt: skip
        for name in ("epsilon", "mu_gdp"):
            assert privacy[name].shape == (1, PARTIES) and privacy[name].maxshape == (None, PARTIES)
            assert privacy[name].dtype == np.float64
        assert privacy["steps"].shape == (1,) and privacy["steps"].maxshape == (None,)
        assert privacy["steps"].dtype.kind == "i" and privacy["steps"][0] == 3
        np.testing.assert_array_equal(privacy["epsilon"][0], [0.5, 0.6, 0.7])
        assert privacy["sample_rate_train"].shape == (PARTIES,) == privacy["sample_rate_val"].shape
        assert privacy["noise_multiplier_w"].shape == () and privacy["noise_multiplier_a"].shape == (PARTIES,)
        assert privacy["clip_w"][()] == 0.01 and privacy["clip_a"][()] == 0.1

        devices = f["ranks"].attrs["device"]
        assert [str(device) for device in devices] == ["cpu", "cuda:0", "cuda:1", "cuda:0"]


def test_privacy_group_only_when_requested(tmp_path: Path) -> None:
    runlog = _create(tmp_path / "fnas.h5", mode="fnas")
    with pytest.raises(RuntimeError, match="without a privacy schema"):
        runlog.append_privacy(1, np.zeros(PARTIES), np.zeros(PARTIES))
    runlog.finish("finished", reason="completed")
    assert read_run(tmp_path / "fnas.h5")["privacy"] is None
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
        dp.append_privacy(1, np.zeros(PARTIES + 1), np.zeros(PARTIES))
    dp.append_privacy(1, np.full(PARTIES, np.inf), np.zeros(PARTIES))  # ε = inf is a legitimate value
    dp.finish("finished", reason="completed")
    assert read_run(tmp_path / "dp.h5")["privacy"]["epsilon"].shape == (1, PARTIES)


def test_status_and_mode_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        _create(tmp_path / "bad_mode.h5", mode="dp")
    assert not (tmp_path / "bad_mode.h5").exists()
    with pytest.raises(ValueError, match="must include"):
        _create(tmp_path / "few_metrics.h5", metric_names=("step", "epoch"))

    path = tmp_path / "search.h5"
    runlog = _create(path)
    runlog.append_metrics(_metric_row(0))
    for status in ("done", "running", "Finished"):
        with pytest.raises(ValueError, match="final status must be one of"):
            runlog.finish(status, reason="x")
    # A rejected finish leaves the log open and running.
    runlog.append_metrics(_metric_row(1))
    assert read_run(path)["status"] == "running"
    runlog.finish("interrupted", reason="SIGUSR1")
    assert read_run(path)["status"] == "interrupted"


def test_create_never_overwrites_an_existing_log(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    first = _create(path)
    first.append_metrics(_metric_row(0))
    first.finish("finished", reason="completed")
    with pytest.raises(FileExistsError):
        _create(path)
    assert read_run(path)["metrics"]["step"].tolist() == [0.0]


# ---------------------------------------------------------------------- appending


def test_missing_metrics_are_nan_and_unknown_names_write_nothing(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path)
    runlog.append_metrics({"step": 0, "train_loss": 1.5})
    with pytest.raises(KeyError, match="train_los"):
        runlog.append_metrics({"step": 1, "train_los": 1.0})
    assert runlog.rows() == 1
    runlog.close()
    run = read_run(path)
    assert {name: values.shape for name, values in run["metrics"].items()} == {name: (1,) for name in METRICS}
    assert run["metrics"]["train_loss"][0] == 1.5
    assert np.isnan(run["metrics"]["val_acc"][0]) and np.isnan(run["metrics"]["lr"][0])


def test_genotype_too_long_raises_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path, genotype_length=8)
    alphas = _softmax_rows(0)
    runlog.append_epoch(alphas, alphas, "a" * 8)  # exactly the limit fits
    with pytest.raises(ValueError, match="9 bytes"):
        runlog.append_epoch(alphas, alphas, "a" * 9)
    with pytest.raises(ValueError, match="10 bytes"):
        runlog.append_epoch(alphas, alphas, "é" * 5)  # 5 characters, 10 bytes in UTF-8
    runlog.append_epoch(alphas, alphas, "é" * 4)
    runlog.finish("finished", reason="completed")
    run = read_run(path)
    assert run["genotypes"] == ["a" * 8, "é" * 4]
    assert run["alphas"]["normal"].shape == (2, EDGES, OPS)


def test_alphas_must_be_softmax_weights_of_the_declared_shape(tmp_path: Path) -> None:
    runlog = _create(tmp_path / "search.h5")
    raw_alphas = 1e-3 * np.random.default_rng(0).random(size=(EDGES, OPS))  # DARTS init scale, not softmax
    with pytest.raises(ValueError, match="sum to 1"):
        runlog.append_epoch(raw_alphas, _softmax_rows(1), "g")
    with pytest.raises(ValueError, match="shape"):
        runlog.append_epoch(_softmax_rows(0)[:, :7], _softmax_rows(1), "g")
    assert runlog.row_counts().epoch_rows == 0
    runlog.finish("failed", reason="test")


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


def test_concurrent_swmr_reader_sees_rows_while_the_run_is_going(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path)
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        lines = _LineReader(reader)
        assert lines.json() == {"opened": True, "status": "running"}
        reports_before_finish = []
        total_rows = 6
        for step in range(total_rows):
            runlog.append_metrics(_metric_row(step))
            if step % 2 == 1:
                runlog.append_epoch(_softmax_rows(step), _softmax_rows(step + 1), f"genotype-{step}")
            epochs = (step + 1) // 2
            reader.stdin.write(f"expect {step + 1} {epochs}\n")
            reader.stdin.flush()
            reports_before_finish.append(lines.json())

        runlog.finish("finished", reason="completed", final_genotype="genotype-5")
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
    with pytest.raises(RuntimeError, match="party 3 diverged"), _create(path) as runlog:
        for step in range(4):
            runlog.append_metrics(_metric_row(step))
        runlog.append_epoch(_softmax_rows(0), _softmax_rows(1), "partial")
        raise RuntimeError("party 3 diverged\nsecond line of detail")
    run = read_run(path)
    assert run["status"] == "failed"
    assert run["reason"] == "RuntimeError: party 3 diverged"
    assert run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert run["genotypes"] == ["partial"]

    # finish is idempotent: the first outcome wins, a later call changes nothing.
    runlog.finish("finished", reason="completed")
    after_second_finish = read_run(path)
    assert after_second_finish["status"] == "failed"
    assert after_second_finish["reason"] == "RuntimeError: party 3 diverged"


def test_reopen_continues_rows_and_adds_up_cost(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path, mode="dpfnas", rank_attrs={"device": ["cpu", "cpu", "cpu", "cpu"]})
    for step in range(3):
        runlog.append_metrics(_metric_row(step))
    runlog.append_privacy(3, np.full(PARTIES, 0.3), np.full(PARTIES, 0.03))
    runlog.finish(
        "interrupted",
        reason="SIGUSR1",
        cost={"wall_seconds": 10.0, "ranks": 4, "gpus": 0, "gpu_hours": 0.0, "cpu_core_hours": 0.5},
    )

    resumed = RunLog.reopen(path, rank_attrs={"device": ["cpu", "cuda:0", "cuda:0", "cuda:1"]})
    assert resumed.rows() == 3 and resumed.row_counts() == (3, 0, 1)
    live = read_run(path)
    assert (live["status"], live["reason"], live["attempts"]) == ("running", "", 2)
    assert live["ranks"]["device"] == ["cpu", "cuda:0", "cuda:0", "cuda:1"]
    for step in range(3, 5):
        resumed.append_metrics(_metric_row(step))
    resumed.append_privacy(5, np.full(PARTIES, 0.5), np.full(PARTIES, 0.05))
    resumed.finish(
        "finished",
        reason="completed",
        cost={"wall_seconds": 5.0, "ranks": 4, "gpus": 3, "gpu_hours": 0.004, "cpu_core_hours": 0.25},
    )

    run = read_run(path)
    assert run["status"] == "finished"
    assert run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert run["metrics"]["train_loss"].tolist() == pytest.approx([2.0, 1.9, 1.8, 1.7, 1.6])
    assert run["privacy"]["steps"].tolist() == [3, 5]
    assert run["cost"]["wall_seconds"] == pytest.approx(15.0)
    assert run["cost"]["cpu_core_hours"] == pytest.approx(0.75)
    assert run["cost"]["gpu_hours"] == pytest.approx(0.004)
    assert (run["cost"]["ranks"], run["cost"]["gpus"]) == (4, 3)  # layout of the latest attempt


_CRASHING_WRITER = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from mpi_fnas.runlog import REQUIRED_METRICS, RunLog

    runlog = RunLog.create(sys.argv[1], mode="fnas", parties=2, config_text="x: 1\\n",
                           metric_names=REQUIRED_METRICS, alpha_shape=(2, 3), genotype_length=16)
    for step in range(4):
        runlog.append_metrics({"step": step, "train_loss": 1.0 / (step + 1)})
    runlog.append_epoch(np.full((2, 3), 1 / 3), np.full((2, 3), 1 / 3), "g0")
    os._exit(9)  # like SIGKILL: no close, no finish
    """
)


def test_reopen_salvages_a_log_whose_writer_was_killed(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    crashed = subprocess.run(
        [sys.executable, "-c", _CRASHING_WRITER, str(path)], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert crashed.returncode == 9, crashed.stderr
    # HDF5 itself refuses a write open of such a file; this is why reopen must salvage it.
    with pytest.raises(OSError, match="already open for write"):
        h5py.File(path, "r+", libver="latest")
    before = read_run(path)
    assert before["status"] == "running" and before["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 3.0]

    resumed = RunLog.reopen(path)
    assert resumed.row_counts() == (4, 1, 0)
    resumed.append_metrics({"step": 4, "train_loss": 0.2})
    resumed.finish("finished", reason="completed")
    run = read_run(path)
    assert run["status"] == "finished" and run["attempts"] == 2
    assert run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert run["metrics"]["train_loss"].tolist() == pytest.approx([1.0, 1 / 2, 1 / 3, 1 / 4, 0.2])
    assert run["genotypes"] == ["g0"]
    assert not Path(str(path) + ".salvage").exists()
    assert sorted(os.listdir(tmp_path)) == ["search.h5"]


def test_a_row_caught_mid_append_is_hidden_and_trimmed_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path)
    for step in range(2):
        runlog.append_metrics(_metric_row(step))
    runlog.close()
    # What a crash between two datasets of one append leaves behind: one column a row longer.
    with h5py.File(path, "r+", libver="latest") as f:
        f["metrics/step"].resize((3,))
        f["metrics/step"][2] = 2.0
    assert read_run(path)["metrics"]["step"].tolist() == [0.0, 1.0]

    resumed = RunLog.reopen(path)
    assert resumed.rows() == 2
    # The file itself is consistent again, also for plain h5py readers that do not use read_run.
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        assert {f["metrics"][name].shape for name in METRICS} == {(2,)}
    resumed.append_metrics(_metric_row(7))
    resumed.finish("finished", reason="completed")
    with h5py.File(path, "r") as f:
        assert {f["metrics"][name].shape for name in METRICS} == {(3,)}
        assert f["metrics/step"][:].tolist() == [0.0, 1.0, 7.0]


def test_truncate_drops_rows_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    runlog = _create(path, mode="dpfnas")
    for step in range(5):
        runlog.append_metrics(_metric_row(step))
    for epoch in range(3):
        runlog.append_epoch(_softmax_rows(epoch), _softmax_rows(epoch + 10), f"g{epoch}")
    for row in range(4):
        runlog.append_privacy(row + 1, np.full(PARTIES, 0.1 * row), np.full(PARTIES, 0.01 * row))
    checkpoint = (3, 1, 2)

    with pytest.raises(ValueError, match="metric_rows=6"):
        runlog.truncate(6, 1, 2)
    with pytest.raises(ValueError, match="privacy_rows=-1"):
        runlog.truncate(3, 1, -1)
    assert runlog.row_counts() == (5, 3, 4)  # a rejected truncate changes nothing

    runlog.truncate(*checkpoint)
    assert runlog.row_counts() == checkpoint and runlog.rows() == 3
    runlog.append_metrics(_metric_row(30))
    runlog.append_epoch(_softmax_rows(7), _softmax_rows(8), "g-new")
    runlog.append_privacy(9, np.full(PARTIES, 0.9), np.full(PARTIES, 0.09))
    runlog.finish("finished", reason="completed")

    run = read_run(path)
    assert run["metrics"]["step"].tolist() == [0.0, 1.0, 2.0, 30.0]
    assert all(values.shape == (4,) for values in run["metrics"].values())
    assert run["genotypes"] == ["g0", "g-new"]
    np.testing.assert_array_equal(run["alphas"]["normal"][1], _softmax_rows(7))
    assert run["privacy"]["steps"].tolist() == [1, 2, 9]
    np.testing.assert_allclose(run["privacy"]["epsilon"][:, 0], [0.0, 0.1, 0.9])
