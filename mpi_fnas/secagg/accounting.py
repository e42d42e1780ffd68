"""ε of a party's records when only the sum of the K parties' discretely noised releases is seen (docs/privacy.md §8).

Record-level DP, per party, as on the local path: a record of party k changes only party k's integer vector, through
the clipped sum it encodes (:func:`~mpi_fnas.secagg.encoding.encode_sum`), and is in its Poisson batch with
probability q. It is protected by the discrete noise the observer cannot subtract: all K parties' against the
server, K − t of them when t parties collude with it. dp-accounting has no event for this, so the bound is here:

0. the rounding: any bound for an integer shift of norms (Δ₂, Δ₁) holds for the mixture over the rounding coins
   (:func:`~mpi_fnas.secagg.encoding.sensitivity`; Rényi divergence is jointly quasi-convex);
1. one unsampled release: KLS21 Proposition 14 (:meth:`SummedDiscreteGaussian.rdp`);
2. Poisson subsampling inside the party: the binomial expansion of the remove direction (Zhu & Wang's "tight"
   formula), which also bounds the add direction because the pair is symmetric (:func:`poisson_subsampled_rdp`);
3. RDP composition over releases and dp_accounting's conversion to (ε, δ) at the best order (:func:`epsilon`).

The proof and its numerical checks: docs/secagg-accounting.md. No MPI, no autograd; rank 0 (planner, ledger) calls it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import special

from mpi_fnas.secagg.encoding import sensitivity

#: The RDP orders: integers only (step 2's binomial expansion, docs/secagg-accounting.md, needs an integer α).
RDP_ORDERS: tuple[int, ...] = (*range(2, 65), 80, 96, 128, 160, 192, 256, 384, 512)


@dataclass(frozen=True)
class SummedDiscreteGaussian:
    """One secure release as an observer who sees only the sum sees it: n parties' N_Z(0, σ²)^D noise protects a
    record whose integer vector has ‖·‖₂ ≤ Δ₂ and ‖·‖₁ ≤ Δ₁ (integer units).

    l2_sensitivity: Δ₂. l1_sensitivity: Δ₁. dimension: D (the padded length). local_variance: σ², each party's
    discrete Gaussian parameter per coordinate. noisy_parties: n, the parties whose noise the observer cannot
    subtract (K against the server; K − t with t colluders).
    """

    l2_sensitivity: float
    l1_sensitivity: float
    dimension: int
    local_variance: float
    noisy_parties: int

    def __post_init__(self) -> None:
        if not (self.l2_sensitivity > 0 and self.l1_sensitivity > 0 and self.local_variance > 0):
            raise ValueError(f"sensitivities and the local variance must be > 0, got {self}")
        if self.dimension < 1 or self.noisy_parties < 1:
            raise ValueError(f"the dimension and the noisy parties must be >= 1, got {self}")

    @classmethod
    def of_record(cls, l2_sensitivity: float, dimension: int, local_variance: float,
                  noisy_parties: int) -> SummedDiscreteGaussian:
        """A record that moves the integer vector by at most `l2_sensitivity` (Δ₂) in D = `dimension` coordinates:
        Δ₁ is at most √D·Δ₂ (Cauchy–Schwarz) and at most Δ₂² (an integer's magnitude is at most its square)."""
        l1_sensitivity = l2_sensitivity * min(math.sqrt(dimension), l2_sensitivity)
        return cls(l2_sensitivity, l1_sensitivity, dimension, local_variance, noisy_parties)

    @property
    def tau(self) -> float:
        """τ of KLS21: 10·Σ_{k=1}^{n−1} exp(−2π²σ²·k/(k+1)); 0 for a single discrete Gaussian."""
        return 10.0 * sum(math.exp(-2.0 * math.pi**2 * self.local_variance * k / (k + 1))
                          for k in range(1, self.noisy_parties))

    def rdp(self, order: float) -> float:
        """ε(α) of one unsampled release (KLS21 Proposition 14, the smallest of its three bounds)."""
        total_variance = self.noisy_parties * self.local_variance
        l2 = self.l2_sensitivity / math.sqrt(total_variance)
        l1 = self.l1_sensitivity / math.sqrt(total_variance)
        tau, dim = self.tau, self.dimension
        return min(order * l2 * l2 / 2.0 + tau * dim,
                   order / 2.0 * (l2 * l2 + 2.0 * l1 * tau + tau * tau * dim),
                   order / 2.0 * (l2 + math.sqrt(dim) * tau) ** 2)


def poisson_subsampled_rdp(order: int, rate: float, mechanism: SummedDiscreteGaussian) -> float:
    """ε(α) of `mechanism` run on a Poisson sample at `rate`, both directions (step 2 of docs/secagg-accounting.md;
    integer α ≥ 2):

    ``1/(α−1)·log Σ_{ℓ=0}^{α} C(α,ℓ)(1−q)^{α−ℓ}q^ℓ e^{(ℓ−1)ε(ℓ)}`` with ε(0) = ε(1) = 0 (the ℓ = 0 and 1 terms
    sum to (1−q)^{α−1}(αq − q + 1)), in log space; never above the unsampled ε(α)."""
    return float(poisson_subsampled_curve((order,), rate, mechanism)[0])


def poisson_subsampled_curve(orders: Sequence[int], rate: float, mechanism: SummedDiscreteGaussian) -> np.ndarray:
    """:func:`poisson_subsampled_rdp` at every order of `orders` (ε(ℓ) computed once for ℓ ≤ the largest)."""
    if any(int(order) != order or order < 2 for order in orders):
        raise ValueError(f"Poisson-subsampled RDP needs integer orders >= 2, got {orders}")
    if not 0 <= rate <= 1:
        raise ValueError(f"the sampling rate must be in [0, 1], got {rate}")
    top = int(max(orders))
    unsampled = np.array([0.0, 0.0, *(mechanism.rdp(ell) for ell in range(2, top + 1))])  # index ℓ
    if rate == 0:
        return np.zeros(len(orders))
    if rate == 1:
        return unsampled[np.asarray(orders, dtype=np.int64)]
    log_q, log_1mq = math.log(rate), math.log1p(-rate)
    out = np.empty(len(orders))
    for i, order in enumerate(int(order) for order in orders):
        ell = np.arange(order + 1)  # ℓ = 0 and 1 have E_P[L^ℓ] = 1: unsampled[0] = unsampled[1] = 0
        terms = _log_comb(order, ell) + ell * log_q + (order - ell) * log_1mq + (ell - 1) * unsampled[ell]
        out[i] = min(float(special.logsumexp(terms)) / (order - 1), unsampled[order])
    return out


def _log_comb(n: int, k: int | np.ndarray) -> float | np.ndarray:
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


@dataclass(frozen=True)
class SecureCharge:
    """`count` releases of one kind on one record set: each a `release` on a Poisson sample at `rate`."""

    release: SummedDiscreteGaussian
    rate: float
    count: int


def composed_rdp(charges: Iterable[SecureCharge], orders: Sequence[int] = RDP_ORDERS) -> np.ndarray:
    """``(len(orders),)``: the RDP curve of every charge composed (RDP adds over releases)."""
    total = np.zeros(len(orders), dtype=np.float64)
    for charge in charges:
        if charge.count:
            total += charge.count * poisson_subsampled_curve(orders, charge.rate, charge.release)
    return total


def epsilon(rdp: np.ndarray, delta: float, orders: Sequence[int] = RDP_ORDERS) -> float:
    """The (ε, δ) guarantee of an RDP curve: the best order's conversion (CKS20 Proposition 12, dp_accounting)."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon  # rank 0's import, as for the PLD ledger

    if not np.any(rdp):
        return 0.0
    return float(compute_epsilon(list(orders), list(rdp), delta)[0])




@dataclass(frozen=True)
class SecureAccounting:
    """What turns a ledger's (σ, q, count) runs into ε under secure aggregation (the public constants of
    :class:`~mpi_fnas.privacy.release.SecureSum`): K parties, each adding N_Z(0, σ_k²) per coordinate to releases
    scaled so that c/γ = √(K·σ_k²)/σ, of at most `dimension` (D, padded) coordinates: the bound grows with D, so
    one D, the run's largest release, covers every release of the run. `colluders`: t, the parties the guarantee
    lets collude with the server (``privacy.colluders``), which :meth:`epsilon` accounts against by default."""

    parties: int
    local_variance: int
    dimension: int
    colluders: int = 0

    def mechanism(self, noise_multiplier: float, colluders: int = 0) -> SummedDiscreteGaussian:
        """One release at σ, as an observer colluding with `colluders` parties sees it (they subtract their
        noise: K − t noises remain)."""
        if not 0 <= colluders < self.parties:
            raise ValueError(f"colluders must be in [0, K - 1] = [0, {self.parties - 1}], got {colluders}")
        units = math.sqrt(self.parties * self.local_variance) / noise_multiplier
        return SummedDiscreteGaussian.of_record(sensitivity(units, self.dimension), self.dimension,
                                                self.local_variance, self.parties - colluders)

    def epsilon(self, runs: Iterable[tuple[float, float, int]], delta: float, colluders: int | None = None) -> float:
        """ε at δ of (σ, q, count) runs composed, against the server with `colluders` parties (None: the
        guarantee's t, :attr:`colluders`; 0: the server alone)."""
        colluders = self.colluders if colluders is None else colluders
        rdp = np.zeros(len(RDP_ORDERS))
        for sigma, rate, count in runs:
            rdp += count * _step_rdp(self, float(sigma), float(rate), colluders)
        return epsilon(rdp, delta)

    def description(self) -> str:
        return (f"RDP of the securely summed distributed discrete Gaussian (KLS21 Prop. 14; Poisson "
                f"subsampling of a symmetric pair), K={self.parties}, local variance {self.local_variance}, "
                f"D<={self.dimension}" + (f", against the server and any {self.colluders} colluding parties"
                                          if self.colluders else ""))


@functools.lru_cache(maxsize=512)
def _step_rdp(accounting: SecureAccounting, sigma: float, rate: float, colluders: int) -> np.ndarray:
    """The RDP curve of one secure release at (σ, q): computed once per key (a ledger's runs repeat them)."""
    return poisson_subsampled_curve(RDP_ORDERS, rate, accounting.mechanism(sigma, colluders))
