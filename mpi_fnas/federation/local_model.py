"""A party's local computation in a stage: the gradients of W (and in the search of A) on its own shards. No MPI.

The party holds its copy of the stage's network, its W shard (the search's train shard D_k^tr, the augmentation's
pool) and, in the search, its validation shard D_k^val, and produces the vectors Algorithm 1 sends:

* ``w_release()``  — G_k, the gradient of W on a batch of its W shard;
* ``a_release()``  — H_k, the gradient of A on a validation batch at the freshly broadcast W' (first order);
* ``val_gradients()`` + ``a_release_second_order(v)`` — H_k with the DARTS finite-difference Hessian term (Eq. 5).

Under DP each release goes through its :class:`~mpi_fnas.privacy.release.Release` (Poisson batch, per-example clip,
noise from the party's secret stream). The augmentation's crops, flips, cutout and drop-path masks are drawn per
example, so nothing couples two examples and the clip bounds each one's influence. Every release is a float32
vector: the gradient, then ``STATS`` = 4 numbers for the log (loss sum, correct predictions, examples, compute
seconds), all zero under DP, where they would be unaccounted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from mpi_fnas.config import AugmentConfig
from mpi_fnas.cpu_kernels import to_channels_last
from mpi_fnas.data.augmentation import augment_images
from mpi_fnas.evaluation import EVAL_BATCH, evaluate
from mpi_fnas.federation.flat import STATS, assign, flatten, numel
from mpi_fnas.federation.memory import pass_examples
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.federation.shard import BatchStream, Shard, Transform, channels_last
from mpi_fnas.privacy import DPParams, PrivacyError, check_model_for_dp
from mpi_fnas.privacy.per_sample import LossFn, Method, per_example_cross_entropy, physical_batches
from mpi_fnas.privacy.release import Release, securely_aggregated
from mpi_fnas.secagg.masks import PairwiseMasks
from mpi_fnas.secagg.series import SecureSeries, rotation_id
from mpi_fnas.space import augment_loss


class Party:
    """The local computation of one party in one stage.

    Args:
        model: the stage's network; its W (and A) are overwritten by the server's broadcasts.
        w_shard: the examples of its W releases (the search's train shard, the augmentation's pool), on its device.
        batch_size: examples per exact step (under DP the releases' expected batch B); `what` names its config key.
        randomness: its ``sampling`` and ``noise`` streams, secret under DP (:mod:`mpi_fnas.federation.randomness`).
        a_shard: the search's validation shard (A's releases); None: the stage has no A.
        releases: the DP releases by vector name (``W``, and ``A`` in the search); None: exact gradients.
        transform: applied to every W batch (the augmentation's crops, flips and cutout); None: none.
        loss_fn: the per-example loss ``(outputs, targets) -> (b,)`` of the W releases.
        method: the per-example gradient method of the DP W release (the augmentation insists on ``hooks``).
        dp_randomness: under DP, the source the plan asks for (``secret`` or ``reproducible``), `randomness`'s own.
        max_physical_batch: examples per pass, bounding the step's memory (``"auto"``: :func:`pass_examples`).
    """

    def __init__(self, model: torch.nn.Module, w_shard: Shard, batch_size: int, randomness: PartyRandomness, *,
                 a_shard: Shard | None = None, releases: dict[str, Release] | None = None,
                 transform: Transform | None = None, loss_fn: LossFn = per_example_cross_entropy,
                 method: Method = "auto", dp_randomness: str | None = None, what: str = "search.batch_size",
                 max_physical_batch: int | Literal["auto"] | None = None) -> None:
        # On the CPU, channels-last (NHWC) storage for the network and the images: oneDNN's convolutions and their
        # backward run 15-40 % faster so for these small feature maps (docs/log/benchmarks.md). The values, and so the
        # releases, are those of the default layout up to float rounding. On a GPU (not measured here) the layout
        # stays as it is.
        self.model = model
        if all(p.device.type == "cpu" for p in model.parameters()):
            to_channels_last(model)
            w_shard, a_shard = (channels_last(shard) if shard is not None else None for shard in (w_shard, a_shard))
        self.w_params = list(model.weights())
        self.a_params = list(model.alphas()) if a_shard is not None else []
        self.num_w = numel(self.w_params)
        self.num_a = numel(self.a_params) if a_shard is not None else None
        self.train, self.val = w_shard, a_shard
        self.randomness = randomness
        self.train_stream = BatchStream(len(w_shard), batch_size, randomness.sampling)
        self.val_stream = BatchStream(len(a_shard), batch_size, randomness.sampling) if a_shard is not None else None
        self.releases = releases
        self.transform, self.loss_fn, self.method = transform, loss_fn, method
        self.max_physical_batch = pass_examples(max_physical_batch, model, tuple(w_shard.x.shape[1:]))
        if releases is not None:
            check_model_for_dp(model)
            for name, shard in (("W", w_shard), ("A", a_shard)):
                if shard is not None and releases[name].expected_batch_size > len(shard):
                    raise ValueError(f"{what} {releases[name].expected_batch_size:g} exceeds this party's shard "
                                     f"({len(shard)} examples): the Poisson rate B/N would exceed 1")
            if dp_randomness != randomness.source:
                raise PrivacyError(f"the DP plan asks for {dp_randomness} randomness, the party was given "
                                   f"{randomness.source} streams")
        self._named_w = self._named(self.w_params)
        self._named_a = self._named(self.a_params)
        self._train_batch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._w_before: np.ndarray | None = None  # W_k, kept for the second-order Hessian term
        self._val_a_grad: torch.Tensor | None = None
        self.masks: PairwiseMasks | None = None  # secure aggregation: set by use_secure_aggregation
        self.series: dict[str, SecureSeries] = {}
        self.w_out = np.zeros(self.num_w + STATS, dtype=np.float32)
        self.a_out = np.zeros(self.num_a + STATS, dtype=np.float32) if a_shard is not None else None
        self.v_out = np.zeros(self.num_w, dtype=np.float32) if a_shard is not None else None

    @property
    def private(self) -> bool:
        return self.releases is not None

    @property
    def secure(self) -> bool:
        """Whether the releases are securely aggregated (``privacy.aggregation: secure``)."""
        return securely_aggregated(self.releases)

    def use_secure_aggregation(self, masks: PairwiseMasks, stage: str, reproducible_seed: int | None = None) -> None:
        """From now on, seal every release with `masks` (agreed this launch): each release kind of this `stage`
        gets its series of labels, counted in lockstep with rank 0's; its rotations labelled by the seed under
        reproducible randomness (`reproducible_seed`: :func:`~mpi_fnas.secagg.series.rotation_id`)."""
        sizes = {"W": self.num_w, "A": self.num_a}
        self.masks = masks
        rotation = rotation_id(masks.run_id, reproducible_seed)
        self.series = {name: SecureSeries(masks.run_id, stage, name, release.encoding(sizes[name]), rotation)
                       for name, release in self.releases.items()}

    # -- checkpointing ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a resumed party continues from, besides W and A: its batch streams' positions, and with
        ``reproducible`` randomness its streams (public keys: a resume is then bit-identical). It goes to the
        party's own state file, never to MPI.

        Never a secret stream's key: a resumed party keeps the streams it keyed from the OS when it was built, so
        every release after a resume, the replay of a step it may have sent before included, draws new Poisson
        coins, rounding coins, augmentations and noise. A replay with the first attempt's noise would hand the
        server the difference of two releases with the noise cancelled (docs/privacy.md §2.2); with fresh noise
        it is an independent release, as the ledger charges it."""
        state = {"train_stream": self.train_stream.state_dict()}
        if self.val_stream is not None:
            state["val_stream"] = self.val_stream.state_dict()
        if not self.randomness.secret:
            state.update(sampling=self.randomness.sampling.state_dict(), noise=self.randomness.noise.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s state (a secret key saved by an older release is never used)."""
        if not self.randomness.secret:
            self.randomness.sampling.load_state_dict(state["sampling"])
            self.randomness.noise.load_state_dict(state["noise"])
        self.train_stream.load_state_dict(state["train_stream"] if "train_stream" in state else state["stream"])
        if self.val_stream is not None:
            self.val_stream.load_state_dict(state["val_stream"])

    # -- parameters from the server ------------------------------------------------------------------------------
    def load_w(self, flat: np.ndarray) -> None:
        """Adopt the broadcast W (the server's W'); in the search the previous W is kept for second order."""
        if self.val is not None:
            self._w_before = flatten(self.w_params)
        assign(self.w_params, flat)

    def load_a(self, flat: np.ndarray) -> None:
        """Set the architecture variables A from the flat vector rank 0 broadcast."""
        assign(self.a_params, flat)

    # -- releases ------------------------------------------------------------------------------------------------
    def w_release(self) -> np.ndarray:
        """G_k: the gradient of W on the next batch of the W shard (mean loss), plus STATS; a view of `w_out`.

        Under DP: the clipped, noised release of W gradients on a Poisson batch of the W shard (STATS zero); under
        secure aggregation its sealed uint32 words (D,), no STATS.
        """
        if self.releases is not None:
            return self._private_release("W", self.train, self._w_examples, self._named_w, self.w_out,
                                         loss_fn=self.loss_fn, method=self.method)
        self._train_batch = self._exact_release(self.train_stream, self._w_examples, self.w_params, self.w_out,
                                                lambda outputs, y: self.loss_fn(outputs, y).mean())
        return self.w_out

    def a_release(self) -> np.ndarray:
        """H_k (first order, Algorithm 1): gradient of A on the next val batch at the current W (= W').

        Under DP: the clipped, noised release of A gradients on a Poisson batch of the validation shard.
        """
        if self.releases is not None:
            return self._private_release("A", self.val, self.val.examples, self._named_a, self.a_out)
        self._exact_release(self.val_stream, self.val.examples, self.a_params, self.a_out)
        return self.a_out

    def val_gradients(self) -> np.ndarray:
        """Second order, stage 1: v_k = ∇_{W'} L(D_k^val batch) (returned) and ∇_A L (kept for stage 2)."""
        self._refuse_under_dp("the second-order validation gradient v_k")
        start = time.perf_counter()
        idx = self.val_stream.next()
        (v, a_grad), loss, correct = self._batch_gradients(*self.val.examples(idx), [self.w_params, self.a_params])
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
            (grad_plus,), _, _ = self._batch_gradients(x, y, [self.a_params])
            assign(self.w_params, self._w_before - eps * v)
            (grad_minus,), _, _ = self._batch_gradients(x, y, [self.a_params])
            hessian = (grad_plus - grad_minus) / (2.0 * eps)  # divide by 2ε — not the (p - n) / 2.*eps slip
            h = h - xi * hessian
            assign(self.w_params, w_new)
        loss, correct, count, seconds = self._val_stats
        self._store(self.a_out, h, loss, correct, count, start - seconds)
        return self.a_out

    # -- evaluation ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate_val(self, batch_size: int = EVAL_BATCH) -> np.ndarray:
        """[loss_sum, correct, count] over the whole validation shard (float32 (3,))."""
        self._refuse_under_dp("the validation loss and accuracy")
        return evaluate(self.model, self.val.x, self.val.y, batch_size)

    # -- internals -----------------------------------------------------------------------------------------------
    def _w_examples(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.train.examples(idx)
        return self.transform(x, y) if self.transform is not None else (x, y)

    def _refuse_under_dp(self, what: str) -> None:
        """The refusal lives where releases are made, not only in config validation: a DP party never computes a
        vector it could send unnoised, whatever Config object it was built from."""
        if self.releases is not None:
            raise PrivacyError(f"a DP party does not release {what}: it is neither clipped per example nor noised, "
                               "so the accountant would not cover it (docs/privacy.md)")

    def _private_release(self, name: str, shard: Shard, examples: Callable, params: dict[str, torch.Tensor],
                         out: np.ndarray, **how) -> np.ndarray:
        """Algorithm 1 inside the party: Poisson batch → per-example clip → sum → + N(0, (σR)²) → ÷ B.

        Nothing data-dependent leaves besides the release: the STATS tail is zero (loss, accuracy, even the
        realised batch size and compute time would be unaccounted releases).
        """
        self.model.train()
        release = self.releases[name]
        if release.secure is not None:
            if self.masks is None:
                raise RuntimeError("a secure release before use_secure_aggregation")
            return release.make(self.model, params, len(shard), examples, self.randomness.sampling,
                                self.randomness.noise, max_physical_batch=self.max_physical_batch,
                                series=self.series[name], masks=self.masks, **how)
        vector = release.make(self.model, params, len(shard), examples, self.randomness.sampling,
                              self.randomness.noise, max_physical_batch=self.max_physical_batch, **how)
        out[:-STATS] = vector.detach().to("cpu", torch.float32).numpy()
        out[-STATS:] = 0.0
        return out

    def _exact_release(self, stream: BatchStream, examples: Callable, params: list[torch.Tensor], out: np.ndarray,
                       loss: Callable = F.cross_entropy) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient of the batch's mean `loss` w.r.t. `params` on the next batch of `stream`, then STATS, into
        `out`; returns the batch (x, y)."""
        start = time.perf_counter()
        idx = stream.next()
        x, y = examples(idx)
        (grad,), loss_sum, correct = self._batch_gradients(x, y, [params], loss)
        self._store(out, grad, loss_sum, correct, len(idx), start)
        return x, y

    def _named(self, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """{name: parameter} in the order of `params`: the wire order the server expects."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        return {names[id(p)]: p for p in params}

    def _batch_gradients(self, x: torch.Tensor, y: torch.Tensor, groups: list[list[torch.Tensor]],
                         loss: Callable = F.cross_entropy) -> tuple[list[torch.Tensor], float, float]:
        """Flat gradients of the batch's mean `loss` w.r.t. each group, the batch's cross-entropy sum and #correct.
        Only the requested groups are differentiated (autograd skips the other parameters' gradient kernels). The
        batch runs in passes of at most ``max_physical_batch`` examples, each pass's mean gradient weighted by its
        share of the batch."""
        self.model.train()
        params = [p for group in groups for p in group]
        total: list[torch.Tensor] | None = None
        loss_sum = correct = 0.0
        for part in physical_batches(int(y.shape[0]), self.max_physical_batch):
            outputs = self.model(x[part])
            grads = torch.autograd.grad(loss(outputs, y[part]), params, allow_unused=True)
            share = (part.stop - part.start) / y.shape[0]
            weighted = [share * g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params, strict=True)]
            total = weighted if total is None else [t + w for t, w in zip(total, weighted, strict=True)]
            logits = (outputs[0] if isinstance(outputs, tuple) else outputs).detach()
            correct += float((logits.argmax(1) == y[part]).sum())
            loss_sum += float(F.cross_entropy(logits, y[part], reduction="sum"))
        if total is None:
            raise ValueError("an exact step needs a batch of at least one example")
        flat, offset = [], 0
        for group in groups:
            flat.append(torch.cat([g.reshape(-1) for g in total[offset : offset + len(group)]]))
            offset += len(group)
        return flat, loss_sum, correct

    @staticmethod
    def _store(out: np.ndarray, grad: torch.Tensor, loss_sum: float, correct: float, count: int, start: float) -> None:
        out[:-STATS] = grad.detach().to("cpu", torch.float32).numpy()
        out[-STATS:] = (loss_sum, correct, count, time.perf_counter() - start)


def search_party(model: torch.nn.Module, train: Shard, val: Shard, batch_size: int, randomness: PartyRandomness,
                 dp: DPParams | None = None, w_rounds: int = 1,
                 max_physical_batch: int | Literal["auto"] | None = None) -> Party:
    """A party of the search: the supernet's W on its train shard, A on its validation shard; `dp`: the run's
    privacy parameters (None: exact gradients); `w_rounds`: W releases per iteration (2 under ADADP);
    `max_physical_batch`: examples per pass (see :class:`Party`)."""
    return Party(model, train, batch_size, randomness, a_shard=val,
                 releases=dp.search_releases(w_rounds) if dp is not None else None,
                 dp_randomness=dp.randomness if dp is not None else None, max_physical_batch=max_physical_batch)


def augment_party(model: torch.nn.Module, pool: Shard, augment: AugmentConfig, randomness: PartyRandomness,
                  release: Release | None = None, dp_randomness: str | None = None,
                  max_physical_batch: int | Literal["auto"] | None = None) -> Party:
    """A party of the augmentation: the network's weights on its pool, each example of a batch cropped, flipped
    and cut out on its own and its drop-path masks drawn per example, all from its sampling stream; the loss adds
    the auxiliary head's. `release`: the DP release (None: exact gradients); `dp_randomness`: with it, the
    randomness the plan asks for, checked against `randomness` as in the search; `max_physical_batch`: examples per
    pass (see :class:`Party`; drop-path masks are then drawn pass by pass: other draws of the same distribution)."""
    model.mask_stream = randomness.sampling  # drop-path masks come from the party's own stream

    def transform(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return augment_images(x, stream=randomness.sampling, cutout=augment.cutout,
                              crop_padding=augment.crop_padding, flip=augment.flip), y

    return Party(model, pool, augment.batch_size, randomness, releases={"W": release} if release is not None else None,
                 transform=transform, loss_fn=lambda outputs, y: augment_loss(outputs, y, augment.auxiliary_weight),
                 method="hooks", dp_randomness=dp_randomness, what="augment.batch_size",
                 max_physical_batch=max_physical_batch)
