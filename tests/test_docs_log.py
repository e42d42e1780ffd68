"""The user pages say how things are now; history and measurements, dated, live in the benchmark log (docs/log/).

README.md and every docs/**/*.md outside docs/log/ name no work date (``2026-11-28``, in the text or in a link's
anchor) and no issue of this project (``issue 46``, ``issues 3 and 4``, a bare ``#46``). An upstream project's
issue, written ``owner/repo#123`` or ``project#123`` (``uxlfoundation/oneDNN#6035``), is a citation and allowed, as
are anchors (``privacy.md#3-accounting``) and HTML entities (``&#8212;``). docs/log/ exists and is in mkdocs.yml's
nav, so the site builds it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "docs" / "log"
USER_PAGES = [ROOT / "README.md",
              *sorted(p for p in (ROOT / "docs").rglob("*.md") if LOG not in p.parents)]

WORK_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
ISSUE_WORD = re.compile(r"\bissues?\s+(?:#\s*)?\d+", re.IGNORECASE)
# '#' and digits not glued to a name (an upstream `repo#12`), a path or a link (`x.md#1-...`) or an entity (`&#8212;`)
BARE_ISSUE = re.compile(r"(?<![\w/&.-])#\d+\b")
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")


def issue_refs(text: str) -> list[str]:
    """The issue references of `text`: ``issue 46`` and bare ``#46``; link targets are left out (an anchor is the
    heading it names, which is checked as text)."""
    prose = LINK_TARGET.sub("]()", text)
    worded = [m.group(0) for m in ISSUE_WORD.finditer(prose)]
    return worded + [m.group(0) for m in BARE_ISSUE.finditer(ISSUE_WORD.sub("", prose))]


def work_dates(text: str) -> list[str]:
    """The work dates of `text`, link targets included (a dated anchor is a date on the page)."""
    return WORK_DATE.findall(text)


def _offences(page: Path) -> list[str]:
    found = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        found += [f"{page.relative_to(ROOT)}:{number}: {hit}" for hit in issue_refs(line) + work_dates(line)]
    return found


def test_the_patterns_tell_issues_and_dates_from_lookalikes() -> None:
    assert issue_refs("as issue 46 asked, and issues #3") == ["issue 46", "issues #3"]
    assert issue_refs("fixed in #46.") == ["#46"]
    assert issue_refs("uxlfoundation/oneDNN#6035, kymatio#1068, PKCS#8, &#8212;, §2.11, a #define") == []
    assert issue_refs("[the mechanism](privacy.md#1-the-mechanism)") == []
    assert work_dates("since 2026-11-28") == ["2026-11-28"]
    assert work_dates("[log](log/benchmarks.md#more-levers-2026-11-28)") == ["2026-11-28"]
    assert work_dates("runs/default-20250501-120000, 1e-5, 2026") == []


def test_user_pages_name_no_issue_and_no_work_date() -> None:
    assert len(USER_PAGES) > 10 and ROOT / "docs" / "benchmarks.md" in USER_PAGES
    assert not any(LOG in page.parents for page in USER_PAGES)
    offences = [hit for page in USER_PAGES for hit in _offences(page)]
    assert not offences, ("user pages say how things are now; move history and dated measurements to docs/log/:\n"
                          + "\n".join(offences))


def _nav_pages(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    return []


def test_the_log_exists_is_dated_and_is_in_the_nav() -> None:
    pages = sorted(LOG.glob("*.md"))
    assert pages, "docs/log/ has no page"
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = set(_nav_pages(yaml.safe_load(text[text.index("\nnav:"):])["nav"]))  # the rest has python tags
    for page in pages:
        assert page.relative_to(ROOT / "docs").as_posix() in nav, f"{page.relative_to(ROOT)} is not in mkdocs.yml's nav"
        text = page.read_text(encoding="utf-8")
        sections = re.split(r"^## ", text, flags=re.M)[1:]
        assert sections, f"{page.relative_to(ROOT)} has no sections"
        undated = [lines[0] for lines in (s.splitlines() for s in sections)
                   if not WORK_DATE.search(next((line for line in lines[1:] if line.strip()), ""))]
        assert not undated, f"{page.relative_to(ROOT)}: sections whose first line has no date: {undated}"


#: The code, configs and scripts a user reads; a package list's "as last read" date is provenance, not history.
SOURCES = [p for pattern in ("mpi_fnas/**/*.py", "configs/*.yaml", "scripts/*", "slurm/*", "Makefile", "Dockerfile")
           for p in sorted(ROOT.glob(pattern)) if p.is_file() and p.name != "device_image_packages.txt"]
LONGEST_DOCSTRING = 15


def test_code_configs_and_scripts_name_no_issue_and_no_work_date() -> None:
    assert any(p.name == "run.py" for p in SOURCES) and any(p.suffix == ".yaml" for p in SOURCES)
    # a bare '#123' in code is a colour or a comment, so only worded issue references count here
    offences = [f"{source.relative_to(ROOT)}:{number}: {hit}" for source in SOURCES
                for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), start=1)
                for hit in ISSUE_WORD.findall(line) + work_dates(line)]
    assert not offences, "history goes to docs/log/, not into code or configs:\n" + "\n".join(offences)


def _long_docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')} ({length} lines)"
            for node in ast.walk(tree) if isinstance(node, kinds)
            for length in [len((ast.get_docstring(node, clean=False) or "").splitlines())]
            if length > LONGEST_DOCSTRING]


def test_every_docstring_is_at_most_15_lines() -> None:
    """Essays, proofs and manuals belong in docs/; a docstring says what a thing is and what a caller may rely on."""
    long = [entry for path in sorted((ROOT / "mpi_fnas").rglob("*.py")) for entry in _long_docstrings(path)]
    assert not long, "docstrings over 15 lines (move the essay to docs/):\n" + "\n".join(long)
