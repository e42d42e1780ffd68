"""Benchmark: one party step and the MPI exchange for a given config.

    python -m mpi_fnas.bench [--config FILE] [--set key=value ...] [--repeats N] [--json]
    mpirun -n K+1 python -m mpi_fnas.bench ...     # the exchange over K+1 real ranks

The party step (G_k then H_k, first order, on random inputs of the configured shape) is timed on one rank while
the others wait; the exchange (Reduce G, Bcast W, Reduce H, Bcast A — the collectives of one iteration, same
buffers as the search) is timed with every rank taking part. Medians over `--repeats`.
``comm_fraction = comm_seconds / (step_seconds + comm_seconds)``.

Speed and memory targets are checked here, never in timed tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from mpi_fnas.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpi_fnas.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", metavar="FILE")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions (after one warm-up)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _input_shape(cfg) -> tuple[int, int, int, int]:
    """(channels, height, width, classes) of the configured dataset, without loading it."""
    if cfg.data.dataset == "cifar10":
        return 3, 32, 32, 10
    return 3, cfg.data.image_size, cfg.data.image_size, 10


def time_party_step(cfg, repeats: int) -> dict[str, float]:
    """Median seconds of one party iteration's compute (w_release + a_release) on random data."""
    import torch

    from mpi_fnas.federation.party import Party, Shard
    from mpi_fnas.federation.search import build_model

    c, h, w, classes = _input_shape(cfg)
    gen = torch.Generator().manual_seed(0)
    n = cfg.search.batch_size

    def shard() -> Shard:
        return Shard(torch.randn(n, c, h, w, generator=gen), torch.randint(0, classes, (n,), generator=gen))

    party = Party(build_model(cfg, c, classes), shard(), shard(), cfg.search.batch_size, gen)
    w_times, a_times = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        party.w_release()
        t1 = time.perf_counter()
        party.a_release()
        t2 = time.perf_counter()
        if i:  # the first round warms up allocators and kernels
            w_times.append(t1 - t0)
            a_times.append(t2 - t1)
    w_med, a_med = statistics.median(w_times), statistics.median(a_times)
    return {"step_seconds": w_med + a_med, "w_release_seconds": w_med, "a_release_seconds": a_med,
            "num_w": party.num_w, "num_a": party.num_a}


def time_exchange(channel, num_w: int, num_a: int, repeats: int) -> float:
    """Median seconds of one iteration's collectives (all ranks must call this)."""
    from mpi_fnas.federation.party import STATS

    g = np.ones(num_w + STATS, dtype=np.float32)
    h = np.ones(num_a + STATS, dtype=np.float32)
    g_sum, h_sum = np.zeros_like(g), np.zeros_like(h)
    w, a = np.zeros(num_w, dtype=np.float32), np.zeros(num_a, dtype=np.float32)
    times = []
    for i in range(repeats + 1):
        channel.barrier()
        t0 = time.perf_counter()
        channel.reduce_sum(g, g_sum)
        channel.bcast(w)
        channel.reduce_sum(h, h_sum)
        channel.bcast(a)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"mpi_fnas.bench: error: {exc}", file=sys.stderr)
        return 2
    import torch
    from mpi4py import MPI

    from mpi_fnas.federation.comm import Channel

    torch.set_num_threads(cfg.runtime.threads_per_rank or 1)
    channel = Channel(MPI.COMM_WORLD)
    timer_rank = 1 if channel.size > 1 else 0
    result: dict[str, float] = {}
    if channel.rank == timer_rank:
        result = time_party_step(cfg, args.repeats)
    sizes = np.array([result.get("num_w", 0), result.get("num_a", 0)], dtype=np.float32)
    channel.comm.Bcast(sizes, root=timer_rank)  # setup: tell everyone the buffer sizes
    comm_seconds = time_exchange(channel, int(sizes[0]), int(sizes[1]), args.repeats)
    step = channel.comm.bcast(result, root=timer_rank)
    if channel.rank != 0:
        return 0
    report = {
        "ranks": channel.size,
        "parties": max(channel.size - 1, 1),
        "batch_size": cfg.search.batch_size,
        "num_w": int(sizes[0]),
        "num_a": int(sizes[1]),
        "threads_per_rank": torch.get_num_threads(),
        "step_seconds": step["step_seconds"],
        "w_release_seconds": step["w_release_seconds"],
        "a_release_seconds": step["a_release_seconds"],
        "comm_seconds": comm_seconds,
        "comm_fraction": comm_seconds / (step["step_seconds"] + comm_seconds),
        "comm_megabytes": 4 * 2 * (int(sizes[0]) + int(sizes[1])) / 1e6,
    }
    if args.json:
        print(json.dumps(report))
    else:
        if channel.size == 1:
            print("note: 1 rank — the exchange is a self-copy; run under mpirun -n K+1 for a real one")
        width = max(len(k) for k in report)
        for key, value in report.items():
            text = f"{value:.6g}" if isinstance(value, float) else str(value)
            print(f"{key:<{width}}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
