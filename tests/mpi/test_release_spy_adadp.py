"""ADADP under DP, spied: per step every party hands MPI two W releases (G1 at W, G2 at W_half, each on a fresh
Poisson batch) and one A release, all noised, and nothing else; the ledger charges both W releases. The same for
the augmentation (``augment.optimizer: adadp``): two weight releases per augment iteration, both charged.

A tiny DP-FNAS search of 2 ADADP steps (search.steps_per_epoch 4 W releases) with a checkpoint after step 1.
On every party: the calls to its Party run w_release, load_w, w_release, load_w, a_release, load_a per step;
it sent exactly [G1, G2, H] per step, each bit-for-bit a ``party_release`` output with a zero tail and N(0, (σR)²)
noise. On the server: the checkpoint carries η; the final ledgers hold 2 W releases per step on every train
shard and 1 A release on every validation shard; the log's ``w_lr`` and ``adadp_err`` are finite.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI
from mpi_waits import quiet_barrier
from pre_recipe import PRE_RECIPE
from test_release_spy import (
    RecordingChannel,
    check_noised_releases,
    check_party_messages,
    pin_secret_keys,
    recording_release,
)

import mpi_fnas.federation.local_model as party_module
import mpi_fnas.privacy.release as release_module
from mpi_fnas.config import load_config
from mpi_fnas.federation.flat import STATS
from mpi_fnas.runlog import read_run
from mpi_fnas.stages.job import run_job, run_search

B = 8
SIGMA = 1.5
CLIP_W, CLIP_A = 0.05, 0.2
STEPS = 2  # ADADP steps: 4 W releases per epoch
GENOTYPE = ("normal=sep_conv_3x3@0,skip_connect@1;normal_concat=2;"
            "reduce=max_pool_3x3@0,skip_connect@1;reduce_concat=2")


def spy_on_party(monkeypatch, methods: tuple[str, ...]) -> tuple[list[dict], list[str]]:
    """Pinned keys, every party release recorded (tests/mpi/test_release_spy.py) and the names of the Party
    `methods` called, in order: (the releases, the calls), filled as the job runs."""
    releases: list[dict] = []
    pin_secret_keys(monkeypatch)
    monkeypatch.setattr(release_module, "party_release", recording_release(release_module.party_release, releases))
    calls: list[str] = []
    for name in methods:
        real = getattr(party_module.Party, name)
        monkeypatch.setattr(party_module.Party, name,
                            lambda self, *a, _real=real, _name=name: (calls.append(_name), _real(self, *a))[1])
    return releases, calls


@pytest.mark.mpi(min_size=3)
def test_adadp_parties_release_two_w_and_one_a_per_step(monkeypatch, shared_dir):
    releases, calls = spy_on_party(monkeypatch, ("w_release", "a_release", "load_w", "load_a"))
    cfg = load_config(None, [*PRE_RECIPE,
        "mode=dpfnas", "privacy.aggregation=local", "seed=1", "data.train_size=320", "data.test_size=16",
        "data.image_size=8",
        "space.channels=4", "space.layers=3", "space.nodes=1", f"search.batch_size={B}", "search.epochs=1",
        f"search.steps_per_epoch={2 * STEPS}", "search.w_optimizer=adadp", "search.w_momentum=0",
        f"privacy.noise_multiplier_w={SIGMA}", f"privacy.noise_multiplier_a={SIGMA}", f"privacy.clip_w={CLIP_W}",
        f"privacy.clip_a={CLIP_A}", "runtime.progress=off", "runtime.log_every=1", "checkpoint.every_steps=1",
    ])
    world = MPI.COMM_WORLD
    run_dir = shared_dir("spy-adadp-")
    channel = RecordingChannel(world)
    outcome = run_search(cfg, channel, run_dir)
    quiet_barrier(world)
    if channel.is_server:
        assert outcome.steps == STEPS
        state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
        assert state["step"] == 1 and state["server"]["adadp"]["lr"] > 0  # η travels with the checkpoint
        ledger = outcome.ledger_state
        assert [sum(run[2] for run in t["runs"]) for t in ledger["train"]] == [2 * STEPS] * channel.parties
        assert [sum(run[2] for run in v["runs"]) for v in ledger["val"]] == [STEPS] * channel.parties
        log = read_run(run_dir / "search.h5")
        w_lr, err = log["metrics"]["w_lr"], log["metrics"]["adadp_err"]
        assert log["privacy"]["charged_steps"][-1].tolist() == [STEPS] * channel.parties
        assert len(err) == STEPS and np.all(np.isfinite(err)) and np.all(err > 0)
        assert w_lr[0] == cfg.search.w_lr and 0.9 * w_lr[0] <= w_lr[1] <= 1.1 * w_lr[0]
        return

    check_party_messages(channel)
    per_step = ["w_release", "load_w", "w_release", "load_w", "a_release", "load_a"]
    assert calls[:2] == ["load_w", "load_a"] and calls[2:] == per_step * STEPS  # G2 only after W_half is loaded
    sizes = [len(buf) - STATS for buf in channel.sent]
    assert len(sizes) == 3 * STEPS and sizes[0] == sizes[1] != sizes[2]
    assert sizes == sizes[:3] * STEPS  # [G1, G2, H] per step, nothing else
    assert len(releases) == 3 * STEPS
    check_noised_releases(channel.sent, releases, batch=B, sigma=SIGMA, clips=(CLIP_W, CLIP_A))
    assert [rel["clip"] for rel in releases] == [CLIP_W, CLIP_W, CLIP_A] * STEPS


@pytest.mark.mpi(min_size=3)
def test_adadp_augment_parties_release_two_weight_gradients_per_iteration(monkeypatch, shared_dir):
    """A DP augmentation of a given genotype with ADADP: 2 iterations (augment.steps_per_epoch 4 releases), a
    checkpoint after iteration 1 carrying η; each party sent [G1, G2] per iteration, noised, nothing else."""
    releases, calls = spy_on_party(monkeypatch, ("w_release", "load_w"))
    cfg = load_config(None, [*PRE_RECIPE,
        "mode=dpfnas", "privacy.aggregation=local", "seed=1", "data.train_size=320", "data.test_size=16",
        "data.image_size=8",
        f"augment.genotype={GENOTYPE}", "augment.epochs=1", f"augment.steps_per_epoch={2 * STEPS}",
        f"augment.batch_size={B}", "augment.layers=2", "augment.channels=4", f"augment.noise_multiplier={SIGMA}",
        f"augment.clip={CLIP_W}", "augment.optimizer=adadp", "augment.momentum=0", "runtime.progress=off",
        "runtime.log_every=1", "checkpoint.every_steps=1",
    ])
    world = MPI.COMM_WORLD
    run_dir = shared_dir("spy-adadp-aug-")
    channel = RecordingChannel(world)
    outcome = run_job(cfg, channel, run_dir, stage="augment")
    quiet_barrier(world)
    if channel.is_server:
        assert outcome.augment.steps == STEPS
        state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
        assert state["stage"] == "augment" and state["step"] == 1 and state["server"]["adadp"]["lr"] > 0
        ledger = state["ledger"]  # after iteration 1: two releases on each shard of the pool (pool all)
        assert ledger["augment"]["steps"] == [1] * channel.parties
        assert ledger["augment"]["releases"]["releases_per_step"] == 2
        assert [sum(run[2] for run in t["runs"]) for t in ledger["train"]] == [2] * channel.parties
        assert [sum(run[2] for run in v["runs"]) for v in ledger["val"]] == [2] * channel.parties
        metrics = read_run(run_dir / "search.h5")["augment"]["metrics"]
        lr, err = metrics["lr"], metrics["adadp_err"]
        assert metrics["step"].tolist() == list(range(1, STEPS + 1)) and np.all(np.isfinite(err)) and np.all(err > 0)
        assert lr[0] == cfg.augment.lr and 0.9 * lr[0] <= lr[1] <= 1.1 * lr[0]
        return

    check_party_messages(channel)
    assert calls[:1] == ["load_w"] and calls[1:] == ["w_release", "load_w"] * (2 * STEPS)  # G2 only at W_half
    assert len(channel.sent) == 2 * STEPS == len(releases)  # [G1, G2] per iteration, nothing else
    check_noised_releases(channel.sent, releases, batch=B, sigma=SIGMA, clips=(CLIP_W,))
