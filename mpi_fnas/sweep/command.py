"""The command line: ``python -m mpi_fnas.sweep`` runs every point of a sweep in one MPI job, or with
``--summarize DIR`` tables an existing sweep (see the package docstring)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mpi_fnas import __version__, cli
from mpi_fnas.config import Config, ConfigError, check_world, config_from_text
from mpi_fnas.privacy.trusted_config import AssignmentRefusedError, check_own, own_run_directory
from mpi_fnas.sweep.points import (
    SWEEP_KEY,
    SweepSpec,
    load_sweep,
    parse_sweep_section,
    point_config,
    sweep_yaml,
    variance_label,
)
from mpi_fnas.sweep.results import PointResult, read_point
from mpi_fnas.sweep.summary import POINTS_CSV, SUMMARY_CSV, format_table, summarize, summarize_dir, write_results

if TYPE_CHECKING:
    from mpi_fnas.federation.comm import Channel

_EPILOG = """\
the sweep config is a run config (see python -m mpi_fnas.run --help for its keys) plus an optional section
  sweep:
    variances: [0.5, 1, 2, 5, 8, 10]   # noise variance sigma^2 per point; sigma_W = sigma_A = sqrt(variance)
    seeds: [0, 1, 2]                   # every variance is run with every seed (default: [0])
  which --set sweep.variances=[1,10] / --set sweep.seeds=[0] override. mode must be dpfnas and
  privacy.target_epsilon unset (the sweep sets sigma itself).

