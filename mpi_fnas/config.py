"""Run configuration: a typed schema, YAML loading, ``--set`` overrides and validation.

The schema's defaults *are* the default configuration (``configs/default.yaml`` is a documented copy that a test
keeps in sync), so ``python -m mpi_fnas.run`` works from an installed wheel without any file.

Every problem with user input raises :class:`ConfigError` whose message is one line naming the key; the CLI turns
it into exit code 2. Nothing here touches MPI, torch or the file system beyond reading the YAML file.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """Invalid user input (config file, ``--set`` override, or a mismatch with the MPI world)."""


MODES = ("vanilla", "fnas", "dpfnas")


@dataclass
class DataConfig:
    """Where the examples come from and how they are split among parties."""

    dataset: Literal["synthetic-shapes", "cifar10"] = "synthetic-shapes"
    root: str = "data"  # cifar10: folder holding cifar-10-batches-py/
    download: bool = False  # cifar10 only: fetch into `root` before the run (needs internet)
    image_size: int = 16  # synthetic-shapes only (cifar10 is 32)
    train_size: int | None = 16000  # examples in the train split (synthetic: generated; cifar10: truncation)
    test_size: int | None = 2000  # examples in the server's test split
    val_fraction: float = 0.5  # share of the train split held out as search-validation (DARTS: 0.5)
    partition: Literal["iid", "dirichlet", "pathological"] = "iid"
    dirichlet_alpha: float = 0.5
    classes_per_party: int = 2


@dataclass
class SpaceConfig:
    """The DARTS supernet."""

    channels: int = 8
    layers: int = 3
    nodes: int = 2  # DARTS uses 4; 2 keeps the default run within minutes on a laptop CPU
    stem_multiplier: int = 3
    norm: Literal["batchnorm", "groupnorm"] = "groupnorm"


@dataclass
class SearchConfig:
    """The bilevel optimisation (DARTS hyper-parameters unless noted)."""

    epochs: int = 2
    batch_size: int = 32  # per party, per step (under DP: the expected Poisson batch size)
    order: Literal["first_order", "second_order"] = "first_order"
    aggregate: Literal["mean", "sum"] = "mean"  # how the server combines party gradients (paper: sum)
    steps_per_epoch: int | None = None  # default: ceil(mean party train-shard size / batch_size)
    w_lr: float = 0.1
    w_lr_min: float = 0.001
    w_momentum: float = 0.9
    w_weight_decay: float = 3e-4
    w_grad_clip: float = 5.0  # server-side clip of the aggregated W gradient norm; 0 disables
    a_optimizer: Literal["adam", "sgd"] = "adam"  # adam: DARTS; sgd: the paper's plain A ← A − η·ΣH_k (Eq. 4)
    a_lr: float = 3e-3
    a_beta1: float = 0.5
    a_beta2: float = 0.999
    a_weight_decay: float = 1e-3


@dataclass
class PrivacyConfig:
    """DP-FNAS (used when mode is dpfnas). The paper's σ_W = σ_A = 1 and R^H = 0.1; R^G = 1 (paper: 0.01).

    Why R^G = 1 by default: the W step is ξ·(clipped mean + noise), so with the paper's 0.01 the weights barely
    move in the few dozen steps of the laptop default. configs/dpfnas.yaml keeps the paper's value.
    """

    noise_multiplier_w: float = 1.0  # σ_W: noise std per coordinate of G_k is σ_W·R^G (before ÷ B)
    noise_multiplier_a: float = 1.0  # σ_A: for H_k
    clip_w: float = 1.0  # R^G: per-example L2 bound of W gradients (paper: 0.01, see configs/dpfnas.yaml)
    clip_a: float = 0.1  # R^H: per-example L2 bound of A gradients
    delta: float | None = None  # per party; must be < 1/N_k; default min(1e-5, 1/(10·N_k)), N_k = smaller shard
    target_epsilon: float | None = None  # if set: calibrate σ_W = σ_A so the worst party ends at this ε
    max_epsilon: float | None = None  # if set: stop (status finished) before a step would exceed this ε
    secure_rng: bool = False  # every noise draw and coin flip straight from the OS CSPRNG (os.urandom)
    reproducible_noise: bool = False  # tests/debugging only: noise and sampling seeded from (seed, rank); VOIDS ε


@dataclass
class FederationConfig:
    """Who takes part. The number of parties is always the MPI world size minus one."""

    parties: int | None = None  # if set, must equal world size - 1 (a guard for batch scripts)


@dataclass
class CheckpointConfig:
    """Checkpoints for resuming (``--resume RUN_DIR``); also written on SIGTERM/SIGUSR1 before stopping."""

    every_steps: int = 100  # 0 disables periodic checkpoints (signals still checkpoint)


@dataclass
class RuntimeConfig:
    """Execution details that do not change the result."""

    threads_per_rank: int | None = None  # torch intra-op threads; default: max(1, cores // ranks_on_node)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # parties' device; rank 0 always uses the CPU
    log_every: int = 4  # write a /metrics (and, under DP, /privacy) row every N steps and at every epoch end
    progress: Literal["auto", "on", "off"] = "auto"  # rank 0's progress bar ("auto": only on a terminal)
    comm_timeout: float = 1800.0  # seconds one collective may take (incl. the slowest party's step) before abort


@dataclass
class Config:
    """The whole run."""

    name: str = "default"
    mode: Literal["vanilla", "fnas", "dpfnas"] = "dpfnas"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    space: SpaceConfig = field(default_factory=SpaceConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def same_search(self, other: Config) -> bool:
        """Equal in everything that changes results (``runtime`` and ``checkpoint`` may differ)."""
        mine, theirs = self.to_dict(), other.to_dict()
        for key in ("runtime", "checkpoint"):
            mine.pop(key)
            theirs.pop(key)
        return mine == theirs


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
    ("search.epochs", lambda v: v >= 1, "must be >= 1"),
    ("search.batch_size", lambda v: v >= 1, "must be >= 1"),
    ("search.steps_per_epoch", lambda v: v is None or v >= 1, "must be >= 1 or null"),
    ("search.w_lr", lambda v: v > 0, "must be > 0"),
    ("search.w_lr_min", lambda v: v >= 0, "must be >= 0"),
    ("search.w_momentum", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("search.w_weight_decay", lambda v: v >= 0, "must be >= 0"),
    ("search.w_grad_clip", lambda v: v >= 0, "must be >= 0 (0 disables)"),
    ("search.a_lr", lambda v: v > 0, "must be > 0"),
    ("search.a_beta1", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("search.a_beta2", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("search.a_weight_decay", lambda v: v >= 0, "must be >= 0"),
    ("federation.parties", lambda v: v is None or v >= 1, "must be >= 1 or null"),
    ("privacy.noise_multiplier_w", lambda v: v > 0, "must be > 0"),
    ("privacy.noise_multiplier_a", lambda v: v > 0, "must be > 0"),
    ("privacy.clip_w", lambda v: v > 0, "must be > 0"),
    ("privacy.clip_a", lambda v: v > 0, "must be > 0"),
    ("privacy.delta", lambda v: v is None or 0 < v < 1, "must be in (0, 1) or null"),
    ("privacy.target_epsilon", lambda v: v is None or v > 0, "must be > 0 or null"),
    ("privacy.max_epsilon", lambda v: v is None or v > 0, "must be > 0 or null"),
    ("runtime.threads_per_rank", lambda v: v is None or v >= 1, "must be >= 1 or null"),
    ("checkpoint.every_steps", lambda v: v >= 0, "must be >= 0 (0 disables)"),
    ("runtime.log_every", lambda v: v >= 1, "must be >= 1"),
    ("runtime.comm_timeout", lambda v: v > 0, "must be > 0"),
]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
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
    if cfg.search.w_lr_min > cfg.search.w_lr:
        raise ConfigError(f"search.w_lr_min: {cfg.search.w_lr_min} must not exceed search.w_lr ({cfg.search.w_lr})")
    if cfg.mode == "vanilla" and cfg.federation.parties not in (None, 1):
        raise ConfigError(f"federation.parties: vanilla NAS has exactly 1 party, got {cfg.federation.parties}")
    if cfg.mode == "dpfnas":
        if cfg.space.norm != "groupnorm":
            raise ConfigError(
                f"space.norm: {cfg.space.norm} mixes examples within a batch, which voids per-example clipping "
                "under DP (mode: dpfnas); use space.norm: groupnorm"
            )
        if cfg.privacy.reproducible_noise and cfg.privacy.secure_rng:
            raise ConfigError("privacy.reproducible_noise: cannot be combined with privacy.secure_rng (one asks for "
                              "seeded, predictable noise, the other for OS entropy); set one of them")
        if cfg.search.order != "first_order":
            raise ConfigError(
                "search.order: second_order is refused under DP: its Hessian term and shared validation gradient "
                "are releases the accountant does not cover (docs/privacy.md); use first_order"
            )
    if not cfg.name or any(c in cfg.name for c in "/\\\0"):
        raise ConfigError(f"name: {cfg.name!r} must be a non-empty name without path separators")
    return cfg


def describe_keys() -> list[str]:
    """One line per config key: ``section.key  type  (default …)``, generated from the schema for ``--help``."""
    lines: list[str] = []

    def walk(cls: type, prefix: str, defaults: Any) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            value = getattr(defaults, f.name)
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], key + ".", value)
            else:
                kind = _type_name(hints[f.name]).replace("one of ", "").replace("'", "")
                default = yaml.safe_dump(value).strip().removesuffix("...").strip()
                lines.append(f"  {key:<28} {kind}  (default {default})")

    walk(Config, "", Config())
    return [line.replace("\n", " ") for line in lines]


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
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ConfigError(f"--config: no such file: {p}") from None
        except OSError as exc:
            raise ConfigError(f"--config: cannot read {p}: {exc.strerror}") from None
        where = str(p)
    return config_from_text(text, overrides, where=where)


def config_from_text(text: str | None, overrides: list[str] | tuple[str, ...] = (), *, where: str = "") -> Config:
    """Like :func:`load_config` for YAML text (e.g. the resolved config stored in a checkpoint or a log)."""
    tree: dict[str, Any] = {}
    if text is not None:
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"--config: {where or 'text'} is not valid YAML{at}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config: {where or 'text'} must contain a mapping at the top level")
        tree = loaded
    for item in overrides:
        key, value = parse_override(item)
        _apply_override(tree, key, value)
    return validate(_build(Config, tree, ""))


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
    return parties
