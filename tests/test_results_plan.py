"""What a results table still needs, and that what it holds follows its protocol (:mod:`mpi_fnas.report.results_plan`,
``Table.configs``): every arm's config holds the setting its tuning runs chose, every recorded row ran its arm's
config, and the plan lists exactly the runs a table lacks, as a script that runs and records each of them."""

from __future__ import annotations

import dataclasses
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from mpi_fnas.baseline.arms import random_genotype_text
from mpi_fnas.config import load_config
from mpi_fnas.config.parsing import parse_override
from mpi_fnas.report import results
from mpi_fnas.report.results import ROOT, TABLES, RunSummary, config_value
from mpi_fnas.report.results_plan import expected_minutes, main, missing_runs, plan_script, select

TABLE = TABLES["private-28"]


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
    best, *others = sorted(tried, key=lambda r: -r.holdout_acc)
    assert all(r.holdout_acc < best.holdout_acc for r in others), "a tie: the tuning chose nothing"
    cfg = load_config(ROOT / TABLE.configs[arm, dataset])
    assert cfg.data.dataset == dataset and cfg.privacy.target_epsilon == 3.0

    def holds(setting: str) -> bool:
        return all(config_value(cfg.to_dict(), key) == value for key, value in map(parse_override, setting.split()))

    assert holds(best.setting), f"{TABLE.configs[arm, dataset]} does not hold {best.setting}, its tuning's choice"
    # A setting names only what it changed from the config it ran on, so holding the chosen one is not enough: a
    # config that also holds in full a worse setting naming a key the choice does not (the length of a lr run that
    # lost to one at the other length) went back on the choice.
    def keys(setting: str) -> set[str]:
        return {parse_override(part)[0] for part in setting.split()}

    assert not any(holds(r.setting) and not keys(r.setting) <= keys(best.setting) for r in others), \
        f"{TABLE.configs[arm, dataset]} holds a setting its tuning did not choose"


def test_every_recorded_row_names_its_arms_config():
    """A row's config is its arm's by name (the settings it held are the tuning tests' and the log's)."""
    names = {key: load_config(ROOT / path).name for key, path in TABLE.configs.items()}
    for row in results.read_summaries():
        if row.table == "private-28":
            assert row.config == names[row.arm, row.dataset], row


def _row(arm: str, dataset: str, epsilon: float, seed: int, wall: float = 1.0) -> RunSummary:
    return RunSummary(table="private-28", arm=arm, dataset=dataset, epsilon_target=epsilon, seed=seed, test_acc=0.9,
                      epsilon_worst=epsilon, wall_seconds=wall, config="c", commit="x")


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
        assert cfg.federation.parties == TABLE.parties
    # The cell a random arm trains is the one mpi_fnas.baseline's random-0 trained at that seed (the recorded rows).
    trained = {(r.dataset, r.seed): r.genotype for r in results.read_summaries() if r.arm == "random-scattering"}
    assert trained
    for run in everything:
        if run.arm == "random-scattering" and (run.dataset, run.seed) in trained:
            assert f"augment.genotype={trained[run.dataset, run.seed]}" in run.overrides
    order = [(-run.epsilon, [arm for arm, _ in TABLE.arms].index(run.arm),
              [dataset for dataset, _ in TABLE.datasets].index(run.dataset), run.seed) for run in everything]
    assert order == sorted(order)  # the table's order
    done = [_row("scatter-linear", "mnist", 2.0, 1), _row("searched", "fashion-mnist", 3.0, 0),
            _row("searched", "fashion-mnist", 3.0, 7)]  # seed 7: a row the table does not need
    left = missing_runs("private-28", done)
    assert {run.name for run in everything} - {run.name for run in left} == {
        "mnist-e2-scatter-linear-s1", "fashion-mnist-e3-searched-s0"}


def _stub(path: Path, log: Path, also: str = "") -> Path:
    path.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$(basename "$0")" "$@" "--" >> {shlex.quote(str(log))}\n'
                    f"{also}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _run_script(tmp_path: Path, runs: list, mpirun_also: str = "") -> tuple[subprocess.CompletedProcess,
                                                                            list[list[str]]]:
    """The plan script of `runs` under stub launchers (each call's arguments logged; the stub mpirun then runs
    `mpirun_also`); its result and the calls."""
    script, log = tmp_path / "todo.sh", tmp_path / "calls"
    script.write_text(plan_script("private-28", runs))
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MPIRUN": str(_stub(tmp_path / "mpirun", log, mpirun_also)),
           "PYTHON": str(_stub(tmp_path / "python", log)), "MPIRUN_ARGS": "--oversubscribe -x OMP_NUM_THREADS"}
    done = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    calls = [call.strip("\n").split("\n") for call in log.read_text().split("--\n") if call.strip()]
    return done, calls


def _planned() -> list:
    return [run for run in missing_runs("private-28", []) if run.epsilon == 1.0 and run.dataset == "mnist"
            and run.arm in ("random-scattering", "cnn-tanh") and run.seed < 2]


def test_the_plan_script_runs_and_records_each_run_then_writes_the_tables(tmp_path):
    runs = _planned()
    done, calls = _run_script(tmp_path, runs)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:len(runs)] == [f"== {run.name}" for run in runs]  # which run goes
    launched = [call[1:] for call in calls if call[0] == "mpirun"]
    recorded = [call[1:] for call in calls if call[1:4] == ["-m", "mpi_fnas.report.results", "record"]]
    assert len(launched) == len(runs) == len(recorded)
    for call, record, run in zip(launched, recorded, runs, strict=True):
        out = str(tmp_path / "out" / run.name)
        assert call[:8] == ["--oversubscribe", "-x", "OMP_NUM_THREADS", "-n", str(run.ranks),
                            str(tmp_path / "python"), "-m", "mpi_fnas.run"]
        assert call[-2:] == ["--out", out] and call[call.index("--config") + 1] == run.config
        assert [call[i + 1] for i, word in enumerate(call) if word == "--set"] == list(run.overrides)
        assert record[3:] == [out, "--arm", run.arm, "--table", "private-28"]
        assert (tmp_path / "out" / f"{run.name}.log").exists()
    assert calls[-1] == ["python", "-m", "mpi_fnas.report.results", "write"]


