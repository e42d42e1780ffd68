"""Where a party's batches, coins, augmentations and noise come from, and who could predict them.

Under DP the noise hides a party's clipped gradient sum only from someone who cannot predict it, and the Poisson
subsampling amplifies privacy only for someone who does not know which examples were drawn. So every random
number a DP party draws comes from a :class:`~mpi_fnas.keystream.Keystream` (AES-256-CTR) keyed on the
party itself (docs/privacy.md §2.1):

* ``secret`` (always under dpfnas): each stream's key is 256 bits of ``os.urandom``, drawn when the party's stage
  starts, in every launch (a replayed step draws fresh randomness); no key leaves its memory, not to its state file.
* ``reproducible`` (``privacy.reproducible_noise``, and every non-DP run): the keys are SHA-256 of (seed, rank,
  stage, purpose). Anyone holding the config rebuilds the streams, so under DP the run's ε is void; for tests
  and debugging only. The draws go through the same code as the secret ones.

Each stage (``search``, ``augment``) has two streams of its own: ``sampling`` (batch order, Poisson coins, and
in the augmentation every example's crop, flip, cutout and drop-path masks) and ``noise`` (the Gaussian noise).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpi_fnas.keystream import Keystream
from mpi_fnas.privacy.params import Randomness

PURPOSES = ("sampling", "noise")


def party_stream(source: Randomness, *, seed: int, rank: int, stage: str, purpose: str) -> Keystream:
    """One stream of party `rank`: secret (keyed from the OS) or reproducible (keyed from public labels)."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown stream purpose {purpose!r}; expected one of {PURPOSES}")
    if source == "reproducible":
        return Keystream.from_labels("party", seed, rank, stage, purpose)
    if source == "secret":
        return Keystream.from_os()
    raise ValueError(f"unknown randomness source {source!r}")


@dataclass
class PartyRandomness:
    """A party's two streams of one stage: ``sampling`` and ``noise`` (see the module doc)."""

    source: Randomness
    sampling: Keystream
    noise: Keystream

    @property
    def secret(self) -> bool:
        """Keyed from the OS: never saved, never restored (a resumed party draws new keys)."""
        return self.source == "secret"

    @classmethod
    def create(cls, source: Randomness, *, seed: int, rank: int, stage: str = "search") -> PartyRandomness:
        """The streams of one stage (``search`` or ``augment``): each stage has streams of its own."""
        return cls(source, *(party_stream(source, seed=seed, rank=rank, stage=stage, purpose=purpose)
                             for purpose in PURPOSES))


def server_stream(reproducible: bool, *, seed: int, stage: str) -> Keystream:
    """Rank 0's own stream of secret draws in `stage` (SecProbe's selection): keyed from the OS, or under
    ``privacy.reproducible_noise`` from (seed, stage) (the run's ε is void anyway, and so is the selection's)."""
    return Keystream.from_labels("server", seed, stage, "selection") if reproducible else Keystream.from_os()
