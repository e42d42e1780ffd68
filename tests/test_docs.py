"""What README.md and the site's pages (docs/**/*.md, containers/README.md) name exists: repository files, config
keys, Python names and runnable modules.

Names are taken from inline code spans, fenced code blocks and Markdown links:

- a *path* is a word with a file extension we ship (``.py``, ``.yaml``, ``.sh``, ``.md`` ...), a word ending in
  ``/``, or a word starting with a top-level folder of the repository. Relative links resolve from the document's
  folder, other paths from the repository root; a bare name (``algorithm.py``, ``space/``) must be the name of some
  file or folder in the repository. ``{a,b}`` is expanded and ``*`` globbed. Absolute paths (HDF5 paths like
  ``/metrics/step``, ``/proc/...``), URLs and words with placeholders (``<name>``, ``$USER``, ``…``) are skipped;
  the few remaining names that are not repository files are in ``NOT_REPO_FILES``;
- a *config key* is ``section.key`` for a section of the schema (``data.download``, ``search.epochs=2``);
- a *Python name* is ``mpi_fnas.a.b`` and must import (module) or be an attribute of one;
- a *module run* is ``python -m mpi_fnas.X``: it must answer ``--help`` with exit code 0 (without MPI);
- an *identifier* in inline code (``Release.make``, ``log.search.truncate``, ``StageLog``, ``torch.randn``) must
  resolve: a class or module of ours (or ``log``/``cfg``, the docs' names for a RunLog and a Config), followed
  through attributes, properties and typed fields; outside names are imported from the venv;
- an *output file* (``baseline.csv``, ``searched.pt``) must be a string literal of the package;
- an *HDF5 path* under one of the log's top-level groups (``/privacy/epsilon``) must be in docs/hdf5.md's Layout,
  which tests/test_hdf5_doc.py checks against the writer.
"""

from __future__ import annotations

import contextlib
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
# Every page of the documentation site (mkdocs.yml: docs/, and containers/README.md, which docs/containers.md
# includes) and the README.
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "containers" / "README.md"]

# Names that look like paths but are not files of the repository, each with the reason.
NOT_REPO_FILES = {
    "cifar-10-batches-py/": "the extracted CIFAR-10 archive under data.root, downloaded by the user",
    "../slurm/x.sh": "docs/hpc.md's example of a relative script path given to sbatch",
    "train/": "an imagefolder tree's train folder under data.root, brought by the user",
    "test/": "an imagefolder tree's test folder under data.root, brought by the user",
    "data.root/test/": "the same, named with its config key",
    "data.root/mnist-cache/": "where data.dataset mnist writes its parsed splits at run time (data/mnist_full.py)",
    "data.root/fashion-mnist/": "where a user puts FashionMNIST's four files (data/fashion_mnist.py)",
    "data.root/fashion-mnist-cache/": "where data.dataset fashion-mnist caches its checked splits (fashion_mnist.py)",
    "todo.sh": "docs/benchmarks.md's name for the script python -m mpi_fnas.report.results_plan prints",
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
    # the file a link names (its #anchor: test_every_readme_link_resolves for the README, mkdocs --strict for docs/)
    return [Mention(doc, text.count("\n", 0, m.start()) + 1, m.group(1).split("#")[0])
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
                 "dpfnas_{1,2,4,8}.sh", "containers.md", "scripts/install.sh", "tests/mpi/"):
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
    """An allow-listed name that became a repository file (or left the docs) should leave the list. And the loop
    checks something: the list is exactly the path-like names the docs name that are not repository files, at
    least one (an emptied list, or an extraction that finds nothing, fails here)."""
    mentions = _path_mentions()
    mentioned = {m.text for m, _ in mentions}
    checked = set()
    for name, reason in NOT_REPO_FILES.items():
        assert reason
        assert name in mentioned, f"{name} is no longer named in the docs"
        assert not _exists(name, ROOT), f"{name} exists now"
        checked.add(name)
    unresolved = {m.text for m, base in mentions if not all(_exists(name, base) for name in _expand(m.text))}
    assert unresolved, "the docs name no path that is not a repository file: the extraction found nothing"
    assert checked == unresolved, f"allow-listed {sorted(checked)}, unresolved in the docs {sorted(unresolved)}"


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
            for m in re.finditer(r"(?<![\w/])mpi_fnas(?:\.\w+)+", span.text)
            if not m.group(0).endswith(".sif")]  # the container image's file (containers/README.md), not a module


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


