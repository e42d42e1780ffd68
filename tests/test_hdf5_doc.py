"""docs/hdf5.md lists exactly the groups, datasets and attributes that ``RunLog.create`` writes, and those that
``RunLog.begin_augment`` adds under ``/augment``.

The doc's "## Layout" section has one "### `/group`" subsection per group, each with a table whose rows start
with "| `name` | kind |" (kind: attr, dataset or group). That is what is parsed here; everything else in the
doc is prose.
"""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import pytest
from runlog_helpers import setup_reports

from mpi_fnas.privacy.release import Release
from mpi_fnas.runlog import SEARCH_METRICS, RunLog, SelectionSchema, StagePrivacy, read_run

DOC = Path(__file__).resolve().parents[1] / "docs" / "hdf5.md"
PARTIES = 2

# One documented member: (group path, name, kind).
Member = tuple[str, str, str]

_HEADING = re.compile(r"^### `(/[^`]*)`")
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*(attr|dataset|group)\s*\|")


def documented_members(text: str) -> set[Member]:
    """Members declared by the Layout section of ``text`` (the markdown of docs/hdf5.md)."""
    layout = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    members: set[Member] = set()
    group = None
    for line in layout.splitlines():
        heading = _HEADING.match(line)
        if heading:
            group = heading.group(1)
            continue
        row = _ROW.match(line)
        if row:
            assert group is not None, f"table row outside a group subsection: {line}"
            member = (group, row.group(1), row.group(2))
            assert member not in members, f"documented twice: {member}"
            members.add(member)
    return members


def file_members(path: Path) -> set[Member]:
    """Every attribute, dataset and group in the file at ``path``, as (group path, name, kind); attributes of
    datasets count too (under the dataset's path), so an undocumented one cannot hide there."""
    members: set[Member] = set()

    def add(parent: str, obj: h5py.Group | h5py.Dataset) -> None:
        members.update((parent, name, "attr") for name in obj.attrs)
        if isinstance(obj, h5py.Group):
            for name, child in obj.items():
                members.add((parent, name, "group" if isinstance(child, h5py.Group) else "dataset"))
                add(f"{parent.rstrip('/')}/{name}", child)

    with h5py.File(path, "r") as f:
        add("/", f)
    return members


#: (alpha_shape, reduce_alpha_shape) per space kind, as ``mpi_fnas.space.search_space(kind).alpha_shapes`` gives them
#: for 4 DARTS nodes and the paper's 5 DPNAS nodes.
ALPHA_SHAPES = {"darts": ((14, 8), (14, 8)), "dpnas": ((15, 10), (0, 10))}


def _fresh_log(path: Path, mode: str, *, augment: bool, space: str = "darts", selection: bool = False) -> Path:
    """A finished search of ``mode`` in ``space`` with one row per family; with augment, also a finished augment
    stage that is private exactly when the search was (as the product runs it); with selection (dpfnas), a
    SecProbe run."""
    privacy = None
    if mode == "dpfnas":
        release = Release(noise_multiplier=1.0, clip=0.1, expected_batch_size=8.0)
        privacy = StagePrivacy(delta=[1e-5] * PARTIES, releases={"W": release, "A": release},
                               sample_rates={"W": [0.01] * PARTIES, "A": [0.02] * PARTIES}, accountant="pld")
    normal, reduce = ALPHA_SHAPES[space]
    schema = SelectionSchema(selection="secprobe", select=1, epsilon_per_step=1.0, score_window=2, aux_size=10,
                             sensitivity=0.1, delta=1e-5)
    runlog = RunLog.create(
        path, mode=mode, parties=PARTIES, config_text="x: 1\n", metric_names=SEARCH_METRICS, alpha_shape=normal,
        reduce_alpha_shape=reduce, space=space, genotype_length=64, alpha_ops=[f"op{k}" for k in range(normal[1])],
        privacy_guarantee="holds" if privacy else f"none: mode {mode} makes no privacy claim",
        privacy=privacy, rank_attrs=setup_reports(PARTIES).rank_attrs,  # what the search passes
        unreliable=[True] + [False] * (PARTIES - 1), corruption=0.5,
        selection=schema if selection else None,
    )  # fmt: skip
    runlog.search.append_metrics({"step": 1})
    if selection:
        runlog.search.append_selection(1, [True] + [False] * (PARTIES - 1), np.full(PARTIES, 0.5), 1.0)
    runlog.search.append_epoch(np.full(normal, 1 / normal[1]), np.full(reduce, 1 / reduce[1]), "g")
    if privacy is not None:
        runlog.search.append_privacy(1, np.ones(PARTIES), np.zeros(PARTIES), np.zeros(PARTIES))
    runlog.search.finish("finished", reason="completed", cost={"wall_seconds": 1.0, "ranks": PARTIES + 1})
    if augment:
        augment_privacy = None
        if privacy is not None:
            augment_privacy = StagePrivacy(delta=[1e-5] * PARTIES, releases={"W": release},
                                           sample_rates={"W": [0.01] * PARTIES})
        runlog.begin_augment(
            genotype="g", params=1000, private=privacy is not None, privacy=augment_privacy, parties=PARTIES,
            privacy_guarantee="holds" if privacy is not None else "none: no privacy claim",
            selection=schema if selection else None,
        )
        runlog.augment.append_metrics({"step": 1, "epoch": 0})
        if augment_privacy is not None:
            runlog.augment.append_privacy(1, np.zeros(PARTIES, np.int64), np.zeros(PARTIES), np.zeros(PARTIES))
        if selection:
            runlog.augment.append_selection(1, [True] + [False] * (PARTIES - 1), np.full(PARTIES, 0.5), 2.0)
        runlog.augment.finish("finished", reason="completed", test_acc=0.5, cost={"wall_seconds": 1.0},
                              epsilon_alone=np.ones(PARTIES) if augment_privacy is not None else None)
    return path


