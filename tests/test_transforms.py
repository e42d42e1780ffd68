"""dp_accounting's FFTs by numpy.fft (mpi_fnas.privacy.transforms): the same transforms, and no plans kept."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import scipy.fft
from scipy import signal

from mpi_fnas.privacy.transforms import NumpyTransforms, numpy_transforms


@pytest.mark.parametrize("norm", [None, "ortho", "forward"])
def test_numpy_transforms_are_scipys_transforms(norm):
    rng = np.random.default_rng(0)
    x = rng.random(1000)
    z = rng.random((30, 40)) + 1j * rng.random((30, 40))
    expected = {
        "fft": scipy.fft.fft(x, 1200, norm=norm), "ifft": scipy.fft.ifft(x, norm=norm),
        "rfft": scipy.fft.rfft(x, 1100, norm=norm), "irfft": scipy.fft.irfft(z[0], 77, norm=norm),
        "fftn": scipy.fft.fftn(z, (32, 50), norm=norm), "ifftn": scipy.fft.ifftn(z, axes=(0,), norm=norm),
        "rfftn": scipy.fft.rfftn(z.real, (40, 45), norm=norm), "irfftn": scipy.fft.irfftn(z, (30, 60), norm=norm),
        "dct": scipy.fft.dct(x, norm=norm),
    }
    with numpy_transforms():
        got = {
            "fft": scipy.fft.fft(x, 1200, norm=norm), "ifft": scipy.fft.ifft(x, norm=norm),
            "rfft": scipy.fft.rfft(x, 1100, norm=norm), "irfft": scipy.fft.irfft(z[0], 77, norm=norm),
            "fftn": scipy.fft.fftn(z, (32, 50), norm=norm), "ifftn": scipy.fft.ifftn(z, axes=(0,), norm=norm),
            "rfftn": scipy.fft.rfftn(z.real, (40, 45), norm=norm),
            "irfftn": scipy.fft.irfftn(z, (30, 60), norm=norm),
            "dct": scipy.fft.dct(x, norm=norm),  # numpy has no DCT: scipy computes it
        }
    for name in expected:
        assert got[name].shape == expected[name].shape, name
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_the_backend_takes_dp_accountings_transforms_on_this_thread_only(monkeypatch):
    calls: list[str] = []
    transforms = dict(NumpyTransforms.TRANSFORMS)

    def counted(name):
        def transform(*args, **kwargs):
            calls.append(name)
            return transforms[name](*args, **kwargs)
        return transform

    monkeypatch.setattr(NumpyTransforms, "TRANSFORMS", {name: counted(name) for name in transforms})
    x = np.random.default_rng(1).random(5000)
    signal.fftconvolve(x, x[:3000])
    assert calls == []  # outside the block: scipy's own
    with numpy_transforms():
        signal.fftconvolve(x, x[:3000])  # dp_accounting's compose
        scipy.fft.ifft(scipy.fft.fft(x, 8192))  # dp_accounting's self_compose
    assert calls == ["rfftn", "rfftn", "irfftn", "fft", "ifft"]


_GROWTH = """
import json, re
from mpi_fnas.privacy.accountant import PrivacyLedger

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
    out = subprocess.run([sys.executable, "-c", _GROWTH], capture_output=True, text=True, check=True, timeout=300)
    grown = json.loads(out.stdout.strip().splitlines()[-1])["grown_mb"]
    assert grown < 40, f"the ledger's process grew by {grown:.0f} MB over 10 ε computations"
