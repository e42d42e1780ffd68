"""Writing the report directory so that it never claims a success it did not have.

The whole report is built in memory first (mpi_fnas.report.document); only then is anything written, into a
temporary directory inside DIR, from which the files are moved into place by renames. The old report.md is
removed first and the new one moved in last, after the files the new report lacks are gone: a report.md in DIR
always belongs to a complete report. A directory a crash left without report.md (only the report's own files and
``.report-*`` staging directories) is still the report's, and the staging leftovers are removed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from mpi_fnas import cli
from mpi_fnas.config import ConfigError
from mpi_fnas.report.baseline import BASELINE_CSV
from mpi_fnas.report.document import REPORT_HTML, REPORT_MD, TITLE
from mpi_fnas.report.page import FIGURES_DIR
from mpi_fnas.report.tables import TABLE1_CSV, TABLE2_CSV

#: Everything the report owns in DIR: replaced by a new report (a file the new one lacks is removed).
OWNED = (REPORT_MD, REPORT_HTML, TABLE1_CSV, TABLE2_CSV, BASELINE_CSV, FIGURES_DIR)


STAGING_PREFIX = ".report-"


def check_out_dir(out: Path) -> None:
    """Refuse, before anything is built, an --out that is a file or a non-empty directory that is not a report:
    the report replaces its own files and figures/ and must not mix with other content. A report directory holds
    a report.md that this command wrote (its first line is the report's title), or, after a crash in the middle
    of a write, nothing but the report's own files and staging directories."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} is a file, not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    markdown = out / REPORT_MD
    if markdown.is_file():
        with open(markdown, encoding="utf-8", errors="replace") as f:
            if f.readline().rstrip("\n") == f"# {TITLE}":
                return
        raise ConfigError(f"--out: {out} holds a {REPORT_MD} that this command did not write (not a report "
                          "directory); choose another directory")
    if all(p.name in OWNED or p.name.startswith(STAGING_PREFIX) for p in out.iterdir()):
        return
    raise ConfigError(f"--out: {out} is not empty and holds no {REPORT_MD} (not a report directory); "
                      "choose another directory")


def write_report(out: Path, files: Mapping[str, bytes]) -> list[Path]:
    """Write `files` (relative path → bytes; top-level files and ``figures/<name>``) into `out`, replacing an
    earlier report there; return the top-level paths written."""
    cli.make_dir(out)
    for leftover in out.glob(f"{STAGING_PREFIX}*"):  # an earlier write that crashed
        shutil.rmtree(leftover, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))  # same file system: renames are atomic
    try:
        for name, data in files.items():
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        (out / REPORT_MD).unlink(missing_ok=True)  # from here until the end, DIR holds no complete report
        old_figures = out / FIGURES_DIR
        if old_figures.exists():
            old_figures.rename(staging / f"{FIGURES_DIR}.old")  # deleted with the staging directory
        if (staging / FIGURES_DIR).exists():
            (staging / FIGURES_DIR).rename(old_figures)
        written = []
        for name in sorted({Path(n).parts[0] for n in files} - {FIGURES_DIR, REPORT_MD}):
            os.replace(staging / name, out / name)
            written.append(out / name)
        for name in set(OWNED) - {Path(n).parts[0] for n in files} - {FIGURES_DIR}:  # figures/ moved out above
            (out / name).unlink(missing_ok=True)  # e.g. a table2.csv of an earlier report with a noise study
        os.replace(staging / REPORT_MD, out / REPORT_MD)  # last: the report is complete
        written.append(out / REPORT_MD)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)
