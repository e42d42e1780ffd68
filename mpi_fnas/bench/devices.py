"""The search's party step on several torch devices side by side (``python -m mpi_fnas.bench --devices cpu,cuda``).

Each device gets the same network, initial weights and inputs (:func:`~mpi_fnas.bench.party_step.make_party`),
plain and private; the steps are timed in alternation, repetition by repetition, so that a load change hits every
device alike. A release ends by copying its vector to the host, so a GPU's time includes the wait for its kernels.
One process, no MPI: the exchange is not part of it.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

from mpi_fnas.bench.party_step import make_party, timed
from mpi_fnas.config import Config

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def parse_devices(text: str) -> list[str]:
    """The devices of ``--devices`` (comma-separated ``cpu``, ``cuda`` or ``cuda:N``, no repeats), in order.

    Raises:
        ValueError: an unknown or repeated name, or none at all.
    """
    devices = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in devices if not _DEVICE.fullmatch(d)]
    if not devices or bad or len(set(devices)) != len(devices):
        raise ValueError(f"--devices must list distinct devices among cpu, cuda, cuda:N (comma-separated), "
                         f"got {text!r}")
    return devices


def check_visible(devices: list[str]) -> None:
    """Raise ValueError if one of `devices` is a CUDA device this process cannot see."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device in devices:
        if device.startswith("cuda") and (int(device.partition(":")[2] or 0) >= count):
            raise ValueError(f"--devices: {device} requested but {count} CUDA device(s) are visible")


def compare_devices(cfg: Config, repeats: int, devices: list[str]) -> dict[str, Any]:
    """Median wall seconds of the plain and the private party step (W release + A release) on each of `devices`,
    their speed-ups against the first device, and each CUDA device's peak allocated memory (MB) over the run."""
    import torch

    from mpi_fnas.privacy.validators import PrivacyError

    for device in devices:
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(device)
    parties: dict[tuple[str, str], Any] = {}
    note = None
    for device in devices:
        parties[device, "plain"] = make_party(cfg, private=False, device=device)
        try:  # a DP party refuses a sample-mixing model when it is built
            parties[device, "dp"] = make_party(cfg, private=True, device=device)
        except PrivacyError as exc:
            note = f"private step not timed: {exc}"
    times: dict[tuple[str, str], list[float]] = {key: [] for key in parties}
    for i in range(repeats + 1):
        for key, party in parties.items():
            seconds = timed(party.w_release)[0] + timed(party.a_release)[0]
            if i:  # the first round warms up allocators, kernels and (on a GPU) the context
                times[key].append(seconds)
    med = {key: statistics.median(v) for key, v in times.items()}
    first = devices[0]
    plain = parties[first, "plain"]
    report: dict[str, Any] = {
        "devices": devices,
        "batch_size": cfg.search.batch_size,
        "num_w": plain.num_w,
        "num_a": plain.num_a,
        "repeats": repeats,
        "threads_per_rank": torch.get_num_threads(),
        "step_seconds": {d: med[d, "plain"] for d in devices},
        "dp_step_seconds": {d: med.get((d, "dp")) for d in devices},
        "step_speedup": {d: med[first, "plain"] / med[d, "plain"] for d in devices},
        "dp_step_speedup": {d: med[first, "dp"] / med[d, "dp"] if (d, "dp") in med and (first, "dp") in med else None
                            for d in devices},
        "peak_memory_mb": {d: torch.cuda.max_memory_allocated(d) / 1e6 if d.startswith("cuda") else None
                           for d in devices},
        "device_names": {d: torch.cuda.get_device_name(d) if d.startswith("cuda") else "cpu" for d in devices},
    }
    if note is not None:
        report["dp_note"] = note
    return report
