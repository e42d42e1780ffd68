"""Whose releases update W and A each step (``federation.selection``): all, random K′, SecProbe's K′, or the oracle's
(the parties simulated as reliable, a baseline that knows them).

No MPI here (the exchange is :mod:`mpi_fnas.federation.algorithm`'s). Under ``secprobe`` the server scores every
party's W release on its own auxiliary set (:meth:`Server.probe_accuracy`), averages each party's last
``score_window`` scores, and draws K′ parties with the exponential mechanism
(:func:`mpi_fnas.privacy.exponential.exponential_mechanism_select`, Δu = 1/n_aux). The draw uses the server's own
secret :class:`~mpi_fnas.keystream.Keystream`, keyed with 256 bits from the OS: the mechanism hides the
aux set from the parties only if they cannot predict its coins (docs/privacy.md, "What SecProbe claims and what we
guarantee"). Its state, and the score window, are rank 0's and are checkpointed with the rest of its state. The
augmentation selects with a Selector of its own (a fresh window, its own stream) that continues the search's draw
count (:meth:`Selector.continue_after`), so the selection's ε composes over both stages.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mpi_fnas.config import Config, FederationConfig
from mpi_fnas.federation.randomness import server_stream
from mpi_fnas.keystream import Keystream
from mpi_fnas.privacy.exponential import (
    exponential_mechanism_select,
    selection_delta,
    selection_epsilon,
    uniform_select,
)


def selection_stream(cfg: Config, stage: str) -> Keystream:
    """The stream of the server's draws in `stage` ("search" or "augment"): secret, except with
    ``privacy.reproducible_noise`` (:func:`~mpi_fnas.federation.randomness.server_stream`)."""
    return server_stream(cfg.privacy.reproducible_noise, seed=cfg.seed, stage=stage)


class Selector:
    """Rank 0's choice, each step, of the parties whose releases are averaged.

    Args:
        fed: the federation settings (``selection``, ``select`` = K′, ``selection_epsilon``, ``score_window``,
            ``aux_size``).
        parties: K.
        rng: the server's secret stream (:func:`selection_stream`).
        unreliable: (K,) bool, the parties simulated as unreliable (public; the oracle chooses the others).
    """

    def __init__(self, fed: FederationConfig, parties: int, rng: Keystream,
                 unreliable: np.ndarray | None = None) -> None:
        self.mode, self.parties = fed.selection, parties
        self.reliable = np.ones(parties, dtype=bool) if unreliable is None else ~np.asarray(unreliable, dtype=bool)
        if self.mode == "oracle":
            self.select = int(self.reliable.sum())
        else:
            self.select = parties if fed.select is None else fed.select
        self.epsilon = fed.selection_epsilon
        self.sensitivity = 1.0 / fed.aux_size if fed.aux_size > 0 else float("nan")
        self.delta = selection_delta(fed.aux_size) if fed.aux_size > 0 else 0.0
        self.rng = rng
        self.window = np.full((fed.score_window, parties), np.nan)  # the last scores, oldest overwritten first
        self.scored = 0  # steps scored so far
        self.draws = 0  # exponential-mechanism draws so far (the steps the aux set has paid for)

    @property
    def scores_needed(self) -> bool:
        """Whether `choose` needs this step's per-party accuracies (secprobe)."""
        return self.mode == "secprobe"

    def choose(self, accuracies: Callable[[], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(chosen (K,) bool, score (K,) float64: the windowed scores used, NaN when none) of this step.

        `accuracies()` gives the parties' aux-set accuracies of this step, (K,); called only under secprobe.
        """
        score = np.full(self.parties, np.nan)
        chosen = np.zeros(self.parties, dtype=bool)
        if self.mode == "all":
            chosen[:] = True
        elif self.mode == "oracle":
            chosen[:] = self.reliable
        elif self.mode == "random":
            chosen[uniform_select(self.parties, self.select, self.rng)] = True
        else:
            self.window[self.scored % self.window.shape[0]] = accuracies()
            self.scored += 1
            score = np.nanmean(self.window[: min(self.scored, self.window.shape[0])], axis=0)
            chosen[exponential_mechanism_select(score, self.select, self.epsilon, self.sensitivity, self.rng)] = True
            self.draws += 1
        return chosen, score

    def continue_after(self, earlier: dict | None) -> None:
        """Count the draws of an earlier stage on the same aux set (the search's :meth:`summary`, None: none), so
        that :meth:`epsilon_spent` composes both stages. The window starts empty: the earlier scores rated another
        network. ValueError when the earlier stage drew at another ε_EM or K′ (the composition assumes one)."""
        if earlier is None or not earlier["draws"]:
            return
        if (earlier["epsilon"], earlier["select"]) != (self.epsilon, self.select):
            raise ValueError(f"federation.selection: the search drew at ε_EM = {earlier['epsilon']}, "
                             f"K′ = {earlier['select']}; the augmentation must draw at the same (it has "
                             f"ε_EM = {self.epsilon}, K′ = {self.select})")
        self.draws = int(earlier["draws"])

    def summary(self) -> dict:
        """What a later stage needs to compose with these draws: draws, ε_EM (epsilon), K′ (select)."""
        return {"draws": self.draws, "epsilon": self.epsilon, "select": self.select}

    def epsilon_spent(self) -> float:
        """ε of the draws so far on the aux set, at δ = ``self.delta`` (0 for all, random, oracle: no aux data)."""
        return selection_epsilon(self.draws, self.epsilon, self.select, self.delta)

    def state_dict(self) -> dict:
        """The selection's window, counts and coins, for rank 0's checkpoint."""
        return {"window": self.window.tolist(), "scored": self.scored, "draws": self.draws,
                "rng": self.rng.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state written by :meth:`state_dict`."""
        window = np.asarray(state["window"], dtype=np.float64)
        if window.shape != self.window.shape:
            raise ValueError(f"selection state: score window {window.shape}, expected {self.window.shape}")
        self.window = window
        self.scored, self.draws = int(state["scored"]), int(state["draws"])
        self.rng.load_state_dict(state["rng"])
