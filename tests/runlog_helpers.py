"""Helpers shared by the run log's tests (test_runlog.py, test_runlog_augment.py): logs to write into, rows to
append, the per-stage plumbing that lets one test run against the search (the root group) and the augment stage
(``/augment``), and child processes (a writer to kill, a SWMR reader) talked to over pipes."""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np

from mpi_fnas.federation.handshake import SetupReports
from mpi_fnas.privacy.release import Release
from mpi_fnas.runlog import AUGMENT_METRICS, SEARCH_METRICS, RunLog, StageLog, StagePrivacy

EDGES, OPS = 14, 8
PARTIES = 3


def setup_reports(parties: int) -> SetupReports:
    """What rank 0 learns at setup in a CPU job of `parties` parties (its ``rank_attrs`` are the log's /ranks)."""
    return SetupReports(devices=["cpu"] * (parties + 1), sent_steps=[0] * parties,
                        onednn_isa=["Intel AVX2"] * (parties + 1), aten_cpu_capability=["AVX2"] * (parties + 1),
                        cpu_model=["AMD EPYC 9R14"] * (parties + 1),
                        exchange="star", exchange_reason="auto: node a runs 3 ranks on 2 cores (...)")
REPO_ROOT = Path(__file__).resolve().parents[1]
GENOTYPE = "Genotype(normal=[('sep_conv_3x3', 0)], reduce=[('max_pool_3x3', 1)])"
PARAMS = 3_349_342
SEARCH_COST = {"wall_seconds": 100.0, "ranks": 4, "gpus": 0, "gpu_hours": 0.0, "cpu_core_hours": 0.5,
               "rss_peak_mb_server": 420.0, "startup_seconds": 6.0, "party_compute_seconds": 60.0,
               "transfer_seconds": 10.0, "server_seconds": 5.0}

#: The two stages a run log writes through one ``StageLog`` each; parametrize a shared behaviour over these.
STAGES = ("search", "augment")
#: Each stage's growing families, in the order of ``row_counts`` and ``truncate``.
FAMILIES = {"search": ("metrics", "epochs", "privacy", "selection"), "augment": ("metrics", "privacy", "selection")}
#: Each stage's metric columns, in the file's order.
METRIC_NAMES = {"search": SEARCH_METRICS, "augment": AUGMENT_METRICS}
#: Where a stage's datasets live in the file.
PREFIX = {"search": "", "augment": "augment/"}
#: How read_run names a stage's step in the reason of a dead writer.
STEP_NOUN = {"search": "step", "augment": "augment step"}


def search_privacy(parties: int = PARTIES) -> StagePrivacy:
    """The search's releases: W with σ 1.0 and clip 0.01, A with a σ per party and clip 0.1."""
    return StagePrivacy(
        delta=[1e-5] * parties,
        releases={"W": Release(noise_multiplier=1.0, clip=0.01, expected_batch_size=16.0),
                  "A": Release(noise_multiplier=np.linspace(1.0, 1.5, parties), clip=0.1, expected_batch_size=16.0)},
        sample_rates={"W": np.linspace(0.01, 0.03, parties), "A": np.linspace(0.02, 0.04, parties)},
        accountant="pld",
    )


def augment_privacy(noise_multiplier: float | np.ndarray = 1.1, clip: float | np.ndarray = 0.1) -> StagePrivacy:
    """The augment stage's one release W (σ 1.1 and clip 0.1 unless given), sample rates 0.01..0.03."""
    return StagePrivacy(delta=[1e-5] * PARTIES,
                        releases={"W": Release(noise_multiplier=noise_multiplier, clip=clip, expected_batch_size=16.0)},
                        sample_rates={"W": np.linspace(0.01, 0.03, PARTIES)})


def create_log(path: Path, *, mode: str = "fnas", genotype_length: int = 64, **overrides) -> RunLog:
    """``RunLog.create`` of a DARTS search over PARTIES parties (with the search's ledger under dpfnas)."""
    arguments = dict(
        mode=mode,
        parties=PARTIES,
        config_text="search:\n  epochs: 2\n",
        metric_names=SEARCH_METRICS,
        alpha_shape=(EDGES, OPS),
        genotype_length=genotype_length,
        privacy_guarantee="holds" if mode == "dpfnas" else f"none: mode {mode} makes no privacy claim",
        privacy=search_privacy() if mode == "dpfnas" else None,
    )
    arguments.update(overrides)
    return RunLog.create(path, **arguments)


