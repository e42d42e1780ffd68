"""``privacy.aggregation: secure`` end to end (docs/privacy.md §8): a DP-FNAS search whose parties seal
their releases (integer encoding, 1/K of the noise, pairwise masks) and whose rank 0 opens only the sums; the log
records the aggregation and both ε (against the server, and with K − 1 colluders), each reproduced from the logged
public constants; a dead party ends the job; and what secure aggregation cannot serve is refused in one line. The
augmentation's secure releases are spied in tests/mpi/test_release_spy_secure.py, which also checks its log."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from conftest import TINY, mpirun, side_by_side, warm_job

from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.federation.flat import numel
from mpi_fnas.federation.party_disk import PartyStore, party_dir
from mpi_fnas.identities import main as make_identities_command
from mpi_fnas.privacy.release import LOCAL_VARIANCE
from mpi_fnas.runlog import read_run
from mpi_fnas.secagg.accounting import SecureCharge, SummedDiscreteGaussian, composed_rdp, epsilon
from mpi_fnas.secagg.encoding import padded_length, sensitivity
from mpi_fnas.secagg.identities import identity_key_path
from mpi_fnas.space import search_space

pytestmark = pytest.mark.slow  # real jobs

PARTIES = 2


@pytest.fixture(scope="module")
def secure_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("secure") / "run"
    out = warm_job(PARTIES + 1, *TINY, "--set", "mode=dpfnas", "--set", "privacy.aggregation=secure",
                   "--out", str(run), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return read_run(run / "search.h5"), out.stdout


def independent_epsilon(sigma_and_rates: list[tuple[float, float, int]], delta: float, noisy: int,
                        dimension: int, parties: int) -> float:
    """ε of releases (σ, q, count) as the accountant's parts compose them: each of the K = `parties` parties adds
    N_Z(0, 8000²) to an encoding with c/γ = √(K·8000²)/σ, accounted at the run's `dimension`."""
    charges = []
    for sigma, rate, count in sigma_and_rates:
        units = math.sqrt(parties * LOCAL_VARIANCE) / sigma
        bound = sensitivity(units, dimension)
        charges.append(SecureCharge(SummedDiscreteGaussian.of_record(bound, dimension, LOCAL_VARIANCE, noisy), rate,
                                    count))
    return epsilon(composed_rdp(charges), delta)


def accounted_dimension(privacy: dict) -> int:
    """D, as the log's accountant line states it (``D<=…``)."""
    return int(re.search(r"D<=(\d+)", privacy["accountant"]).group(1))


def reproduced_epsilons(privacy: dict, k: int, parties: int) -> dict[str, float]:
    """Party `k`'s last ``epsilon`` (all `parties` noises count) and ``epsilon_collusion`` (its own noise alone),
    composed independently from the log's public facts: its σ, q and charged steps on each shard, δ and D."""
    steps = int(privacy["charged_steps"][-1, k])
    shards = ([(float(privacy["noise_multiplier_w"]), float(privacy["sample_rate_train"][k]), steps)],
              [(float(privacy["noise_multiplier_a"]), float(privacy["sample_rate_val"][k]), steps)])
    delta, dimension = float(privacy["delta"][k]), accounted_dimension(privacy)
    return {name: max(independent_epsilon(shard, delta, noisy, dimension, parties=parties) for shard in shards)
            for name, noisy in (("epsilon", parties), ("epsilon_collusion", 1))}


def test_a_secure_run_logs_both_epsilons_each_reproduced(secure_run):
    log, stdout = secure_run
    p = log["privacy"]
    assert p["aggregation"] == "secure" and "KLS21" in p["accountant"]
    assert log["privacy_guarantee"] == "holds" and log["status"] == "finished"
    # The accounted dimension, as the accountant's line states it, is the run's largest release, padded: the
    # supernet's W (no augmentation here).
    cfg = load_config(None, [*TINY[1::2], "mode=dpfnas"])
    supernet = search_space(cfg.space.kind).build_supernet(cfg.space, seed=0, in_channels=3, num_classes=10)
    assert accounted_dimension(p) == padded_length(numel(supernet.weights()))
    k = 0  # both parties hold equal shards here: party 1's last search row
    for name, expected in reproduced_epsilons(p, k, PARTIES).items():
        assert p[name][-1, k] == pytest.approx(expected, rel=1e-9), name
    assert np.all(p["epsilon_collusion"] > p["epsilon"])
    assert "against the server (secure aggregation" in stdout and "collude with the server" in stdout


