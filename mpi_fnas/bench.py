"""Benchmark: one party step (non-private and private) of the search and of the augmentation, and the MPI
exchange, for a given config.

    python -m mpi_fnas.bench [--config FILE] [--set key=value ...] [--repeats N] [--no-memory] [--json]
    mpirun -n K+1 python -m mpi_fnas.bench ...     # the exchange over K+1 real ranks

The party step (G_k then H_k, first order, on random inputs of the configured shape) is timed on one rank while
the others wait (in a sleeping poll, so they do not steal its core); the exchange (Reduce G, Bcast W, Reduce H,
Bcast A — the collectives of one iteration, same buffers as the search) is timed with every rank taking part.
Medians over `--repeats`. ``comm_fraction = comm_seconds / (step_seconds + comm_seconds)``. A private step is also
split three ways: the plain step's compute, the DP work (``dp_work_seconds = dp_step_seconds - step_seconds``:
per-example gradients, clipping, noise) and the exchange (``split_*_fraction``, summing to 1).

The same step is also timed privately (DP-FNAS, ``search_party(..., dp=DPParams(...))``): same network and initial
weights, same inputs, same batch size B. The private party's shard holds exactly B examples, so its Poisson rate
is q = B / N = 1 and every Poisson batch is exactly those B examples, the batch the non-private party uses.
The two variants are timed in alternation so that load changes on a shared machine hit both alike.
The augmentation's party step (one weight release of the augmented network, ``augment.batch_size`` examples) is
timed the same way, plain and private, interleaved.
Peak memory of each variant is the peak RSS of a fresh subprocess during one step (see docs/benchmarks.md).
Secure against local aggregation of the W release (K = 8, equal ε against the server) is compared on the same
party: the noise in the server's sum, the cost of sealing and opening, the bits the sum needs.
The private step of the hand-designed ``cnn-tanh`` (one party, one batch) is timed beside Opacus's
(``GradSampleModule`` + ``DPOptimizer``, noise included) on the same network, weights, inputs and threads:
``dp_step_vs_opacus`` = CPU seconds ours / theirs (:func:`compare_opacus`).

Speed and memory targets are checked here, never in timed tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mpi_fnas import cli
from mpi_fnas.config import DIGIT_DATASETS, Config
from mpi_fnas.federation.memory import peak_rss_mb
from mpi_fnas.federation.stage import process_age

if TYPE_CHECKING:  # torch-importing modules stay out of the CLI's start-up (argument and config errors)
    from mpi_fnas.federation.comm import Channel
    from mpi_fnas.federation.party import Party

VARIANTS = ("plain", "private")
SERVER_VARIANT = "server"  # rank 0's memory (measure_server_memory)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpi_fnas.bench", description=__doc__.split("\n\n")[0])
    cli.add_config_arguments(p)
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions (after one warm-up)")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the peak-memory subprocesses (the rss fields are then null)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-opacus", dest="opacus", action="store_false",
                   help="skip the comparison with Opacus (the opacus_* fields and dp_step_vs_opacus are then null)")
    p.add_argument("--no-aggregation", dest="aggregation", action="store_false",
                   help="skip the secure-against-local aggregation comparison (the aggregate_* and secure_* fields "
                        "are then null)")
    # Internal: measure one variant's peak memory in this (fresh) process and print it as JSON.
    p.add_argument("--_variant", dest="variant", choices=(*VARIANTS, SERVER_VARIANT), help=argparse.SUPPRESS)
    return p


def _input_shape(cfg: Config) -> tuple[int, int, int, int]:
    """(channels, height, width, classes) of the configured dataset, without loading it."""
    if cfg.data.dataset == "cifar10":
        return 3, 32, 32, 10
    return 1 if cfg.data.dataset in DIGIT_DATASETS else 3, cfg.data.image_size, cfg.data.image_size, 10


def make_party(cfg: Config, private: bool, examples: int | None = None) -> Party:
    """A party on random data: train and val shards of `examples` (default B = search.batch_size) examples each.

    Both variants get the same model initialisation (``build_supernet`` seeds from ``cfg.seed``) and the same inputs
    (a fixed data seed). The private party's expected batch size equals its shard size, so its Poisson rate is 1
    and each private batch is the whole shard, exactly the examples of the non-private batch.
    """
    import torch

    from mpi_fnas.federation.party import Shard, search_party
    from mpi_fnas.federation.randomness import PartyRandomness
    from mpi_fnas.privacy import DPParams
    from mpi_fnas.space import search_space

    c, h, w, classes = _input_shape(cfg)
    n = examples or cfg.search.batch_size
    data_gen = torch.Generator().manual_seed(0)

    def shard() -> Shard:
        return Shard(torch.randn(n, c, h, w, generator=data_gen),
                     torch.randint(0, classes, (n,), generator=data_gen))

    train, val = shard(), shard()
    model = search_space(cfg.space.kind).build_supernet(cfg.space, seed=cfg.seed, in_channels=c, num_classes=classes)
    if not private:
        return search_party(model, train, val, n, PartyRandomness.create("reproducible", seed=cfg.seed, rank=1),
                            max_physical_batch=cfg.runtime.max_physical_batch)
    # The private party draws from secret streams (keyed from the OS), exactly as a DP party of a run does. Its step
    # is the local release (per-example clipping and Gaussian noise, no masks: one party has no pairs to mask with);
    # what secure aggregation adds to a step is timed apart (secure_* fields).
    dp = DPParams.from_config(dataclasses.replace(cfg.privacy, aggregation="local"), n)
    return search_party(model, train, val, n, PartyRandomness.create(dp.randomness, seed=cfg.seed, rank=1), dp=dp,
                        max_physical_batch=cfg.runtime.max_physical_batch)


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def time_party_step(cfg: Config, repeats: int, private: bool = True) -> dict[str, Any]:
    """Median seconds of one party iteration's compute (w_release + a_release) on random data.

    With `private`, also the DP-FNAS step on the same network, inputs and batch (interleaved with the non-private
    one, repetition by repetition) and the per-example gradient computation of the W release alone.
    """
    from mpi_fnas.privacy import per_sample_gradients
    from mpi_fnas.privacy.per_sample import hooks_supported
    from mpi_fnas.privacy.validators import PrivacyError

    plain = make_party(cfg, private=False)
    jobs: dict[str, Callable[[], Any]] = {"w": plain.w_release, "a": plain.a_release}
    result: dict[str, Any] = {"num_w": plain.num_w, "num_a": plain.num_a}
    dp = None
    if private:
        try:  # a DP party refuses a sample-mixing model when it is built
            dp = make_party(cfg, private=True)
        except PrivacyError as exc:
            result["dp_note"] = f"private step not timed: {exc}"
    if dp is not None:
        w_named, a_named = dict(dp.model.named_weights()), dict(dp.model.named_alphas())
        x, y = dp.train.x, dp.train.y  # the whole shard = the private batch (q = 1)
        jobs.update({
            "dp_w": dp.w_release,
            "dp_a": dp.a_release,
            # The first stage of party_release alone (same method selection as the release: "auto").
            "ps_w": lambda: per_sample_gradients(dp.model, w_named, x, y),
            "ps_a": lambda: per_sample_gradients(dp.model, a_named, dp.val.x, dp.val.y),
        })
        result["per_sample_method_w"] = "hooks" if hooks_supported(dp.model, w_named) else "vmap"
        result["per_sample_method_a"] = "hooks" if hooks_supported(dp.model, a_named) else "vmap"
    if dp is not None:
        jobs.update(_noise_jobs(dp.num_w + dp.num_a))
    wall: dict[str, list[float]] = {k: [] for k in jobs}
    cpu: dict[str, list[float]] = {k: [] for k in jobs}
    for i in range(repeats + 1):
        for key, job in jobs.items():
            w, c = _timed(job)
            if i:  # the first round warms up allocators and kernels
                wall[key].append(w)
                cpu[key].append(c)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    result.update({"step_seconds": med["w"] + med["a"], "w_release_seconds": med["w"],
                   "a_release_seconds": med["a"], "step_cpu_seconds": med_cpu["w"] + med_cpu["a"]})
    result["step_gflop"] = _counted_gflop(lambda: (plain.w_release(), plain.a_release()))
    result["step_gflops"] = result["step_gflop"] / result["step_cpu_seconds"]
    result["core_peak_gflops"] = _dense_matmul_gflops(repeats)
    if dp is not None:
        dp_step = med["dp_w"] + med["dp_a"]
        dp_cpu = med_cpu["dp_w"] + med_cpu["dp_a"]
        result.update({
            "dp_step_seconds": dp_step,
            "dp_w_release_seconds": med["dp_w"],
            "dp_a_release_seconds": med["dp_a"],
            "dp_step_ratio": dp_step / result["step_seconds"],
            "dp_step_cpu_seconds": dp_cpu,
            "dp_step_ratio_cpu": dp_cpu / result["step_cpu_seconds"],
            "per_sample_seconds": med["ps_w"],
            "per_sample_a_seconds": med["ps_a"],
            "noise_seconds": med["noise_keystream"],
            "noise_seconds_torch_generator": med["noise_torch"],
            "noise_source_ratio": med["noise_keystream"] / med["noise_torch"],
        })
    return result


def _counted_gflop(step: Callable[[], Any]) -> float:
    """GFLOP of one call of `step`, counted by ``torch.utils.flop_counter`` (convolutions and matmuls, forward and
    backward; element-wise ops are not counted, as in the usual FLOP budgets of NAS papers). Counted on the stock
    kernels: the network's FLOPs, not those of a faster route's larger convolution (``mpi_fnas.space.depthwise``)."""
    from torch.utils.flop_counter import FlopCounterMode

    from mpi_fnas.space.depthwise import stock_kernels

    with stock_kernels(), FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops() / 1e9


def _dense_matmul_gflops(repeats: int, n: int = 1024) -> float:
    """The core's dense rate in this process: GFLOP/s of an n×n float32 matmul (2n³ FLOP), median CPU time."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    times = [_timed(lambda: torch.mm(a, b))[1] for _ in range(max(repeats, 3))]
    return 2 * n**3 / 1e9 / statistics.median(times)


