"""A sweep's summary: one row per variance (SummaryRow), the printed table and the CSV files (points.csv,
summary.csv)."""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpi_fnas.config import ConfigError
from mpi_fnas.sweep.composition import SweepComposition, compose_sweep, touched_by, worst_of
from mpi_fnas.sweep.points import POINT_DIR, variance_label
from mpi_fnas.sweep.results import LOG_NAME, PointResult, read_point

SUMMARY_CSV = "summary.csv"
POINTS_CSV = "points.csv"


@dataclass(frozen=True)
class SummaryRow:
    """One line of the Table-2-like summary: one variance over its finished seeds."""

    variance: float
    sigma: float
    seeds: int
    test_error_mean_pct: float
    test_error_std_pct: float  # sample standard deviation over seeds (ddof 1); NaN with one seed
    epsilon_worst: float  # one run: max over seeds and parties (ε does not depend on the seed: same q, σ, T, δ)
    delta: float
    mu_gdp_worst: float
    steps: int
    # Over the sweep: the largest composed ε of the data pools this variance's runs released (NaN: unknown).
    epsilon_sweep_composed: float = float("nan")
    delta_sweep_composed: float = float("nan")
    composed: tuple[SweepComposition, ...] = ()  # the pools behind it, for the table's notes


def summarize(results: Sequence[PointResult]) -> list[SummaryRow]:
    """Group the finished runs by variance (ascending); the sweep ε composes every run, finished or not."""
    compositions = compose_sweep(results)
    finished = [r for r in results if r.finished]
    rows = []
    for variance in sorted({r.variance for r in finished}):
        group = [r for r in finished if r.variance == variance]
        errors = np.array([r.test_error_pct for r in group])
        touched = [c for c in compositions if any(c in touched_by(r, compositions) for r in group)]
        worst = worst_of(touched)
        rows.append(SummaryRow(
            variance=variance, sigma=group[0].sigma, seeds=len(group),
            test_error_mean_pct=float(errors.mean()),
            test_error_std_pct=float(errors.std(ddof=1)) if len(group) > 1 else float("nan"),
            epsilon_worst=max(r.epsilon_worst for r in group), delta=max(r.delta for r in group),
            mu_gdp_worst=max(r.mu_gdp_worst for r in group), steps=max(r.steps for r in group),
            epsilon_sweep_composed=worst.epsilon if worst else float("nan"),
            delta_sweep_composed=max(c.delta for c in touched) if touched else float("nan"),
            composed=tuple(touched),
        ))
    return rows


def format_table(rows: Sequence[SummaryRow], parties: int | None = None) -> str:
    """The summary as the paper prints Table 2, plus σ and the privacy cost of one run and of the whole sweep."""
    who = f"{parties} parties, " if parties is not None else ""
    lines = [
        f"== noise sweep ({who}test error of the supernet on the server's test split; ε: tight PLD bound, worst "
        "party) ==",
        f"{'variance':>9} {'σ':>7} {'seeds':>5} {'test error (%)':>17} {'ε one run':>10} {'δ':>9} {'steps':>6} "
        f"{'ε sweep':>10}",
    ]
    for r in rows:
        spread = f"± {r.test_error_std_pct:5.2f}" if math.isfinite(r.test_error_std_pct) else "(1 seed)"
        lines.append(f"{variance_label(r.variance):>9} {r.sigma:>7.4g} {r.seeds:>5} "
                     f"{r.test_error_mean_pct:>7.2f} {spread:>9} {r.epsilon_worst:>10.4g} {r.delta:>9.3g} "
                     f"{r.steps:>6} {r.epsilon_sweep_composed:>10.4g}")
    pools: dict[str, SweepComposition] = {}
    for r in rows:
        pools.update({c.data_pool: c for c in r.composed})
    lines += ["ε one run: that run alone. ε sweep: what a party really spent, its ε composed (PLD) over every run",
              "of the sweep that released its examples (every variance of a seed reuses the same shards):"]
    lines += [f"  {pools[name].describe()}" for name in sorted(pools)] or ["  (unknown: no release facts)"]
    return "\n".join(lines)


