"""Noise sweep (the paper's Table 2 in small): every (noise variance, seed) point of a DP-FNAS run, in one MPI job.

    mpirun -n K+1 python -m mpi_fnas.sweep --config configs/dpfnas_noise_sweep.yaml [--set key=value ...] [--out DIR]
    python -m mpi_fnas.sweep --summarize DIR        # table an existing sweep (e.g. slurm/noise_sweep.sh's output)

The config is a normal run config plus an optional top-level ``sweep:`` section, which this tool strips before
the run config is validated (so ``mpi_fnas.run`` does not accept the file as it is; the rest of it is an ordinary
run config)::

    sweep:
      variances: [0.5, 1, 2, 5, 8, 10]   # the paper's "variance of noise" σ²; each point sets σ_W = σ_A = √σ²
      seeds: [0, 1, 2]

``--set sweep.variances=[1,10]`` / ``--set sweep.seeds=[0]`` override it like any other key. Without the section
the sweep is the paper's six variances with seed 0 (the defaults of ``slurm/noise_sweep.sh``, which runs the same
points as an array job with the same σ and the same directory names).

Every rank loops over the same points in the same order on one :class:`~mpi_fnas.federation.comm.Channel`;
point (v, s) writes ``DIR/var<v>-seed<s>/search.h5`` (DIR default ``runs/<name>-sweep-<timestamp>``). After every
point rank 0 rewrites ``DIR/points.csv`` (one row per run) and ``DIR/summary.csv`` (one row per variance: test
error mean ± std over seeds, worst party's ε), so a crash keeps the finished points' results, and at the end it
prints the table. The error is the supernet's on the server's test split: under DP the parties' validation
accuracy is not released (it would be an unaccounted release), so it stands in for the paper's validation error.

Privacy over the whole sweep. The ε of one point (``epsilon_worst``) is what that run alone spent. But the points
of one seed reuse the same examples on the same parties (the data, its train/validation split and its partition
depend only on the data config, the seed and K, never on σ), so a party's examples were released in every
point of its seed, and what it really spent is the composition of all of them. ``epsilon_sweep_composed`` (in
points.csv, summary.csv and the table's "ε sweep" column) is that composition, computed with the PLD accountant
(:class:`mpi_fnas.privacy.PrivacyLedger`, which mixes different σ and q exactly) from each log's /privacy facts:

* which points share examples (:func:`data_identity`): synthetic-shapes renders image i as a pure function of
  (seed, split, i), so different seeds draw different examples and each seed is its own pool; CIFAR-10 has the
  same images for every seed (only re-partitioned), so all its points form one pool.
* one placement in a pool (synthetic-shapes, or CIFAR-10 with one seed): party k held the same train and the
  same validation shard in every point; its ε is the larger of its composed train and composed validation
  ledgers (disjoint shards), at its δ; the column holds the worst party.
* several placements (CIFAR-10 over several seeds): an image may have been in any party's train or validation
  shard in each seed, so the bound is the worst case, per point the smallest σ, largest rate and largest count
  of any party and shard (dominating every placement), at the smallest δ.
* releases per shard come from ``/privacy/charged_steps`` when the log has it, else ``/privacy/steps``; a
  requeued run without charged_steps and an unfinished run (failed, still running, or an abandoned
  ``search-attempt<n>.h5`` in the point's directory) are charged an upper bound (``exact_sweep_composed`` False).

It covers the points in DIR only: runs outside it on the same data (another sweep, a plain ``mpi_fnas.run``)
compose on top.

Exit codes as ``mpi_fnas.run``: 0 finished · 1 failure (job aborted, that point's log ``failed``) · 2 bad input
(one line from rank 0) · 75 interrupted by SIGTERM/SIGUSR1/SIGINT (the current point checkpointed; resume it with
``mpi_fnas.run --resume DIR/var<v>-seed<s>``, run the points not yet done with ``--set sweep.…`` into the same
``--out`` — a point that already has a log is refused, never overwritten — then ``--summarize DIR``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from mpi_fnas import __version__, cli
from mpi_fnas.config import Config, ConfigError, check_world, config_from_text, parse_override, validate

SWEEP_KEY = "sweep"
PAPER_VARIANCES = (0.5, 1.0, 2.0, 5.0, 8.0, 10.0)  # Table 2
DEFAULT_SEEDS = (0,)
NOISE_KEYS = ("noise_multiplier_w", "noise_multiplier_a")  # both releases get the same σ (as slurm/noise_sweep.sh)
SUMMARY_CSV = "summary.csv"
POINTS_CSV = "points.csv"
_POINT_DIR = re.compile(r"^var(?P<variance>[^/]+)-seed(?P<seed>\d+)$")

_EPILOG = """\
the sweep config is a run config (see python -m mpi_fnas.run --help for its keys) plus an optional section
  sweep:
    variances: [0.5, 1, 2, 5, 8, 10]   # noise variance sigma^2 per point; sigma_W = sigma_A = sqrt(variance)
    seeds: [0, 1, 2]                   # every variance is run with every seed (default: [0])
  which --set sweep.variances=[1,10] / --set sweep.seeds=[0] override. mode must be dpfnas and
  privacy.target_epsilon unset (the sweep sets sigma itself).

