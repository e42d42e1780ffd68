"""The package imports one way: no two modules of mpi_fnas import each other, directly or through others.

Every import statement of a module counts, wherever it stands: at module level, under ``if TYPE_CHECKING:`` and
inside functions. A cycle hidden behind a type-only or a lazy import is still a cycle
in the design (rank 0's stage driver ↔ its loop and ``privacy/params.py`` ↔ ``privacy/release.py`` were two once),
so the graph is read with ast, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mpi_fnas"


def _module_names(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module and package of `package`."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports. ``from a.b import c`` is an edge to ``a.b.c`` when that is a
    module, else to ``a.b``; relative imports resolve from the importing module's package."""
    modules = _module_names(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        imported.add(f"{base}.{alias.name}")
                    elif base in modules:
                        imported.add(base)
        graph[name] = imported - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert len(graph) > 100
    assert "mpi_fnas.stages.rank0_loop" in graph["mpi_fnas.stages.rank0_driver"]
    assert "mpi_fnas.privacy.release" in graph["mpi_fnas.privacy.params"]


def test_cycles_are_found(tmp_path: Path) -> None:
    """A cycle through a type-only import and one through a function's import are both found."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import B\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\nB = 1\n")
    (package / "sub" / "c.py").write_text("def f():\n    from ..sub import d\n")
    (package / "sub" / "d.py").write_text("from . import c\n")
    (package / "e.py").write_text("import pkg.a\n")
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]


def test_the_package_has_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in found)


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph one level up: each top-level module or subpackage of the package (``mpi_fnas.cli``,
    ``mpi_fnas.privacy``, ...) is one node, as the house's plan draws them."""

    def unit(name: str) -> str:
        return ".".join(name.split(".")[:2])

    units: dict[str, set[str]] = {}
    for name, imported in graph.items():
        units.setdefault(unit(name), set()).update(unit(other) for other in imported)
    return {name: imported - {name} for name, imported in units.items()}


def test_no_arrow_runs_back_up_between_the_packages_units() -> None:
    """No two top-level units import each other, however deep the modules that do it: an import from privacy/
    into secagg/ while secagg/ imports privacy/, or from federation/ into cli while cli starts federation/, is an
    arrow back up in the house's plan even where no two modules form a circle."""
    found = cycles(unit_graph(import_graph()))
    assert not found, "units that import each other:\n" + "\n".join(" <-> ".join(c) for c in found)


# What runs autograd: its modules imported, or a backward pass or gradient called by name.
AUTOGRAD_MODULES = ("torch.autograd", "torch.func", "functorch")
AUTOGRAD_CALLS = {"backward", "grad", "vjp", "jacrev", "vmap"}


def mpi_and_autograd(path: Path) -> tuple[bool, bool]:
    """(does the file import mpi4py, does it run autograd), from its imports and calls anywhere in it."""
    mpi = autograd = False
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        mpi |= any(name.split(".")[0] == "mpi4py" for name in names)
        autograd |= any(name.startswith(AUTOGRAD_MODULES) for name in names)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            autograd |= f"{node.value.id}.{node.attr}" in AUTOGRAD_MODULES
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            autograd |= node.func.attr in AUTOGRAD_CALLS
    return mpi, autograd


def test_mixing_is_found(tmp_path: Path) -> None:
    both = tmp_path / "both.py"
    both.write_text("def f(loss):\n    from mpi4py import MPI\n    loss.backward()\n")
    grads = tmp_path / "grads.py"
    grads.write_text("import torch\ng = torch.func.grad(lambda x: x)\n")
    assert mpi_and_autograd(both) == (True, True)
    assert mpi_and_autograd(grads) == (False, True)


def test_no_module_both_calls_mpi_and_runs_autograd() -> None:
    """The party's computation never sees a communicator: a module that talks MPI does not differentiate."""
    flags = {name: mpi_and_autograd(path) for name, path in _module_names(PACKAGE).items()}
    found = sorted(name for name, (mpi, autograd) in flags.items() if mpi and autograd)
    assert flags["mpi_fnas.federation.local_model"][1] and flags["mpi_fnas.privacy.per_sample"][1]
    assert not found, f"modules that import mpi4py and run autograd: {found}"
