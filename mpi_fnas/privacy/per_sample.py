"""Per-example gradients: one flat gradient vector per example of a batch.

Two exact methods behind one function:

* ``"vmap"`` — ``torch.func.vmap(torch.func.grad(loss of one example))`` over ``functional_call``. Works for
  any parameter of any model. Slow, and its first call imports ``torch._dynamo`` (~1.5 s per process).
* ``"hooks"`` — one ordinary batched forward, one backward to the *outputs* of the layers owning the parameters,
  and, as the backward reaches each layer, its per-example weight gradient from its input and output gradient (the
  layer's tensors are then let go, so a step's peak does not hold every layer at once): for convolutions one depthwise
  convolution of the input with the output gradients (depthwise kernels), one batched matmul (dense 1x1 kernels),
  a loop over kernel offsets, one batched matmul of unfolded patches (dense kernels on few output pixels), or one
  grouped weight-gradient kernel with the batch folded into the groups; an outer
  product for linear layers, ``x_hat * grad`` for GroupNorm/LayerNorm. Autograd is never asked for parameter gradients,
  so the backward skips the batched weight-gradient kernels that the per-example ones replace.
  Supported owners: ``nn.Conv2d`` (zero padding, any stride/dilation/groups), ``nn.Linear``, ``nn.GroupNorm``,
  ``nn.LayerNorm``. A module called several times in one forward (weight sharing) is handled by summing the
  contributions of every call; an in-place op on a recorded layer output is detected and refused.
  A parameter the model names in ``per_example_parameters`` (the DARTS and DPNAS alphas, which the network uses
  directly rather than through a leaf module) is replaced by B copies ``(B, *shape)``, example i using copy i
  (the model's forward supports that), and its per-example gradient is the gradient of copy i, from the same
  backward.
* ``"auto"`` (default) — ``"hooks"`` when every requested parameter has a supported owner or is one of the
  model's ``per_example_parameters``, else ``"vmap"``.

Both methods assume no layer mixes the examples of a batch (no BatchNorm): then example i's gradient depends
only on example i. ``mpi_fnas.privacy.validators.check_model_for_dp`` enforces that before any release.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, grad, vmap

#: ``loss_fn(outputs (b, ...), targets (b, ...)) -> (b,)`` per-example losses. Not reduced: a mean would
#: silently rescale the hooks method by 1/b, so a reduced loss is rejected.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Statistics = tuple[torch.Tensor, torch.Tensor] | None  # a GroupNorm call's saved (mean, rstd), each (B, G)
Method = Literal["auto", "vmap", "hooks"]

_HOOKABLE = (nn.Conv2d, nn.Linear, nn.GroupNorm, nn.LayerNorm)

#: A dense convolution's per-example weight gradients come from unfolded patches (one batched matmul) when its input
#: channels are at least this many times its output pixels, from a grouped weight-gradient kernel otherwise. At 64
#: examples on one thread (docs/benchmarks.md, "the private step against Opacus's") unfolding is 1.2–6× faster at 32–128
#: channels on 4×4 or 128 channels on 8×8 (Papernot et al.'s CIFAR-10 tanh net's last blocks), and 1.3–8× slower at 8–64
#: channels on 8×8 to 16×16 (the stems and the cells of the DARTS networks here).
UNFOLD_CHANNELS_PER_PIXEL = 2


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
        params: ``{name in model.named_parameters(): value}`` — the tensors to differentiate; their values
            replace the model's own for this computation (pass ``dict(model.named_parameters())`` to use them).
        inputs: ``(B, ...)`` batch; ``B = 0`` is allowed.
        targets: ``(B, ...)`` targets, passed to ``loss_fn``.
        loss_fn: per-example loss, ``(outputs (b, ...), targets (b, ...)) -> (b,)``.
        method: ``"auto"``, ``"vmap"`` or ``"hooks"`` (see the module docstring); all give the same result.
        max_chunk: process at most this many examples at a time, in :func:`physical_batches` (bounds peak memory);
            None = whole batch.

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
    copied = _per_example_names(model, params)
    owners = {_owner_name(name) for name in params if name not in copied}
    named = dict(model.named_modules())  # one walk of the module tree, not one per parameter
    modules = {owner: named[owner] for owner in owners}
    calls: list[_Call] = []  # every call of an owner module, in call order

    # enable_grad: a caller's no_grad() must not silently turn the layer outputs into constants.
    with torch.enable_grad(), _record_calls(modules, calls):
        # Differentiable copies of the requested tensors make every owner's output part of the graph; the rest is
        # detached so no other gradient is computed.
        diff = {n: p.detach().requires_grad_(True) for n, p in params.items() if n not in copied}
        diff.update({n: params[n].detach().expand(batch, *params[n].shape).clone().requires_grad_(True)
                     for n in copied})
        fixed = {name: t.detach() for name, t in model.named_parameters()}
        fixed.update({name: b for name, b in model.named_buffers()})
        outputs = functional_call(model, {**fixed, **diff}, (inputs,))
        total_loss = _checked_losses(loss_fn(outputs, targets), batch).sum()
    if not total_loss.requires_grad:  # no owner module ran, no copy was used: the loss does not depend on them
        return torch.cat([torch.zeros(batch, p.numel(), device=p.device, dtype=p.dtype) for p in params.values()], 1)
    if any(call.output._version != call.version for call in calls):
        # An in-place op on a layer output re-points its grad_fn: the output gradient would be the wrong one.
        raise RuntimeError("a layer output was modified in place; use method='vmap' or out-of-place ops")
    owner_of = [call.owner for call in calls]
    input_of: list[torch.Tensor | None] = [call.layer_input for call in calls]
    statistics_of = [call.statistics for call in calls]
    layer_outputs = [call.output for call in calls]
    calls.clear()  # input_of holds the only references to the layer inputs, dropped as each is used
    per_param: dict[str, torch.Tensor] = {}

    def add_layer(index: int, g_out: torch.Tensor) -> None:
        # Runs as soon as the backward reaches this call's output: the layer's per-example gradients, then its input
        # is let go, so the inputs of the layers behind the backward are freed as it goes (a step's peak holds the
        # output gradients, not every layer's input as well).
        owner, layer_in = owner_of[index], input_of[index]
        input_of[index] = None
        for attr, g in _layer_per_example_grads(modules[owner], layer_in, g_out, statistics_of[index]).items():
            name = f"{owner}.{attr}" if owner else attr
            if name in params:
                per_param[name] = per_param[name] + g if name in per_param else g

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
    for n, g in zip(copied, grads[len(owner_of):], strict=True):
        if g is not None:
            per_param[n] = g
    del grads
    rows = [
        per_param[name].reshape(batch, -1)
        if name in per_param
        else torch.zeros(batch, p.numel(), device=p.device, dtype=p.dtype)
        for name, p in params.items()
    ]
    return torch.cat(rows, dim=1)


class _Call(NamedTuple):
    """One call of an owner module in the forward, as the per-example hooks need it."""

    owner: str  # the module's name
    layer_input: torch.Tensor  # its input, detached
    output: torch.Tensor  # its output, in the graph
    version: int  # the output's version at the call (an in-place op on it would change it)
    statistics: Statistics  # what the forward saved for the backward (:func:`_saved_statistics`)


@contextmanager
def _record_calls(modules: Mapping[str, nn.Module], calls: list[_Call]) -> Iterator[None]:
    handles = []
    for owner, module in modules.items():

        def record(mod: nn.Module, args: tuple, output: torch.Tensor, owner: str = owner) -> None:
            calls.append(_Call(owner, args[0].detach(), output, output._version, _saved_statistics(mod, output)))

        handles.append(module.register_forward_hook(record))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _saved_statistics(module: nn.Module, output: torch.Tensor) -> Statistics:
    """An affine GroupNorm's per-(example, group) mean and 1/std, each (B, G), as its forward saved them for the
    backward; None for other modules, or where the output's graph node is not the native GroupNorm's."""
    if not (isinstance(module, nn.GroupNorm) and module.affine):
        return None
    node = output.grad_fn
    if type(node).__name__ != "NativeGroupNormBackward0":
        return None
    return node._saved_result1, node._saved_result2


def _layer_per_example_grads(module: nn.Module, x: torch.Tensor, g_out: torch.Tensor,
                             statistics: Statistics = None) -> dict[str, torch.Tensor]:
    """``{"weight": (B, *weight.shape), "bias": (B, *bias.shape)}`` for one call of ``module``; `statistics`: what
    :func:`_saved_statistics` found for the call."""
    batch = x.shape[0]
    result: dict[str, torch.Tensor] = {}
    if isinstance(module, nn.Conv2d):
        # Five exact ways, picked by speed (measured on CPU, see docs/benchmarks.md): for a depthwise kernel, one
        # depthwise convolution of the input with the output gradient; for a dense 1x1 kernel, one batched matmul;
        # a loop over kernel offsets for other dilated or 1x1 kernels (mkldnn's dilated weight gradient is slow);
        # one batched matmul of unfolded patches for a dense kernel with few output pixels per input channel (the
        # deep layers of a CNN: B tiny convolutions cost more than their arithmetic there); a grouped convolution
        # backward with one group per (example, group) elsewhere.
        depthwise = module.groups == module.in_channels == module.out_channels
        if depthwise:
            result["weight"] = _depthwise_weight_grads_by_correlation(module, x, g_out)
        elif module.kernel_size == (1, 1) and module.groups == 1 and module.padding == (0, 0):
            result["weight"] = _pointwise_weight_grads_by_bmm(module, x, g_out)
        elif module.kernel_size == (1, 1) or max(module.dilation) > 1:
            result["weight"] = _conv_weight_grads_by_offsets(module, x, g_out)
        elif module.groups == 1 and module.in_channels >= UNFOLD_CHANNELS_PER_PIXEL * g_out[0, 0].numel():
            result["weight"] = _conv_weight_grads_by_unfold(module, x, g_out)
        else:
            result["weight"] = _conv_weight_grads_by_grouped_backward(module, x, g_out)
        if module.bias is not None:
            result["bias"] = g_out.sum(dim=(2, 3))
    elif isinstance(module, nn.Linear):
        g = g_out.reshape(batch, -1, module.out_features)
        result["weight"] = torch.einsum("bto,bti->boi", g, x.reshape(batch, -1, module.in_features))
        if module.bias is not None:
            result["bias"] = g.sum(dim=1)
    elif isinstance(module, nn.GroupNorm) and module.affine:
        # y = x_hat * weight + bias per channel, x_hat = (x - mean) * rstd per example and group.
        spatial = tuple(range(2, x.dim()))
        g_sum = g_out.sum(dim=spatial)  # (B, C)
        if statistics is None:  # normalise again
            x_hat = F.group_norm(x, module.num_groups, eps=module.eps)
            result["weight"] = (g_out * x_hat).sum(dim=spatial)
        else:
            # From the forward's own mean and rstd, as GroupNorm's backward forms its weight gradient:
            # sum(g * x_hat) = rstd * (sum(g * x) - mean * sum(g)). Normalising again took about as long as the
            # layer's forward.
            channels_per_group = module.num_channels // module.num_groups
            mean, rstd = (s.repeat_interleave(channels_per_group, dim=1) for s in statistics)  # (B, C) each
            result["weight"] = ((g_out * x).sum(dim=spatial) - g_sum * mean) * rstd
        result["bias"] = g_sum
    elif isinstance(module, nn.LayerNorm) and module.elementwise_affine:
        x_hat = F.layer_norm(x, module.normalized_shape, eps=module.eps)
        # Sum over the dims between the batch and the normalised ones (none for (B, features) inputs; note that
        # sum(dim=()) would reduce everything).
        leading = tuple(range(1, x.dim() - len(module.normalized_shape)))
        weighted = g_out * x_hat
        result["weight"] = weighted.sum(dim=leading) if leading else weighted
        if module.bias is not None:
            result["bias"] = g_out.sum(dim=leading) if leading else g_out
    return result


def _conv_weight_grads_by_offsets(conv: nn.Conv2d, x: torch.Tensor, g_out: torch.Tensor) -> torch.Tensor:
    """Per-example conv weight gradients ``(B, *conv.weight.shape)`` as a sum over kernel offsets.

    For offset (i, j), the weight gradient of example b is ``sum_{h,w} g_out[b, o, h, w] * x_pad[b, c, h*s + i*d,
    w*s + j*d]`` within each group: a strided slice of the padded input contracted with the output gradient.
    """
    batch, groups = x.shape[0], conv.groups
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = conv.kernel_size, conv.stride, conv.dilation, conv.padding
    out_h, out_w = g_out.shape[2:]
    padded = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
    padded = padded.reshape(batch, groups, conv.in_channels // groups, *padded.shape[2:])
    g = g_out.reshape(batch, groups, conv.out_channels // groups, out_h, out_w)
    per_offset = []
    for i in range(kh):
        for j in range(kw):
            patch = padded[
                ..., i * dh : i * dh + sh * (out_h - 1) + 1 : sh, j * dw : j * dw + sw * (out_w - 1) + 1 : sw
            ]
            per_offset.append(torch.einsum("bgohw,bgihw->bgoi", g, patch))
    return torch.stack(per_offset, dim=-1).reshape(batch, *conv.weight.shape)


def _conv_weight_grads_by_unfold(conv: nn.Conv2d, x: torch.Tensor, g_out: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients ``(B, C_out, C_in, kh, kw)`` of a dense (groups 1) convolution, im2col style.

    ``F.unfold`` gives example b's input patches ``(C_in·kh·kw, H'W')``; its gradient is ``g_b (C_out, H'W')`` times
    their transpose: one batched matmul. The patches take kh·kw times the input's memory, which is why only layers
    with few output pixels use it (:data:`UNFOLD_CHANNELS_PER_PIXEL`).
    """
    patches = F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=conv.padding, stride=conv.stride)
    return torch.bmm(g_out.flatten(2), patches.transpose(1, 2)).reshape(x.shape[0], *conv.weight.shape)


