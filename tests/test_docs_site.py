"""The documentation site builds with no warning (``make docs``: ``mkdocs build --strict``): a broken link or
anchor, a page missing from the nav, a module on no API page or a public name without a docstring fails it
(scripts/mkdocs_hooks.py). And it reads at 1280 px (docs/stylesheets/extra.css): in headless Chromium at 1280×800
(tests/chromium.py), the front page, hpc.html and privacy.html have no code block and no table wider than its box
(nothing cut, nothing to scroll sideways), and no name in a table broken mid-word where it would fit on one line.

The site is built once for the module (``make test`` runs a module on one worker: ``--dist loadfile``). The
screenshots of the whole pages go to the test's tmp folder, and also into ``MPI_FNAS_SCREENSHOTS`` when that names a
folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from chromium import BROKEN_WORDS, PAGES, TOO_WIDE, WIDTH, Chromium, chromium_binary

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mkdocs build --strict`` into a fresh folder, once for the module."""
    site = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return site


def test_the_site_builds_strict(site: Path) -> None:
    for page in ("index.html", "config.html", "api/federation.html", "containers.html"):
        assert (site / page).is_file(), page
    config = (site / "config.html").read_text(encoding="utf-8")
    assert "search.epochs" in config and "privacy.aggregation" in config  # the keys, from the schema
    assert "runs/&lt;name&gt;-&lt;YYYYmmdd-HHMMSS&gt;/" in config  # a meaning's <...> is text, not a tag
    api = (site / "api" / "stages.html").read_text(encoding="utf-8")
    assert "What <code>ServerLoop</code> needs of a stage" in api  # a docstring, its Sphinx role made a code span
    assert ":class:" not in api
    assert "Apptainer" in (site / "containers.html").read_text(encoding="utf-8")  # containers/README.md included


def test_no_code_block_or_table_is_cut_at_1280_px(site: Path, tmp_path: Path) -> None:
    binary = chromium_binary()
    shots = tmp_path / "screens"
    profile = tmp_path / "profile"
    shots.mkdir()
    profile.mkdir()
    offenders: list[str] = []
    browser = Chromium(binary, profile)
    try:
        for page in PAGES:
            target, session = browser.open((site / page).as_uri())
            for check in (TOO_WIDE, BROKEN_WORDS):
                offenders += [f"{page}: {found}" for found in browser.evaluate(check, session)]
            (shots / page.replace(".html", ".png")).write_bytes(browser.screenshot(session))
            browser.send("Target.closeTarget", {"targetId": target})
    finally:
        browser.close()
    keep = os.environ.get("MPI_FNAS_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for png in shots.iterdir():
            shutil.copy(png, Path(keep) / png.name)
    if offenders:
        pytest.fail(f"{len(offenders)} at {WIDTH} px (screenshots in {keep or shots}):\n" + "\n".join(offenders),
                    pytrace=False)
