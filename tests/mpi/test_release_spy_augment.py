"""The augmentation, spied like the search: everything a DP party hands to MPI is a noised release or data-independent.

A DP job that trains a given genotype (no search) with a checkpoint every 2 steps. On every party:
  * it sent exactly one buffer per step (its weight release) and nothing else (no statistics, no evaluation);
  * each buffer's gradient part is bit-for-bit the output of a ``party_release`` call, with a zero tail;
  * release·B − clipped sum is N(0, (σR)²) per coordinate (chi-square bounds on the pooled variance);
  * every object it sent is plain data (its device, its augment sent-steps count, checkpoint acknowledgements);
and on the server: the augmentation's checkpoint holds no party state, while each party's own directory does.
Twice: with every release reduced, and under SecProbe's selection (releases gathered, one party's pool partly noise).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from mpi4py import MPI
from test_release_spy import (
    SELECTING,
    RecordingChannel,
    check_checkpoint_holds_no_party_state,
    check_noised_releases,
    check_party_messages,
    pin_secret_keys,
    recording_release,
)

import mpi_fnas.privacy.release as release_module
from mpi_fnas.config import load_config
from mpi_fnas.federation.job import run_job
from mpi_fnas.runlog import read_run

B = 8
SIGMA = 1.5
CLIP = 0.1
STEPS = 3
GENOTYPE = ("normal=sep_conv_3x3@0,skip_connect@1;normal_concat=2;"
            "reduce=max_pool_3x3@0,skip_connect@1;reduce_concat=2")


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("selecting", [False, True], ids=["reduce", "secprobe"])
def test_augment_parties_hand_only_noised_releases_to_mpi(monkeypatch, selecting):
    releases: list[dict] = []
    pin_secret_keys(monkeypatch)
    monkeypatch.setattr(release_module, "party_release", recording_release(release_module.party_release, releases))
    cfg = load_config(None, [
        "mode=dpfnas", "seed=1", "data.train_size=320", "data.test_size=16", "data.image_size=8",
        f"augment.genotype={GENOTYPE}", "augment.epochs=1", f"augment.steps_per_epoch={STEPS}",
        f"augment.batch_size={B}", "augment.layers=2", "augment.channels=4", f"augment.noise_multiplier={SIGMA}",
        f"augment.clip={CLIP}", "runtime.progress=off", "checkpoint.every_steps=2", *(SELECTING if selecting else []),
    ])
    world = MPI.COMM_WORLD
    run_dir = Path(world.bcast(tempfile.mkdtemp(prefix="spy-augment-") if world.Get_rank() == 0 else None, root=0))
    channel = RecordingChannel(world)
    run_job(cfg, channel, run_dir, stage="augment")
    world.Barrier()
    if channel.is_server:
        state = check_checkpoint_holds_no_party_state(
            run_dir, ["format_version", "stage", "step", "plan_steps", "genotype", "config", "server", "selection",
                      "ledger", "stats", "test_acc", "test_loss", "log_rows"], party_state="augment-state-2.pt")
        assert state["stage"] == "augment" and state["step"] == 2
        # the log's release constants are the configured public ones (never a realised batch size)
        privacy = read_run(run_dir / "search.h5")["augment"]["privacy"]
        assert (privacy["expected_batch_size"], privacy["clip"], privacy["noise_multiplier"]) == (B, CLIP, SIGMA)
        return

    check_party_messages(channel, exchange="gather" if selecting else "reduce_sum")

    assert len(channel.sent) == STEPS == len(releases)  # one release per step, nothing else
    check_noised_releases(channel.sent, releases, batch=B, sigma=SIGMA, clips=(CLIP,))
