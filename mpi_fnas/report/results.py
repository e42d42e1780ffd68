"""Results tables written from the runs that made them, never typed: each run's per-seed summary is kept small in
the repository (``docs/results/runs.csv``: table, arm, dataset, ε target, seed, accuracy, ε, wall, config, commit,
cell, CPU model), and the Markdown tables of the README and the docs are rendered from that file between markers.

    python -m mpi_fnas.report.results record RUN_DIR... --arm ARM [--note TEXT]   # add the runs' summaries
    python -m mpi_fnas.report.results record RUN_DIR --arm ARM --tuning SETTING   # a tuning run (data.holdout)
    python -m mpi_fnas.report.results write                                       # rewrite every marked table

A marked table is ``<!-- results: TABLE -->`` … ``<!-- /results -->`` in a Markdown file: rows are the arms, columns
the datasets at each ε of TABLE (:data:`TABLES`), cells the mean ± standard error over seeds (n), beside the
papers' numbers (:data:`PUBLISHED`); ``<!-- tuning: TABLE -->`` … ``<!-- /tuning -->`` lists the tuning runs that
chose each arm's setting (``docs/results/tuning.csv``: the setting tried, its held-out accuracy);
``<!-- cells: TABLE -->`` … ``<!-- /cells -->`` the cell each searched run found.
tests/test_results.py checks that every marked table is what ``write`` renders. A results table takes no tuning
run (``data.holdout`` > 0), so it holds only test-split numbers of finished runs.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from mpi_fnas.baseline.arms import SEARCHED
from mpi_fnas.config import ConfigError, parse_override

ROOT = Path(__file__).resolve().parents[2]
#: The per-seed summaries, in the repository.
RUNS_CSV = ROOT / "docs" / "results" / "runs.csv"
#: A tuning run's summary: its setting and held-out accuracy.
TUNING_CSV = ROOT / "docs" / "results" / "tuning.csv"
#: The Markdown files whose marked tables ``write`` renders.
MARKED = (ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "dpnas.md")
_MARK = re.compile(r"(<!-- (?P<kind>results|tuning|cells): (?P<table>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /(?P=kind) -->)",
                   re.S)


@dataclass(frozen=True)
class RunSummary:
    """One finished run's numbers: what a table's cell averages over seeds."""

    table: str  # the table it belongs to (:data:`TABLES`)
    arm: str  # the row: "searched", "cnn-tanh", "scatter-linear", …
    dataset: str  # data.dataset
    epsilon_target: float  # privacy.target_epsilon (NaN without DP)
    seed: int
    test_acc: float  # the trained network's (the augmentation's; the search's when it trains nothing)
    epsilon_worst: float  # the worst party's ε, search + augmentation
    wall_seconds: float  # search + augmentation
    config: str  # the config's name
    commit: str  # the commit the summary was recorded at
    note: str = ""
    genotype: str = ""  # the cell it trained (a searched arm's: the search's final genotype); "" for a hand design
    cpu_model: str = ""  # its ranks' hosts' (/ranks attr cpu_model, each model once): where the wall time ran


@dataclass(frozen=True)
class TuningSummary:
    """One tuning run: an arm's `setting` (``key=value`` as ``--set`` takes it, several separated by spaces) at the
    tuning seed, scored on the split held out of the training set (``data.holdout``)."""

    table: str
    arm: str
    dataset: str
    epsilon_target: float
    seed: int
    setting: str
    holdout_acc: float
    wall_seconds: float
    commit: str


@dataclass(frozen=True)
class Table:
    """A results table: its arms (rows, in order, with their labels) and datasets (columns, with labels), at each
    ε of `epsilons`; the config each (arm, dataset) runs (an arm without one is only published), the parties of
    every run, and the seeds a cell needs (:mod:`mpi_fnas.report.results_plan` lists the runs a cell lacks)."""

    arms: tuple[tuple[str, str], ...]
    datasets: tuple[tuple[str, str], ...]
    epsilons: tuple[float, ...]
    configs: dict[tuple[str, str], str]
    parties: int = 8
    seeds: tuple[int, ...] = (0, 1, 2)


#: The tables the docs mark: the private networks at 28×28, K = 8, secure aggregation.
TABLES: dict[str, Table] = {
    "private-28": Table(
        arms=(("searched", "searched cell (conv stem, pool head)"),
              ("searched-scattering", "searched cell (scattering stem, head searched)"),
              ("random-scattering", "random cells of that space (no sigmoid)"),
              ("cnn-tanh", "`cnn-tanh` (Papernot et al.'s tanh CNN)"),
              ("scatter-linear", "`scatter-linear` (ScatterNet + linear)"),
              ("scatter-cnn", "`scatter-cnn` (ScatterNet + CNN)"),
              ("dpsur", "DPSUR 2023 (published; not run here)")),
        datasets=(("mnist", "MNIST 28×28"), ("fashion-mnist", "FashionMNIST 28×28")),
        epsilons=(3.0, 2.0, 1.0),
        # A random arm runs its searched arm's config with the cell it draws (mpi_fnas.baseline's random-0).
        configs={(arm, dataset): f"configs/{prefix}{suffix}.yaml"
                 for dataset, prefix in (("mnist", "mnist28"), ("fashion-mnist", "fmnist28"))
                 for arm, suffix in (("searched", ""), ("searched-scattering", "_scattering_stem"),
                                     ("random-scattering", "_scattering_stem"), ("cnn-tanh", "_tanh"),
                                     ("scatter-linear", "_scatter_linear"), ("scatter-cnn", "_scatter_cnn"))}),
}
#: The papers' numbers at (arm, dataset, ε), central DP, δ = 1e-5 (../shared/papers/private-image-anchors.md).
PUBLISHED: dict[tuple[str, str, float], str] = {
    ("searched", "mnist", 3.0): "DPNAS 98.57 (search not charged)",
    ("searched", "fashion-mnist", 3.0): "DPNAS 88.09 (search not charged)",
    ("cnn-tanh", "mnist", 3.0): "98.1 (ε 2.93)",
    ("cnn-tanh", "fashion-mnist", 3.0): "86.0–86.1",
    ("scatter-linear", "mnist", 3.0): "98.7",
    ("scatter-linear", "mnist", 2.0): "98.5",
    ("scatter-linear", "fashion-mnist", 3.0): "89.7",
    ("scatter-cnn", "mnist", 3.0): "98.7",
    ("scatter-cnn", "mnist", 2.0): "98.4",
    ("scatter-linear", "mnist", 1.0): "98.1 (ε 1.2)",
    ("scatter-cnn", "fashion-mnist", 3.0): "89.0",
    ("dpsur", "mnist", 3.0): "98.88",
    ("dpsur", "mnist", 2.0): "98.70",
    ("dpsur", "mnist", 1.0): "97.93",
    ("dpsur", "fashion-mnist", 3.0): "89.71",
    ("dpsur", "fashion-mnist", 2.0): "89.34",
    ("dpsur", "fashion-mnist", 1.0): "88.38",
}


class ResultsError(ValueError):
    """A run that cannot be summarised (not finished, a tuning run) or a file that does not parse: one line."""


# -- summaries ------------------------------------------------------------------------------------------------------
def summarize(run_dir: Path, *, table: str, arm: str, commit: str, note: str = "",
              tuning: str | None = None) -> RunSummary | TuningSummary:
    """The summary of the finished run in `run_dir` as a row of `table`'s `arm`; with `tuning` (the setting it
    tried), of a tuning run, which must have held a split out (``data.holdout``)."""
    from mpi_fnas.runlog import read_run

    if table not in TABLES:
        raise ResultsError(f"unknown table {table!r}; expected one of {', '.join(TABLES)}")
    log_path = Path(run_dir) / "search.h5"
    if not log_path.is_file():
        raise ResultsError(f"{run_dir}: no run log (search.h5)")
    log = read_run(log_path)
    cfg = yaml.safe_load(log["config"])
    holdout = cfg["data"].get("holdout", 0)
    if holdout and tuning is None:
        raise ResultsError(f"{run_dir}: a tuning run (data.holdout {holdout}): its numbers are not the test split's")
    if tuning is not None and not holdout:
        raise ResultsError(f"{run_dir}: not a tuning run (data.holdout 0): it was scored on the test split")
    augment = log["augment"]
    stage = augment if augment is not None else log
    if log["status"] != "finished" or stage["status"] != "finished":
        raise ResultsError(f"{run_dir}: not finished (status {stage['status']})")
    epsilon = np.asarray((stage.get("privacy") or {}).get("epsilon", []), dtype=np.float64)
    walls = [log["cost"]["wall_seconds"], (augment.get("cost") or {}).get("wall_seconds", 0.0) if augment else 0.0]
    target = cfg["privacy"].get("target_epsilon")
    if tuning is not None:
        _check_setting(tuning, cfg, run_dir)
        return TuningSummary(table=table, arm=arm, dataset=cfg["data"]["dataset"],
                             epsilon_target=float(target) if target is not None else math.nan, seed=int(cfg["seed"]),
                             setting=tuning, holdout_acc=float(stage["test_acc"]),
                             wall_seconds=float(np.nansum(walls)), commit=commit)
    # The cell it trained: the one given, else the search's (a hand-designed network has neither).
    genotype = str(cfg["augment"].get("genotype") or log.get("final_genotype") or "")
    models = "; ".join(dict.fromkeys(map(str, log["ranks"].get("cpu_model", []))))  # each machine once, rank order
    return RunSummary(table=table, arm=arm, dataset=cfg["data"]["dataset"],
                      epsilon_target=float(target) if target is not None and cfg["mode"] == "dpfnas" else math.nan,
                      seed=int(cfg["seed"]), test_acc=float(stage["test_acc"]),
                      epsilon_worst=float(epsilon[-1].max()) if epsilon.size else math.nan,
                      wall_seconds=float(np.nansum(walls)), config=str(cfg.get("name", "")), commit=commit, note=note,
                      genotype=genotype, cpu_model=models)


def read_summaries(path: Path = RUNS_CSV, kind: type = RunSummary) -> list:
    """Every summary (of `kind`: :class:`RunSummary`, :class:`TuningSummary`) in `path` ([] when it does not
    exist)."""
    if not Path(path).exists():
        return []
    kinds = {f.name: f.type for f in fields(kind)}
    with open(path, newline="") as f:
        return [kind(**{key: _parse(kinds[key], value) for key, value in row.items()}) for row in csv.DictReader(f)]


def write_summaries(rows: Iterable, path: Path = RUNS_CSV, kind: type = RunSummary) -> None:
    """`rows` into `path`, sorted by table, ε, dataset, arm, seed (and setting) (a stable file to diff)."""
    ordered = sorted(rows, key=lambda r: (r.table, -r.epsilon_target, r.dataset, r.arm, r.seed,
                                          getattr(r, "setting", ""), r.commit))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[f.name for f in fields(kind)], lineterminator="\n")
        writer.writeheader()
        for row in ordered:
            writer.writerow({key: f"{value:.6g}" if isinstance(value, float) else value
                             for key, value in asdict(row).items()})


def _parse(kind: str, value: str) -> object:
    return int(value) if kind == "int" else float(value) if kind == "float" else value


# -- tables ---------------------------------------------------------------------------------------------------------
def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error = sample std / √n; NaN for one value)."""
    array = np.asarray(values, dtype=np.float64)
    se = float(array.std(ddof=1) / math.sqrt(array.size)) if array.size > 1 else math.nan
    return float(array.mean()), se


