"""A party's one step loop, for any stage: before anything of a step leaves a DP party, its send count grows on its
own disk; at a checkpoint step it saves its own state, then acknowledges with an empty message; at a stop it waits
for the server to finish its checkpoint and the log. The iteration itself (what is computed and sent) is the
stage's own. No autograd here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mpi_fnas.federation.algorithm import CONTINUE, STOP
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.party_disk import PartyStore
from mpi_fnas.stages.iteration import Injections

if TYPE_CHECKING:  # the party's computation (autograd): this module only exchanges and saves its state
    from mpi_fnas.federation.local_model import Party


def party_steps(channel: Channel, *, stage: str, first: int, last: int, store: PartyStore | None, party: Party,
                iterate: Callable[[int], int]) -> bool:
    """Run steps `first`..`last` of `stage` on this party; True when the server stopped the run (interrupted).

    `iterate(step)` runs one iteration and returns rank 0's control word. A DP party counts each step's sends in
    `store` before they leave it; at a checkpoint it saves its own state there, tagged with its randomness source.
    """
    injected = Injections(channel.rank, stage)
    for step in range(first, last + 1):
        injected.at(step)
        if party.private and store is not None:
            store.record_send()  # before anything of this step leaves the party
        control = iterate(step)
        if control != CONTINUE:
            if store is not None:
                store.save_party(step, party.randomness.source, party.state_dict())
            channel.gather_objects(None)  # acknowledge: this party's state of `step` is on its disk
            if control == STOP:
                channel.barrier()  # wait for the server to finish its checkpoint and the log
                return True
    return False
