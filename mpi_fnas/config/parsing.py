"""From YAML text and ``--set`` overrides to a checked :class:`~mpi_fnas.config.Config`: the defaults, then the file,
then the overrides, each value checked against its field's type; a stored config (a log's, a checkpoint's) read
with the keys removed since dropped and the keys added since given the value they meant then."""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from mpi_fnas.config.checks import validate
from mpi_fnas.config.errors import ConfigError
from mpi_fnas.config.schema import Config

#: Keys that once existed, with why they are gone: a config that sets one gets this one line, not "unknown key".
#: Configs stored by earlier versions (in a log, a checkpoint, ``searched.pt``) are read with these keys dropped.
REMOVED_KEYS = {
    "privacy.secure_rng": "removed: every DP party now draws all its noise and coins from AES-256-CTR keyed with "
                          "256 bits of OS entropy (docs/privacy.md §2.1), so there is nothing to switch on; "
                          "delete the key",
}
#: Keys added after a config could have been stored (a log, a checkpoint, ``searched.pt``), with the value that means
#: what a stored config meant before the key existed. Their built-in default may differ: ``space.ops`` is every op of
#: the space in a config written before it, while the built-in default keeps the DPNAS convolutions.
ADDED_KEYS: dict[str, Any] = {"space.ops": []}


def type_name(tp: Any) -> str:
    """The values an annotation accepts, in words: ``one of 'iid', 'local'``, ``int or null``, ``list of int``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; return it (ints are accepted where floats are expected)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(choices):
            return "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if not isinstance(value, bool) and value in choices:
            return value
        raise ConfigError(f"{key}: {value!r} is not {type_name(tp)}")
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {type_name(tp)} (e.g. [8, 16, 32]), got {value!r}")
        return [_coerce(key, item, typing.get_args(tp)[0]) for item in value]
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected null, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise TypeError(f"unsupported annotation {tp!r} for {key}")  # a schema bug, not user error


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            where = f"{prefix}.{key}" if prefix else str(key)
            if where in REMOVED_KEYS:
                raise ConfigError(f"{where}: {REMOVED_KEYS[where]}")
            choices = ", ".join(fields)
            raise ConfigError(f"{where}: unknown key (valid keys here: {choices})")
    kwargs = {}
    for name in fields:
        if name not in data:
            continue
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, data[name], key)
        else:
            kwargs[name] = _coerce(key, data[name], tp)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``dotted.key=value``; the value is parsed as YAML (so ``3``, ``0.1``, ``true``, ``null`` work)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r} ({exc.__class__.__name__})") from None
    return key, value


def _apply_override(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults ← YAML file (if any) ← ``--set`` overrides, then validation.

    Raises ConfigError (one-line message naming the key) on any problem.
    """
    text, where = None, ""
    if path is not None:
        text, where = read_config_file(path), str(Path(path))
    return config_from_text(text, overrides, where=where)


def read_config_file(path: str | Path) -> str:
    """The text of the config file `path`; ConfigError (one line) when it is missing or cannot be read."""
    p = Path(path)
    try:
        return p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file: {p}") from None
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {p}: {exc.strerror}") from None


def yaml_mapping(text: str, where: str = "") -> dict[str, Any]:
    """The top-level mapping of config YAML `text` ({} for an empty document); ConfigError (one line naming
    `where`, the file, or "text") when it is not valid YAML or not a mapping."""
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"--config: {where or 'text'} is not valid YAML{at}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config: {where or 'text'} must contain a mapping at the top level")
    return loaded


def config_from_text(text: str | None, overrides: list[str] | tuple[str, ...] = (), *, where: str = "",
                     stored: bool = False) -> Config:
    """Like :func:`load_config` for YAML text. With `stored` the text is a resolved config this program wrote
    earlier (in a log, a checkpoint, ``searched.pt``), possibly by an older version: its REMOVED_KEYS are dropped, and
    the ADDED_KEYS it lacks get the value they meant then."""
    tree = yaml_mapping(text, where) if text is not None else {}
    if stored:
        _drop_removed(tree)
        _add_missing(tree)
    for item in overrides:
        key, value = parse_override(item)
        _apply_override(tree, key, value)
    return validate(_build(Config, tree, ""))


def _add_missing(tree: dict[str, Any]) -> None:
    """Give every ADDED_KEYS entry that a stored config tree lacks the value it meant then, in place."""
    for dotted, value in ADDED_KEYS.items():
        node, leaf = _section_of(tree, dotted, create=True)
        if node is not None:
            node.setdefault(leaf, copy.deepcopy(value))


def _drop_removed(tree: dict[str, Any]) -> None:
    """Remove every REMOVED_KEYS entry from a config tree, in place."""
    for dotted in REMOVED_KEYS:
        node, leaf = _section_of(tree, dotted, create=False)
        if node is not None:
            node.pop(leaf, None)


def _section_of(tree: dict[str, Any], dotted: str, *, create: bool) -> tuple[dict[str, Any] | None, str]:
    """(the mapping that holds `dotted`'s last part, that part): sections missing from `tree` are made when
    `create`, else the mapping is None (as when a section is not a mapping)."""
    *sections, leaf = dotted.split(".")
    node: Any = tree
    for section in sections:
        if not isinstance(node, dict):
            return None, leaf
        node = node.setdefault(section, {}) if create else node.get(section)
    return (node if isinstance(node, dict) else None), leaf
