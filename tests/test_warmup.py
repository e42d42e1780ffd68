"""The W warm-up (``search.warmup_epochs``): real MPI jobs (a server and one party: A is rank 0's), FNAS and
DP-FNAS side by side.

What is checked: during the warm-up A does not move (the logged alphas of the warm-up epochs are the initial ones,
computed independently from the seed) and it moves afterwards; the parties' statistics show no H release in the
warm-up (FNAS: the validation loss is NaN there, finite after); under DP every iteration is still charged whole
(an upper bound, docs/privacy.md); a warm-up as long as the search is refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY, warm_jobs
from pre_recipe import PRE_RECIPE

from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.runlog import read_run
from mpi_fnas.space import search_space

pytestmark = pytest.mark.slow  # real MPI jobs

WARM = [*TINY, "--set", "search.epochs=3", "--set", "search.warmup_epochs=2", "--set", "search.a_lr=0.05"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup")
    outs = warm_jobs((2, [*WARM, "--set", "mode=fnas", "--out", str(root / "fnas")]),
                           (2, [*WARM, "--set", "mode=dpfnas", "--out", str(root / "dp")]))
    return root, dict(zip(("fnas", "dp"), outs, strict=True))


def _initial_alphas() -> np.ndarray:
    cfg = load_config(None, WARM[1::2])  # WARM is all --set KEY=VALUE pairs
    supernet = search_space("darts").build_supernet(cfg.space, seed=0, in_channels=3, num_classes=10)
    return supernet.alpha_softmax()["normal"].detach().numpy()


@pytest.mark.parametrize("mode", ["fnas", "dp"])
def test_a_stays_during_the_warm_up_and_moves_after(runs, mode):
    root, outs = runs
    assert outs[mode].returncode == 0, outs[mode].stderr[-3000:]
    log = read_run(root / mode / "search.h5")
    normal = log["alphas"]["normal"]  # (epochs, edges, ops): one row per epoch end
    initial = _initial_alphas()
    for epoch in (0, 1):
        np.testing.assert_allclose(normal[epoch], initial, rtol=0, atol=1e-7)
    assert np.abs(normal[2] - initial).max() > 1e-4


def test_the_warm_up_sends_no_h_and_dp_charges_whole_iterations(runs):
    root, _ = runs
    fnas = read_run(root / "fnas" / "search.h5")["metrics"]
    warm = fnas["epoch"] < 2
    assert np.isnan(fnas["val_loss"][warm]).all() and np.isfinite(fnas["val_loss"][~warm]).all()
    assert np.isfinite(fnas["train_loss"]).all()
    dp = read_run(root / "dp" / "search.h5")
    assert dp["privacy"]["charged_steps"][-1].tolist() == [12]  # 3 epochs of 4, warm-up included


def test_a_warm_up_as_long_as_the_search_is_refused():
    with pytest.raises(ConfigError, match=r"^search\.warmup_epochs: 2 leaves no epoch in which A is trained"):
        load_config(None, [*PRE_RECIPE, "search.epochs=2", "search.warmup_epochs=2"])
