"""The discrete Gaussian N_Z(0, σ²), sampled exactly with integer arithmetic from a party's keystream.

N_Z(0, σ²) puts mass ∝ exp(−y²/(2σ²)) on every integer y. The sampler is Algorithm 3 of Canonne, Kamath & Steinke,
"The Discrete Gaussian for Differential Privacy" (NeurIPS 2020, arXiv 2004.00010): a discrete Laplace proposal
(their Algorithm 2) accepted with probability exp(−(|Y| − σ²/t)²/(2σ²)), every Bernoulli(exp(−γ)) drawn by their
Algorithm 1 from uniform integers only. σ² is a rational number; no floating point enters a draw, so the samples
follow N_Z(0, σ²) exactly (up to the keystream's indistinguishability from uniform bits), which a floating-point
sampler cannot promise in the tails where privacy is decided.

The algorithms run vectorised, in numpy (a round of rejection sampling is a few array operations on its pending
coordinates; in torch each operation's fixed cost was most of the sampler's time): every pending coordinate draws at
once and only the rejected ones draw again, so the stream's consumption depends on the outcomes (it is a secret
stream: nothing about it is released).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import torch

from mpi_fnas.keystream import UNIFORM_BITS, Keystream

#: The largest denominator 2·p·t²·q of a Bernoulli(exp(−γ)) in the acceptance step (σ² = p/q, t = ⌊σ⌋ + 1) that
#: :meth:`Keystream.integers` draws exactly: σ up to about 8,000 for an integer σ².
MAX_DENOMINATOR = 2**UNIFORM_BITS
#: Candidates drawn per missing value in a round of rejection sampling: a little above 1/acceptance of each sampler
#: (the discrete Laplace keeps ~63 % of its candidates, 1 − e^−1; the Gaussian step ~76 % of its Laplace draws at
#: σ = 8000), so most values are filled in the first round and few candidates are drawn in vain.
LAPLACE_OVERDRAW = 1.7
GAUSSIAN_OVERDRAW = 1.4
# |Y|·t·q − p below this squares within int64; beyond it (probability < exp(−2^31/t²)) Python integers take over.
_INT64_SAFE = 2**31


def bernoulli_exp(numerator: torch.Tensor, denominator: int, stream: Keystream) -> torch.Tensor:
    """Bernoulli(exp(−γ)) for each γ = numerator / denominator ≥ 0: bool tensor of numerator's shape.

    CKS20 Algorithm 1: exp(−γ) is a product of ⌊γ⌋ draws of Bernoulli(exp(−1)) and one of Bernoulli(exp(−f)) with
    f = γ − ⌊γ⌋ ∈ [0, 1); Bernoulli(exp(−f)) is the parity of the first k with A_k = 0, A_k ~ Bernoulli(f/k).
    Bernoulli(f/k) is one uniform integer below k·denominator compared with f's numerator while that product is
    within 2^53, and Bernoulli(f) ∧ Bernoulli(1/k) beyond (two draws, every integer within 2^53).
    """
    values = numerator.to(torch.int64).numpy()
    return torch.from_numpy(_bernoulli_exp(values.reshape(-1), denominator, stream).reshape(values.shape))


def _bernoulli_exp(numerator: np.ndarray, denominator: int, stream: Keystream) -> np.ndarray:
    if not 1 <= denominator <= MAX_DENOMINATOR:
        raise ValueError(f"bernoulli_exp: the denominator must be in [1, 2^53], got {denominator}")
    whole = numerator // denominator
    return _bernoulli_exp_split(whole, numerator - whole * denominator, denominator, stream)


def _bernoulli_exp_split(whole: np.ndarray, fraction: np.ndarray, denominator: int,
                         stream: Keystream) -> np.ndarray:
    """Bernoulli(exp(−(whole + fraction / denominator))), with 0 ≤ fraction < denominator."""
    result = _bernoulli_exp_fraction(fraction, denominator, stream)
    # ⌊γ⌋ factors of Bernoulli(exp(−1)): round r kills the elements that still owe a factor and draw 0.
    alive = np.flatnonzero(result & (whole > 0))
    rounds = 0
    while alive.size:
        rounds += 1
        keep = _bernoulli_exp_fraction(np.ones(alive.size, dtype=np.int64), 1, stream)
        result[alive[~keep]] = False
        alive = alive[keep & (whole[alive] > rounds)]
    return result


def _bernoulli_exp_fraction(fraction: np.ndarray, denominator: int, stream: Keystream) -> np.ndarray:
    """Bernoulli(exp(−f)) for f = fraction / denominator ∈ [0, 1] (CKS20 Algorithm 1, γ ≤ 1)."""
    odd = np.zeros(fraction.size, dtype=bool)
    pending = np.arange(fraction.size)
    k = 1
    while pending.size:
        if k == 1 and denominator == 1:  # Bernoulli(f) with f ∈ {0, 1} (the exp(−1) factors): no draw needed
            hit = fraction >= 1
        elif k * denominator <= MAX_DENOMINATOR:  # Bernoulli(f/k) in one draw: P = fraction / (k·denominator)
            hit = stream.integers_array(k * denominator, pending.size) < fraction
        else:
            hit = stream.integers_array(denominator, pending.size) < fraction  # Bernoulli(f)
            hit &= stream.integers_array(k, pending.size) == 0  # ∧ Bernoulli(1/k)
        if k % 2:
            odd[pending[~hit]] = True
        pending, fraction = pending[hit], fraction[hit]
        k += 1
    return odd


def discrete_laplace(n: int, scale: int, stream: Keystream) -> torch.Tensor:
    """``(n,)`` int64 from the discrete Laplace with P(y) ∝ exp(−|y|/scale), integer scale ≥ 1 (CKS20 Algorithm 2)."""
    return torch.from_numpy(_discrete_laplace(n, scale, stream))


def _discrete_laplace(n: int, scale: int, stream: Keystream) -> np.ndarray:
    if scale < 1:
        raise ValueError(f"discrete_laplace: the scale must be an integer >= 1, got {scale}")
    return _fill(n, lambda m: _laplace_candidates(m, scale, stream), LAPLACE_OVERDRAW)


def _laplace_candidates(m: int, scale: int, stream: Keystream) -> tuple[np.ndarray, np.ndarray]:
    """`m` candidates of CKS20 Algorithm 2 and whether each was accepted."""
    u = stream.integers_array(scale, m)
    accepted = _bernoulli_exp(u, scale, stream)  # U uniform on 0..t−1, kept with probability exp(−U/t)
    v = np.zeros(m, dtype=np.int64)  # V: the number of Bernoulli(exp(−1)) successes before a failure
    counting = np.flatnonzero(accepted)
    while counting.size:
        more = _bernoulli_exp_fraction(np.ones(counting.size, dtype=np.int64), 1, stream)  # Bernoulli(exp(−1))
        counting = counting[more]
        v[counting] += 1
    magnitude = u + scale * v
    negative = stream.integers_array(2, m) == 1
    accepted &= ~(negative & (magnitude == 0))  # −0 is redrawn: zero would otherwise be counted twice
    return np.where(negative, -magnitude, magnitude), accepted


def _fill(n: int, candidates: Callable[[int], tuple[np.ndarray, np.ndarray]], overdraw: float) -> np.ndarray:
    """``(n,)`` int64 of accepted candidates, in the order drawn. Each round draws for every missing value with a
    margin (`overdraw` candidates per value), so a rejection sampler finishes in a few vectorised rounds instead of a
    long tail of small ones; keeping the first accepted i.i.d. candidates keeps their distribution."""
    out = np.zeros(n, dtype=np.int64)
    filled = 0
    while filled < n:
        values, accepted = candidates(math.ceil((n - filled) * overdraw) + 16)
        kept = values[accepted][: n - filled]
        out[filled : filled + kept.size] = kept
        filled += kept.size
    return out


def discrete_gaussian(n: int, sigma_squared: Fraction | int, stream: Keystream) -> torch.Tensor:
    """``(n,)`` int64, i.i.d. N_Z(0, σ²) for a rational σ² > 0 (CKS20 Algorithm 3, exact)."""
    variance = Fraction(sigma_squared)
    if variance <= 0:
        raise ValueError(f"discrete_gaussian: σ² must be > 0, got {sigma_squared}")
    p, q = variance.numerator, variance.denominator
    t = math.isqrt(p // q) + 1  # ⌊σ⌋ + 1
    denominator = 2 * p * t * t * q  # γ = (|Y|·t·q − p)² / (2·p·t²·q) = (|Y| − σ²/t)² / (2σ²)
    if denominator > MAX_DENOMINATOR:
        raise ValueError(f"discrete_gaussian: σ² = {variance} is too large for exact 53-bit draws (σ ≲ 8,000)")
    return torch.from_numpy(_fill(n, lambda m: _gaussian_candidates(m, p, q, t, denominator, stream),
                                  GAUSSIAN_OVERDRAW))


def _gaussian_candidates(m: int, p: int, q: int, t: int, denominator: int,
                         stream: Keystream) -> tuple[np.ndarray, np.ndarray]:
    """`m` candidates of CKS20 Algorithm 3 (σ² = p/q, t = ⌊σ⌋ + 1) and whether each was accepted."""
    y = _discrete_laplace(m, t, stream)
    centred = np.abs(y) * (t * q) - p
    if bool((np.abs(centred) >= _INT64_SAFE).any()):
        return y, _accept_wide(centred, denominator, stream)
    return y, _bernoulli_exp(centred * centred, denominator, stream)


def _accept_wide(centred: np.ndarray, denominator: int, stream: Keystream) -> np.ndarray:
    """The acceptance step when some (|Y|·t·q − p)² would overflow int64: ⌊γ⌋ and the fraction in Python integers
    (⌊γ⌋ capped at 2^62: a γ that large is rejected by its first factors long before the cap matters)."""
    squares = [int(c) ** 2 for c in centred.tolist()]
    whole = np.array([min(s // denominator, 2**62) for s in squares], dtype=np.int64)
    fraction = np.array([s % denominator for s in squares], dtype=np.int64)
    return _bernoulli_exp_split(whole, fraction, denominator, stream)
