"""Warm ranks for the tests' jobs: ``mpirun -n N python tests/helpers/job_pool.py QUEUE_DIR CLIENT_PID``.

Every rank imports torch, mpi4py and the package once; then each batch of jobs the client (a pytest process,
``conftest.warm_jobs``) writes into QUEUE_DIR runs here, side by side, each on a sub-communicator of its own through
its command's ``main`` (``mpi_fnas.run``, ``mpi_fnas.sweep``, ``mpi_fnas.baseline``), as a launch of its own runs it.
Why: a tiny job's launch spends ~8 of its ~13
CPU-seconds starting processes and importing, and the suite starts dozens of them.

Protocol (files, written whole then renamed): the client writes ``batch-<n>.json`` =
``{"jobs": [{"ranks", "args", "env", "module"}, ...]}``; each rank of job j writes ``batch-<n>.<j>.<rank>.json`` =
``{"code", "stdout", "stderr"}``; world rank 0 writes ``batch-<n>.done`` once every rank is back. A job that fails
aborts the pool (its ``MPI_Abort``, as in a launch of its own): the client sees the pool end and starts another for
its next batch. The pool ends when ``QUEUE_DIR/stop`` appears or the client process is gone.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

# MPI first: MPICH's MPI_Init spins until every rank is in it, so no rank should wait there while another imports.
from mpi4py import MPI  # noqa: I001

import torch  # imported once here: what the warm ranks save

import mpi_fnas.run  # noqa: F401  (the package, once: what the warm ranks save)
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.pending import FIRST_PAUSE, next_pause

PLAN_TAG = 7
BATCH_LIMIT = 3600.0  # seconds a rank waits for the others of its batch (the client gives up sooner)
# The longest sleep between an idle rank's looks for work (the channel's doubling pauses up to it): idle ranks sleep
# (2 cores, other lanes' jobs); at a fixed 20 ms the 7 idle ranks took a tenth of a core, most of the suite's time.
IDLE_PAUSE_CAP = 0.25


def _idle_pauses():
    """The pauses of one idle wait: the channel's (next_pause), doubling from FIRST_PAUSE up to IDLE_PAUSE_CAP."""
    pause, start = FIRST_PAUSE, time.monotonic()
    while True:
        yield pause
        pause = next_pause(pause, time.monotonic() - start, IDLE_PAUSE_CAP, 0.0, ceiling=IDLE_PAUSE_CAP)


def _write(path: Path, obj: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.rename(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _next_batch(queue: Path, client: int) -> tuple[str, list[dict]] | None:
    """World rank 0: the oldest batch in the queue (None: stop)."""
    pauses = _idle_pauses()
    while True:
        if (queue / "stop").exists() or not _alive(client):
            return None
        batches = sorted(queue.glob("batch-*.json"), key=lambda p: int(p.name.split("-")[1].split(".")[0]))
        batches = [p for p in batches if p.name.count(".") == 1]
        if batches:
            return batches[0].name[:-len(".json")], json.loads(batches[0].read_text())["jobs"]
        time.sleep(next(pauses))


def _receive_plan(world) -> dict:
    """Ranks > 0: the next plan from world rank 0, sleeping between probes."""
    status, pauses = MPI.Status(), _idle_pauses()
    while not world.Iprobe(source=0, tag=PLAN_TAG, status=status):
        time.sleep(next(pauses))
    data = bytearray(status.Get_count(MPI.BYTE))
    world.Recv([data, MPI.BYTE], source=0, tag=PLAN_TAG)
    return json.loads(bytes(data))


def _quiet_barrier(comm) -> None:
    """Wait for every rank through the package's polled barrier (it sleeps while it waits: MPICH's own spins), for as
    long as the longest batch the client allows."""
    Channel(comm, timeout=BATCH_LIMIT).barrier()


def _captured(call) -> tuple[int, str, str]:
    """``call()``'s return value and everything written to file descriptors 1 and 2 meanwhile (Python's prints and
    what C libraries write: a launch's output holds both)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = call()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, old in zip((1, 2), saved, strict=True):
                os.dup2(old, fd)
                os.close(old)
        out.seek(0)
        err.seek(0)
        return code, out.read().decode(errors="replace"), err.read().decode(errors="replace")


def _run_job(job: dict, comm) -> dict:
    """Run one job on `comm`, this rank's part: its exit code and what it printed."""
    saved_env = {key: os.environ.get(key) for key in job.get("env", {})}
    os.environ.update(job.get("env", {}))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")  # a warning an earlier job showed is shown again, as a new process would
            code, out, err = _captured(lambda: importlib.import_module(job["module"]).main(list(job["args"]),
                                                                                            comm=comm))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {"code": int(code), "stdout": out, "stderr": err}


def serve(queue: Path, client: int) -> None:
    """Every rank: run the client's batches until it stops."""
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    torch.set_num_threads(1)
    while True:
        if rank == 0:
            found = _next_batch(queue, client)
            plan = {"stop": True} if found is None else {"name": found[0], "jobs": found[1]}
            payload = json.dumps(plan).encode()
            for dest in range(1, world.Get_size()):
                world.Send([payload, MPI.BYTE], dest=dest, tag=PLAN_TAG)
        else:
            plan = _receive_plan(world)
        if plan.get("stop"):
            return
        # Job j takes the next plan["jobs"][j]["ranks"] world ranks; its first is its server.
        color, start = MPI.UNDEFINED, 0
        for j, job in enumerate(plan["jobs"]):
            if start <= rank < start + job["ranks"]:
                color = j
            start += job["ranks"]
        sub = world.Split(color, rank)
        if sub != MPI.COMM_NULL:
            try:
                result = _run_job(plan["jobs"][color], sub)
            except BaseException:  # what main lets out (argparse exits too): end the pool, never hang it
                traceback.print_exc()
                world.Abort(1)
            _write(queue / f"{plan['name']}.{color}.{sub.Get_rank()}.json", result)
            sub.Free()
        _quiet_barrier(world)
        if rank == 0:
            (queue / f"{plan['name']}.json").unlink()
            (queue / f"{plan['name']}.done").touch()


if __name__ == "__main__":
    queue, client = Path(sys.argv[1]), int(sys.argv[2])
    serve(queue, client)
    if MPI.COMM_WORLD.Get_rank() == 0:  # the client may be gone, or be ended before its own clean-up runs
        shutil.rmtree(queue, ignore_errors=True)
