"""The privacy parameters of a DP-FNAS run: one object from the config to the plan, the party and the log.

:class:`DPParams` is built once from the ``privacy`` section (:meth:`DPParams.from_config`) and completed by the
plan (a calibrated σ under ``target_epsilon``). Its :meth:`DPParams.search_releases` are the
:class:`~mpi_fnas.privacy.release.Release` objects the parties release through, the ledger charges and the run log
records. :class:`PrivacyPlan` is the run's plan around them (σ calibrated, sample rates, δ, steps): it depends on
the releases, never the other way round. A new privacy key is a config field (with its documentation line) and a
field of the same name here, which :meth:`DPParams.from_config` reads by name; the code that uses it reads it from
this object. A new logged field of every release (both stages) is a ``Release`` field named in
``mpi_fnas.runlog.schema.RELEASE_FIELDS`` and in ``LoggedRelease``, with its rows in docs/hdf5.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from mpi_fnas.privacy.release import AugmentReleases, Release, SecureSum
from mpi_fnas.wire import wire_type

if TYPE_CHECKING:  # rank 0's accountant (scipy): the type only
    from mpi_fnas.secagg.accounting import SecureAccounting

Randomness = Literal["secret", "reproducible"]
Aggregation = Literal["local", "secure"]


@wire_type
@dataclass(frozen=True)
class DPParams:
    """Public constants of the party releases (Algorithm 1) and the budget they are planned against.

    noise_multiplier_w / noise_multiplier_a: σ_W, σ_A; the noise std per coordinate is σ·R before the ÷ B.
    clip_w / clip_a: R^G, R^H, the per-example L2 bounds.
    expected_batch_size: B; the Poisson rate of a shard of N examples is q = B / N, and every release is ÷ B.
    delta: the configured δ per party, or None for the default (see ``mpi_fnas.privacy.calibration``).
    target_epsilon / max_epsilon: calibrate σ to / stop before this ε (None: off).
    search_share: with target_epsilon, the share of it the search alone may spend (None: one σ for every stage).
    reproducible_noise: key the party's randomness from (seed, rank): for tests only, it voids the guarantee.
    aggregation: ``local`` (each party adds noise σ·R) or ``secure`` (1/K of its variance; only the sum is seen).
    parties: K, the parties whose releases are summed (the plan's; secure aggregation splits the noise K ways).
    secure_dimension: D, the padded length secure aggregation accounts every release at (the planner's
        :func:`~mpi_fnas.federation.job_plan.secure_dimension`: the run's largest release); None under ``local``.
    colluders: t, the parties the guarantee lets collude with the server under ``secure`` (0: the server alone).
    """

    noise_multiplier_w: float
    noise_multiplier_a: float
    clip_w: float
    clip_a: float
    expected_batch_size: float
    delta: float | None = None
    target_epsilon: float | None = None
    max_epsilon: float | None = None
    search_share: float | None = None
    reproducible_noise: bool = False
    aggregation: Aggregation = "local"
    parties: int = 1
    secure_dimension: int | None = None
    colluders: int = 0

    @classmethod
    def from_config(cls, privacy: Any, batch_size: float, parties: int = 1,
                    secure_dimension: int | None = None) -> DPParams:
        """From the ``privacy`` config section (every field of the same name), ``search.batch_size``, K and (under
        ``secure``) the accounted dimension."""
        names = {f.name for f in dataclasses.fields(cls)} - {"expected_batch_size", "parties", "secure_dimension"}
        return cls(expected_batch_size=float(batch_size), parties=int(parties), secure_dimension=secure_dimension,
                   **{name: getattr(privacy, name) for name in names})

    @property
    def secure_sum(self) -> SecureSum | None:
        """The public constants of secure aggregation, or None under ``local``."""
        if self.aggregation != "secure":
            return None
        if self.secure_dimension is None:
            raise ValueError("privacy.aggregation secure: the plan gives no accounted dimension (secure_dimension)")
        return SecureSum(self.parties, self.secure_dimension, colluders=self.colluders)

    @property
    def secure_accounting(self) -> SecureAccounting | None:
        """What the ledger and the planner account secure releases with (None: the local path's PLD)."""
        return self.secure_sum.accounting if self.secure_sum is not None else None

    @property
    def cap(self) -> tuple[float, str] | None:
        """(ε, its config key): the smaller of ``target_epsilon`` and ``max_epsilon``, the ε no party may pass (a
        resumed stage's replays included); None when neither is set."""
        caps = [(float(value), f"privacy.{key}") for key, value in
                (("target_epsilon", self.target_epsilon), ("max_epsilon", self.max_epsilon)) if value is not None]
        return min(caps) if caps else None

    def party_caps(self, party_max_epsilon: float | None) -> list[tuple[tuple[float, str], bool]]:
        """A party's own caps (:mod:`mpi_fnas.privacy.party_ledger`), smallest first, each ``((ε, its config key),
        whether it composes the party's earlier runs on the same data)``: the run's :attr:`cap` over this run, and
        its ``privacy.party_max_epsilon`` over this run and the earlier ones (a baseline's other arms)."""
        caps = [(self.cap, False)]
        if party_max_epsilon is not None:
            caps.append(((float(party_max_epsilon), "privacy.party_max_epsilon"), True))
        return sorted(((cap, total) for cap, total in caps if cap is not None), key=lambda item: item[0][0])

    @property
    def randomness(self) -> Randomness:
        """Where the party's noise and Poisson coins come from (docs/privacy.md §2.1): ``secret`` (a keystream keyed
        from the OS, the default) or ``reproducible`` (keyed from the public config)."""
        return "reproducible" if self.reproducible_noise else "secret"

    @property
    def guarantee(self) -> str:
        """``"holds"``, or one line saying why the accounted ε does not hold (the log's ``privacy_guarantee``)."""
        if self.reproducible_noise:
            return ("void: privacy.reproducible_noise keys every party's noise and sampling from the public config, "
                    "so anyone holding the config can subtract the noise")
        return "holds"

    def search_releases(self, w_releases_per_step: int = 1) -> dict[str, Release]:
        """The search's releases: ``W`` (G_k, on the train shard; 2 per iteration under ADADP) and ``A`` (H_k, on
        the validation shard)."""
        return {"W": Release(self.noise_multiplier_w, self.clip_w, self.expected_batch_size, w_releases_per_step,
                             self.secure_sum),
                "A": Release(self.noise_multiplier_a, self.clip_a, self.expected_batch_size, 1, self.secure_sum)}

    def with_noise(self, noise_multiplier_w: float, noise_multiplier_a: float) -> DPParams:
        """A copy with the noise multipliers σ_W and σ_A the planner calibrated."""
        return dataclasses.replace(self, noise_multiplier_w=noise_multiplier_w, noise_multiplier_a=noise_multiplier_a)


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
