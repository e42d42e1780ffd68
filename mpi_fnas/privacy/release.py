"""One kind of DP release a party makes, and the one object that says what it is (Opacus' DPOptimizer in spirit).

A :class:`Release` owns the public constants of the mechanism: σ (``noise_multiplier``), the per-example clip R,
the expected batch B (every release divides by it, never by the realised batch) and how many such releases one
iteration makes (``per_step``: 2 weight releases under ADADP). Everything else reads them from it:

* a party makes the release through :meth:`Release.make` (Poisson batch at rate B / N of its shard, per-example
  gradients, clip, sum, Gaussian noise from its secret stream, ÷ B: :func:`~mpi_fnas.privacy.mechanism.party_release`;
  no MPI here: the caller sends the vector it returns);
* the run's plan gives each stage its releases (the search: ``W`` and ``A``, from
  :meth:`mpi_fnas.privacy.params.DPParams.search_releases` in :class:`~mpi_fnas.privacy.params.PrivacyPlan`; the
  augmentation: its weights' release, :attr:`AugmentReleases.release`), the ledger
  (:mod:`mpi_fnas.privacy.federation_ledger`) charges them and the planner (:mod:`mpi_fnas.privacy.calibration`)
  sizes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from mpi_fnas.keystream import Keystream
from mpi_fnas.privacy.mechanism import party_release, secure_party_release
from mpi_fnas.privacy.per_sample import LossFn, Method, per_example_cross_entropy
from mpi_fnas.privacy.sampling import poisson_sample
from mpi_fnas.secagg.encoding import Encoding, padded_length
from mpi_fnas.wire import wire_type

if TYPE_CHECKING:
    from mpi_fnas.secagg.accounting import SecureAccounting
    from mpi_fnas.secagg.masks import PairwiseMasks
    from mpi_fnas.secagg.series import SecureSeries

#: ``examples(indices) -> (inputs (b, ...), targets (b,))``: a party's examples at Poisson-drawn positions (after
#: whatever per-example transform the stage applies, e.g. the augmentation's crops).
Examples = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


#: Each party's discrete Gaussian parameter σ_k² per coordinate, in integer units, under secure aggregation: 8000²,
#: the largest the exact sampler handles in 53-bit integers, so the rounding's share of the sensitivity (Δ₂ over
#: c/γ, with c/γ = √K·8000/σ) is as small as it can be; the sum's noise, √K·8000 units, fills ~17 of the 32 bits.
LOCAL_VARIANCE = 8000**2


@wire_type
@dataclass(frozen=True)
class SecureSum:
    """Public constants of secure aggregation (``privacy.aggregation: secure``, docs/privacy.md): K parties each add
    N_Z(0, `local_variance`) per coordinate to their integer-encoded release, so the sum carries the central
    variance K·σ_k², which is (σ·c/γ)² for the release's σ: the scale γ is chosen so. `dimension` is D, the padded
    length every release of the run is accounted at (its largest: the planner's
    :func:`~mpi_fnas.federation.job_plan.secure_dimension`); a longer release is refused."""

    parties: int  # K
    dimension: int  # D: the accounted (padded) length, ≥ every release's
    local_variance: int = LOCAL_VARIANCE  # σ_k², integer units
    bits: int = 32  # the sum lives mod 2^bits
    colluders: int = 0  # t: the parties the guarantee lets collude with the server (privacy.colluders)

    def __post_init__(self) -> None:
        if self.parties < 1 or self.dimension < 1 or padded_length(self.dimension) != self.dimension:
            raise ValueError(f"secure aggregation needs K >= 1 and a padded dimension (padded_length(D) == D), "
                             f"got K={self.parties}, D={self.dimension}")
        if not 0 <= self.colluders < self.parties:
            raise ValueError(f"secure aggregation: colluders must be in [0, K − 1], got {self.colluders} of "
                             f"K={self.parties}")

    def units_per_clip(self, noise_multiplier: float) -> float:
        """c/γ: integer units per clip bound, so that K·σ_k² = (σ·c/γ)²."""
        return math.sqrt(self.parties * self.local_variance) / noise_multiplier

    @property
    def accounting(self) -> SecureAccounting:
        """The accountant of these releases (:mod:`mpi_fnas.secagg.accounting`: rank 0's, with scipy)."""
        from mpi_fnas.secagg.accounting import SecureAccounting

        return SecureAccounting(self.parties, self.local_variance, self.dimension, self.colluders)

    def state_dict(self) -> dict[str, Any]:
        """The constants as plain values, for checkpoints and the wire."""
        return {"parties": self.parties, "dimension": self.dimension, "local_variance": self.local_variance,
                "bits": self.bits, "colluders": self.colluders}


@dataclass(frozen=True)
class Release:
    """The public constants of one kind of release (see the module doc)."""

    noise_multiplier: float  # σ: the noise std per coordinate is σ·R before the division by B
    clip: float  # R: the per-example L2 bound, the sensitivity of the sum
    expected_batch_size: float  # B = q·N: public; every release is divided by it
    per_step: int = 1  # releases of this kind per iteration (2 weight releases under ADADP)
    secure: SecureSum | None = None  # None: local noise (σ·R in full per party); else secure aggregation

    @property
    def aggregation(self) -> str:
        """``local`` or ``secure`` (the ``privacy.aggregation`` the release was planned for)."""
        return "local" if self.secure is None else "secure"

    def encoding(self, dimension: int) -> Encoding:
        """The integer encoding of a secure release of `dimension` coordinates (c = R, γ from σ and K)."""
        if self.secure is None:
            raise ValueError("a local release has no integer encoding")
        if padded_length(dimension) > self.secure.dimension:
            raise ValueError(f"a secure release of {dimension} coordinates exceeds the {self.secure.dimension} the "
                             "run's accountant covers (SecureSum.dimension)")
        scale = self.clip / self.secure.units_per_clip(self.noise_multiplier)
        return Encoding(dimension, self.clip, scale, bits=self.secure.bits)

    def sample_rate(self, shard_size: int) -> float:
        """q = B / N of a shard of `shard_size` examples (ValueError when B exceeds it: q would exceed 1)."""
        if self.expected_batch_size > shard_size:
            raise ValueError(f"the expected batch size {self.expected_batch_size:g} exceeds the shard "
                             f"({shard_size} examples): the Poisson rate B/N would exceed 1")
        return self.expected_batch_size / shard_size

    def make(self, model: nn.Module, params: Mapping[str, torch.Tensor], shard_size: int, examples: Examples,
             sampling: Keystream, noise: Keystream, *, loss_fn: LossFn = per_example_cross_entropy,
             method: Method = "auto", max_physical_batch: int | None = None, series: SecureSeries | None = None,
             masks: PairwiseMasks | None = None) -> torch.Tensor | np.ndarray:
        """One release over a Poisson batch I of the shard.

        Local: ``(Σ_{i ∈ I} clip(g_i, R) + N(0, (σR)² I)) / B``, ``(P,)`` on the parameters' device. Secure (with
        the party's `series` of this release and its `masks`): ``round(rotate(Σ_{i ∈ I} clip(g_i, R)) / γ) +
        N_Z(0, σ_k²)^D`` mod 2^bits plus the pairwise masks, ``(D,)`` uint32 (rank 0 opens the sum).

        `examples(indices)` gives the batch's examples (on the model's device); `sampling` draws the Poisson coins
        (and a secure release's rounding coins), `noise` the noise (the party's secret streams). The batch is
        processed in passes of at most `max_physical_batch` examples (None: one), which bounds memory and changes
        nothing else (:func:`~mpi_fnas.privacy.mechanism.clipped_gradient_sum`).
        """
        indices = poisson_sample(shard_size, self.sample_rate(shard_size), sampling)
        inputs, targets = examples(indices)
        if self.secure is None:
            return party_release(model, params, inputs, targets, clip_bound=self.clip,
                                 noise_multiplier=self.noise_multiplier, expected_batch_size=self.expected_batch_size,
                                 noise_stream=noise, loss_fn=loss_fn, method=method,
                                 max_physical_batch=max_physical_batch)
        if series is None or masks is None:
            raise ValueError("a secure release needs the party's series and pairwise masks")
        total = secure_party_release(model, params, inputs, targets, encoding=series.encoding,
                                     signs=series.next_signs(), local_variance=self.secure.local_variance,
                                     rounding_stream=sampling, noise_stream=noise, loss_fn=loss_fn, method=method,
                                     max_physical_batch=max_physical_batch)
        return series.seal(total, masks)


@dataclass(frozen=True)
class IterationReleases:
    """What one iteration of a stage releases on a party's two shards: ``(σ, q, releases)`` on each (q = 0: the
    stage never touches that shard). Built from the stage's :class:`Release` objects (:meth:`of`) by rank 0's
    ledger and by the party's own alike."""

    train: tuple[float, float, int]
    val: tuple[float, float, int]

    @classmethod
    def of(cls, train: Release, train_rate: float, val: Release, val_rate: float) -> IterationReleases:
        """The releases `train` at rate `train_rate` on the train shard and `val` at `val_rate` on the validation
        shard, each `per_step` times an iteration."""
        return cls(*((float(release.noise_multiplier), float(rate), int(release.per_step))
                     for release, rate in ((train, train_rate), (val, val_rate))))

    @classmethod
    def from_lists(cls, train: Sequence[float], val: Sequence[float]) -> IterationReleases:
        """From the ``[σ, q, releases]`` lists of a party's record."""
        return cls(*((float(s), float(q), int(r)) for s, q, r in (train, val)))

    def runs(self, iterations: int) -> tuple[tuple, tuple]:
        """((σ, q, count) runs on the train shard, the same on the validation shard) of `iterations` iterations."""
        return tuple(((sigma, rate, releases * int(iterations)),) if rate > 0 and iterations > 0 else ()
                     for sigma, rate, releases in (self.train, self.val))


def securely_aggregated(releases: Mapping[str, Release] | None) -> bool:
    """Whether a stage's releases (by name; None: not private) go through secure aggregation."""
    return releases is not None and any(release.secure is not None for release in releases.values())


AugmentPool = Literal["all", "train"]


@wire_type
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
    secure: SecureSum | None = None  # secure aggregation's constants (None: local noise)

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
        return Release(self.noise_multiplier, self.clip, self.expected_batch_size, self.releases_per_step, self.secure)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (JSON/HDF5-attribute friendly); :meth:`from_state_dict` restores it."""
        return {"noise_multiplier": float(self.noise_multiplier), "clip": float(self.clip),
                "expected_batch_size": float(self.expected_batch_size),
                "sample_rate_train": self.sample_rate_train.tolist(), "sample_rate_val": self.sample_rate_val.tolist(),
                "steps": self.steps, "stop_reason": self.stop_reason, "releases_per_step": self.releases_per_step,
                "secure": self.secure.state_dict() if self.secure is not None else None}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> AugmentReleases:
        """The releases a state of :meth:`state_dict` describes (older states without ``secure`` included)."""
        secure = state.get("secure")  # absent from states written before secure aggregation
        if secure and "dimension" not in secure:
            # Written when each example was encoded on its own and accounted at 2^22: its releases are not the ones
            # this version's accountant describes, so they cannot be continued.
            raise ValueError("the saved secure-aggregation state predates the encoding of the clipped sum; resume it "
                             "with the version that wrote it")
        return cls(**{**state, "secure": SecureSum(**secure) if secure else None})


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
        raise ValueError(f"augment.batch_size {expected_batch_size:g} exceeds party {party + 1}'s pool "
                         f"({int(n_pool[party])} examples, pool {pool!r}): the Poisson rate B/N must not exceed 1; "
                         "set a smaller augment.batch_size")
    rate = expected_batch_size / n_pool
    return rate, (rate.copy() if pool == "all" else np.zeros_like(rate))
