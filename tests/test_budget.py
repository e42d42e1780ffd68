"""The federation's budget: δ per party (default and refusal), replayed releases charged, ε off the critical path.

The "independent" side of the ε comparisons calls dp_accounting directly, never mpi_fnas helpers.
"""

from __future__ import annotations

import json
import math
import threading

import dp_accounting
import numpy as np
import pytest

from mpi_fnas.privacy import DPParams
from mpi_fnas.privacy import federation_ledger as ledger_module
from mpi_fnas.privacy.calibration import party_deltas, plan_privacy
from mpi_fnas.privacy.federation_ledger import FederationLedger

DELTA = 1e-5
# A safety net, not an assertion: a blocked worker gives up after this long, so a broken ready() fails the test
# instead of hanging the suite.
GATE_TIMEOUT_S = 30.0


def dp_params(**overrides: object) -> DPParams:
    values = {"noise_multiplier_w": 1.0, "noise_multiplier_a": 1.5, "clip_w": 0.01, "clip_a": 0.1,
              "expected_batch_size": 20.0, "delta": DELTA}
    return DPParams(**{**values, **overrides})


def direct_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    """dp_accounting's own PLD accountant (same grid as the ledger) for ``steps`` Poisson Gaussian releases."""
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


# -- δ ------------------------------------------------------------------------------------------------------------


def test_default_delta_per_party_uses_its_larger_shard():
    deltas = party_deltas([6250, 40_000, 500], [6250, 200_000, 1_000_000], None)
    assert deltas == pytest.approx([1e-5, 1 / (10 * 200_000), 1 / (10 * 1_000_000)], rel=1e-12)
    plan = plan_privacy([6250, 40_000], [6250, 200_000], dp_params(delta=None), planned_steps=10)
    assert plan.delta == pytest.approx([1e-5, 5e-7], rel=1e-12)


def test_delta_not_below_one_over_n_is_refused_in_one_line_naming_the_party():
    # Party 2's larger shard (20 000) puts the bound at 5e-5: 5e-5 itself is refused, just below is accepted.
    train, val = [100, 5_000], [100, 20_000]
    with pytest.raises(ValueError) as refused:
        party_deltas(train, val, 5e-5)
    message = str(refused.value)
    assert "\n" not in message
    assert "party 2" in message and "N_k = 20000" in message and "5e-05" in message, message
    assert party_deltas(train, val, 4.9e-5) == pytest.approx([4.9e-5, 4.9e-5])
    with pytest.raises(ValueError, match="party 2"):
        plan_privacy(train, val, dp_params(delta=5e-5), planned_steps=10)
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        party_deltas(train, val, 0.0)


# -- replays ------------------------------------------------------------------------------------------------------


def test_replays_are_charged_on_both_ledgers_like_extra_steps():
    """ε after charges == dp_accounting's composition with the extra steps; state survives JSON, replays included."""
    sizes = [400, 400, 400]  # equal shards: q_tr = q_val = 0.05 for everyone
    plan = plan_privacy(sizes, sizes, dp_params(), planned_steps=100)
    ledger = FederationLedger(plan)
    steps, replays = 40, 7
    for _ in range(steps):
        ledger.record_step()
    ledger.charge_replays(1, replays)
    ledger.charge_replays(2, 0)

    def expected(count: int) -> float:  # a party's ε is the larger of its train (σ_W) and val (σ_A) ledgers'
        return max(direct_epsilon(1.0, 0.05, count, DELTA), direct_epsilon(1.5, 0.05, count, DELTA))

    eps = ledger.epsilons()
    assert eps[1] == pytest.approx(expected(steps + replays), rel=1e-9)
    assert eps[0] == eps[2] == pytest.approx(expected(steps), rel=1e-9)
    assert eps[1] > eps[0]
    assert ledger.charged_steps().dtype == np.int64
    assert ledger.charged_steps().tolist() == [steps, steps + replays, steps]
    assert ledger.train[1].steps == ledger.val[1].steps == steps + replays  # both of party 1's shards
    val_expected = direct_epsilon(1.5, 0.05, steps + replays, DELTA)
    assert ledger.val[1].get_epsilon(DELTA) == pytest.approx(val_expected, rel=1e-9)
    mu = ledger.mu_gdp()  # Theorem 3.1 with T = charged releases, σ_W the binding one
    assert mu[1] == pytest.approx(0.05 * math.sqrt((steps + replays) * math.expm1(1.0)), rel=1e-12)

    state = json.loads(json.dumps(ledger.state_dict()))
    assert state["replays"] == [0, replays, 0]
    restored = FederationLedger(plan)
    restored.load_state_dict(state)
    assert restored.charged_steps().tolist() == ledger.charged_steps().tolist()
    assert np.array_equal(restored.epsilons(), eps)
    assert restored.state_dict() == ledger.state_dict()
    old = {key: value for key, value in state.items() if key != "replays"}  # a checkpoint from before replays
    restored.load_state_dict(old)
    assert restored.state_dict()["replays"] == [0, 0, 0]

    with pytest.raises(ValueError, match="party index"):
        ledger.charge_replays(3, 1)
    with pytest.raises(ValueError, match="non-negative"):
        ledger.charge_replays(0, -1)


