"""A sweep's results read back from its run logs: each point's outcome (PointResult) and the releases each log
made on its parties' data (LogReleases), the inputs of the sweep-wide composition."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpi_fnas.config import Config, config_from_text
from mpi_fnas.federation.adadp import w_rounds
from mpi_fnas.runlog.schema import LOG_NAME
from mpi_fnas.sweep.points import POINT_DIR, noise_multiplier

#: Final statuses whose last /privacy row counts every release of the log (a signal checkpoints at the step it
#: logs); any other status (failed, running) may have released after its last row.
SETTLED_STATUSES = ("finished", "interrupted")

#: Logs of attempts abandoned when a run preempted before its first checkpoint was started afresh in the same
#: directory (mpi_fnas.run renames the old log): their releases were made on the same shards and count too.
ABANDONED_LOG_GLOB = "search-attempt*.h5"


@dataclass(frozen=True)
class LogReleases:
    """The releases one run log records on its parties' data: the inputs of the sweep-wide composition.

    Tuples are per party (K,), party k at index k - 1. Every iteration releases two Poisson-subsampled Gaussian
    mechanisms per party: G_k on its train shard (rate q_tr = B/N_k^tr, noise multiplier σ_W) and H_k on its
    disjoint validation shard (q_val = B/N_k^val, σ_A); ``releases`` counts iterations, each one release per
    shard, except under ADADP (``w_releases_per_step`` 2: G1 and G2 on the train shard, docs/adadp.md).
    """

    log: str  # "var<v>-seed<s>/search.h5" (or an abandoned search-attempt<n>.h5 of that point)
    data_pool: str  # logs of one pool drew on the same examples (see data_identity)
    placement: str  # logs of one placement gave party k the same train and the same validation shard
    sample_rate_train: tuple[float, ...]
    sample_rate_val: tuple[float, ...]
    noise_multiplier_w: tuple[float, ...]
    noise_multiplier_a: tuple[float, ...]
    delta: tuple[float, ...]
    releases: tuple[int, ...]  # releases charged to each of party k's two ledgers
    exact: bool  # False: `releases` is an upper bound (an unfinished run, or requeues the log cannot count)
    w_releases_per_step: int = 1  # train-shard releases per iteration (2 under search.w_optimizer: adadp)


def data_identity(cfg: Config, parties: int) -> tuple[str, str]:
    """Which examples a run drew on (its *pool*) and how it placed them on its parties (its *placement*).

    synthetic-shapes renders example i of a split as a pure function of (seed, split, i) (mpi_fnas.data.synthetic:
    every parameter comes from a generator seeded with the seed), so runs with different seeds draw independent
    images and share no example: the pool is the seed. CIFAR-10 holds the same images whatever the seed (the seed
    only re-partitions them), so all its runs form one pool, and so does any other dataset read from files.
    The placement (search train/validation split, then the partition among the K parties) is a function of the
    data config, the seed and K only (mpi_fnas.federation.job_plan.plan_assignments); it is keyed on every data key,
    including ones it does not depend on (image size, test size): a spurious difference only makes the bound
    more conservative.
    """
    if cfg.data.dataset == "synthetic-shapes":
        pool = f"synthetic-shapes seed {cfg.seed}"
    else:
        pool = f"{cfg.data.dataset} (same images for every seed)"
    placement = json.dumps({"data": dataclasses.asdict(cfg.data), "seed": cfg.seed, "parties": int(parties)},
                           sort_keys=True)
    return pool, placement


def planned_steps_bound(cfg: Config, sample_rate_train: Sequence[float]) -> int:
    """An upper bound on the iterations (= releases per shard) of one attempt of a run: epochs × steps per epoch.

    privacy.max_epsilon can only shorten the plan. Without search.steps_per_epoch an epoch is, as the plan
    computes it, ceil(mean train-shard size / B), the shard sizes recovered from the log as N_k = B / q_k.
    """
    per_epoch = cfg.search.steps_per_epoch
    if per_epoch is None:
        batch = cfg.search.batch_size
        sizes = [round(batch / q) for q in sample_rate_train]
        per_epoch = max(1, math.ceil(float(np.mean(sizes)) / batch))
    per_epoch = math.ceil(per_epoch / w_rounds(cfg.search.w_optimizer))  # as the plan: an epoch counts W releases
    return int(cfg.search.epochs) * int(per_epoch)


def log_releases(log: dict[str, Any], name: str) -> LogReleases:
    """The releases recorded by `log` (a :func:`mpi_fnas.runlog.read_run` dict of a dpfnas run), named `name`.

    Counts: ``/privacy/charged_steps`` of the last row when the log has it (it includes releases replayed after a
    requeue), else ``/privacy/steps`` plus, for every resume (``attempts`` > 1), the releases between the
    checkpoint it restarted from and the crash, which the restored ledger lost: at most checkpoint.every_steps
    (the plan's steps with periodic checkpoints off). A log that is not finished or interrupted (failed,
    running) may have released after its last row: it is charged up to the plan's end. Such counts are upper
    bounds (``exact`` False).
    """
    privacy = log["privacy"]
    if privacy is None:
        raise ValueError(f"{name}: not a DP-FNAS log (no /privacy group)")
    parties = int(log["parties"])
    cfg = config_from_text(log["config"], stored=True)

    def per_party(value: Any) -> tuple[float, ...]:
        return tuple(float(v) for v in np.broadcast_to(np.asarray(value, dtype=float), (parties,)))

    q_train = per_party(privacy["sample_rate_train"])
    planned = planned_steps_bound(cfg, q_train)
    rows = len(privacy["steps"])
    last_step = int(privacy["steps"][-1]) if rows else 0
    charged = privacy.get("charged_steps")
    exact = True
    if charged is not None and rows and len(charged) == rows and np.all(np.asarray(charged[-1]) >= 0):
        counts = np.asarray(charged[-1], dtype=np.int64).reshape(parties)
    else:  # a log written before /privacy/charged_steps existed (or with an unfilled row)
        counts = np.full(parties, last_step, dtype=np.int64)
        resumes = int(log.get("attempts", 1)) - 1
        if resumes > 0:
            gap = min(cfg.checkpoint.every_steps or planned, planned)
            counts += resumes * gap
            exact = False
    if log["status"] not in SETTLED_STATUSES:
        counts += max(0, planned - last_step)
        exact = False
    pool, placement = data_identity(cfg, parties)
    return LogReleases(
        log=name, data_pool=pool, placement=placement, sample_rate_train=q_train,
        sample_rate_val=per_party(privacy["sample_rate_val"]),
        noise_multiplier_w=per_party(privacy["noise_multiplier_w"]),
        noise_multiplier_a=per_party(privacy["noise_multiplier_a"]),
        delta=per_party(privacy["delta"]), releases=tuple(int(c) for c in counts), exact=exact,
        w_releases_per_step=w_rounds(cfg.search.w_optimizer),
    )


@dataclass(frozen=True)
class PointResult:
    """One run of the sweep (finished or not), as read back from its log."""

    variance: float
    seed: int
    sigma: float  # the σ_W the run used (σ_A is the same)
    test_acc: float  # the server's test split, supernet, after the last step (NaN if never evaluated)
    epsilon_worst: float  # max over parties of the tight ε (PLD) of this run alone, at its last logged step
    epsilon_best: float
    delta: float  # max over parties
    mu_gdp_worst: float  # the paper's Theorem 3.1 μ (an approximation, not the guarantee)
    steps: int
    status: str
    stop_reason: str
    wall_seconds: float
    run_dir: Path
    releases: tuple[LogReleases, ...] = ()  # search.h5 then abandoned attempts; () = unknown (no composition)

    @property
    def test_error_pct(self) -> float:
        return 100.0 * (1.0 - self.test_acc)

    @property
    def finished(self) -> bool:
        return self.status == "finished"


def read_point(run_dir: str | Path) -> PointResult:
    """Read point ``DIR/var<v>-seed<s>`` from its search.h5 (written by this tool or by slurm/noise_sweep.sh),
    with the releases of its abandoned attempts (search-attempt<n>.h5), if any.

    Raises ValueError when the directory name, the log's config and its privacy parameters disagree, or when the
    log is not a DP-FNAS log.
    """
    from mpi_fnas.runlog import read_run

    run_dir = Path(run_dir)
    match = POINT_DIR.match(run_dir.name)
    if match is None:
        raise ValueError(f"{run_dir}: not a sweep point directory (var<variance>-seed<seed>)")
    variance, seed = float(match["variance"]), int(match["seed"])
    log = read_run(run_dir / LOG_NAME)
    privacy = log["privacy"]
    if privacy is None:
        raise ValueError(f"{run_dir}: the log holds no privacy record (not a DP-FNAS run)")
    rows = len(privacy["steps"])
    if rows == 0 and log["status"] == "finished":
        raise ValueError(f"{run_dir}: a finished log without a privacy row (not a DP-FNAS run of this tool)")
    cfg = config_from_text(log["config"], stored=True)
    sigma = float(np.max(privacy["noise_multiplier_w"]))
    if cfg.seed != seed or not math.isclose(sigma, noise_multiplier(variance), rel_tol=1e-9):
        raise ValueError(f"{run_dir}: the log's seed {cfg.seed} / σ {sigma:.6g} do not match the directory name")
    releases = [log_releases(log, f"{run_dir.name}/{LOG_NAME}")]
    for old in sorted(run_dir.glob(ABANDONED_LOG_GLOB)):
        releases.append(log_releases(read_run(old), f"{run_dir.name}/{old.name}"))
    test = log["metrics"]["test_acc"]
    evaluated = test[np.isfinite(test)]
    epsilon = np.asarray(privacy["epsilon"][-1], dtype=float) if rows else np.full(1, np.nan)
    return PointResult(
        variance=variance, seed=seed, sigma=sigma,
        test_acc=float(evaluated[-1]) if evaluated.size else float("nan"),
        epsilon_worst=float(epsilon.max()), epsilon_best=float(epsilon.min()),
        delta=float(np.max(privacy["delta"])),
        mu_gdp_worst=float(np.max(privacy["mu_gdp"][-1])) if rows else float("nan"),
        steps=int(log["metrics"]["step"][-1]) if len(log["metrics"]["step"]) else 0,
        status=log["status"], stop_reason=log["reason"], wall_seconds=float(log["cost"]["wall_seconds"]),
        run_dir=run_dir, releases=tuple(releases),
    )