def _noise_jobs(size: int) -> dict[str, Callable[[], Any]]:
    """The Gaussian noise of one private step (`size` = |W| + |A| coordinates), from the party's secret keystream
    (what a release draws) and, for comparison only, from the seeded torch generator it replaced (32-bit seed
    space; docs/privacy.md §2.1). Both go through the same float64 transform."""
    import torch

    from mpi_fnas.keystream import Keystream
    from mpi_fnas.privacy.mechanism import gaussian_noise, standard_normal_from_bits

    stream, generator = Keystream.from_os(), torch.Generator().manual_seed(2)
    return {
        "noise_keystream": lambda: gaussian_noise(size, std=1.0, stream=stream),
        "noise_torch": lambda: standard_normal_from_bits(
            torch.randint(0, 2**53, (size,), generator=generator, dtype=torch.int64)).to(torch.float32),
    }


def make_augment_party(cfg: Config, private: bool):
    """An augmentation party on random data: a pool of exactly B = ``augment.batch_size`` examples (so a private
    Poisson batch, at rate 1, is the plain batch), the network of ``augment.network``: a hand-designed one, or the
    cell of ``augment.genotype`` or, if unset, of the genotype the supernet starts from (its near-uniform alphas,
    derived from ``cfg.seed``)."""
    import torch

    from mpi_fnas.federation.party import Shard, augment_party
    from mpi_fnas.federation.randomness import PartyRandomness
    from mpi_fnas.privacy.release import AugmentReleases
    from mpi_fnas.space import augment_network, search_space, trains_cell

    c, h, w, classes = _input_shape(cfg)
    space = search_space(cfg.space.kind)
    genotype = None  # a hand-designed network has none
    if cfg.augment.genotype is not None:
        genotype = space.parse_genotype(cfg.augment.genotype, cfg.space)
    elif trains_cell(cfg):
        genotype = space.build_supernet(cfg.space, seed=cfg.seed, in_channels=c, num_classes=classes).genotype()
    model = augment_network(cfg, genotype, seed=cfg.seed, in_channels=c, num_classes=classes)
    n = cfg.augment.batch_size
    data_gen = torch.Generator().manual_seed(0)
    pool = Shard(torch.randn(n, c, h, w, generator=data_gen), torch.randint(0, classes, (n,), generator=data_gen))
    releases = None
    if private:
        one = np.ones(1)
        releases = AugmentReleases(noise_multiplier=cfg.augment.noise_multiplier, clip=cfg.augment.clip,
                                   expected_batch_size=float(n), sample_rate_train=one, sample_rate_val=one,
                                   steps=1, stop_reason="completed")
    streams = PartyRandomness.create("secret" if private else "reproducible", seed=cfg.seed, rank=1, stage="augment")
    party = augment_party(model, pool, cfg.augment, streams, releases.release if releases is not None else None,
                          streams.source if releases is not None else None, cfg.runtime.max_physical_batch)
    party.model.drop_path_prob = cfg.augment.drop_path
    return party


