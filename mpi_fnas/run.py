"""Command line: ``mpirun -n K+1 python -m mpi_fnas.run [--config FILE] [--set key=value ...]``.

Rank 0 is the parameter server, ranks 1..K are the parties (K = world size − 1). Exit codes:
0 finished · 1 failure (the whole job is aborted; the log says ``failed``) · 2 bad input (one line from rank 0) ·
75 interrupted by SIGTERM/SIGUSR1/SIGINT after writing a checkpoint (resume with ``--resume RUN_DIR``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from mpi_fnas import __version__
from mpi_fnas.config import Config, ConfigError, check_world, config_from_text, describe_keys, load_config

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: checkpointed, resume me (the Slurm scripts requeue on it)

_EPILOG = """\
examples:
  mpirun -n 9 python -m mpi_fnas.run                                   # 8 parties, default config
  mpirun -n 5 python -m mpi_fnas.run --config configs/fnas.yaml --set search.epochs=2
  mpirun -n 2 python -m mpi_fnas.run --config configs/vanilla_nas.yaml # vanilla NAS: one party

configuration keys (every key can be set in a YAML file or with --set; defaults = configs/default.yaml):
{keys}

output: runs/<name>-<YYYYmmdd-HHMMSS>/search.h5 (HDF5, schema in docs/hdf5.md) unless --out is given;
  RUN_DIR/checkpoint.pt every checkpoint.every_steps steps and on SIGTERM/SIGUSR1/SIGINT (then exit 75).
resume: --resume RUN_DIR continues from its checkpoint with the checkpointed config (a --config/--set given
  too must agree with it except runtime.* and checkpoint.*); without a checkpoint it starts afresh there,
  keeping an earlier search.h5 as search-attempt<N>.h5.
