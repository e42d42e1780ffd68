"""Shared test setup: one torch thread per process (parallel MPI ranks on a 2-core box must not thrash), the
helpers that launch real `mpirun` jobs of the command line in subprocesses, and :func:`perturb_others` for the
per-example checks of both search spaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from pre_recipe import PRE_RECIPE_ARGS, TINY_DARTS_OPS, as_args, tiny

from mpi_fnas.scaling.rss import rank_of

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
#: The torch device of the device-path tests (tests/test_device_path.py): MPI_FNAS_TEST_DEVICE, default cpu
#: (scripts/device_check.sh sets cuda on a GPU machine).
TEST_DEVICE = os.environ.get("MPI_FNAS_TEST_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def _no_kept_features() -> None:
    """Each test starts with no fixed-stem features kept by an earlier one in this process (they count transforms)."""
    from mpi_fnas.stages.party_data import forget_kept_features

    forget_kept_features()


@pytest.fixture
def torch_device() -> str:
    """MPI_FNAS_TEST_DEVICE (default ``cpu``); a CUDA device that is not visible fails the test rather than skipping
    it, so a GPU check without a GPU cannot pass."""
    if TEST_DEVICE.startswith("cuda"):
        from mpi_fnas.bench.devices import check_visible

        try:
            check_visible([TEST_DEVICE])
        except ValueError as exc:
            pytest.fail(f"MPI_FNAS_TEST_DEVICE: {exc}")
    return TEST_DEVICE


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


#: Ranks of the warm pool (tests/helpers/job_pool.py): two 3-rank jobs side by side, or one of up to 7 ranks.
POOL_RANKS = 7
#: The commands the warm ranks run: each one's module for ``python -m`` and the module of its ``main(argv, comm)``.
WARM_MAINS = {"mpi_fnas.run": "mpi_fnas.run", "mpi_fnas.sweep": "mpi_fnas.sweep.command",
              "mpi_fnas.baseline": "mpi_fnas.baseline.command"}


class _WarmPool:
    """The warm ranks of this pytest process (started at the first :func:`warm_jobs`, again after a job aborted
    them; stopped when this process exits)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.queue: Path | None = None
        self.batches = 0

    def ensure(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        import atexit
        import tempfile

        self.queue = Path(tempfile.mkdtemp(prefix="mpi_fnas-pool."))
        cmd = [MPIRUN, "-n", str(POOL_RANKS), sys.executable, str(ROOT / "tests" / "helpers" / "job_pool.py"),
               str(self.queue), str(os.getpid())]
        with open(self.queue / "pool.log", "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=_env(None))
        atexit.register(self.stop, self.proc, self.queue)

    @staticmethod
    def stop(proc: subprocess.Popen, queue: Path) -> None:
        import shutil

        (queue / "stop").touch()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(queue, ignore_errors=True)

    def run(self, jobs: list[dict], deadline: float) -> list[subprocess.CompletedProcess]:
        self.ensure()
        assert self.proc is not None and self.queue is not None
        self.batches += 1
        name = f"batch-{self.batches}"
        tmp = self.queue / f"{name}.tmp"
        tmp.write_text(json.dumps({"jobs": jobs}))
        tmp.rename(self.queue / f"{name}.json")
        while not (self.queue / f"{name}.done").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                if self.proc.poll() is None:
                    self.proc.kill()
                self.proc.wait()
                log = (self.queue / "pool.log").read_text(errors="replace")[-4000:]
                raise RuntimeError(f"the warm pool ended (or timed out) in a batch of {jobs}:\n{log}")
            time.sleep(0.05)
        results = []
        for j, job in enumerate(jobs):
            parts = [json.loads((self.queue / f"{name}.{j}.{r}.json").read_text()) for r in range(job["ranks"])]
            code = 0
            for part in parts:  # as mpiexec (Hydra) combines its ranks' exit codes
                code |= part["code"]
            results.append(subprocess.CompletedProcess(
                ["warm", str(job["ranks"]), *job["args"]], code,
                "".join(part["stdout"] for part in parts), "".join(part["stderr"] for part in parts)))
        return results


_POOL = _WarmPool()


def warm_jobs(*launches: tuple, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Run jobs, each ``(ranks, args)``, ``(ranks, args, env)`` or ``(ranks, args, env, module)`` (``mpi_fnas.run``,
    ``mpi_fnas.sweep`` or ``mpi_fnas.baseline``; default the first) as :func:`mpirun_together` takes them, in this
    process's warm ranks (tests/helpers/job_pool.py): side by side where they fit, on sub-communicators of their
    own, through the same ``main`` a launch runs, without a launch's start-up (~8 CPU-s of its ~13). Their results
    in order, as :func:`mpirun_together` gives them (every rank's output joined, their exit codes OR-ed as mpiexec
    does); `env` may hold only the failure-injection variables (INJECTION_ENV), which a job reads as it runs.

    Only for jobs that end by returning (finished, interrupted, bad input): a job that fails aborts the pool
    (MPI_Abort), and the call raises. The command line, the exit codes of failures, signals and kills stay
    :func:`mpirun` launches."""
    jobs = [{"ranks": ranks, "args": list(args), "env": dict(rest[0]) if rest and rest[0] else {},
             "module": WARM_MAINS[rest[1] if len(rest) > 1 else "mpi_fnas.run"]}
            for ranks, args, *rest in launches]
    for job in jobs:  # a variable read when a process starts would do nothing in a warm one
        assert set(job["env"]) <= set(INJECTION_ENV), f"{job['env']}: a launch of its own (mpirun) sets these"
    deadline = time.monotonic() + timeout  # one for the whole call, every batch of it
    results: list[subprocess.CompletedProcess] = []
    batch: list[dict] = []
    for job in jobs:
        assert job["ranks"] <= POOL_RANKS, f"a job of {job['ranks']} ranks needs a launch of its own"
        if sum(j["ranks"] for j in batch) + job["ranks"] > POOL_RANKS:
            results += _POOL.run(batch, deadline)
            batch = []
        batch.append(job)
    if batch:
        results += _POOL.run(batch, deadline)
    return results


def warm_job(ranks: int, *args: str, env: dict | None = None, module: str = "mpi_fnas.run",
             timeout: float = 600) -> subprocess.CompletedProcess:
    """One :func:`warm_jobs` job: ``mpirun -n RANKS python -m MODULE ARGS`` without its launch."""
    return warm_jobs((ranks, list(args), env, module), timeout=timeout)[0]


def side_by_side(warm: list[tuple], launched: list[tuple], timeout: float = 600
                 ) -> tuple[list[subprocess.CompletedProcess], list[subprocess.CompletedProcess]]:
    """:func:`warm_jobs` of `warm` while :func:`mpirun_together` runs `launched` (jobs that fail or that a test
    watches from outside): (the warm results, the launched results)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(warm_jobs, *warm, timeout=timeout)
        launched_results = mpirun_together(*launched, timeout=timeout)
        return future.result(timeout=timeout), launched_results


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
    """Modules with a `slow` test (they run jobs: the longest work) first, then the in-process ones, each group in
    its usual order. Why: `make test` hands whole modules to two pytest-xdist workers as they come free
    (scripts/run_tests.sh), and the short one-core modules at the end even out when the workers finish. Whole
    modules move, so a module-scoped fixture is still set up once."""
    launches = {item.module.__name__ for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module.__name__ not in launches)  # stable: the order within each group stays