def time_augment_step(cfg: Config, repeats: int) -> dict[str, Any]:
    """Median seconds of one augmentation party step, plain and private, interleaved (same network and batch)."""
    from mpi_fnas.privacy.validators import PrivacyError

    plain = make_augment_party(cfg, private=False)
    jobs: dict[str, Callable[[], Any]] = {"plain": plain.w_release}
    result: dict[str, Any] = {"augment_num_w": plain.num_w}
    try:
        private = make_augment_party(cfg, private=True)
        jobs["private"] = private.w_release
    except PrivacyError as exc:
        result["augment_dp_note"] = f"private augment step not timed: {exc}"
    wall: dict[str, list[float]] = {k: [] for k in jobs}
    for i in range(repeats + 1):
        for key, job in jobs.items():
            seconds, _ = _timed(job)
            if i:
                wall[key].append(seconds)
    result["augment_step_seconds"] = statistics.median(wall["plain"])
    if "private" in wall:
        result["augment_dp_step_seconds"] = statistics.median(wall["private"])
        result["augment_dp_step_ratio"] = result["augment_dp_step_seconds"] / result["augment_step_seconds"]
    return result


# -- peak memory ------------------------------------------------------------------------------------------------
def compare_opacus(cfg: Config, repeats: int) -> dict[str, Any]:
    """The private step of ``augment.network: cnn-tanh`` beside Opacus's, interleaved, medians of CPU seconds.

    Ours: the augmentation party's release of one Poisson batch at rate 1 (exactly ``augment.batch_size``
    examples: per-example gradients, clip, Gaussian noise from the AES keystream, ÷ B). Theirs: the same network
    (a copy, same weights) in ``GradSampleModule``, one forward and backward on the same batch, then
    ``DPOptimizer.step`` (clip, Gaussian noise from torch's generator, ÷ B, the SGD update: O(P), negligible
    here). Same clip, σ and B (the ``augment`` section). ``dp_step_vs_opacus`` = ours / theirs: ≤ 1 means ours
    is no slower. Without Opacus installed (the ``test`` extra has it) only ``opacus_note`` says why.
    """
    try:
        from opacus import GradSampleModule
        from opacus import __version__ as opacus_version
        from opacus.optimizers import DPOptimizer
    except ImportError:
        return {"opacus_note": "Opacus is not installed (pip install opacus; the test extra installs it)"}
    import copy

    import torch
    import torch.nn.functional as F

    augment = dataclasses.replace(cfg.augment, network="cnn-tanh", genotype=None, drop_path=0.0,
                                  auxiliary_weight=0.0, cutout=0, crop_padding=0, flip=False)
    ours = make_augment_party(dataclasses.replace(cfg, augment=augment), private=True)
    x, y = ours.train.x, ours.train.y  # the whole pool: the Poisson batch at rate 1
    theirs = GradSampleModule(copy.deepcopy(ours.model))
    optimizer = DPOptimizer(torch.optim.SGD(theirs.parameters(), lr=augment.lr),
                            noise_multiplier=augment.noise_multiplier, max_grad_norm=augment.clip,
                            expected_batch_size=augment.batch_size)

    def opacus_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(theirs(x), y).backward()
        optimizer.step()

    cpu: dict[str, list[float]] = {"ours": [], "opacus": []}
    for i in range(repeats + 1):
        for key, job in (("ours", ours.w_release), ("opacus", opacus_step)):
            _, seconds = _timed(job)
            if i:  # the first round warms up allocators and kernels
                cpu[key].append(seconds)
    mine, other = statistics.median(cpu["ours"]), statistics.median(cpu["opacus"])
    return {"opacus_version": opacus_version, "cnn_tanh_params": sum(p.numel() for p in ours.model.parameters()),
            "cnn_tanh_dp_step_cpu_seconds": mine, "opacus_dp_step_cpu_seconds": other,
            "dp_step_vs_opacus": mine / other}


