"""The command line: ``mpirun -n K+1 python -m mpi_fnas.baseline`` runs every arm of a baseline in one MPI job
(see the package docstring)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpi_fnas import __version__, cli
from mpi_fnas.baseline.arms import Arm, arm_config, arms, check_base, earlier_arms, parse_handcrafted
from mpi_fnas.baseline.results import (
    CSV_NAME,
    LOG_NAME,
    ArmResult,
    compare,
    finished,
    format_comparison,
    read_arm,
    write_csv,
)
from mpi_fnas.config import Config, ConfigError, check_world, config_from_text
from mpi_fnas.privacy.trusted_config import AssignmentRefusedError, check_own, own_run_directory
from mpi_fnas.refusal import ReportedRefusalError, refusal_line, refusal_text

if TYPE_CHECKING:
    from mpi_fnas.federation.comm import Channel

_EPILOG = """\
for every seed: the searched arm (the config's search, then the augmentation of the cell it found), --random R
  cells drawn uniformly from the same space (public draw from the seed, logged) and the --handcrafted networks
  (augment.network cnn-tanh, cnn-gn: what a DP practitioner would train instead), each trained by the same
  augmentation; under dpfnas every arm is calibrated to privacy.target_epsilon (required): the searched arm's search
  and augmentation together, another arm's augmentation alone; both ε are reported (they agree within 1 %). Each
  party derives every arm's config from its own command line, and composes its own ε over the arms on its data:
  privacy.party_max_epsilon caps that total.
output: DIR/seed<S>/searched/search.h5, DIR/seed<S>/random-<i>/search.h5, DIR/seed<S>/<network>/search.h5,
  DIR/baseline.csv (one row per arm and seed, rewritten after every arm), DIR/baseline.yaml (the base config). An
  arm that already finished in DIR is read back, not rerun; an unfinished one is refused (resume it with
  mpi_fnas.run --resume, or remove it).
report: python -m mpi_fnas.report DIR adds the baseline table, RI against the random cells' mean and against the
  best hand-designed network, and the searched cell's rank among the random ones.
exit codes: 0 finished, 1 failure (job aborted), 2 bad input, 75 interrupted (the current arm checkpointed).
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mpi_fnas.baseline``."""
    parser = cli.command_parser(
        "mpi_fnas.baseline", "Does the search beat random, and the hand-designed networks? The searched cell against "
        "R random cells of the same space and the hand-designed CNNs asked for, trained by the same augmentation at "
        "the same total ε, over several seeds, in one MPI job.", _EPILOG)
    parser.add_argument("--random", type=int, required=True, metavar="R",
                        help="random cells per seed (NAS practice: at least 8; 0 only with --handcrafted)")
    parser.add_argument("--handcrafted", metavar="NETWORKS", default="",
                        help="hand-designed networks to train as arms too, comma-separated: cnn-tanh,cnn-gn "
                        "(augment.network)")
    parser.add_argument("--seeds", type=int, nargs="+", required=True, metavar="S", help="seeds (at least 3 to "
                        "judge a difference against its standard error)")
    parser.add_argument("--out", metavar="DIR", help="baseline directory (default runs/<name>-baseline-<timestamp>)")
    return parser


def main(argv: list[str] | None = None, comm: Any = None) -> int:
    """``python -m mpi_fnas.baseline`` on every rank of `comm` (COMM_WORLD): the arms of every seed, at equal ε."""
    args = build_parser().parse_args(argv)
    base, config_error = cli.load_config_args(args)
    if config_error is None:
        try:
            _check_arguments(base, args)
        except ConfigError as exc:
            config_error = exc

    def setup(channel: Channel) -> tuple[Config, Path]:
        cli.require_parties(channel, "mpi_fnas.baseline", "mpirun -n 9 python -m mpi_fnas.baseline --random 8 "
                            "--seeds 0 1 2")
        text, path = cli.decide_on_root(channel, lambda: (base.to_yaml(), str(_decide_dir(base, args))))
        resolved = config_from_text(text, stored=True)
        if not channel.is_server:  # a party runs what its own command line says, not what rank 0 claims it says
            check_own(base, resolved, channel.rank)
            path = own_run_directory(args.out, path, rank=channel.rank)
        check_world(resolved, channel.size)
        return resolved, Path(path)

    return cli.run_series(base, config_error, setup, debug=args.debug, comm=comm,
                          run=lambda channel, stop, resolved, out: _run_baseline(resolved, channel, out, args, stop))


def _check_arguments(base: Config, args: argparse.Namespace) -> None:
    check_base(base)
    args.handcrafted = parse_handcrafted(args.handcrafted)
    if args.random < (0 if args.handcrafted else 1):
        raise ConfigError(f"--random: expected at least {0 if args.handcrafted else 1} random cell(s) per seed"
                          f"{'' if args.handcrafted else ' (or --handcrafted networks to compare with)'}, got "
                          f"{args.random}")
    if any(seed < 0 for seed in args.seeds) or len(set(args.seeds)) != len(args.seeds):
        raise ConfigError(f"--seeds: expected distinct seeds >= 0, got {' '.join(map(str, args.seeds))}")


def _decide_dir(base: Config, args: argparse.Namespace) -> Path:
    """Rank 0: the baseline directory; refuses (one line) an arm left unfinished there, before anything runs."""
    path = Path(args.out) if args.out else Path("runs") / f"{base.name}-baseline-{time.strftime('%Y%m%d-%H%M%S')}"
    for arm in arms(args.seeds, args.random, args.handcrafted):
        run_dir = arm.run_dir(path)
        if (run_dir / LOG_NAME).exists() and not finished(run_dir):
            raise ConfigError(f"--out: {run_dir} holds an unfinished run; resume it with mpi_fnas.run --resume "
                              f"{run_dir}, or remove it (nothing was overwritten)")
    cli.make_dir(path)
    (path / "baseline.yaml").write_text(base.to_yaml())
    return path


def _run_baseline(base: Config, channel, out: Path, args: argparse.Namespace, stop: cli.StopRequest) -> int:
    from mpi_fnas.federation.party_disk import EarlierRun, party_dir
    from mpi_fnas.progress import Progress
    from mpi_fnas.stages.job import run_job

    threads = cli.limit_torch_threads(base)
    todo = arms(args.seeds, args.random, args.handcrafted)
    if channel.is_server:
        handcrafted = f" + {', '.join(args.handcrafted)}" if args.handcrafted else ""
        print(f"mpi_fnas {__version__}: baseline: {len(args.seeds)} seed(s) x (searched + {args.random} "
              f"random cells{handcrafted}) = {len(todo)} arms, mode={base.mode} space={base.space.kind} "
              f"parties={channel.parties} threads/rank={threads} out={out}", flush=True)
    results: list[ArmResult] = []
    searched_epsilon: dict[int, float] = {}
    for number, arm in enumerate(todo, start=1):
        run_dir, tag = arm.run_dir(out), f"[{number}/{len(todo)}] seed {arm.seed} {arm.name}"

        def decide(arm: Arm = arm, run_dir: Path = run_dir) -> tuple[str, bool]:
            """Rank 0: the arm's config (as YAML, so every rank runs the same) and whether it already finished."""
            cfg = arm_config(base, arm)
            done = finished(run_dir)
            if not done:
                cli.make_dir(run_dir)
            return cfg.to_yaml(), done

        def one_arm(arm: Arm = arm, run_dir: Path = run_dir, tag: str = tag) -> int:
            text, done = cli.decide_on_root(channel, decide)
            cfg = config_from_text(text, stored=True)
            _accept_arm(channel, base, arm, cfg)
            if not done:
                stage = "search" if arm.searched else "augment"
                if channel.is_server:
                    print(f"{tag} → {run_dir / LOG_NAME}", flush=True)
                # A party composes this arm's releases with its own record of every other arm it ran here.
                earlier = [EarlierRun(*found) for found in earlier_arms(out, arm, channel.rank)] \
                    if not channel.is_server else []
                outcome = run_job(cfg, channel, run_dir, stage=stage, stop_requested=stop, earlier=earlier,
                                  progress=lambda name: (
                                      Progress(cfg.runtime.progress, label=name, private=cfg.mode == "dpfnas")
                                      if channel.is_server else None))
                if not channel.is_server:
                    return cli.EXIT_INTERRUPTED if outcome else cli.EXIT_OK
                if outcome.interrupted:
                    write_csv(out, results)
                    print(f"\nmpi_fnas: {tag} interrupted and checkpointed; resume it with mpi_fnas.run --resume "
                          f"{run_dir}, then run this command again with the same --out", file=sys.stderr, flush=True)
                    return cli.EXIT_INTERRUPTED
            if channel.is_server:
                result = read_arm(run_dir, arm, searched_epsilon.get(arm.seed, float("nan")))
                if arm.searched:
                    searched_epsilon[arm.seed] = result.epsilon_worst
                results.append(result)
                write_csv(out, results)
                _print_arm(tag, result, reused=done)
            return cli.EXIT_OK

        code = cli.run_guarded(channel, one_arm, debug=args.debug,
                               private=base.mode == "dpfnas" and not channel.is_server,
                               party_dir=party_dir(run_dir, channel.rank))
        if code != cli.EXIT_OK:
            return code
    if channel.is_server:
        print("\n" + format_comparison(compare(results)), flush=True)
        print(f"results         {out / CSV_NAME} (report: python -m mpi_fnas.report {out})", flush=True)
    return cli.EXIT_OK


def _accept_arm(channel: Channel, base: Config, arm: Arm, received: Config) -> None:
    """Every party derives `arm`'s config itself from `base`, its own command line's (nothing of it from rank 0), and
    checks rank 0's `received` one against it (:func:`check_own`); the verdicts are gathered, so rank 0 learns a
    refusal before it plans the arm and ends the job at once, after every refusing party printed its line.
    """
    refusal = None
    if not channel.is_server:
        try:
            check_own(arm_config(base, arm), received, channel.rank)
        except AssignmentRefusedError as exc:
            print(refusal_line(channel.rank, exc), file=sys.stderr, flush=True)
            refusal = refusal_text(exc)
    verdicts = channel.gather_objects(refusal)
    if refusal is not None:
        raise ReportedRefusalError(refusal)  # rank 0 ends the job (or this party does, after the grace)
    if channel.is_server:
        refused = {rank: line for rank, line in enumerate(verdicts[1:], start=1) if line is not None}
        if refused:
            from mpi_fnas.federation.comm import PartyFailedError

            rank = min(refused)
            raise PartyFailedError(f"party rank {rank} failed: {refused[rank]} (refused by parties {sorted(refused)})")


def _print_arm(tag: str, result: ArmResult, *, reused: bool) -> None:
    eps = "" if result.epsilon_worst != result.epsilon_worst else (
        f"  ε {result.epsilon_worst:.4g} (searched {result.epsilon_searched:.4g})")
    again = "  (finished earlier: read back)" if reused else ""
    print(f"{tag}: test acc {result.test_acc:.4f}  params {result.params}{eps}  {result.wall_seconds:.1f} s{again}",
          flush=True)
