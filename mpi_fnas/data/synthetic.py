"""``synthetic-shapes``: the offline default dataset, procedurally rendered RGB images of 10 shape classes.

Classes (index: kind), each drawn inside a box of half-extent ``R`` pixels around a random centre:

    0 disc           1 ring     2 filled square    3 hollow square   4 triangle (apex up or down)
    5 diagonal cross 6 plus     7 horizontal bars  8 vertical bars   9 diagonal stripes ("/")

Per example, independently of the class: centre, scale ``R`` in [0.22, 0.40]·S, stroke, stripe period and phase,
a random background colour, a foreground colour 0.3–0.7 away from it in every channel (either sign) and pixel noise
of a random level. So only the shape determines the class (docs/data.md says why this dataset).

Determinism: the image of example ``i`` depends only on ``(seed, split, image_size, i)``, not on the split size:
parameters are drawn in blocks of ``_BLOCK`` examples, each from a ``numpy`` Generator seeded with ``(seed, split,
block)``, and the pixel noise is a counter-based hash of a per-example key and the pixel position. Rendering any
subset of indices is bit-identical to rendering everything and slicing, and renders only those examples.
"""

from __future__ import annotations

import numpy as np
import torch

CLASS_NAMES: tuple[str, ...] = (
    "disc",
    "ring",
    "square",
    "hollow_square",
    "triangle",
    "cross",
    "plus",
    "horizontal_bars",
    "vertical_bars",
    "diagonal_stripes",
)
NUM_CLASSES = len(CLASS_NAMES)

# Examples per parameter block; fixed forever, since changing it changes every image.
_BLOCK = 4096
_SPLIT_CODES = {"train": 0, "test": 1, "aux": 2}  # aux: the server's SecProbe set
# Examples rendered at once; bounds the temporary uint64 noise-hash arrays (~6 MB each at 16×16).
_RENDER_CHUNK = 1024
# Mixed into every seed so these streams never coincide with other uses of the same user seed.
_STREAM_TAG = 0x5A4E7E5

