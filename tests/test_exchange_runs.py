"""The collective exchange end to end (real MPI jobs, side by side): a secure search through the tree finishes
with the ε its releases compose to, the star's, and under reproducible noise with the star's alphas bit for bit
(the opened sums of the same uploads are the same integers: tests/mpi/test_exchange_patterns.py; the rotations are
then labelled by the seed, not by each launch's keys); under local aggregation the same ε and alphas equal up to
the float32 summation order; a party that fails mid-step ends a collective job with the log `failed`; the log says
which pattern ran and why. `auto` on this machine (more ranks than cores) is the star: every other run of the suite
takes it."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY, side_by_side
from test_secure_aggregation import reproduced_epsilons

from mpi_fnas.runlog import read_run

pytestmark = pytest.mark.slow  # real MPI jobs

PARTIES = 3  # 4 ranks: the tree 0 ← 1, 0 ← 2 ← 3 (party 2 relays party 3's words)
SECURE = [*TINY, "--set", "mode=dpfnas", "--set", "privacy.aggregation=secure", "--set", "search.steps_per_epoch=2"]
LOCAL = [*TINY, "--set", "mode=dpfnas", "--set", "search.steps_per_epoch=2"]
COLLECTIVE = ["--set", "runtime.exchange=collective"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("exchange")
    plans = {
        "secure-collective": [*SECURE, *COLLECTIVE, "--set", "privacy.reproducible_noise=true"],
        "secure-star": [*SECURE, "--set", "privacy.reproducible_noise=true"],
        "local-star": [*LOCAL, "--set", "privacy.reproducible_noise=true"],
        "local-collective": [*LOCAL, "--set", "privacy.reproducible_noise=true", *COLLECTIVE],
        "failed-collective": [*LOCAL, *COLLECTIVE],
    }
    faults = {"failed-collective": {"MPI_FNAS_INJECT_FAULT": "3:3"}}
    jobs = {name: (PARTIES + 1, [*args, "--out", str(root / name)], faults.get(name)) for name, args in plans.items()}
    finishing = [name for name in plans if name not in faults]
    warm, failed = side_by_side([jobs[name] for name in finishing], [jobs[name] for name in faults])
    return root, {**dict(zip(finishing, warm, strict=True)), **dict(zip(faults, failed, strict=True))}


def log_of(runs, name: str) -> dict:
    root, outs = runs
    if not name.startswith("failed"):
        assert outs[name].returncode == 0, outs[name].stderr[-3000:]
    return read_run(root / name / "search.h5")


def test_a_secure_search_through_the_tree_finishes_with_the_epsilon_its_releases_compose_to(runs):
    """The ε the star logs is the same composition (tests/test_secure_aggregation.py): it depends on σ, q, the
    count and D, never on the route of the masked words."""
    tree = log_of(runs, "secure-collective")
    p = tree["privacy"]
    assert tree["status"] == "finished" and p["aggregation"] == "secure"
    for k in range(PARTIES):
        for name, expected in reproduced_epsilons(p, k, PARTIES).items():
            assert p[name][-1, k] == pytest.approx(expected, rel=1e-9), (k, name)
    assert np.isfinite(tree["metrics"]["test_loss"][-1])  # the last epoch's evaluation of what the tree opened
    assert (tree["ranks"]["exchange"], tree["ranks"]["exchange_reason"]) == ("collective",
                                                                             "runtime.exchange is collective")
    assert "exchange: collective (runtime.exchange is collective)" in runs[1]["secure-collective"].stdout


def test_a_secure_search_under_reproducible_noise_repeats_bit_for_bit_whatever_the_route(runs):
    """privacy.reproducible_noise makes a secure run repeat as a local one does: every draw is keyed from the
    config, the rotations from the seed, and the masks (fresh keys each launch) cancel in the sum; so the tree's
    alphas are the star's exactly (before: two secure runs at one seed ended with different alphas)."""
    tree, star = log_of(runs, "secure-collective"), log_of(runs, "secure-star")
    assert star["ranks"]["exchange"] == "star"
    for cell in ("normal", "reduce"):
        np.testing.assert_array_equal(tree["alphas"][cell], star["alphas"][cell])


def test_a_local_search_through_mpi_reduce_keeps_its_epsilon_and_its_alphas_to_rounding(runs):
    star, tree = log_of(runs, "local-star"), log_of(runs, "local-collective")
    np.testing.assert_array_equal(tree["privacy"]["epsilon"], star["privacy"]["epsilon"])
    for cell in ("normal", "reduce"):
        np.testing.assert_allclose(tree["alphas"][cell], star["alphas"][cell], rtol=1e-4, atol=1e-6)
    assert tree["ranks"]["exchange"] == "collective"
    assert star["ranks"]["exchange"] == "star"  # auto: 4 ranks on this machine's cores
    assert star["ranks"]["exchange_reason"].startswith("auto: node ")


def test_a_party_that_fails_mid_step_ends_a_collective_job_quickly_and_marks_the_log(runs):
    _, outs = runs
    out = outs["failed-collective"]
    assert out.returncode != 0
    log = log_of(runs, "failed-collective")
    assert log["status"] == "failed" and "party rank 3 failed" in log["reason"], log["reason"]
