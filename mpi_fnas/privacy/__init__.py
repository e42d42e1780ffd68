"""Differential privacy for DP-FNAS, MPI-free: sampling, per-example gradients, clipping, the Gaussian release,
accounting and an empirical audit. See docs/privacy.md.

The party's release is :func:`party_release` (Algorithm 1 with the expected batch size as divisor).
"""

from importlib import import_module
from typing import Any

# Each public name and the module that defines it, imported on first use: a party rank needs the release
# (torch) but not the accountant (dp_accounting, scipy: ~1 s and ~60 MB a rank), which only rank 0 runs.
_EXPORTS = {
    "PrivacyLedger": "accountant", "calibrate_noise_multiplier": "accountant", "default_delta": "accountant",
    "gdp_epsilon": "accountant", "party_epsilon": "accountant",
    "AuditDesign": "audit", "AuditResult": "audit", "audit_mechanism": "audit",
    "clip_per_sample": "clipping", "clipped_sum": "clipping",
    "gaussian_noise": "mechanism", "party_release": "mechanism", "privatize_per_sample_gradients": "mechanism",
    "DPParams": "params",
    "per_example_cross_entropy": "per_sample", "per_sample_gradients": "per_sample",
    "poisson_sample": "sampling",
    "PrivacyError": "validators", "check_dp_search_options": "validators", "check_model_for_dp": "validators",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