def test_the_plan_script_stops_at_a_run_directory_already_there_and_still_writes_the_tables(tmp_path):
    """A directory already there may hold a run of another setting (an earlier plan's): never recorded as this one."""
    runs = _planned()
    (tmp_path / "out" / runs[1].name).mkdir(parents=True)
    done, calls = _run_script(tmp_path, runs)
    assert done.returncode == 2 and f"{runs[1].name} is there already" in done.stderr
    launched = [call[-1] for call in calls if call[0] == "mpirun"]
    assert launched == [str(tmp_path / "out" / runs[0].name)]
    assert calls[-1] == ["python", "-m", "mpi_fnas.report.results", "write"]


def test_the_plan_script_stops_between_runs_when_asked(tmp_path):
    """OUT/STOP, created while a run goes, lets that run finish and be recorded, then ends the script cleanly."""
    runs = _planned()
    out = tmp_path / "out"
    done, calls = _run_script(tmp_path, runs, mpirun_also=f"touch {shlex.quote(str(out / 'STOP'))}")
    assert done.returncode == 0 and f"STOP is there: stopped before {runs[1].name}" in done.stdout
    assert [call[-1] for call in calls if call[0] == "mpirun"] == [str(out / runs[0].name)]
    assert [call[4] for call in calls if call[1:4] == ["-m", "mpi_fnas.report.results", "record"]] == [
        str(out / runs[0].name)]  # the run that was going on is recorded
    assert calls[-1] == ["python", "-m", "mpi_fnas.report.results", "write"]


def test_the_command_prints_the_names_or_the_script(capsys):
    assert main(["--list"]) == 0
    names = capsys.readouterr().out.split()
    assert names == [run.name for run in missing_runs("private-28", results.read_summaries())]
    assert main([]) == 0
    text = capsys.readouterr().out
    assert text.startswith("#!/usr/bin/env bash") and text.count("\nrun ") == len(names)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_only_selects_runs_in_the_patterns_order_each_once_and_refuses_a_pattern_matching_none(capsys, monkeypatch):
    everything = missing_runs("private-28", [])
    chosen = select(everything, ["*-scatter-linear-s2", "mnist-e1-*", "mnist-e1-scatter-linear-s2"])
    names = [run.name for run in chosen]
    linear = [run.name for run in everything if run.arm == "scatter-linear" and run.seed == 2]
    mnist1 = [run.name for run in everything if run.dataset == "mnist" and run.epsilon == 1.0]
    assert names == linear + [name for name in mnist1 if name not in linear]  # the patterns' order, each once
    with pytest.raises(ValueError, match="matches none"):
        select(everything, ["mnist-*", "mnist-e4-*"])
    monkeypatch.setattr("mpi_fnas.report.results_plan.read_summaries", lambda: [])  # every run missing
    assert main(["--list", "--only", "*-s9"]) == 2
    assert "--only '*-s9' matches none" in capsys.readouterr().err
    assert main(["--list", "--only", "*-scatter-linear-s2", "--only", "mnist-e1-*"]) == 0
    assert capsys.readouterr().out.split() == names


def test_the_script_says_how_long_each_run_took_at_its_cell():
    runs = [run for run in missing_runs("private-28", []) if run.seed == 0 and run.epsilon == 1.0
            and run.dataset == "mnist" and run.arm in ("cnn-tanh", "scatter-cnn")]
    rows = [_row("cnn-tanh", "mnist", 3.0, 0, wall=120.0), _row("cnn-tanh", "mnist", 2.0, 1, wall=180.0),
            _row("cnn-tanh", "mnist", 2.0, 2, wall=600.0), _row("cnn-tanh", "fashion-mnist", 3.0, 0, wall=9e9),
            dataclasses.replace(_row("cnn-tanh", "mnist", 3.0, 0, wall=9e9), table="another")]
    assert expected_minutes("private-28", runs[0], rows) == 3.0  # its arm and dataset's median, not others'
    assert expected_minutes("private-28", runs[1], rows) is None
    # a random arm's seed draws its network: that seed's runs if any, else the arm's
    random = [run for run in missing_runs("private-28", []) if run.arm == "random-scattering" and run.seed == 2]
    drawn = [_row("random-scattering", random[0].dataset, 3.0, 0, wall=600.0),
             _row("random-scattering", random[0].dataset, 3.0, 1, wall=600.0),
             _row("random-scattering", random[0].dataset, 3.0, 2, wall=240.0)]
    assert expected_minutes("private-28", random[0], drawn) == 4.0
    assert expected_minutes("private-28", random[0], drawn[:2]) == 10.0
    text = plan_script("private-28", runs, rows)
    assert "# Time: about 0.1 h by the recorded runs' wall times, 1 of 2 run(s) known." in text
    assert "# mnist, ε 1, cnn-tanh, seed 0, about 3 min\nrun mnist-e1-cnn-tanh-s0 " in text
    assert "# mnist, ε 1, scatter-cnn, seed 0\nrun " in text
    assert "# Time: unknown (no run of these arms recorded)." in plan_script("private-28", runs, [])
