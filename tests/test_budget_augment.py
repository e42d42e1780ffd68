"""The budget across the search and the augment: composed ε per party, joint planning, planning the augment alone.

The "independent" side of the ε comparisons calls dp_accounting directly, never mpi_fnas helpers: a party's two
shards each compose their own Poisson-subsampled Gaussian events (the search's W or A releases, then the augment
releases at that shard's rate), and the party's ε is the larger of the two.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from fractions import Fraction

import dp_accounting
import numpy as np
import pytest

from mpi_fnas.privacy import DPParams, calibration
from mpi_fnas.privacy.calibration import plan_augment, plan_privacy
from mpi_fnas.privacy.federation_ledger import FederationLedger
from mpi_fnas.privacy.release import AugmentReleases, augment_sample_rates
from mpi_fnas.privacy.shard_ledger import calibrate_noise_multiplier

DELTA = 1e-5
B, B_AUG = 20.0, 30.0
# Two unequal parties: party 1 has the smaller train shard, party 2 the smaller validation shard, so neither
# party's shards dominate the other's and the worst shard depends on the stage.
TRAIN, VAL = [400, 900], [700, 350]
# σ around 2 keeps every PLD here small (cheap to build), the rates (up to 0.086) keep ε well above 0.
SIGMA_W, SIGMA_A, SIGMA_AUG = 2.0, 2.5, 2.2


def dp_params(**overrides: object) -> DPParams:
    values = {"noise_multiplier_w": SIGMA_W, "noise_multiplier_a": SIGMA_A, "clip_w": 0.01, "clip_a": 0.1,
              "expected_batch_size": B, "delta": DELTA}
    return DPParams(**{**values, **overrides})


def releases(pool: str, steps: int, sigma: float = SIGMA_AUG) -> AugmentReleases:
    rate_train, rate_val = augment_sample_rates(TRAIN, VAL, B_AUG, pool)
    return AugmentReleases(sigma, 1.0, B_AUG, rate_train, rate_val, steps)


def direct_shard_epsilon(events: list[tuple[float, float, int]]) -> float:
    """dp_accounting's own PLD accountant (the ledger's grid) over (σ, q, count) events, composed in order."""
    accountant = dp_accounting.pld.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
    for sigma, q, count in events:
        if q > 0 and count > 0:
            accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count)
    return accountant.get_epsilon(DELTA)


def direct_rates(pool: str) -> list[tuple[float, float, float, float]]:
    """Per party (q_tr, q_val, augment rate of a train record, of a validation record), from the sizes alone."""
    rates = []
    for n_tr, n_val in zip(TRAIN, VAL, strict=True):
        augment_tr = B_AUG / (n_tr + n_val) if pool == "all" else B_AUG / n_tr
        augment_val = B_AUG / (n_tr + n_val) if pool == "all" else 0.0
        rates.append((B / n_tr, B / n_val, augment_tr, augment_val))
    return rates


def direct_party_epsilons(pool: str, search: list[int], augment: list[int], sigma_w: float = SIGMA_W,
                          sigma_a: float = SIGMA_A, sigma_aug: float = SIGMA_AUG) -> list[float]:
    """Each party's ε after ``search[k]`` search releases and ``augment[k]`` augment releases."""
    out = []
    for (q_tr, q_val, a_tr, a_val), n_search, n_augment in zip(direct_rates(pool), search, augment, strict=True):
        train = direct_shard_epsilon([(sigma_w, q_tr, n_search), (sigma_aug, a_tr, n_augment)])
        val = direct_shard_epsilon([(sigma_a, q_val, n_search), (sigma_aug, a_val, n_augment)])
        out.append(max(train, val))
    return out


def run_job(plan, search_steps: int, augment: AugmentReleases, augment_steps: int) -> FederationLedger:
    ledger = FederationLedger(plan)
    for _ in range(search_steps):
        ledger.record_step()
    ledger.start_augment(augment)
    for _ in range(augment_steps):
        ledger.record_step("augment")
    return ledger


