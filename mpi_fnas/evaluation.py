"""Loss and accuracy of a model on a set of examples (used by the server on its test split). No MPI here."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

#: Examples per forward pass of an evaluation. 128, not 256: about half the rise of rank 0's peak memory, in the same
#: CPU time (docs/log/benchmarks.md, "Rank 0's evaluation").
EVAL_BATCH = 128


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = EVAL_BATCH) -> np.ndarray:
    """[loss_sum, correct, count] of `model` on (x (N, C, H, W), y (N,)) as float32 (3,).

    Runs in eval mode (no drop-path, no auxiliary head). Neither network keeps running statistics, so their
    BatchNorm, where allowed, normalises with the batch's statistics in eval mode too.
    """
    was_training = model.training
    model.eval()
    loss_sum = 0.0
    correct = 0.0
    for i in range(0, int(y.shape[0]), batch_size):
        logits = model(x[i : i + batch_size])
        target = y[i : i + batch_size]
        loss_sum += float(F.cross_entropy(logits, target, reduction="sum"))
        correct += float((logits.argmax(1) == target).sum())
    model.train(was_training)
    return np.array([loss_sum, correct, float(y.shape[0])], dtype=np.float32)


def ratio(a: float, b: float) -> float:
    """a / b, NaN when b is not positive (no example, no accuracy)."""
    return float(a / b) if b > 0 else float("nan")
