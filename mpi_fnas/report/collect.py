"""Finding run logs under the paths given and reading each into a :class:`RunRecord` (plain values, no HDF5).

Every number a table shows is decided here, per run, from the log as :func:`mpi_fnas.runlog.read_run` returns
it; docs/report.md lists which HDF5 path each one comes from.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from mpi_fnas.config import CELL_NETWORK, ConfigError, searches_first
from mpi_fnas.runlog import DEFAULT_STALE_SECONDS, read_run
from mpi_fnas.runlog.liveness import WriterRecord, writer_gone_reason
from mpi_fnas.sweep import LOG_NAME

#: Table order of the modes (the paper's Table 1: vanilla NAS, FNAS, DP-FNAS).
MODE_ORDER = ("vanilla", "fnas", "dpfnas")
STAGE_AUGMENT = "augment"  # the test error is the augmented network's (/augment test_error)
STAGE_SUPERNET = "supernet"  # the test error is the supernet's after the search (/metrics/test_acc)
FINISHED = "finished"
#: What a run trained without searching it (its label in the report): a given ``augment.genotype``; a hand-designed
#: network is named by its ``augment.network``.
GIVEN_CELL = "augmentation of a given cell"
#: Status of a run whose search finished and whose config asked for an augmentation that the log does not hold
#: (the job is between its stages, or ended there).
AUGMENT_PENDING = "augment pending"


@dataclass(frozen=True)
class RunRecord:
    """One run (one ``search.h5``), reduced to what the report shows.

    Fractions are in [0, 1]; costs are the search's own (``/cost``, summed over attempts, augmentation excluded).
    ``status`` is ``finished`` only when every stage the run has (or was configured to have) finished; otherwise
    the unfinished stage's status (``running``, ``failed``, ``interrupted``; prefixed ``augment`` for the
    augmentation, or ``augment pending``). Only finished runs enter the tables.
    """

    path: Path  # the search.h5
    label: str  # the run directory, relative to the input path it was found under
    slug: str  # `label` made safe (and unique) as a file name prefix of the run's figures
    mode: str
    parties: int
    seed: int | None
    searched: bool  # the job searched (False: augment.genotype or a hand-designed augment.network, no search)
    noise_variance: float | None  # σ_W² of the search (/privacy/noise_multiplier_w, max over parties); None: no DP
    # or no search
    augment_private: bool | None  # /augment private (DP releases in the augmentation); None: no /augment
    augment_noise_variance: float | None  # σ_aug² (/augment/privacy/noise_multiplier); None: not private, none
    status: str
    reason: str  # why the unfinished stage stopped, or the search's reason when finished
    stage: str  # STAGE_AUGMENT when the augmentation finished, else STAGE_SUPERNET
    test_error: float  # of `stage`: /augment test_error, else 1 − the last finite /metrics/test_acc; NaN: none
    supernet_test_error: float
    augment_test_error: float | None
    params: int | None  # /augment params (the trained network, no auxiliary head); None without augmentation
    search_wall_seconds: float
    search_gpu_hours: float
    search_cpu_core_hours: float
    attempts: int  # of the search (root ``attempts``: 1 + resumes)
    augment_attempts: int | None
    epsilon_worst: float  # max over parties of the ε that covers the released model (see epsilon_covers); NaN: no DP
    epsilon_best: float
    epsilon_covers: str  # "search + augment", "search", "augment" (no search) or "" (no DP ledger row)
    colluders: int  # privacy.colluders of that ε (secure aggregation: against the server and any t parties)
    # max over parties of the augmentation's ε alone, its search not charged (/augment/privacy epsilon_alone: what
    # DPNAS reports); NaN without a private augmentation, or in a log from before it was written
    epsilon_augment_alone: float
    privacy_guarantee: str  # of the released model: /augment's attribute when augmented, else the root's
    genotype: str  # the cell the run found (final, else the last epoch's), or the augmented one
    network: str  # what the augmentation trained (/augment network): cell, or a hand-designed network; cell when
    # not augmented
    log: dict[str, Any] = field(repr=False, compare=False)  # the whole read_run dict, for the figures

    @property
    def handcrafted(self) -> bool:
        """Whether the run trained a hand-designed network (no cell)."""
        return self.network != CELL_NETWORK

    @property
    def searched_cell(self) -> bool:
        """Whether the run is a search (with or without the augmentation of the cell it found): what Tables 1 and 2
        average. A given cell's or a hand-designed network's run is reported beside them (:attr:`trained`)."""
        return self.searched and not self.handcrafted

    @property
    def trained(self) -> str:
        """What the run trained, as the report labels it: ``searched cell``, :data:`GIVEN_CELL`, or the
        hand-designed network's name."""
        if self.handcrafted:
            return self.network
        return "searched cell" if self.searched else GIVEN_CELL

    @property
    def final(self) -> bool:
        """Whether the run counts in the tables."""
        return self.status == FINISHED

    @property
    def augmented(self) -> bool:
        return self.stage == STAGE_AUGMENT


