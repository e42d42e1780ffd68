"""Each party's own ledger and its cap (docs/privacy.md §2.12): a party composes what it sent from its
own record and journals with rank 0's accountant, gets rank 0's ε to the last bit in an honest run, and refuses,
before it sends anything, iterations that would take it past its cap, whatever rank 0 asks. Rank 0 announces
the same count from the same function, so an honest resumed run ends within the cap instead."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, mpirun, side_by_side, warm_job

from mpi_fnas.federation.party_disk import PartyStore, party_dir
from mpi_fnas.privacy import party_ledger
from mpi_fnas.privacy.calibration import plan_privacy
from mpi_fnas.privacy.federation_ledger import FederationLedger
from mpi_fnas.privacy.params import DPParams
from mpi_fnas.runlog import read_run

PARTIES = 2
DP = [*TINY, "--set", "mode=dpfnas"]
#: TINY's ε (σ = 1, q = 8/100 on both shards, δ = 1e-5) is 2.0951 after 6 of its 8 search steps, 2.1768 after 7.
CAP = 2.1
HELPERS = Path(__file__).parent / "helpers"


def sent(run: Path, rank: int) -> int:
    return PartyStore(party_dir(run, rank)).sent_steps


# -- the pieces --------------------------------------------------------------------------------------------------
def test_each_launch_record_covers_its_iterations_up_to_the_next_launch_of_its_stage():
    record = [
        {"stage": "search", "from": 0, "train": [1.0, 0.1, 2], "val": [1.0, 0.2, 1]},
        {"stage": "augment", "from": 0, "train": [0.8, 0.05, 1], "val": [0.8, 0.0, 1]},  # the pool leaves val out
        {"stage": "search", "from": 5, "train": [1.5, 0.1, 2], "val": [1.5, 0.2, 1]},  # a resume with another σ
    ]
    train, val = party_ledger.spent_runs(record, {"search": 8, "augment": 3})
    assert train == ((0.8, 0.05, 3), (1.0, 0.1, 10), (1.5, 0.1, 6))
    assert val == ((1.0, 0.2, 5), (1.5, 0.2, 3))
    with pytest.raises(ValueError, match="runs past its search journal"):
        party_ledger.spent_runs(record, {"search": 4, "augment": 3})


def test_a_partys_caps_are_the_runs_over_the_run_and_its_own_over_earlier_runs_too():
    params = DPParams(1.0, 1.0, 1.0, 0.1, 8.0, target_epsilon=3.0, max_epsilon=2.0)
    assert params.party_caps(None) == [((2.0, "privacy.max_epsilon"), False)]
    assert params.party_caps(1.5) == [((1.5, "privacy.party_max_epsilon"), True), ((2.0, "privacy.max_epsilon"), False)]
    assert params.party_caps(9) == [((2.0, "privacy.max_epsilon"), False), ((9.0, "privacy.party_max_epsilon"), True)]
    assert DPParams(1.0, 1.0, 1.0, 0.1, 8.0).party_caps(None) == []


def test_rank_0_and_each_party_count_the_same_iterations_within_a_cap():
    """Unequal parties, one with replays charged: rank 0's count per party (its ledger) equals the party's (its own
    record), and is the largest n with ε ≤ cap."""
    cap, requested = 3.0, 200
    params = DPParams(1.0, 1.2, 1.0, 0.1, 8.0, max_epsilon=cap)
    sizes = {1: (100, 80), 2: (200, 150)}
    ledger = FederationLedger(plan_privacy([100, 200], [80, 150], params, 40))
    for _ in range(3):
        ledger.record_step()
    ledger.charge_sent([5, 3])  # party 1 sent two steps more before a crash
    rank_0 = ledger.iterations_within(cap, "search", requested)
    for rank, (n_train, n_val) in sizes.items():
        record = [{"stage": "search", "from": 0, "train": [1.0, 8.0 / n_train, 1], "val": [1.2, 8.0 / n_val, 1],
                   "sizes": [n_train, n_val], "secure": None}]
        journal = {"search": [5, 3][rank - 1]}
        releases = party_ledger.IterationReleases((1.0, 8.0 / n_train, 1), (1.2, 8.0 / n_val, 1))
        delta = party_ledger.own_delta(None, record, [n_train, n_val])
        spent = party_ledger.spent_runs(record, journal)
        allowed = party_ledger.iterations_within(cap, spent, releases, delta, None, requested)
        assert allowed == rank_0[rank - 1] and 0 < allowed < requested
        assert party_ledger.epsilon_after(spent, releases, allowed, delta, None) <= cap
        assert party_ledger.epsilon_after(spent, releases, allowed + 1, delta, None) > cap
        assert party_ledger.recorded_epsilon(record, journal, None) == ledger.epsilons()[rank - 1]
    assert rank_0.tolist() == [15, 114]  # the smaller party, with its replays, has less left


def test_a_partys_own_ledger_accounts_against_the_colluders_it_was_configured_for():
    """``privacy.colluders`` t: the party's record carries t, and its own ε from it is rank 0's to the last bit;
    read without t (a party that ignored it) the same releases would look cheaper, and its cap would allow more."""
    from mpi_fnas.privacy.release import LOCAL_VARIANCE

    parties, dimension, t, n_train, n_val = 4, 1024, 2, 200, 150
    params = DPParams(1.5, 1.5, 1.0, 0.1, 8.0, aggregation="secure", parties=parties, secure_dimension=dimension,
                      colluders=t)
    ledger = FederationLedger(plan_privacy([n_train] * parties, [n_val] * parties, params, 20))
    for _ in range(20):
        ledger.record_step()
    secure = [parties, LOCAL_VARIANCE, dimension, t]
    record = [{"stage": "search", "from": 0, "train": [1.5, 8.0 / n_train, 1], "val": [1.5, 8.0 / n_val, 1],
               "sizes": [n_train, n_val], "secure": secure}]
    own = party_ledger.recorded_epsilon(record, {"search": 20}, None)
    assert own == ledger.epsilons()[0]
    without_t = [{**record[0], "secure": secure[:3]}]
    assert party_ledger.recorded_epsilon(without_t, {"search": 20}, None) == ledger.epsilons_server()[0] < own


# -- end to end ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_party_refuses_iterations_past_its_cap_whatever_rank_0_asks(tmp_path):
    """Three runs side by side under ε cap 2.1 (6 of TINY's 8 steps):

    * an honest rank 0 under ``privacy.max_epsilon``: it plans 6 steps, finishes, and each party's own ε is the
      log's to the last bit;
    * a modified rank 0 (tests/helpers/lying_server.py) that plans and announces all 8 steps: each party refuses
      in one line before sending anything, and the log says failed;
    * ``privacy.party_max_epsilon`` alone, which rank 0 does not plan with: the same refusal, by the party's own
      cap."""
    runs = {name: tmp_path / name for name in ("honest", "lying", "own_cap")}
    lying_env = {"PYTHONPATH": str(HELPERS)}
    launches = {
        "honest": (PARTIES + 1, [*DP, "--set", f"privacy.max_epsilon={CAP}", "--out", str(runs["honest"])]),
        "lying": (PARTIES + 1, [*DP, "--set", f"privacy.max_epsilon={CAP}", "--out", str(runs["lying"])],
                  lying_env, "lying_server"),
        "own_cap": (PARTIES + 1, [*DP, "--set", f"privacy.party_max_epsilon={CAP}", "--out", str(runs["own_cap"])]),
    }
    warm, launched = side_by_side([launches.pop("honest")], list(launches.values()))  # the lying ones fail
    done = {"honest": warm[0], **dict(zip(launches, launched, strict=True))}
    assert done["honest"].returncode == 0, done["honest"].stderr[-3000:]
    log = read_run(runs["honest"] / "search.h5")
    assert log["status"] == "finished" and log["privacy"]["charged_steps"][-1].tolist() == [6, 6]
    privacy = log["privacy"]
    for rank in range(1, PARTIES + 1):
        store = PartyStore(party_dir(runs["honest"], rank))
        assert store.recorded_epsilon() == privacy["epsilon"][-1][rank - 1] <= CAP
        # Shard by shard, not only the larger ε: the party records the (σ, q, releases per iteration) rank 0 charges.
        [segment] = store.release_record()
        assert segment["train"] == [privacy["noise_multiplier_w"], privacy["sample_rate_train"][rank - 1], 1]
        assert segment["val"] == [privacy["noise_multiplier_a"], privacy["sample_rate_val"][rank - 1], 1]
    for name, key in (("lying", "privacy.max_epsilon"), ("own_cap", "privacy.party_max_epsilon")):
        out = done[name]
        assert out.returncode != 0
        lines = [line for line in out.stderr.splitlines() if "error: BudgetRefusedError" in line]
        assert lines and all(f"asks for: its own cap {key} 2.1 allows 6 after what it has sent (ε = 0, 0 "
                             "search iterations)" in line for line in lines), out.stderr[-3000:]
        failed = read_run(runs[name] / "search.h5")
        assert failed["status"] == "failed" and "BudgetRefusedError" in failed["reason"], failed["reason"]
        assert [sent(runs[name], rank) for rank in (1, 2)] == [0, 0]  # nothing left either party


@pytest.mark.slow
def test_a_resume_whose_replays_would_pass_the_cap_ends_within_it(tmp_path):
    """Under ``privacy.max_epsilon`` the plan is 6 steps; party 1 fails at step 4 after the checkpoint of step 2,
    when both parties had sent step 3 (and party 2 perhaps step 4). The resume replays them: rank 0 announces, and
    every party accepts, fewer steps than the plan's remaining 4, so the run finishes within the cap (it used to
    end past it) and every party's own ε is the log's."""
    run = tmp_path / "run"
    common = [*DP, "--set", f"privacy.max_epsilon={CAP}", "--set", "checkpoint.every_steps=2"]
    failed = mpirun(PARTIES + 1, *common, "--out", str(run), env={"MPI_FNAS_INJECT_FAULT": "1:4"}, timeout=300)
    assert failed.returncode == 1, failed.stderr[-3000:]
    before = [sent(run, rank) for rank in (1, 2)]
    assert before[0] == 3 and before[1] in (3, 4), before
    resumed = warm_job(PARTIES + 1, *common, "--resume", str(run), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = read_run(run / "search.h5")
    assert log["status"] == "finished"
    assert "privacy.max_epsilon reached: 2.1 allows" in log["reason"], log["reason"]
    charged = log["privacy"]["charged_steps"][-1]
    assert charged.max() == 6 and np.all(log["privacy"]["epsilon"][-1] <= CAP), log["privacy"]["epsilon"][-1]
    for rank in range(1, PARTIES + 1):
        assert sent(run, rank) == charged[rank - 1]
        assert PartyStore(party_dir(run, rank)).recorded_epsilon() == log["privacy"]["epsilon"][-1][rank - 1]


def test_earlier_runs_compose_shard_by_shard_when_split_alike_and_on_both_shards_otherwise(tmp_path):
    """An earlier run on the same split adds its train releases to the train ledger and its validation releases to
    the validation one; a run at another seed (another split) may have held any example in either shard, so both of
    its shards' releases count on both. The party remembers the runs it composes, so a resume composes them too."""
    from mpi_fnas.federation.party_disk import EarlierRun, PartyStore

    record = [{"stage": "augment", "from": 0, "train": [1.0, 0.1, 1], "val": [2.0, 0.2, 1], "sizes": [50, 50],
               "secure": None}]
    sent = {"search": 0, "augment": 3}
    spent = ((), ())
    same, _ = party_ledger.with_earlier(spent, None, [(record, sent, True)])
    other, _ = party_ledger.with_earlier(spent, None, [(record, sent, False)])
    assert same == (((1.0, 0.1, 3),), ((2.0, 0.2, 3),))
    assert other == (((1.0, 0.1, 3), (2.0, 0.2, 3)), ((1.0, 0.1, 3), (2.0, 0.2, 3)))
    store = PartyStore(tmp_path / "rank1")
    runs = [EarlierRun(tmp_path / "a", True), EarlierRun(tmp_path / "b", False)]
    assert store.earlier_runs(runs) == runs
    assert PartyStore(tmp_path / "rank1").earlier_runs() == runs  # a resume launched without them
    assert store.earlier_runs([EarlierRun(tmp_path / "c", True)]) == [*runs, EarlierRun(tmp_path / "c", True)]
