"""A baseline's results, read back from its arms' logs: ``baseline.csv`` and the comparison NAS researchers make.

No MPI, no torch. Every number comes from an arm's ``search.h5`` (:func:`mpi_fnas.runlog.read_run`): ``test_acc``
and ``params`` from ``/augment``; ``epsilon_worst``, the worst party's ε of the last ``/augment/privacy/epsilon``
row (search and augmentation composed; NaN without DP).

The comparison (Yang et al., ICLR 2020, "NAS evaluation is frustratingly hard"), per seed s with the searched cell's
accuracy a_s and a reference accuracy r_s: the random cells' mean m_s, and the best hand-designed network's h_s (the
most accurate ``--handcrafted`` arm of the seed: the practitioner's best choice, so the comparison favours it):

* RI_s = 100 · (a_s − r_s) / r_s, the relative improvement; reported as mean ± sample std over seeds;
* the searched cell's rank among the random cells of its seed (1 = better than every one);
* d_s = a_s − r_s; the search "beats" the reference when mean(d) exceeds its standard error std(d)/√S (S ≥ 2
  seeds with that reference).
"""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from mpi_fnas.baseline.arms import RANDOM_PREFIX, SEARCHED, Arm
from mpi_fnas.config import CELL_NETWORK, HANDCRAFTED_NETWORKS
from mpi_fnas.runlog.schema import LOG_NAME

CSV_NAME = "baseline.csv"

#: Relative agreement required between a random or hand-designed arm's ε and its searched arm's (within 1 %).
EPSILON_TOLERANCE = 0.01
#: The references the searched cell is compared with (:meth:`SeedComparison.reference`).
RANDOM, HANDCRAFTED = "random", "handcrafted"


@dataclass(frozen=True)
class ArmResult:
    """One row of ``baseline.csv`` (the first six columns are the comparison's; the rest say how it was made). A
    hand-designed arm's ``genotype`` is empty: its ``network`` (last, so that a CSV written before it reads back as
    ``cell``) names what it trained."""

    arm: str
    seed: int
    genotype: str
    params: int
    test_acc: float
    epsilon_worst: float
    epsilon_searched: float  # the searched arm's ε of the same seed (every arm was calibrated to the same target)
    augment_noise_multiplier: float  # σ_aug the augmentation ran with (NaN without DP)
    status: str
    wall_seconds: float  # search + augmentation
    network: str = CELL_NETWORK  # /augment network: cell, or the hand-designed network trained
    colluders: int = 0  # privacy.colluders: epsilon_worst holds against the server and any t parties (last: see above)


def read_arm(run_dir: Path, arm: Arm, epsilon_searched: float) -> ArmResult:
    """The result of `arm` from ``run_dir/search.h5``."""
    from mpi_fnas.runlog import read_run

    log = read_run(Path(run_dir) / LOG_NAME)
    augment = log["augment"] or {}
    privacy = augment.get("privacy") or {}
    epsilon = np.asarray(privacy.get("epsilon", []), dtype=np.float64)
    epsilon_worst = float(epsilon[-1].max()) if epsilon.size else math.nan
    sigma = privacy.get("noise_multiplier", math.nan)
    status = log["status"] if log["status"] != "finished" else augment.get("status", "augment pending")
    # An augment-only arm has no search cost (NaN): count what ran.
    wall = float(np.nansum([log["cost"]["wall_seconds"], (augment.get("cost") or {}).get("wall_seconds", 0.0)]))
    return ArmResult(
        arm=arm.name, seed=arm.seed, genotype=str(augment.get("genotype") or ""), params=int(augment.get("params", 0)),
        test_acc=float(augment.get("test_acc", math.nan)), epsilon_worst=epsilon_worst,
        epsilon_searched=epsilon_worst if arm.searched else float(epsilon_searched),
        augment_noise_multiplier=float(np.max(sigma)) if np.size(sigma) else math.nan, status=str(status),
        wall_seconds=wall, network=str(augment.get("network", arm.network)), colluders=int(privacy.get("colluders", 0)),
    )


def finished(run_dir: Path) -> bool:
    """Whether the arm in `run_dir` finished both its stages (its log says so)."""
    from mpi_fnas.runlog import read_run

    path = Path(run_dir) / LOG_NAME
    if not path.exists():
        return False
    log = read_run(path)
    return log["status"] == "finished" and log["augment"] is not None and log["augment"]["status"] == "finished"


def write_csv(out: Path, rows: list[ArmResult]) -> Path:
    """Write ``OUT/baseline.csv`` (rewritten after every arm, so a crash keeps the finished ones)."""
    path = Path(out) / CSV_NAME
    names = [f.name for f in fields(ArmResult)]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names, lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(v) for k, v in asdict(row).items()})
    tmp.replace(path)
    return path


