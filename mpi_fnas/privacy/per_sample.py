"""Per-example gradients: one flat gradient vector per example of a batch (docs/privacy.md, "Per-example gradients").

Two exact methods behind one function:

* ``"vmap"`` — ``torch.func.vmap(torch.func.grad(loss of one example))`` over ``functional_call``: any parameter
  of any model, but slow, and its first call imports ``torch._dynamo``.
* ``"hooks"`` — one batched forward, one backward to the *outputs* of the layers owning the parameters, and each
  layer's per-example weight gradient from its input and output gradient (:mod:`mpi_fnas.privacy.layer_grads`).
  Owners: ``nn.Conv2d`` (zero padding), ``nn.Linear``, ``nn.GroupNorm``, ``nn.LayerNorm``, also called several times
  in one forward; an in-place op on a recorded output is refused. A parameter in the model's
  ``per_example_parameters`` (the alphas) is passed as B copies ``(B, *shape)``, example i's gradient that of copy i.
* ``"auto"`` (default) — ``"hooks"`` when every requested parameter has a supported owner or is one of the
  model's ``per_example_parameters``, else ``"vmap"``.

Both assume no layer mixes a batch's examples (no BatchNorm; :func:`~mpi_fnas.privacy.validators.check_model_for_dp`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, grad, vmap

from mpi_fnas.privacy import layer_grads

#: ``loss_fn(outputs (b, ...), targets (b, ...)) -> (b,)`` per-example losses. Not reduced: a mean would
#: silently rescale the hooks method by 1/b, so a reduced loss is rejected.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Method = Literal["auto", "vmap", "hooks"]

_HOOKABLE = (nn.Conv2d, nn.Linear, nn.GroupNorm, nn.LayerNorm)

def per_example_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each example: logits ``(b, classes)``, int64 targets ``(b,)`` -> ``(b,)``."""
    return F.cross_entropy(outputs, targets, reduction="none")


