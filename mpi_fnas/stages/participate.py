"""A party's side of a stage (ranks 1..K): its own data, its own randomness, its own state on its own disk.

One loop runs every stage (:func:`participate`, then :func:`~mpi_fnas.stages.party_loop.party_steps`); a stage
says what the party trains and what each step asks of it (:class:`~mpi_fnas.stages.base.StageSide`). What a party
hands to MPI, and nothing else (tests/mpi/test_release_spy.py checks every call):

* at setup: its device name, its CPU kernels (:mod:`mpi_fnas.cpu_kernels`: the machine's, not the data's) and how
  many iterations of the stage it has ever sent (``sent_steps``, data-independent); to the other parties, the
  digest of the config and stage plan rank 0 sent it (public: :func:`~mpi_fnas.federation.handshake.plan_digest`);
* per iteration: the releases of Algorithm 1 (under DP: clipped and noised, with a zero STATS tail);
* at a checkpoint: an empty acknowledgement once it has saved its own state;
* on failure: a reason (under DP a generic one; the details stay in its own ``error.log``).

Its stream keys never leave its memory: a resumed party keys new streams (a replayed step draws fresh randomness)
and restores only its batch positions, from its own directory
(:class:`~mpi_fnas.federation.party_store.PartyStore`). An unreliable
party holds its corrupted shards here too (:func:`~mpi_fnas.stages.base.own_examples`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mpi_fnas.config import Config
from mpi_fnas.data import Dataset
from mpi_fnas.federation.algorithm import PartyBuffers, party_iteration
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.handshake import (
    agree_masks,
    agree_on_plan,
    plan_digest,
    receive_assignment,
    receive_last_step,
    report_setup,
)
from mpi_fnas.federation.inventory import report_inventory
from mpi_fnas.federation.party_store import PartyStore, party_dir
from mpi_fnas.federation.plan import SetupError, open_split, own_shards, party_corruption, secure_dimension, shared_plan
from mpi_fnas.federation.verify import check_checkpoint_step, check_corruption
from mpi_fnas.privacy.trusted_config import AssignmentRefusedError, pin_directory, write_pin
from mpi_fnas.refusal import ReportedRefusalError, refusal_line, refusal_text
from mpi_fnas.secagg.identities import IdentityError, PartyIdentity, load_party_identity
from mpi_fnas.stages.base import StageSide
from mpi_fnas.stages.iteration import Injections
from mpi_fnas.stages.party_loop import party_steps


def participate(cfg: Config, channel: Channel, run_dir: Path | None, side: StageSide) -> bool:
    """Run party `channel.rank`'s side of a whole stage; True when it stopped as interrupted."""
    report_inventory(cfg, channel)  # data.partition local: its folder's public facts, before the plan
    got, device = receive_assignment(channel, side.assignment, cfg.runtime.device)
    store = PartyStore(party_dir(run_dir, channel.rank), stage=side.name) if run_dir is not None else None
    Injections(channel.rank, side.name).at(0)  # the failure tests' late setup report (step 0: the setup)
    try:
        data = check_assignment(cfg, side, got, channel, store)
        # Its identity now, not at the key round: a key the roster does not name is a refusal like any other, in
        # this setup report (a notice sent later could reach rank 0 before another party's report, and the job
        # would end before its log exists).
        identity = own_identity(cfg, run_dir, channel) if side.secure(cfg) else None
    except (AssignmentRefusedError, IdentityError) as refusal:
        # Its line on its own stderr first, then in its setup report: rank 0 gathers every party's report (so every
        # refusing party has printed before the job ends), opens its log, marks it failed and aborts the job.
        print(refusal_line(channel.rank, refusal), file=sys.stderr, flush=True)
        report_setup(channel, device, store.sent_steps if store and side.private(cfg) else 0,
                     refused=refusal_text(refusal))
        raise ReportedRefusalError(refusal_text(refusal)) from refusal
    if run_dir is not None:
        # The config this party runs, pinned only now that rank 0 has accepted the setup as well (a launch refused as
        # bad input leaves nothing behind): what it trusts on a --resume or --augment without a --config of its own
        # (mpi_fnas.run checked it against its own first; docs/privacy.md §2.10).
        write_pin(pin_directory(run_dir, channel.rank), cfg.to_yaml())
    party = side.build(cfg, got, data, channel.rank, device)
    if got.checkpoint_step > 0:
        if store is None:
            raise SetupError("--resume needs the run directory")
        # Its own batch positions; its secret streams stay the new ones this launch keyed (Party.state_dict).
        party.load_state_dict(store.load_party(got.checkpoint_step, party.randomness.source))
    report_setup(channel, device, store.sent_steps if store and party.private else 0)
    last = got.steps
    if party.private:
        last = receive_last_step(channel, first=got.checkpoint_step + 1, planned=got.steps)
    agree_on_plan(channel, plan_digest(side.name, cfg.to_yaml(), shared_plan(got), last), stage=side.name)
    if party.private:
        keep_own_ledger(cfg, side, got, store, channel.rank, last - got.checkpoint_step)
    if party.secure:
        party.use_secure_aggregation(agree_masks(channel, identity), side.name)

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


