"""The scaling study (mpi_fnas.scaling): the grid plan, the local runner's skip/resume (with a stand-in mpirun), each
rank's memory from a fake /proc, and the collector on logs written with the package's own writer (no MPI run)."""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runlog_helpers import SEARCH_COST, setup_reports

from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.report.cost_model import rank0_link_values
from mpi_fnas.runlog import SEARCH_METRICS, RunLog
from mpi_fnas.scaling import GRID_KEYS, ScalingPoint, main, parse_dirname, plan_grid, point_steps, run_arguments
from mpi_fnas.scaling.grid import check_overrides
from mpi_fnas.scaling.results import COLUMNS, read_study, study_rows
from mpi_fnas.scaling.rss import read_rss, sample_ranks, write_rss
from mpi_fnas.scaling.runner import run_point
from mpi_fnas.scaling.sizes import release_sizes

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "smoke.yaml")
# The smoke supernet, plain FNAS (a log without a privacy ledger), as a finished point's resolved config.
CONFIG_TEXT = load_config(SMOKE, ["mode=fnas"]).to_yaml()


# -- the plan -----------------------------------------------------------------------------------------------------
def test_strong_scaling_divides_the_steps_and_weak_keeps_them():
    assert [point_steps("strong", k, 10) for k in (1, 2, 3, 4, 16)] == [10, 5, 4, 3, 1]
    assert [point_steps("weak", k, 10) for k in (1, 2, 3, 4, 16)] == [10] * 5


def test_the_grid_names_and_orders_its_points():
    points = plan_grid([4, 1], ["star", "collective"], ["strong", "weak"], [0, 3], 8)
    assert len(points) == 16
    assert [p.dirname for p in points[:4]] == ["strong-star-K1-seed0", "strong-star-K1-seed3", "strong-star-K4-seed0",
                                               "strong-star-K4-seed3"]
    assert points[2] == ScalingPoint(parties=4, exchange="star", scaling="strong", seed=0, steps=2)
    assert points[-1] == ScalingPoint(parties=4, exchange="collective", scaling="weak", seed=3, steps=8)
    assert points[2].ranks == 5
    assert all(parse_dirname(p.dirname) == (p.scaling, p.exchange, p.parties, p.seed) for p in points)
    assert parse_dirname("strong-star-K0-seed0") is None and parse_dirname("dpfnas-K2-seed0") is None


def test_run_arguments_put_the_grid_keys_after_the_users():
    point = ScalingPoint(parties=8, exchange="collective", scaling="strong", seed=2, steps=3)
    args = run_arguments(point, "c.yaml", ["privacy.aggregation=secure"], Path("/r/x"))
    assert args == ["--config", "c.yaml", "--out", "/r/x", "--set", "privacy.aggregation=secure",
                    "--set", "federation.parties=8", "--set", "runtime.exchange=collective", "--set", "search.epochs=1",
                    "--set", "search.steps_per_epoch=3", "--set", "augment.epochs=0", "--set", "seed=2"]
    assert run_arguments(point, None, [], Path("/r/x"), resume=True)[:2] == ["--resume", "/r/x"]
    assert {item.split("=")[0] for item in point.overrides()} == set(GRID_KEYS)
    cfg = load_config(SMOKE, point.overrides())
    assert (cfg.federation.parties, cfg.runtime.exchange, cfg.search.epochs * cfg.search.steps_per_epoch,
            cfg.augment.epochs, cfg.seed) == (8, "collective", 3, 0, 2)


@pytest.mark.parametrize(("grid", "message"), [
    (dict(parties=[0]), "--parties: expected whole numbers >= 1, got 0"),
    (dict(exchanges=["ring"]), "--exchanges: expected star or collective, got 'ring'"),
    (dict(scalings=["medium"]), "--scaling: expected strong or weak, got 'medium'"),
    (dict(seeds=[-1]), "--seeds: expected whole numbers >= 0, got -1"),
    (dict(steps=0), "--steps: expected a whole number >= 1, got 0"),
    (dict(parties=[2, 2]), "--parties: a value is given twice: 2 2"),
    (dict(exchanges=[]), "--exchanges: give at least one value"),
])
def test_a_bad_grid_value_is_refused(grid, message):
    values = dict(parties=[1, 2], exchanges=["star"], scalings=["weak"], seeds=[0], steps=4) | grid
    with pytest.raises(ConfigError) as refused:
        plan_grid(**values)
    assert str(refused.value) == message


