"""The results report: run logs turned into the paper's Tables 1 and 2, figures and one page; and a live view.

    python -m mpi_fnas.report RUN_DIR_OR_ROOT... [--out DIR]     # default DIR: ./report
    python -m mpi_fnas.report --follow RUN_DIR [--interval S]    # one run, while it is written

Every ``search.h5`` at or under the paths is read with :func:`mpi_fnas.runlog.read_run`. Finished runs are grouped
by (mode, K, search noise variance σ_W², augmentation private or not, its noise variance σ_aug²) and averaged over
seeds; runs that are running, failed or interrupted (a dead writer reads as failed) are listed with their status
and left out of the means. DIR receives report.md, report.html (self-contained: the figures inline), table1.csv,
table2.csv (when one K was run at several noise settings), trained.csv (runs that trained a given cell or a
hand-designed network: never in Tables 1 and 2) and figures/*.png. Bad input (a path without runs, a
file that is not a run log, a bad option) is one line on stderr and exit 2, with nothing written; the report is
built in memory and written only when complete.
docs/report.md names every column and figure and the HDF5 path each number comes from.

Modules: ``collect`` (finding logs, one RunRecord per run), ``tables`` (groups, Tables 1 and 2, CSV), ``trained``
(a given cell's and a hand-designed network's runs, grouped apart),
``figures`` (matplotlib, Agg canvas), ``cells`` (a genotype's cells drawn as graphs), ``page`` (Markdown and
self-contained HTML from one block list), ``document`` (what the report says), ``output`` (writing DIR),
``follow`` (the live view) and ``command`` (the command line, ``main``; run by ``__main__``).
"""

from mpi_fnas.report.command import build_parser, main

__all__ = ["build_parser", "main"]
