"""Every buffer a DP party hands to MPI is a noised release, never a raw gradient.

Each party's Channel records what it passes to ``reduce_sum``; ``party_release`` is wrapped to record its output
and, independently, the clipped sum it must contain. Then, on every party:
  * it sent exactly 2 buffers per step (G_k, H_k) and nothing else (no statistics, no final evaluation);
  * each buffer's gradient part is bit-for-bit the output of a ``party_release`` call, with a zero tail;
  * release·B − clipped sum is N(0, (σR)²) per coordinate (chi-square bounds on the pooled variance).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI
from scipy import stats

import mpi_fnas.federation.party as party_module
from mpi_fnas.config import load_config
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.flat import STATS
from mpi_fnas.federation.search import run_search
from mpi_fnas.privacy import clipped_sum, per_sample_gradients

B = 8
SIGMA = 1.5
CLIP_W, CLIP_A = 0.05, 0.2
STEPS = 3


class RecordingChannel(Channel):
    def __init__(self, comm) -> None:
        super().__init__(comm)
        self.sent: list[np.ndarray] = []

    def reduce_sum(self, send, recv=None) -> None:
        if not self.is_server:
            self.sent.append(send.copy())
        super().reduce_sum(send, recv)


@pytest.mark.mpi(min_size=3)
def test_parties_hand_only_noised_releases_to_mpi(monkeypatch):
    releases: list[dict] = []
    real_release = party_module.party_release

    def spy(model, params, inputs, targets, **kw):
        out = real_release(model, params, inputs, targets, **kw)
        with torch.no_grad():
            clean = clipped_sum(per_sample_gradients(model, params, inputs, targets), kw["clip_bound"])
        releases.append({"out": out.detach().numpy().copy(), "clean": clean.numpy().copy(),
                         "clip": kw["clip_bound"], "sigma": kw["noise_multiplier"], "b": int(inputs.shape[0]),
                         "B": kw["expected_batch_size"]})
        return out

    monkeypatch.setattr(party_module, "party_release", spy)
    cfg = load_config(None, [
        "mode=dpfnas", "seed=1", "data.train_size=320", "data.test_size=16", "data.image_size=8",
        "space.channels=4", "space.layers=3", "space.nodes=1", f"search.batch_size={B}", "search.epochs=1",
        f"search.steps_per_epoch={STEPS}", f"privacy.noise_multiplier_w={SIGMA}",
        f"privacy.noise_multiplier_a={SIGMA}", f"privacy.clip_w={CLIP_W}", f"privacy.clip_a={CLIP_A}",
        "runtime.progress=off",
    ])
    channel = RecordingChannel(MPI.COMM_WORLD)
    run_search(cfg, channel, None)
    if channel.is_server:
        return

    assert len(channel.sent) == 2 * STEPS  # G_k and H_k per step, nothing else
    assert len(releases) == 2 * STEPS
    residuals = []
    for sent, rel in zip(channel.sent, releases, strict=True):
        np.testing.assert_array_equal(sent[:-STATS], rel["out"].astype(np.float32))  # exactly the release
        assert not np.any(sent[-STATS:])  # no loss, accuracy, batch size or timing rides along
        assert rel["B"] == B and rel["sigma"] == SIGMA and rel["clip"] in (CLIP_W, CLIP_A)
        # The clipped sum has norm ≤ b·R; the release adds σR noise per coordinate before dividing by B.
        assert np.linalg.norm(rel["clean"]) <= rel["b"] * rel["clip"] * (1 + 1e-5)
        residuals.append((rel["out"].astype(np.float64) * B - rel["clean"]) / (SIGMA * rel["clip"]))
    z = np.concatenate(residuals)
    n = z.size
    # Pooled variance of n standard normals: n·s² ~ χ²(n); two-sided 1e-6 bounds.
    lo, hi = stats.chi2.ppf([1e-6, 1 - 1e-6], n) / n
    assert lo < float(np.mean(z**2)) < hi, f"noise variance {np.mean(z**2):.4f} outside [{lo:.4f}, {hi:.4f}]"
    assert abs(float(np.mean(z))) < 6 / np.sqrt(n)
