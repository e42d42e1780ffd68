"""The memory a job will need, planned on rank 0 before any party computes: the expected peak resident memory of
each rank and of each node, and the refusal of a placement that cannot fit.

Every rank reports only public machine facts (:func:`node_facts`: its host name and the memory its node gives the
job). The estimate is a pure function of the config, the world size and those facts; no party measures or sends its
own memory, because a DP party's peak is data-dependent (its activations grow with the realised Poisson batch).

The model, per rank, in MB (10^6 bytes), fitted as docs/benchmarks.md, "Memory per rank" says:

* a party: runtime + ``PARTY_MODULES_MB`` + ``PARTY_WORKING_MB`` + its examples + ``SEARCH_STEP_FACTOR`` × the
  supernet's step + ``AUGMENT_STEP_FACTOR`` × the augmentation network's step, where a step is B_max × (the bytes
  autograd saves per example + one per-example gradient), B_max = B + 3√B under DP and B otherwise, at most
  ``runtime.max_physical_batch``;
* rank 0: runtime + ``SERVER_MODULES_MB`` + its test split + ``SERVER_WORKING_MB``; "runtime" is rank 0's resident
  memory with torch imported.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from mpi_fnas.config import Config
from mpi_fnas.wire import wire_type

# The terms of the model (docs/benchmarks.md, "Memory per rank"); their measurements: docs/log/benchmarks.md.
PARTY_MODULES_MB = 12.0  # mpi4py and a party's modules above torch
PARTY_WORKING_MB = 100.0  # what a party's allocator keeps whatever its steps (30 until the DPNAS default's refit)
SERVER_MODULES_MB = 100.0  # rank 0's planner, ledgers and log: dp_accounting, scipy, h5py
SERVER_WORKING_MB = 140.0  # rank 0's evaluation, ledger worker and log writer, with room for run-to-run spread
SEARCH_STEP_FACTOR = 1.35  # a party's peak above its data, per MB of a supernet step (a least-squares fit, rounded up)
AUGMENT_STEP_FACTOR = 5.5  # the same per MB of an augmentation step (3.0 until the DPNAS default's refit)
POISSON_MARGIN_SIGMAS = 3.0  # B_max = B + 3 √B for a Poisson batch of mean B
# runtime.max_physical_batch: auto. Passes of 128-256 examples ran the 28x28 networks' private step fastest, passes of
# 32 up to 1.4x slower, and larger passes gained little but memory (docs/log/benchmarks.md). The floor is the fixed
# default auto replaced, so no step gets slower; the budget keeps a large network's pass within memory.
PASS_MEMORY_MB = 64.0
AUTO_PASS_MIN, AUTO_PASS_MAX = 32, 128


@wire_type
@dataclass(frozen=True)
class NodeFacts:
    """What one rank reports: its host, the memory its node gives the job (MB) with where that came from, and the
    cores it may run on."""

    host: str
    capacity_mb: float
    source: str
    cores: int = 1


@dataclass(frozen=True)
class RankEstimate:
    """The expected peak resident memory of one kind of rank, in MB, by part."""

    role: str  # "server" or "party"
    runtime_mb: float
    data_mb: float
    step_mb: float

    @property
    def total_mb(self) -> float:
        return self.runtime_mb + self.data_mb + self.step_mb


@dataclass(frozen=True)
class StepTerm:
    """One stage's step in a party's estimate: MB per example of a pass (its fitted factor included), the most
    examples a batch of the stage may hold (B_max), and the examples of an ``auto`` pass (:func:`pass_examples`)."""

    mb_per_example: float
    largest_batch: float
    auto_examples: int = AUTO_PASS_MIN

    def mb(self, max_physical_batch: int | str | None) -> float:
        """MB of the step when a batch runs in passes of at most `max_physical_batch` examples (None: one pass;
        ``auto``: :attr:`auto_examples`)."""
        cap = self.auto_examples if max_physical_batch == "auto" else max_physical_batch
        examples = self.largest_batch if cap is None else min(self.largest_batch, cap)
        return self.mb_per_example * examples


@dataclass(frozen=True)
class MemoryPlan:
    """The estimate of every rank and the nodes they share."""

    server: RankEstimate
    party: RankEstimate
    nodes: dict[str, list[int]]  # host -> the world ranks on it
    capacity_mb: dict[str, tuple[float, str]]  # host -> (MB the node gives the job, its source)
    steps: tuple[StepTerm, ...] = ()  # the party's steps (its step_mb is their sum at the configured passes)

    def node_mb(self, host: str) -> float:
        """The expected peak of all ranks on `host` together."""
        return sum(self.server.total_mb if rank == 0 else self.party.total_mb for rank in self.nodes[host])

    def lines(self) -> list[str]:
        """What rank 0 prints before the run: the per-rank estimate, then one line per node."""
        lines = [f"memory: expected peak per rank ~{_gb(self.server.total_mb)} (server), "
                 f"~{_gb(self.party.total_mb)} (party; {_gb(self.party.runtime_mb)} runtime, "
                 f"{_gb(self.party.data_mb)} data, {_gb(self.party.step_mb)} steps)"]
        for host, ranks in self.nodes.items():
            capacity, source = self.capacity_mb[host]
            parties = sum(1 for rank in ranks if rank != 0)
            what = " + ".join((["server"] if 0 in ranks else []) + ([f"{parties} parties"] if parties else []))
            lines.append(f"memory: node {host}: {what}: ~{_gb(self.node_mb(host))} of {_gb(capacity)} ({source})")
        return lines

    def at_passes(self, max_physical_batch: int | None) -> MemoryPlan:
        """The same plan with a party's batches run in passes of at most `max_physical_batch` examples."""
        step = sum(term.mb(max_physical_batch) for term in self.steps)
        return dataclasses.replace(self, party=dataclasses.replace(self.party, step_mb=step))

    def fitting_passes(self) -> int | None:
        """The largest ``runtime.max_physical_batch`` with which every node holds its ranks (None: not even 1)."""
        largest = math.ceil(max((term.largest_batch for term in self.steps), default=1))
        return next((cap for cap in range(largest, 0, -1) if self.at_passes(cap)._crowded() is None), None)

    def refusal(self) -> str | None:
        """One line if some node cannot hold its ranks, else None; it says which passes would fit."""
        host = self._crowded()
        if host is None:
            return None
        capacity, source = self.capacity_mb[host]
        fitting = self.fitting_passes()
        passes = (f"runtime.max_physical_batch={fitting} would fit (~{_gb(self.at_passes(fitting).party.total_mb)} "
                  "per party)" if fitting is not None else "not even runtime.max_physical_batch=1 would fit")
        return (f"memory: node {host} would need ~{_gb(self.node_mb(host))} for its {len(self.nodes[host])} ranks "
                f"(~{_gb(self.party.total_mb)} per party, ~{_gb(self.server.total_mb)} for the server) but gives the "
                f"job {_gb(capacity)} ({source}); {passes}; or spread the ranks over more nodes, shrink the batch or "
                "the network, or set runtime.node_memory_mb if the node really has more")

    def _crowded(self) -> str | None:
        """The first node whose ranks would need more than it gives the job, or None."""
        return next((host for host in self.nodes if self.node_mb(host) > self.capacity_mb[host][0]), None)


