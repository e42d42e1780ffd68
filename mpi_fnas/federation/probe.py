"""SecProbe's score of one release (Zhao et al.): the accuracy on the server's aux set of the weights that release
alone would step to. No MPI; shared by the search's and the augmentation's servers.

The probe is a plain gradient step, W − lr·clip(g), at the stage's current learning rate and with its server-side
norm clip, no momentum and no weight decay: it scores the release, not the optimizer's history.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from mpi_fnas.evaluation import evaluate
from mpi_fnas.federation.flat import assign


def probe_accuracy(model: nn.Module, weights: Sequence[torch.Tensor], w: torch.Tensor, grad: np.ndarray, lr: float,
                   clip: float, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy on (x (n, C, H, W), y (n,)) of `model` with its `weights` set to W − lr·g.

    Args:
        model: the server's network, its other tensors (the search's A) already the global ones.
        weights: the tensors of `model` that W flattens (``model.weights()``), overwritten here.
        w: the global W (num_w,) float32, unchanged.
        grad: one party's W release g (num_w,).
        lr: the step size of the probe (the stage's current learning rate).
        clip: the server's norm clip of an update (0: none); g is scaled down to it.
    """
    g = torch.from_numpy(np.ascontiguousarray(grad, dtype=np.float32))
    if clip > 0:
        norm = float(torch.linalg.vector_norm(g))
        if norm > clip:
            g = g * (clip / norm)
    assign(weights, w - lr * g)
    stats = evaluate(model, x, y)
    return float(stats[1] / stats[2])