def _under(member: Member, group: str) -> bool:
    """Whether ``member`` is the group at path ``group`` or lies inside it."""
    parent, name = group.rsplit("/", 1)
    return member[0] == group or member[0].startswith(group + "/") or member == (parent or "/", name, "group")


@pytest.mark.parametrize(("mode", "augment", "space", "selection"), [
    ("dpfnas", False, "darts", False), ("fnas", False, "darts", False), ("dpfnas", True, "darts", False),
    ("fnas", True, "darts", False), ("dpfnas", True, "dpnas", False), ("fnas", False, "dpnas", False),
    ("dpfnas", False, "darts", True), ("dpfnas", True, "darts", True),
])
def test_doc_lists_exactly_what_the_writer_creates(tmp_path: Path, mode: str, augment: bool, space: str,
                                                   selection: bool) -> None:
    documented = documented_members(DOC.read_text(encoding="utf-8"))
    if not selection:  # the doc marks /selection and /privacy/selection_epsilon as existing only with a selection
        documented = {member for member in documented if not _under(member, "/selection")}
        documented = {member for member in documented if not _under(member, "/augment/selection")}
        documented.discard(("/privacy", "selection_epsilon", "dataset"))
        documented.discard(("/augment/privacy", "selection_epsilon", "dataset"))
    if mode != "dpfnas":  # the doc marks /privacy as dpfnas-only (and the augment stage is private only then)
        documented = {member for member in documented if not _under(member, "/privacy")}
        documented = {member for member in documented if not _under(member, "/augment/privacy")}
    if not augment:  # the doc marks /augment as existing once an augment stage has begun
        documented = {member for member in documented if not _under(member, "/augment")}
    written = file_members(_fresh_log(tmp_path / "search.h5", mode, augment=augment, space=space,
                                      selection=selection))
    assert sorted(written - documented) == [], "written but not documented"
    assert sorted(documented - written) == [], "documented but not written"


def test_dpnas_alphas_are_one_cell_and_an_edgeless_reduce_as_documented(tmp_path: Path) -> None:
    """docs/hdf5.md, /alphas: under space dpnas, normal holds the (15, 10) cell, reduce grows with it at 0 edges."""
    path = _fresh_log(tmp_path / "search.h5", "dpfnas", augment=False, space="dpnas")
    with h5py.File(path, "r") as f:
        assert f.attrs["space"] == "dpnas"
        assert f["alphas/normal"].shape == (1, 15, 10) and f["alphas/normal"].maxshape == (None, 15, 10)
        assert f["alphas/reduce"].shape == (1, 0, 10) and f["alphas/reduce"].maxshape == (None, None, 10)
    run = read_run(path)
    assert run["space"] == "dpnas" and run["alphas"]["reduce"].shape == (1, 0, 10)
    assert np.allclose(run["alphas"]["normal"][0].sum(axis=1), 1.0)