def node_facts(node_memory_mb: float | None) -> NodeFacts:
    """This rank's host name and the memory its node gives the job: `node_memory_mb` when set, else the smallest of
    the node's available memory (``MemAvailable``), the room left under this process's cgroup limit, and Slurm's
    ``SLURM_MEM_PER_NODE``. Public machine facts, the same for every rank of a node."""
    host, cores = socket.gethostname(), len(os.sched_getaffinity(0))
    if node_memory_mb is not None:
        return NodeFacts(host, float(node_memory_mb), "runtime.node_memory_mb", cores)
    found = [(value, source) for value, source in (
        (_status_mb("MemAvailable", "/proc/meminfo"), "available on the node"),
        (_cgroup_room_mb(), "cgroup limit"),
        (_slurm_mem_mb(), "SLURM_MEM_PER_NODE"),
    ) if value is not None]
    if not found:
        return NodeFacts(host, math.inf, "unknown", cores)
    value, source = min(found)
    return NodeFacts(host, value, source, cores)


def plan_memory(cfg: Config, facts: list[NodeFacts], *, stage: str) -> MemoryPlan:
    """The plan for a world whose rank r reported ``facts[r]``; `stage` is the job's first ("search" or
    "augment"). Builds the networks once on a 2-example input."""
    from mpi_fnas.federation.job_plan import open_split, parse_genotype
    from mpi_fnas.space import augment_network, largest_augment_network, search_space
    from mpi_fnas.space.scattering import fixed_stem_of

    parties = len(facts) - 1
    test = open_split(cfg, "test", download=cfg.data.download)  # rank 0 would fetch a missing CIFAR-10 next anyway
    shape = (test.in_channels, cfg.data.image_size, cfg.data.image_size)
    example_mb = math.prod(shape) * 4 / 1e6
    runtime = _torch_runtime_mb()
    steps: list[StepTerm] = []
    space = search_space(cfg.space.kind)
    dims = {"in_channels": test.in_channels, "num_classes": test.num_classes}
    if stage == "search":
        supernet = space.build_supernet(cfg.space, seed=cfg.seed, **dims)
        stem = fixed_stem_of(supernet)
        steps.append(_step_term(SEARCH_STEP_FACTOR, step_mb(supernet, stem.output_shape(cfg.data.image_size)
                                                             if stem is not None else shape, 1),
                                _largest_batch(cfg.search.batch_size, cfg.mode == "dpfnas")))
    if cfg.augment.epochs > 0:
        if cfg.augment.genotype is not None:
            # SetupError (one line, exit 2) for a genotype this config cannot train, e.g. an op outside space.ops
            genotype = parse_genotype(cfg.augment.genotype, "augment.genotype", cfg.space)
            network = augment_network(cfg, genotype, seed=cfg.seed, **dims)
        else:  # the searched cell is not known yet: the largest it could be (or the hand-designed network)
            network = largest_augment_network(cfg, seed=cfg.seed, **dims)
        private = cfg.mode == "dpfnas" and cfg.augment.private
        stem = fixed_stem_of(network)  # a ScatterNet trains on its examples' scattering, kept instead of the images
        augment_shape = stem.output_shape(cfg.data.image_size) if stem is not None else shape
        steps.append(_step_term(AUGMENT_STEP_FACTOR, step_mb(network, augment_shape, 1),
                                _largest_batch(cfg.augment.batch_size, private)))
        augment_example_mb = math.prod(augment_shape) * 4 / 1e6
    else:
        augment_example_mb = 0.0
    shard = (cfg.data.train_size or _default_train_size(cfg)) / max(parties, 1)
    party = RankEstimate("party", runtime + PARTY_MODULES_MB + PARTY_WORKING_MB,
                         shard * ((stage == "search") * example_mb + augment_example_mb),
                         sum(term.mb(cfg.runtime.max_physical_batch) for term in steps))
    server = RankEstimate("server", runtime + SERVER_MODULES_MB, len(test) * max(example_mb, augment_example_mb),
                          SERVER_WORKING_MB)
    nodes: dict[str, list[int]] = {}
    capacity: dict[str, tuple[float, str]] = {}
    for rank, fact in enumerate(facts):
        nodes.setdefault(fact.host, []).append(rank)
        capacity[fact.host] = min(capacity.get(fact.host, (math.inf, "")), (fact.capacity_mb, fact.source))
    return MemoryPlan(server, party, nodes, capacity, tuple(steps))