def find_logs(paths: Sequence[str | Path]) -> list[tuple[Path, Path]]:
    """Every ``search.h5`` at or under `paths` (files named search.h5, run directories, roots searched
    recursively), as (log, the input path it was found under), in path order, each log once.

    Raises ConfigError for a path that does not exist, a file not named search.h5, or a directory without one.
    """
    found: dict[Path, tuple[Path, Path]] = {}
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise ConfigError(f"{path}: no such file or directory")
        if path.is_file():
            if path.name != LOG_NAME:
                raise ConfigError(f"{path}: not a run log (expected a run directory or its {LOG_NAME})")
            logs = [path]
            base = path.parent
        else:
            logs = sorted(p for p in path.rglob(LOG_NAME) if p.is_file())
            base = path
            if not logs:
                raise ConfigError(f"{path}: no run found (no {LOG_NAME} in it or below it)")
        for log in logs:
            found.setdefault(log.resolve(), (log, base))
    return sorted(found.values(), key=lambda pair: str(pair[0]))


def read_record(path: Path, base: Path, *, slug: str | None = None) -> RunRecord:
    """Read one log into a RunRecord; `base` names it (label = its run directory relative to `base`).

    Raises ConfigError when the file is not a readable run log (not HDF5, truncated, not written by mpi_fnas).
    """
    try:
        log = read_run(path)
    except Exception as exc:  # h5py raises OSError, RuntimeError, KeyError ... for damaged or foreign files
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path}: not a readable run log ({text})") from None
    label = _label(path.parent, base)
    return record_from_log(log, path, label, slug or slugify(label))


def record_from_log(log: dict[str, Any], path: Path, label: str, slug: str) -> RunRecord:
    """The RunRecord of a :func:`mpi_fnas.runlog.read_run` dict (no file access)."""
    config = parse_config(log["config"])
    augment = log["augment"]
    status, reason = run_status(log, config)
    supernet_error = supernet_test_error(log)
    augmented = augment is not None and augment["status"] == FINISHED
    searched = job_searched(config)
    epsilon, covers = released_epsilon(log, searched=searched)
    cost = log["cost"]
    genotype = log["final_genotype"] or (log["genotypes"][-1] if log["genotypes"] else "")
    if augment is not None and augment["genotype"]:
        genotype = augment["genotype"]
    return RunRecord(
        path=path, label=label, slug=slug, mode=log["mode"], parties=int(log["parties"]),
        seed=_int_or_none(config.get("seed")), searched=searched,
        noise_variance=noise_variance(log) if searched else None,
        augment_private=bool(augment["private"]) if augment is not None else None,
        augment_noise_variance=augment_noise_variance(log),
        status=status, reason=reason,
        stage=STAGE_AUGMENT if augmented else STAGE_SUPERNET,
        test_error=float(augment["test_error"]) if augmented else supernet_error,
        supernet_test_error=supernet_error,
        augment_test_error=float(augment["test_error"]) if augment is not None else None,
        params=int(augment["params"]) if augment is not None else None,
        search_wall_seconds=float(cost["wall_seconds"]), search_gpu_hours=float(cost["gpu_hours"]),
        search_cpu_core_hours=float(cost["cpu_core_hours"]), attempts=int(log["attempts"]),
        augment_attempts=int(augment["attempts"]) if augment is not None else None,
        epsilon_worst=float(np.max(epsilon)) if epsilon.size else math.nan,
        epsilon_best=float(np.min(epsilon)) if epsilon.size else math.nan,
        epsilon_covers=covers, colluders=released_colluders(log), epsilon_augment_alone=augment_alone_epsilon(log),
        privacy_guarantee=str(augment["privacy_guarantee"] if augment is not None else log["privacy_guarantee"]),
        genotype=genotype, network=str(augment["network"]) if augment is not None else CELL_NETWORK, log=log,
    )


