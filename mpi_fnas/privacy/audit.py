"""Empirical privacy audit of a release function with a Dirac gradient canary (docs/privacy.md §5).

Two neighbouring datasets: D (a few ordinary examples) and D' = D + one canary whose gradient is
``canary_scale * R`` along coordinate 0 (outside the clip ball, on a coordinate no other example touches). At
sample rate q = 1 each trial runs ``steps`` releases on D or D' and scores the sum of released coordinate 0. The
threshold of "canary present iff score > threshold" is chosen on half of the trials; Clopper-Pearson upper bounds
on its FPR and FNR on the other half give an epsilon *lower* bound, since (epsilon, delta)-DP forces
``FPR + e^eps FNR >= 1 - delta`` and ``FNR + e^eps FPR >= 1 - delta``.

The audited object is the real mechanism: :func:`~mpi_fnas.privacy.mechanism.party_release` on a linear "canary
model" whose per-example gradient is its input, by default; :func:`audit_secure_sum` audits the sum rank 0 opens
under secure aggregation with every real piece (encoding, discrete noise shares, pairwise masks, the uint32 sum).

A lower bound above the claimed epsilon proves the implementation (or the accounting) wrong at the stated
confidence; one below it is only *consistent* with the claim: one canary, one statistic, no proof of privacy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats
from torch import nn

from mpi_fnas.keystream import Keystream
from mpi_fnas.privacy.clipping import clip_per_sample
from mpi_fnas.privacy.mechanism import party_release
from mpi_fnas.privacy.release import Release
from mpi_fnas.secagg.discrete_gaussian import discrete_gaussian
from mpi_fnas.secagg.encoding import encode_sum
from mpi_fnas.secagg.masks import PairwiseMasks
from mpi_fnas.secagg.series import SecureSeries

#: ``release_fn(model, params, inputs, targets, noise_stream) -> (P,)`` — the mechanism under audit.
ReleaseFn = Callable[[nn.Module, Mapping[str, torch.Tensor], torch.Tensor, torch.Tensor, Keystream], torch.Tensor]
#: ``noise_fn(n, local_variance, stream) -> (n,)`` int64 — a party's discrete noise share (secure aggregation).
NoiseFn = Callable[[int, int, Keystream], torch.Tensor]


class CanaryModel(nn.Module):
    """``x (b, dim) -> (b, 1)``, ``x @ w``; with :func:`canary_loss` the gradient of example i is ``x_i``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The linear model's output."""
        return self.linear(x)


