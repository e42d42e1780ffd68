"""Which CPU kernels torch runs here, and the network layout that keeps them safe.

* :func:`onednn_isa`: the instruction set of oneDNN's kernels (convolutions, their gradients) in this process, as
  oneDNN names it: ``Intel AVX2`` on an AVX2-only CPU or under ``ONEDNN_MAX_CPU_ISA=AVX2``, ``Intel AVX-512 ...`` on
  an AVX-512 one. The bench and the run log (``/ranks`` attr ``onednn_isa``) record it, so that a number can be
  traced to its kernels. ATen's own vectorised kernels follow :func:`aten_cpu_capability` instead, which
  ``ONEDNN_MAX_CPU_ISA`` does not change.
* :func:`cpu_model`: the host's CPU model (``/ranks`` attr ``cpu_model``, the results' ``cpu_model`` column, the
  bench's), so that a wall time can be traced to its machine.
* :func:`to_channels_last`: a network in channels-last (NHWC) storage (:func:`images_to_channels_last`: its inputs),
  refused when it holds a 1x1 convolution of stride > 1: oneDNN 3.12's weight gradient of that convolution writes past
  its workspace for a channels-last input with fewer channels than its block (8 on AVX2, 16 on AVX-512;
  uxlfoundation/oneDNN#6035, docs/benchmarks.md "heap corruption on AVX2 CPUs"). The project's networks take such
  strides by slicing (``FactorizedReduce``); this check keeps a new network from bringing the kernel back.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["aten_cpu_capability", "cpu_model", "images_to_channels_last", "onednn_isa", "strided_pointwise_convs",
           "to_channels_last"]

_ISA_PREFIX = "isa:"


def aten_cpu_capability() -> str:
    """ATen's vectorised CPU kernels in this process: ``DEFAULT``, ``AVX2``, ``AVX512`` (``ATEN_CPU_CAPABILITY``)."""
    return str(torch.backends.cpu.get_cpu_capability())


@functools.cache
def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """This host's CPU model, e.g. ``AMD EPYC 9R14``: Linux's first ``model name``, else ``platform.processor()``."""
    model = ""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            model = next((line.split(":", 1)[1] for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return " ".join(model.split()) or platform.processor() or platform.machine() or "unknown CPU"


@functools.cache
def onednn_isa() -> str:
    """oneDNN's CPU instruction set in this process (e.g. ``Intel AVX2``); ``none`` without oneDNN.

    torch has no query for it, so oneDNN is asked the way a user would: one small channels-last convolution with its
    verbose mode on, whose header names the ISA, read from file descriptor 1 (redirected to a temporary file for
    that call only; oneDNN prints the header once per process, hence the cache).
    """
    if not torch.backends.mkldnn.is_available():
        return "none"
    x = torch.zeros(2, 8, 8, 8).contiguous(memory_format=torch.channels_last)
    weight = torch.zeros(8, 8, 3, 3).contiguous(memory_format=torch.channels_last)
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile() as captured:
        libc.fflush(None)
        saved = os.dup(1)
        try:
            os.dup2(captured.fileno(), 1)
            with torch.no_grad(), torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                F.conv2d(x, weight, padding=1)
            libc.fflush(None)  # oneDNN's printf buffer goes to the file, not to the restored stdout
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        text = captured.read().decode(errors="replace")
    for line in text.splitlines():
        if ",cpu," in line and _ISA_PREFIX in line:
            return line.split(_ISA_PREFIX, 1)[1].strip()
    return "unknown"


def strided_pointwise_convs(model: nn.Module) -> list[str]:
    """Names of `model`'s ``nn.Conv2d`` layers with a 1x1 kernel and a stride other than 1."""
    return [name for name, layer in model.named_modules()
            if isinstance(layer, nn.Conv2d) and tuple(layer.kernel_size) == (1, 1) and tuple(layer.stride) != (1, 1)]


def to_channels_last(model: nn.Module) -> nn.Module:
    """`model` in channels-last storage (in place, returned); ValueError when it has a strided 1x1 convolution,
    whose channels-last weight gradient corrupts memory in oneDNN 3.12 (see the module's docstring)."""
    unsafe = strided_pointwise_convs(model)
    if unsafe:
        raise ValueError(f"{type(model).__name__} has 1x1 convolutions of stride > 1 ({', '.join(unsafe)}), whose "
                         "channels-last weight gradient corrupts memory in oneDNN 3.12 (uxlfoundation/oneDNN#6035): "
                         "take the stride by slicing the input and convolve at stride 1 (as FactorizedReduce does)")
    return model.to(memory_format=torch.channels_last)


def images_to_channels_last(images: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) `images` in the layout of a network :func:`to_channels_last` made (no copy when they already
    are); a tensor of another shape as it is."""
    return images.contiguous(memory_format=torch.channels_last) if images.dim() == 4 else images