def check_assignment(cfg: Config, side: StageSide, got: Any, channel: Channel, store: PartyStore | None) -> Dataset:
    """This party's train split, once it accepts its assignment `got`; AssignmentRefusedError unless it does
    (:mod:`mpi_fnas.federation.verify`): its DP parameters against those it derives (K from its own communicator,
    D recomputed here), its shards against the split it computes itself, and a checkpoint step it must hold its
    own state for."""
    data = open_split(cfg, "train", party=channel.rank)
    side.check(cfg, got, parties=channel.parties, dimension=own_dimension(cfg, data), rank=channel.rank)
    side.check_shards(cfg, got, own_shards(cfg, data, channel.parties, channel.rank), examples=len(data),
                      rank=channel.rank)
    check_corruption(got.corruption, party_corruption(cfg, channel.parties, channel.rank), rank=channel.rank,
                     what=f"{side.name} assignment")
    step = got.checkpoint_step
    saved = store is not None and isinstance(step, int) and store.has_state(step)
    check_checkpoint_step(step, saved, rank=channel.rank, what=f"{side.name} assignment")
    return data


def keep_own_ledger(cfg: Config, side: StageSide, got: Any, store: PartyStore | None, rank: int,
                    requested: int) -> None:
    """This party's own budget (:mod:`mpi_fnas.privacy.party_ledger`), before it sends anything of this launch:
    BudgetRefusedError when the `requested` iterations rank 0 announced would take its ε, composed from its own
    record and journals, past its own cap; then this launch's releases recorded in its directory."""
    per_iteration, sizes = side.per_iteration(got)
    record = store.release_record() if store is not None else []
    params = side.params(got)
    secure = params.secure_sum
    cap = params.party_cap(cfg.privacy.party_max_epsilon)
    if cap is not None:
        from mpi_fnas.privacy import party_ledger  # rank 0's accountant: loaded only by a party with a cap

        sent = store.sent_by_stage() if store is not None else {}
        party_ledger.check_request(cap, record, sent, per_iteration,
                                   cfg.privacy.delta, sizes, secure.accounting if secure is not None else None,
                                   requested, rank=rank, stage=side.name)
    if store is not None:
        constants = [secure.parties, secure.local_variance, secure.dimension, secure.colluders] if secure else None
        store.begin_releases(list(per_iteration.train), list(per_iteration.val), sizes, constants)


def own_dimension(cfg: Config, data: Dataset) -> int | None:
    """D of secure aggregation as this party computes it (the planner's :func:`secure_dimension`, from the shape
    of its own train split `data`: < 1 s, docs/privacy.md §2.10), or None when its releases are not securely
    aggregated."""
    if cfg.mode != "dpfnas" or cfg.privacy.aggregation != "secure":
        return None
    return secure_dimension(cfg, data.in_channels, data.num_classes)


def own_identity(cfg: Config, run_dir: Path | None, channel: Channel) -> PartyIdentity | None:
    """This party's identity under ``privacy.party_identities`` (its private key from its own directory, the
    roster checked against this job's K), or None when the setting is off."""
    if not cfg.privacy.party_identities:
        return None
    if run_dir is None:
        raise SetupError("privacy.party_identities needs the run directory (the party's identity.key is there)")
    return load_party_identity(Path(cfg.privacy.party_identities), party_dir(run_dir, channel.rank), channel.rank,
                               channel.parties)
