"""ADADP in the augmentation (``augment.optimizer: adadp``): every augment iteration makes two weight releases per
party (at W, then at W_half), and the ledger, its resume check and the planners count both.

At the same rates and σ, T/2 ADADP augment iterations must cost exactly what T plain ones cost; the planners'
bounds then halve the iterations. Also: the config refusals, the halved epoch, and the augment server's rounds.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.federation.adadp import adadp_settings
from mpi_fnas.federation.plan import augment_steps
from mpi_fnas.privacy import DPParams
from mpi_fnas.privacy.ledger import FederationLedger
from mpi_fnas.privacy.planning import plan_augment, plan_privacy
from mpi_fnas.privacy.release import AugmentReleases

ONE = [400]  # one party with equal shards: the planners stay cheap
T = 40
GENOTYPE = ("normal=sep_conv_3x3@0,skip_connect@1;normal_concat=2;"
            "reduce=max_pool_3x3@0,skip_connect@1;reduce_concat=2")


def params(**overrides: object) -> DPParams:
    values = {"noise_multiplier_w": 2.0, "noise_multiplier_a": 2.0, "clip_w": 1.0, "clip_a": 0.1,
              "expected_batch_size": 20.0, "delta": 1e-5}
    return DPParams(**{**values, **overrides})


def augment(steps: int, releases_per_step: int, sigma: float = 2.2, pool: str = "all") -> AugmentReleases:
    # pool "all": a train record and a validation record are each sampled at 30/800 per release; "train": 30/400
    rates = (30 / 800, 30 / 800) if pool == "all" else (30 / 400, 0.0)
    return AugmentReleases(noise_multiplier=sigma, clip=1.0, expected_batch_size=30.0,
                           sample_rate_train=np.full(1, rates[0]), sample_rate_val=np.full(1, rates[1]),
                           steps=steps, releases_per_step=releases_per_step)


def augment_ledger(iterations: int, releases_per_step: int, search_steps: int = 5,
                   pool: str = "all") -> FederationLedger:
    """A ledger after `search_steps` plain search iterations and `iterations` augment iterations."""
    ledger = FederationLedger(plan_privacy(ONE, ONE, params(), planned_steps=search_steps))
    for _ in range(search_steps):
        ledger.record_step()
    ledger.start_augment(augment(iterations, releases_per_step, pool=pool))
    for _ in range(iterations):
        ledger.record_augment_step()
    return ledger


def test_half_as_many_adadp_augment_iterations_cost_exactly_the_plain_epsilon():
    plain, adadp = augment_ledger(T, 1), augment_ledger(T // 2, 2)
    assert np.array_equal(adadp.epsilons(), plain.epsilons())  # exactly: the ledgers hold the same runs
    assert [t.steps for t in adadp.train] == [5 + T] and [v.steps for v in adadp.val] == [5 + T]
    assert adadp.augment_steps().tolist() == [T // 2]  # the log counts iterations
    assert np.all(augment_ledger(T // 2, 1).epsilons() < plain.epsilons())  # one release each would be cheaper
    for ledger in (plain, adadp):
        ledger.close()


def test_adadp_augment_replays_and_resume_charge_both_releases():
    ledger = augment_ledger(3, 2, pool="train")  # the validation shard keeps the search's 5 releases
    ledger.charge_sent([5], stage="augment")  # 2 replayed iterations: 4 more releases
    assert [t.steps for t in ledger.train] == [5 + 10] and [v.steps for v in ledger.val] == [5]
    assert ledger.augment_steps().tolist() == [5]
    restored = FederationLedger(ledger.plan)
    restored.load_state_dict(ledger.state_dict())
    assert restored.augment.releases_per_step == 2 and restored.augment_steps().tolist() == [5]
    assert np.array_equal(restored.epsilons(), ledger.epsilons())
    one_release = ledger.state_dict()
    one_release["augment"]["releases"]["releases_per_step"] = 1  # the ledgers hold twice what this state says
    with pytest.raises(ValueError, match="disagree"):
        FederationLedger(ledger.plan).load_state_dict(one_release)
    with pytest.raises(ValueError, match="releases per step changed"):
        ledger.start_augment(augment(3, 1, pool="train"))


def test_plan_augment_max_epsilon_allows_half_as_many_adadp_iterations():
    ledger = augment_ledger(0, 1)
    budget = float(ledger.epsilons()[0]) + 0.15  # 40 plain iterations would add about 0.22
    plain = plan_augment(ledger, augment(T, 1), params(max_epsilon=budget))
    adadp = plan_augment(ledger, augment(T, 2), params(max_epsilon=budget))
    assert 0 < plain.steps < T and adadp.steps == plain.steps // 2
    assert adadp.releases_per_step == 2


def test_plan_augment_target_epsilon_calibrates_sigma_for_every_release():
    ledger = augment_ledger(0, 1)
    target = float(ledger.epsilons()[0]) + 0.2
    plain = plan_augment(ledger, augment(T, 1, sigma=1.0), params(target_epsilon=target))
    adadp = plan_augment(ledger, augment(T // 2, 2, sigma=1.0), params(target_epsilon=target))
    assert adadp.noise_multiplier == plain.noise_multiplier  # the same T releases to cover


def test_job_planner_counts_both_augment_releases_within_max_epsilon():
    def spent(plan, releases_per_step: int) -> float:
        ledger = FederationLedger(plan_privacy(ONE, ONE, params(), planned_steps=1))
        for _ in range(plan.steps):
            ledger.record_step()
        ledger.start_augment(replace(plan.augment, releases_per_step=releases_per_step))
        for _ in range(plan.augment.steps):
            ledger.record_augment_step()
        return float(ledger.epsilons()[0])

    adadp = plan_privacy(ONE, ONE, params(max_epsilon=0.7), planned_steps=20, augment=augment(T, 2))
    assert adadp.augment.releases_per_step == 2 and adadp.augment.steps < T
    assert spent(adadp, 2) <= 0.7  # 20 search + 40 plain augment iterations: 0.67; with 80 releases 0.80
    one_release = plan_privacy(ONE, ONE, params(max_epsilon=0.7), planned_steps=20, augment=augment(T, 1))
    assert spent(one_release, 2) > 0.7  # a plan counting one release per iteration lets ADADP overspend


def test_augment_config_refusals_and_the_halved_epoch():
    with pytest.raises(ConfigError, match=r"^augment\.momentum: 0\.9 is refused with augment\.optimizer adadp") as e:
        load_config(None, ["augment.optimizer=adadp"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"augment\.optimizer"):
        load_config(None, ["augment.optimizer=adam"])
    # η₀ below augment.lr_min is fine: ADADP has no cosine schedule
    cfg = load_config(None, ["augment.optimizer=adadp", "augment.momentum=0", "augment.lr=0.001",
                             "augment.lr_min=0.01", "augment.steps_per_epoch=7", "augment.epochs=3"])
    assert augment_steps(cfg, [100]) == (4, 12)  # 7 weight releases per epoch: ⌈7/2⌉ ADADP iterations
    assert adadp_settings(cfg, private=False).tol == 0.1 and adadp_settings(cfg, private=True).tol == 1.0


