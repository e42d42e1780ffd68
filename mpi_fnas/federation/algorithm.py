"""One iteration of (DP-)FNAS — Algorithm 1 of Singh, Zhou et al. (2020), both roles side by side.

    party k:  G_k = release of ∇_W L(D_k^tr batch)            ──Reduce(sum)──▶  server: W ← step(Σ G_k)
    party k:  W'_k ← W                                         ◀──Bcast W─────
    party k:  H_k = release of ∇_A L(D_k^val batch; A, W')     ──Reduce(sum)──▶  server: A ← step(Σ H_k)
    party k:  A_k ← A                                          ◀──Bcast A─────

With ``second_order`` an extra round trip precedes H_k: every party sends v_k = ∇_{W'} L(D_k^val batch), the
server broadcasts the aggregate v, and each party adds its finite-difference Hessian term along that common v
(Eq. 5). Using the aggregate v makes Σ_k H_k the exact unrolled gradient of the aggregated validation loss
(the paper's per-party v_k drops cross-party terms); it costs one more W-sized exchange per step.

With ADADP (``search.w_optimizer: adadp``) the W half takes two rounds (Koskela & Honkela, Algorithm 2):
G1 at W → the server broadcasts W_half = W − (η/2)·G1 → G2 at W_half, on a fresh batch → the server broadcasts
the next W and adapts η (:mod:`mpi_fnas.federation.adadp`). The A half follows once.

Under DP the party's "release" is clipped and noised inside the party (``Party`` decides; see
``mpi_fnas.privacy``); nothing here changes. The server contributes zeros to every Reduce.
The returned ``StepStats`` carries the STATS tails (loss sums, counts, compute seconds) for logging.

With ``federation.selection`` random or secprobe the server needs every release, not their sum: both Reduces
become Gathers (:func:`server_iteration_selecting`), the server chooses K′ parties after the W phase
(:class:`~mpi_fnas.federation.selection.Selector`) and sums only theirs, for W and for A. A party sends the same
buffer either way; it is told which at setup (``Assignment.gathered``).

The final broadcast carries one extra number after A, the server's *control* word for the step boundary
(CONTINUE, CHECKPOINT, or STOP = checkpoint and end as interrupted), so every rank agrees where to stop
without another collective.

During the warm-up (``search.warmup_epochs``; ``train_a`` false, a public function of the step) only the W half
runs: no party computes or sends H_k and A stays; the final broadcast still carries A and the control word.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.flat import STATS
from mpi_fnas.federation.party import Party
from mpi_fnas.federation.selection import Selector
from mpi_fnas.federation.server import Server
from mpi_fnas.federation.stage import CONTINUE


@dataclass
class StepStats:
    """Summed over parties: [loss_sum, correct, count, compute_seconds] of the W phase and the A phase."""

    train: np.ndarray
    val: np.ndarray


class ServerBuffers:
    """Receive buffers and the zero contributions of rank 0, allocated once."""

    def __init__(self, num_w: int, num_a: int) -> None:
        self.w_zero = np.zeros(num_w + STATS, dtype=np.float32)
        self.w_sum = np.zeros(num_w + STATS, dtype=np.float32)
        self.a_zero = np.zeros(num_a + STATS, dtype=np.float32)
        self.a_sum = np.zeros(num_a + STATS, dtype=np.float32)
        self.a_send = np.zeros(num_a + 1, dtype=np.float32)  # A, then the control word
        self.v_zero = np.zeros(num_w, dtype=np.float32)
        self.v_sum = np.zeros(num_w, dtype=np.float32)


@dataclass
class SelectedStepStats(StepStats):
    """StepStats (summed over every party) and this step's selection: chosen (K,) bool, score (K,) float64."""

    chosen: np.ndarray
    score: np.ndarray


class GatherBuffers:
    """Rank 0's buffers of the gathered releases, one row per party (K, n + STATS), allocated once."""

    def __init__(self, parties: int, num_w: int, num_a: int) -> None:
        self.w_zero = np.zeros(num_w + STATS, dtype=np.float32)
        self.w_parts = np.zeros((parties, num_w + STATS), dtype=np.float32)
        self.w_sum = np.zeros(num_w + STATS, dtype=np.float32)
        self.a_zero = np.zeros(num_a + STATS, dtype=np.float32)
        self.a_parts = np.zeros((parties, num_a + STATS), dtype=np.float32)
        self.a_sum = np.zeros(num_a + STATS, dtype=np.float32)
        self.a_send = np.zeros(num_a + 1, dtype=np.float32)  # A, then the control word


def sum_rows(parts: np.ndarray, chosen: np.ndarray, out: np.ndarray) -> None:
    """out = 0 + Σ of the `chosen` rows of `parts` (K, n), in rank order: the float32 sum a Reduce of exactly
    those parties computes (the server's zero contribution first), so ``all`` selected = the Reduce bit for bit."""
    out[:] = 0
    for row in np.flatnonzero(chosen):
        np.add(out, parts[row], out=out)


