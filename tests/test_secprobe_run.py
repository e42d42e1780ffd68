"""SecProbe end to end (issue 13): a real mpirun search where the unreliable parties hold pure noise.

One run, 4 parties of which 2 hold only noise images with random labels (``federation.corruption=1``), secprobe
drawing K′ = 2 at a high ε_EM. Checked from the log alone: the unreliable parties are the seed's, the server
chose them less often than the reliable ones, every row chose exactly K′, every party's releases were accounted
(selected or not), and ``/privacy/selection_epsilon`` is the composition of the run's draws, recomputed here in
closed form. The DP noise is small (σ = 0.05: a huge party ε, irrelevant here) so that one release carries
enough signal for the probe within a few steps; the mechanism's own statistics are tests/test_secprobe.py's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import TINY, mpirun

from mpi_fnas.data.corruption import unreliable_parties
from mpi_fnas.runlog import read_run

pytestmark = pytest.mark.slow  # a real mpirun job

PARTIES, UNRELIABLE, SELECT, EPSILON_EM, AUX = 4, 2, 2, 200.0, 200
SECPROBE = [
    "--set", "mode=dpfnas", "--set", f"federation.unreliable_parties={UNRELIABLE}", "--set", "federation.corruption=1",
    "--set", f"federation.aux_size={AUX}", "--set", "federation.selection=secprobe",
    "--set", f"federation.select={SELECT}", "--set", f"federation.selection_epsilon={EPSILON_EM}",
    "--set", "privacy.noise_multiplier_w=0.05", "--set", "privacy.noise_multiplier_a=0.05",
    "--set", "search.w_lr=0.5", "--set", "search.epochs=3", "--set", "search.steps_per_epoch=6",
]


def test_secprobe_chooses_pure_noise_parties_less_often(tmp_path) -> None:
    out = tmp_path / "run"
    result = mpirun(PARTIES + 1, *TINY, *SECPROBE, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    run = read_run(out / "search.h5")
    assert run["status"] == "finished"

    unreliable = np.asarray(run["unreliable"], dtype=bool)
    assert np.array_equal(unreliable, unreliable_parties(PARTIES, UNRELIABLE, seed=0))
    assert run["corruption"] == 1.0

    selection = run["selection"]
    steps = int(run["metrics"]["step"][-1])
    chosen = np.asarray(selection["chosen"], dtype=bool)
    assert list(selection["steps"]) == list(range(1, steps + 1))
    assert (chosen.sum(axis=1) == SELECT).all()
    rate_unreliable, rate_reliable = chosen[:, unreliable].mean(), chosen[:, ~unreliable].mean()
    assert rate_unreliable < rate_reliable, (rate_unreliable, rate_reliable, selection["score"])
    assert np.isfinite(selection["score"]).all() and ((selection["score"] >= 0) & (selection["score"] <= 1)).all()

    # Every party's releases accounted, chosen or not: the same charges and (equal shards) the same ε.
    privacy = run["privacy"]
    assert (privacy["charged_steps"][-1] == steps).all()
    assert np.ptp(privacy["epsilon"][-1]) < 1e-9

    # The selection's ε after step t: min(t·ε_EM, ρ + 2√(ρ ln 1/δ)) with ρ = t·ε_EM²/(8K′), δ = min(1e-5, 1/(10 n)).
    delta = min(1e-5, 1 / (10 * AUX))
    assert selection["delta"] == delta and selection["sensitivity"] == 1 / AUX
    for t, logged in zip(selection["steps"], selection["selection_epsilon"], strict=True):
        rho = t * EPSILON_EM**2 / (8 * SELECT)
        assert logged == pytest.approx(min(t * EPSILON_EM, rho + 2 * math.sqrt(rho * math.log(1 / delta))))
