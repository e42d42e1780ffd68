"""The report's figures across runs, as PNG bytes: Table 1's accuracy bars, Table 2's error against the noise and
the search cost. Drawn as :mod:`mpi_fnas.report.figures` draws a run's (its size, its canvas, its colours)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from mpi_fnas.report.collect import MODE_ORDER, STAGE_AUGMENT, RunRecord
from mpi_fnas.report.figures import MODE_COLORS, new_figure, png_bytes
from mpi_fnas.report.tables import Group, augment_noise_label, noise_label
from mpi_fnas.sweep import variance_label


def table1_figure(groups: Sequence[Group]) -> bytes:
    """Table 1 as bars: mean test error (%) per (mode, K), ± std over seeds; ε and the stage above the bars."""
    figure = new_figure()
    ax = figure.subplots()
    x = np.arange(len(groups))
    known = [math.isfinite(g.test_error_mean) for g in groups]  # a group without any test error: no bar, "n/a"
    means = [100 * g.test_error_mean if ok else 0.0 for g, ok in zip(groups, known, strict=True)]
    stds = [100 * g.test_error_std if math.isfinite(g.test_error_std) else 0.0 for g in groups]
    colors = [MODE_COLORS.get(g.mode, "#2ca02c") for g in groups]
    hatches = ["" if g.stage == STAGE_AUGMENT else "//" for g in groups]
    bars = ax.bar(x, means, yerr=stds, capsize=4, color=colors, edgecolor="black", linewidth=0.6)
    for bar, hatch, ok in zip(bars, hatches, known, strict=True):
        bar.set_hatch(hatch)
        bar.set_visible(ok)
    for i, g in enumerate(groups):
        note = f"ε {g.epsilon_worst:.3g}\n" if math.isfinite(g.epsilon_worst) else ""
        ax.text(i, means[i] + stds[i], f"{note}n={len(g.runs)}" if known[i] else f"{note}n/a", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(x, [f"{g.mode}\nK={g.parties}" for g in groups])
    ax.set_ylabel("test error (%)")
    ax.set_ylim(0, max([m + s for m, s in zip(means, stds, strict=True)] + [1.0]) * 1.25)
    ax.set_title("Table 1: test error (mean ± std over seeds; hatched: supernet, no augmentation)", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    return png_bytes(figure)


def table2_figure(groups: Sequence[Group]) -> bytes:
    """Table 2 as curves: error (%) against a noise variance, worst ε on a right axis. A panel against the search's
    σ_W², one line per (K, augmentation setting), and one against the augmentation's σ_aug², one line per (K, σ_W²);
    a panel is drawn when some line of it has two or more points (else the σ_W² panel alone, or the σ_aug² one when
    no row has a σ_W²). A non-private augmentation (no σ_aug²) has no place on the σ_aug² axis."""
    panels = [(axis, lines) for axis, lines in (("search", _table2_lines(groups, "search")),
                                                ("augment", _table2_lines(groups, "augment")))
              if any(len(points) > 1 for points in lines.values())]
    if not panels:
        axis = "search" if any(g.noise_variance is not None for g in groups) else "augment"
        panels = [(axis, _table2_lines(groups, axis))]
    figure = new_figure()
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, (axis, lines) in zip(axes, panels, strict=True):
        right = ax.twinx()
        for i, (name, points) in enumerate(lines.items()):
            x = [v for v, _ in points]
            means = [100 * g.test_error_mean for _, g in points]
            stds = [100 * g.test_error_std if math.isfinite(g.test_error_std) else 0.0 for _, g in points]
            ax.errorbar(x, means, yerr=stds, marker="o", capsize=4, color=f"C{i % 10}", label=f"error, {name}")
            # ε may be inf (no guarantee) or missing; a log axis shows only finite positive values.
            eps = [(v, g.epsilon_worst) for v, g in points if math.isfinite(g.epsilon_worst) and g.epsilon_worst > 0]
            if eps:
                right.plot(*zip(*eps, strict=True), linestyle=":", marker="x", color=f"C{i % 10}",
                           label=f"ε worst, {name}")
                right.set_yscale("log")
        ax.set_xscale("log")
        ticks = sorted({v for points in lines.values() for v, _ in points})
        ax.set_xticks(ticks, [variance_label(v) for v in ticks])
        ax.minorticks_off()
        ax.set_xlabel("search noise variance σ_W²" if axis == "search" else "augmentation noise variance σ_aug²")
        ax.set_ylabel("test error (%)")
        right.set_ylabel("ε (worst party)")
        handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    figure.suptitle("Table 2: error against noise (mean ± std over seeds)", fontsize=11)
    figure.tight_layout()
    return png_bytes(figure)


def _table2_lines(groups: Sequence[Group], axis: str) -> dict[str, list[tuple[float, Group]]]:
    """The lines of a Table 2 panel: {legend: [(x, group)] by x}. Against σ_W² ("search") a line is a (K,
    augmentation setting); against σ_aug² ("augment") a (K, σ_W²). Groups without a value on the axis are left out."""
    lines: dict[str, list[tuple[float, Group]]] = {}
    for g in groups:
        x = g.noise_variance if axis == "search" else g.augment_noise_variance
        if x is None:
            continue
        if axis == "search":
            name = f"K={g.parties}" + ("" if g.augment_private is None else f", σ_aug² {augment_noise_label(g)}")
        else:
            name = f"K={g.parties}, σ_W² {noise_label(g.noise_variance)}"
        lines.setdefault(name, []).append((x, g))
    return {name: sorted(points, key=lambda point: point[0]) for name, points in lines.items()}


def cost_figure(runs: Sequence[RunRecord]) -> bytes:
    """Search wall time against K per mode (log-log), the mean over the finished runs of each (mode, K) whatever
    their noise (a search's cost does not depend on σ), with each mode's ideal strong-scaling line
    t(K) = t(K₀) · K₀ / K from its smallest K₀ (the same data split over K parties working in parallel), drawn
    over every K of the figure for a mode measured at two K or more. Runs without a positive wall time are left
    out; a figure with no point left says so."""
    hours: dict[tuple[str, int], list[float]] = {}
    for run in runs:
        if run.final and math.isfinite(run.search_wall_seconds) and run.search_wall_seconds > 0:
            hours.setdefault((run.mode, run.parties), []).append(run.search_wall_seconds / 3600.0)
    figure = new_figure()
    ax = figure.subplots()
    ax.set_title("Search cost against K (from /cost; the augmentation is not included)", fontsize=11)
    if not hours:
        ax.text(0.5, 0.5, "no finished run with a positive search wall time", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return png_bytes(figure)
    ks = sorted({k for _, k in hours})
    span = np.array(ks if len(ks) > 1 else [ks[0] / 2, ks[0], ks[0] * 2], dtype=float)
    modes = sorted({m for m, _ in hours}, key=lambda m: MODE_ORDER.index(m) if m in MODE_ORDER else 99)
    for mode in modes:
        parties = np.array(sorted(k for m, k in hours if m == mode), dtype=float)
        mean_hours = np.array([np.mean(hours[(mode, int(k))]) for k in parties])
        colour = MODE_COLORS.get(mode, "#2ca02c")
        ax.plot(parties, mean_hours, marker="o", color=colour, label=f"{mode}: measured")
        if len(parties) > 1:  # a line through one point would say nothing about scaling
            ax.plot(span, mean_hours[0] * parties[0] / span, linestyle="--", color=colour, alpha=0.7,
                    label=f"{mode}: ideal strong scaling from K={int(parties[0])}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("parties K")
    ax.set_ylabel("search wall time (hours, mean over seeds)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    figure.tight_layout()
    return png_bytes(figure)


# -- helpers --------------------------------------------------------------------------------------------------------
