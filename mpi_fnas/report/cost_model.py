"""The search's wall time from K, the model size, the link and one party's step: a cost model, and its check.

One iteration of Algorithm 1 under ``runtime.exchange: star`` (every transfer crosses rank 0's link)::

    T_step     = T_party + T_transfer + T_server      # the search: steps * T_step
    T_party    = t_step * max(1, (K + 1) / cores)     # the ranks compute side by side; on fewer cores, in turns
    T_transfer = 2 * K * 32 * (n_W + n_A) / bandwidth # bits (float32) of G and H in, W and A out; bit/s
                 + ROUND_TRIPS * latency + 4 * K * t_message
    T_server   = t_server                             # rank 0's W and A steps and sums (small)

Under ``collective`` rank 0's link carries what the algorithm that runs sends (:func:`reduce_values`,
:func:`bcast_values`). ``t_step``: the bench's ``step_seconds`` (``dp_step_seconds`` under DP), every core busy;
nothing is fitted to the runs it is checked against (docs/hpc.md, "What the network costs a search: the cost model").

    python -m mpi_fnas.report.cost_model --bench BENCH.json... [--private] [--cores 2] [--figure F] -- RATE:RUN_DIR...
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpi_fnas.federation.topology import COLLECTIVE, STAR, tree_children

BYTES_PER_VALUE = 4  # float32 releases and broadcasts, uint32 secure words
ROUND_TRIPS = 8  # per iteration: 4 exchanges, each a handshake (rendezvous or synchronous send) and the data
# MPICH's defaults for choosing a nonblocking reduce's and broadcast's algorithm (MPIR_CVAR_REDUCE_SHORT_MSG_SIZE,
# MPIR_CVAR_BCAST_SHORT_MSG_SIZE, MPIR_CVAR_BCAST_MIN_PROCS), in bytes and ranks.
REDUCE_SHORT_BYTES = 2048
BCAST_SHORT_BYTES = 12288
BCAST_MIN_RANKS = 8


def reduce_values(values: int, ranks: int, exchange: str, own_tree: bool) -> float:
    """Values rank 0's link carries, in its busier direction, to reduce `values` values from `ranks` ranks onto rank 0.

    Star: one copy from each party. `own_tree` (secure words): the channel's binomial tree, one copy from each of
    rank 0's children. ``MPI_Ireduce``: binomial below MPICH's short-message size or for fewer values than the
    largest power of two p' <= `ranks`, else reduce-scatter by recursive halving and a gather: 2 (1 - 1/p') copies
    in where `ranks` = p', one copy where rank 0 is among the ranks first folded onto a neighbour."""
    if exchange == STAR:
        return float((ranks - 1) * values)
    pof2 = 1 << (ranks.bit_length() - 1)
    if own_tree or values * BYTES_PER_VALUE <= REDUCE_SHORT_BYTES or values < pof2:
        return float(len(tree_children(0, ranks)) * values)
    return 2.0 * values * (1 - 1 / pof2) if pof2 == ranks else float(values)


def bcast_values(values: int, ranks: int, exchange: str) -> float:
    """Values rank 0's link carries to broadcast `values` values to `ranks` ranks: a copy to each party (star), to
    each of its binomial children (``MPI_Ibcast`` of short messages or fewer than 8 ranks), else a scatter and an
    allgather, 2 (1 - 1/`ranks`) copies out."""
    if exchange == STAR:
        return float((ranks - 1) * values)
    if values * BYTES_PER_VALUE < BCAST_SHORT_BYTES or ranks < BCAST_MIN_RANKS:
        return float(len(tree_children(0, ranks)) * values)
    return 2.0 * values * (1 - 1 / ranks)


def rank0_link_values(num_w: int, num_a: int, parties: int, exchange: str, secure: bool) -> float:
    """Values on rank 0's link per iteration: G_k and H_k reduced, W and A broadcast (the star's 2 K (n_W + n_A))."""
    ranks = parties + 1
    return sum(reduce_values(n, ranks, exchange, secure) + bcast_values(n, ranks, exchange) for n in (num_w, num_a))