def test_a_set_of_a_grid_key_is_refused():
    check_overrides(["privacy.aggregation=secure", "search.batch_size=4"])
    for key in GRID_KEYS:
        with pytest.raises(ConfigError, match=f"--set {key}: the scaling study sets this key"):
            check_overrides([f"{key}=1"])


# -- logs as finished points ---------------------------------------------------------------------------------------
def write_point(root: Path, name: str, *, steps: int, party: float, transfer: float, server: float,
                status: str = "finished", exchange: str | None = None, config_text: str = CONFIG_TEXT) -> Path:
    """A point's search.h5 written by RunLog: K from the name, `steps` metric rows, /cost's split as given."""
    _, requested, parties, _ = parse_dirname(name)
    run_dir = root / name
    run_dir.mkdir(parents=True)
    reports = dataclasses.replace(setup_reports(parties), exchange=exchange or requested)
    log = RunLog.create(run_dir / "search.h5", mode="fnas", parties=parties, config_text=config_text,
                        metric_names=SEARCH_METRICS, alpha_shape=(5, 8), genotype_length=128,
                        privacy_guarantee="none: mode fnas makes no privacy claim", rank_attrs=reports.rank_attrs)
    for step in range(1, steps + 1):
        log.search.append_metrics({"step": step, "epoch": 0})
    cost = SEARCH_COST | {"party_compute_seconds": party, "transfer_seconds": transfer, "server_seconds": server,
                          "ranks": parties + 1}
    log.search.finish(status, reason="completed" if status == "finished" else "a party died", cost=cost,
                      final_genotype="Genotype()")
    log.close()
    return run_dir


@pytest.fixture
def study(tmp_path):
    """Strong star K = 1, 2, 4 (8, 4, 2 steps; 8.0, 5.0, 3.0 s of iterations), a failed strong star K = 8, and weak
    collective K = 1, 2 over two seeds at K = 1 (4 steps; 4.0 and 6.0, then 5.0 s)."""
    root = tmp_path / "study"
    write_point(root, "strong-star-K1-seed0", steps=8, party=6.0, transfer=1.0, server=1.0)
    write_point(root, "strong-star-K2-seed0", steps=4, party=3.0, transfer=1.5, server=0.5)
    write_point(root, "strong-star-K4-seed0", steps=2, party=1.0, transfer=1.5, server=0.5)
    write_point(root, "strong-star-K8-seed0", steps=1, party=1.0, transfer=1.0, server=1.0, status="failed")
    write_point(root, "weak-collective-K1-seed0", steps=4, party=3.0, transfer=0.5, server=0.5)
    write_point(root, "weak-collective-K1-seed1", steps=4, party=5.0, transfer=0.5, server=0.5)
    write_point(root, "weak-collective-K2-seed0", steps=4, party=4.0, transfer=0.5, server=0.5)
    return root


def rows_by_point(root: Path, **options) -> dict:
    return {row.point: row for row in study_rows(read_study(root), **options)}


def test_efficiency_is_against_the_smallest_k_of_each_series(study):
    rows = rows_by_point(study)
    strong = {k: rows[f"strong-star-K{k}-seed0"] for k in (1, 2, 4, 8)}
    assert strong[1].efficiency == pytest.approx(1.0)
    assert strong[2].efficiency == pytest.approx(8.0 * 1 / (2 * 5.0))  # T(K0)·K0 / (K·T(K))
    assert strong[4].efficiency == pytest.approx(8.0 * 1 / (4 * 3.0))
    assert strong[8].status == "failed" and math.isnan(strong[8].efficiency)
    weak = rows["weak-collective-K2-seed0"]
    assert weak.efficiency == pytest.approx(5.0 / 5.0)  # T(K0) = the mean over K0's seeds (4.0, 6.0), T0 / T
    assert rows["weak-collective-K1-seed1"].efficiency == pytest.approx(5.0 / 6.0)
    assert {row.efficiency_base_parties for row in rows.values() if row.final} == {1}


