"""The report's figures, as PNG bytes: per run (alphas, cells, curves, ε) and across runs (Tables 1 and 2, cost).

matplotlib only, through its Agg canvas (``Figure`` + ``FigureCanvasAgg``, never pyplot): no display, no global
state, nothing but a PNG in memory. Every figure is FIGURE_PIXELS (width, height) pixels, and its PNG carries
no version or date, so the same logs give the same bytes.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mpi_fnas.report.cells import draw_cell, draw_dense_cell, op_colors, state_name
from mpi_fnas.report.collect import MODE_ORDER, STAGE_AUGMENT, RunRecord
from mpi_fnas.report.tables import Group, augment_noise_label, noise_label
from mpi_fnas.sweep import variance_label

DPI = 80
FIGSIZE = (11.0, 5.5)  # inches
#: Size of every figure, (width, height) in pixels.
FIGURE_PIXELS = (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))
#: File name suffixes of a run's figures (``<run>-<suffix>.png``); ``epsilon`` only for runs with a DP ledger,
#: ``selection`` only for runs whose server selected parties (``/selection``).
RUN_FIGURES = ("alphas", "alphas-epochs", "cells", "curves", "epsilon", "selection")
#: File names of the figures across runs (table2.png only when Table 2 exists).
TABLE1_FIGURE, TABLE2_FIGURE, COST_FIGURE = "table1.png", "table2.png", "search-cost.png"
_MODE_COLORS = {"vanilla": "#7f7f7f", "fnas": "#1f77b4", "dpfnas": "#d62728"}


def new_figure() -> Figure:
    """A blank figure of the report's size on an Agg canvas."""
    figure = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(figure)
    return figure


