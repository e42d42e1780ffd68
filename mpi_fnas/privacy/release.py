"""One kind of DP release a party makes, and the one object that says what it is (Opacus' DPOptimizer in spirit).

A :class:`Release` owns the public constants of the mechanism: σ (``noise_multiplier``), the per-example clip R,
the expected batch B (every release divides by it, never by the realised batch) and how many such releases one
iteration makes (``per_step``: 2 weight releases under ADADP). Everything else reads them from it:

* a party makes the release through :meth:`Release.make` (Poisson batch at rate B / N of its shard, per-example
  gradients, clip, sum, Gaussian noise from its secret stream, ÷ B: :func:`~mpi_fnas.privacy.mechanism.party_release`;
  no MPI here: the caller sends the vector it returns);
* the run's plan gives each stage its releases (the search: ``W`` and ``A``, from
  :meth:`mpi_fnas.privacy.params.DPParams.search_releases` in :class:`PrivacyPlan`; the augmentation: its
  weights' release, :attr:`AugmentReleases.release`), the ledger (:mod:`mpi_fnas.privacy.ledger`) charges them and
  the planner (:mod:`mpi_fnas.privacy.planning`) sizes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from mpi_fnas.privacy.keystream import Keystream
from mpi_fnas.privacy.mechanism import party_release
from mpi_fnas.privacy.per_sample import LossFn, Method, per_example_cross_entropy
from mpi_fnas.privacy.sampling import poisson_sample

if TYPE_CHECKING:  # params builds the search's releases: the type only, no import cycle
    from mpi_fnas.privacy.params import DPParams

#: ``examples(indices) -> (inputs (b, ...), targets (b,))``: a party's examples at Poisson-drawn positions (after
#: whatever per-example transform the stage applies, e.g. the augmentation's crops).
Examples = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Release:
    """The public constants of one kind of release (see the module doc)."""

    noise_multiplier: float  # σ: the noise std per coordinate is σ·R before the division by B
    clip: float  # R: the per-example L2 bound, the sensitivity of the sum
    expected_batch_size: float  # B = q·N: public; every release is divided by it
    per_step: int = 1  # releases of this kind per iteration (2 weight releases under ADADP)

    def sample_rate(self, shard_size: int) -> float:
        """q = B / N of a shard of `shard_size` examples (ValueError when B exceeds it: q would exceed 1)."""
        if self.expected_batch_size > shard_size:
            raise ValueError(f"the expected batch size {self.expected_batch_size:g} exceeds the shard "
                             f"({shard_size} examples): the Poisson rate B/N would exceed 1")
        return self.expected_batch_size / shard_size

    def make(self, model: nn.Module, params: Mapping[str, torch.Tensor], shard_size: int, examples: Examples,
             sampling: Keystream, noise: Keystream, *, loss_fn: LossFn = per_example_cross_entropy,
             method: Method = "auto") -> torch.Tensor:
        """One release: ``(Σ_{i ∈ I} clip(g_i, R) + N(0, (σR)² I)) / B`` over a Poisson batch I of the shard.

        `examples(indices)` gives the batch's examples (on the model's device); `sampling` draws the Poisson coins,
        `noise` the Gaussian noise (the party's secret streams). Returns ``(P,)`` on the parameters' device.
        """
        indices = poisson_sample(shard_size, self.sample_rate(shard_size), sampling)
        inputs, targets = examples(indices)
        return party_release(model, params, inputs, targets, clip_bound=self.clip,
                             noise_multiplier=self.noise_multiplier, expected_batch_size=self.expected_batch_size,
                             noise_stream=noise, loss_fn=loss_fn, method=method)


AugmentPool = Literal["all", "train"]


@dataclass(frozen=True)
class AugmentReleases:
    """Public constants of the augment stage's releases. Arrays are (K,), party k at index k - 1.

    Each augment iteration, every party makes ``releases_per_step`` releases (:attr:`release`) of its pool (2 under
    ``augment.optimizer: adadp``, each on a fresh Poisson batch). A record of party k's train shard is sampled with
    rate ``sample_rate_train[k]``, one of its validation shard with ``sample_rate_val[k]`` (0: the pool leaves that
    shard out, and its ledger is not charged).
    """

    noise_multiplier: float
    clip: float
    expected_batch_size: float
    sample_rate_train: np.ndarray
    sample_rate_val: np.ndarray
    steps: int  # augment iterations planned (≤ the configured ones)
    stop_reason: str = "completed"  # or why fewer augment steps were planned
    releases_per_step: int = 1  # weight releases per augment iteration (2 under ADADP: at W, then at W_half)

    def __post_init__(self) -> None:
        # Frozen: the arrays are normalised through object.__setattr__, once, here.
        rate_train = np.array(self.sample_rate_train, dtype=np.float64)
        rate_val = np.array(self.sample_rate_val, dtype=np.float64)
        if rate_train.ndim != 1 or rate_train.shape != rate_val.shape:
            raise ValueError(f"augment sample rates must be two (K,) arrays, got shapes {rate_train.shape} and "
                             f"{rate_val.shape}")
        if not all(np.all((rates >= 0) & (rates <= 1)) for rates in (rate_train, rate_val)):
            raise ValueError("augment sample rates must be in [0, 1]")
        if not (self.noise_multiplier > 0 and np.isfinite(self.noise_multiplier)):
            raise ValueError(f"augment noise multiplier must be positive and finite, got {self.noise_multiplier}")
        if not (self.clip > 0 and self.expected_batch_size > 0):
            raise ValueError(f"augment clip and batch size must be > 0, got {self.clip:g} and "
                             f"{self.expected_batch_size:g}")
        if int(self.steps) != self.steps or self.steps < 0:
            raise ValueError(f"augment steps must be a non-negative integer, got {self.steps}")
        if int(self.releases_per_step) != self.releases_per_step or self.releases_per_step < 1:
            raise ValueError(f"augment releases per step must be an integer >= 1, got {self.releases_per_step}")
        for name, value in (("sample_rate_train", rate_train), ("sample_rate_val", rate_val),
                            ("steps", int(self.steps)), ("releases_per_step", int(self.releases_per_step))):
            object.__setattr__(self, name, value)

    @property
    def release(self) -> Release:
        """The release a party makes each time (σ, clip, B, releases per iteration)."""
        return Release(self.noise_multiplier, self.clip, self.expected_batch_size, self.releases_per_step)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (JSON/HDF5-attribute friendly); :meth:`from_state_dict` restores it."""
        return {"noise_multiplier": float(self.noise_multiplier), "clip": float(self.clip),
                "expected_batch_size": float(self.expected_batch_size),
                "sample_rate_train": self.sample_rate_train.tolist(), "sample_rate_val": self.sample_rate_val.tolist(),
                "steps": self.steps, "stop_reason": self.stop_reason, "releases_per_step": self.releases_per_step}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> AugmentReleases:
        return cls(**state)


@dataclass(frozen=True)
class PrivacyPlan:
    """Public constants of a DP run. Arrays are (K,), party k at index k - 1. ``params`` is what every party
    receives (σ calibrated by the planner under ``target_epsilon``)."""

    params: DPParams
    sample_rate_train: np.ndarray
    sample_rate_val: np.ndarray
    delta: np.ndarray
    steps: int  # iterations the run will take (≤ the configured epochs × steps per epoch)
    stop_reason: str  # "completed" or why fewer steps were planned
    augment: AugmentReleases | None = None  # the augment stage as planned with the search (σ, steps), if it was
    # W releases per search iteration on the train shard: 2 under ADADP (G1 and G2, each on a fresh Poisson
    # batch), else 1. The validation shard pays one A release per iteration either way.
    w_releases_per_step: int = 1


def augment_sample_rates(
    train_sizes: Sequence[int],
    val_sizes: Sequence[int],
    expected_batch_size: float,
    pool: AugmentPool,
) -> tuple[np.ndarray, np.ndarray]:
    """(K,) Poisson rate of a party's train records and (K,) of its validation records in one augment release.

    ``pool="all"``: the party samples its train and validation shards together, so every record of either has
    rate B / (N_tr + N_val). ``pool="train"``: only the train shard, rate B / N_tr; validation records have rate 0
    (never touched). Raises ValueError, one line, when B exceeds a party's pool.
    """
    if pool not in ("all", "train"):
        raise ValueError(f"augment pool must be 'all' or 'train', got {pool!r}")
    n_pool = np.asarray(train_sizes, dtype=np.float64)
    if pool == "all":
        n_pool = n_pool + np.asarray(val_sizes, dtype=np.float64)
    if not expected_batch_size > 0:
        raise ValueError(f"augment batch size must be > 0, got {expected_batch_size:g}")
    if np.any(n_pool < expected_batch_size):
        party = int(np.argmin(n_pool))
        raise ValueError(f"augment batch size {expected_batch_size:g} exceeds party {party + 1}'s pool "
                         f"({int(n_pool[party])} examples, pool {pool!r}): the Poisson rate B/N must not exceed 1")
    rate = expected_batch_size / n_pool
    return rate, (rate.copy() if pool == "all" else np.zeros_like(rate))
