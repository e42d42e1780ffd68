"""A party checks what rank 0 asks of it (issue 45, docs/privacy.md §2.10): the config it runs and the DP parameters
of its assignments, against what it derives itself. Without MPI; over MPI: tests/mpi/test_assignment_refusal.py;
a whole job: test_a_job_whose_rank_0_lowers_sigma_fails_with_every_partys_line."""

from __future__ import annotations

import dataclasses
import stat
import sys
import time

import pytest
from conftest import MPIRUN, ROOT, TINY, _env
from pre_recipe import PRE_RECIPE

from mpi_fnas.config import load_config
from mpi_fnas.federation.party_store import PartyStore, party_dir
from mpi_fnas.federation.plan import AugmentAssignment, augment_demand, plan_run, secure_dimension
from mpi_fnas.federation.verify import (
    calibrated,
    check_augment,
    check_checkpoint_step,
    check_network,
    check_params,
    expected_params,
)
from mpi_fnas.privacy.trusted_config import (
    AssignmentRefusedError,
    check_config,
    config_differences,
    pin_directory,
    read_pin,
    trusted_config,
    write_pin,
)

K = 3
SMALL = ["data.train_size=400", "data.test_size=40", "data.image_size=8", "space.channels=4", "space.layers=3",
         "space.nodes=2", "search.batch_size=8", "search.steps_per_epoch=2", "augment.batch_size=8",
         "augment.epochs=1", "augment.steps_per_epoch=2", "mode=dpfnas"]


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


def test_a_checkpoint_step_the_party_never_saved_is_refused(tmp_path):
    store = PartyStore(party_dir(tmp_path, 1))
    store.save_party(4, "secret", {"positions": 1})
    for step, saved in ((0, False), (4, store.has_state(4))):
        check_checkpoint_step(step, saved, rank=1, what="search assignment")
    assert not store.has_state(6)
    with pytest.raises(AssignmentRefusedError, match="checkpoint_step 6: this party saved no state of its own"):
        check_checkpoint_step(6, store.has_state(6), rank=1, what="search assignment")


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


# -- a whole job -------------------------------------------------------------------------------------------------
#: Rank 0 halves σ_W in every search assignment it plans (plan_run, before serve imports it).
LYING_SERVER = """
import sys, dataclasses
from mpi_fnas.federation import plan
honest = plan.plan_run
def lying(*args, **kwargs):
    run = honest(*args, **kwargs)
    for a in run.assignments:
        a.dp = a.dp.with_noise(a.dp.noise_multiplier_w / 2, a.dp.noise_multiplier_a)
    return run
plan.plan_run = lying
from mpi_fnas.run import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_job_whose_rank_0_lowers_sigma_fails_with_every_partys_line(tmp_path):
    import subprocess

    from mpi_fnas.runlog import read_run

    out = tmp_path / "run"
    start = time.monotonic()
    done = subprocess.run([MPIRUN, "-n", "3", sys.executable, "-c", LYING_SERVER, *TINY, "--set", "mode=dpfnas",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(None))
    took = time.monotonic() - start
    assert done.returncode != 0, done.stderr
    for rank in (1, 2):
        assert (f"[mpi_fnas rank {rank}] error: AssignmentRefusedError: rank {rank} refuses the search assignment "
                "rank 0 sent: noise_multiplier_w 0.5 where this party derives 1.0") in done.stderr, done.stderr
    assert read_run(out / "search.h5")["status"] == "failed"
    assert took < 120, took  # FAILURE_GRACE is 60 s: rank 0 must have aborted the job on the notice


#: Rank 0 keeps the honest config (augment.network: cnn-tanh) but asks every party to train cnn-gn.
OTHER_NETWORK_SERVER = """
import sys
from mpi_fnas.federation import plan
honest = plan.plan_augment_stage
def lying(*args, **kwargs):
    augment = honest(*args, **kwargs)
    for a in augment.assignments:
        a.network = "cnn-gn"
    return augment
