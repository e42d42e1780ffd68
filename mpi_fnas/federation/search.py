"""The federated search job: setup, the epoch loop, logging and the final evaluation.

``run_search`` is what every rank calls; the server/party split is the first thing it does. Setup:

1. rank 0 reads the train split's *labels* (never the inputs), splits it into search-train and search-val
   (DARTS), partitions both among the K parties, and scatters each party its index arrays;
2. each party renders/loads only its own examples; rank 0 loads only the test split;
3. rank 0 builds the supernet from the seed and broadcasts the initial W and A, so all copies start equal.

Then ``epochs × steps_per_epoch`` iterations of :mod:`mpi_fnas.federation.algorithm`, and at the end the parties
evaluate the final model on their whole validation shards (summed by Reduce) and rank 0 on its test split.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mpi_fnas.config import Config, ConfigError
from mpi_fnas.data import DatasetNotFoundError, open_dataset, partition_indices, split_train_val
from mpi_fnas.federation.algorithm import ServerBuffers, StepStats, party_iteration, server_iteration
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.party import Party, Shard
from mpi_fnas.federation.server import Server, w_learning_rate
from mpi_fnas.runlog import RunLog
from mpi_fnas.space import PRIMITIVES, SearchNetwork, max_genotype_length, num_edges

METRICS = (
    "step", "epoch", "train_loss", "train_acc", "val_loss", "val_acc",
    "step_seconds", "comm_seconds", "party_seconds", "w_lr",
)
FAULT_ENV = "MPI_FNAS_INJECT_FAULT"  # "RANK:STEP" — a party raises at that step (used by the failure tests)


@dataclass
class Assignment:
    """What the server tells a party at setup (global indices into the dataset's train split)."""

    train_indices: np.ndarray
    val_indices: np.ndarray
    steps_per_epoch: int


@dataclass
class SearchOutcome:
    """Rank 0's result of a search."""

    mode: str
    parties: int
    epochs: int
    steps: int
    val_acc: float
    val_loss: float
    test_acc: float
    genotype: str
    wall_seconds: float
    log_path: Path | None
    w: np.ndarray = field(repr=False)
    a: np.ndarray = field(repr=False)
    alphas: dict[str, np.ndarray] = field(repr=False, default_factory=dict)


class SetupError(ConfigError):
    """Bad input discovered during setup (missing dataset, impossible partition): exit code 2."""


class ServerReportedError(SetupError):
    """On a party: the server found bad input during setup and will print it; stop quietly with exit code 2."""


def build_model(cfg: Config, in_channels: int, num_classes: int) -> SearchNetwork:
    """The supernet of `cfg.space`, initialised from `cfg.seed` (identical on every rank)."""
    torch.manual_seed(cfg.seed)
    return SearchNetwork(
        channels=cfg.space.channels, num_classes=num_classes, layers=cfg.space.layers, nodes=cfg.space.nodes,
        stem_multiplier=cfg.space.stem_multiplier, in_channels=in_channels, norm=cfg.space.norm,
    )


def open_split(cfg: Config, split: str):
    """The dataset object for `split` ("train" or "test"); raises SetupError when it cannot be found."""
    size = cfg.data.train_size if split == "train" else cfg.data.test_size
    try:
        return open_dataset(cfg.data.dataset, split, root=cfg.data.root, image_size=cfg.data.image_size,
                            size=size, seed=cfg.seed)
    except DatasetNotFoundError as exc:
        raise SetupError(str(exc)) from None


def plan_assignments(cfg: Config, parties: int) -> list[Assignment]:
    """Rank 0: split and partition the train split by labels; one Assignment per party."""
    labels = open_split(cfg, "train").labels
    train_idx, val_idx = split_train_val(len(labels), cfg.data.val_fraction, cfg.seed)
    try:
        kw = {"dirichlet_alpha": cfg.data.dirichlet_alpha, "classes_per_party": cfg.data.classes_per_party}
        train_parts = partition_indices(labels[train_idx], parties, cfg.data.partition, cfg.seed, **kw)
        val_parts = partition_indices(labels[val_idx], parties, cfg.data.partition, cfg.seed + 1, **kw)
    except ValueError as exc:
        raise SetupError(f"data.partition: {exc}") from None
    steps = cfg.search.steps_per_epoch
    if steps is None:  # one epoch = one pass over the mean party's train shard
        steps = max(1, math.ceil(np.mean([len(p) for p in train_parts]) / cfg.search.batch_size))
    return [Assignment(train_idx[tp], val_idx[vp], steps) for tp, vp in zip(train_parts, val_parts, strict=True)]


def run_search(cfg: Config, channel: Channel, run_dir: Path | None, *,
               assignments: list[Assignment] | None = None,
               progress: Callable[[int, int, dict[str, float]], None] | None = None) -> SearchOutcome | None:
    """Run the whole search on every rank; rank 0 returns the outcome, parties return None.

    `assignments` (rank 0 only) replaces the planned partition — tests use it to compare K parties with one
    party holding their union. `progress(step, total, row)` is called on rank 0 after each logged row.
    """
    if channel.is_server:
        return _serve(cfg, channel, run_dir, assignments, progress)
    _participate(cfg, channel)
    return None


# ---------------------------------------------------------------------------------------------------------------
def _serve(cfg: Config, channel: Channel, run_dir: Path | None, assignments: list[Assignment] | None,
           progress: Callable[[int, int, dict[str, float]], None] | None) -> SearchOutcome:
    start = time.perf_counter()
    parties = channel.parties
    try:
        if assignments is None:
            assignments = plan_assignments(cfg, parties)
        test = open_split(cfg, "test")
    except SetupError as exc:
        channel.scatter_setup([None] + [("error", str(exc))] * parties)
        raise
    channel.scatter_setup([None, *assignments])
    steps_per_epoch = assignments[0].steps_per_epoch

    devices = channel.gather_setup("cpu")

    log = None
    if run_dir is not None:
        log = RunLog.create(
            run_dir / "search.h5", mode=cfg.mode, parties=parties, config_text=cfg.to_yaml(),
            metric_names=METRICS, alpha_shape=(num_edges(cfg.space.nodes), len(PRIMITIVES)),
            genotype_length=max_genotype_length(cfg.space.nodes, PRIMITIVES),
            rank_attrs={"devices": [str(d) for d in devices]},
        )
    try:
        model = build_model(cfg, test.in_channels, test.num_classes)
        server = Server(model, cfg.search, parties)
        channel.bcast(server.w_buffer)
        channel.bcast(server.a_buffer)
        x_test, y_test = test.render(np.arange(len(test.labels)))
        outcome = _server_loop(cfg, channel, server, steps_per_epoch, log, progress, x_test, y_test, start)
    except BaseException as exc:
        if log is not None:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            log.finish(status, reason=f"{type(exc).__name__}: {exc}".splitlines()[0],
                       cost=_cost(channel, start))
        raise
    if log is not None:
        log.finish("finished", reason="completed", final_genotype=outcome.genotype, cost=_cost(channel, start))
    return outcome


def _server_loop(cfg: Config, channel: Channel, server: Server, steps_per_epoch: int, log: RunLog | None,
                 progress, x_test: torch.Tensor, y_test: torch.Tensor, start: float) -> SearchOutcome:
    buffers = ServerBuffers(server.w.numel(), server.a.numel())
    second_order = cfg.search.order == "second_order"
    total = cfg.search.epochs * steps_per_epoch
    acc = _Accumulator()
    step = 0
    for epoch in range(cfg.search.epochs):
        server.start_epoch(epoch)
        for _ in range(steps_per_epoch):
            t0, c0 = time.perf_counter(), channel.comm_seconds
            stats = server_iteration(server, channel, buffers, second_order)
            step += 1
            acc.add(stats, time.perf_counter() - t0, channel.comm_seconds - c0)
            if step % cfg.runtime.log_every == 0 or step == total:
                row = acc.row(step, epoch, channel.parties, server.xi)
                if log is not None:
                    log.append_metrics(row)
                if progress is not None:
                    progress(step, total, row)
        if log is not None:
            soft = server.alpha_softmax()
            log.append_epoch(soft["normal"], soft["reduce"], server.genotype().to_string())

    val = np.zeros(3, dtype=np.float32)
    channel.reduce_sum(np.zeros(3, dtype=np.float32), val)  # Σ_k [loss_sum, correct, count] on D_k^val
    test = server.evaluate(x_test, y_test)
    soft = server.alpha_softmax()
    return SearchOutcome(
        mode=cfg.mode, parties=channel.parties, epochs=cfg.search.epochs, steps=total,
        val_acc=float(val[1] / max(val[2], 1)), val_loss=float(val[0] / max(val[2], 1)),
        test_acc=float(test[1] / max(test[2], 1)), genotype=server.genotype().to_string(),
        wall_seconds=time.perf_counter() - start, log_path=log.path if log is not None else None,
        w=server.w_buffer.copy(), a=server.a_buffer.copy(), alphas=soft,
    )


def _cost(channel: Channel, start: float) -> dict[str, float]:
    wall = time.perf_counter() - start
    gpus = 0  # filled in by the GPU placement work; CPU-only runs use none
    return {"wall_seconds": wall, "ranks": channel.size, "gpus": gpus, "gpu_hours": wall * gpus / 3600.0,
            "cpu_core_hours": wall * channel.size / 3600.0}


class _Accumulator:
    """Sums StepStats between two logged rows."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.train = np.zeros(4)
        self.val = np.zeros(4)
        self.steps = 0
        self.wall = 0.0
        self.comm = 0.0

    def add(self, stats: StepStats, wall: float, comm: float) -> None:
        self.train += stats.train
        self.val += stats.val
        self.steps += 1
        self.wall += wall
        self.comm += comm

    def row(self, step: int, epoch: int, parties: int, w_lr: float) -> dict[str, float]:
        def ratio(a: float, b: float) -> float:
            return a / b if b > 0 else float("nan")

        row = {
            "step": step, "epoch": epoch,
            "train_loss": ratio(self.train[0], self.train[2]), "train_acc": ratio(self.train[1], self.train[2]),
            "val_loss": ratio(self.val[0], self.val[2]), "val_acc": ratio(self.val[1], self.val[2]),
            "step_seconds": self.wall / self.steps, "comm_seconds": self.comm / self.steps,
            "party_seconds": (self.train[3] + self.val[3]) / parties / self.steps, "w_lr": w_lr,
        }
        self.reset()
        return row


# ---------------------------------------------------------------------------------------------------------------
def _participate(cfg: Config, channel: Channel) -> None:
    got = channel.scatter_setup(None)
    if isinstance(got, tuple) and got and got[0] == "error":
        raise ServerReportedError(got[1])
    assert isinstance(got, Assignment)
    device = _party_device(cfg, channel.rank)
    channel.gather_setup(str(device))

    data = open_split(cfg, "train")
    x_tr, y_tr = data.render(got.train_indices)
    x_val, y_val = data.render(got.val_indices)
    model = build_model(cfg, data.in_channels, data.num_classes).to(device)
    generator = torch.Generator().manual_seed(cfg.seed * 100_003 + channel.rank)
    party = Party(model, Shard(x_tr.to(device), y_tr.to(device)), Shard(x_val.to(device), y_val.to(device)),
                  cfg.search.batch_size, generator)
    w_in = np.zeros(party.num_w, dtype=np.float32)
    a_in = np.zeros(party.num_a, dtype=np.float32)
    v_in = np.zeros(party.num_w, dtype=np.float32)
    channel.bcast(w_in)
    channel.bcast(a_in)
    party.load_w(w_in)
    party.load_a(a_in)

    fault_rank, fault_step = _fault_injection()
    second_order = cfg.search.order == "second_order"
    step = 0
    for epoch in range(cfg.search.epochs):
        xi = w_learning_rate(cfg.search, epoch)
        for _ in range(got.steps_per_epoch):
            step += 1
            if channel.rank == fault_rank and step == fault_step:
                raise RuntimeError(f"injected fault at step {step} ({FAULT_ENV})")
            party_iteration(party, channel, w_in, a_in, v_in, second_order, xi)
    channel.reduce_sum(party.evaluate_val())


def _party_device(cfg: Config, rank: int) -> torch.device:
    if cfg.runtime.device == "cpu" or (cfg.runtime.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SetupError("runtime.device: cuda requested but no CUDA device is visible")
    return torch.device(f"cuda:{(rank - 1) % torch.cuda.device_count()}")


def _fault_injection() -> tuple[int, int]:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return -1, -1
    rank, step = spec.split(":")
    return int(rank), int(step)
