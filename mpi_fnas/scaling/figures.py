"""The study's figures, as PNG bytes on the report's Agg canvas (:mod:`mpi_fnas.report.figures`), one quantity
each, a panel per scaling and one legend: the time per iteration measured against the cost model's, the efficiency
against its bound on shared cores, and the values on rank 0's link. Means over seeds."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from mpi_fnas.report.figures import new_figure, png_bytes
from mpi_fnas.scaling.results import PointRow

#: File names under DIR/figures/.
TIME_FIGURE, EFFICIENCY_FIGURE, LINK_FIGURE = "scaling-time.png", "scaling-efficiency.png", "scaling-link.png"
_COLOURS = {"star": "#d62728", "collective": "#1f77b4"}
_MEASURED, _MODEL = {"linestyle": "-", "marker": "o"}, {"linestyle": "--", "marker": None}
_LEGEND_CHARACTERS = 150  # characters of 8-point legend text across the report's figure

Draw = Callable[[object, str, Sequence[PointRow]], None]


def _series(rows: Sequence[PointRow], scaling: str, exchange: str,
            value: Callable[[PointRow], float]) -> tuple[list[int], list[float]]:
    """(K, mean of `value` over seeds) of the finished points of one series, leaving out non-finite values."""
    by_k: dict[int, list[float]] = {}
    for row in rows:
        if row.final and row.scaling == scaling and row.exchange == exchange and math.isfinite(value(row)):
            by_k.setdefault(row.parties, []).append(value(row))
    ks = sorted(by_k)
    return ks, [statistics.fmean(by_k[k]) for k in ks]


def _exchanges(rows: Sequence[PointRow]) -> list[str]:
    return sorted({row.exchange for row in rows})


def _model_label(cores: float | None) -> str:
    return "cost model, a core per rank" if cores is None else f"cost model, {cores:g} shared cores"


def _panels(rows: Sequence[PointRow], title: str, ylabel: str, draw: Draw, log_y: bool = False) -> Figure:
    """A panel per scaling, `draw` filling each; one legend for the figure, below the panels."""
    scalings = sorted({row.scaling for row in rows if row.final})
    figure = new_figure()
    if not scalings:
        ax = figure.subplots()
        ax.text(0.5, 0.5, "no finished point", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return figure
    axes = figure.subplots(1, len(scalings), squeeze=False)[0]
    ks = sorted({row.parties for row in rows if row.final})
    for ax, scaling in zip(axes, scalings, strict=True):
        draw(ax, scaling, rows)
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 0.2, 0.5, 1, 2, 5: a few labels a decade
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("parties K")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{scaling} scaling", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    labelled = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    # As many columns as the longest label lets fit across the figure, and room below the panels for the rows.
    columns = max(1, min(4, len(labelled), _LEGEND_CHARACTERS // (max(map(len, labelled), default=1) + 6)))
    figure.suptitle(title, fontsize=11)
    figure.tight_layout(rect=(0, 0.04 + 0.045 * math.ceil(len(labelled) / columns), 1, 1))
    figure.legend(list(labelled.values()), list(labelled), loc="lower center", ncol=columns, fontsize=8,
                  frameon=False)
    return figure


def time_figure(rows: Sequence[PointRow], cores: float | None = None) -> Figure:
    """Seconds per iteration against K (log-log): measured (solid) and the cost model's (dashed), per exchange."""

    def draw(ax, scaling: str, rows: Sequence[PointRow]) -> None:
        for exchange in _exchanges(rows):
            for value, style, what in ((lambda r: r.iteration_seconds, _MEASURED, "measured"),
                                       (lambda r: r.predicted_iteration_seconds, _MODEL, _model_label(cores))):
                ks, ys = _series(rows, scaling, exchange, value)
                if ks:
                    ax.plot(ks, ys, color=_COLOURS.get(exchange, "#2ca02c"), label=f"{exchange}: {what}", **style)

    return _panels(rows, "Seconds per search iteration", "seconds", draw, log_y=True)


