"""Reading a study back: one row per point from its ``search.h5`` (the report's readers) and the cost model, and the
efficiency of each point against the smallest K of its (scaling, exchange) series.

Per iteration, from ``/cost``: the whole iteration and its split into the parties' compute (rank 0's wait for the
releases: their passes, and under DP clipping, noise and, under secure aggregation, the sealing), the transfer (the
exchange) and rank 0's own work (its steps, the sums, and under secure aggregation the opening). The log has no finer
split (DP work apart from the passes, sealing apart from opening): ``python -m mpi_fnas.bench`` measures those for
one party. From the cost model (:mod:`mpi_fnas.report.cost_model`): the values on rank 0's link per iteration for
the pattern that ran, and the predicted iteration.

Efficiency, in the search's whole iteration time T (``/cost``: compute + transfer + rank 0's work, summed over the
steps): strong scaling T(K0)·K0 / (K·T(K)), weak scaling T(K0) / T(K), K0 the series' smallest K, T(K0) the mean
over its seeds.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mpi_fnas.config import ConfigError
from mpi_fnas.report.collect import RunRecord, collect_runs, parse_config, secure_aggregation
from mpi_fnas.report.cost_model import BYTES_PER_VALUE, Link, StepCosts, predict_step, rank0_link_values
from mpi_fnas.scaling.grid import STRONG, parse_dirname
from mpi_fnas.scaling.rss import read_rss
from mpi_fnas.scaling.sizes import release_sizes

#: The CSV's columns, in order (docs/hpc.md, "The scaling study", says what each holds).
COLUMNS = ("point", "scaling", "exchange", "exchange_ran", "parties", "seed", "status", "steps", "iteration_seconds",
           "party_compute_seconds", "transfer_seconds", "server_seconds", "iterations_seconds", "startup_seconds",
           "wall_seconds", "rank0_link_values", "rank0_link_bytes", "predicted_iteration_seconds", "predicted_from",
           "efficiency", "efficiency_base_parties", "rss_peak_mb_server", "rss_peak_mb_party_max",
           "rss_peak_mb_ranks_total")


@dataclass(frozen=True)
class PointRow:
    """One point of the study as the CSV shows it; NaN where the log (or the model) has no number."""

    point: str
    scaling: str
    exchange: str  # requested (the directory name, = runtime.exchange)
    exchange_ran: str  # /ranks exchange
    parties: int
    seed: int
    status: str
    steps: int
    iteration_seconds: float
    party_compute_seconds: float
    transfer_seconds: float
    server_seconds: float
    iterations_seconds: float
    startup_seconds: float
    wall_seconds: float
    rank0_link_values: float
    rank0_link_bytes: float
    predicted_iteration_seconds: float = math.nan
    predicted_from: str = ""
    efficiency: float = math.nan
    efficiency_base_parties: int | None = None
    rss_peak_mb_server: float = math.nan
    rss_peak_mb_party_max: float = math.nan
    rss_peak_mb_ranks_total: float = math.nan
    secure: bool = False  # the releases were secure words (the model's tree under collectives); not a CSV column

    @property
    def final(self) -> bool:
        return self.status == "finished" and self.steps > 0 and math.isfinite(self.iterations_seconds)

    @property
    def series(self) -> tuple[str, str]:
        return self.scaling, self.exchange


def read_study(root: str | Path) -> list[RunRecord]:
    """Every point's log under `root` (ConfigError: no log, or a log whose directory is not a point's)."""
    records = collect_runs([root])
    for record in records:
        if parse_dirname(record.path.parent.name) is None:
            raise ConfigError(f"{record.path.parent}: not a scaling point's directory (expected "
                              "<strong|weak>-<star|collective>-K<parties>-seed<seed>)")
    return records


def point_row(record: RunRecord) -> PointRow:
    """The measured part of a point's row (no efficiency, no prediction yet)."""
    scaling, exchange, parties, seed = parse_dirname(record.path.parent.name)
    log = record.log
    cost, secure = log["cost"], secure_aggregation(parse_config(log["config"]))
    steps = int(log["metrics"]["step"][-1]) if len(log["metrics"].get("step", ())) else 0
    split = [float(cost.get(key, math.nan)) for key in ("party_compute_seconds", "transfer_seconds",
                                                           "server_seconds")]
    total = sum(split)
    ran = str(log["ranks"].get("exchange", ""))
    values = math.nan
    if ran:
        try:
            num_w, num_a = release_sizes(log["config"])
            values = rank0_link_values(num_w, num_a, int(log["parties"]), ran, secure)
        except ConfigError as exc:
            print(f"mpi_fnas.scaling: {record.path}: no link values ({exc})", file=sys.stderr)
    peaks = read_rss(record.path.parent)
    parties_mb = [mb for rank, mb in peaks.items() if rank > 0]
    per = (lambda x: x / steps) if steps else (lambda x: math.nan)
    return PointRow(
        point=record.path.parent.name, scaling=scaling, exchange=exchange, exchange_ran=ran, parties=parties,
        seed=seed, status=record.status, steps=steps, iteration_seconds=per(total),
        party_compute_seconds=per(split[0]), transfer_seconds=per(split[1]), server_seconds=per(split[2]),
        iterations_seconds=total, startup_seconds=float(cost.get("startup_seconds", math.nan)),
        wall_seconds=float(cost.get("wall_seconds", math.nan)), rank0_link_values=values,
        rank0_link_bytes=BYTES_PER_VALUE * values, rss_peak_mb_server=float(cost.get("rss_peak_mb_server", math.nan)),
        rss_peak_mb_party_max=max(parties_mb) if parties_mb else math.nan,
        rss_peak_mb_ranks_total=sum(peaks.values()) if peaks else math.nan, secure=secure,
    )


