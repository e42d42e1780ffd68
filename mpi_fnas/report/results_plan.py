"""The runs a results table still lacks, as a shell script: planning apart from running. Every arm of the table that
has a config (``Table.configs`` of :mod:`mpi_fnas.report.results`), at every dataset, ε and seed it needs, that
``docs/results/runs.csv`` does not hold yet becomes one run and its ``record``.

    python -m mpi_fnas.report.results_plan > todo.sh     # then, from the repository root: bash todo.sh
    python -m mpi_fnas.report.results_plan --list         # only the runs' names
    python -m mpi_fnas.report.results_plan --only '*-s2' --only 'mnist-*'   # those first, in that order

A random arm trains the cell ``mpi_fnas.baseline``'s ``random-0`` arm draws at that seed (public: a function of the
config and the seed), so its run needs no searched arm beside it.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from mpi_fnas.baseline.arms import RANDOM_PREFIX
from mpi_fnas.report.results import ROOT, TABLES, ResultsError, RunSummary, read_summaries


@dataclass(frozen=True)
class PlannedRun:
    """One run a table lacks: its row, column, ε and seed, and how to run it."""

    arm: str
    dataset: str
    epsilon: float
    seed: int
    config: str  # relative to the repository root
    ranks: int  # the server and the table's parties
    overrides: tuple[str, ...]  # ``--set`` arguments, KEY=VALUE

    @property
    def name(self) -> str:
        """Its run directory's name: ``<dataset>-e<ε>-<arm>-s<seed>``."""
        return f"{self.dataset}-e{self.epsilon:g}-{self.arm}-s{self.seed}"


def missing_runs(table_name: str, rows: Sequence[RunSummary]) -> list[PlannedRun]:
    """The runs of table `table_name` that `rows` do not hold, in the table's order (ε, arm, dataset, seed).

    Args:
        table_name: a key of :data:`~mpi_fnas.report.results.TABLES`.
        rows: the recorded summaries (``read_summaries()``).

    Returns:
        One :class:`PlannedRun` per (arm, dataset, ε, seed) without a row; an arm without a config (a published
        number) is never planned.

    Example:
        >>> names = [run.name for run in missing_runs("private-28", read_summaries())]  # e.g. mnist-e1-cnn-tanh-s0
    """
    from mpi_fnas.baseline.arms import Arm, arm_config  # torch: only to draw a random arm's cell
    from mpi_fnas.config import load_config

    table = TABLES[table_name]
    have = {(r.arm, r.dataset, r.epsilon_target, r.seed) for r in rows if r.table == table_name}
    loaded = {key: load_config(ROOT / path) for key, path in table.configs.items()}  # once, not once per ε
    planned = []
    for epsilon in table.epsilons:
        for arm, _ in table.arms:
            for dataset, _ in table.datasets:
                config = table.configs.get((arm, dataset))
                if config is None:
                    continue
                cfg = loaded[arm, dataset]
                for seed in table.seeds:
                    if (arm, dataset, epsilon, seed) in have:
                        continue
                    overrides = [f"seed={seed}", f"privacy.target_epsilon={epsilon:g}",
                                 f"federation.parties={table.parties}"]  # a run with another K is refused
                    if arm.startswith(RANDOM_PREFIX):
                        drawn = arm_config(cfg, Arm(f"{RANDOM_PREFIX}0", seed)).augment.genotype
                        overrides.append(f"augment.genotype={drawn}")
                    planned.append(PlannedRun(arm, dataset, epsilon, seed, config, table.parties + 1,
                                              tuple(overrides)))
    return planned


_HEAD = """\
#!/usr/bin/env bash
# The {count} run(s) table {table} lacks (seeds {seeds} at every ε), from: python -m mpi_fnas.report.results_plan
# Time: {total}.
# Run it from the repository root: each run, its output in OUT/NAME.log, then its record in docs/results/runs.csv;
# the marked tables are rewritten when it ends. A run directory already there stops it (an interrupted run: resume
# it with mpi_fnas.run --resume DIR and record it, or remove it; then plan again). To stop it between runs, create
# OUT/STOP: the run going on finishes and is recorded. Environment: OUT (runs/{table}), PYTHON and MPIRUN (.venv's,
# else from PATH), MPIRUN_ARGS (more launcher options, e.g. --oversubscribe).
set -euo pipefail
[ -f mpi_fnas/report/results.py ] || {{ echo "run this from the repository root" >&2; exit 2; }}
venv() {{ if [ -x ".venv/bin/$1" ]; then echo ".venv/bin/$1"; else echo "$1"; fi; }}
out=${{OUT:-runs/{table}}}; python=${{PYTHON:-$(venv python)}}; mpirun=${{MPIRUN:-$(venv mpirun)}}
read -r -a launch <<< "${{MPIRUN_ARGS:-}}"
mkdir -p "$out"
trap '"$python" -m mpi_fnas.report.results write' EXIT  # the tables hold every run recorded, however it ends

run() {{  # run NAME ARM RANKS ARGS...: the run in OUT/NAME, then its record
  local dir=$out/$1 arm=$2 ranks=$3
  if [ -e "$out/STOP" ]; then  # asked to stop between runs (not a failure: the runs so far are recorded)
    echo "$out/STOP is there: stopped before $1; remove it and plan again to go on"; exit 0
  fi
  if [ -e "$dir" ]; then
    echo "$dir is there already: resume or record it, or remove it; then plan again" >&2; exit 2
  fi
  echo "== $1"; shift 3
  "$mpirun" "${{launch[@]}}" -n "$ranks" "$python" -m mpi_fnas.run "$@" --out "$dir" > "$dir.log" 2>&1
  "$python" -m mpi_fnas.report.results record "$dir" --arm "$arm" --table {table}
}}

"""