def searched_log(path: Path, *, mode: str = "fnas") -> RunLog:
    """A log whose search logged 3 rows (and a ledger row under dpfnas) and finished with GENOTYPE and SEARCH_COST
    (the writer stays usable for the augment stage)."""
    runlog = create_log(path, mode=mode, genotype_length=128, rank_attrs=setup_reports(PARTIES).rank_attrs)
    for step in range(3):
        runlog.search.append_metrics({"step": step, "epoch": 0})
    if mode == "dpfnas":
        runlog.search.append_privacy(3, np.full(PARTIES, 3), np.full(PARTIES, 0.5), np.full(PARTIES, 0.05))
    runlog.search.finish("finished", reason="completed", final_genotype=GENOTYPE, cost=SEARCH_COST)
    return runlog


def begin_augment(runlog: RunLog, *, private: bool = False, **overrides) -> StageLog:
    """``runlog.begin_augment`` of GENOTYPE with PARAMS (private: with ``augment_privacy()``); overrides replace
    any argument."""
    arguments = dict(
        genotype=GENOTYPE,
        params=PARAMS,
        private=private,
        privacy=augment_privacy() if private else None,
        parties=PARTIES,
        privacy_guarantee="holds" if private else "none: mode fnas makes no privacy claim",
    )
    arguments.update(overrides)
    return runlog.begin_augment(**arguments)


def softmax_rows(seed: int) -> np.ndarray:
    """(EDGES, OPS) float32 weights that are a distribution per edge, distinct per seed."""
    logits = np.random.default_rng(seed).normal(size=(EDGES, OPS))
    weights = np.exp(logits)
    return (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)