def test_a_row_splits_the_iteration_and_counts_rank_0s_link(study):
    rows = rows_by_point(study)
    row = rows["strong-star-K4-seed0"]
    assert (row.steps, row.iteration_seconds, row.party_compute_seconds, row.transfer_seconds, row.server_seconds) == \
        pytest.approx((2, 1.5, 0.5, 0.75, 0.25))
    num_w, num_a = release_sizes(CONFIG_TEXT)
    assert row.rank0_link_values == 2 * 4 * (num_w + num_a)  # the star: K copies each way
    assert rows["weak-collective-K2-seed0"].rank0_link_values == rank0_link_values(num_w, num_a, 2, "collective",
                                                                                     False)
    assert row.rank0_link_bytes == 4 * row.rank0_link_values


def test_the_model_calibrates_on_the_smallest_k_unless_a_bench_is_given(study):
    rows = rows_by_point(study, cores=2.0)
    # K0 = 1: 6.0 s / 8 steps of party compute on max(1, 2/2) = 1 share; K = 4: 5 ranks on 2 cores, unlimited link
    assert rows["strong-star-K4-seed0"].predicted_iteration_seconds == pytest.approx(0.75 * 5 / 2)
    assert rows["strong-star-K4-seed0"].predicted_from == "K=1 run"
    bench = rows_by_point(study, party_step_seconds=0.2)  # a core per rank: the step itself
    assert bench["strong-star-K4-seed0"].predicted_iteration_seconds == pytest.approx(0.2)
    assert bench["strong-star-K4-seed0"].predicted_from == "bench"


def test_rank_memory_from_rss_csv_enters_the_row(study):
    (study / "strong-star-K2-seed0" / "rss.csv").write_text("rank,peak_mb\n0,400\n1,300\n2,320.0\n")
    rows = rows_by_point(study)
    row = rows["strong-star-K2-seed0"]
    assert (row.rss_peak_mb_party_max, row.rss_peak_mb_ranks_total) == (320.0, 1020.0)
    assert row.rss_peak_mb_server == SEARCH_COST["rss_peak_mb_server"]
    assert math.isnan(rows["strong-star-K4-seed0"].rss_peak_mb_party_max)  # no rss.csv: no number


