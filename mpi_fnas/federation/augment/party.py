"""A party's local computation in the augmentation: the gradient of the network's weights on its pool. No MPI.

Per iteration the party draws a batch of its own pool (under DP a Poisson batch, B expected), augments every
example independently (crop, flip, cutout) and runs the network with per-example drop-path masks, all from its
own secret sampling stream (:mod:`mpi_fnas.federation.randomness`), so nothing couples two examples of a batch and
the per-example clipping bounds each example's influence. The drop-path masks are drawn in the one batched forward
of the ``hooks`` per-example method, which the private release therefore insists on. It returns the float32
vector Algorithm 1 sends: the gradient followed by ``STATS`` numbers (loss sum, correct predictions, examples,
compute seconds; all zero under DP, where they would be unaccounted).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from mpi_fnas.config import AugmentConfig
from mpi_fnas.data.augmentation import augment_images
from mpi_fnas.federation.flat import STATS, assign, numel
from mpi_fnas.federation.party import BatchStream, Shard
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.privacy import check_model_for_dp
from mpi_fnas.privacy.release import AugmentReleases
from mpi_fnas.space import AugmentNetwork, augment_loss
from mpi_fnas.space.dpnas import DpnasNetwork


class AugmentParty:
    """Local training computation of one party.

    Args:
        model: the augmented network; its weights are overwritten by the server's broadcasts.
        pool: the party's examples for the augmentation (on the model's device).
        cfg: the ``augment`` section (batch size, augmentation, auxiliary weight).
        randomness: the party's streams of this stage: ``sampling`` for batches, Poisson coins, augmentation and
            drop-path masks; ``noise`` for the Gaussian noise (DP). Secret under DP.
        releases: the DP releases' constants; None for exact gradients.
    """

    def __init__(self, model: AugmentNetwork | DpnasNetwork, pool: Shard, cfg: AugmentConfig,
                 randomness: PartyRandomness, releases: AugmentReleases | None = None) -> None:
        self.model = model
        self.w_params = list(model.weights())
        self.num_w = numel(self.w_params)
        self.pool = pool
        self.cfg = cfg
        self.randomness = randomness
        self.releases = releases
        self.stream = BatchStream(len(pool), cfg.batch_size, randomness.sampling)
        model.mask_stream = randomness.sampling  # drop-path masks come from the party's own stream
        if releases is not None:
            check_model_for_dp(model)
            if releases.expected_batch_size > len(pool):
                raise ValueError(f"augment.batch_size {releases.expected_batch_size:g} exceeds this party's pool "
                                 f"({len(pool)} examples): the Poisson rate B/N would exceed 1")
        names = {id(p): name for name, p in model.named_parameters()}
        self._named_w = {names[id(p)]: p for p in self.w_params}
        self.out = np.zeros(self.num_w + STATS, dtype=np.float32)

    def load_w(self, flat: np.ndarray) -> None:
        assign(self.w_params, flat)

    def release(self, drop_path_prob: float) -> np.ndarray:
        """The gradient of the weights on the next batch, plus STATS; a view of ``out``.

        Under DP: Poisson batch → augment → per-example clip at ``clip`` → sum → + N(0, (σ·clip)²) → ÷ B.
        """
        self.model.drop_path_prob = drop_path_prob
        self.model.train()
        loss_fn = self._loss_fn()
        if self.releases is not None:
            vector = self.releases.release.make(
                self.model, self._named_w, len(self.pool), self._augmented, self.randomness.sampling,
                self.randomness.noise, loss_fn=loss_fn, method="hooks",  # one batched forward: one mask per example
            )
            self.out[:-STATS] = vector.detach().to("cpu", torch.float32).numpy()
            self.out[-STATS:] = 0.0
            return self.out
        start = time.perf_counter()
        x, y = self._augmented(self.stream.next())
        outputs = self.model(x)
        loss = loss_fn(outputs, y).mean()
        grads = torch.autograd.grad(loss, self.w_params, allow_unused=True)
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                          for g, p in zip(grads, self.w_params, strict=True)])
        logits = outputs[0] if isinstance(outputs, tuple) else outputs
        self.out[:-STATS] = flat.detach().to("cpu", torch.float32).numpy()
        self.out[-STATS:] = (float(torch.nn.functional.cross_entropy(logits.detach(), y, reduction="sum")),
                             float((logits.detach().argmax(1) == y).sum()), float(y.shape[0]),
                             time.perf_counter() - start)
        return self.out

    def state_dict(self) -> dict:
        """Everything that makes this party's future releases what they will be, besides the weights. It holds the
        party's stream keys: it goes to the party's own state file, never to MPI."""
        return {
            "sampling": self.randomness.sampling.state_dict(),
            "noise": self.randomness.noise.state_dict(),
            "stream": self.stream.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.randomness.sampling.load_state_dict(state["sampling"])
        self.randomness.noise.load_state_dict(state["noise"])
        self.stream.load_state_dict(state["stream"])

    def _augmented(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.pool.examples(idx)
        x = augment_images(x, stream=self.randomness.sampling, cutout=self.cfg.cutout,
                           crop_padding=self.cfg.crop_padding, flip=self.cfg.flip)
        return x, y

    def _loss_fn(self) -> Callable[[object, torch.Tensor], torch.Tensor]:
        weight = self.cfg.auxiliary_weight

        def loss(outputs, targets: torch.Tensor) -> torch.Tensor:
            return augment_loss(outputs, targets, weight)

        return loss
