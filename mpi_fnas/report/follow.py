"""``--follow RUN_DIR``: a live view of one run, read from its SWMR log while rank 0 writes it.

Every ``interval`` seconds the log is read again with :func:`mpi_fnas.runlog.read_run` (a fresh SWMR open each
time, so new attributes and the ``/augment`` group show up) and one status line is shown: the stage, step/total,
epoch, s/step and ETA, ε per party (worst, best), the last test accuracy; the current genotype is printed on its
own line whenever it changes. On a terminal the status line is redrawn in place (``\\r``); otherwise a line is
printed whenever the step or the status changed.

It ends when the run does: exit 0 finished (every stage the run was configured for), 1 failed (a dead writer
included: read_run reports a ``running`` log whose writer died as ``failed``, and a search that finished while
the augmentation it asked for never started and its writer is gone counts as failed too), 75 interrupted
(checkpointed; ``mpi_fnas.run --resume`` continues it). On a run that already ended it prints the final state at
once.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from mpi_fnas import cli
from mpi_fnas.config import CELL_NETWORK, ConfigError, config_from_text
from mpi_fnas.federation.adadp import w_rounds
from mpi_fnas.report.collect import (
    AUGMENT_PENDING,
    FINISHED,
    config_value,
    parse_config,
    read_record,
    record_from_log,
    released_epsilon,
    run_status,
    supernet_test_error,
)
from mpi_fnas.runlog import DEFAULT_STALE_SECONDS, read_run
from mpi_fnas.sweep import LOG_NAME, planned_steps_bound

#: How long --follow waits for a run directory's search.h5 to appear (the run creates it during its setup).
LOG_WAIT_SECONDS = 60.0
_EXIT = {FINISHED: cli.EXIT_OK, "failed": cli.EXIT_FAILURE, "interrupted": cli.EXIT_INTERRUPTED}


@dataclass(frozen=True)
class Snapshot:
    """What one read of the log shows. ``outcome`` is None while the run goes on, else its final status."""

    stage: str  # "search" or "augment"
    step: int  # last logged step of the stage (0: none yet)
    total: int | None  # planned steps of the stage (None: unknown)
    epoch: int | None  # 1-based epoch of the last logged row
    epochs: int | None
    step_seconds: float | None  # from the log (non-DP search rows, or a finished stage's cost); else None
    epsilon_worst: float | None
    epsilon_best: float | None
    test_acc: float | None
    genotype: str  # what the stage trains: the cell's genotype, or the hand-designed network's name (see network)
    outcome: str | None
    reason: str
    network: str = CELL_NETWORK  # augment.network of the augmentation (cell in the search)


def locate_log(run_dir: str | Path, wait_seconds: float = LOG_WAIT_SECONDS,
               sleep: Callable[[float], None] = time.sleep) -> Path:
    """The run's search.h5 (RUN_DIR/search.h5, or the file itself); waits up to `wait_seconds` for a run
    directory that exists but has no log yet. Raises ConfigError otherwise."""
    path = Path(run_dir)
    if path.is_file():
        if path.name != LOG_NAME:
            raise ConfigError(f"--follow: {path} is not a run log (expected a run directory or its {LOG_NAME})")
        return path
    if not path.is_dir():
        raise ConfigError(f"--follow: {path}: no such run directory")
    deadline = time.monotonic() + wait_seconds
    while not (path / LOG_NAME).is_file():
        if time.monotonic() >= deadline:
            raise ConfigError(f"--follow: {path} holds no {LOG_NAME} (follow one run directory, not a root)")
        sleep(0.5)
    return path / LOG_NAME


def snapshot(log: dict[str, Any], *, now: float | None = None,
             stale_after: float = DEFAULT_STALE_SECONDS) -> Snapshot:
    """Reduce a read_run dict to what the live view shows (no file access)."""
    config = parse_config(log["config"])
    augment = log["augment"]
    epsilon, _ = released_epsilon(log)
    eps_worst = float(epsilon.max()) if epsilon.size else None
    eps_best = float(epsilon.min()) if epsilon.size else None
    if augment is None:
        metrics = log["metrics"]
        step = int(log["last_step"] or 0)
        total = _planned_search_steps(log, config)
        acc = 1.0 - supernet_test_error(log)
        genotype = log["genotypes"][-1] if log["genotypes"] else ""
        outcome, reason = _search_outcome(log, config, now if now is not None else time.time(), stale_after)
        seconds = _finite_mean(metrics.get("step_seconds"))
        if seconds is None and outcome is not None and step:
            seconds = _per_step(log["cost"]["wall_seconds"], step)
        return Snapshot("search", step, total, _epoch(metrics), config_value(config, "search.epochs"), seconds,
                        eps_worst, eps_best, acc if math.isfinite(acc) else None, genotype, outcome, reason)
    metrics = augment["metrics"]
    steps = metrics["step"]
    step = int(steps[-1]) if len(steps) else 0
    tests = np.asarray(metrics["test_acc"], dtype=float)
    tests = tests[np.isfinite(tests)]
    status = augment["status"]
    outcome = None if status == "running" else status
    seconds = _per_step(augment["cost"]["wall_seconds"], step) if outcome is not None and step else None
    return Snapshot("augment", step, _planned_augment_steps(log, config), _epoch(metrics),
                    config_value(config, "augment.epochs"), seconds, eps_worst, eps_best,
                    float(tests[-1]) if tests.size else None, augment["genotype"] or augment["network"], outcome,
                    augment["reason"], augment["network"])


class LiveView:
    """Shows snapshots on `stream`: a status line per change (redrawn in place on a terminal), the genotype when
    it changes. s/step is measured by this view (wall time over steps since it first saw the stage) unless the
    log says it."""

    def __init__(self, stream: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.clock = clock
        self.tty = stream.isatty()
        self._first: dict[str, tuple[float, int]] = {}  # stage -> (clock, step) when first seen
        self._last_key: tuple | None = None
        self._genotype = ""
        self._shown = 0  # length of the line being redrawn (terminal)

    def show(self, snap: Snapshot) -> None:
        """Print `snap`: its genotype (or network) when it changed, then its status line."""
        now = self.clock()
        first = self._first.setdefault(snap.stage, (now, snap.step))
        measured = (now - first[0]) / (snap.step - first[1]) if snap.step > first[1] else None
        seconds = snap.step_seconds if snap.step_seconds is not None else measured
        if snap.genotype and snap.genotype != self._genotype:
            self._genotype = snap.genotype
            self._end_line()
            self.stream.write(f"{'genotype' if snap.network == CELL_NETWORK else 'network'} {snap.genotype}\n")
        line = status_line(snap, seconds)
        key = (snap.stage, snap.step, snap.outcome, snap.test_acc, snap.epsilon_worst)
        if self.tty:
            self.stream.write("\r" + line.ljust(self._shown))
            self._shown = len(line)
        elif key != self._last_key:
            self.stream.write(line + "\n")
        self._last_key = key
        self.stream.flush()

    def final(self, log: dict[str, Any], snap: Snapshot) -> None:
        """The end: the outcome, then what the run produced (a few plain lines)."""
        self._end_line()
        for line in final_lines(log, snap):
            self.stream.write(line + "\n")
        self.stream.flush()

    def _end_line(self) -> None:
        if self.tty and self._shown:
            self.stream.write("\n")
            self._shown = 0


def status_line(snap: Snapshot, seconds_per_step: float | None) -> str:
    """``search step 3/8 epoch 2/2 1.20 s/step ETA 0:00:06 ε worst 1.9 best 1.8 test_acc 0.125``."""
    known_total = snap.total is not None and snap.total >= snap.step and snap.total > 0
    parts = [f"{snap.stage:<7} step {snap.step}" + (f"/{snap.total}" if known_total else "")]
    if snap.epoch is not None:
        parts.append(f"epoch {snap.epoch}" + (f"/{snap.epochs}" if snap.epochs else ""))
    if seconds_per_step is not None:
        parts.append(f"{seconds_per_step:.2f} s/step")
        if known_total and snap.outcome is None:
            assert snap.total is not None
            parts.append(f"ETA {_clock(seconds_per_step * (snap.total - snap.step))}")
    if snap.epsilon_worst is not None:
        parts.append(f"ε worst {snap.epsilon_worst:.4g} best {snap.epsilon_best:.4g}")
    if snap.test_acc is not None:
        parts.append(f"test_acc {snap.test_acc:.4f}")
    parts.append(snap.outcome or "running")
    return "  ".join(parts)


def final_lines(log: dict[str, Any], snap: Snapshot) -> list[str]:
    """The final state of a run that ended: outcome and reason, then the numbers of the report's runs table."""
    record = record_from_log(log, Path(LOG_NAME), "run", "run")
    lines = [f"== run {snap.outcome} ==" if snap.outcome else "== run ==", f"reason      {snap.reason or '-'}"]
    lines.append(f"search      {log['status']}, {log['last_step'] or 0} steps, supernet test error "
                 f"{_fmt(record.supernet_test_error, '.4f')}, wall {_fmt(record.search_wall_seconds, '.1f')} s, "
                 f"attempts {record.attempts}")
    augment = log["augment"]
    if augment is not None:
        lines.append(f"augment     {augment['status']}, test error {_fmt(augment['test_error'], '.4f')}, "
                     f"params {augment['params']}, wall {_fmt(augment['cost']['wall_seconds'], '.1f')} s")
    if record.epsilon_covers:
        lines.append(f"ε           worst {record.epsilon_worst:.4g}, best {record.epsilon_best:.4g} "
                     f"({record.epsilon_covers}; guarantee: {record.privacy_guarantee})")
    if record.handcrafted:
        lines.append(f"network     {record.network} (hand-designed, no cell)")
    lines.append(f"genotype    {record.genotype or '-'}")
    return lines


