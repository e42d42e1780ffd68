"""The study's rows as DIR/scaling.csv (every column, empty where there is no number) and as a markdown table."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from mpi_fnas.scaling.results import COLUMNS, PointRow

CSV_NAME = "scaling.csv"


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if not math.isfinite(value) else f"{value:.6g}"
    return str(value)


def csv_text(rows: Sequence[PointRow]) -> str:
    """The CSV: a header of :data:`~mpi_fnas.scaling.results.COLUMNS`, one line per point."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        values = asdict(row)
        writer.writerow([_cell(values[column]) for column in COLUMNS])
    return buffer.getvalue()


def write_csv(root: Path, rows: Sequence[PointRow]) -> Path:
    """Write ROOT/scaling.csv (replacing an earlier one) and return its path."""
    path = root / CSV_NAME
    tmp = path.with_suffix(".csv.tmp")
    tmp.write_text(csv_text(rows))
    tmp.replace(path)
    return path


def _f(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else "–"


def markdown_table(rows: Sequence[PointRow]) -> str:
    """One line per point: K, pattern, scaling, s/iteration and its split, rank 0's link, efficiency, memory."""
    lines = ["| K | exchange | scaling | steps | s/iteration | parties' compute | transfer | rank 0 | model (s) | "
             "rank 0's link (MB/iteration) | efficiency | party peak RSS (MB) | all ranks (GB) |", "|---" * 13 + "|"]
    for row in rows:
        lines.append(
            f"| {row.parties} | {row.exchange} | {row.scaling} | {row.steps} | {_f(row.iteration_seconds, '.3f')} | "
            f"{_f(row.party_compute_seconds, '.3f')} | {_f(row.transfer_seconds, '.3f')} | "
            f"{_f(row.server_seconds, '.3f')} | {_f(row.predicted_iteration_seconds, '.3f')} | "
            f"{_f(row.rank0_link_bytes / 1e6, '.2f')} | {_f(row.efficiency, '.2f')} | "
            f"{_f(row.rss_peak_mb_party_max, '.0f')} | {_f(row.rss_peak_mb_ranks_total / 1e3, '.1f')} |")
    return "\n".join(lines) + "\n"
