"""Planning, on rank 0 before any party computes: what each stage of a job will do.

The search: partitions, step counts and the privacy plan of the whole job (:func:`plan_run`). The augmentation:
each party's pool, its step counts and the privacy of its releases, planned against what the search spent
(:func:`plan_augment_stage`). No MPI and no autograd here: a plan is a pure function of the config, the train
split's *labels*, the number of parties (and, for the augmentation, the search's ledgers). Rank 0 reads the labels
to partition the data (a simulation convenience, and a trust assumption: see docs/privacy.md, "Threat model"); it
never reads the parties' inputs. With ``data.partition: local`` it reads nothing of theirs: each party splits its
own folder, and the plan needs only each party's number of examples (:mod:`mpi_fnas.federation.inventory`). The
pools follow from the search's partition, so the augmentation trains on exactly the shards the search used and the
privacy ledgers of the search continue.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mpi_fnas.config import CELL_NETWORK, Config, SetupError, SpaceConfig
from mpi_fnas.data import DatasetNotFoundError, HeldOut, open_dataset, partition_indices, split_train_val
from mpi_fnas.data.corruption import party_corruption, unreliable_parties
from mpi_fnas.federation.adadp import w_rounds
from mpi_fnas.federation.aux_set import party_positions
from mpi_fnas.federation.flat import numel
from mpi_fnas.privacy import DPParams
from mpi_fnas.privacy.params import PrivacyPlan
from mpi_fnas.privacy.release import AugmentReleases, SecureSum, augment_sample_rates
from mpi_fnas.secagg.encoding import padded_length
from mpi_fnas.space import largest_augment_network, search_space
from mpi_fnas.wire import wire_type

if TYPE_CHECKING:
    from mpi_fnas.privacy.federation_ledger import FederationLedger


@contextmanager
def _setup_errors(prefix: str = "", errors: tuple[type[Exception], ...] = (ValueError,)) -> Iterator[None]:
    """Re-raise one of ``errors`` raised in the block as a one-line SetupError, its message after ``prefix``."""
    try:
        yield
    except errors as exc:
        raise SetupError(f"{prefix}{exc}") from None


@wire_type
@dataclass
class Assignment:
    """What the server tells a party at setup (global indices into the dataset's train split)."""

    train_indices: np.ndarray
    val_indices: np.ndarray
    steps_per_epoch: int
    steps: int = 0  # iterations of the whole run (filled in by plan_run)
    dp: DPParams | None = None  # the privacy parameters under dpfnas
    checkpoint_step: int = 0  # > 0 when resuming: the party restores its own state of that step
    unreliable: bool = False  # simulated as unreliable (drawn from the seed; public)
    corruption: float = 0.0  # the fraction of each shard the party replaces by noise (0 unless unreliable)
    gathered: bool = False  # the server gathers every release (selection random or secprobe) instead of a Reduce

    #: The fields that differ from party to party; every other field is the stage's plan, the same for all.
    PER_PARTY: ClassVar[tuple[str, ...]] = ("train_indices", "val_indices", "unreliable", "corruption")


@dataclass
class RunPlan:
    """Rank 0's plan of the run: one Assignment per party, and the privacy plan under DP."""

    assignments: list[Assignment]
    steps_per_epoch: int
    steps: int
    privacy: PrivacyPlan | None
    stop_reason: str = "completed"

    @property
    def unreliable(self) -> np.ndarray:
        """(K,) bool: the parties simulated as unreliable (public)."""
        return np.array([a.unreliable for a in self.assignments], dtype=bool)

    @property
    def shard_sizes(self) -> list[list[int]]:
        """[[N_k^train, N_k^val], ...] per party: public (the sample rates are B / N)."""
        return [[len(a.train_indices), len(a.val_indices)] for a in self.assignments]


def open_split(cfg: Config, split: str, *, download: bool = False, party: int | None = None):
    """The dataset object for `split` ("train" or "test"); SetupError (one line) when it is missing or unusable.
    With ``data.holdout`` N, "test" is the train split's last N examples (:class:`~mpi_fnas.data.HeldOut`), which no
    party is given: settings are tuned on it, and the test split is not read.

    `download` (rank 0 only, which opens the train split before any party does): fetch a missing CIFAR-10.
    `party`: the party opening it; with ``data.partition: local`` its train split is its own folder.
    """
    if split == "test" and cfg.data.holdout:  # tuning: the last data.holdout train examples, never the test split
        train = open_split(cfg, "train", download=download)
        return HeldOut(train, np.arange(len(train) - cfg.data.holdout, len(train)))
    size = cfg.data.train_size if split == "train" else cfg.data.test_size
    own = party if cfg.data.partition == "local" else None
    with _setup_errors(errors=(DatasetNotFoundError, ValueError)):
        return open_dataset(cfg.data.dataset, split, root=cfg.data.root, image_size=cfg.data.image_size,
                            size=size, seed=cfg.seed, download=download, party=own)


def plan_assignments(cfg: Config, parties: int, local_sizes: list[int] | None = None) -> list[Assignment]:
    """Split and partition the train split by labels; one Assignment per party.

    With ``data.partition: local``, `local_sizes` (each party's number of examples, from its inventory) replaces
    the central split: party k's shards are a seeded train/validation split of its own folder's positions.
    """
    if cfg.data.partition == "local":
        if local_sizes is None or len(local_sizes) != parties:
            raise SetupError("data.partition local: the plan needs every party's inventory")
        shards = [local_shards(cfg, n, rank) for rank, n in enumerate(local_sizes, start=1)]
        return _assignments(cfg, [t for t, _ in shards], [v for _, v in shards])
    train = open_split(cfg, "train", download=cfg.data.download)
    if cfg.data.dataset == "imagefolder" and tuple(open_split(cfg, "test").classes) != tuple(train.classes):
        raise SetupError(f"data.dataset imagefolder: {cfg.data.root}/train and {cfg.data.root}/test have different "
                         "class sub-folders; they must have the same")
    train_parts, val_parts = central_shards(cfg, train.labels, parties)
    return _assignments(cfg, train_parts, val_parts)


def own_shards(cfg: Config, data: Any, parties: int, rank: int
               ) -> tuple[tuple[np.ndarray, np.ndarray], list[tuple[int, int]] | None]:
    """Party `rank`'s (train, val) shards as it computes them itself from the `data` it opened (its own folder under
    ``data.partition: local``, else the train split every party holds) and the public config: what rank 0 must
    assign it (:func:`~mpi_fnas.federation.verify.check_shards`); and every party's (N_train, N_val), which a
    central partition gives it too (None under ``local``: each party's own count)."""
    if cfg.data.partition == "local":
        return local_shards(cfg, len(data), rank), None
    train, val = central_shards(cfg, data.labels, parties)
    return (train[rank - 1], val[rank - 1]), [(len(t), len(v)) for t, v in zip(train, val, strict=True)]


@dataclass
class PartyView:
    """What a party computes for itself of the plan rank 0 must have sent it, from the public config and its own
    train split: secure aggregation's D (None unless its releases are securely aggregated), its (train, val)
    shards of its `examples`, its corruption fraction, and every party's shard sizes (N_train, N_val), which set
    the steps per epoch (under ``data.partition: local`` the others' as they told it:
    :func:`~mpi_fnas.federation.handshake.exchange_shard_sizes`)."""

    dimension: int | None
    shards: tuple[np.ndarray, np.ndarray]
    examples: int
    corruption: float
    sizes: list[tuple[int, int]]


def party_view(cfg: Config, data: Any, parties: int, rank: int,
               told: Callable[[tuple[int, int]], list[tuple[int, int]]] | None = None) -> PartyView:
    """Party `rank`'s :class:`PartyView` from the `data` it opened (the functions rank 0 plans with,
    docs/privacy.md §2.10). `told(own sizes)`: under ``data.partition: local``, every party's sizes as the parties
    tell each other (None: only its own is known)."""
    secure = cfg.mode == "dpfnas" and cfg.privacy.aggregation == "secure"
    dimension = secure_dimension(cfg, data.in_channels, data.num_classes) if secure else None
    shards, sizes = own_shards(cfg, data, parties, rank)
    if sizes is None:
        own = (len(shards[0]), len(shards[1]))
        sizes = told(own) if told is not None else [own]
    return PartyView(dimension, shards, len(data), party_corruption(cfg, parties, rank), sizes)


def local_shards(cfg: Config, examples: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``data.partition: local``: party `rank`'s (train, val) positions in its own folder of `examples` images,
    a split seeded by the public seed and its rank (the party computes it too, to check its assignment)."""
    with _setup_errors("data.partition local: "):
        return split_train_val(examples, cfg.data.val_fraction, cfg.seed + rank)


def central_shards(cfg: Config, labels: np.ndarray, parties: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The central partition: every party's train shard and validation shard (indices into the train split whose
    `labels` are given), a public function of the config, the labels and K: a party recomputes its own to check
    what rank 0 assigns it."""
    with _setup_errors():
        labels = labels[: party_positions(cfg, len(labels))]  # the held-out aux slice goes to no party
    train_idx, val_idx = split_train_val(len(labels), cfg.data.val_fraction, cfg.seed)
    with _setup_errors("data.partition: "):
        kw = {"dirichlet_alpha": cfg.data.dirichlet_alpha, "classes_per_party": cfg.data.classes_per_party}
        train_parts = partition_indices(labels[train_idx], parties, cfg.data.partition, cfg.seed, **kw)
        val_parts = partition_indices(labels[val_idx], parties, cfg.data.partition, cfg.seed + 1, **kw)
    return [train_idx[tp] for tp in train_parts], [val_idx[vp] for vp in val_parts]


def search_steps_per_epoch(cfg: Config, train_sizes: Sequence[int]) -> int:
    """The search's iterations per epoch: ``search.steps_per_epoch``, or one pass over the mean party's train shard
    (`train_sizes`: every party's N_k^train), counted in W releases (an ADADP iteration makes two: docs/adadp.md).
    Rank 0 plans with it; a DP party derives it too, to check its assignment."""
    steps = cfg.search.steps_per_epoch
    if steps is None:  # one epoch = one pass over the mean party's train shard
        steps = max(1, math.ceil(np.mean(train_sizes) / cfg.search.batch_size))
    return math.ceil(steps / w_rounds(cfg.search.w_optimizer))


def _assignments(cfg: Config, train_parts: list[np.ndarray], val_parts: list[np.ndarray]) -> list[Assignment]:
    """One Assignment per party from its train and validation shards (indices into the dataset it opens)."""
    steps = search_steps_per_epoch(cfg, [len(p) for p in train_parts])
    parties = len(train_parts)
    corruption = [party_corruption(cfg, parties, rank) for rank in range(1, parties + 1)]  # what each party checks
    unreliable = unreliable_parties(parties, cfg.federation.unreliable_parties, cfg.seed)
    return [Assignment(tp, vp, steps, unreliable=bool(bad), corruption=c, gathered=cfg.federation.selection != "all")
            for tp, vp, bad, c in zip(train_parts, val_parts, unreliable, corruption, strict=True)]


def augment_pools(cfg: Config, assignments: list[Assignment]) -> list[np.ndarray]:
    """Each party's augmentation pool: its train shard, then (``augment.pool: all``) its validation shard."""
    if cfg.augment.pool == "train":
        return [a.train_indices for a in assignments]
    return [np.concatenate([a.train_indices, a.val_indices]) for a in assignments]


def augment_steps(cfg: Config, pool_sizes: list[int]) -> tuple[int, int]:
    """(steps per epoch, planned steps) of the augmentation: an epoch is one pass over the mean party's pool, and
    ``augment.steps_per_epoch`` counts weight releases (batches) as in the search: an ADADP iteration makes two."""
    per_epoch = cfg.augment.steps_per_epoch or max(1, math.ceil(float(np.mean(pool_sizes)) / cfg.augment.batch_size))
    per_epoch = math.ceil(per_epoch / w_rounds(cfg.augment.optimizer))
    return per_epoch, cfg.augment.epochs * per_epoch


def augment_is_private(cfg: Config) -> bool:
    """Whether the augmentation's releases are DP: dpfnas with ``augment.private``."""
    return cfg.mode == "dpfnas" and cfg.augment.private


def secure_dimension(cfg: Config, in_channels: int | None = None, num_classes: int | None = None) -> int:
    """D of secure aggregation's accountant (:class:`~mpi_fnas.privacy.release.SecureSum`): the padded length of
    the run's largest release. That is the supernet's W or A or, when the augmentation is private, the largest
    network it may train (:func:`~mpi_fnas.space.largest_augment_network`): under ``augment.network: cell`` the
    evaluation network of the space's largest cell (:meth:`~mpi_fnas.space.kinds.DartsSpace.largest_genotype`): its
    ε is planned before the search has picked a cell, and a searched cell and a random one are then accounted alike;
    under a hand-designed ``augment.network``, that network (so the key is one of those a party checks).
    Public: it follows from the config and the data's shape (`in_channels`, `num_classes`; None: rank 0's test
    split's). Rank 0 plans with it, and each party recomputes it from its own train split to check its assignment
    (:mod:`mpi_fnas.federation.verify`): it builds the networks once, see docs/privacy.md §2.10 for the cost."""
    space = search_space(cfg.space.kind)
    if in_channels is None or num_classes is None:
        test = open_split(cfg, "test")
        in_channels, num_classes = test.in_channels, test.num_classes
    shape = {"in_channels": in_channels, "num_classes": num_classes}
    supernet = space.build_supernet(cfg.space, seed=cfg.seed, **shape)
    sizes = [numel(supernet.weights()), numel(supernet.alphas())]
    if augment_is_private(cfg) and cfg.augment.epochs > 0:
        largest = largest_augment_network(cfg, seed=cfg.seed, **shape)
        sizes.append(numel(largest.weights()))
    return padded_length(max(sizes))


def augment_demand(cfg: Config, assignments: list[Assignment], secure: SecureSum | None) -> AugmentReleases | None:
    """The augmentation's DP releases as configured (σ, clip, B, rates, planned steps), or None; `secure`: the
    search plan's secure aggregation (None: local noise)."""
    if not augment_is_private(cfg) or cfg.augment.epochs == 0:
        return None
    with _setup_errors("augment: "):
        q_tr, q_val = augment_sample_rates([len(a.train_indices) for a in assignments],
                                           [len(a.val_indices) for a in assignments], cfg.augment.batch_size,
                                           cfg.augment.pool)
    return AugmentReleases(
        noise_multiplier=cfg.augment.noise_multiplier, clip=cfg.augment.clip,
        expected_batch_size=float(cfg.augment.batch_size), sample_rate_train=q_tr, sample_rate_val=q_val,
        steps=augment_steps(cfg, [len(p) for p in augment_pools(cfg, assignments)])[1], stop_reason="completed",
        releases_per_step=w_rounds(cfg.augment.optimizer),
        secure=secure,
    )


def plan_run(cfg: Config, parties: int, assignments: list[Assignment] | None = None, *,
             search: bool = True, local_sizes: list[int] | None = None) -> RunPlan:
    """The whole plan: partition (unless given), step count, and under DP the privacy plan of the whole job: the
    search (none without `search`, when ``augment.genotype`` is given) and the augmentation planned after it
    (docs/privacy.md, "Privacy across the search and the augmentation")."""
    if assignments is None:
        assignments = plan_assignments(cfg, parties, local_sizes)
    steps_per_epoch = assignments[0].steps_per_epoch
    steps = cfg.search.epochs * steps_per_epoch if search else 0
    privacy, reason = None, "completed"
    if cfg.mode == "dpfnas":
        with _setup_errors("privacy: "):
            # Imported here: parties import this module for their assignments, and the planner's accountant
            # (dp_accounting, scipy: ~1 s and ~60 MB a rank) is rank 0's alone.
            from mpi_fnas.privacy.calibration import plan_privacy

            dimension = secure_dimension(cfg) if cfg.privacy.aggregation == "secure" else None
            params = DPParams.from_config(cfg.privacy, cfg.search.batch_size, len(assignments), dimension)
            privacy = plan_privacy(
                [len(a.train_indices) for a in assignments], [len(a.val_indices) for a in assignments],
                params, planned_steps=steps, augment=augment_demand(cfg, assignments, params.secure_sum),
                w_releases_per_step=w_rounds(cfg.search.w_optimizer),
            )
        steps, reason = privacy.steps, privacy.stop_reason
    for a in assignments:
        a.steps = steps
        a.dp = privacy.params if privacy is not None else None
    return RunPlan(assignments, steps_per_epoch, steps, privacy, reason)


def shared_plan(assignment: Assignment | AugmentAssignment) -> dict[str, Any]:
    """The fields of `assignment` that rank 0 sends every party alike (its ``PER_PARTY`` fields left out)."""
    return {field.name: getattr(assignment, field.name) for field in dataclasses.fields(assignment)
            if field.name not in assignment.PER_PARTY}


def attach_resume(plan: RunPlan | AugmentPlan, checkpoint: dict) -> None:
    """Check that the re-planned stage is the checkpointed one; tell each party which state to restore."""
    if isinstance(plan, AugmentPlan):
        network = checkpoint.get("network", CELL_NETWORK)  # a checkpoint from before augment.network trained a cell
        if (checkpoint["plan_steps"], checkpoint["genotype"], network) != (plan.steps, plan.genotype_text,
                                                                           plan.network):
            raise SetupError("--resume: the augmentation checkpoint was written by a run with a different plan "
                             f"({checkpoint['plan_steps']} steps, network {network}, genotype "
                             f"{checkpoint['genotype'] or '-'})")
    elif checkpoint["plan_steps"] != plan.steps or len(checkpoint["shard_sizes"]) != len(plan.assignments):
        raise SetupError("--resume: the checkpoint was written by a run with a different plan "
                         f"({checkpoint['plan_steps']} steps, {len(checkpoint['shard_sizes'])} parties)")
    elif [list(s) for s in checkpoint["shard_sizes"]] != plan.shard_sizes:
        raise SetupError("--resume: the data partition differs from the checkpointed run's")
    for assignment in plan.assignments:
        assignment.checkpoint_step = int(checkpoint["step"])


@wire_type
@dataclass
class AugmentAssignment:
    """What the server tells a party at the start of the augmentation."""

    pool_indices: np.ndarray  # global indices into the train split: the party's train shard (then its val shard)
    genotype: str  # the cell's genotype text; "" when `network` is hand-designed
    steps_per_epoch: int
    steps: int
    releases: AugmentReleases | None  # the DP releases' public constants (None: exact gradients)
    params: DPParams | None  # the run's privacy parameters (where the party's randomness comes from)
    checkpoint_step: int = 0  # > 0 when resuming: the party restores its own state of that step
    train_count: int = 0  # the first train_count pool indices are the search's train shard, the rest its val shard
    corruption: float = 0.0  # the fraction of each shard the party replaces by noise, as in the search
    gathered: bool = False  # the server gathers every release (a selection) instead of a Reduce
    network: str = CELL_NETWORK  # augment.network: what is trained (the party checks it against its own config)

    #: The fields that differ from party to party (see Assignment.PER_PARTY).
    PER_PARTY: ClassVar[tuple[str, ...]] = ("pool_indices", "train_count", "corruption")


@dataclass
class AugmentPlan:
    """Rank 0's plan of the augmentation."""

    assignments: list[AugmentAssignment]
    genotype: Any  # the space's genotype (mpi_fnas.space.Genotype, mpi_fnas.space.dpnas.DpnasGenotype); None for a
    # hand-designed network
    steps_per_epoch: int
    steps: int
    releases: AugmentReleases | None
    stop_reason: str
    network: str = CELL_NETWORK  # augment.network

    @property
    def pool_sizes(self) -> list[int]:
        return [len(a.pool_indices) for a in self.assignments]

    @property
    def genotype_text(self) -> str:
        """The trained cell's genotype text, or "" when the network is hand-designed (no cell)."""
        return self.genotype.to_string() if self.genotype is not None else ""


def parse_genotype(text: str, where: str, space: SpaceConfig) -> Any:
    """A genotype string of the `space` section's kind (its genotype's ``to_string``) that a network can be built
    from; SetupError naming `where` when it does not parse, uses an op outside ``space.ops``, or cannot be trained
    (a DPNAS cell cut off from its input)."""
    kind = search_space(space.kind)
    with _setup_errors(f"{where}: "):
        genotype = kind.parse_genotype(text, space)
        kind.check_trainable(genotype)
    return genotype


def plan_augment_stage(cfg: Config, search: list[Assignment], genotype: Any,
                       ledger: FederationLedger | None, params: DPParams | None) -> AugmentPlan:
    """The augmentation's plan of ``augment.network`` (`genotype`: the cell's, None for a hand-designed network),
    its privacy planned against what the search has spent (``ledger``: under DP, every release the search made,
    replays included), so ``privacy.target_epsilon`` and ``privacy.max_epsilon`` bound the whole job: see
    docs/privacy.md, "Privacy across the search and the augmentation"."""
    party_pools = augment_pools(cfg, search)
    per_epoch, steps = augment_steps(cfg, [len(p) for p in party_pools])
    releases, reason = None, "completed"
    demand = augment_demand(cfg, search, params.secure_sum if params is not None else None)
    if demand is not None:
        assert ledger is not None and params is not None
        with _setup_errors("privacy: "):
            from mpi_fnas.privacy.calibration import plan_augment  # rank 0's alone (see plan_run)

            releases = plan_augment(ledger, demand, params)
        steps, reason = releases.steps, releases.stop_reason
    text = genotype.to_string() if genotype is not None else ""
    assignments = [
        AugmentAssignment(pool, text, per_epoch, steps, releases,
                          params if releases is not None else None, train_count=len(shards.train_indices),
                          corruption=shards.corruption, gathered=shards.gathered, network=cfg.augment.network)
        for pool, shards in zip(party_pools, search, strict=True)
    ]
    return AugmentPlan(assignments, genotype, per_epoch, steps, releases, reason, cfg.augment.network)
