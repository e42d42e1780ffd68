"""The report keeps a given cell's and a hand-designed network's runs out of Tables 1 and 2.

One folder holds real tiny runs: a DP-FNAS search with the augmentation of the cell it found, the augmentation of
a given cell (``augment.genotype``: no search) and a hand-designed network (``augment.network=cnn-tanh``: no
search). A copy of the given cell's log with another genotype stands for a second cell (its own group, never
averaged with the first). Table 1 holds the search alone, with its σ_W²; trained.csv and the report's section
"Trained without a search" hold the others, labelled, with the cell named and ε of the augmentation alone.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import h5py
import pytest
from conftest import TINY, warm_jobs

from mpi_fnas.report import main
from mpi_fnas.report.collect import GIVEN_CELL, read_record
from mpi_fnas.runlog import read_run

pytestmark = pytest.mark.slow  # real MPI jobs

AUGMENT = ["--set", "mode=dpfnas", "--set", "search.steps_per_epoch=2", "--set", "augment.epochs=1",
           "--set", "augment.steps_per_epoch=2", "--set", "augment.layers=2", "--set", "augment.channels=4",
           "--set", "augment.batch_size=16"]
GIVEN = ("normal=sep_conv_3x3@0,sep_conv_3x3@1|sep_conv_3x3@0,skip_connect@2;normal_concat=2,3;"
         "reduce=max_pool_3x3@0,max_pool_3x3@1|skip_connect@2,max_pool_3x3@1;reduce_concat=2,3")
OTHER = GIVEN.replace("sep_conv_3x3", "dil_conv_3x3")  # the second cell (a rewritten copy of the given run's log)


def escaped(cell: str) -> str:
    """A table cell as report.md writes it (a genotype's ``|`` escaped)."""
    return cell.replace("|", "\\|")


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixed")
    plans = {
        "search": [],
        "given": ["--set", f"augment.genotype={GIVEN}"],
        "cnn-tanh": ["--set", "augment.network=cnn-tanh", "--set", "augment.drop_path=0",
                     "--set", "augment.auxiliary_weight=0"],
    }
    results = warm_jobs(*((3, [*TINY, *AUGMENT, *extra, "--out", str(root / name)])
                                for name, extra in plans.items()))
    for name, result in zip(plans, results, strict=True):
        assert result.returncode == 0, (name, result.stderr[-3000:])
    shutil.copytree(root / "given", root / "given-other", ignore=lambda _, names: [n for n in names
                                                                                    if n != "search.h5"])
    with h5py.File(root / "given-other" / "search.h5", "r+") as f:
        f["augment"].attrs["genotype"] = OTHER
        f["augment"].attrs["test_error"] = 0.5
    return root


def test_a_run_that_did_not_search_is_labelled_and_has_no_search_noise(folder: Path) -> None:
    search, given, network = (read_record(folder / name / "search.h5", folder) for name in ("search", "given",
                                                                                              "cnn-tanh"))
    assert (search.trained, search.searched, search.noise_variance) == ("searched cell", True, 1.0)
    assert search.epsilon_covers == "search + augment"
    assert (given.trained, given.searched, given.noise_variance, given.genotype) == (GIVEN_CELL, False, None, GIVEN)
    assert (network.trained, network.searched, network.noise_variance) == ("cnn-tanh", False, None)
    for run in (given, network):  # ε of the augmentation alone: its ledger charged nothing before it
        log = read_run(run.path)
        assert run.epsilon_covers == "augment"
        assert run.epsilon_worst == pytest.approx(float(max(log["augment"]["privacy"]["epsilon"][-1])))
        assert len(log["privacy"]["epsilon"]) == 0


def test_table1_averages_the_search_alone_and_the_others_have_their_own_groups(folder: Path, tmp_path: Path,
                                                                              capsys) -> None:
    out = tmp_path / "report"
    assert main([str(folder), "--out", str(out)]) == 0, capsys.readouterr().err
    search = read_record(folder / "search" / "search.h5", folder)
    table1 = read_csv(out / "table1.csv")
    assert [(r["mode"], r["parties"], r["runs"]) for r in table1] == [("dpfnas", "2", "1")]
    assert float(table1[0]["test_error_mean"]) == pytest.approx(search.test_error)
    assert float(table1[0]["epsilon_worst"]) == pytest.approx(search.epsilon_worst)
    assert not (out / "table2.csv").exists()

    trained = read_csv(out / "trained.csv")
    # By what was trained, then the cell named (OTHER's dil_conv sorts before GIVEN's sep_conv).
    assert [(r["trained"], r["named"], r["runs"], r["epsilon_covers"]) for r in trained] == [
        (GIVEN_CELL, OTHER, "1", "augment"), (GIVEN_CELL, GIVEN, "1", "augment"),
        ("cnn-tanh", "cnn-tanh", "1", "augment")]
    assert all(r["augment_noise_variance"] for r in trained)  # private: σ_aug² given, no σ_W² column at all
    given = read_record(folder / "given" / "search.h5", folder)
    assert float(trained[0]["test_error_mean"]) == pytest.approx(0.5)
    assert float(trained[1]["test_error_mean"]) == pytest.approx(given.test_error)
    assert float(trained[1]["epsilon_worst"]) == pytest.approx(given.epsilon_worst)

    md = (out / "report.md").read_text()
    table1_md = md[md.index("## Table 1"):md.index("## Trained without a search")]
    assert [line.split(" | ")[:3] for line in table1_md.splitlines() if line.startswith("| dpfnas")] == [
        ["| dpfnas", "2", "1"]]  # σ_W² = 1: the search's
    section = md[md.index("## Trained without a search"):md.index("## Runs")]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[:2] for row in rows] == [
        [f"| {GIVEN_CELL}", f"`{escaped(OTHER)}`"], [f"| {GIVEN_CELL}", f"`{escaped(GIVEN)}`"],
        ["| cnn-tanh", "`cnn-tanh`"]]
    assert all(row.split(" | ")[-1].rstrip(" |") == "augment" for row in rows)
