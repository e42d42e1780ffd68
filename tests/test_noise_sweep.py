"""The noise sweep (paper Table 2 in small): `mpi_fnas.sweep` as users run it, plus its config handling.

The real sweeps run as 3-rank jobs (server + 2 parties; in the warm ranks, conftest.warm_jobs) on a tiny setting
(TINY below), short: what they check is what the logs, the tables and the composed ε say, not how well they learn.
The setting is the one on which σ = 1 learns clearly above chance in 30 steps and σ² = 10 does not: that signal is
a benchmark (docs/benchmarks.md, "The noise sweep's signal").
"""

from __future__ import annotations

import csv
import functools
import math
import subprocess
import sys
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import yaml
from conftest import mpirun, warm_job

from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.runlog import read_run
from mpi_fnas.sweep import (
    PAPER_VARIANCES,
    LogReleases,
    PointResult,
    SweepPoint,
    compose_sweep,
    data_identity,
    format_table,
    load_sweep,
    noise_multiplier,
    point_config,
    read_point,
    summarize,
    summarize_dir,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "dpfnas_noise_sweep.yaml"
# The tiny setting (on top of the shipped config): 1 cell with 1 node on 8×8 images, full shards as the expected
# batch (q = 1), a large W step; the benchmark's setting (docs/benchmarks.md, "The noise sweep's signal").
TINY = [
    "federation.parties=2", "data.train_size=1024", "data.test_size=300", "data.image_size=8",
    "space.channels=8", "space.layers=1", "space.nodes=1", "search.epochs=1", "search.steps_per_epoch=30",
    "search.batch_size=256", "search.w_lr=0.8", "search.w_lr_min=0.8", "privacy.clip_w=4.0",
    "privacy.clip_a=0.15", "runtime.progress=off", "runtime.threads_per_rank=1", "runtime.log_every=10",
    # Reproducible noise (ε void): the statistical test below was measured with fixed seeds and must stay fixed.
    "privacy.reproducible_noise=true",
]


def sweep(ranks: int, *args: str, sets: list[str] = (), env: dict | None = None, launch: bool = False,
          timeout: float = 600) -> subprocess.CompletedProcess:
    """``mpirun -n RANKS python -m mpi_fnas.sweep ARGS --set SETS...``: in the warm ranks (conftest.warm_jobs), or
    a launch of its own if `launch` (a sweep that fails aborts its job)."""
    args = (*args, *(arg for item in sets for arg in ("--set", item)))
    if launch:
        return mpirun(ranks, *args, module="mpi_fnas.sweep", env=env, timeout=timeout)
    return warm_job(ranks, *args, module="mpi_fnas.sweep", env=env, timeout=timeout)


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# -- the config ----------------------------------------------------------------------------------------------------
def test_shipped_config_is_table_2_and_its_run_part_loads_with_load_config(tmp_path):
    base, spec = load_sweep(CONFIG)
    assert base.mode == "dpfnas" and base.federation.parties == 4
    assert spec.variances == PAPER_VARIANCES and spec.seeds == (0, 1, 2)
    assert len(spec.points()) == 18
    # Without its sweep section the file is an ordinary run config, and the sweep tool reads the same config.
    tree = yaml.safe_load(CONFIG.read_text())
    tree.pop("sweep")
    plain = tmp_path / "run.yaml"
    plain.write_text(yaml.safe_dump(tree))
    assert load_config(plain) == base
    with pytest.raises(ConfigError, match="sweep: unknown key"):
        load_config(CONFIG)  # documented: mpi_fnas.run does not take the file as it is


def test_point_sets_seed_and_both_noise_multipliers_to_sqrt_variance():
    base, _ = load_sweep(CONFIG)
    for variance, seed in [(0.5, 2), (1.0, 0), (10.0, 1)]:
        cfg = point_config(base, SweepPoint(variance, seed))
        assert cfg.seed == seed
        assert cfg.privacy.noise_multiplier_w == cfg.privacy.noise_multiplier_a
        assert math.isclose(cfg.privacy.noise_multiplier_w ** 2, variance, rel_tol=1e-11)
        assert cfg.privacy.clip_w == base.privacy.clip_w and cfg.search == base.search
    assert base.privacy.noise_multiplier_w == 1.0  # the base config is not modified


def test_points_match_the_slurm_array_job():
    """slurm/noise_sweep.sh computes σ with awk "%.12g" and names runs var<variance as written>-seed<seed>."""
    variances = "0.5 1 2 5 8 10"
    awk = subprocess.run(["awk", "BEGIN { n = split(\"" + variances + "\", v, \" \"); "
                          "for (i = 1; i <= n; i++) printf \"%.12g\\n\", sqrt(v[i]) }"],
                         capture_output=True, text=True, check=True)
    sigmas = [float(line) for line in awk.stdout.split()]
    assert sigmas == [noise_multiplier(float(v)) for v in variances.split()]
    assert noise_multiplier(2.0) != math.sqrt(2.0)  # the rounding is real, so matching it matters
    _, spec = load_sweep(CONFIG)
    names = [p.dirname for p in spec.points() if p.seed == 0]
    assert names == [f"var{v}-seed0" for v in variances.split()]
    script = (ROOT / "slurm" / "noise_sweep.sh").read_text()
    assert '/var$variance-seed$seed' in script and "privacy.noise_multiplier_w privacy.noise_multiplier_a" in script


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["sweep.variance=[1]"], "sweep.variance: unknown key"),
        (["sweep.variances=[1,-2]"], "sweep.variances: -2 is not a finite number > 0"),
        (["sweep.variances=[]"], "sweep.variances: must list at least one value"),
        (["sweep.variances=[1,1.0]"], "sweep.variances: 1 is listed twice"),
        (["sweep.seeds=[0,0.5]"], "sweep.seeds: 0.5 is not an integer >= 0"),
        (["sweep.variances.x=1"], "expected sweep.variances=[...]"),
        (["mode=fnas", "space.norm=groupnorm"], "mode: a noise sweep needs mode dpfnas"),
        (["privacy.target_epsilon=3"], "privacy.target_epsilon: the sweep sets the noise multipliers"),
        (["search.epochs=0"], "search.epochs: 0 must be >= 1"),
    ],
)
def test_bad_sweep_input_is_a_config_error(sets, needle):
    with pytest.raises(ConfigError) as info:
        load_sweep(CONFIG, sets)
    assert needle in str(info.value)


