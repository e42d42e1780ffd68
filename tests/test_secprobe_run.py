"""SecProbe end to end (issue 13): a real mpirun search where the unreliable parties hold pure noise.

One run, 4 parties of which 2 hold only noise images with random labels (``federation.corruption=1``), secprobe
drawing K′ = 2 at a very high ε_EM, where the exponential mechanism is (numerically) the top-K′ of the scores.
Checked from the log alone: the unreliable parties are the seed's, every step chose exactly K′ parties and they
are the best-scored ones, the scores are accuracies on the aux set, every party's releases were accounted
(selected or not), and ``/privacy/selection_epsilon`` is the composition of the run's draws, recomputed here in
closed form. The mechanism's own statistics are tests/test_secprobe.py's.

Not asserted here: that the pure-noise parties are chosen less often. At this scale the supernet is at chance
(measured: 60 non-DP steps of plain SGD leave it at ≤ 0.19 aux accuracy), so the probe's scores do not yet tell
noise releases from clean ones; that rate is the experiment's (docs/secprobe.md).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import TINY, mpirun

from mpi_fnas.data.corruption import unreliable_parties
from mpi_fnas.runlog import read_run

pytestmark = pytest.mark.slow  # a real mpirun job

PARTIES, UNRELIABLE, SELECT, EPSILON_EM, AUX = 4, 2, 2, 1e6, 200
SECPROBE = [
    "--set", "mode=dpfnas", "--set", f"federation.unreliable_parties={UNRELIABLE}", "--set", "federation.corruption=1",
    "--set", f"federation.aux_size={AUX}", "--set", "federation.selection=secprobe",
    "--set", f"federation.select={SELECT}", "--set", f"federation.selection_epsilon={EPSILON_EM}",
    "--set", "privacy.noise_multiplier_w=0.05", "--set", "privacy.noise_multiplier_a=0.05",
]


def test_secprobe_run_chooses_the_best_scored_parties_and_accounts_every_draw(tmp_path) -> None:
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
    score = np.asarray(selection["score"])
    assert np.isfinite(score).all() and ((score >= 0) & (score <= 1)).all()
    assert np.allclose(score * AUX, np.round(score * AUX))  # accuracies on the AUX examples (window 1)
    for row_chosen, row_score in zip(chosen, score, strict=True):  # ε_EM·Δu⁻¹ huge: the top-K′ (ties either way)
        assert row_score[row_chosen].min() >= row_score[~row_chosen].max()

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
