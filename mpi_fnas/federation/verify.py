"""A party checks its assignment: the DP parameters it derives itself, against what rank 0 asks of it.

A server that lies could ask a party for less noise than the user configured (a smaller σ, a larger clip, B or K,
another σ_k² or D, reproducible randomness, a state the party never saved). So a party derives each one itself and
refuses an assignment that differs (:class:`~mpi_fnas.privacy.trusted_config.AssignmentRefusedError`, one line):
K from its own communicator; the clips, B, δ, the aggregation, the randomness source and the ε settings from its
checked config (:mod:`mpi_fnas.privacy.trusted_config`); σ_k² and the modulus from the code; D as the planner
computes it (:func:`~mpi_fnas.federation.job_plan.secure_dimension`); the network (:func:`check_network`); σ from the
config, or under ``privacy.target_epsilon`` one σ for W and A, positive and finite, taken on trust; its step count
(:func:`check_steps`); its shards (:func:`check_shards`: distinct, train and validation disjoint, and the very
split it computes itself). Each check, and why: docs/privacy.md §2.10.

No MPI and no autograd: the party's side (:mod:`mpi_fnas.stages.party_driver`) calls these and sends nothing
until they pass.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpi_fnas.config import Config
from mpi_fnas.federation.adadp import w_rounds
from mpi_fnas.privacy.params import DPParams
from mpi_fnas.privacy.release import AugmentReleases, SecureSum
from mpi_fnas.privacy.trusted_config import AssignmentRefusedError

_SIGMAS = ("noise_multiplier_w", "noise_multiplier_a")


def expected_params(cfg: Config, parties: int, dimension: int | None) -> DPParams | None:
    """The search's DP parameters as this party derives them (None unless ``mode: dpfnas``): `parties` is K from
    its own communicator, `dimension` the D it computed (used under ``secure`` only)."""
    if cfg.mode != "dpfnas":
        return None
    secure = cfg.privacy.aggregation == "secure"
    return DPParams.from_config(cfg.privacy, cfg.search.batch_size, parties, dimension if secure else None)


def calibrated(cfg: Config) -> bool:
    """Whether rank 0's planner calibrates σ (``privacy.target_epsilon``): the party cannot re-derive it cheaply."""
    return cfg.privacy.target_epsilon is not None


def _refuse(rank: int, what: str, reason: str) -> AssignmentRefusedError:
    return AssignmentRefusedError(f"rank {rank} refuses the {what} rank 0 sent: {reason}; nothing was computed or "
                                  "sent")


