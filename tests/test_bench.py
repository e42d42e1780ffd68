"""The benchmark CLI reports the documented fields, consistently (no timing targets here: see docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pre_recipe import PRE_RECIPE

from mpi_fnas import bench
from mpi_fnas.config import load_config
from mpi_fnas.cpu_kernels import aten_cpu_capability, cpu_model, onednn_isa
from mpi_fnas.federation.flat import STATS
from mpi_fnas.federation.memory import peak_rss_mb
from mpi_fnas.privacy import DPParams, per_sample_gradients

ROOT = Path(__file__).resolve().parents[1]
TINY_SETTINGS = [*PRE_RECIPE, "space.channels=4", "space.layers=3", "space.nodes=1", "data.image_size=8",
                 "search.batch_size=4"]
TINY = [arg for item in TINY_SETTINGS for arg in ("--set", item)] + ["--repeats", "1", "--json"]
DP_TIMES = ("dp_step_seconds", "dp_w_release_seconds", "dp_a_release_seconds", "dp_step_cpu_seconds",
            "per_sample_seconds", "per_sample_a_seconds")
OPACUS_FIELDS = ("opacus_version", "opacus_network", "opacus_network_params", "network_dp_step_cpu_seconds",
                 "opacus_dp_step_cpu_seconds", "dp_step_vs_opacus")
AGGREGATION_FIELDS = ("aggregate_parties", "aggregate_epsilon", "aggregate_sigma_local", "aggregate_sigma_secure",
                      "aggregate_noise_std_ratio", "aggregate_noise_std_ratio_expected", "secure_overhead_fraction",
                      "secure_bits_needed", "secure_overflow_rate")
RSS_FIELDS = ("rss_baseline_mb", "step_rss_mb", "dp_step_rss_mb", "peak_rss_ratio", "rss_method", "rss_peak_mb_party",
              "rss_peak_mb_server", "startup_seconds")


def _run_bench(ranks: int, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "mpi_fnas.bench", *TINY, *extra]
    if ranks > 1:
        cmd = [str(Path(sys.executable).parent / "mpirun"), "-n", str(ranks), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1  # rank 0 only
    return json.loads(lines[0])


# 1 rank without the memory subprocesses (with the aggregation comparison), 3 ranks with them (without it): the
# subprocess path that must not join the MPI job is the one under mpirun.
@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "memory"), [(1, False), (3, True)])
def test_bench_json_fields(ranks, memory):
    report = _run_bench(ranks, *(["--no-aggregation", "--no-opacus"] if memory else ["--no-memory"]))
    assert report["ranks"] == ranks
    assert report["step_seconds"] > 0 and report["comm_seconds"] > 0
    assert report["step_seconds"] == pytest.approx(report["w_release_seconds"] + report["a_release_seconds"])
    assert report["comm_fraction"] == pytest.approx(
        report["comm_seconds"] / (report["step_seconds"] + report["comm_seconds"]))
    assert report["num_a"] == 2 * 2 * 8  # 2 cells kinds × 2 edges (1 node) × 8 ops
    # Which machine and kernels ran: its CPU, oneDNN's ISA as this process's (the same environment,
    # ONEDNN_MAX_CPU_ISA included), and ATen's.
    assert (report["cpu_model"], report["onednn_isa"], report["aten_cpu_capability"]) == (
        cpu_model(), onednn_isa(), aten_cpu_capability())
    # The plain step's counted FLOPs over its CPU time, beside the core's dense matmul rate of the same run.
    assert report["step_gflop"] > 0 and report["core_peak_gflops"] > 0
    assert report["step_gflops"] == pytest.approx(report["step_gflop"] / report["step_cpu_seconds"])

    # The private step: every timing present and positive, ratios consistent with the times they divide.
    for key in DP_TIMES:
        assert report[key] > 0, key
    assert report["dp_step_seconds"] == pytest.approx(
        report["dp_w_release_seconds"] + report["dp_a_release_seconds"])
    assert report["dp_step_ratio"] == pytest.approx(report["dp_step_seconds"] / report["step_seconds"])
    assert report["dp_step_ratio_cpu"] == pytest.approx(report["dp_step_cpu_seconds"] / report["step_cpu_seconds"])
    # ... and split three ways: the plain step's compute, the DP work on top of it, the exchange
    assert report["dp_work_seconds"] == pytest.approx(report["dp_step_seconds"] - report["step_seconds"])
    whole = report["dp_step_seconds"] + report["comm_seconds"]
    assert report["split_compute_fraction"] == pytest.approx(report["step_seconds"] / whole)
    assert report["split_comm_fraction"] == pytest.approx(report["comm_seconds"] / whole)
    assert sum(report[f"split_{part}_fraction"] for part in ("compute", "dp", "comm")) == pytest.approx(1.0)
    # The supernet's W is all Conv/GroupNorm/Linear, its alphas are per-example copies: both by hooks.
    assert (report["per_sample_method_w"], report["per_sample_method_a"]) == ("hooks", "hooks")

    # The augmentation's step, plain and private, on the same network and batch.
    assert report["augment_num_w"] > 0 and report["augment_step_seconds"] > 0
    assert report["augment_dp_step_ratio"] == pytest.approx(
        report["augment_dp_step_seconds"] / report["augment_step_seconds"])

    if memory:
        assert all(report[key] is None for key in (*AGGREGATION_FIELDS, *OPACUS_FIELDS))
    else:  # the configured cell's private step beside Opacus's: both timed, the ratio ours over theirs
        assert report["opacus_version"] and report["opacus_network_params"] > 0
        assert report["opacus_network"].startswith("cell ")  # the network the config trains, not a stand-in
        assert report["dp_step_vs_opacus"] == pytest.approx(
            report["network_dp_step_cpu_seconds"] / report["opacus_dp_step_cpu_seconds"])
    if not memory:  # secure against local aggregation at equal ε, K = 8 (docs/benchmarks.md)
        assert report["aggregate_parties"] == 8 and report["aggregate_epsilon"] > 0
        assert report["aggregate_sigma_secure"] > report["aggregate_sigma_local"] == 1.0  # the bound costs noise
        expected = report["aggregate_noise_std_ratio_expected"]
        assert expected == pytest.approx(report["aggregate_sigma_secure"] / (8**0.5 * report["aggregate_sigma_local"]))
        # A measurement, not a property: below 1 at the default config (0.59), above it at this tiny ε (docs)
        assert report["aggregate_noise_std_ratio"] == pytest.approx(expected, rel=0.15)
        assert report["secure_overhead_fraction"] == pytest.approx(
            (report["secure_w_release_cpu_seconds"] - report["local_w_release_cpu_seconds"]
             + report["secure_open_cpu_seconds"]) / report["dp_step_cpu_seconds"])
        assert 1 < report["secure_bits_needed"] <= report["secure_bits"] == 32 and report["secure_overflow_rate"] == 0
    if memory:
        assert report["rss_baseline_mb"] > 0
        assert report["step_rss_mb"] > 0 and report["dp_step_rss_mb"] > 0
        assert report["peak_rss_ratio"] == pytest.approx(report["dp_step_rss_mb"] / report["step_rss_mb"])
        # Not the inherited high-water mark of the (much larger) parent rank: the baseline is the child's own.
        assert report["rss_method"] in ("VmHWM", "ru_maxrss")
        # The private party process's whole peak (imports, supernet, the step) and its start-up time.
        assert report["rss_peak_mb_party"] >= report["rss_baseline_mb"]
        # Rank 0's (its planner, the test split, the supernet's evaluation): at least what torch alone holds.
        assert report["rss_peak_mb_server"] > 100
        assert 0 < report["startup_seconds"] < 300
    else:
        assert all(report[key] is None for key in RSS_FIELDS)


def test_bench_batchnorm_skips_private_step_with_reason():
    # An FNAS config may use BatchNorm (the config refuses it under mode dpfnas); DP cannot time a private step.
    report = _run_bench(1, "--no-memory", "--set", "mode=fnas", "--set", "space.norm=batchnorm")
    assert report["step_seconds"] > 0
    assert report["dp_step_seconds"] is None and report["dp_step_ratio"] is None
    assert "BatchNorm" in report["dp_note"]
    assert report["opacus_note"].startswith("not compared: module ") and report["dp_step_vs_opacus"] is None


def test_private_and_plain_steps_compute_on_the_same_network_and_batch():
    """With clipping inactive and negligible noise, the private release is the non-private mean gradient.

    That holds only if both parties have the same weights, the same inputs and the same batch (the whole shard of
    B examples: Poisson rate 1) and the release is divided by B = the realised batch size. Noise std σR = 1e-9.
    """
    cfg = load_config(None, [*TINY_SETTINGS, "privacy.clip_w=1000.0", "privacy.clip_a=1000.0",
                             "privacy.noise_multiplier_w=1.0e-12", "privacy.noise_multiplier_a=1.0e-12"])
    plain, private = bench.make_party(cfg, private=False), bench.make_party(cfg, private=True)
    assert private.releases is not None and plain.releases is None
    assert {r.expected_batch_size for r in private.releases.values()} == {len(private.train)} == {cfg.search.batch_size}
    per_example = per_sample_gradients(private.model, dict(private.model.named_weights()), private.train.x,
                                       private.train.y)
    assert float(per_example.norm(dim=1).max()) < 1000.0  # the premise: clipping does not act
    for release in ("w_release", "a_release"):
        mean_grad = getattr(plain, release)().copy()
        dp_release = getattr(private, release)().copy()
        assert mean_grad[-2] == cfg.search.batch_size  # the STATS count: the non-private batch is B examples
        assert np.all(dp_release[-STATS:] == 0)  # nothing but the release leaves a private party
        # float32 sums in a different order: compare the vectors, not the tiniest coordinates.
        error = np.linalg.norm(dp_release[:-STATS] - mean_grad[:-STATS]) / np.linalg.norm(mean_grad[:-STATS])
        assert error < 1e-5, (release, error)


def test_private_party_uses_the_configured_privacy_settings():
    cfg = load_config(None, [*TINY_SETTINGS, "privacy.clip_w=0.5", "privacy.noise_multiplier_a=3.0"])
    party = bench.make_party(cfg, private=True)
    # The local release (the secure path's extra work is timed apart, secure_* fields).
    local = dataclasses.replace(cfg.privacy, aggregation="local")
    assert party.releases == DPParams.from_config(local, cfg.search.batch_size).search_releases()
    assert (party.releases["W"].clip, party.releases["A"].clip, party.releases["A"].noise_multiplier) == (
        0.5, cfg.privacy.clip_a, 3.0)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_peak_rss_probe_sees_an_allocation_after_reset():
    """The memory probe measures what happens after the reset, not the process's earlier high-water mark."""
    # Fresh anonymous mappings, every page written: new resident memory whatever the allocator kept from earlier
    # tests (a numpy array may reuse freed heap pages that are still resident: no growth to see).
    big = _touched_mapping(60_000_000)
    big.close()
    assert bench._reset_peak_rss()
    before = peak_rss_mb()
    block = _touched_mapping(40_000_000)
    after = peak_rss_mb()
    block.close()
    assert 35 <= after - before <= 60
    assert math.isfinite(before) and before > 0