# -- rates ----------------------------------------------------------------------------------------------------------


def test_augment_sample_rates_per_pool_and_refusal_in_one_line():
    rate_train, rate_val = augment_sample_rates(TRAIN, VAL, B_AUG, "all")
    assert rate_train.tolist() == pytest.approx([30 / 1100, 30 / 1250], rel=1e-15)
    assert rate_val.tolist() == rate_train.tolist()
    rate_train, rate_val = augment_sample_rates(TRAIN, VAL, B_AUG, "train")
    assert rate_train.tolist() == pytest.approx([30 / 400, 30 / 900], rel=1e-15)
    assert rate_val.tolist() == [0.0, 0.0]
    # 500 fits the pool "all" of both parties (1100, 1250) but not party 1's train shard (400).
    assert augment_sample_rates(TRAIN, VAL, 500.0, "all")[0].max() <= 1.0
    with pytest.raises(ValueError) as refused:
        augment_sample_rates(TRAIN, VAL, 500.0, "train")
    assert "\n" not in str(refused.value) and "party 1" in str(refused.value) and "400" in str(refused.value)
    with pytest.raises(ValueError, match="pool"):
        augment_sample_rates(TRAIN, VAL, B_AUG, "val")  # type: ignore[arg-type]


# -- the composition ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["all", "train"])
def test_composed_epsilon_after_search_and_augment_equals_dp_accounting(pool):
    """Per party: train ledger = W releases + augment at the train rate; val = A + augment at the val rate."""
    plan = plan_privacy(TRAIN, VAL, dp_params(), planned_steps=100)
    search_steps, augment_steps = 25, 15
    ledger = run_job(plan, search_steps, releases(pool, 40), 0)
    ledger.charge_replays(1, 3)  # party 2 replays 3 search steps
    for _ in range(augment_steps):
        ledger.record_step("augment")
    ledger.charge_replays(0, 2, stage="augment")  # party 1 replays 2 augment steps
    search, augment = [search_steps, search_steps + 3], [augment_steps + 2, augment_steps]

    expected = direct_party_epsilons(pool, search, augment)
    eps = ledger.epsilons()
    assert eps.tolist() == pytest.approx(expected, rel=1e-6)
    # Every train shard paid for the augment (a party's ε may still be its validation shard's).
    for k, (q_tr, _, augment_tr, _) in enumerate(direct_rates(pool)):
        train = direct_shard_epsilon([(SIGMA_W, q_tr, search[k]), (SIGMA_AUG, augment_tr, augment[k])])
        assert ledger.train[k].get_epsilon(DELTA) == pytest.approx(train, rel=1e-6)
        assert train > direct_shard_epsilon([(SIGMA_W, q_tr, search[k])])
    # The log's /privacy/charged_steps keeps counting the search's releases only.
    assert ledger.charged_steps().tolist() == search
    assert ledger.charged_steps("augment").tolist() == augment
    if pool == "train":  # validation records are never touched: their ledger holds the search's A releases only
        assert [v.steps for v in ledger.val] == search
        assert [t.steps for t in ledger.train] == [s + a for s, a in zip(search, augment, strict=True)]
    # The background path computes the same composition.
    try:
        ledger.submit(search_steps + augment_steps)
        (row,) = ledger.drain()
    finally:
        ledger.close()
    assert np.array_equal(row.epsilon, eps)
    assert row.charged_steps.tolist() == search and row.augment_steps.tolist() == augment
    # Each stage alone (the DPNAS protocol's augmentation ε): its own releases composed, the other stage's not.
    alone = [max(direct_shard_epsilon([(SIGMA_AUG, a_tr, n)]), direct_shard_epsilon([(SIGMA_AUG, a_val, n)]))
             for (_, _, a_tr, a_val), n in zip(direct_rates(pool), augment, strict=True)]
    assert ledger.epsilons_alone("augment").tolist() == pytest.approx(alone, rel=1e-6)
    searched = [max(direct_shard_epsilon([(SIGMA_W, q_tr, n)]), direct_shard_epsilon([(SIGMA_A, q_val, n)]))
                for (q_tr, q_val, _, _), n in zip(direct_rates(pool), search, strict=True)]
    assert ledger.epsilons_alone("search").tolist() == pytest.approx(searched, rel=1e-6)
    assert np.all(ledger.epsilons_alone("augment") < eps)


