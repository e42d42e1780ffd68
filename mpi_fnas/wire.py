"""The data-only format of the objects ranks exchange at setup (assignments, reports, keys, decisions).

Nothing received is executed: a message is a JSON header and the raw bytes of its arrays and byte strings, never a
pickle (unpickling runs whatever code the sender chose). :func:`decode` builds only these values, and refuses
anything else with :class:`WireError`: None, bool, int, float (NaN and ±inf included), str, bytes; lists, tuples,
and dicts whose keys are str or int; numpy arrays of a numeric or bool dtype (no object arrays); and instances of
the dataclasses and NamedTuples registered with :func:`wire_type`, built by their own constructor from exactly their
fields, each checked against the field's type annotation (``int``, ``np.ndarray``, ``X | None``, ``Literal``, a
registered class).

Layout: 8 bytes (big-endian) giving the header's length, the UTF-8 JSON header, then the blobs back to back. The
header's tagged objects (``{"$t": ...}``) name a kind and, for bytes and arrays, a blob by index with its dtype and
shape; a blob's length must be exactly what its dtype and shape say. No MPI and no torch here (numpy only):
:class:`~mpi_fnas.federation.comm.Channel` sends the bytes, and the modules that define the wire types register
them where they are defined.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any, TypeVar

import numpy as np

__all__ = ["WireError", "decode", "encode", "wire_type"]

_LENGTH_BYTES = 8
_MAX_DEPTH = 32  # nesting a setup object never reaches; bounds the decoder's recursion on a hostile header
_ARRAY_KINDS = "biuf"  # bool, signed and unsigned ints, floats: no object, string or void dtypes
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

T = TypeVar("T")
_TYPES: dict[str, type] = {}


class WireError(ValueError):
    """A message that is not a well-formed data-only message, or a value that cannot be sent as one."""


def wire_type(cls: type[T]) -> type[T]:
    """Class decorator: instances of the dataclass (or NamedTuple) `cls` may be sent, and are rebuilt from their
    fields on receipt. Registered by class name, which must be unique."""
    name = cls.__name__
    if name in _TYPES and _TYPES[name] is not cls:
        raise TypeError(f"wire type name {name!r} is registered twice")
    if not (dataclasses.is_dataclass(cls) or _is_namedtuple(cls)):
        raise TypeError(f"{name} is neither a dataclass nor a NamedTuple")
    _TYPES[name] = cls
    return cls


# -- encoding -------------------------------------------------------------------------------------------------------
def encode(obj: object) -> bytes:
    """`obj` as one data-only message (WireError for a value of another kind)."""
    blobs: list[bytes] = []
    header = json.dumps(_to_json(obj, blobs, 0), separators=(",", ":"), allow_nan=False).encode()
    return b"".join([len(header).to_bytes(_LENGTH_BYTES, "big"), header, *blobs])


def _to_json(obj: object, blobs: list[bytes], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise WireError("object nested too deeply")
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, np.bool_):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return value if math.isfinite(value) else {"$t": "float", "v": repr(value)}
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, (bytes, bytearray)):
        blobs.append(bytes(obj))
        return {"$t": "bytes", "blob": len(blobs) - 1, "size": len(obj)}
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _ARRAY_KINDS:
            raise WireError(f"arrays of dtype {obj.dtype} cannot be sent")
        blobs.append(np.ascontiguousarray(obj).tobytes())
        return {"$t": "array", "blob": len(blobs) - 1, "dtype": obj.dtype.str, "shape": list(obj.shape)}
    name = type(obj).__name__
    if _TYPES.get(name) is type(obj):
        items = obj._asdict() if _is_namedtuple(type(obj)) else {
            f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return {"$t": "object", "type": name, "fields": {k: _to_json(v, blobs, depth + 1) for k, v in items.items()}}
    if isinstance(obj, list):
        return [_to_json(v, blobs, depth + 1) for v in obj]
    if isinstance(obj, tuple):
        return {"$t": "tuple", "items": [_to_json(v, blobs, depth + 1) for v in obj]}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
            raise WireError("dict keys must be str or int")
        return {"$t": "dict", "items": [[k, _to_json(v, blobs, depth + 1)] for k, v in obj.items()]}
    raise WireError(f"a {type(obj).__name__} cannot be sent (not a registered wire type)")


# -- decoding -------------------------------------------------------------------------------------------------------
def decode(message: bytes) -> object:
    """The value of one message from :func:`encode`; WireError for anything else (nothing in it is executed)."""
    data = bytes(message)
    if len(data) < _LENGTH_BYTES:
        raise WireError("message shorter than its length prefix")
    length = int.from_bytes(data[:_LENGTH_BYTES], "big")
    if length > len(data) - _LENGTH_BYTES:
        raise WireError("header longer than the message")
    try:
        header = json.loads(data[_LENGTH_BYTES:_LENGTH_BYTES + length].decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireError(f"header is not JSON: {exc}") from None
    reader = _Blobs(memoryview(data)[_LENGTH_BYTES + length:])
    value = _from_json(header, reader, 0)
    reader.check_all_used()
    return value


class _Blobs:
    """The message's blobs, handed out in order, each exactly as long as its header entry says."""

    def __init__(self, rest: memoryview) -> None:
        self.rest, self.offset, self.count = rest, 0, 0

    def take(self, index: object, size: int) -> bytes:
        if index != self.count:
            raise WireError("blobs out of order")
        if size < 0 or self.offset + size > len(self.rest):
            raise WireError("blob past the end of the message")
        blob = bytes(self.rest[self.offset:self.offset + size])
        self.offset, self.count = self.offset + size, self.count + 1
        return blob

    def check_all_used(self) -> None:
        if self.offset != len(self.rest):
            raise WireError("bytes after the last blob")


