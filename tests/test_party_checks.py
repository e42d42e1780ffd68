"""A party checks what rank 0 asks of it (docs/privacy.md §2.10): the config it runs and the DP parameters
of its assignments, against what it derives itself. Without MPI; over MPI: tests/mpi/test_assignment_refusal.py;
a whole job: test_a_job_whose_rank_0_lowers_sigma_fails_with_every_partys_line."""

from __future__ import annotations

import dataclasses
import stat
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TINY
from pre_recipe import PRE_RECIPE, tiny

from mpi_fnas.config import load_config
from mpi_fnas.data.corruption import party_corruption
from mpi_fnas.federation import job_plan
from mpi_fnas.federation.handshake import plan_digest
from mpi_fnas.federation.job_plan import AugmentAssignment, augment_demand, plan_run, secure_dimension
from mpi_fnas.federation.party_disk import PartyStore, party_dir
from mpi_fnas.federation.verify import (
    calibrated,
    check_augment,
    check_checkpoint_step,
    check_corruption,
    check_network,
    check_params,
    check_shards,
    expected_params,
)
from mpi_fnas.privacy.trusted_config import (
    AssignmentRefusedError,
    check_config,
    config_differences,
    own_run_directory,
    pin_directory,
    read_pin,
    trusted_config,
    write_pin,
)
from mpi_fnas.stages.augment import AugmentSide
from mpi_fnas.stages.search import SearchSide

K = 3
SMALL = tiny("search.steps_per_epoch=2", "augment.batch_size=8", "augment.epochs=1", "augment.steps_per_epoch=2",
             "mode=dpfnas")


def config(*overrides: str):
    return load_config(None, [*PRE_RECIPE, *SMALL, *overrides])


def honest(cfg):
    """What an honest rank 0 sends: the search's DP parameters and the augmentation's releases, and D."""
    dimension = secure_dimension(cfg) if cfg.privacy.aggregation == "secure" else None
    plan = plan_run(cfg, K)
    params = plan.privacy.params
    releases = augment_demand(cfg, plan.assignments, params.secure_sum)
    return params, releases, dimension


def search_check(cfg, got, dimension, parties=K):
    check_params(expected_params(cfg, parties, dimension), got, calibrated=calibrated(cfg), rank=1,
                 what="search assignment")


# -- the search's DP parameters ----------------------------------------------------------------------------------
@pytest.mark.parametrize("aggregation", ["local", "secure"])
def test_the_honest_assignment_is_accepted(aggregation):
    cfg = config(f"privacy.aggregation={aggregation}")
    params, releases, dimension = honest(cfg)
    search_check(cfg, params, dimension)
    check_augment(cfg, releases, params, parties=K, dimension=dimension, rank=1)