exit codes: 0 finished, 1 failure (job aborted, log status 'failed'), 2 bad input, 75 interrupted (checkpointed).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpi_fnas.run",
        description="Federated (and differentially-private) DARTS search over MPI. "
        "Rank 0 is the parameter server; ranks 1..K are the parties.",
        epilog=_EPILOG.format(keys="\n".join(describe_keys())),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: built-in = configs/default.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set search.epochs=2 (repeatable; value is YAML)")
    parser.add_argument("--out", metavar="RUN_DIR", help="run directory for search.h5 (must not hold a log yet)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for bad input too")
    parser.add_argument("--version", action="version", version=f"mpi_fnas {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Parse the config before touching MPI or torch: bad input should be cheap and identical on every rank.
    try:
        cfg = load_config(args.config, args.overrides)
        config_error = None
    except ConfigError as exc:
        cfg, config_error = None, exc
    if args.print_config and cfg is not None and config_error is None and _launcher_rank() in (None, 0):
        print(cfg.to_yaml(), end="")
        return EXIT_OK

    _limit_threads(cfg)
    from mpi4py import MPI  # MPI_Init happens here, after cheap argument checks

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        if config_error is not None and not (args.resume and not args.config and not args.overrides):
            raise config_error
        if args.resume and args.out and Path(args.resume) != Path(args.out):
            raise ConfigError("--out and --resume name different run directories; give one of them")
        cfg, run_dir, resume = _agree_setup(comm, cfg, args)
        check_world(cfg, comm.Get_size())
    except ConfigError as exc:
        return _bad_input(rank, exc, args.debug)
    return _run(cfg, comm, run_dir, resume, args.debug)


def _run(cfg: Config, comm, run_dir: Path, resume: dict | None, debug: bool) -> int:
    import torch  # after thread limits are in the environment

    from mpi_fnas.federation.comm import Channel, PartyFailedError
    from mpi_fnas.federation.search import ServerReportedError, SetupError, run_search
    from mpi_fnas.progress import Progress

    torch.set_num_threads(_threads(cfg))
    channel = Channel(comm, timeout=cfg.runtime.comm_timeout)
    rank = channel.rank
    stop = StopRequest.install()
    if rank == 0:
        what = f"resuming at step {int(resume['step']) + 1}" if resume is not None else "starting"
        print(f"mpi_fnas {__version__}: {what}: mode={cfg.mode} parties={channel.parties} ranks={channel.size} "
              f"threads/rank={torch.get_num_threads()} log={run_dir / 'search.h5'}", flush=True)
        print("# resolved config\n" + cfg.to_yaml(), end="", flush=True)
    try:
        outcome = run_search(cfg, channel, run_dir, progress=Progress(cfg.runtime.progress) if rank == 0 else None,
                             resume=resume, stop_requested=stop)
    except ServerReportedError:
        return EXIT_BAD_INPUT  # rank 0 prints the line
    except SetupError as exc:
        if rank == 0:
            return _bad_input(rank, exc, debug)
        _fail(channel, f"{type(exc).__name__}: {exc}")
    except PartyFailedError as exc:
        print(f"mpi_fnas: error: {exc}; aborting the job (log marked failed)", file=sys.stderr, flush=True)
        channel.abort(EXIT_FAILURE)
    except KeyboardInterrupt:
        print(f"mpi_fnas: rank {rank} interrupted; aborting the job", file=sys.stderr, flush=True)
        channel.abort(130)
    except BaseException as exc:  # anything else must end the whole job, never hang it
        _fail(channel, f"{type(exc).__name__}: {exc}")
    if rank != 0:
        return EXIT_INTERRUPTED if outcome else EXIT_OK
    if outcome.interrupted:
        print(f"\nmpi_fnas: {outcome.stop_reason}; resume with: --resume {run_dir}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    _summary(outcome)
    return EXIT_OK


class StopRequest:
    """SIGTERM / SIGUSR1 / SIGINT only set a flag; rank 0 turns it into a checkpoint at the next step boundary.

    Every rank installs it (SIGUSR1 would otherwise kill a party); only rank 0's flag decides, and the parties
    learn the decision from the server's control word. A second SIGINT raises KeyboardInterrupt as usual.
    """

    def __init__(self) -> None:
        self.reason: str | None = None

    @classmethod
    def install(cls) -> StopRequest:
        request = cls()
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, request._handle)
        return request

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.reason is not None:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name

    def __call__(self) -> str | None:
        return self.reason


def _fail(channel, message: str) -> None:
    """Print this rank's traceback, tell the server (so it marks the log), and abort the job."""
    sys.stderr.write(f"[mpi_fnas rank {channel.rank}] " + traceback.format_exc())
    sys.stderr.flush()
    if channel.is_server:
        print(f"mpi_fnas: error: server failed: {message}; aborting the job (log marked failed)",
              file=sys.stderr, flush=True)
    else:
        channel.notify_failure(message)
    channel.abort(EXIT_FAILURE)


def _bad_input(rank: int, exc: Exception, debug: bool) -> int:
    if rank == 0:
        if debug:
            traceback.print_exception(exc)
        print(f"mpi_fnas: error: {exc}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def _agree_setup(comm, cfg: Config | None, args) -> tuple[Config, Path, dict | None]:
    """Rank 0 decides the config, the run directory and the checkpoint to resume; every rank learns them.

    The config travels as YAML text from rank 0, so all ranks run the same one even if their files differ.
    """
    decision: tuple[str, str, str] | None = None
    resume = None
    if comm.Get_rank() == 0:
        try:
            cfg, path, resume = _decide(cfg, args)
            decision = ("ok", cfg.to_yaml(), str(path))
        except ConfigError as exc:
            decision = ("error", str(exc), "")
    kind, text, path_text = comm.bcast(decision, root=0)
    if kind == "error":
        raise ConfigError(text)
    return config_from_text(text), Path(path_text), resume


def _decide(cfg: Config | None, args) -> tuple[Config, Path, dict | None]:
    from mpi_fnas.checkpoint import load_checkpoint

    if not args.resume:
        assert cfg is not None
        path = Path(args.out) if args.out else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if (path / "search.h5").exists():
            raise ConfigError(f"--out: {path} already holds a run log (search.h5); choose another directory or "
                              "--resume it (nothing was overwritten)")
        _make_dir(path)
        return cfg, path, None

    path = Path(args.resume)
    try:
        state = load_checkpoint(path)
    except (ValueError, OSError, RuntimeError) as exc:
        raise ConfigError(f"--resume: cannot read {path}/checkpoint.pt ({exc})") from None
    if state is None:  # preempted before the first checkpoint: start afresh, keep what is there
        if cfg is None:
            raise ConfigError(f"--resume: {path} holds no checkpoint; give --config to start the run afresh there")
        _make_dir(path)
        log = path / "search.h5"
        if log.exists():
            n = 1
            while (path / f"search-attempt{n}.h5").exists():
                n += 1
            log.rename(path / f"search-attempt{n}.h5")
        return cfg, path, None
    saved = config_from_text(state["config"])
    if cfg is not None and (args.config or args.overrides) and not cfg.same_search(saved):
        raise ConfigError(f"--resume: the given config differs from the one {path} was started with "
                          "(only runtime.* and checkpoint.* may change)")
    from mpi_fnas.runlog import read_run

    if read_run(path / "search.h5")["status"] == "finished":
        raise ConfigError(f"--resume: the run in {path} has already finished")
    if cfg is not None and (args.config or args.overrides):
        saved.runtime, saved.checkpoint = cfg.runtime, cfg.checkpoint
    return saved, path, state


def _make_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out: cannot create {path}: {exc.strerror}") from None


def _summary(outcome) -> None:
    mins, secs = divmod(outcome.wall_seconds, 60)
    if outcome.epsilon is None:
        val = f"{outcome.val_acc:.4f}  (loss {outcome.val_loss:.4f}, all parties' validation shards)"
    else:
        val = "not released under DP (it would be an unaccounted release); see the test accuracy"
    lines = [
        "",
        "== mpi_fnas search finished ==",
        f"mode            {outcome.mode}",
        f"parties         {outcome.parties}",
        f"epochs          {outcome.epochs} ({outcome.steps} steps; {outcome.stop_reason})",
        f"final val acc   {val}",
        f"test acc        {outcome.test_acc:.4f}  (server's test split, supernet)",
    ]
    if outcome.epsilon is not None:
        eps, mu = outcome.epsilon, outcome.mu_gdp
        lines += [
            f"privacy         ε = {eps.max():.4g} (worst party) … {eps.min():.4g} (best) at δ = "
            f"{outcome.delta.max():.3g} — tight PLD bound, per party, max over its train/val ledgers",
            f"                (paper's Theorem 3.1 μ-GDP, a CLT approximation: μ = {mu.max():.4g}; not the guarantee)",
        ]
    lines += [
        f"genotype        {outcome.genotype}",
        f"wall time       {int(mins)}m{secs:04.1f}s",
        f"log             {outcome.log_path}",
    ]
    print("\n".join(lines), flush=True)


# -- threads ------------------------------------------------------------------------------------------------------
def _launcher_rank() -> int | None:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return None


def _local_ranks() -> int:
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def _threads(cfg: Config | None) -> int:
    """runtime.threads_per_rank, else OMP_NUM_THREADS (a launcher's choice, e.g. --cpus-per-task), else the cores
    this process may use divided by the ranks on this node."""
    if cfg is not None and cfg.runtime.threads_per_rank:
        return cfg.runtime.threads_per_rank
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // _local_ranks())


def _limit_threads(cfg: Config | None) -> None:
    # OpenMP/BLAS pools are sized at library load: set the environment before torch is imported.
    n = str(_threads(cfg))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, n)


if __name__ == "__main__":
    sys.exit(main())