def test_augment_charges_need_start_augment_and_fixed_rates():
    plan = plan_privacy(TRAIN, VAL, dp_params(), planned_steps=10)
    ledger = FederationLedger(plan)
    with pytest.raises(RuntimeError, match="start_augment"):
        ledger.record_step("augment")
    ledger.start_augment(releases("all", 10))
    ledger.record_step("augment")
    ledger.start_augment(releases("all", 10, sigma=2.0))  # a re-planned σ_aug: allowed, the past keeps its σ
    with pytest.raises(ValueError, match="rates changed"):
        ledger.start_augment(releases("train", 10))
    with pytest.raises(ValueError, match="party index"):
        ledger.charge_replays(2, 1, stage="augment")
    with pytest.raises(ValueError, match="non-negative"):
        ledger.charge_replays(0, -1, stage="augment")
    ledger.charge_sent([1, 3], stage="augment")  # party 2 sent two augment steps the ledger never recorded
    assert ledger.charged_steps("augment").tolist() == [1, 3] and ledger.charged_steps().tolist() == [0, 0]


@pytest.mark.parametrize(("change", "match"), [
    ({"sample_rate_val": [0.1]}, "two \\(K,\\) arrays"),
    ({"sample_rate_train": [0.1, 1.5]}, r"in \[0, 1\]"),
    ({"noise_multiplier": float("inf")}, "positive and finite"),
    ({"clip": 0.0}, "clip and batch size must be > 0"),
    ({"steps": 2.5}, "non-negative integer"),
    ({"releases_per_step": 0}, "integer >= 1"),
])
def test_augment_release_constants_are_refused_when_they_cannot_be_public_facts(change, match):
    good = releases("all", 10)
    with pytest.raises(ValueError, match=match):
        replace(good, **change)


def test_the_ledger_refuses_augment_releases_or_a_state_of_another_party_count():
    ledger = FederationLedger(plan_privacy(TRAIN, VAL, dp_params(), planned_steps=10))
    one_party = AugmentReleases(SIGMA_AUG, 1.0, B_AUG, [0.1], [0.1], 10)
    with pytest.raises(ValueError, match="cover 1 parties, the ledger 2"):
        ledger.start_augment(one_party)
    state = ledger.state_dict()
    state["augment"] = {"releases": one_party.state_dict(), "steps": [0, 0], "replays": [0, 0]}
    with pytest.raises(ValueError, match="a different number of parties"):
        FederationLedger(ledger.plan).load_state_dict(state)
    with pytest.raises(ValueError, match="invalid augment step counts"):
        FederationLedger(ledger.plan).load_state_dict({**state, "augment": {**state["augment"], "steps": [0]}})


# -- planning the whole job -----------------------------------------------------------------------------------------


def test_joint_target_calibrates_one_sigma_so_the_worst_party_ends_at_the_target():
    target, search_steps, augment_steps = 0.8, 30, 40
    plan = plan_privacy(TRAIN, VAL, dp_params(target_epsilon=target), search_steps,
                        augment=releases("all", augment_steps))
    sigma = plan.params.noise_multiplier_w
    assert plan.params.noise_multiplier_a == sigma and plan.augment.noise_multiplier == sigma
    assert (plan.steps, plan.augment.steps) == (search_steps, augment_steps)
    assert plan.stop_reason == plan.augment.stop_reason == "completed"

    ledger = run_job(plan, search_steps, plan.augment, augment_steps)
    worst = ledger.epsilons().max()
    direct = max(direct_party_epsilons("all", [search_steps] * 2, [augment_steps] * 2, sigma, sigma, sigma))
    assert worst == pytest.approx(direct, rel=1e-6)
    assert worst <= target
    assert worst >= target - 0.01
    # σ is the smallest within the tolerance (1e-3): a little less noise would exceed the target.
    less = sigma - 2e-3
    assert max(direct_party_epsilons("all", [search_steps] * 2, [augment_steps] * 2, less, less, less)) > target

    # Without the augment the plan is what it always was: σ for the search alone, from the worst rate and δ. The
    # calibration itself is dp_accounting's (tests/test_accountant.py); here, that the planner asks it for these.
    alone = plan_privacy(TRAIN, VAL, dp_params(target_epsilon=target), search_steps)
    assert alone.augment is None
    expected = calibrate_noise_multiplier(target, DELTA, B / 350, search_steps, value_discretization_interval=1e-4)
    assert alone.params.noise_multiplier_w == alone.params.noise_multiplier_a == expected
    assert alone.params.noise_multiplier_w < sigma  # the augment's releases cost noise