def read_csv(path: Path) -> list[ArmResult]:
    """The rows of a ``baseline.csv``."""
    types = {f.name: f.type for f in fields(ArmResult)}
    rows = []
    with open(path, newline="") as f:
        for record in csv.DictReader(f):
            rows.append(ArmResult(**{k: _parse(v, types[k]) for k, v in record.items()}))
    return rows


@dataclass(frozen=True)
class SeedComparison:
    """One seed: the searched cell against that seed's random cells and hand-designed networks (either may be
    absent: an empty tuple, its numbers NaN)."""

    seed: int
    searched_acc: float
    random_mean: float  # NaN without random arms
    random_accs: tuple[float, ...]
    relative_improvement: float  # RI_s against the random mean, %
    rank: int  # 1 + the random cells strictly better than the searched one
    epsilon_searched: float
    epsilon_random_max_deviation: float  # max over the random arms of |ε_random / ε_searched − 1|
    handcrafted: tuple[tuple[str, float], ...] = ()  # (network, test accuracy) of each hand-designed arm
    epsilon_handcrafted_max_deviation: float = math.nan  # max over the hand-designed arms of |ε / ε_searched − 1|

    @property
    def epsilon_max_deviation(self) -> float:
        """max over every random and hand-designed arm of |ε / ε_searched − 1|; NaN without DP."""
        finite = [d for d in (self.epsilon_random_max_deviation, self.epsilon_handcrafted_max_deviation)
                  if math.isfinite(d)]
        return max(finite, default=math.nan)

    @property
    def best_handcrafted(self) -> tuple[str, float]:
        """(network, accuracy) of the seed's most accurate hand-designed arm; ("", NaN) without one."""
        return max(self.handcrafted, key=lambda item: item[1], default=("", math.nan))

    @property
    def relative_improvement_handcrafted(self) -> float:
        """RI_s against the best hand-designed network, %."""
        return _relative_improvement(self.searched_acc, self.best_handcrafted[1])

    def reference(self, kind: str) -> float:
        """r_s: the random cells' mean (``RANDOM``) or the best hand-designed network's accuracy (``HANDCRAFTED``)."""
        return {RANDOM: self.random_mean, HANDCRAFTED: self.best_handcrafted[1]}[kind]


@dataclass(frozen=True)
class Comparison:
    """The baseline over every seed that has a finished searched arm and at least one finished random or
    hand-designed arm. Each statistic is over the seeds that have its reference."""

    seeds: tuple[SeedComparison, ...]

    def against(self, kind: str) -> tuple[SeedComparison, ...]:
        """The seeds that have the reference `kind` (``RANDOM`` or ``HANDCRAFTED``)."""
        return tuple(s for s in self.seeds if math.isfinite(s.reference(kind)))

    def relative_improvement_against(self, kind: str) -> tuple[float, float]:
        """RI against the reference `kind`: mean and sample std over its seeds (std NaN with one seed), %."""
        return _mean_std([_relative_improvement(s.searched_acc, s.reference(kind)) for s in self.against(kind)])

    def difference_against(self, kind: str) -> tuple[float, float]:
        """mean over the seeds of `kind` of d_s = a_s − r_s, and its standard error std(d)/√S (NaN with one seed)."""
        d = [s.searched_acc - s.reference(kind) for s in self.against(kind)]
        mean, std = _mean_std(d)
        return mean, std / math.sqrt(len(d)) if len(d) > 1 else math.nan

    def beats(self, kind: str) -> bool | None:
        """mean(d) > SE(d) against the reference `kind`; None with fewer than 2 of its seeds."""
        mean, se = self.difference_against(kind)
        return None if not math.isfinite(se) else bool(mean > se)

    @property
    def relative_improvement(self) -> tuple[float, float]:
        """RI against the random cells' mean: mean and sample std over seeds, %."""
        return self.relative_improvement_against(RANDOM)

    @property
    def difference(self) -> tuple[float, float]:
        """mean over seeds of d_s = a_s − m_s (random mean), and its standard error."""
        return self.difference_against(RANDOM)

    @property
    def beats_random(self) -> bool | None:
        """mean(d) > SE(d) against the random mean; None with fewer than 2 seeds."""
        return self.beats(RANDOM)

    @property
    def has_handcrafted(self) -> bool:
        return bool(self.against(HANDCRAFTED))

    @property
    def epsilon_agrees(self) -> bool:
        """Every random and hand-designed arm's ε is within EPSILON_TOLERANCE of its searched arm's (vacuously true
        without DP)."""
        return all(not s.epsilon_max_deviation > EPSILON_TOLERANCE for s in self.seeds)


