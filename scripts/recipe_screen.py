"""One-process screen of a network's private training on mnist-5k (docs/log/benchmarks.md, "the private recipe").

Full-batch DP-GD on the 4,000 train digits: each example's gradient clipped to ``--clip``, one Gaussian noise of std
``sigma * clip`` on the sum, divided by 4,000. That is what the secure path does when every party's batch is its
whole pool (q = 1): one noise for the sum of the 8 parties' clipped sums. Then SGD with momentum, weight decay, a
cosine lr per step and the server's clip 1 of the update, as the augmentation does. ``--clip 0``: the exact mean
gradient (non-private). sigma: the secure path's calibration at a total ε of 3 (10.7157 for 40 steps, 18.352 for
100), or ``--sigma``. ``--act tanh|selu`` swaps every ReLU module of the network for that activation. Prints the test
accuracy every 10 steps with the per-example gradient norms' median and 10/90 % quantiles, then one JSON line.

    PYTHONPATH=. python scripts/recipe_screen.py --clip 0 --lr 0.05   # DARTS_V2 cell, no noise: 0.570
    PYTHONPATH=. python scripts/recipe_screen.py --act tanh --lr 2    # DARTS_V2 cell, tanh in its ops, DP: 0.281

``--copies M --crop-padding P``: augmentation multiplicity (De et al. 2022), each example's gradient the mean over M
randomly cropped copies before the clip. ``--ema D``: also the test accuracy of an exponential moving average of the
weights (decay D, updated after every step), which is post-processing of the released updates and costs no ε.
``--gn-groups G``: GroupNorm with at most G groups instead of the package's 4 (``mpi_fnas.space.ops.make_norm``: gcd
of the channels and G; 1 normalises over every channel of an example, as LayerNorm does).

Not part of the package: no MPI, one process, two threads.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from mpi_fnas.config import load_config
from mpi_fnas.data.augmentation import augment_images
from mpi_fnas.data.datasets import open_dataset
from mpi_fnas.keystream import Keystream
from mpi_fnas.privacy.clipping import clipped_sum
from mpi_fnas.privacy.per_sample import per_sample_gradients
from mpi_fnas.space import ops as space_ops
from mpi_fnas.space.augmented import augment_network
from mpi_fnas.space.kinds import search_space

#: σ of the secure path's calibration at total ε 3, δ 1e-5, q = 1, by number of steps.
SECURE_SIGMA_AT_EPSILON_3 = {40: 10.7157, 100: 18.352}
DARTS_V2 = ("normal=sep_conv_3x3@0,sep_conv_3x3@1|sep_conv_3x3@0,sep_conv_3x3@1|sep_conv_3x3@1,skip_connect@0|"
            "skip_connect@0,dil_conv_3x3@2;normal_concat=2,3,4,5;reduce=max_pool_3x3@0,max_pool_3x3@1|"
            "skip_connect@2,max_pool_3x3@1|max_pool_3x3@0,skip_connect@2|skip_connect@2,max_pool_3x3@1;"
            "reduce_concat=2,3,4,5")
ACTIVATIONS = {"tanh": nn.Tanh, "selu": nn.SELU}


def swap_relus(module: nn.Module, activation: str) -> None:
    """Replace every ``nn.ReLU`` child of `module` (recursively) by a new `activation` module, in place."""
    for name, child in module.named_children():
        if isinstance(child, nn.ReLU):
            setattr(module, name, ACTIVATIONS[activation]())
        else:
            swap_relus(child, activation)


def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy of `net` on x (N, 1, 14, 14), y (N,)."""
    net.eval()
    with torch.no_grad():
        correct = (net(x).argmax(1) == y).float().mean().item()
    net.train()
    return correct


