"""Poisson subsampling of a party's shard (the sampling Theorem 3.1 and the PLD accountant assume).

Each example is included independently with probability q, so the batch size is Binomial(N, q) and may be 0.
This is NOT "shuffle and take B": the privacy amplification the accountant credits holds only for this scheme.
"""

from __future__ import annotations

import torch

from mpi_fnas.keystream import Keystream


def poisson_sample(num_examples: int, sample_rate: float, stream: Keystream) -> torch.Tensor:
    """Indices of a Poisson subsample of ``range(num_examples)``.

    Args:
        num_examples: shard size N (>= 0).
        sample_rate: inclusion probability q in [0, 1] (q = B / N for expected batch size B).
        stream: the party's secret :class:`~mpi_fnas.keystream.Keystream`, source of the coins.

    Returns:
        int64 CPU tensor ``(b,)`` of distinct, increasing indices, ``b ~ Binomial(N, q)``; ``b = 0`` is valid.
    """
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    if not 0.0 <= sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
    # float64 coins (a 2^-53 grid): float32 ones (a 2^-24 grid, and q rounded to float32 in the comparison)
    # realise a rate on the 2^-24 grid, not q: for small q that is not the rate the accountant was given.
    coins = stream.uniform(num_examples)
    # The coins are in [0, 1): q = 1 includes everyone and q = 0 no one, as the accountant assumes.
    return torch.nonzero(coins < sample_rate, as_tuple=False).reshape(-1).to(torch.int64)
