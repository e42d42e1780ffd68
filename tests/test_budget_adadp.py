"""ADADP's accounting: each iteration charges the train shard twice (G1, G2) and the validation shard once (H).

At the same q and σ, T/2 ADADP iterations must cost exactly what T plain iterations cost (Koskela & Honkela,
Theorem 2: the budget allows half as many ADADP steps), in the ledger, the resume check and the planners.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpi_fnas.privacy import DPParams
from mpi_fnas.privacy import planning as planning_module
from mpi_fnas.privacy.ledger import FederationLedger
from mpi_fnas.privacy.planning import plan_privacy
from mpi_fnas.privacy.release import AugmentReleases
from mpi_fnas.sweep.composition import compose_pool
from mpi_fnas.sweep.results import LogReleases

SIZES = [400, 400]  # equal train and validation shards: q_tr = q_val, so the train ledger binds in both runs
T = 40


def params(**overrides: object) -> DPParams:
    values = {"noise_multiplier_w": 1.1, "noise_multiplier_a": 1.1, "clip_w": 1.0, "clip_a": 0.1,
              "expected_batch_size": 20.0, "delta": 1e-5}
    return DPParams(**{**values, **overrides})


def run_ledger(w_releases: int, iterations: int) -> FederationLedger:
    plan = plan_privacy(SIZES, SIZES, params(), planned_steps=iterations, w_releases_per_step=w_releases)
    ledger = FederationLedger(plan)
    for _ in range(iterations):
        ledger.record_step()
    return ledger


def test_half_as_many_adadp_iterations_cost_exactly_the_plain_epsilon():
    plain, adadp = run_ledger(1, T), run_ledger(2, T // 2)
    assert np.array_equal(adadp.epsilons(), plain.epsilons())  # exactly: the train ledgers are identical
    assert [t.steps for t in adadp.train] == [T, T] and [v.steps for v in adadp.val] == [T // 2, T // 2]
    assert adadp.charged_steps().tolist() == [T // 2, T // 2]  # the log counts iterations
    # One release per iteration would be cheaper: the equality above is not a coincidence of the grid.
    assert np.all(run_ledger(1, T // 2).epsilons() < plain.epsilons())
    plain.close()
    adadp.close()


def test_adadp_replays_and_resume_charge_both_w_releases():
    ledger = run_ledger(2, 3)
    ledger.charge_sent([5, 3])  # party 1 replays 2 iterations: 4 more W releases, 2 more A releases
    assert [t.steps for t in ledger.train] == [10, 6] and [v.steps for v in ledger.val] == [5, 3]
    restored = FederationLedger(ledger.plan)
    restored.load_state_dict(ledger.state_dict())
    assert restored.charged_steps().tolist() == [5, 3]
    assert np.array_equal(restored.epsilons(), ledger.epsilons())
    plain_plan = plan_privacy(SIZES, SIZES, params(), planned_steps=3)
    with pytest.raises(ValueError, match="disagree"):  # a state of ADADP's ledgers under a one-release plan
        FederationLedger(plain_plan).load_state_dict(ledger.state_dict())


def test_max_epsilon_allows_half_as_many_adadp_iterations():
    one = [400]  # one party: the planner's binary search stays cheap
    plain = plan_privacy(one, one, params(max_epsilon=2.0), planned_steps=40)
    adadp = plan_privacy(one, one, params(max_epsilon=2.0), planned_steps=20, w_releases_per_step=2)
    assert plain.steps < 40 and adadp.steps == plain.steps // 2
    assert adadp.w_releases_per_step == 2


def test_target_epsilon_calibrates_sigma_for_every_w_release(monkeypatch):
    # The calibration itself is dp_accounting's (slow at the ledger's grid): here, what it is asked to cover.
    asked: list[int] = []

    def spy(target_epsilon: float, delta: float, sample_rate: float, num_steps: int) -> float:
        asked.append(num_steps)
        return 1.0

    monkeypatch.setattr(planning_module, "calibrate_noise_multiplier", spy)
    plan_privacy(SIZES, SIZES, params(target_epsilon=3.0), planned_steps=T)
    plan_privacy(SIZES, SIZES, params(target_epsilon=3.0), planned_steps=T // 2, w_releases_per_step=2)
    assert asked == [T, T]


def test_job_planner_with_augment_keeps_adadp_within_max_epsilon():
    one = [400]
    augment = AugmentReleases(noise_multiplier=1.0, clip=1.0, expected_batch_size=20.0,
                              sample_rate_train=np.full(1, 20 / 800), sample_rate_val=np.full(1, 20 / 800), steps=20)

    def spent(plan, charged_releases: int) -> float:
        """ε of a ledger charging ``charged_releases`` W releases per iteration the plan's steps of both stages."""
        ledger = FederationLedger(plan_privacy(one, one, params(), planned_steps=1,
                                               w_releases_per_step=charged_releases))
        for _ in range(plan.steps):
            ledger.record_step()
        ledger.start_augment(plan.augment)
        for _ in range(plan.augment.steps):
            ledger.record_augment_step()
        return float(ledger.epsilons()[0])

    adadp = plan_privacy(one, one, params(max_epsilon=2.0), planned_steps=20, augment=augment, w_releases_per_step=2)
    assert adadp.w_releases_per_step == 2 and adadp.steps < 20
    assert spent(adadp, 2) <= 2.0
    # A plan that counted one W release per iteration would let ADADP overspend.
    one_release = plan_privacy(one, one, params(max_epsilon=2.0), planned_steps=20, augment=augment)
    assert spent(one_release, 2) > 2.0


def test_sweep_composition_counts_both_w_releases_of_an_adadp_log():
    def log(iterations: int, w_releases: int) -> LogReleases:
        return LogReleases(log="x/search.h5", data_pool="pool", placement="one", sample_rate_train=(0.05,),
                           sample_rate_val=(0.05,), noise_multiplier_w=(1.1,), noise_multiplier_a=(1.1,),
                           delta=(1e-5,), releases=(iterations,), exact=True, w_releases_per_step=w_releases)

    plain, adadp = compose_pool("pool", [log(T, 1)]), compose_pool("pool", [log(T // 2, 2)])
    assert adadp.per_party == plain.per_party
    assert compose_pool("pool", [log(T // 2, 1)]).epsilon < plain.epsilon
