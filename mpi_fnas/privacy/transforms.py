"""dp_accounting's Fourier transforms computed by numpy.fft, which keeps no plans between calls.

dp_accounting composes privacy loss distributions by FFT: ``self_compose`` through ``scipy.fft.fft``/``ifft``,
``compose`` through ``scipy.signal.fftconvolve`` (``rfftn``/``irfftn``). scipy's pocketfft keeps the plans of the
last 16 lengths of every transform type in static caches (a plan of length n holds ~8 n bytes of twiddle factors for
real input, ~16 n for complex), and frees one only when a newer length displaces it. The lengths grow with the
composed steps, so rank 0, which computes ε at every logged row and calibrates σ over dozens of compositions, kept
those caches full of ever larger plans. Measured here (docs/log/benchmarks.md, "fifth round"): 20 ε of growing
length left 133 MB resident in scipy's caches, 6 MB with numpy.fft (numpy ≥ 2, the same pocketfft without a plan
cache), in the same time, ε equal to 1e-9 relative or closer.

:func:`numpy_transforms` is a context manager: inside it, on the calling thread only (scipy's backends are
thread-local), the transforms numpy implements go to :mod:`numpy.fft`; any other, a call with a precomputed
``plan`` or one with repeated axes (which scipy refuses), falls through to scipy's own. No MPI, no autograd.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import scipy.fft


def _one_axis(name: str) -> Callable[..., Any]:
    """scipy's signature of a one-axis transform, computed by numpy.fft's `name` (overwrite_x and workers are
    hints that do not change the result)."""
    numpy_transform = getattr(np.fft, name)

    def transform(x: Any, n: int | None = None, axis: int = -1, norm: str | None = None, overwrite_x: bool = False,
                  workers: int | None = None, *, plan: Any = None) -> Any:
        if plan is not None:
            return NotImplemented
        return numpy_transform(x, n=n, axis=axis, norm=norm)

    return transform


def _many_axes(name: str) -> Callable[..., Any]:
    """scipy's signature of an n-axis transform, computed by numpy.fft's `name`."""
    numpy_transform = getattr(np.fft, name)

    def transform(x: Any, s: Any = None, axes: Any = None, norm: str | None = None, overwrite_x: bool = False,
                  workers: int | None = None, *, plan: Any = None) -> Any:
        if plan is not None:
            return NotImplemented
        s = (s,) if isinstance(s, numbers.Integral) else s  # scipy takes one length or axis as a plain integer
        axes = (axes,) if isinstance(axes, numbers.Integral) else axes
        if s is not None and axes is None:  # numpy (≥ 2.0) wants the axes whenever the shape is given
            axes = tuple(range(-len(s), 0))
        if axes is not None and len({axis % max(np.ndim(x), 1) for axis in axes}) != len(axes):
            return NotImplemented  # repeated axes: scipy raises where numpy would transform twice
        return numpy_transform(x, s=s, axes=axes, norm=norm)

    return transform


class NumpyTransforms:
    """A scipy.fft backend (the uarray protocol): ``fft``, ``ifft``, ``rfft``, ``irfft`` and their n-axis forms by
    numpy.fft; ``NotImplemented`` for the rest, which scipy then computes itself."""

    __ua_domain__ = "numpy.scipy.fft"
    TRANSFORMS: ClassVar[dict[str, Callable[..., Any]]] = {
        **{name: _one_axis(name) for name in ("fft", "ifft", "rfft", "irfft")},
        **{name: _many_axes(name) for name in ("fftn", "ifftn", "rfftn", "irfftn")},
    }

    @staticmethod
    def __ua_function__(method: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        transform = NumpyTransforms.TRANSFORMS.get(method.__name__)
        return NotImplemented if transform is None else transform(*args, **kwargs)


@contextmanager
def numpy_transforms() -> Iterator[None]:
    """Within the block, on this thread, scipy.fft's transforms that numpy has are numpy.fft's (no plan cache)."""
    with scipy.fft.set_backend(NumpyTransforms):
        yield