def step_mb(model, shape: tuple[int, ...], batch: float) -> float:
    """MB of one training step of `model` at `batch` examples of `shape` (C, H, W): the tensors autograd saves for
    the backward pass plus one per-example gradient, per example, times the batch (both grow linearly in it). Runs
    one forward of 2 examples in the model's mode, on its device."""
    import torch

    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()  # views of one storage count once
        return tensor

    device = next(model.parameters(), torch.empty(0)).device
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(torch.zeros(2, *shape, device=device))
    params = sum(p.numel() for p in model.parameters())
    return batch * (sum(saved.values()) / 2 + 4 * params) / 1e6


def pass_examples(setting: int | str | None, model, shape: tuple[int, ...]) -> int | None:
    """The examples per forward/backward pass that ``runtime.max_physical_batch`` = `setting` means for `model` on
    examples of `shape`: the setting itself when it is a number, or None (one pass per batch); for ``auto``, as
    many examples as :data:`PASS_MEMORY_MB` of step memory (:func:`step_mb`) holds, from :data:`AUTO_PASS_MIN` to
    :data:`AUTO_PASS_MAX`.
    A pure function of the network and the shape, so every party of a stage gets the same passes. The model is
    measured on a copy (a forward in training mode would move a BatchNorm's running statistics).

    Example:
        >>> pass_examples("auto", ScatterCnn(1, 10, 28), (81, 7, 7))  # doctest: +SKIP
        128
    """
    if setting != "auto":
        return setting  # type: ignore[return-value]
    import copy

    return _auto_examples(step_mb(copy.deepcopy(model), shape, 1))


