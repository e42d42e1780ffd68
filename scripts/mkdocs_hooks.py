"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks``), run by ``make docs`` and tests/test_docs_site.py.

* The API reference is generated: one page per part of the package (:data:`API_PAGES`), each rendering its modules
  with mkdocstrings; a module of the package that no page names fails the build (it would be missing from the site).
* The config reference (``config.md``) is generated from the schema, ``mpi_fnas.config.key_docs()``: every key, its
  accepted values, default and meaning, as ``--help`` and ``configs/default.yaml`` show them.
* Every public module, class, function and method of the package has a docstring, or the build fails (mkdocstrings
  renders a missing docstring as nothing, silently). A method without one inherits its base class's, as Python's
  ``help()`` shows it.
* :class:`SphinxRoles` (a griffe extension, mkdocs.yml) turns the docstrings' Sphinx roles (``:class:`~a.b.C``...)
  into code spans, which Markdown renders.

Warnings go to MkDocs' logger, so ``mkdocs build --strict`` fails on them.
"""

from __future__ import annotations

import html
import logging
import re
import sys
from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mpi_fnas"
log = logging.getLogger("mkdocs.hooks.mpi_fnas")

#: API reference pages: (file, title, the modules it renders: a prefix takes the package and every module under it).
API_PAGES = (
    ("api/entry-points.md", "Entry points", ("mpi_fnas", "mpi_fnas.run", "mpi_fnas.cli", "mpi_fnas.config",
                                             "mpi_fnas.bench", "mpi_fnas.identities", "mpi_fnas.__main__")),
    ("api/stages.md", "Stages", ("mpi_fnas.stages",)),
    ("api/federation.md", "Federation", ("mpi_fnas.federation",)),
    ("api/privacy.md", "Privacy", ("mpi_fnas.privacy",)),
    ("api/secagg.md", "Secure aggregation", ("mpi_fnas.secagg",)),
    ("api/space.md", "Search spaces and networks", ("mpi_fnas.space", "mpi_fnas.op_names")),
    ("api/data.md", "Data", ("mpi_fnas.data",)),
    ("api/runlog.md", "Run log (HDF5)", ("mpi_fnas.runlog",)),
    ("api/report.md", "Report", ("mpi_fnas.report",)),
    ("api/experiments.md", "Sweep, baseline and scaling study", ("mpi_fnas.sweep", "mpi_fnas.baseline",
                                                                "mpi_fnas.scaling")),
    ("api/support.md", "Support modules", ("mpi_fnas.checkpoint", "mpi_fnas.evaluation", "mpi_fnas.progress",
                                           "mpi_fnas.optim", "mpi_fnas.wire", "mpi_fnas.cpu_kernels",
                                           "mpi_fnas.keystream", "mpi_fnas.refusal", "mpi_fnas.moved")),
)
CONFIG_PAGE = "config.md"
CONFIG_MARKER = "<!-- config keys: generated from mpi_fnas.config.key_docs() -->"
#: Public names that may stay without a docstring, each with the reason.
UNDOCUMENTED = {
    "mpi_fnas.secagg.accounting.SecureAccounting.description":
        "secagg/accounting.py is being rewritten; its docstrings come with that rewrite",
}


def _modules() -> list[str]:
    """Every module of the package, dotted, in file order."""
    names = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _page_modules(prefixes: tuple[str, ...], modules: list[str]) -> list[str]:
    """The modules a page renders: exact names, and for a package prefix the package and all below it."""
    chosen = []
    for prefix in prefixes:
        below = [m for m in modules if m == prefix or (m.startswith(prefix + ".") and prefix != PACKAGE)]
        chosen += [m for m in below if m not in chosen]
    return chosen


def _api_markdown(title: str, modules: list[str]) -> str:
    lines = [f"# {title}", "", "Generated from the docstrings (mkdocstrings); the source is in `mpi_fnas/`.", ""]
    for module in modules:
        lines += [f"::: {module}", ""]
    return "\n".join(lines)


def _config_markdown() -> str:
    sys.path.insert(0, str(ROOT))
    from mpi_fnas.config import key_docs

    rows: dict[str, list[str]] = {}
    for doc in key_docs():
        section = doc.key.split(".")[0] if "." in doc.key else "(top level)"
        default = "null" if doc.default is None else str(doc.default).lower() if isinstance(doc.default, bool) \
            else str(doc.default)
        default = default.replace("|", "\\|")  # a code span in a table cell: only the pipe needs escaping
        rows.setdefault(section, []).append(f"| `{doc.key}` | {_cell(doc.kind)} | `{default}` | "
                                            f"{_cell(doc.meaning)} |")
    out = []
    for section, lines in rows.items():
        out += [f"## {section}", "", "| key | accepted values | default | meaning |", "|---|---|---|---|", *lines, ""]
    return "\n".join(out)


def _cell(text: object) -> str:
    """`text` as a Markdown table cell: HTML escaped (``runs/<name>-…/`` is text, not a tag), ``|`` escaped."""
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("\n", " ")


def on_files(files: Any, config: Any) -> Any:
    """Add the generated API pages; fail on a module no page renders."""
    from mkdocs.structure.files import File

    modules = _modules()
    covered: set[str] = set()
    index = ["# API reference", "", "Generated from the package's docstrings by mkdocstrings, one page per part. The "
             "build fails when a public module, class, function or method has no docstring, or when a module of "
             "`mpi_fnas/` is on no page (`scripts/mkdocs_hooks.py`).", ""]
    for path, title, prefixes in API_PAGES:
        chosen = _page_modules(prefixes, modules)
        covered.update(chosen)
        files.append(File.generated(config, path, content=_api_markdown(title, chosen)))
        index.append(f"- [{title}]({path.removeprefix('api/')}): " + ", ".join(f"`{m}`" for m in chosen))
    files.append(File.generated(config, "api/index.md", content="\n".join(index) + "\n"))
    for module in modules:
        if module not in covered:
            log.warning("API reference: module %s is on no page of scripts/mkdocs_hooks.py's API_PAGES", module)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill the config reference page from the schema."""
    if page.file.src_uri == CONFIG_PAGE:
        if CONFIG_MARKER not in markdown:
            log.warning("%s: the marker %r is missing", CONFIG_PAGE, CONFIG_MARKER)
        return markdown.replace(CONFIG_MARKER, _config_markdown())
    return markdown


