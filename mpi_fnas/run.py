"""Command line: ``mpirun -n K+1 python -m mpi_fnas.run [--config FILE] [--set key=value ...]``.

Rank 0 is the parameter server, ranks 1..K are the parties (K = world size − 1). Exit codes (mpi_fnas.cli):
0 finished · 1 failure (the whole job is aborted; the log says ``failed``) · 2 bad input (one line from rank 0) ·
75 interrupted by SIGTERM/SIGUSR1/SIGINT after writing a checkpoint (resume with ``--resume RUN_DIR``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mpi_fnas import __version__, cli
from mpi_fnas.config import Config, ConfigError, check_world, config_from_text, describe_keys

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
    cli.add_config_arguments(parser)
    parser.add_argument("--out", metavar="RUN_DIR", help="run directory for search.h5 (must not hold a log yet)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, config_error = cli.load_config_args(args)
    if args.print_config and config_error is None and cli.launcher_rank() in (None, 0):
        print(cfg.to_yaml(), end="")
        return cli.EXIT_OK

    from mpi_fnas.federation.comm import Channel

    comm = cli.start_mpi(cfg)
    channel = Channel(comm)
    stop = cli.StopRequest.install()
    state: dict = {}

    def setup() -> int:
        if config_error is not None and not (args.resume and not args.config and not args.overrides):
            raise config_error
        if args.resume and args.out and Path(args.resume) != Path(args.out):
            raise ConfigError("--out and --resume name different run directories; give one of them")
        text, path = cli.decide_on_root(channel, lambda: _decide(cfg, args))
        state["cfg"], state["run_dir"] = config_from_text(text), Path(path)
        check_world(state["cfg"], channel.size)
        return cli.EXIT_OK

    code = cli.run_guarded(channel, setup, debug=args.debug)
    if code != cli.EXIT_OK:
        return code
    run_cfg, run_dir = state["cfg"], state["run_dir"]
    channel.timeout = run_cfg.runtime.comm_timeout
    private_party = run_cfg.mode == "dpfnas" and not channel.is_server
    from mpi_fnas.federation.party_store import party_dir

    code = cli.run_guarded(channel, lambda: _run(run_cfg, channel, run_dir, args, stop), debug=args.debug,
                           private=private_party, party_dir=party_dir(run_dir, channel.rank))
    stop.disarm()
    return code


def _run(cfg: Config, channel, run_dir: Path, args: argparse.Namespace, stop: cli.StopRequest) -> int:
    from mpi_fnas.checkpoint import load_checkpoint
    from mpi_fnas.federation.search import run_search
    from mpi_fnas.progress import Progress

    threads = cli.limit_torch_threads(cfg)
    resume = load_checkpoint(run_dir) if channel.is_server and args.resume else None
    if channel.is_server:
        what = f"resuming at step {int(resume['step']) + 1}" if resume is not None else "starting"
        print(f"mpi_fnas {__version__}: {what}: mode={cfg.mode} parties={channel.parties} ranks={channel.size} "
              f"threads/rank={threads} log={run_dir / 'search.h5'}", flush=True)
        if cfg.mode == "dpfnas" and cfg.privacy.reproducible_noise:
            print("mpi_fnas: WARNING: privacy.reproducible_noise is on: every party's noise and sampling follow from "
                  "the public config, so the ε this run reports is VOID (for tests and debugging only)",
                  file=sys.stderr, flush=True)
        if args.verbose:
            print("# resolved config\n" + cfg.to_yaml(), end="", flush=True)
    outcome = run_search(cfg, channel, run_dir, progress=Progress(cfg.runtime.progress) if channel.is_server else None,
                         resume=resume, stop_requested=stop)
    if not channel.is_server:
        return cli.EXIT_INTERRUPTED if outcome else cli.EXIT_OK
    if outcome.interrupted:
        print(f"\nmpi_fnas: {outcome.stop_reason}; resume with: --resume {run_dir}", file=sys.stderr, flush=True)
        return cli.EXIT_INTERRUPTED
    _summary(outcome)
    return cli.EXIT_OK


def _decide(cfg: Config | None, args: argparse.Namespace) -> tuple[str, str]:
    """Rank 0: the config (as YAML text, so every rank runs the same one) and the run directory."""
    from mpi_fnas.checkpoint import load_checkpoint

    if not args.resume:
        assert cfg is not None
        path = Path(args.out) if args.out else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if (path / "search.h5").exists():
            raise ConfigError(f"--out: {path} already holds a run log (search.h5); choose another directory or "
                              "--resume it (nothing was overwritten)")
        cli.make_dir(path)
        return cfg.to_yaml(), str(path)

    path = Path(args.resume)
    try:
        state = load_checkpoint(path)
    except (ValueError, OSError, RuntimeError) as exc:
        raise ConfigError(f"--resume: cannot read {path}/checkpoint.pt ({exc})") from None
    log = path / "search.h5"
    if state is None:  # preempted before the first checkpoint: start afresh, keep what is there
        if cfg is None:
            raise ConfigError(f"--resume: {path} holds no checkpoint; give --config to start the run afresh there")
        cli.make_dir(path)
        if log.exists():
            n = 1
            while (path / f"search-attempt{n}.h5").exists():
                n += 1
            log.rename(path / f"search-attempt{n}.h5")
        return cfg.to_yaml(), str(path)
    saved = config_from_text(state["config"])
    if cfg is not None and (args.config or args.overrides) and not cfg.same_search(saved):
        raise ConfigError(f"--resume: the given config differs from the one {path} was started with "
                          "(only runtime.* and checkpoint.* may change)")
    if not log.exists():
        raise ConfigError(f"--resume: {path} holds checkpoint.pt but no search.h5; the run cannot be continued "
                          "without its log (start a new run with --out)")
    from mpi_fnas.runlog import read_run

    try:
        status = read_run(log)["status"]
    except OSError as exc:
        raise ConfigError(f"--resume: cannot read {log} ({exc})") from None
    if status == "finished":
        raise ConfigError(f"--resume: the run in {path} has already finished")
    if status == "running":
        raise ConfigError(f"--resume: the run in {path} is still running (its writer is alive); stop it first")
    if cfg is not None and (args.config or args.overrides):
        saved.runtime, saved.checkpoint = cfg.runtime, cfg.checkpoint
    return saved.to_yaml(), str(path)


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
    if outcome.epsilon is not None and outcome.privacy_guarantee != "holds":
        lines += [f"privacy         ε VOID: {outcome.privacy_guarantee}"]
    elif outcome.epsilon is not None:
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


if __name__ == "__main__":
    sys.exit(main())
