"""A party's local computation: gradients of W and A on its own shards. No MPI here.

The party holds a local copy of the supernet (W_k, A_k), its train shard D_k^tr and its validation shard D_k^val,
and produces the vectors Algorithm 1 sends to the server:

* ``w_release()``  — G_k, the gradient of W on a train batch (first half of an iteration);
* ``a_release()``  — H_k, the gradient of A on a validation batch at the freshly broadcast W' (first order);
* ``val_gradients()`` + ``a_release_second_order(v)`` — H_k with the DARTS finite-difference Hessian term (Eq. 5).

Every release returns a float32 vector: the gradient followed by ``STATS`` = 4 summary numbers
(loss sum, correct predictions, examples, compute seconds) that ride in the same Reduce for logging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from mpi_fnas.evaluation import evaluate
from mpi_fnas.federation.flat import STATS, assign, flatten, numel
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.privacy import DPParams, PrivacyError, check_model_for_dp
from mpi_fnas.privacy.keystream import Keystream
from mpi_fnas.privacy.release import Release
from mpi_fnas.space import SearchNetwork
from mpi_fnas.space.dpnas import DpnasSearchNetwork


@dataclass
class Shard:
    """A party's examples: x (N, C, H, W) float32, y (N,) int64, on the party's device."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def examples(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) at `indices` (CPU or device), on the shard's device."""
        indices = indices.to(self.y.device)
        return self.x[indices], self.y[indices]


class BatchStream:
    """Shuffled mini-batches of a shard, reshuffled whenever fewer than `batch_size` unseen examples remain.

    A batch size at least the shard size gives the whole shard every time (full-batch gradients).
    """

    def __init__(self, size: int, batch_size: int, stream: Keystream) -> None:
        if size < 1:
            raise ValueError("a party shard must hold at least one example")
        self.size = size
        self.batch_size = min(batch_size, size)
        self.stream = stream
        self._order = torch.empty(0, dtype=torch.long)
        self._pos = 0

    def next(self) -> torch.Tensor:
        """Indices (batch_size,) int64 into the shard."""
        if self._pos + self.batch_size > self._order.numel():
            self._order = self.stream.permutation(self.size)
            self._pos = 0
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return idx

    def state_dict(self) -> dict:
        return {"order": self._order.clone(), "pos": self._pos}

    def load_state_dict(self, state: dict) -> None:
        self._order = state["order"].clone()
        self._pos = int(state["pos"])


