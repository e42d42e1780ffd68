"""The party's differentially-private release (Algorithm 1 of Singh, Zhou et al. 2020, DP-FNAS).

For one Poisson batch I_t of a party's shard, the party sends

    release = ( sum_{i in I_t} g_i / max(1, ||g_i||_2 / R)  +  N(0, (sigma * R)^2 I_P) ) / B

where g_i is example i's gradient w.r.t. the released parameters (all of W for G_k, all of A for H_k), R the clip
bound (R^G or R^H), sigma the noise multiplier and B the *expected* batch size q * N (a public constant).

Deviation from the paper, on purpose: Algorithm 1 divides by |I_t|, the realised batch size. |I_t| depends on the
data (it is the number of examples the coin flips picked), so dividing by it releases a data-dependent scale that
the accountant does not cover (Opacus divides by the expected batch size too). Dividing by the public B is a
post-processing of the Gaussian mechanism, so the accounting of the sum is the accounting of the release.

Nothing in this module talks to MPI: the caller sends the returned vector.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from mpi_fnas.keystream import UNIFORM_BITS, Keystream
from mpi_fnas.privacy.clipping import clipped_sum
from mpi_fnas.privacy.per_sample import (
    LossFn,
    Method,
    hook_clipped_sum,
    hooks_supported,
    per_example_cross_entropy,
    per_sample_gradients,
    physical_batches,
)
from mpi_fnas.privacy.validators import check_model_for_dp
from mpi_fnas.secagg.discrete_gaussian import discrete_gaussian
from mpi_fnas.secagg.encoding import Encoding, encode_sum


def party_release(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    clip_bound: float,
    noise_multiplier: float,
    expected_batch_size: float,
    noise_stream: Keystream,
    loss_fn: LossFn = per_example_cross_entropy,
    method: Method = "auto",
    max_physical_batch: int | None = None,
) -> torch.Tensor:
    """One DP release of a party: clipped per-example gradient sum plus Gaussian noise, over the expected B.

    Args:
        model: the network (must pass :func:`~mpi_fnas.privacy.validators.check_model_for_dp`: no BatchNorm).
        params: ``{name: tensor}`` of the parameters whose gradient is released, in the flat release's order.
        inputs, targets: ``(b, ...)`` the Poisson batch and its targets (``b = 0``: the release is noise / B).
        clip_bound, noise_multiplier: R > 0, the per-example L2 bound; sigma > 0 (noise std ``sigma * R``, then ÷ B).
        expected_batch_size: B = q * N > 0, public; never pass the realised ``b``.
        noise_stream: the party's secret noise :class:`~mpi_fnas.keystream.Keystream` (docs/privacy.md §2.1).
        loss_fn, method: the per-example loss and gradient method, as in ``per_sample_gradients``.
        max_physical_batch: examples per pass (None: one pass); see :func:`clipped_gradient_sum`.

    Returns:
        ``(P,)`` tensor, P = total numel of ``params``, on their device and dtype.
    """
    check_model_for_dp(model)
    _check_release_arguments(clip_bound, noise_multiplier, expected_batch_size)
    total = clipped_gradient_sum(model, params, inputs, targets, clip_bound, loss_fn=loss_fn, method=method,
                                 max_physical_batch=max_physical_batch)
    return _add_noise_and_divide(total, clip_bound, noise_multiplier, expected_batch_size, noise_stream)


def clipped_gradient_sum(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    clip_bound: float,
    *,
    loss_fn: LossFn = per_example_cross_entropy,
    method: Method = "auto",
    max_physical_batch: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``sum_i clip(g_i, R)`` over the batch ``inputs (b, ...)`` -> ``(P,)``, computed in passes of at most
    `max_physical_batch` examples (:func:`~mpi_fnas.privacy.per_sample.physical_batches`; None: one pass).

    Each example is in exactly one pass and clipped on its own, so the sum, and with it the sensitivity R, is that
    of one pass over the whole batch (up to float rounding); what the passes bound is memory: the activations and
    the ``(b, P)`` per-example gradients of one pass at a time, whatever the realised Poisson batch (Opacus'
    ``BatchMemoryManager`` does the same for its optimizer steps). The per-pass sums are accumulated in `dtype`
    on `device` (default: the parameters' own).
    """
    first = next(iter(params.values()), None)
    if first is None:
        raise ValueError("params is empty: nothing to differentiate")
    total = torch.zeros(sum(p.numel() for p in params.values()), dtype=dtype or first.dtype,
                        device=device if device is not None else first.device)
    # The hooks method sums the clipped gradients layer by layer, without the (b, P) matrix (hook_clipped_sum).
    layer_by_layer = method == "hooks" or (method == "auto" and hooks_supported(model, params))
    # An empty batch still makes one (empty) pass, so its parameters are checked as any other batch's.
    for part in physical_batches(int(inputs.shape[0]), max_physical_batch) or [slice(0, 0)]:
        if layer_by_layer:
            total += hook_clipped_sum(model, params, inputs[part], targets[part], clip_bound, loss_fn,
                                      dtype=total.dtype).to(total.device)
            continue
        grads = per_sample_gradients(model, params, inputs[part], targets[part], loss_fn, method=method)
        total += clipped_sum(grads.detach().to(total.device, total.dtype), clip_bound)
    return total