def equal_epsilon_sigmas(cfg: Config, parties: int, dimension: int) -> tuple[float, float, float]:
    """(σ local, σ secure, ε): the configured σ_W = σ_A of a search of the configured length over `parties` parties
    (the default run's shards, augmentation left out), its worst party's ε against the server under local noise
    (tight PLD), and the σ the secure accountant (at the accounted `dimension`) needs for that same ε."""
    from mpi_fnas.federation.plan import plan_assignments
    from mpi_fnas.privacy import DPParams
    from mpi_fnas.privacy.accountant import PrivacyLedger
    from mpi_fnas.privacy.planning import plan_privacy

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

    from mpi_fnas.federation.plan import secure_dimension
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
        wall_local = _timed(local_release)[1]
        for s in series:
            s.count = 0  # timing only: the labels repeat, nothing is sent
        wall_secure = _timed(lambda: secure_release(0))[1]
        wall_open = _timed(lambda: server.open(words, batch))[1]
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


def _reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux ``clear_refs`` 5); False where that is not possible.

    Needed because on Linux a child's ``ru_maxrss`` starts at its parent's RSS at fork time (the high-water mark
    survives exec): a child spawned by a 1 GB parent reports >= 1 GB whatever it does.
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def measure_variant_memory(cfg: Config, variant: str) -> dict[str, Any]:
    """Run in a fresh process: peak RSS of one party step of `variant` above the RSS before it.

    Before the step: imports, model and data creation, and a warm-up step of the same variant on a 1-example
    batch (it loads the lazily initialised kernels and allocator pools, a cost that does not scale with the
    batch). Then the peak is reset to the current RSS (baseline) and one full step (w_release + a_release) at
    batch B runs; ``peak_mb - baseline_mb`` is what the step itself needed.
    """
    import gc

    party = make_party(cfg, private=variant == "private")
    startup = process_age()  # launch -> a party ready for its first step (no MPI handshake here)
    warm = make_party(cfg, private=variant == "private", examples=1)
    warm.w_release()
    warm.a_release()
    del warm
    gc.collect()
    before_reset = peak_rss_mb()
    if _reset_peak_rss():
        method, baseline = "VmHWM", peak_rss_mb()
    else:  # no reset: the peak so far is the best baseline there is (an overestimate of it)
        method, baseline = "ru_maxrss", peak_rss_mb()
    party.w_release()
    party.a_release()
    peak = peak_rss_mb()
    return {"baseline_mb": baseline, "peak_mb": peak, "method": method, "process_peak_mb": max(before_reset, peak),
            "startup_seconds": startup}