def study_rows(records: Sequence[RunRecord], *, link: Link | None = None, cores: float | None = None,
               party_step_seconds: float | None = None) -> list[PointRow]:
    """The rows of the study in order scaling, exchange, K, seed, with efficiencies and predictions.

    The model's party step is `party_step_seconds` (a bench's) when given, else calibrated per series on its smallest
    K: that point's party compute per iteration over max(1, (K0 + 1) / cores). `cores`: the cores the ranks share
    (None: a core per rank). `link`: rank 0's link (None: unlimited)."""
    link = link if link is not None else Link(math.inf)
    rows = [(point_row(record), record) for record in records]
    rows.sort(key=lambda pair: (pair[0].scaling, pair[0].exchange, pair[0].parties, pair[0].seed))
    out: list[PointRow] = []
    for series in dict.fromkeys(row.series for row, _ in rows):
        members = [(row, record) for row, record in rows if row.series == series]
        final = [row for row, _ in members if row.final]
        base_k = min((row.parties for row in final), default=None)
        base_rows = [row for row in final if row.parties == base_k]
        base_t = statistics.fmean(row.iterations_seconds for row in base_rows) if base_rows else math.nan
        t_step, source = party_step_seconds, "bench"
        if t_step is None and base_rows:
            share = max(1.0, (base_k + 1) / (cores if cores is not None else base_k + 1))
            t_step = statistics.fmean(row.party_compute_seconds for row in base_rows) / share
            source = f"K={base_k} run"
        for row, record in members:
            changes: dict = {}
            if row.final and base_rows:
                ratio = base_t / row.iterations_seconds
                changes["efficiency"] = ratio * base_k / row.parties if row.scaling == STRONG else ratio
                changes["efficiency_base_parties"] = base_k
            if t_step is not None and row.exchange_ran and math.isfinite(row.rank0_link_values):
                num_w, num_a = release_sizes(record.log["config"])
                costs = StepCosts(party_step_seconds=t_step, server_seconds=0.0, message_seconds=0.0, num_w=num_w,
                                  num_a=num_a)
                step = predict_step(costs, row.parties, link, cores if cores is not None else row.parties + 1,
                                    row.exchange_ran, row.secure)
                changes.update(predicted_iteration_seconds=step.total, predicted_from=source)
            out.append(replace(row, **changes))
    return out
