"""The augmentation: the searched cell trained from scratch across the parties (real jobs of 2 parties, run in the
tests' warm ranks: conftest.warm_jobs).

What is checked: it learns (exact gradients; how well DP-FNAS's learns is a benchmark), it trains exactly a given
genotype with the size an independent count gives, the ε it logs is the composition of the search's and its own
releases (checked against dp_accounting directly), an interrupted augmentation resumes to the uninterrupted result,
and `--augment` refuses what it must.
"""

from __future__ import annotations

import functools
import shutil

import dp_accounting
import numpy as np
import pytest
from conftest import TINY, mpirun, rank0_decision, warm_job, warm_jobs
from pre_recipe import PRE_RECIPE

from mpi_fnas.checkpoint import load_checkpoint
from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.federation.job_plan import SetupError
from mpi_fnas.federation.party_disk import PartyStore, party_dir
from mpi_fnas.privacy.shard_ledger import DEFAULT_VALUE_DISCRETIZATION
from mpi_fnas.runlog import read_run
from mpi_fnas.space import DARTS_V2, Genotype, build_augment_network
from mpi_fnas.space.handcrafted import TanhCifarNet
from mpi_fnas.stages.augment import AugmentStage

pytestmark = pytest.mark.slow  # real MPI jobs

# A search of TINY shortened to 4 steps, then a small, short augmentation on pools of 800 (8×8 images: what these
# tests check does not depend on learning anything).
AUGMENT = [
    *TINY, "--set", "search.epochs=1", "--set", "data.train_size=1600", "--set", "data.test_size=400",
    "--set", "augment.epochs=1", "--set", "augment.steps_per_epoch=6", "--set", "augment.layers=3",
    "--set", "augment.channels=8", "--set", "augment.batch_size=64",
]
# Long enough to learn: 100 steps of 2 × 64 examples with exact gradients, on 16×16 images so shapes are
# recognisable, and TINY's 2 search epochs (the cells these numbers were measured with). The private run is the
# short one: what it checks (its log, its ε) does not depend on learning; how well private training learns is a
# benchmark (docs/benchmarks.md), never a test's threshold.
LEARN_FNAS = ["--set", "data.image_size=16", "--set", "search.epochs=2", "--set", "augment.epochs=2",
              "--set", "augment.steps_per_epoch=50", "--set", "augment.lr=0.05"]
REPRODUCIBLE = ["--set", "privacy.reproducible_noise=true"]
SMALL_GENOTYPE = ("normal=sep_conv_3x3@0,sep_conv_3x3@1|sep_conv_3x3@0,skip_connect@2;normal_concat=2,3;"
                  "reduce=max_pool_3x3@0,max_pool_3x3@1|skip_connect@2,max_pool_3x3@1;reduce_concat=2,3")


def launch(*args: str, ranks: int = 3, env: dict | None = None):
    return warm_job(ranks, *args, env=env)


@pytest.fixture(scope="module")
def learning_runs(tmp_path_factory):
    """Two runs, started side by side: {"dp": (run dir, result), "fnas": (run dir, result)}.

    dp: a short DP-FNAS search and augmentation, secret noise (the real thing); fnas: a longer one with exact
    gradients, long enough to learn."""
    root = tmp_path_factory.mktemp("learn")
    dp, fnas = warm_jobs((3, [*AUGMENT, "--set", "mode=dpfnas", "--out", str(root / "dp")]),
                               (3, [*AUGMENT, *LEARN_FNAS, "--set", "mode=fnas", "--out", str(root / "fnas")]))
    return {"dp": (root / "dp", dp), "fnas": (root / "fnas", fnas)}


@pytest.fixture(scope="module")
def dp_run(learning_runs):
    run, out = learning_runs["dp"]
    assert out.returncode == 0, out.stderr[-3000:]
    return run, out


def test_fnas_augmentation_learns(learning_runs):
    run, out = learning_runs["fnas"]
    assert out.returncode == 0, out.stderr[-3000:]
    augment = read_run(run / "search.h5")["augment"]
    assert augment["status"] == "finished" and not augment["private"]
    assert augment["test_acc"] > 0.3, augment  # chance is 0.1
    assert augment["test_error"] == pytest.approx(1 - augment["test_acc"])
    assert np.isfinite(augment["metrics"]["train_loss"]).all()  # exact gradients: the parties' loss is logged
    assert "== mpi_fnas augmentation finished ==" in out.stdout


