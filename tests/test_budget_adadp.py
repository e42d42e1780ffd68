"""ADADP's accounting in both stages: an ADADP iteration makes two weight releases per party (the search: G1, G2
on the train shard and one H on the validation shard; the augmentation: two gradients of the pool, at W and at
W_half), and the ledger, its resume check and the planners count both.

At the same rates and σ, T/2 ADADP iterations must cost exactly what T plain iterations cost (Koskela & Honkela,
Theorem 2: the budget allows half as many ADADP steps). Each behaviour is one test over both stages.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.federation.adadp import adadp_settings
from mpi_fnas.federation.job_plan import augment_steps
from mpi_fnas.privacy import DPParams, calibration
from mpi_fnas.privacy.calibration import plan_augment, plan_privacy
from mpi_fnas.privacy.federation_ledger import STAGES, FederationLedger
from mpi_fnas.privacy.release import AugmentReleases
from mpi_fnas.sweep.composition import compose_pool
from mpi_fnas.sweep.results import LogReleases

SIZES = [400, 400]  # the search's two parties, equal train and validation shards: q_tr = q_val
ONE = [400]  # the augmentation's one party with equal shards: the planners stay cheap
SEARCH_BEFORE_AUGMENT = 5  # plain search iterations the augmentation's ledger holds first
T = 40


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


def ledger_after(stage: str, iterations: int, releases_per_step: int, pool: str = "all") -> FederationLedger:
    """A ledger that charged `iterations` iterations of `stage`, each making `releases_per_step` weight releases:
    the search's on two parties, the augmentation's on one party after SEARCH_BEFORE_AUGMENT plain search ones."""
    if stage == "search":
        ledger = FederationLedger(plan_privacy(SIZES, SIZES, params(), planned_steps=iterations,
                                               w_releases_per_step=releases_per_step))
    else:
        ledger = FederationLedger(plan_privacy(ONE, ONE, params(), planned_steps=SEARCH_BEFORE_AUGMENT))
        for _ in range(SEARCH_BEFORE_AUGMENT):
            ledger.record_step()
        ledger.start_augment(augment(iterations, releases_per_step, pool=pool))
    for _ in range(iterations):
        ledger.record_step(stage)
    return ledger


def iterations(ledger: FederationLedger, stage: str) -> list[int]:
    """The iterations of `stage` the ledger counts per party (what the log records)."""
    return ledger.charged_steps(stage).tolist()


def shard_releases(ledger: FederationLedger) -> tuple[list[int], list[int]]:
    """The releases each party's train and validation ledgers hold."""
    return [t.steps for t in ledger.train], [v.steps for v in ledger.val]


