"""containers/mpi_fnas.def: structure, the shared install step, and its scripts run against this checkout.

Apptainer is not installable here, so the image is never built. Instead: the sections are parsed and checked,
the %files set is copied to a scratch /opt/mpi_fnas and built into a wheel (what install.sh's non-editable pip
install does first), and the %environment, %runscript and %test bodies are executed by bash with this
repository's venv standing in for /opt/venv.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
DEF_FILE = REPO / "containers" / "mpi_fnas.def"
INSTALL_SH = REPO / "scripts" / "install.sh"
VENV_BIN = Path(sys.executable).parent


def parse_definition(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """(header keywords, {section name: body}) of an Apptainer definition file; comments dropped."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        match = re.match(r"^%(\w+)\s*$", line)
        if match:
            current = sections.setdefault(match.group(1), [])
            continue
        if current is None:
            keyword = re.match(r"^(\w+):\s*(\S.*)$", line)
            if keyword:
                header[keyword.group(1)] = keyword.group(2).strip()
        else:
            current.append(line)
    return header, {name: "\n".join(body) for name, body in sections.items()}


HEADER, SECTIONS = parse_definition(DEF_FILE.read_text())


def files_mapping() -> dict[str, str]:
    """%files as {source relative to the repo: destination in the image}."""
    pairs = [line.split() for line in SECTIONS["files"].splitlines() if line.strip() and line.strip()[0] != "#"]
    assert all(len(p) == 2 for p in pairs), pairs
    return dict(pairs)


def needed_by_install() -> set[str]:
    """Top-level repo paths the non-editable install reads: install.sh's own $here/... files, the script itself,
    the package directories and the readme that pyproject.toml names, and pyproject.toml."""
    needed = {"pyproject.toml", "scripts"}
    needed |= {m.split("/")[0] for m in re.findall(r"\$here/([\w.-]+(?:/[\w.-]+)*)", INSTALL_SH.read_text())}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    readme = pyproject["project"].get("readme")
    if readme:
        needed.add(readme if isinstance(readme, str) else readme["file"])
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        needed.add(pattern.rstrip("*").rstrip("."))
    return needed