def undocumented(package: griffe.Module) -> list[str]:
    """Public modules, classes, functions and methods of `package` without a docstring (dunder methods are
    described by their class; a method inherits its base's docstring)."""
    missing: list[str] = []

    def inherits(cls: griffe.Class, name: str) -> bool:
        try:
            bases = cls.mro()
        except ValueError:
            return False
        return any(name in base.members and base.members[name].docstring for base in bases)

    def walk(obj: griffe.Object) -> None:
        for name, member in obj.members.items():
            if member.is_alias or not member.is_public or (name.startswith("__") and name.endswith("__")):
                continue
            if member.is_module or member.is_class or member.is_function:
                if not member.docstring and not (obj.is_class and inherits(obj, name)):
                    missing.append(member.path)
                if member.is_module or member.is_class:
                    walk(member)

    if not package.docstring:
        missing.append(package.path)
    walk(package)
    return missing


def on_pre_build(config: Any) -> None:
    """Fail on an undocumented public name (and on an allow-list entry that is documented now)."""
    package = griffe.load(PACKAGE, search_paths=[str(ROOT)], extensions=griffe.load_extensions(SphinxRoles))
    missing = undocumented(package)
    for path in missing:
        if path not in UNDOCUMENTED:
            log.warning("API reference: %s has no docstring", path)
    for path in UNDOCUMENTED:
        if path not in missing:
            log.warning("API reference: %s is documented now: drop it from UNDOCUMENTED", path)


_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const)::?`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    """``:class:`~a.b.C``` becomes ```C```, ``:func:`a.b.f``` becomes ```a.b.f```: the docstrings are written for
    Sphinx-style readers, the site renders Markdown."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)


def _code(match: re.Match[str]) -> str:
    target = match.group(1)
    shown = target.rsplit(".", 1)[-1] if match.group(0).split("`")[1].startswith("~") else target
    return f"`{shown}`"