# --- identifiers in inline code: `Release.make`, `log.search.truncate`, `ServerLoop`, `torch.randn` -------------

# Instance names the docs use for objects of a documented class, e.g. `log.search` for a RunLog's `search`.
INSTANCE_NAMES = {"log": "mpi_fnas.runlog.RunLog", "cfg": "mpi_fnas.config.Config"}
# Short names the docs use for outside modules.
MODULE_NAMES = {"nn": "torch.nn", "autograd": "torch.autograd", "np": "numpy"}
# CamelCase words that are not Python names, each with the reason.
NOT_PYTHON_NAMES = {
    "VmHWM": "the peak-resident-memory field of Linux /proc/self/status",
    "Restarts": "the restart counter scontrol shows for a requeued Slurm job",
    "Ibcast": "an MPI operation (nonblocking broadcast), named as MPI names it",
    "Ireduce": "an MPI operation (nonblocking reduce), named as MPI names it",
    **{field: "a Slurm field (slurm.conf or scontrol show job)"
       for field in ("KillWait", "PreemptMode", "GraceTime", "ExitCode", "Command")},
}
# Outside classes the docs name bare, with the module that defines them.
OUTSIDE_CLASSES = {"GaussianDpEvent": "dp_accounting", "PoissonSampledDpEvent": "dp_accounting"}
OUTPUT_EXTENSIONS = ("csv", "html", "png", "pt", "h5", "log")


