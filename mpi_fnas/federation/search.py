"""The federated search job: setup, the iteration loop, logging and the final evaluation.

``run_search`` is what every rank calls; the server/party split is the first thing it does. Setup:

1. rank 0 reads the train split's *labels* (never the inputs), splits it into search-train and search-val
   (DARTS), partitions both among the K parties, plans the run (steps; under DP the sample rates, δ, σ and the
   step budget) and scatters each party its :class:`Assignment`;
2. each party renders/loads only its own examples; rank 0 loads only the test split;
3. rank 0 builds the supernet from the seed and broadcasts the initial W and A, so all copies start equal.

Then ``steps`` iterations of :mod:`mpi_fnas.federation.algorithm`. At every epoch end rank 0 logs the alphas and
genotype and evaluates the test split. At the end (FNAS only) the parties evaluate their whole validation shards
(summed by Reduce); under DP that would be an unaccounted release, so only the test accuracy is reported.
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

from mpi_fnas.checkpoint import save_checkpoint
from mpi_fnas.config import Config, ConfigError
from mpi_fnas.data import DatasetNotFoundError, open_dataset, partition_indices, split_train_val
from mpi_fnas.federation.algorithm import (
    CHECKPOINT,
    CONTINUE,
    STOP,
    ServerBuffers,
    StepStats,
    party_iteration,
    server_iteration,
)
from mpi_fnas.federation.comm import Channel
from mpi_fnas.federation.party import Party, Shard
from mpi_fnas.federation.placement import device_for_rank
from mpi_fnas.federation.server import Server, w_learning_rate
from mpi_fnas.privacy import DPParams
from mpi_fnas.privacy.budget import FederationLedger, PrivacyPlan, plan_privacy
from mpi_fnas.runlog import PrivacySchema, RunLog
from mpi_fnas.space import PRIMITIVES, SearchNetwork, max_genotype_length, num_edges

METRICS = (
    "step", "epoch", "train_loss", "train_acc", "val_loss", "val_acc",
    "step_seconds", "comm_seconds", "party_seconds", "w_lr", "test_loss", "test_acc",
)
FAULT_ENV = "MPI_FNAS_INJECT_FAULT"  # "RANK:STEP" — a party raises at that step (used by the failure tests)
STOP_ENV = "MPI_FNAS_STOP_AFTER"  # "STEP" — behave as if SIGUSR1 arrived during that step (resume tests)


@dataclass
class Assignment:
    """What the server tells a party at setup (global indices into the dataset's train split)."""

    train_indices: np.ndarray
    val_indices: np.ndarray
    steps_per_epoch: int
    steps: int = 0  # iterations of the whole run (0: epochs × steps_per_epoch, filled in by plan_run)
    dp: DPParams | None = None
    start_step: int = 1  # > 1 when resuming
    party_state: dict | None = None  # the party's checkpointed state when resuming


@dataclass
class RunPlan:
    """Rank 0's plan of the run: one Assignment per party, and the privacy plan under DP."""

    assignments: list[Assignment]
    steps_per_epoch: int
    steps: int
    privacy: PrivacyPlan | None
    stop_reason: str = "completed"


@dataclass
class SearchOutcome:
    """Rank 0's result of a search."""

    mode: str
    parties: int
    epochs: int
    steps: int
    val_acc: float  # NaN under DP (not released)
    val_loss: float
    test_acc: float
    genotype: str
    wall_seconds: float
    log_path: Path | None
    stop_reason: str
    w: np.ndarray = field(repr=False)
    a: np.ndarray = field(repr=False)
    alphas: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    interrupted: bool = False  # stopped by a signal after writing a checkpoint
    epsilon: np.ndarray | None = None  # (K,) tight ε per party (DP only)
    mu_gdp: np.ndarray | None = None
    delta: np.ndarray | None = None


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


def plan_run(cfg: Config, parties: int, assignments: list[Assignment] | None = None) -> RunPlan:
    """Rank 0: the whole plan (partition unless given, step count, privacy parameters under DP)."""
    if assignments is None:
        assignments = plan_assignments(cfg, parties)
    steps_per_epoch = assignments[0].steps_per_epoch
    steps = cfg.search.epochs * steps_per_epoch
    privacy = None
    reason = "completed"
    if cfg.mode == "dpfnas":
        try:
            privacy = plan_privacy(
                [len(a.train_indices) for a in assignments], [len(a.val_indices) for a in assignments],
                DPParams.from_config(cfg.privacy, cfg.search.batch_size), planned_steps=steps,
            )
        except ValueError as exc:
            raise SetupError(f"privacy: {exc}") from None
        steps, reason = privacy.steps, privacy.stop_reason
    for a in assignments:
        a.steps = steps
        a.dp = privacy.params if privacy is not None else None
    return RunPlan(assignments, steps_per_epoch, steps, privacy, reason)


def run_search(cfg: Config, channel: Channel, run_dir: Path | None, *,
               assignments: list[Assignment] | None = None,
               progress: Callable[[int, int, dict[str, float]], None] | None = None,
               resume: dict | None = None,
               stop_requested: Callable[[], str | None] = lambda: None) -> SearchOutcome | bool | None:
    """Run the whole search on every rank.

    Rank 0 returns the :class:`SearchOutcome`; a party returns True when the run stopped as interrupted.
    `assignments` (rank 0 only) replaces the planned partition — tests use it to compare K parties with one
    party holding their union. `progress(step, total, row)` is called on rank 0 after each logged row.
    `resume` (rank 0 only) is a checkpoint to continue from (``mpi_fnas.checkpoint.load_checkpoint``).
    `stop_requested()` (rank 0) returns a reason to checkpoint and stop at the next step boundary, or None.
    """
    if channel.is_server:
        return _serve(cfg, channel, run_dir, assignments, progress, resume, stop_requested)
    return _participate(cfg, channel)


# -- rank 0 -------------------------------------------------------------------------------------------------------
def _serve(cfg: Config, channel: Channel, run_dir: Path | None, assignments: list[Assignment] | None,
           progress: Callable[[int, int, dict[str, float]], None] | None, resume: dict | None,
           stop_requested: Callable[[], str | None]) -> SearchOutcome:
    start = time.perf_counter()
    parties = channel.parties
    try:
        plan = plan_run(cfg, parties, assignments)
        test = open_split(cfg, "test")
        if resume is not None:
            _attach_resume(plan, resume)
    except SetupError as exc:
        channel.scatter_setup([None] + [("error", str(exc))] * parties)
        raise
    channel.scatter_setup([None, *plan.assignments])
    device_for_rank(channel.comm, preference="cpu")  # collective: the parties pick theirs at the same time
    devices = channel.gather_setup("cpu")

    log = None
    if run_dir is not None:
        if resume is not None:
            log = RunLog.reopen(run_dir / "search.h5", rank_attrs={"devices": [str(d) for d in devices]})
            log.truncate(*resume["log_rows"])
        else:
            log = RunLog.create(
                run_dir / "search.h5", mode=cfg.mode, parties=parties, config_text=cfg.to_yaml(),
                metric_names=METRICS, alpha_shape=(num_edges(cfg.space.nodes), len(PRIMITIVES)),
                genotype_length=max_genotype_length(cfg.space.nodes, PRIMITIVES),
                privacy=_privacy_schema(plan.privacy) if plan.privacy is not None else None,
                rank_attrs={"devices": [str(d) for d in devices]},
            )
    gpus = len({d for d in devices if str(d).startswith("cuda")})
    try:
        model = build_model(cfg, test.in_channels, test.num_classes)
        server = Server(model, cfg.search, parties)
        if resume is not None:
            server.load_state_dict(resume["server"])
        channel.bcast(server.w_buffer)
        channel.bcast(server.a_buffer)
        x_test, y_test = test.render(np.arange(len(test.labels)))
        outcome = _server_loop(cfg, channel, server, plan, log, progress, x_test, y_test, start, run_dir,
                               resume, stop_requested)
    except BaseException as exc:
        if log is not None:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            log.finish(status, reason=f"{type(exc).__name__}: {exc}".splitlines()[0],
                       cost=_cost(channel, start, gpus))
        raise
    if log is not None:
        log.finish("interrupted" if outcome.interrupted else "finished", reason=outcome.stop_reason,
                   final_genotype=None if outcome.interrupted else outcome.genotype, cost=_cost(channel, start, gpus))
    if outcome.interrupted:
        channel.barrier()  # the parties exit only once the checkpoint and the log are on disk
    return outcome


def _attach_resume(plan: RunPlan, resume: dict) -> None:
    """Check the re-planned run is the checkpointed one and hand each party its saved state."""
    if resume["plan_steps"] != plan.steps or len(resume["parties"]) != len(plan.assignments):
        raise SetupError("--resume: the checkpoint was written by a run with a different plan "
                         f"({resume['plan_steps']} steps, {len(resume['parties'])} parties)")
    for assignment, sizes, state in zip(plan.assignments, resume["shard_sizes"], resume["parties"], strict=True):
        if [len(assignment.train_indices), len(assignment.val_indices)] != list(sizes):
            raise SetupError("--resume: the data partition differs from the checkpointed run's")
        assignment.start_step = int(resume["step"]) + 1
        assignment.party_state = state


def _privacy_schema(plan: PrivacyPlan) -> PrivacySchema:
    from mpi_fnas.privacy.accountant import PrivacyLedger

    return PrivacySchema(
        delta=plan.delta, accountant=PrivacyLedger().description(),
        sample_rate_train=plan.sample_rate_train, sample_rate_val=plan.sample_rate_val,
        noise_multiplier_w=plan.params.noise_multiplier_w, noise_multiplier_a=plan.params.noise_multiplier_a,
        clip_w=plan.params.clip_w, clip_a=plan.params.clip_a,
    )


def _server_loop(cfg: Config, channel: Channel, server: Server, plan: RunPlan, log: RunLog | None,
                 progress, x_test: torch.Tensor, y_test: torch.Tensor, start: float, run_dir: Path | None,
                 resume: dict | None, stop_requested: Callable[[], str | None]) -> SearchOutcome:
    buffers = ServerBuffers(server.w.numel(), server.a.numel())
    second_order = cfg.search.order == "second_order"
    ledger = FederationLedger(plan.privacy) if plan.privacy is not None else None
    acc = _Accumulator()
    first = 1
    if resume is not None:
        first = int(resume["step"]) + 1
        acc.load_state_dict(resume["accumulator"])
        if ledger is not None:
            ledger.load_state_dict(resume["ledger"])
    stop_after = int(os.environ.get(STOP_ENV, "0") or 0)
    test_stats = np.full(3, np.nan)
    stop_reason, interrupted = plan.stop_reason, False
    for step in range(first, plan.steps + 1):
        epoch = (step - 1) // plan.steps_per_epoch
        if (step - 1) % plan.steps_per_epoch == 0:
            server.start_epoch(epoch)
        signal_name = stop_requested() or (f"{STOP_ENV}={stop_after}" if step == stop_after else None)
        control = CONTINUE
        if signal_name is not None and step < plan.steps:
            control = STOP
        elif cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < plan.steps:
            control = CHECKPOINT
        t0, c0 = time.perf_counter(), channel.comm_seconds
        stats = server_iteration(server, channel, buffers, second_order, control)
        if ledger is not None:
            ledger.record_step()
        acc.add(stats, time.perf_counter() - t0, channel.comm_seconds - c0)
        epoch_end = step % plan.steps_per_epoch == 0 or step == plan.steps
        if epoch_end:
            test_stats = server.evaluate(x_test, y_test)
            if log is not None:
                soft = server.alpha_softmax()
                log.append_epoch(soft["normal"], soft["reduce"], server.genotype().to_string())
        if step % cfg.runtime.log_every == 0 or epoch_end or control != CONTINUE:
            row = acc.row(step, epoch, channel.parties, server.xi)
            if epoch_end:
                row["test_loss"] = _ratio(test_stats[0], test_stats[2])
                row["test_acc"] = _ratio(test_stats[1], test_stats[2])
            if log is not None:
                log.append_metrics(row)
                if ledger is not None:
                    log.append_privacy(step, ledger.epsilons(), ledger.mu_gdp())
            if progress is not None:
                progress(step, plan.steps, row)
        if control != CONTINUE:
            party_states = channel.gather_setup(None)[1:]
            if run_dir is not None:
                save_checkpoint(run_dir, {
                    "step": step, "plan_steps": plan.steps, "config": cfg.to_yaml(),
                    "server": server.state_dict(), "parties": party_states,
                    "shard_sizes": [[len(a.train_indices), len(a.val_indices)] for a in plan.assignments],
                    "ledger": ledger.state_dict() if ledger is not None else None,
                    "accumulator": acc.state_dict(),
                    "log_rows": list(log.row_counts()) if log is not None else [0, 0, 0],
                })
            if control == STOP:
                stop_reason, interrupted = f"interrupted by {signal_name}: checkpointed at step {step}", True
                break

    val = np.full(3, np.nan, dtype=np.float32)
    if ledger is None and not interrupted:  # under DP the parties' validation accuracy is not released
        val[:] = 0
        channel.reduce_sum(np.zeros(3, dtype=np.float32), val)  # Σ_k [loss_sum, correct, count] on D_k^val
    soft = server.alpha_softmax()
    return SearchOutcome(
        mode=cfg.mode, parties=channel.parties, epochs=math.ceil(plan.steps / plan.steps_per_epoch),
        steps=step if interrupted else plan.steps, val_acc=_ratio(val[1], val[2]), val_loss=_ratio(val[0], val[2]),
        test_acc=_ratio(test_stats[1], test_stats[2]), genotype=server.genotype().to_string(),
        wall_seconds=time.perf_counter() - start, log_path=log.path if log is not None else None,
        stop_reason=stop_reason, w=server.w_buffer.copy(), a=server.a_buffer.copy(), alphas=soft,
        interrupted=interrupted,
        epsilon=ledger.epsilons() if ledger is not None else None,
        mu_gdp=ledger.mu_gdp() if ledger is not None else None,
        delta=plan.privacy.delta if plan.privacy is not None else None,
    )


def _ratio(a: float, b: float) -> float:
    return float(a / b) if b > 0 else float("nan")


def _cost(channel: Channel, start: float, gpus: int) -> dict[str, float]:
    """This attempt's cost (the log adds the attempts of a requeued run up). Core-hours count 1 core a rank."""
    wall = time.perf_counter() - start
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
        # Under DP the parties send no statistics: counts are 0 and the loss/accuracy columns are NaN.
        row = {
            "step": step, "epoch": epoch,
            "train_loss": _ratio(self.train[0], self.train[2]), "train_acc": _ratio(self.train[1], self.train[2]),
            "val_loss": _ratio(self.val[0], self.val[2]), "val_acc": _ratio(self.val[1], self.val[2]),
            "step_seconds": self.wall / self.steps, "comm_seconds": self.comm / self.steps,
            "party_seconds": (self.train[3] + self.val[3]) / parties / self.steps if self.train[2] > 0
            else float("nan"),
            "w_lr": w_lr,
        }
        self.reset()
        return row

    def state_dict(self) -> dict:
        return {"train": self.train.tolist(), "val": self.val.tolist(), "steps": self.steps, "wall": self.wall,
                "comm": self.comm}

    def load_state_dict(self, state: dict) -> None:
        self.train, self.val = np.array(state["train"]), np.array(state["val"])
        self.steps, self.wall, self.comm = int(state["steps"]), float(state["wall"]), float(state["comm"])


# -- ranks 1..K ---------------------------------------------------------------------------------------------------
def _participate(cfg: Config, channel: Channel) -> bool:
    got = channel.scatter_setup(None)
    if isinstance(got, tuple) and got and got[0] == "error":
        raise ServerReportedError(got[1])
    assert isinstance(got, Assignment)
    device = torch.device(device_for_rank(channel.comm, preference=cfg.runtime.device))
    channel.gather_setup(str(device))

    data = open_split(cfg, "train")
    x_tr, y_tr = data.render(got.train_indices)
    x_val, y_val = data.render(got.val_indices)
    model = build_model(cfg, data.in_channels, data.num_classes).to(device)
    generator = torch.Generator().manual_seed(_stream_seed(cfg, channel.rank, "batches"))
    noise_generator = None
    if got.dp is not None:
        noise_generator = torch.Generator(device=device).manual_seed(_stream_seed(cfg, channel.rank, "noise"))
    party = Party(model, Shard(x_tr.to(device), y_tr.to(device)), Shard(x_val.to(device), y_val.to(device)),
                  cfg.search.batch_size, generator, dp=got.dp, noise_generator=noise_generator)
    if got.party_state is not None:
        party.load_state_dict(got.party_state)
    w_in = np.zeros(party.num_w, dtype=np.float32)
    a_in = np.zeros(party.num_a + 1, dtype=np.float32)  # A and the control word
    v_in = np.zeros(party.num_w, dtype=np.float32)
    channel.bcast(w_in)
    channel.bcast(a_in[:-1])
    party.load_w(w_in)
    party.load_a(a_in[:-1])

    fault_rank, fault_step = _fault_injection()
    second_order = cfg.search.order == "second_order"
    for step in range(got.start_step, got.steps + 1):
        if channel.rank == fault_rank and step == fault_step:
            raise RuntimeError(f"injected fault at step {step} ({FAULT_ENV})")
        xi = w_learning_rate(cfg.search, (step - 1) // got.steps_per_epoch)
        control = party_iteration(party, channel, w_in, a_in, v_in, second_order, xi)
        if control != CONTINUE:
            channel.gather_setup(party.state_dict())
            if control == STOP:
                channel.barrier()  # wait for the server to finish the checkpoint and the log
                return True
    if got.dp is None:
        channel.reduce_sum(party.evaluate_val())
    return False


def _stream_seed(cfg: Config, rank: int, purpose: str) -> int:
    """Independent, reproducible seeds per (run seed, rank, purpose); OS entropy with privacy.secure_rng."""
    if cfg.mode == "dpfnas" and cfg.privacy.secure_rng:
        return int.from_bytes(os.urandom(8), "little") >> 1
    base = {"batches": 0, "noise": 1}[purpose]
    return int(np.random.SeedSequence([cfg.seed, rank, base]).generate_state(1, dtype=np.uint64)[0] >> 1)


def _fault_injection() -> tuple[int, int]:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return -1, -1
    rank, step = spec.split(":")
    return int(rank), int(step)
