"""The protocol both stages (search, augmentation) follow around their iterations, on each side of the wire.

1. Setup: rank 0 scatters each party its assignment, or the setup error to all (so no party waits for a decision
   that never comes); every rank picks its device; each party reports its device and how many iterations it has
   ever sent in this stage (data-independent; non-zero only after a crash, when the server charges the replays).
2. Under DP, rank 0 announces how many iterations the stage will run (:func:`announce_last_step`); each party
   checks that number against its own ledger and cap (:mod:`mpi_fnas.privacy.party_ledger`).
3. Under secure aggregation, the key round: rank 0 relays every party's fresh X25519 public key
   (:func:`relay_public_keys`, :func:`agree_masks`), and the parties confirm among themselves that all were shown
   the same set of the job's K keys, signed with ``privacy.party_identities`` (:func:`confirm_key_set`).
4. Before the first release the parties confirm, party to party, that rank 0 sent each of them the same config and
   stage plan (:func:`agree_on_plan`), so that none waits at another exchange than the others until the timeout.

Then the party's steps (:mod:`mpi_fnas.stages.party_loop`). Why each round: docs/privacy.md §2.10 and §8.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from mpi_fnas.config import ServerReportedError
from mpi_fnas.cpu_kernels import aten_cpu_capability, cpu_model, onednn_isa
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.placement import device_for_rank
from mpi_fnas.privacy.trusted_config import AssignmentRefusedError
from mpi_fnas.secagg.identities import PartyIdentity
from mpi_fnas.secagg.keyset import check_confirmations, confirmation
from mpi_fnas.secagg.masks import PUBLIC_KEY_BYTES, PairwiseMasks, launch_id
from mpi_fnas.wire import encode

AssignmentT = TypeVar("AssignmentT")


@dataclass(frozen=True)
class SetupReports:
    """What rank 0 learns at setup: every rank's device, CPU model and CPU kernels (rank 0 first;
    :mod:`mpi_fnas.cpu_kernels`), each party's count of sent iterations, and the exchange pattern every rank agreed
    on, with why."""

    devices: list[str]
    sent_steps: list[int]
    onednn_isa: list[str]
    aten_cpu_capability: list[str]
    cpu_model: list[str]
    refusals: dict[int, str] = field(default_factory=dict)  # rank -> its one line: it refused its assignment
    exchange: str = "star"
    exchange_reason: str = ""

    @property
    def gpus(self) -> int:
        """Distinct CUDA devices in the job (the cost's GPU count)."""
        return len({d for d in self.devices if d.startswith("cuda")})

    @property
    def rank_attrs(self) -> dict[str, list[str]]:
        """The run log's ``/ranks`` attributes."""
        return {"devices": self.devices, **{fact: getattr(self, fact) for fact in MACHINE_FACTS},
                "exchange": self.exchange, "exchange_reason": self.exchange_reason}


#: The machine's facts each rank reports at setup, as SetupReports fields and /ranks attrs: data-independent.
MACHINE_FACTS = {"onednn_isa": onednn_isa, "aten_cpu_capability": aten_cpu_capability, "cpu_model": cpu_model}


# -- rank 0 ----------------------------------------------------------------------------------------------------------
def refuse_setup(channel: Channel, message: str) -> None:
    """Tell every party that setup failed (each then raises :class:`ServerReportedError` with `message`)."""
    channel.scatter_objects([None] + [("error", message)] * channel.parties)


def hand_out(channel: Channel, assignments: Sequence[object]) -> SetupReports:
    """Scatter party k its assignment ``assignments[k - 1]``, agree on devices, and gather the parties' reports."""
    channel.scatter_objects([None, *assignments])
    device_for_rank(channel.comm, preference="cpu")  # collective: the parties pick theirs at the same time
    reports = channel.gather_objects(None)[1:]
    return SetupReports(devices=["cpu"] + [str(r["device"]) for r in reports],
                        sent_steps=[int(r["sent_steps"]) for r in reports],
                        **{fact: [probe()] + [str(r[fact]) for r in reports] for fact, probe in MACHINE_FACTS.items()},
                        refusals={rank: str(r["refused"]) for rank, r in enumerate(reports, start=1)
                                  if r.get("refused") is not None},
                        exchange=channel.pattern, exchange_reason=channel.pattern_reason)


def relay_public_keys(channel: Channel) -> bytes:
    """Secure aggregation's key round on rank 0: gather every party's public key, relay them all to every party;
    returns the launch id (:func:`~mpi_fnas.secagg.masks.launch_id`) the parties derive from the same keys."""
    keys = {rank: key for rank, key in enumerate(channel.gather_objects(None)[1:], start=1)}
    for rank, key in keys.items():
        if not isinstance(key, bytes) or len(key) != PUBLIC_KEY_BYTES:
            raise ValueError(f"party {rank} sent a public key that is not {PUBLIC_KEY_BYTES} bytes")
    channel.bcast_object(keys)
    return launch_id(keys)


def announce_last_step(channel: Channel, last: int) -> None:
    """Under DP: tell every party the stage's last step (a JSON integer), which each checks against its own cap."""
    channel.bcast_object(int(last))


# -- a party ---------------------------------------------------------------------------------------------------------
def receive_last_step(channel: Channel, *, first: int, planned: int) -> int:
    """The last step rank 0 announced (:func:`announce_last_step`); AssignmentRefusedError unless it is an integer
    from `first` − 1 (no iteration) to `planned`, the assignment's."""
    last = channel.bcast_object(None)
    if not isinstance(last, int) or isinstance(last, bool) or not first - 1 <= last <= planned:
        raise AssignmentRefusedError(f"rank {channel.rank} refuses the last step {last!r} rank 0 announced: not a "
                                     f"step from {first - 1} to the assignment's {planned}; nothing was sent")
    return last


def receive_assignment(channel: Channel, kind: type[AssignmentT], device_preference: str,
                       ) -> tuple[AssignmentT, torch.device]:
    """This party's assignment (of type `kind`) and its device. Raises ServerReportedError if rank 0 refused."""
    got = channel.scatter_objects(None)
    if isinstance(got, tuple) and got and got[0] == "error":
        raise ServerReportedError(got[1])
    if not isinstance(got, kind):
        raise TypeError(f"expected a {kind.__name__} from rank 0, got {type(got).__name__}")
    return got, torch.device(device_for_rank(channel.comm, preference=device_preference))


def report_setup(channel: Channel, device: torch.device, sent_steps: int, refused: str | None = None) -> None:
    """The party's only setup message: its device, CPU model and CPU kernels (the machine's, not the data's) and its
    count of sent iterations (0 unless DP); with `refused`, its one public line refusing its assignment
    (:mod:`mpi_fnas.federation.verify`): rank 0 learns every refusal at once, opens its log and marks it failed."""
    report: dict[str, object] = {"device": str(device), "sent_steps": sent_steps,
                                 **{fact: probe() for fact, probe in MACHINE_FACTS.items()}}
    if refused is not None:
        report["refused"] = refused
    channel.gather_objects(report)


def agree_masks(channel: Channel, identity: PartyIdentity | None = None) -> PairwiseMasks:
    """Secure aggregation's key round on a party: a fresh X25519 key pair (its private key never leaves the
    object), the public key to rank 0, every party's public key back, the set checked and confirmed among the
    parties (:func:`confirm_key_set`; with `identity`, signed), the pairwise secrets derived.

    Raises :class:`~mpi_fnas.secagg.keyset.KeySetError` (one line) before this party masks anything if the set
    is not this job's K parties, if another party was shown another set, or if a key is not its party's.
    """
    masks = PairwiseMasks(channel.rank)
    channel.gather_objects(masks.public_key)
    relayed = channel.bcast_object(None)
    masks.agree(relayed, parties=channel.parties)  # K from this party's own communicator, not from rank 0
    confirm_key_set(channel, relayed, identity)
    return masks


def confirm_key_set(channel: Channel, public_keys: dict[int, bytes], identity: PartyIdentity | None) -> None:
    """The parties' hash round: each sends every other party, directly, the digest of the set it was shown (with
    `identity`, its signature of its own key and that digest) and checks what the others sent.

    Why among the parties: a confirmation relayed by rank 0 would be rank 0's word, and rank 0 is the party that
    could show different sets. :meth:`~mpi_fnas.federation.comm.Channel.exchange_among_parties` sends point to
    point (MPI names each message's sender), so every party sees every other party's digest as sent, and
    every party finds a difference, each raising its own one-line error: no party waits for one that refused.
    What it cannot see without identities, and what signatures add: :mod:`mpi_fnas.secagg.keyset`.
    """
    received = channel.exchange_among_parties(confirmation(public_keys, channel.rank, identity))
    check_confirmations(public_keys, channel.rank, received, identity)


def exchange_shard_sizes(channel: Channel, own: tuple[int, int] | None, val_fraction: float
                         ) -> list[tuple[int, int]]:
    """Party, under ``data.partition: local``: send every other party, directly, this party's shard sizes `own`
    (N_train, N_val: public counts, which rank 0 plans with too) and return every party's, party 1 first. The steps
    per epoch follow from them, so a party derives its step count from what the parties say, not from rank 0.
    `own` None: this party refuses its setup, and says so to the others (they refuse too, rather than wait for
    it). AssignmentRefusedError for a message that is not two counts, or not a split of ``val_fraction`` of some
    folder (:func:`~mpi_fnas.data.split_train_val`; a colluding party can still overstate its folder)."""
    received = channel.exchange_among_parties(struct.pack(">QQ", *(own if own is not None else (0, 0))))
    if own is None:
        return []
    sizes = {channel.rank: own}
    for rank, message in received.items():
        counts = struct.unpack(">QQ", message) if len(message) == 16 else None
        if counts == (0, 0):
            raise AssignmentRefusedError(f"rank {channel.rank} refuses its setup: party {rank} refused its own")
        total = sum(counts) if counts is not None else 0
        if counts is None or total < 2 or counts[1] != round(total * val_fraction):
            raise AssignmentRefusedError(f"rank {channel.rank} refuses party {rank}'s shard sizes {counts}: not the "
                                         f"split of data.val_fraction {val_fraction} of a folder")
        sizes[rank] = counts
    return [tuple(int(n) for n in sizes[rank]) for rank in sorted(sizes)]


def plan_digest(stage: str, config_text: str, plan: dict[str, Any], last: int, pattern: str) -> bytes:
    """SHA-256 of what every party of a stage must have been sent alike: the config text it runs, the stage's plan
    (:func:`~mpi_fnas.federation.job_plan.shared_plan`), the last step announced and the exchange pattern rank 0 chose
    (:func:`mpi_fnas.cli.agree_on_exchange`). Public values, so a plain hash."""
    digest = hashlib.sha256(b"mpi_fnas stage plan\0" + stage.encode() + b"\0")
    for part in (config_text.encode(), encode(plan), str(int(last)).encode(), pattern.encode()):
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.digest()


def agree_on_plan(channel: Channel, stage: str, config_text: str, plan: dict[str, Any], last: int) -> None:
    """Party: send every other party, directly, this party's :func:`plan_digest` of the `stage`'s `config_text`,
    `plan`, `last` step and exchange pattern (``channel.pattern``), and compare theirs. Raises
    :class:`AssignmentRefusedError` (one line, on every party that sees a difference) before anything of the stage
    is sent when rank 0 sent some party another config, plan or pattern (a party in a tree that the others are not
    in would wait for them until the timeout)."""
    digest = plan_digest(stage, config_text, plan, last, channel.pattern)
    received = channel.exchange_among_parties(digest)
    differing = sorted(rank for rank, theirs in received.items() if theirs != digest)
    if differing:
        raise AssignmentRefusedError(
            f"rank {channel.rank} refuses the {stage} plan: rank 0 sent rank(s) {', '.join(map(str, differing))} "
            "another config, stage plan or exchange pattern than it sent this party; nothing was sent")