def _positive_sigma(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_params(expected: DPParams | None, got: Any, *, calibrated: bool, rank: int, what: str) -> None:
    """Raise :class:`AssignmentRefusedError` unless rank 0's `got` DP parameters are `expected` (σ aside when
    `calibrated`: then σ_W = σ_A, positive and finite). `what` names the assignment in the line."""
    if expected is None:
        return  # not private: the party's config says the server may see its gradients
    if type(got) is not DPParams:
        raise _refuse(rank, what, f"no DP parameters ({type(got).__name__}) where this party's config says mode "
                                  "dpfnas: its releases would carry no noise")
    for field in dataclasses.fields(DPParams):
        mine, theirs = getattr(expected, field.name), getattr(got, field.name)
        if field.name in _SIGMAS and calibrated:
            continue
        if mine != theirs:
            raise _refuse(rank, what, f"{field.name} {theirs!r} where this party derives {mine!r}")
    if calibrated:
        sigma_w, sigma_a = got.noise_multiplier_w, got.noise_multiplier_a
        if not (_positive_sigma(sigma_w) and sigma_w == sigma_a):
            raise _refuse(rank, what, f"calibrated σ_W {sigma_w!r} and σ_A {sigma_a!r}: privacy.target_epsilon "
                                      "calibrates one positive, finite σ for both")


def expected_secure_sum(cfg: Config, parties: int, dimension: int | None) -> SecureSum | None:
    """Secure aggregation's constants as this party derives them (σ_k² and the modulus: the code's), or None."""
    if cfg.mode != "dpfnas" or cfg.privacy.aggregation != "secure":
        return None
    assert dimension is not None
    return SecureSum(parties, dimension, colluders=cfg.privacy.colluders)


def check_augment(cfg: Config, releases: Any, params: Any, *, parties: int, dimension: int | None,
                  rank: int) -> None:
    """Raise :class:`AssignmentRefusedError` unless the augmentation's `releases` and `params` (an
    :class:`~mpi_fnas.federation.job_plan.AugmentAssignment`'s) are what this party's config makes them: private
    when ``augment.private`` under dpfnas, with its clip, B, releases per step (2 under ADADP), σ (unless
    calibrated: positive, finite) and secure aggregation's constants; `params` as the search's."""
    what = "augmentation assignment"
    if not (cfg.mode == "dpfnas" and cfg.augment.private):
        return  # exact gradients, as the party's own config says
    if type(releases) is not AugmentReleases:
        raise _refuse(rank, what, f"no DP releases ({type(releases).__name__}) where this party's config says "
                                  "augment.private: its gradients would leave it exact")
    check_params(expected_params(cfg, parties, dimension), params, calibrated=calibrated(cfg), rank=rank, what=what)
    expected = {"clip": float(cfg.augment.clip), "expected_batch_size": float(cfg.augment.batch_size),
                "releases_per_step": w_rounds(cfg.augment.optimizer),
                "secure": expected_secure_sum(cfg, parties, dimension)}
    if not calibrated(cfg):
        expected["noise_multiplier"] = float(cfg.augment.noise_multiplier)
    for name, mine in expected.items():
        theirs = getattr(releases, name)
        if mine != theirs:
            raise _refuse(rank, what, f"augment {name} {theirs!r} where this party derives {mine!r}")
    if not _positive_sigma(releases.noise_multiplier):
        raise _refuse(rank, what, f"augment noise_multiplier {releases.noise_multiplier!r}: not positive and finite")


def check_network(cfg: Config, network: Any, *, rank: int) -> None:
    """Raise :class:`AssignmentRefusedError` unless the augmentation assignment's `network` is this party's own
    ``augment.network``: the network decides the released dimension (and, under secure aggregation, the accounted
    D), so the party trains only the one its config names, whatever rank 0 says."""
    if network != cfg.augment.network:
        raise _refuse(rank, "augmentation assignment", f"augment network {network!r} where this party's config says "
                                                       f"{cfg.augment.network!r}")


def check_checkpoint_step(step: Any, held: Sequence[int], *, rank: int, what: str, stage_over: str | None = None
                          ) -> None:
    """Raise :class:`AssignmentRefusedError` unless `step` is a point this party may continue its stage from: a
    checkpoint step whose state it saved itself (`held`: the steps of the states in its directory), or 0 (the
    start) while it holds none. A restart from 0 where it holds states would release the stage's steps once more,
    which is how a rank 0 that feigned interruptions would spend an uncapped party's budget again and again; a party
    resumes only from its own state. `stage_over`: why the stage is over on this party (its next stage has begun),
    refused whatever the step."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise _refuse(rank, what, f"checkpoint_step {step!r} is not a step")
    if stage_over is not None:
        raise _refuse(rank, what, f"the stage is over on this party ({stage_over})")
    if step > 0 and step not in held:
        raise _refuse(rank, what, f"checkpoint_step {step}: this party saved no state of its own for that step")
    if step == 0 and held:
        raise _refuse(rank, what, f"checkpoint_step 0 where this party holds its own state of step {max(held)}: a "
                                  "restart would release the stage's steps once more (resume from the checkpoint, "
                                  "or start a new run directory)")


def check_shards(received: Sequence[tuple[str, Any]], expected: Sequence[np.ndarray], *, examples: int,
                 partition: str, rank: int, what: str) -> None:
    """Raise :class:`AssignmentRefusedError` unless every `(name, indices)` shard rank 0 sent is a 1-D integer array
    of distinct indices into this party's `examples`, no two shards share an index, and each equals the one this
    party computes itself (`expected`, in order: the public seeded split of ``data.partition`` `partition`), as a set
    of examples."""
    seen: list[tuple[str, np.ndarray]] = []
    for (name, indices), mine in zip(received, expected, strict=True):
        if not isinstance(indices, np.ndarray) or indices.ndim != 1 or indices.dtype.kind not in "iu":
            shape = getattr(indices, "shape", None)
            raise _refuse(rank, what, f"{name} are not a list of indices (shape {shape}, "
                                      f"{getattr(indices, 'dtype', type(indices).__name__)})")
        if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= examples):
            raise _refuse(rank, what, f"{name} point outside this party's {examples} examples")
        distinct = np.unique(indices)
        if distinct.size != indices.size:
            raise _refuse(rank, what, f"{name} repeat examples ({indices.size - distinct.size} of {indices.size} "
                                      "are repeats): each would be sampled as if it were another")
        for other, earlier in seen:
            shared = np.intersect1d(distinct, earlier, assume_unique=True).size
            if shared:
                raise _refuse(rank, what, f"{name} share {shared} examples with its {other}: each shard is "
                                          "accounted on its own")
        if not np.array_equal(distinct, np.unique(mine)):  # the same examples; their order decides no ε
            raise _refuse(rank, what, f"{name} ({indices.size}) are not the examples of the seeded {partition} "
                                      f"split this party computes itself ({mine.size})")
        seen.append((name, distinct))


def check_steps(steps_per_epoch: Any, steps: Any, expected_per_epoch: int, epochs: int, *, rank: int,
                what: str) -> None:
    """Raise :class:`AssignmentRefusedError` unless the assignment's `steps_per_epoch` is the one this party derives
    from its own config and the shard sizes (`expected_per_epoch`) and its `steps` are at most `epochs` of them: the
    number of releases, and with it ε, is the config's, with or without an ε target or cap. Fewer steps (an ε cap
    the plan stops at) only release less."""
    if steps_per_epoch != expected_per_epoch:
        raise _refuse(rank, what, f"steps_per_epoch {steps_per_epoch!r} where this party derives {expected_per_epoch}")
    most = epochs * expected_per_epoch
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= most:
        raise _refuse(rank, what, f"steps {steps!r} where this party's config allows at most {epochs} epochs x "
                                  f"{expected_per_epoch} = {most}")


def check_gathered(gathered: Any, cfg: Config, *, rank: int, what: str) -> None:
    """Raise :class:`AssignmentRefusedError` unless the assignment's `gathered` (the server gathers each party's
    release instead of a sum) is what this party's ``federation.selection`` gives: a selection gathers, ``all``
    sums."""
    expected = cfg.federation.selection != "all"
    if gathered is not expected:
        raise _refuse(rank, what, f"gathered {gathered!r} where this party's federation.selection "
                                  f"{cfg.federation.selection} gives {expected}")


def check_corruption(corruption: Any, expected: float, *, rank: int, what: str) -> None:
    """Raise :class:`AssignmentRefusedError` unless the fraction of its shards rank 0 tells this party to replace by
    noise is the one the public seed gives it (``federation.unreliable_parties``)."""
    if corruption != expected:
        raise _refuse(rank, what, f"corruption {corruption!r} where this party derives {expected!r}")
