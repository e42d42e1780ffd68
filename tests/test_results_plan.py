"""What a results table still needs, and that what it holds follows its protocol (:mod:`mpi_fnas.report.results_plan`,
``Table.configs``): every arm's config holds the setting its tuning runs chose, every recorded row ran its arm's
config, and the plan lists exactly the runs a table lacks, as a script that runs and records each of them."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from mpi_fnas.baseline.arms import random_genotype_text
from mpi_fnas.config import load_config
from mpi_fnas.config.parsing import parse_override
from mpi_fnas.report import results
from mpi_fnas.report.results import ROOT, TABLES, RunSummary
from mpi_fnas.report.results_plan import main, missing_runs, plan_script

TABLE = TABLES["private-28"]


def _held(cfg, key: str):
    held = cfg.to_dict()
    for name in key.split("."):
        held = held[name]
    return held


@pytest.mark.parametrize(("arm", "dataset"), sorted(TABLE.configs))
def test_every_arm_config_holds_the_setting_its_tuning_chose(arm, dataset):
    """A results row is only the protocol's when its config is what the tuning chose: the best held-out setting of
    the arm's tuning runs (ε = 3; a random arm is its searched arm's config with a drawn cell, and is not tuned)."""
    tried = [r for r in results.read_summaries(results.TUNING_CSV, results.TuningSummary)
             if (r.table, r.arm, r.dataset, r.epsilon_target) == ("private-28", arm, dataset, 3.0)]
    if arm.startswith("random-"):
        assert not tried
        return
    assert tried, f"{arm} on {dataset}: no tuning run"
    best = max(tried, key=lambda r: r.holdout_acc)
    cfg = load_config(ROOT / TABLE.configs[arm, dataset])
    assert cfg.data.dataset == dataset and cfg.privacy.target_epsilon == 3.0
    for part in best.setting.split():
        key, value = parse_override(part)
        assert _held(cfg, key) == value, f"{TABLE.configs[arm, dataset]}: {key} is {_held(cfg, key)}, " \
            f"its tuning chose {best.setting}"


def test_every_recorded_row_ran_its_arms_config():
    names = {key: load_config(ROOT / path).name for key, path in TABLE.configs.items()}
    for row in results.read_summaries():
        if row.table == "private-28":
            assert row.config == names[row.arm, row.dataset], row


def _row(arm: str, dataset: str, epsilon: float, seed: int) -> RunSummary:
    return RunSummary(table="private-28", arm=arm, dataset=dataset, epsilon_target=epsilon, seed=seed, test_acc=0.9,
                      epsilon_worst=epsilon, wall_seconds=1.0, config="c", commit="x")


def test_the_plan_lists_exactly_the_runs_a_table_lacks():
    everything = missing_runs("private-28", [])
    arms = {arm for arm, _ in TABLE.configs}
    assert len(everything) == len(arms) * len(TABLE.datasets) * len(TABLE.epsilons) * len(TABLE.seeds)
    assert "dpsur" not in {run.arm for run in everything}  # a published number is never run
    assert len({run.name for run in everything}) == len(everything)
    for run in everything:
        cfg = load_config(ROOT / run.config, list(run.overrides))
        assert (cfg.data.dataset, cfg.seed, cfg.privacy.target_epsilon) == (run.dataset, run.seed, run.epsilon)
        assert run.ranks == TABLE.parties + 1
        drawn = random_genotype_text(load_config(ROOT / run.config), run.seed, 0) \
            if run.arm.startswith("random-") else None
        assert cfg.augment.genotype == drawn, run
    done = [_row("scatter-linear", "mnist", 2.0, 1), _row("searched", "fashion-mnist", 3.0, 0),
            _row("searched", "fashion-mnist", 3.0, 7)]  # seed 7: a row the table does not need
    left = missing_runs("private-28", done)
    assert {run.name for run in everything} - {run.name for run in left} == {
        "mnist-e2-scatter-linear-s1", "fashion-mnist-e3-searched-s0"}


def _stub(path: Path, log: Path) -> Path:
    path.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$(basename "$0")" "$@" "--" >> {log}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_the_plan_script_runs_and_records_each_run_then_writes_the_tables(tmp_path):
    runs = [run for run in missing_runs("private-28", []) if run.epsilon == 1.0 and run.dataset == "mnist"
            and run.arm in ("random-scattering", "cnn-tanh") and run.seed < 2]
    script = tmp_path / "todo.sh"
    script.write_text(plan_script("private-28", runs))
    (tmp_path / "out" / runs[0].name).mkdir(parents=True)
    (tmp_path / "out" / runs[0].name / "search.h5").write_bytes(b"")  # a run already there: recorded, not rerun
    log = tmp_path / "calls"
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MPIRUN": str(_stub(tmp_path / "mpirun", log)),
           "PYTHON": str(_stub(tmp_path / "python", log))}
    subprocess.run(["bash", str(script)], cwd=ROOT, env=env, check=True, timeout=60)
    calls = [call.strip("\n").split("\n")[1:] for call in log.read_text().split("--\n") if call.strip()]
    launched = [call for call in calls if call[0] == "-n"]
    recorded = [call for call in calls if call[:3] == ["-m", "mpi_fnas.report.results", "record"]]
    assert [call[-1] for call in launched] == [str(tmp_path / "out" / run.name) for run in runs[1:]]
    for call, run in zip(launched, runs[1:], strict=True):
        assert call[:5] == ["-n", str(run.ranks), env["PYTHON"], "-m", "mpi_fnas.run"]
        sets = [call[i + 1] for i, word in enumerate(call) if word == "--set"]
        assert call[call.index("--config") + 1] == run.config and sets == list(run.overrides)
    assert [(call[3], call[5]) for call in recorded] == [(str(tmp_path / "out" / run.name), run.arm) for run in runs]
    assert calls[-1] == ["-m", "mpi_fnas.report.results", "write"]


def test_the_command_prints_the_names_or_the_script(capsys):
    assert main(["--list"]) == 0
    names = capsys.readouterr().out.split()
    assert names == [run.name for run in missing_runs("private-28", results.read_summaries())]
    assert main([]) == 0
    text = capsys.readouterr().out
    assert text.startswith("#!/usr/bin/env bash") and text.count("\nrun ") == len(names)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