def arguments() -> dict[str, str]:
    """%arguments (Apptainer >= 1.2 build arguments) as {name: default}."""
    lines = [line.strip() for line in SECTIONS["arguments"].splitlines()]
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def run_bash(script: str, env_overrides: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> str:
    """Run `script` with the image's %environment sourced first and this venv standing in for /opt/venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(env_overrides or {})
    program = f"{SECTIONS['environment']}\nexport PATH={VENV_BIN}:$PATH\n{script}"
    done = subprocess.run(
        ["bash", "-c", program, "runscript", *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_header_bootstraps_python_311():
    assert HEADER["Bootstrap"] == "docker"
    assert re.fullmatch(r"python:3\.11[\w.-]*", HEADER["From"]), HEADER["From"]


def test_has_every_section_a_user_needs():
    for name in ("labels", "help", "files", "post", "environment", "runscript", "test"):
        assert SECTIONS.get(name, "").strip(), f"%{name} missing or empty"


def test_post_installs_through_the_shared_script_non_editable():
    calls = [line for line in SECTIONS["post"].splitlines() if "scripts/install.sh" in line]
    assert len(calls) == 1, calls
    call = calls[0]
    assert re.search(r"(^|\s)MPI_FNAS_EDITABLE=0\s", call), call
    assert re.search(r"(^|\s)MPI_FNAS_TORCH=\{\{ MPI_FNAS_TORCH \}\}\s", call), call
    assert arguments()["MPI_FNAS_TORCH"] == "cuda"  # clusters' GPUs: the CPU-only build only when asked for
    assert re.search(r"/opt/mpi_fnas/scripts/install\.sh\s+/opt/venv\s*$", call), call
    assert "pip install" not in SECTIONS["post"]  # no second install path next to the shared script


def test_files_copy_everything_install_needs_and_exist():
    mapping = files_mapping()
    assert needed_by_install() <= set(mapping), needed_by_install() - set(mapping)
    assert "configs" in mapping
    for source, destination in mapping.items():
        assert (REPO / source).exists(), f"%files source {source} missing: the image build would fail"
        assert destination == f"/opt/mpi_fnas/{source}", (source, destination)


def test_files_set_builds_the_wheel(tmp_path):
    """Copy exactly the %files sources and build the project wheel from them, as the image's pip install will."""
    image_root = tmp_path / "opt" / "mpi_fnas"
    image_root.mkdir(parents=True)
    for source in files_mapping():
        src = REPO / source
        if not src.exists():
            pytest.fail(f"%files source {source} missing")
        if src.is_dir():
            shutil.copytree(src, image_root / source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, image_root / source)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "wheels"), str(image_root)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "wheels").glob("mpi_fnas-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"mpi_fnas/__init__.py", "mpi_fnas/run.py", "mpi_fnas/federation/placement.py"} <= names


def test_environment_sets_runtime_variables():
    out = run_bash('echo "$HDF5_USE_FILE_LOCKING $PYTHONUNBUFFERED $OMP_NUM_THREADS $MKL_NUM_THREADS $VIRTUAL_ENV"')
    assert out.split() == ["FALSE", "1", "1", "1", "/opt/venv"]
    assert run_bash('echo "$OMP_NUM_THREADS"', {"OMP_NUM_THREADS": "4"}).strip() == "4"  # caller's choice kept
    path = run_bash('echo "$PATH"').strip().split(":")
    assert path[1] == "/opt/venv/bin"  # [0] is this test's stand-in venv


def test_runscript_forwards_arguments_to_the_cli():
    assert re.search(r'python -m mpi_fnas\.run "\$@"', SECTIONS["runscript"])
    out = run_bash(SECTIONS["runscript"], args=("--help",))
    assert "usage:" in out and "--config" in out


def test_self_check_passes_against_this_checkout():
    assert "mpi_fnas.run --help" in SECTIONS["test"]
    out = run_bash(SECTIONS["test"])
    assert "self-check: ok" in out


def test_labels_name_the_project_version():
    labels = dict(line.split(None, 1) for line in SECTIONS["labels"].splitlines() if line.strip())
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert labels["org.opencontainers.image.version"] == version
    assert labels["org.opencontainers.image.title"] == "mpi_fnas"


# containers/Dockerfile: the image `make image` builds here (scripts/build_image.sh) must be the .def's image.
DOCKERFILE = REPO / "containers" / "Dockerfile"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, argument text) per Dockerfile instruction; continuations joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in joined.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def commands(body: str) -> list[str]:
    """A section's shell commands: no comments, no `set -eu`, Apptainer's {{ ARG }} written as a shell ${ARG}."""
    lines = [line.strip() for line in body.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#") and line != "set -eu"]
    return [re.sub(r"\{\{\s*(\w+)\s*\}\}", r"${\1}", line) for line in lines]


def exports(body: str) -> dict[str, str]:
    """`export A=x B=y` lines as {A: x, B: y}; quotes dropped, a caller's-default ${A:-v} read as v."""
    pairs: dict[str, str] = {}
    for line in commands(body):
        if line.startswith("export "):
            for word in line.split()[1:]:
                name, value = word.split("=", 1)
                value = value.strip('"')
                default = re.fullmatch(r"\$\{(\w+):-(.*)\}", value)  # ${NAME:-v}: v unless the caller set NAME
                if default and default.group(1) == name:
                    value = default.group(2)
                pairs[name] = value.replace("${PATH}", "$PATH")
    return pairs


def test_dockerfile_builds_from_the_defs_base_with_its_arguments():
    steps = dockerfile_instructions()
    args = dict(value.split("=", 1) if "=" in value else (value, None) for kind, value in steps if kind == "ARG")
    assert args["BASE"] == HEADER["From"]
    assert ("FROM", "$BASE") in steps
    assert args["MPI_FNAS_TORCH"] == arguments()["MPI_FNAS_TORCH"]


def test_dockerfile_copies_exactly_the_defs_files():
    copies = [tuple(value.split()) for kind, value in dockerfile_instructions() if kind == "COPY"]
    assert dict(copies) == files_mapping() and len(copies) == len(files_mapping())


def test_dockerfile_runs_the_defs_post_then_its_self_check():
    steps = dockerfile_instructions()
    runs = [value for kind, value in steps if kind == "RUN"]
    post = [line for line in commands(SECTIONS["post"]) if not line.startswith("export ")]
    self_check = [line for line in commands(SECTIONS["test"]) if not line.startswith("echo ")]
    assert runs == post + self_check
    build_args = dict(value.split("=", 1) for kind, value in steps if kind == "ARG" and "=" in value)
    assert exports(SECTIONS["post"]).items() <= build_args.items()  # %post's exports: build-time only


def test_dockerfile_environment_is_the_defs():
    env = dict(value.split("=", 1) for kind, value in dockerfile_instructions() if kind == "ENV")
    assert env == exports(SECTIONS["environment"])
