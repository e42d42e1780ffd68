"""A party's own disk: its stream states, its count of sent releases, and its error details.

In the simulation the directory is ``RUN_DIR/parties/rank<k>/``; in a deployment, the party's own disk. Nothing in
it is ever sent to the server. The directory is 0700 and every file in it 0600 (whatever the umask).

* ``state-<step>.pt``: its batch-stream positions at a checkpoint step (and, only under reproducible randomness,
  its public stream keys), written before the server's own checkpoint of that step;
* ``sent_steps``: how many iterations' releases it ever handed to MPI, fsynced *before* each send, so a crash can
  only over-count; a resume charges the replays from it (docs/privacy.md §2.2, "Replays are charged");
* ``augment-state-<step>.pt``, ``augment_sent_steps``: the same for the augmentation (``stage="augment"``);
* ``releases.pt``: what one iteration of each launch of a stage released (σ, q, how many), from which journal count
  on: with the journals, its own ledger (:mod:`mpi_fnas.privacy.party_ledger`);
* ``earlier.json``: its directories of earlier runs on the same data, which its cap composes with this run
  (a baseline's other arms: :meth:`PartyStore.earlier_runs`);
* ``error.log``: the full text of a failure under DP, where the party sends the server only a generic reason.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from mpi_fnas.checkpoint import PRIVATE_FILE_MODE, atomic_load, atomic_save
from mpi_fnas.config import SetupError

PRIVATE_DIR_MODE = 0o700
#: The stages a party keeps a journal for, and the file of each.
JOURNALS = {"search": "sent_steps", "augment": "augment_sent_steps"}
RELEASES_NAME = "releases.pt"
EARLIER_NAME = "earlier.json"


def party_dir(run_dir: Path, rank: int) -> Path:
    """The directory of party `rank` under `run_dir`."""
    return Path(run_dir) / "parties" / f"rank{rank}"


class EarlierRun(NamedTuple):
    """A party's own directory of an earlier run on the same data (a baseline's other arm), whose releases its
    ``privacy.party_max_epsilon`` composes with this run's; `same_split`: whether that run split the data into the
    same train and validation shards (else an example may have been in either)."""

    directory: Path
    same_split: bool


class PartyStore:
    """The files of one party and one stage (``search`` or ``augment``) in its own directory (created on first use)."""

    def __init__(self, directory: Path, stage: str = "search") -> None:
        self.directory, self.stage = Path(directory), stage
        self.directory.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
        os.chmod(self.directory, PRIVATE_DIR_MODE)  # also when it existed, and whatever the umask
        prefix = "" if stage == "search" else f"{stage}-"
        self._state_name = f"{prefix}state-{{step}}.pt"
        self._state_pattern = re.compile(rf"^{re.escape(prefix)}state-(\d+)\.pt$")
        self._journal = self.directory / JOURNALS[stage]
        self._sent = _read_journal(self._journal)
        self._fd: int | None = None

    # -- sent releases -------------------------------------------------------------------------------------------
    @property
    def sent_steps(self) -> int:
        """Iterations whose releases this party has handed to MPI, over every attempt of the run."""
        return self._sent

    def record_send(self) -> None:
        """Count one more iteration's releases, durably, before they are sent."""
        if self._fd is None:
            self._fd = os.open(self._journal, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
            os.fchmod(self._fd, PRIVATE_FILE_MODE)
        self._sent += 1
        os.pwrite(self._fd, f"{self._sent:020d}\n".encode(), 0)
        os.fsync(self._fd)

    def sent_by_stage(self) -> dict[str, int]:
        """Every stage's count of sent iterations (this one's as this store holds it)."""
        return {stage: self._sent if stage == self.stage else _read_journal(self.directory / name)
                for stage, name in JOURNALS.items()}

    # -- what each launch released -------------------------------------------------------------------------------
    def release_record(self) -> list[dict[str, Any]]:
        """Every launch's ``{"stage", "from", "train", "val", "sizes", "secure"}``, both stages, in the order written
        ([] before the first): see :func:`mpi_fnas.privacy.party_ledger.spent_runs`."""
        path = self.directory / RELEASES_NAME
        return list(atomic_load(path)["segments"]) if path.exists() else []

    def recorded_epsilon(self, delta: float | None = None) -> float:
        """This party's ε from its own directory alone (its record and journals; `delta`: ``privacy.delta``, None
        for the default): :func:`mpi_fnas.privacy.party_ledger.recorded_epsilon` (loads the accountant)."""
        from mpi_fnas.privacy.party_ledger import recorded_epsilon

        return recorded_epsilon(self.release_record(), self.sent_by_stage(), delta)

    def begin_releases(self, train: list[float], val: list[float], sizes: list[int],
                       secure: list[int] | None) -> None:
        """Record what one iteration of this launch releases on each shard (``[σ, q, releases]``; `sizes`: the
        search shards' (N_tr, N_val); `secure`: secure aggregation's [K, σ_k², D, t] or None), before its first send:
        from the journal's count on, or from 0 for a stage with no record yet (a directory of an older version:
        its past sends are taken to be these)."""
        segments = self.release_record()
        mine = [segment for segment in segments if segment["stage"] == self.stage]
        if mine and (mine[-1]["train"], mine[-1]["val"], mine[-1]["secure"]) == (train, val, secure):
            return  # the same releases as the launch before: its segment goes on
        entry = {"stage": self.stage, "from": self._sent if mine else 0, "train": train, "val": val,
                 "sizes": [int(n) for n in sizes], "secure": secure}
        atomic_save(self.directory / RELEASES_NAME, {"segments": [*segments, entry]})

    # -- stream states -------------------------------------------------------------------------------------------
    def save_state(self, step: int, state: dict[str, Any]) -> None:
        """Keep the party's state of checkpoint `step`; drop older ones except the previous checkpoint's.

        States of steps after `step` are left by an attempt that died before the server's checkpoint: stale.
        """
        atomic_save(self.directory / self._state_name.format(step=step), {"step": step, **state})
        steps = self._saved_steps()
        older = [s for s in steps if s < step]
        for s in steps:
            if s > step or (older and s < max(older)):
                (self.directory / self._state_name.format(step=s)).unlink(missing_ok=True)

    def earlier_runs(self, given: Sequence[EarlierRun] = ()) -> list[EarlierRun]:
        """The earlier runs this party composes with this one: those it recorded in its directory when this run
        began (so a resume launched without them still composes them) and the `given` ones, which it records."""
        path = self.directory / EARLIER_NAME
        known = [EarlierRun(Path(d), bool(same)) for d, same in json.loads(path.read_text())] if path.exists() else []
        runs = list(dict.fromkeys([*known, *given]))
        if runs != known:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
            with os.fdopen(fd, "w") as f:
                json.dump([[str(run.directory), run.same_split] for run in runs], f)
        return runs

    def held_steps(self) -> list[int]:
        """The checkpoint steps whose state this party holds for its stage (at most the last two)."""
        return self._saved_steps()

    def has_state(self, step: int) -> bool:
        """Whether this party saved its own state at checkpoint `step` (a resume from any other step is refused)."""
        return (self.directory / self._state_name.format(step=step)).exists()

    def load_state(self, step: int) -> dict[str, Any]:
        """The state saved at checkpoint `step`. Raises FileNotFoundError when this party has none."""
        path = self.directory / self._state_name.format(step=step)
        if not path.exists():
            raise FileNotFoundError(f"party has no saved state for checkpoint step {step} in its own directory")
        return atomic_load(path)

    def save_party(self, step: int, randomness: str, party_state: dict[str, Any]) -> None:
        """Keep a party's own state of checkpoint `step` (see `save_state`), tagged with its randomness source."""
        self.save_state(step, {"randomness": randomness, "party": party_state})

    def load_party(self, step: int, randomness: str) -> dict[str, Any]:
        """The party state saved by `save_party` at `step`; refused when it was saved with another randomness source
        (a resumed run must continue the same streams)."""
        saved = self.load_state(step)
        if saved["randomness"] != randomness:
            raise SetupError(f"--resume: this party's state was saved with {saved['randomness']!r} randomness")
        return saved["party"]

    def _saved_steps(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := self._state_pattern.match(p.name)))

    # -- failures ------------------------------------------------------------------------------------------------
    def write_error(self, text: str) -> Path:
        """Append the details of a failure to the party's own ``error.log``; return its path."""
        path = self.directory / "error.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE)
        os.fchmod(fd, PRIVATE_FILE_MODE)
        with os.fdopen(fd, "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")
        return path

    def close(self) -> None:
        """Close the file the store holds open (again: nothing)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_journal(path: Path) -> int:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return 0
    return int(text) if text else 0