@dataclass(frozen=True)
class Link:
    """Rank 0's network link: bandwidth in bits per second (``math.inf``: unlimited) and one-way latency in s."""

    bandwidth_bits: float
    latency_seconds: float = 0.0

    @classmethod
    def parse(cls, rate: str, latency_seconds: float = 0.0) -> Link:
        """From a tc rate ("100mbit", "1gbit", "unlimited")."""
        if rate in ("", "unlimited", "inf"):
            return cls(math.inf, latency_seconds)
        match = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)?bit", rate.lower())
        if match is None:
            raise ValueError(f"rate {rate!r}: expected e.g. 100mbit, 1gbit or unlimited")
        scale = {None: 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
        return cls(float(match.group(1)) * scale, latency_seconds)

    def describe(self) -> str:
        """The bandwidth for a reader: "unlimited", "1 Gbit/s", "100 Mbit/s"."""
        if math.isinf(self.bandwidth_bits):
            return "unlimited"
        for scale, unit in ((1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
            if self.bandwidth_bits >= scale:
                return f"{self.bandwidth_bits / scale:g} {unit}"
        return f"{self.bandwidth_bits:g} bit/s"


@dataclass(frozen=True)
class StepCosts:
    """What one iteration costs apart from the network: one party's step on one core (s), rank 0's own work per
    iteration (s), the software cost of one message (s), and the released sizes (values of W and of A)."""

    party_step_seconds: float
    server_seconds: float
    message_seconds: float
    num_w: int
    num_a: int


@dataclass(frozen=True)
class IterationTime:
    """Seconds of iterations, by part: the parties' compute, the transfer, rank 0's own work. :func:`predict_step`
    gives one iteration's; :class:`MeasuredSearch` holds a whole search's (``/cost``)."""

    party: float
    transfer: float
    server: float

    @property
    def total(self) -> float:
        return self.party + self.transfer + self.server


def predict_step(costs: StepCosts, parties: int, link: Link, cores: float, exchange: str = STAR,
                 secure: bool = False) -> IterationTime:
    """T_step of the module docstring for K = `parties`, the K + 1 ranks sharing `cores` cores (a core each: K + 1),
    under the `exchange` pattern that ran (`secure`: the releases are secure words, reduced by the channel's tree).

    Rank 0 counts as one more rank on shared cores: it takes the parties' CPU for its ε accounting (every
    ``runtime.log_every`` steps under DP), its own steps and MPI's progress polling. With K / cores instead, the
    compute-bound runs of the benchmark log (docs/log/benchmarks.md) came out 21-27 % short."""
    party = costs.party_step_seconds * max(1.0, (parties + 1) / cores)
    values = rank0_link_values(costs.num_w, costs.num_a, parties, exchange, secure)
    wire = BYTES_PER_VALUE * values * 8 / link.bandwidth_bits
    # messages and hops on rank 0's critical path: K per exchange in the star, a tree's depth with collectives
    hops = parties if exchange == STAR else len(tree_children(0, parties + 1))
    latency = ROUND_TRIPS * link.latency_seconds * (1 if exchange == STAR else hops)
    transfer = wire + latency + 4 * hops * costs.message_seconds
    return IterationTime(party, transfer, costs.server_seconds)


def strong_scaling_efficiency(costs: StepCosts, parties: int, link: Link, exchange: str = STAR,
                              secure: bool = False) -> float:
    """T_1 / (K T_K) at a fixed amount of data, every rank on a core or GPU of its own: T_step(1) / T_step(K)."""
    one = predict_step(costs, 1, link, 2, exchange, secure).total
    return one / predict_step(costs, parties, link, parties + 1, exchange, secure).total


def scaling_table(costs: StepCosts, parties: Sequence[int], link: Link, secure: bool) -> str:
    """Modelled strong scaling on a cluster (a core or GPU per rank): per K, the iteration time, rank 0's link values
    and the efficiency under each pattern, as a markdown table."""
    lines = ["| K | star: step (s) | star: values on rank 0's link | star: efficiency | collective: step (s) | "
             "collective: values on rank 0's link | collective: efficiency |", "|---" * 7 + "|"]
    for k in parties:
        cells = []
        for exchange in (STAR, COLLECTIVE):
            one = predict_step(costs, 1, link, 2, exchange, secure).total
            step = predict_step(costs, k, link, k + 1, exchange, secure).total
            values = rank0_link_values(costs.num_w, costs.num_a, k, exchange, secure)
            cells += [f"{step:.3f}", f"{values:,.0f}", f"{one / step:.2f}"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def transfer_to_compute_for(efficiency: float, parties: int) -> float:
    """The largest per-party transfer c (in units of the party's compute, with the transfer K c at K parties and
    the server's work left out) at which efficiency(K) = (1 + c) / (1 + K c) still reaches `efficiency`. The paper's
    Table 1 (1.25 GPU-days at K = 1, 0.59 at K = 8: 1.25 / (8 * 0.59) = 26.5 %) reads as c = 0.66."""
    return (1.0 - efficiency) / (parties * efficiency - 1.0)


def bench_costs(benches: Sequence[dict], private: bool) -> StepCosts:
    """StepCosts from ``python -m mpi_fnas.bench --json`` runs on one rank each, taken at once, one per core the
    parties share (so the step is timed with every core busy, as the parties run it): their mean step, plain or
    private, and the sizes. Rank 0's own work and one message's software cost are left at 0: both are milliseconds
    a step here (``/cost/server_seconds``; the bench's exchange), under 1 % of an iteration."""
    key = "dp_step_seconds" if private else "step_seconds"
    return StepCosts(party_step_seconds=sum(bench[key] for bench in benches) / len(benches), server_seconds=0.0,
                     message_seconds=0.0, num_w=int(benches[0]["num_w"]), num_a=int(benches[0]["num_a"]))


@dataclass(frozen=True)
class MeasuredSearch:
    """A search's iterations, from its log: K, steps, and rank 0's split of their time (``/cost``)."""

    parties: int
    steps: int
    time: IterationTime  # all `steps` iterations together
    exchange: str = STAR  # the pattern that ran (``/ranks`` ``exchange``)
    secure: bool = False  # secure aggregation: the channel's own tree under collectives


def measured_search(run_dir: Path) -> MeasuredSearch:
    """Read a run's ``search.h5``."""
    from mpi_fnas.report.collect import parse_config, secure_aggregation
    from mpi_fnas.runlog import read_run

    run = read_run(Path(run_dir) / "search.h5")
    cost = run["cost"]
    return MeasuredSearch(parties=int(run["parties"]), steps=int(run["metrics"]["step"][-1]),
                          time=IterationTime(cost["party_compute_seconds"], cost["transfer_seconds"],
                                             cost["server_seconds"]),
                          exchange=str(run["ranks"].get("exchange", STAR)),
                          secure=secure_aggregation(parse_config(run["config"])))


@dataclass(frozen=True)
class Comparison:
    """One run beside the model: its link, what it measured, what the model predicts for it."""

    rate: str
    measured: MeasuredSearch
    predicted: IterationTime  # one iteration

    @property
    def predicted_total(self) -> float:
        return self.measured.steps * self.predicted.total

    @property
    def error(self) -> float:
        return self.predicted_total / self.measured.time.total - 1.0


def compare(benches: Sequence[dict], runs: Sequence[tuple[str, Path]], cores: float, private: bool,
            latency_seconds: float = 0.0) -> list[Comparison]:
    """Each (rate, run directory) beside the model's prediction from the `benches` alone."""
    costs = bench_costs(benches, private)
    rows = []
    for rate, run_dir in runs:
        seen = measured_search(run_dir)
        rows.append(Comparison(rate, seen, predict_step(costs, seen.parties, Link.parse(rate, latency_seconds),
                                                        cores, seen.exchange, seen.secure)))
    return rows


def markdown_table(rows: Sequence[Comparison]) -> str:
    """The comparison as scripts/cost_table.sh prints it (its runs: docs/log/benchmarks.md)."""
    lines = ["| K | link | exchange | steps | measured (s) | predicted (s) | error | transfer measured (s) | transfer "
             "predicted (s) | parties measured (s) | parties predicted (s) |", "|---" * 11 + "|"]
    for row in rows:
        seen, step = row.measured, row.predicted
        lines.append(f"| {seen.parties} | {row.rate} | {seen.exchange} | {seen.steps} | {seen.time.total:.1f} | "
                     f"{row.predicted_total:.1f} | {row.error:+.0%} | {seen.time.transfer:.1f} | "
                     f"{seen.steps * step.transfer:.1f} | {seen.time.party:.1f} | {seen.steps * step.party:.1f} |")
    return "\n".join(lines) + "\n"


def comparison_figure(rows: Sequence[Comparison]) -> bytes:
    """Predicted against measured iteration time, one point per run (K by marker, link by colour), with y = x and
    the ±20 % band."""
    from mpi_fnas.report.figures import new_figure, png_bytes

    figure = new_figure()
    axes = figure.add_subplot(1, 1, 1)
    rates = sorted({row.rate for row in rows}, key=lambda rate: -Link.parse(rate).bandwidth_bits)
    markers = {2: "o", 4: "s", 8: "^"}
    for index, rate in enumerate(rates):
        for row in (r for r in rows if r.rate == rate):
            axes.scatter(row.measured.time.total, row.predicted_total, color=f"C{index}",
                         marker=markers.get(row.measured.parties, "D"), s=50)
    top = max(max(row.measured.time.total, row.predicted_total) for row in rows) * 1.1
    line = np.linspace(0.0, top, 50)
    axes.plot(line, line, color="black", linewidth=1)
    axes.fill_between(line, 0.8 * line, 1.2 * line, color="grey", alpha=0.2, label="±20 %")
    for index, rate in enumerate(rates):
        axes.scatter([], [], color=f"C{index}", label=rate)
    for parties, marker in markers.items():
        axes.scatter([], [], color="grey", marker=marker, label=f"K = {parties}")
    axes.set_xlim(0, top)
    axes.set_ylim(0, top)
    axes.set_xlabel("measured: the search's iterations (s)")
    axes.set_ylabel("predicted by the cost model (s)")
    axes.legend(loc="upper left", fontsize=8)
    return png_bytes(figure)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpi_fnas.report.cost_model", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="RATE:RUN_DIR pairs: rank 0's link rate as tc takes it (100mbit, 1gbit, "
                   "unlimited) and a run directory with search.h5")
    p.add_argument("--bench", type=Path, nargs="+", required=True,
                   help="python -m mpi_fnas.bench --json outputs (one rank each; one per core, run at once)")
    p.add_argument("--latency", type=float, default=0.0, help="one-way link latency, seconds")
    p.add_argument("--cores", type=float, default=2.0, help="cores the K + 1 ranks share (a core each: K + 1)")
    p.add_argument("--private", action="store_true", help="the runs are DP: the party's step is the private one")
    p.add_argument("--figure", type=Path, help="write the predicted-against-measured figure here (PNG)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mpi_fnas.report.cost_model``: the predicted against the measured search times; the exit code."""
    args = _parser().parse_args(argv)
    benches = [json.loads(path.read_text()) for path in args.bench]
    runs = [(pair.split(":", 1)[0], Path(pair.split(":", 1)[1])) for pair in args.runs]
    rows = compare(benches, runs, args.cores, args.private, args.latency)
    print(markdown_table(rows), end="")
    if args.figure is not None:
        args.figure.write_bytes(comparison_figure(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