# -- ε off the critical path ----------------------------------------------------------------------------------------


def test_background_rows_equal_the_synchronous_numbers_in_order_and_identical_parties_once(monkeypatch):
    sizes_tr, sizes_val = [400, 400, 1000, 1000], [400, 400, 1000, 1000]  # two pairs of identical parties
    # σ_A = σ_W and equal shards: a party's two ledgers hit the same cached PLD, which keeps this test fast.
    plan = plan_privacy(sizes_tr, sizes_val, dp_params(noise_multiplier_a=1.0), planned_steps=100)
    ledger = FederationLedger(plan)
    calls = []

    def counting_party_epsilon(train, val, delta):
        calls.append((train.steps, delta))
        return max(train.get_epsilon(delta), val.get_epsilon(delta))

    monkeypatch.setattr(ledger_module, "party_epsilon", counting_party_epsilon)
    expected = []
    try:
        for step in range(1, 31):
            ledger.record_step()
            if step == 20:
                ledger.charge_replays(0, 3)  # parties 0 and 1 stop being identical
            if step % 10 == 0:
                ledger.submit(step)
                expected.append((step, ledger.charged_steps(), ledger.epsilons(), ledger.mu_gdp()))
        rows = ledger.drain()
    finally:
        ledger.close()
    assert [row.step for row in rows] == [10, 20, 30]
    for row, (step, charged, eps, mu) in zip(rows, expected, strict=True):
        assert row.step == step
        assert np.array_equal(row.charged_steps, charged)
        assert np.array_equal(row.epsilon, eps)  # exactly: the same computation on the same counts
        assert np.array_equal(row.mu_gdp, mu)
    assert rows[2].charged_steps.tolist() == [33, 30, 30, 30]
    assert rows[2].epsilon[0] > rows[2].epsilon[1]
    # Distinct parties per row: 2, 3 (after the replay), 3; each row computed twice (synchronous + background).
    assert len(calls) == 2 * (2 + 3 + 3)
    assert ledger.ready() == [] and ledger.drain() == []


def test_ready_returns_finished_rows_without_waiting_for_a_pending_one(monkeypatch):
    plan = plan_privacy([400, 400], [400, 400], dp_params(), planned_steps=10)  # identical parties: 1 call per row
    ledger = FederationLedger(plan)
    second_started, release, gave_up = threading.Event(), threading.Event(), []

    def gated_party_epsilon(train, val, delta):
        if train.steps == 2:  # the second row blocks until the test releases it
            second_started.set()
            if not release.wait(GATE_TIMEOUT_S):
                gave_up.append(train.steps)
        return float(train.steps)

    monkeypatch.setattr(ledger_module, "party_epsilon", gated_party_epsilon)
    try:
        for step in (1, 2, 3):
            ledger.record_step()
            ledger.submit(step)
        # The worker runs rows in order: once the second has started, the first is finished.
        assert second_started.wait(GATE_TIMEOUT_S)
        first = ledger.ready()  # row 2 is blocked and row 3 queued: this must return at once, with row 1 only
        assert not gave_up, "ready() waited for the blocked computation"
        assert [row.step for row in first] == [1]
        assert first[0].epsilon.tolist() == [1.0, 1.0]
        release.set()
        rest = ledger.drain()
    finally:
        release.set()
        ledger.close()
    assert [row.step for row in rest] == [2, 3]
    assert [row.epsilon.tolist() for row in rest] == [[2.0, 2.0], [3.0, 3.0]]
    assert not any(thread.name == "privacy-epsilon" for thread in threading.enumerate())