def test_collect_writes_the_csv_and_the_figures(study, capsys):
    assert main(["collect", str(study)]) == 0
    with open(study / "scaling.csv") as handle:
        reader = csv.DictReader(handle)
        lines = list(reader)
    assert tuple(reader.fieldnames) == COLUMNS
    assert [line["point"] for line in lines] == ["strong-star-K1-seed0", "strong-star-K2-seed0", "strong-star-K4-seed0",
                                                 "strong-star-K8-seed0", "weak-collective-K1-seed0",
                                                 "weak-collective-K1-seed1", "weak-collective-K2-seed0"]
    assert float(lines[1]["efficiency"]) == pytest.approx(0.8)
    assert lines[3]["status"] == "failed" and lines[3]["efficiency"] == ""
    for name in ("scaling-time.png", "scaling-efficiency.png", "scaling-link.png"):
        assert (study / "figures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 4 | star | strong | 2 | 1.500 |" in capsys.readouterr().out


def test_each_figure_shows_one_quantity_with_one_legend_and_the_shared_core_bound(study):
    from mpi_fnas.scaling.figures import efficiency_figure, link_figure, shared_core_bound, time_figure

    rows = list(rows_by_point(study, cores=2.0).values())
    assert [shared_core_bound(k, 1, 2.0) for k in (1, 2, 4, 8)] == pytest.approx([1, 2 / 3, 2 / 5, 2 / 9])
    assert shared_core_bound(8, 1, 16.0) == 1.0
    for figure, wanted in ((time_figure(rows, 2.0), {"star: measured", "star: cost model, 2 shared cores"}),
                           (efficiency_figure(rows, 2.0), {"star: measured", "ideal",
                                                           "bound on 2 shared cores: min(1, 2/(K+1))"}),
                           (link_figure(rows), {"star", "collective"})):
        assert len(figure.legends) == 1 and not any(ax.get_legend() for ax in figure.axes)
        labels = [text.get_text() for text in figure.legends[0].get_texts()]
        assert wanted <= set(labels) and len(labels) == len(set(labels))  # each series named once
        assert all("/" not in ax.get_title() for ax in figure.axes)  # no code path as a title
    strong = next(ax for ax in efficiency_figure(rows, 2.0).axes if ax.get_title() == "strong scaling")
    bound = next(line for line in strong.get_lines() if line.get_label().startswith("bound"))
    assert list(bound.get_ydata()) == pytest.approx([1, 2 / 3, 2 / 5])  # the finished strong points: K = 1, 2, 4


def test_the_efficiency_figure_draws_the_modelled_cluster_beside_the_shared_cores(study):
    from mpi_fnas.report.cost_model import Link
    from mpi_fnas.scaling.figures import efficiency_figure

    shared = list(rows_by_point(study, cores=2.0).values())
    cluster = list(rows_by_point(study, cores=None, link=Link.parse("unlimited")).values())
    strong = next(ax for ax in efficiency_figure(shared, 2.0, cluster, "unlimited").axes
                  if ax.get_title() == "strong scaling")
    lines = {line.get_label(): list(line.get_ydata()) for line in strong.get_lines()}
    # a core per rank and no wire: every party computes at once, so the model keeps the smallest K's efficiency
    assert lines["star: cost model, a cluster (a core per rank, unlimited)"] == pytest.approx([1.0, 1.0, 1.0])
    assert lines["star: cost model, 2 shared cores"][-1] < 0.5  # while 5 ranks on 2 cores take turns
    without = efficiency_figure(shared, 2.0).axes[0].get_lines()
    assert not any("cluster" in line.get_label() for line in without)
    assert [Link.parse(rate).describe() for rate in ("1gbit", "100mbit", "unlimited")] == [
        "1 Gbit/s", "100 Mbit/s", "unlimited"]


@pytest.mark.parametrize(("argv", "message"), [
    (["collect", "{tmp}/none"], "{tmp}/none: no such directory"),
    (["collect", "{tmp}/empty"], "{tmp}/empty: no run found (no search.h5 in it or below it)"),
    (["collect", "{tmp}/foreign"], "{tmp}/foreign/dpfnas-K2-seed0: not a scaling point's directory"),
    (["collect", "{tmp}/empty", "--link", "fast"], "--link: rate 'fast': expected e.g. 100mbit"),
    (["collect", "{tmp}/empty", "--cluster-link", "fast"], "--cluster-link: rate 'fast': expected e.g. 100mbit"),
    (["run", "--out", "{tmp}/o", "--parties", "0", "--config", SMOKE], "--parties: expected whole numbers >= 1"),
    (["run", "--out", "{tmp}/o", "--exchanges", "ring", "--config", SMOKE], "--exchanges: expected star or collective"),
    (["run", "--out", "{tmp}/o", "--set", "seed=3", "--config", SMOKE], "--set seed: the scaling study sets this key"),
    (["run", "--out", "{tmp}/o", "--config", "{tmp}/null.yaml"], "--steps: the config's search.steps_per_epoch"),
    (["run", "--out", "{tmp}/o", "--parties", "two"], "argument --parties: invalid int value: 'two'"),
    ([], "give a command: run or collect"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "null.yaml").write_text("search:\n  steps_per_epoch: null\n")
    write_point(tmp_path / "foreign", "strong-star-K2-seed0", steps=1, party=1, transfer=0, server=0)
    (tmp_path / "foreign" / "strong-star-K2-seed0").rename(tmp_path / "foreign" / "dpfnas-K2-seed0")
    code = run_main([arg.format(tmp=tmp_path) for arg in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and message.format(tmp=tmp_path) in err, err
    assert not (tmp_path / "o").exists()


def run_main(argv: list[str]) -> int:
    """main's exit code, also where argparse exits (SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exited:
        return exited.code


# -- the local runner, with a stand-in mpirun ------------------------------------------------------------------------
@pytest.fixture
def fake_mpirun(tmp_path):
    """An executable that records its argv in RECORD and exits 0 (no MPI, nothing runs)."""
    record = tmp_path / "argv.txt"
    script = tmp_path / "mpirun"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    script.chmod(0o755)
    return str(script), record


def test_the_runner_skips_a_finished_point_and_resumes_an_unfinished_one(tmp_path, fake_mpirun):
    mpirun, record = fake_mpirun
    root = tmp_path / "study"
    finished = ScalingPoint(parties=2, exchange="star", scaling="strong", seed=0, steps=4)
    write_point(root, finished.dirname, steps=4, party=1, transfer=0, server=0)
    assert run_point(finished, root, SMOKE, [], mpirun).skipped and not record.exists()

    failed = ScalingPoint(parties=4, exchange="star", scaling="strong", seed=0, steps=2)
    write_point(root, failed.dirname, steps=1, party=1, transfer=0, server=0, status="failed")
    outcome = run_point(failed, root, SMOKE, ["privacy.aggregation=secure"], mpirun)
    assert (outcome.skipped, outcome.exit_code) == (False, 0)
    assert record.read_text().split() == ["-n", "5", sys.executable, "-m", "mpi_fnas.run",
                                          *run_arguments(failed, SMOKE, ["privacy.aggregation=secure"],
                                                         root / failed.dirname, resume=True)]

    new = ScalingPoint(parties=1, exchange="collective", scaling="weak", seed=0, steps=2)
    run_point(new, root, None, [], mpirun)
    assert record.read_text().split()[5:7] == ["--out", str(root / new.dirname)]
    assert (root / new.dirname / "launch.log").read_text().startswith(mpirun)


@pytest.mark.parametrize(("overrides", "ranks"), [
    ([], [0, 1]),  # DP-FNAS on the synthetic shapes (public): every rank's peak
    (["data.dataset=mnist-5k", "data.image_size=14"], [0]),  # DP on real digits: a party's peak follows its batches
    (["mode=fnas", "data.dataset=mnist-5k", "data.image_size=14"], [0, 1]),  # no DP: nothing private in it
])
def test_rss_csv_keeps_a_partys_peak_only_where_it_is_public(tmp_path, overrides, ranks):
    """A stand-in mpirun starts two ranks (PMI_RANK 0 and 1) that live for 1.5 s; the runner samples both and
    writes beside the log only what anyone reading the run directory may see."""
    script = tmp_path / "mpirun"
    script.write_text("#!/bin/sh\nPMI_RANK=0 sleep 1.5 &\nPMI_RANK=1 sleep 1.5 &\nwait\n")
    script.chmod(0o755)
    point = ScalingPoint(parties=1, exchange="star", scaling="weak", seed=0, steps=2)
    run_point(point, tmp_path / "study", SMOKE, overrides, str(script))
    assert sorted(read_rss(tmp_path / "study" / point.dirname)) == ranks


def test_rank_memory_is_read_below_the_launcher_from_proc(tmp_path):
    """A fake /proc: launcher 10 -> proxy 11 -> ranks 12 (PMI_RANK 0) and 13 (PMI_RANK 1); 20 is unrelated."""
    proc = tmp_path / "proc"
    for pid, ppid, rank, hwm_kb in ((10, 1, None, 5000), (11, 10, None, 6000), (12, 11, 0, 400_000),
                                    (13, 11, 1, 300_000), (20, 1, 0, 999_999)):
        entry = proc / str(pid)
        entry.mkdir(parents=True)
        (entry / "stat").write_text(f"{pid} (py thon) S {ppid} 1 1 0")
        env = b"PATH=/bin\0" + (f"PMI_RANK={rank}\0".encode() if rank is not None else b"")
        (entry / "environ").write_bytes(env)
        (entry / "status").write_text(f"Name:\tpython\nVmHWM:\t  {hwm_kb} kB\nVmRSS:\t  1 kB\n")
    assert sample_ranks(10, proc) == {0: pytest.approx(400_000 * 1024 / 1e6), 1: pytest.approx(300_000 * 1024 / 1e6)}
    assert read_rss(tmp_path) == {}
    write_rss(tmp_path, {1: 300.04, 0: 400.0})
    assert read_rss(tmp_path) == {0: 400.0, 1: 300.0}


def test_the_runner_does_not_load_mpi_or_torch():
    code = ("import sys, mpi_fnas.scaling.runner, mpi_fnas.scaling.command; "
            "sys.exit(any(m in sys.modules for m in ('mpi4py', 'torch')))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0
