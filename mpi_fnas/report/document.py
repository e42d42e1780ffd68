"""What the report says: the tables, the runs, the figures, assembled into page blocks and rendered into the files
of the report directory (in memory; mpi_fnas.report.output writes them)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from mpi_fnas import __version__
from mpi_fnas.report.baseline import BASELINE_COLUMNS, BASELINE_CSV, baseline_section, find_baselines, table_runs
from mpi_fnas.report.collect import RunRecord, slugify
from mpi_fnas.report.figures import COST_FIGURE, FIGURE_PIXELS, TABLE1_FIGURE, TABLE2_FIGURE, run_figures
from mpi_fnas.report.page import (
    FIGURES_DIR,
    Block,
    Bullets,
    Heading,
    Image,
    Paragraph,
    Table,
    render_html,
    render_markdown,
)
from mpi_fnas.report.table_figures import cost_figure, table1_figure, table2_figure
from mpi_fnas.report.tables import (
    TABLE1_COLUMNS,
    TABLE1_CSV,
    TABLE2_COLUMNS,
    TABLE2_CSV,
    Group,
    augment_noise_label,
    csv_text,
    group_runs,
    noise_label,
    noise_studies,
    table1_groups,
    table1_rows,
    table2_groups,
    table2_rows,
)
from mpi_fnas.report.trained import (
    TRAINED_COLUMNS,
    TRAINED_CSV,
    TrainedGroup,
    trained_groups,
    trained_rows,
    trained_runs,
)

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
TITLE = "mpi_fnas report"


def build_report(runs: Sequence[RunRecord], inputs: Sequence[str]) -> dict[str, bytes]:
    """Every file of the report directory, by relative path: report.md, report.html, table1.csv, table2.csv (when
    Table 2 exists), trained.csv (when a run trained a given cell or a hand-designed network), baseline_table.csv
    (when a random baseline is among the inputs) and figures/<name>.png. `inputs`: the paths given, named in the
    report's first line. Tables 1 and 2 average searches only (:func:`~mpi_fnas.report.baseline.table_runs`): the
    runs of a baseline are compared in its own section, a given cell's or a hand-designed network's in theirs
    (:mod:`mpi_fnas.report.trained`)."""
    baselines = find_baselines(inputs)
    groups = group_runs(table_runs(runs, baselines))
    table1, table2 = table1_groups(groups), table2_groups(groups)
    trained = trained_groups(trained_runs(runs, baselines))
    across: dict[str, bytes] = {}
    if table1:
        across[TABLE1_FIGURE] = table1_figure(table1)
    if groups:  # every finished run: a search's cost does not depend on its noise, so noise studies count too
        across[COST_FIGURE] = cost_figure([run for run in runs if run.searched])
    if table2:
        across[TABLE2_FIGURE] = table2_figure(table2)
    per_run = {run.slug: run_figures(run) for run in runs}
    images = dict(across)
    for figures in per_run.values():
        images.update(figures)

    blocks: list[Block] = [Heading(TITLE, 1), Paragraph(_summary(runs, inputs))]
    blocks += _table1_blocks(table1, groups)
    blocks += _table2_blocks(table2)
    blocks += _trained_blocks(trained)
    baseline_rows: list[dict[str, object]] = []
    for directory in baselines:
        label = os.path.relpath(directory)
        section, figures, rows = baseline_section(directory, label, slugify(label))
        blocks += section
        images.update(figures)
        baseline_rows += rows
    blocks += _runs_blocks(runs, groups)
    for run in runs:
        blocks += _run_blocks(run, per_run[run.slug])

    files = {
        REPORT_MD: render_markdown(blocks).encode("utf-8"),
        REPORT_HTML: render_html(blocks, images, TITLE).encode("utf-8"),
        TABLE1_CSV: csv_text(TABLE1_COLUMNS, table1_rows(table1)).encode("utf-8"),
    }
    if table2:
        files[TABLE2_CSV] = csv_text(TABLE2_COLUMNS, table2_rows(table2)).encode("utf-8")
    if trained:
        files[TRAINED_CSV] = csv_text(TRAINED_COLUMNS, trained_rows(trained)).encode("utf-8")
    if baselines:
        files[BASELINE_CSV] = csv_text(BASELINE_COLUMNS, baseline_rows).encode("utf-8")
    files.update({f"{FIGURES_DIR}/{name}": png for name, png in images.items()})
    return files


def _summary(runs: Sequence[RunRecord], inputs: Sequence[str]) -> str:
    final = sum(r.final for r in runs)
    where = ", ".join(f"`{path}`" for path in inputs)
    return (f"{len(runs)} run{'s' if len(runs) != 1 else ''} found under {where}: {final} finished (in the tables), "
            f"{len(runs) - final} not finished (listed under Runs, left out of the means). Errors are in %, mean ± "
            f"sample std over seeds; ε is the worst party's tight (PLD) bound. Made by mpi_fnas {__version__}; "
            f"each number's source in the log is described in the project's docs/report.md. Figures are "
            f"{FIGURE_PIXELS[0]} × {FIGURE_PIXELS[1]} px.")


def _table1_blocks(table1: Sequence[Group], groups: Sequence[Group]) -> list[Block]:
    blocks: list[Block] = [Heading("Table 1: accuracy, privacy and search cost"), Paragraph(
        "One row per (mode, K), averaged over seeds. Stage `augment`: the test error of the found cell trained "
        "from scratch (`/augment`); `supernet`: the supernet's after the search (no run of the group was "
        "augmented). ε: search + augmentation composed where the augmentation was private, else the search's. "
        "σ_W²: the search's noise variance; σ_aug²: the augmentation's (`not private`: augment.private was false). "
        "Search cost from `/cost` (all attempts of the search; the augmentation excluded). Params: the augmented "
        "network's, in millions.")]
    studies = sorted(noise_studies(groups))
    if studies:
        names = ", ".join(f"{mode} K={k}" for mode, k in studies)
        blocks.append(Paragraph(f"Left out here, as noise studies (several noise settings σ_W², σ_aug²; see "
                                f"Table 2): {names}."))
    if not table1:
        return [*blocks, Paragraph("No finished run outside a noise study: Table 1 is empty.")]
    # GPU-days only where a run had a GPU: on CPU-only runs the column would be all zeros (table1.csv keeps it)
    gpu = any(g.search_gpu_days > 0 for g in table1)
    header = ("mode", "K", "σ_W²", "σ_aug²", "runs", "test error (%)", "stage", "params (M)", "search GPU-days",
              "search CPU core-h", "search wall h", "attempts", "ε worst")
    rows = tuple((g.mode, str(g.parties), noise_label(g.noise_variance),
                  augment_noise_label(g), str(len(g.runs)), _error(g), g.stage,
                  _num(g.params_m, ".4f"), _num(g.search_gpu_days, ".3g"), _num(g.search_cpu_core_hours, ".3g"),
                  _num(g.search_wall_hours, ".3g"), _num(g.attempts, ".3g"), _num(g.epsilon_worst, ".4g"))
                 for g in table1)
    keep = [i for i, name in enumerate(header) if gpu or name != "search GPU-days"]
    blocks.append(Table(tuple(header[i] for i in keep), tuple(tuple(row[i] for i in keep) for row in rows)))
    blocks.append(Image(TABLE1_FIGURE, "Table 1: test error per mode and K"))
    blocks.append(Image(COST_FIGURE, "Search wall time against K, with the ideal strong-scaling line"))
    return blocks


def _table2_blocks(table2: Sequence[Group]) -> list[Block]:
    if not table2:
        return []
    return [
        Heading("Table 2: error against noise variance"),
        Paragraph("DP-FNAS runs of one K at several noise settings, averaged over seeds: the search's noise variance "
                  "σ_W² (`/privacy/noise_multiplier_w`) and the augmentation's σ_aug² "
                  "(`/augment/privacy/noise_multiplier`; `not private`: augment.private was false, `–`: no "
                  "augmentation). The error is the test error of the row's stage (the parties' validation accuracy "
                  "is not released under DP, so the server's test split stands in for it)."),
        Table(("K", "σ_W²", "σ_aug²", "runs", "error (%)", "stage", "ε worst"),
              tuple((str(g.parties), noise_label(g.noise_variance),
                     augment_noise_label(g), str(len(g.runs)), _error(g),
                     g.stage, _num(g.epsilon_worst, ".4g")) for g in table2)),
        Image(TABLE2_FIGURE, "Table 2: error (left axis) and worst ε (right axis) against the noise variance that "
                             "varies"),
    ]


def _trained_blocks(trained: Sequence[TrainedGroup]) -> list[Block]:
    if not trained:
        return []
    return [
        Heading("Trained without a search: given cells and hand-designed networks"),
        Paragraph("Runs that trained a cell they were given (`augment.genotype`) or a hand-designed network "
                  "(`augment.network`), averaged over seeds per cell or network and setting; never part of Tables 1 "
                  "and 2, which average searches. Such a run has no search noise σ_W², and its ε covers the "
                  "augmentation alone (`augment`), or the search it followed (`search + augment`)."),
        Table(("trained", "cell or network", "mode", "K", "σ_aug²", "runs", "test error (%)", "params (M)",
               "ε worst", "ε covers"),
              tuple((g.trained, f"`{g.named}`", g.mode, str(g.parties), augment_noise_label(g), str(len(g.runs)),
                     _error(g), _num(g.params_m, ".4f"), _num(g.epsilon_worst, ".4g"), g.epsilon_covers or "–")
                    for g in trained)),
    ]


def _runs_blocks(runs: Sequence[RunRecord], groups: Sequence[Group]) -> list[Block]:
    rows = tuple((f"`{r.label}`", r.mode, str(r.parties), _opt(r.seed), noise_label(r.noise_variance),
                  augment_noise_label(r), r.status,
                  _num(100 * r.test_error, ".2f"), r.stage, _opt(r.params),
                  f"{_num(r.epsilon_worst, '.4g')} ({r.epsilon_covers})" if r.epsilon_covers else "–",
                  _num(r.search_wall_seconds, ".1f"),
                  str(r.attempts) + (f" + {r.augment_attempts}" if r.augment_attempts is not None else ""))
                 for r in runs)
    blocks: list[Block] = [Heading("Runs"), Table(
        ("run", "mode", "K", "seed", "σ_W²", "σ_aug²", "status", "test error (%)", "stage", "params",
         "ε worst (covers)",
         "search wall s", "attempts (search + augment)"), rows)]
    notes = [f"`{r.label}`: {r.status}, left out of the means ({r.reason or 'no reason recorded'})"
             for r in runs if not r.final]
    left_out = {r.label: r for g in groups for r in g.left_out}  # one run may be left out of several groups
    notes += [f"`{r.label}`: finished without an augmentation; left out of its group, whose other runs were "
              "augmented (an augmented and a supernet error are different quantities)"
              for r in left_out.values()]
    notes += [f"`{r.label}`: privacy guarantee: {r.privacy_guarantee}"
              for r in runs if r.mode == "dpfnas" and r.privacy_guarantee != "holds"]
    notes += [f"`{r.label}`: trained {_what(r)}, not a searched cell; reported under \"Trained without a search\", "
              "not in Tables 1 and 2" for r in runs if r.final and not r.searched_cell]
    if notes:
        blocks.append(Bullets(tuple(notes)))
    return blocks


def _run_blocks(run: RunRecord, figures: dict[str, bytes]) -> list[Block]:
    blocks: list[Block] = [
        Heading(f"Run {run.label}", 3),
        Paragraph(f"{run.mode}, K = {run.parties}, seed {_opt(run.seed)}, status {run.status}; "
                  + (f"genotype `{run.genotype or 'none yet'}`" if run.searched_cell else _what(run)
                     + (f"; the searched genotype, not trained: `{run.genotype}`"
                        if run.handcrafted and run.searched and run.genotype else ""))),
    ]
    captions = {"alphas": "final alphas (edge × op)", "alphas-epochs": "alphas over epochs",
                "cells": "derived cells", "curves": "loss and accuracy", "epsilon": "ε per party over steps",
                "selection": "selection rate per party"}
    for name in figures:
        suffix = name[len(run.slug) + 1 : -len(".png")]
        blocks.append(Image(name, f"{run.label}: {captions.get(suffix, suffix)}"))
    return blocks


def _what(run: RunRecord) -> str:
    """A run that did not train a searched cell, as the report names it: the cell given, or the network."""
    if run.handcrafted:
        return f"the hand-designed network `{run.network}`"
    return f"a given cell (augmentation of a given cell): `{run.genotype}`"


def _error(g: Group) -> str:
    mean, std = 100 * g.test_error_mean, 100 * g.test_error_std
    if len(g.runs) == 1:
        return f"{_num(mean, '.2f')} (1 run)"
    return f"{_num(mean, '.2f')} ± {_num(std, '.2f')}"


def _num(value: float, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec)


def _opt(value: object) -> str:
    return "–" if value is None else str(value)