def secure_party_release(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    encoding: Encoding,
    signs: torch.Tensor,
    local_variance: int,
    rounding_stream: Keystream,
    noise_stream: Keystream,
    loss_fn: LossFn = per_example_cross_entropy,
    method: Method = "auto",
    max_physical_batch: int | None = None,
) -> torch.Tensor:
    """A party's release under secure aggregation, before its masks: ``(D,)`` int64 =
    ``round(rotate(Σ_i clip(g_i, c)) / γ) + N_Z(0, σ_k²)^D`` (after KLS21 Algorithm 1; the clipped sum is encoded
    once, so one example moves the integer vector by at most the encoding's sensitivity, c/γ + √D).

    Args: as :func:`party_release`, and `encoding` (c, γ, β, D), `signs` (the public rotation of this release),
    `local_variance` (σ_k², integer units: this party's share of the central variance), `rounding_stream` (the
    rounding coins: the party's secret sampling stream) and `noise_stream` (the discrete noise).
    """
    check_model_for_dp(model)
    # Clipped and summed in float64: the sensitivity assumes ‖g_i‖ ≤ c, which float32 clipping can miss by an ulp.
    total = clipped_gradient_sum(model, params, inputs, targets, encoding.clip, loss_fn=loss_fn, method=method,
                                 max_physical_batch=max_physical_batch, dtype=torch.float64, device="cpu")
    total = encode_sum(total, encoding, signs, rounding_stream)
    return total + discrete_gaussian(encoding.padded, local_variance, noise_stream)


def privatize_per_sample_gradients(
    per_sample_grads: torch.Tensor,
    *,
    clip_bound: float,
    noise_multiplier: float,
    expected_batch_size: float,
    noise_stream: Keystream,
) -> torch.Tensor:
    """The Gaussian mechanism on already computed per-example gradients: clip, sum, add noise, divide by B.

    This is the second half of :func:`party_release` (which only adds the per-example gradient computation),
    exposed so that the mechanism can be audited on chosen gradients. It always clips: there is no way to
    release an unclipped sum through it.

    Args:
        per_sample_grads: ``(b, P)``, row i depending on example i only.
        clip_bound, noise_multiplier, expected_batch_size, noise_stream: as in :func:`party_release`.

    Returns:
        ``(P,)`` = ``(sum_i clip(g_i, R) + N(0, (sigma R)^2 I)) / B``.
    """
    _check_release_arguments(clip_bound, noise_multiplier, expected_batch_size)
    return _add_noise_and_divide(clipped_sum(per_sample_grads, clip_bound), clip_bound, noise_multiplier,
                                 expected_batch_size, noise_stream)


def _add_noise_and_divide(total: torch.Tensor, clip_bound: float, noise_multiplier: float, expected_batch_size: float,
                          noise_stream: Keystream) -> torch.Tensor:
    """``(total + N(0, (σR)² I)) / B`` for a clipped sum ``total (P,)``."""
    noise = gaussian_noise(
        total.shape[0],
        std=noise_multiplier * clip_bound,
        stream=noise_stream,
        device=total.device,
        dtype=total.dtype,
    )
    return (total + noise) / expected_batch_size


def gaussian_noise(
    size: int,
    *,
    std: float,
    stream: Keystream,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(size,)`` i.i.d. N(0, std^2) on ``device``, cast to ``dtype`` only after the scaling by ``std``.

    The draws are :func:`standard_normal_from_bits` of ``stream.bits(size)`` (53 uniform bits each, drawn on the
    CPU and moved to ``device``): exact in float64 far into the tail, and the same numbers on CPU and CUDA.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    return (standard_normal_from_bits(stream.bits(size).to(device)) * std).to(dtype)


def standard_normal_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Standard normals from uniform integers ``bits`` in ``[0, 2^53)`` (any shape) -> float64, same shape.

    Bit 0 is the sign; the other 52 bits k give ``u = (k + 1/2) 2^-53`` in (0, 1/2) and ``|z| = -Phi^-1(u)``
    (``torch.special.ndtri`` in float64). Every step before ``ndtri`` is exact in float64, so the sampler puts
    mass 2^-53 on each of 2^53 points, each the midpoint quantile of its cell: ``P(|z| > t)`` is within 2^-52 of
    the true ``2 Phi(-t)`` for every t, and the largest output is ``-Phi^-1(2^-54) = 8.29``, where the normal
    tail mass is ~1e-16, far below any accounted delta.

    Why not ``torch.randn``: in float32 on CPU it never exceeds 5.77 (its uniforms have 24 bits), so an output
    beyond that proves a canary present and puts a floor of about ``P(|z| > 5.77 sigma)`` under delta (the
    mechanism of Theorem 3.1 assumes exact Gaussian noise).
    """
    # k < 2^52 and k + 1/2 are exact in float64, and so is the power-of-two scaling (in place: ~2x faster).
    uniform = torch.bitwise_right_shift(bits, 1).to(torch.float64).add_(0.5).mul_(2.0**-UNIFORM_BITS)
    sign = torch.bitwise_and(bits, 1).to(torch.float64).mul_(-2.0).add_(1.0)  # +1 or -1
    return torch.special.ndtri(uniform).mul_(sign)


def _check_release_arguments(clip_bound: float, noise_multiplier: float, expected_batch_size: float) -> None:
    if not (math.isfinite(clip_bound) and clip_bound > 0):
        raise ValueError(f"clip_bound must be positive and finite, got {clip_bound}")
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(f"noise_multiplier must be positive and finite, got {noise_multiplier} (no DP without noise)")
    if not (math.isfinite(expected_batch_size) and expected_batch_size > 0):
        raise ValueError(f"expected_batch_size must be positive and finite, got {expected_batch_size}")
