"""How much of √K the secure path's accountant gives back, by batch size, at a fixed ε (docs/privacy.md §8).

For K parties of N examples each, a total ε and a number of epochs, prints one Markdown row per sampling rate q
(T = epochs / q steps): the σ each accountant needs for ε at δ, and the noise std on the server's mean gradient in
clip units that σ gives (local: √K·σ / (K·N·q), each party adds its full noise; secure: σ / (K·N·q), one noise for
the sum). The three σ columns:

* local: the Poisson-subsampled Gaussian's PLD (:class:`mpi_fnas.privacy.shard_ledger.PrivacyLedger`), exact;
* secure: the bound the secure path uses (:class:`mpi_fnas.secagg.accounting.SecureAccounting`);
* Gaussian RDP: dp_accounting's RDP of the Poisson-subsampled continuous Gaussian, which the secure bound would be
  if the rounding cost nothing: the secure column's excess over it is the rounding's √D in Δ₂ (and KLS21's τ),
  its excess over the local column is RDP's conversion to (ε, δ).

    python scripts/secure_sigma_table.py --parties 8 --shard 500 --epsilon 3 --epochs 10 40

No MPI, no torch; a few seconds per row.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant

from mpi_fnas.privacy.release import LOCAL_VARIANCE
from mpi_fnas.privacy.shard_ledger import PrivacyLedger
from mpi_fnas.secagg.accounting import RDP_ORDERS, SecureAccounting

Epsilon = Callable[[float, float, int], float]  # (σ, q, steps) -> ε


def smallest_sigma(epsilon_of: Epsilon, rate: float, steps: int, target: float) -> float:
    """The smallest σ (to 0.1 %) whose ε at (`rate`, `steps`) is ≤ `target`, by bisection in log σ."""
    lo, hi = 0.05, 1000.0
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if epsilon_of(mid, rate, steps) > target else (lo, mid)
    return hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parties", type=int, default=8)
    parser.add_argument("--shard", type=int, default=500, help="examples per party (N)")
    parser.add_argument("--dimension", type=int, default=32768, help="the accounted (padded) release length D")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, nargs="+", default=[10, 40])
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 0.5, 0.256, 0.1])
    args = parser.parse_args()
    secure = SecureAccounting(args.parties, LOCAL_VARIANCE, args.dimension)

    def local_epsilon(sigma: float, rate: float, steps: int) -> float:
        ledger = PrivacyLedger()
        ledger.step(noise_multiplier=sigma, sample_rate=rate, num_steps=steps)
        return ledger.get_epsilon(args.delta)

    def secure_epsilon(sigma: float, rate: float, steps: int) -> float:
        return secure.epsilon([(sigma, rate, steps)], args.delta)

    def gaussian_rdp_epsilon(sigma: float, rate: float, steps: int) -> float:
        accountant = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS))
        accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), steps)
        return accountant.get_epsilon(args.delta)

    print("| epochs | q | steps | σ local (PLD) | σ secure (its bound) | σ Gaussian RDP | mean-gradient noise, local "
          "| secure | local / secure |")
    print("|---|---|---|---|---|---|---|---|---|")
    root_k = math.sqrt(args.parties)
    for epochs in args.epochs:
        for rate in args.rates:
            steps = round(epochs / rate)
            sigmas = [smallest_sigma(f, rate, steps, args.epsilon)
                      for f in (local_epsilon, secure_epsilon, gaussian_rdp_epsilon)]
            batch = args.parties * args.shard * rate
            local_noise, secure_noise = root_k * sigmas[0] / batch, sigmas[1] / batch
            print(f"| {epochs} | {rate:g} | {steps} | {sigmas[0]:.2f} | {sigmas[1]:.2f} | {sigmas[2]:.2f} | "
                  f"{local_noise:.5f} | {secure_noise:.5f} | {local_noise / secure_noise:.2f} |")


if __name__ == "__main__":
    main()
