"""Each rank's peak resident memory, read from /proc while a local point runs (Linux; elsewhere nothing).

The study's runner started every rank on this machine, so it reads their ``VmHWM`` (the kernel's high-water mark
of resident memory) the way ``top`` would: an operator's measurement of its own processes, not something a party
sends. A run's log holds rank 0's peak only (``/cost`` ``rss_peak_mb_server``): under DP a party's peak follows its
realised Poisson batches, which depend on its data. So RUN_DIR/rss.csv, which anyone reading the run directory sees,
keeps the parties' peaks only where they are public (:func:`public_peaks`): no DP, or the synthetic data.
"""

from __future__ import annotations

import csv
import io
import threading
from pathlib import Path

RSS_FILE = "rss.csv"  # in the point's run directory
PUBLIC_DATASETS = ("synthetic-shapes",)  # drawn from a public seed: nothing in them is anybody's
_PROC = Path("/proc")


def _children(proc: Path) -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state": ppid
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def rank_of(pid: int, proc: Path = _PROC) -> int | None:
    """The MPI rank of process `pid` (``PMI_RANK`` in its environment), or None."""
    try:
        environ = (proc / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"PMI_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


def _hwm_mb(proc: Path, pid: int) -> float | None:
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6  # kB (KiB) -> MB (10^6 bytes)
    except OSError:
        return None
    return None


def sample_ranks(root_pid: int, proc: Path = _PROC) -> dict[int, float]:
    """{rank: peak MB so far} of the processes below `root_pid` (the launcher) that carry a ``PMI_RANK``."""
    tree = _children(proc)
    found: dict[int, float] = {}
    todo = list(tree.get(root_pid, []))
    while todo:
        pid = todo.pop()
        todo += tree.get(pid, [])
        rank = rank_of(pid, proc)
        mb = _hwm_mb(proc, pid) if rank is not None else None
        if rank is not None and mb is not None:
            found[rank] = max(found.get(rank, 0.0), mb)
    return found


class RssSampler:
    """Samples :func:`sample_ranks` every `interval` seconds in a thread until :meth:`stop`, keeping each rank's
    largest ``VmHWM`` (it only grows, so the last sample before a rank exits is its peak, up to one interval)."""

    def __init__(self, root_pid: int, interval: float = 0.5, proc: Path = _PROC) -> None:
        self.peaks: dict[int, float] = {}
        self._root, self._interval, self._proc = root_pid, interval, proc
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._done.is_set():
            if self._proc.is_dir():
                for rank, mb in sample_ranks(self._root, self._proc).items():
                    self.peaks[rank] = max(self.peaks.get(rank, 0.0), mb)
            self._done.wait(self._interval)

    def stop(self) -> dict[int, float]:
        """Stop sampling; the peaks by rank."""
        self._done.set()
        self._thread.join()
        return dict(sorted(self.peaks.items()))


def public_peaks(peaks: dict[int, float], mode: str, dataset: str) -> dict[int, float]:
    """The peaks that may be written beside the log: every rank's, unless the run is private (``dpfnas``) on data
    that is not public; then rank 0's only (its peak is in the log already)."""
    if mode != "dpfnas" or dataset in PUBLIC_DATASETS:
        return dict(peaks)
    return {rank: mb for rank, mb in peaks.items() if rank == 0}


def write_rss(run_dir: Path, peaks: dict[int, float]) -> None:
    """Store the peaks in RUN_DIR/rss.csv (``rank,peak_mb``; nothing when none was seen)."""
    if peaks:
        lines = ["rank,peak_mb", *(f"{rank},{mb:.1f}" for rank, mb in sorted(peaks.items()))]
        (run_dir / RSS_FILE).write_text("\n".join(lines) + "\n")


def read_rss(run_dir: Path) -> dict[int, float]:
    """The peaks of RUN_DIR/rss.csv by rank; {} when the point has none (a cluster run, an unreadable file)."""
    try:
        rows = csv.DictReader(io.StringIO((run_dir / RSS_FILE).read_text()))
        return {int(row["rank"]): float(row["peak_mb"]) for row in rows}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
