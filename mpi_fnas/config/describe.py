"""The schema described: every key's type, default and meaning for ``--help``, the config reference page, and the
generated ``configs/default.yaml``."""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any

import yaml

from mpi_fnas.config.parsing import type_name
from mpi_fnas.config.schema import HELP, Config


@dataclass(frozen=True)
class KeyDoc:
    """One leaf config key as documented by the schema."""

    key: str  # dotted, e.g. "search.epochs"
    kind: str  # the accepted values, e.g. "int or null", "iid, dirichlet, pathological"
    default: Any
    meaning: str  # one line, from the field's metadata


def key_docs() -> list[KeyDoc]:
    """Every leaf key of :class:`Config` in schema order, with its type, default and meaning."""
    docs: list[KeyDoc] = []

    def walk(cls: type, prefix: str, defaults: Any) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            value = getattr(defaults, f.name)
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], key + ".", value)
            else:
                kind = type_name(hints[f.name]).replace("one of ", "").replace("'", "")
                docs.append(KeyDoc(key, kind, value, str(f.metadata.get(HELP, ""))))

    walk(Config, "", Config())
    return docs


def _yaml_scalar(value: Any) -> str:
    # A list on one line, in flow style ([8, 16, 32]): block style would not survive the joined line.
    return yaml.safe_dump(value, default_flow_style=isinstance(value, list) or None).strip().removesuffix(
        "...").strip().replace("\n", " ")


def describe_keys(width: int = 100) -> list[str]:
    """Lines for ``--help``: per key ``  section.key  type  (default …)``, then its meaning indented below."""
    lines: list[str] = []
    for doc in key_docs():
        lines.append(f"  {doc.key:<28} {doc.kind}  (default {_yaml_scalar(doc.default)})")
        lines += textwrap.wrap(doc.meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                               break_long_words=False, break_on_hyphens=False)
    return lines


_DEFAULTS_HEADER = (
    "The built-in defaults of python -m mpi_fnas.run with the meaning of every key, generated from the schema in "
    "mpi_fnas/config/schema.py by mpi_fnas.config.documented_defaults_yaml() (tests/test_config.py keeps this file "
    "identical to it). A config file only needs the keys it changes."
)


def documented_defaults_yaml(width: int = 118) -> str:
    """The default configuration as YAML with every key's meaning (and each section's purpose) as comments.

    This is the exact text of ``configs/default.yaml``.
    """

    def comment(text: str, indent: str) -> list[str]:
        return textwrap.wrap(text, width, initial_indent=indent + "# ", subsequent_indent=indent + "# ",
                             break_long_words=False, break_on_hyphens=False)

    lines = comment(_DEFAULTS_HEADER, "")
    hints = typing.get_type_hints(Config)
    defaults = Config()
    for f in dataclasses.fields(Config):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            purpose = " ".join(inspect.getdoc(hints[f.name]).split("\n\n")[0].replace("``", "").split())
            lines += ["", *comment(purpose, ""), f"{f.name}:"]
            for sub in dataclasses.fields(hints[f.name]):
                lines += comment(sub.metadata[HELP], "  ")
                lines.append(f"  {sub.name}: {_yaml_scalar(getattr(value, sub.name))}")
        else:
            lines += comment(f.metadata[HELP], "")
            lines.append(f"{f.name}: {_yaml_scalar(value)}")
    return "\n".join(lines) + "\n"
