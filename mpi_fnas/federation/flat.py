"""Flat float32 vectors <-> lists of tensors: the wire format of W, A and their gradients.

One contiguous buffer per quantity keeps every exchange to a single MPI call (no per-tensor messages, no pickling).
The order is the order of the tensor list (``SearchNetwork.weights()`` / ``.alphas()``), identical on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: Numbers appended to every party vector on the wire: loss sum, correct predictions, examples, compute seconds
#: (logging only; all zero under DP, where they would be unaccounted releases).
STATS = 4


def numel(tensors: Sequence[torch.Tensor]) -> int:
    """Total number of elements of `tensors`."""
    return sum(t.numel() for t in tensors)


def flatten(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """Concatenate `tensors` (any device) into a new float32 host vector of length ``numel(tensors)``."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
    return flat.to(device="cpu", dtype=torch.float32).numpy()


def assign(tensors: Sequence[torch.Tensor], flat: np.ndarray | torch.Tensor) -> None:
    """Copy the float32 vector `flat` into `tensors` in place (on their devices and dtypes)."""
    n = numel(tensors)
    if tuple(flat.shape) != (n,):
        raise ValueError(f"flat vector has shape {tuple(flat.shape)}, expected ({n},)")
    src = torch.as_tensor(flat)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            k = t.numel()
            t.copy_(src[offset : offset + k].view_as(t))
            offset += k