def per_sample_gradients(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: LossFn = per_example_cross_entropy,
    *,
    method: Method = "auto",
    max_chunk: int | None = None,
) -> torch.Tensor:
    """Gradient of each example's loss w.r.t. ``params``, flattened and concatenated in ``params``' order.

    Args:
        model: the network; parameters and buffers not in ``params`` are held fixed (read, never updated).
        params: ``{name in model.named_parameters(): value}``, the tensors to differentiate; their values replace
            the model's own here (``dict(model.named_parameters())`` uses the model's).
        inputs, targets: ``(B, ...)`` batch and its targets (passed to ``loss_fn``); ``B = 0`` is allowed.
        loss_fn: per-example loss, ``(outputs (b, ...), targets (b, ...)) -> (b,)``.
        method: ``"auto"``, ``"vmap"`` or ``"hooks"`` (see the module docstring); all give the same result.
        max_chunk: at most this many examples at a time (:func:`physical_batches`; bounds peak memory); None: all.

    Returns:
        ``(B, P)`` tensor on the params' device and dtype, ``P = sum(p.numel() for p in params.values())``;
        row i is ``d loss_fn(model(inputs[i:i+1]), targets[i:i+1]) / d params``.
    """
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"inputs and targets disagree on the batch size: {inputs.shape[0]} vs {targets.shape[0]}")
    if max_chunk is not None and max_chunk < 1:
        raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
    _check_param_names(model, params)
    unhookable = _unhookable(model, params)
    if method == "auto":
        method = "vmap" if unhookable else "hooks"
    if method == "vmap":
        compute = _vmap_gradients
    elif method == "hooks":
        if unhookable:
            raise ValueError(
                "method='hooks' needs every parameter to belong to an nn.Conv2d/Linear/GroupNorm/LayerNorm or to be "
                f"one of the model's per_example_parameters (unsupported: {', '.join(unhookable)}); use method='vmap'"
            )
        compute = _hook_gradients
    else:
        raise ValueError(f"unknown method {method!r}; expected 'auto', 'vmap' or 'hooks'")

    batch = int(inputs.shape[0])
    first = next(iter(params.values()), None)
    if first is None:
        raise ValueError("params is empty: nothing to differentiate")
    num_params = sum(p.numel() for p in params.values())
    if batch == 0:
        return torch.zeros(0, num_params, device=first.device, dtype=first.dtype)
    parts = [compute(model, params, inputs[part], targets[part], loss_fn)
             for part in physical_batches(batch, max_chunk)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def physical_batches(count: int, limit: int | None) -> list[slice]:
    """Split ``count`` examples into passes of at most ``limit`` (None: one pass), as equal as the count allows.

    Equal passes rather than full ones plus a remainder: a pass costs a fixed overhead (one forward and backward
    through every layer) plus a share per example, so 2 passes of 10 are cheaper than one of 16 and one of 4 at the
    same peak. ``count = 0`` gives no pass.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"a physical batch must hold at least 1 example, got {limit}")
    passes = 1 if limit is None or count <= limit else -(-count // limit)
    bounds = [count * i // passes for i in range(passes + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(passes) if bounds[i + 1] > bounds[i]]


def hooks_supported(model: nn.Module, params: Mapping[str, torch.Tensor]) -> bool:
    """Whether every parameter in ``params`` is owned by a module type the ``"hooks"`` method handles."""
    return not _unhookable(model, params)


# -- vmap ------------------------------------------------------------------------------------------------------


def _vmap_gradients(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: LossFn,
) -> torch.Tensor:
    # Everything not differentiated is passed detached, so torch.func does not also build an outer autograd graph
    # through the model's own requires_grad parameters.
    fixed = {name: t.detach() for name, t in model.named_parameters()}
    fixed.update({name: b for name, b in model.named_buffers()})
    names = list(params)

    def example_loss(diff: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        outputs = functional_call(model, {**fixed, **diff}, (x.unsqueeze(0),))
        return _checked_losses(loss_fn(outputs, y.unsqueeze(0)), 1).sum()

    # randomness="different": dropout/drop-path draw an independent mask per example, as in a batched forward.
    grads = vmap(grad(example_loss), in_dims=(None, 0, 0), randomness="different")(
        {n: params[n].detach() for n in names}, inputs, targets
    )
    return torch.cat([grads[n].reshape(inputs.shape[0], -1) for n in names], dim=1)


# -- hooks -----------------------------------------------------------------------------------------------------


def _hook_gradients(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: LossFn,
) -> torch.Tensor:
    batch = int(inputs.shape[0])
    per_param: dict[str, torch.Tensor] = {}

    def add_layer(owner: str, module: nn.Module, layer_in: torch.Tensor, g_out: torch.Tensor,
                  statistics: layer_grads.Statistics) -> None:
        for attr, g in layer_grads.layer_per_example_grads(module, layer_in, g_out, statistics).items():
            name = f"{owner}.{attr}" if owner else attr
            if name in params:
                per_param[name] = per_param[name] + g if name in per_param else g

    copies = _hook_pass(model, params, inputs, targets, loss_fn, add_layer)
    if copies is None:  # the loss does not depend on the parameters
        return torch.cat([torch.zeros(batch, p.numel(), device=p.device, dtype=p.dtype) for p in params.values()], 1)
    per_param.update(copies)
    rows = [
        per_param[name].reshape(batch, -1)
        if name in per_param
        else torch.zeros(batch, p.numel(), device=p.device, dtype=p.dtype)
        for name, p in params.items()
    ]
    return torch.cat(rows, dim=1)


LayerCallback = Callable[[str, nn.Module, torch.Tensor, torch.Tensor, layer_grads.Statistics], None]


def _hook_pass(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: LossFn,
    on_layer: LayerCallback,
) -> dict[str, torch.Tensor] | None:
    """The hooks method's one forward and one backward: ``on_layer(owner, module, input, output gradient,
    statistics)`` for every call of an owner module whose output influenced the loss, as the backward reaches it
    (then its input is let go); returns the per-example gradients ``(B, *shape)`` of the parameters the model takes
    as per-example copies, or None when no owner ran and no copy was used (the loss does not depend on them)."""
    batch = int(inputs.shape[0])
    copied = _per_example_names(model, params)
    owners = {_owner_name(name) for name in params if name not in copied}
    named = dict(model.named_modules())  # one walk of the module tree, not one per parameter
    modules = {owner: named[owner] for owner in owners}
    calls: list[layer_grads.LayerCall] = []  # every call of an owner module, in call order

    # enable_grad: a caller's no_grad() must not silently turn the layer outputs into constants.
    with torch.enable_grad(), layer_grads.record_calls(modules, calls):
        # Differentiable copies of the requested tensors make every owner's output part of the graph; the rest is
        # detached so no other gradient is computed.
        diff = {n: p.detach().requires_grad_(True) for n, p in params.items() if n not in copied}
        diff.update({n: params[n].detach().expand(batch, *params[n].shape).clone().requires_grad_(True)
                     for n in copied})
        fixed = {name: t.detach() for name, t in model.named_parameters()}
        fixed.update({name: b for name, b in model.named_buffers()})
        outputs = functional_call(model, {**fixed, **diff}, (inputs,))
        total_loss = _checked_losses(loss_fn(outputs, targets), batch).sum()
    if not total_loss.requires_grad:
        return None
    if any(call.output._version != call.version for call in calls):
        # An in-place op on a layer output re-points its grad_fn: the output gradient would be the wrong one.
        raise RuntimeError("a layer output was modified in place; use method='vmap' or out-of-place ops")
    owner_of = [call.owner for call in calls]
    input_of: list[torch.Tensor | None] = [call.layer_input for call in calls]
    statistics_of = [call.statistics for call in calls]
    layer_outputs = [call.output for call in calls]
    calls.clear()  # input_of holds the only references to the layer inputs, dropped as each is used

    def add_layer(index: int, g_out: torch.Tensor) -> None:
        # Runs as soon as the backward reaches this call's output: the callback, then the layer's input is let go,
        # so the inputs of the layers behind the backward are freed as it goes (a step's peak holds the output
        # gradients, not every layer's input as well).
        owner, layer_in = owner_of[index], input_of[index]
        input_of[index] = None
        on_layer(owner, modules[owner], layer_in, g_out, statistics_of[index])

    # A call whose output did not influence the loss gets no gradient: its hook never runs.
    handles = [out.register_hook(partial(add_layer, index)) for index, out in enumerate(layer_outputs)]
    # Only the gradients at the layer outputs (and the per-example copies) are requested: the parameter-gradient
    # kernels are skipped. The outputs are named by their graph edges, so that no reference here keeps an output
    # alive once the backward is past it.
    wanted = [*(get_gradient_edge(out) for out in layer_outputs), *(diff[n] for n in copied)]
    del layer_outputs
    try:
        grads = torch.autograd.grad(total_loss, wanted, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return {n: g for n, g in zip(copied, grads[len(owner_of):], strict=True) if g is not None}


def hook_clipped_sum(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    clip_bound: float,
    loss_fn: LossFn = per_example_cross_entropy,
    *,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``sum_i clip(g_i, R)`` -> ``(P,)`` in `dtype`, by the hooks method, without the ``(B, P)`` matrix of
    per-example gradients: the norm of example i's gradient is summed from every layer's part, and the clipped sum
    taken layer by layer. A linear layer called once on ``(B, in)`` inputs never forms its ``(B, out, in)``
    per-example weight gradients: example i's is the outer product of its output gradient δ_i and input x_i, whose
    squared norm is ``‖δ_i‖²·‖x_i‖²`` and whose clipped sum is ``(c ⊙ δ)ᵀ x``, one matmul (Goodfellow 2015; Li et
    al.'s ghost clipping). Every other layer's per-example gradients are formed as
    :func:`per_sample_gradients` forms them, one layer at a time. The factors and the sums are taken in `dtype`, so
    each example's clipped contribution has norm at most R as computed (the secure path's float64). The same sum as
    ``clipped_sum(per_sample_gradients(..., method="hooks"), R)`` up to rounding; a row that is not finite counts 0.
    """
    if not (math.isfinite(clip_bound) and clip_bound > 0):
        raise ValueError(f"clip bound must be positive and finite, got {clip_bound}")
    _check_param_names(model, params)
    unhookable = _unhookable(model, params)
    if unhookable:
        raise ValueError(f"hook_clipped_sum needs every parameter hookable (unsupported: {', '.join(unhookable)})")
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"inputs and targets disagree on the batch size: {inputs.shape[0]} vs {targets.shape[0]}")
    batch = int(inputs.shape[0])
    first = next(iter(params.values()))
    if batch == 0:
        return torch.zeros(sum(p.numel() for p in params.values()), dtype=dtype, device=first.device)
    outer: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # a once-called linear layer: (x, δ), (B, in), (B, out)
    formed: dict[str, torch.Tensor] = {}  # every other parameter's per-example gradients, (B, numel)
    calls: dict[str, int] = {}

    def add_layer(owner: str, module: nn.Module, layer_in: torch.Tensor, g_out: torch.Tensor,
                  statistics: layer_grads.Statistics) -> None:
        calls[owner] = calls.get(owner, 0) + 1
        if isinstance(module, nn.Linear) and layer_in.dim() == 2 and owner not in outer and calls[owner] == 1:
            outer[owner] = (layer_in, g_out)
            return
        if owner in outer:  # called again (shared weights): its per-example gradients are formed after all
            x, g = outer.pop(owner)
            add_layer_grads(owner, module, x, g, None)
        add_layer_grads(owner, module, layer_in, g_out, statistics)

    def add_layer_grads(owner: str, module: nn.Module, layer_in: torch.Tensor, g_out: torch.Tensor,
                        statistics: layer_grads.Statistics) -> None:
        for attr, g in layer_grads.layer_per_example_grads(module, layer_in, g_out, statistics).items():
            name = f"{owner}.{attr}" if owner else attr
            if name in params:
                g = g.reshape(batch, -1)
                formed[name] = formed[name] + g if name in formed else g

    copies = _hook_pass(model, params, inputs, targets, loss_fn, add_layer) or {}
    for name in list(copies):
        formed[name] = copies.pop(name).reshape(batch, -1)
    # Each float32 block is dropped once widened, and a row's squared norm is taken without squaring the block:
    # neither the two precisions of a block nor its square are held at once (a pass's largest tensors).
    wide = {name: formed.pop(name).to(dtype) for name in list(formed)}
    pairs = {owner: tuple(t.to(dtype) for t in outer.pop(owner)) for owner in list(outer)}
    squared = torch.zeros(batch, dtype=dtype, device=first.device)
    for g in wide.values():
        squared += _row_dots(g)
    for owner, (x, g) in pairs.items():
        with_bias = f"{owner}.bias" if owner else "bias"
        weight_wanted = (f"{owner}.weight" if owner else "weight") in params
        g_sq = _row_dots(g)
        if weight_wanted:
            squared += g_sq * _row_dots(x)
        if with_bias in params:
            squared += g_sq
    norms = squared.sqrt()
    factors = torch.where(torch.isfinite(norms), 1.0 / torch.clamp(norms / clip_bound, min=1.0), 0.0)
    kept = factors > 0
    every = bool(kept.all())  # else a dropped row is made 0 first: 0 * nan would be nan
    pieces = []
    for name, p in params.items():
        owner, attr = _owner_name(name), name.rsplit(".", 1)[-1]
        if name in wide:
            pieces.append(factors @ (wide[name] if every else torch.where(kept[:, None], wide[name], 0.0)))
        elif owner in pairs:
            x, g = pairs[owner] if every else (torch.where(kept[:, None], t, 0.0) for t in pairs[owner])
            scaled = g * factors[:, None]
            pieces.append((scaled.T @ x).reshape(-1) if attr == "weight" else scaled.sum(dim=0))
        else:  # not reached by the loss: no gradient
            pieces.append(torch.zeros(p.numel(), dtype=dtype, device=first.device))
    return torch.cat(pieces)


