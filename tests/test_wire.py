"""The data-only wire format: what a rank sends is rebuilt as plain data or a registered dataclass,
and nothing received is ever executed."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pytest
from conftest import ROOT

from mpi_fnas.federation.job_plan import Assignment
from mpi_fnas.privacy.params import DPParams
from mpi_fnas.wire import WireError, decode, encode, wire_type


@wire_type
@dataclass(frozen=True)
class Example:
    count: int
    rate: float
    label: Literal["a", "b"]
    values: np.ndarray
    note: str | None = None


def roundtrip(obj: object) -> object:
    return decode(encode(obj))


def test_plain_values_round_trip_exactly():
    value = {"device": "cpu", 3: b"\x00\xff" * 16, "n": [1, 2.5, None, True, (4, "x")], "nan": math.nan,
             "inf": -math.inf, "big": 2**70}
    got = roundtrip(value)
    assert got.keys() == value.keys() and isinstance(got["n"][-1], tuple)
    assert got[3] == value[3] and got["big"] == 2**70 and math.isnan(got["nan"]) and got["inf"] == -math.inf
    assert roundtrip(("error", "party 1: no data")) == ("error", "party 1: no data")


def test_arrays_keep_dtype_shape_and_values():
    for array in (np.arange(12, dtype=np.int64).reshape(3, 4), np.array([], dtype=np.float32),
                  np.array([True, False]), np.float64([[math.pi]])):
        got = roundtrip(array)
        assert got.dtype == array.dtype and got.shape == array.shape
        np.testing.assert_array_equal(got, array)
        assert got.flags.writeable


def test_a_registered_dataclass_is_rebuilt_by_its_constructor():
    got = roundtrip(Example(3, 0.5, "b", np.ones(2)))
    assert isinstance(got, Example) and got.count == 3 and got.label == "b" and got.note is None
    assignment = Assignment(np.arange(5), np.arange(5, 7), 4, steps=8,
                            dp=DPParams(1.0, 1.1, 0.01, 0.1, 8.0, parties=2, aggregation="secure"))
    back = roundtrip(assignment)
    assert isinstance(back.dp, DPParams) and back.dp == assignment.dp
    np.testing.assert_array_equal(back.train_indices, assignment.train_indices)


@pytest.mark.parametrize("value", [object(), {1.5: 2}, np.array(["a"], dtype=object), {True: 1}, set()])
def test_what_is_not_data_cannot_be_sent(value):
    with pytest.raises(WireError):
        encode(value)


def forged(header: str, *blobs: bytes) -> bytes:
    raw = header.encode()
    return len(raw).to_bytes(8, "big") + raw + b"".join(blobs)


@pytest.mark.parametrize(("message", "reason"), [
    (b"\x00\x00", "shorter"),
    (forged('{"$t": "object", "type": "Popen", "fields": {}}'), "unknown wire type"),
    (forged('{"$t": "object", "type": "Example", "fields": {"count": 1}}'), "fields"),
    (forged('{"$t": "object", "type": "Example", "fields": {"count": "1", "rate": 1, "label": "a", "values": null,'
            ' "note": null}}'), "does not fit"),
    (forged('{"$t": "object", "type": "Example", "fields": {"count": 1, "rate": 1, "label": "c",'
            ' "values": {"$t": "array", "blob": 0, "dtype": "<f8", "shape": [0]}, "note": null}}'), "does not fit"),
    (forged('{"$t": "array", "blob": 0, "dtype": "|O", "shape": [1]}', bytes(8)), "dtype"),
    (forged('{"$t": "array", "blob": 0, "dtype": "<f8", "shape": [4]}', bytes(8)), "past the end"),
    (forged('{"$t": "bytes", "blob": 0, "size": 2}', b"abc"), "after the last blob"),
    (forged('{"$t": "eval", "code": "1"}'), "malformed"),
    (forged('{"untagged": 1}'), "untagged"),
    (forged("[" * 100 + "]" * 100), "deeply"),
    (pickle.dumps({"a": 1}), "header"),
])
def test_a_malformed_or_foreign_message_is_refused(message, reason):
    with pytest.raises(WireError, match=reason):
        decode(message)


def test_a_pickle_is_refused_and_never_executed(tmp_path):
    """A pickle whose loading would create a file: decode refuses it, and the file is never made."""
    marker = tmp_path / "pwned"
    code = textwrap.dedent(f"""
        import os, pickle
        from mpi_fnas.wire import WireError, decode

        class Exploit:
            def __reduce__(self):
                return (os.system, ("touch {marker}",))

        try:
            decode(pickle.dumps(Exploit()))
        except WireError as exc:
            print("refused:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused:")
    assert not marker.exists()
