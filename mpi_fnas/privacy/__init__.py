"""Differential privacy for DP-FNAS, MPI-free: sampling, per-example gradients, clipping, the Gaussian release,
accounting and an empirical audit. See docs/privacy.md.

* a party's release: ``release`` (one kind of release), ``params`` (the run's DP parameters), ``sampling``,
  ``per_sample`` (with ``layer_grads``), ``clipping`` and ``mechanism``: :func:`party_release` (Algorithm 1 with the
  expected batch size as divisor); ``validators`` refuses what the accounting would get wrong;
* rank 0's accountants: ``calibration`` (the plan before the run: rates, δ, σ, the step budget; with ``monotone``),
  ``shard_ledger`` (:class:`PrivacyLedger`, one (party, shard) ledger, and the ε math), ``federation_ledger``
  (every party's ledgers during the run, ε on ``worker``'s thread); ``gaussian_pld`` and ``transforms`` (the PLDs);
* a party's own guard: ``trusted_config`` (the config it trusts) and ``party_ledger`` (its own ledger and cap);
* ``exponential`` (SecProbe's draw and its ε) and ``audit`` (empirical ε lower bounds).
"""

from importlib import import_module
from typing import Any

# Each public name and the module that defines it, imported on first use: a party rank needs the release
# (torch) but not the accountant (dp_accounting, scipy: ~1 s and ~60 MB a rank), which only rank 0 runs.
_EXPORTS = {
    "PrivacyLedger": "shard_ledger", "calibrate_noise_multiplier": "shard_ledger", "default_delta": "shard_ledger",
    "gdp_epsilon": "shard_ledger", "party_epsilon": "shard_ledger",
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
