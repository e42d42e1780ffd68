"""A party's checks of its assignment over MPI (issue 45, docs/privacy.md §2.10): rank 0 plays the adversary and
sends every party an assignment with a larger K or a smaller σ. Every party refuses, in one line, before it builds
anything or sends a release, and rank 0 learns every refusal from the setup reports; no rank hangs. Without MPI:
tests/test_party_checks.py (which also runs a whole job whose rank 0 lies). The honest assignment passes the same
checks in every spy test (tests/mpi/test_release_spy*.py), which run the parties' whole side.

Run with: mpirun -n 5 python -m pytest --with-mpi --only-mpi tests/mpi/test_assignment_refusal.py (any size >= 2).
"""

from __future__ import annotations

import dataclasses

import pytest
from pre_recipe import PRE_RECIPE

from mpi_fnas.cli import ReportedRefusalError
from mpi_fnas.config import load_config
from mpi_fnas.federation.handshake import hand_out
from mpi_fnas.federation.participate import SearchSide, participate
from mpi_fnas.federation.plan import plan_run
from mpi_fnas.privacy.trusted_config import AssignmentRefusedError

CONFIG = [*PRE_RECIPE, "mode=dpfnas", "data.train_size=400", "data.test_size=40", "data.image_size=8",
          "space.channels=4", "space.layers=3", "space.nodes=2", "search.batch_size=8", "search.steps_per_epoch=2",
          "augment.epochs=0", "runtime.progress=off"]
LIES = {"K": lambda dp: dataclasses.replace(dp, parties=dp.parties + 1),
        "sigma": lambda dp: dp.with_noise(dp.noise_multiplier_w, dp.noise_multiplier_a / 4)}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_changed_assignment_is_refused_by_every_party(channel, lie, shared_dir):
    cfg = load_config(None, CONFIG)
    run_dir = shared_dir("assignment-refusal-")
    if channel.is_server:
        plan = plan_run(cfg, channel.parties)
        for assignment in plan.assignments:
            assignment.dp = LIES[lie](assignment.dp)
        reports = hand_out(channel, plan.assignments)
        assert sorted(reports.refusals) == list(range(1, channel.size))  # every party, each in its own line
        for rank, line in reports.refusals.items():
            assert line.startswith(f"AssignmentRefusedError: rank {rank} refuses the search assignment rank 0 sent")
            assert "\n" not in line
        return
    name = {"K": "parties", "sigma": "noise_multiplier_a"}[lie]
    # Printed, and in its setup report (rank 0 marks the log failed): the party raises ReportedRefusalError.
    with pytest.raises(ReportedRefusalError, match=rf"^AssignmentRefusedError: rank {channel.rank} refuses the search "
                                                   rf"assignment rank 0 sent: {name} ") as refused:
        participate(cfg, channel, run_dir, SearchSide(cfg))
    assert isinstance(refused.value.__cause__, AssignmentRefusedError)
    assert not (run_dir / "parties" / f"rank{channel.rank}" / "sent_steps").exists()  # nothing was released
