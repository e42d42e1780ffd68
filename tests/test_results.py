"""The results tables of the README and the docs are written from per-seed summaries of the runs that made them
(docs/results/runs.csv, :mod:`mpi_fnas.report.results`): every marked table is what the command renders, a summary
is read from a real run's log, a tuning run is refused, and the means and standard errors are the hand-computed
ones."""

from __future__ import annotations

import csv
import dataclasses
import math
import shutil

import h5py
import pytest
from conftest import TINY, warm_jobs

from mpi_fnas.cpu_kernels import cpu_model
from mpi_fnas.report import results
from mpi_fnas.report.results import ResultsError, RunSummary
from mpi_fnas.runlog import read_run


def test_every_marked_table_is_what_the_summaries_render():
    rows = results.read_summaries()
    tuning = results.read_summaries(results.TUNING_CSV, results.TuningSummary)
    assert results.stale_tables(rows, tuning=tuning) == [], "run: python -m mpi_fnas.report.results write"
    for run in tuning:  # every tuning run at a seed no table row reports
        assert run.seed not in {row.seed for row in rows if (row.table, row.arm, row.dataset) ==
                                (run.table, run.arm, run.dataset)}, run
    for row in rows:  # only test-split numbers of finished runs, each row a known table's arm and dataset
        table = results.TABLES[row.table]
        assert row.arm in dict(table.arms) and row.dataset in dict(table.datasets), row
        assert 0 < row.test_acc <= 1 and row.epsilon_worst <= row.epsilon_target * 1.001, row


def _row(arm: str, seed: int, acc: float, dataset: str = "mnist", epsilon: float = 3.0) -> RunSummary:
    return RunSummary(table="private-28", arm=arm, dataset=dataset, epsilon_target=epsilon, seed=seed,
                      test_acc=acc, epsilon_worst=epsilon, wall_seconds=1.0, config="c", commit="x")


def test_a_table_is_the_mean_and_standard_error_over_seeds(tmp_path):
    rows = [_row("cnn-tanh", 0, 0.98), _row("cnn-tanh", 1, 0.97), _row("cnn-tanh", 2, 0.99),
            _row("scatter-linear", 0, 0.89, "fashion-mnist"), _row("searched", 0, 0.95, epsilon=1.0)]
    text = results.render_table("private-28", rows)
    mean, se = results.mean_se([0.98, 0.97, 0.99])
    assert math.isclose(se, 0.01 / math.sqrt(3))
    assert f"| 3 | `cnn-tanh` (Papernot et al.'s tanh CNN) | {100 * mean:.2f} ± {100 * se:.2f} (3; 0 min) | " \
        "98.1 (ε 2.93) |" in text
    assert "| 89.00 (1; 0 min) | 89.7 |" in text
    assert "| 1 | searched cell (conv stem, pool head) | 95.00 (1; 0 min) | – |" in text
    marked = tmp_path / "page.md"
    marked.write_text("before\n<!-- results: private-28 -->\nold\n<!-- /results -->\nafter\n")
    fresh = results.rewrite(marked.read_text(), rows)
    assert fresh == f"before\n<!-- results: private-28 -->\n{text}<!-- /results -->\nafter\n"
    assert results.stale_tables(rows, [marked]) == ["page.md: results private-28"]
    marked.write_text(fresh)
    assert results.stale_tables(rows, [marked]) == []
    results.write_summaries(rows, tmp_path / "runs.csv")
    assert sorted(results.read_summaries(tmp_path / "runs.csv"), key=repr) == sorted(rows, key=repr)
    tuning = [results.TuningSummary("private-28", "scatter-linear", "mnist", 3.0, 100, f"augment.lr={lr}", acc, 1.0,
                                    "x") for lr, acc in ((4, 0.90), (8, 0.95), (16, 0.93))]
    tuned = results.render_tuning("private-28", tuning)
    assert ("| mnist | 3 | `scatter-linear` (ScatterNet + linear) | augment.lr=4: 90.00, **augment.lr=8: 95.00**, "
            "augment.lr=16: 93.00 | 3 |") in tuned
    marked.write_text("<!-- tuning: private-28 -->\n<!-- /tuning -->\n")
    fresh = results.rewrite(marked.read_text(), rows, tuning)
    assert fresh == f"<!-- tuning: private-28 -->\n{tuned}<!-- /tuning -->\n"