def follow(run_dir: str | Path, interval: float = 2.0, stream: TextIO | None = None,
           sleep: Callable[[float], None] = time.sleep) -> int:
    """Follow one run until it ends; return the exit code (0 finished, 1 failed, 75 interrupted).

    Raises ConfigError when `run_dir` is not a run (no such directory, no log, not a readable log).
    """
    stream = stream or sys.stdout
    path = locate_log(run_dir, sleep=sleep)
    read_record(path, path.parent)  # a corrupt or foreign file is bad input, reported before the view starts
    view = LiveView(stream)
    while True:
        try:
            log = read_run(path)
        except Exception as exc:  # the file went away or was damaged under us
            print(f"mpi_fnas: error: --follow: {path}: cannot read the log any more ({exc})", file=sys.stderr)
            return cli.EXIT_FAILURE
        snap = snapshot(log)
        view.show(snap)
        if snap.outcome is not None:
            view.final(log, snap)
            return _EXIT.get(snap.outcome, cli.EXIT_FAILURE)
        sleep(interval)


# -- helpers --------------------------------------------------------------------------------------------------------
def _search_outcome(log: dict[str, Any], config: dict[str, Any], now: float,
                    stale_after: float) -> tuple[str | None, str]:
    """The search stage's outcome, or None while the run goes on (also between the search and its augmentation):
    the report's rule (collect.run_status), so the two never disagree."""
    if log["status"] == "running":
        return None, ""
    status, reason = run_status(log, config, now=now, stale_after=stale_after)  # log["augment"] is None here
    return (None, "") if status == AUGMENT_PENDING else (status, reason)