def measure_server_memory(cfg: Config, parties: int = 8) -> dict[str, Any]:
    """Run in a fresh process: rank 0's peak resident memory through what it holds in a search: its modules (planner,
    ledgers, log), the plan of `parties` parties (under dpfnas the privacy plan of the whole job), the test split
    rendered, the supernet, and one evaluation of it on the test split."""
    from mpi_fnas.federation import serve  # noqa: F401  (rank 0's modules: what a server imports)
    from mpi_fnas.federation.plan import open_split, plan_run
    from mpi_fnas.federation.server import search_server
    from mpi_fnas.space import search_space

    plan_run(cfg, parties)
    test = open_split(cfg, "test")
    x, y = test.render(np.arange(len(test.labels)))
    model = search_space(cfg.space.kind).build_supernet(cfg.space, seed=cfg.seed, in_channels=test.in_channels,
                                                          num_classes=test.num_classes)
    search_server(model, cfg.search, parties).evaluate(x, y)  # as rank 0 evaluates: its layout and batch
    return {"process_peak_mb": peak_rss_mb()}


def _child_env() -> dict[str, str]:
    # The child must not join the parent's MPI job: drop the process-manager variables mpirun set.
    return {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_"))}


def measure_memory(args: argparse.Namespace) -> dict[str, float]:
    """Peak RSS of the non-private and private step and of rank 0, each in its own fresh subprocess; ratio of the
    step costs."""
    base = [sys.executable, "-m", "mpi_fnas.bench"]
    if args.config:
        base += ["--config", args.config]
    for item in args.overrides:
        base += ["--set", item]
    runs = {}
    for variant in (*VARIANTS, SERVER_VARIANT):
        out = subprocess.run([*base, "--_variant", variant], capture_output=True, text=True, env=_child_env(),
                             check=False)
        if out.returncode != 0:
            raise RuntimeError(f"memory subprocess ({variant}) failed:\n{out.stderr.strip()}")
        runs[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    step = runs["plain"]["peak_mb"] - runs["plain"]["baseline_mb"]
    dp_step = runs["private"]["peak_mb"] - runs["private"]["baseline_mb"]
    return {
        "rss_baseline_mb": runs["plain"]["baseline_mb"],
        "step_rss_mb": step,
        "dp_step_rss_mb": dp_step,
        "peak_rss_ratio": dp_step / step if step > 0 else float("nan"),
        "rss_method": runs["private"]["method"],
        "rss_peak_mb_party": runs["private"]["process_peak_mb"],
        "rss_peak_mb_server": runs[SERVER_VARIANT]["process_peak_mb"],
        "startup_seconds": runs["private"]["startup_seconds"],
    }


def _variant_main(cfg: Config, variant: str) -> int:
    # Importing the package's MPI module must not initialise MPI in this helper process.
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    import torch

    torch.set_num_threads(cfg.runtime.threads_per_rank or 1)
    print(json.dumps(measure_server_memory(cfg) if variant == SERVER_VARIANT else measure_variant_memory(cfg, variant)))
    return 0


# -- exchange ---------------------------------------------------------------------------------------------------
def time_exchange(channel: Channel, num_w: int, num_a: int, repeats: int, lag: float = 0.1) -> float:
    """Median seconds the collectives of one iteration add to a step (all ranks must call this; rank 0 gets it).

    The collectives are those of a first-order iteration on buffers of the search's sizes: Reduce G, Bcast W,
    Reduce H, Bcast A. In the search the ranks wait in the first Reduce for the slowest party, so here the last
    rank joins each iteration `lag` seconds after the others: its time inside the four collectives — from the
    moment the last contribution is there until it holds the new A — is what the exchange costs a step. (The
    others' time also contains the wait; a barrier-started exchange would miss the cost of waking waiters up.)
    """
    from mpi_fnas.federation.flat import STATS

    g = np.ones(num_w + STATS, dtype=np.float32)
    h = np.ones(num_a + STATS, dtype=np.float32)
    g_sum, h_sum = np.zeros_like(g), np.zeros_like(h)
    w, a = np.zeros(num_w, dtype=np.float32), np.zeros(num_a, dtype=np.float32)
    last = channel.size - 1
    times = []
    for i in range(repeats + 1):
        channel.barrier()
        if channel.rank == last:
            time.sleep(lag)  # the others are already waiting in the Reduce
        t0 = time.perf_counter()
        channel.reduce_sum(g, g_sum)
        channel.bcast(w)
        channel.reduce_sum(h, h_sum)
        channel.bcast(a)
        if i:
            times.append(time.perf_counter() - t0)
    medians = channel.gather_objects(statistics.median(times))
    return medians[last] if medians is not None else statistics.median(times)


REPORT_KEYS_FROM_STEP = (
    "onednn_isa", "aten_cpu_capability",
    "step_seconds", "w_release_seconds", "a_release_seconds", "step_cpu_seconds",
    "step_gflop", "step_gflops", "core_peak_gflops",
    "dp_step_seconds", "dp_w_release_seconds", "dp_a_release_seconds", "dp_step_ratio",
    "dp_step_cpu_seconds", "dp_step_ratio_cpu", "per_sample_seconds", "per_sample_a_seconds",
    "per_sample_method_w", "per_sample_method_a",
    "noise_seconds", "noise_seconds_torch_generator", "noise_source_ratio",
    "rss_baseline_mb", "step_rss_mb", "dp_step_rss_mb", "peak_rss_ratio", "rss_method",
    "rss_peak_mb_party", "rss_peak_mb_server", "startup_seconds",
    "augment_num_w", "augment_step_seconds", "augment_dp_step_seconds", "augment_dp_step_ratio",
    "aggregate_parties", "aggregate_epsilon", "aggregate_sigma_local", "aggregate_sigma_secure",
    "aggregate_noise_std_ratio", "aggregate_noise_std_ratio_expected", "secure_w_release_cpu_seconds",
    "local_w_release_cpu_seconds", "secure_open_cpu_seconds", "secure_overhead_fraction", "secure_bits_needed",
    "secure_bits", "secure_overflow_rate",
    "opacus_version", "cnn_tanh_params", "cnn_tanh_dp_step_cpu_seconds", "opacus_dp_step_cpu_seconds",
    "dp_step_vs_opacus",
)


def main(argv: list[str] | None = None) -> int:
    """``python -m mpi_fnas.bench``: time the party steps and an iteration's exchange; the exit code."""
    args = _parser().parse_args(argv)
    cfg, error = cli.load_config_args(args)
    if error is not None:
        return cli.report_bad_input(cli.launcher_rank() or 0, error, args.debug)
    if args.variant:
        return _variant_main(cfg, args.variant)
    import torch

    from mpi_fnas.federation.comm import Channel

    channel = Channel(cli.start_mpi(cfg))
    torch.set_num_threads(cfg.runtime.threads_per_rank or 1)
    timer_rank = 1 if channel.size > 1 else 0
    result: dict[str, Any] = {}
    if channel.rank == timer_rank:
        from mpi_fnas.cpu_kernels import aten_cpu_capability, onednn_isa

        result = {"onednn_isa": onednn_isa(), "aten_cpu_capability": aten_cpu_capability()}  # whose kernels ran
        result.update(time_party_step(cfg, args.repeats))
        result.update(time_augment_step(cfg, args.repeats))
        if args.opacus:
            result.update(compare_opacus(cfg, args.repeats))
        if args.aggregation and "dp_step_seconds" in result:
            result.update(compare_aggregation(cfg, args.repeats))
            result["secure_overhead_fraction"] = (
                result["secure_w_release_cpu_seconds"] - result["local_w_release_cpu_seconds"]
                + result["secure_open_cpu_seconds"]) / result["dp_step_cpu_seconds"]
        if args.memory and "dp_step_seconds" in result:
            result.update(measure_memory(args))
    # The others wait here in a sleeping poll: a blocking MPICH call would spin and steal the timer's core.
    channel.barrier()
    sizes = np.array([result.get("num_w", 0), result.get("num_a", 0)], dtype=np.float32)
    channel.comm.Bcast(sizes, root=timer_rank)  # setup: tell everyone the buffer sizes
    comm_seconds = time_exchange(channel, int(sizes[0]), int(sizes[1]), args.repeats)
    gathered = channel.gather_objects(result)  # as data (mpi_fnas.wire), never a pickle
    if channel.rank != 0:
        return 0
    step = gathered[timer_rank]
    report: dict[str, Any] = {
        "ranks": channel.size,
        "parties": max(channel.size - 1, 1),
        "batch_size": cfg.search.batch_size,
        "num_w": int(sizes[0]),
        "num_a": int(sizes[1]),
        "threads_per_rank": torch.get_num_threads(),
        "repeats": args.repeats,
    }
    report.update({key: step.get(key) for key in REPORT_KEYS_FROM_STEP})
    report["comm_seconds"] = comm_seconds
    report["comm_fraction"] = comm_seconds / (step["step_seconds"] + comm_seconds)
    report["comm_megabytes"] = 4 * 2 * (int(sizes[0]) + int(sizes[1])) / 1e6
    if step.get("dp_step_seconds") is not None:  # a private step split three ways: compute, the DP work, exchange
        report["dp_work_seconds"] = step["dp_step_seconds"] - step["step_seconds"]
        whole = step["dp_step_seconds"] + comm_seconds
        report["split_compute_fraction"] = step["step_seconds"] / whole
        report["split_dp_fraction"] = report["dp_work_seconds"] / whole
        report["split_comm_fraction"] = comm_seconds / whole
    for note in ("dp_note", "augment_dp_note", "opacus_note"):
        if note in step:
            report[note] = step[note]
    if args.json:
        print(json.dumps(report))
    else:
        if channel.size == 1:
            print("note: 1 rank — the exchange is a self-copy; run under mpirun -n K+1 for a real one")
        width = max(len(k) for k in report)
        for key, value in report.items():
            text = "n/a" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)
            print(f"{key:<{width}}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