def test_the_cells_block_lists_each_searched_runs_genotype_and_a_drawn_or_hand_designed_one_has_none(tmp_path):
    cell = "dpnas=conv_3x3_selu@0|conv_3x3_linear@0,conv_3x3_linear@1"
    rows = [dataclasses.replace(_row("searched", 1, 0.9635, "fashion-mnist"), genotype=cell),
            dataclasses.replace(_row("searched", 0, 0.95, epsilon=1.0), genotype="dpnas=conv_3x3_tanh@0"),
            dataclasses.replace(_row("searched-scattering", 0, 0.9, epsilon=1.0), genotype=cell + ";head=dpnas"),
            dataclasses.replace(_row("random-scattering", 0, 0.9), genotype=cell + ";head=pool",
                                cpu_model="AMD EPYC 9R14; Intel Xeon"),
            _row("cnn-tanh", 0, 0.98)]
    listed = results.render_cells("private-28", rows)
    assert listed == (f"- searched cell (conv stem, pool head), fashion-mnist, ε 3, seed 1: `{cell}`, 96.35 %\n"
                      "- searched cell (conv stem, pool head), mnist, ε 1, seed 0: `dpnas=conv_3x3_tanh@0`, 95.00 %\n"
                      "- searched cell (scattering stem, head searched), mnist, ε 1, seed 0: "
                      f"`{cell};head=dpnas`, 90.00 %\n")
    marked = tmp_path / "page.md"
    marked.write_text("<!-- cells: private-28 -->\n<!-- /cells -->\n")
    assert results.rewrite(marked.read_text(), rows) == f"<!-- cells: private-28 -->\n{listed}<!-- /cells -->\n"
    results.write_summaries(rows, tmp_path / "runs.csv")
    assert sorted(results.read_summaries(tmp_path / "runs.csv"), key=repr) == sorted(rows, key=repr)
    # a file written before the columns existed reads as no genotype and no CPU
    old = tmp_path / "old.csv"
    with open(tmp_path / "runs.csv", newline="") as new, open(old, "w", newline="") as out:
        csv.writer(out).writerows(line[:-2] for line in csv.reader(new))
    assert {(r.genotype, r.cpu_model) for r in results.read_summaries(old)} == {("", "")}


@pytest.mark.slow
def test_a_summary_is_read_from_a_finished_run_and_a_tuning_run_is_refused(tmp_path):
    trained = ["--set", "augment.epochs=1", "--set", "augment.steps_per_epoch=2", "--set", "augment.batch_size=8",
               "--set", "privacy.target_epsilon=4"]
    small, searched = [*TINY, "--set", "augment.network=cnn-gn", *trained], [*TINY, *trained]
    done, tuning, cell = warm_jobs((3, [*small, "--out", str(tmp_path / "run")]),
                                   (3, [*small, "--set", "data.holdout=50", "--set", "augment.lr=2",
                                        "--out", str(tmp_path / "tuning")]),
                                   (3, [*searched, "--out", str(tmp_path / "cell")]))
    assert done.returncode == cell.returncode == tuning.returncode == 0, (
        done.stderr[-2000:] + tuning.stderr[-2000:] + cell.stderr[-2000:])
    found = results.summarize(tmp_path / "cell", table="private-28", arm="searched", commit="abc")
    assert found.genotype and found.genotype == read_run(tmp_path / "cell" / "search.h5")["final_genotype"]
    assert "tuning: data.holdout 50" in tuning.stdout
    row = results.summarize(tmp_path / "run", table="private-28", arm="cnn-gn", commit="abc")
    assert (row.arm, row.dataset, row.epsilon_target, row.seed, row.commit) == ("cnn-gn", "synthetic-shapes", 4.0,
                                                                                0, "abc")
    assert row.genotype == ""  # a hand-designed network: no cell (and no search)
    assert row.cpu_model == cpu_model()  # its ranks' one host: where the wall time ran
    assert 0 <= row.test_acc <= 1 and 0 < row.epsilon_worst <= 4.0 * 1.001 and row.wall_seconds > 0
    shutil.copytree(tmp_path / "run", tmp_path / "two-hosts")  # as if its ranks had run on two kinds of node
    with h5py.File(tmp_path / "two-hosts" / "search.h5", "r+") as log:
        log["ranks"].attrs["cpu_model"] = ["Intel Xeon", "AMD EPYC", "Intel Xeon"]
    hosts = results.summarize(tmp_path / "two-hosts", table="private-28", arm="cnn-gn", commit="abc")
    assert hosts.cpu_model == "Intel Xeon; AMD EPYC"  # each model once, in rank order
    with pytest.raises(ResultsError, match=r"a tuning run \(data\.holdout 50\)"):
        results.summarize(tmp_path / "tuning", table="private-28", arm="cnn-gn", commit="abc")
    tried = results.summarize(tmp_path / "tuning", table="private-28", arm="cnn-gn", commit="abc",
                              tuning="augment.lr=2")
    assert (tried.setting, tried.seed) == ("augment.lr=2", 0) and 0 <= tried.holdout_acc <= 1
    both = results.summarize(tmp_path / "tuning", table="private-28", arm="cnn-gn", commit="abc",
                             tuning="augment.lr=2 augment.epochs=1")  # a length tried at the chosen lr
    assert both.setting == "augment.lr=2 augment.epochs=1"
    for claimed, held in (("augment.lr=4", r"augment\.lr=2(\.0)?"),
                          ("augment.lr=2 augment.epochs=40", r"augment\.epochs=1"),
                          ("augment.widths=8", "no such key")):  # the table says only what the run's config held
        with pytest.raises(ResultsError, match=rf"did not try .*\(its config: {held}\)"):
            results.summarize(tmp_path / "tuning", table="private-28", arm="cnn-gn", commit="abc", tuning=claimed)
    with pytest.raises(ResultsError, match=r"not a tuning run \(data\.holdout 0\)"):
        results.summarize(tmp_path / "run", table="private-28", arm="cnn-gn", commit="abc", tuning="augment.lr=2")
    with pytest.raises(ResultsError, match="no run log"):
        results.summarize(tmp_path, table="private-28", arm="cnn-gn", commit="abc")