def _row_dots(rows: torch.Tensor) -> torch.Tensor:
    """``(B, n) -> (B,)``: each row's squared norm, without a (B, n) square (2-5x faster on the CPU)."""
    return torch.linalg.vector_norm(rows, dim=1).square()


def _hookable(module: nn.Module, attr: str) -> bool:
    if isinstance(module, nn.Conv2d):
        # Non-zero padding modes pad before the conv and string paddings are not unfold arguments.
        return module.padding_mode == "zeros" and not isinstance(module.padding, str)
    return isinstance(module, _HOOKABLE) and attr in ("weight", "bias")


def _per_example_names(model: nn.Module, params: Mapping[str, torch.Tensor]) -> list[str]:
    """The requested parameters the model's forward takes as per-example copies (its ``per_example_parameters``)."""
    declared = set(getattr(model, "per_example_parameters", ()))
    return [name for name in params if name in declared]


def _unhookable(model: nn.Module, params: Mapping[str, torch.Tensor]) -> list[str]:
    copied = set(_per_example_names(model, params))
    named = dict(model.named_modules())  # one walk of the module tree, not one per parameter
    return [name for name in params
            if name not in copied and not _hookable(named[_owner_name(name)], name.rsplit(".", 1)[-1])]


def _owner_name(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def _check_param_names(model: nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    known = {name for name, _ in model.named_parameters()}
    unknown = [name for name in params if name not in known]
    if unknown:
        raise KeyError(f"not parameters of the model: {', '.join(unknown)}")


def _checked_losses(losses: torch.Tensor, batch: int) -> torch.Tensor:
    if losses.shape != (batch,):
        raise ValueError(
            f"loss_fn must return one loss per example, shape ({batch},), got {tuple(losses.shape)}; "
            "use e.g. F.cross_entropy(..., reduction='none')"
        )
    return losses
