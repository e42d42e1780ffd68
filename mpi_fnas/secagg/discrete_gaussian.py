"""The discrete Gaussian N_Z(0, σ²), sampled exactly with integer arithmetic from a party's keystream.

N_Z(0, σ²) puts mass ∝ exp(−y²/(2σ²)) on every integer y. The sampler is Algorithm 3 of Canonne, Kamath & Steinke,
"The Discrete Gaussian for Differential Privacy" (NeurIPS 2020, arXiv 2004.00010): a discrete Laplace proposal
(their Algorithm 2) accepted with probability exp(−(|Y| − σ²/t)²/(2σ²)), every Bernoulli(exp(−γ)) drawn by their
Algorithm 1 from uniform integers only. σ² is a rational number; no floating point enters a draw, so the samples
follow N_Z(0, σ²) exactly (up to the keystream's indistinguishability from uniform bits), which a floating-point
sampler cannot promise in the tails where privacy is decided.

The algorithms run vectorised: every pending coordinate draws at once and only the rejected ones draw again, so the
stream's consumption depends on the outcomes (it is a secret stream: nothing about it is released).
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from mpi_fnas.privacy.keystream import UNIFORM_BITS, Keystream

#: The largest denominator 2·p·t²·q of a Bernoulli(exp(−γ)) in the acceptance step (σ² = p/q, t = ⌊σ⌋ + 1) that
#: :meth:`Keystream.integers` draws exactly: σ up to about 8,000 for an integer σ².
MAX_DENOMINATOR = 2**UNIFORM_BITS
#: Candidates drawn per missing value in a round of rejection sampling (both samplers accept more than half).
OVERDRAW = 2.0
# |Y|·t·q − p below this squares within int64; beyond it (probability < exp(−2^31/t²)) Python integers take over.
_INT64_SAFE = 2**31


def bernoulli_exp(numerator: torch.Tensor, denominator: int, stream: Keystream) -> torch.Tensor:
    """Bernoulli(exp(−γ)) for each γ = numerator / denominator ≥ 0: bool tensor of numerator's shape.

    CKS20 Algorithm 1: exp(−γ) is a product of ⌊γ⌋ draws of Bernoulli(exp(−1)) and one of Bernoulli(exp(−f)) with
    f = γ − ⌊γ⌋ ∈ [0, 1); Bernoulli(exp(−f)) is the parity of the first k with A_k = 0, A_k ~ Bernoulli(f/k), and
    Bernoulli(f/k) = Bernoulli(f) ∧ Bernoulli(1/k) keeps every uniform integer within 2^53.
    """
    if not 1 <= denominator <= MAX_DENOMINATOR:
        raise ValueError(f"bernoulli_exp: the denominator must be in [1, 2^53], got {denominator}")
    numerator = numerator.to(torch.int64)
    whole = torch.div(numerator, denominator, rounding_mode="floor")
    return _bernoulli_exp_split(whole, numerator - whole * denominator, denominator, stream)


def _bernoulli_exp_split(whole: torch.Tensor, fraction: torch.Tensor, denominator: int,
                         stream: Keystream) -> torch.Tensor:
    """Bernoulli(exp(−(whole + fraction / denominator))), with 0 ≤ fraction < denominator."""
    result = _bernoulli_exp_fraction(fraction, denominator, stream)
    # ⌊γ⌋ factors of Bernoulli(exp(−1)): round r kills the elements that still owe a factor and draw 0.
    alive = torch.nonzero(result & (whole > 0)).reshape(-1)
    rounds = 0
    while alive.numel():
        rounds += 1
        keep = _bernoulli_exp_fraction(torch.ones(alive.numel(), dtype=torch.int64), 1, stream)
        result[alive[~keep]] = False
        alive = alive[keep & (whole[alive] > rounds)]
    return result


def _bernoulli_exp_fraction(fraction: torch.Tensor, denominator: int, stream: Keystream) -> torch.Tensor:
    """Bernoulli(exp(−f)) for f = fraction / denominator ∈ [0, 1] (CKS20 Algorithm 1, γ ≤ 1)."""
    fraction = fraction.reshape(-1)
    odd = torch.zeros(fraction.numel(), dtype=torch.bool)
    pending = torch.arange(fraction.numel())
    k = 1
    while pending.numel():
        hit = stream.integers(denominator, pending.numel()) < fraction[pending]  # Bernoulli(f)
        if k > 1:
            hit &= stream.integers(k, pending.numel()) == 0  # ∧ Bernoulli(1/k)
        stopped = pending[~hit]
        odd[stopped] = k % 2 == 1
        pending = pending[hit]
        k += 1
    return odd


def discrete_laplace(n: int, scale: int, stream: Keystream) -> torch.Tensor:
    """``(n,)`` int64 from the discrete Laplace with P(y) ∝ exp(−|y|/scale), integer scale ≥ 1 (CKS20 Algorithm 2)."""
    if scale < 1:
        raise ValueError(f"discrete_laplace: the scale must be an integer >= 1, got {scale}")
    return _fill(n, lambda m: _laplace_candidates(m, scale, stream))


def _laplace_candidates(m: int, scale: int, stream: Keystream) -> tuple[torch.Tensor, torch.Tensor]:
    """`m` candidates of CKS20 Algorithm 2 and whether each was accepted."""
    u = stream.integers(scale, m)
    accepted = bernoulli_exp(u, scale, stream)  # U uniform on 0..t−1, kept with probability exp(−U/t)
    v = torch.zeros(m, dtype=torch.int64)  # V: the number of Bernoulli(exp(−1)) successes before a failure
    counting = torch.nonzero(accepted).reshape(-1)
    while counting.numel():
        more = bernoulli_exp(torch.ones(counting.numel(), dtype=torch.int64), 1, stream)
        v[counting[more]] += 1
        counting = counting[more]
    magnitude = u + scale * v
    negative = stream.integers(2, m) == 1
    accepted &= ~(negative & (magnitude == 0))  # −0 is redrawn: zero would otherwise be counted twice
    return torch.where(negative, -magnitude, magnitude), accepted


def _fill(n: int, candidates) -> torch.Tensor:
    """``(n,)`` int64 of accepted candidates, in the order drawn. Each round draws for every missing value with a
    margin (``OVERDRAW``), so a rejection sampler finishes in a few vectorised rounds instead of a long tail of small
    ones; keeping the first accepted i.i.d. candidates keeps their distribution."""
    out = torch.zeros(n, dtype=torch.int64)
    filled = 0
    while filled < n:
        values, accepted = candidates(math.ceil((n - filled) * OVERDRAW) + 16)
        kept = values[accepted][: n - filled]
        out[filled : filled + kept.numel()] = kept
        filled += kept.numel()
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
    return _fill(n, lambda m: _gaussian_candidates(m, p, q, t, denominator, stream))


def _gaussian_candidates(m: int, p: int, q: int, t: int, denominator: int,
                         stream: Keystream) -> tuple[torch.Tensor, torch.Tensor]:
    """`m` candidates of CKS20 Algorithm 3 (σ² = p/q, t = ⌊σ⌋ + 1) and whether each was accepted."""
    y = discrete_laplace(m, t, stream)
    centred = y.abs() * (t * q) - p
    if bool((centred.abs() >= _INT64_SAFE).any()):
        return y, _accept_wide(centred, denominator, stream)
    return y, bernoulli_exp(centred * centred, denominator, stream)


def _accept_wide(centred: torch.Tensor, denominator: int, stream: Keystream) -> torch.Tensor:
    """The acceptance step when some (|Y|·t·q − p)² would overflow int64: ⌊γ⌋ and the fraction in Python integers
    (⌊γ⌋ capped at 2^62: a γ that large is rejected by its first factors long before the cap matters)."""
    squares = [int(c) ** 2 for c in centred.tolist()]
    whole = torch.tensor([min(s // denominator, 2**62) for s in squares], dtype=torch.int64)
    fraction = torch.tensor([s % denominator for s in squares], dtype=torch.int64)
    return _bernoulli_exp_split(whole, fraction, denominator, stream)
