"""The noise sweep (paper Table 2 in small): `mpi_fnas.sweep` as users run it, plus its config handling.

The central test runs a real sweep under `mpirun -n 3` (server + 2 parties) on a tiny setting tuned so that
σ = 1 learns clearly above chance in 30 steps and σ² = 10 does not (each party's release has per-coordinate noise
σ·R/B; with B = 256 and R near the median per-example gradient norm, σ² = 10 drowns the signal). Measured on
this 2-core box (9 seeds, 3 triples): σ = 1 test error 80.3 / 81.6 / 81.3 %, σ² = 10: 91.4 / 88.6 / 89.0 %;
every σ = 1 seed (77–85 %) beat every σ² = 10 seed (87–93 %). Chance is 90 % (10 classes).
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.runlog import read_run
from mpi_fnas.sweep import (
    PAPER_VARIANCES,
    PointResult,
    SweepPoint,
    load_sweep,
    noise_multiplier,
    point_config,
    summarize,
)

ROOT = Path(__file__).resolve().parents[1]
MPIRUN = str(Path(sys.executable).parent / "mpirun")
CONFIG = ROOT / "configs" / "dpfnas_noise_sweep.yaml"
STEPS = 30
# The tiny setting (on top of the shipped config): 1 cell with 1 node on 8×8 images, full shards as the expected
# batch (q = 1), a large W step. See the module docstring for the numbers it gives.
TINY = [
    "federation.parties=2", "data.train_size=1024", "data.test_size=300", "data.image_size=8",
    "space.channels=8", "space.layers=1", "space.nodes=1", "search.epochs=1", f"search.steps_per_epoch={STEPS}",
    "search.batch_size=256", "search.w_lr=0.8", "search.w_lr_min=0.8", "privacy.clip_w=4.0",
    "privacy.clip_a=0.15", "runtime.progress=off", "runtime.threads_per_rank=1", "runtime.log_every=10",
]
CHANCE_ERROR_PCT = 90.0


def sweep(ranks: int, *args: str, sets: list[str] = (), env: dict | None = None,
          timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [MPIRUN, "-n", str(ranks), sys.executable, "-m", "mpi_fnas.sweep", *args]
    for item in sets:
        cmd += ["--set", item]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


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


# -- the command line ----------------------------------------------------------------------------------------------
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


def test_existing_run_log_is_never_overwritten(tmp_path):
    log = tmp_path / "sw" / "var10-seed2" / "search.h5"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"precious")
    out = sweep(3, "--config", str(CONFIG), "--out", str(tmp_path / "sw"),
                sets=[*TINY, "sweep.variances=[1,10]", "sweep.seeds=[0,2]"], timeout=120)
    assert out.returncode == 2 and "var10-seed2 already holds a run log" in out.stderr
    assert log.read_bytes() == b"precious"
    assert not (tmp_path / "sw" / "var1-seed0").exists()  # refused before the first point ran


def test_party_failure_aborts_the_sweep_without_hanging(tmp_path):
    out_dir = tmp_path / "sw"
    out = sweep(3, "--config", str(CONFIG), "--out", str(out_dir),
                sets=[*TINY, "search.steps_per_epoch=4", "sweep.variances=[1,10]", "sweep.seeds=[0]"],
                env={"MPI_FNAS_INJECT_FAULT": "2:3"}, timeout=180)
    assert out.returncode not in (0, 2), out.stdout
    assert "injected fault at step 3" in out.stderr
    assert read_run(out_dir / "var1-seed0" / "search.h5")["status"] == "failed"
    assert not (out_dir / "var10-seed0").exists()  # the sweep stopped at the failing point
    assert not (out_dir / "summary.csv").exists()


@pytest.mark.slow
def test_table_2_in_small_error_grows_with_noise_variance(tmp_path):
    out_dir = tmp_path / "sw"
    seeds = [0, 1, 2]
    out = sweep(3, "--config", str(CONFIG), "--out", str(out_dir),
                sets=[*TINY, "sweep.variances=[1,10]", f"sweep.seeds={seeds}"])
    assert out.returncode == 0, out.stderr[-3000:]

    # Every run finished; read the per-seed errors straight from the logs (not through mpi_fnas.sweep).
    errors: dict[str, list[float]] = {}
    epsilons: dict[str, float] = {}
    for variance in ("1", "10"):
        for seed in seeds:
            log = read_run(out_dir / f"var{variance}-seed{seed}" / "search.h5")
            assert log["status"] == "finished" and log["reason"] == "completed"
            assert int(log["metrics"]["step"][-1]) == STEPS
            assert log["privacy"]["noise_multiplier_w"] == pytest.approx(math.sqrt(float(variance)))
            assert log["privacy"]["noise_multiplier_a"] == pytest.approx(math.sqrt(float(variance)))
            assert f"seed: {seed}\n" in log["config"]
            errors.setdefault(variance, []).append(100.0 * (1.0 - log["metrics"]["test_acc"][-1]))
            epsilons[variance] = float(log["privacy"]["epsilon"][-1].max())

    summary = read_csv(out_dir / "summary.csv")
    assert [row["variance"] for row in summary] == ["1", "10"]  # one row per variance
    for row in summary:
        mine = errors[row["variance"]]
        assert int(row["seeds"]) == len(seeds)
        assert float(row["test_error_mean_pct"]) == pytest.approx(np.mean(mine))
        assert float(row["test_error_std_pct"]) == pytest.approx(np.std(mine, ddof=1))
        assert float(row["epsilon_worst"]) == pytest.approx(epsilons[row["variance"]])
        assert float(row["sigma"]) == pytest.approx(math.sqrt(float(row["variance"])))
    assert len(read_csv(out_dir / "points.csv")) == 2 * len(seeds)
    assert "test error (%)" in out.stdout and str(out_dir / "summary.csv") in out.stdout

    # The signal: σ = 1 learns clearly above chance, σ² = 10 is worse (more noise, stronger privacy).
    err_1, err_10 = np.mean(errors["1"]), np.mean(errors["10"])
    print(f"test error (%): σ²=1 {np.round(errors['1'], 2)} mean {err_1:.2f}; "
          f"σ²=10 {np.round(errors['10'], 2)} mean {err_10:.2f}")
    assert err_1 < CHANCE_ERROR_PCT - 4.0, errors
    assert err_10 > err_1 + 3.0, errors
    assert epsilons["10"] < epsilons["1"]

    # --summarize re-tables the directory from the logs alone, to the same summary.
    before = (out_dir / "summary.csv").read_text()
    (out_dir / "summary.csv").unlink()
    again = subprocess.run([sys.executable, "-m", "mpi_fnas.sweep", "--summarize", str(out_dir)],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0, again.stderr
    assert (out_dir / "summary.csv").read_text() == before


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

    resumed = subprocess.run([MPIRUN, "-n", "3", sys.executable, "-m", "mpi_fnas.run", "--resume", str(run_dir)],
                             capture_output=True, text=True, timeout=180, cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = read_run(run_dir / "search.h5")
    assert log["status"] == "finished" and int(log["metrics"]["step"][-1]) == 4
