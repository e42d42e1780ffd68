"""Peak memory of one party step, plain and private, and of rank 0: each measured in a fresh subprocess
(``python -m mpi_fnas.bench --_variant plain|private|server``, the same config) that prints one JSON line, so that
no earlier allocation of the parent counts (see docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

from mpi_fnas.bench.party_step import make_party
from mpi_fnas.config import Config
from mpi_fnas.federation.memory import peak_rss_mb
from mpi_fnas.stages.iteration import process_age

VARIANTS = ("plain", "private")
SERVER_VARIANT = "server"  # rank 0's memory (measure_server_memory)


def _reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux ``clear_refs`` 5); False where that is not possible.

    Needed because on Linux a child's ``ru_maxrss`` starts at its parent's RSS at fork time (the high-water mark
    survives exec): a child spawned by a 1 GB parent reports >= 1 GB whatever it does.
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def measure_variant_memory(cfg: Config, variant: str) -> dict[str, Any]:
    """Run in a fresh process: peak RSS of one party step of `variant` above the RSS before it.

    Before the step: imports, model and data creation, and a warm-up step of the same variant on a 1-example
    batch (it loads the lazily initialised kernels and allocator pools, a cost that does not scale with the
    batch). Then the peak is reset to the current RSS (baseline) and one full step (w_release + a_release) at
    batch B runs; ``peak_mb - baseline_mb`` is what the step itself needed.
    """
    import gc

    party = make_party(cfg, private=variant == "private")
    startup = process_age()  # launch -> a party ready for its first step (no MPI handshake here)
    warm = make_party(cfg, private=variant == "private", examples=1)
    warm.w_release()
    warm.a_release()
    del warm
    gc.collect()
    before_reset = peak_rss_mb()
    if _reset_peak_rss():
        method, baseline = "VmHWM", peak_rss_mb()
    else:  # no reset: the peak so far is the best baseline there is (an overestimate of it)
        method, baseline = "ru_maxrss", peak_rss_mb()
    party.w_release()
    party.a_release()
    peak = peak_rss_mb()
    return {"baseline_mb": baseline, "peak_mb": peak, "method": method, "process_peak_mb": max(before_reset, peak),
            "startup_seconds": startup}


def measure_server_memory(cfg: Config, parties: int = 8) -> dict[str, Any]:
    """Run in a fresh process: rank 0's peak resident memory through what it holds in a search: its modules (planner,
    ledgers, log), the plan of `parties` parties (under dpfnas the privacy plan of the whole job), the test split
    rendered, the supernet, and one evaluation of it on the test split."""
    from mpi_fnas.federation.global_model import search_server
    from mpi_fnas.federation.job_plan import open_split, plan_run
    from mpi_fnas.space import search_space
    from mpi_fnas.stages import rank0_driver  # noqa: F401  (rank 0's modules: what a server imports)

    plan_run(cfg, parties)
    test = open_split(cfg, "test")
    x, y = test.render(np.arange(len(test.labels)))
    model = search_space(cfg.space.kind).build_supernet(cfg.space, seed=cfg.seed, in_channels=test.in_channels,
                                                          num_classes=test.num_classes)
    search_server(model, cfg.search, parties).evaluate(x, y)  # as rank 0 evaluates: its layout and batch
    return {"process_peak_mb": peak_rss_mb()}


def _child_env() -> dict[str, str]:
    # The child must not join the parent's MPI job: drop the process-manager variables mpirun set.
    return {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_"))}


def measure_memory(args: argparse.Namespace) -> dict[str, float]:
    """Peak RSS of the non-private and private step and of rank 0, each in its own fresh subprocess; ratio of the
    step costs."""
    base = [sys.executable, "-m", "mpi_fnas.bench"]
    if args.config:
        base += ["--config", args.config]
    for item in args.overrides:
        base += ["--set", item]
    runs = {}
    for variant in (*VARIANTS, SERVER_VARIANT):
        out = subprocess.run([*base, "--_variant", variant], capture_output=True, text=True, env=_child_env(),
                             check=False)
        if out.returncode != 0:
            raise RuntimeError(f"memory subprocess ({variant}) failed:\n{out.stderr.strip()}")
        runs[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    step = runs["plain"]["peak_mb"] - runs["plain"]["baseline_mb"]
    dp_step = runs["private"]["peak_mb"] - runs["private"]["baseline_mb"]
    return {
        "rss_baseline_mb": runs["plain"]["baseline_mb"],
        "step_rss_mb": step,
        "dp_step_rss_mb": dp_step,
        "peak_rss_ratio": dp_step / step if step > 0 else float("nan"),
        "rss_method": runs["private"]["method"],
        "rss_peak_mb_party": runs["private"]["process_peak_mb"],
        "rss_peak_mb_server": runs[SERVER_VARIANT]["process_peak_mb"],
        "startup_seconds": runs["private"]["startup_seconds"],
    }