def test_summary_groups_by_variance_with_sample_std():
    def point(variance: float, seed: int, acc: float, eps: float) -> PointResult:
        return PointResult(variance=variance, seed=seed, sigma=noise_multiplier(variance), test_acc=acc,
                           epsilon_worst=eps, epsilon_best=eps / 2, delta=1e-5, mu_gdp_worst=0.1, steps=5,
                           status="finished", stop_reason="completed", wall_seconds=1.0, run_dir=Path("x"))

    rows = summarize([point(10, 0, 0.1, 2.0), point(1, 0, 0.3, 9.0), point(1, 1, 0.2, 9.5), point(10, 1, 0.15, 2.0)])
    assert [r.variance for r in rows] == [1.0, 10.0] and [r.seeds for r in rows] == [2, 2]
    assert rows[0].test_error_mean_pct == pytest.approx(75.0)
    assert rows[0].test_error_std_pct == pytest.approx(math.sqrt(50.0))  # errors 70 %, 80 %: ddof 1
    assert rows[0].epsilon_worst == 9.5 and rows[1].test_error_mean_pct == pytest.approx(87.5)
    assert math.isnan(summarize([point(1, 0, 0.5, 1.0)])[0].test_error_std_pct)  # one seed: no spread


# -- privacy over the whole sweep ------------------------------------------------------------------------------------
# An accountant independent of mpi_fnas.privacy: dp_accounting's own PLDAccountant on the DpEvent of the releases,
# at the grid PrivacyLedger uses (1e-4). Events are (σ, q, count) triples.
@functools.lru_cache(maxsize=64)
def reference_epsilon(events: tuple[tuple[float, float, int], ...], delta: float) -> float:
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count)
        for sigma, q, count in events if count > 0
    ]))
    return float(accountant.get_epsilon(delta))


def released(name: str, pool: str, placement: str, q_train: tuple[float, ...], q_val: tuple[float, ...],
             sigma: float, releases: tuple[int, ...], delta: tuple[float, ...]) -> LogReleases:
    return LogReleases(log=name, data_pool=pool, placement=placement, sample_rate_train=q_train,
                       sample_rate_val=q_val, noise_multiplier_w=(sigma,) * len(q_train),
                       noise_multiplier_a=(sigma,) * len(q_train), delta=delta, releases=releases, exact=True)


