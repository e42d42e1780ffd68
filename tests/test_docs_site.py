"""The documentation site builds with no warning (``make docs``: ``mkdocs build --strict``): a broken link or
anchor, a page missing from the nav, a module on no API page or a public name without a docstring fails it
(scripts/mkdocs_hooks.py). It is one of ``make test``'s serial modules (scripts/run_tests.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    site = tmp_path / "site"
    for page in ("index.html", "config.html", "api/federation.html", "containers.html"):
        assert (site / page).is_file(), page
    config = (site / "config.html").read_text(encoding="utf-8")
    assert "search.epochs" in config and "privacy.aggregation" in config  # the keys, from the schema
    assert "runs/&lt;name&gt;-&lt;YYYYmmdd-HHMMSS&gt;/" in config  # a meaning's <...> is text, not a tag
    api = (site / "api" / "stages.html").read_text(encoding="utf-8")
    assert "What <code>ServerLoop</code> needs of a stage" in api  # a docstring, its Sphinx role made a code span
    assert ":class:" not in api
    assert "Apptainer" in (site / "containers.html").read_text(encoding="utf-8")  # containers/README.md included
