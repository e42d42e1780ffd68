"""Rank 0's progress display: a one-line bar on a terminal, a few plain lines in a log file.

It shows only what is known. Under DP the parties release no loss or accuracy (those row values are NaN) and the
per-step timing columns are NaN too (per-step timings would reveal the realised batch size), so a line there reads
``step/total, epoch, ε so far, last test accuracy, s/step, ETA``, and the console obeys the log's rule: its timing
comes from whole epochs only (see :class:`Progress`, ``private``). A Slurm ``.out`` file keeps every line, and two
lines with a cumulative s/step taken at arbitrary steps would give the duration of the steps between them.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _finite(row: Mapping[str, float], key: str) -> float | None:
    """``row[key]`` as a float if present and finite, else None."""
    value = row.get(key)
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class Progress:
    """Callable ``(step, total, row)`` for :func:`mpi_fnas.stages.job.run_search`.

    ``row`` is a metrics row as logged to ``/metrics``; its values are shown only when finite. s/step is the wall
    time since the first call over the steps done since (before a second call: the row's ``step_seconds``), the ETA
    s/step × steps left; with ``private`` the clock is read only at epoch ends (docs/privacy.md §2.3).

    Args:
        mode: "on" (a live bar), "off", or "auto" (a bar on a terminal, else one line per 10 % of the steps).
        stream: where to write (default: standard error).
        width: characters of the bar.
        clock: seconds, monotonic (tests pass a fake one).
        label: the stage shown before the bar ("search", "augment"; "" shows none).
        private: timing from whole epochs only (a DP run).
    """

    def __init__(self, mode: str = "auto", stream: TextIO | None = None, width: int = 24,
                 clock: Callable[[], float] = time.perf_counter, label: str = "", private: bool = False) -> None:
        self.label = label
        self.private = private
        self._epoch_ends: list[tuple[float, int]] = []  # private: (clock, step) at the epoch ends seen
        self.stream = stream or sys.stderr
        self.live = mode == "on" or (mode == "auto" and self.stream.isatty())
        self.enabled = mode != "off"
        self.width = width
        self.clock = clock
        self._first: tuple[float, int] | None = None  # (clock, step) of the first call
        self._test_acc: float | None = None
        self._next_tenth = 1
        self._shown = 0  # length of the live line on screen, to blank a longer previous one

    def __call__(self, step: int, total: int, row: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        text = self._line(step, total, row)
        if self.live:
            self.stream.write("\r" + text.ljust(self._shown) + ("\n" if step == total else ""))
            self._shown = len(text)
            self.stream.flush()
        elif step * 10 >= self._next_tenth * total or step == total:
            self._next_tenth = step * 10 // max(total, 1) + 1
            self.stream.write(text + "\n")
            self.stream.flush()

    def _line(self, step: int, total: int, row: Mapping[str, float]) -> str:
        """The text for this call (updates the clock and the remembered test accuracy)."""
        test_acc = _finite(row, "test_acc")
        if self.private:
            now = math.nan  # never read between epoch ends
            if test_acc is not None:
                self._epoch_ends.append((self.clock(), step))
        else:
            now = self.clock()
            if self._first is None:
                self._first = (now, step)
        if test_acc is not None:
            self._test_acc = test_acc

        filled = min(self.width, int(self.width * step / total)) if total > 0 else self.width
        parts = [f"{self.label} " if self.label else ""]
        parts[0] += f"[{'#' * filled}{'.' * (self.width - filled)}] {step}/{total}"
        epoch = _finite(row, "epoch")
        if epoch is not None:
            parts.append(f"ep {int(epoch) + 1}")
        for key, label in (("train_loss", "loss"), ("val_acc", "val_acc")):
            value = _finite(row, key)
            if value is not None:
                parts.append(f"{label} {value:.3f}")
        if self._test_acc is not None:
            parts.append(f"test_acc {self._test_acc:.3f}")
        epsilon = row.get("epsilon")
        if epsilon is not None and not math.isnan(float(epsilon)):  # inf is a meaningful ε ("no guarantee")
            parts.append(f"ε {float(epsilon):.3g}")
        seconds_per_step = self._seconds_per_step(now, step, row)
        if seconds_per_step is not None:
            parts.append(f"{seconds_per_step:.2f}s/step eta {_clock(seconds_per_step * max(0, total - step))}")
        return " ".join(parts)

    def _seconds_per_step(self, now: float, step: int, row: Mapping[str, float]) -> float | None:
        if self.private:
            if len(self._epoch_ends) < 2:
                return None
            (first_time, first_step), (last_time, last_step) = self._epoch_ends[0], self._epoch_ends[-1]
            return (last_time - first_time) / (last_step - first_step)
        assert self._first is not None
        first_time, first_step = self._first
        if step > first_step:
            return (now - first_time) / (step - first_step)
        return _finite(row, "step_seconds")
