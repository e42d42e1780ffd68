"""The report's figures of one run, as PNG bytes (alphas, cells, curves, ε, selection); across runs (Tables 1 and 2,
cost): :mod:`mpi_fnas.report.table_figures`.

matplotlib only, through its Agg canvas (``Figure`` + ``FigureCanvasAgg``, never pyplot): no display, no global
state, nothing but a PNG in memory. Every figure is FIGURE_PIXELS (width, height) pixels, and its PNG carries
no version or date, so the same logs give the same bytes.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mpi_fnas.report.cells import draw_cell, draw_dense_cell, op_colors, state_name
from mpi_fnas.report.collect import RunRecord

DPI = 80
FIGSIZE = (11.0, 5.5)  # inches
#: Size of every figure, (width, height) in pixels.
FIGURE_PIXELS = (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))
#: File name suffixes of a run's figures (``<run>-<suffix>.png``); ``epsilon`` only for runs with a DP ledger,
#: ``selection`` only for runs whose server selected parties (``/selection``).
RUN_FIGURES = ("alphas", "alphas-epochs", "cells", "curves", "epsilon", "selection")
#: File names of the figures across runs (table2.png only when Table 2 exists).
TABLE1_FIGURE, TABLE2_FIGURE, COST_FIGURE = "table1.png", "table2.png", "search-cost.png"
MODE_COLORS = {"vanilla": "#7f7f7f", "fnas": "#1f77b4", "dpfnas": "#d62728"}


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