def test_a_search_share_gives_the_search_its_part_and_the_augmentation_the_rest():
    """privacy.search_share: σ_W = σ_A so the search alone ends at share·target, σ_aug so both end at the target."""
    target, search_steps, augment_steps = 0.8, 30, 40
    sigmas = {}
    for share in (0.2, 0.6):
        plan = plan_privacy(TRAIN, VAL, dp_params(target_epsilon=target, search_share=share), search_steps,
                            augment=releases("all", augment_steps))
        sigma, sigma_aug = plan.params.noise_multiplier_w, plan.augment.noise_multiplier
        assert plan.params.noise_multiplier_a == sigma
        search_alone = max(direct_party_epsilons("all", [search_steps] * 2, [0, 0], sigma, sigma, sigma_aug))
        assert share * target - 0.01 <= search_alone <= share * target
        total = max(direct_party_epsilons("all", [search_steps] * 2, [augment_steps] * 2, sigma, sigma, sigma_aug))
        assert target - 0.01 <= total <= target
        sigmas[share] = (sigma, sigma_aug)
    # A smaller share buys the search less ε (more noise) and leaves the augmentation more (less noise).
    assert sigmas[0.2][0] > sigmas[0.6][0] and sigmas[0.2][1] < sigmas[0.6][1]


def test_joint_max_epsilon_shortens_both_stages_to_the_same_fraction():
    budget, search_planned, augment_planned = 0.8, 60, 90
    plan = plan_privacy(TRAIN, VAL, dp_params(max_epsilon=budget), search_planned,
                        augment=releases("all", augment_planned))
    steps, augment_steps = plan.steps, plan.augment.steps
    assert 0 < steps < search_planned and 0 < augment_steps < augment_planned
    # One fraction f gives both: floor(f·60) = steps and floor(f·90) = augment_steps (exact fractions).
    low = max(Fraction(steps, search_planned), Fraction(augment_steps, augment_planned))
    high = min(Fraction(steps + 1, search_planned), Fraction(augment_steps + 1, augment_planned))
    assert low < high
    assert plan.params.noise_multiplier_w == SIGMA_W and plan.augment.noise_multiplier == SIGMA_AUG  # not touched
    assert "max_epsilon reached" in plan.stop_reason and f"{steps} of {search_planned}" in plan.stop_reason
    assert f"{augment_steps} of {augment_planned} augment steps" in plan.augment.stop_reason

    def worst(n_search: int, n_augment: int) -> float:
        return max(direct_party_epsilons("all", [n_search] * 2, [n_augment] * 2))

    assert worst(steps, augment_steps) <= budget
    # The next fraction that moves anything (one more step of a stage, of both when they coincide) exceeds it.
    assert worst(math.floor(high * search_planned), math.floor(high * augment_planned)) > budget

    relaxed = plan_privacy(TRAIN, VAL, dp_params(max_epsilon=100.0), search_planned,
                           augment=releases("all", augment_planned))
    assert (relaxed.steps, relaxed.augment.steps) == (search_planned, augment_planned)
    assert relaxed.stop_reason == relaxed.augment.stop_reason == "completed"