LIES = {  # what rank 0 changes -> the refusal names it
    "K": (lambda p: dataclasses.replace(p, parties=K + 5), "parties"),
    "smaller sigma": (lambda p: p.with_noise(p.noise_multiplier_w / 2, p.noise_multiplier_a), "noise_multiplier_w"),
    "larger clip": (lambda p: dataclasses.replace(p, clip_a=p.clip_a * 10), "clip_a"),
    "another B": (lambda p: dataclasses.replace(p, expected_batch_size=p.expected_batch_size * 4),
                  "expected_batch_size"),
    "another D": (lambda p: dataclasses.replace(p, secure_dimension=p.secure_dimension * 2), "secure_dimension"),
    "reproducible": (lambda p: dataclasses.replace(p, reproducible_noise=True), "reproducible_noise"),
    "local noise": (lambda p: dataclasses.replace(p, aggregation="local", secure_dimension=None), "aggregation"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_search_assignment_that_asks_for_less_noise_is_refused(lie):
    cfg = config("privacy.aggregation=secure")
    params, _, dimension = honest(cfg)
    change, name = LIES[lie]
    with pytest.raises(AssignmentRefusedError, match=rf"^rank 1 refuses the search assignment rank 0 sent: {name} "):
        search_check(cfg, change(params), dimension)


def test_no_dp_parameters_under_dpfnas_are_refused():
    cfg = config()
    with pytest.raises(AssignmentRefusedError, match="no DP parameters"):
        search_check(cfg, None, None)


def test_a_calibrated_sigma_is_checked_for_one_positive_value_only():
    # Under privacy.target_epsilon rank 0's accountant sets σ: a party checks σ_W = σ_A > 0 and takes the value on
    # trust (docs/privacy.md §2.10); everything else is still derived.
    cfg = config("privacy.target_epsilon=8")
    params, _, dimension = honest(cfg)
    search_check(cfg, params, dimension)
    for bad in ((params.noise_multiplier_w, params.noise_multiplier_w / 2), (0.0, 0.0), (float("nan"),) * 2):
        with pytest.raises(AssignmentRefusedError, match="calibrates one positive, finite σ"):
            search_check(cfg, params.with_noise(*bad), dimension)
    with pytest.raises(AssignmentRefusedError, match="clip_w"):
        search_check(cfg, dataclasses.replace(params, clip_w=5.0), dimension)


# -- the augmentation's ------------------------------------------------------------------------------------------
AUGMENT_LIES = {
    "smaller sigma": ({"noise_multiplier": 0.1}, "noise_multiplier"),
    "larger clip": ({"clip": 100.0}, "clip"),
    "another B": ({"expected_batch_size": 64.0}, "expected_batch_size"),
    "one release per ADADP step": ({"releases_per_step": 2}, "releases_per_step"),
    "K": ({"secure": {"parties": K + 1}}, "secure"),
    "local variance": ({"secure": {"local_variance": 100**2}}, "secure"),
}


@pytest.mark.parametrize("lie", sorted(AUGMENT_LIES))
def test_an_augmentation_that_asks_for_less_noise_is_refused(lie):
    cfg = config("privacy.aggregation=secure")
    params, releases, dimension = honest(cfg)
    change, name = AUGMENT_LIES[lie]
    if "secure" in change:  # secure aggregation's constants, one of them changed
        change = {"secure": dataclasses.replace(releases.secure, **change["secure"])}
    with pytest.raises(AssignmentRefusedError, match=rf"refuses the augmentation assignment rank 0 sent: augment "
                                                     rf"{name} "):
        check_augment(cfg, dataclasses.replace(releases, **change), params, parties=K, dimension=dimension, rank=1)


def test_exact_gradients_or_other_params_in_a_private_augmentation_are_refused():
    cfg = config()
    params, releases, _ = honest(cfg)
    with pytest.raises(AssignmentRefusedError, match="no DP releases"):
        check_augment(cfg, None, None, parties=K, dimension=None, rank=2)
    with pytest.raises(AssignmentRefusedError, match="parties"):
        check_augment(cfg, releases, dataclasses.replace(params, parties=1), parties=K, dimension=None, rank=2)
    assert AugmentAssignment.__dataclass_fields__["releases"]  # the fields checked are the assignment's


def test_an_augmentation_of_another_network_is_refused():
    """The network sets the released dimension (and secure aggregation's D): the party trains only its own
    config's, whatever the assignment says, with or without DP."""
    for own in ("cell", "cnn-tanh", "cnn-gn"):
        for mode in ("dpfnas", "fnas"):
            cfg = config(f"augment.network={own}", f"mode={mode}")
            check_network(cfg, own, rank=1)
            for other in {"cell", "cnn-tanh", "cnn-gn", None} - {own}:
                with pytest.raises(AssignmentRefusedError, match=rf"^rank 1 refuses the augmentation assignment rank 0 "
                                                                 rf"sent: augment network {other!r} where this party's "
                                                                 rf"config says {own!r}; nothing was computed"):
                    check_network(cfg, other, rank=1)
    assert AugmentAssignment.__dataclass_fields__["network"].default == "cell"


STEP_LIES = {  # (steps_per_epoch, steps) from the planned ones -> the refusal names
    "more epochs": (lambda per, steps: (per, 10 * steps), "steps"),
    "longer epochs": (lambda per, steps: (2 * per, 2 * steps), "steps_per_epoch"),
    "a float": (lambda per, steps: (per, float(steps)), "steps"),
    "negative": (lambda per, steps: (per, -1), "steps"),
}


@pytest.mark.parametrize("lie", sorted(STEP_LIES))
def test_a_step_count_the_config_does_not_give_is_refused_with_or_without_a_cap(lie):
    """The search's and the augmentation's: the steps per epoch from the config and every party's shard sizes, at
    most the configured epochs of them (fewer pass), with no ε target or cap."""
    from mpi_fnas.privacy.federation_ledger import FederationLedger

    cfg = config("privacy.target_epsilon=null", "search.steps_per_epoch=null", "augment.steps_per_epoch=null")
    planned = plan_run(cfg, K)
    search = planned.assignments
    augment = job_plan.plan_augment_stage(cfg, search, None, FederationLedger(planned.privacy),
                                             planned.privacy.params).assignments
    data = job_plan.open_split(cfg, "train")
    change, name = STEP_LIES[lie]
    for side, got, what in ((SearchSide(cfg), search[0], "search"), (AugmentSide(cfg), augment[0], "augmentation")):
        own = job_plan.party_view(cfg, data, K, 1)
        side.check(cfg, got, own, parties=K, rank=1)
        side.check(cfg, dataclasses.replace(got, steps=got.steps - 1), own, parties=K, rank=1)
        per, steps = change(got.steps_per_epoch, got.steps)
        with pytest.raises(AssignmentRefusedError, match=rf"^rank 1 refuses the {what} assignment rank 0 sent: "
                                                         rf"{name} "):
            side.check(cfg, dataclasses.replace(got, steps_per_epoch=per, steps=steps), own, parties=K, rank=1)


def test_a_party_continues_a_stage_only_from_its_own_state(tmp_path):
    """A checkpoint step it saved its state for, or 0 while it holds none. Refused: a step it never saved; a
    restart from 0 where it holds states (a rank 0 feigning interruptions would otherwise have an uncapped party
    release its whole plan at every relaunch); a search once its augmentation has begun."""
    store = PartyStore(party_dir(tmp_path, 1))
    check_checkpoint_step(0, store.held_steps(), rank=1, what="search assignment")  # a fresh stage
    store.save_party(4, "secret", {"positions": 1})
    store.save_party(8, "secret", {"positions": 2})
    assert store.held_steps() == [4, 8]
    for step in (4, 8):  # the last checkpoint, or the one before (rank 0 died before writing the last)
        check_checkpoint_step(step, store.held_steps(), rank=1, what="search assignment")
    with pytest.raises(AssignmentRefusedError, match="checkpoint_step 6: this party saved no state of its own"):
        check_checkpoint_step(6, store.held_steps(), rank=1, what="search assignment")
    with pytest.raises(AssignmentRefusedError, match="checkpoint_step 0 where this party holds its own state of step "
                                                     "8: a restart would release"):
        check_checkpoint_step(0, store.held_steps(), rank=1, what="search assignment")
    with pytest.raises(AssignmentRefusedError, match=r"the stage is over on this party \(its augment has begun\)"):
        check_checkpoint_step(8, store.held_steps(), rank=1, what="search assignment",
                              stage_over="its augment has begun")


# -- the shards ----------------------------------------------------------------------------------------------------
def shards_check(cfg, received, rank=1, examples=400, parties=K):
    """What a party of `cfg` does with the (train, val) indices rank 0 sent it (central partition: the train split
    it holds, of `examples` labels)."""
    labels = job_plan.open_split(cfg, "train").labels
    assert len(labels) == examples
    train, val = job_plan.central_shards(cfg, labels, parties)
    check_shards([("train indices", received[0]), ("validation indices", received[1])],
                 (train[rank - 1], val[rank - 1]), examples=examples, partition=cfg.data.partition, rank=rank,
                 what="search assignment")


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "pathological"])
def test_the_planned_shards_are_the_ones_each_party_computes(partition):
    cfg = config(f"data.partition={partition}")
    for rank, assignment in enumerate(plan_run(cfg, K).assignments, start=1):
        shards_check(cfg, (assignment.train_indices, assignment.val_indices), rank=rank)
        shards_check(cfg, (assignment.train_indices[::-1], assignment.val_indices), rank=rank)  # any order


