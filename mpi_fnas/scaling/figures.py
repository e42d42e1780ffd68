"""The study's figures, as PNG bytes on the report's Agg canvas (:mod:`mpi_fnas.report.figures`): per scaling, the
time per iteration and its split against K, the efficiency, and the values on rank 0's link. Means over seeds."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from mpi_fnas.report.figures import new_figure, png_bytes
from mpi_fnas.scaling.results import PointRow

#: File names under DIR/figures/.
TIME_FIGURE, EFFICIENCY_FIGURE, LINK_FIGURE = "scaling-time.png", "scaling-efficiency.png", "scaling-link.png"
_COLOURS = {"star": "#d62728", "collective": "#1f77b4"}


def _series(rows: Sequence[PointRow], scaling: str, exchange: str,
            value: Callable[[PointRow], float]) -> tuple[list[int], list[float]]:
    """(K, mean of `value` over seeds) of the finished points of one series, leaving out non-finite values."""
    by_k: dict[int, list[float]] = {}
    for row in rows:
        if row.final and row.scaling == scaling and row.exchange == exchange and math.isfinite(value(row)):
            by_k.setdefault(row.parties, []).append(value(row))
    ks = sorted(by_k)
    return ks, [statistics.fmean(by_k[k]) for k in ks]


def _panels(rows: Sequence[PointRow], title: str, ylabel: str,
            draw: Callable[[object, str, str, Sequence[PointRow]], None], log_y: bool = False) -> bytes:
    scalings = sorted({row.scaling for row in rows if row.final})
    figure = new_figure()
    if not scalings:
        ax = figure.subplots()
        ax.text(0.5, 0.5, "no finished point", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return png_bytes(figure)
    axes = figure.subplots(1, len(scalings), squeeze=False)[0]
    ks = sorted({row.parties for row in rows if row.final})
    for ax, scaling in zip(axes, scalings, strict=True):
        for exchange in sorted({row.exchange for row in rows}):
            draw(ax, scaling, exchange, rows)
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("parties K")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{scaling} scaling", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    return png_bytes(figure)


def time_figure(rows: Sequence[PointRow]) -> bytes:
    """Seconds per iteration against K (log-log): measured, the parties' compute in it, and the model's."""

    def draw(ax, scaling: str, exchange: str, rows: Sequence[PointRow]) -> None:
        colour = _COLOURS.get(exchange, "#2ca02c")
        for value, style, label in ((lambda r: r.iteration_seconds, "-", "iteration"),
                                    (lambda r: r.party_compute_seconds, ":", "parties' compute"),
                                    (lambda r: r.transfer_seconds + r.server_seconds, "-.", "transfer + rank 0"),
                                    (lambda r: r.predicted_iteration_seconds, "--", "model")):
            ks, ys = _series(rows, scaling, exchange, value)
            if ks:
                ax.plot(ks, ys, style, marker="o" if style == "-" else None, color=colour,
                        label=f"{exchange}: {label}")

    return _panels(rows, "Time per search iteration (from /cost; model: report/cost_model.py)", "seconds", draw,
                   log_y=True)


def efficiency_figure(rows: Sequence[PointRow]) -> bytes:
    """Efficiency against K, with the ideal 1."""

    def draw(ax, scaling: str, exchange: str, rows: Sequence[PointRow]) -> None:
        ks, ys = _series(rows, scaling, exchange, lambda r: r.efficiency)
        if ks:
            ax.plot(ks, ys, "-", marker="o", color=_COLOURS.get(exchange, "#2ca02c"), label=exchange)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_ylim(bottom=0)

    return _panels(rows, "Efficiency against the smallest K (strong: T0·K0/(K·T), weak: T0/T)", "efficiency", draw)


def link_figure(rows: Sequence[PointRow]) -> bytes:
    """MB on rank 0's link per iteration against K (the cost model's count for the pattern that ran)."""

    def draw(ax, scaling: str, exchange: str, rows: Sequence[PointRow]) -> None:
        ks, ys = _series(rows, scaling, exchange, lambda r: r.rank0_link_bytes / 1e6)
        if ks:
            ax.plot(ks, ys, "-", marker="o", color=_COLOURS.get(exchange, "#2ca02c"), label=exchange)

    return _panels(rows, "Rank 0's link per iteration (cost model)", "MB per iteration", draw, log_y=True)


def study_figures(rows: Sequence[PointRow]) -> dict[str, bytes]:
    """{file name: PNG} of every figure."""
    return {TIME_FIGURE: time_figure(rows), EFFICIENCY_FIGURE: efficiency_figure(rows), LINK_FIGURE: link_figure(rows)}