def canary_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-example loss ``<w, x_i>``: outputs ``(b, 1)`` -> ``(b,)`` (targets are ignored)."""
    del targets
    return outputs[:, 0]


@dataclass(frozen=True)
class AuditResult:
    """Outcome of :func:`audit_mechanism` (rates and counts are on the held-out half of the trials)."""

    epsilon_lower_bound: float
    threshold: float
    false_positives: int
    false_negatives: int
    holdout_trials: int  # per hypothesis
    fpr_upper: float
    fnr_upper: float
    steps: int
    delta: float
    confidence: float


@dataclass(frozen=True)
class AuditDesign:
    """The experiment both audits run, whatever the release under audit (see module docstring).

    Attributes:
        steps: releases per trial (composed; the score sums them).
        trials: trials per hypothesis (D and D'); half choose the threshold, half measure the rates.
        delta: the delta at which the lower bound is stated.
        confidence: joint confidence of the two Clopper-Pearson bounds (Bonferroni split).
        canary_scale: canary gradient norm in units of R (> 1 so that clipping matters).
        num_other: ordinary examples in D, with gradients of norm R / 2 on coordinate 1.
        dim: parameter dimension of the canary model (>= 2).
        seed: keys the auditor's streams (public: the audit is reproducible).
    """

    steps: int
    trials: int
    delta: float
    confidence: float = 0.95
    canary_scale: float = 10.0
    num_other: int = 3
    dim: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.trials < 4:
            raise ValueError("need at least 4 trials per hypothesis")
        if self.dim < 2:
            raise ValueError("dim must be >= 2 (coordinate 0 for the canary, 1 for the others)")

    def examples(self, clip: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(num_other, dim)`` ordinary examples (R/2 on coordinate 1) and the ``(1, dim)`` canary (scale·R on 0)."""
        others = torch.zeros(self.num_other, self.dim, dtype=dtype)
        others[:, 1] = 0.5 * clip
        canary = torch.zeros(1, self.dim, dtype=dtype)
        canary[0, 0] = self.canary_scale * clip
        return others, canary

    def bound(self, scores: dict[bool, np.ndarray]) -> AuditResult:
        """The ε lower bound of per-trial scores without (False) and with (True) the canary: the threshold is chosen
        on the first half of the trials, the rates are counted on the second."""
        trials = len(scores[False])
        half = trials // 2
        threshold = _best_threshold(scores[False][:half], scores[True][:half], self.delta, self.confidence)
        negatives, positives = scores[False][half:], scores[True][half:]
        false_positives = int(np.sum(negatives > threshold))
        false_negatives = int(np.sum(positives <= threshold))
        n = trials - half
        alpha = 1.0 - self.confidence
        fpr_upper = clopper_pearson_upper(false_positives, n, alpha / 2)
        fnr_upper = clopper_pearson_upper(false_negatives, n, alpha / 2)
        return AuditResult(
            epsilon_lower_bound=epsilon_from_rates(fpr_upper, fnr_upper, self.delta),
            threshold=float(threshold),
            false_positives=false_positives,
            false_negatives=false_negatives,
            holdout_trials=n,
            fpr_upper=fpr_upper,
            fnr_upper=fnr_upper,
            steps=self.steps,
            delta=self.delta,
            confidence=self.confidence,
        )


def audit_mechanism(
    release_fn: ReleaseFn | None = None,
    *,
    clip_bound: float,
    noise_multiplier: float,
    design: AuditDesign,
) -> AuditResult:
    """Lower-bound the epsilon of ``release_fn`` at ``design.delta`` with a Dirac canary (see module docstring).

    Args:
        release_fn: the mechanism; None audits the real ``party_release`` with ``clip_bound``,
            ``noise_multiplier`` and expected batch size ``design.num_other + 1`` (q = 1).
        clip_bound, noise_multiplier: the mechanism's R and sigma (the canary's norm is ``canary_scale * R``).
        design: steps, trials, delta, confidence, the canary and the seed of the one public noise stream (the
            auditor's own, reproducible).
    """
    if release_fn is None:
        release_fn = functools.partial(
            _real_release,
            clip_bound=clip_bound,
            noise_multiplier=noise_multiplier,
            expected_batch_size=float(design.num_other + 1),
        )
    model = CanaryModel(design.dim)
    params = dict(model.named_parameters())
    others, canary = design.examples(clip_bound, torch.float32)
    datasets = {False: others, True: torch.cat([others, canary])}
    noise_stream = Keystream.from_labels("audit", design.seed)

    scores = {present: np.empty(design.trials) for present in (False, True)}
    for trial in range(design.trials):
        for present in (False, True):  # interleaved, so both hypotheses see the same stretch of the stream
            inputs = datasets[present]
            targets = torch.zeros(inputs.shape[0])
            total = 0.0
            for _ in range(design.steps):
                total += float(release_fn(model, params, inputs, targets, noise_stream)[0])
            scores[present][trial] = total

    return design.bound(scores)


def audit_secure_sum(release: Release, *, design: AuditDesign, noise_fn: NoiseFn = discrete_gaussian) -> AuditResult:
    """Lower-bound the ε against the server of secure aggregation at ``design.delta`` with a Dirac canary in party 1.

    Args:
        release: a secure :class:`~mpi_fnas.privacy.release.Release` (σ, c = R, K = ``release.secure.parties``);
            q = 1: every example is in every release, and rank 0 divides by B = ``design.num_other + 1``.
        design: as in :func:`audit_mechanism`; every party holds ``num_other`` ordinary examples (norm R/2 on
            coordinate 1), party 1 the canary too under D'.
        noise_fn: a party's noise share (the real :func:`~mpi_fnas.secagg.discrete_gaussian.discrete_gaussian`;
            tests pass broken ones).
    """
    if release.secure is None:
        raise ValueError("audit_secure_sum audits a secure release; audit_mechanism audits the local one")
    parties, clip, trials, dim = release.secure.parties, release.clip, design.trials, design.dim
    encoding = release.encoding(dim)
    others, canary = design.examples(clip, torch.float64)
    # OS keys (the masks cancel whatever they are) under a fixed run id: the rotations, labelled by it, and so the
    # whole audit follow from `seed` alone (a launch id from the fresh keys made the bound vary from run to run).
    run_id = f"audit/{design.seed}".encode()
    masks = [PairwiseMasks(rank, run_id=run_id) for rank in range(1, parties + 1)]
    for party in masks:
        party.agree({mask.rank: mask.public_key for mask in masks}, parties=parties)
    series = [SecureSeries(run_id, "audit", "canary", encoding) for _ in range(parties + 1)]  # rank 0, 1..K
    stream = Keystream.from_labels("audit/secure", design.seed)  # the auditor's: every party's coins and noise

    # Every trial's clipped sum, computed once: (trials, d); party 1's under D' holds the canary.
    sums = {present: clip_per_sample(torch.cat([others, canary]) if present else others, clip).sum(dim=0)
            .expand(trials, dim) for present in (False, True)}
    scores = {present: np.zeros(trials) for present in (False, True)}
    for _ in range(design.steps):
        for present in (False, True):
            words = np.zeros(trials * encoding.padded, dtype=np.uint32)
            for rank in range(1, parties + 1):
                signs = series[rank].next_signs()
                encoded = encode_sum(sums[present and rank == 1], encoding, signs, stream).reshape(-1)
                total = encoded + noise_fn(trials * encoding.padded, release.secure.local_variance, stream)
                words += series[rank].seal(total, masks[rank - 1])  # uint32: wraps mod 2^32 like the Reduce
            opened = series[0].open(words.reshape(trials, encoding.padded), float(design.num_other + 1))
            scores[present] += opened[:, 0]
    return design.bound(scores)


def clopper_pearson_upper(errors: int, trials: int, alpha: float) -> float:
    """One-sided ``1 - alpha`` Clopper-Pearson upper bound on a rate after ``errors`` in ``trials``."""
    if errors >= trials:
        return 1.0
    return float(stats.beta.ppf(1.0 - alpha, errors + 1, trials - errors))


def epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """The smallest epsilon >= 0 that (epsilon, delta)-DP allows for a test with these FPR and FNR."""
    bounds = [0.0]
    for a, b in ((fpr, fnr), (fnr, fpr)):
        if 1.0 - delta - a > 0 and b > 0:
            bounds.append(math.log((1.0 - delta - a) / b))
    return max(bounds)


def _real_release(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    noise_stream: Keystream,
    *,
    clip_bound: float,
    noise_multiplier: float,
    expected_batch_size: float,
) -> torch.Tensor:
    return party_release(
        model,
        params,
        inputs,
        targets,
        clip_bound=clip_bound,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        noise_stream=noise_stream,
        loss_fn=canary_loss,
    )


def _best_threshold(negatives: np.ndarray, positives: np.ndarray, delta: float, confidence: float) -> float:
    """The threshold with the largest epsilon lower bound on this split.

    Candidates are the midpoints between consecutive observed scores (and one below all of them): a threshold
    in the middle of a gap generalises to the held-out half better than one sitting on an observed score.
    """
    observed = np.unique(np.concatenate([negatives, positives]))
    candidates = np.concatenate([observed[:1] - 1.0, (observed[1:] + observed[:-1]) / 2])
    neg_sorted, pos_sorted = np.sort(negatives), np.sort(positives)
    false_positives = len(negatives) - np.searchsorted(neg_sorted, candidates, side="right")
    false_negatives = np.searchsorted(pos_sorted, candidates, side="right")
    alpha = 1.0 - confidence
    fpr_upper = _clopper_pearson_upper_array(false_positives, len(negatives), alpha / 2)
    fnr_upper = _clopper_pearson_upper_array(false_negatives, len(positives), alpha / 2)
    eps = [epsilon_from_rates(float(a), float(b), delta) for a, b in zip(fpr_upper, fnr_upper, strict=True)]
    return float(candidates[int(np.argmax(eps))])


def _clopper_pearson_upper_array(errors: np.ndarray, trials: int, alpha: float) -> np.ndarray:
    inside = errors < trials
    bounds = np.ones(errors.shape)
    bounds[inside] = stats.beta.ppf(1.0 - alpha, errors[inside] + 1, trials - errors[inside])
    return bounds