SHARD_LIES = {  # (train, val) rank 0 sends party 1 from its planned ones -> the refusal's reason
    "one example at every train position": (lambda t, v: (np.full_like(t, t[0]), v), "train indices repeat examples"),
    "a repeat in the validation shard": (lambda t, v: (t, np.concatenate([v, v[:1]])), "validation indices repeat"),
    "the validation shard is the train shard": (lambda t, v: (t, t.copy()), "validation indices share"),
    "one shared example": (lambda t, v: (t, np.concatenate([v[1:], t[:1]])), "validation indices share 1 examples"),
    "past its data": (lambda t, v: (t + 400, v), "train indices point outside this party's 400 examples"),
    "negative": (lambda t, v: (t - 400, v), "train indices point outside"),
    "a subset": (lambda t, v: (t[1:], v), r"train indices \(\d+\) are not the examples of the seeded iid split"),
    "floats": (lambda t, v: (t.astype(float), v), "train indices are not a list of indices"),
    "a matrix": (lambda t, v: (t.reshape(1, -1), v), "train indices are not a list of indices"),
}


@pytest.mark.parametrize("lie", sorted(SHARD_LIES))
def test_shards_that_are_not_the_partys_own_are_refused_in_one_line(lie):
    cfg = config()
    planned = plan_run(cfg, K).assignments[0]
    change, reason = SHARD_LIES[lie]
    with pytest.raises(AssignmentRefusedError, match=rf"^rank 1 refuses the search assignment rank 0 sent: {reason}"):
        shards_check(cfg, change(planned.train_indices, planned.val_indices))


def test_under_a_local_partition_the_party_splits_its_own_folder_itself():
    """Rank 0 plans a local partition from each party's count alone; the party computes the same split of its own
    positions, and refuses indices that repeat one of its images (accepted before: ε printed 3, ≈ 331 real)."""
    cfg = config("data.partition=local", "data.dataset=imagefolder", "data.root=/nonexistent", "data.image_size=8")
    sizes = [90, 120, 75]
    for rank, assignment in enumerate(job_plan.plan_assignments(cfg, K, sizes), start=1):
        own = job_plan.local_shards(cfg, sizes[rank - 1], rank)
        received = [("train indices", assignment.train_indices), ("validation indices", assignment.val_indices)]
        check_shards(received, own, examples=sizes[rank - 1], partition="local", rank=rank, what="search assignment")
        with pytest.raises(AssignmentRefusedError, match="train indices repeat examples"):
            check_shards([("train indices", np.zeros_like(assignment.train_indices)), received[1]], own,
                         examples=sizes[rank - 1], partition="local", rank=rank, what="search assignment")
        with pytest.raises(AssignmentRefusedError, match="not the examples of the seeded local split"):  # another's
            check_shards(received, job_plan.local_shards(cfg, sizes[rank - 1], rank % K + 1),
                         examples=sizes[rank - 1], partition="local", rank=rank, what="search assignment")


