"""The parameter server's state: global W and A, their optimizers and the LR schedule. No MPI here.

W and A live as two flat float32 vectors (the wire format), so the optimizers act element-wise on exactly what
travels; SGD with momentum and weight decay and Adam are element-wise, so this equals per-tensor optimisation.
The numpy views ``w_buffer`` / ``a_buffer`` share memory with the tensors: a Bcast sends them without copies.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mpi_fnas.config import SearchConfig
from mpi_fnas.evaluation import evaluate
from mpi_fnas.federation.adadp import AdadpSettings, AdadpStep, adadp_gradient
from mpi_fnas.federation.flat import assign, flatten
from mpi_fnas.federation.probe import probe_accuracy
from mpi_fnas.space import Genotype, SearchNetwork
from mpi_fnas.space.dpnas import DpnasGenotype, DpnasSearchNetwork


def w_learning_rate(search: SearchConfig, epoch: int) -> float:
    """Cosine-annealed W learning rate of `epoch` (0-based), as DARTS: w_lr → w_lr_min over `epochs`.

    A pure function of public settings, so every party knows ξ for the second-order term without a message.
    """
    progress = min(epoch, search.epochs) / search.epochs
    return search.w_lr_min + 0.5 * (search.w_lr - search.w_lr_min) * (1.0 + math.cos(math.pi * progress))


class Server:
    """Global state of the search (rank 0).

    Args:
        model: a supernet of any space (``search_space(kind).build_supernet``) whose current W and A are the initial
            global values (rank 0 builds it from the seed); it is also used to evaluate on the server's test split
            and to derive genotypes.
        search: optimiser settings.
        parties: K, for ``aggregate: mean``.
        adadp: with ``search.w_optimizer: adadp``, the step-size rule's settings; W then takes an ADADP step
            (:meth:`adadp_half_step`, then :meth:`adadp_full_step`) instead of the SGD step.
    """

    def __init__(self, model: SearchNetwork | DpnasSearchNetwork, search: SearchConfig, parties: int,
                 adadp: AdadpSettings | None = None) -> None:
        # `parties` is the number of releases summed into each update: K, or K′ when the server selects.
        self.model = model
        self.search = search
        self.parties = parties
        self.w = torch.nn.Parameter(torch.from_numpy(flatten(list(model.weights()))))
        self.a = torch.nn.Parameter(torch.from_numpy(flatten(list(model.alphas()))))
        self.w_opt = torch.optim.SGD(
            [self.w], lr=search.w_lr, momentum=search.w_momentum, weight_decay=search.w_weight_decay
        )
        if search.a_optimizer == "adam":
            self.a_opt: torch.optim.Optimizer = torch.optim.Adam(
                [self.a], lr=search.a_lr, betas=(search.a_beta1, search.a_beta2), weight_decay=search.a_weight_decay
            )
        else:
            self.a_opt = torch.optim.SGD([self.a], lr=search.a_lr, weight_decay=search.a_weight_decay)
        self.adadp = AdadpStep(adadp, search.w_lr) if adadp is not None else None
        self.epoch = 0

    @property
    def w_buffer(self) -> np.ndarray:
        """W as a float32 numpy view (shares memory with the parameter)."""
        return self.w.data.numpy()

    @property
    def a_buffer(self) -> np.ndarray:
        return self.a.data.numpy()

    @property
    def xi(self) -> float:
        """The current W learning rate: the ξ of the unrolled step W' = W − ξ·∇W (Eq. 4–5); ADADP's η."""
        if self.adadp is not None:
            return self.adadp.lr
        return float(self.w_opt.param_groups[0]["lr"])

    def w_log_values(self) -> tuple[float, float]:
        """(w_lr, adadp_err) of the log: the W learning rate used by the last step, and ADADP's error (NaN
        outside ADADP)."""
        if self.adadp is not None:
            return self.adadp.lr_used, self.adadp.err
        return self.xi, float("nan")

    def aggregate(self, summed: np.ndarray) -> np.ndarray:
        """Combine the Reduce-summed party vectors: their mean (default) or their sum (the paper's Eq. 3–4)."""
        return summed / self.parties if self.search.aggregate == "mean" else summed

    def step_w(self, summed_grad: np.ndarray) -> None:
        """W ← SGD step on the aggregated party gradients (clipped to ``w_grad_clip`` in norm)."""
        self.w.grad = torch.from_numpy(np.ascontiguousarray(self.aggregate(summed_grad), dtype=np.float32))
        if self.search.w_grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([self.w], self.search.w_grad_clip)
        self.w_opt.step()

    def adadp_half_step(self, summed_grad: np.ndarray) -> None:
        """ADADP, first W round: W ← W_half = W − (η/2)·G1, the point of the parties' second release."""
        assert self.adadp is not None
        g1 = self._adadp_gradient(summed_grad)
        self._set_w(self.adadp.half(self.w_buffer, g1))

    def adadp_full_step(self, summed_grad: np.ndarray) -> None:
        """ADADP, second W round: W ← the next iterate from G2 at W_half; η adapts (docs/adadp.md)."""
        assert self.adadp is not None
        g2 = self._adadp_gradient(summed_grad)
        self._set_w(self.adadp.finish(self.w_buffer, g2))

    def _adadp_gradient(self, summed_grad: np.ndarray) -> np.ndarray:
        """The aggregated W gradient at the current W (n,) float32, norm-clipped, plus weight decay·W."""
        return adadp_gradient(self.aggregate(summed_grad), self.w_buffer, clip=self.search.w_grad_clip,
                              weight_decay=self.search.w_weight_decay)

    def _set_w(self, flat: np.ndarray) -> None:
        with torch.no_grad():
            self.w.copy_(torch.from_numpy(flat))

    def step_a(self, summed_grad: np.ndarray) -> None:
        """A ← optimizer step (Adam or SGD) on the aggregated party architecture gradients."""
        self.a.grad = torch.from_numpy(np.ascontiguousarray(self.aggregate(summed_grad), dtype=np.float32))
        self.a_opt.step()

    def start_epoch(self, epoch: int) -> None:
        """Set the W learning rate of `epoch` (0-based) from the public cosine schedule (ADADP ignores it)."""
        self.epoch = epoch
        for group in self.w_opt.param_groups:
            group["lr"] = w_learning_rate(self.search, epoch)

    def state_dict(self) -> dict:
        return {"w": self.w.data.clone(), "a": self.a.data.clone(), "w_opt": self.w_opt.state_dict(),
                "a_opt": self.a_opt.state_dict(), "epoch": self.epoch,
                "adadp": self.adadp.state_dict() if self.adadp is not None else None}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.w.copy_(state["w"])
            self.a.copy_(state["a"])
        self.w_opt.load_state_dict(state["w_opt"])
        self.a_opt.load_state_dict(state["a_opt"])
        if self.adadp is not None:
            self.adadp.load_state_dict(state["adadp"])
        self.start_epoch(int(state["epoch"]))

    # -- views of the global state ---------------------------------------------------------------------------------
    def sync_model(self) -> SearchNetwork | DpnasSearchNetwork:
        """Copy the global W and A into the server's model (for evaluation / genotype) and return it."""
        assign(list(self.model.weights()), self.w_buffer)
        assign(list(self.model.alphas()), self.a_buffer)
        return self.model

    def alpha_softmax(self) -> dict[str, np.ndarray]:
        """{"normal": (edges, ops), "reduce": (edges, ops)} softmax weights of the global A."""
        soft = self.sync_model().alpha_softmax()
        return {k: v.detach().cpu().numpy().astype(np.float32) for k, v in soft.items()}

    def genotype(self) -> Genotype | DpnasGenotype:
        return self.sync_model().genotype()

    def alpha_movement(self) -> tuple[float, float]:
        """How far the search has moved A from uniform: (the edges' mean softmax entropy over log(ops), 1.0 for
        uniform weights; the edges' mean margin p_top − p_second, 0.0 for uniform ones)."""
        rows = np.concatenate([w for w in self.alpha_softmax().values() if w.size], axis=0).astype(np.float64)
        entropy = -(rows * np.log(np.clip(rows, 1e-300, None))).sum(axis=1) / np.log(rows.shape[1])
        top = np.sort(rows, axis=1)
        return float(entropy.mean()), float((top[:, -1] - top[:, -2]).mean())

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        """[loss_sum, correct, count] of the global model on (x, y)."""
        return evaluate(self.sync_model(), x, y)

    def probe_accuracy(self, grad: np.ndarray, x: torch.Tensor, y: torch.Tensor) -> float:
        """Accuracy on (x, y) of W − ξ·g, the weights one party's W release g (num_w,) alone would step to, with
        the current A (:func:`mpi_fnas.federation.probe.probe_accuracy`, the server's clip ``w_grad_clip``). W, A
        and the optimizers are unchanged."""
        model = self.sync_model()
        return probe_accuracy(model, list(model.weights()), self.w.data, grad, self.xi, self.search.w_grad_clip, x, y)