def fake_point(variance: float, seed: int, *logs: LogReleases, status: str = "finished") -> PointResult:
    return PointResult(variance=variance, seed=seed, sigma=noise_multiplier(variance), test_acc=0.5,
                       epsilon_worst=1.0, epsilon_best=1.0, delta=1e-5, mu_gdp_worst=0.1, steps=5, status=status,
                       stop_reason="completed", wall_seconds=1.0, run_dir=Path(f"var{variance:g}-seed{seed}"),
                       releases=logs)


def test_sweep_epsilon_composes_each_partys_ledgers_over_every_point_of_its_seed():
    """Synthetic data, two seeds (two pools), two variances each: party k's ε over the sweep is the composition of
    its train releases over both points, and of its validation releases, the larger of the two, at its δ; each
    seed's pool is composed on its own. Compared with an independent dp_accounting composition (rel ≤ 1e-6)."""
    q_train, q_val, deltas = (0.25, 0.125), (0.125, 0.125), (1e-5, 2e-6)  # party 2: smaller rates, smaller δ
    points = []
    for seed in (0, 1):
        pool = f"synthetic-shapes seed {seed}"
        points += [
            fake_point(4.0, seed, released(f"var4-seed{seed}/search.h5", pool, f"p{seed}", q_train, q_val, 2.0,
                                           (6, 6), deltas)),
            # party 2 was charged fewer releases (charged_steps differ per party)
            fake_point(16.0, seed, released(f"var16-seed{seed}/search.h5", pool, f"p{seed}", q_train, q_val, 4.0,
                                            (9, 7), deltas)),
        ]
    compositions = compose_sweep(points)
    assert [c.data_pool for c in compositions] == ["synthetic-shapes seed 0", "synthetic-shapes seed 1"]

    def party(k: int) -> float:
        train = ((2.0, q_train[k], 6), (4.0, q_train[k], (9, 7)[k]))
        val = ((2.0, q_val[k], 6), (4.0, q_val[k], (9, 7)[k]))
        return max(reference_epsilon(train, deltas[k]), reference_epsilon(val, deltas[k]))

    expected = [party(0), party(1)]
    for c in compositions:
        assert c.per_party == pytest.approx(expected, rel=1e-6)
        assert c.epsilon == pytest.approx(max(expected), rel=1e-6)
        assert c.runs == 2 and c.exact and c.delta == max(deltas)
    # Composition matters: the sweep ε is well above the one-point ε of either point.
    one_point = max(reference_epsilon(((2.0, 0.25, 6),), 1e-5), reference_epsilon(((4.0, 0.25, 9),), 1e-5))
    assert compositions[0].epsilon > 1.05 * one_point

    rows = summarize(points)
    assert [r.epsilon_sweep_composed for r in rows] == pytest.approx([max(expected)] * 2, rel=1e-6)
    assert all(r.delta_sweep_composed == max(deltas) for r in rows)
    table = format_table(rows)
    assert "ε sweep" in table and "synthetic-shapes seed 1: 2 runs, per party: same shards in every run" in table


def test_seeds_that_repartition_the_same_examples_get_the_worst_case_over_placements():
    """CIFAR-10-like: the same images under two seeds (two placements). An image may have been in any party's train
    or validation shard under each seed, so the bound must cover the worst choice per seed: here the largest rate
    lies in party 1's train shard under seed 0 and party 2's validation shard under seed 1, a combination no single
    party/ledger saw. The composed ε equals the independent composition of that worst placement (it is attained,
    as σ and the counts agree) and bounds every other placement."""
    pool, small, large = "cifar10 (same images for every seed)", 0.0625, 0.25
    delta = (1e-5, 1e-5)
    points = [
        fake_point(16.0, 0, released("var16-seed0/search.h5", pool, "s0", (large, small), (small, small), 4.0,
                                     (5, 5), delta)),
        fake_point(16.0, 1, released("var16-seed1/search.h5", pool, "s1", (small, small), (small, large), 4.0,
                                     (5, 5), delta)),
    ]
    (composition,) = compose_sweep(points)
    placements = {((4.0, a, 5), (4.0, b, 5)) for a in (small, large) for b in (small, large)}
    bounds = {events: reference_epsilon(events, 1e-5) for events in placements}
    assert composition.epsilon == pytest.approx(max(bounds.values()), rel=1e-6)
    assert composition.per_party is None and composition.runs == 2
    assert composition.epsilon == pytest.approx(reference_epsilon(((4.0, large, 5), (4.0, large, 5)), 1e-5), rel=1e-6)
    assert all(composition.epsilon >= value * (1 - 1e-9) for value in bounds.values())
    # What a per-party composition would claim (each party's own two ledgers) is less: not a bound here.
    per_party_claim = reference_epsilon(((4.0, large, 5), (4.0, small, 5)), 1e-5)
    assert composition.epsilon > 1.05 * per_party_claim


