"""Minimal pure-torch reproducer of the heap corruption on AVX2 CPUs (no mpi_fnas import).

oneDNN 3.12 (torch 2.13/2.14 CPU wheels) writes past its "reduce to unit stride" (rtus) workspace in the weight
gradient of a strided 1x1 convolution whose input is channels-last (nhwc) with fewer input channels than the
kernel's channel block: 8 for ``jit_1x1:avx2``, 16 for ``jit_1x1:avx512_core``. Upstream:
uxlfoundation/oneDNN#6035. In mpi_fnas the op was FactorizedReduce's two 1x1 stride-2 convolutions
(docs/benchmarks.md, "heap corruption on AVX2 CPUs").

    python scripts/repro_onednn_avx2.py [--ic 4] [--oc 8] [--stride 2] [--batch 4] [--side 8] [--layout cl|nchw]
                                        [--iters 300] [--threads 1] [--subsample]

Run it under ``ONEDNN_MAX_CPU_ISA=AVX2`` on a CPU with AVX-512 to get the AVX2 kernels. Exit 0 and ``ok`` when every
iteration finished and the weight gradient equals float64's; glibc's abort (134), SIGSEGV (139) or exit 1 (a wrong
gradient) when the kernel corrupted memory. ``--subsample`` computes the same convolution as mpi_fnas does now: the
strided input ``x[:, :, ::s, ::s]`` through a stride-1 1x1 convolution, which needs no rtus workspace.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ic", type=int, default=4)
    parser.add_argument("--oc", type=int, default=8)
    parser.add_argument("--stride", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--side", type=int, default=8)
    parser.add_argument("--layout", choices=("cl", "nchw"), default="cl")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--subsample", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    fmt = torch.channels_last if args.layout == "cl" else torch.contiguous_format
    weight = torch.randn(args.oc, args.ic, 1, 1).contiguous(memory_format=fmt).requires_grad_()
    for _ in range(args.iters):
        x = torch.randn(args.batch, args.ic, args.side, args.side).contiguous(memory_format=fmt)
        if args.subsample:
            y = F.conv2d(x[:, :, :: args.stride, :: args.stride], weight)
        else:
            y = F.conv2d(x, weight, stride=args.stride)
        grad_out = torch.randn_like(y)
        (grad_weight,) = torch.autograd.grad(y, weight, grad_out)
    # The same gradient in float64, which takes no oneDNN kernel: sum over examples and positions of g * x.
    x64, g64 = x[:, :, :: args.stride, :: args.stride].double(), grad_out.double()
    expected = torch.einsum("nohw,nihw->oi", g64, x64)[:, :, None, None]
    error = (grad_weight.double() - expected).abs().max().item()
    if error > 1e-3 * max(1.0, expected.abs().max().item()):
        print(f"wrong weight gradient: max error {error:.3g}", flush=True)
        return 1
    print(f"ok: {args.iters} iterations, max error {error:.2g}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
