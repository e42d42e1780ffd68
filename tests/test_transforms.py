"""dp_accounting's FFTs by numpy.fft (mpi_fnas.privacy.transforms): the same transforms, and no plans kept."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import scipy.fft
from scipy import signal

from mpi_fnas.privacy import PrivacyLedger, calibrate_noise_multiplier
from mpi_fnas.privacy.transforms import NumpyTransforms, numpy_transforms


@pytest.mark.parametrize("norm", [None, "ortho", "forward"])
def test_numpy_transforms_are_scipys_transforms(norm):
    rng = np.random.default_rng(0)
    x = rng.random(1000)
    z = rng.random((30, 40)) + 1j * rng.random((30, 40))

    def transforms() -> dict[str, np.ndarray]:
        return {
            "fft": scipy.fft.fft(x, 1200, norm=norm), "ifft": scipy.fft.ifft(x, norm=norm),
            "rfft": scipy.fft.rfft(x, 1100, norm=norm), "irfft": scipy.fft.irfft(z[0], 77, norm=norm),
            "fft axis 0": scipy.fft.fft(z, 50, axis=0, norm=norm), "irfft axis 0": scipy.fft.irfft(z, axis=0),
            "fftn": scipy.fft.fftn(z, (32, 50), norm=norm), "ifftn": scipy.fft.ifftn(z, axes=(0,), norm=norm),
            "fftn one length": scipy.fft.fftn(z, 25, norm=norm), "fftn one axis": scipy.fft.fftn(z, axes=0),
            "rfftn": scipy.fft.rfftn(z.real, (40, 45), norm=norm), "irfftn": scipy.fft.irfftn(z, (30, 60), norm=norm),
            "dct": scipy.fft.dct(x, norm=norm),  # numpy has no DCT: scipy computes it inside the block too
        }

    expected = transforms()
    with numpy_transforms(), warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy ≥ 2 warns where a shape comes without its axes
        got = transforms()
        with pytest.raises(ValueError, match="unique"):  # repeated axes: scipy's refusal, not a double transform
            scipy.fft.fftn(z, axes=(0, -2))
    for name in expected:
        assert got[name].shape == expected[name].shape, name
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-10, atol=1e-12, err_msg=name)


class Recorder:
    """A scipy.fft backend that records what reaches it and lets scipy compute it."""

    __ua_domain__ = "numpy.scipy.fft"
    calls: ClassVar[list[str]] = []

    @staticmethod
    def __ua_function__(method, args, kwargs):
        Recorder.calls.append(method.__name__)
        return NotImplemented


@pytest.fixture
def numpy_calls(monkeypatch) -> list[tuple[str, str]]:
    """(transform, thread name) of every call the numpy backend computes."""
    calls: list[tuple[str, str]] = []
    transforms = dict(NumpyTransforms.TRANSFORMS)

    def counted(name):
        def transform(*args, **kwargs):
            calls.append((name, threading.current_thread().name))
            return transforms[name](*args, **kwargs)
        return transform

    monkeypatch.setattr(NumpyTransforms, "TRANSFORMS", {name: counted(name) for name in transforms})
    return calls


def test_the_backend_takes_dp_accountings_transforms_on_the_calling_thread_only(numpy_calls):
    x = np.random.default_rng(1).random(5000)
    signal.fftconvolve(x, x[:3000])
    assert numpy_calls == []  # outside the block: scipy's own
    with numpy_transforms():
        signal.fftconvolve(x, x[:3000])  # what dp_accounting's compose calls
        scipy.fft.ifft(scipy.fft.fft(x, 8192))  # what its self_compose calls
        other = threading.Thread(target=scipy.fft.fft, args=(x,), name="other")
        other.start()
        other.join()
    assert numpy_calls == [(name, "MainThread") for name in ("rfftn", "rfftn", "irfftn", "fft", "ifft")]


def test_the_ledgers_compositions_leave_no_transform_to_scipy(numpy_calls):
    """A real ε (two runs: self_compose and compose) and a real σ calibration: numpy computes their transforms and
    none falls through to scipy (Recorder, the next backend in line, would see it)."""
    Recorder.calls.clear()
    with scipy.fft.set_backend(Recorder):
        epsilon = PrivacyLedger.from_runs(((0.85, 0.016, 137), (1.0, 0.008, 11))).get_epsilon(1e-5)
        sigma = calibrate_noise_multiplier(2.0, 1e-5, 0.05, 23, value_discretization_interval=1e-3)
        assert Recorder.calls == []
        scipy.fft.fft(np.ones(8))  # the recorder does see a transform outside the accountant's block
    assert Recorder.calls == ["fft"]
    assert {name for name, _ in numpy_calls} >= {"fft", "ifft", "rfftn", "irfftn"}
    assert epsilon > 0 and sigma > 0


_GROWTH = """
import json, re
from mpi_fnas.privacy.shard_ledger import PrivacyLedger

def anonymous_mb():
    return int(re.search(r"Anonymous:\\s+(\\d+)", open("/proc/self/smaps_rollup").read()).group(1)) / 1024

PrivacyLedger.from_runs(((0.85, 0.016, 20), (1.0, 0.008, 10))).get_epsilon(1e-5)  # the one-step PLDs, cached
before = anonymous_mb()
for steps in range(50, 1500, 150):  # 10 compositions, each of a new length, as a run's logged rows are
    PrivacyLedger.from_runs(((0.85, 0.016, steps), (1.0, 0.008, 10))).get_epsilon(1e-5)
print(json.dumps({"grown_mb": anonymous_mb() - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps_rollup")
def test_a_ledger_computing_epsilon_at_growing_step_counts_keeps_no_transform_plans():
    """The ε of 10 growing compositions: scipy's pocketfft kept ~120 MB of plans for them (mpi_fnas.privacy.
    transforms); through numpy.fft a fresh process grows by a few MB."""
    out = subprocess.run([sys.executable, "-c", _GROWTH], capture_output=True, text=True, check=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])  # this checkout's mpi_fnas, whatever is installed
    grown = json.loads(out.stdout.strip().splitlines()[-1])["grown_mb"]
    assert grown < 40, f"the ledger's process grew by {grown:.0f} MB over 10 ε computations"