def test_an_augmentation_pool_is_the_partys_own_shards():
    for pool in ("train", "all"):
        cfg = config(f"augment.pool={pool}", "mode=fnas")
        search = plan_run(cfg, K).assignments
        augment = job_plan.plan_augment_stage(cfg, search, None, None, None).assignments
        side = AugmentSide(cfg)
        data = job_plan.open_split(cfg, "train")
        for rank, got in enumerate(augment, start=1):
            own = job_plan.party_view(cfg, data, K, rank)
            side.check(cfg, got, own, parties=K, rank=rank)
            for lie, reason in (({"train_count": len(got.pool_indices) + 1}, "train_count"),
                                ({"pool_indices": np.concatenate([got.pool_indices, got.pool_indices[:1]])},
                                 "pool's (train|validation) part (share|repeat|.*not the seeded)"),
                                ({"pool_indices": augment[rank % K].pool_indices,  # another party's pool
                                  "train_count": augment[rank % K].train_count}, "not the examples of the seeded")):
                with pytest.raises(AssignmentRefusedError, match=rf"rank {rank} refuses the augmentation .*{reason}"):
                    side.check(cfg, dataclasses.replace(got, **lie), own, parties=K, rank=rank)


def test_a_corruption_the_seed_does_not_give_is_refused():
    cfg = config("mode=fnas", "federation.unreliable_parties=1", "federation.corruption=0.5")
    for rank, assignment in enumerate(plan_run(cfg, K).assignments, start=1):
        expected = party_corruption(cfg, K, rank)
        check_corruption(assignment.corruption, expected, rank=rank, what="search assignment")
        with pytest.raises(AssignmentRefusedError, match="corruption"):
            check_corruption(0.5 - assignment.corruption, expected, rank=rank, what="search assignment")


# -- the run directory and the stage plan --------------------------------------------------------------------------
def test_a_party_keeps_its_state_in_the_run_directory_it_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dirA").mkdir()
    assert own_run_directory(None, "runs/fresh", rank=1) == Path("runs/fresh")  # a fresh run: rank 0 names it
    for received in ("dirA", str(tmp_path / "dirA"), "./dirA/", "sub/../dirA"):  # the same directory, spelled apart
        assert own_run_directory("dirA", received, rank=1) == Path("dirA")
    with pytest.raises(AssignmentRefusedError, match=r"^rank 2 refuses the run directory rank 0 named: dirB is not "
                                                     r"its own dirA; nothing was computed or sent$"):
        own_run_directory("dirA", "dirB", rank=2)


def test_the_plan_digest_covers_the_config_the_shared_plan_the_last_step_and_the_pattern():
    cfg = config()
    first, second = plan_run(cfg, K).assignments[:2]
    assert set(job_plan.shared_plan(first)) == {"steps_per_epoch", "steps", "dp", "checkpoint_step", "gathered"}

    text = cfg.to_yaml()

    def digest(stage="search", text=text, plan=first, last=first.steps, pattern="star"):
        return plan_digest(stage, text, job_plan.shared_plan(plan), last, pattern)

    assert digest() == digest(plan=second)
    others = [digest(stage="augment"), digest(text=config("search.warmup_epochs=1").to_yaml()),
              digest(last=first.steps - 1), digest(plan=dataclasses.replace(first, steps_per_epoch=9)),
              digest(pattern="collective")]
    assert len({digest(), *others}) == 6


# -- colluders -----------------------------------------------------------------------------------------------------
def test_colluders_calibrate_sigma_so_that_the_guarantee_holds_against_them():
    """``privacy.colluders`` t: σ grows with t so that ε against the server and any t parties is the target; against
    the server alone it is then below the target; t = K − 1 needs about √K times the noise (local noise's σ)."""
    from mpi_fnas.privacy.federation_ledger import FederationLedger

    sigmas, server = {}, {}
    for t in (0, 1, K - 1):
        cfg = config("privacy.aggregation=secure", "privacy.target_epsilon=3", f"privacy.colluders={t}",
                     "augment.epochs=0")
        plan = plan_run(cfg, K)
        params = plan.privacy.params
        assert params.colluders == t and params.secure_sum.colluders == t
        ledger = FederationLedger(plan.privacy)
        for _ in range(plan.steps):
            ledger.record_step()
        assert abs(ledger.epsilons().max() - 3.0) < 0.05
        sigmas[t], server[t] = params.noise_multiplier_w, ledger.epsilons_server()
    assert sigmas[0] < sigmas[1] < sigmas[K - 1]
    assert server[0] is None and server[1].max() < 3.0
    with pytest.raises(AssignmentRefusedError, match="colluders 0 where this party derives 2"):
        cfg = config("privacy.aggregation=secure", f"privacy.colluders={K - 1}")
        params, _, dimension = honest(cfg)
        search_check(cfg, dataclasses.replace(params, colluders=0), dimension)


