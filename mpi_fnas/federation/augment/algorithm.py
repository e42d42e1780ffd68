"""One iteration of the federated augmentation, both roles side by side: Algorithm 1 without the A phase.

    party k:  G_k = release of ∇_W L(batch of its pool)   ──Reduce(sum)──▶  server: W ← SGD(mean_k G_k)
    party k:  W_k ← W                                      ◀──Bcast W─────

With ADADP (``augment.optimizer: adadp``) that round runs twice: G1 at W → the server broadcasts
W_half = W − (η/2)·G1 → G2 at W_half, on a fresh batch → the server broadcasts the next W and adapts η.

Under DP the release is clipped and noised inside the party (:class:`~.party.AugmentParty`). The server
contributes zeros to the Reduce, and the broadcast carries the control word after W (see
:mod:`mpi_fnas.federation.stage`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mpi_fnas.federation.augment.party import AugmentParty
from mpi_fnas.federation.augment.server import AugmentServer
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.flat import STATS
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
                            rounds: int = 1) -> int:
    """Party k's half of an iteration; `w_in` is the (W + control word) receive buffer. Returns the control word
    of the last round. `rounds`: 2 under ADADP (a release at W, then one at the broadcast W_half), else 1."""
    for _ in range(rounds):
        channel.reduce_sum(party.release(drop_path_prob))  # G_k (ADADP: G1_k, then G2_k)
        channel.bcast(w_in)
        party.load_w(w_in[:-1])  # W_k ← W (ADADP: W_half first)
    return int(w_in[-1])
