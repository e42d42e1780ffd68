"""One iteration of (DP-)FNAS — Algorithm 1 of Singh, Zhou et al. (2020), both roles side by side, for any stage.

    party k:  G_k = release of ∇_W L(D_k^tr batch)            ──Reduce(sum)──▶  server: W ← step(Σ G_k)
    party k:  W'_k ← W                                         ◀──Bcast W─────
    party k:  H_k = release of ∇_A L(D_k^val batch; A, W')     ──Reduce(sum)──▶  server: A ← step(Σ H_k)
    party k:  A_k ← A                                          ◀──Bcast A─────

The augmentation has no A (its iteration is the W half alone); in the search's warm-up no party sends H_k. ADADP
takes two W rounds (:mod:`mpi_fnas.federation.adadp`); ``second_order`` adds a round for the aggregate validation
gradient v before H_k (Eq. 5). Under DP a release is clipped and noised inside the party
(:mod:`mpi_fnas.privacy.release`); under secure aggregation it is uint32 words whose sum rank 0 opens
(:mod:`mpi_fnas.secagg`). With ``federation.selection`` random, secprobe or oracle the Reduces become Gathers and
the server sums only the K′ parties it chose (:class:`~.selection.Selector`). Every broadcast ends with the
server's control word (CONTINUE, CHECKPOINT or STOP). Each variant, and why: docs/exchange.md, "One iteration".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.flat import STATS
from mpi_fnas.federation.selection import Selector

if TYPE_CHECKING:  # each side's state: autograd, which this MPI module never calls itself
    from mpi_fnas.federation.global_model import Server
    from mpi_fnas.federation.local_model import Party
    from mpi_fnas.secagg.series import SecureSeries


#: The control word of a step's last broadcast (every other broadcast carries CONTINUE).
CONTINUE, CHECKPOINT, STOP = 0, 1, 2


@dataclass
class StepStats:
    """Summed over parties: [loss_sum, correct, count, compute_seconds] of the W rounds and of the A round (zeros
    without A); with a selection also chosen (K,) bool and score (K,) float64, else None."""

    train: np.ndarray
    val: np.ndarray
    chosen: np.ndarray | None = None
    score: np.ndarray | None = None


class Exchange:
    """Rank 0's buffers of one vector (n,), allocated once: its zero contribution and receive buffer (n + STATS), the
    rows of a gather (K, n + STATS) when the server selects, and its broadcast (the vector, then the control word).
    Under secure aggregation (`series`: the release's labels on rank 0; `expected_batch_size`: its B) the sum
    arrives as uint32 words (D,) and is opened into ``total`` (STATS zero)."""

    def __init__(self, n: int, gathered_parties: int | None, series: SecureSeries | None = None,
                 expected_batch_size: float = 1.0) -> None:
        self.zero = np.zeros(n + STATS, dtype=np.float32)
        self.total = np.zeros(n + STATS, dtype=np.float32)
        self.parts = np.zeros((gathered_parties, n + STATS), dtype=np.float32) if gathered_parties else None
        self.send = np.zeros(n + 1, dtype=np.float32)
        self.series, self.expected_batch_size = series, expected_batch_size
        padded = series.encoding.padded if series is not None else 0
        self.words_zero = np.zeros(padded, dtype=np.uint32)
        self.words_total = np.zeros(padded, dtype=np.uint32)


class ServerBuffers:
    """Rank 0's buffers of a stage: W's exchange, A's (None without A) and v's (second order)."""

    def __init__(self, num_w: int, num_a: int | None, *, gathered_parties: int | None = None,
                 second_order: bool = False, secure: dict[str, tuple[SecureSeries, float]] | None = None) -> None:
        secure = secure or {}
        self.w = Exchange(num_w, gathered_parties, *secure.get("W", ()))
        self.a = Exchange(num_a, gathered_parties, *secure.get("A", ())) if num_a is not None else None
        self.v_zero = np.zeros(num_w, dtype=np.float32) if second_order else None
        self.v_sum = np.zeros(num_w, dtype=np.float32) if second_order else None


def sum_rows(parts: np.ndarray, chosen: np.ndarray, out: np.ndarray) -> None:
    """out = 0 + Σ of the `chosen` rows of `parts` (K, n), in rank order: the float32 sum a Reduce of exactly
    those parties computes (the server's zero contribution first), so ``all`` selected = the Reduce bit for bit."""
    out[:] = 0
    for row in np.flatnonzero(chosen):
        np.add(out, parts[row], out=out)


class _Selection:
    """The server's choice of K′ parties in one iteration, made at the first gathered W round."""

    def __init__(self, selector: Selector | None, server: Server, aux: tuple) -> None:
        self.selector, self.server, self.aux = selector, server, aux
        self.chosen: np.ndarray | None = None
        self.score: np.ndarray | None = None

    def receive(self, channel: Channel, ex: Exchange, *, first: bool) -> np.ndarray:
        """Σ of this round's releases (the chosen parties' with a selection) into ``ex.total``; their STATS (all
        parties') returned."""
        if ex.series is not None:  # sealed words: the masks cancel in the sum, which rank 0 opens
            channel.reduce_sum(ex.words_zero, ex.words_total)
            ex.total[:-STATS] = ex.series.open(ex.words_total, ex.expected_batch_size)
            ex.total[-STATS:] = 0.0
            return ex.total[-STATS:].copy()
        if self.selector is None:
            channel.reduce_sum(ex.zero, ex.total)
            return ex.total[-STATS:].copy()
        channel.gather(ex.zero, ex.parts)
        if first:
            x_aux, y_aux = self.aux
            self.chosen, self.score = self.selector.choose(
                lambda: np.array([self.server.probe_accuracy(g[:-STATS], x_aux, y_aux) for g in ex.parts]))
        sum_rows(ex.parts, self.chosen, ex.total)
        return ex.parts[:, -STATS:].sum(axis=0)


def _broadcast(channel: Channel, ex: Exchange, vector: np.ndarray, control: int) -> None:
    ex.send[:-1] = vector
    ex.send[-1] = control
    channel.bcast(ex.send)


def server_iteration(server: Server, channel: Channel, buf: ServerBuffers, control: int = CONTINUE, *,
                     train_a: bool = True, selector: Selector | None = None, aux: tuple = (None, None)) -> StepStats:
    """Rank 0's half of one iteration; `control` rides on its last broadcast. `selector` (with `buf` built for
    gathering): sum only the K′ parties it chooses (`aux`: the server's aux set, used when it scores)."""
    selection = _Selection(selector, server, aux)
    updates = server.w_updates()
    train = np.zeros(STATS, dtype=np.float32)
    for i, update in enumerate(updates):
        stats = selection.receive(channel, buf.w, first=i == 0)  # Σ_k G_k (ADADP: G1_k, then G2_k)
        train = stats if i == 0 else train + stats
        update(buf.w.total[:-STATS])
        last = buf.a is None and i == len(updates) - 1
        _broadcast(channel, buf.w, server.w_buffer, control if last else CONTINUE)  # W' (ADADP: W_half first)
    val = np.zeros(STATS, dtype=np.float32)
    if buf.a is not None:
        if train_a:
            if buf.v_sum is not None:
                channel.reduce_sum(buf.v_zero, buf.v_sum)  # Σ_k v_k
                channel.bcast(np.ascontiguousarray(server.aggregate(buf.v_sum), dtype=np.float32))
            val = selection.receive(channel, buf.a, first=False)  # Σ_k H_k
            server.step_a(buf.a.total[:-STATS])
        _broadcast(channel, buf.a, server.a_buffer, control)
    return StepStats(train=train, val=val, chosen=selection.chosen, score=selection.score)


class PartyBuffers:
    """A party's receive buffers, allocated once: W and A, each with the control word after it, and v."""

    def __init__(self, num_w: int, num_a: int | None) -> None:
        self.w = np.zeros(num_w + 1, dtype=np.float32)
        self.a = np.zeros(num_a + 1, dtype=np.float32) if num_a is not None else None
        self.v = np.zeros(num_w, dtype=np.float32)


def party_iteration(party: Party, channel: Channel, buf: PartyBuffers, *, w_rounds: int = 1, gathered: bool = False,
                    train_a: bool = True, second_order: bool = False, xi: float = 0.0) -> int:
    """Party k's half of one iteration; returns the control word of the server's last broadcast.

    `w_rounds`: 2 under ADADP, else 1; `gathered`: the server gathers the releases (a selection); `train_a`: false
    in the warm-up; `xi`: the server's W learning rate of this step (the public schedule's), for Eq. 5.
    """
    send = channel.gather if gathered else channel.reduce_sum
    for _ in range(w_rounds):
        send(party.w_release())  # G_k (ADADP: G1_k, then G2_k)
        channel.bcast(buf.w)
        party.load_w(buf.w[:-1])  # W'_k ← W (ADADP: W_half first)
    if buf.a is None:
        return int(buf.w[-1])
    if train_a:
        if second_order:
            channel.reduce_sum(party.val_gradients())  # v_k
            channel.bcast(buf.v)
            send(party.a_release_second_order(buf.v, xi))  # H_k
        else:
            send(party.a_release())  # H_k
    channel.bcast(buf.a)
    party.load_a(buf.a[:-1])  # A_k ← A
    return int(buf.a[-1])
