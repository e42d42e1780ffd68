"""Command line: ``mpirun -n K+1 python -m mpi_fnas.run [--config FILE] [--set key=value ...]``.

Rank 0 is the parameter server, ranks 1..K are the parties (K = world size − 1). Exit codes (mpi_fnas.cli):
0 finished · 1 failure (the whole job is aborted; the log says ``failed``) · 2 bad input (one line from rank 0) ·
75 interrupted by SIGTERM/SIGUSR1/SIGINT after writing a checkpoint (resume with ``--resume RUN_DIR``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from mpi_fnas import __version__, cli
from mpi_fnas.config import (
    CELL_NETWORK,
    Config,
    ConfigError,
    check_world,
    config_from_text,
    describe_keys,
    searches_first,
)
from mpi_fnas.privacy.trusted_config import AssignmentRefusedError
from mpi_fnas.stages.summary import summary

if TYPE_CHECKING:  # mpi4py loads with the channel, after the argument and config checks
    from mpi_fnas.federation.comm import Channel

_EPILOG = """\
examples:
  mpirun -n 9 python -m mpi_fnas.run                                   # 8 parties, default config
  mpirun -n 5 python -m mpi_fnas.run --config configs/fnas.yaml --set search.epochs=2
  mpirun -n 2 python -m mpi_fnas.run --config configs/vanilla_nas.yaml # vanilla NAS: one party

configuration keys (every key can be set in a YAML file or with --set; defaults = configs/default.yaml):
{keys}

stages: the search, then (augment.epochs > 0) the augmentation: the found cell trained from scratch by the same
  parties (augment.genotype: train that genotype, no search; augment.network cnn-tanh or cnn-gn: train that
  hand-designed network, no search; augment.epochs=0: search only).
output: runs/<name>-<YYYYmmdd-HHMMSS>/search.h5 (HDF5, schema in docs/hdf5.md; the augmentation in /augment)
  unless --out is given; RUN_DIR/searched.pt when the search finishes; RUN_DIR/checkpoint.pt every
  checkpoint.every_steps steps and on SIGTERM/SIGUSR1/SIGINT (then exit 75).
augment: --augment RUN_DIR trains the cell of the finished search in RUN_DIR, continuing its privacy ledgers and
  appending to its log; only augment.*, runtime.* and checkpoint.* may be changed (with --set).
resume: --resume RUN_DIR continues from its checkpoint with the checkpointed config (a --config/--set given
  too must agree with it except runtime.* and checkpoint.*); without a checkpoint it starts afresh there,
  keeping an earlier search.h5 as search-attempt<N>.h5.
