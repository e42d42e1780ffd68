"""One iteration of the federated augmentation, both roles side by side: Algorithm 1 without the A phase.

    party k:  G_k = release of ∇_W L(batch of its pool)   ──Reduce(sum)──▶  server: W ← SGD(mean_k G_k)
    party k:  W_k ← W                                      ◀──Bcast W─────

With ADADP (``augment.optimizer: adadp``) that round runs twice: G1 at W → the server broadcasts
W_half = W − (η/2)·G1 → G2 at W_half, on a fresh batch → the server broadcasts the next W and adapts η.

Under DP the release is clipped and noised inside the party (:class:`~.party.AugmentParty`). The server
contributes zeros to the Reduce, and the broadcast carries the control word after W (see
:mod:`mpi_fnas.federation.stage`).

With ``federation.selection`` random, secprobe or oracle the Reduce becomes a Gather
(:func:`server_augment_iteration_selecting`): the server chooses K′ parties with the search's
:class:`~mpi_fnas.federation.selection.Selector` (secprobe: each release probed on the aux set,
:meth:`AugmentServer.probe_accuracy`) and steps on the mean of theirs. A party sends the same buffer either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mpi_fnas.federation.algorithm import sum_rows
from mpi_fnas.federation.augment.party import AugmentParty
from mpi_fnas.federation.augment.server import AugmentServer
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.flat import STATS
from mpi_fnas.federation.selection import Selector
from mpi_fnas.federation.stage import CONTINUE


class AugmentBuffers:
    """Rank 0's receive buffer, its zero contribution and its send buffer (W, then the control word)."""

    def __init__(self, num_w: int) -> None:
        self.zero = np.zeros(num_w + STATS, dtype=np.float32)
        self.sum = np.zeros(num_w + STATS, dtype=np.float32)
        self.send = np.zeros(num_w + 1, dtype=np.float32)


def server_augment_iteration(server: AugmentServer, channel: Channel, buf: AugmentBuffers, step: int,
                             control: int) -> np.ndarray:
    """Rank 0's half of iteration `step`; returns the summed STATS tail (zeros under DP)."""
    if server.adadp is None:
        return _round(lambda g: server.step(step, g), server, channel, buf, control)  # Σ_k G_k → W
    stats = _round(server.adadp_half_step, server, channel, buf, CONTINUE)  # Σ_k G1_k → W_half
    return stats + _round(server.adadp_full_step, server, channel, buf, control)  # Σ_k G2_k → W


class AugmentGatherBuffers:
    """Rank 0's buffers of the gathered releases, one row per party (K, num_w + STATS), allocated once."""

    def __init__(self, parties: int, num_w: int) -> None:
        self.zero = np.zeros(num_w + STATS, dtype=np.float32)
        self.parts = np.zeros((parties, num_w + STATS), dtype=np.float32)
        self.sum = np.zeros(num_w + STATS, dtype=np.float32)
        self.send = np.zeros(num_w + 1, dtype=np.float32)


@dataclass
class SelectedAugmentStats:
    """One selecting iteration: STATS summed over every party (4,), chosen (K,) bool, score (K,) float64."""

    stats: np.ndarray
    chosen: np.ndarray
    score: np.ndarray


def server_augment_iteration_selecting(server: AugmentServer, channel: Channel, buf: AugmentGatherBuffers,
                                       selector: Selector, x_aux, y_aux, step: int,
                                       control: int) -> SelectedAugmentStats:
    """Rank 0's half of iteration `step` with a selection: only the chosen parties' releases update W.

    `x_aux`, `y_aux`: the server's aux set (used only when ``selector.scores_needed``). `server.parties` must be
    K′ (the mean divides by the number of summed releases). Never under ADADP (refused by the config).
    """
    channel.gather(buf.zero, buf.parts)  # every G_k
    chosen, score = selector.choose(
        lambda: np.array([server.probe_accuracy(g[:-STATS], x_aux, y_aux, step) for g in buf.parts]))
    sum_rows(buf.parts, chosen, buf.sum)
    server.step(step, buf.sum[:-STATS])
    buf.send[:-1] = server.w_buffer
    buf.send[-1] = control
    channel.bcast(buf.send)  # W and the control word
    return SelectedAugmentStats(stats=buf.parts[:, -STATS:].sum(axis=0), chosen=chosen, score=score)


def _round(update: Callable[[np.ndarray], None], server: AugmentServer, channel: Channel, buf: AugmentBuffers,
           control: int) -> np.ndarray:
    """One weight round on rank 0: Reduce the releases, `update` W with their sum, broadcast W and `control`."""
    channel.reduce_sum(buf.zero, buf.sum)
    update(buf.sum[:-STATS])
    buf.send[:-1] = server.w_buffer
    buf.send[-1] = control
    channel.bcast(buf.send)  # W and the control word
    return buf.sum[-STATS:].copy()


def party_augment_iteration(party: AugmentParty, channel: Channel, w_in: np.ndarray, drop_path_prob: float,
                            rounds: int = 1, gathered: bool = False) -> int:
    """Party k's half of an iteration; `w_in` is the (W + control word) receive buffer. Returns the control word
    of the last round. `rounds`: 2 under ADADP (a release at W, then one at the broadcast W_half), else 1.
    `gathered`: the server gathers the releases (a selection; never with ADADP) instead of reducing them."""
    send = channel.gather if gathered else channel.reduce_sum
    for _ in range(rounds):
        send(party.release(drop_path_prob))  # G_k (ADADP: G1_k, then G2_k)
        channel.bcast(w_in)
        party.load_w(w_in[:-1])  # W_k ← W (ADADP: W_half first)
    return int(w_in[-1])
