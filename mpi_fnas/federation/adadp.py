"""ADADP's step-size rule (Koskela & Honkela, "Learning Rate Adaptation for Federated and Differentially Private
Learning", Algorithm 2). Pure numpy: no MPI, no autograd.

One ADADP step of SGD on W, from two gradient releases G1 (at W) and G2 (at the half point):

    W_full = W − η·G1                 (one Euler step)
    W_half = W − (η/2)·G1             (broadcast: the parties release G2 there)
    Ŵ      = W_half − (η/2)·G2        (two half steps)
    e_i    = |W_full,i − Ŵ_i| / max(1, |W_full,i|),   err = ‖e‖₂
    η      ← clamp(tol/err, α_min, α_max)·η            (``factor: sqrt`` clamps √(tol/err) instead)
    next W = Ŵ (``next: extrapolated``) or W_full (``next: full``); W itself when ``reject`` and err > tol.

The rule only post-processes releases, so it costs no privacy. Vectors are flat (n,) float32 (the wire format);
the error is computed in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from mpi_fnas.config import Config

NextIterate = Literal["extrapolated", "full"]
Factor = Literal["linear", "sqrt"]


@dataclass(frozen=True)
class AdadpSettings:
    """The rule's public constants (config section ``adadp``, with ``tol`` and ``reject`` resolved per mode)."""

    tol: float
    alpha_min: float = 0.9
    alpha_max: float = 1.1
    next: NextIterate = "extrapolated"
    factor: Factor = "linear"
    reject: bool = False


def relative_error(w_full: np.ndarray, w_hat: np.ndarray) -> float:
    """err = ‖e‖₂ with e_i = |W_full,i − Ŵ_i| / max(1, |W_full,i|) (the paper's Eq. 6); both (n,)."""
    full = w_full.astype(np.float64)
    return float(np.linalg.norm(np.abs(full - w_hat.astype(np.float64)) / np.maximum(1.0, np.abs(full))))


def step_factor(err: float, settings: AdadpSettings) -> float:
    """The multiplier of η, always within [α_min, α_max]; err = 0 (or NaN) gives α_max (resp. α_min)."""
    if math.isnan(err):  # a diverged step: shrink, never grow
        return settings.alpha_min
    ratio = settings.tol / err if err > 0 else math.inf
    if settings.factor == "sqrt":
        ratio = math.sqrt(ratio)
    return min(max(ratio, settings.alpha_min), settings.alpha_max)


class AdadpStep:
    """The server's ADADP state: the step size η, and W and W_full between the two halves of a step (:meth:`half`,
    then :meth:`finish`); ``lr_used`` and ``err`` describe the last finished step (for the log; NaN before the first).
    """

    def __init__(self, settings: AdadpSettings, lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"the ADADP initial step size must be > 0, got {lr}")
        self.settings = settings
        self.lr = float(lr)
        self.lr_used = self.err = math.nan
        self._start: np.ndarray | None = None
        self._full: np.ndarray | None = None

    def half(self, w: np.ndarray, g1: np.ndarray) -> np.ndarray:
        """W_half = W − (η/2)·G1 (float32, (n,)); W and W_full = W − η·G1 are kept for :meth:`finish`."""
        self._start = w.astype(np.float32, copy=True)
        self._full = (w - np.float32(self.lr) * g1).astype(np.float32)
        return (w - np.float32(self.lr / 2) * g1).astype(np.float32)

    def finish(self, w_half: np.ndarray, g2: np.ndarray) -> np.ndarray:
        """The next W (float32, (n,)) from G2 at W_half; η is updated for the next step."""
        if self._start is None or self._full is None:
            raise RuntimeError("AdadpStep.finish needs half() first")
        w_hat = (w_half - np.float32(self.lr / 2) * g2).astype(np.float32)
        self.err = relative_error(self._full, w_hat)
        self.lr_used = self.lr
        if self.settings.reject and not self.err <= self.settings.tol:
            nxt = self._start  # Algorithm 1 of the paper: discard the step, retry with a smaller η
        else:
            nxt = w_hat if self.settings.next == "extrapolated" else self._full
        self.lr *= step_factor(self.err, self.settings)
        self._start = self._full = None
        return nxt

    def state_dict(self) -> dict[str, float]:
        """η (exact: a Python float) and the last step's log values; taken between steps only."""
        return {"lr": self.lr, "lr_used": self.lr_used, "err": self.err}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore a state written by :meth:`state_dict`."""
        self.lr, self.lr_used, self.err = float(state["lr"]), float(state["lr_used"]), float(state["err"])


def adadp_gradient(mean_grad: np.ndarray, w: np.ndarray, *, clip: float, weight_decay: float) -> np.ndarray:
    """The gradient an ADADP half step uses, (n,) float32: the aggregated release `mean_grad` (n,) clipped to
    L2 norm `clip` (0: no clip), then + `weight_decay`·`w` at the point `w` (n,) it was released at (torch SGD's
    order), so weight decay is part of the flow both integrations follow. Public post-processing."""
    grad = np.ascontiguousarray(mean_grad, dtype=np.float32)
    if clip > 0:
        norm = float(np.linalg.norm(grad.astype(np.float64)))
        if norm > clip:
            grad = grad * np.float32(clip / (norm + 1e-6))
    return (grad + np.float32(weight_decay) * w).astype(np.float32)


def w_rounds(w_optimizer: str) -> int:
    """W releases per iteration: 2 under ADADP (G1 at W, G2 at W_half), 1 otherwise; for ``search.w_optimizer``
    and ``augment.optimizer`` alike."""
    return 2 if w_optimizer == "adadp" else 1


def adadp_settings(cfg: Config, *, private: bool | None = None) -> AdadpSettings:
    """The ``adadp`` section with its defaults resolved for noisy (`private`) or exact releases: tol 1.0 and no
    rejection under DP, tol 0.1 and rejection otherwise. `private` None: the search's, ``mode == dpfnas`` (the
    augmentation passes whether its own releases are DP)."""
    if private is None:
        private = cfg.mode == "dpfnas"
    section = cfg.adadp
    return AdadpSettings(
        tol=section.tol if section.tol is not None else (1.0 if private else 0.1),
        alpha_min=section.alpha_min, alpha_max=section.alpha_max, next=section.next, factor=section.factor,
        reject=section.reject if section.reject is not None else not private,
    )
