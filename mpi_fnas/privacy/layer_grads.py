"""Per-example weight gradients of one layer from the tensors the hooks method saw (its input x and the gradient
of its output), without autograd's batched weight gradient (:mod:`mpi_fnas.privacy.per_sample`, ``"hooks"``).

For convolutions: one depthwise convolution of the input with the output gradients (depthwise kernels), one
batched matmul (dense 1x1 kernels), a loop over kernel offsets, one batched matmul of unfolded patches (dense
kernels on few output pixels), or one grouped weight-gradient kernel with the batch folded into the groups; an
outer product for linear layers, ``x_hat * grad`` for GroupNorm/LayerNorm (from the statistics the forward saved).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

Statistics = tuple[torch.Tensor, torch.Tensor] | None  # a GroupNorm call's saved (mean, rstd), each (B, G)


#: A dense convolution's per-example weight gradients come from unfolded patches (one batched matmul) when its input
#: channels are at least this many times its output pixels, from a grouped weight-gradient kernel otherwise. At 64
#: examples on one thread (docs/log/benchmarks.md, "against Opacus's") unfolding is 1.2–6× faster at 32–128
#: channels on 4×4 or 128 channels on 8×8 (Papernot et al.'s CIFAR-10 tanh net's last blocks), and 1.3–8× slower at 8–64
#: channels on 8×8 to 16×16 (the stems and the cells of the DARTS networks here).
UNFOLD_CHANNELS_PER_PIXEL = 2


class LayerCall(NamedTuple):
    """One call of an owner module in the forward, as the per-example hooks need it."""

    owner: str  # the module's name
    layer_input: torch.Tensor  # its input, detached
    output: torch.Tensor  # its output, in the graph
    version: int  # the output's version at the call (an in-place op on it would change it)
    statistics: Statistics  # what the forward saved for the backward (:func:`saved_statistics`)


@contextmanager
def record_calls(modules: Mapping[str, nn.Module], calls: list[LayerCall]) -> Iterator[None]:
    """While in the block, append every forward call of the `modules` (by owner name) to `calls`, in call order,
    with its input, output and what its forward saved."""
    handles = []
    for owner, module in modules.items():

        def record(mod: nn.Module, args: tuple, output: torch.Tensor, owner: str = owner) -> None:
            calls.append(LayerCall(owner, args[0].detach(), output, output._version, saved_statistics(mod, output)))

        handles.append(module.register_forward_hook(record))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def saved_statistics(module: nn.Module, output: torch.Tensor) -> Statistics:
    """An affine GroupNorm's per-(example, group) mean and 1/std, each (B, G), as its forward saved them for the
    backward; None for other modules, or where the output's graph node is not the native GroupNorm's."""
    if not (isinstance(module, nn.GroupNorm) and module.affine):
        return None
    node = output.grad_fn
    if type(node).__name__ != "NativeGroupNormBackward0":
        return None
    return node._saved_result1, node._saved_result2


def layer_per_example_grads(module: nn.Module, x: torch.Tensor, g_out: torch.Tensor,
                             statistics: Statistics = None) -> dict[str, torch.Tensor]:
    """``{"weight": (B, *weight.shape), "bias": (B, *bias.shape)}`` for one call of ``module``; `statistics`: what
    :func:`saved_statistics` found for the call."""
    batch = x.shape[0]
    result: dict[str, torch.Tensor] = {}
    if isinstance(module, nn.Conv2d):
        # Five exact ways, picked by speed (measured on CPU, see docs/log/benchmarks.md): for a depthwise kernel, one
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
            result["weight"] = conv_weight_grads_by_unfold(module, x, g_out)
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


def conv_weight_grads_by_unfold(conv: nn.Conv2d, x: torch.Tensor, g_out: torch.Tensor) -> torch.Tensor:
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
