"""Grouping finished runs by (mode, K, noise setting), averaging over seeds, and the CSV text of Tables 1 and 2.

A run's noise setting is the search's noise variance σ_W² and its augmentation's: whether the augmentation was
private and, if so, its noise variance σ_aug² (an ε–accuracy study varies σ_aug at one σ_W, as
scripts/augment_table.sh does). Only finished runs (RunRecord.final) enter a group. Table 1 has one row per
(mode, parties): a (mode, K) whose runs span several noise settings is a noise study, shown in Table 2 only
(averaging over different σ would mix settings, and Table 1 has no σ column). Table 2 is made when such a study
exists: one row per (K, σ_W², σ_aug²) of it.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from mpi_fnas.report.collect import MODE_ORDER, STAGE_AUGMENT, STAGE_SUPERNET, RunRecord
from mpi_fnas.sweep import variance_label

TABLE1_CSV = "table1.csv"
TABLE2_CSV = "table2.csv"
TABLE1_COLUMNS = (
    "mode", "parties", "runs", "test_error_mean", "test_error_std", "stage", "params_m", "search_gpu_days",
    "search_cpu_core_hours", "search_wall_hours", "attempts", "epsilon_worst", "colluders", "epsilon_augment_worst",
)
#: The paper's Table 2 columns, then the ones that say which row is which: σ_aug² (empty: the augmentation was not
#: private, or there was none: see stage), K and the stage of the error.
TABLE2_COLUMNS = ("noise_variance", "runs", "val_or_test_error_mean", "val_or_test_error_std", "epsilon_worst",
                  "augment_noise_variance", "parties", "stage")


@dataclass(frozen=True)
class Group:
    """The finished runs of one (mode, parties, noise setting), usually one per seed.

    The noise setting is ``noise_variance`` (the search's σ_W²), ``augment_private`` and ``augment_noise_variance``
    (σ_aug², None when the augmentation was not private); both augmentation fields are None in a supernet group.
    ``stage`` is STAGE_AUGMENT when the group's runs finished an augmentation; the means are over those runs only,
    and the search-only runs of the same (mode, parties, σ_W²) are in ``left_out`` (an augmented and a supernet
    error are not the same quantity). Otherwise every run is a supernet run and ``left_out`` is empty.
    """

    mode: str
    parties: int
    noise_variance: float | None
    augment_private: bool | None
    augment_noise_variance: float | None
    stage: str
    runs: tuple[RunRecord, ...]  # the runs averaged
    left_out: tuple[RunRecord, ...] = ()

    @property
    def setting(self) -> tuple[float | None, bool | None, float | None]:
        """The noise setting: (σ_W², whether the augmentation was private, σ_aug²)."""
        return self.noise_variance, self.augment_private, self.augment_noise_variance

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

    @property
    def epsilon_augment_worst(self) -> float:
        """The largest ε over the runs and parties of the augmentation alone, its search not charged (the DPNAS
        protocol's ε); NaN where no run logged one."""
        values = [r.epsilon_augment_alone for r in self.runs if not math.isnan(r.epsilon_augment_alone)]
        return max(values) if values else math.nan

    @property
    def colluders(self) -> int:
        """The ``privacy.colluders`` t that :attr:`epsilon_worst` holds against with the server (one per group)."""
        return max((r.colluders for r in self.runs), default=0)


def group_runs(runs: Iterable[RunRecord]) -> list[Group]:
    """Group the finished runs of `runs` by (mode, parties, σ_W², colluders, augmentation private, σ_aug²), in table
    order (mode as the paper orders them, then K, σ_W², σ_aug²). Unfinished runs are left out here; the report lists
    them with their status. Among the runs of one (mode, parties, σ_W², colluders), the augmented ones are grouped by
    their augmentation's setting and the search-only ones are left out of each such group; if none was augmented,
    they are one supernet group."""
    buckets: dict[tuple[str, int, float | None, int], list[RunRecord]] = {}
    for run in runs:
        if run.final:
            buckets.setdefault((run.mode, run.parties, run.noise_variance, run.colluders), []).append(run)
    groups = []
    for (mode, parties, variance, _), members in buckets.items():
        search_only = tuple(r for r in members if not r.augmented)
        by_augment: dict[tuple[bool | None, float | None], list[RunRecord]] = {}
        for run in members:
            if run.augmented:
                by_augment.setdefault((run.augment_private, run.augment_noise_variance), []).append(run)
        for (private, augment_variance), augmented in by_augment.items():
            groups.append(Group(mode, parties, variance, private, augment_variance, STAGE_AUGMENT,
                                tuple(augmented), search_only))
        if not by_augment:
            groups.append(Group(mode, parties, variance, None, None, STAGE_SUPERNET, search_only))
    return sorted(groups, key=_order)


def noise_studies(groups: Sequence[Group]) -> set[tuple[str, int]]:
    """The (mode, parties) settings whose finished runs span several noise settings (σ_W², or the augmentation's:
    σ_aug², private or not)."""
    seen: dict[tuple[str, int], set[tuple[float | None, bool | None, float | None]]] = {}
    for g in groups:
        seen.setdefault((g.mode, g.parties), set()).add(g.setting)
    return {setting for setting, settings in seen.items() if len(settings) > 1}


def table1_groups(groups: Sequence[Group]) -> list[Group]:
    """Table 1's rows: one group per (mode, parties), noise studies excluded (they are Table 2)."""
    studies = noise_studies(groups)
    return [g for g in groups if (g.mode, g.parties) not in studies]


def table2_groups(groups: Sequence[Group]) -> list[Group]:
    """Table 2's rows: the groups of the noise studies, by K, σ_W², σ_aug² (a non-private augmentation first), then
    mode; empty when there is no study."""
    studies = noise_studies(groups)
    rows = [g for g in groups if (g.mode, g.parties) in studies]
    return sorted(rows, key=lambda g: (g.parties, _or_below(g.noise_variance), _or_below(g.augment_noise_variance),
                                       *_order(g)[:2]))


def table1_rows(groups: Sequence[Group]) -> list[dict[str, object]]:
    """The rows of table1.csv (TABLE1_COLUMNS), one per group of `groups` (see table1_groups)."""
    return [{
        "mode": g.mode, "parties": g.parties, "runs": len(g.runs),
        "test_error_mean": g.test_error_mean, "test_error_std": g.test_error_std, "stage": g.stage,
        "params_m": g.params_m, "search_gpu_days": g.search_gpu_days,
        "search_cpu_core_hours": g.search_cpu_core_hours, "search_wall_hours": g.search_wall_hours,
        "attempts": g.attempts, "epsilon_worst": g.epsilon_worst, "colluders": g.colluders,
        "epsilon_augment_worst": g.epsilon_augment_worst,
    } for g in groups]


def table2_rows(groups: Sequence[Group]) -> list[dict[str, object]]:
    """The rows of table2.csv (TABLE2_COLUMNS), one per group of `groups` (see table2_groups)."""
    return [{
        "noise_variance": g.noise_variance, "runs": len(g.runs), "val_or_test_error_mean": g.test_error_mean,
        "val_or_test_error_std": g.test_error_std, "epsilon_worst": g.epsilon_worst,
        "augment_noise_variance": g.augment_noise_variance, "parties": g.parties, "stage": g.stage,
    } for g in groups]


def noise_label(variance: float | None) -> str:
    """A noise variance as the report shows it ("–": none, no DP)."""
    return "–" if variance is None else variance_label(variance)


def augment_noise_label(item: Group | RunRecord) -> str:
    """σ_aug² of a group or run as the report shows it: "–" without an augmentation, "not private" for one with
    augment.private false."""
    if item.augment_private is None:
        return "–"
    return noise_label(item.augment_noise_variance) if item.augment_private else "not private"


def csv_text(columns: Sequence[str], rows: Sequence[dict[str, object]]) -> str:
    """CSV with a header line. Floats are written in full (repr: they read back exactly); NaN as ``nan``, ∞ as
    ``inf``, None as an empty field."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _order(g: Group) -> tuple:
    mode = MODE_ORDER.index(g.mode) if g.mode in MODE_ORDER else len(MODE_ORDER)
    return mode, g.mode, g.parties, _or_below(g.noise_variance), _or_below(g.augment_noise_variance)


def _or_below(variance: float | None) -> float:
    """A variance as a sort key: None (no noise) before every variance."""
    return -1.0 if variance is None else variance


def _mean(values: Iterable[float]) -> float:
    array = np.asarray(list(values), dtype=float)
    return float(array.mean()) if array.size else math.nan


def _std(values: Iterable[float]) -> float:
    array = np.asarray(list(values), dtype=float)
    return float(array.std(ddof=1)) if array.size > 1 else math.nan