def _from_json(node: Any, blobs: _Blobs, depth: int) -> object:
    if depth > _MAX_DEPTH:
        raise WireError("message nested too deeply")
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_from_json(v, blobs, depth + 1) for v in node]
    if not isinstance(node, dict) or not isinstance(node.get("$t"), str):
        raise WireError("untagged object in the header")
    kind = node["$t"]
    fields = set(node)
    if kind == "float" and fields == {"$t", "v"} and node["v"] in _FLOATS:
        return _FLOATS[node["v"]]
    if kind == "bytes" and fields == {"$t", "blob", "size"} and _is_count(node["size"]):
        return blobs.take(node["blob"], node["size"])
    if kind == "array" and fields == {"$t", "blob", "dtype", "shape"}:
        return _array(node, blobs)
    if kind == "tuple" and fields == {"$t", "items"} and isinstance(node["items"], list):
        return tuple(_from_json(v, blobs, depth + 1) for v in node["items"])
    if kind == "dict" and fields == {"$t", "items"} and isinstance(node["items"], list):
        out: dict[str | int, object] = {}
        for item in node["items"]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))
                    and not isinstance(item[0], bool)):
                raise WireError("malformed dict item")
            out[item[0]] = _from_json(item[1], blobs, depth + 1)
        return out
    if kind == "object" and fields == {"$t", "type", "fields"} and isinstance(node["fields"], dict):
        return _instance(node, blobs, depth)
    raise WireError(f"malformed {kind!r} entry")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _array(node: dict, blobs: _Blobs) -> np.ndarray:
    try:
        dtype = np.dtype(node["dtype"]) if isinstance(node["dtype"], str) else None
    except TypeError:
        dtype = None
    shape = node["shape"]
    if dtype is None or dtype.kind not in _ARRAY_KINDS or dtype.hasobject:
        raise WireError(f"array dtype {node['dtype']!r} refused")
    if not (isinstance(shape, list) and len(shape) <= _MAX_DEPTH and all(_is_count(n) for n in shape)):
        raise WireError("malformed array shape")
    count = math.prod(shape)
    return np.frombuffer(blobs.take(node["blob"], count * dtype.itemsize), dtype=dtype).reshape(shape).copy()


def _instance(node: dict, blobs: _Blobs, depth: int) -> object:
    cls = _TYPES.get(node["type"]) if isinstance(node["type"], str) else None
    if cls is None:
        raise WireError(f"unknown wire type {node['type']!r}")
    hints = typing.get_type_hints(cls)
    names = list(cls._fields) if _is_namedtuple(cls) else [f.name for f in dataclasses.fields(cls) if f.init]
    if set(node["fields"]) != set(names):
        raise WireError(f"{cls.__name__}: fields {sorted(node['fields'])} are not {sorted(names)}")
    values = {name: _from_json(node["fields"][name], blobs, depth + 1) for name in names}
    for name, value in values.items():
        if not _conforms(value, hints[name]):
            raise WireError(f"{cls.__name__}.{name}: a {type(value).__name__} does not fit {hints[name]}")
    try:
        return cls(**values)  # the class's own checks (__post_init__) run too
    except (TypeError, ValueError) as exc:
        raise WireError(f"{cls.__name__}: {exc}") from None


def _conforms(value: object, hint: Any) -> bool:
    """Whether a decoded `value` fits the annotation `hint` (the schema of a wire type's field)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if origin is typing.Literal:
        return any(type(value) is type(choice) and value == choice for choice in args)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (bool, str, bytes):
        return isinstance(value, hint)
    if hint is np.ndarray or origin is np.ndarray:
        return isinstance(value, np.ndarray)
    if origin in (list, tuple, dict):
        if not isinstance(value, origin):
            return False
        if origin is list:
            return all(_conforms(v, args[0]) for v in value) if args else True
        if origin is dict:
            return all(_conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items()) if args else True
        if args and args[-1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(_conforms(v, a) for v, a in zip(value, args, strict=True)) \
            if args else True
    if isinstance(hint, type) and hint in _TYPES.values():
        return isinstance(value, hint)
    return False  # an annotation the schema does not know: refuse rather than guess


def _is_namedtuple(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")

