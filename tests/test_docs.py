"""What README.md and docs/*.md name exists: repository files, config keys, Python names and runnable modules.

Names are taken from inline code spans, fenced code blocks and Markdown links:

- a *path* is a word with a file extension we ship (``.py``, ``.yaml``, ``.sh``, ``.md`` ...), a word ending in
  ``/``, or a word starting with a top-level folder of the repository. Relative links resolve from the document's
  folder, other paths from the repository root; a bare name (``algorithm.py``, ``space/``) must be the name of some
  file or folder in the repository. ``{a,b}`` is expanded and ``*`` globbed. Absolute paths (HDF5 paths like
  ``/metrics/step``, ``/proc/...``), URLs and words with placeholders (``<name>``, ``$USER``, ``…``) are skipped;
  the few remaining names that are not repository files are in ``NOT_REPO_FILES``;
- a *config key* is ``section.key`` for a section of the schema (``data.download``, ``search.epochs=2``);
- a *Python name* is ``mpi_fnas.a.b`` and must import (module) or be an attribute of one;
- a *module run* is ``python -m mpi_fnas.X``: it must answer ``--help`` with exit code 0 (without MPI).
"""

from __future__ import annotations

import importlib
import itertools
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpi_fnas.config import REMOVED_KEYS, Config, key_docs

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Names that look like paths but are not files of the repository, each with the reason.
NOT_REPO_FILES = {
    "cifar-10-batches-py/": "the extracted CIFAR-10 archive under data.root, downloaded by the user",
    "../slurm/x.sh": "docs/hpc.md's example of a relative script path given to sbatch",
    "train/": "an imagefolder tree's train folder under data.root, brought by the user",
    "test/": "an imagefolder tree's test folder under data.root, brought by the user",
    "data.root/test/": "the same, named with its config key",
}
SHIPPED_EXTENSIONS = ("py", "yaml", "yml", "sh", "md", "def", "txt", "toml", "cfg", "json")
PLACEHOLDER = re.compile(r"[<>$…]|RUN_DIR|TABLE1_ROOT|RUN_ROOT")
SECTIONS = [name for name, value in vars(Config()).items() if hasattr(value, "__dataclass_fields__")]
CONFIG_KEYS = {doc.key for doc in key_docs()}


