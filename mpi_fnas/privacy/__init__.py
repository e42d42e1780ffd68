"""Differential privacy for DP-FNAS, MPI-free: sampling, per-example gradients, clipping, the Gaussian release,
accounting and an empirical audit. See docs/privacy.md.

The party's release is :func:`party_release` (Algorithm 1 with the expected batch size as divisor).
"""

from mpi_fnas.privacy.accountant import (
    PrivacyLedger,
    calibrate_noise_multiplier,
    default_delta,
    gdp_epsilon,
    party_epsilon,
)
from mpi_fnas.privacy.audit import AuditResult, audit_mechanism
from mpi_fnas.privacy.clipping import clip_per_sample, clipped_sum
from mpi_fnas.privacy.mechanism import gaussian_noise, party_release, privatize_per_sample_gradients
from mpi_fnas.privacy.params import DPParams
from mpi_fnas.privacy.per_sample import per_example_cross_entropy, per_sample_gradients
from mpi_fnas.privacy.sampling import poisson_sample
from mpi_fnas.privacy.validators import PrivacyError, check_dp_search_options, check_model_for_dp

__all__ = [
    "AuditResult",
    "DPParams",
    "PrivacyError",
    "PrivacyLedger",
    "audit_mechanism",
    "calibrate_noise_multiplier",
    "check_dp_search_options",
    "check_model_for_dp",
    "clip_per_sample",
    "clipped_sum",
    "default_delta",
    "gaussian_noise",
    "gdp_epsilon",
    "party_epsilon",
    "party_release",
    "per_example_cross_entropy",
    "per_sample_gradients",
    "poisson_sample",
    "privatize_per_sample_gradients",
]