def _auto_examples(mb_per_example: float) -> int:
    return min(AUTO_PASS_MAX, max(AUTO_PASS_MIN, int(PASS_MEMORY_MB / mb_per_example)))


def _step_term(factor: float, mb_per_example: float, largest_batch: float) -> StepTerm:
    """A stage's term from its network's raw :func:`step_mb` per example and its fitted factor."""
    return StepTerm(factor * mb_per_example, largest_batch, _auto_examples(mb_per_example))


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (since start, or since the peak was last reset), in MB."""
    peak = _status_mb("VmHWM")
    if peak is not None:
        return peak
    import resource  # not Linux: ru_maxrss is bytes on macOS, KiB elsewhere
    import sys

    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value / 1e6 if sys.platform == "darwin" else value * 1024 / 1e6


def _largest_batch(batch_size: int, poisson: bool) -> float:
    """B_max: the batch itself, or B + 3√B for a Poisson batch of mean B."""
    return batch_size + POISSON_MARGIN_SIGMAS * math.sqrt(batch_size) if poisson else float(batch_size)


def _default_train_size(cfg: Config) -> int:
    """The train split's size when ``data.train_size`` is null: the dataset's whole train split (an imagefolder's
    size is not known without reading it: its data then count as 0)."""
    return {"cifar10": 50_000, "mnist": 60_000, "fashion-mnist": 60_000, "mnist-5k": 4_000}.get(cfg.data.dataset, 0)


def _torch_runtime_mb() -> float:
    """Resident MB of this process once torch is imported (rank 0's: the ranks run the same build)."""
    import torch  # noqa: F401  (its import is what is measured)

    return _status_mb("VmRSS") or 250.0


def return_free_memory() -> None:
    """Give the heap's free pages back to the operating system (glibc's ``malloc_trim``; elsewhere only a garbage
    collection). Rank 0 calls it between the search and the augmentation: the augmentation's allocations then start
    from a compact heap instead of adding to what the search's freed objects left scattered (docs/log/benchmarks.md,
    "Rank 0"). Not after every step, where the page faults it causes cost more than it saves."""
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def _status_mb(key: str, path: str = "/proc/self/status") -> float | None:
    """The ``KEY:  N kB`` line of a /proc file (this process's status by default) in MB; None where there is none."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / 1e6
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room_mb() -> float | None:
    """Room left under this process's cgroup v2 memory limit (``memory.max`` − ``memory.current``), if it has one."""
    try:
        line = next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
        group = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return (int(limit) - int((group / "memory.current").read_text())) / 1e6
    except (OSError, ValueError, StopIteration):
        return None


def _slurm_mem_mb() -> float | None:
    value = os.environ.get("SLURM_MEM_PER_NODE", "")
    return float(value) * 1.048576 if value.isdigit() else None  # Slurm's MB are MiB


def _gb(mb: float) -> str:
    return "unlimited" if math.isinf(mb) else f"{mb / 1000:.2f} GB"