def _pointwise_weight_grads_by_bmm(conv: nn.Conv2d, x: torch.Tensor, g_out: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients ``(B, C_out, C_in, 1, 1)`` of a dense 1x1 convolution without padding.

    Example b's gradient is ``g_b (C_out, H'W') @ x_b^T (H'W', C_in)``, x_b read at the pixels the stride visits:
    one batched matmul. Flattening H'W' is a view in either memory layout (a strided x is copied once), so a
    channels-last batch needs no transposing copy (2-6× faster than the offset loop's einsum at these sizes).
    """
    sh, sw = conv.stride
    read = x[..., ::sh, ::sw] if (sh, sw) != (1, 1) else x
    return torch.bmm(g_out.flatten(2), read.flatten(2).transpose(1, 2)).reshape(x.shape[0], *conv.weight.shape)


def _depthwise_weight_grads_by_correlation(conv: nn.Conv2d, x: torch.Tensor, g_out: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients ``(B, C, 1, kh, kw)`` of a depthwise conv (groups = in = out channels C).

    Example b's gradient at offset (i, j) of channel c is ``sum_{h,w} g_out[b, c, h, w] * x_pad[b, c, h*s + i*d,
    w*s + j*d]``: the correlation of the padded input with the output gradient, taken with stride d and dilation s.
    With the B·C (example, channel) pairs as the channels of one image, that is a single depthwise convolution
    whose kernels are the output gradients; its first kh × kw outputs are the gradients. The convolution pads x
    itself: a separate ``F.pad`` of a channels-last x, copied to the folded layout, cost 2-3× the whole call.
    """
    batch, channels = x.shape[0], conv.in_channels
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    kernels = g_out.reshape(batch * channels, 1, *g_out.shape[2:])
    grads = F.conv2d(x.reshape(1, batch * channels, *x.shape[2:]), kernels, stride=(dh, dw), padding=conv.padding,
                     dilation=(sh, sw), groups=batch * channels)
    return grads[..., :kh, :kw].reshape(batch, *conv.weight.shape)


def _conv_weight_grads_by_grouped_backward(conv: nn.Conv2d, x: torch.Tensor, g_out: torch.Tensor) -> torch.Tensor:
    """Per-example conv weight gradients ``(B, *conv.weight.shape)`` from one grouped weight-gradient kernel.

    Folding the batch into the channels, ``(1, B*Cin, H, W)`` with ``B*groups`` groups, makes the batched weight
    gradient of that single "example" the stack of the per-example weight gradients.
    """
    batch = x.shape[0]
    weight_shape = (batch * conv.out_channels, *conv.weight.shape[1:])
    _, weight_grad, _ = torch.ops.aten.convolution_backward(
        g_out.reshape(1, batch * conv.out_channels, *g_out.shape[2:]),
        x.reshape(1, batch * conv.in_channels, *x.shape[2:]),
        conv.weight.detach().expand(batch, *conv.weight.shape).reshape(weight_shape),
        None,
        conv.stride,
        conv.padding,
        conv.dilation,
        False,
        [0, 0],
        batch * conv.groups,
        [False, True, False],
    )
    return weight_grad.reshape(batch, *conv.weight.shape)


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