def _package_index() -> tuple[dict[str, list[str]], dict[str, list[str]], set[str]]:
    """(module short name -> dotted modules, class name -> dotted modules defining it, every def/class name) over
    the mpi_fnas package, read with ast so nothing is imported to build it."""
    import ast

    modules: dict[str, list[str]] = {}
    classes: dict[str, list[str]] = {}
    defined: set[str] = set()
    for path in sorted((ROOT / "mpi_fnas").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules.setdefault(dotted.split(".")[-1], []).append(dotted)
        if len(dotted.split(".")) > 2:  # `federation.job_plan` as well as `job_plan`
            modules.setdefault(".".join(dotted.split(".")[-2:]), []).append(dotted)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.add(node.name)
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(dotted)
    return modules, classes, defined


MODULES, CLASSES, DEFINED = _package_index()


def _identifier_mentions() -> list[Mention]:
    """Dotted names, ``name()`` calls and CamelCase words in inline code spans (fenced blocks are shell and YAML).
    Paths, ``mpi_fnas.*`` (checked above), config keys and output file names are left out."""
    found = []
    for doc in DOCS:
        for span in _code_spans(doc):
            if "\n" in span.text:
                continue
            for word in _words(span):
                text = word.text
                if (_is_path(text) or text.startswith("mpi_fnas") or text.split(".")[0] in SECTIONS
                        or re.search(r"\.(" + "|".join(OUTPUT_EXTENSIONS) + r")$", text)):
                    continue
                dotted = re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(\(\))?", text)
                call = re.fullmatch(r"[A-Za-z_]\w*\(\)", text)
                camel = re.fullmatch(r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+|[A-Z][a-z]{2,}", text)
                if (dotted or call or camel) and text not in ("True", "False", "None"):
                    found.append(word)
    return found


def _attribute(obj: object, name: str) -> tuple[bool, object]:
    """(found, what to look in next) for ``obj.name``: a class's property or typed field leads to its type."""
    import typing

    if isinstance(obj, type):
        hints = {}
        try:
            hints = typing.get_type_hints(obj)
        except Exception:  # unresolvable annotations: fall back to the raw ones
            hints = getattr(obj, "__annotations__", {})
        member = getattr(obj, name, None)
        if isinstance(member, property):
            returns = typing.get_type_hints(member.fget).get("return")
            return True, returns
        if name in hints:
            return True, hints[name]
        if name in getattr(obj, "__dataclass_fields__", {}) or hasattr(obj, name):
            return True, member
        assigned = _instance_attributes(obj)
        if name in assigned:
            return True, assigned[name]
        return False, None
    if hasattr(obj, name):
        return True, getattr(obj, name)
    return False, None


def _instance_attributes(cls: type) -> dict[str, object]:
    """``self.name = Kind(...)`` or ``self.name: Kind | None = ...`` in the methods of ``cls``: name -> Kind (the
    class, looked up in the defining module; None when it cannot be told)."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(cls).lstrip())
    except (OSError, TypeError, SyntaxError):
        return {}
    namespace = vars(importlib.import_module(cls.__module__))
    found: dict[str, object] = {}
    for node in ast.walk(tree):
        target, kind = None, None
        if isinstance(node, ast.AnnAssign):
            target = node.target
            names = [n.id for n in ast.walk(node.annotation) if isinstance(n, ast.Name) and n.id != "None"]
            kind = names[0] if names else None
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            kind = node.value.func.id if isinstance(node.value, ast.Call) and isinstance(node.value.func,
                                                                                          ast.Name) else None
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            known = found.get(target.attr)
            found[target.attr] = known if known is not None else namespace.get(kind) if kind else None
    return found


def _starts(head: str) -> list[object]:
    """What the first part of a dotted name can be: an instance name, a class or module of ours, or an outside
    module."""
    if head in INSTANCE_NAMES:
        return [_import_dotted(INSTANCE_NAMES[head])]
    starts: list[object] = [getattr(importlib.import_module(m), head) for m in CLASSES.get(head, [])]
    starts += [importlib.import_module(m) for m in MODULES.get(head, [])]
    if not starts:
        with contextlib.suppress(ImportError):
            starts.append(importlib.import_module(MODULE_NAMES.get(head, head)))
    return starts


def _import_dotted(dotted: str) -> object:
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _names_something(text: str) -> bool:
    import builtins

    text = text.removesuffix("()")
    if "." not in text:
        if text in NOT_PYTHON_NAMES or text in DEFINED or hasattr(builtins, text):
            return True
        return text in OUTSIDE_CLASSES and hasattr(importlib.import_module(OUTSIDE_CLASSES[text]), text)
    head, *rest = text.split(".")
    for obj in _starts(head):
        for part in rest:
            found, obj = _attribute(obj, part)
            if not found:
                break
        else:
            return True
    return False


def test_identifier_extraction_finds_known_mentions() -> None:
    texts = {m.text for m in _identifier_mentions()}
    for name in ("Release.make", "log.search.truncate", "StageLog", "torch.randn", "os.urandom", "Keystream"):
        assert name in texts, name
    assert not {"baseline.csv", "search.epochs", "True", "S128", "MPI_FNAS_HOME"} & texts
    assert _names_something("RunLog.begin_augment") and not _names_something("RunLog.begin_augmentation")
    assert not _names_something("log.search.no_such_method") and not _names_something("NoSuchClassHere")


def test_every_named_identifier_exists() -> None:
    """A class, method, attribute or outside function named in inline code exists (outside names are imported
    from the venv: `torch.func.vmap`, `os.replace`)."""
    bad = sorted({f"{m.where()}: {m.text}" for m in _identifier_mentions() if not _names_something(m.text)})
    assert not bad, "docs name Python objects that do not exist:\n" + "\n".join(bad)


def test_identifier_allow_lists_are_still_needed(monkeypatch) -> None:
    """Every allow-listed word is still named in the docs and is not a name of ours; and the loop checks
    something: without the list, exactly its words would be the docs' unresolved identifiers, at least one."""
    texts = {m.text for m in _identifier_mentions()}
    checked = set()
    for name, reason in NOT_PYTHON_NAMES.items():
        assert reason and name in texts, f"{name} is no longer named in the docs"
        assert name not in DEFINED, f"{name} is a name of ours now"
        checked.add(name)
    monkeypatch.setitem(globals(), "NOT_PYTHON_NAMES", {})  # what _names_something reads
    unresolved = {text for text in texts if not _names_something(text)}
    assert unresolved, "no identifier the docs name needs the allow list: the extraction found nothing"
    assert checked == unresolved, f"allow-listed {sorted(checked)}, unresolved without it {sorted(unresolved)}"


def test_every_named_output_file_is_written_by_the_code() -> None:
    """Output files the docs name (`baseline.csv`, `searched.pt`) are names the package writes."""
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "mpi_fnas").rglob("*.py"))
    names = {(m.where(), m.text) for doc in DOCS for span in _code_spans(doc) for m in _words(span)
             if re.fullmatch(r"[\w.-]+\.(" + "|".join(OUTPUT_EXTENSIONS) + r")", m.text)}
    assert any(text == "searched.pt" for _, text in names)
    missing = sorted(f"{where}: {text}" for where, text in names
                     if f'"{text}"' not in source and f"'{text}'" not in source)
    assert not missing, "docs name output files the code never writes:\n" + "\n".join(missing)