def collect_runs(paths: Sequence[str | Path]) -> list[RunRecord]:
    """Find and read every run under `paths` (see find_logs, read_record); figure prefixes are made unique. In table
    order: mode (as MODE_ORDER), K, noise variance σ_W², augmentation noise variance σ_aug², seed, then name."""
    records = []
    used: set[str] = set()
    for log, base in find_logs(paths):
        slug = slugify(_label(log.parent, base))
        unique, n = slug, 2
        while unique in used:  # two inputs may hold run directories of the same name
            unique, n = f"{slug}-{n}", n + 1
        used.add(unique)
        records.append(read_record(log, base, slug=unique))
    return sorted(records, key=_table_order)


# -- the numbers of one run ------------------------------------------------------------------------------------------
def parse_config(text: str) -> dict[str, Any]:
    """The run's resolved config as a plain mapping. Read as YAML, not validated against today's schema, so a log
    written by an older version (a key since renamed) still reports; {} when it is not a mapping."""
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}
    return tree if isinstance(tree, dict) else {}


def config_value(config: dict[str, Any], dotted: str, default: Any = None) -> Any:
    """``config["a"]["b"]`` for ``"a.b"``, or `default` where a level is missing."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def secure_aggregation(config: dict[str, Any]) -> bool:
    """Whether a run's releases were secure aggregation's words (DP-FNAS under ``privacy.aggregation: secure``)."""
    return config_value(config, "mode") == "dpfnas" and config_value(config, "privacy.aggregation") == "secure"


def run_status(log: dict[str, Any], config: dict[str, Any], *, now: float | None = None,
               stale_after: float = DEFAULT_STALE_SECONDS) -> tuple[str, str]:
    """(status, reason) of the whole run: the search's unless it finished, then the augmentation's.

    A finished search whose config asks for an augmentation the log does not hold is ``augment pending`` while
    the job's writer lives (it is between its stages), and ``failed`` once it is gone (the job died there): the
    live view (``--follow``) applies the same rule.
    """
    if log["status"] != FINISHED:
        return log["status"], log["reason"]
    augment = log["augment"]
    if augment is None:
        epochs = config_value(config, "augment.epochs", 0)
        if isinstance(epochs, int) and epochs > 0:
            gone = writer_gone_reason(WriterRecord(**log["writer"]), now=time.time() if now is None else now,
                                      stale_after=stale_after)
            if gone is not None:
                return "failed", f"the search finished but its augmentation never started: {gone}"
            return AUGMENT_PENDING, "the config asks for an augmentation (augment.epochs > 0); the log holds none"
        return FINISHED, log["reason"]
    if augment["status"] != FINISHED:
        return f"augment {augment['status']}", augment["reason"]
    return FINISHED, augment["reason"]


def supernet_test_error(log: dict[str, Any]) -> float:
    """1 − the last test accuracy of the supernet (/metrics/test_acc is finite only on epoch-end rows); NaN if the
    search never reached an epoch end."""
    acc = np.asarray(log["metrics"].get("test_acc", np.empty(0)), dtype=float)
    acc = acc[np.isfinite(acc)]
    return float(1.0 - acc[-1]) if acc.size else math.nan


def job_searched(config: dict[str, Any]) -> bool:
    """Whether the job of the run's config searched (:func:`~mpi_fnas.config.searches_first`, as mpi_fnas.run
    decides). The log's config is the job's first: after ``--augment RUN_DIR --set augment.network=...`` it is the
    search's."""
    return searches_first(config_value(config, "augment.genotype"),
                          config_value(config, "augment.network", CELL_NETWORK))


