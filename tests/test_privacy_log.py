"""A DP run's HDF5 /privacy group: every logged ε and μ is reproduced by an independent recomputation.

The recomputation uses dp_accounting directly (not mpi_fnas.privacy) from what the log itself records
(sample rates, noise multipliers, δ, the releases charged to each party), and the closed form of Theorem 3.1
for μ.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from conftest import warm_job
from pre_recipe import PRE_RECIPE_ARGS

from mpi_fnas.runlog import read_run

pytestmark = pytest.mark.slow  # real MPI jobs


def pld_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


@pytest.fixture(scope="module")
def dp_log(tmp_path_factory) -> dict:
    run = tmp_path_factory.mktemp("dp") / "run"
    out = warm_job(4, *PRE_RECIPE_ARGS, "--set", "mode=dpfnas", "--set", "data.train_size=600",
             "--set", "data.partition=dirichlet",
             "--set", "data.dirichlet_alpha=1.0", "--set", "data.test_size=20", "--set", "data.image_size=8",
             "--set", "space.channels=4", "--set", "space.nodes=1", "--set", "search.batch_size=8",
             "--set", "search.epochs=2", "--set", "search.steps_per_epoch=3", "--set", "privacy.noise_multiplier_a=1.3",
             "--set", "privacy.clip_w=0.01", "--set", "privacy.aggregation=local",  # the PLD path is what is checked
             "--set", "runtime.log_every=2", "--set", "runtime.progress=off",
             "--set", "augment.epochs=0",  # the search's /privacy is what is checked: no augmentation
           "--out", str(run))
    assert out.returncode == 0, out.stderr
    log = read_run(run / "search.h5")
    log["stdout"] = out.stdout
    return log


def test_privacy_group_records_the_plan(dp_log):
    p = dp_log["privacy"]
    assert dp_log["mode"] == "dpfnas" and dp_log["parties"] == 3
    assert p["epsilon"].shape == (len(p["steps"]), 3) and p["mu_gdp"].shape == p["epsilon"].shape
    np.testing.assert_array_equal(p["steps"], [2, 3, 4, 6])  # every 2nd step and every epoch end
    assert "PLD" in p["accountant"]
    assert p["clip_w"] == 0.01 and p["clip_a"] == 0.1
    assert float(p["noise_multiplier_w"]) == 1.0 and float(p["noise_multiplier_a"]) == 1.3
    # Dirichlet shards differ in size, so the rates (and the ε) differ per party: q = B / N_k.
    assert len(set(np.round(p["sample_rate_train"], 12))) > 1
    assert np.all(p["delta"] <= 1e-5)


def test_logged_epsilon_is_reproduced_independently(dp_log):
    p = dp_log["privacy"]
    # No crash, no replay: every party has been charged exactly one release per shard and step.
    np.testing.assert_array_equal(p["charged_steps"], np.repeat(p["steps"][:, None], 3, axis=1))
    for row in (0, len(p["steps"]) - 1):  # the first and the last row (each composition takes half a second)
        for k in range(3):
            steps = int(p["charged_steps"][row, k])
            d = float(p["delta"][k])
            expected = max(pld_epsilon(float(p["sample_rate_train"][k]), float(p["noise_multiplier_w"]), int(steps), d),
                           pld_epsilon(float(p["sample_rate_val"][k]), float(p["noise_multiplier_a"]), int(steps), d))
            assert p["epsilon"][row, k] == pytest.approx(expected, rel=1e-9)
            mu = max(float(q) * math.sqrt(int(steps) * (math.exp(1 / s**2) - 1))
                     for q, s in ((p["sample_rate_train"][k], float(p["noise_multiplier_w"])),
                                  (p["sample_rate_val"][k], float(p["noise_multiplier_a"]))))
            assert p["mu_gdp"][row, k] == pytest.approx(mu, rel=1e-12)
    assert np.all(np.diff(p["epsilon"], axis=0) > 0)  # ε only grows


def test_summary_reports_the_worst_and_best_party(dp_log):
    eps = dp_log["privacy"]["epsilon"][-1]
    assert f"ε = {eps.max():.4g} (worst party) … {eps.min():.4g} (best)" in dp_log["stdout"]
    assert "not released under DP" in dp_log["stdout"]
