"""The scaling study's grid: points (K, exchange pattern, strong or weak scaling, seed), each point's steps, the
``mpi_fnas.run`` arguments that run it and the directory it writes. Pure planning: nothing here runs or reads a run.

Steps. ``S`` is the number of iterations one party runs at K = 1. Strong scaling keeps the total work fixed: with the
same per-party batch, a K-party point runs ceil(S / K) iterations, so every point processes about S·B examples in
all. Weak scaling keeps each party's work fixed: every point runs S iterations (K·S·B examples in all). A point sets
``search.epochs=1`` and ``search.steps_per_epoch`` to its steps, ``augment.epochs=0`` (the study times the search),
``federation.parties`` (checked against the world size), ``runtime.exchange`` and ``seed``; the data keys stay the
config's, so every point shares the config's data and a party's shard is 1/K of it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpi_fnas.config import Config, ConfigError, load_config
from mpi_fnas.config.parsing import parse_override
from mpi_fnas.federation.topology import COLLECTIVE, STAR

STRONG, WEAK = "strong", "weak"
SCALINGS = (STRONG, WEAK)
EXCHANGES = (STAR, COLLECTIVE)
DEFAULT_PARTIES = (1, 2, 4, 8)
#: The config keys every point sets itself; a ``--set`` of one of them is refused.
GRID_KEYS = ("federation.parties", "runtime.exchange", "search.epochs", "search.steps_per_epoch", "augment.epochs",
             "seed")
_DIRNAME = re.compile(rf"({'|'.join(SCALINGS)})-({'|'.join(EXCHANGES)})-K([1-9][0-9]*)-seed([0-9]+)")


def point_steps(scaling: str, parties: int, steps: int) -> int:
    """Iterations of a K-party point when one party alone would run `steps`: ceil(steps / K) (strong), steps
    (weak)."""
    if scaling not in SCALINGS:
        raise ConfigError(f"scaling: expected one of {', '.join(SCALINGS)}, got {scaling!r}")
    return math.ceil(steps / parties) if scaling == STRONG else steps


@dataclass(frozen=True)
class ScalingPoint:
    """One run of the study: `parties` parties exchanging by `exchange`, `steps` iterations, `seed`."""

    parties: int
    exchange: str
    scaling: str
    seed: int
    steps: int

    @property
    def ranks(self) -> int:
        """MPI ranks of the run: rank 0 and the K parties."""
        return self.parties + 1

    @property
    def dirname(self) -> str:
        """The run directory's name under the study's root, e.g. ``strong-star-K8-seed0``."""
        return f"{self.scaling}-{self.exchange}-K{self.parties}-seed{self.seed}"

    def overrides(self) -> list[str]:
        """The point's ``--set`` values (:data:`GRID_KEYS`)."""
        return [f"federation.parties={self.parties}", f"runtime.exchange={self.exchange}", "search.epochs=1",
                f"search.steps_per_epoch={self.steps}", "augment.epochs=0", f"seed={self.seed}"]


def parse_dirname(name: str) -> tuple[str, str, int, int] | None:
    """(scaling, exchange, K, seed) of a point's directory name, or None for any other name."""
    match = _DIRNAME.fullmatch(name)
    if match is None:
        return None
    return match.group(1), match.group(2), int(match.group(3)), int(match.group(4))


def plan_grid(parties: Sequence[int], exchanges: Sequence[str], scalings: Sequence[str], seeds: Sequence[int],
              steps: int) -> list[ScalingPoint]:
    """Every point of the grid, in order scaling, exchange, K, seed. ConfigError (one line) on a bad value."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"--steps: expected a whole number >= 1, got {steps!r}")
    for name, values in (("--parties", parties), ("--exchanges", exchanges), ("--scaling", scalings),
                         ("--seeds", seeds)):
        if not values:
            raise ConfigError(f"{name}: give at least one value")
        if len(set(values)) != len(values):
            raise ConfigError(f"{name}: a value is given twice: {' '.join(map(str, values))}")
    for k in parties:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"--parties: expected whole numbers >= 1, got {k!r}")
    for exchange in exchanges:
        if exchange not in EXCHANGES:
            raise ConfigError(f"--exchanges: expected {' or '.join(EXCHANGES)}, got {exchange!r}")
    for scaling in scalings:
        if scaling not in SCALINGS:
            raise ConfigError(f"--scaling: expected {' or '.join(SCALINGS)}, got {scaling!r}")
    for seed in seeds:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ConfigError(f"--seeds: expected whole numbers >= 0, got {seed!r}")
    return [ScalingPoint(k, exchange, scaling, seed, point_steps(scaling, k, steps))
            for scaling in scalings for exchange in exchanges for k in sorted(parties) for seed in seeds]


def check_overrides(overrides: Iterable[str]) -> None:
    """Refuse a ``--set`` of a key the grid sets itself (ConfigError, one line)."""
    for item in overrides:
        key, _ = parse_override(item)
        if key in GRID_KEYS:
            raise ConfigError(f"--set {key}: the scaling study sets this key per point ({', '.join(GRID_KEYS)}); "
                              "choose it with the study's own options")


def default_steps(config: str | None, overrides: Sequence[str]) -> int:
    """S of the config: search.epochs × search.steps_per_epoch; ConfigError when steps_per_epoch is null."""
    cfg = load_config(config, list(overrides))
    if cfg.search.steps_per_epoch is None:
        raise ConfigError("--steps: the config's search.steps_per_epoch is null (one epoch = the shard); give --steps")
    return cfg.search.epochs * cfg.search.steps_per_epoch


def point_config(point: ScalingPoint, config: str | None, overrides: Sequence[str]) -> Config:
    """The config a point runs (validated, so a bad combination is refused before anything starts)."""
    return load_config(config, [*overrides, *point.overrides()])


def run_arguments(point: ScalingPoint, config: str | None, overrides: Sequence[str], run_dir: Path,
                  resume: bool = False) -> list[str]:
    """The ``python -m mpi_fnas.run`` arguments of `point`: the config, `overrides`, then the grid's keys; ``--out``
    for a new run, ``--resume`` to continue (or restart, keeping the old log) the run in `run_dir`."""
    args = [] if config is None else ["--config", str(config)]
    args += ["--resume" if resume else "--out", str(run_dir)]
    for item in [*overrides, *point.overrides()]:
        args += ["--set", item]
    return args
