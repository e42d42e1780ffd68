"""Where a party's batch sampling and noise come from, and who could predict them.

Under DP the noise hides a party's clipped gradient sum only from someone who cannot predict it, and the Poisson
subsampling amplifies privacy only for someone who does not know which examples were drawn. So a DP party's
randomness must be unpredictable to everyone but that party (docs/privacy.md, "Randomness"):

* ``secret`` (default under dpfnas): the party seeds its own generators from the OS CSPRNG when the run starts.
  The seed and the generator states never leave the party: they live in its own directory, for resuming.
* ``os`` (``privacy.secure_rng``): every noise draw comes straight from ``os.urandom``, and the party re-seeds its
  sampling generator from ``os.urandom`` before every Poisson batch: nothing to save, nothing to predict.
* ``reproducible`` (``privacy.reproducible_noise``, and every non-DP run): seeds derived from (seed, rank). Anyone
  holding the config regenerates the noise, so under DP the run's ε is void; for tests and debugging only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from mpi_fnas.privacy.params import Randomness


def os_seed() -> int:
    """63 bits from the operating system's CSPRNG."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def reproducible_seed(seed: int, rank: int, purpose: str, stage: str = "search") -> int:
    """Independent, reproducible seeds per (run seed, rank, purpose, stage): public, hence predictable."""
    stream = {"batches": 0, "noise": 1}[purpose] + {"search": 0, "augment": 2}[stage]
    return int(np.random.SeedSequence([seed, rank, stream]).generate_state(1, dtype=np.uint64)[0] >> 1)


@dataclass
class PartyRandomness:
    """A party's generators: ``sampling`` (CPU: batch order, Poisson coins) and ``noise`` (on the model's device,
    None when the noise comes from ``os.urandom``)."""

    source: Randomness
    sampling: torch.Generator
    noise: torch.Generator | None

    @classmethod
    def create(cls, source: Randomness, *, seed: int, rank: int, device: torch.device,
               stage: str = "search") -> PartyRandomness:
        """The generators of one stage (``search`` or ``augment``): each stage has streams of its own."""
        if source == "reproducible":
            sampling_seed = reproducible_seed(seed, rank, "batches", stage)
            noise_seed = reproducible_seed(seed, rank, "noise", stage)
        else:
            sampling_seed, noise_seed = os_seed(), os_seed()
        sampling = torch.Generator().manual_seed(sampling_seed)
        noise = None if source == "os" else torch.Generator(device=device).manual_seed(noise_seed)
        return cls(source, sampling, noise)

    @property
    def secure_rng(self) -> bool:
        """True when the noise is drawn from ``os.urandom`` (the release's ``secure_rng`` flag)."""
        return self.source == "os"
