"""The report's baseline section: for each baseline directory given (one holding ``baseline.csv``, written by
``python -m mpi_fnas.baseline``), a table per arm (the searched cell, the random cells, the hand-designed networks),
the per-seed comparison (rank, RI against the random mean and against the best hand-designed network), the verdicts
and a figure.

The numbers are read again from the arms' logs (:func:`mpi_fnas.baseline.results.read_arm`), not from the CSV, so
the report and the tool cannot disagree; the CSV only names the arms. Runs under a baseline directory are left out
of Tables 1 and 2 (a random cell is not a searched one) and listed under Runs like any other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mpi_fnas.baseline.arms import RANDOM_PREFIX, SEARCHED, Arm
from mpi_fnas.baseline.results import (
    CSV_NAME,
    HANDCRAFTED,
    LOG_NAME,
    RANDOM,
    ArmResult,
    Comparison,
    compare,
    read_arm,
    read_csv,
    verdict,
)
from mpi_fnas.config import HANDCRAFTED_NETWORKS
from mpi_fnas.report.collect import RunRecord
from mpi_fnas.report.figures import new_figure, png_bytes
from mpi_fnas.report.page import Block, Heading, Image, Paragraph, Table

#: The report's per-arm table of every baseline, as CSV (one row per baseline directory and arm).
BASELINE_CSV = "baseline_table.csv"
BASELINE_COLUMNS = ("baseline", "arm", "seeds", "test_acc_mean", "test_acc_std", "params_mean", "epsilon_worst_mean")


def find_baselines(paths: Sequence[str | Path]) -> list[Path]:
    """Every directory at or under `paths` that holds a ``baseline.csv``, sorted, each once."""
    found = set()
    for given in paths:
        path = Path(given)
        if path.is_file():
            path = path.parent
        if not path.is_dir():
            continue
        found.update(p.parent.resolve() for p in path.rglob(CSV_NAME) if p.is_file())
        if (path / CSV_NAME).is_file():
            found.add(path.resolve())
    return sorted(found)


def under(path: Path, baselines: Sequence[Path]) -> bool:
    """Whether the log `path` belongs to one of `baselines`."""
    resolved = Path(path).resolve()
    return any(base in resolved.parents for base in baselines)


def table_runs(runs: Sequence[RunRecord], baselines: Sequence[Path]) -> list[RunRecord]:
    """The runs Tables 1 and 2 may average: searches (:attr:`RunRecord.searched_cell`) outside every baseline. An
    arm of a baseline (a random cell is not a searched one) is compared in its baseline's own section; a given
    cell's or a hand-designed network's run in its own group (:mod:`mpi_fnas.report.trained`)."""
    return [run for run in runs if not under(run.path, baselines) and run.searched_cell]


def baseline_rows(directory: Path) -> list[ArmResult]:
    """The arms named in ``directory/baseline.csv``, read from their logs (the searched arm of each seed first)."""
    named = read_csv(directory / CSV_NAME)
    arms = sorted({(r.seed, r.arm) for r in named}, key=lambda sa: (sa[0], sa[1] != SEARCHED, _arm_order(sa[1])))
    rows: list[ArmResult] = []
    searched: dict[int, float] = {}
    for seed, name in arms:
        arm = Arm(name, seed)
        if not (arm.run_dir(directory) / LOG_NAME).is_file():
            continue
        row = read_arm(arm.run_dir(directory), arm, searched.get(seed, math.nan))
        if arm.searched:
            searched[seed] = row.epsilon_worst
        rows.append(row)
    return rows


def baseline_section(directory: Path, label: str, slug: str
                     ) -> tuple[list[Block], dict[str, bytes], list[dict[str, object]]]:
    """(the page blocks, {figure name: png}, the CSV rows (BASELINE_COLUMNS)) of one baseline."""
    rows = baseline_rows(directory)
    comparison = compare(rows)
    figure = f"baseline-{slug}.png"
    blocks: list[Block] = [
        Heading(f"Random-architecture baseline: `{label}`"),
        Paragraph("Does the search beat random, and the hand-designed networks a DP practitioner would train instead? "
                  "The searched cell against random cells of the same space, drawn uniformly from a public seed, and "
                  "against the hand-designed networks asked for (`--handcrafted`: `cnn-tanh`, Papernot et al. 2021's "
                  "tanh CNN; `cnn-gn`, a GroupNorm CNN), each trained by the same augmentation at the same total ε "
                  "(under DP every arm is calibrated to the config's privacy.target_epsilon: the ε "
                  "columns below). RI = 100·(acc_searched − acc_ref) / acc_ref per seed (Yang et al., ICLR 2020), "
                  "with acc_ref the random cells' mean, or the seed's best hand-designed network; rank 1 = the "
                  "searched cell beats every random cell of its seed."),
    ]
    per_arm = _per_arm(rows)
    blocks.append(Table(("arm", "seeds", "test acc (mean ± std)", "params (mean)", "ε worst (mean)"),
                        tuple((f"`{arm}`", str(n), f"{_f(m, '.4f')} ± {_f(s, '.4f')}", _f(p, '.0f'), _f(e, '.4g'))
                              for arm, n, m, s, p, e in per_arm)))
    if comparison.seeds:
        hand = comparison.has_handcrafted
        blocks.append(Table(
            ("seed", "searched acc", "random acc (mean ± std)", "rank", "RI (%)",
             *(("best hand-designed (acc)", "RI vs hand-designed (%)") if hand else ()), "ε searched",
             "max |ε other − ε searched| (%)"),
            tuple((str(s.seed), _f(s.searched_acc, ".4f"),
                   f"{_f(_mean(s.random_accs), '.4f')} ± {_f(_std(s.random_accs), '.4f')} ({len(s.random_accs)})",
                   f"{s.rank} of {len(s.random_accs) + 1}", _f(s.relative_improvement, "+.2f"),
                   *((f"`{s.best_handcrafted[0] or '–'}` ({_f(s.best_handcrafted[1], '.4f')})",
                      _f(s.relative_improvement_handcrafted, "+.2f")) if hand else ()),
                   _f(s.epsilon_searched, ".4g"), _f(100 * s.epsilon_max_deviation, ".2f"))
                  for s in comparison.seeds)))
        blocks.append(Paragraph(_verdict(comparison)))
        blocks.append(Image(figure, f"{label}: test accuracy of the searched cell (star), the random cells (dots) and "
                                    "the hand-designed networks (diamonds), per seed"))
        figures = {figure: _figure(comparison, label)}
    else:
        blocks.append(Paragraph("No seed has both a finished searched arm and a finished random arm yet."))
        figures = {}
    csv_rows = [dict(zip(BASELINE_COLUMNS, (label, arm, n, m, s, p, e), strict=True)) for arm, n, m, s, p, e in per_arm]
    return blocks, figures, csv_rows


def _per_arm(rows: list[ArmResult]) -> list[tuple]:
    """(arm, seeds, acc mean, acc std, params mean, ε mean): ``searched``, then the random arms pooled (as
    ``random``), then each random arm, then each hand-designed network."""
    done = [r for r in rows if r.status == "finished"]
    groups: dict[str, list[ArmResult]] = {SEARCHED: [r for r in done if r.arm == SEARCHED],
                                          "random (all cells)": [r for r in done if r.arm.startswith(RANDOM_PREFIX)]}
    for name in sorted({r.arm for r in done if r.arm != SEARCHED}, key=_arm_order):
        groups[name] = [r for r in done if r.arm == name]
    table = []
    for name, members in groups.items():
        if not members:
            continue
        accs = [r.test_acc for r in members]
        table.append((name, len({r.seed for r in members}), float(np.mean(accs)), _std(accs),
                      float(np.mean([r.params for r in members])), float(np.mean([r.epsilon_worst for r in members]))))
    return table


def _verdict(comparison: Comparison) -> str:
    """The verdict against each reference the baseline has (the random mean, the best hand-designed network)."""
    lines = [verdict(comparison, kind) for kind in (RANDOM, HANDCRAFTED) if comparison.against(kind)]
    if comparison.against(RANDOM):
        lines.append(f"The searched cell's rank among the random cells per seed: "
                     f"{', '.join(str(s.rank) for s in comparison.against(RANDOM))}.")
    if not comparison.epsilon_agrees:
        lines.append("WARNING: a random or hand-designed arm's ε differs from its searched arm's by more than 1 %.")
    return " ".join(f"{line}." if not line.endswith(".") else line for line in lines)


def _figure(comparison: Comparison, label: str) -> bytes:
    figure = new_figure()
    ax = figure.subplots()
    for i, s in enumerate(comparison.seeds):
        if s.random_accs:
            jitter = np.linspace(-0.15, 0.15, len(s.random_accs)) if len(s.random_accs) > 1 else np.zeros(1)
            ax.scatter(i + jitter, s.random_accs, color="#7f7f7f", s=25, label="random cells" if i == 0 else None)
            ax.plot([i - 0.25, i + 0.25], [s.random_mean] * 2, color="#7f7f7f", linewidth=1.5,
                    label="random mean" if i == 0 else None)
        for j, (network, acc) in enumerate(s.handcrafted):
            ax.scatter([i + 0.3], [acc], marker="D", s=45, color=_HAND_COLORS[j % len(_HAND_COLORS)],
                       edgecolor="black", zorder=3, label=network if i == 0 else None)
        ax.scatter([i], [s.searched_acc], marker="*", s=220, color="#d62728", edgecolor="black", zorder=3,
                   label="searched cell" if i == 0 else None)
    ax.set_xticks(range(len(comparison.seeds)), [f"seed {s.seed}" for s in comparison.seeds])
    ax.set_ylabel("test accuracy (augmented)")
    ri, ri_std = comparison.relative_improvement
    ax.set_title(f"{label}: RI {_f(ri, '+.1f')} ± {_f(ri_std, '.1f')} %", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    figure.tight_layout()
    return png_bytes(figure)


_HAND_COLORS = ("#1f77b4", "#2ca02c", "#9467bd")  # one per hand-designed network


def _arm_order(name: str) -> tuple[int, str]:
    """searched, random-0 .. random-(R-1), then the hand-designed networks in HANDCRAFTED_NETWORKS order."""
    if name.startswith(RANDOM_PREFIX):
        return int(name[len(RANDOM_PREFIX):]), name
    if name in HANDCRAFTED_NETWORKS:
        return 1_000_000 + HANDCRAFTED_NETWORKS.index(name), name
    return -1, name


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def _std(values: Sequence[float]) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else math.nan


def _f(value: float, spec: str) -> str:
    return format(value, spec) if value is not None and math.isfinite(value) else "–"
