"""The results report (``python -m mpi_fnas.report``) on real tiny runs, K = 2: FNAS and DP-FNAS (with a tiny
private augmentation) at seeds 0 and 1, one FNAS seed followed live by ``--follow``, and an FNAS search that fails
at step 3. The five jobs run at once.

Every number of table1.csv / table2.csv is recomputed here from the logs (read_run), every figure decoded and
looked at, the HTML page checked to embed every figure and link nothing outside itself; bad input is one line,
exit 2 and nothing written; ``--follow`` exits 0 on a finished run (also one it watched live), 1 on a failed one
and on one whose writer died. The noise studies of Table 2 (several σ_W² or σ_aug² at one K) are edited copies
of the real DP-FNAS logs: the report reads nothing but the logs, and a launch costs about ten CPU-seconds of
interpreter and torch start-up per rank on CI's 2 cores.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import csv
import dataclasses
import io
import math
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import ROOT, TINY, mpirun_background, wait_for, warm_jobs
from matplotlib.image import imread, imsave

from mpi_fnas.report import document, main
from mpi_fnas.report.collect import read_record
from mpi_fnas.report.figures import FIGURE_PIXELS
from mpi_fnas.report.table_figures import cost_figure, table1_figure
from mpi_fnas.report.tables import group_runs
from mpi_fnas.runlog import read_run
from mpi_fnas.runlog.liveness import machine_scope, process_identity

pytestmark = pytest.mark.slow  # real MPI jobs

SMALL = [*TINY, "--set", "search.steps_per_epoch=2"]  # 2 epochs of 2 steps
AUGMENT = ["--set", "augment.epochs=1", "--set", "augment.steps_per_epoch=2", "--set", "augment.layers=2",
           "--set", "augment.channels=4", "--set", "augment.batch_size=16"]
FINISHED = ("fnas-K2-seed0", "fnas-K2-seed1", "dpfnas-K2-seed0", "dpfnas-K2-seed1")
FAILED = "fnas-K2-seed2"  # in a supernet group: counted, it would change the FNAS mean
LIVE = "fnas-K2-seed1"  # followed live while it runs; party 1 stalls at step 3 so the view sees it going
TABLE1_COLUMNS = ["mode", "parties", "runs", "test_error_mean", "test_error_std", "stage", "params_m",
                  "search_gpu_days", "search_cpu_core_hours", "search_wall_hours", "attempts", "epsilon_worst",
                  "colluders", "epsilon_augment_worst"]
TABLE2_COLUMNS = ["noise_variance", "runs", "val_or_test_error_mean", "val_or_test_error_std", "epsilon_worst"]
TABLE2_EXTRA_COLUMNS = ["augment_noise_variance", "parties", "stage"]  # after those five: σ_aug², K, stage


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def report_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpi_fnas.report", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=_env())


def report(capsys, *args: str) -> tuple[int, str, str]:
    """main(args) in this process (cheaper than a new interpreter): (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The five runs, laid out as slurm/table1.sh does (<root>/<mode>-K<parties>-seed<seed>/search.h5), started at
    once (``--follow`` watches LIVE from the moment its log exists). Returns (root, follow result)."""
    root = tmp_path_factory.mktemp("table1")
    fnas, dpfnas = [*SMALL, "--set", "mode=fnas"], [*SMALL, *AUGMENT, "--set", "mode=dpfnas"]
    plans = {
        "fnas-K2-seed0": ([*fnas, "--set", "seed=0"], None),
        LIVE: ([*fnas, "--set", "seed=1"], {"MPI_FNAS_INJECT_SLEEP": "1:3:6"}),
        "dpfnas-K2-seed0": ([*dpfnas, "--set", "seed=0"], None),
        "dpfnas-K2-seed1": ([*dpfnas, "--set", "seed=1"], None),
        FAILED: ([*fnas, "--set", "seed=2"], {"MPI_FNAS_INJECT_FAULT": "2:3"}),
    }
    # The live and the failed run are launches of their own (one is watched, one aborts); the others run in the warm
    # ranks meanwhile.
    procs = {name: mpirun_background(3, *plans[name][0], "--out", str(root / name), env=plans[name][1])
             for name in (LIVE, FAILED)}
    finished = [name for name in plans if name not in procs]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        warm = pool.submit(warm_jobs, *((3, [*plans[name][0], "--out", str(root / name)]) for name in finished))
        try:
            assert wait_for(lambda: (root / LIVE / "search.h5").is_file(), timeout=300), "the live run never started"
            followed = report_cli("--follow", str(root / LIVE), "--interval", "0.5", timeout=600)
            outputs = {name: proc.communicate(timeout=600) for name, proc in procs.items()}
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        for name, out in zip(finished, warm.result(timeout=600), strict=True):
            assert out.returncode == 0, (name, out.stderr[-3000:])
    assert procs[LIVE].returncode == 0, outputs[LIVE][1][-3000:]
    assert procs[FAILED].returncode != 0
    return root, followed


@pytest.fixture(scope="module")
def made(runs, tmp_path_factory):
    """The report of the whole root: (report dir, stdout). Made in this process (torch and matplotlib are loaded
    once); the command line itself is run by the --follow and bad-option tests and by test_docs."""
    root, _ = runs
    out = tmp_path_factory.mktemp("report") / "report"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([str(root), "--out", str(out)])
    assert code == 0, stderr.getvalue()
    return out, stdout.getvalue()


def logs(root: Path) -> dict[str, dict]:
    return {name: read_run(root / name / "search.h5") for name in (*FINISHED, FAILED)}


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def expected_group(group: list[dict]) -> dict[str, float]:
    """A Table 1 row computed here from read_run dicts, independently of the report's code."""
    augmented = all(log["augment"] is not None for log in group)
    if augmented:
        errors = [log["augment"]["test_error"] for log in group]
        params_m = float(np.mean([log["augment"]["params"] for log in group])) / 1e6
    else:
        errors = []
        for log in group:
            acc = log["metrics"]["test_acc"]
            errors.append(1.0 - acc[np.isfinite(acc)][-1])
        params_m = math.nan
    # ε of the released model: a private augmentation's ledger composes both stages; else the search's.
    ledgers = [log["augment"]["privacy"] if log["augment"] is not None and log["augment"]["privacy"] is not None
               else log["privacy"] for log in group]
    epsilon = math.nan if ledgers[0] is None else max(float(np.max(ledger["epsilon"][-1])) for ledger in ledgers)
    # The augmentation's ε alone (the DPNAS protocol): its own ledger rows' releases, read from the attr.
    alone = [float(np.max(log["augment"]["privacy"]["epsilon_alone"])) for log in group
             if log["augment"] is not None and log["augment"]["privacy"] is not None]
    return {
        "runs": len(group), "test_error_mean": float(np.mean(errors)), "test_error_std": float(np.std(errors, ddof=1)),
        "params_m": params_m, "search_gpu_days": float(np.mean([log["cost"]["gpu_hours"] for log in group])) / 24,
        "search_cpu_core_hours": float(np.mean([log["cost"]["cpu_core_hours"] for log in group])),
        "search_wall_hours": float(np.mean([log["cost"]["wall_seconds"] for log in group])) / 3600,
        "attempts": float(np.mean([log["attempts"] for log in group])), "epsilon_worst": epsilon,
        "epsilon_augment_worst": max(alone) if alone else math.nan, "stage": "augment" if augmented else "supernet",
    }


def assert_row(row: dict[str, str], expected: dict[str, float]) -> None:
    for column, value in expected.items():
        if isinstance(value, str):
            assert row[column] == value, column
        elif math.isnan(value):
            assert math.isnan(float(row[column])), column
        else:
            assert float(row[column]) == pytest.approx(value, rel=1e-12, abs=1e-15), column


# -- the tables ------------------------------------------------------------------------------------------------------
def test_table1_equals_the_logs_and_leaves_the_failed_run_out(runs, made):
    root, _ = runs
    out, stdout = made
    by_name = logs(root)
    assert by_name[FAILED]["status"] == "failed"
    columns, rows = read_csv(out / "table1.csv")
    assert columns == TABLE1_COLUMNS
    assert [(r["mode"], r["parties"]) for r in rows] == [("fnas", "2"), ("dpfnas", "2")]
    fnas, dpfnas = rows
    # The failed run is not in the mean (runs = 2, the mean and std of seeds 0 and 1).
    assert_row(fnas, expected_group([by_name["fnas-K2-seed0"], by_name["fnas-K2-seed1"]]))
    # The ε covers search + augmentation (the augment ledger), more than the search's alone.
    assert_row(dpfnas, expected_group([by_name["dpfnas-K2-seed0"], by_name["dpfnas-K2-seed1"]]))
    search_only = max(float(np.max(by_name[n]["privacy"]["epsilon"][-1])) for n in ("dpfnas-K2-seed0",
                                                                                   "dpfnas-K2-seed1"))
    assert float(dpfnas["epsilon_worst"]) > search_only
    assert 0 < float(dpfnas["epsilon_augment_worst"]) < float(dpfnas["epsilon_worst"])  # the search not charged
    assert not (out / "table2.csv").exists()  # one noise level
    # ... and listed with its status, in the report and on stdout.
    md = (out / "report.md").read_text()
    line = next(line for line in md.splitlines() if f"`{FAILED}`" in line and line.startswith("|"))
    assert "| failed |" in line
    assert f"`{FAILED}`: failed, left out of the means" in md
    assert f"left out  {FAILED}: failed" in stdout


@pytest.fixture
def stub_run_figures(monkeypatch):
    """Each run's figures replaced by one tiny PNG, for tests on edited copies of the real runs: their figures are
    the originals' (tested on the real runs by the `made` report), and drawing ~5 per run costs seconds."""
    buffer = io.BytesIO()
    imsave(buffer, np.zeros((2, 2, 3)), format="png")
    monkeypatch.setattr(document, "run_figures", lambda run: {f"{run.slug}-stub.png": buffer.getvalue()})
    return monkeypatch


def test_table2_with_several_noise_levels_and_a_report_replaces_the_last(runs, tmp_path, capsys, stub_run_figures):
    """Two more DP-FNAS runs at σ² = 2 (copies of the logs with σ_W = √2): K = 2 is now a noise study, so it
    leaves Table 1 for Table 2. A later report into the same directory leaves no file of this one behind (its
    figures drawn for real this time)."""
    root, _ = runs
    study = tmp_path / "study"
    for seed in (0, 1):
        shutil.copytree(root / f"dpfnas-K2-seed{seed}", study / f"var1-seed{seed}", ignore=_only_logs)
        shutil.copytree(root / f"dpfnas-K2-seed{seed}", study / f"var2-seed{seed}", ignore=_only_logs)
        with h5py.File(study / f"var2-seed{seed}" / "search.h5", "r+") as f:
            f["privacy/noise_multiplier_w"][...] = math.sqrt(2.0)
    out = tmp_path / "report"
    code, _, err = report(capsys, str(study), "--out", str(out))
    assert code == 0, err
    columns, rows = read_csv(out / "table2.csv")
    assert columns == [*TABLE2_COLUMNS, *TABLE2_EXTRA_COLUMNS]
    assert [(float(r["noise_variance"]), r["parties"], r["stage"]) for r in rows] == [(1.0, "2", "augment"),
                                                                                    (2.0, "2", "augment")]
    assert {r["augment_noise_variance"] for r in rows} == {"0.7225"}  # σ_aug = 0.85, the default, in both
    for row, level in zip(rows, ("var1", "var2"), strict=True):
        group = [read_run(study / f"{level}-seed{seed}" / "search.h5") for seed in (0, 1)]
        expected = expected_group(group)
        assert_row(row, {"runs": 2, "val_or_test_error_mean": expected["test_error_mean"],
                         "val_or_test_error_std": expected["test_error_std"],
                         "epsilon_worst": expected["epsilon_worst"]})
    assert read_csv(out / "table1.csv")[1] == []  # the only setting is a noise study
    assert (out / "figures" / "table2.png").is_file()
    assert (out / "figures" / "var1-seed0-stub.png").is_file()

    stub_run_figures.undo()
    code, _, err = report(capsys, str(root / "fnas-K2-seed0"), "--out", str(out))
    assert code == 0, err
    assert not (out / "table2.csv").exists()
    assert {p.name for p in (out / "figures").iterdir()} == {
        "table1.png", "search-cost.png", *(f"fnas-K2-seed0-{s}.png" for s in ("alphas", "alphas-epochs", "cells",
                                                                           "curves"))}
    assert sorted(p.name for p in out.iterdir()) == ["figures", "report.html", "report.md", "table1.csv"]


def test_augmentation_noise_levels_and_a_non_private_augmentation_are_never_averaged(runs, tmp_path, capsys,
                                                                                    stub_run_figures):
    """An ε–accuracy study (scripts/augment_table.sh) varies the augmentation's noise at one search σ: DP-FNAS at
    σ_aug = 0.7 and 1.2, and with augment.private false, two seeds each, all at σ_W² = 1. Copies of the DP-FNAS logs
    with /augment/privacy/noise_multiplier, ε and the test error rewritten (the non-private ones: /augment private
    False, no ledger). Each setting is a Table 2 row of its own (runs 2), identified by K, σ_W² and σ_aug²; the
    six runs are never one mean, and (mode, K) is a noise study, so Table 1 is empty."""
    root, _ = runs
    study = tmp_path / "study"
    settings = {  # name -> (σ_aug, None: not private; test error of seeds 0 and 1; last ε of seed 0)
        "aug0.7": (0.7, (0.30, 0.40), 6.0), "aug1.2": (1.2, (0.50, 0.70), 2.0), "exact": (None, (0.10, 0.20), None)}
    for name, (sigma, errors, epsilon) in settings.items():
        for seed, error in enumerate(errors):
            run = study / f"{name}-seed{seed}"
            shutil.copytree(root / f"dpfnas-K2-seed{seed}", run, ignore=_only_logs)
            with h5py.File(run / "search.h5", "r+") as f:
                augment = f["augment"]
                augment.attrs["test_error"], augment.attrs["test_acc"] = error, 1.0 - error
                if sigma is None:
                    augment.attrs["private"] = False
                    augment.attrs["privacy_guarantee"] = "none: augment.private is false"
                    del augment["privacy"]
                else:
                    augment["privacy/noise_multiplier"][...] = sigma
                    augment["privacy/epsilon"][-1] = epsilon + seed
    out = tmp_path / "report"
    code, _, err = report(capsys, str(study), "--out", str(out))
    assert code == 0, err
    assert read_csv(out / "table1.csv")[1] == []
    columns, rows = read_csv(out / "table2.csv")
    assert columns == [*TABLE2_COLUMNS, *TABLE2_EXTRA_COLUMNS]
    # By K, σ_W², then σ_aug² (not private first).
    assert [(r["parties"], r["noise_variance"], r["augment_noise_variance"], r["stage"]) for r in rows] == [
        ("2", "1.0", "", "augment"), ("2", "1.0", "0.49", "augment"), ("2", "1.0", "1.44", "augment")]
    for row, name in zip(rows, ("exact", "aug0.7", "aug1.2"), strict=True):
        expected = expected_group([read_run(study / f"{name}-seed{seed}" / "search.h5") for seed in (0, 1)])
        assert_row(row, {"runs": 2, "val_or_test_error_mean": expected["test_error_mean"],
                         "val_or_test_error_std": expected["test_error_std"],
                         "epsilon_worst": expected["epsilon_worst"]})
    assert [float(r["val_or_test_error_mean"]) for r in rows] == pytest.approx([0.15, 0.35, 0.60])
    assert [float(r["epsilon_worst"]) for r in rows[1:]] == [7.0, 3.0]
    md = (out / "report.md").read_text()
    table2 = md[md.index("## Table 2"):md.index("## Runs")]
    assert [line.split(" | ")[:4] for line in table2.splitlines() if line.startswith("| 2 |")] == [
        ["| 2", "1", "not private", "2"], ["| 2", "1", "0.49", "2"], ["| 2", "1", "1.44", "2"]]


def _only_logs(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if n != "search.h5"]


# -- figures and the page --------------------------------------------------------------------------------------------
def expected_figures(root: Path) -> set[str]:
    names = {"table1.png", "search-cost.png"}
    for name, log in logs(root).items():
        if len(log["alphas"]["normal"]):
            names |= {f"{name}-alphas.png", f"{name}-alphas-epochs.png"}
        if log["final_genotype"] or log["genotypes"]:
            names.add(f"{name}-cells.png")
        names.add(f"{name}-curves.png")
        if log["privacy"] is not None and len(log["privacy"]["epsilon"]):
            names.add(f"{name}-epsilon.png")
    return names


def test_every_figure_decodes_has_the_size_and_is_not_blank(runs, made):
    root, _ = runs
    out, _ = made
    pngs = sorted((out / "figures").glob("*.png"))
    assert {p.name for p in pngs} == expected_figures(root)
    assert {f"{name}-epsilon.png" for name in ("dpfnas-K2-seed0", "dpfnas-K2-seed1")} <= {p.name for p in pngs}
    width, height = FIGURE_PIXELS
    for png in pngs:
        pixels = imread(png)
        assert pixels.shape[:2] == (height, width), png.name
        assert float(pixels[..., :3].var()) > 1e-4, f"{png.name} is blank"


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.links: list[tuple[str, str, str]] = []
        self.open: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in ("img", "br", "meta"):
            self.open.append(tag)
        for name, value in attrs:
            if name in ("src", "href", "srcset", "data", "action", "poster"):
                (self.images if tag == "img" and name == "src" else self.links).append((tag, name, value))

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, (tag, self.open[-5:])
        self.open.pop()


def test_the_html_page_embeds_every_figure_and_links_nothing_outside(made):
    out, _ = made
    page = _Page()
    page.feed((out / "report.html").read_text(encoding="utf-8"))
    page.close()
    assert page.open == [] and page.links == []
    embedded = []
    for _, _, src in page.images:
        assert src.startswith("data:image/png;base64,"), src[:60]
        embedded.append(base64.b64decode(src.split(",", 1)[1], validate=True))
    figures = {p.read_bytes() for p in (out / "figures").glob("*.png")}
    assert set(embedded) == figures and len(embedded) == len(figures)
    md = (out / "report.md").read_text()
    for png in (out / "figures").glob("*.png"):
        assert f"](figures/{png.name})" in md


# -- bad input -------------------------------------------------------------------------------------------------------
def test_an_unknown_option_is_one_line_and_exit_2(tmp_path):
    out = report_cli("--bogus", str(tmp_path), "--out", str(tmp_path / "r"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["mpi_fnas: error: unrecognized arguments: --bogus (see --help)"]
    assert not (tmp_path / "r").exists()


def test_bad_inputs_are_one_line_exit_2_and_write_nothing(runs, tmp_path, capsys):
    root, _ = runs
    empty = tmp_path / "empty"
    empty.mkdir()
    junk = tmp_path / "junk" / "run"
    junk.mkdir(parents=True)
    (junk / "search.h5").write_bytes(b"this is not HDF5\n" * 64)
    truncated = tmp_path / "truncated" / "run"
    truncated.mkdir(parents=True)
    whole = (root / "fnas-K2-seed0" / "search.h5").read_bytes()  # cut at a third: past the superblock
    (truncated / "search.h5").write_bytes(whole[: len(whole) // 3])
    mixed = tmp_path / "mixed"  # one good run beside a corrupt log: the whole report is refused
    shutil.copytree(root / "fnas-K2-seed0", mixed / "good", ignore=_only_logs)
    shutil.copytree(junk, mixed / "bad")
    stranger = tmp_path / "stranger"  # --out: a directory that is not a report
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine\n")
    docs = tmp_path / "docs"  # --out: a hand-written report.md (this repository's docs/) is not a report's
    docs.mkdir()
    (docs / "report.md").write_text("# The results report\n")
    cases = [
        ([str(tmp_path / "missing")], "no such file or directory"),
        ([str(empty)], "no run found"),
        ([str(junk.parent)], "not a readable run log"),
        ([str(truncated)], "not a readable run log"),
        ([str(mixed)], "not a readable run log"),
        ([str(root / LIVE / "parties")], "no run found"),  # in a real run's directory
        ([], "give at least one run directory"),
        (["--follow", str(root / "fnas-K2-seed0"), str(root)], "--follow takes one run directory"),
        (["--follow", str(empty.parent / "missing")], "no such run directory"),
        (["--follow", str(root / "fnas-K2-seed0"), "--interval", "0"], "--interval"),
    ]
    for args, message in cases:
        out = tmp_path / "out"
        code, _, stderr = report(capsys, *args, *(["--out", str(out)] if "--follow" not in args else []))
        assert code == 2, (args, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mpi_fnas: error: ") and message in lines[0], (args, lines)
        assert not out.exists(), args
    code, _, stderr = report(capsys, str(root / "fnas-K2-seed0"), "--out", str(stranger))
    assert code == 2 and "not a report directory" in stderr
    assert sorted(p.name for p in stranger.iterdir()) == ["notes.txt"]
    code, _, stderr = report(capsys, str(root / "fnas-K2-seed0"), "--out", str(docs))
    assert code == 2 and "did not write" in stderr
    assert (docs / "report.md").read_text() == "# The results report\n"


def test_a_report_directory_a_crash_left_half_written_is_still_the_report(runs, tmp_path, capsys, stub_run_figures):
    """A write that crashed after removing report.md leaves the report's own files and its staging directory:
    the next report is accepted there and clears the leftovers."""
    root, _ = runs
    out = tmp_path / "report"
    (out / "figures").mkdir(parents=True)
    (out / "table1.csv").write_text("old\n")
    (out / "table2.csv").write_text("old\n")
    (out / ".report-crashed" / "figures").mkdir(parents=True)
    code, _, err = report(capsys, str(root / "fnas-K2-seed0"), "--out", str(out))
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["figures", "report.html", "report.md", "table1.csv"]


# -- the live view ---------------------------------------------------------------------------------------------------
def test_follow_watches_a_live_run_to_its_end(runs):
    _, followed = runs
    assert followed.returncode == 0, followed.stderr
    lines = followed.stdout.splitlines()
    live = [line for line in lines if line.startswith("search") and line.endswith("running")]
    assert live, followed.stdout  # seen while it ran
    assert any("step " in line and "/4" in line and "epoch " in line for line in live), followed.stdout
    assert any("s/step" in line and "ETA" in line for line in live), followed.stdout
    assert any(line.startswith("genotype normal=") for line in lines)
    assert "== run finished ==" in lines


def test_follow_a_finished_run_prints_its_state_and_exits_0(runs, capsys):
    root, _ = runs
    code, out, err = report(capsys, "--follow", str(root / "dpfnas-K2-seed0"))
    assert code == 0, err
    log = read_run(root / "dpfnas-K2-seed0" / "search.h5")
    worst = float(np.max(log["augment"]["privacy"]["epsilon"][-1]))
    assert "== run finished ==" in out and f"ε           worst {worst:.4g}" in out
    assert f"test error {log['augment']['test_error']:.4f}" in out


def test_follow_a_failed_run_exits_1(runs, capsys):
    root, _ = runs
    code, out, _ = report(capsys, "--follow", str(root / FAILED))
    assert code == 1
    assert "== run failed ==" in out and "party rank 2 failed" in out


def test_a_dead_writer_is_a_failed_run_for_follow_and_the_report(runs, tmp_path, capsys, stub_run_figures):
    """A run killed with its ranks (SIGKILL, node loss) leaves status running; its writer process is gone. Beside
    it, the same log claimed by a live writer (this process) is a run still going: listed as running."""
    root, _ = runs
    dead = tmp_path / "logs" / "fnas-K2-seed0"
    going = tmp_path / "logs" / "fnas-K2-seed1"
    shutil.copytree(root / "fnas-K2-seed0", dead, ignore=_only_logs)
    shutil.copytree(root / "fnas-K2-seed1", going, ignore=_only_logs)
    between = tmp_path / "logs" / "dpfnas-K2-seed0"  # the search finished, the job died before its augmentation
    shutil.copytree(root / "dpfnas-K2-seed0", between, ignore=_only_logs)
    for run in (dead, going, between):
        with h5py.File(run / "search.h5", "r+") as f:
            if run == between:
                del f["augment"]
            else:
                f.attrs["status"] = "running"
                f.attrs["reason"] = ""
            # The writer: this process for `going`; for the others one that has ended (a start tick no process has:
            # their own writer may be a warm rank, still alive).
            writer = os.getpid() if run == going else int(f["writer/pid"][()])
            f["writer/pid"][()] = writer
            f["writer/process"][()] = (process_identity(writer) if run == going else f"{machine_scope()}/0").encode()
    code, out, _ = report(capsys, "--follow", str(dead))
    assert code == 1
    assert "== run failed ==" in out and "writer died" in out
    code, out, _ = report(capsys, "--follow", str(between))
    assert code == 1 and "augmentation never started" in out
    code, stdout, err = report(capsys, str(dead.parent), "--out", str(tmp_path / "r"))
    assert code == 0, err
    assert "left out  fnas-K2-seed0: failed (writer died" in stdout
    assert "left out  fnas-K2-seed1: running" in stdout
    assert "left out  dpfnas-K2-seed0: failed (the search finished but its augmentation never started" in stdout
    assert read_csv(tmp_path / "r" / "table1.csv")[1] == []


def test_missing_numbers_draw_no_bar_and_no_cost_point_instead_of_failing(runs, stub_run_figures):
    """Two finished runs without a test error (NaN) or a positive wall time: the Table 1 group shows "n/a" rather
    than a 0 % bar, the search-cost figure says it has no point rather than failing on a log axis, and the page
    does not call a group of two runs "(1 run)"."""
    root, _ = runs
    run = read_record(root / "fnas-K2-seed0" / "search.h5", root)
    broken = [dataclasses.replace(run, test_error=math.nan, search_wall_seconds=0.0, seed=seed, slug=f"s{seed}")
              for seed in (0, 1)]
    width, height = FIGURE_PIXELS
    for png in (table1_figure(group_runs(broken)), cost_figure(broken)):
        pixels = imread(io.BytesIO(png))
        assert pixels.shape[:2] == (height, width) and float(pixels[..., :3].var()) > 1e-4
    page = document.build_report(broken, [str(root)])["report.md"].decode()
    assert "(1 run)" not in page


def test_the_gpu_days_column_shows_only_where_a_run_had_a_gpu(runs, stub_run_figures):
    """On CPU-only runs the report's Table 1 leaves out its always-zero GPU-days column (table1.csv keeps it)."""
    root, _ = runs
    run = read_record(root / "fnas-K2-seed0" / "search.h5", root)
    cpu = [dataclasses.replace(run, seed=seed, slug=f"s{seed}") for seed in (0, 1)]
    header = next(line for line in document.build_report(cpu, [str(root)])["report.md"].decode().splitlines()
                  if line.startswith("| mode |"))
    assert "GPU-days" not in header and "search CPU core-h" in header
    gpu = [dataclasses.replace(r, search_gpu_hours=12.0) for r in cpu]
    files = document.build_report(gpu, [str(root)])
    assert "| search GPU-days |" in files["report.md"].decode() and "| 0.5 |" in files["report.md"].decode()
    header_of = lambda files: files["table1.csv"].decode().splitlines()[0]  # noqa: E731
    assert header_of(files) == header_of(document.build_report(cpu, [str(root)])) == ",".join(TABLE1_COLUMNS)


def test_the_ideal_scaling_line_needs_two_k(runs, monkeypatch):
    """A mode measured at one K gets its point and no "ideal scaling" line: a line through one point says nothing."""
    from mpi_fnas.report import table_figures

    made, original = [], table_figures.new_figure
    monkeypatch.setattr(table_figures, "new_figure", lambda: made.append(original()) or made[-1])
    root, _ = runs
    run = read_record(root / "fnas-K2-seed0" / "search.h5", root)

    def labels(parties: tuple[int, ...]) -> list[str]:
        cost_figure([dataclasses.replace(run, parties=k, seed=i, slug=f"s{i}") for i, k in enumerate(parties)])
        return [line.get_label() for ax in made[-1].axes for line in ax.get_lines()]

    assert labels((2, 2)) == ["fnas: measured"]
    assert labels((2, 4)) == ["fnas: measured", "fnas: ideal strong scaling from K=2"]
