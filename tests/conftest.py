"""Shared test setup: one torch thread per process (parallel MPI ranks on a 2-core box must not thrash), the
helpers that launch real `mpirun` jobs of the command line in subprocesses, and :func:`perturb_others` for the
per-example checks of both search spaces."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from pre_recipe import PRE_RECIPE_ARGS, TINY_DARTS_OPS, as_args, tiny

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
MPIRUN = str(Path(sys.executable).parent / "mpirun")
#: A search small enough for a few seconds per run on 2 cores (2 epochs of 4 steps, a row per step, 4 ops).
TINY = [*PRE_RECIPE_ARGS, *as_args(tiny(
    TINY_DARTS_OPS, "search.epochs=2", "search.steps_per_epoch=4", "runtime.progress=off", "checkpoint.every_steps=0",
    "runtime.log_every=1",
    "augment.epochs=0",  # search only; the augmentation's tests add their own tiny one
    # Local noise, not the secure default: these runs test everything else, and local is 2 s cheaper per run (no
    # key round) and resumes bit for bit under reproducible noise. tests/test_secure_aggregation.py, the secure spy
    # tests and the party-ledger tests run the secure path; the default itself is checked there too.
    "privacy.aggregation=local",
))]
#: Environment variables of the failure-injection hooks; never inherited by a launch unless given.
INJECTION_ENV = ("MPI_FNAS_STOP_AFTER", "MPI_FNAS_INJECT_FAULT", "MPI_FNAS_INJECT_SLEEP")


def perturb_others(x: torch.Tensor) -> torch.Tensor:
    """A copy of the batch `x` whose examples after the first are redrawn (global RNG) with another scale and mean:
    example 0's output or gradient must not change if nothing mixes examples."""
    changed = x.clone()
    changed[1:] = 3.0 * torch.randn_like(x[1:]) + 1.0
    return changed


def _env(extra: dict | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in INJECTION_ENV}
    return {**env, "OMP_NUM_THREADS": "1", **(extra or {})}


def mpirun(ranks: int, *args: str, module: str = "mpi_fnas.run", env: dict | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``mpirun -n RANKS python -m MODULE ARGS`` to completion (output captured)."""
    cmd = [MPIRUN, "-n", str(ranks), sys.executable, "-m", module, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env(env))


def mpirun_background(ranks: int, *args: str, env: dict | None = None) -> subprocess.Popen:
    """Start ``mpirun -n RANKS python -m mpi_fnas.run ARGS``; the caller waits for it or kills it."""
    cmd = [MPIRUN, "-n", str(ranks), sys.executable, "-m", "mpi_fnas.run", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env))


def mpirun_together(*launches: tuple, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Run independent jobs at the same time, each ``(ranks, args)``, ``(ranks, args, env)`` or ``(ranks, args, env,
    module)`` (default ``mpi_fnas.run``); their results in order.

    Why: a 3-rank run leaves the 2 cores partly idle (every rank importing torch, rank 0 alone evaluating or writing
    the log, waiters sleeping between polls), so two runs side by side take well under twice one run's wall time.
    """
    procs = []
    try:
        for ranks, args, *rest in launches:
            env = rest[0] if rest else None
            module = rest[1] if len(rest) > 1 else "mpi_fnas.run"
            cmd = [MPIRUN, "-n", str(ranks), sys.executable, "-m", module, *args]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=_env(env)))
        deadline = time.monotonic() + timeout
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def rank0_decision(*argv: str) -> tuple[str, str, str]:
    """Rank 0's decision on a ``mpi_fnas.run`` command line, in this process (no launch): (config text, run
    directory, stage). A refusal raises the ConfigError a launch prints as its one line, exit 2 (tests/test_cli.py
    launches that path)."""
    from mpi_fnas import cli
    from mpi_fnas.run import build_parser, decide_launch

    args = build_parser().parse_args(list(argv))
    cfg, error = cli.load_config_args(args)
    assert error is None, error
    return decide_launch(cfg, args, [])


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                children.append(int(entry.name))
    return children + [g for c in children for g in descendants(c)]


def rank_of(pid: int) -> int | None:
    """The MPI rank of process `pid` (PMI_RANK in its environment), or None."""
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"PMI_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


def wait_for(condition, timeout: float = 120.0, poll: float = 0.3) -> bool:
    """Poll `condition()` until it is true (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return False


def rank_pid(proc: subprocess.Popen, rank: int) -> int | None:
    """The PID of MPI rank `rank` of the job started by `proc`, or None."""
    return next((p for p in descendants(proc.pid) if rank_of(p) == rank), None)


def pytest_collection_modifyitems(config, items) -> None:
    """Modules without a `slow` test (in-process, one core) run first, then the modules that launch `mpirun` jobs,
    each group in its usual order. Why: `make test` runs the Slurm tests beside this lane in its first minutes
    (scripts/run_tests.sh), and their jobs leave one core idle beside a one-core test but collide with a
    multi-rank launch (the augmentation's learning runs took 100 s beside them, 53 s alone). Whole modules move, so
    a module-scoped fixture is still set up once."""
    launches = {item.module.__name__ for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module.__name__ in launches)  # stable: the order within each group stays