def test_dp_augmentation_finishes_and_logs_nothing_data_dependent(dp_run):
    run, out = dp_run
    augment = read_run(run / "search.h5")["augment"]
    assert augment["status"] == "finished" and augment["private"] and augment["privacy_guarantee"] == "holds"
    assert 0.0 <= augment["test_acc"] <= 1.0 and augment["test_error"] == pytest.approx(1 - augment["test_acc"])
    assert np.isnan(augment["metrics"]["train_loss"]).all() and np.isnan(augment["metrics"]["train_acc"]).all()
    assert "search + augmentation composed" in out.stdout and "the augmentation alone" not in out.stdout
    assert "for the augmentation's releases by themselves, its search not charged" in out.stdout  # DPNAS's ε
    assert "noise           σ = " in out.stdout


@functools.lru_cache(maxsize=64)
def composed_epsilon(search_sigma: float, search_rate: float, search_steps: int, sigma_aug: float, rate: float,
                     augment_releases: int, delta: float) -> float:
    """dp_accounting's PLD ε of `search_steps` Poisson-sampled Gaussian releases then `augment_releases` more.
    Cached: parties with equal shards ask for the same composition (seconds each)."""
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=DEFAULT_VALUE_DISCRETIZATION)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        search_rate, dp_accounting.GaussianDpEvent(search_sigma)), search_steps)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        rate, dp_accounting.GaussianDpEvent(sigma_aug)), augment_releases)
    return accountant.get_epsilon(delta)


@functools.lru_cache(maxsize=16)
def alone_epsilon(sigma_aug: float, rate: float, augment_releases: int, delta: float) -> float:
    """dp_accounting's PLD ε of `augment_releases` Poisson-sampled Gaussian releases alone (cached as above)."""
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=DEFAULT_VALUE_DISCRETIZATION)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma_aug)),
                       augment_releases)
    return accountant.get_epsilon(delta)


def independent_epsilon(log: dict, party: int, augment_releases: int) -> float:
    """ε of `party` composed in dp_accounting from the log's public facts: every search release the ledger charged on
    each of its shards, then `augment_releases` augment releases (which touch both shards: the pool is all)."""
    search, augment = log["privacy"], log["augment"]["privacy"]
    search_steps = int(search["charged_steps"][-1][party])
    sigma_aug = float(np.asarray(augment["noise_multiplier"]).reshape(-1)[0])
    delta, rate = float(augment["delta"][party]), float(augment["sample_rate"][party])
    sigma_w = float(np.asarray(search["noise_multiplier_w"]).reshape(-1)[0])
    sigma_a = float(np.asarray(search["noise_multiplier_a"]).reshape(-1)[0])
    return max(composed_epsilon(sigma, float(search[key][party]), search_steps, sigma_aug, rate, augment_releases,
                                delta)
               for sigma, key in ((sigma_w, "sample_rate_train"), (sigma_a, "sample_rate_val")))


def test_dp_augmentation_epsilon_is_the_composition_of_both_stages(dp_run):
    """/augment/privacy/epsilon against dp_accounting composing every release of both stages, per party."""
    run, _ = dp_run
    log = read_run(run / "search.h5")
    augment_steps = int(log["augment"]["privacy"]["steps"][-1])
    assert int(log["privacy"]["charged_steps"][-1][0]) > 0 and augment_steps > 0
    sigma_aug = float(np.asarray(log["augment"]["privacy"]["noise_multiplier"]).reshape(-1)[0])
    for k in range(log["parties"]):
        assert log["augment"]["privacy"]["epsilon"][-1][k] == pytest.approx(
            independent_epsilon(log, k, augment_steps), rel=1e-6)
        assert log["augment"]["privacy"]["epsilon"][-1][k] > log["privacy"]["epsilon"][-1][k]  # it costs privacy
        # Each party's own ledger (its record and journals) composes both stages to the same ε.
        store = PartyStore(party_dir(run, k + 1))
        assert store.recorded_epsilon() == log["augment"]["privacy"]["epsilon"][-1][k]
        # Shard by shard, not only the larger ε: the party records the (σ, q) rank 0 charges (the pool is both).
        rate = float(log["augment"]["privacy"]["sample_rate"][k])
        [segment] = [s for s in store.release_record() if s["stage"] == "augment"]
        assert segment["train"][:2] == segment["val"][:2] == [sigma_aug, rate]
        # ... and its augmentation alone (DPNAS's protocol, the search not charged) is the augment releases' ε.
        alone = alone_epsilon(sigma_aug, rate, augment_steps, float(log["augment"]["privacy"]["delta"][k]))
        assert log["augment"]["privacy"]["epsilon_alone"][k] == pytest.approx(alone, rel=1e-6)


