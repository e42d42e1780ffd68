"""The command line: ``python -m mpi_fnas.scaling run --out DIR ...`` runs the grid here and collects it;
``python -m mpi_fnas.scaling collect DIR`` reads a study (local, or slurm/scaling.sh's) into DIR/scaling.csv and
DIR/figures/scaling-*.png. Bad input: one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from mpi_fnas import __version__, cli
from mpi_fnas.config import ConfigError
from mpi_fnas.scaling.grid import DEFAULT_PARTIES, EXCHANGES, SCALINGS

if TYPE_CHECKING:
    from mpi_fnas.report.cost_model import Link

_EPILOG = """\
run: one `mpirun -n K+1 python -m mpi_fnas.run` per point (K, exchange, scaling, seed), one after the other, into
  DIR/<scaling>-<exchange>-K<K>-seed<seed>/ (search.h5, launch.log, rss.csv); points whose log says finished are
  skipped, unfinished ones resumed, so the same command again continues a study. Then it collects DIR.
  strong scaling: a K-party point runs ceil(S/K) iterations (the same total work at every K); weak: S at every K.
  S: --steps, default the config's search.epochs x search.steps_per_epoch. Every point sets federation.parties,
  runtime.exchange, search.epochs=1, search.steps_per_epoch, augment.epochs=0 and seed (not settable by --set).
collect: DIR/scaling.csv (one row per point: time per iteration and its split from /cost, rank 0's link and the
  predicted iteration from the cost model, efficiency against the smallest K of each (scaling, exchange) series,
  memory), DIR/figures/scaling-time.png, scaling-efficiency.png, scaling-link.png; the table on stdout.