def test_more_colluders_than_other_parties_is_bad_input():
    from mpi_fnas.config import ConfigError, check_world

    check_world(config(f"privacy.colluders={K - 1}"), K + 1)
    with pytest.raises(ConfigError, match=rf"^privacy.colluders: {K} colluders among {K} parties"):
        check_world(config(f"privacy.colluders={K}"), K + 1)


# -- the config ----------------------------------------------------------------------------------------------------
def test_a_config_that_differs_in_a_privacy_key_is_refused_in_one_line():
    own = config()
    assert config_differences(own, config("runtime.log_every=9", "name=other", "search.w_lr=0.5")) == []
    check_config(own, config("runtime.log_every=9"), rank=2, trusted_name="its own config")
    for key, value in (("privacy.noise_multiplier_w", "0.5"), ("search.batch_size", "4"), ("mode", "fnas"),
                       ("privacy.aggregation", "local"), ("augment.private", "false"), ("space.channels", "16"),
                       ("augment.network", "cnn-gn")):
        with pytest.raises(AssignmentRefusedError, match=rf"^rank 2 refuses the config rank 0 sent: {key}: ") as no:
            check_config(own, config(f"{key}={value}"), rank=2, trusted_name="its own config")
        assert "\n" not in str(no.value)


def test_on_resume_and_augment_the_pin_is_trusted(tmp_path):
    directory = pin_directory(tmp_path, 1)
    assert directory == party_dir(tmp_path, 1)
    own = config()
    write_pin(directory, own.to_yaml())
    assert stat.S_IMODE((directory / "config.yaml").stat().st_mode) == 0o600
    pin = read_pin(directory)
    # --resume without a config of its own (the defaults, σ = 1): the pin, not the defaults, is what rank 0's must be
    lowered = config("privacy.noise_multiplier_a=0.25")
    write_pin(directory, lowered.to_yaml())
    trusted, name = trusted_config(load_config(), explicit=False, resume=True, augment=False, overrides=[],
                                   pin=read_pin(directory), rank=1)
    assert name == "its pinned config" and trusted.privacy.noise_multiplier_a == 0.25
    with pytest.raises(AssignmentRefusedError, match=r"privacy\.noise_multiplier_a: 1\.0 where its pinned config says"):
        check_config(trusted, own, rank=1, trusted_name=name)
    # --augment: the pin with the party's own --set, as rank 0 applies them
    trusted, _ = trusted_config(None, explicit=True, resume=False, augment=True,
                                overrides=["augment.noise_multiplier=3"], pin=pin, rank=1)
    check_config(trusted, config("augment.noise_multiplier=3"), rank=1, trusted_name="pin")
    with pytest.raises(AssignmentRefusedError, match=r"augment\.noise_multiplier"):
        check_config(trusted, own, rank=1, trusted_name="pin")
    for resume, augment in ((True, False), (False, True)):  # nothing to trust: refused
        with pytest.raises(AssignmentRefusedError, match="holds no pinned config"):
            trusted_config(None, explicit=False, resume=resume, augment=augment, overrides=[], pin=None, rank=1)


# -- a whole job, rank 0 lying ---------------------------------------------------------------------------------
OWN_CELL = ("normal=sep_conv_3x3@0,skip_connect@1|sep_conv_3x3@0,skip_connect@2;normal_concat=2,3;"
            "reduce=max_pool_3x3@0,sep_conv_3x3@1|skip_connect@0,sep_conv_3x3@2;reduce_concat=2,3")
AUGMENT_ONLY = ["--set", "augment.epochs=1", "--set", "augment.steps_per_epoch=2", "--set", "augment.batch_size=8"]


