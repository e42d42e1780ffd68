"""A dilated depthwise convolution whose input gradient runs on the fast forward kernel (CPU).

oneDNN's backward-data kernel for depthwise convolutions is slow on the CPU when the kernel is dilated, and far slower
at stride 2 (docs/log/benchmarks.md, "Dilated depthwise input gradient"). Every DARTS ``dil_conv`` holds one, and every
step, plain or private, back-propagates through it.

The input gradient of ``y = conv(x, w)`` (stride s, padding p, dilation d, kernel k) is a convolution of the output
gradient g, with s − 1 zeros inserted between its pixels, and the flipped kernel::

    grad_x = conv2d(up_s(g), flip(w), padding = d·(k − 1) − p, dilation = d, groups = C)

where ``up_s(g)`` is g spread onto every s-th pixel of a zero grid of side ``H + 2p − d·(k − 1)`` (so the result has
the input's side H). :class:`DepthwiseConv2d` uses it for dilated kernels on the CPU; undilated ones (where a Python
autograd function's cost per call outweighs the gain) and every GPU keep oneDNN's kernel, and the weight gradient
stays oneDNN's. Values equal oneDNN's up to float rounding (``tests/test_space.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def depthwise_input_gradient(grad_out: torch.Tensor, weight: torch.Tensor, input_size: tuple[int, int],
                             stride: tuple[int, int], padding: tuple[int, int],
                             dilation: tuple[int, int]) -> torch.Tensor:
    """The input gradient ``(B, C, H, W)`` of a depthwise convolution from its output gradient ``(B, C, H', W')``
    and its weight ``(C, 1, kh, kw)``, as one forward depthwise convolution (the module docstring). Needs
    ``padding <= dilation·(kernel − 1)`` in each dimension. Keeps ``grad_out``'s memory format."""
    batch, channels, out_h, out_w = grad_out.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = weight.shape[2:], stride, padding, dilation
    side_h, side_w = input_size[0] + 2 * ph - dh * (kh - 1), input_size[1] + 2 * pw - dw * (kw - 1)
    spread = grad_out
    if (side_h, side_w) != (out_h, out_w):  # stride > 1: out_h·sh >= side_h > (out_h − 1)·sh, and likewise for w
        # Out of place (F.pad and reshape, not a slice assignment), so that vmap can batch it (torch.func).
        channels_last = grad_out.is_contiguous(memory_format=torch.channels_last) and not grad_out.is_contiguous()
        if sw > 1:
            spread = F.pad(spread.unsqueeze(-1), (0, sw - 1)).reshape(batch, channels, out_h, out_w * sw)
        if sh > 1:
            spread = F.pad(spread.unsqueeze(-2), (0, 0, 0, sh - 1)).reshape(batch, channels, out_h * sh, -1)
        spread = spread[..., :side_h, :side_w]
        if channels_last:
            spread = spread.contiguous(memory_format=torch.channels_last)
    return F.conv2d(spread, weight.flip(2, 3), padding=(dh * (kh - 1) - ph, dw * (kw - 1) - pw), dilation=dilation,
                    groups=channels)


_stock_kernels_only = False


@contextmanager
def stock_kernels() -> Iterator[None]:
    """Within: every :class:`DepthwiseConv2d` runs oneDNN's kernels, so that ``torch.utils.flop_counter`` counts
    the convolution the network computes, not the 4× larger zero-spread grid of a stride-2 input gradient (the
    bench's ``step_gflop``)."""
    global _stock_kernels_only
    previous, _stock_kernels_only = _stock_kernels_only, True
    try:
        yield
    finally:
        _stock_kernels_only = previous


class _DepthwiseConv(torch.autograd.Function):
    """``conv2d(x, weight, groups = C)`` whose backward computes the input gradient by
    :func:`depthwise_input_gradient`; functorch transforms (vmap, grad) derive their rules from it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, stride: tuple[int, int], padding: tuple[int, int],
                dilation: tuple[int, int]) -> torch.Tensor:
        return F.conv2d(x, weight, None, stride, padding, dilation, weight.shape[0])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, weight, stride, padding, dilation = inputs
        ctx.save_for_backward(x, weight)
        ctx.geometry = (stride, padding, dilation)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        stride, padding, dilation = ctx.geometry
        grad_x = grad_w = None
        if _engine_needs(ctx, 0):
            grad_x = depthwise_input_gradient(grad_out, weight, tuple(x.shape[2:]), stride, padding, dilation)
        if _engine_needs(ctx, 1):
            grad_w = _weight_gradient(grad_out, x, weight, stride, padding, dilation)
        return grad_x, grad_w, None, None, None


def _weight_gradient(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: tuple[int, int],
                     padding: tuple[int, int], dilation: tuple[int, int]) -> torch.Tensor:
    """oneDNN's weight gradient ``(C, 1, kh, kw)`` of the depthwise convolution (summed over the batch)."""
    return torch.ops.aten.convolution_backward(grad_out, x, weight, None, stride, padding, dilation, False, [0, 0],
                                               weight.shape[0], [False, True, False])[1]


# torch's private engine query (the one its public register_multi_grad_hook uses); a torch without it computes all.
_will_engine_execute_node = getattr(torch._C, "_will_engine_execute_node", None)


def _engine_needs(ctx: Any, index: int) -> bool:
    """Whether this backward pass uses input `index`'s gradient. ``needs_input_grad`` only says that the input
    requires grad; a private release asks autograd for the layer outputs' gradients alone (the per-example hooks),
    and then the weight's would be a wasted oneDNN weight-gradient kernel, the slowest part of the backward. Native
    nodes skip it the same way (``torch.autograd.graph.register_multi_grad_hook`` asks the engine likewise). Where the
    engine cannot tell, the gradient is computed."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[index][0]
    if node is None or _will_engine_execute_node is None:
        return True
    try:
        return _will_engine_execute_node(node)
    except RuntimeError:  # the engine cannot tell for a leaf under torch.autograd.grad (torch.func.grad): compute
        return True


class DepthwiseConv2d(nn.Conv2d):
    """``nn.Conv2d(channels, channels, kernel_size, groups=channels, bias=False)`` (zero padding): ``(N, C, H, W)``
    -> ``(N, C, H', W')``, the same parameters and outputs, with the faster input gradient on the CPU when dilated.
    A subclass, so the per-example hooks treat it as the convolution it is."""

    def __init__(self, channels: int, kernel_size: int, *, stride: int = 1, padding: int = 0,
                 dilation: int = 1) -> None:
        super().__init__(channels, channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                         groups=channels, bias=False)
        reach = [d * (k - 1) for d, k in zip(self.dilation, self.kernel_size, strict=True)]
        self.fast_input_gradient = (max(self.dilation) > 1
                                    and all(p <= r for p, r in zip(self.padding, reach, strict=True)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The depthwise convolution of `x` (a faster input gradient on CPU where it applies)."""
        if (not self.fast_input_gradient or x.device.type != "cpu" or not torch.is_grad_enabled()
                or _stock_kernels_only):
            return super().forward(x)
        return _DepthwiseConv.apply(x, self.weight, self.stride, self.padding, self.dilation)
