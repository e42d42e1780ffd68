"""The image of `make image` (scripts/build_image.sh, containers/Dockerfile) runs the project as
the venv does: the smoke config (reproducible noise) run by this machine's hydra with each rank in its own ch-run
container (the hybrid model: the host's launcher, the image's MPICH) logs the same alphas, ε and genotype, bit for
bit, as the same run with venv ranks; and so it does across the simulated cluster's hosts (`cluster.sh run --image`).

Building the image takes minutes, so CI does not build it and these tests skip there, saying so; after
`make image` they run here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_cluster import leftovers

from mpi_fnas.runlog import read_run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
IMAGE = Path(os.environ.get("MPI_FNAS_IMAGE", "/var/tmp/mpi_fnas-image/img/mpi_fnas"))
MPIRUN = str(Path(sys.executable).parent / "mpirun")
SMOKE = ["--config", "configs/smoke.yaml", "--set", "search.epochs=1"]
PREFIX = "mfi"  # this test's cluster.sh hosts: apart from a user's (mfc) and the other tests' (mft, mfs)


def image_missing() -> str | None:
    """Why the image of `make image` cannot run here (a skip reason), or None."""
    if not (IMAGE / "opt" / "venv" / "bin" / "python").exists():
        return f"no image at {IMAGE}: `make image` builds it (minutes; not in CI)"
    if shutil.which("ch-run", path="/usr/bin:" + os.environ.get("PATH", "")) is None:
        return "Charliecloud's ch-run is not installed (apt-get install charliecloud)"
    return None


@pytest.fixture(scope="module")
def image() -> Path:
    reason = image_missing()
    if reason is not None:
        pytest.skip(reason)
    return IMAGE


@pytest.fixture(scope="module")
def venv_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("venv") / "run"
    done = subprocess.run([MPIRUN, "-n", "3", sys.executable, "-m", "mpi_fnas.run", *SMOKE, "--out", str(out)],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return read_run(out / "search.h5")


def assert_same_search(run: dict, reference: dict) -> None:
    assert run["status"] == reference["status"] == "finished"
    for cell in ("normal", "reduce"):
        assert np.array_equal(run["alphas"][cell], reference["alphas"][cell]), cell
    assert np.array_equal(run["privacy"]["epsilon"], reference["privacy"]["epsilon"])
    assert run["final_genotype"] == reference["final_genotype"]


def test_ranks_in_the_image_match_venv_ranks(image, venv_run, tmp_path):
    out = tmp_path / "run"
    # MPIR_CVAR_CH4_CMA_ENABLE=0: ranks of one host in separate containers cannot attach to each other's memory.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIR_CVAR_CH4_CMA_ENABLE": "0",
           "USER": os.environ.get("USER", "root")}
    cmd = [MPIRUN, "-n", "3", "/usr/bin/ch-run", "--set-env", "-b", f"{REPO}:/opt/mpi_fnas", "-c", "/opt/mpi_fnas",
           str(image), "--", "python", "-m", "mpi_fnas.run", *SMOKE, "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    versions = subprocess.run(["/usr/bin/ch-run", "--set-env", str(image), "--", "python", "-c",
                               "import sys, torch; print(sys.prefix, torch.__version__)"],
                              env=env, capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert versions[0] == "/opt/venv"  # the image's own install, not this checkout's venv
    print(f"\nimage: python in {versions[0]}, torch {versions[1]}")
    assert_same_search(read_run(out / "search.h5"), venv_run)


def test_ranks_in_the_image_across_cluster_hosts_match_venv_ranks(image, venv_run, tmp_path):
    if os.geteuid() != 0 or shutil.which("nsenter") is None:
        pytest.skip("the simulated cluster needs root and nsenter (network namespaces); not available here")
    env = {**os.environ, "MFC_STATE": str(tmp_path / "hosts"), "MFC_PREFIX": PREFIX, "MPI_FNAS_IMAGE": str(image)}

    def cluster_sh(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(REPO / "scripts" / "cluster.sh"), *args], env=env, capture_output=True,
                              text=True, timeout=300, check=False)

    cluster_sh("down")
    try:
        up = cluster_sh("up", "3")
        assert up.returncode == 0, up.stderr
        out = tmp_path / "run"
        done = cluster_sh("run", "--image", "3", *SMOKE, "--out", str(out))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert_same_search(read_run(out / "search.h5"), venv_run)
    finally:
        cluster_sh("down")
        assert not leftovers(PREFIX)
