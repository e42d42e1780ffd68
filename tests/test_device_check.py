"""The GPU check's scripts (scripts/device_wheels.sh, scripts/device_check.sh) and the bench's ``--devices`` mode,
without a GPU, a download or an MPI job: the scripts parse, the carried wheels cover what the image lacks, the check
ends inside its budget when a step hangs and says so, and writes no more files than come back from the machine."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from mpi_fnas.bench.devices import compare_devices, parse_devices
from mpi_fnas.config import load_config

ROOT = Path(__file__).resolve().parents[1]
WHEELS_SCRIPT = ROOT / "scripts" / "device_wheels.sh"
CHECK_SCRIPT = ROOT / "scripts" / "device_check.sh"


def image_packages() -> set[str]:
    text = (ROOT / "scripts" / "device_image_packages.txt").read_text()
    return {canonicalize_name(line) for line in text.splitlines() if line and not line.startswith("#")}


def carried_wheels() -> list[str]:
    match = re.search(r"^WHEELS=\(([^)]*)\)", WHEELS_SCRIPT.read_text(), re.MULTILINE)
    assert match, "WHEELS=(...) not found in scripts/device_wheels.sh"
    return [canonicalize_name(name) for name in match[1].split()]


@pytest.mark.parametrize("script", [WHEELS_SCRIPT, CHECK_SCRIPT], ids=lambda p: p.name)
def test_scripts_parse(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_carried_wheels_cover_every_runtime_need_the_image_lacks():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    image, carried = image_packages(), carried_wheels()
    needs = {canonicalize_name(Requirement(spec).name) for spec in project["dependencies"]}
    assert needs - image - set(carried) == set()
    assert {"mpich", "pytest-mpi"} <= set(carried)  # an mpirun and its libmpi; tests/mpi's plugin
    # One version of each package: nothing the image holds travels again, nothing twice.
    assert set(carried) & image == set() and len(set(carried)) == len(carried)


def test_check_writes_at_most_six_logs_beside_its_summary_directly_under_out():
    names = set(re.findall(r'\$out/([A-Za-z0-9_.-]+)', CHECK_SCRIPT.read_text()))
    assert "device_check.md" in names
    assert len(names - {"device_check.md"}) <= 6, names
    assert not re.search(r'\$out/[^"\s]*/', CHECK_SCRIPT.read_text())  # no sub-folders


def test_check_refuses_an_unknown_device_in_one_line(tmp_path):
    out = subprocess.run(["bash", str(CHECK_SCRIPT)], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "DEVICE_CHECK_DEVICE": "tpu", "OUT": str(tmp_path)})
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "cuda or cpu" in out.stderr


def test_check_ends_inside_its_budget_when_a_step_hangs_and_names_it(tmp_path):
    fake = tmp_path / "python"  # every `python -m ...` step hangs, every helper call fails at once
    fake.write_text('#!/bin/sh\ncase "$1" in -m) exec sleep 300;; *) exit 1;; esac\n')
    fake.chmod(0o755)
    out_dir = tmp_path / "out"
    started = time.monotonic()
    proc = subprocess.Popen(["bash", str(CHECK_SCRIPT)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "DEVICE_CHECK_DEVICE": "cpu", "BUDGET": "20",
                                                         "PYTHON": str(fake), "OUT": str(out_dir)})
    try:
        returncode = proc.wait(timeout=60)
    finally:  # a check that overran leaves nothing behind (its hanging steps included)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - started < 20
    assert returncode != 0
    summary = (out_dir / "device_check.md").read_text()
    assert "device tests (exit 124, timed out)" in summary
    assert "party step (no time left)" in summary and "DP-FNAS run (no time left)" in summary


def test_parse_devices():
    assert parse_devices("cpu, cuda") == ["cpu", "cuda"] and parse_devices("cuda:1") == ["cuda:1"]
    for bad in ("", "gpu", "cpu,cpu", "cuda:x"):
        with pytest.raises(ValueError, match="--devices"):
            parse_devices(bad)


def test_bench_devices_refuses_an_invisible_gpu_with_exit_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    out = subprocess.run([sys.executable, "-m", "mpi_fnas.bench", "--devices", "cpu,cuda"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "cuda" in out.stderr and out.stderr.count("\n") == 1


def test_compare_devices_reports_each_device_and_the_ratios():
    cfg = load_config(None, ["space.kind=darts", "space.ops=[]", "space.channels=4", "space.layers=3",
                             "space.nodes=1", "space.norm=groupnorm", "data.image_size=8", "search.batch_size=4"])
    report = compare_devices(cfg, 1, ["cpu"])
    assert report["devices"] == ["cpu"] and report["batch_size"] == 4
    assert report["step_seconds"]["cpu"] > 0 and report["dp_step_seconds"]["cpu"] > 0
    assert report["step_speedup"] == {"cpu": 1.0} and report["dp_step_speedup"] == {"cpu": 1.0}
    assert report["peak_memory_mb"] == {"cpu": None}
