"""The arms of a baseline: for each seed, the searched arm, R random cells and the hand-designed networks asked
for, each one's run directory and config. No MPI, no autograd.

* ``searched``: the configured job as it is (search, then the augmentation of the cell it found), at ``seed``;
* ``random-<i>``: the same augmentation, with no search, of a genotype drawn uniformly from the same space without
  the sigmoid activation (``search_space(kind).random_genotype``): a public draw, seeded with (RANDOM_TAG, seed, i),
  so the same command draws the same cells, and the cell is logged (``augment.genotype``, ``baseline.csv``);
* ``cnn-tanh``, ``cnn-gn`` (``--handcrafted``): the same augmentation of that hand-designed network
  (``augment.network``), with no search. It has no cell paths to drop and no auxiliary head, so its
  ``augment.drop_path`` and ``augment.auxiliary_weight`` are 0.

Under DP every arm runs at the user's own privacy settings (``privacy.target_epsilon``, its caps and δ): the
searched arm's search and augmentation together, any other arm's augmentation alone (docs/privacy.md §3.1). No
arm's config depends on anything rank 0 measured, so each party derives every arm's config from its own command
line and refuses any other (:mod:`mpi_fnas.baseline.command`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpi_fnas.config import CELL_NETWORK, HANDCRAFTED_NETWORKS, Config, ConfigError, validate

SEARCHED = "searched"
RANDOM_PREFIX = "random-"
#: Mixed into the genotype draw's seed so that it shares no stream with any other use of the run seed.
RANDOM_TAG = 0xBA5E
#: The random cells leave out the sigmoid activation (the DPNAS space's ``conv_3x3_sigmoid``): it rarely trains
#: under DP, so a control that draws it would measure little more than the search's avoiding it.
SIGMOID_SUFFIX = "_sigmoid"


@dataclass(frozen=True)
class Arm:
    """One run of the baseline: `name` (``searched``, ``random-<i>`` or a hand-designed network's) at `seed`."""

    name: str
    seed: int

    @property
    def searched(self) -> bool:
        return self.name == SEARCHED

    @property
    def handcrafted(self) -> bool:
        """Whether the arm trains a hand-designed network (its name is the network's, ``augment.network``)."""
        return self.name in HANDCRAFTED_NETWORKS

    @property
    def network(self) -> str:
        """The arm's ``augment.network``: its own name for a hand-designed arm, else ``cell``."""
        return self.name if self.handcrafted else CELL_NETWORK

    @property
    def index(self) -> int:
        """i of ``random-<i>`` (−1 for the searched and the hand-designed arms)."""
        return int(self.name[len(RANDOM_PREFIX):]) if self.name.startswith(RANDOM_PREFIX) else -1

    def run_dir(self, out: Path) -> Path:
        """``OUT/seed<seed>/<name>``: where the arm's ``search.h5`` goes."""
        return Path(out) / f"seed{self.seed}" / self.name


def arms(seeds: list[int], random: int, handcrafted: Sequence[str] = ()) -> list[Arm]:
    """Every arm, seed by seed: the searched arm first (the others need its ε), then random-0 .. random-(R-1), then
    the `handcrafted` networks in the order given."""
    return [Arm(name, seed) for seed in seeds
            for name in (SEARCHED, *(f"{RANDOM_PREFIX}{i}" for i in range(random)), *handcrafted)]


def parse_handcrafted(text: str | None) -> list[str]:
    """The networks of ``--handcrafted`` (comma-separated, e.g. ``cnn-tanh,cnn-gn``; None or "": none); ConfigError
    (one line) for an unknown or repeated name."""
    names = [name.strip() for name in (text or "").split(",") if name.strip()]
    unknown = [name for name in names if name not in HANDCRAFTED_NETWORKS]
    if unknown:
        raise ConfigError(f"--handcrafted: unknown network {unknown[0]!r}; expected a comma-separated list of "
                          f"{', '.join(HANDCRAFTED_NETWORKS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"--handcrafted: a network is named twice in {text!r}")
    return names


def random_genotype_text(cfg: Config, seed: int, index: int) -> str:
    """Cell `index` of seed `seed`: drawn uniformly from ``cfg.space`` without the sigmoid activation, with the public
    generator (see the module)."""
    from mpi_fnas.space import search_space  # torch: only where a genotype is drawn

    kind = search_space(cfg.space.kind)
    ops = [op for op in kind.candidates(cfg.space) if not op.endswith(SIGMOID_SUFFIX)]
    rng = np.random.default_rng([RANDOM_TAG, seed, index])
    return kind.random_genotype(dataclasses.replace(cfg.space, ops=ops), rng).to_string()


def check_base(cfg: Config) -> None:
    """ConfigError (one line) for a config the baseline cannot compare arms with."""
    if cfg.augment.epochs == 0:
        raise ConfigError("augment.epochs: the baseline compares cells trained from scratch; set augment.epochs > 0")
    if cfg.augment.genotype is not None:
        raise ConfigError("augment.genotype: the baseline draws the random cells itself and searches the other; "
                          "leave augment.genotype unset")
    if cfg.augment.network != CELL_NETWORK:
        raise ConfigError(f"augment.network: the baseline's searched arm trains its cell; leave augment.network: cell "
                          f"and ask for {cfg.augment.network} with --handcrafted {cfg.augment.network}")
    if cfg.mode == "dpfnas" and not cfg.augment.private:
        raise ConfigError("augment.private: false trains with exact gradients, so the arms' ε cannot be made equal; "
                          "the baseline needs a private augmentation under dpfnas")
    if cfg.mode == "dpfnas" and cfg.privacy.target_epsilon is None:
        raise ConfigError("privacy.target_epsilon: the baseline compares its arms at one total ε, which each arm is "
                          "calibrated to; set privacy.target_epsilon (e.g. --set privacy.target_epsilon=3)")


def arm_config(base: Config, arm: Arm) -> Config:
    """The run config of `arm`: `base` at the arm's seed; a random arm trains its drawn cell, a hand-designed arm its
    network (no drop-path, no auxiliary head). Its privacy section is `base`'s as it is (the same target, caps and
    δ): a function of `base` and `arm` alone, so every party derives it itself."""
    cfg = copy.deepcopy(base)
    cfg.seed = arm.seed
    if arm.handcrafted:
        cfg.augment.network = arm.network
        cfg.augment.drop_path = cfg.augment.auxiliary_weight = 0.0
    elif not arm.searched:
        cfg.augment.genotype = random_genotype_text(base, arm.seed, arm.index)
    return validate(cfg)


def earlier_arms(out: Path, arm: Arm, rank: int) -> list[tuple[Path, bool]]:
    """Party `rank`'s own directories of every other arm it ran under the baseline directory `out` (whatever
    seed, whatever order they ran in), each with whether it split the data as `arm` does (the same seed): the
    releases its ``privacy.party_max_epsilon`` composes with `arm`'s."""
    own = Path(out) / f"seed{arm.seed}" / arm.name
    found = []
    for directory in sorted(Path(out).glob(f"seed*/*/parties/rank{rank}")):
        run = directory.parent.parent
        if run != own and directory.is_dir():
            found.append((directory, run.parent.name == f"seed{arm.seed}"))
    return found
