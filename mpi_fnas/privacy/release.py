"""One kind of DP release a party makes, and the one object that says what it is (Opacus' DPOptimizer in spirit).

A :class:`Release` owns the public constants of the mechanism: σ (``noise_multiplier``), the per-example clip R,
the expected batch B (every release divides by it, never by the realised batch) and how many such releases one
iteration makes (``per_step``: 2 weight releases under ADADP). Everything else reads them from it:

* a party makes the release through :meth:`Release.make` (Poisson batch at rate B / N of its shard, per-example
  gradients, clip, sum, Gaussian noise from its secret stream, ÷ B: :func:`~mpi_fnas.privacy.mechanism.party_release`);
* the run's plan gives each stage its releases (the search: ``W`` and ``A``, from
  :meth:`mpi_fnas.privacy.params.DPParams.search_releases`; the augmentation: its weights' release,
  :attr:`mpi_fnas.privacy.budget.AugmentReleases.release`), and the log's privacy schema is built from them.

No MPI here: the caller sends the vector :meth:`Release.make` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mpi_fnas.privacy.keystream import Keystream
from mpi_fnas.privacy.mechanism import party_release
from mpi_fnas.privacy.per_sample import LossFn, Method, per_example_cross_entropy
from mpi_fnas.privacy.sampling import poisson_sample

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