@dataclass(frozen=True)
class Mention:
    doc: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def _tracked_files() -> list[str]:
    """Repository files (git's index if available, else the working tree without caches and the venv)."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
        return [line for line in out.stdout.splitlines() if line]
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)]


TRACKED = _tracked_files()
TOP_LEVEL = {Path(f).parts[0] for f in TRACKED if len(Path(f).parts) > 1}
BASENAMES = {Path(f).name for f in TRACKED} | {part + "/" for f in TRACKED for part in Path(f).parts[:-1]}


def _code_spans(doc: Path) -> list[Mention]:
    """Text of every inline code span and fenced code block, with the line it starts on."""
    text = doc.read_text(encoding="utf-8")
    spans: list[Mention] = []
    for match in re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        spans.append(Mention(doc, text.count("\n", 0, match.start()) + 2, match.group(1)))
    prose = re.sub(r"^```[^\n]*\n.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    for match in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", prose):
        spans.append(Mention(doc, prose.count("\n", 0, match.start()) + 1, match.group(1)))
    return spans


def _words(span: Mention) -> list[Mention]:
    words = []
    for offset, line in enumerate(span.text.splitlines()):
        for raw in re.split(r"[\s=\"'()\[\];|`]+", line):
            raw = raw.strip(",")  # but not inside: fnas_{1,2,4,8}.sh
            word = raw.rstrip(".:")  # sentence punctuation; a leading dot belongs to the name (.venv/)
            if raw.endswith("/"):
                word = word.rstrip(":") if word.endswith("/") else word + "/"
            if word:
                words.append(Mention(span.doc, span.line + offset, word))
    return words


def _links(doc: Path) -> list[Mention]:
    text = doc.read_text(encoding="utf-8")
    return [Mention(doc, text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:|#", m.group(1))]


def _is_path(word: str) -> bool:
    if word.startswith(("/", "~")) or "://" in word or PLACEHOLDER.search(word) or word.startswith("-"):
        return False
    if re.search(r"\.(" + "|".join(SHIPPED_EXTENSIONS) + r")$", word):
        return True
    if word.endswith("/") and re.fullmatch(r"[\w.{},*-]+(/[\w.{},*-]+)*/", word):
        return True
    return "/" in word and word.split("/")[0] in TOP_LEVEL


def _expand(word: str) -> list[str]:
    """``fnas_{1,2}.sh`` -> ``fnas_1.sh``, ``fnas_2.sh``."""
    parts = re.split(r"\{([^{}]*,[^{}]*)\}", word)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _exists(name: str, base: Path) -> bool:
    if "::" in name:  # a pytest node id: the file exists and defines that test
        path, test = name.split("::", 1)
        return _exists(path, base) and re.search(rf"^\s*def {re.escape(test)}\(", (ROOT / path).read_text(),
                                                  re.MULTILINE) is not None
    if "/" not in name.rstrip("/"):  # a bare name: some file or folder of the repository has it
        if "*" in name:
            return any(Path(f).match(name) for f in TRACKED)
        return name in BASENAMES or (base / name).exists() or (ROOT / name).exists()
    if "*" in name:
        return any(ROOT.glob(name))
    return (base / name).exists() or (ROOT / name).exists()


def _path_mentions() -> list[tuple[Mention, Path]]:
    found = []
    for doc in DOCS:
        for link in _links(doc):
            found.append((link, doc.parent))
        for span in _code_spans(doc):
            found += [(w, ROOT) for w in _words(span) if _is_path(w.text)]
    return found


def _module_runs() -> dict[str, list[Mention]]:
    runs: dict[str, list[Mention]] = {}
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in re.finditer(r"python3? -m (mpi_fnas(?:\.\w+)*)", text):
            runs.setdefault(m.group(1), []).append(Mention(doc, text.count("\n", 0, m.start()) + 1, m.group(1)))
    return runs


def test_the_extraction_finds_what_the_docs_name() -> None:
    """Guards the regexes: known mentions must be found (else the tests below would pass vacuously)."""
    paths = {m.text for m, _ in _path_mentions()}
    for name in ("configs/dpfnas.yaml", "docs/privacy.md", "slurm/noise_sweep.sh", "mpi_fnas/federation/algorithm.py",
                 "dpfnas_{1,2,4,8}.sh", "../containers/README.md", "scripts/install.sh", "tests/mpi/"):
        assert name in paths, name
    assert {"mpi_fnas.run", "mpi_fnas.bench", "mpi_fnas.sweep"} <= set(_module_runs())
    keys = {m.text for m in _config_key_mentions()}
    assert {"data.download", "privacy.reproducible_noise", "search.order", "federation.parties"} <= keys
    assert "search.h5" not in keys and "privacy.md" not in keys
    assert not _is_path("/metrics/val_acc") and not _is_path("runs/<name>-<timestamp>/search.h5")
    assert _expand("dpfnas_{1,2}.sh") == ["dpfnas_1.sh", "dpfnas_2.sh"]


def test_every_named_path_exists() -> None:
    missing = []
    for mention, base in _path_mentions():
        if mention.text in NOT_REPO_FILES:
            continue
        for name in _expand(mention.text):
            if not _exists(name, base):
                missing.append(f"{mention.where()}: {name}")
    assert not missing, "docs name files that do not exist:\n" + "\n".join(missing)


def test_allow_list_entries_are_still_needed() -> None:
    """An allow-listed name that became a repository file (or left the docs) should leave the list."""
    mentioned = {m.text for m, _ in _path_mentions()}
    for name, reason in NOT_REPO_FILES.items():
        assert reason
        assert name in mentioned, f"{name} is no longer named in the docs"
        assert not _exists(name, ROOT), f"{name} exists now"


def _config_key_mentions() -> list[Mention]:
    pattern = re.compile(r"(?<![\w./-])((?:" + "|".join(SECTIONS) + r")\.\w+)(?![\w/(])")
    found = []
    for doc in DOCS:
        for span in _code_spans(doc):
            for offset, line in enumerate(span.text.splitlines()):
                for m in pattern.finditer(line):
                    if not re.search(r"\.(" + "|".join((*SHIPPED_EXTENSIONS, "h5", "pt")) + r")$", m.group(1)):
                        found.append(Mention(doc, span.line + offset, m.group(1)))
    return found


def test_every_named_config_key_exists() -> None:
    """A doc may name a removed key (to say it is gone): config.REMOVED_KEYS lists those, with why."""
    unknown = [f"{m.where()}: {m.text}" for m in _config_key_mentions()
               if m.text not in CONFIG_KEYS and m.text not in REMOVED_KEYS]
    assert not unknown, "docs name config keys the schema does not have:\n" + "\n".join(unknown)


def _python_name_mentions() -> list[Mention]:
    return [Mention(span.doc, span.line, m.group(0))
            for doc in DOCS for span in _code_spans(doc)
            for m in re.finditer(r"(?<![\w/])mpi_fnas(?:\.\w+)+", span.text)]


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_named_python_name_imports() -> None:
    mentions = _python_name_mentions()
    assert any(m.text == "mpi_fnas.runlog.read_run" for m in mentions)
    bad = sorted({f"{m.where()}: {m.text}" for m in mentions if not _resolves(m.text)})
    assert not bad, "docs name Python objects that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", sorted(_module_runs()))
def test_every_named_module_answers_help(module: str) -> None:
    where = ", ".join(m.where() for m in _module_runs()[module])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    for var in [v for v in env if v.startswith(("PMI_", "OMPI_", "PMIX_"))]:  # --help must not need MPI
        del env[var]
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=env)
    assert out.returncode == 0, f"{module} (named at {where}): exit {out.returncode}: {out.stderr[-500:]}"
    assert "usage:" in out.stdout.lower(), f"{module} --help printed no usage"