def select(runs: Sequence[PlannedRun], patterns: Sequence[str]) -> list[PlannedRun]:
    """The runs whose names match one of the shell-style `patterns`, in the patterns' order (each pattern's runs in
    `runs`' order, each run once).

    Raises:
        ValueError: a pattern matches no run (a typo would otherwise plan nothing).
    """
    chosen: dict[str, PlannedRun] = {}
    for pattern in patterns:
        matched = [run for run in runs if fnmatchcase(run.name, pattern)]
        if not matched:
            raise ValueError(f"--only {pattern!r} matches none of the {len(runs)} run(s) the table lacks "
                             "(see --list)")
        chosen.update((run.name, run) for run in matched)  # a run already chosen keeps its place
    return list(chosen.values())


def expected_minutes(table_name: str, run: PlannedRun, rows: Sequence[RunSummary]) -> float | None:
    """The median wall time, in minutes, of table `table_name`'s recorded runs of `run`'s arm and dataset at any ε
    (a random arm's at `run`'s seed if there are any, since its seed draws its network), or None without one: what
    the run should take on the machines that ran those."""
    same = [r for r in rows if (r.table, r.arm, r.dataset) == (table_name, run.arm, run.dataset)]
    if run.arm.startswith(RANDOM_PREFIX):
        same = [r for r in same if r.seed == run.seed] or same
    return statistics.median(r.wall_seconds for r in same) / 60 if same else None


def plan_script(table_name: str, runs: Sequence[PlannedRun], rows: Sequence[RunSummary] = ()) -> str:
    """The bash script that runs and records `runs` (:func:`missing_runs`) of table `table_name`, and rewrites the
    marked tables when it ends; each run's comment says how long its cell's recorded `rows` took."""
    seeds = " ".join(map(str, TABLES[table_name].seeds))
    minutes = [expected_minutes(table_name, run, rows) for run in runs]
    known = [m for m in minutes if m is not None]
    total = f"about {sum(known) / 60:.1f} h by the recorded runs' wall times" if known else \
        "unknown (no run of these arms recorded)"
    if known and len(known) < len(runs):
        total += f", {len(known)} of {len(runs)} run(s) known"
    lines = [_HEAD.format(count=len(runs), table=table_name, seeds=seeds, total=total)]
    for run, m in zip(runs, minutes, strict=True):
        sets = " ".join(f"--set {shlex.quote(item)}" for item in run.overrides)
        words = " ".join(shlex.quote(str(word)) for word in (run.name, run.arm, run.ranks, "--config", run.config))
        took = f", about {m:.0f} min" if m is not None else ""
        lines.append(f"# {run.dataset}, ε {run.epsilon:g}, {run.arm}, seed {run.seed}{took}\n"
                     f"run {words} {sets}\n")
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m mpi_fnas.report.results_plan``: print the script of the runs a table lacks; the exit code."""
    parser = argparse.ArgumentParser(prog="python -m mpi_fnas.report.results_plan",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", default="private-28", choices=sorted(TABLES))
    parser.add_argument("--list", action="store_true", help="print the runs' names only, one a line")
    parser.add_argument("--only", action="append", metavar="GLOB", default=[],
                        help="only the runs whose names match GLOB (shell-style, e.g. '*-s2'); several run in the "
                        "order given")
    args = parser.parse_args(argv)
    try:
        rows = read_summaries()
        runs = missing_runs(args.table, rows)
        if args.only:
            runs = select(runs, args.only)
    except (ResultsError, OSError, ValueError) as exc:
        print(f"mpi_fnas: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write("".join(f"{run.name}\n" for run in runs) if args.list else plan_script(args.table, runs, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