def png_bytes(figure: Figure) -> bytes:
    """The figure as PNG (exactly FIGURE_PIXELS; no ``Software`` metadata, so the bytes do not name a version)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    return buffer.getvalue()


# -- one run --------------------------------------------------------------------------------------------------------
def run_figures(run: RunRecord) -> dict[str, bytes]:
    """``{"<slug>-<suffix>.png": PNG}`` for the figures `run`'s log has data for: alphas and cells need an epoch
    end (and a parseable genotype), ε a DP ledger row; the curves are always drawn."""
    log = run.log
    space = log.get("space", "darts")
    figures: dict[str, bytes] = {}
    if len(log["alphas"]["normal"]):
        ops = log.get("alpha_ops")
        figures[f"{run.slug}-alphas.png"] = alphas_heatmap(log["alphas"], run.label, space, ops)
        figures[f"{run.slug}-alphas-epochs.png"] = alphas_over_epochs(log["alphas"], run.label, space, ops)
    cells = cells_figure(run.genotype, run.label, space) if run.genotype else None
    if cells is not None:
        figures[f"{run.slug}-cells.png"] = cells
    figures[f"{run.slug}-curves.png"] = curves(log, run.label)
    epsilon = epsilon_over_steps(log, run.label)
    if epsilon is not None:
        figures[f"{run.slug}-epsilon.png"] = epsilon
    selection = selection_rate(log, run.label)
    if selection is not None:
        figures[f"{run.slug}-selection.png"] = selection
    return figures


def selection_rate(log: dict[str, Any], label: str) -> bytes | None:
    """The fraction of steps each party was chosen, one panel per stage that selected (``/selection/chosen``, then
    ``/augment/selection/chosen``), unreliable parties (root attr ``unreliable``) in a colour of their own; the
    selection ε on the aux set after the stage (both stages composed) in the panel's title. None without rows."""
    augment = log.get("augment") or {}
    stages = [(name, selection) for name, selection in (("search", log.get("selection")),
                                                        ("augmentation", augment.get("selection")))
              if selection is not None and len(selection["chosen"])]
    if not stages:
        return None
    parties = np.asarray(stages[0][1]["chosen"]).shape[1]
    unreliable = log.get("unreliable")
    unreliable = np.zeros(parties, dtype=bool) if unreliable is None else np.asarray(unreliable, dtype=bool)
    figure = new_figure()
    axes = figure.subplots(1, len(stages), squeeze=False)[0]
    colors = ["#d62728" if bad else "#1f77b4" for bad in unreliable]
    for ax, (stage, selection) in zip(axes, stages, strict=True):
        chosen = np.asarray(selection["chosen"], dtype=bool)  # (steps, K)
        ax.bar(np.arange(1, parties + 1), chosen.mean(axis=0), color=colors)
        expected = float(selection["select"]) / parties  # what a uniform draw of K′ would give every party
        ax.axhline(expected, color="#555555", linestyle="--", linewidth=1)
        ax.text(parties + 0.4, expected, f" K′/K = {expected:.2f}", fontsize=8, va="bottom", ha="right",
                color="#555555")
        ax.set_xticks(range(1, parties + 1), [f"party {k}" + (" (unreliable)" if bad else "")
                                              for k, bad in enumerate(unreliable, start=1)], rotation=20, fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(f"fraction of the {chosen.shape[0]} {stage} steps chosen")
        ax.grid(alpha=0.3, axis="y")
        eps = float(selection["selection_epsilon"][-1])
        ax.set_title(f"{stage}: selection ε on the aux set = {eps:.3g} at δ = {float(selection['delta']):.0e}",
                     fontsize=9)
    figure.suptitle(f"{label}: selection {stages[0][1]['selection']} (K′ = {stages[0][1]['select']}); "
                    f"corruption P = {float(log.get('corruption', 0.0)):g}", fontsize=9)
    return png_bytes(figure)


def alphas_heatmap(alphas: dict[str, np.ndarray], label: str, space: str = "darts",
                   ops: Sequence[str] | None = None) -> bytes:
    """The last epoch's softmax alphas, edge × op: normal and reduce side by side (DARTS), or the one cell of every
    stage (DPNAS, whose reduce matrix has no edge). alphas: {"normal", "reduce": (epochs, edges, ops)}; ops: the
    columns' names (the log's ``/alphas`` attr; None: the kind's)."""
    primitives = _primitives(alphas["normal"].shape[2], space, ops)
    cells = _cells_with_edges(alphas)
    figure = new_figure()
    axes = figure.subplots(1, len(cells), squeeze=False)[0]
    epochs = alphas["normal"].shape[0]
    for ax, cell in zip(axes, cells, strict=True):
        final = np.asarray(alphas[cell][-1], dtype=float)
        # The colour scale spans the values, not [0, 1]: early in a search all weights are near 1/ops.
        image = ax.imshow(final, aspect="auto", cmap="viridis")
        ax.set_xticks(range(final.shape[1]), primitives, rotation=40, ha="right", fontsize=8)
        ax.set_yticks(range(final.shape[0]), _EDGE_LABELS.get(space, _darts_edge_labels)(final.shape[0]), fontsize=8)
        ax.set_title(_cell_title(cell, len(cells)), fontsize=10)
        figure.colorbar(image, ax=ax, fraction=0.046, pad=0.03)
    figure.suptitle(f"{label}: softmax alphas after epoch {epochs} (edge × op)", fontsize=11)
    figure.tight_layout()
    return png_bytes(figure)


def alphas_over_epochs(alphas: dict[str, np.ndarray], label: str, space: str = "darts",
                       ops: Sequence[str] | None = None) -> bytes:
    """Each op's softmax weight averaged over the edges, per epoch end (the heatmap shows the edges); one panel per
    cell with edges. ops: as :func:`alphas_heatmap`'s."""
    from mpi_fnas.space import search_space  # imports torch: only when drawing

    primitives = _primitives(alphas["normal"].shape[2], space, ops)
    # The kind's every op, so that an op has one colour in every figure (cells_figure's too), whatever space.ops kept.
    colors = op_colors(search_space(space).primitives)
    if not set(primitives) <= set(colors):  # columns named "op k": an alpha this version cannot name
        colors = op_colors(primitives)
    cells = _cells_with_edges(alphas)
    figure = new_figure()
    axes = figure.subplots(1, len(cells), sharey=True, squeeze=False)[0]
    for ax, cell in zip(axes, cells, strict=True):
        values = np.asarray(alphas[cell], dtype=float)  # (epochs, edges, ops)
        epochs = np.arange(1, values.shape[0] + 1)
        for k, name in enumerate(primitives):
            ax.plot(epochs, values[:, :, k].mean(axis=1), marker="o", markersize=3, color=colors[name],
                    linestyle="--" if name == "none" else "-", label=name)
        ax.set_xlabel("epoch")
        ax.set_title(_cell_title(cell, len(cells)), fontsize=10)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("mean softmax weight over edges")
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.suptitle(f"{label}: alphas over epochs", fontsize=11)
    figure.tight_layout()
    return png_bytes(figure)


def cells_figure(genotype_text: str, label: str, space: str = "darts") -> bytes | None:
    """The cells of a genotype string of `space` as graphs (DARTS: normal and reduce; DPNAS: its one cell); None
    when the text does not parse."""
    from mpi_fnas.space import search_space  # imports torch: only when drawing

    kind = search_space(space)
    try:
        genotype = kind.parse_genotype(genotype_text)
    except ValueError:
        return None
    colors = op_colors(kind.primitives)
    figure = new_figure()
    _CELL_DRAWERS[space](figure, genotype, colors)
    figure.suptitle(f"{label}: derived cells", fontsize=11)
    figure.tight_layout()
    return png_bytes(figure)


def _draw_darts_cells(figure: Figure, genotype: Any, colors: dict[str, str]) -> None:
    axes = figure.subplots(1, 2)
    draw_cell(axes[0], genotype.normal, genotype.normal_concat, "normal cell", colors)
    draw_cell(axes[1], genotype.reduce, genotype.reduce_concat, "reduction cell", colors)


def _draw_dpnas_cell(figure: Figure, genotype: Any, colors: dict[str, str]) -> None:
    ax = figure.subplots()
    node_edges = [genotype.node_edges(i) for i in range(genotype.nodes)]
    note = "" if genotype.connected else " (no path from the input: not trainable)"
    draw_dense_cell(ax, node_edges, f"the cell of every stage{note}", colors)


#: How the cells of a genotype are drawn, per space kind.
_CELL_DRAWERS = {"darts": _draw_darts_cells, "dpnas": _draw_dpnas_cell}


def curves(log: dict[str, Any], label: str) -> bytes:
    """Loss and accuracy against steps: the search (top or only row) and, when the run has one, the augmentation.
    Under DP the parties' train/validation values are not released (NaN); only the server's test values show."""
    augment = log["augment"]
    figure = new_figure()
    rows = 2 if augment is not None else 1
    axes = np.atleast_2d(figure.subplots(rows, 2, squeeze=False))
    dp = log["mode"] == "dpfnas"
    search = log["metrics"]
    _series(axes[0][0], search, ("train_loss", "val_loss", "test_loss"), "search: loss (nats)", dp)
    _series(axes[0][1], search, ("train_acc", "val_acc", "test_acc"), "search: accuracy", dp)
    if augment is not None:
        private = bool(augment["private"])
        _series(axes[1][0], augment["metrics"], ("train_loss", "test_loss"), "augment: loss (nats)", private)
        _series(axes[1][1], augment["metrics"], ("train_acc", "test_acc"), "augment: accuracy", private)
    figure.suptitle(f"{label}: loss and accuracy", fontsize=11)
    figure.tight_layout()
    return png_bytes(figure)


def epsilon_over_steps(log: dict[str, Any], label: str) -> bytes | None:
    """ε of every party at each ledger row: the search's (/privacy), then the composed search + augment ledger
    (/augment/privacy) after the search's last step. None without a DP ledger row."""
    privacy = log["privacy"]
    if privacy is None or not len(privacy["steps"]):
        return None
    augment = log["augment"]
    ledger = augment["privacy"] if augment is not None else None
    steps = np.asarray(privacy["steps"], dtype=float)
    epsilon = np.asarray(privacy["epsilon"], dtype=float)  # (rows, K)
    figure = new_figure()
    ax = figure.subplots()
    colors = [f"C{k % 10}" for k in range(epsilon.shape[1])]
    for k in range(epsilon.shape[1]):
        ax.plot(steps, epsilon[:, k], marker="o", markersize=3, color=colors[k], label=f"party {k + 1}")
    if ledger is not None and len(ledger["steps"]):
        offset = steps[-1]
        aug_steps = offset + np.asarray(ledger["steps"], dtype=float)
        aug_eps = np.asarray(ledger["epsilon"], dtype=float)
        for k in range(aug_eps.shape[1]):
            ax.plot(np.r_[offset, aug_steps], np.r_[epsilon[-1, k], aug_eps[:, k]], linestyle="--", marker="s",
                    markersize=3, color=colors[k])
        ax.axvline(offset, color="#999999", linewidth=1)
        ax.text(offset, ax.get_ylim()[1], " augmentation (dashed: search + augment composed)", fontsize=8,
                va="top", ha="left", color="#555555")
    ax.set_xlabel("step (search, then augmentation)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("ε (tight PLD bound)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=max(1, epsilon.shape[1] // 8))
    delta = float(np.max(privacy["delta"]))
    ax.set_title(f"{label}: ε per party over steps (δ = {delta:.3g})", fontsize=11)
    figure.tight_layout()
    return png_bytes(figure)


# -- across runs ----------------------------------------------------------------------------------------------------
def table1_figure(groups: Sequence[Group]) -> bytes:
    """Table 1 as bars: mean test error (%) per (mode, K), ± std over seeds; ε and the stage above the bars."""
    figure = new_figure()
    ax = figure.subplots()
    x = np.arange(len(groups))
    known = [math.isfinite(g.test_error_mean) for g in groups]  # a group without any test error: no bar, "n/a"
    means = [100 * g.test_error_mean if ok else 0.0 for g, ok in zip(groups, known, strict=True)]
    stds = [100 * g.test_error_std if math.isfinite(g.test_error_std) else 0.0 for g in groups]
    colors = [_MODE_COLORS.get(g.mode, "#2ca02c") for g in groups]
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
    over every K of the figure (and a factor 2 either side when there is only one). Runs without a positive wall
    time are left out; a figure with no point left says so."""
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
        colour = _MODE_COLORS.get(mode, "#2ca02c")
        ax.plot(parties, mean_hours, marker="o", color=colour, label=f"{mode}: measured")
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
def _primitives(ops: int, space: str = "darts", names: Sequence[str] | None = None) -> list[str]:
    from mpi_fnas.space import search_space

    primitives = list(names) if names else search_space(space).primitives
    return list(primitives) if len(primitives) == ops else [f"op {k}" for k in range(ops)]


def _cells_with_edges(alphas: dict[str, np.ndarray]) -> list[str]:
    """The alpha matrices worth a panel: those with edges (DPNAS' reduce matrix has none)."""
    return [cell for cell in ("normal", "reduce") if np.asarray(alphas[cell]).shape[1] > 0]


def _cell_title(cell: str, panels: int) -> str:
    return "the cell of every stage" if panels == 1 and cell == "normal" else f"{cell} cell"


def _edge_labels(edges: int, inputs: Callable[[int], list[str]]) -> list[str]:
    """``"<input> → <node>"`` per alpha row, node by node; `inputs(node)` names that node's inputs in row order."""
    labels = []
    node = 0
    while len(labels) < edges:
        labels += [f"{name} → {node}" for name in inputs(node)]
        node += 1
    return labels[:edges]


def _darts_edge_labels(edges: int) -> list[str]:
    """The labels of `edges` DARTS alpha rows (node i has inputs 0 .. i + 1: see mpi_fnas.space.genotype)."""
    return _edge_labels(edges, lambda node: [state_name(j) for j in range(node + 2)])


def _dpnas_edge_labels(edges: int) -> list[str]:
    """The labels of `edges` DPNAS alpha rows (node i has inputs in, 0 .. i - 1: see mpi_fnas.space.dpnas.genotype)."""
    return _edge_labels(edges, lambda node: ["in", *(str(j) for j in range(node))])


#: Alpha-row labels per space kind.
_EDGE_LABELS = {"darts": _darts_edge_labels, "dpnas": _dpnas_edge_labels}


def _series(ax: Axes, metrics: dict[str, np.ndarray], names: Sequence[str], title: str, private: bool) -> None:
    steps = np.asarray(metrics.get("step", np.empty(0)), dtype=float)
    drawn = 0
    for name in names:
        values = np.asarray(metrics.get(name, np.full(len(steps), np.nan)), dtype=float)[: len(steps)]
        finite = np.isfinite(values)
        if finite.any():
            few = finite.sum() <= 30  # markers where the points are few (epoch-end test values, short runs)
            ax.plot(steps[finite], values[finite], marker="o" if few else None, markersize=3, label=name)
            drawn += 1
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    if private:
        ax.text(0.5, 0.02, "train/validation values are not released under DP", transform=ax.transAxes,
                ha="center", va="bottom", fontsize=8, color="#777777")
    elif not drawn:
        ax.text(0.5, 0.5, "nothing logged", transform=ax.transAxes, ha="center", va="center", color="#777777")
