"""Secure against local aggregation of the search's W release at equal ε against the server: the noise in the
server's sum, the cost of sealing and opening, the bits the sum needs (docs/privacy.md §8)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import numpy as np

from mpi_fnas.bench.party_step import make_party, timed
from mpi_fnas.config import Config


def equal_epsilon_sigmas(cfg: Config, parties: int, dimension: int) -> tuple[float, float, float]:
    """(σ local, σ secure, ε): the configured σ_W = σ_A of a search of the configured length over `parties` parties
    (the default run's shards, augmentation left out), its worst party's ε against the server under local noise
    (tight PLD), and the σ the secure accountant (at the accounted `dimension`) needs for that same ε."""
    from mpi_fnas.federation.job_plan import plan_assignments
    from mpi_fnas.privacy import DPParams
    from mpi_fnas.privacy.calibration import plan_privacy
    from mpi_fnas.privacy.shard_ledger import PrivacyLedger

    assignments = plan_assignments(cfg, parties)
    train = [len(a.train_indices) for a in assignments]
    val = [len(a.val_indices) for a in assignments]
    steps = cfg.search.epochs * assignments[0].steps_per_epoch
    local = DPParams.from_config(dataclasses.replace(cfg.privacy, aggregation="local", target_epsilon=None,
                                                     max_epsilon=None), cfg.search.batch_size, parties)
    plan = plan_privacy(train, val, local, steps)
    sigma = plan.params.noise_multiplier_w
    epsilon = max(PrivacyLedger.from_runs(((sigma, float(q), steps),)).get_epsilon(float(plan.delta.min()))
                  for q in (plan.sample_rate_train.max(), plan.sample_rate_val.max()))
    secure = dataclasses.replace(local, aggregation="secure", target_epsilon=epsilon, secure_dimension=dimension)
    return sigma, plan_privacy(train, val, secure, steps).params.noise_multiplier_w, epsilon


def compare_aggregation(cfg: Config, repeats: int, parties: int = 8) -> dict[str, Any]:
    """Secure against local aggregation of the search's W release, K = `parties` (docs/privacy.md §8).

    At equal ε against the server (:func:`equal_epsilon_sigmas`), K releases of each kind of the same batch (the
    bench's party, q = 1) are summed as rank 0 sums them; ``aggregate_noise_std_ratio`` is the std of the secure
    sum's error over the local sum's (the server's average divides both by K·B), beside its expected value
    σ_secure / (√K·σ_local). The cost: one party's secure W release (encode, discrete noise, masks) against its
    local one, interleaved, plus rank 0's opening of the sum, as a share of the private party step; and the bits
    the summed integers needed out of 32, with the share of coordinates that would wrap at ``bits``.
    """
    import math

    import torch

    from mpi_fnas.federation.job_plan import secure_dimension
    from mpi_fnas.keystream import Keystream
    from mpi_fnas.privacy import clipped_sum, per_sample_gradients
    from mpi_fnas.privacy.mechanism import secure_party_release
    from mpi_fnas.privacy.release import Release, SecureSum
    from mpi_fnas.secagg.masks import PairwiseMasks
    from mpi_fnas.secagg.series import SecureSeries

    dimension = secure_dimension(cfg)  # as a run of this config accounts it: its largest release
    sigma_local, sigma_secure, epsilon = equal_epsilon_sigmas(cfg, parties, dimension)
    party = make_party(cfg, private=True)
    batch, clip = float(cfg.search.batch_size), cfg.privacy.clip_w
    named = dict(party.model.named_weights())
    exact = clipped_sum(per_sample_gradients(party.model, named, party.train.x, party.train.y), clip).double()
    local = Release(sigma_local, clip, batch)
    secure = Release(sigma_secure, clip, batch, secure=SecureSum(parties, dimension))
    masks = [PairwiseMasks(rank) for rank in range(1, parties + 1)]
    for m in masks:
        m.agree({other.rank: other.public_key for other in masks}, parties=parties)
    encoding = secure.encoding(party.num_w)
    series = [SecureSeries(m.run_id, "search", "W", encoding) for m in masks]
    server = SecureSeries(masks[0].run_id, "search", "W", encoding)

    def local_release() -> torch.Tensor:
        return local.make(party.model, named, len(party.train), party.train.examples, Keystream.from_os(),
                          Keystream.from_os())

    def secure_release(k: int) -> np.ndarray:
        return secure.make(party.model, named, len(party.train), party.train.examples, Keystream.from_os(),
                           Keystream.from_os(), series=series[k], masks=masks[k])

    local_error = sum(local_release().double() for _ in range(parties)) * batch - parties * exact
    # The secure sum, release by release as Release.make seals it, keeping the integer totals' exact (unwrapped)
    # sum for the bits it needs.
    words = np.zeros(encoding.padded, dtype=np.uint32)
    exact_sum = torch.zeros(encoding.padded, dtype=torch.int64)
    for k in range(parties):
        total = secure_party_release(party.model, named, party.train.x, party.train.y, encoding=encoding,
                                     signs=series[k].next_signs(), local_variance=secure.secure.local_variance,
                                     rounding_stream=Keystream.from_os(), noise_stream=Keystream.from_os())
        words += series[k].seal(total, masks[k])
        exact_sum += total
    opened = server.open(words, batch)
    secure_error = torch.from_numpy(opened).double() * batch - parties * exact
    local_seconds, secure_seconds, open_seconds = [], [], []
    for i in range(repeats + 1):
        wall_local = timed(local_release)[1]
        for s in series:
            s.count = 0  # timing only: the labels repeat, nothing is sent
        wall_secure = timed(lambda: secure_release(0))[1]
        wall_open = timed(lambda: server.open(words, batch))[1]
        if i:
            local_seconds.append(wall_local)
            secure_seconds.append(wall_secure)
            open_seconds.append(wall_open)
    magnitude = int(exact_sum.abs().max())
    return {
        "aggregate_parties": parties,
        "aggregate_epsilon": epsilon,
        "aggregate_sigma_local": sigma_local,
        "aggregate_sigma_secure": sigma_secure,
        "aggregate_noise_std_ratio": float(secure_error.std() / local_error.std()),
        "aggregate_noise_std_ratio_expected": sigma_secure / (math.sqrt(parties) * sigma_local),
        "secure_w_release_cpu_seconds": statistics.median(secure_seconds),
        "local_w_release_cpu_seconds": statistics.median(local_seconds),
        "secure_open_cpu_seconds": statistics.median(open_seconds),
        "secure_bits_needed": magnitude.bit_length() + 1,  # sign bit included
        "secure_bits": encoding.bits,
        "secure_overflow_rate": float((exact_sum.abs() >= 2 ** (encoding.bits - 1)).double().mean()),
    }