def released_colluders(log: dict[str, Any]) -> int:
    """The ``privacy.colluders`` t the released ε holds against (with the server): its privacy group's ``colluders``
    attribute (0 in logs written before it, under local noise and without DP)."""
    augment = log["augment"]
    for privacy in ((augment or {}).get("privacy"), log["privacy"]):
        if privacy is not None and len(privacy["epsilon"]):
            return int(privacy.get("colluders", 0))
    return 0


def augment_alone_epsilon(log: dict[str, Any]) -> float:
    """The worst party's ε of the augmentation's releases alone (``/augment/privacy`` attr ``epsilon_alone``); NaN
    where the log has none (no private augmentation, a failed one, or a log written before it)."""
    privacy = (log["augment"] or {}).get("privacy")
    alone = None if privacy is None else privacy.get("epsilon_alone")
    return float(np.max(alone)) if alone is not None and np.size(alone) else math.nan


def released_epsilon(log: dict[str, Any], *, searched: bool = True) -> tuple[np.ndarray, str]:
    """(ε per party, what it covers) of the model the run released.

    A private augmentation's ledger composes the search's releases with its own, so its last row is the ε of the
    augmented network ("search + augment"; "augment" when the job did not search: its ledgers held nothing
    before the augmentation). Otherwise the search's last row ("search"): a search-only run, or one
    whose augmentation was not private (augment.private false; the paper's protocol: ε is the search's and the
    final weights are not private, which ``privacy_guarantee`` says). Empty for a run without a DP ledger row.
    """
    augment = log["augment"]
    if augment is not None and augment["privacy"] is not None and len(augment["privacy"]["epsilon"]):
        return np.asarray(augment["privacy"]["epsilon"][-1], dtype=float), "search + augment" if searched else "augment"
    privacy = log["privacy"]
    if privacy is not None and len(privacy["epsilon"]):
        return np.asarray(privacy["epsilon"][-1], dtype=float), "search"
    return np.empty(0), ""


def noise_variance(log: dict[str, Any]) -> float | None:
    """The search's noise variance σ_W² (the paper's Table 2 "variance of noise"), from the σ the run actually used
    (/privacy/noise_multiplier_w: a calibrated σ differs from the config's), max over parties. Rounded to 10
    significant digits: the sweep's σ = √variance is itself rounded (mpi_fnas.sweep.noise_multiplier)."""
    privacy = log["privacy"]
    if privacy is None:
        return None
    return _variance(privacy["noise_multiplier_w"])


def augment_noise_variance(log: dict[str, Any]) -> float | None:
    """The augmentation's noise variance σ_aug² (what an ε–accuracy study such as scripts/augment_table.sh varies
    at one search σ), from /augment/privacy/noise_multiplier (scalar or per party: the max), rounded as
    noise_variance. None when the run has no augmentation or a non-private one (augment.private false)."""
    augment = log["augment"]
    if augment is None or augment["privacy"] is None:
        return None
    return _variance(augment["privacy"]["noise_multiplier"])


def _variance(sigma: Any) -> float:
    largest = float(np.max(np.asarray(sigma, dtype=float)))
    return float(f"{largest * largest:.10g}")


def slugify(label: str) -> str:
    """A file-name-safe prefix for a run's figures: path separators and other characters become ``_``."""
    slug = re.sub(r"[^A-Za-z0-9.=+-]+", "_", label).strip("._")
    return slug or "run"


def _table_order(run: RunRecord) -> tuple:
    mode = MODE_ORDER.index(run.mode) if run.mode in MODE_ORDER else len(MODE_ORDER)
    variance = -1.0 if run.noise_variance is None else run.noise_variance
    augment = -1.0 if run.augment_noise_variance is None else run.augment_noise_variance
    return mode, run.mode, run.parties, variance, augment, -1 if run.seed is None else run.seed, run.label


def _label(run_dir: Path, base: Path) -> str:
    try:
        relative = run_dir.relative_to(base)
    except ValueError:
        relative = Path(run_dir.name)
    return str(relative) if str(relative) != "." else (run_dir.resolve().name or str(run_dir))


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
