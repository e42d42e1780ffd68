"""The search's wall time from K, the model size, the link and one party's step: a cost model, and its check.

One iteration of Algorithm 1, as rank 0 runs it (``federation.comm``: every party sends its release to rank 0, and
rank 0 sends W and A to every party, point to point, so the exchange is a star around rank 0's link)::

    T_step     = T_party + T_transfer + T_server
    T_party    = t_step * max(1, K / cores)           # the parties compute side by side; on fewer cores, in turns
    T_transfer = 2 * K * 4 * (n_W + n_A) / bandwidth  # G and H in, W and A out: K copies each way on rank 0's link
                 + ROUND_TRIPS * latency + 4 * K * t_message
    T_server   = t_server                             # rank 0's W and A steps and sums (measured, small)

    T_search   = steps * T_step                       # the iterations; start-up and evaluations are apart

``t_step`` is one party's step on one core (``python -m mpi_fnas.bench``: ``step_seconds``, or ``dp_step_seconds``
under DP), ``t_message`` the software cost of one message on an unlimited link (from the same bench's exchange).
Nothing is fitted to the runs the model is checked against.

Strong scaling at a fixed amount of data: K parties each hold 1/K of it, so an epoch takes 1/K of the steps, and

    efficiency(K) = T_1 / (K * T_K) = T_step(1) / T_step(K)

which the star's K-fold transfer pulls down as K grows (:func:`strong_scaling_efficiency`).

    python -m mpi_fnas.report.cost_model RUN_DIR... --bench BENCH.json --rate 100mbit [--latency 0.0001]
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

BYTES_PER_VALUE = 4  # float32 releases and broadcasts
ROUND_TRIPS = 8  # per iteration: 4 exchanges, each with a rendezvous handshake (large messages) before the data


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


@dataclass(frozen=True)
class StepCosts:
    """What one iteration costs apart from the network: one party's step on one core (s), rank 0's own work per
    iteration (s), the software cost of one message (s), and the released sizes (values of W and of A)."""

    party_step_seconds: float
    server_seconds: float
    message_seconds: float
    num_w: int
    num_a: int

    @property
    def megabytes(self) -> float:
        """One release of W and A, in MB."""
        return BYTES_PER_VALUE * (self.num_w + self.num_a) / 1e6


@dataclass(frozen=True)
class StepPrediction:
    """One iteration's predicted seconds, by part."""

    party: float
    transfer: float
    server: float

    @property
    def total(self) -> float:
        return self.party + self.transfer + self.server


def predict_step(costs: StepCosts, parties: int, link: Link, cores: float) -> StepPrediction:
    """T_step of the module docstring for K = `parties` on `cores` cores shared by the parties."""
    party = costs.party_step_seconds * max(1.0, parties / cores)
    wire = 2 * parties * BYTES_PER_VALUE * (costs.num_w + costs.num_a) * 8 / link.bandwidth_bits
    transfer = wire + ROUND_TRIPS * link.latency_seconds + 4 * parties * costs.message_seconds
    return StepPrediction(party, transfer, costs.server_seconds)


def strong_scaling_efficiency(costs: StepCosts, parties: int, link: Link, cores_per_party: float = 1.0) -> float:
    """T_1 / (K T_K) at a fixed amount of data (each party a core or GPU of its own): T_step(1) / T_step(K)."""
    one = predict_step(costs, 1, link, cores_per_party).total
    return one / predict_step(costs, parties, link, parties * cores_per_party).total


def transfer_to_compute_for(efficiency: float, parties: int) -> float:
    """The largest per-party transfer c (in units of the party's compute, with the transfer K c at K parties and
    the server's work left out) at which efficiency(K) = (1 + c) / (1 + K c) still reaches `efficiency`."""
    return (1.0 - efficiency) / (parties * efficiency - 1.0)


def implied_transfer_to_compute(efficiency: float, parties: int) -> float:
    """The per-party c that gives `efficiency` at K = `parties` under (1 + c) / (1 + K c): the paper's Table 1
    (1.25 GPU-days at K = 1, 0.59 at K = 8: 1.25 / (8 * 0.59) = 27 %) read through the star's model."""
    return transfer_to_compute_for(efficiency, parties)


def bench_costs(bench: dict, private: bool, server_seconds: float) -> StepCosts:
    """StepCosts from ``python -m mpi_fnas.bench --json`` (its exchange over R ranks gives one message's cost:
    4 (R - 1) messages of ``comm_megabytes / 2`` on a fast path) and rank 0's measured work per iteration."""
    messages = 4 * max(bench["ranks"] - 1, 1)
    return StepCosts(party_step_seconds=bench["dp_step_seconds" if private else "step_seconds"],
                     server_seconds=server_seconds, message_seconds=bench["comm_seconds"] / messages,
                     num_w=int(bench["num_w"]), num_a=int(bench["num_a"]))


@dataclass(frozen=True)
class MeasuredSearch:
    """A finished search's iterations, from its log: K, steps, and rank 0's split of their time (``/cost``)."""

    parties: int
    steps: int
    party: float
    transfer: float
    server: float

    @property
    def total(self) -> float:
        return self.party + self.transfer + self.server


def measured_search(run_dir: Path) -> MeasuredSearch:
    """Read a run's ``search.h5``."""
    from mpi_fnas.runlog import read_run

    run = read_run(Path(run_dir) / "search.h5")
    cost = run["cost"]
    return MeasuredSearch(parties=int(run["parties"]), steps=int(run["metrics"]["step"][-1]),
                          party=cost["party_compute_seconds"], transfer=cost["transfer_seconds"],
                          server=cost["server_seconds"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpi_fnas.report.cost_model", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (each with search.h5)")
    p.add_argument("--bench", type=Path, required=True, help="python -m mpi_fnas.bench --json output (one line)")
    p.add_argument("--rate", default="unlimited", help="rank 0's link rate, as tc takes it (100mbit, 1gbit)")
    p.add_argument("--latency", type=float, default=0.0, help="one-way link latency, seconds")
    p.add_argument("--cores", type=float, default=2.0, help="cores the parties share (each its own: K)")
    p.add_argument("--private", action="store_true", help="the runs are DP: the party's step is the private one")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    bench = json.loads(args.bench.read_text())
    link = Link.parse(args.rate, args.latency)
    print("K  steps  measured_s  predicted_s  error  transfer_measured_s  transfer_predicted_s")
    for run_dir in args.runs:
        seen = measured_search(run_dir)
        costs = bench_costs(bench, args.private, seen.server / max(seen.steps, 1))
        step = predict_step(costs, seen.parties, link, args.cores)
        predicted = seen.steps * step.total
        print(f"{seen.parties}  {seen.steps}  {seen.total:.2f}  {predicted:.2f}  {predicted / seen.total - 1:+.1%}  "
              f"{seen.transfer:.2f}  {seen.steps * step.transfer:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