def test_secure_aggregation_is_the_dp_default_and_refuses_a_selection_in_one_line_naming_local():
    """Secure by default: ``mode: dpfnas`` aggregates securely unless the config says ``local``; a selection, which
    needs each party's own release, is refused in one line that says which key to set (the default or asked for)."""
    assert load_config(None, []).privacy.aggregation == "secure" and load_config(None, []).mode == "dpfnas"
    for asked in ([], ["privacy.aggregation=secure"]):
        with pytest.raises(ConfigError, match=r"privacy\.aggregation: secure.*federation\.selection random.*set "
                                              r"privacy\.aggregation: local") as refused:
            load_config(None, ["mode=dpfnas", *asked, "federation.selection=random", "federation.select=1"])
        assert "\n" not in str(refused.value)
    assert load_config(None, ["privacy.aggregation=local", "federation.selection=random",
                              "federation.select=1"]).federation.selection == "random"


def test_target_epsilon_calibrates_sigma_on_the_secure_accountant():
    """The planner calibrates σ_W = σ_A with the secure accountant (not the local PLD): the worst party ends at
    most at the target, and a σ one tolerance smaller would exceed it; max_epsilon cuts the steps on it too."""
    from mpi_fnas.privacy import DPParams
    from mpi_fnas.privacy.calibration import plan_privacy
    from mpi_fnas.privacy.shard_ledger import PrivacyLedger

    params = DPParams(1.0, 1.0, 1.0, 0.1, 8.0, target_epsilon=3.0, aggregation="secure", parties=2,
                      secure_dimension=2**15)
    plan = plan_privacy([160, 200], [160, 200], params, planned_steps=30)
    sigma, accounting, delta = plan.params.noise_multiplier_w, params.secure_accounting, float(plan.delta.min())

    def worst(s: float, steps: int = 30) -> float:
        return accounting.epsilon([(s, 8 / 160, steps)], delta)

    assert plan.params.noise_multiplier_a == sigma
    assert worst(sigma) <= 3.0 < worst(sigma - 2e-3)
    # The local path's tight PLD at that σ is below the target: the bound costs noise (docs/privacy.md §8).
    assert PrivacyLedger.from_runs(((sigma, 8 / 160, 30),)).get_epsilon(delta) < 3.0
    capped = plan_privacy([160, 200], [160, 200], DPParams(1.0, 1.0, 1.0, 0.1, 8.0, max_epsilon=2.0,
                                                            aggregation="secure", parties=2,
                                                            secure_dimension=2**15), 30)
    assert worst(1.0, capped.steps) <= 2.0 < worst(1.0, capped.steps + 1) and capped.steps < 30


def test_a_party_that_dies_mid_step_ends_a_secure_job_and_no_partial_sum_is_used(tmp_path):
    """Under secure aggregation a dead party leaves its peers' masks uncancelled: the job must end (non-zero, quickly)
    with the log marked failed and the ε of what was sent, never open a sum of K − 1 uploads."""
    run = tmp_path / "run"
    out = mpirun(PARTIES + 1, *TINY, "--set", "mode=dpfnas", "--set", "privacy.aggregation=secure", "--out", str(run),
                 env={"MPI_FNAS_INJECT_FAULT": "2:3"}, timeout=180)
    assert out.returncode != 0
    log = read_run(run / "search.h5")
    assert log["status"] == "failed" and "party rank 2 failed" in log["reason"]
    # Step 3's sum never opened. Step 2's row is usually logged too, but under load rank 0 can still be polling its
    # step-2 broadcast when rank 2's notice arrives, and it fails that step before the row (it still charges it).
    assert 1 <= len(log["metrics"]["step"]) <= 2
    assert log["privacy"]["steps"][-1] >= 2 and np.all(log["privacy"]["epsilon"][-1] > 0)