@pytest.fixture(scope="module")
def given_genotype_runs(tmp_path_factory):
    """Three independent launches with a genotype on the command line, side by side: {name: (run dir, result)}.

    exact: SMALL_GENOTYPE under FNAS; not_private: SMALL_GENOTYPE under DP-FNAS with augment.private=false (2 steps);
    darts_v2: DARTS_V2 with augment.epochs=0 (refused)."""
    root = tmp_path_factory.mktemp("given")
    plans = {
        "exact": [*AUGMENT, "--set", "mode=fnas", "--set", f"augment.genotype={SMALL_GENOTYPE}"],
        "not_private": [*AUGMENT, "--set", "mode=dpfnas", "--set", "augment.private=false",
                        "--set", f"augment.genotype={SMALL_GENOTYPE}", "--set", "augment.steps_per_epoch=2"],
        "darts_v2": [*AUGMENT, "--set", f"augment.genotype={DARTS_V2.to_string()}", "--set", "augment.epochs=0"],
    }
    outs = warm_jobs(*((3, [*args, "--out", str(root / name)]) for name, args in plans.items()))
    return {name: (root / name, out) for name, out in zip(plans, outs, strict=True)}


def test_given_genotype_is_trained_exactly_without_a_search(given_genotype_runs):
    text = SMALL_GENOTYPE
    run, out = given_genotype_runs["exact"]
    assert out.returncode == 0, out.stderr[-3000:]
    log = read_run(run / "search.h5")
    assert len(log["metrics"]["step"]) == 0  # no search ran
    assert log["augment"]["genotype"] == text
    expected = build_augment_network(Genotype.from_string(text), channels=8, layers=3, seed=0, in_channels=3,
                                     num_classes=10).num_params()
    assert log["augment"]["params"] == expected
    assert "== mpi_fnas search finished ==" not in out.stdout


def test_darts_v2_baseline_parses_from_the_command_line(given_genotype_runs):
    _, out = given_genotype_runs["darts_v2"]
    assert out.returncode == 2 and "augment.genotype" in out.stderr  # needs epochs > 0: one clear line


def test_a_hand_designed_network_is_trained_by_the_same_private_augmentation(tmp_path):
    """augment.network cnn-tanh: no genotype and no search; the same DP releases, ledgers (rank 0's and
    each party's own) and log as a cell's, with the network's exact size. Beside it, the same network with
    augment.epochs=0 is refused in one line (nothing to train, and no search)."""
    hand = [*AUGMENT, "--set", "mode=dpfnas", "--set", "augment.network=cnn-tanh", "--set", "augment.steps_per_epoch=3"]
    run = tmp_path / "cnn"
    done, refused = warm_jobs((3, [*hand, "--out", str(run)]),
                                    (3, [*hand, "--set", "augment.epochs=0", "--out", str(tmp_path / "none")]))
    assert refused.returncode == 2 and "augment.network: training the hand-designed cnn-tanh needs augment.epochs > 0" \
        in refused.stderr, refused.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    log = read_run(run / "search.h5")
    assert len(log["metrics"]["step"]) == 0 and log["final_genotype"] == ""  # no search ran, no cell
    assert log["reason"] == "no search: augment.network cnn-tanh is hand-designed (no cell)"
    augment = log["augment"]
    assert (augment["status"], augment["network"], augment["genotype"]) == ("finished", "cnn-tanh", "")
    assert augment["private"] and augment["privacy_guarantee"] == "holds"
    assert augment["params"] == TanhCifarNet(3, 10, 8).num_params()  # colour 8x8: the CIFAR-10 net, 304,810
    assert int(augment["privacy"]["steps"][-1]) == 3
    epsilon = augment["privacy"]["epsilon"][-1]
    assert np.all(np.isfinite(epsilon)) and np.all(epsilon > 0)
    for k in range(log["parties"]):  # each party's own ledger composes its releases to the same ε
        assert PartyStore(party_dir(run, k + 1)).recorded_epsilon() == epsilon[k]
    assert "network         cnn-tanh (hand-designed, no cell)" in done.stdout
    # Its ε is the augmentation's alone (no search was charged), and the summary says so, with the σ it used.
    assert "— the augmentation alone" in done.stdout and "search + augmentation" not in done.stdout
    privacy = augment["privacy"]
    assert (f"noise           σ = {privacy['noise_multiplier']:.4g} per release ({privacy['aggregation']})"
            in done.stdout)
    assert "== mpi_fnas search finished ==" not in done.stdout


