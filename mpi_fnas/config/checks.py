"""A config's range and cross-field checks (the types are checked while it is built), and the MPI world's against
it; each problem is one :class:`~mpi_fnas.config.ConfigError` line naming the key."""

from __future__ import annotations

from typing import Any

from mpi_fnas.config.errors import ConfigError
from mpi_fnas.config.schema import (
    CELL_NETWORK,
    DIGIT_DATASETS,
    MAX_AUX_SIZE,
    Config,
)
from mpi_fnas.op_names import DPNAS_CONVS, PRIMITIVES_BY_KIND, candidate_ops

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
    ("search.gdas_temperature_final", lambda v: v is None or v > 0, "must be > 0 or null"),
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
    ("data.holdout", lambda v: v >= 0, "must be >= 0 (0: off)"),
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
    ("runtime.max_physical_batch", lambda v: v is None or v == "auto" or v >= 1, "must be >= 1, auto or null"),
]


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
        if cfg.space.stem == "scattering" and cfg.space.stem_stride != 1:
            raise ConfigError(f"space.stem_stride: {cfg.space.stem_stride} is the conv stem's; the scattering stem "
                              "quarters the side itself, so leave it at 1")
        if cfg.space.head == "dpnas" and cfg.space.head_pool != 1:
            raise ConfigError(f"space.head_pool: {cfg.space.head_pool} is the pool head's; the dpnas head pools "
                              "to 3x3 itself, so leave it at 1")
        side = cfg.data.image_size // 4 if cfg.space.stem != "conv" else \
            -(-cfg.data.image_size // cfg.space.stem_stride)
        for _ in cfg.space.stage_channels:  # each stage's pool halves the side, rounding up
            side = -(-side // 2)
        if cfg.space.head_pool > side:
            raise ConfigError(f"space.head_pool: {cfg.space.head_pool} exceeds the last stage's {side}x{side} maps "
                              f"(data.image_size {cfg.data.image_size}, stem stride {cfg.space.stem_stride}, "
                              f"{len(cfg.space.stage_channels)} stages): at most {side}")
    elif cfg.search.method == "gdas":
        raise ConfigError("search.method: gdas draws one op per edge of the dpnas cell; set space.kind: dpnas or "
                          "search.method: darts")
    elif cfg.space.stem != "conv" or cfg.space.head != "pool":
        raise ConfigError(f"space.{'stem' if cfg.space.stem != 'conv' else 'head'}: "
                          f"{cfg.space.stem if cfg.space.stem != 'conv' else cfg.space.head} is for space.kind dpnas; "
                          "the darts networks have a conv stem and a pool head")
    elif cfg.space.stem_stride != 1:
        raise ConfigError(f"space.stem_stride: {cfg.space.stem_stride} is for space.kind dpnas; the darts networks' "
                          "stem keeps the input's side, so leave it at 1")
    elif cfg.space.head_pool != 1:
        raise ConfigError(f"space.head_pool: {cfg.space.head_pool} is for space.kind dpnas; the darts networks' "
                          "classifier reads the global average pool, so leave it at 1")
    _validate_network(cfg)
    _validate_fixed_stem_augmentation(cfg)
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


def _validate_fixed_stem_augmentation(cfg: Config) -> None:
    """A scattering front-end (a ScatterNet's, or a cell's ``space.stem``) is computed once per example before the
    augmentation, so a crop, flip or cutout per step would act on its features, not on the images."""
    if cfg.augment.network.startswith("scatter-"):
        what, other = f"augment.network {cfg.augment.network} computes each example's scattering once", ""
    elif cfg.augment.network == CELL_NETWORK and cfg.space.kind == "dpnas" and cfg.space.stem != "conv":
        what = "space.stem scattering transforms each example once" if cfg.space.stem == "scattering" else \
            "space.stem search may choose the scattering stem, which transforms each example once"
        other = ", or set space.stem: conv"
    else:
        return
    moved = [key for key, value in (("augment.cutout", cfg.augment.cutout),
                                    ("augment.crop_padding", cfg.augment.crop_padding),
                                    ("augment.flip", cfg.augment.flip)) if value]
    if moved:
        raise ConfigError(f"{moved[0]}: {what}, so its images cannot be augmented per step; set augment.cutout and "
                          f"augment.crop_padding to 0 and augment.flip to false{other}")


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
        if data.holdout > 0:
            raise ConfigError("data.holdout: with data.partition local there is no central train split to hold "
                              "a tuning split out of; set it to 0")


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
