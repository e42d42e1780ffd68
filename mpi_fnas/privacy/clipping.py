"""Per-example L2 clipping (Algorithm 1: ``g / max(1, ||g||_2 / R)``).

Clipping every example's gradient to norm <= R bounds how much one example can move the sum: adding or removing
it changes ``sum_i clip(g_i)`` by at most R in L2 norm. That sensitivity is what the Gaussian noise is scaled to.
"""

from __future__ import annotations

import math

import torch


def clip_factors(grads: torch.Tensor, bound: float) -> torch.Tensor:
    """Per-example scale ``1 / max(1, ||g_i|| / R)`` for ``grads (B, P)`` -> ``(B,)``.

    A row whose norm is not finite (a NaN or inf entry) gets factor 0, i.e. contributes nothing: dropping it is
    still a function of that example alone, with norm 0 <= R, so the sensitivity bound holds, and one example's
    NaN cannot poison (and so reveal itself in) the release.
    """
    if grads.dim() != 2:
        raise ValueError(f"grads must be (B, P), got shape {tuple(grads.shape)}")
    if not (math.isfinite(bound) and bound > 0):
        raise ValueError(f"clip bound must be positive and finite, got {bound}")
    norms = torch.linalg.vector_norm(grads, dim=1)
    factors = 1.0 / torch.clamp(norms / bound, min=1.0)
    return torch.where(torch.isfinite(norms), factors, 0.0)


def clip_per_sample(grads: torch.Tensor, bound: float) -> torch.Tensor:
    """Clip each row of ``grads (B, P)`` to L2 norm <= ``bound`` -> ``(B, P)`` (rows already inside unchanged)."""
    factors = clip_factors(grads, bound)
    # where() rather than a product alone so that a dropped row is 0, not 0 * nan = nan.
    return torch.where(factors[:, None] > 0, grads * factors[:, None], 0.0)


def clipped_sum(grads: torch.Tensor, bound: float) -> torch.Tensor:
    """``sum_i clip(g_i, bound)`` of ``grads (B, P)`` -> ``(P,)``; ``B = 0`` gives zeros."""
    factors = clip_factors(grads, bound)
    if bool((factors > 0).all()):
        # factors @ grads: the weighted sum without materialising a clipped (B, P) copy.
        return factors.to(grads.dtype) @ grads
    return clip_per_sample(grads, bound).sum(dim=0)
