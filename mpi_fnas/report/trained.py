"""Runs that trained a network without searching for it: a given cell (``augment.genotype``) or a hand-designed
network (``augment.network``: cnn-tanh, cnn-gn). Each kind gets its own groups, beside Tables 1 and 2 and never
averaged into them.

A group is one (what was trained, the cell or network named, mode, K, the augmentation's noise setting, what ε
covers), averaged over seeds: two given cells are two groups, and a run that did not search has no σ_W². Its ε is
the augmentation's alone ("augment"); a hand-designed network trained after a finished search (``--augment RUN_DIR
--set augment.network=...``) keeps its search in its ε ("search + augment") and is grouped apart from those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mpi_fnas.report.baseline import under
from mpi_fnas.report.collect import STAGE_AUGMENT, RunRecord
from mpi_fnas.report.tables import Group

TRAINED_CSV = "trained.csv"
TRAINED_COLUMNS = ("trained", "named", "mode", "parties", "augment_noise_variance", "runs", "test_error_mean",
                   "test_error_std", "params_m", "epsilon_worst", "epsilon_covers")


@dataclass(frozen=True)
class TrainedGroup(Group):
    """The finished runs that trained one given cell or one hand-designed network in one setting. ``trained`` is
    :attr:`RunRecord.trained` (``augmentation of a given cell`` or the network's name), ``named`` the genotype of
    the cell or the network's name, ``epsilon_covers`` what the group's ε covers (``augment``, or ``search +
    augment`` after a search; empty without DP)."""

    trained: str = ""
    named: str = ""
    epsilon_covers: str = ""


def trained_runs(runs: Sequence[RunRecord], baselines: Sequence[Path]) -> list[RunRecord]:
    """The finished runs of a given cell or a hand-designed network, outside every baseline (a baseline's
    hand-designed arms are compared in its own section)."""
    return [run for run in runs if run.final and not run.searched_cell and not under(run.path, baselines)]


def trained_groups(runs: Sequence[RunRecord]) -> list[TrainedGroup]:
    """Group `runs` (see :func:`trained_runs`) by (trained, named, mode, K, augmentation private, σ_aug², ε covers),
    ordered by those keys."""
    buckets: dict[tuple, list[RunRecord]] = {}
    for run in runs:
        named = run.network if run.handcrafted else run.genotype
        key = (run.trained, named, run.mode, run.parties, run.augment_private, run.augment_noise_variance,
               run.epsilon_covers)
        buckets.setdefault(key, []).append(run)
    groups = [TrainedGroup(mode, parties, None, private, variance, STAGE_AUGMENT, tuple(members), trained=trained,
                           named=named, epsilon_covers=covers)
              for (trained, named, mode, parties, private, variance, covers), members in buckets.items()]
    return sorted(groups, key=lambda g: (g.trained, g.named, g.mode, g.parties, str(g.augment_noise_variance),
                                         g.epsilon_covers))


def trained_rows(groups: Sequence[TrainedGroup]) -> list[dict[str, object]]:
    """The rows of trained.csv (TRAINED_COLUMNS), one per group."""
    return [{
        "trained": g.trained, "named": g.named, "mode": g.mode, "parties": g.parties,
        "augment_noise_variance": g.augment_noise_variance, "runs": len(g.runs), "test_error_mean": g.test_error_mean,
        "test_error_std": g.test_error_std, "params_m": g.params_m, "epsilon_worst": g.epsilon_worst,
        "epsilon_covers": g.epsilon_covers,
    } for g in groups]
