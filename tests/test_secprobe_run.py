"""SecProbe end to end: one real MPI job, a search and then an augmentation, where the unreliable
parties hold pure noise. The only real-MPI test of SecProbe; everything else is in process
(tests/test_secprobe.py, tests/test_secprobe_augment.py).

4 parties of which 2 hold only noise images with random labels (``federation.corruption=1``), secprobe drawing
K′ = 2 at a very high ε_EM, where the exponential mechanism is (numerically) the top-K′ of the scores, in both
stages. Checked from the log alone: the unreliable parties are the seed's; every step of each stage chose exactly
K′ parties and they are the best-scored ones; the scores are accuracies on the aux set; every party's releases
were accounted (selected or not); ``/privacy/selection_epsilon`` is the composition of the search's draws and
``/augment/privacy/selection_epsilon`` that of the search's and the augmentation's together, recomputed here in
closed form. That secprobe chooses pure-noise parties less often is tests/test_secprobe_augment.py's (a tiny
network at chance gives every release the same score: docs/secprobe.md).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import TINY, warm_job

from mpi_fnas.data.corruption import unreliable_parties
from mpi_fnas.runlog import read_run

pytestmark = pytest.mark.slow  # a real MPI job

PARTIES, UNRELIABLE, SELECT, EPSILON_EM, AUX = 4, 2, 2, 1e6, 100
SEARCH_STEPS, AUGMENT_STEPS = 3, 3
SECPROBE = [
    "--set", "mode=dpfnas", "--set", f"federation.unreliable_parties={UNRELIABLE}", "--set", "federation.corruption=1",
    "--set", f"federation.aux_size={AUX}", "--set", "federation.selection=secprobe",
    "--set", f"federation.select={SELECT}", "--set", f"federation.selection_epsilon={EPSILON_EM}",
    "--set", "search.epochs=1", "--set", f"search.steps_per_epoch={SEARCH_STEPS}",
    "--set", "augment.epochs=1", "--set", f"augment.steps_per_epoch={AUGMENT_STEPS}", "--set", "augment.layers=1",
    "--set", "augment.channels=4", "--set", "augment.batch_size=8",
]  # the default σ: a tiny σ makes rank 0's PLD accounting the slowest part of the job (minutes)


def closed_form(draws: int, delta: float) -> float:
    """min(T·ε_EM, ρ + 2√(ρ ln 1/δ)) with ρ = T·ε_EM²/(8K′)."""
    rho = draws * EPSILON_EM**2 / (8 * SELECT)
    return min(draws * EPSILON_EM, rho + 2 * math.sqrt(rho * math.log(1 / delta)))


def check_stage(selection: dict, steps: int) -> None:
    """Every step chose exactly K′ parties, the best-scored (ties either way), on aux-set accuracies."""
    chosen = np.asarray(selection["chosen"], dtype=bool)
    assert list(selection["steps"]) == list(range(1, steps + 1))
    assert (chosen.sum(axis=1) == SELECT).all()
    score = np.asarray(selection["score"])
    assert np.isfinite(score).all() and ((score >= 0) & (score <= 1)).all()
    assert np.allclose(score * AUX, np.round(score * AUX))  # accuracies on the AUX examples (window 1)
    for row_chosen, row_score in zip(chosen, score, strict=True):  # ε_EM·Δu⁻¹ huge: the top-K′
        assert row_score[row_chosen].min() >= row_score[~row_chosen].max()


def test_secprobe_run_of_both_stages_chooses_the_best_scored_parties_and_accounts_every_draw(tmp_path) -> None:
    out = tmp_path / "run"
    result = warm_job(PARTIES + 1, *TINY, *SECPROBE, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    run = read_run(out / "search.h5")
    augment = run["augment"]
    assert run["status"] == "finished" and augment["status"] == "finished"

    unreliable = np.asarray(run["unreliable"], dtype=bool)
    assert np.array_equal(unreliable, unreliable_parties(PARTIES, UNRELIABLE, seed=0))
    assert run["corruption"] == 1.0

    check_stage(run["selection"], SEARCH_STEPS)
    check_stage(augment["selection"], AUGMENT_STEPS)

    # Every party's releases accounted, chosen or not: the same charges and (equal shards) the same ε.
    assert (run["privacy"]["charged_steps"][-1] == SEARCH_STEPS).all()
    assert np.ptp(run["privacy"]["epsilon"][-1]) < 1e-9
    assert np.ptp(augment["privacy"]["epsilon"][-1]) < 1e-9
    assert (augment["privacy"]["epsilon"][-1] > run["privacy"]["epsilon"][-1]).all()  # both stages composed

    # The selection's ε: the search's draws, then the augmentation's counted on top of them.
    delta = min(1e-5, 1 / (10 * AUX))
    for selection, before in ((run["selection"], 0), (augment["selection"], SEARCH_STEPS)):
        assert selection["delta"] == delta and selection["sensitivity"] == 1 / AUX
        for t, logged in zip(selection["steps"], selection["selection_epsilon"], strict=True):
            assert logged == pytest.approx(closed_form(before + t, delta))
