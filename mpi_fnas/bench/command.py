"""``python -m mpi_fnas.bench``: the arguments, the run of every benchmark on its rank, the report (a table or one
JSON object), and the internal ``--_variant`` mode a memory subprocess runs in.

Only the standard library, numpy and torch-free modules are imported at start-up, so argument and config errors
are reported before torch (or MPI) loads.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from mpi_fnas import cli
from mpi_fnas.bench.aggregation import compare_aggregation
from mpi_fnas.bench.augment_step import time_augment_step
from mpi_fnas.bench.devices import check_visible, compare_devices, parse_devices
from mpi_fnas.bench.exchange import time_exchange
from mpi_fnas.bench.memory import (
    SERVER_VARIANT,
    VARIANTS,
    measure_memory,
    measure_server_memory,
    measure_variant_memory,
)
from mpi_fnas.bench.opacus_comparison import compare_opacus
from mpi_fnas.bench.party_step import time_party_step
from mpi_fnas.bench.scattering import time_scattering
from mpi_fnas.config import Config

# --help's description: the first paragraph of the package's docstring (mpi_fnas/bench/__init__.py).
DESCRIPTION = """Benchmark: one party step (non-private and private) of the search and of the augmentation, and the MPI
exchange, for a given config."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpi_fnas.bench", description=DESCRIPTION)
    cli.add_config_arguments(p)
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions (after one warm-up)")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the peak-memory subprocesses (the rss fields are then null)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-opacus", dest="opacus", action="store_false",
                   help="skip the comparison with Opacus (the opacus_* fields and dp_step_vs_opacus are then null)")
    p.add_argument("--no-aggregation", dest="aggregation", action="store_false",
                   help="skip the secure-against-local aggregation comparison (the aggregate_* and secure_* fields "
                        "are then null)")
    p.add_argument("--devices", metavar="LIST",
                   help="comma-separated torch devices, e.g. cpu,cuda: time only the search's party step (plain and "
                        "private) on each, side by side in this one process (no MPI, no exchange)")
    # Internal: measure one variant's peak memory in this (fresh) process and print it as JSON.
    p.add_argument("--_variant", dest="variant", choices=(*VARIANTS, SERVER_VARIANT), help=argparse.SUPPRESS)
    return p


def _variant_main(cfg: Config, variant: str) -> int:
    # Importing the package's MPI module must not initialise MPI in this helper process.
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    import torch

    torch.set_num_threads(cfg.runtime.threads_per_rank or 1)
    print(json.dumps(measure_server_memory(cfg) if variant == SERVER_VARIANT else measure_variant_memory(cfg, variant)))
    return 0


def _devices_main(cfg: Config, args: argparse.Namespace) -> int:
    """``--devices``: the party step on each device, side by side; bad devices are bad input (exit 2)."""
    import mpi4py

    mpi4py.rc.initialize = False  # one process, no MPI job
    mpi4py.rc.finalize = False
    try:
        devices = parse_devices(args.devices)
        check_visible(devices)
    except ValueError as exc:
        return cli.report_bad_input(0, exc, args.debug)
    import torch

    torch.set_num_threads(cfg.runtime.threads_per_rank or 1)
    report = compare_devices(cfg, args.repeats, devices)
    if args.json:
        print(json.dumps(report))
    else:
        width = max(len(k) for k in report)
        for key, value in report.items():
            print(f"{key:<{width}}  {value}")
    return 0


REPORT_KEYS_FROM_STEP = (
    "cpu_model", "onednn_isa", "aten_cpu_capability",
    "step_seconds", "w_release_seconds", "a_release_seconds", "step_cpu_seconds",
    "step_gflop", "step_gflops", "core_peak_gflops",
    "dp_step_seconds", "dp_w_release_seconds", "dp_a_release_seconds", "dp_step_ratio",
    "dp_step_cpu_seconds", "dp_step_ratio_cpu", "per_sample_seconds", "per_sample_a_seconds",
    "per_sample_method_w", "per_sample_method_a",
    "noise_seconds", "noise_seconds_torch_generator", "noise_source_ratio",
    "rss_baseline_mb", "step_rss_mb", "dp_step_rss_mb", "peak_rss_ratio", "rss_method",
    "rss_peak_mb_party", "rss_peak_mb_server", "startup_seconds",
    "augment_num_w", "augment_step_seconds", "augment_dp_step_seconds", "augment_dp_step_ratio",
    "aggregate_parties", "aggregate_epsilon", "aggregate_sigma_local", "aggregate_sigma_secure",
    "aggregate_noise_std_ratio", "aggregate_noise_std_ratio_expected", "secure_w_release_cpu_seconds",
    "local_w_release_cpu_seconds", "secure_open_cpu_seconds", "secure_overhead_fraction", "secure_bits_needed",
    "secure_bits", "secure_overflow_rate",
    "opacus_version", "opacus_network", "opacus_network_params", "network_dp_step_cpu_seconds",
    "opacus_dp_step_cpu_seconds", "dp_step_vs_opacus",
    "scatter_examples", "scatter_seconds", "scatter_cpu_seconds", "scatter_ms_per_example", "scatter_features_mb",
    "scatter_peak_growth_mb",
)


