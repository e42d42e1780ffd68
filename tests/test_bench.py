"""The benchmark CLI reports the documented fields, consistently (no timing targets here: see docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--set", "space.channels=4", "--set", "space.layers=3", "--set", "space.nodes=1",
        "--set", "data.image_size=8", "--set", "search.batch_size=4", "--repeats", "1", "--json"]


@pytest.mark.parametrize("ranks", [1, 3])
def test_bench_json_fields(ranks):
    cmd = [sys.executable, "-m", "mpi_fnas.bench", *TINY]
    if ranks > 1:
        cmd = [str(Path(sys.executable).parent / "mpirun"), "-n", str(ranks), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1  # rank 0 only
    report = json.loads(lines[0])
    assert report["ranks"] == ranks
    assert report["step_seconds"] > 0 and report["comm_seconds"] > 0
    assert report["step_seconds"] == pytest.approx(report["w_release_seconds"] + report["a_release_seconds"])
    assert report["comm_fraction"] == pytest.approx(
        report["comm_seconds"] / (report["step_seconds"] + report["comm_seconds"]))
    assert report["num_a"] == 2 * 2 * 8  # 2 cells kinds × 2 edges (1 node) × 8 ops


def test_bench_bad_config_exit_2():
    out = subprocess.run([sys.executable, "-m", "mpi_fnas.bench", "--set", "search.batch_size=0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "search.batch_size" in out.stderr