def server_iteration_selecting(server: Server, channel: Channel, buf: GatherBuffers, selector: Selector,
                               x_aux, y_aux, control: int = CONTINUE, train_a: bool = True) -> SelectedStepStats:
    """Rank 0's half of one first-order iteration with a selection: only the chosen parties update W and A.

    `x_aux`, `y_aux`: the server's aux set (used only when ``selector.scores_needed``). `server.parties` must be
    K′ (the mean divides by the number of summed releases).
    """
    channel.gather(buf.w_zero, buf.w_parts)  # every G_k
    chosen, score = selector.choose(
        lambda: np.array([server.probe_accuracy(g[:-STATS], x_aux, y_aux) for g in buf.w_parts]))
    sum_rows(buf.w_parts, chosen, buf.w_sum)
    server.step_w(buf.w_sum[:-STATS])
    channel.bcast(server.w_buffer)  # W'
    buf.a_parts[:] = 0
    if train_a:
        channel.gather(buf.a_zero, buf.a_parts)  # every H_k
        sum_rows(buf.a_parts, chosen, buf.a_sum)
        server.step_a(buf.a_sum[:-STATS])
    buf.a_send[:-1] = server.a_buffer
    buf.a_send[-1] = control
    channel.bcast(buf.a_send)  # A and the control word
    return SelectedStepStats(train=buf.w_parts[:, -STATS:].sum(axis=0), val=buf.a_parts[:, -STATS:].sum(axis=0),
                             chosen=chosen, score=score)


def server_iteration(server: Server, channel: Channel, buf: ServerBuffers, second_order: bool,
                     control: int = CONTINUE, train_a: bool = True) -> StepStats:
    """Rank 0's half of one iteration; `control` tells the parties what happens after it; without `train_a` (the
    warm-up) only the W half."""
    if server.adadp is None:
        train = _w_round(server.step_w, channel, buf, server)  # Σ_k G_k → W'
    else:
        train = _w_round(server.adadp_half_step, channel, buf, server)  # Σ_k G1_k → W_half
        train += _w_round(server.adadp_full_step, channel, buf, server)  # Σ_k G2_k → W'
    buf.a_sum[:] = 0
    if train_a:
        if second_order:
            channel.reduce_sum(buf.v_zero, buf.v_sum)  # Σ_k v_k
            v = np.ascontiguousarray(server.aggregate(buf.v_sum), dtype=np.float32)
            channel.bcast(v)
        channel.reduce_sum(buf.a_zero, buf.a_sum)  # Σ_k H_k
        server.step_a(buf.a_sum[:-STATS])
    buf.a_send[:-1] = server.a_buffer
    buf.a_send[-1] = control
    channel.bcast(buf.a_send)  # A and the control word
    return StepStats(train=train, val=buf.a_sum[-STATS:].copy())


def _w_round(step: Callable[[np.ndarray], None], channel: Channel, buf: ServerBuffers, server: Server) -> np.ndarray:
    """One W round on rank 0: Reduce the parties' W releases, `step` W with their sum, broadcast W; its STATS."""
    channel.reduce_sum(buf.w_zero, buf.w_sum)
    step(buf.w_sum[:-STATS])
    channel.bcast(server.w_buffer)
    return buf.w_sum[-STATS:].copy()


def party_iteration(party: Party, channel: Channel, w_in: np.ndarray, a_in: np.ndarray, v_in: np.ndarray,
                    second_order: bool, xi: float, w_rounds: int = 1, gathered: bool = False,
                    train_a: bool = True) -> int:
    """Party k's half of one iteration; returns the server's control word.

    `w_in`, `a_in` (A + control word), `v_in` are preallocated receive buffers. `xi` is the server's W learning
    rate of this step (the parties follow the same public schedule). `w_rounds`: 2 under ADADP (G1 at W, then
    G2 at the broadcast W_half on a fresh batch), else 1. `gathered`: the server gathers the releases (a
    selection; never with ADADP) instead of reducing them; the party sends the same buffers either way.
    `train_a`: false during the warm-up, where the party computes and sends no H_k.
    """
    send = channel.gather if gathered else channel.reduce_sum
    for _ in range(w_rounds):
        send(party.w_release())  # G_k (ADADP: G1_k, then G2_k)
        channel.bcast(w_in)
        party.load_w(w_in)  # W'_k ← W (ADADP: W_half first)
    if train_a:
        if second_order:
            channel.reduce_sum(party.val_gradients())  # v_k
            channel.bcast(v_in)
            h = party.a_release_second_order(v_in, xi)
        else:
            h = party.a_release()
        send(h)  # H_k
    channel.bcast(a_in)
    party.load_a(a_in[:-1])  # A_k ← A
    return int(a_in[-1])
