"""Rank 0's progress line: only known values, ε and the last test accuracy under DP, s/step from its own clock."""

from __future__ import annotations

import io
import math

from mpi_fnas.progress import Progress

NAN = math.nan


class FakeClock:
    """A settable monotonic clock (seconds), so s/step and the ETA are exact without timing anything."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def dp_row(step: int, epoch: int, epsilon: float, test_acc: float | None = None) -> dict[str, float]:
    """A /metrics row as rank 0 builds it under DP: no party statistics, NaN per-step timings."""
    row = {"step": step, "epoch": epoch, "train_loss": NAN, "train_acc": NAN, "val_loss": NAN, "val_acc": NAN,
           "step_seconds": NAN, "comm_seconds": NAN, "party_seconds": NAN, "w_lr": 0.05, "epsilon": epsilon}
    if test_acc is not None:
        row.update(test_loss=1.7, test_acc=test_acc)
    return row


def fnas_row(step: int, epoch: int, step_seconds: float, test_acc: float | None = None) -> dict[str, float]:
    """A /metrics row of a non-private run."""
    row = {"step": step, "epoch": epoch, "train_loss": 2.0 - 0.01 * step, "train_acc": 0.3, "val_loss": 2.1,
           "val_acc": 0.25 + 0.01 * step, "step_seconds": step_seconds, "comm_seconds": 0.01,
           "party_seconds": 0.3, "w_lr": 0.05}
    if test_acc is not None:
        row.update(test_loss=1.7, test_acc=test_acc)
    return row


def test_dp_line_shows_epsilon_last_test_acc_and_wall_clock_rate_never_nan() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress("on", stream=out, width=8, clock=clock)
    # 16 steps, 8 per epoch, a row every 4 steps; every step takes 2.5 s of wall time.
    for step in (4, 8, 12, 16):
        clock.now += 2.5 * 4
        epoch_end = step % 8 == 0
        progress(step, 16, dp_row(step, (step - 1) // 8, 0.1 * step, test_acc=0.1 + step / 100 if epoch_end else None))
    frames = out.getvalue().split("\r")[1:]
    assert len(frames) == 4 and out.getvalue().endswith("\n")
    for frame in frames:
        assert "nan" not in frame.lower()
        assert "loss" not in frame and "val_acc" not in frame  # not released under DP
    first, second, third, last = (f.rstrip() for f in frames)
    # First call: nothing measured yet and the row's timing is NaN, so no rate and no ETA rather than a guess.
    assert first == "[##......] 4/16 ep 1 ε 0.4"
    assert second == "[####....] 8/16 ep 1 test_acc 0.180 ε 0.8 2.50s/step eta 0:00:20"
    # The test accuracy of the last epoch end stays on the line until the next epoch end.
    assert third == "[######..] 12/16 ep 2 test_acc 0.180 ε 1.2 2.50s/step eta 0:00:10"
    assert last == "[########] 16/16 ep 2 test_acc 0.260 ε 1.6 2.50s/step eta 0:00:00"


def test_rate_is_wall_time_since_the_first_call_over_steps_done() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress("on", stream=out, width=4, clock=clock)
    progress(101, 200, dp_row(101, 0, 3.0))  # a resumed run: its first call is at step 101
    clock.now += 30.0  # 3 steps in 30 s (evaluation and logging included): 10 s/step
    progress(104, 200, dp_row(104, 0, 3.1))
    assert out.getvalue().split("\r")[-1].rstrip().endswith("10.00s/step eta 0:16:00")  # 96 steps left
    clock.now += 5.0  # the rate averages over everything since the first call: 35 s / 5 steps
    progress(106, 200, dp_row(106, 0, 3.2))
    assert out.getvalue().split("\r")[-1].rstrip().endswith("7.00s/step eta 0:10:58")  # 94 × 7 = 658 s


def test_non_private_line_shows_finite_loss_and_val_acc() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress("on", stream=out, width=4, clock=clock)
    progress(2, 8, fnas_row(2, 0, step_seconds=0.75))  # first call: the row's own step time is finite, use it
    clock.now += 2.0
    progress(4, 8, fnas_row(4, 0, step_seconds=0.9, test_acc=0.5))
    first, second = (f.rstrip() for f in out.getvalue().split("\r")[1:])
    assert first == "[#...] 2/8 ep 1 loss 1.980 val_acc 0.270 0.75s/step eta 0:00:04"
    assert second == "[##..] 4/8 ep 1 loss 1.960 val_acc 0.290 test_acc 0.500 1.00s/step eta 0:00:04"
    assert "ε" not in out.getvalue()
    partial = fnas_row(6, 1, step_seconds=0.9)
    partial["val_acc"] = NAN  # any non-finite value is left out, not printed as nan
    clock.now += 2.0
    progress(6, 8, partial)
    assert out.getvalue().split("\r")[-1].rstrip() == "[###.] 6/8 ep 2 loss 1.940 test_acc 0.500 1.00s/step eta 0:00:02"


def test_infinite_epsilon_is_shown() -> None:
    out = io.StringIO()
    Progress("on", stream=out, width=4, clock=FakeClock())(1, 4, dp_row(1, 0, math.inf))
    assert "ε inf" in out.getvalue()


def test_live_line_blanks_the_rest_of_a_longer_previous_line() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress("on", stream=out, width=4, clock=clock)
    progress(1, 100, fnas_row(1, 0, step_seconds=0.5))
    long_frame = out.getvalue().split("\r")[-1]
    clock.now += 1.0
    progress(2, 100, dp_row(2, 0, 0.2))  # shorter text
    short_frame = out.getvalue().split("\r")[-1]
    assert len(short_frame) == len(long_frame) and short_frame.endswith(" ")


def test_log_file_mode_writes_about_one_line_per_tenth_and_off_writes_nothing() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress("auto", stream=out, clock=clock)  # a StringIO is not a terminal
    for step in range(1, 101):
        clock.now += 1.0
        progress(step, 100, dp_row(step, 0, 0.01 * step))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split()[1] for line in lines] == [f"{s}/100" for s in range(10, 101, 10)]
    assert all("nan" not in line for line in lines)

    silent = io.StringIO()
    off = Progress("off", stream=silent, clock=clock)
    off(5, 10, dp_row(5, 0, 0.1))
    off(10, 10, dp_row(10, 0, 0.2))
    assert silent.getvalue() == ""


def _private_lines(step_durations: list[float], steps_per_epoch: int, log_every: int = 1) -> list[str]:
    """The frames a private (DP) progress prints when step i takes ``step_durations[i - 1]`` seconds; rank 0
    evaluates (and the row carries test_acc) at every epoch end."""
    clock, out = FakeClock(), io.StringIO()
    progress = Progress("on", stream=out, width=8, clock=clock, private=True)
    total = len(step_durations)
    for step, seconds in enumerate(step_durations, start=1):
        clock.now += seconds
        epoch_end = step % steps_per_epoch == 0
        if step % log_every == 0 or epoch_end:
            progress(step, total, dp_row(step, (step - 1) // steps_per_epoch, 0.1 * step,
                                         test_acc=0.5 if epoch_end else None))
    return [frame.rstrip() for frame in out.getvalue().split("\r")[1:]]


def test_private_progress_shows_nothing_finer_than_whole_epochs() -> None:
    """No timing side channel: a step's duration tracks its realised Poisson batch, and a Slurm .out file keeps every
    line. Two runs whose steps take different times, but whose epochs take the same, must print the same lines."""
    uneven = [0.1, 3.0, 0.2, 2.7, 5.0, 0.5, 0.4, 0.1, 1.0, 1.0, 1.0, 3.0]  # epochs of 4 steps: 6, 6 and 6 s
    even = [1.5] * 12
    assert _private_lines(uneven, 4) == _private_lines(even, 4)
    lines = _private_lines(uneven, 4)
    # No rate before two epoch ends; from then on the rate of whole epochs: 6 s per 4 steps.
    assert not any("s/step" in line for line in lines[:7])
    assert lines[7] == "[#####...] 8/12 ep 2 test_acc 0.500 ε 0.8 1.50s/step eta 0:00:06"
    assert all("1.50s/step" in line for line in lines[7:])
    # A slower last epoch shows at its end, and only there: (6 s + 12 s) / 8 steps since the first epoch end.
    slower = _private_lines([1.5] * 8 + [0.5, 0.5, 0.5, 10.5], 4)
    assert slower[-2] == lines[-2] and slower[-1].endswith("2.25s/step eta 0:00:00")
