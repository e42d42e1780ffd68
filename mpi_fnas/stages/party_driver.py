"""A party's side of a stage (ranks 1..K): its own data, its own randomness, its own state on its own disk.

One loop runs every stage (:func:`participate`, then :func:`~mpi_fnas.stages.party_loop.party_steps`); a stage
says what the party trains and what each step asks of it (:class:`~mpi_fnas.stages.base.StageSide`). What a party
hands to MPI, and nothing else (tests/mpi/test_release_spy.py checks every call):

* at setup: its device name, its CPU kernels (the machine's: :mod:`mpi_fnas.cpu_kernels`), the iterations it ever
  sent (``sent_steps``); to the parties, the digest of its plan (:func:`~mpi_fnas.federation.handshake.plan_digest`);
* per iteration: the releases of Algorithm 1 (under DP: clipped and noised, with a zero STATS tail);
* at a checkpoint: an empty acknowledgement once it has saved its own state;
* on failure: a reason (under DP a generic one; the details stay in its own ``error.log``).

Its stream keys never leave its memory: a resumed party keys new streams and restores only its batch positions, from
its own directory (:class:`~mpi_fnas.federation.party_disk.PartyStore`). An unreliable party holds its corrupted
shards here too (:func:`~mpi_fnas.stages.base.own_examples`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch

from mpi_fnas.config import Config
from mpi_fnas.federation.algorithm import PartyBuffers, party_iteration
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.handshake import (
    agree_masks,
    agree_on_plan,
    exchange_shard_sizes,
    receive_assignment,
    receive_last_step,
    report_setup,
)
from mpi_fnas.federation.inventory import report_inventory
from mpi_fnas.federation.job_plan import SetupError, open_split, party_view, shared_plan
from mpi_fnas.federation.party_disk import EarlierRun, PartyStore, party_dir
from mpi_fnas.federation.verify import check_checkpoint_step, check_corruption
from mpi_fnas.privacy.trusted_config import AssignmentRefusedError, pin_directory, write_pin
from mpi_fnas.refusal import ReportedRefusalError, refusal_line, refusal_text
from mpi_fnas.secagg.identities import IdentityError, load_party_identity
from mpi_fnas.stages.base import StageSide
from mpi_fnas.stages.iteration import Injections
from mpi_fnas.stages.party_loop import party_steps


def participate(cfg: Config, channel: Channel, run_dir: Path | None, side: StageSide,
                earlier: Sequence[EarlierRun] = (), refusal: Exception | None = None) -> bool:
    """Run party `channel.rank`'s side of a whole stage; True when it stopped as interrupted. `earlier`: this
    party's own directories of earlier runs on the same data (:func:`~mpi_fnas.stages.job.run_job`); `refusal`:
    what it refused at the launch (rank 0's config or run directory, its exchange), reported in this setup report
    instead of anything being built or sent."""
    rank = channel.rank
    report_inventory(cfg, channel)  # data.partition local: its folder's public facts, before the plan
    got, device = receive_assignment(channel, side.assignment, cfg.runtime.device)
    # The parties tell each other their shard sizes (data.partition local, where they set the steps per epoch).
    tells = side.private(cfg) and cfg.data.partition == "local" and side.needs_sizes(cfg)
    if refusal is not None:
        if tells:  # the others would wait for its sizes: it says it refuses, so they refuse at once too
            exchange_shard_sizes(channel, None, cfg.data.val_fraction)
        refuse_in_report(channel, device, refusal)
    store = PartyStore(party_dir(run_dir, rank), stage=side.name) if run_dir is not None else None
    Injections(rank, side.name).at(0)  # the failure tests' late setup report (step 0: the setup)
    try:
        # Its assignment against what it computes itself (mpi_fnas.federation.verify): its DP parameters (K from
        # its own communicator, D from its own split), its shards, its corruption, and a checkpoint step it holds.
        data = open_split(cfg, "train", party=rank)
        own = party_view(cfg, data, channel.parties, rank, told=(
            lambda sizes: exchange_shard_sizes(channel, sizes, cfg.data.val_fraction)) if tells else None)
        side.check(cfg, got, own, parties=channel.parties, rank=rank)
        check_corruption(got.corruption, own.corruption, rank=rank, what=f"{side.name} assignment")
        sent = store.sent_by_stage() if store is not None else {}
        later = [stage for stage in side.later_stages if sent.get(stage, 0) > 0]
        check_checkpoint_step(got.checkpoint_step, store.held_steps() if store is not None else [], rank=rank,
                              what=f"{side.name} assignment", stage_over=f"its {later[0]} has begun" if later else None)
        # Its identity now, not at the key round: a key the roster does not name is a refusal like any other, in
        # this setup report (a notice sent later could reach rank 0 before another party's report, and the job
        # would end before its log exists).
        identity = None
        if side.secure(cfg) and cfg.privacy.party_identities:
            if run_dir is None:
                raise SetupError("privacy.party_identities needs the run directory (the party's identity.key is there)")
            identity = load_party_identity(Path(cfg.privacy.party_identities), party_dir(run_dir, rank), rank,
                                           channel.parties)
    except (AssignmentRefusedError, IdentityError) as refused:
        refuse_in_report(channel, device, refused, store.sent_steps if store and side.private(cfg) else 0)
    if run_dir is not None:
        # The config this party runs, pinned only now that rank 0 has accepted the setup as well (a launch refused as
        # bad input leaves nothing behind): what it trusts on a --resume or --augment without a --config of its own
        # (mpi_fnas.run checked it against its own first; docs/privacy.md §2.10).
        write_pin(pin_directory(run_dir, rank), cfg.to_yaml())
    party = side.build(cfg, got, data, rank, device)
    if got.checkpoint_step > 0:
        if store is None:
            raise SetupError("--resume needs the run directory")
        # Its own batch positions; its secret streams stay the new ones this launch keyed (Party.state_dict).
        party.load_state_dict(store.load_party(got.checkpoint_step, party.randomness.source))
    report_setup(channel, device, store.sent_steps if store and party.private else 0)
    last = got.steps
    if party.private:
        last = receive_last_step(channel, first=got.checkpoint_step + 1, planned=got.steps)
    agree_on_plan(channel, side.name, cfg.to_yaml(), shared_plan(got), last)
    if party.private:
        runs = store.earlier_runs(earlier) if store is not None else list(earlier)
        side.keep_own_ledger(cfg, got, store, rank, requested=last - got.checkpoint_step,
                             earlier=[(PartyStore(run.directory), run.same_split) for run in runs
                                      if run.directory.is_dir()])
    if party.secure:
        party.use_secure_aggregation(agree_masks(channel, identity), side.name,
                                     cfg.seed if side.params(got).reproducible_noise else None)

    buf = PartyBuffers(party.num_w, party.num_a)
    channel.bcast(buf.w[:-1])  # the initial W (and A)
    party.load_w(buf.w[:-1])
    if buf.a is not None:
        channel.bcast(buf.a[:-1])
        party.load_a(buf.a[:-1])

    def iterate(step: int) -> int:
        return party_iteration(party, channel, buf, gathered=got.gathered, **side.step(party, step))

    stopped = party_steps(channel, stage=side.name, first=got.checkpoint_step + 1, last=last, store=store,
                          party=party, iterate=iterate)
    if not stopped:
        side.finish(party, channel)
    return stopped


def refuse_in_report(channel: Channel, device: torch.device, refusal: Exception, sent_steps: int = 0) -> NoReturn:
    """Refuse in this party's setup report: its line on its own stderr first, then in the report. Rank 0 gathers
    every party's report (so every refusing party has printed before the job ends), opens its log, marks it failed
    and aborts the job; this party waits for that (:class:`~mpi_fnas.refusal.ReportedRefusalError`)."""
    print(refusal_line(channel.rank, refusal), file=sys.stderr, flush=True)
    report_setup(channel, device, sent_steps, refused=refusal_text(refusal))
    raise ReportedRefusalError(refusal_text(refusal)) from refusal
