"""The parameter server's state of a stage (rank 0): the global W (and the search's A), their optimizers and the
learning-rate schedule. No MPI here.

W and A live as flat float32 vectors (the wire format), so the optimizers act element-wise on exactly what
travels; SGD with momentum and weight decay and Adam are element-wise, so this equals per-tensor optimisation.
The numpy views ``w_buffer`` / ``a_buffer`` share memory with the tensors. With ADADP the W update is the
step-size rule of :mod:`mpi_fnas.federation.adadp` (two rounds per iteration) instead of the SGD step.

The stage says the rest (:mod:`mpi_fnas.stages.rank0_driver`): W's update rule, its public per-step schedule, and
A's optimizer in the search.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mpi_fnas.config import AugmentConfig, SearchConfig
from mpi_fnas.cpu_kernels import images_to_channels_last, to_channels_last
from mpi_fnas.evaluation import evaluate
from mpi_fnas.federation.adadp import AdadpSettings, AdadpStep, adadp_gradient
from mpi_fnas.federation.flat import assign, flatten
from mpi_fnas.federation.probe import probe_accuracy
from mpi_fnas.federation.schedules import augment_learning_rate, search_learning_rate
from mpi_fnas.optim import FlatAdam, FlatSGD
from mpi_fnas.space import Genotype
from mpi_fnas.space.dpnas import DpnasGenotype


@dataclass(frozen=True)
class UpdateRule:
    """How rank 0 steps W from the parties' summed releases: SGD (or ADADP, starting at η = ``lr``) at the
    schedule's ``lr_at(step)``, with momentum and weight decay, the aggregate clipped to ``grad_clip`` in L2 norm
    (0: none). ``aggregate``: ``mean`` divides the sum by the number of summed releases, ``sum`` keeps it (the
    paper's Eq. 3–4)."""

    lr: float  # the configured (initial) learning rate
    lr_at: Callable[[int], float]  # the public learning rate of 1-based iteration `step`
    momentum: float
    weight_decay: float
    grad_clip: float
    aggregate: str = "mean"


class Server:
    """Global state of one stage on rank 0.

    Args:
        model: the stage's network (the search's supernet, the augmentation's network) whose current W (and A)
            are the initial global values (every rank builds it from the seed); also used to evaluate on the
            server's test split, to probe releases and (the search) to derive genotypes.
        rule: W's update rule.
        parties: the number of releases summed into each update: K, or K′ when the server selects.
        adadp: with ADADP, its settings; W then takes :meth:`adadp_half_step` and :meth:`adadp_full_step`.
        a_optimizer: the search's A optimizer, built on the flat A parameter; None: the stage has no A.
    """

    def __init__(self, model: nn.Module, rule: UpdateRule, parties: int, *, adadp: AdadpSettings | None = None,
                 a_optimizer: Callable[[nn.Parameter], FlatSGD | FlatAdam] | None = None) -> None:
        # Rank 0 computes on the CPU, where channels-last runs its evaluations (the test split, SecProbe's probes) in
        # about 55 % of the CPU time (docs/log/benchmarks.md, "Rank 0"); W and A are flattened in the default order.
        self.model = to_channels_last(model)
        self.rule, self.parties = rule, parties
        self.w = nn.Parameter(torch.from_numpy(flatten(list(model.weights()))))
        self.w_opt = FlatSGD(self.w, lr=rule.lr, momentum=rule.momentum, weight_decay=rule.weight_decay)
        self.adadp = AdadpStep(adadp, rule.lr) if adadp is not None else None
        self.a = nn.Parameter(torch.from_numpy(flatten(list(model.alphas())))) if a_optimizer is not None else None
        self.a_opt = a_optimizer(self.a) if a_optimizer is not None else None

    @property
    def w_buffer(self) -> np.ndarray:
        """W as a float32 numpy view (shares memory with the parameter)."""
        return self.w.data.numpy()

    @property
    def a_buffer(self) -> np.ndarray | None:
        return self.a.data.numpy() if self.a is not None else None

    @property
    def lr(self) -> float:
        """The current SGD learning rate of W: the ξ of the unrolled step W' = W − ξ·∇W (Eq. 4–5) and of a probe."""
        return float(self.w_opt.param_groups[0]["lr"])

    def log_values(self) -> tuple[float, float]:
        """(the W learning rate the last step used, ADADP's error of it) for the log; under ADADP η (NaN before
        the first step), else the SGD rate and NaN."""
        if self.adadp is not None:
            return self.adadp.lr_used, self.adadp.err
        return self.lr, math.nan

    def begin_step(self, step: int) -> None:
        """Set W's learning rate of iteration `step` (1-based) from the public schedule (ADADP adapts its own)."""
        for group in self.w_opt.param_groups:
            group["lr"] = self.rule.lr_at(step)

    def aggregate(self, summed: np.ndarray) -> np.ndarray:
        """Combine the summed party vectors: their mean (default) or their sum."""
        return summed / self.parties if self.rule.aggregate == "mean" else summed

    def w_updates(self) -> list[Callable[[np.ndarray], None]]:
        """W's update of each W round of an iteration: the SGD step, or ADADP's two halves."""
        return [self.step_w] if self.adadp is None else [self.adadp_half_step, self.adadp_full_step]

    def step_w(self, summed_grad: np.ndarray) -> None:
        """W ← SGD step on the aggregated party gradients (clipped to ``grad_clip`` in norm)."""
        self.w.grad = torch.from_numpy(np.ascontiguousarray(self.aggregate(summed_grad), dtype=np.float32))
        if self.rule.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([self.w], self.rule.grad_clip)
        self.w_opt.step()

    def adadp_half_step(self, summed_grad: np.ndarray) -> None:
        """ADADP, first W round: W ← W_half = W − (η/2)·G1, the point of the parties' second release."""
        assert self.adadp is not None
        self._adadp_step(self.adadp.half, summed_grad)

    def adadp_full_step(self, summed_grad: np.ndarray) -> None:
        """ADADP, second W round: W ← the next iterate from G2 at W_half; η adapts (docs/adadp.md)."""
        assert self.adadp is not None
        self._adadp_step(self.adadp.finish, summed_grad)

    def _adadp_step(self, step: Callable[[np.ndarray, np.ndarray], np.ndarray], summed_grad: np.ndarray) -> None:
        """W ← step(W, g), g the aggregated W gradient at the current W (n,) float32, norm-clipped, + weight decay·W."""
        grad = adadp_gradient(self.aggregate(summed_grad), self.w_buffer, clip=self.rule.grad_clip,
                              weight_decay=self.rule.weight_decay)
        with torch.no_grad():
            self.w.copy_(torch.from_numpy(step(self.w_buffer, grad)))

    def step_a(self, summed_grad: np.ndarray) -> None:
        """A ← its optimizer's step on the aggregated party architecture gradients."""
        self.a.grad = torch.from_numpy(np.ascontiguousarray(self.aggregate(summed_grad), dtype=np.float32))
        self.a_opt.step()

    def state_dict(self) -> dict:
        """W (and A), their optimizers and the update rule's state, for rank 0's checkpoint."""
        return {"w": self.w.data.clone(), "w_opt": self.w_opt.state_dict(),
                "a": self.a.data.clone() if self.a is not None else None,
                "a_opt": self.a_opt.state_dict() if self.a_opt is not None else None,
                "adadp": self.adadp.state_dict() if self.adadp is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state written by :meth:`state_dict`."""
        with torch.no_grad():
            self.w.copy_(state["w"])
            if self.a is not None:
                self.a.copy_(state["a"])
        self.w_opt.load_state_dict(state["w_opt"] if "w_opt" in state else state["opt"])  # "opt": older augment
        if self.a_opt is not None:
            self.a_opt.load_state_dict(state["a_opt"])
        if self.adadp is not None:
            self.adadp.load_state_dict(state["adadp"])

    # -- views of the global state ---------------------------------------------------------------------------------
    def sync_model(self) -> nn.Module:
        """Copy the global W (and A) into the server's model (for evaluation, probes, genotypes) and return it."""
        assign(list(self.model.weights()), self.w_buffer)
        if self.a is not None:
            assign(list(self.model.alphas()), self.a_buffer)
        return self.model

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        """[loss_sum, correct, count] of the global model on (x, y)."""
        return evaluate(self.sync_model(), images_to_channels_last(x), y)

    def probe_accuracy(self, grad: np.ndarray, x: torch.Tensor, y: torch.Tensor) -> float:
        """SecProbe's score of one party's W release g (num_w,): the accuracy on (x, y) of W − lr·g, the weights it
        alone would step to at this iteration's rate, with the current A and the server's ``grad_clip``
        (:func:`mpi_fnas.federation.probe.probe_accuracy`). W, A and the optimizers are unchanged."""
        model = self.sync_model()
        return probe_accuracy(model, list(model.weights()), self.w.data, grad, self.lr, self.rule.grad_clip,
                              images_to_channels_last(x), y)

    def alpha_softmax(self) -> dict[str, np.ndarray]:
        """The search: {"normal": (edges, ops), "reduce": (edges, ops)} softmax weights of the global A."""
        soft = self.sync_model().alpha_softmax()
        return {k: v.detach().cpu().numpy().astype(np.float32) for k, v in soft.items()}

    def genotype(self) -> Genotype | DpnasGenotype:
        """The search: the cell the global A derives."""
        return self.sync_model().genotype()

    def alpha_movement(self) -> tuple[float, float]:
        """The search: how far A has moved from uniform: (the edges' mean softmax entropy over log(ops), 1.0 for
        uniform weights; the edges' mean margin p_top − p_second, 0.0 for uniform ones)."""
        rows = np.concatenate([w for w in self.alpha_softmax().values() if w.size], axis=0).astype(np.float64)
        entropy = -(rows * np.log(np.clip(rows, 1e-300, None))).sum(axis=1) / np.log(rows.shape[1])
        top = np.sort(rows, axis=1)
        return float(entropy.mean()), float((top[:, -1] - top[:, -2]).mean())


def search_server(model: nn.Module, search: SearchConfig, parties: int, steps_per_epoch: int = 1,
                  adadp: AdadpSettings | None = None) -> Server:
    """The search's server: W by SGD (or ADADP) at the cosine rate of each epoch of `steps_per_epoch`
    iterations, A by Adam or SGD; both on the mean (or, ``search.aggregate: sum``, the sum) of the releases. Under
    ``search.method: gdas`` its model (what it evaluates and probes with) runs the argmax path, the network the
    parties' single paths train, rather than the mixture of every op."""
    if search.method == "gdas":
        model.argmax_path()
    def a_optimizer(a: nn.Parameter) -> FlatSGD | FlatAdam:
        if search.a_optimizer == "adam":
            return FlatAdam(a, lr=search.a_lr, betas=(search.a_beta1, search.a_beta2),
                            weight_decay=search.a_weight_decay)
        return FlatSGD(a, lr=search.a_lr, weight_decay=search.a_weight_decay)

    rule = UpdateRule(lr=search.w_lr, lr_at=lambda step: search_learning_rate(search, (step - 1) // steps_per_epoch),
                      momentum=search.w_momentum, weight_decay=search.w_weight_decay, grad_clip=search.w_grad_clip,
                      aggregate=search.aggregate)
    return Server(model, rule, parties, adadp=adadp, a_optimizer=a_optimizer)


def augment_server(model: nn.Module, augment: AugmentConfig, parties: int, steps: int,
                   adadp: AdadpSettings | None = None) -> Server:
    """The augmentation's server: the network's weights by SGD (or ADADP) on the mean release, at the cosine rate
    of each of its `steps` iterations."""
    rule = UpdateRule(lr=augment.lr, lr_at=lambda step: augment_learning_rate(augment, step, steps),
                      momentum=augment.momentum, weight_decay=augment.weight_decay, grad_clip=augment.grad_clip)
    return Server(model, rule, parties, adadp=adadp)