output: DIR/var<variance>-seed<seed>/search.h5 per point (DIR: --out, default runs/<name>-sweep-<timestamp>),
  DIR/points.csv (one row per run) and DIR/summary.csv (one row per variance), rewritten after every point.
  --summarize DIR reads the logs of a finished sweep (or of slurm/noise_sweep.sh's array job) without MPI.
privacy: epsilon_worst is one run alone. epsilon_sweep_composed (table column "ε sweep") is what a party really
  spent over the sweep: every variance of a seed reuses the same examples on the same parties, so its epsilon
  composes (PLD) over all of them, at delta_sweep_composed; synthetic-shapes seeds draw different examples
  (one composition per seed), CIFAR-10 seeds only re-partition the same images (one composition over every
  point, worst case over which party held an image). Unfinished or requeued runs count at an upper bound.
exit codes: 0 finished, 1 failure (job aborted), 2 bad input, 75 interrupted (current point checkpointed).
"""


# -- the sweep's points --------------------------------------------------------------------------------------------
def noise_multiplier(variance: float) -> float:
    """σ = √variance, rounded to 12 significant digits exactly as ``slurm/noise_sweep.sh`` (awk "%.12g") does,
    so the array job and this sweep run bit-identical configs."""
    return float(f"{math.sqrt(variance):.12g}")


def variance_label(variance: float) -> str:
    """How a variance appears in directory names and tables: 0.5 → "0.5", 1.0 → "1", 10.0 → "10"."""
    return f"{variance:.12g}"


@dataclass(frozen=True)
class SweepPoint:
    """One run of the sweep."""

    variance: float
    seed: int

    @property
    def sigma(self) -> float:
        return noise_multiplier(self.variance)

    @property
    def dirname(self) -> str:
        return f"var{variance_label(self.variance)}-seed{self.seed}"


@dataclass(frozen=True)
class SweepSpec:
    """The ``sweep:`` section: every variance is run with every seed, variances in the outer loop."""

    variances: tuple[float, ...] = PAPER_VARIANCES
    seeds: tuple[int, ...] = DEFAULT_SEEDS

    def points(self) -> list[SweepPoint]:
        return [SweepPoint(v, s) for v in self.variances for s in self.seeds]

    def to_dict(self) -> dict[str, list]:
        return {"variances": list(self.variances), "seeds": list(self.seeds)}


def parse_sweep_section(section: Any) -> SweepSpec:
    """Validate the ``sweep:`` mapping (None → defaults). A bare number is taken as a one-element list."""
    if section is None:
        return SweepSpec()
    if not isinstance(section, dict):
        raise ConfigError(f"{SWEEP_KEY}: expected a mapping with keys variances, seeds; got {section!r}")
    unknown = [k for k in section if k not in ("variances", "seeds")]
    if unknown:
        raise ConfigError(f"{SWEEP_KEY}.{unknown[0]}: unknown key (valid keys here: variances, seeds)")
    variances = _number_list(section.get("variances", list(PAPER_VARIANCES)), "variances", integer=False)
    seeds = _number_list(section.get("seeds", list(DEFAULT_SEEDS)), "seeds", integer=True)
    return SweepSpec(tuple(float(v) for v in variances), tuple(int(s) for s in seeds))


def _number_list(value: Any, name: str, *, integer: bool) -> list:
    key = f"{SWEEP_KEY}.{name}"
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ConfigError(f"{key}: must list at least one value")
    for item in items:
        if integer:
            if not isinstance(item, int) or isinstance(item, bool) or item < 0:
                raise ConfigError(f"{key}: {item!r} is not an integer >= 0")
        elif isinstance(item, bool) or not isinstance(item, (int, float)) or not (math.isfinite(item) and item > 0):
            raise ConfigError(f"{key}: {item!r} is not a finite number > 0")
    # Two equal entries would write the same run directory twice (1 and 1.0 are the same variance).
    labels = [str(i) if integer else variance_label(float(i)) for i in items]
    for label in labels:
        if labels.count(label) > 1:
            raise ConfigError(f"{key}: {label} is listed twice")
    return items


def point_config(base: Config, point: SweepPoint) -> Config:
    """The run config of one point: `base` with its seed and σ_W = σ_A = √variance."""
    cfg = copy.deepcopy(base)
    cfg.seed = point.seed
    for key in NOISE_KEYS:
        setattr(cfg.privacy, key, point.sigma)
    return validate(cfg)


def load_sweep(path: str | Path | None, overrides: Sequence[str] = ()) -> tuple[Config, SweepSpec]:
    """Defaults ← YAML file (its ``sweep:`` section stripped) ← ``--set`` overrides; ``sweep.*`` overrides go to
    the sweep section. Raises ConfigError (one line naming the key) on any problem, including a config whose
    points could not run as a noise sweep."""
    tree: dict[str, Any] = {}
    if path is not None:
        tree = _read_yaml_mapping(Path(path))
    section = tree.pop(SWEEP_KEY, None)
    run_overrides = []
    for item in overrides:
        key, value = parse_override(item)
        if key == SWEEP_KEY or key.startswith(SWEEP_KEY + "."):
            parts = key.split(".")[1:]
            if len(parts) != 1:
                raise ConfigError(f"--set {key}: expected sweep.variances=[...] or sweep.seeds=[...]")
            if section is None:
                section = {}
            if not isinstance(section, dict):
                raise ConfigError(f"{SWEEP_KEY}: expected a mapping with keys variances, seeds; got {section!r}")
            section = {**section, parts[0]: value}
        else:
            run_overrides.append(item)
    spec = parse_sweep_section(section)
    base = config_from_text(yaml.safe_dump(tree, sort_keys=False), run_overrides, where=str(path or ""))
    if base.mode != "dpfnas":
        raise ConfigError(f"mode: a noise sweep needs mode dpfnas (got {base.mode}); the noise multipliers would "
                          "be ignored")
    if base.privacy.target_epsilon is not None:
        raise ConfigError("privacy.target_epsilon: the sweep sets the noise multipliers itself; drop target_epsilon "
                          "(privacy.max_epsilon may stay)")
    for point in spec.points():  # all points must be valid before the first one runs
        point_config(base, point)
    return base, spec


def _read_yaml_mapping(path: Path) -> dict[str, Any]:
    # The same messages as mpi_fnas.config.load_config, which cannot read the file itself (the sweep key).
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file: {path}") from None
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path}: {exc.strerror}") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"--config: {path} is not valid YAML{at}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config: {path} must contain a mapping at the top level")
    return loaded


def sweep_yaml(base: Config, spec: SweepSpec) -> str:
    """The resolved sweep config: the base run config with the sweep section appended (loadable by load_sweep)."""
    return base.to_yaml() + yaml.safe_dump({SWEEP_KEY: spec.to_dict()}, sort_keys=False, default_flow_style=None)


# -- results -------------------------------------------------------------------------------------------------------
#: Final statuses whose last /privacy row counts every release of the log (a signal checkpoints at the step it
#: logs); any other status (failed, running) may have released after its last row.
SETTLED_STATUSES = ("finished", "interrupted")
LOG_NAME = "search.h5"
#: Logs of attempts abandoned when a run preempted before its first checkpoint was started afresh in the same
#: directory (mpi_fnas.run renames the old log): their releases were made on the same shards and count too.
ABANDONED_LOG_GLOB = "search-attempt*.h5"


@dataclass(frozen=True)
class LogReleases:
    """The releases one run log records on its parties' data: the inputs of the sweep-wide composition.

    Tuples are per party (K,), party k at index k - 1. Every iteration releases two Poisson-subsampled Gaussian
    mechanisms per party: G_k on its train shard (rate q_tr = B/N_k^tr, noise multiplier σ_W) and H_k on its
    disjoint validation shard (q_val = B/N_k^val, σ_A); ``releases`` counts them per shard (train and validation
    alike).
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


def data_identity(cfg: Config, parties: int) -> tuple[str, str]:
    """Which examples a run drew on (its *pool*) and how it placed them on its parties (its *placement*).

    synthetic-shapes renders example i of a split as a pure function of (seed, split, i) (mpi_fnas.data.synthetic:
    every parameter comes from a generator seeded with the seed), so runs with different seeds draw independent
    images and share no example: the pool is the seed. CIFAR-10 holds the same images whatever the seed (the seed
    only re-partitions them), so all its runs form one pool, and so does any other dataset read from files.
    The placement (search train/validation split, then the partition among the K parties) is a function of the
    data config, the seed and K only (federation.search.plan_assignments); it is keyed on every data key,
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
    cfg = config_from_text(log["config"])

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
    match = _POINT_DIR.match(run_dir.name)
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
    cfg = config_from_text(log["config"])
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


# -- what a party really spent over the sweep ----------------------------------------------------------------------
@dataclass(frozen=True)
class SweepComposition:
    """The privacy of the examples of one data pool, composed over every log of the sweep that released them.

    ``per_party`` is set when every log gave party k the same shards (one placement): then party k's ε is the
    PLD composition of its train ledgers over the logs, and of its validation ledgers, the larger of the two (the
    shards are disjoint), at its own δ (the smallest over the logs). Otherwise (CIFAR-10 over several seeds: an
    image may have been in any party's train or validation shard in each placement) ``per_party`` is None and
    ``epsilon`` is the worst case over placements: per log one release sequence with the smallest σ, the largest
    rate and the largest count of any party and shard, at the smallest δ. A larger rate, a smaller σ and more
    releases each dominate (the subsampled Gaussian's privacy profile grows with q, shrinks with σ), and
    composition keeps dominance, so this bounds every placement and is exact when all shards had the same rate.
    """

    data_pool: str
    logs: tuple[str, ...]
    epsilon: float  # the worst party (or the worst-case placement): what the pool's most exposed example spent
    delta: float  # the δ `epsilon` holds at (the largest of the parties' δ when per party)
    per_party: tuple[float, ...] | None
    exact: bool  # False: some log's releases are an upper bound (see log_releases), so is `epsilon`

    @property
    def runs(self) -> int:
        """Number of sweep points (run directories) composed."""
        return len({name.split("/")[0] for name in self.logs})

    def describe(self) -> str:
        how = ("per party: same shards in every run" if self.per_party is not None
               else "worst case over placements: the seeds re-partition the same examples")
        bound = "" if self.exact else "; upper bound: unfinished runs or requeues counted at their plan"
        return (f"{self.data_pool}: {self.runs} run{'s' if self.runs != 1 else ''}, {how} → ε = {self.epsilon:.4g} "
                f"at δ = {self.delta:.3g}{bound}")


def compose_sweep(results: Sequence[PointResult]) -> list[SweepComposition]:
    """One composition per data pool over every log of `results` (finished or not: an unfinished run released
    data too), sorted by pool. Empty when any result lacks its release facts (built by hand, not read)."""
    if not results or any(not r.releases for r in results):
        return []
    pools: dict[str, list[LogReleases]] = {}
    for r in results:
        for released in r.releases:
            pools.setdefault(released.data_pool, []).append(released)
    return [compose_pool(pool, pools[pool]) for pool in sorted(pools)]


def compose_pool(pool: str, logs: Sequence[LogReleases]) -> SweepComposition:
    """Compose the releases of `logs` (all of data pool `pool`) with the PLD accountant; see SweepComposition."""
    from mpi_fnas.privacy import PrivacyLedger

    exact = all(r.exact for r in logs)
    names = tuple(r.log for r in logs)
    if len({r.placement for r in logs}) == 1:
        per_party = []
        deltas = []
        for k in range(len(logs[0].releases)):
            train, val = PrivacyLedger(), PrivacyLedger()
            for r in logs:
                train.step(noise_multiplier=r.noise_multiplier_w[k], sample_rate=r.sample_rate_train[k],
                           num_steps=r.releases[k])
                val.step(noise_multiplier=r.noise_multiplier_a[k], sample_rate=r.sample_rate_val[k],
                         num_steps=r.releases[k])
            delta = min(r.delta[k] for r in logs)  # a bound at the smallest δ holds at every larger one
            per_party.append(max(train.get_epsilon(delta), val.get_epsilon(delta)))
            deltas.append(delta)
        return SweepComposition(pool, names, max(per_party), max(deltas), tuple(per_party), exact)
    worst = PrivacyLedger()
    for r in logs:
        worst.step(noise_multiplier=min(*r.noise_multiplier_w, *r.noise_multiplier_a),
                   sample_rate=max(*r.sample_rate_train, *r.sample_rate_val), num_steps=max(r.releases))
    delta = min(min(r.delta) for r in logs)
    return SweepComposition(pool, names, worst.get_epsilon(delta), delta, None, exact)


def _worst_of(compositions: Sequence[SweepComposition]) -> SweepComposition | None:
    return max(compositions, key=lambda c: c.epsilon, default=None)


def _touched(result: PointResult, compositions: Sequence[SweepComposition]) -> list[SweepComposition]:
    pools = {released.data_pool for released in result.releases}
    return [c for c in compositions if c.data_pool in pools]


@dataclass(frozen=True)
class SummaryRow:
    """One line of the Table-2-like summary: one variance over its finished seeds."""

    variance: float
    sigma: float
    seeds: int
    test_error_mean_pct: float
    test_error_std_pct: float  # sample standard deviation over seeds (ddof 1); NaN with one seed
    epsilon_worst: float  # one run: max over seeds and parties (ε does not depend on the seed: same q, σ, T, δ)
    delta: float
    mu_gdp_worst: float
    steps: int
    # Over the sweep: the largest composed ε of the data pools this variance's runs released (NaN: unknown).
    epsilon_sweep_composed: float = float("nan")
    delta_sweep_composed: float = float("nan")
    composed: tuple[SweepComposition, ...] = ()  # the pools behind it, for the table's notes


def summarize(results: Sequence[PointResult]) -> list[SummaryRow]:
    """Group the finished runs by variance (ascending); the sweep ε composes every run, finished or not."""
    compositions = compose_sweep(results)
    finished = [r for r in results if r.finished]
    rows = []
    for variance in sorted({r.variance for r in finished}):
        group = [r for r in finished if r.variance == variance]
        errors = np.array([r.test_error_pct for r in group])
        touched = [c for c in compositions if any(c in _touched(r, compositions) for r in group)]
        worst = _worst_of(touched)
        rows.append(SummaryRow(
            variance=variance, sigma=group[0].sigma, seeds=len(group),
            test_error_mean_pct=float(errors.mean()),
            test_error_std_pct=float(errors.std(ddof=1)) if len(group) > 1 else float("nan"),
            epsilon_worst=max(r.epsilon_worst for r in group), delta=max(r.delta for r in group),
            mu_gdp_worst=max(r.mu_gdp_worst for r in group), steps=max(r.steps for r in group),
            epsilon_sweep_composed=worst.epsilon if worst else float("nan"),
            delta_sweep_composed=max(c.delta for c in touched) if touched else float("nan"),
            composed=tuple(touched),
        ))
    return rows


def format_table(rows: Sequence[SummaryRow], parties: int | None = None) -> str:
    """The summary as the paper prints Table 2, plus σ and the privacy cost of one run and of the whole sweep."""
    who = f"{parties} parties, " if parties is not None else ""
    lines = [
        f"== noise sweep ({who}test error of the supernet on the server's test split; ε: tight PLD bound, worst "
        "party) ==",
        f"{'variance':>9} {'σ':>7} {'seeds':>5} {'test error (%)':>17} {'ε one run':>10} {'δ':>9} {'steps':>6} "
        f"{'ε sweep':>10}",
    ]
    for r in rows:
        spread = f"± {r.test_error_std_pct:5.2f}" if math.isfinite(r.test_error_std_pct) else "(1 seed)"
        lines.append(f"{variance_label(r.variance):>9} {r.sigma:>7.4g} {r.seeds:>5} "
                     f"{r.test_error_mean_pct:>7.2f} {spread:>9} {r.epsilon_worst:>10.4g} {r.delta:>9.3g} "
                     f"{r.steps:>6} {r.epsilon_sweep_composed:>10.4g}")
    pools: dict[str, SweepComposition] = {}
    for r in rows:
        pools.update({c.data_pool: c for c in r.composed})
    lines += ["ε one run: that run alone. ε sweep: what a party really spent, its ε composed (PLD) over every run",
              "of the sweep that released its examples (every variance of a seed reuses the same shards):"]
    lines += [f"  {pools[name].describe()}" for name in sorted(pools)] or ["  (unknown: no release facts)"]
    return "\n".join(lines)


def write_results(out_dir: str | Path, results: Sequence[PointResult]) -> tuple[Path, Path]:
    """Write ``points.csv`` (one row per run) and ``summary.csv`` (one row per variance); return their paths.

    ``epsilon_sweep_composed`` (and its ``delta_sweep_composed``, ``runs_sweep_composed``, ``pool_sweep_composed``)
    is what a party really spent: ε composed over every run of the sweep that released the same examples (see
    compose_sweep); per point for its data pool, per variance the largest over the pools its runs released.
    """
    out_dir = Path(out_dir)
    points_path, summary_path = out_dir / POINTS_CSV, out_dir / SUMMARY_CSV
    compositions = compose_sweep(results)
    point_rows = [{
        "variance": variance_label(r.variance), "sigma": r.sigma, "seed": r.seed, "test_acc": r.test_acc,
        "test_error_pct": r.test_error_pct, "epsilon_worst": r.epsilon_worst, "epsilon_best": r.epsilon_best,
        "delta": r.delta, "mu_gdp_worst": r.mu_gdp_worst, "steps": r.steps, "status": r.status,
        "stop_reason": r.stop_reason, "wall_seconds": r.wall_seconds, "run_dir": r.run_dir.name,
        **_composed_columns(_touched(r, compositions)),
    } for r in sorted(results, key=lambda r: (r.variance, r.seed))]
    summary_rows = [{
        "variance": variance_label(r.variance), "sigma": r.sigma, "seeds": r.seeds,
        "test_error_mean_pct": r.test_error_mean_pct, "test_error_std_pct": r.test_error_std_pct,
        "epsilon_worst": r.epsilon_worst, "delta": r.delta, "mu_gdp_worst": r.mu_gdp_worst, "steps": r.steps,
        **_composed_columns(r.composed),
    } for r in summarize(results)]
    _write_csv(points_path, point_rows)
    _write_csv(summary_path, summary_rows)
    return points_path, summary_path


def _composed_columns(compositions: Sequence[SweepComposition]) -> dict[str, Any]:
    # (max ε, max δ) over pools is a valid pair for each of them: a bound at a smaller δ holds at a larger one.
    worst = _worst_of(compositions)
    return {
        "epsilon_sweep_composed": worst.epsilon if worst else float("nan"),
        "delta_sweep_composed": max(c.delta for c in compositions) if compositions else float("nan"),
        "runs_sweep_composed": worst.runs if worst else 0,
        "pool_sweep_composed": worst.data_pool if worst else "",
        "exact_sweep_composed": all(c.exact for c in compositions) if compositions else False,
    }


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:  # whole file then rename: a reader never sees half a table
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def summarize_dir(out_dir: str | Path) -> list[PointResult]:
    """Every point under `out_dir` (``var*-seed*/search.h5``), finished or not: an unfinished run is left out of
    the error table but its releases count in the sweep ε. Raises ConfigError if none finished."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise ConfigError(f"--summarize: no such directory: {out_dir}")
    results = []
    for child in sorted(out_dir.iterdir()):
        if _POINT_DIR.match(child.name) and (child / LOG_NAME).exists():
            try:
                results.append(read_point(child))
            except (ValueError, OSError, KeyError) as exc:
                raise ConfigError(f"--summarize: {exc}") from None
    for r in results:
        if not r.finished:
            print(f"mpi_fnas.sweep: {r.run_dir.name}: status {r.status}: not in the error table; its releases "
                  "still count in the sweep ε", file=sys.stderr)
    if not any(r.finished for r in results):
        raise ConfigError(f"--summarize: {out_dir} holds no finished var<v>-seed<s>/search.h5")
    return results


# -- command line --------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpi_fnas.sweep",
        description="DP-FNAS noise sweep (paper Table 2): one run per (noise variance, seed), all inside one MPI "
        "job. Rank 0 is the parameter server; ranks 1..K are the parties.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_config_arguments(parser)  # --config takes an optional sweep: section; --set sweep.seeds=[0,1,2] works
    parser.add_argument("--out", metavar="DIR", help="sweep directory (default runs/<name>-sweep-<timestamp>)")
    parser.add_argument("--summarize", metavar="DIR", help="print and write the table of an existing sweep "
                        "directory, then exit (no MPI)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved sweep config and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.summarize:
        return _summarize_command(args)
    # Parse the config before touching MPI or torch: bad input should be cheap and identical on every rank.
    try:
        base, spec = load_sweep(args.config, args.overrides)
        config_error = None
    except ConfigError as exc:
        base, spec, config_error = None, None, exc
    if args.print_config and config_error is None and cli.launcher_rank() in (None, 0):
        print(sweep_yaml(base, spec), end="")
        return cli.EXIT_OK

    from mpi_fnas.federation.comm import Channel

    channel = Channel(cli.start_mpi(base))
    stop = cli.StopRequest.install()
    state: dict = {}

    def setup() -> int:
        if config_error is not None:
            raise config_error
        if channel.size < 2:
            raise ConfigError("mpi_fnas.sweep needs at least 2 MPI ranks (1 server + K parties); launch it as: "
                              "mpirun -n 5 python -m mpi_fnas.sweep --config configs/dpfnas_noise_sweep.yaml")
        text, path = cli.decide_on_root(channel, lambda: (sweep_yaml(base, spec), str(_decide_dir(base, spec,
                                                                                                   args.out))))
        tree = yaml.safe_load(text)
        state["spec"] = parse_sweep_section(tree.pop(SWEEP_KEY))
        state["base"] = config_from_text(yaml.safe_dump(tree, sort_keys=False))
        state["out"] = Path(path)
        check_world(state["base"], channel.size)
        return cli.EXIT_OK

    code = cli.run_guarded(channel, setup, debug=args.debug)
    if code != cli.EXIT_OK:
        return code
    channel.timeout = state["base"].runtime.comm_timeout
    code = _run_sweep(state["base"], state["spec"], channel, state["out"], args, stop)
    stop.disarm()
    return code


def _summarize_command(args: argparse.Namespace) -> int:
    try:
        if args.config or args.overrides or args.out:
            raise ConfigError("--summarize takes only the sweep directory")
        results = summarize_dir(args.summarize)
    except ConfigError as exc:
        return cli.report_bad_input(0, exc, args.debug)
    _, summary_path = write_results(args.summarize, results)
    print(format_table(summarize(results)) + f"\nsummary         {summary_path}", flush=True)
    return cli.EXIT_OK


def _decide_dir(base: Config, spec: SweepSpec, out: str | None) -> Path:
    path = Path(out) if out else Path("runs") / f"{base.name}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    for point in spec.points():  # refuse before anything runs: nothing is ever overwritten
        if (path / point.dirname / "search.h5").exists():
            raise ConfigError(f"--out: {path / point.dirname} already holds a run log (search.h5); choose another "
                              "directory (nothing was overwritten)")
    cli.make_dir(path)
    try:
        (path / "sweep.yaml").write_text(sweep_yaml(base, spec))  # what ran, loadable by --config
    except OSError as exc:
        raise ConfigError(f"--out: cannot write {path / 'sweep.yaml'}: {exc.strerror}") from None
    return path


def _run_sweep(base: Config, spec: SweepSpec, channel, out_dir: Path, args: argparse.Namespace,
               stop: cli.StopRequest) -> int:
    from mpi_fnas.federation.party_store import party_dir
    from mpi_fnas.federation.search import run_search
    from mpi_fnas.progress import Progress

    threads = cli.limit_torch_threads(base)
    rank = channel.rank
    points = spec.points()
    if rank == 0:
        print(f"mpi_fnas {__version__}: noise sweep: {len(spec.variances)} variances x {len(spec.seeds)} seeds = "
              f"{len(points)} runs, parties={channel.parties} ranks={channel.size} "
              f"threads/rank={threads} out={out_dir}", flush=True)
        if args.verbose:
            print("# resolved sweep config\n" + sweep_yaml(base, spec), end="", flush=True)
    results: list[PointResult] = []
    for index, point in enumerate(points, start=1):
        cfg = point_config(base, point)
        run_dir = out_dir / point.dirname
        if rank == 0:
            print(f"[{index}/{len(points)}] variance {variance_label(point.variance)} (σ = {point.sigma:.6g}) "
                  f"seed {point.seed} → {run_dir / 'search.h5'}", flush=True)

        def one_point(cfg: Config = cfg, run_dir: Path = run_dir, tag: str = f"[{index}/{len(points)}]") -> int:
            if rank == 0:
                run_dir.mkdir(parents=True, exist_ok=True)
            outcome = run_search(cfg, channel, run_dir, resume=None, stop_requested=stop,
                                 progress=Progress(cfg.runtime.progress) if rank == 0 else None)
            if rank != 0:
                return cli.EXIT_INTERRUPTED if outcome else cli.EXIT_OK
            if outcome.interrupted:
                if results:
                    write_results(out_dir, results)
                print(f"\nmpi_fnas: {outcome.stop_reason} in {run_dir.name}; resume that run with "
                      f"mpi_fnas.run --resume {run_dir}; points after it did not run", file=sys.stderr, flush=True)
                return cli.EXIT_INTERRUPTED
            # Inside the guard: the parties already wait in the next point's setup, so a failure here must abort.
            results.append(_record(out_dir, run_dir, results, tag))
            return cli.EXIT_OK

        # The same failure policy as mpi_fnas.run: bad input ends every rank with 2, anything else aborts the job.
        code = cli.run_guarded(channel, one_point, debug=args.debug,
                               private=cfg.mode == "dpfnas" and rank != 0, party_dir=party_dir(run_dir, rank))
        if code != cli.EXIT_OK:
            return code
    if rank == 0:
        print("\n" + format_table(summarize(results), channel.parties), flush=True)
        print(f"summary         {out_dir / SUMMARY_CSV} (per run: {out_dir / POINTS_CSV})", flush=True)
    return cli.EXIT_OK


def _record(out_dir: Path, run_dir: Path, earlier: list[PointResult], tag: str) -> PointResult:
    """Rank 0: read a finished point back from its log, rewrite the CSVs, print one line."""
    result = read_point(run_dir)
    write_results(out_dir, [*earlier, result])  # after every point, so a later failure keeps what finished
    print(f"{tag} variance {variance_label(result.variance)} seed {result.seed}: test error "
          f"{result.test_error_pct:.2f}%  ε = {result.epsilon_worst:.4g} (worst party)  {result.steps} steps  "
          f"{result.wall_seconds:.1f} s", flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
