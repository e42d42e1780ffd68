"""A party's checks of its assignment over MPI (docs/privacy.md §2.10): rank 0 plays the adversary and sends every
party an assignment with a larger K or a smaller σ, or shards that are not the party's own (repeats, a validation
shard equal to the train shard, indices past its data, another party's shard). Every party refuses, in one line,
before it builds anything or sends a release, and rank 0 learns every refusal from the setup reports; no rank
hangs. Rank 0 sending one party another config or plan than the others is refused by every party in the parties'
own round, before any release. Without MPI:
tests/test_party_checks.py (which also runs a whole job whose rank 0 lies). The honest assignment passes the same
checks in every spy test (tests/mpi/test_release_spy*.py), which run the parties' whole side.

Run with: mpirun -n 5 python -m pytest --with-mpi --only-mpi tests/mpi/test_assignment_refusal.py (any size >= 2).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from pre_recipe import PRE_RECIPE

from mpi_fnas.config import load_config
from mpi_fnas.federation.handshake import announce_last_step, hand_out
from mpi_fnas.federation.job_plan import plan_run
from mpi_fnas.privacy.trusted_config import AssignmentRefusedError
from mpi_fnas.refusal import ReportedRefusalError
from mpi_fnas.stages.party_driver import participate
from mpi_fnas.stages.search import SearchSide

CONFIG = [*PRE_RECIPE, "mode=dpfnas", "data.train_size=400", "data.test_size=40", "data.image_size=8",
          "space.channels=4", "space.layers=3", "space.nodes=2", "search.batch_size=8", "search.steps_per_epoch=2",
          "augment.epochs=0", "runtime.progress=off"]
def _with_dp(change):
    def lie(assignment, train_shards):
        assignment.dp = change(assignment.dp)
    return lie


def _repeats(assignment, train_shards):  # one example at every train position (the attack on a Poisson batch)
    assignment.train_indices = np.full_like(assignment.train_indices, assignment.train_indices[0])


def _val_is_train(assignment, train_shards):  # both ledgers would account the same examples as if they were others
    assignment.val_indices = assignment.train_indices.copy()


def _outside(assignment, train_shards):
    assignment.train_indices = assignment.train_indices + 10_000


def _another_partys(assignment, train_shards):  # distinct, in range, disjoint: but not the party's seeded shard
    mine = next(k for k, shard in enumerate(train_shards) if np.array_equal(shard, assignment.train_indices))
    assignment.train_indices = train_shards[(mine + 1) % len(train_shards)].copy()


#: lie -> (what rank 0 does to each assignment, the start of the refusal's reason)
LIES = {"K": (_with_dp(lambda dp: dataclasses.replace(dp, parties=dp.parties + 1)), "parties "),
        "sigma": (_with_dp(lambda dp: dp.with_noise(dp.noise_multiplier_w, dp.noise_multiplier_a / 4)),
                  "noise_multiplier_a "),
        "repeats": (_repeats, "train indices repeat examples"),
        "val is train": (_val_is_train, "validation indices share"),
        "outside": (_outside, "train indices point outside"),
        "another party's": (_another_partys, "train indices .* are not the examples of the seeded iid split")}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_changed_assignment_is_refused_by_every_party(channel, lie, shared_dir):
    cfg = load_config(None, CONFIG)
    run_dir = shared_dir("assignment-refusal-")
    change, reason = LIES[lie]
    if lie == "another party's" and channel.parties < 2:
        pytest.skip("one party has no other party's shard")
    if channel.is_server:
        plan = plan_run(cfg, channel.parties)
        train_shards = [a.train_indices.copy() for a in plan.assignments]  # every party's, as planned
        for assignment in plan.assignments:
            change(assignment, train_shards)
        reports = hand_out(channel, plan.assignments)
        assert sorted(reports.refusals) == list(range(1, channel.size))  # every party, each in its own line
        for rank, line in reports.refusals.items():
            assert line.startswith(f"AssignmentRefusedError: rank {rank} refuses the search assignment rank 0 sent")
            assert "\n" not in line
        return
    # Printed, and in its setup report (rank 0 marks the log failed): the party raises ReportedRefusalError.
    with pytest.raises(ReportedRefusalError, match=rf"^AssignmentRefusedError: rank {channel.rank} refuses the search "
                                                   rf"assignment rank 0 sent: {reason}") as refused:
        participate(cfg, channel, run_dir, SearchSide(cfg))
    assert isinstance(refused.value.__cause__, AssignmentRefusedError)
    assert not (run_dir / "parties" / f"rank{channel.rank}" / "sent_steps").exists()  # nothing was released


#: A key no party checks against its own config, or the exchange pattern: the parties' round catches it (a step
#: count that differs is refused by the party's own step check first).
ONE_PARTY_LIES = ["search.warmup_epochs", "exchange pattern"]


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("lie", ONE_PARTY_LIES)
def test_a_config_or_plan_rank_0_changes_for_one_party_is_refused_by_every_party(channel, lie, shared_dir):
    """Party 1 runs another warm-up (or was told another exchange pattern) than the others: before, it waited at a
    different exchange than they did until ``runtime.comm_timeout``; now every party refuses at setup, naming the
    ranks."""
    cfg = load_config(None, CONFIG)
    run_dir = shared_dir("plan-refusal-")
    plan = plan_run(cfg, channel.parties)
    if channel.is_server:
        reports = hand_out(channel, plan.assignments)
        assert not reports.refusals  # each assignment alone is one its party accepts
        announce_last_step(channel, plan.steps)
        return
    if channel.rank == 1 and lie == "search.warmup_epochs":
        cfg.search.warmup_epochs = 1  # as if rank 0 had sent party 1 this config
    if channel.rank == 1 and lie == "exchange pattern":
        channel.pattern = "collective"  # as if rank 0 had told party 1 this pattern
    others = ", ".join(map(str, range(2, channel.size))) if channel.rank == 1 else "1"
    with pytest.raises(AssignmentRefusedError, match=rf"^rank {channel.rank} refuses the search plan: rank 0 sent "
                                                     rf"rank\(s\) {others} another config, stage plan or "
                                                     r"exchange pattern"):
        participate(cfg, channel, run_dir, SearchSide(cfg))
    assert not (run_dir / "parties" / f"rank{channel.rank}" / "sent_steps").exists()  # nothing was released