def noisy_mean_gradient(net: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                        clip: float, sigma: float, generator: torch.Generator, chunk: int = 500, copies: int = 1,
                        crop_padding: int = 0, stream: Keystream | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(P,) sum of the per-example gradients clipped to `clip` plus N(0, (sigma·clip)²), divided by N; and the (N,)
    per-example gradient norms before clipping. `copies` > 1: augmentation multiplicity (De et al. 2022): each
    example's gradient is the mean over that many randomly cropped copies (`crop_padding`), taken before the clip, so
    one example still moves the sum by at most `clip`."""
    total = torch.zeros(sum(p.numel() for p in params.values()))
    norms = []
    for start in range(0, len(x), chunk):
        xb, yb = x[start:start + chunk], y[start:start + chunk]
        if copies > 1:
            xb = torch.cat([augment_images(xb, stream=stream, crop_padding=crop_padding) for _ in range(copies)])
            grads = per_sample_gradients(net, params, xb, yb.repeat(copies)).view(copies, len(yb), -1).mean(0)
        else:
            grads = per_sample_gradients(net, params, xb, yb)
        norms.append(grads.norm(dim=1))
        total += clipped_sum(grads, clip)  # the parties' own clip
    total += torch.randn(total.shape, generator=generator) * sigma * clip
    return total / len(x), torch.cat(norms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=3e-4)
    parser.add_argument("--clip", type=float, default=1.0, help="per-example clip; 0: exact gradients, no noise")
    parser.add_argument("--sigma", type=float, default=None, help="default: the secure path's σ at ε 3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--act", choices=("relu", *ACTIVATIONS), default="relu")
    parser.add_argument("--genotype", default=DARTS_V2)
    parser.add_argument("--set", action="append", default=[], help="config override on configs/mnist.yaml")
    parser.add_argument("--copies", type=int, default=1, help="augmentation multiplicity: randomly cropped copies "
                        "per example, their gradients averaged before the clip")
    parser.add_argument("--crop-padding", type=int, default=1, help="with --copies > 1: the random crop's padding")
    parser.add_argument("--ema", type=float, default=0.0, help="also evaluate an exponential moving average of the "
                        "weights with this decay (0: none)")
    parser.add_argument("--gn-groups", type=int, default=None, help="GroupNorm's largest number of groups "
                        "(default: the package's)")
    args = parser.parse_args()
    if args.gn_groups is not None:  # read by make_norm when the network is built, below
        space_ops._GROUPNORM_MAX_GROUPS = args.gn_groups
    torch.set_num_threads(2)
    sigma = SECURE_SIGMA_AT_EPSILON_3[args.steps] if args.sigma is None else args.sigma
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "mnist.yaml", args.set)
    train = open_dataset("mnist-5k", "train", root="data", image_size=14, size=None, seed=0)
    test = open_dataset("mnist-5k", "test", root="data", image_size=14, size=None, seed=0)
    x_train, y_train = train.render(np.arange(len(train)))
    x_test, y_test = test.render(np.arange(len(test)))
    genotype = search_space(cfg.space.kind).parse_genotype(args.genotype) if cfg.augment.network == "cell" else None
    net = augment_network(cfg, genotype, seed=args.seed, in_channels=1, num_classes=10)
    if args.act != "relu":
        swap_relus(net, args.act)
    params = dict(net.named_parameters())
    generator = torch.Generator().manual_seed(1000 + args.seed)
    stream = Keystream.from_os()
    velocity = [torch.zeros_like(p) for p in params.values()]
    averaged = [p.detach().clone() for p in params.values()] if args.ema > 0 else None
    started = time.time()
    for step in range(args.steps):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        norms = None
        if args.clip > 0:
            grad, norms = noisy_mean_gradient(net, params, x_train, y_train, args.clip, sigma, generator,
                                              copies=args.copies, crop_padding=args.crop_padding, stream=stream)
        else:
            net.zero_grad()
            nn.functional.cross_entropy(net(x_train), y_train).backward()
            grad = torch.cat([p.grad.flatten() for p in params.values()])
        grad_norm = grad.norm().item()
        if grad_norm > 1.0:
            grad = grad / grad_norm
        offset = 0
        with torch.no_grad():
            for p, v in zip(params.values(), velocity, strict=True):
                g = grad[offset:offset + p.numel()].view_as(p) + args.weight_decay * p
                offset += p.numel()
                v.mul_(args.momentum).add_(g)
                p.sub_(lr * v)
            if args.ema > 0:
                for p, a in zip(params.values(), averaged, strict=True):
                    a.lerp_(p, 1 - args.ema)
        if step % 10 == 9 or step == args.steps - 1:
            spread = ("" if norms is None else f" grad norm median {norms.median():.2f} p10 {norms.quantile(.1):.2f} "
                      f"p90 {norms.quantile(.9):.2f}")
            print(f"step {step + 1} acc {accuracy(net, x_test, y_test):.3f}{spread} |update| {grad_norm:.3f} "
                  f"{time.time() - started:.0f}s", flush=True)
    result = {"acc": accuracy(net, x_test, y_test)}
    if args.ema > 0:
        with torch.no_grad():
            for p, a in zip(params.values(), averaged, strict=True):
                p.copy_(a)
        result["ema_acc"] = accuracy(net, x_test, y_test)
    print(json.dumps({"params": sum(p.numel() for p in params.values()), **result,
                      "wall": time.time() - started, "args": vars(args)}))


if __name__ == "__main__":
    main()
