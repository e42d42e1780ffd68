"""The results report: run logs turned into the paper's Tables 1 and 2, figures and one page; and a live view.

    python -m mpi_fnas.report RUN_DIR_OR_ROOT... [--out DIR]     # default DIR: ./report
    python -m mpi_fnas.report --follow RUN_DIR [--interval S]    # one run, while it is written

Every ``search.h5`` at or under the paths is read with :func:`mpi_fnas.runlog.read_run`. Finished runs are grouped
by (mode, K, σ_W², augmentation private or not, σ_aug²) and averaged over seeds; other runs are listed with their
status and left out of the means. DIR receives report.md, report.html, table1.csv, table2.csv, trained.csv and
figures/*.png, written only once the whole report is built; bad input is one line on stderr and exit 2. Every
column and figure, and the HDF5 path each number comes from: docs/report.md.

Modules: ``collect`` (one RunRecord per run), ``tables`` (Tables 1 and 2, CSV), ``trained`` (a given cell or a
hand-designed network), ``baseline`` (its section), ``cost_model``, ``figures`` (a run's), ``table_figures`` (across
runs), ``cells`` (a genotype drawn), ``page`` (Markdown, HTML), ``document`` (what the report says), ``output``
(writing DIR), ``follow`` (the live view), ``command`` (``main``); ``results``: the README's results tables.
"""

from mpi_fnas.report.command import build_parser, main

__all__ = ["build_parser", "main"]