plan.plan_augment_stage = lying
from mpi_fnas.run import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_job_whose_rank_0_asks_for_another_network_fails_with_every_partys_line(tmp_path):
    import subprocess

    from mpi_fnas.runlog import read_run

    out = tmp_path / "run"
    done = subprocess.run([MPIRUN, "-n", "3", sys.executable, "-c", OTHER_NETWORK_SERVER, *TINY, "--set", "mode=dpfnas",
                           "--set", "augment.network=cnn-tanh", "--set", "augment.epochs=1", "--set",
                           "augment.steps_per_epoch=2", "--set", "augment.batch_size=8", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(None))
    assert done.returncode != 0, done.stderr
    for rank in (1, 2):
        assert (f"[mpi_fnas rank {rank}] error: AssignmentRefusedError: rank {rank} refuses the augmentation "
                "assignment rank 0 sent: augment network 'cnn-gn' where this party's config says 'cnn-tanh'"
                ) in done.stderr, done.stderr
    log = read_run(out / "search.h5")
    assert log["augment"]["status"] == "failed" and log["augment"]["network"] == "cnn-tanh"
    assert not (party_dir(out, 1) / "sent_steps").exists()  # nothing was released


#: Rank 0 asks every party to train a cell of sep_conv_5x5 edges, an op its space.ops leaves out: a network larger
#: than the one the run's ε (under secure aggregation, its D) was planned for.
OTHER_OPS_SERVER = """
import sys
from mpi_fnas.federation import plan
honest = plan.plan_augment_stage
LARGER = ("normal=sep_conv_5x5@0,sep_conv_5x5@1|sep_conv_5x5@0,sep_conv_5x5@1;normal_concat=2,3;"
          "reduce=sep_conv_5x5@0,sep_conv_5x5@1|sep_conv_5x5@0,sep_conv_5x5@1;reduce_concat=2,3")
def lying(*args, **kwargs):
    augment = honest(*args, **kwargs)
    for a in augment.assignments:
        a.genotype = LARGER
    return augment
plan.plan_augment_stage = lying
from mpi_fnas.run import main
sys.exit(main(sys.argv[1:]))
"""
OWN_CELL = ("normal=sep_conv_3x3@0,skip_connect@1|sep_conv_3x3@0,skip_connect@2;normal_concat=2,3;"
            "reduce=max_pool_3x3@0,sep_conv_3x3@1|skip_connect@0,sep_conv_3x3@2;reduce_concat=2,3")


@pytest.mark.slow
def test_a_job_whose_rank_0_asks_for_an_op_outside_space_ops_fails_before_any_release(tmp_path):
    """A party builds only a cell of its own config's ``space.ops``, whatever genotype rank 0 sends (secure
    aggregation: its D was planned for the largest network of those ops)."""
    import subprocess

    out = tmp_path / "run"
    done = subprocess.run([MPIRUN, "-n", "3", sys.executable, "-c", OTHER_OPS_SERVER, *TINY, "--set", "mode=dpfnas",
                           "--set", "privacy.aggregation=secure",
                           "--set", "space.ops=[sep_conv_3x3, skip_connect, max_pool_3x3]",
                           "--set", f"augment.genotype={OWN_CELL}", "--set", "augment.epochs=1",
                           "--set", "augment.steps_per_epoch=2", "--set", "augment.batch_size=8", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(None))
    assert done.returncode != 0, done.stderr
    # Under DP a party's error text stays on its own disk; what rank 0 prints says where.
    assert "the party failed; under DP its error text stays with it" in done.stderr, done.stderr
    errors = [party_dir(out, rank) / "error.log" for rank in (1, 2)]
    assert any("unknown op 'sep_conv_5x5'" in path.read_text() for path in errors if path.exists()), done.stderr
    for rank in (1, 2):
        assert not (party_dir(out, rank) / "sent_steps").exists()  # nothing was released
