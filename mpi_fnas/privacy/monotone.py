"""Monotone searches over integer indices: the planner's budgets and σ (:mod:`mpi_fnas.privacy.calibration`)."""

from __future__ import annotations

from collections.abc import Callable


def bisect(within: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest i in [lo, hi) with within(i), given within(lo) and not within(hi) (monotone)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if within(mid) else (lo, mid)
    return lo


def gallop(within: Callable[[int], bool], guess: int, last: int) -> int:
    """The largest i ≤ last with within(i) (true at 0, monotone), searched outwards from ``guess``."""
    if not within(guess):
        return bisect(within, 0, guess)
    lo, step = guess, 1
    while lo + step <= last and within(lo + step):
        lo, step = lo + step, step * 2
    return bisect(within, lo, min(lo + step, last + 1))
