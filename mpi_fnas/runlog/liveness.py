"""The writer's liveness record (``/writer``) and the rule that tells a live writer from a dead one.

When any rank is SIGKILLed, mpirun kills rank 0 too, so nothing gets to write a final status: the file says
``running`` forever. The writer therefore records who it is (host, PID, process identity, when it took the file)
and a heartbeat time, in small fixed-size datasets: SWMR allows overwriting a dataset's values in place (then
``flush``), never changing attributes, so these are datasets, not attributes.

A reader decides "the writer is dead" by one of two rules:

* Same kernel and PID namespace as the writer (the ``process`` identity matches this machine's scope): the
  writer is alive exactly when its PID exists, is not a zombie and started at the recorded kernel tick. This
  rule is authoritative; a live writer is never judged by its heartbeat there, so a long step is not a death.
* Anywhere else (another node, another container): the heartbeat is older than ``stale_after`` seconds. This
  compares two hosts' clocks; ``stale_after`` must exceed the longest gap between heartbeats (one step).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

WRITER_GROUP = "writer"
HOST_BYTES = 255  # HOST_NAME_MAX is 64 on Linux; FQDNs may be longer
PROCESS_BYTES = 128  # "<boot id (36)>/pid:[<inode>]/<ticks>"
# /writer's datasets, one scalar per WriterRecord field.
_RECORD_DTYPES = {"host": f"S{HOST_BYTES}", "pid": np.int64, "process": f"S{PROCESS_BYTES}", "started": np.float64,
                  "heartbeat": np.float64}


@dataclass(frozen=True)
class WriterRecord:
    """Contents of ``/writer``.

    host: hostname of the writer. pid: its process id. process: ``"<boot id>/<pid namespace>/<start tick>"`` of
    that process on Linux, ``""`` where /proc is unavailable. started: Unix time (s) the writer took the file
    (create or reopen). heartbeat: Unix time (s) of its last sign of life.
    """

    host: str
    pid: int
    process: str
    started: float
    heartbeat: float


def current_writer() -> WriterRecord:
    """The record of this process, taking the file now."""
    now = time.time()
    pid = os.getpid()
    return WriterRecord(socket.gethostname(), pid, process_identity(pid), now, now)


def machine_scope() -> str:
    """``"<boot id>/<pid namespace>"`` of this process: two processes see the same PIDs exactly when their
    scopes are equal. ``""`` where /proc is unavailable."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")  # e.g. "pid:[4026531836]"
    except OSError:
        return ""
    return f"{boot_id}/{namespace}"


def process_identity(pid: int) -> str:
    """``"<machine scope>/<start tick>"`` of the live process ``pid`` as seen from here; ``""`` if there is no such
    process, it is a zombie (killed, not yet reaped), or /proc is unavailable. The start tick (clock ticks
    after boot, immune to wall-clock changes) tells a reused PID from the original process."""
    scope = machine_scope()
    if not scope:
        return ""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # proc(5): field 2 (comm) may contain spaces and ")", so split after the last ")": field 3 (state) comes
    # first there and field 22 (starttime) is the 20th.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return ""
    return f"{scope}/{fields[19]}"


def store_writer_record(handle: h5py.File, record: WriterRecord) -> None:
    """Write ``record`` into ``/writer``, creating the group first if needed (only outside SWMR mode)."""
    if WRITER_GROUP not in handle:
        group = handle.create_group(WRITER_GROUP)
        for name, dtype in _RECORD_DTYPES.items():
            group.create_dataset(name, shape=(), dtype=dtype)
    group = handle[WRITER_GROUP]
    for name, dtype in _RECORD_DTYPES.items():
        value = getattr(record, name)  # text is cut to its dataset's bytes
        group[name][()] = value.encode("utf-8")[: np.dtype(dtype).itemsize] if isinstance(value, str) else value


def read_writer_record(handle: h5py.File) -> WriterRecord:
    """``/writer`` as stored in an open log (a fresh open sees the latest flushed values)."""
    group = handle[WRITER_GROUP]
    return WriterRecord(
        host=group["host"][()].decode("utf-8", errors="replace"),  # truncation may have split a character
        pid=int(group["pid"][()]),
        process=group["process"][()].decode("utf-8", errors="replace"),
        started=float(group["started"][()]),
        heartbeat=float(group["heartbeat"][()]),
    )


def alive_here(record: WriterRecord) -> bool | None:
    """Whether the writer process is alive, when this machine can tell (same kernel and PID namespace);
    None when it cannot (other host or container, no /proc)."""
    scope = machine_scope()
    if not record.process or not scope or record.process.rsplit("/", 1)[0] != scope:
        return None
    return process_identity(record.pid) == record.process


def writer_gone_reason(record: WriterRecord, *, now: float, stale_after: float) -> str | None:
    """Why the writer of a log still marked ``running`` must be dead, or None if it may be alive.

    now: Unix time (s) of the judgement. stale_after: seconds without a heartbeat after which a writer that
    this machine cannot check directly counts as dead.
    """
    alive = alive_here(record)
    if alive is True:
        return None
    if alive is False:
        return f"writer died: process {record.pid} on {record.host} is gone"
    silence = now - record.heartbeat
    if silence > stale_after:
        return (f"writer stopped heartbeating: process {record.pid} on {record.host} last heartbeat "
                f"{silence:.0f} s ago (stale after {stale_after:g} s)")
    return None
