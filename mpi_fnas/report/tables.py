"""Grouping finished runs by (mode, K, noise variance), averaging over seeds, and the CSV text of Tables 1 and 2.

Only finished runs (RunRecord.final) enter a group. Table 1 has one row per (mode, parties): a (mode, K) whose
runs span several noise variances is a noise study, shown in Table 2 only (averaging over different σ would mix
settings, and Table 1 has no σ column). Table 2 is made when such a study exists: one row per (K, σ²) of it.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from mpi_fnas.report.collect import MODE_ORDER, STAGE_AUGMENT, STAGE_SUPERNET, RunRecord

TABLE1_CSV = "table1.csv"
TABLE2_CSV = "table2.csv"
TABLE1_COLUMNS = (
    "mode", "parties", "runs", "test_error_mean", "test_error_std", "stage", "params_m", "search_gpu_days",
    "search_cpu_core_hours", "search_wall_hours", "attempts", "epsilon_worst",
)
TABLE2_COLUMNS = ("noise_variance", "runs", "val_or_test_error_mean", "val_or_test_error_std", "epsilon_worst")


@dataclass(frozen=True)
class Group:
    """The finished runs of one (mode, parties, noise variance), usually one per seed.

    ``stage`` is STAGE_AUGMENT when any run of the group finished an augmentation; the means are then over those
    runs only, and the group's search-only runs are in ``left_out`` (an augmented and a supernet error are not
    the same quantity). Otherwise every run is a supernet run and ``left_out`` is empty.
    """

    mode: str
    parties: int
    noise_variance: float | None
    stage: str
    runs: tuple[RunRecord, ...]  # the runs averaged
    left_out: tuple[RunRecord, ...] = ()

    @property
    def test_error_mean(self) -> float:
        """Mean test error (fraction) over the runs."""
        return _mean(r.test_error for r in self.runs)

    @property
    def test_error_std(self) -> float:
        """Sample standard deviation (ddof 1) of the test error over the runs; NaN for one run."""
        return _std(r.test_error for r in self.runs)

    @property
    def params_m(self) -> float:
        """Mean parameter count of the augmented networks, in millions; NaN for a supernet group (the paper's
        column is the evaluated network's size; a supernet's is neither comparable nor logged)."""
        if self.stage != STAGE_AUGMENT:
            return math.nan
        return _mean(r.params for r in self.runs if r.params is not None) / 1e6

    @property
    def search_gpu_days(self) -> float:
        """Mean search cost in GPU-days (/cost gpu_hours / 24; 0 on CPU-only runs)."""
        return _mean(r.search_gpu_hours for r in self.runs) / 24.0

    @property
    def search_cpu_core_hours(self) -> float:
        """Mean search cost in CPU core-hours (/cost cpu_core_hours: one core per rank)."""
        return _mean(r.search_cpu_core_hours for r in self.runs)

    @property
    def search_wall_hours(self) -> float:
        """Mean wall time of the search in hours (/cost wall_seconds / 3600, summed over a run's attempts)."""
        return _mean(r.search_wall_seconds for r in self.runs) / 3600.0

    @property
    def attempts(self) -> float:
        """Mean number of attempts of the search per run (1: no run was requeued or resumed)."""
        return _mean(r.attempts for r in self.runs)

    @property
    def epsilon_worst(self) -> float:
        """The largest ε over the runs and parties (search + augment where augmented privately); NaN: no DP."""
        values = [r.epsilon_worst for r in self.runs if not math.isnan(r.epsilon_worst)]
        return max(values) if values else math.nan


def group_runs(runs: Iterable[RunRecord]) -> list[Group]:
    """Group the finished runs of `runs` by (mode, parties, noise variance), in table order (mode as the paper
    orders them, then K, then σ²). Unfinished runs are left out here; the report lists them with their status."""
    buckets: dict[tuple[str, int, float | None], list[RunRecord]] = {}
    for run in runs:
        if run.final:
            buckets.setdefault((run.mode, run.parties, run.noise_variance), []).append(run)
    groups = []
    for (mode, parties, variance), members in buckets.items():
        augmented = tuple(r for r in members if r.augmented)
        if augmented:
            group = Group(mode, parties, variance, STAGE_AUGMENT, augmented,
                          tuple(r for r in members if not r.augmented))
        else:
            group = Group(mode, parties, variance, STAGE_SUPERNET, tuple(members))
        groups.append(group)
    return sorted(groups, key=_order)


def noise_studies(groups: Sequence[Group]) -> set[tuple[str, int]]:
    """The (mode, parties) settings whose finished runs span several noise variances."""
    seen: dict[tuple[str, int], set[float | None]] = {}
    for g in groups:
        seen.setdefault((g.mode, g.parties), set()).add(g.noise_variance)
    return {setting for setting, variances in seen.items() if len(variances) > 1}


def table1_groups(groups: Sequence[Group]) -> list[Group]:
    """Table 1's rows: one group per (mode, parties), noise studies excluded (they are Table 2)."""
    studies = noise_studies(groups)
    return [g for g in groups if (g.mode, g.parties) not in studies]


def table2_groups(groups: Sequence[Group]) -> list[Group]:
    """Table 2's rows: the groups of the noise studies, by K then σ²; empty when there is no study."""
    studies = noise_studies(groups)
    rows = [g for g in groups if (g.mode, g.parties) in studies]
    return sorted(rows, key=lambda g: (g.parties, g.noise_variance or 0.0))


def table1_rows(groups: Sequence[Group]) -> list[dict[str, object]]:
    """The rows of table1.csv (TABLE1_COLUMNS), one per group of `groups` (see table1_groups)."""
    return [{
        "mode": g.mode, "parties": g.parties, "runs": len(g.runs),
        "test_error_mean": g.test_error_mean, "test_error_std": g.test_error_std, "stage": g.stage,
        "params_m": g.params_m, "search_gpu_days": g.search_gpu_days,
        "search_cpu_core_hours": g.search_cpu_core_hours, "search_wall_hours": g.search_wall_hours,
        "attempts": g.attempts, "epsilon_worst": g.epsilon_worst,
    } for g in groups]


def table2_rows(groups: Sequence[Group]) -> list[dict[str, object]]:
    """The rows of table2.csv (TABLE2_COLUMNS), one per group of `groups` (see table2_groups)."""
    return [{
        "noise_variance": g.noise_variance, "runs": len(g.runs), "val_or_test_error_mean": g.test_error_mean,
        "val_or_test_error_std": g.test_error_std, "epsilon_worst": g.epsilon_worst,
    } for g in groups]


def csv_text(columns: Sequence[str], rows: Sequence[dict[str, object]]) -> str:
    """CSV with a header line. Floats are written in full (repr: they read back exactly); NaN as ``nan``, ∞ as
    ``inf``."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _order(g: Group) -> tuple:
    mode = MODE_ORDER.index(g.mode) if g.mode in MODE_ORDER else len(MODE_ORDER)
    return mode, g.mode, g.parties, g.noise_variance if g.noise_variance is not None else -1.0


def _mean(values: Iterable[float]) -> float:
    array = np.asarray(list(values), dtype=float)
    return float(array.mean()) if array.size else math.nan


def _std(values: Iterable[float]) -> float:
    array = np.asarray(list(values), dtype=float)
    return float(array.std(ddof=1)) if array.size > 1 else math.nan