exit codes: 0 finished, 1 failure (job aborted, log status 'failed'), 2 bad input, 75 interrupted (checkpointed).
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mpi_fnas.run`` (its ``--help`` lists every config key)."""
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
    parser.add_argument("--augment", metavar="RUN_DIR",
                        help="train the cell of the finished search in RUN_DIR (--set augment.* may change)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser


def main(argv: list[str] | None = None, comm: Any = None) -> int:
    """``python -m mpi_fnas.run`` on every rank: the job (search, augmentation) and its summary; the exit code.

    `comm`: the communicator the job runs on (rank 0 the server), default COMM_WORLD; the tests run several jobs in
    one set of warm processes on sub-communicators of theirs (tests/helpers/job_pool.py)."""
    args = build_parser().parse_args(argv)
    cfg, config_error = cli.load_config_args(args)
    if args.print_config and config_error is None and cli.launcher_rank(comm) in (None, 0):
        print(cfg.to_yaml(), end="")
        return cli.EXIT_OK

    from mpi_fnas.federation.comm import Channel

    channel = Channel(cli.start_mpi(cfg) if comm is None else comm)
    stop = cli.StopRequest.install()
    made: list[Path] = []  # rank 0: the run directory this launch created, if it did
    code, launch = cli.run_guarded_value(channel, lambda: agree_on_launch(channel, cfg, config_error, args, made),
                                         debug=args.debug)
    if code != cli.EXIT_OK:
        return _tidy_bad_input(code, channel.rank, made)
    channel.timeout = launch.cfg.runtime.comm_timeout
    # Its own config's mode too: a party whose user asked for DP keeps its error texts even if rank 0 said otherwise.
    private_party = "dpfnas" in (launch.cfg.mode, cfg.mode if cfg is not None else None) and not channel.is_server
    from mpi_fnas.federation.party_disk import party_dir

    code = cli.run_guarded(channel, lambda: _run(launch, channel, args, stop), debug=args.debug,
                           private=private_party, party_dir=party_dir(launch.run_dir, channel.rank))
    stop.disarm()
    return _tidy_bad_input(code, channel.rank, made)


class Launch(NamedTuple):
    """What every rank takes from the launch: the config it runs, the config it trusts (rank 0's own: the same), its
    run directory, the stage to run, and a party's refusal for its first setup report (None: it refuses nothing)."""

    cfg: Config
    own: Config
    run_dir: Path
    stage: str
    refusal: AssignmentRefusedError | None = None


def agree_on_launch(channel: Channel, cfg: Config | None, config_error: ConfigError | None,
                    args: argparse.Namespace, made: list[Path]) -> Launch:
    """The launch every rank runs: bad input (`config_error`, options that do not combine) raised; then rank 0
    decides the config, the run directory and the stage (:func:`decide_launch`, a directory it creates appended to
    `made`) and every party accepts or refuses them (:func:`accept_launch`)."""
    if config_error is not None and not ((args.resume or args.augment) and not args.config and not args.overrides):
        raise config_error
    if args.resume and args.out and Path(args.resume) != Path(args.out):
        raise ConfigError("--out and --resume name different run directories; give one of them")
    if args.augment and (args.resume or args.out):
        raise ConfigError("--augment RUN_DIR names its run directory; do not combine it with --resume or --out")
    text, path, stage = cli.decide_on_root(channel, lambda: decide_launch(cfg, args, made))
    if channel.is_server:
        run_cfg = config_from_text(text, stored=True)
        check_world(run_cfg, channel.size)
        return Launch(run_cfg, run_cfg, Path(path), stage)
    # A party runs what it checked, keeps its state where it says, and refuses in its first setup report.
    run_cfg, own, run_dir, refusal = accept_launch(cfg, args, text, path, channel.rank, channel.size)
    return Launch(run_cfg, own, run_dir, stage, refusal)


def accept_launch(own: Config | None, args: argparse.Namespace, text: str, path: str, rank: int, size: int
                  ) -> tuple[Config, Config, Path, AssignmentRefusedError | None]:
    """A party's side of the launch: rank 0's config `text` against the config it trusts (its own, or on
    ``--resume``/``--augment`` its pin: :func:`~mpi_fnas.privacy.trusted_config.trusted_config`), and rank 0's run
    directory `path` against the one it was launched with. Returns (the config it runs, the config it trusts, its
    run directory, its refusal or None).

    A refusal (a difference in a privacy-relevant key, text that does not parse or validate here, another run
    directory) is not raised here but kept: the party takes part in the stage's setup, by rank 0's config where it
    parses (so that its exchanges are the ones rank 0 and the others make; its own where it does not) and from its
    own directory, builds and sends nothing else, and puts its one line in its first setup report
    (:func:`~mpi_fnas.stages.party_driver.participate`), so that rank 0 opens its log, marks it failed and ends the
    job at once. Raises :class:`~mpi_fnas.privacy.trusted_config.AssignmentRefusedError` only when it has no config
    to trust at all (then nothing can be set up), and ConfigError (bad input, exit 2 on every rank) when rank 0's
    config does not fit the world of `size` ranks, as rank 0 finds too."""
    from mpi_fnas.privacy import trusted_config as trusted

    refusal: AssignmentRefusedError | None = None
    try:
        run_dir = trusted.own_run_directory(args.augment or args.resume or args.out, path, rank=rank)
    except AssignmentRefusedError as exc:
        run_dir, refusal = Path(args.augment or args.resume or args.out), exc
    overrides = args.overrides if args.augment else resumable_overrides(args.overrides)
    expected, name = trusted.trusted_config(own, explicit=bool(args.config or args.overrides),
                                            resume=bool(args.resume), augment=bool(args.augment),
                                            overrides=overrides, config_file=bool(args.config),
                                            pin=trusted.read_pin(trusted.pin_directory(run_dir, rank)), rank=rank)
    try:
        received = config_from_text(text, stored=True)
    except ConfigError as exc:
        return expected, expected, run_dir, refusal or AssignmentRefusedError(
            f"rank {rank} refuses the config rank 0 sent: it does not validate here "
            f"({exc}); nothing was computed or sent")
    check_world(received, size)
    try:
        trusted.check_config(expected, received, rank=rank, trusted_name=name)
    except AssignmentRefusedError as exc:
        refusal = refusal or exc
    # Rank 0's text, parsed, sets the setup's exchanges the party takes part in until its report; nothing is built.
    return received, expected, run_dir, refusal


def check_placement(channel: Channel, cfg: Config, own: Config, stage: str,
                    pending: list[AssignmentRefusedError] | None = None) -> list[str]:
    """Every rank reports its host, the memory its node gives the job and its cores (public machine facts); rank 0
    refuses (bad input, one line) a placement whose expected peak cannot fit a node, and chooses the exchange
    pattern, which every party checks against its `own` config (:func:`cli.agree_on_exchange`; a party's refusal
    goes to `pending`, for its first setup report). Rank 0 gets the lines to print."""
    from mpi_fnas.federation.memory import node_facts

    facts = channel.gather_objects(node_facts(cfg.runtime.node_memory_mb))  # rank 0: every rank's; parties: None

    def plan() -> list[str]:
        from mpi_fnas.federation.memory import plan_memory

        memory = plan_memory(cfg, facts, stage=stage)
        refusal = memory.refusal()
        if refusal is not None:
            raise ConfigError(refusal)
        return memory.lines()

    lines = cli.decide_on_root(channel, plan) or []
    return [*lines, cli.agree_on_exchange(channel, cfg, own, facts, pending=pending)]


def _tidy_bad_input(code: int, rank: int, made: list[Path]) -> int:
    """Bad input found after rank 0 created the run directory (a world size that does not fit the config, a data
    folder that is not there) leaves nothing in it: remove it again, so that a refused launch leaves no empty
    ``runs/<name>-<time>/`` behind. Anything written there is kept."""
    if code == cli.EXIT_BAD_INPUT and rank == 0:
        for path in made:
            with contextlib.suppress(OSError):
                path.rmdir()  # only an empty directory goes
    return code


def _run(launch: Launch, channel: Channel, args: argparse.Namespace, stop: cli.StopRequest) -> int:
    from mpi_fnas.checkpoint import load_checkpoint
    from mpi_fnas.progress import Progress
    from mpi_fnas.stages.job import run_job

    cfg, own, run_dir, stage, refusal = launch
    # After the imports (torch), so that the parties import it while rank 0 plans.
    pending = [refusal] if refusal is not None else []  # a party's launch refusal, for its first setup report
    placement = check_placement(channel, cfg, own, stage, pending)
    threads = cli.limit_torch_threads(cfg)
    resume = None
    if channel.is_server and (args.resume or args.augment):
        resume = load_checkpoint(run_dir)
        if resume is not None and resume.get("stage", "search") != stage:
            resume = None  # a search checkpoint left behind by a search that has finished since
    if channel.is_server:
        what = "starting"
        if resume is not None:
            what = f"resuming {'the augmentation ' if stage == 'augment' else ''}at step {int(resume['step']) + 1}"
        elif stage == "augment":
            what = "starting the augmentation"
        print(f"mpi_fnas {__version__}: {what}: mode={cfg.mode} parties={channel.parties} ranks={channel.size} "
              f"threads/rank={threads} log={run_dir / 'search.h5'}", flush=True)
        if cfg.mode == "dpfnas" and cfg.privacy.reproducible_noise:
            print("mpi_fnas: WARNING: privacy.reproducible_noise is on: every party's noise and sampling follow from "
                  "the public config, so the ε this run reports is VOID (for tests and debugging only)",
                  file=sys.stderr, flush=True)
        if cfg.data.holdout:
            print(f"mpi_fnas: tuning: data.holdout {cfg.data.holdout}: every 'test' number below is on the train "
                  "split's last examples held out of the parties' data, not on the test split", flush=True)
        if cfg.mode == "dpfnas" and cfg.augment.epochs > 0 and not cfg.augment.private:
            print("mpi_fnas: WARNING: augment.private is false: the augmentation trains with EXACT gradients, so the "
                  "final weights are NOT private and the ε reported covers the search only", file=sys.stderr,
                  flush=True)
        print("\n".join(placement), flush=True)
        if args.verbose:
            print("# resolved config\n" + cfg.to_yaml(), end="", flush=True)
    outcome = run_job(cfg, channel, run_dir, stage=stage, resume=resume,
                      progress=lambda name: Progress(cfg.runtime.progress, label=name, private=cfg.mode == "dpfnas")
                      if channel.is_server else None,
                      stop_requested=stop, refusal=pending[0] if pending else None)
    if not channel.is_server:
        return cli.EXIT_INTERRUPTED if outcome else cli.EXIT_OK
    if outcome.interrupted:
        stopped = outcome.augment if outcome.augment is not None else outcome.search
        print(f"\nmpi_fnas: {stopped.stop_reason}; resume with: --resume {run_dir}", file=sys.stderr, flush=True)
        return cli.EXIT_INTERRUPTED
    print(summary(outcome.search, outcome.augment), flush=True)
    return cli.EXIT_OK


def decide_launch(cfg: Config | None, args: argparse.Namespace, made: list[Path]) -> tuple[str, str, str]:
    """Rank 0: the config (as YAML text, so every rank runs the same one), the run directory and the stage; a new
    run's directory, if this launch creates it, is appended to `made`."""
    if args.augment:
        return _decide_augment(cfg, args)
    if not args.resume:
        assert cfg is not None
        path = Path(args.out) if args.out else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if (path / "search.h5").exists():
            raise ConfigError(f"--out: {path} already holds a run log (search.h5); choose another directory or "
                              "--resume it (nothing was overwritten)")
        _check_stages(cfg)
        if not path.exists():
            made.append(path)
        cli.make_dir(path)
        return cfg.to_yaml(), str(path), _first_stage(cfg)
    return _decide_resume(cfg, args)


def _first_stage(cfg: Config) -> str:
    """A new job's first stage (:func:`~mpi_fnas.config.searches_first`)."""
    return "search" if searches_first(cfg.augment.genotype, cfg.augment.network) else "augment"


def _check_stages(cfg: Config) -> None:
    if cfg.augment.genotype is not None and cfg.augment.epochs == 0:
        raise ConfigError("augment.genotype: training a given genotype needs augment.epochs > 0")
    if cfg.augment.network != CELL_NETWORK and cfg.augment.epochs == 0:
        raise ConfigError(f"augment.network: training the hand-designed {cfg.augment.network} needs augment.epochs > 0 "
                          "(it does not search)")


def _decide_resume(cfg: Config | None, args: argparse.Namespace) -> tuple[str, str, str]:
    from mpi_fnas.checkpoint import load_checkpoint
    from mpi_fnas.stages.job import searched_state

    path = Path(args.resume)
    try:
        state = load_checkpoint(path)
        searched = searched_state(path)
    except (ValueError, OSError, RuntimeError) as exc:
        raise ConfigError(f"--resume: cannot read the checkpoint in {path} ({exc})") from None
    log = path / "search.h5"
    if state is None and searched is None:  # preempted before the first checkpoint: start afresh, keep what is there
        if cfg is None:
            raise ConfigError(f"--resume: {path} holds no checkpoint; give --config to start the run afresh there")
        _check_stages(cfg)
        cli.make_dir(path)
        if log.exists():
            n = 1
            while (path / f"search-attempt{n}.h5").exists():
                n += 1
            log.rename(path / f"search-attempt{n}.h5")
        return cfg.to_yaml(), str(path), _first_stage(cfg)
    augmenting = state is not None and state.get("stage") == "augment"
    saved = config_from_text(state["config"] if state is not None and (augmenting or searched is None)
                             else searched["config"], stored=True)
    if cfg is not None and (args.config or args.overrides) and not cfg.same_search(saved):
        raise ConfigError(f"--resume: the given config differs from the one {path} was started with "
                          "(only runtime.* and checkpoint.* may change)")
    if not log.exists():
        raise ConfigError(f"--resume: {path} holds checkpoint.pt but no search.h5; the run cannot be continued "
                          "without its log (start a new run with --out)")
    run = _read_log(log, "--resume")
    if cfg is not None and args.config:
        saved.runtime, saved.checkpoint = cfg.runtime, cfg.checkpoint
    elif args.overrides:  # only the runtime.* and checkpoint.* keys given change: the others keep the run's own
        saved = config_from_text(saved.to_yaml(), resumable_overrides(args.overrides), stored=True)
    if searched is None and not augmenting:  # the search did not finish
        if run["status"] == "finished":
            raise ConfigError(f"--resume: the run in {path} has already finished")
        if run["status"] == "running":
            raise ConfigError(f"--resume: the run in {path} is still running (its writer is alive); stop it first")
        return saved.to_yaml(), str(path), "search"
    augment = run.get("augment")
    if augment is not None and augment["status"] == "running":
        raise ConfigError(f"--resume: the run in {path} is still running (its writer is alive); stop it first")
    if saved.augment.epochs == 0 or (augment is not None and augment["status"] == "finished"):
        raise ConfigError(f"--resume: the run in {path} has already finished")
    return saved.to_yaml(), str(path), "augment"


def resumable_overrides(overrides: list[str]) -> list[str]:
    """The ``--set`` overrides a resume applies to its run's own config: those of ``runtime.*`` and
    ``checkpoint.*`` (the others must agree with the run's config, which ``same_search`` has checked)."""
    return [item for item in overrides if item.strip().startswith(("runtime.", "checkpoint."))]


def _decide_augment(cfg: Config | None, args: argparse.Namespace) -> tuple[str, str, str]:
    from mpi_fnas.stages.job import searched_state

    path = Path(args.augment)
    log = path / "search.h5"
    if not log.exists():
        raise ConfigError(f"--augment: {path} holds no run log (search.h5)")
    run = _read_log(log, "--augment")
    try:
        searched = searched_state(path)
    except (ValueError, OSError, RuntimeError) as exc:
        raise ConfigError(f"--augment: cannot read {path}/searched.pt ({exc})") from None
    if run["status"] != "finished" or searched is None:
        raise ConfigError(f"--augment: the search in {path} did not finish (status {run['status']}); "
                          f"continue it with --resume {path}")
    augment = run.get("augment")
    if augment is not None:
        if augment["status"] == "finished":
            raise ConfigError(f"--augment: the run in {path} was already augmented "
                              f"(test accuracy {augment['test_acc']:.4f})")
        raise ConfigError(f"--augment: the augmentation of {path} was started already (status {augment['status']}); "
                          f"continue it with --resume {path}")
    if args.config:
        raise ConfigError("--augment uses the run's own config; change the augmentation with --set augment.KEY=VALUE")
    try:
        saved = config_from_text(searched["config"], args.overrides, where="--augment", stored=True)
    except ConfigError as exc:
        raise ConfigError(str(exc)) from None
    original = config_from_text(searched["config"], stored=True).to_dict()
    changed = saved.to_dict()
    for key in ("augment", "runtime", "checkpoint"):
        original.pop(key)
        changed.pop(key)
    if changed != original:
        raise ConfigError("--augment: only augment.*, runtime.* and checkpoint.* may differ from the search's config")
    if saved.augment.epochs == 0:
        raise ConfigError("--augment: the run's config has augment.epochs: 0; set it with --set augment.epochs=N")
    if saved.augment.genotype is not None:
        raise ConfigError("--augment trains the searched cell; to train a given genotype start a new run with "
                          "--set augment.genotype=...")
    return saved.to_yaml(), str(path), "augment"


def _read_log(log: Path, option: str) -> dict:
    from mpi_fnas.runlog import read_run

    try:
        return read_run(log)
    except OSError as exc:
        raise ConfigError(f"{option}: cannot read {log} ({exc})") from None


if __name__ == "__main__":
    cli.exit_process(main())
