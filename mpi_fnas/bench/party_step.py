"""The search's party step on random data, plain and private: building the parties, timing their releases (with
the per-example gradients and the noise of the private one apart), the step's counted GFLOP and the core's dense
matmul rate. The timing helpers here (:func:`timed`, :func:`input_shape`) serve the other benchmarks too."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpi_fnas.config import DIGIT_DATASETS, Config

if TYPE_CHECKING:  # torch-importing modules stay out of the CLI's start-up (argument and config errors)
    from mpi_fnas.federation.local_model import Party


def input_shape(cfg: Config) -> tuple[int, int, int, int]:
    """(channels, height, width, classes) of the configured dataset, without loading it."""
    if cfg.data.dataset == "cifar10":
        return 3, 32, 32, 10
    return 1 if cfg.data.dataset in DIGIT_DATASETS else 3, cfg.data.image_size, cfg.data.image_size, 10


def make_party(cfg: Config, private: bool, examples: int | None = None, device: str = "cpu") -> Party:
    """A party on random data: train and val shards of `examples` (default B = search.batch_size) examples each,
    network and shards on the torch `device`.

    Both variants get the same model initialisation (``build_supernet`` seeds from ``cfg.seed``) and the same inputs
    (a fixed data seed). The private party's expected batch size equals its shard size, so its Poisson rate is 1
    and each private batch is the whole shard, exactly the examples of the non-private batch.
    """
    import torch

    from mpi_fnas.federation.local_model import search_party
    from mpi_fnas.federation.randomness import PartyRandomness
    from mpi_fnas.federation.shard import Shard
    from mpi_fnas.privacy import DPParams
    from mpi_fnas.space import search_space
    from mpi_fnas.space.scattering import fixed_stem_of

    c, h, w, classes = input_shape(cfg)
    n = examples or cfg.search.batch_size
    data_gen = torch.Generator().manual_seed(0)

    model = search_space(cfg.space.kind).build_supernet(cfg.space, seed=cfg.seed, in_channels=c, num_classes=classes)
    model.to(device)
    stem = fixed_stem_of(model)  # space.stem scattering: the party's shards are its examples' scattering

    def shard() -> Shard:
        x = torch.randn(n, c, h, w, generator=data_gen).to(device)
        return Shard(stem(x) if stem is not None else x, torch.randint(0, classes, (n,), generator=data_gen).to(device))

    train, val = shard(), shard()
    if not private:
        return search_party(model, train, val, n, PartyRandomness.create("reproducible", seed=cfg.seed, rank=1),
                            max_physical_batch=cfg.runtime.max_physical_batch)
    # The private party draws from secret streams (keyed from the OS), exactly as a DP party of a run does. Its step
    # is the local release (per-example clipping and Gaussian noise, no masks: one party has no pairs to mask with);
    # what secure aggregation adds to a step is timed apart (secure_* fields).
    dp = DPParams.from_config(dataclasses.replace(cfg.privacy, aggregation="local"), n)
    return search_party(model, train, val, n, PartyRandomness.create(dp.randomness, seed=cfg.seed, rank=1), dp=dp,
                        max_physical_batch=cfg.runtime.max_physical_batch)


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
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
            w, c = timed(job)
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
    times = [timed(lambda: torch.mm(a, b))[1] for _ in range(max(repeats, 3))]
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