def test_a_failed_background_computation_raises_when_its_row_is_read(monkeypatch):
    plan = plan_privacy([400], [400], dp_params(), planned_steps=10)
    ledger = FederationLedger(plan)

    def failing_party_epsilon(train, val, delta):
        raise RuntimeError("accountant broke")

    monkeypatch.setattr(ledger_module, "party_epsilon", failing_party_epsilon)
    try:
        ledger.record_step()
        ledger.submit(1)
        with pytest.raises(RuntimeError, match="accountant broke"):
            ledger.drain()
    finally:
        ledger.close()


def test_settle_keeps_the_submitted_rows_and_adds_one_for_what_was_charged_since(monkeypatch):
    """A failing run logs the ε its ledgers charged up to the failure: the rows in flight plus the charges after
    the last of them (steps 4 and 5 and a replay here); no duplicate row when nothing was charged since."""
    plan = plan_privacy([400, 400], [400, 400], dp_params(), planned_steps=10)
    monkeypatch.setattr(ledger_module, "party_epsilon", lambda train, val, delta: float(train.steps))
    ledger = FederationLedger(plan)
    for step in (1, 2, 3):
        ledger.record_step()
        ledger.submit(step)
    ledger.record_step()
    ledger.record_step()
    ledger.charge_replays(1, 2)
    rows = ledger.settle(5, timeout=GATE_TIMEOUT_S)
    assert [row.step for row in rows] == [1, 2, 3, 5]
    assert rows[-1].charged_steps.tolist() == [5, 7] and rows[-1].epsilon.tolist() == [5.0, 7.0]
    assert not any(thread.name == "privacy-epsilon" for thread in threading.enumerate())

    unchanged = FederationLedger(plan)
    unchanged.record_step()
    unchanged.submit(1)
    assert [row.step for row in unchanged.settle(1, timeout=GATE_TIMEOUT_S)] == [1]


def test_settle_gives_up_at_its_timeout_instead_of_waiting_for_a_stuck_row(monkeypatch):
    plan = plan_privacy([400], [400], dp_params(), planned_steps=10)
    release = threading.Event()

    def gated_party_epsilon(train, val, delta):
        if train.steps == 2:
            release.wait(GATE_TIMEOUT_S)
        return float(train.steps)

    monkeypatch.setattr(ledger_module, "party_epsilon", gated_party_epsilon)
    ledger = FederationLedger(plan)
    try:
        for step in (1, 2):
            ledger.record_step()
            ledger.submit(step)
        ledger.record_step()
        rows = ledger.settle(3, timeout=0.5)  # row 2 is stuck: row 1 only, and settle returns
    finally:
        release.set()
    assert [row.step for row in rows] == [1]


def test_charge_sent_charges_each_stage_only_what_a_party_sent_beyond_the_ledger():
    sizes = [400, 400, 400]
    plan = plan_privacy(sizes, sizes, dp_params(), planned_steps=100)
    ledger = FederationLedger(plan)
    for _ in range(4):
        ledger.record_step()
    ledger.charge_sent([4, 6, 3])  # party 2 sent two steps the ledger never saw; party 3's count is behind
    assert ledger.charged_steps().tolist() == [4, 6, 4]
    assert ledger.state_dict()["replays"] == [0, 2, 0]