def test_interrupted_augmentation_resumes_to_the_uninterrupted_result(tmp_path):
    """DP (reproducible noise): the parties' own generator states and the ledger must both resume exactly."""
    common = [*AUGMENT, "--set", "mode=dpfnas", *REPRODUCIBLE]
    run = tmp_path / "interrupted"
    straight, first = warm_jobs((3, [*common, "--out", str(tmp_path / "straight")]),  # independent
                                      (3, [*common, "--out", str(run)], {"MPI_FNAS_STOP_AFTER": "augment:3"}))
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert first.returncode == 75, first.stderr[-3000:]
    assert read_run(run / "search.h5")["augment"]["status"] == "interrupted"
    assert load_checkpoint(run)["stage"] == "augment" and load_checkpoint(run)["step"] == 3
    second = launch(*common, "--resume", str(run))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming the augmentation at step 4" in second.stdout
    a, b = read_run(tmp_path / "straight" / "search.h5")["augment"], read_run(run / "search.h5")["augment"]
    assert b["status"] == "finished" and b["attempts"] == 2
    for name in ("step", "test_acc", "test_loss", "train_loss"):
        np.testing.assert_array_equal(a["metrics"][name], b["metrics"][name])  # bit for bit
    assert a["test_acc"] == b["test_acc"]
    np.testing.assert_array_equal(a["privacy"]["epsilon"], b["privacy"]["epsilon"])


def test_a_failed_augmentation_resumes_from_each_party_own_state_and_charges_its_replays(tmp_path):
    """Secret noise (the real thing): party 2 fails at augment step 6 of 6, after the checkpoint of step 4.

    Party 2 had sent steps 1..5 and party 1 steps 1..5 or 1..6 (it may or may not have started step 6 before the
    job was torn down): what each sent is on its own disk. Two copies of the failed run are resumed: they end
    different, since a resumed party keys new streams and its replays of steps 5 and 6 draw fresh randomness (issue
    45), and each party's ε composes every augment release it ever sent, those replays included."""
    common = [*AUGMENT, "--set", "mode=dpfnas", "--set", "checkpoint.every_steps=2"]
    run = tmp_path / "run"
    failed = mpirun(3, *common, "--out", str(run), env={"MPI_FNAS_INJECT_FAULT": "2:augment:6"}, timeout=600)
    assert failed.returncode == 1, failed.stderr[-3000:]
    dead = read_run(run / "search.h5")
    assert dead["augment"]["status"] == "failed"
    # The failed log holds the ε of the 5 augment steps rank 0 completed and of step 6, in flight when party 2
    # failed (party 1 may have sent it): rows are per epoch, the last one comes from the failure path. Each is the
    # party's own composition of both stages, and covers every release any party sent.
    assert dead["augment"]["privacy"]["steps"][-1] == 6, dead["augment"]["privacy"]["steps"]
    for k in range(dead["parties"]):
        assert dead["augment"]["privacy"]["epsilon"][-1][k] == pytest.approx(independent_epsilon(dead, k, 6), rel=1e-6)
    assert load_checkpoint(run)["stage"] == "augment" and load_checkpoint(run)["step"] == 4
    sent = [PartyStore(party_dir(run, rank), stage="augment").sent_steps for rank in (1, 2)]
    assert sent[1] == 5 and sent[0] in (5, 6), sent
    for rank in (1, 2):
        assert PartyStore(party_dir(run, rank), stage="augment").load_state(4)["randomness"] == "secret"
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    for out in warm_jobs(*((3, [*common, "--resume", str(d)]) for d in (run, copy))):  # independent copies
        assert out.returncode == 0, out.stderr[-3000:]
    a, b = read_run(run / "search.h5"), read_run(copy / "search.h5")
    assert a["augment"]["status"] == "finished" and a["augment"]["attempts"] == 2
    assert not np.array_equal(a["augment"]["metrics"]["test_loss"], b["augment"]["metrics"]["test_loss"])
    for k in range(a["parties"]):
        releases = 6 + sent[k] - 4  # every step once, plus the steps sent after the checkpoint (replayed)
        assert a["augment"]["privacy"]["epsilon"][-1][k] == pytest.approx(
            independent_epsilon(a, k, releases), rel=1e-6)
        assert a["augment"]["privacy"]["epsilon"][-1][k] > independent_epsilon(a, k, 6)  # replays cost privacy
        # The party's own ledger agrees, its replays included.
        assert PartyStore(party_dir(run, k + 1)).recorded_epsilon() == a["augment"]["privacy"]["epsilon"][-1][k]