exit codes: 0 done, 1 a point failed (the others still ran and were collected), 2 bad input.
"""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, except that bad input is one line on stderr and exit 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        print(f"mpi_fnas.scaling: error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(cli.EXIT_BAD_INPUT)


def _add_model_options(parser: argparse.ArgumentParser, cores_default: str) -> None:
    parser.add_argument("--link", default="unlimited", metavar="RATE",
                        help="rank 0's link for the model's prediction, as tc writes it (1gbit, 100mbit, unlimited)")
    parser.add_argument("--cores", type=float, metavar="N",
                        help=f"cores the ranks share, for the model ({cores_default})")
    parser.add_argument("--cluster-link", default="1gbit", metavar="RATE",
                        help="where the ranks share cores, the efficiency figure also draws the model of a cluster, a "
                        "core per rank, with rank 0 on this link (default 1gbit)")
    parser.add_argument("--bench", type=Path, nargs="+", metavar="JSON",
                        help="python -m mpi_fnas.bench --json outputs: the model's party step (default: calibrated on "
                        "each series' smallest K)")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mpi_fnas.scaling``."""
    parser = _OneLineParser(prog="python -m mpi_fnas.scaling", epilog=_EPILOG,
                            description="Scaling study of the search: strong and weak scaling over K and the exchange "
                            "pattern, measured (one run per point) and beside the cost model.",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"mpi_fnas {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{run,collect}")
    run = commands.add_parser("run", help="run the grid on this machine, then collect it",
                              epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--out", required=True, metavar="DIR", help="the study's directory (re-run: resume it)")
    run.add_argument("--parties", type=int, nargs="+", default=list(DEFAULT_PARTIES), metavar="K")
    run.add_argument("--exchanges", nargs="+", default=list(EXCHANGES), metavar="PATTERN",
                     help=f"{' and/or '.join(EXCHANGES)}")
    run.add_argument("--scaling", nargs="+", default=list(SCALINGS), metavar="KIND",
                     help=f"{' and/or '.join(SCALINGS)}")
    run.add_argument("--seeds", type=int, nargs="+", default=[0], metavar="SEED")
    run.add_argument("--steps", type=int, metavar="S", help="iterations of one party alone (K = 1)")
    cli.add_config_arguments(run)
    run.add_argument("--mpirun", metavar="PATH", help="mpirun (default: beside this Python, else on PATH)")
    _add_model_options(run, "default: this machine's")
    collect = commands.add_parser("collect", help="read a study into DIR/scaling.csv and DIR/figures/")
    collect.add_argument("dir", metavar="DIR")
    collect.add_argument("--debug", action="store_true", help="show full tracebacks for bad input too")
    _add_model_options(collect, "default: a core per rank, as on a cluster")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m mpi_fnas.scaling``: the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("give a command: run or collect")
    if args.cores is not None and not (math.isfinite(args.cores) and args.cores > 0):
        parser.error(f"--cores: expected a number > 0, got {args.cores}")
    if args.command == "collect":
        try:
            link, cluster_link, party_step = _model_inputs(args)
        except ConfigError as exc:
            return cli.report_bad_input(0, exc, args.debug)
        return _collect(Path(args.dir), link, cluster_link, party_step, args.cores, args.debug)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from mpi_fnas.scaling.grid import check_overrides, default_steps, plan_grid, point_config
    from mpi_fnas.scaling.runner import find_mpirun, run_grid

    root = Path(args.out)
    try:
        check_overrides(args.overrides)
        steps = args.steps if args.steps is not None else default_steps(args.config, args.overrides)
        points = plan_grid(args.parties, args.exchanges, args.scaling, args.seeds, steps)
        for point in points:  # every point's config is valid before the first one starts
            point_config(point, args.config, args.overrides)
        mpirun = find_mpirun(args.mpirun)
        link, cluster_link, party_step = _model_inputs(args)
        cli.make_dir(root)
    except ConfigError as exc:
        return cli.report_bad_input(0, exc, args.debug)
    print(f"mpi_fnas.scaling: {len(points)} points into {root}", flush=True)
    outcomes = run_grid(points, root, args.config, args.overrides, mpirun)
    cores = args.cores if args.cores is not None else float(os.cpu_count() or 1)
    code = _collect(root, link, cluster_link, party_step, cores, args.debug)
    failed = [o for o in outcomes if not o.skipped and o.exit_code != 0]
    for outcome in failed:
        print(f"mpi_fnas.scaling: {outcome.point.dirname} exited {outcome.exit_code}", file=sys.stderr, flush=True)
    return cli.EXIT_FAILURE if failed or code != cli.EXIT_OK else cli.EXIT_OK


def _model_inputs(args: argparse.Namespace) -> tuple[Link, Link, float | None]:
    """(--link, --cluster-link, the bench's party step or None); ConfigError on a bad --link, --cluster-link or
    --bench."""
    from mpi_fnas.report.cost_model import Link

    links = []
    for option, rate in (("--link", args.link), ("--cluster-link", args.cluster_link)):
        try:
            links.append(Link.parse(rate))
        except ValueError as exc:
            raise ConfigError(f"{option}: {exc}") from None
    link, cluster_link = links
    if not args.bench:
        return link, cluster_link, None
    steps = []
    for path in args.bench:
        try:
            bench = json.loads(path.read_text())
            steps.append(float(bench["dp_step_seconds"] if "dp_step_seconds" in bench else bench["step_seconds"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--bench {path}: not a python -m mpi_fnas.bench --json output ({exc})") from None
    return link, cluster_link, sum(steps) / len(steps)


def _collect(root: Path, link: Link, cluster_link: Link, party_step: float | None, cores: float | None,
             debug: bool) -> int:
    """Read the study under `root` into ROOT/scaling.csv and ROOT/figures/ (the model on `link` with `cores` cores,
    its party step `party_step` or calibrated per series; where `cores` are shared, the efficiency figure also models
    a cluster: a core per rank, `cluster_link`); bad input: one line, exit 2."""
    from mpi_fnas.scaling.figures import study_figures
    from mpi_fnas.scaling.results import read_study, study_rows
    from mpi_fnas.scaling.table import markdown_table, write_csv

    try:
        if not root.is_dir():
            raise ConfigError(f"{root}: no such directory")
        records = read_study(root)
        rows = study_rows(records, link=link, cores=cores, party_step_seconds=party_step)
        cluster = (study_rows(records, link=cluster_link, cores=None, party_step_seconds=party_step)
                   if cores is not None else None)
    except ConfigError as exc:
        return cli.report_bad_input(0, exc, debug)
    csv_path = write_csv(root, rows)
    figures = root / "figures"
    figures.mkdir(exist_ok=True)
    for name, png in study_figures(rows, cores, cluster, cluster_link.describe()).items():
        (figures / name).write_bytes(png)
    print(markdown_table(rows), end="")
    final = sum(row.final for row in rows)
    print(f"mpi_fnas.scaling: {len(rows)} points ({final} finished) -> {csv_path}, {figures}/scaling-*.png", flush=True)
    return cli.EXIT_OK
