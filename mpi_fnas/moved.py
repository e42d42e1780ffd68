"""What moved where: the package's old module paths and names, each with its new home.

An old path still imports, with a DeprecationWarning saying where it went, and gives the new module itself
(:class:`MovedModuleFinder`, which ``mpi_fnas/__init__.py`` installs); a name that left a module that stays is
forwarded by that module's ``__getattr__`` through :func:`moved_name`. Nothing here imports the package: the new
homes are imported only when an old path or name is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

#: Old module path -> the module that holds its contents now.
MOVED = {
    "mpi_fnas.stages.serve": "mpi_fnas.stages.rank0_driver",
    "mpi_fnas.stages.server_loop": "mpi_fnas.stages.rank0_loop",
    "mpi_fnas.stages.participate": "mpi_fnas.stages.party_driver",
    "mpi_fnas.federation.server": "mpi_fnas.federation.global_model",
    "mpi_fnas.federation.party": "mpi_fnas.federation.local_model",
    "mpi_fnas.federation.party_store": "mpi_fnas.federation.party_disk",
    "mpi_fnas.federation.plan": "mpi_fnas.federation.job_plan",
    "mpi_fnas.privacy.planning": "mpi_fnas.privacy.calibration",
    "mpi_fnas.privacy.accountant": "mpi_fnas.privacy.shard_ledger",
    "mpi_fnas.privacy.ledger": "mpi_fnas.privacy.federation_ledger",
    "mpi_fnas.scaling.plan": "mpi_fnas.scaling.grid",
}

#: Old dotted name (in a module that stays) -> the module that defines it now.
MOVED_NAMES = {
    **{f"mpi_fnas.stages.base.{name}": "mpi_fnas.stages.setup"
       for name in ("StageSetup", "stage_setup", "job_ledger", "guarantee", "selection_schema", "rates")},
    **{f"mpi_fnas.stages.base.{name}": "mpi_fnas.stages.party_data" for name in ("with_fixed_stem", "own_examples")},
}


def moved_name(module: str, name: str) -> Any:
    """`name` of `module` from the module that defines it now, with a DeprecationWarning (a module's
    ``__getattr__`` calls this); AttributeError for a name that never moved."""
    new = MOVED_NAMES.get(f"{module}.{name}")
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} moved to {new}.{name}", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(new), name)


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The import of an old module path (:data:`MOVED`): a DeprecationWarning naming the new path, and the new
    module in its place (``sys.modules`` holds it under both names). Consulted after the regular finders, so a real
    module of an old name would win."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        """A spec with this loader for an old path; None for any other name."""
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        """None: the import system's default placeholder, which :meth:`exec_module` replaces."""
        return None

    def exec_module(self, module: ModuleType) -> None:
        """Warn, import the new module and put it in ``sys.modules`` under the old name (the import then returns
        it, as the import system does for a loader that replaces its module there)."""
        old, new = module.__name__, MOVED[module.__name__]
        # stacklevel 2: the warning points at the import statement (the import system's frames are skipped)
        warnings.warn(f"{old} moved to {new}", DeprecationWarning, stacklevel=2)
        sys.modules[old] = importlib.import_module(new)


def install() -> None:
    """Add the finder to ``sys.meta_path`` once (after the regular finders)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