def test_data_identity_follows_what_the_data_depends_on():
    """Pools and placements as mpi_fnas.data makes them: the planned shards of two variances of one seed are the
    same indices; two seeds of synthetic-shapes render different images; CIFAR-10 seeds share one pool."""
    from mpi_fnas.federation.job_plan import open_split, plan_assignments

    base, _ = load_sweep(CONFIG, TINY)
    cfg = {(v, s): point_config(base, SweepPoint(v, s)) for v in (1.0, 10.0) for s in (0, 1)}
    ident = {key: data_identity(c, 2) for key, c in cfg.items()}
    assert ident[1.0, 0] == ident[10.0, 0] and ident[1.0, 1] == ident[10.0, 1]
    assert ident[1.0, 0][0] != ident[1.0, 1][0]  # different seeds: different examples
    same_a, same_b = plan_assignments(cfg[1.0, 0], 2), plan_assignments(cfg[10.0, 0], 2)
    for a, b in zip(same_a, same_b, strict=True):
        assert np.array_equal(a.train_indices, b.train_indices) and np.array_equal(a.val_indices, b.val_indices)
    x0, _ = open_split(cfg[1.0, 0], "train").render(np.arange(8))
    x1, _ = open_split(cfg[1.0, 1], "train").render(np.arange(8))
    assert not np.any(np.all(np.isclose(x0.flatten(1), x1.flatten(1)), axis=1))  # not one image in common

    cifar, _ = load_sweep(CONFIG, [*TINY, "data.dataset=cifar10", "data.image_size=32"])
    pool0, placement0 = data_identity(point_config(cifar, SweepPoint(1.0, 0)), 2)
    pool1, placement1 = data_identity(point_config(cifar, SweepPoint(1.0, 1)), 2)
    assert pool0 == pool1 and placement0 != placement1  # the same images, re-partitioned


def logged_releases(log: dict) -> np.ndarray:
    """Releases per party as the log records them: /privacy/charged_steps when present, else /privacy/steps."""
    privacy = log["privacy"]
    if "charged_steps" in privacy:
        return np.asarray(privacy["charged_steps"][-1])
    return np.full(log["parties"], int(privacy["steps"][-1]))


def reference_from_logs(logs: list[dict]) -> float:
    """Worst party's ε composed over `logs` (one placement), straight from read_run and dp_accounting."""
    worst = 0.0
    privacy = [log["privacy"] for log in logs]
    for k in range(logs[0]["parties"]):
        delta = min(float(np.broadcast_to(p["delta"], (logs[0]["parties"],))[k]) for p in privacy)
        for sigma_key, rate_key in (("noise_multiplier_w", "sample_rate_train"),
                                    ("noise_multiplier_a", "sample_rate_val")):
            events = tuple((float(np.broadcast_to(p[sigma_key], (len(p[rate_key]),))[k]), float(p[rate_key][k]),
                            int(logged_releases(log)[k])) for p, log in zip(privacy, logs, strict=True))
            worst = max(worst, reference_epsilon(events, delta))
    return worst