def main(argv: list[str] | None = None) -> int:
    """``python -m mpi_fnas.bench``: time the party steps and an iteration's exchange; the exit code."""
    args = _parser().parse_args(argv)
    cfg, error = cli.load_config_args(args)
    if error is not None:
        return cli.report_bad_input(cli.launcher_rank() or 0, error, args.debug)
    if args.variant:
        return _variant_main(cfg, args.variant)
    if args.devices is not None:
        return _devices_main(cfg, args)
    from mpi_fnas.federation.comm import Channel

    # MPI first: start_mpi limits the thread pools before torch loads, and MPICH's MPI_Init spins until every rank
    # is in it, so ranks that meet there early would burn a core while the others import torch.
    channel = Channel(cli.start_mpi(cfg))
    import torch

    torch.set_num_threads(cfg.runtime.threads_per_rank or 1)
    timer_rank = 1 if channel.size > 1 else 0
    result: dict[str, Any] = {}
    if channel.rank == timer_rank:
        from mpi_fnas.cpu_kernels import aten_cpu_capability, cpu_model, onednn_isa

        result = {"cpu_model": cpu_model(), "onednn_isa": onednn_isa(),  # which machine and kernels ran
                  "aten_cpu_capability": aten_cpu_capability()}
        result.update(time_scattering(cfg, max(channel.size - 1, 1)))  # first: its memory before the others'
        result.update(time_party_step(cfg, args.repeats))
        result.update(time_augment_step(cfg, args.repeats))
        if args.opacus:
            result.update(compare_opacus(cfg, args.repeats))
        if args.aggregation and "dp_step_seconds" in result:
            result.update(compare_aggregation(cfg, args.repeats))
            result["secure_overhead_fraction"] = (
                result["secure_w_release_cpu_seconds"] - result["local_w_release_cpu_seconds"]
                + result["secure_open_cpu_seconds"]) / result["dp_step_cpu_seconds"]
        if args.memory and "dp_step_seconds" in result:
            result.update(measure_memory(args))
    # The others wait here in a sleeping poll: a blocking MPICH call would spin and steal the timer's core.
    channel.barrier()
    sizes = np.array([result.get("num_w", 0), result.get("num_a", 0)], dtype=np.float32)
    channel.comm.Bcast(sizes, root=timer_rank)  # setup: tell everyone the buffer sizes
    comm_seconds = time_exchange(channel, int(sizes[0]), int(sizes[1]), args.repeats)
    gathered = channel.gather_objects(result)  # as data (mpi_fnas.wire), never a pickle
    if channel.rank != 0:
        return 0
    step = gathered[timer_rank]
    report: dict[str, Any] = {
        "ranks": channel.size,
        "parties": max(channel.size - 1, 1),
        "batch_size": cfg.search.batch_size,
        "num_w": int(sizes[0]),
        "num_a": int(sizes[1]),
        "threads_per_rank": torch.get_num_threads(),
        "repeats": args.repeats,
    }
    report.update({key: step.get(key) for key in REPORT_KEYS_FROM_STEP})
    report["comm_seconds"] = comm_seconds
    report["comm_fraction"] = comm_seconds / (step["step_seconds"] + comm_seconds)
    report["comm_megabytes"] = 4 * 2 * (int(sizes[0]) + int(sizes[1])) / 1e6
    if step.get("dp_step_seconds") is not None:  # a private step split three ways: compute, the DP work, exchange
        report["dp_work_seconds"] = step["dp_step_seconds"] - step["step_seconds"]
        whole = step["dp_step_seconds"] + comm_seconds
        report["split_compute_fraction"] = step["step_seconds"] / whole
        report["split_dp_fraction"] = report["dp_work_seconds"] / whole
        report["split_comm_fraction"] = comm_seconds / whole
    for note in ("dp_note", "augment_dp_note", "opacus_note"):
        if note in step:
            report[note] = step[note]
    if args.json:
        print(json.dumps(report))
    else:
        if channel.size == 1:
            print("note: 1 rank — the exchange is a self-copy; run under mpirun -n K+1 for a real one")
        width = max(len(k) for k in report)
        for key, value in report.items():
            text = "n/a" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)
            print(f"{key:<{width}}  {text}")
    return 0