output: DIR/var<variance>-seed<seed>/search.h5 per point (DIR: --out, default runs/<name>-sweep-<timestamp>),
  DIR/points.csv (one row per run) and DIR/summary.csv (one row per variance), rewritten after every point.
  --summarize DIR reads the logs of a finished sweep (or of slurm/noise_sweep.sh's array job) without MPI.
privacy: epsilon_worst is one run alone. epsilon_sweep_composed (table column "ε sweep") is what a party really
  spent over the sweep: every variance of a seed reuses the same examples on the same parties, so its epsilon
  composes (PLD) over all of them, at delta_sweep_composed; synthetic-shapes seeds draw different examples
  (one composition per seed), CIFAR-10 seeds only re-partition the same images (one composition over every
  point, worst case over which party held an image). Unfinished or requeued runs count at an upper bound.
exit codes: 0 finished, 1 failure (job aborted), 2 bad input, 75 interrupted (current point checkpointed).
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mpi_fnas.sweep``."""
    # --config takes an optional sweep: section; --set sweep.seeds=[0,1,2] works
    parser = cli.command_parser(
        "mpi_fnas.sweep", "DP-FNAS noise sweep (paper Table 2): one run per (noise variance, seed), all inside one "
        "MPI job. Rank 0 is the parameter server; ranks 1..K are the parties.", _EPILOG)
    parser.add_argument("--out", metavar="DIR", help="sweep directory (default runs/<name>-sweep-<timestamp>)")
    parser.add_argument("--summarize", metavar="DIR", help="print and write the table of an existing sweep "
                        "directory, then exit (no MPI)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved sweep config and exit")
    return parser


def main(argv: list[str] | None = None, comm: Any = None) -> int:
    """``python -m mpi_fnas.sweep`` on every rank of `comm` (COMM_WORLD): every point, then the summary; exit code."""
    args = build_parser().parse_args(argv)
    if args.summarize:
        return _summarize_command(args)
    # Parse the config before touching MPI or torch: bad input should be cheap and identical on every rank.
    try:
        base, spec = load_sweep(args.config, args.overrides)
        config_error = None
    except ConfigError as exc:
        base, spec, config_error = None, None, exc
    if args.print_config and config_error is None and cli.launcher_rank(comm) in (None, 0):
        print(sweep_yaml(base, spec), end="")
        return cli.EXIT_OK

    def setup(channel: Channel) -> tuple[Config, SweepSpec, Path]:
        cli.require_parties(channel, "mpi_fnas.sweep",
                            "mpirun -n 5 python -m mpi_fnas.sweep --config configs/dpfnas_noise_sweep.yaml")
        text, path = cli.decide_on_root(channel, lambda: (sweep_yaml(base, spec), str(_decide_dir(base, spec,
                                                                                                   args.out))))
        tree = yaml.safe_load(text)
        resolved_spec = parse_sweep_section(tree.pop(SWEEP_KEY))
        resolved = config_from_text(yaml.safe_dump(tree, sort_keys=False))
        if not channel.is_server:  # a party runs what its own command line says, not what rank 0 claims it says
            check_own(base, resolved, channel.rank)
            if resolved_spec != spec:
                raise AssignmentRefusedError(f"rank {channel.rank} refuses the sweep rank 0 sent: its points differ "
                                             "from this party's own sweep section; nothing was computed or sent")
            path = own_run_directory(args.out, path, rank=channel.rank)
        check_world(resolved, channel.size)
        return resolved, resolved_spec, Path(path)

    def run(channel: Channel, stop: cli.StopRequest, resolved: Config, resolved_spec: SweepSpec, out: Path) -> int:
        return _run_sweep(resolved, resolved_spec, channel, out, args, stop)

    return cli.run_series(base, config_error, setup, run, debug=args.debug, comm=comm)


def _summarize_command(args: argparse.Namespace) -> int:
    try:
        if args.config or args.overrides or args.out:
            raise ConfigError("--summarize takes only the sweep directory")
        results = summarize_dir(args.summarize)
    except ConfigError as exc:
        return cli.report_bad_input(0, exc, args.debug)
    _, summary_path = write_results(args.summarize, results)
    print(format_table(summarize(results)) + f"\nsummary         {summary_path}", flush=True)
    return cli.EXIT_OK


def _decide_dir(base: Config, spec: SweepSpec, out: str | None) -> Path:
    path = Path(out) if out else Path("runs") / f"{base.name}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    for point in spec.points():  # refuse before anything runs: nothing is ever overwritten
        if (path / point.dirname / "search.h5").exists():
            raise ConfigError(f"--out: {path / point.dirname} already holds a run log (search.h5); choose another "
                              "directory (nothing was overwritten)")
    cli.make_dir(path)
    try:
        (path / "sweep.yaml").write_text(sweep_yaml(base, spec))  # what ran, loadable by --config
    except OSError as exc:
        raise ConfigError(f"--out: cannot write {path / 'sweep.yaml'}: {exc.strerror}") from None
    return path


def _run_sweep(base: Config, spec: SweepSpec, channel, out_dir: Path, args: argparse.Namespace,
               stop: cli.StopRequest) -> int:
    from mpi_fnas.federation.party_disk import party_dir
    from mpi_fnas.progress import Progress
    from mpi_fnas.stages.job import run_search

    threads = cli.limit_torch_threads(base)
    rank = channel.rank
    points = spec.points()
    if rank == 0:
        print(f"mpi_fnas {__version__}: noise sweep: {len(spec.variances)} variances x {len(spec.seeds)} seeds = "
              f"{len(points)} runs, parties={channel.parties} ranks={channel.size} "
              f"threads/rank={threads} out={out_dir}", flush=True)
        if args.verbose:
            print("# resolved sweep config\n" + sweep_yaml(base, spec), end="", flush=True)
    results: list[PointResult] = []
    for index, point in enumerate(points, start=1):
        cfg = point_config(base, point)
        run_dir = out_dir / point.dirname
        if rank == 0:
            print(f"[{index}/{len(points)}] variance {variance_label(point.variance)} (σ = {point.sigma:.6g}) "
                  f"seed {point.seed} → {run_dir / 'search.h5'}", flush=True)

        def one_point(cfg: Config = cfg, run_dir: Path = run_dir, tag: str = f"[{index}/{len(points)}]") -> int:
            if rank == 0:
                run_dir.mkdir(parents=True, exist_ok=True)
            outcome = run_search(cfg, channel, run_dir, resume=None, stop_requested=stop,
                                 progress=Progress(cfg.runtime.progress) if rank == 0 else None)
            if rank != 0:
                return cli.EXIT_INTERRUPTED if outcome else cli.EXIT_OK
            if outcome.interrupted:
                if results:
                    write_results(out_dir, results)
                print(f"\nmpi_fnas: {outcome.stop_reason} in {run_dir.name}; resume that run with "
                      f"mpi_fnas.run --resume {run_dir}; points after it did not run", file=sys.stderr, flush=True)
                return cli.EXIT_INTERRUPTED
            # Inside the guard: the parties already wait in the next point's setup, so a failure here must abort.
            results.append(_record(out_dir, run_dir, results, tag))
            return cli.EXIT_OK

        # The same failure policy as mpi_fnas.run: bad input ends every rank with 2, anything else aborts the job.
        code = cli.run_guarded(channel, one_point, debug=args.debug,
                               private=cfg.mode == "dpfnas" and rank != 0, party_dir=party_dir(run_dir, rank))
        if code != cli.EXIT_OK:
            return code
    if rank == 0:
        print("\n" + format_table(summarize(results), channel.parties), flush=True)
        print(f"summary         {out_dir / SUMMARY_CSV} (per run: {out_dir / POINTS_CSV})", flush=True)
    return cli.EXIT_OK


def _record(out_dir: Path, run_dir: Path, earlier: list[PointResult], tag: str) -> PointResult:
    """Rank 0: read a finished point back from its log, rewrite the CSVs, print one line."""
    result = read_point(run_dir)
    write_results(out_dir, [*earlier, result])  # after every point, so a later failure keeps what finished
    print(f"{tag} variance {variance_label(result.variance)} seed {result.seed}: test error "
          f"{result.test_error_pct:.2f}%  ε = {result.epsilon_worst:.4g} (worst party)  {result.steps} steps  "
          f"{result.wall_seconds:.1f} s", flush=True)
    return result