@pytest.mark.slow
def test_sweep_epsilon_from_real_logs_matches_an_independent_composition(tmp_path):
    """A real 2 variances × 2 seeds sweep, as users run it: every point's log, and summary.csv, points.csv and the
    table equal to what the logs say (read straight, not through mpi_fnas.sweep): per variance the mean and sample
    std of the test error, σ, the worst point ε; per seed the worst party's ε composed over both variances, as
    dp_accounting composes the releases of the logs; ``--summarize`` re-tables the directory alike; a log of an
    abandoned attempt in a point's directory is composed too. (That the error grows with the noise is an accuracy
    claim: docs/benchmarks.md, "The noise sweep's signal".)"""
    out_dir = tmp_path / "sw"
    steps, seeds = 3, [0, 1]
    out = sweep(3, "--config", str(CONFIG), "--out", str(out_dir),
                sets=[*TINY, f"search.steps_per_epoch={steps}", "search.batch_size=64", "sweep.variances=[4,16]",
                      f"sweep.seeds={seeds}"], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    logs = {(v, s): read_run(out_dir / f"var{v}-seed{s}" / "search.h5") for v in (4, 16) for s in seeds}
    errors: dict[str, list[float]] = {}
    for (variance, seed), log in logs.items():
        assert log["status"] == "finished" and log["reason"] == "completed"
        assert int(log["metrics"]["step"][-1]) == steps
        assert log["privacy"]["noise_multiplier_w"] == pytest.approx(math.sqrt(variance))
        assert log["privacy"]["noise_multiplier_a"] == pytest.approx(math.sqrt(variance))
        assert f"seed: {seed}\n" in log["config"]
        errors.setdefault(str(variance), []).append(100.0 * (1.0 - log["metrics"]["test_acc"][-1]))
    summary = read_csv(out_dir / "summary.csv")
    assert [row["variance"] for row in summary] == ["4", "16"]  # one row per variance
    for row in summary:
        mine = errors[row["variance"]]
        worst = max(float(logs[int(row["variance"]), s]["privacy"]["epsilon"][-1].max()) for s in seeds)
        assert int(row["seeds"]) == len(seeds)
        assert float(row["test_error_mean_pct"]) == pytest.approx(np.mean(mine))
        assert float(row["test_error_std_pct"]) == pytest.approx(np.std(mine, ddof=1))
        assert float(row["epsilon_worst"]) == pytest.approx(worst)
        assert float(row["sigma"]) == pytest.approx(math.sqrt(float(row["variance"])))
    assert float(summary[1]["epsilon_worst"]) < float(summary[0]["epsilon_worst"])  # more noise, less spent
    assert len(read_csv(out_dir / "points.csv")) == 2 * len(seeds)
    assert "test error (%)" in out.stdout and str(out_dir / "summary.csv") in out.stdout
    before = (out_dir / "summary.csv").read_text()
    (out_dir / "summary.csv").unlink()
    again = subprocess.run([sys.executable, "-m", "mpi_fnas.sweep", "--summarize", str(out_dir)],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0, again.stderr
    assert (out_dir / "summary.csv").read_text() == before

    per_seed = {s: reference_from_logs([logs[4, s], logs[16, s]]) for s in (0, 1)}
    one_point = max(float(log["privacy"]["epsilon"][-1].max()) for log in logs.values())
    assert min(per_seed.values()) > one_point  # the sweep spent more than any one point

    for row in read_csv(out_dir / "summary.csv"):
        assert float(row["epsilon_sweep_composed"]) == pytest.approx(max(per_seed.values()), rel=1e-6)
        assert row["exact_sweep_composed"] == "True" and int(row["runs_sweep_composed"]) == 2
    for row in read_csv(out_dir / "points.csv"):
        assert float(row["epsilon_sweep_composed"]) == pytest.approx(per_seed[int(row["seed"])], rel=1e-6)
        assert row["pool_sweep_composed"] == f"synthetic-shapes seed {row['seed']}"
    assert "ε sweep" in out.stdout and "synthetic-shapes seed 0: 2 runs" in out.stdout

    # A run preempted before its first checkpoint and started afresh leaves search-attempt<n>.h5: it released the
    # same shards, so it composes into its seed's pool (here a copy of a finished log: 3 more releases each).
    attempt = out_dir / "var4-seed0" / "search-attempt1.h5"
    attempt.write_bytes((out_dir / "var16-seed0" / "search.h5").read_bytes())
    results = summarize_dir(out_dir)
    by_pool = {c.data_pool: c for c in compose_sweep(results)}
    seed0 = by_pool["synthetic-shapes seed 0"]
    assert seed0.runs == 2 and len(seed0.logs) == 3
    expected = reference_from_logs([logs[4, 0], logs[16, 0], read_run(attempt)])
    assert seed0.epsilon == pytest.approx(expected, rel=1e-6) and seed0.epsilon > per_seed[0]
    assert by_pool["synthetic-shapes seed 1"].epsilon == pytest.approx(per_seed[1], rel=1e-6)


# -- the command line ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["sweep.variances=[0]"], "sweep.variances: 0 is not a finite number > 0"),
        ([], "federation.parties: config says 4 but the MPI world has 2 parties"),
    ],
    ids=["bad-variance", "party-count"],
)
def test_bad_input_is_one_line_from_rank_0_and_exit_2(sets, needle, tmp_path):
    out = sweep(3, "--config", str(CONFIG), "--out", str(tmp_path / "sw"), sets=sets, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("mpi_fnas: error: ") and needle in lines[0]


@pytest.mark.slow
def test_existing_run_log_is_never_overwritten(tmp_path):
    log = tmp_path / "sw" / "var10-seed2" / "search.h5"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"precious")
    out = sweep(3, "--config", str(CONFIG), "--out", str(tmp_path / "sw"),
                sets=[*TINY, "sweep.variances=[1,10]", "sweep.seeds=[0,2]"], timeout=120)
    assert out.returncode == 2 and "var10-seed2 already holds a run log" in out.stderr
    assert log.read_bytes() == b"precious"
    assert not (tmp_path / "sw" / "var1-seed0").exists()  # refused before the first point ran


