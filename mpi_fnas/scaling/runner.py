"""Running the grid on this machine: one ``mpirun -n K+1 python -m mpi_fnas.run ...`` per point, as a subprocess.

No MPI here: the runner only starts jobs and reads their logs. A point whose log says ``finished`` is skipped, so
running the same command again resumes the study; a point with an unfinished log is continued with ``--resume``
(from its checkpoint, or afresh with the old log kept as ``search-attempt<N>.h5``). Each point's output goes to
RUN_DIR/launch.log and each rank's peak memory, where it is public, to RUN_DIR/rss.csv
(:mod:`mpi_fnas.scaling.rss`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mpi_fnas.config import ConfigError
from mpi_fnas.runlog.schema import LOG_NAME
from mpi_fnas.scaling.grid import ScalingPoint, point_config, run_arguments
from mpi_fnas.scaling.rss import RssSampler, public_peaks, write_rss

LAUNCH_OUTPUT = "launch.log"


@dataclass(frozen=True)
class PointOutcome:
    """What the runner did with a point: ``skipped`` (already finished) or the exit code of its job."""

    point: ScalingPoint
    skipped: bool
    exit_code: int
    seconds: float


def finished(run_dir: Path) -> bool:
    """Whether the point's log says its search finished (the report's reading of the log)."""
    from mpi_fnas.report.collect import read_record

    log = run_dir / LOG_NAME
    if not log.is_file():
        return False
    try:
        return read_record(log, run_dir.parent).status == "finished"
    except ConfigError:
        return False  # unreadable: run it again (mpi_fnas.run keeps the old file as search-attempt<N>.h5)


def find_mpirun(given: str | None) -> str:
    """The mpirun to start points with: `given`, else the one beside this Python, else the one on PATH."""
    if given:
        return given
    beside = Path(sys.executable).parent / "mpirun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpirun")
    if found is None:
        raise ConfigError("mpirun: not found beside this Python or on PATH (give --mpirun)")
    return found


def launch_command(point: ScalingPoint, run_args: Sequence[str], mpirun: str, python: str = sys.executable,
                   mpirun_args: Sequence[str] = ()) -> list[str]:
    """``mpirun -n K+1 [mpirun_args] python -m mpi_fnas.run RUN_ARGS``."""
    return [mpirun, "-n", str(point.ranks), *mpirun_args, python, "-m", "mpi_fnas.run", *run_args]


def run_point(point: ScalingPoint, root: Path, config: str | None, overrides: Sequence[str], mpirun: str,
              mpirun_args: Sequence[str] = ()) -> PointOutcome:
    """Run (or resume, or skip) one point under `root`."""
    run_dir = root / point.dirname
    if finished(run_dir):
        return PointOutcome(point, True, 0, 0.0)
    cfg = point_config(point, config, overrides)
    resume = (run_dir / LOG_NAME).exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    command = launch_command(point, run_arguments(point, config, overrides, run_dir, resume), mpirun,
                             mpirun_args=mpirun_args)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: K + 1 ranks share the cores
    env["PYTHONUNBUFFERED"] = "1"
    start = time.monotonic()
    with open(run_dir / LAUNCH_OUTPUT, "a") as output:
        output.write(" ".join(command) + "\n")
        output.flush()
        job = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        sampler = RssSampler(job.pid)
        try:
            code = job.wait()
        except KeyboardInterrupt:  # ask the run to checkpoint and stop, as launch.sh forwards a preemption
            job.send_signal(signal.SIGUSR1)
            code = job.wait()
            raise
        finally:
            write_rss(run_dir, public_peaks(sampler.stop(), cfg.mode, cfg.data.dataset))
    return PointOutcome(point, False, code, time.monotonic() - start)


def run_grid(points: Sequence[ScalingPoint], root: Path, config: str | None, overrides: Sequence[str],
             mpirun: str, mpirun_args: Sequence[str] = ()) -> list[PointOutcome]:
    """Every point in turn, one line each on stdout; a failed point does not stop the others."""
    outcomes = []
    for index, point in enumerate(points, start=1):
        tag = f"[{index}/{len(points)}] {point.dirname} ({point.ranks} ranks, {point.steps} steps)"
        print(f"{tag} ...", flush=True)
        outcome = run_point(point, root, config, overrides, mpirun, mpirun_args)
        if outcome.skipped:
            print(f"{tag}: finished already, skipped", flush=True)
        else:
            what = "finished" if outcome.exit_code == 0 else f"exit {outcome.exit_code}, see " \
                f"{root / point.dirname / LAUNCH_OUTPUT}"
            print(f"{tag}: {what} in {outcome.seconds:.1f} s", flush=True)
        outcomes.append(outcome)
    return outcomes
