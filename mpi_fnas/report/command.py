"""The command line: ``python -m mpi_fnas.report RUN_DIR_OR_ROOT... [--out DIR]`` writes the report;
``python -m mpi_fnas.report --follow RUN_DIR [--interval S]`` follows one run live (see the package docstring)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import NoReturn

from mpi_fnas import __version__, cli
from mpi_fnas.config import ConfigError

DEFAULT_OUT = "report"

_EPILOG = """\
output (DIR, default ./report; an earlier report there is replaced, any other non-empty directory refused):
  report.md, report.html (one self-contained page, figures inline), table1.csv (one row per mode and K),
  table2.csv (only with a noise study: one K at several noise variances σ_W² or σ_aug²), baseline_table.csv
  (only with a random baseline from python -m mpi_fnas.baseline: one row per arm), figures/*.png.
  Runs that are running, failed or interrupted are listed with their status and left out of the means.
follow: --follow RUN_DIR reads the run's log every --interval seconds while it is written and shows
  step/epoch, s/step, ETA, ε per party (worst, best), the genotype and the last test accuracy.
exit codes: 0 done (--follow: the run finished), 1 failure (--follow: the run failed, a dead writer
  included), 2 bad input (one line; nothing written), 75 (--follow) the run was interrupted (resume it).
how each number is derived from the HDF5 log: docs/report.md.
"""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, except that bad input is the project's one line on stderr and exit 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        print(f"mpi_fnas: error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(cli.EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mpi_fnas.report``."""
    parser = _OneLineParser(
        prog="python -m mpi_fnas.report",
        description="Turn run directories (or roots holding them: a Table 1 array, a noise sweep) into the "
        "paper's Tables 1 and 2, figures and a report page; or follow one run live.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="*", metavar="RUN_DIR_OR_ROOT",
                        help="run directories, their search.h5, or directories searched recursively for search.h5")
    parser.add_argument("--out", metavar="DIR", help=f"report directory (default ./{DEFAULT_OUT})")
    parser.add_argument("--follow", metavar="RUN_DIR", help="follow one run while it is written, until it ends")
    parser.add_argument("--interval", type=float, metavar="S", help="--follow: seconds between refreshes "
                        "(default 2)")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for bad input too")
    parser.add_argument("--version", action="version", version=f"mpi_fnas {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m mpi_fnas.report``: the report of the runs under the paths, or ``--follow`` one run; the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.follow is not None:
        if args.paths or args.out is not None:
            parser.error("--follow takes one run directory and no other paths or --out")
        interval = 2.0 if args.interval is None else args.interval
        if not (math.isfinite(interval) and interval > 0):
            parser.error(f"--interval: expected seconds > 0, got {args.interval}")
        return _follow_command(args.follow, interval, args.debug)
    if args.interval is not None:
        parser.error("--interval goes with --follow")
    if not args.paths:
        parser.error("give at least one run directory or root (or --follow RUN_DIR)")
    return _report_command(args.paths, Path(args.out if args.out is not None else DEFAULT_OUT), args.debug)


def _report_command(paths: list[str], out: Path, debug: bool) -> int:
    from mpi_fnas.report.collect import collect_runs
    from mpi_fnas.report.output import check_out_dir, write_report

    try:
        check_out_dir(out)
        runs = collect_runs(paths)  # every log is read (and judged) before anything is built or written
    except ConfigError as exc:
        return cli.report_bad_input(0, exc, debug)

    from mpi_fnas.baseline.results import compare, format_comparison
    from mpi_fnas.report.baseline import baseline_rows, find_baselines, table_runs
    from mpi_fnas.report.document import build_report  # matplotlib, torch (genotypes): only for a real report
    from mpi_fnas.report.tables import augment_noise_label, group_runs, noise_label, table1_groups, table2_groups
    from mpi_fnas.report.trained import trained_groups, trained_runs

    files = build_report(runs, paths)
    try:
        write_report(out, files)
    except ConfigError as exc:
        return cli.report_bad_input(0, exc, debug)
    except OSError as exc:
        print(f"mpi_fnas: error: --out: cannot write the report into {out}: {exc}", file=sys.stderr, flush=True)
        return cli.EXIT_FAILURE
    final = [r for r in runs if r.final]
    print(f"mpi_fnas.report: {len(runs)} runs, {len(final)} finished (in the tables), "
          f"{len(runs) - len(final)} left out", flush=True)
    for r in runs:
        if not r.final:
            print(f"  left out  {r.label}: {r.status} ({r.reason or 'no reason recorded'})")
    baselines = find_baselines(paths)
    groups = group_runs(table_runs(runs, baselines))
    table2 = table2_groups(groups)
    for g, study in [*((g, False) for g in table1_groups(groups)), *((g, True) for g in table2)]:
        std = f" ± {100 * g.test_error_std:.2f}" if math.isfinite(g.test_error_std) else ""
        eps = f"  ε {g.epsilon_worst:.4g}" if math.isfinite(g.epsilon_worst) else ""
        noise = f"  σ_W² {noise_label(g.noise_variance)}  σ_aug² {augment_noise_label(g)}" if study else ""
        print(f"  {g.mode:<8} K={g.parties:<3}{noise}  runs {len(g.runs)}  test error "
              f"{100 * g.test_error_mean:.2f}{std} % ({g.stage})  search {g.search_wall_hours:.3g} h{eps}")
    for g in trained_groups(trained_runs(runs, baselines)):  # a given cell's or a hand-designed network's runs
        eps = f"  ε {g.epsilon_worst:.4g} ({g.epsilon_covers})" if math.isfinite(g.epsilon_worst) else ""
        print(f"  {g.trained} {g.named}: {g.mode} K={g.parties}  runs {len(g.runs)}  test error "
              f"{100 * g.test_error_mean:.2f} %{eps}")
    for directory in baselines:
        print(f"  baseline {directory}:\n" + "\n".join(
            f"    {line}" for line in format_comparison(compare(baseline_rows(directory))).splitlines()))
    figures = sum(name.startswith("figures/") for name in files)
    print(f"wrote {out / 'report.html'}, {out / 'report.md'}, the tables and {figures} figures in {out / 'figures'}",
          flush=True)
    return cli.EXIT_OK


def _follow_command(run_dir: str, interval: float, debug: bool) -> int:
    from mpi_fnas.report.follow import follow

    try:
        return follow(run_dir, interval)
    except ConfigError as exc:
        return cli.report_bad_input(0, exc, debug)
    except KeyboardInterrupt:
        print("", flush=True)
        return 130
