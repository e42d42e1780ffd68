"""Command line: ``mpirun -n K+1 python -m mpi_fnas.run [--config FILE] [--set key=value ...]``.

Rank 0 is the parameter server, ranks 1..K are the parties (K = world size − 1). Exit codes:
0 finished · 1 failure (the whole job is aborted; the log says ``failed``) · 2 bad input (one line from rank 0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from mpi_fnas import __version__
from mpi_fnas.config import Config, ConfigError, check_world, describe_keys, load_config

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2

_EPILOG = """\
examples:
  mpirun -n 9 python -m mpi_fnas.run                                   # 8 parties, default config
  mpirun -n 5 python -m mpi_fnas.run --config configs/fnas.yaml --set search.epochs=2
  mpirun -n 2 python -m mpi_fnas.run --config configs/vanilla_nas.yaml # vanilla NAS: one party

configuration keys (every key can be set in a YAML file or with --set; defaults = configs/default.yaml):
{keys}

output: runs/<name>-<YYYYmmdd-HHMMSS>/search.h5 (HDF5, schema in docs/hdf5.md) unless --out is given.
exit codes: 0 finished, 1 failure (job aborted, log status 'failed'), 2 bad input.
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
        if config_error is not None:
            raise config_error
        assert cfg is not None
        check_world(cfg, comm.Get_size())
        run_dir = _agree_run_dir(comm, cfg, args.out)
    except ConfigError as exc:
        return _bad_input(rank, exc, args.debug)
    return _run(cfg, comm, run_dir, args.debug)


def _run(cfg: Config, comm, run_dir: Path, debug: bool) -> int:
    import torch  # after thread limits are in the environment

    from mpi_fnas.federation.comm import Channel, PartyFailedError
    from mpi_fnas.federation.search import ServerReportedError, SetupError, run_search
    from mpi_fnas.progress import Progress

    torch.set_num_threads(_threads(cfg))
    channel = Channel(comm, timeout=cfg.runtime.comm_timeout)
    rank = channel.rank
    if rank == 0:
        print(f"mpi_fnas {__version__}: mode={cfg.mode} parties={channel.parties} ranks={channel.size} "
              f"threads/rank={torch.get_num_threads()} log={run_dir / 'search.h5'}", flush=True)
        print("# resolved config\n" + cfg.to_yaml(), end="", flush=True)
    try:
        outcome = run_search(cfg, channel, run_dir, progress=Progress(cfg.runtime.progress) if rank == 0 else None)
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
    if rank == 0 and outcome is not None:
        _summary(outcome)
    return EXIT_OK


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


def _agree_run_dir(comm, cfg: Config, out: str | None) -> Path:
    """Rank 0 picks (and creates) the run directory; every rank learns it or the same error."""
    result: tuple[str, str] | None = None
    if comm.Get_rank() == 0:
        path = Path(out) if out else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if (path / "search.h5").exists():
            result = ("error", f"--out: {path} already holds a run log (search.h5); "
                               "choose another directory (nothing was overwritten)")
        else:
            try:
                path.mkdir(parents=True, exist_ok=True)
                result = ("ok", str(path))
            except OSError as exc:
                result = ("error", f"--out: cannot create {path}: {exc.strerror}")
    kind, text = comm.bcast(result, root=0)
    if kind == "error":
        raise ConfigError(text)
    return Path(text)


def _summary(outcome) -> None:
    mins, secs = divmod(outcome.wall_seconds, 60)
    lines = [
        "",
        "== mpi_fnas search finished ==",
        f"mode            {outcome.mode}",
        f"parties         {outcome.parties}",
        f"epochs          {outcome.epochs} ({outcome.steps} steps)",
        f"final val acc   {outcome.val_acc:.4f}  (loss {outcome.val_loss:.4f}, all parties' val shards)",
        f"test acc        {outcome.test_acc:.4f}  (server's test split, supernet)",
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
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "PMI_SIZE"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def _threads(cfg: Config | None) -> int:
    """runtime.threads_per_rank, else the cores this process may use divided by the ranks on this node."""
    if cfg is not None and cfg.runtime.threads_per_rank:
        return cfg.runtime.threads_per_rank
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // _local_ranks())


def _limit_threads(cfg: Config | None) -> None:
    # OpenMP/BLAS pools are sized at library load: set the environment before torch is imported.
    n = str(_threads(cfg))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, n)


if __name__ == "__main__":
    sys.exit(main())
