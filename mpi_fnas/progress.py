"""Rank 0's progress display: a one-line bar on a terminal, a few plain lines in a log file."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Callable ``(step, total, row)`` for :func:`mpi_fnas.federation.search.run_search`.

    Args:
        mode: "on" (a live bar), "off", or "auto" (a live bar only when `stream` is a terminal; otherwise one
            line per 10 % so batch logs stay short).
    """

    def __init__(self, mode: str = "auto", stream: TextIO | None = None, width: int = 24) -> None:
        self.stream = stream or sys.stderr
        self.live = mode == "on" or (mode == "auto" and self.stream.isatty())
        self.enabled = mode != "off"
        self.width = width
        self.start = time.perf_counter()
        self._next_tenth = 1

    def __call__(self, step: int, total: int, row: dict[str, float]) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / step * (total - step) if step else 0.0
        filled = int(self.width * step / total)
        text = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {step}/{total} ep {int(row['epoch']) + 1} "
            f"loss {row['train_loss']:.3f} val_acc {row['val_acc']:.3f} "
            f"{row['step_seconds']:.2f}s/step eta {_clock(eta)}"
        )
        if self.live:
            self.stream.write("\r" + text + ("\n" if step == total else ""))
            self.stream.flush()
        elif step * 10 >= self._next_tenth * total or step == total:
            self._next_tenth = step * 10 // total + 1
            self.stream.write(text + "\n")
            self.stream.flush()