# -- planning the augment alone -------------------------------------------------------------------------------------


def spent_ledger(search_steps: int = 30) -> FederationLedger:
    """A federation after its search: every party ran ``search_steps``; party 2 replayed 4 of them."""
    ledger = FederationLedger(plan_privacy(TRAIN, VAL, dp_params(), planned_steps=search_steps))
    for _ in range(search_steps):
        ledger.record_step()
    ledger.charge_replays(1, 4)
    return ledger


@pytest.mark.parametrize("pool", ["all", "train"])
def test_plan_augment_calibrates_sigma_to_what_the_search_left(pool):
    ledger = spent_ledger()
    spent = ledger.epsilons().max()
    target = spent + 0.2
    planned = plan_augment(ledger, releases(pool, 40, sigma=1.0), dp_params(target_epsilon=target))
    assert planned.steps == 40 and planned.stop_reason == "completed"
    sigma = planned.noise_multiplier
    ledger.start_augment(planned)
    for _ in range(planned.steps):
        ledger.record_step("augment")
    worst = ledger.epsilons().max()
    assert target - 0.01 <= worst <= target
    search = [30, 34]
    assert worst == pytest.approx(max(direct_party_epsilons(pool, search, [40, 40], sigma_aug=sigma)), rel=1e-6)
    less = max(direct_party_epsilons(pool, search, [40, 40], sigma_aug=sigma - 2e-3))
    assert less > target


def test_plan_augment_max_epsilon_allows_the_largest_number_of_steps():
    ledger = spent_ledger()
    spent = ledger.epsilons().max()
    budget = spent + 0.1  # 200 augment steps would add about 0.32
    planned = plan_augment(ledger, releases("all", 200), dp_params(max_epsilon=budget))
    steps = planned.steps
    assert 0 < steps < 200
    assert f"{steps} of 200 augment steps" in planned.stop_reason
    assert planned.noise_multiplier == SIGMA_AUG
    search = [30, 34]
    assert max(direct_party_epsilons("all", search, [steps] * 2)) <= budget
    assert max(direct_party_epsilons("all", search, [steps + 1] * 2)) > budget

    generous = plan_augment(ledger, releases("all", 20), dp_params(max_epsilon=spent + 5))
    assert generous.steps == 20 and generous.stop_reason == "completed"
    nothing = plan_augment(ledger, releases("all", 20), dp_params(max_epsilon=spent * 0.9))
    assert nothing.steps == 0 and "0 of 20 augment steps" in nothing.stop_reason
    unchanged = releases("all", 20)
    assert plan_augment(ledger, unchanged, dp_params()) is unchanged


def test_plan_augment_refuses_a_target_the_search_already_spent():
    ledger = spent_ledger()
    spent = ledger.epsilons()
    worst_party = int(np.argmax(spent)) + 1
    for target in (spent.max(), spent.max() * 0.5):
        with pytest.raises(ValueError) as refused:
            plan_augment(ledger, releases("all", 10), dp_params(target_epsilon=target))
        message = str(refused.value)
        assert "\n" not in message and "already spent" in message and f"party {worst_party}" in message, message


# -- checkpoints ----------------------------------------------------------------------------------------------------


