"""The exponential mechanism that picks whom the server trusts (SecProbe, Zhao et al.), and its privacy cost.

No MPI: numpy, and the server's :class:`~mpi_fnas.keystream.Keystream` for the coins. The server scores each of
the K parties with u_k ∈ [0, 1] (its accuracy on the server's auxiliary set) and draws K′ of them *without
replacement* by "peeling": K′ successive exponential mechanisms, each over the parties not yet drawn, with

    Pr[k] ∝ exp(ε′ · u_k / (2 Δu)),   ε′ = ε / K′,

so one step's draw costs ε (basic composition; Durfee & Rogers 2019). Δu = 1/n_aux, the score's sensitivity
under replace-one neighbouring aux sets (tighter than the paper's 1/2, still valid).

Composition over T steps (:func:`selection_epsilon`) is the smaller of basic composition, T·ε (pure DP), and
zCDP, ρ = T·ε²/(8K′) converted to (ρ + 2√(ρ ln(1/δ)), δ)-DP: the run is (min of the two, δ)-DP with respect to
the aux set. Why and with which citations: docs/privacy.md §7.
"""

from __future__ import annotations

import math

import numpy as np

from mpi_fnas.keystream import Keystream


def exponential_mechanism_select(scores: np.ndarray, k: int, epsilon: float, sensitivity: float,
                                 rng: Keystream) -> np.ndarray:
    """Draw `k` distinct indices of `scores` with the exponential mechanism, peeled (see the module doc).

    Args:
        scores: (K,) finite utilities u_k; a higher score is more likely to be drawn.
        k: K′, how many to draw (1 ≤ k ≤ K).
        epsilon: ε of the whole draw (each of the k peels uses ε/k).
        sensitivity: Δu, the most any u_k can change between neighbouring aux sets (> 0).
        rng: the server's own secret stream (its draws must be unpredictable to the parties).
    Returns:
        (k,) int64 indices in draw order.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1 or not np.all(np.isfinite(scores)):
        raise ValueError("scores must be a 1-D array of finite numbers")
    if not 1 <= k <= scores.size:
        raise ValueError(f"k must be in [1, {scores.size}], got {k}")
    if not (epsilon > 0 and sensitivity > 0):
        raise ValueError("epsilon and sensitivity must be > 0")
    logits = (epsilon / k) * scores / (2.0 * sensitivity)
    remaining = np.ones(scores.size, dtype=bool)
    chosen = np.empty(k, dtype=np.int64)
    for draw in range(k):
        candidates = np.flatnonzero(remaining)
        weights = np.exp(logits[candidates] - logits[candidates].max())  # shift: no overflow, same distribution
        cumulative = np.cumsum(weights)
        at = np.searchsorted(cumulative, float(rng.uniform(1)[0]) * cumulative[-1], side="right")  # inverse CDF
        pick = candidates[min(int(at), candidates.size - 1)]
        chosen[draw] = pick
        remaining[pick] = False
    return chosen


def uniform_select(parties: int, k: int, rng: Keystream) -> np.ndarray:
    """The ``random`` baseline: `k` of `parties` indices uniformly without replacement, (k,) int64."""
    return np.sort(rng.permutation(parties)[:k].numpy()).astype(np.int64)


def selection_epsilon(steps: int, epsilon: float, select: int, delta: float) -> float:
    """ε of `steps` draws of `select` parties at ε = `epsilon` each, at δ = `delta` (module doc: min of two bounds).

    0 for no steps; basic composition alone when δ = 0.
    """
    if steps <= 0:
        return 0.0
    basic = steps * epsilon
    if delta <= 0:
        return basic
    rho = steps * epsilon**2 / (8.0 * select)
    return min(basic, rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta)))


def selection_delta(aux_size: int) -> float:
    """δ of the selection's (ε, δ) guarantee: min(1e-5, 1/(10·n_aux)), the rule the parties' default δ follows."""
    return min(1e-5, 1.0 / (10.0 * aux_size))
