"""Old logs still read: a committed log written by an earlier release of the code, read by today's reader and report.

``tests/data/old_logs/dpfnas-9ba821c.h5`` is the log of the tiny DP run below, made with the code at commit 9ba821c
(the last landed main before the stage-axis redesign; its ``/augment/privacy`` has no ``charged_steps`` and no
``mu_gdp``)::

    mpirun -n 3 python -m mpi_fnas.run --out OUT --set mode=dpfnas --set seed=3 --set data.train_size=320 \\
      --set data.test_size=32 --set data.image_size=8 --set search.epochs=1 --set search.steps_per_epoch=2 \\
      --set search.batch_size=8 --set augment.epochs=1 --set augment.steps_per_epoch=2 --set augment.batch_size=8 \\
      --set augment.layers=2 --set augment.channels=4 --set space.layers=2 --set space.channels=4 \\
      --set runtime.progress=off

The numbers asserted are the ones that run printed (ε 2.138 for search + augmentation, 4302 params).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from mpi_fnas.report.command import main as report_main
from mpi_fnas.runlog import read_run
from mpi_fnas.space.genotype import Genotype

OLD_LOG = Path(__file__).parent / "data" / "old_logs" / "dpfnas-9ba821c.h5"


def test_a_log_of_9ba821c_reads_whole() -> None:
    log = read_run(OLD_LOG)
    assert (log["status"], log["reason"], log["mode"], log["space"], log["parties"]) == (
        "finished", "completed", "dpfnas", "darts", 2)
    assert log["version"] == "0.1.0" and log["attempts"] == 1 and not log["stale"]
    Genotype.from_string(log["final_genotype"])  # the genotype string still parses
    assert log["genotypes"] == [log["final_genotype"]]
    assert log["metrics"]["step"].tolist() == [2.0] and log["metrics"]["test_acc"].tolist() == [0.0625]
    assert log["alphas"]["normal"].shape[0] == 1
    privacy = log["privacy"]
    assert privacy["steps"].tolist() == [2] and privacy["charged_steps"].tolist() == [[2, 2]]
    np.testing.assert_allclose(privacy["epsilon"], [[1.91744868, 1.91744868]])
    np.testing.assert_allclose(privacy["mu_gdp"], [[0.18537971, 0.18537971]])
    assert (privacy["noise_multiplier_w"], privacy["clip_w"], privacy["clip_a"]) == (1.0, 1.0, 0.1)
    augment = log["augment"]
    assert (augment["status"], augment["params"], augment["test_acc"], augment["private"]) == (
        "finished", 4302, 0.0625, True)
    assert augment["genotype"] == log["final_genotype"] and augment["metrics"]["step"].tolist() == [2]
    aug_privacy = augment["privacy"]
    assert (aug_privacy["noise_multiplier"], aug_privacy["clip"], aug_privacy["steps"].tolist()) == (0.85, 1.0, [2])
    np.testing.assert_allclose(aug_privacy["epsilon"], [[2.13786, 2.13786]])
    # written before /augment/privacy had them: absent, not invented
    assert "charged_steps" not in aug_privacy and "mu_gdp" not in aug_privacy


def test_the_report_tables_an_old_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    shutil.copy(OLD_LOG, run / "search.h5")
    assert report_main([str(tmp_path / "runs"), "--out", str(tmp_path / "report")]) == 0
    header, row = (tmp_path / "report" / "table1.csv").read_text().splitlines()
    fields = dict(zip(header.split(","), row.split(","), strict=True))
    assert (fields["mode"], fields["parties"], fields["stage"], fields["test_error_mean"]) == (
        "dpfnas", "2", "augment", "0.9375")
    assert abs(float(fields["epsilon_worst"]) - 2.13786) < 1e-5