def search_row(step: int) -> dict[str, float]:
    """One search metric row: step, epoch, a train_loss falling from 2.0 by 0.1 a step, and val_acc."""
    return {"step": step, "epoch": step // 2, "train_loss": 2.0 - 0.1 * step, "val_acc": 0.1 * step}


def augment_row(step: int, *, private: bool = False) -> dict[str, float]:
    """One augment metric row (train_loss as in ``search_row``); under DP the caller passes NaN for train_*, and
    test_* only every 2nd step."""
    row = {"step": step, "epoch": step // 2, "lr": 0.025 * (1 - step / 100)}
    row.update(train_loss=math.nan, train_acc=math.nan) if private else row.update(train_loss=2.0 - 0.1 * step)
    if step % 2 == 1:
        row.update(test_loss=1.5, test_acc=0.1 * step)
    return row


# ---------------------------------------------------------------------- one test, either stage


def open_stage(path: Path, stage: str, *, private: bool = False, steps: int = 0) -> RunLog:
    """A new log at `path` whose `stage` is running (with a privacy ledger when `private`): the search of a fresh
    log, or the augment stage begun after a finished search (``searched_log``); `stage` has logged ``metric_row``
    of steps 0 .. steps-1. Its writer: ``log.stage(stage)``."""
    mode = "dpfnas" if private else "fnas"
    if stage == "search":
        runlog = create_log(path, mode=mode)
    else:
        runlog = searched_log(path, mode=mode)
        begin_augment(runlog, private=private)
    for step in range(steps):
        runlog.stage(stage).append_metrics(metric_row(stage, step))
    return runlog


def metric_row(stage: str, step: int) -> dict[str, float]:
    """One metric row of `stage` (``search_row`` or ``augment_row``): both have step, epoch = step // 2 and
    train_loss = 2.0 − 0.1·step."""
    return search_row(step) if stage == "search" else augment_row(step)


def rows(stage: str, **counts: int) -> tuple[int, ...]:
    """Row counts of `stage`'s families (``FAMILIES`` order, as ``row_counts`` returns and ``truncate`` takes); a
    family not named has 0 rows."""
    unknown = set(counts) - set(FAMILIES[stage])
    if unknown:
        raise ValueError(f"the {stage} stage has no families {sorted(unknown)}")
    return tuple(counts.get(family, 0) for family in FAMILIES[stage])


def record(run: dict, stage: str) -> dict:
    """`stage`'s part of a ``read_run`` result: the top level for the search, ``run["augment"]`` for the augment."""
    return run if stage == "search" else run["augment"]


def reopen_log(path: Path, stage: str) -> RunLog:
    """``RunLog.reopen`` as a later job calls it to continue `stage` (``augment=True`` for the augment stage)."""
    return RunLog.reopen(path, augment=stage == "augment")


def resume(runlog: RunLog, stage: str, *, private: bool = False) -> StageLog:
    """`stage` of a reopened (or interrupted) log, running again: the reopened search already is; the augment stage
    is begun again (``begin_augment``, another attempt)."""
    if stage == "augment":
        begin_augment(runlog, private=private)
    return runlog.stage(stage)


def cost(wall_seconds: float, ranks: int, gpus: int, gpu_hours: float, cpu_core_hours: float,
         rss_peak_mb_server: float = 300.0, startup_seconds: float = 5.0) -> dict[str, float]:
    """One attempt's cost, as a stage's ``finish`` takes it (its iterations split 60/10/5 % of its wall time)."""
    return {"wall_seconds": wall_seconds, "ranks": ranks, "gpus": gpus, "gpu_hours": gpu_hours,
            "cpu_core_hours": cpu_core_hours, "rss_peak_mb_server": rss_peak_mb_server,
            "startup_seconds": startup_seconds, "party_compute_seconds": 0.6 * wall_seconds,
            "transfer_seconds": 0.1 * wall_seconds, "server_seconds": 0.05 * wall_seconds}


# ---------------------------------------------------------------------- child processes


def python_child(script: str, path: Path, *args: str) -> subprocess.Popen:
    """A python subprocess running `script` on the log at `path` (argv[1]; `args` follow), talking over pipes."""
    return subprocess.Popen([sys.executable, "-c", script, str(path), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)  # fmt: skip


class LineReader:
    """Reads a child's stdout lines on a thread so the test can wait with a timeout instead of hanging."""

    def __init__(self, process: subprocess.Popen) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(process,), daemon=True).start()

    def _pump(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self._lines.put(line)

    def json(self, timeout: float = 60.0) -> dict:
        """The child's next stdout line, parsed as JSON."""
        return json.loads(self._lines.get(timeout=timeout))


def end(process: subprocess.Popen) -> None:
    """Kill and reap `process` if it is still running (a test's ``finally``)."""
    if process.poll() is None:
        process.kill()
        process.wait()


# A real writer process of the stage named by argv[2] (``open_stage`` with a ledger): logs 5 metric rows, 2 ledger
# rows (charged steps step+1.. per party) and, in the search, 2 epochs; heartbeats, reports its PID, then waits
# (alive) until the test kills it.
_WRITER = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    sys.path.insert(0, "tests")
    from runlog_helpers import PARTIES, metric_row, open_stage, softmax_rows

    path, stage = sys.argv[1], sys.argv[2]
    runlog = open_stage(path, stage, private=True)
    log = runlog.stage(stage)
    for step in range(5):
        log.append_metrics(metric_row(stage, step))
        runlog.heartbeat()
        if step % 2 == 1:
            if stage == "search":
                log.append_epoch(softmax_rows(step), softmax_rows(step + 1), f"g{step}")
            log.append_privacy(step + 1, np.arange(step + 1, step + 1 + PARTIES), np.full(PARTIES, 0.1 * step),
                               np.full(PARTIES, 0.01))
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.readline()  # alive until killed (or told to go)
    """
)
#: What the killed writer's stage holds (``row_counts``).
KILLED_WRITER_ROWS = {"search": (5, 2, 2, 0), "augment": (5, 2, 0)}


def start_writer(path: Path, stage: str) -> tuple[subprocess.Popen, int]:
    """A writer subprocess of `stage` that has logged everything and is now idle; returns it and its PID."""
    process = python_child(_WRITER, path, stage)
    try:
        pid = LineReader(process).json()["pid"]
    except BaseException:
        end(process)
        raise
    assert pid == process.pid
    return process, pid


def sigkill(process: subprocess.Popen, pid: int, *, reap: bool) -> None:
    """SIGKILL the writer by PID, as mpirun does; without reap it is left a zombie (exited, not yet waited for)."""
    os.kill(pid, signal.SIGKILL)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # wait for the death, but keep the zombie
    if reap:
        process.wait(timeout=30)