@pytest.fixture(scope="module")
def lying_jobs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path, float]]:
    """Ten jobs side by side, each with a rank 0 modified as tests/helpers/lying_server.py says (the parties run the
    real code): each job's result, run directory and wall seconds, by lie."""
    from conftest import mpirun_together

    root = tmp_path_factory.mktemp("lying")
    dp = [*TINY, "--set", "mode=dpfnas"]
    dir_a, dir_b = root / "dirA", root / "dirB"
    run_cfg = load_config(None, dp[1::2])  # TINY is all --set KEY=VALUE pairs
    for rank in (1, 2):
        write_pin(pin_directory(dir_a, rank), run_cfg.to_yaml())
    (dir_a / "search.h5").touch()
    jobs = {
        "run_dir": (["--resume", str(dir_a)], {"LYING_SERVER_DIR": str(dir_b)}, dir_a),
        "one_party_plan": ([*TINY, "--set", "mode=fnas", "--out", str(root / "plan")], {}, root / "plan"),
        "low_sigma": ([*dp, "--out", str(root / "sigma")], {}, root / "sigma"),
        "other_network": ([*dp, "--set", "augment.network=cnn-tanh", *AUGMENT_ONLY, "--out", str(root / "network")],
                          {}, root / "network"),
        "other_ops": ([*dp, "--set", "privacy.aggregation=secure",
                       "--set", "space.ops=[sep_conv_3x3, skip_connect, max_pool_3x3]",
                       "--set", f"augment.genotype={OWN_CELL}", *AUGMENT_ONLY, "--out", str(root / "ops")],
                      {}, root / "ops"),
        "collective": ([*TINY, "--set", "mode=fnas", "--out", str(root / "collective")], {}, root / "collective"),
        "steps": ([*dp, "--out", str(root / "steps")], {}, root / "steps"),
        "unparseable": ([*dp, "--out", str(root / "unparseable")], {}, root / "unparseable"),
        "exchange_text": ([*dp, "--set", "runtime.exchange=star", "--out", str(root / "text")], {}, root / "text"),
        "split_pattern": ([*dp, "--set", "runtime.exchange=collective", "--set", "runtime.comm_timeout=600",
                           "--out", str(root / "split")], {}, root / "split"),
    }
    helpers = {"PYTHONPATH": str(ROOT / "tests" / "helpers")}
    start = time.monotonic()
    done = mpirun_together(*((3, args, {**helpers, **env, "LYING_SERVER": lie}, "lying_server")
                             for lie, (args, env, _) in jobs.items()), timeout=300)
    took = time.monotonic() - start
    return {lie: (out, jobs[lie][2], took) for lie, out in zip(jobs, done, strict=True)}


def refusing(stderr: str, what: str) -> list[int]:
    """The parties (ranks 1, 2) whose one-line refusal ``rank r refuses {what}`` is on `stderr` (``{other}`` in
    `what` stands for the other party's rank)."""
    return [rank for rank in (1, 2) if f"[mpi_fnas rank {rank}] error: AssignmentRefusedError: rank {rank} refuses "
            + what.replace("{other}", str(3 - rank)) in stderr]


def refused_by_every_party(job: tuple[subprocess.CompletedProcess, Path, float], what: str) -> tuple[Path, float]:
    """The run directory and wall seconds of a lying job, once it is seen to have failed with both parties' refusal
    `what` (see :func:`refusing`)."""
    done, out, took = job
    assert done.returncode != 0, done.stderr
    assert refusing(done.stderr, what) == [1, 2], done.stderr
    return out, took


def released_nothing(run_dir: Path, ranks: tuple[int, ...] = (1, 2)) -> bool:
    """Whether no party of `ranks` recorded a sent step in `run_dir`."""
    return not any((party_dir(run_dir, rank) / "sent_steps").exists() for rank in ranks)


@pytest.mark.slow
def test_a_job_whose_rank_0_lowers_sigma_fails_with_every_partys_line(lying_jobs):
    from mpi_fnas.runlog import read_run

    out, took = refused_by_every_party(lying_jobs["low_sigma"], "the search assignment rank 0 sent: "
                                       "noise_multiplier_w 0.5 where this party derives 1.0")
    assert read_run(out / "search.h5")["status"] == "failed"
    assert took < 120, took  # FAILURE_GRACE is 60 s: rank 0 must have aborted the job on the notice


@pytest.mark.slow
def test_a_job_whose_rank_0_asks_for_another_network_fails_with_every_partys_line(lying_jobs):
    from mpi_fnas.runlog import read_run

    out, _ = refused_by_every_party(lying_jobs["other_network"], "the augmentation assignment rank 0 sent: augment "
                                    "network 'cnn-gn' where this party's config says 'cnn-tanh'")
    log = read_run(out / "search.h5")
    assert log["augment"]["status"] == "failed" and log["augment"]["network"] == "cnn-tanh"
    assert released_nothing(out, ranks=(1,))


@pytest.mark.slow
def test_a_job_whose_rank_0_asks_for_an_op_outside_space_ops_fails_before_any_release(lying_jobs):
    """A party builds only a cell of its own config's ``space.ops``, whatever genotype rank 0 sends (secure
    aggregation: its D was planned for the largest network of those ops): here a cell of sep_conv_5x5 edges."""
    done, out, _ = lying_jobs["other_ops"]
    assert done.returncode != 0, done.stderr
    # Under DP a party's error text stays on its own disk; what rank 0 prints says where.
    assert "the party failed; under DP its error text stays with it" in done.stderr, done.stderr
    errors = [party_dir(out, rank) / "error.log" for rank in (1, 2)]
    assert any("unknown op 'sep_conv_5x5'" in path.read_text() for path in errors if path.exists()), done.stderr
    assert released_nothing(out)


