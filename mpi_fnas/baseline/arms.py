"""The arms of a random-architecture baseline: for each seed, the searched arm and R random cells, each one's
run directory and config. No MPI, no autograd.

* ``searched``: the configured job as it is (search, then the augmentation of the cell it found), at ``seed``;
* ``random-<i>``: the same augmentation of a genotype drawn uniformly from the same space
  (``search_space(kind).random_genotype``), with no search. Its draw is public: a numpy generator seeded with
  (RANDOM_TAG, seed, i), so the same command draws the same cells, and the cell is logged (``augment.genotype``,
  ``baseline.csv``). Under DP it spent nothing on a search, so its augmentation gets the searched arm's whole
  budget: ``privacy.target_epsilon`` is set to the searched arm's final worst-party ε (search + augmentation),
  which calibrates σ_aug (docs/privacy.md §3.1), and ``privacy.max_epsilon`` is cleared.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpi_fnas.config import Config, ConfigError, validate

SEARCHED = "searched"
RANDOM_PREFIX = "random-"
#: Mixed into the genotype draw's seed so that it shares no stream with any other use of the run seed.
RANDOM_TAG = 0xBA5E


@dataclass(frozen=True)
class Arm:
    """One run of the baseline: `name` (``searched`` or ``random-<i>``) at `seed`."""

    name: str
    seed: int

    @property
    def searched(self) -> bool:
        return self.name == SEARCHED

    @property
    def index(self) -> int:
        """i of ``random-<i>`` (−1 for the searched arm)."""
        return -1 if self.searched else int(self.name[len(RANDOM_PREFIX):])

    def run_dir(self, out: Path) -> Path:
        """``OUT/seed<seed>/<name>``: where the arm's ``search.h5`` goes."""
        return Path(out) / f"seed{self.seed}" / self.name


def arms(seeds: list[int], random: int) -> list[Arm]:
    """Every arm, seed by seed: the searched arm first (the random arms need its ε), then random-0 .. random-(R-1)."""
    return [Arm(name, seed) for seed in seeds for name in (SEARCHED, *(f"{RANDOM_PREFIX}{i}" for i in range(random)))]


def random_genotype_text(cfg: Config, seed: int, index: int) -> str:
    """Cell `index` of seed `seed`: drawn uniformly from ``cfg.space`` with the public generator (see the module)."""
    from mpi_fnas.space import search_space  # torch: only where a genotype is drawn

    rng = np.random.default_rng([RANDOM_TAG, seed, index])
    return search_space(cfg.space.kind).random_genotype(cfg.space, rng).to_string()


def check_base(cfg: Config) -> None:
    """ConfigError (one line) for a config the baseline cannot compare arms with."""
    if cfg.augment.epochs == 0:
        raise ConfigError("augment.epochs: the baseline compares cells trained from scratch; set augment.epochs > 0")
    if cfg.augment.genotype is not None:
        raise ConfigError("augment.genotype: the baseline draws the random cells itself and searches the other; "
                          "leave augment.genotype unset")
    if cfg.mode == "dpfnas" and not cfg.augment.private:
        raise ConfigError("augment.private: false trains with exact gradients, so the arms' ε cannot be made equal; "
                          "the baseline needs a private augmentation under dpfnas")


def arm_config(base: Config, arm: Arm, searched_epsilon: float | None) -> Config:
    """The run config of `arm`: `base` at the arm's seed; a random arm trains its drawn cell, under DP calibrated to
    `searched_epsilon` (the searched arm's final worst-party ε)."""
    cfg = copy.deepcopy(base)
    cfg.seed = arm.seed
    if not arm.searched:
        cfg.augment.genotype = random_genotype_text(base, arm.seed, arm.index)
        if cfg.mode == "dpfnas":
            if searched_epsilon is None or not np.isfinite(searched_epsilon):
                raise ConfigError(f"seed {arm.seed}: the searched arm reported no ε to calibrate {arm.name} to")
            cfg.privacy.target_epsilon = float(searched_epsilon)
            cfg.privacy.max_epsilon = None
    return validate(cfg)
