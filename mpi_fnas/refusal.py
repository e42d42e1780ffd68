"""A party's refusal as one line: what it prints on its own stderr and what rank 0 is told. Below both the launch
layer (``cli``) and the federation, which refuse through it."""

from __future__ import annotations


def refusal_text(exc: BaseException) -> str:
    """A refusal as the one line rank 0 gets: its kind and the first line of its reason."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def refusal_line(rank: int, exc: BaseException) -> str:
    """The one line a refusing party prints on its own stderr."""
    return f"[mpi_fnas rank {rank}] error: {refusal_text(exc)}; aborting the job"


class ReportedRefusalError(Exception):
    """This party refused its setup (an assignment, or an identity it cannot use) and has printed its line and put
    it in its setup report already (:func:`mpi_fnas.stages.party_driver.participate`): rank 0 marks the log
    failed and ends the job, so the party sends no notice (one now could reach rank 0 before the other parties'
    reports, and the job would end before its log exists)."""