@pytest.mark.slow
def test_a_rank_0_that_names_another_run_directory_or_changes_one_partys_plan_is_refused(lying_jobs):
    """* ``--resume dirA``, where rank 0 names a fresh ``dirB``: before, every party wrote its record and journal in
      dirB, so dirA's cap never saw those releases (ε 3.30 over two launches at a cap of 3, 7.10 after 50); now
      each party refuses in one line, and writes nothing in dirB;
    * party 1's search plan one step per epoch longer than the others' (plain FNAS: under DP the party's own step
      check refuses it first): before, the job waited until
      ``runtime.comm_timeout``; now every party refuses in the parties' own round, and the log says failed."""
    from mpi_fnas.runlog import read_run

    (swapped, dir_a, took), (one_party, plan_dir, _) = lying_jobs["run_dir"], lying_jobs["one_party_plan"]
    dir_b = dir_a.parent / "dirB"
    # Each refusing party prints its line before it tells rank 0, whose abort may end the other before it prints.
    assert swapped.returncode != 0, swapped.stderr[-3000:]
    assert refusing(swapped.stderr, f"the run directory rank 0 named: {dir_b} is not its own {dir_a}; nothing was "
                    "computed or sent"), swapped.stderr[-3000:]
    assert not any(party_dir(dir_b, rank).exists() for rank in (1, 2)) and released_nothing(dir_a)
    assert one_party.returncode != 0, one_party.stderr[-3000:]
    assert refusing(one_party.stderr, "the search plan: rank 0 sent rank(s) {other} another config, stage plan or "
                    "exchange pattern"
                    ), one_party.stderr[-3000:]
    assert released_nothing(plan_dir)
    assert read_run(plan_dir / "search.h5")["status"] == "failed"
    assert took < 120, took  # within the failure grace, not runtime.comm_timeout


@pytest.mark.slow
def test_a_party_refuses_a_collective_exchange_its_own_config_does_not_allow(lying_jobs):
    """Plain FNAS under ``runtime.exchange: auto`` keeps the star (a reduction tree would hand a party's raw gradient,
    or a sum holding it, to another party): a rank 0 that chooses collectives anyway is refused by every party in
    one line, before any release."""
    done, out, took = lying_jobs["collective"]
    assert done.returncode != 0, done.stderr[-3000:]
    assert refusing(done.stderr, "the collective exchange rank 0 chose: mode fnas: a reduction tree would hand raw "
                    "gradient sums to other parties"), done.stderr[-3000:]
    assert released_nothing(out)
    assert took < 120, took


@pytest.mark.slow
def test_a_job_whose_rank_0_asks_for_more_steps_than_the_config_gives_fails_before_any_release(lying_jobs):
    """No ε target, no cap: the step count is the config's, which each party derives itself (before, every party ran
    the 80 iterations rank 0 planned where the config gives 8: ε 1.98 where 12 steps give 1.42 in the issue's run)."""
    from mpi_fnas.runlog import read_run

    out, took = refused_by_every_party(lying_jobs["steps"], "the search assignment rank 0 sent: steps 80 where this "
                                       "party's config allows at most 2 epochs x 4 = 8")
    assert released_nothing(out)
    assert read_run(out / "search.h5")["status"] == "failed"
    assert took < 120, took


@pytest.mark.slow
def test_a_rank_0_that_sends_another_exchange_pattern_in_the_config_or_to_one_party_is_refused(lying_jobs):
    """* the config's ``runtime.exchange`` is what the party was launched with: before, a rank 0 that sent
      ``collective`` in the text and kept the star had it pinned, and a resume ran collectives the party's launch
      (``star``) did not allow;
    * a pattern told to one party and not the others is part of the digest the parties compare: before, party 1
      waited in a broadcast the others never joined until ``runtime.comm_timeout``."""
    from mpi_fnas.runlog import read_run

    done, out, _ = lying_jobs["exchange_text"]
    assert done.returncode != 0, done.stderr[-3000:]
    assert refusing(done.stderr, "the config rank 0 sent: runtime.exchange: 'collective' where its own config says "
                    "'star'"), done.stderr[-3000:]
    assert released_nothing(out) and not (party_dir(out, 1) / "config.yaml").exists()  # nothing pinned
    out, took = refused_by_every_party(lying_jobs["split_pattern"], "the search plan: rank 0 sent rank(s) {other} "
                                       "another config, stage plan or exchange pattern")
    assert released_nothing(out)
    assert read_run(out / "search.h5")["status"] == "failed"
    assert took < 120, took  # the failure grace, far below runtime.comm_timeout (600 s)


