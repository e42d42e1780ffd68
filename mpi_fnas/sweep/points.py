"""The sweep's points and config: which (noise variance, seed) runs there are, each one's run config, and the
``sweep:`` section of a sweep config file."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mpi_fnas.config import (
    Config,
    ConfigError,
    config_from_text,
    parse_override,
    read_config_file,
    validate,
    yaml_mapping,
)

SWEEP_KEY = "sweep"
PAPER_VARIANCES = (0.5, 1.0, 2.0, 5.0, 8.0, 10.0)  # Table 2
DEFAULT_SEEDS = (0,)
NOISE_KEYS = ("noise_multiplier_w", "noise_multiplier_a")  # both releases get the same σ (as slurm/noise_sweep.sh)
#: The name of a point's directory (SweepPoint.dirname): ``var<variance>-seed<seed>``.
POINT_DIR = re.compile(r"^var(?P<variance>[^/]+)-seed(?P<seed>\d+)$")


def noise_multiplier(variance: float) -> float:
    """σ = √variance, rounded to 12 significant digits exactly as ``slurm/noise_sweep.sh`` (awk "%.12g") does,
    so the array job and this sweep run bit-identical configs."""
    return float(f"{math.sqrt(variance):.12g}")


def variance_label(variance: float) -> str:
    """How a variance appears in directory names and tables: 0.5 → "0.5", 1.0 → "1", 10.0 → "10"."""
    return f"{variance:.12g}"


@dataclass(frozen=True)
class SweepPoint:
    """One run of the sweep."""

    variance: float
    seed: int

    @property
    def sigma(self) -> float:
        return noise_multiplier(self.variance)

    @property
    def dirname(self) -> str:
        return f"var{variance_label(self.variance)}-seed{self.seed}"


@dataclass(frozen=True)
class SweepSpec:
    """The ``sweep:`` section: every variance is run with every seed, variances in the outer loop."""

    variances: tuple[float, ...] = PAPER_VARIANCES
    seeds: tuple[int, ...] = DEFAULT_SEEDS

    def points(self) -> list[SweepPoint]:
        """Every (noise variance, seed) point of the sweep, variances outermost."""
        return [SweepPoint(v, s) for v in self.variances for s in self.seeds]

    def to_dict(self) -> dict[str, list]:
        """The spec as plain lists (the ``sweep:`` section of a config)."""
        return {"variances": list(self.variances), "seeds": list(self.seeds)}


def parse_sweep_section(section: Any) -> SweepSpec:
    """Validate the ``sweep:`` mapping (None → defaults). A bare number is taken as a one-element list."""
    if section is None:
        return SweepSpec()
    if not isinstance(section, dict):
        raise ConfigError(f"{SWEEP_KEY}: expected a mapping with keys variances, seeds; got {section!r}")
    unknown = [k for k in section if k not in ("variances", "seeds")]
    if unknown:
        raise ConfigError(f"{SWEEP_KEY}.{unknown[0]}: unknown key (valid keys here: variances, seeds)")
    variances = _number_list(section.get("variances", list(PAPER_VARIANCES)), "variances", integer=False)
    seeds = _number_list(section.get("seeds", list(DEFAULT_SEEDS)), "seeds", integer=True)
    return SweepSpec(tuple(float(v) for v in variances), tuple(int(s) for s in seeds))


def _number_list(value: Any, name: str, *, integer: bool) -> list:
    key = f"{SWEEP_KEY}.{name}"
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ConfigError(f"{key}: must list at least one value")
    for item in items:
        if integer:
            if not isinstance(item, int) or isinstance(item, bool) or item < 0:
                raise ConfigError(f"{key}: {item!r} is not an integer >= 0")
        elif isinstance(item, bool) or not isinstance(item, (int, float)) or not (math.isfinite(item) and item > 0):
            raise ConfigError(f"{key}: {item!r} is not a finite number > 0")
    # Two equal entries would write the same run directory twice (1 and 1.0 are the same variance).
    labels = [str(i) if integer else variance_label(float(i)) for i in items]
    for label in labels:
        if labels.count(label) > 1:
            raise ConfigError(f"{key}: {label} is listed twice")
    return items


def point_config(base: Config, point: SweepPoint) -> Config:
    """The run config of one point: `base` with its seed and σ_W = σ_A = √variance."""
    cfg = copy.deepcopy(base)
    cfg.seed = point.seed
    for key in NOISE_KEYS:
        setattr(cfg.privacy, key, point.sigma)
    return validate(cfg)


def load_sweep(path: str | Path | None, overrides: Sequence[str] = ()) -> tuple[Config, SweepSpec]:
    """Defaults ← YAML file (its ``sweep:`` section stripped) ← ``--set`` overrides; ``sweep.*`` overrides go to
    the sweep section. Raises ConfigError (one line naming the key) on any problem, including a config whose
    points could not run as a noise sweep."""
    tree: dict[str, Any] = {}
    if path is not None:
        tree = yaml_mapping(read_config_file(path), str(Path(path)))
    section = tree.pop(SWEEP_KEY, None)
    run_overrides = []
    for item in overrides:
        key, value = parse_override(item)
        if key == SWEEP_KEY or key.startswith(SWEEP_KEY + "."):
            parts = key.split(".")[1:]
            if len(parts) != 1:
                raise ConfigError(f"--set {key}: expected sweep.variances=[...] or sweep.seeds=[...]")
            if section is None:
                section = {}
            if not isinstance(section, dict):
                raise ConfigError(f"{SWEEP_KEY}: expected a mapping with keys variances, seeds; got {section!r}")
            section = {**section, parts[0]: value}
        else:
            run_overrides.append(item)
    spec = parse_sweep_section(section)
    base = config_from_text(yaml.safe_dump(tree, sort_keys=False), run_overrides, where=str(path or ""))
    if base.mode != "dpfnas":
        raise ConfigError(f"mode: a noise sweep needs mode dpfnas (got {base.mode}); the noise multipliers would "
                          "be ignored")
    if base.privacy.target_epsilon is not None:
        raise ConfigError("privacy.target_epsilon: the sweep sets the noise multipliers itself; drop target_epsilon "
                          "(privacy.max_epsilon may stay)")
    for point in spec.points():  # all points must be valid before the first one runs
        point_config(base, point)
    return base, spec


def sweep_yaml(base: Config, spec: SweepSpec) -> str:
    """The resolved sweep config: the base run config with the sweep section appended (loadable by load_sweep)."""
    return base.to_yaml() + yaml.safe_dump({SWEEP_KEY: spec.to_dict()}, sort_keys=False, default_flow_style=None)