def _touched_mapping(size: int) -> mmap.mmap:
    mapping = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        mapping[offset] = 1
    return mapping


def test_bench_bad_config_exit_2():
    out = subprocess.run([sys.executable, "-m", "mpi_fnas.bench", "--set", "search.batch_size=0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "search.batch_size" in out.stderr


def test_the_scattering_of_a_partys_pool_is_timed_and_its_memory_counted():
    """A ScatterNet's stem runs once per party on its pool: the bench times it on a pool of the party's size and
    counts the features it keeps (81·C channels at S/4: 81·49 floats a 28x28 grey image); nothing for other
    networks."""
    from mpi_fnas.bench.scattering import party_pool_size, time_scattering
    from mpi_fnas.config import load_config

    cfg = load_config(None, ["data.dataset=mnist-5k", "data.image_size=28", "data.train_size=400",
                             "augment.network=scatter-linear"])
    assert party_pool_size(cfg, 4) == 100
    report = time_scattering(cfg, 4)
    assert report["scatter_examples"] == 100 and report["scatter_seconds"] > 0
    assert report["scatter_features_mb"] == pytest.approx(100 * 81 * 49 * 4 / 1e6)
    assert report["scatter_peak_growth_mb"] >= 0
    assert time_scattering(load_config(None, ["augment.network=cnn-gn"]), 4) == {}


def test_opacus_is_compared_on_the_cell_the_config_trains():
    """The configured cell's private step beside Opacus's on a copy of it: both timed, the ratio ours over theirs;
    the network named is the cell (of the genotype the supernet starts from), not a stand-in."""
    from mpi_fnas.bench.opacus_comparison import compare_opacus

    cfg = load_config(None, ["data.image_size=8", "space.stage_channels=[4, 8]", "augment.batch_size=8"])
    report = compare_opacus(cfg, repeats=1)
    assert report["opacus_network"].startswith("cell dpnas=") and report["opacus_network_params"] > 0
    assert report["dp_step_vs_opacus"] == pytest.approx(
        report["network_dp_step_cpu_seconds"] / report["opacus_dp_step_cpu_seconds"])