def test_the_exchange_a_party_allows_is_its_own_launchs():
    """``runtime.exchange`` is checked like a privacy key (on a resume: the pin's, or the party's own runtime.* when
    it gives them, as rank 0 does); a DP job whose augmentation sends exact gradients keeps the star under auto."""
    from mpi_fnas.federation.topology import collective_refusal

    with pytest.raises(AssignmentRefusedError, match=r"runtime\.exchange: 'collective' where its own config says "
                                                     r"'star'"):
        check_config(config("runtime.exchange=star"), config("runtime.exchange=collective"), rank=1,
                     trusted_name="its own config")
    pin = config("runtime.exchange=star").to_yaml()
    collective = config("runtime.exchange=collective")
    for own, overrides, config_file, expected in (
            (None, [], False, "star"),  # a resume without settings: the pin's
            (collective, ["runtime.exchange=collective"], False, "collective"),  # the key given with --set
            (config("runtime.comm_timeout=99"), ["runtime.comm_timeout=99"], False, "star"),  # another key: kept
            (collective, [], True, "collective")):  # a --config file's runtime section, whole
        trusted, _ = trusted_config(own, explicit=own is not None, resume=True, augment=False, overrides=overrides,
                                    pin=pin, rank=1, config_file=config_file)
        assert trusted.runtime.exchange == expected, (overrides, config_file)
    exact = config("augment.private=false", "augment.epochs=1")
    assert "augment.private false: a reduction tree" in collective_refusal(exact)
    assert collective_refusal(config("augment.private=false", "augment.epochs=1", "runtime.exchange=collective")) \
        is None
    assert collective_refusal(config("augment.epochs=1")) is None  # private releases: a partial sum is noised


@pytest.mark.slow
def test_config_text_a_party_cannot_validate_is_refused_in_one_line_and_the_log_says_failed(lying_jobs):
    """Before, every party exited 2 without a line, rank 0 waited until its timeout and no log was written."""
    from mpi_fnas.runlog import read_run

    out, took = refused_by_every_party(lying_jobs["unparseable"], "the config rank 0 sent: it does not validate here "
                                       "(search.order: second_order is refused under DP")
    assert released_nothing(out)
    assert read_run(out / "search.h5")["status"] == "failed"
    assert took < 120, took


@pytest.mark.parametrize("selection", ["all", "random"])
def test_a_gathered_exchange_the_selection_does_not_give_is_refused_in_one_line(selection):
    """``gathered`` follows ``federation.selection`` (a selection gathers each release, ``all`` sums them): before, a
    gathered assignment under ``all`` ended the party in a generic TypeError."""
    from mpi_fnas.federation.verify import check_gathered

    cfg = config(f"federation.selection={selection}", *(["federation.select=2", "privacy.aggregation=local"]
                                                         if selection != "all" else []))
    got = plan_run(cfg, K).assignments[0]
    check_gathered(got.gathered, cfg, rank=1, what="search assignment")
    SearchSide(cfg).check(cfg, got, job_plan.party_view(cfg, job_plan.open_split(cfg, "train"), K, 1),
                          parties=K, rank=1)
    for lie in (not got.gathered, 1, None):
        with pytest.raises(AssignmentRefusedError, match=rf"^rank 1 refuses the search assignment rank 0 sent: "
                                                         rf"gathered {lie!r} where this party's federation.selection "
                                                         rf"{selection} gives {got.gathered}; nothing"):
            SearchSide(cfg).check(cfg, dataclasses.replace(got, gathered=lie),
                                  job_plan.party_view(cfg, job_plan.open_split(cfg, "train"), K, 1),
                                  parties=K, rank=1)


@pytest.mark.slow
def test_a_rank_0_that_restarts_a_checkpointed_stage_from_zero_is_refused(tmp_path):
    """No ε cap: a run stopped after its checkpoint at step 2, then resumed by a rank 0 that sends checkpoint step 0
    (before: every party released the whole plan once more, at every such relaunch). Every party refuses in its
    setup report; nothing more is sent."""
    from conftest import ROOT, mpirun, warm_job

    run = tmp_path / "run"
    dp = [*TINY, "--set", "mode=dpfnas", "--set", "checkpoint.every_steps=2"]
    stopped = warm_job(3, *dp, "--out", str(run), env={"MPI_FNAS_STOP_AFTER": "2"})
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    sent = [int((party_dir(run, rank) / "sent_steps").read_text()) for rank in (1, 2)]
    resumed = mpirun(3, "--resume", str(run), module="lying_server",
                     env={"PYTHONPATH": str(ROOT / "tests" / "helpers"), "LYING_SERVER": "restart"})
    assert resumed.returncode != 0, resumed.stderr[-3000:]
    assert refusing(resumed.stderr, "the search assignment rank 0 sent: checkpoint_step 0 where this party holds "
                    "its own state of step 2"), resumed.stderr[-3000:]
    assert [int((party_dir(run, rank) / "sent_steps").read_text()) for rank in (1, 2)] == sent