def render_table(name: str, rows: Sequence[RunSummary]) -> str:
    """The Markdown of table `name` from `rows`: one line per (ε, arm), a column per dataset with ours (mean ± SE in
    %; n seeds; the mean wall time of one run here, search and training) and the papers'."""
    table = TABLES[name]
    head = ["ε", "arm"] + [f"{label} {who}" for _, label in table.datasets for who in ("(ours)", "(papers)")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for epsilon in table.epsilons:
        for arm, label in table.arms:
            cells = []
            for dataset, _ in table.datasets:
                runs = [r for r in rows if (r.table, r.arm, r.dataset) == (name, arm, dataset)
                        and r.epsilon_target == epsilon]
                ours = "–"
                if runs:
                    mean, se = mean_se([r.test_acc for r in runs])
                    minutes = float(np.mean([r.wall_seconds for r in runs])) / 60
                    ours = f"{100 * mean:.2f}" + (f" ± {100 * se:.2f}" if not math.isnan(se) else "") + \
                        f" ({len(runs)}; {minutes:.0f} min)"
                cells.append(f"{ours} | {PUBLISHED.get((arm, dataset, epsilon), '–')}")
            if any(cell != "– | –" for cell in cells):
                lines.append(f"| {epsilon:g} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_tuning(name: str, rows: Sequence[TuningSummary]) -> str:
    """The Markdown of table `name`'s tuning runs: one line per (dataset, ε, arm), each setting tried with its
    held-out accuracy (%), the chosen one (the best) in bold."""
    lines = ["| data | ε | arm | settings tried (held-out accuracy %, tuning seed) | runs |", "|---|---|---|---|---|"]
    labels = dict(TABLES[name].arms)
    keys = sorted({(r.dataset, r.epsilon_target, r.arm) for r in rows if r.table == name},
                  key=lambda k: (k[0], -k[1], _arm_order(name, k[2]), k[2]))
    for dataset, epsilon, arm in keys:
        tried = sorted((r for r in rows if (r.table, r.dataset, r.epsilon_target, r.arm) == (name, dataset, epsilon,
                                                                                               arm)),
                       key=lambda r: _setting_order(r.setting))
        best = max(tried, key=lambda r: r.holdout_acc)
        cells = ", ".join((f"**{r.setting}: {100 * r.holdout_acc:.2f}**" if r is best else
                           f"{r.setting}: {100 * r.holdout_acc:.2f}") for r in tried)
        lines.append(f"| {dataset} | {epsilon:g} | {labels.get(arm, arm)} | {cells} | {len(tried)} |")
    return "\n".join(lines) + "\n"


def render_cells(name: str, rows: Sequence[RunSummary]) -> str:
    """The Markdown of the cells table `name`'s searched arms found: one list item per run (arm, dataset, ε, seed),
    its genotype and test accuracy (%). A list, not a table: a genotype's ``|`` would split a table's cells. A random
    arm's cell was drawn, not found, so it is not listed."""
    labels = dict(TABLES[name].arms)
    found = sorted((r for r in rows if r.table == name and r.genotype and r.arm.startswith(SEARCHED)),
                   key=lambda r: (_arm_order(name, r.arm), r.dataset, -r.epsilon_target, r.seed))
    return "".join(f"- {labels.get(r.arm, r.arm)}, {r.dataset}, ε {r.epsilon_target:g}, seed {r.seed}: "
                   f"`{r.genotype}`, {100 * r.test_acc:.2f} %\n" for r in found)


def _arm_order(name: str, arm: str) -> int:
    """`arm`'s row in table `name` (an arm the table does not list: after every listed one)."""
    order = [listed for listed, _ in TABLES[name].arms]
    return order.index(arm) if arm in order else len(order)


def _setting_order(setting: str) -> tuple:
    """Settings in the order of their values (numbers as numbers: lr=4 before lr=16)."""
    key, _, value = setting.partition("=")
    try:
        return key, 0, float(value), value
    except ValueError:
        return key, 1, 0.0, value


def _render(match: re.Match, rows: Sequence[RunSummary], tuning: Sequence[TuningSummary]) -> str:
    if match.group("kind") == "tuning":
        return render_tuning(match.group("table"), tuning)
    if match.group("kind") == "cells":
        return render_cells(match.group("table"), rows)
    return render_table(match.group("table"), rows)


def rewrite(text: str, rows: Sequence[RunSummary], tuning: Sequence[TuningSummary] = ()) -> str:
    """`text` with every marked table rendered afresh from `rows` (and the tuning tables from `tuning`)."""
    return _MARK.sub(lambda m: m.group(1) + _render(m, rows, tuning) + m.group(5), text)


def stale_tables(rows: Sequence[RunSummary], files: Iterable[Path] = MARKED,
                 tuning: Sequence[TuningSummary] = ()) -> list[str]:
    """The marked tables of `files` that differ from what `rows` and `tuning` render (empty: every one is
    current)."""
    stale = []
    for path in files:
        text = Path(path).read_text(encoding="utf-8")
        for match in _MARK.finditer(text):
            if match.group("body") != _render(match, rows, tuning):
                stale.append(f"{Path(path).name}: {match.group('kind')} {match.group('table')}")
    return stale


def _check_setting(setting: str, cfg: dict, run_dir: Path) -> None:
    """Refuse a tuning `setting` (``key=value``, several separated by spaces) that the run's own config does not
    hold: the tuning table says what each run tried, read from nowhere but the run."""
    for part in setting.split():
        try:
            key, wanted = parse_override(part)
        except ConfigError as exc:
            raise ResultsError(f"--tuning {setting!r}: {exc}") from None
        held = config_value(cfg, key)
        if held is MISSING or held != wanted:
            found = "no such key" if held is MISSING else f"{key}={held}"
            raise ResultsError(f"{run_dir}: the run did not try {part} (its config: {found})")


#: What :func:`config_value` gives for a key the config does not hold.
MISSING = object()


def config_value(cfg: dict, key: str) -> Any:
    """The value of the dotted `key` (``augment.lr``) in the config `cfg` as a dict (a run's logged config, or
    ``Config.to_dict()``); :data:`MISSING` where it has none."""
    held: Any = cfg
    for name in key.split("."):
        held = held.get(name, MISSING) if isinstance(held, dict) else MISSING
    return held


# -- the command line ---------------------------------------------------------------------------------------------
def _identity(row: RunSummary | TuningSummary) -> tuple:
    """What a newer record of the same run replaces: its table, arm, dataset, ε, seed (and setting)."""
    return (row.table, row.arm, row.dataset, row.epsilon_target, row.seed, getattr(row, "setting", None))


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """``python -m mpi_fnas.report.results``: record runs, or rewrite the marked tables; the exit code."""
    parser = argparse.ArgumentParser(prog="python -m mpi_fnas.report.results", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    record = sub.add_parser("record", help="add finished runs' summaries to docs/results/runs.csv")
    record.add_argument("runs", nargs="+", metavar="RUN_DIR")
    record.add_argument("--arm", required=True, help="the row: searched, cnn-tanh, scatter-linear, scatter-cnn, …")
    record.add_argument("--table", default="private-28", help=f"one of {', '.join(TABLES)}")
    record.add_argument("--commit", default=None, help="the commit the runs ran at (default: HEAD)")
    record.add_argument("--note", default="")
    record.add_argument("--tuning", metavar="SETTING", help="a tuning run (data.holdout): the setting it tried, as "
                        "--set takes it, several separated by spaces (e.g. augment.lr=8, or 'augment.lr=8 "
                        "augment.epochs=20'), each checked against the run's config; recorded in "
                        "docs/results/tuning.csv")
    sub.add_parser("write", help="rewrite every marked table of README.md, docs/index.md, docs/benchmarks.md and "
                   "docs/dpnas.md")
    args = parser.parse_args(argv)
    try:
        rows, tuning = read_summaries(), read_summaries(TUNING_CSV, TuningSummary)
        if args.command == "record":
            commit = args.commit or _commit()
            new = [summarize(Path(run), table=args.table, arm=args.arm, commit=commit, note=args.note,
                             tuning=args.tuning) for run in args.runs]
            same = {_identity(n) for n in new}
            if args.tuning is not None:
                write_summaries([*(r for r in tuning if _identity(r) not in same), *new], TUNING_CSV, TuningSummary)
            else:
                write_summaries([*(r for r in rows if _identity(r) not in same), *new])
            print(f"recorded {len(new)} run(s) in {TUNING_CSV if args.tuning is not None else RUNS_CSV}")
            return 0
        for path in MARKED:
            text = path.read_text(encoding="utf-8")
            path.write_text(rewrite(text, rows, tuning), encoding="utf-8")
        print(f"rewrote the marked tables of {', '.join(p.name for p in MARKED)}")
        return 0
    except (ResultsError, OSError, KeyError) as exc:
        print(f"mpi_fnas: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
