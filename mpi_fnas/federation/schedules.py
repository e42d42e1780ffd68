"""The public schedules of a stage: pure functions of the config and the step, so every rank follows them without
a message (the parties need ξ for the second-order term, the drop-path probability for their masks and, under
``search.method: gdas``, the path's Gumbel draw)."""

from __future__ import annotations

import math

import torch

from mpi_fnas.config import AugmentConfig, SearchConfig
from mpi_fnas.keystream import Keystream


def cosine(start: float, end: float, progress: float) -> float:
    """The cosine annealing of DARTS at `progress` in [0, 1]: `start` → `end`."""
    return end + 0.5 * (start - end) * (1.0 + math.cos(math.pi * progress))


def search_learning_rate(search: SearchConfig, epoch: int) -> float:
    """The search's W learning rate ξ of `epoch` (0-based): w_lr → w_lr_min over `epochs`, once per epoch."""
    return cosine(search.w_lr, search.w_lr_min, min(epoch, search.epochs) / search.epochs)


def gdas_temperature(search: SearchConfig, epoch: int) -> float:
    """GDAS's τ of `epoch` (0-based): ``gdas_temperature``, or with ``gdas_temperature_final`` a linear anneal from
    the first to the last of ``epochs`` (Dong & Yang: 10 to 0.1), held after it."""
    if search.gdas_temperature_final is None or search.epochs <= 1:
        return search.gdas_temperature
    share = min(epoch, search.epochs - 1) / (search.epochs - 1)
    return search.gdas_temperature + (search.gdas_temperature_final - search.gdas_temperature) * share


def augment_learning_rate(cfg: AugmentConfig, step: int, steps: int) -> float:
    """The augmentation's learning rate of iteration `step` (1-based) of `steps`: lr → lr_min, per step."""
    return cosine(cfg.lr, cfg.lr_min, (step - 1) / max(steps, 1))


def drop_path_probability(cfg: AugmentConfig, step: int, steps_per_epoch: int) -> float:
    """DARTS' linear ramp: ``drop_path · epoch / epochs`` with the 0-based epoch of `step` (1-based)."""
    epoch = (step - 1) // steps_per_epoch
    return cfg.drop_path * epoch / max(cfg.epochs, 1)


def path_noise(seed: int, step: int, shape: tuple[int, int], label: str = "") -> torch.Tensor:
    """The Gumbel draw (edges, ops) of search iteration `step` under ``search.method: gdas``: one public stream per
    (seed, step), so every party runs the same path whatever it has drawn before (a resume too), and no secret
    draw is spent on it (the path depends on no data). `label`: a searched choice's draw (``stem``, ``head``), a
    stream of its own."""
    labels = ("gdas-path", seed, step, label) if label else ("gdas-path", seed, step)
    uniform = Keystream.from_labels(*labels).uniform(shape).clamp_min(2.0 ** -53)  # log(0)
    return -torch.log(-torch.log(uniform)).to(torch.float32)