def _planned_search_steps(log: dict[str, Any], config: dict[str, Any]) -> int | None:
    """epochs × steps per epoch; without search.steps_per_epoch an epoch is one pass over the mean party's train
    shard (exact from the DP sample rates, else estimated from the data sizes). privacy.max_epsilon may end the
    run earlier."""
    if log["privacy"] is not None:
        try:
            cfg = config_from_text(log["config"], stored=True)
        except ConfigError:
            return None
        rates = np.broadcast_to(np.asarray(log["privacy"]["sample_rate_train"], dtype=float), (log["parties"],))
        return planned_steps_bound(cfg, [float(q) for q in rates])
    per_epoch = config_value(config, "search.steps_per_epoch")
    if per_epoch is None:
        shard = _examples(config) * (1.0 - float(config_value(config, "data.val_fraction", 0.5))) / log["parties"]
        per_epoch = max(1, math.ceil(shard / int(config_value(config, "search.batch_size", 1))))
    if isinstance(per_epoch, int):  # as the plan: an epoch counts W releases, an ADADP iteration makes two
        per_epoch = math.ceil(per_epoch / w_rounds(str(config_value(config, "search.w_optimizer", "sgd"))))
    epochs = config_value(config, "search.epochs")
    return int(epochs) * int(per_epoch) if isinstance(epochs, int) else None


def _planned_augment_steps(log: dict[str, Any], config: dict[str, Any]) -> int | None:
    """augment.epochs × steps per epoch (one pass over the mean party's pool when not set). From the root config,
    which a later ``--augment RUN_DIR --set augment.…`` does not update: then unknown or off (shown without a total
    once the step passes it)."""
    epochs = config_value(config, "augment.epochs")
    per_epoch = config_value(config, "augment.steps_per_epoch")
    if per_epoch is None:
        share = 1.0 if config_value(config, "augment.pool", "all") == "all" else (
            1.0 - float(config_value(config, "data.val_fraction", 0.5)))
        per_epoch = max(1, math.ceil(_examples(config) * share / log["parties"]
                                     / int(config_value(config, "augment.batch_size", 1))))
    if isinstance(per_epoch, int):  # as the plan: an epoch counts weight releases, an ADADP iteration makes two
        per_epoch = math.ceil(per_epoch / w_rounds(str(config_value(config, "augment.optimizer", "sgd"))))
    return int(epochs) * int(per_epoch) if isinstance(epochs, int) else None


def _examples(config: dict[str, Any]) -> int:
    size = config_value(config, "data.train_size")
    return int(size) if isinstance(size, int) else 50000  # null: all of CIFAR-10's train split


def _epoch(metrics: dict[str, np.ndarray]) -> int | None:
    epochs = np.asarray(metrics.get("epoch", np.empty(0)), dtype=float)
    return int(epochs[-1]) + 1 if epochs.size and math.isfinite(epochs[-1]) else None


def _finite_mean(values: Any) -> float | None:
    if values is None:
        return None
    array = np.asarray(values, dtype=float)
    array = array[np.isfinite(array)]
    return float(array.mean()) if array.size else None


def _per_step(wall_seconds: float, steps: int) -> float | None:
    return float(wall_seconds) / steps if math.isfinite(float(wall_seconds)) and steps > 0 else None


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _fmt(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(float(value)) else "-"