def compare(rows: list[ArmResult]) -> Comparison:
    """The comparison of the finished arms of `rows` (see the module doc)."""
    by_seed: dict[int, list[ArmResult]] = {}
    for row in rows:
        if row.status == "finished" and math.isfinite(row.test_acc):
            by_seed.setdefault(row.seed, []).append(row)
    seeds = []
    for seed in sorted(by_seed):
        searched = [r for r in by_seed[seed] if r.arm == SEARCHED]
        randoms = [r for r in by_seed[seed] if r.arm.startswith(RANDOM_PREFIX)]
        handcrafted = [r for r in by_seed[seed] if r.arm in HANDCRAFTED_NETWORKS]
        if not searched or not (randoms or handcrafted):
            continue
        a = searched[0].test_acc
        accs = tuple(r.test_acc for r in randoms)
        mean = float(np.mean(accs)) if accs else math.nan
        eps = searched[0].epsilon_worst
        seeds.append(SeedComparison(
            seed=seed, searched_acc=a, random_mean=mean, random_accs=accs,
            relative_improvement=_relative_improvement(a, mean),
            rank=1 + sum(acc > a for acc in accs), epsilon_searched=eps,
            epsilon_random_max_deviation=_max_deviation(randoms, eps),
            handcrafted=tuple((r.arm, r.test_acc) for r in handcrafted),
            epsilon_handcrafted_max_deviation=_max_deviation(handcrafted, eps),
        ))
    return Comparison(tuple(seeds))


def _relative_improvement(acc: float, reference: float) -> float:
    """100 · (acc − reference) / reference, %; NaN without a positive reference."""
    return 100.0 * (acc - reference) / reference if reference > 0 else math.nan


def _max_deviation(rows: list[ArmResult], epsilon: float) -> float:
    """max over `rows` of |ε_row / `epsilon` − 1|; NaN without rows or without a positive `epsilon` (no DP)."""
    deviations = [abs(r.epsilon_worst / epsilon - 1.0) for r in rows if math.isfinite(epsilon) and epsilon > 0]
    return max(deviations) if deviations else math.nan


#: What the verdict line says, by reference and by ``Comparison.beats``.
_VERDICTS = {RANDOM: "random", HANDCRAFTED: "the best hand-designed network"}


def verdict(comparison: Comparison, kind: str) -> str:
    """One line: RI against the reference `kind`, the difference and its standard error, and whether the search
    beats it."""
    ri, ri_std = comparison.relative_improvement_against(kind)
    d, se = comparison.difference_against(kind)
    name = _VERDICTS[kind]
    beats = comparison.beats(kind)
    said = ("one seed: no standard error" if beats is None else
            f"searched {'beats' if beats else 'does NOT beat'} {name} by more than one standard error")
    return (f"RI = {ri:+.2f} ± {_fmt(ri_std, '.2f')} % vs {name} over {len(comparison.against(kind))} seed(s); "
            f"searched − {name} = {d:+.4f} (SE {_fmt(se, '.4f')}): {said}")


def format_comparison(comparison: Comparison) -> str:
    """The lines printed at the end of a baseline (and in the report's text)."""
    hand = comparison.has_handcrafted
    header = "seed  searched acc  random acc (mean ± std, n)   rank   RI %     ε searched  max |Δε|"
    lines = [header + ("   best hand-designed (acc)   RI vs hand %" if hand else "")]
    for s in comparison.seeds:
        mean, std = _mean_std(list(s.random_accs))
        line = (f"{s.seed:<5} {s.searched_acc:<13.4f} {_fmt(mean, '.4f')} ± {_fmt(std, '.4f')} "
                f"({len(s.random_accs)}){'':<8}{s.rank:<6} {_fmt(s.relative_improvement, '+.2f'):<8} "
                f"{_fmt(s.epsilon_searched, '.4g'):<11} "
                f"{_fmt(100 * s.epsilon_max_deviation, '.2f')} %")
        if hand:
            network, acc = s.best_handcrafted
            line += f"   {network or '—'} ({_fmt(acc, '.4f')}){'':<6}{_fmt(s.relative_improvement_handcrafted, '+.2f')}"
        lines.append(line)
    lines += [verdict(comparison, kind) for kind in (RANDOM, HANDCRAFTED) if comparison.against(kind)]
    return "\n".join(lines)


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else math.nan


def _fmt(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else "—"


def _cell(value: object) -> object:
    return repr(value) if isinstance(value, float) else value


def _parse(text: str, kind: object) -> object:
    if kind in (int, "int"):
        return int(text)
    if kind in (float, "float"):
        return float(text)
    return text