class Party:
    """Local DARTS computation of one party.

    Args:
        model: the supernet; its W and A are overwritten by the server's broadcasts.
        train, val: the party's shards (already on the model's device).
        batch_size: examples per step.
        randomness: the party's streams of this stage: ``sampling`` for batch order and Poisson coins, ``noise``
            for the Gaussian noise (DP only). Secret under DP (:mod:`mpi_fnas.federation.randomness`).
        dp: DP-FNAS settings; None for FNAS (exact mean gradients).
    """

    def __init__(
        self, model: SearchNetwork | DpnasSearchNetwork, train: Shard, val: Shard, batch_size: int,
        randomness: PartyRandomness, dp: DPParams | None = None,
    ) -> None:
        self.model = model
        self.w_params = list(model.weights())
        self.a_params = list(model.alphas())
        self.num_w = numel(self.w_params)
        self.num_a = numel(self.a_params)
        self.train = train
        self.val = val
        self.randomness = randomness
        self.train_stream = BatchStream(len(train), batch_size, randomness.sampling)
        self.val_stream = BatchStream(len(val), batch_size, randomness.sampling)
        self.dp = dp
        # The releases this party makes (σ, clip, B each): W's on the train shard, A's on the validation shard.
        self.releases = dp.search_releases() if dp is not None else {}
        if dp is not None:
            check_model_for_dp(model)
            for name, shard in (("train", train), ("validation", val)):
                if dp.expected_batch_size > len(shard):
                    raise ValueError(f"search.batch_size {dp.expected_batch_size:g} exceeds this party's {name} shard "
                                     f"({len(shard)} examples): the Poisson rate B/N would exceed 1")
            if dp.randomness != randomness.source:
                raise PrivacyError(f"the DP plan asks for {dp.randomness} randomness, the party was given "
                                   f"{randomness.source} streams")
        self._named_w = self._named(self.w_params)
        self._named_a = self._named(self.a_params)
        self._train_batch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._w_before: np.ndarray | None = None  # W_k, kept for the second-order Hessian term
        self._val_a_grad: torch.Tensor | None = None
        self.w_out = np.zeros(self.num_w + STATS, dtype=np.float32)
        self.a_out = np.zeros(self.num_a + STATS, dtype=np.float32)
        self.v_out = np.zeros(self.num_w, dtype=np.float32)

    # -- checkpointing ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything that makes this party's future releases what they will be, besides W and A. It holds the
        party's stream keys: it goes to the party's own state file, never to MPI."""
        return {
            "sampling": self.randomness.sampling.state_dict(),
            "noise": self.randomness.noise.state_dict(),
            "train_stream": self.train_stream.state_dict(),
            "val_stream": self.val_stream.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.randomness.sampling.load_state_dict(state["sampling"])
        self.randomness.noise.load_state_dict(state["noise"])
        self.train_stream.load_state_dict(state["train_stream"])
        self.val_stream.load_state_dict(state["val_stream"])

    # -- parameters from the server ------------------------------------------------------------------------------
    def load_w(self, flat: np.ndarray) -> None:
        """Adopt the broadcast W (the server's W'); the previous W is kept for second order."""
        self._w_before = flatten(self.w_params)
        assign(self.w_params, flat)

    def load_a(self, flat: np.ndarray) -> None:
        assign(self.a_params, flat)

    # -- releases ------------------------------------------------------------------------------------------------
    def w_release(self) -> np.ndarray:
        """G_k: mean-loss gradient of W on the next train batch, plus STATS. Returns a view of `w_out`.

        Under DP: the clipped, noised release of W gradients on a Poisson batch of the train shard (STATS zero).
        """
        if self.dp is not None:
            return self._private_release(self.releases["W"], self.train, self._named_w, self.w_out)
        start = time.perf_counter()
        idx = self.train_stream.next()
        x, y = self.train.x[idx], self.train.y[idx]
        self._train_batch = (x, y)
        (grad,), loss, correct = self._gradients(x, y, [self.w_params])
        self._store(self.w_out, grad, loss, correct, len(idx), start)
        return self.w_out

    def a_release(self) -> np.ndarray:
        """H_k (first order, Algorithm 1): gradient of A on the next val batch at the current W (= W').

        Under DP: the clipped, noised release of A gradients on a Poisson batch of the validation shard.
        """
        if self.dp is not None:
            return self._private_release(self.releases["A"], self.val, self._named_a, self.a_out)
        start = time.perf_counter()
        idx = self.val_stream.next()
        (grad,), loss, correct = self._gradients(self.val.x[idx], self.val.y[idx], [self.a_params])
        self._store(self.a_out, grad, loss, correct, len(idx), start)
        return self.a_out

    def val_gradients(self) -> np.ndarray:
        """Second order, stage 1: v_k = ∇_{W'} L(D_k^val batch) (returned) and ∇_A L (kept for stage 2)."""
        self._refuse_under_dp("the second-order validation gradient v_k")
        start = time.perf_counter()
        idx = self.val_stream.next()
        (v, a_grad), loss, correct = self._gradients(self.val.x[idx], self.val.y[idx],
                                                     [self.w_params, self.a_params])
        self.v_out[:] = v.to("cpu", torch.float32).numpy()
        self._val_a_grad = a_grad
        self._val_stats = (loss, correct, len(idx), time.perf_counter() - start)
        return self.v_out

    def a_release_second_order(self, v: np.ndarray, xi: float) -> np.ndarray:
        """Second order, stage 2 (Eq. 5): H_k = ∇_A L_val(W') − ξ·(∇_A L_tr(W⁺) − ∇_A L_tr(W⁻)) / (2ε).

        W± = W ± ε·v with W the weights *before* the server's update, v the aggregated validation gradient of
        all parties (so the sum of the H_k is the exact unrolled gradient of the aggregated validation loss),
        ε = 0.01 / ‖v‖, and the train batch the one this party used for G_k.
        """
        self._refuse_under_dp("the second-order architecture gradient")
        if self._train_batch is None or self._w_before is None or self._val_a_grad is None:
            raise RuntimeError("a_release_second_order needs w_release, load_w and val_gradients first")
        start = time.perf_counter()
        w_new = flatten(self.w_params)
        norm = float(np.linalg.norm(v.astype(np.float64)))
        h = self._val_a_grad
        if norm > 0:
            eps = 0.01 / norm
            x, y = self._train_batch
            assign(self.w_params, self._w_before + eps * v)
            (grad_plus,), _, _ = self._gradients(x, y, [self.a_params])
            assign(self.w_params, self._w_before - eps * v)
            (grad_minus,), _, _ = self._gradients(x, y, [self.a_params])
            hessian = (grad_plus - grad_minus) / (2.0 * eps)  # divide by 2ε — not the (p - n) / 2.*eps slip
            h = h - xi * hessian
            assign(self.w_params, w_new)
        loss, correct, count, seconds = self._val_stats
        self._store(self.a_out, h, loss, correct, count, start - seconds)
        return self.a_out

    # -- evaluation ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate_val(self, batch_size: int = 256) -> np.ndarray:
        """[loss_sum, correct, count] over the whole validation shard (float32 (3,))."""
        self._refuse_under_dp("the validation loss and accuracy")
        return evaluate(self.model, self.val.x, self.val.y, batch_size)

    # -- internals -----------------------------------------------------------------------------------------------
    def _refuse_under_dp(self, what: str) -> None:
        """The refusal lives where releases are made, not only in config validation: a DP party never computes a
        vector it could send unnoised, whatever Config object it was built from."""
        if self.dp is not None:
            raise PrivacyError(f"a DP party does not release {what}: it is neither clipped per example nor noised, "
                               "so the accountant would not cover it (docs/privacy.md)")

    def _private_release(self, release: Release, shard: Shard, params: dict[str, torch.Tensor],
                         out: np.ndarray) -> np.ndarray:
        """Algorithm 1 inside the party: Poisson batch → per-example clip → sum → + N(0, (σR)²) → ÷ B.

        Nothing data-dependent leaves besides the release: the STATS tail is zero (loss, accuracy, even the
        realised batch size and compute time would be unaccounted releases).
        """
        self.model.train()
        vector = release.make(self.model, params, len(shard), shard.examples, self.randomness.sampling,
                              self.randomness.noise)
        out[:-STATS] = vector.detach().to("cpu", torch.float32).numpy()
        out[-STATS:] = 0.0
        return out

    def _named(self, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """{name: parameter} in the order of `params` — the wire order the server expects."""
        wanted = {id(p) for p in params}
        named = {name: p for name, p in self.model.named_parameters() if id(p) in wanted}
        if [id(p) for p in named.values()] != [id(p) for p in params]:
            raise RuntimeError("named_parameters() order differs from weights()/alphas(): releases would be "
                               "scrambled on the wire")
        return named

    def _gradients(self, x: torch.Tensor, y: torch.Tensor, groups: list[list[torch.Tensor]]
                   ) -> tuple[list[torch.Tensor], float, float]:
        """Flat gradients of the batch-mean loss w.r.t. each parameter group, the loss sum and #correct.

        Only the requested groups are differentiated (autograd skips the other parameters' gradient kernels).
        """
        self.model.train()
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        params = [p for group in groups for p in group]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        flat, offset = [], 0
        for group in groups:
            chunk = grads[offset : offset + len(group)]
            offset += len(group)
            flat.append(torch.cat([
                (g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(chunk, group, strict=True)
            ]))
        correct = float((logits.detach().argmax(1) == y).sum())
        return flat, loss.item() * int(y.shape[0]), correct

    @staticmethod
    def _store(out: np.ndarray, grad: torch.Tensor, loss_sum: float, correct: float, count: int,
               start: float) -> None:
        out[:-STATS] = grad.detach().to("cpu", torch.float32).numpy()
        out[-STATS:] = (loss_sum, correct, count, time.perf_counter() - start)
