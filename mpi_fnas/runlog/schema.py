"""Names and layout of the HDF5 run log: what exists in the file, with which dtype and shape.

docs/hdf5.md documents every name below; tests/test_hdf5_doc.py checks that the document and a freshly created
file list exactly the same groups, datasets and attributes. Everything the search will ever write is created here
before the writer enters SWMR mode (SWMR cannot create objects or attributes later); the augment stage's
``/augment`` group is created the same way later, by ``build_augment`` while ``RunLog.begin_augment`` holds the
file outside SWMR mode.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

import h5py
import numpy as np

from mpi_fnas import __version__

#: The log's file name in a run directory.
LOG_NAME = "search.h5"
FINAL_STATUSES = ("finished", "failed", "interrupted")

# The search's metric columns, in the order they are listed in /metrics (one float64 dataset each).
SEARCH_METRICS = ("step", "epoch", "train_loss", "train_acc", "val_loss", "val_acc", "step_seconds", "comm_seconds",
                  "party_seconds", "w_lr", "adadp_err", "test_loss", "test_acc")

# Costs of successive attempts (requeues) add up; the layout fields describe the latest attempt.
COST_ADDITIVE = ("wall_seconds", "gpu_hours", "cpu_core_hours",
                 # rank 0's time in the iterations, split (stages.iteration.IterationClock)
                 "party_compute_seconds", "transfer_seconds", "server_seconds")
COST_LAYOUT = ("ranks", "gpus")
# The largest over attempts. Rank 0's own peak resident memory only: a DP party's peak depends on its realised Poisson
# batches (data-dependent), so no party reports it (federation.memory plans it instead). Logs written before it
# have none: read as NaN.
COST_PEAK = ("rss_peak_mb_server",)
# The latest attempt's, a float (NaN in logs written before it, and for an attempt that failed before its first step).
COST_LATEST = ("startup_seconds",)
COST_FIELDS = COST_ADDITIVE + COST_LAYOUT + COST_PEAK + COST_LATEST

EPOCH_DATASETS = ("alphas/normal", "alphas/reduce", "genotype")
# The ledger rows of every stage (/privacy, /augment/privacy), one row per StageLog.append_privacy. /augment/privacy
# of logs written before the stages shared one writer holds only steps and epsilon; logs written before secure
# aggregation have no epsilon_collusion (ε if K − 1 parties collude with the server; = epsilon under local noise).
PRIVACY_GROWING = ("steps", "charged_steps", "epsilon", "mu_gdp", "epsilon_collusion")
# What the log records of every DP release (mpi_fnas.privacy.release.Release), as the dataset <field><suffix> of its
# stage's privacy group (the suffix by release: StageLayout.releases).
RELEASE_FIELDS = ("noise_multiplier", "clip", "expected_batch_size")

# The server's selection (federation.selection random, secprobe or oracle): /selection, one row per step, and the ε
# its draws cost on the aux set in /privacy/selection_epsilon (same rows); the augmentation's in /augment/selection
# and /augment/privacy/selection_epsilon. The family's datasets, in RowCounts order:
SELECTION_GROUP = "selection"
SELECTION_GROWING = ("steps", "chosen", "score")
SELECTION_EPSILON = "selection_epsilon"  # in /privacy
SELECTION_ATTRS = ("selection", "select", "epsilon_per_step", "score_window", "aux_size", "sensitivity", "delta")

# Chunk lengths along the growing axis: big enough that a long run has few chunks, small enough that a
# flush per row rewrites little.
_METRIC_CHUNK_ROWS = 256
_EPOCH_CHUNK_ROWS = 16
_PRIVACY_CHUNK_ROWS = 64

# The augment stage (training the derived genotype from scratch) lives in this group of the search's file.
AUGMENT_GROUP = "augment"
# Its metric columns, in the order they are listed in /augment/metrics: step and epoch are int64 (an exact
# counter, unlike /metrics/step), the rest float64.
AUGMENT_METRICS = ("step", "epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr", "adadp_err")
AUGMENT_INT_METRICS = ("step", "epoch")


class LoggedRelease(Protocol):
    """What the log records of one kind of DP release (:class:`mpi_fnas.privacy.release.Release`): its
    ``RELEASE_FIELDS``."""

    noise_multiplier: float
    clip: float
    expected_batch_size: float
    aggregation: str  # "local" or "secure": the group's ``aggregation`` attr


@dataclass(frozen=True)
class StagePrivacy:
    """Fixed privacy facts of one DP stage, written once into its ``privacy`` group (``/privacy``,
    ``/augment/privacy``). K = number of parties.

    delta: (K,) target δ per party. releases: the stage's releases by name (``W``, and the search's ``A``); the log
    records each one's ``RELEASE_FIELDS`` as its own dataset (scalar or (K,)), named by the stage's layout.
    sample_rates: by release name, (K,) the Poisson rate B/N of the shard that release samples. accountant: the ε
    accountant's name (the search's ``/privacy`` attr; ``""`` elsewhere).
    """

    delta: Sequence[float] | np.ndarray
    releases: Mapping[str, LoggedRelease]
    sample_rates: Mapping[str, Sequence[float] | np.ndarray]
    accountant: str = ""


@dataclass(frozen=True)
class SelectionSchema:
    """Fixed facts of the server's selection, written once as ``/selection`` attrs (docs/secprobe.md).

    selection: ``random`` or ``secprobe``. select: K′. epsilon_per_step: ε_EM of one step's draw. score_window:
    steps a score averages. aux_size: n_aux. sensitivity: Δu of the score. delta: δ of ``selection_epsilon``.
    """

    selection: str
    select: int
    epsilon_per_step: float
    score_window: int
    aux_size: int
    sensitivity: float
    delta: float


@dataclass(frozen=True)
class StageLayout:
    """Where one stage's rows live in the file: its group (``""`` is the root) and its growing families, in the
    order a checkpoint records their row counts: ``metrics``, ``epochs`` (the search's alphas and genotype per
    epoch end), ``privacy`` (``PRIVACY_GROWING``) and ``selection`` (``SELECTION_GROWING``, then
    ``privacy/selection_epsilon``)."""

    name: str  # "search" or "augment"
    group: str
    metrics: tuple[str, ...]
    releases: Mapping[str, tuple[str, str]]  # release name -> (its datasets' suffix, its sample-rate dataset)
    int_metrics: tuple[str, ...] = ()  # exact counters stored as int64, required in every row
    epochs: bool = False
    delta_attr: bool = False  # δ (and the accountant) as attrs of the privacy group, not a δ dataset

    @property
    def families(self) -> tuple[str, ...]:
        return ("metrics", "epochs", "privacy", "selection") if self.epochs else ("metrics", "privacy", "selection")

    @property
    def privacy_fixed(self) -> tuple[str, ...]:
        """The privacy group's datasets written once: each release's sample rate and ``RELEASE_FIELDS`` (and δ)."""
        rates = tuple(rate for _, rate in self.releases.values())
        fields = tuple(field + suffix for field in RELEASE_FIELDS for suffix, _ in self.releases.values())
        return rates + fields + (() if self.delta_attr else ("delta",))


SEARCH_LAYOUT = StageLayout("search", "", SEARCH_METRICS, {"W": ("_w", "sample_rate_train"),
                                                           "A": ("_a", "sample_rate_val")},
                            epochs=True, delta_attr=True)
AUGMENT_LAYOUT = StageLayout("augment", AUGMENT_GROUP, AUGMENT_METRICS, {"W": ("", "sample_rate")},
                             AUGMENT_INT_METRICS)
STAGE_LAYOUTS = {layout.name: layout for layout in (SEARCH_LAYOUT, AUGMENT_LAYOUT)}


def stage_families(handle: h5py.File, layout: StageLayout) -> dict[str, list[h5py.Dataset]]:
    """The datasets of `layout`'s growing families, by family name in ``layout.families`` order.

    The datasets of one family always gain a row together. Every family is empty while the stage's group does not
    exist; the privacy family without ``privacy/``, the selection family without ``selection/``.
    """
    group = handle.get(layout.group or "/")
    if group is None:
        return {name: [] for name in layout.families}
    metrics, privacy, selection = group["metrics"], group.get("privacy"), group.get(SELECTION_GROUP)
    families = {"metrics": [metrics[name] for name in (layout.metrics if layout.group else metrics)]}
    if layout.epochs:
        families["epochs"] = [handle[name] for name in EPOCH_DATASETS]
    families["privacy"] = [] if privacy is None else [privacy[name] for name in PRIVACY_GROWING if name in privacy]
    families["selection"] = [] if selection is None else [
        *(selection[name] for name in SELECTION_GROWING), privacy[SELECTION_EPSILON]]
    return families


def common_length(datasets: Sequence[h5py.Dataset]) -> int:
    """Rows every dataset of a family has (a crash between the datasets of one append leaves one longer)."""
    return min((int(dataset.shape[0]) for dataset in datasets), default=0)


def build_skeleton(handle: h5py.File, *, mode: str, parties: int, config_text: str, privacy_guarantee: str,
                   metric_names: Sequence[str], alpha_shape: tuple[int, int], genotype_length: int,
                   privacy: Mapping[str, Any] | None, rank_values: Mapping[str, Any], unreliable: np.ndarray,
                   corruption: float, selection: SelectionSchema | None = None, space: str = "darts",
                   reduce_alpha_shape: tuple[int, int] | None = None, alpha_ops: Sequence[str] = ()) -> None:
    """Create the root attributes and every group/dataset except ``/writer`` (see ``liveness``), growing datasets
    with 0 rows (the arguments as ``RunLog.create`` takes them, checked). privacy: the search's
    :func:`privacy_arrays`, or None. selection: needs privacy (its ε rows live in ``/privacy``)."""
    handle.attrs.update({
        "status": "running", "mode": mode, "space": space, "parties": np.int64(parties), "config": config_text,
        "privacy_guarantee": privacy_guarantee, "version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "reason": "", "final_genotype": "",
        "attempts": np.int64(1), "unreliable": np.asarray(unreliable, dtype=bool), "corruption": np.float64(corruption),
    })
    _metrics_group(handle, metric_names)
    alphas = handle.create_group("alphas")
    if alpha_ops:
        if len(alpha_ops) != alpha_shape[1] or any("," in op for op in alpha_ops):
            raise ValueError(f"alpha_ops: expected {alpha_shape[1]} op names without commas, got {list(alpha_ops)}")
        alphas.attrs["ops"] = ",".join(alpha_ops)  # the columns' names: a restricted space's are not the kind's
    shapes = {"normal": alpha_shape, "reduce": alpha_shape if reduce_alpha_shape is None else reduce_alpha_shape}
    for cell, shape in shapes.items():
        _growing(alphas, cell, tuple(shape), np.float32, 1, math.nan)
    _growing(handle, "genotype", (), f"S{genotype_length}", _EPOCH_CHUNK_ROWS, None)
    _empty_cost(handle.create_group("cost"))
    handle.create_group("ranks").attrs.update(rank_values)
    _privacy_and_selection(handle, SEARCH_LAYOUT, privacy, selection, parties)


def _privacy_and_selection(parent: h5py.Group, layout: StageLayout, privacy: Mapping[str, Any] | None,
                           selection: SelectionSchema | None, parties: int) -> None:
    """A stage's ``parent/privacy`` when `privacy` is given, and its ``parent/selection`` (attrs
    ``SELECTION_ATTRS``, growing ``SELECTION_GROWING``) and ``parent/privacy/selection_epsilon`` when `selection` is
    (refused without privacy); `parent` is the root (search) or ``/augment``."""
    if privacy is not None:
        privacy_group(parent, layout, privacy, parties)
    if selection is None:
        return
    if privacy is None:
        where = parent.name.rstrip("/")
        what = "an augment selection" if where else "a selection"
        raise ValueError(f"{what} needs a privacy ledger ({where}/privacy/{SELECTION_EPSILON})")
    chosen = parent.create_group(SELECTION_GROUP, track_order=True)
    chosen.attrs.update({name: getattr(selection, name) for name in SELECTION_ATTRS})
    _growing(chosen, "steps", (), np.int64, _PRIVACY_CHUNK_ROWS, -1)
    _growing(chosen, "chosen", (parties,), np.bool_, _PRIVACY_CHUNK_ROWS, False)
    _growing(chosen, "score", (parties,), np.float64, _PRIVACY_CHUNK_ROWS, math.nan)
    _growing(parent["privacy"], SELECTION_EPSILON, (), np.float64, _PRIVACY_CHUNK_ROWS, math.nan)


def build_augment(handle: h5py.File, *, genotype: str, params: int, private: bool, parties: int,
                  privacy: Mapping[str, Any] | None, privacy_guarantee: str,
                  selection: SelectionSchema | None = None, network: str = "cell") -> None:
    """Create ``/augment`` (status ``running``, attempts 1) with empty growing datasets, and its ``privacy`` and
    ``selection`` as ``build_skeleton`` does the search's (privacy: the augmentation's :func:`privacy_arrays`).
    Only outside SWMR mode."""
    group = handle.create_group(AUGMENT_GROUP, track_order=True)
    group.attrs.update({
        "status": "running", "reason": "", "network": network, "genotype": genotype, "params": np.int64(params),
        # NaN until the stage finishes and reports it
        "test_acc": np.float64(math.nan), "test_error": np.float64(math.nan),
        "private": np.bool_(private), "privacy_guarantee": privacy_guarantee, "attempts": np.int64(1),
    })
    _metrics_group(group, AUGMENT_METRICS, AUGMENT_INT_METRICS)
    _empty_cost(group.create_group("cost"))
    _privacy_and_selection(group, AUGMENT_LAYOUT, privacy, selection, parties)


def privacy_arrays(layout: StageLayout, privacy: StagePrivacy, parties: int) -> dict[str, Any]:
    """What a stage's privacy group records of `privacy`: {dataset or attr name: value}, checked before anything
    is written (``layout.privacy_fixed``: rates (K,), ``RELEASE_FIELDS`` scalar or (K,); δ (K,); the accountant
    when δ is an attr). ValueError on a wrong shape."""
    values: dict[str, Any] = {"delta": per_party("delta", privacy.delta, parties)}
    for release, (_, rate) in layout.releases.items():
        values[rate] = per_party(rate, privacy.sample_rates[release], parties)
    for field in RELEASE_FIELDS:
        for release, (suffix, _) in layout.releases.items():
            value = np.asarray(getattr(privacy.releases[release], field), dtype=np.float64)
            if value.shape not in ((), (parties,)):
                raise ValueError(f"{field}{suffix} must be a scalar or have shape ({parties},), got {value.shape}")
            values[field + suffix] = value
    if layout.delta_attr:
        values["accountant"] = privacy.accountant
    aggregations = {release.aggregation for release in privacy.releases.values()}
    if len(aggregations) != 1:
        raise ValueError(f"a stage's releases must share one aggregation, got {sorted(aggregations)}")
    values["aggregation"] = aggregations.pop()
    secure = next(iter(privacy.releases.values())).secure
    values["colluders"] = secure.colluders if secure is not None else 0
    return values


def privacy_group(parent: h5py.Group, layout: StageLayout, values: Mapping[str, Any], parties: int) -> None:
    """``parent/privacy`` of a stage: its fixed datasets and δ (`values`, from :func:`privacy_arrays`; δ and the
    accountant are attrs of the search's group) and the growing ledger rows (``PRIVACY_GROWING``)."""
    group = parent.create_group("privacy", track_order=not layout.delta_attr)
    for name in layout.privacy_fixed:
        group.create_dataset(name, data=values[name])
    if layout.delta_attr:
        group.attrs["delta"] = values["delta"]
        group.attrs["accountant"] = values["accountant"]
    group.attrs["aggregation"] = values["aggregation"]
    group.attrs["colluders"] = values["colluders"]
    _growing(group, "steps", (), np.int64, _PRIVACY_CHUNK_ROWS, -1)
    _growing(group, "charged_steps", (parties,), np.int64, _PRIVACY_CHUNK_ROWS, -1)
    for name in ("epsilon", "mu_gdp", "epsilon_collusion"):
        _growing(group, name, (parties,), np.float64, _PRIVACY_CHUNK_ROWS, math.nan)


def _metrics_group(parent: h5py.Group, names: Sequence[str], int_names: Sequence[str] = ()) -> None:
    """``parent/metrics``: one growing dataset per name, int64 for ``int_names`` and float64 for the others."""
    # track_order keeps the caller's column order when the group is listed (default listing is alphabetical).
    metrics = parent.create_group("metrics", track_order=True)
    for name in names:
        # fill value NaN (-1 for int64 counters): a row caught half-written reads as such, not as a plausible 0
        exact = name in int_names
        _growing(metrics, name, (), np.int64 if exact else np.float64, _METRIC_CHUNK_ROWS, -1 if exact else math.nan)


def _empty_cost(group: h5py.Group) -> None:
    """The ``COST_FIELDS`` attrs of a cost group before any attempt has reported: NaN (additive: none reported
    yet) and 0 (layout)."""
    group.attrs.update({name: np.float64(math.nan) for name in COST_ADDITIVE + COST_PEAK + COST_LATEST})
    group.attrs.update({name: np.int64(0) for name in COST_LAYOUT})


def _growing(parent: h5py.Group, name: str, row_shape: tuple[int, ...], dtype: Any, chunk_rows: int, fill: Any) -> None:
    """A dataset of shape (0, *row_shape) that grows along axis 0.

    A zero-length row axis (e.g. the reduction alphas of a space without reduction cell) gets maxshape None and
    chunk length 1 on that axis: HDF5 chunks must be positive and no longer than a fixed axis."""
    parent.create_dataset(
        name,
        shape=(0, *row_shape),
        maxshape=(None, *(size if size > 0 else None for size in row_shape)),
        chunks=(chunk_rows, *(max(size, 1) for size in row_shape)),
        dtype=dtype,
        fillvalue=fill,
    )


def per_party(name: str, values: Any, parties: int, dtype: Any = np.float64) -> np.ndarray:
    """``values`` as a (K,) array; any other shape raises (h5py would broadcast a scalar into every party)."""
    array = np.asarray(values, dtype=dtype)
    if array.shape != (parties,):
        raise ValueError(f"{name} must have shape ({parties},) (one value per party), got {array.shape}")
    return array