def test_exact_augmentation_under_dpfnas_says_loudly_it_is_not_private(given_genotype_runs):
    run, out = given_genotype_runs["not_private"]  # a given genotype: no search needed for what is checked
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("WARNING: augment.private is false: the augmentation trains with EXACT gradients, so the final weights "
            "are NOT private") in out.stderr
    assert "NOT PRIVATE: augment.private is false" in out.stdout
    log = read_run(run / "search.h5")
    assert not log["augment"]["private"]
    assert "NOT private; ε covers the search only" in log["augment"]["privacy_guarantee"]
    assert log["augment"]["privacy"] is None  # no augment ε: it would claim what the releases do not give
    assert np.isfinite(log["augment"]["metrics"]["train_loss"]).all()  # exact gradients and the parties' loss


def test_augment_later_continues_the_ledgers_and_refuses_what_it_must(tmp_path):
    run = tmp_path / "run"
    searched = tmp_path / "searched"
    common = [*AUGMENT, "--set", "mode=dpfnas"]
    # Two independent runs side by side; then rank 0's refusals, in this process.
    stopped, finished = warm_jobs(
        (3, [*common, "--out", str(run)], {"MPI_FNAS_STOP_AFTER": "3"}),  # the search did not finish
        (3, [*common, "--set", "augment.epochs=0", "--out", str(searched)]))
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert finished.returncode == 0, finished.stderr[-3000:]
    log = read_run(searched / "search.h5")
    assert log["augment"] is None
    with pytest.raises(ConfigError, match=r"^--augment: the search in .* did not finish \(status interrupted\)"):
        rank0_decision("--augment", str(run))
    with pytest.raises(ConfigError, match=r"^--augment: only augment\.\*, runtime\.\* and checkpoint\.\* may differ"):
        rank0_decision("--augment", str(searched), "--set", "search.epochs=3")
    out = launch("--augment", str(searched), "--set", "augment.epochs=1")
    assert out.returncode == 0, out.stderr[-3000:]
    log = read_run(searched / "search.h5")
    assert log["status"] == "finished" and log["augment"]["status"] == "finished"
    assert (log["augment"]["privacy"]["epsilon"][-1] > log["privacy"]["epsilon"][-1]).all()  # continued ledgers
    with pytest.raises(ConfigError, match=r"^--augment: the run in .* was already augmented"):
        rank0_decision("--augment", str(searched), "--set", "augment.epochs=1")


class _Parties:
    """What rank 0's planning asks of a channel under a central partition: the number of parties."""

    parties = 2


def test_the_augmentation_refuses_shards_other_than_the_searchs():
    cfg = load_config(None, [*PRE_RECIPE, "data.train_size=256", "data.test_size=16", "data.image_size=8",
                             "mode=dpfnas", "augment.epochs=1"])
    searched = {"genotype": DARTS_V2.to_string(), "ledger": None, "selection": None}
    setup = AugmentStage.plan(cfg, _Parties(), searched)  # an older searched.pt: no shard sizes to check
    sizes = setup.search_plan.shard_sizes
    setup = AugmentStage.plan(cfg, _Parties(), {**searched, "shard_sizes": sizes})
    assert setup.search_plan.shard_sizes == sizes and setup.private
    moved = [[sizes[0][0] + 1, sizes[0][1] - 1], *sizes[1:]]  # one example moved from a party's val to its train
    with pytest.raises(SetupError, match=r"^--augment: the parties' shards differ from the search's") as err:
        AugmentStage.plan(cfg, _Parties(), {**searched, "shard_sizes": moved})
    assert "\n" not in str(err.value)