def shared_core_bound(parties: int, base_parties: int, cores: float) -> float:
    """The best efficiency K + 1 ranks on `cores` shared cores allow against K0 + 1 (strong or weak alike): a rank
    gets min(1, cores / (K + 1)) of a core, so at most that share over the base point's."""
    return min(1.0, cores / (parties + 1)) / min(1.0, cores / (base_parties + 1))


def _model_efficiency(rows: Sequence[PointRow], scaling: str, exchange: str) -> tuple[list[int], list[float]]:
    """The cost model's efficiency against its own prediction at the series' smallest K. Per iteration, both
    scalings come to T_iteration(K0) / T_iteration(K): a strong-scaling point runs K0/K of the base's iterations."""
    ks, times = _series(rows, scaling, exchange, lambda r: r.predicted_iteration_seconds)
    return ks, [times[0] / t for t in times]


def efficiency_figure(rows: Sequence[PointRow], cores: float | None = None,
                      cluster: Sequence[PointRow] | None = None, cluster_link: str = "") -> Figure:
    """Efficiency against K, measured (solid) and modelled (dashed), with the bound of `cores` shared cores (a core
    per rank: 1); beside them (dash-dot) the model of a cluster, a core per rank on `cluster_link`, from `cluster`
    (the same points' rows as the model predicts them there)."""

    def draw(ax, scaling: str, rows: Sequence[PointRow]) -> None:
        ks = sorted({row.parties for row in rows if row.final and row.scaling == scaling})
        for exchange in _exchanges(rows):
            colour = _COLOURS.get(exchange, "#2ca02c")
            xs, ys = _series(rows, scaling, exchange, lambda r: r.efficiency)
            if xs:
                ax.plot(xs, ys, color=colour, label=f"{exchange}: measured", **_MEASURED)
            xs, ys = _model_efficiency(rows, scaling, exchange)
            if xs:
                ax.plot(xs, ys, color=colour, label=f"{exchange}: {_model_label(cores)}", **_MODEL)
            xs, ys = _model_efficiency(cluster or (), scaling, exchange)
            if xs:
                ax.plot(xs, ys, color=colour, linestyle="-.", alpha=0.7,
                        label=f"{exchange}: cost model, a cluster (a core per rank, {cluster_link})")
        if ks and cores is not None:
            ax.plot(ks, [shared_core_bound(k, ks[0], cores) for k in ks], ":", color="black", linewidth=1.5,
                    label=f"bound on {cores:g} shared cores: min(1, {cores:g}/(K+1))")
        ax.axhline(1.0, color="grey", linewidth=0.8, label="ideal")
        ax.set_ylim(bottom=0)

    return _panels(rows, "Efficiency against the smallest K (strong: T0·K0/(K·T); weak: T0/T)", "efficiency", draw)


def link_figure(rows: Sequence[PointRow]) -> Figure:
    """MB on rank 0's link per iteration against K (the cost model's count for the pattern that ran)."""

    def draw(ax, scaling: str, rows: Sequence[PointRow]) -> None:
        for exchange in _exchanges(rows):
            ks, ys = _series(rows, scaling, exchange, lambda r: r.rank0_link_bytes / 1e6)
            if ks:
                ax.plot(ks, ys, color=_COLOURS.get(exchange, "#2ca02c"), label=exchange, **_MEASURED)

    return _panels(rows, "Megabytes through rank 0's link per iteration", "MB per iteration", draw, log_y=True)


def study_figures(rows: Sequence[PointRow], cores: float | None = None, cluster: Sequence[PointRow] | None = None,
                  cluster_link: str = "") -> dict[str, bytes]:
    """{file name: PNG} of every figure; `cores`: the cores the ranks shared, as the model took them (None: a core
    per rank); `cluster`, `cluster_link`: the modelled cluster the efficiency figure draws beside them."""
    figures = {TIME_FIGURE: time_figure(rows, cores),
               EFFICIENCY_FIGURE: efficiency_figure(rows, cores, cluster, cluster_link),
               LINK_FIGURE: link_figure(rows)}
    return {name: png_bytes(figure) for name, figure in figures.items()}
