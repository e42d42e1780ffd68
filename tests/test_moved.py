"""Old module paths and names still work, and say where they went (mpi_fnas/moved.py).

An old path (``mpi_fnas.stages.serve``) imports with a DeprecationWarning naming its new path, and is the new module
itself, not a copy; every new path imports; a name that left ``mpi_fnas.stages.base`` is forwarded with a warning;
anything else is still an ImportError or an AttributeError.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from mpi_fnas.moved import MOVED, MOVED_NAMES

ROOT = Path(__file__).resolve().parents[1]


def _forget(monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    """As if `old` had never been imported in this process (an earlier test may have)."""
    monkeypatch.delitem(sys.modules, old, raising=False)
    parent, _, child = old.rpartition(".")
    monkeypatch.delattr(importlib.import_module(parent), child, raising=False)


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_path_imports_warns_and_is_the_new_module(monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    _forget(monkeypatch, old)
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(old)} moved to {re.escape(new)}$"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and sys.modules[old] is module


def test_the_warning_points_at_the_import_statement(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget(monkeypatch, "mpi_fnas.scaling.plan")
    with pytest.warns(DeprecationWarning) as caught:
        from mpi_fnas.scaling import plan
    assert [Path(w.filename) for w in caught] == [Path(__file__)]
    assert plan is importlib.import_module("mpi_fnas.scaling.grid")


def test_every_new_path_imports_and_no_old_path_is_a_file() -> None:
    for old, new in MOVED.items():
        assert importlib.import_module(new).__name__ == new
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), f"{old} is a module again: leave MOVED"


@pytest.mark.parametrize(("dotted", "new"), sorted(MOVED_NAMES.items()))
def test_a_name_moved_out_of_a_module_is_forwarded_with_a_warning(dotted: str, new: str) -> None:
    module, _, name = dotted.rpartition(".")
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(dotted)} moved to {re.escape(new)}.{name}$"):
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(new), name)


def test_other_names_fail_as_before() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mpi_fnas.stages.no_such_module")
    base = importlib.import_module("mpi_fnas.stages.base")
    assert not hasattr(base, "no_such_name")
    with pytest.raises(ImportError):
        exec("from mpi_fnas.stages.base import no_such_name")