def test_state_round_trip_with_augment_charges_and_replays():
    plan = plan_privacy(TRAIN, VAL, dp_params(), planned_steps=100)
    ledger = run_job(plan, 12, releases("train", 40), 7)  # pool "train": the val ledgers hold no augment release
    ledger.charge_replays(0, 2)
    ledger.charge_replays(1, 3, stage="augment")
    state = json.loads(json.dumps(ledger.state_dict()))
    assert state["augment"]["steps"] == [7, 10] and state["augment"]["replays"] == [0, 3]
    assert state["replays"] == [2, 0]

    restored = FederationLedger(plan)
    restored.load_state_dict(state)
    assert restored.charged_steps().tolist() == ledger.charged_steps().tolist() == [14, 12]
    assert restored.charged_steps("augment").tolist() == [7, 10]
    assert np.array_equal(restored.epsilons(), ledger.epsilons())
    for stage in ("search", "augment"):
        assert np.array_equal(restored.epsilons_alone(stage), ledger.epsilons_alone(stage))
    # A state from before each stage's releases were kept alone rebuilds them from the counts: the same ε.
    older = json.loads(json.dumps(state))
    del older["alone"]
    rebuilt = FederationLedger(plan)
    rebuilt.load_state_dict(older)
    for stage in ("search", "augment"):
        assert rebuilt.epsilons_alone(stage).tolist() == pytest.approx(ledger.epsilons_alone(stage).tolist())
    assert restored.state_dict() == ledger.state_dict()
    assert restored.augment.sample_rate_train.tolist() == ledger.augment.sample_rate_train.tolist()
    restored.record_step("augment")  # continues from the restored releases
    assert restored.charged_steps("augment").tolist() == [8, 11]

    before_augment = FederationLedger(plan)  # a state written before the augment existed loads as "none yet"
    for _ in range(5):
        before_augment.record_step()
    old = before_augment.state_dict()
    assert "augment" not in old
    restored.load_state_dict(old)
    assert restored.augment is None and restored.charged_steps("augment").tolist() == [0, 0]
    assert restored.charged_steps().tolist() == [5, 5]

    corrupt = json.loads(json.dumps(state))
    corrupt["augment"]["steps"] = [7, 9]  # party 2's train ledger holds one augment release more than this says
    with pytest.raises(ValueError, match="disagree"):
        FederationLedger(plan).load_state_dict(corrupt)


# -- the planners' shortcut -----------------------------------------------------------------------------------------


def test_the_worst_shard_is_always_among_the_non_dominated_ones():
    """The planners search only the shards no other one dominates; over random shards that loses nothing.

    Shards mix spent releases (replays included), search and augment rates (0: never touched) and δ. The
    check runs on a coarse grid (cheap); the domination argument does not depend on the grid.
    """
    rng = np.random.default_rng(7)
    sigma_w, sigma_a = 2.0, 2.5
    shards = set()
    for _ in range(14):
        spent = calibration._canonical_runs(
            [(sigma_w, float(rng.choice([0.02, 0.04])), int(rng.integers(10, 14))),
             (sigma_a, float(rng.choice([0.03, 0.05])), int(rng.integers(0, 3)))])
        search = (float(rng.choice([sigma_w, sigma_a])), float(rng.choice([0.0, 0.02, 0.05])))
        augment = (2.2, float(rng.choice([0.0, 0.01, 0.03])))
        shards.add(calibration._Shard(spent, search, augment, float(rng.choice([1e-5, 1e-6]))))
    front = calibration._front(shards)
    assert 1 < len(front) < len(shards)  # the draw exercises the shortcut
    for search_steps, augment_steps in ((0, 0), (5, 0), (3, 8)):
        everyone = calibration._worst(sorted(shards, key=repr), search_steps, augment_steps, None, 1e-3)
        assert calibration._worst(front, search_steps, augment_steps, None, 1e-3) == everyone

    # Traps: a shard with a slightly lower search rate than ``base`` that is worse on one other count, so it
    # is not dominated. A domination rule that ignored that count would drop the worst shard.
    base = calibration._Shard(((2.0, 0.02, 10),), (2.0, 0.04), (2.2, 0.02), 1e-5)
    traps = {"smaller δ": replace(base, search=(2.0, 0.039), delta=1e-9),
             "less noise": replace(base, search=(1.5, 0.039)),
             "more spent": replace(base, spent=((2.0, 0.02, 40),), search=(2.0, 0.039)),
             "higher augment rate": replace(base, search=(2.0, 0.039), augment=(2.2, 0.03))}
    for name, trap in traps.items():
        assert calibration._front({base, trap}) == sorted({base, trap}, key=repr), name
        assert calibration._worst([trap], 5, 5, None, 1e-3) > calibration._worst([base], 5, 5, None, 1e-3), name
    assert calibration._front({base, replace(base, search=(2.0, 0.039))}) == [base]