def test_an_interrupted_secure_run_resumes_with_fresh_keys_and_charges_every_release(tmp_path):
    """Resume under secure aggregation: the resumed launch runs its own key round with every party (a party that
    skipped it could not seal a release), finishes, and the ledger charges all 8 steps of every party."""
    run = tmp_path / "run"
    secure = [*TINY, "--set", "mode=dpfnas", "--set", "privacy.aggregation=secure", "--set", "checkpoint.every_steps=2"]
    stopped = warm_job(PARTIES + 1, *secure, "--out", str(run), env={"MPI_FNAS_STOP_AFTER": "4"}, timeout=300)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    resumed = warm_job(PARTIES + 1, *secure, "--resume", str(run), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = read_run(run / "search.h5")
    assert log["status"] == "finished" and log["attempts"] == 2
    np.testing.assert_array_equal(log["privacy"]["charged_steps"][-1], [8, 8])
    assert np.all(np.isfinite(log["metrics"]["test_acc"][-1:]))


def test_a_secure_run_with_party_identities_finishes_and_a_party_outside_the_roster_stops_it(tmp_path):
    """Against a server that substitutes keys: with ``privacy.party_identities`` (made by
    ``python -m mpi_fnas.identities``) an honest secure run signs and checks every key and finishes. A second run
    whose party 2 holds a key the roster does not name stops in one line from that party (under DP too: the refusal
    is public), quickly, the log marked failed: also when another party reports its setup late (party 1 sleeps 5 s
    first), so the refusal cannot end the job before rank 0 has every report and its log open (CI once saw no log:
    the identity was read after the setup report, and its notice overtook party 1's report)."""
    runs = {name: tmp_path / name for name in ("honest", "stranger")}
    for run in runs.values():
        assert make_identities_command([str(run), "--parties", str(PARTIES)]) == 0
    stranger_key = identity_key_path(runs["stranger"] / "parties" / "rank2")
    stranger_key.unlink()
    assert make_identities_command([str(tmp_path / "elsewhere"), "--parties", str(PARTIES)]) == 0
    identity_key_path(tmp_path / "elsewhere" / "parties" / "rank2").rename(stranger_key)
    secure = [*TINY, "--set", "mode=dpfnas", "--set", "privacy.aggregation=secure"]
    late_setup = {"honest": {}, "stranger": {"MPI_FNAS_INJECT_SLEEP": "1:0:5"}}
    honest, stranger = (results[0] for results in side_by_side(*[  # the stranger's job fails: a launch of its own
        [(PARTIES + 1, [*secure, "--set", f"privacy.party_identities={run / 'party_identities.yaml'}", "--out",
                        str(run)], late_setup[name])] for name, run in runs.items()]))
    assert honest.returncode == 0, honest.stderr[-3000:]
    log = read_run(runs["honest"] / "search.h5")
    assert log["status"] == "finished" and len(log["metrics"]["step"]) == 8
    for rank in range(1, PARTIES + 1):  # each party's own ledger: the secure RDP bound, the log's ε
        assert PartyStore(party_dir(runs["honest"], rank)).recorded_epsilon() == log["privacy"]["epsilon"][-1][rank - 1]
    assert stranger.returncode != 0
    refusal = [line for line in stranger.stderr.splitlines() if line.startswith("[mpi_fnas rank 2] error:")]
    assert len(refusal) == 1 and "holds another key at rank 2" in refusal[0], stranger.stderr[-3000:]
    failed = read_run(runs["stranger"] / "search.h5")
    assert failed["status"] == "failed" and "party rank 2 failed: IdentityError" in failed["reason"]