@pytest.mark.parametrize("stage", STAGES)
def test_half_as_many_adadp_iterations_cost_exactly_the_plain_epsilon(stage):
    plain, adadp = ledger_after(stage, T, 1), ledger_after(stage, T // 2, 2)
    assert np.array_equal(adadp.epsilons(), plain.epsilons())  # exactly: the ledgers hold the same runs
    # The search's validation shard pays one H per iteration; the augmentation's pool (pool all) two gradients.
    expected = {"search": ([T, T], [T // 2, T // 2]), "augment": ([5 + T], [5 + T])}[stage]
    assert shard_releases(adadp) == expected
    assert iterations(adadp, stage) == [T // 2] * len(adadp.train)  # the log counts iterations
    # One release per iteration would be cheaper: the equality above is not a coincidence of the grid.
    assert np.all(ledger_after(stage, T // 2, 1).epsilons() < plain.epsilons())
    for ledger in (plain, adadp):
        ledger.close()


@pytest.mark.parametrize("stage", STAGES)
def test_adadp_replays_and_resume_charge_both_releases(stage):
    ledger = ledger_after(stage, 3, 2, pool="train")  # the augmentation's validation shard keeps the search's 5
    sent = {"search": [5, 3], "augment": [5]}[stage]
    ledger.charge_sent(sent, stage=stage)  # party 1 replays 2 iterations: 4 more weight releases
    expected = {"search": ([10, 6], [5, 3]), "augment": ([5 + 10], [5])}[stage]
    assert shard_releases(ledger) == expected
    restored = FederationLedger(ledger.plan)
    restored.load_state_dict(ledger.state_dict())
    assert iterations(restored, stage) == sent
    assert np.array_equal(restored.epsilons(), ledger.epsilons())
    # A state that says one release per iteration while the ledgers hold two is refused.
    state, plan = ledger.state_dict(), plan_privacy(SIZES, SIZES, params(), planned_steps=3)
    if stage == "augment":
        state["augment"]["releases"]["releases_per_step"] = 1
        plan = ledger.plan
    with pytest.raises(ValueError, match="disagree"):
        FederationLedger(plan).load_state_dict(state)
    if stage == "augment":
        with pytest.raises(ValueError, match="releases per step changed"):
            ledger.start_augment(augment(3, 1, pool="train"))


def max_epsilon_plan(stage: str, releases_per_step: int) -> tuple[int, int]:
    """(iterations, releases per iteration) the planner allows `stage` under a max_epsilon the plain plan of T
    iterations exceeds."""
    if stage == "search":
        plan = plan_privacy(ONE, ONE, params(max_epsilon=0.6), planned_steps=T // releases_per_step,
                            w_releases_per_step=releases_per_step)
        return plan.steps, plan.w_releases_per_step
    ledger = ledger_after("augment", 0, 1)
    budget = float(ledger.epsilons()[0]) + 0.15  # 40 plain iterations would add about 0.22
    plan = plan_augment(ledger, augment(T, releases_per_step), params(max_epsilon=budget))
    return plan.steps, plan.releases_per_step


@pytest.mark.parametrize("stage", STAGES)
def test_max_epsilon_allows_half_as_many_adadp_iterations(stage):
    plain, adadp = max_epsilon_plan(stage, 1), max_epsilon_plan(stage, 2)
    assert 0 < plain[0] < T and adadp == (plain[0] // 2, 2)


def test_target_epsilon_calibrates_the_search_sigma_for_every_w_release(monkeypatch):
    # The calibration itself is dp_accounting's (slow at the ledger's grid): here, what it is asked to cover.
    asked: list[int] = []

    def spy(target_epsilon: float, delta: float, sample_rate: float, num_steps: int) -> float:
        asked.append(num_steps)
        return 1.0

    monkeypatch.setattr(calibration, "calibrate_noise_multiplier", spy)
    plan_privacy(SIZES, SIZES, params(target_epsilon=3.0), planned_steps=T)
    plan_privacy(SIZES, SIZES, params(target_epsilon=3.0), planned_steps=T // 2, w_releases_per_step=2)
    assert asked == [T, T]


def test_target_epsilon_calibrates_the_augment_sigma_for_every_release():
    ledger = ledger_after("augment", 0, 1)
    target = float(ledger.epsilons()[0]) + 0.2
    plain = plan_augment(ledger, augment(T, 1, sigma=1.0), params(target_epsilon=target))
    adadp = plan_augment(ledger, augment(T // 2, 2, sigma=1.0), params(target_epsilon=target))
    assert adadp.noise_multiplier == plain.noise_multiplier  # the same T releases to cover


@pytest.mark.parametrize("stage", STAGES)
def test_job_planner_counts_both_releases_within_max_epsilon(stage):
    budget = 0.7  # 20 search + 40 plain augment iterations: 0.67

    def plan(releases_per_step: int):
        search_releases = releases_per_step if stage == "search" else 1
        augment_releases = releases_per_step if stage == "augment" else 1
        return plan_privacy(ONE, ONE, params(max_epsilon=budget), planned_steps=20,
                            augment=augment(T, augment_releases), w_releases_per_step=search_releases)

    def spent(job) -> float:
        """ε of a ledger charging ADADP's two releases per `stage` iteration for the plan's steps of both stages."""
        ledger = FederationLedger(plan_privacy(ONE, ONE, params(), planned_steps=1,
                                               w_releases_per_step=2 if stage == "search" else 1))
        for _ in range(job.steps):
            ledger.record_step()
        ledger.start_augment(replace(job.augment, releases_per_step=2 if stage == "augment" else 1))
        for _ in range(job.augment.steps):
            ledger.record_step("augment")
        return float(ledger.epsilons()[0])

    adadp = plan(2)
    planned = {"search": (adadp.w_releases_per_step, adadp.steps, 20),
               "augment": (adadp.augment.releases_per_step, adadp.augment.steps, T)}[stage]
    assert planned[0] == 2 and planned[1] < planned[2]
    assert spent(adadp) <= budget
    assert spent(plan(1)) > budget  # a plan counting one release per iteration lets ADADP overspend


def test_sweep_composition_counts_both_w_releases_of_an_adadp_log():
    def log(iterations: int, w_releases: int) -> LogReleases:
        return LogReleases(log="x/search.h5", data_pool="pool", placement="one", sample_rate_train=(0.05,),
                           sample_rate_val=(0.05,), noise_multiplier_w=(1.1,), noise_multiplier_a=(1.1,),
                           delta=(1e-5,), releases=(iterations,), exact=True, w_releases_per_step=w_releases)

    plain, adadp = compose_pool("pool", [log(T, 1)]), compose_pool("pool", [log(T // 2, 2)])
    assert adadp.per_party == plain.per_party
    assert compose_pool("pool", [log(T // 2, 1)]).epsilon < plain.epsilon


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