@pytest.mark.slow
def test_party_failure_aborts_the_sweep_without_hanging(tmp_path):
    out_dir = tmp_path / "sw"
    out = sweep(3, "--config", str(CONFIG), "--out", str(out_dir),
                sets=[*TINY, "search.steps_per_epoch=4", "sweep.variances=[1,10]", "sweep.seeds=[0]"],
                env={"MPI_FNAS_INJECT_FAULT": "2:3"}, launch=True, timeout=180)
    assert out.returncode not in (0, 2), out.stdout
    # Under DP the party's error text stays with it: a generic reason on the wire, the details in its error.log.
    assert "injected fault at step 3" not in out.stderr
    assert "injected fault at step 3" in (out_dir / "var1-seed0" / "parties" / "rank2" / "error.log").read_text()
    assert read_run(out_dir / "var1-seed0" / "search.h5")["status"] == "failed"
    assert not (out_dir / "var10-seed0").exists()  # the sweep stopped at the failing point
    assert not (out_dir / "summary.csv").exists()
    # The failed run released data after its last /privacy row (here: none was logged before step 3): the sweep ε
    # charges it up to the plan's end (4 steps), flagged as an upper bound; it is never a finished point.
    point = read_point(out_dir / "var1-seed0")
    assert point.status == "failed" and len(point.releases) == 1
    assert point.releases[0].releases == (4, 4) and not point.releases[0].exact
    with pytest.raises(ConfigError, match="holds no finished"):
        summarize_dir(out_dir)


@pytest.mark.slow
def test_signal_checkpoints_the_current_point_and_exits_75(tmp_path):
    """SIGTERM/SIGUSR1 (simulated at step 2) stops the sweep like mpi_fnas.run: checkpoint, log, exit 75; the
    point then resumes to completion with mpi_fnas.run --resume, as the message says."""
    out_dir = tmp_path / "sw"
    out = sweep(3, "--config", str(CONFIG), "--out", str(out_dir),
                sets=[*TINY, "search.steps_per_epoch=4", "sweep.variances=[1,10]", "sweep.seeds=[0]"],
                env={"MPI_FNAS_STOP_AFTER": "2"}, timeout=180)
    run_dir = out_dir / "var1-seed0"
    assert out.returncode == 75, out.stderr[-2000:]
    assert f"--resume {run_dir}" in out.stderr
    assert read_run(run_dir / "search.h5")["status"] == "interrupted"
    assert (run_dir / "checkpoint.pt").exists() and not (out_dir / "var10-seed0").exists()

    resumed = warm_job(3, "--resume", str(run_dir), timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = read_run(run_dir / "search.h5")
    assert log["status"] == "finished" and int(log["metrics"]["step"][-1]) == 4
    # Releases of the resumed run: charged_steps when the log has them; else the log cannot tell how many steps
    # after the checkpoint were replayed, so every resume adds checkpoint.every_steps (off here: the plan, 4).
    (released,) = read_point(run_dir).releases
    if "charged_steps" in log["privacy"]:
        assert released.releases == tuple(int(c) for c in log["privacy"]["charged_steps"][-1]) and released.exact
    else:
        assert log["attempts"] == 2 and released.releases == (8, 8) and not released.exact