# Pixel statistics of the clipped images in [0, 1] (measured over 50k training images; the same for all
# channels by symmetry), used to bring inputs to roughly zero mean and unit std.
PIXEL_MEAN = 0.5
PIXEL_STD = 0.281

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MIX1 = _U64(0xBF58476D1CE4E5B9)
_MIX2 = _U64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, elementwise on a uint64 array (wrapping arithmetic is intended)."""
    z = x ^ (x >> _U64(30))
    z = z * _MIX1
    z = z ^ (z >> _U64(27))
    z = z * _MIX2
    return z ^ (z >> _U64(31))


def _hash_noise(keys: np.ndarray, count: int) -> np.ndarray:
    """Approximately standard-normal noise, shape ``(len(keys), count)`` float32, a pure function of each key.

    Each 64-bit hash gives four 16-bit uniforms whose centred sum (Irwin–Hall, variance 1/3) is rescaled to
    unit variance. Only integer ops, + and * are used, so results are bit-identical however batched.
    """
    counters = np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
    h = _splitmix64(keys[:, None] + counters[None, :])
    mask16 = _U64(0xFFFF)
    total = np.zeros(h.shape, dtype=np.float32)
    for shift in (0, 16, 32, 48):
        total += ((h >> _U64(shift)) & mask16).astype(np.float32)
    # Each uniform is (k + 0.5) / 65536, mean 1/2; four of them have mean 2 and variance 1/3.
    uniform_sum = (total + np.float32(2.0)) * np.float32(1.0 / 65536.0)
    return (uniform_sum - np.float32(2.0)) * np.float32(np.sqrt(3.0))


def _stripe_distance(u: np.ndarray, period: np.ndarray, phase: np.ndarray) -> np.ndarray:
    """Signed distance (pixels, negative inside) to bands of width period/2 along coordinate ``u``."""
    t = u / period + phase
    frac = t - np.floor(t)
    return (np.abs(frac - np.float32(0.5)) - np.float32(0.25)) * period


def _signed_distance(label: int, x: np.ndarray, y: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
    """Signed distance in pixels (negative inside) of shape ``label`` at offsets ``x, y`` of shape (n, S, S).

    ``p`` holds per-example parameters already shaped (n, 1, 1).
    """
    radius, thick = p["radius"], p["thickness"]
    half_t = thick * np.float32(0.5)
    box = np.maximum(np.abs(x), np.abs(y)) - radius
    if label == 0:  # disc
        return np.sqrt(x * x + y * y) - radius
    if label == 1:  # ring whose outer edge is the disc's edge
        return np.abs(np.sqrt(x * x + y * y) - (radius - half_t)) - half_t
    if label == 2:  # filled square
        return box
    if label == 3:  # hollow square
        return np.abs(box + half_t) - half_t
    if label == 4:  # isosceles triangle, apex up or down: intersection of three half-planes
        yf = y * p["flip"]
        inv_sqrt5 = np.float32(1.0 / np.sqrt(5.0))
        base = yf - radius
        left = (-2.0 * x - (yf + radius)) * inv_sqrt5
        right = (2.0 * x - (yf + radius)) * inv_sqrt5
        return np.maximum(base, np.maximum(left, right))
    inv_sqrt2 = np.float32(1.0 / np.sqrt(2.0))
    if label == 5:  # X: both diagonals, clipped to the box
        arms = np.minimum(np.abs(x + y), np.abs(x - y)) * inv_sqrt2 - half_t
        return np.maximum(arms, box)
    if label == 6:  # plus
        return np.maximum(np.minimum(np.abs(x), np.abs(y)) - half_t, box)
    if label == 7:  # horizontal bars
        return np.maximum(_stripe_distance(y, p["period"], p["phase"]), box)
    if label == 8:  # vertical bars
        return np.maximum(_stripe_distance(x, p["period"], p["phase"]), box)
    if label == 9:  # diagonal stripes
        return np.maximum(_stripe_distance((x + y) * inv_sqrt2, p["period"], p["phase"]), box)
    raise AssertionError(f"unknown shape label {label}")


class SyntheticShapes:
    """One split of ``synthetic-shapes``: ``size`` examples of ``image_size``×``image_size`` RGB images.

    ``labels`` is available without rendering; ``render(indices)`` draws only the requested examples.
    """

    name = "synthetic-shapes"
    num_classes = NUM_CLASSES
    in_channels = 3

    def __init__(self, split: str, size: int, image_size: int = 16, seed: int = 0) -> None:
        if split not in _SPLIT_CODES:
            raise ValueError(f"split must be one of {sorted(_SPLIT_CODES)}, got {split!r}")
        if int(size) < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if int(image_size) < 8:
            raise ValueError(f"image_size must be >= 8, got {image_size}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.split = split
        self.size = int(size)
        self.image_size = int(image_size)
        self.seed = int(seed)
        self._params = self._draw_parameters()

    def __len__(self) -> int:
        return self.size

    @property
    def labels(self) -> np.ndarray:
        """Class of every example, int64 (size,). No rendering involved."""
        return self._params["label"]

    def _draw_parameters(self) -> dict[str, np.ndarray]:
        """All per-example parameters, each an array of leading dimension ``size``."""
        s = np.float32(self.image_size)
        blocks: list[dict[str, np.ndarray]] = []
        for block in range((self.size + _BLOCK - 1) // _BLOCK):
            rng = np.random.default_rng([_STREAM_TAG, self.seed, _SPLIT_CODES[self.split], block])
            # Each block's labels are a shuffled, exactly balanced sequence, so any prefix is near-balanced.
            label = rng.permutation(np.arange(_BLOCK) % NUM_CLASSES).astype(np.int64)
            radius = (rng.uniform(0.22, 0.40, _BLOCK) * s).astype(np.float32)
            centre = radius[:, None] + rng.uniform(0.0, 1.0, (_BLOCK, 2)).astype(np.float32) * (
                s - 2.0 * radius[:, None]
            )
            thickness = radius * rng.uniform(0.30, 0.45, _BLOCK).astype(np.float32)
            period = 2.0 * radius / rng.uniform(1.8, 2.8, _BLOCK).astype(np.float32)
            phase = rng.uniform(0.0, 1.0, _BLOCK).astype(np.float32)
            flip = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), _BLOCK)
            background = rng.uniform(0.0, 1.0, (_BLOCK, 3)).astype(np.float32)
            # Per-channel offset of 0.3–0.7 modulo 1: guaranteed contrast, random polarity.
            offset = rng.uniform(0.3, 0.7, (_BLOCK, 3)).astype(np.float32)
            foreground = np.mod(background + offset, np.float32(1.0))
            noise_std = rng.uniform(0.02, 0.12, _BLOCK).astype(np.float32)
            noise_key = rng.integers(0, np.iinfo(np.uint64).max, _BLOCK, dtype=np.uint64, endpoint=True)
            blocks.append(
                {
                    "label": label,
                    "radius": radius,
                    "cx": centre[:, 0].copy(),
                    "cy": centre[:, 1].copy(),
                    "thickness": thickness,
                    "period": period,
                    "phase": phase,
                    "flip": flip,
                    "background": background,
                    "foreground": foreground,
                    "noise_std": noise_std,
                    "noise_key": noise_key,
                }
            )
        return {k: np.concatenate([b[k] for b in blocks])[: self.size] for k in blocks[0]}

    def render(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Render examples ``indices`` (1-D ints in [0, size)).

        Returns x float32 (N, 3, S, S), normalised to roughly zero mean / unit std, and y int64 (N,), on CPU.
        """
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise ValueError("indices must be a 1-D integer array")
        idx = idx.astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.size):
            raise IndexError(f"indices out of range [0, {self.size})")
        image = np.empty((idx.size, 3, self.image_size, self.image_size), dtype=np.float32)
        # Chunks bound the memory of the uint64 noise hashes; results do not depend on the chunking.
        for start in range(0, idx.size, _RENDER_CHUNK):
            stop = min(start + _RENDER_CHUNK, idx.size)
            image[start:stop] = self._render_unit_range(idx[start:stop])
        image -= np.float32(PIXEL_MEAN)
        image *= np.float32(1.0 / PIXEL_STD)
        return torch.from_numpy(image), torch.from_numpy(self.labels[idx])

    def _render_unit_range(self, idx: np.ndarray) -> np.ndarray:
        """Images of examples ``idx`` with pixel values in [0, 1], float32 (N, 3, S, S)."""
        p = {k: v[idx] for k, v in self._params.items()}
        n, s = idx.size, self.image_size

        centres = np.arange(s, dtype=np.float32) + np.float32(0.5)  # pixel centres
        mask = np.empty((n, s, s), dtype=np.float32)
        for label in np.unique(p["label"]):
            rows = np.flatnonzero(p["label"] == label)
            q = {k: v[rows][:, None, None] for k, v in p.items() if v.ndim == 1}
            x = centres[None, None, :] - q["cx"]
            y = centres[None, :, None] - q["cy"]
            dist = _signed_distance(int(label), x, y, q)
            # Area coverage of a pixel by the shape, approximated from the signed distance (anti-aliasing).
            mask[rows] = np.clip(np.float32(0.5) - dist, 0.0, 1.0)

        bg = p["background"][:, :, None, None]
        fg = p["foreground"][:, :, None, None]
        image = bg + (fg - bg) * mask[:, None, :, :]
        noise = _hash_noise(p["noise_key"], 3 * s * s).reshape(n, 3, s, s)
        image += p["noise_std"][:, None, None, None] * noise
        return np.clip(image, 0.0, 1.0, out=image)
