"""Refuse configurations under which the privacy accounting would be wrong (rather than silently under-account).

* Sample-mixing layers: per-example clipping bounds one example's influence only if example i's loss depends on
  example i alone. BatchNorm normalises with batch statistics, so every example's gradient depends on every other
  example of the batch: one example can then move *all* clipped gradients, the sensitivity is no longer R and the
  accountant's epsilon is meaningless. Running-statistics buffers (InstanceNorm with ``track_running_stats``) are
  worse still: they accumulate batch statistics that are never clipped nor noised.
* Second-order DARTS: see :func:`check_dp_search_options`.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm


class PrivacyError(ValueError):
    """A configuration that differential privacy, as accounted here, does not cover."""


_NORM_ADVICE = (
    "set `space.norm: groupnorm` (GroupNorm normalises each example on its own). Per-example clipping bounds an "
    "example's influence only if each example's loss depends on that example alone; a layer that mixes the "
    "examples of a batch breaks the sensitivity bound the privacy accounting relies on"
)


def check_model_for_dp(model: nn.Module) -> None:
    """Raise :class:`PrivacyError` naming the first sample-mixing module of ``model``; return None if none.

    Refused: every BatchNorm variant (``BatchNorm1d/2d/3d``, lazy variants, ``SyncBatchNorm``) whatever its
    ``track_running_stats`` (with False it mixes the batch in eval mode too), and InstanceNorm with
    ``track_running_stats=True``. GroupNorm, LayerNorm and InstanceNorm without running stats are per-example.
    """
    for name, module in model.named_modules():
        where = name or "<root>"
        if isinstance(module, _BatchNorm):
            raise PrivacyError(
                f"module {where!r} ({type(module).__name__}) normalises with batch statistics and so mixes the "
                f"examples of a batch; under differential privacy {_NORM_ADVICE}"
            )
        if isinstance(module, _InstanceNorm) and module.track_running_stats:
            raise PrivacyError(
                f"module {where!r} ({type(module).__name__}, track_running_stats=True) accumulates batch "
                f"statistics in buffers that are neither clipped nor noised; use track_running_stats=False or "
                f"{_NORM_ADVICE}"
            )


def check_dp_search_options(order: str) -> None:
    """Raise :class:`PrivacyError` for a DARTS order that the accounting does not cover under DP.

    ``first_order`` is accepted. ``second_order`` is refused: its architecture gradient contains the finite-
    difference Hessian term ``(grad_A L_tr(W+) - grad_A L_tr(W-)) / 2eps``, which reads the party's *train* shard
    a second time per step, and the unrolled vector ``v = grad_W' L_val`` that defines ``W+-`` reads the *val*
    shard and is exchanged in the clear. Neither is clipped per example nor noised, so releasing them would be
    an unaccounted query on D^tr and D^val. Refusing is safer than reporting an epsilon that is too small.
    """
    if order == "first_order":
        return
    if order == "second_order":
        raise PrivacyError(
            "darts order 'second_order' is not supported under differential privacy: the Hessian term reads the "
            "train shard again (a second, unclipped and un-noised release on D^tr per step) and the unrolled "
            "vector v = grad_W' L_val is a release on D^val; the accountant would under-count both. Use "
            "`first_order` (Algorithm 1 of the DP-FNAS paper) — see docs/privacy.md"
        )
    raise PrivacyError(f"unknown darts order {order!r}; expected 'first_order' or 'second_order'")