def write_results(out_dir: str | Path, results: Sequence[PointResult]) -> tuple[Path, Path]:
    """Write ``points.csv`` (one row per run) and ``summary.csv`` (one row per variance); return their paths.

    ``epsilon_sweep_composed`` (and its ``delta_sweep_composed``, ``runs_sweep_composed``, ``pool_sweep_composed``)
    is what a party really spent: ε composed over every run of the sweep that released the same examples (see
    compose_sweep); per point for its data pool, per variance the largest over the pools its runs released.
    """
    out_dir = Path(out_dir)
    points_path, summary_path = out_dir / POINTS_CSV, out_dir / SUMMARY_CSV
    compositions = compose_sweep(results)
    point_rows = [{
        "variance": variance_label(r.variance), "sigma": r.sigma, "seed": r.seed, "test_acc": r.test_acc,
        "test_error_pct": r.test_error_pct, "epsilon_worst": r.epsilon_worst, "epsilon_best": r.epsilon_best,
        "delta": r.delta, "mu_gdp_worst": r.mu_gdp_worst, "steps": r.steps, "status": r.status,
        "stop_reason": r.stop_reason, "wall_seconds": r.wall_seconds, "run_dir": r.run_dir.name,
        **_composed_columns(touched_by(r, compositions)),
    } for r in sorted(results, key=lambda r: (r.variance, r.seed))]
    summary_rows = [{
        "variance": variance_label(r.variance), "sigma": r.sigma, "seeds": r.seeds,
        "test_error_mean_pct": r.test_error_mean_pct, "test_error_std_pct": r.test_error_std_pct,
        "epsilon_worst": r.epsilon_worst, "delta": r.delta, "mu_gdp_worst": r.mu_gdp_worst, "steps": r.steps,
        **_composed_columns(r.composed),
    } for r in summarize(results)]
    _write_csv(points_path, point_rows)
    _write_csv(summary_path, summary_rows)
    return points_path, summary_path


def _composed_columns(compositions: Sequence[SweepComposition]) -> dict[str, Any]:
    # (max ε, max δ) over pools is a valid pair for each of them: a bound at a smaller δ holds at a larger one.
    worst = worst_of(compositions)
    return {
        "epsilon_sweep_composed": worst.epsilon if worst else float("nan"),
        "delta_sweep_composed": max(c.delta for c in compositions) if compositions else float("nan"),
        "runs_sweep_composed": worst.runs if worst else 0,
        "pool_sweep_composed": worst.data_pool if worst else "",
        "exact_sweep_composed": all(c.exact for c in compositions) if compositions else False,
    }


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:  # whole file then rename: a reader never sees half a table
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def summarize_dir(out_dir: str | Path) -> list[PointResult]:
    """Every point under `out_dir` (``var*-seed*/search.h5``), finished or not: an unfinished run is left out of
    the error table but its releases count in the sweep ε. Raises ConfigError if none finished."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise ConfigError(f"--summarize: no such directory: {out_dir}")
    results = []
    for child in sorted(out_dir.iterdir()):
        if POINT_DIR.match(child.name) and (child / LOG_NAME).exists():
            try:
                results.append(read_point(child))
            except (ValueError, OSError, KeyError) as exc:
                raise ConfigError(f"--summarize: {exc}") from None
    for r in results:
        if not r.finished:
            print(f"mpi_fnas.sweep: {r.run_dir.name}: status {r.status}: not in the error table; its releases "
                  "still count in the sweep ε", file=sys.stderr)
    if not any(r.finished for r in results):
        raise ConfigError(f"--summarize: {out_dir} holds no finished var<v>-seed<s>/search.h5")
    return results