# --- HDF5 paths: `/augment/privacy/epsilon` anywhere in the docs is a member docs/hdf5.md lists ------------------

def _hdf5_paths() -> set[str]:
    """Every group, dataset and attribute path docs/hdf5.md's Layout declares (it is checked against the writer
    by tests/test_hdf5_doc.py)."""
    from test_hdf5_doc import DOC, documented_members

    members = documented_members(DOC.read_text(encoding="utf-8"))
    return {f"{group.rstrip('/')}/{name}" for group, name, _ in members} | {group for group, _, _ in members}


def _hdf5_mentions() -> list[Mention]:
    tops = {path.split("/")[1] for path in _hdf5_paths() if path.count("/") >= 1 and path != "/"}
    return [word for doc in DOCS for span in _code_spans(doc) for word in _words(span)
            if re.fullmatch(r"(/[\w*{},]+)+", word.text) and word.text.split("/")[1] in tops]


def test_every_named_hdf5_path_is_in_the_layout() -> None:
    known = _hdf5_paths()
    mentions = _hdf5_mentions()
    assert {"/privacy/epsilon", "/augment/privacy", "/alphas/{normal,reduce}"} <= {m.text for m in mentions}
    missing = []
    for mention in mentions:
        for name in _expand(mention.text):
            pattern = re.compile(re.escape(name).replace(r"\*", r"[^/]+"))
            if not any(pattern.fullmatch(path) for path in known):
                missing.append(f"{mention.where()}: {name}")
    assert not missing, "docs name HDF5 paths docs/hdf5.md does not list:\n" + "\n".join(missing)


# --- the README's links: every relative link names a file, and every #anchor a heading of it ----------------------

def _anchors(doc: Path) -> set[str]:
    """The anchors of `doc`'s headings as GitHub and the site (mkdocs.yml's toc slugify) make them."""
    from pymdownx.slugs import slugify

    slug = slugify(case="lower")
    text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.S | re.M)
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M):
        html = re.sub(r"`([^`]*)`", r"<code>\1</code>", heading)
        anchors.add(slug(html, "-"))
    return anchors


def test_every_readme_link_resolves() -> None:
    readme = ROOT / "README.md"
    links = re.findall(r"\]\(([^)\s]+)\)", readme.read_text(encoding="utf-8"))
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert len(local) >= 10 and any("#" in link for link in local)
    bad = []
    for link in local:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else readme
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif anchor and anchor not in _anchors(target):
            bad.append(f"{link}: {target.relative_to(ROOT)} has no heading with that anchor")
    assert not bad, "README.md links that do not resolve:\n" + "\n".join(bad)


def test_the_readme_is_a_front_page() -> None:
    """At most 150 lines, with the CI's test command (.ci/run runs `make test`) and the generated results table
    within its first 25 lines (mpi_fnas.report.results writes it between its markers)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert "make test" in (ROOT / ".ci" / "run").read_text() and re.search(r"^make test\b", text, re.M)
    first = next(i for i, line in enumerate(text.splitlines(), start=1) if line == "<!-- results: private-28 -->")
    assert first <= 25

