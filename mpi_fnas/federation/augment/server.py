"""The augmentation's global state on rank 0: the network's weights, their update and the public schedules. No MPI.

The weights travel as one flat float32 vector (the wire format), as in the search. SGD with momentum and weight
decay is element-wise, so stepping the flat vector equals stepping every tensor. With ``augment.optimizer: adadp``
the update is the search's ADADP rule (:mod:`mpi_fnas.federation.adadp`): two half steps per iteration.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mpi_fnas.config import AugmentConfig
from mpi_fnas.evaluation import evaluate
from mpi_fnas.federation.adadp import AdadpSettings, AdadpStep, adadp_gradient
from mpi_fnas.federation.flat import assign, flatten
from mpi_fnas.federation.probe import probe_accuracy
from mpi_fnas.space import AugmentNetwork
from mpi_fnas.space.dpnas import DpnasNetwork


def augment_learning_rate(cfg: AugmentConfig, step: int, steps: int) -> float:
    """The SGD learning rate of iteration `step` (1-based) of `steps`: cosine from lr to lr_min, per step."""
    progress = (step - 1) / max(steps, 1)
    return cfg.lr_min + 0.5 * (cfg.lr - cfg.lr_min) * (1.0 + math.cos(math.pi * progress))


def drop_path_probability(cfg: AugmentConfig, step: int, steps_per_epoch: int) -> float:
    """DARTS' linear ramp: ``drop_path · epoch / epochs`` with the 0-based epoch of `step` (1-based).

    A pure function of public settings, so the parties follow it without a message.
    """
    epoch = (step - 1) // steps_per_epoch
    return cfg.drop_path * epoch / max(cfg.epochs, 1)


class AugmentServer:
    """Global weights of the augmented network (rank 0) and their optimizer.

    Args:
        model: the network built from the seed (every rank builds the same); also evaluates on the test split.
        cfg: the ``augment`` section (optimiser settings).
        parties: the number of releases averaged into each update: K, or K′ when the server selects.
        steps: iterations of the whole augmentation (the cosine schedule's length).
        adadp: with ``augment.optimizer: adadp``, the step-size rule's settings; each iteration is then
            :meth:`adadp_half_step` and :meth:`adadp_full_step` instead of :meth:`step` (``lr`` the initial η).
    """

    def __init__(self, model: AugmentNetwork | DpnasNetwork, cfg: AugmentConfig, parties: int, steps: int,
                 adadp: AdadpSettings | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.parties = parties
        self.steps = steps
        self.w = torch.nn.Parameter(torch.from_numpy(flatten(list(model.weights()))))
        self.opt = torch.optim.SGD([self.w], lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        self.adadp = AdadpStep(adadp, cfg.lr) if adadp is not None else None

    @property
    def w_buffer(self) -> np.ndarray:
        """The weights as a float32 numpy view (shares memory with the parameter)."""
        return self.w.data.numpy()

    @property
    def lr(self) -> float:
        """The learning rate the last iteration used (under ADADP its η; NaN before the first ADADP iteration)."""
        if self.adadp is not None:
            return self.adadp.lr_used
        return float(self.opt.param_groups[0]["lr"])

    @property
    def adadp_err(self) -> float:
        """ADADP's error estimate of the last iteration (the log's ``adadp_err``); NaN outside ADADP."""
        return self.adadp.err if self.adadp is not None else math.nan

    def step(self, step: int, summed_grad: np.ndarray) -> None:
        """One SGD step at iteration `step` on the mean of the K party gradients (clipped to ``grad_clip``)."""
        for group in self.opt.param_groups:
            group["lr"] = augment_learning_rate(self.cfg, step, self.steps)
        self.w.grad = torch.from_numpy(np.ascontiguousarray(summed_grad / self.parties, dtype=np.float32))
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([self.w], self.cfg.grad_clip)
        self.opt.step()

    def adadp_half_step(self, summed_grad: np.ndarray) -> None:
        """ADADP, first round: W ← W_half = W − (η/2)·G1 from the K parties' summed releases (n,)."""
        assert self.adadp is not None
        self._set_w(self.adadp.half(self.w_buffer, self._adadp_gradient(summed_grad)))

    def adadp_full_step(self, summed_grad: np.ndarray) -> None:
        """ADADP, second round: W ← the next iterate from G2 (summed, (n,)) at W_half; η adapts."""
        assert self.adadp is not None
        self._set_w(self.adadp.finish(self.w_buffer, self._adadp_gradient(summed_grad)))

    def _adadp_gradient(self, summed_grad: np.ndarray) -> np.ndarray:
        return adadp_gradient(summed_grad / self.parties, self.w_buffer, clip=self.cfg.grad_clip,
                              weight_decay=self.cfg.weight_decay)

    def _set_w(self, flat: np.ndarray) -> None:
        with torch.no_grad():
            self.w.copy_(torch.from_numpy(flat))

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        """[loss_sum, correct, count] of the global weights on (x, y), in eval mode."""
        assign(list(self.model.weights()), self.w_buffer)
        return evaluate(self.model, x, y)

    def probe_accuracy(self, grad: np.ndarray, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        """SecProbe's score of one party's release g (num_w,) at iteration `step`: the accuracy on (x, y) of
        W − lr·g at that iteration's scheduled lr, with the server's ``grad_clip``
        (:func:`mpi_fnas.federation.probe.probe_accuracy`). W and the optimizer are unchanged."""
        return probe_accuracy(self.model, list(self.model.weights()), self.w.data, grad,
                              augment_learning_rate(self.cfg, step, self.steps), self.cfg.grad_clip, x, y)

    def state_dict(self) -> dict:
        return {"w": self.w.data.clone(), "opt": self.opt.state_dict(),
                "adadp": self.adadp.state_dict() if self.adadp is not None else None}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.w.copy_(state["w"])
        self.opt.load_state_dict(state["opt"])
        if self.adadp is not None:
            self.adadp.load_state_dict(state["adadp"])
