#!/usr/bin/env bash
# The wheels the GPU check (scripts/device_check.sh) carries to a GPU machine that has no package registry: every
# package the project needs that the machine's image lacks (scripts/device_image_packages.txt), as manylinux x86_64
# CPython 3.12 wheels, at constraints.txt's versions where it pins them. Runs where PyPI is reachable.
#
#   bash scripts/device_wheels.sh        # into .whl/ (git-ignored), replacing what was there; prints the total size
#
# Then checks that every wheel's own needs (Requires-Dist, markers evaluated for CPython 3.12 on Linux, extras
# skipped) are in the image or among these wheels, and fails naming any that is missing.
# Environment: PYTHON (default .venv/bin/python; it runs pip and needs `packaging`).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
dest=$here/.whl

# What travels: the runtime needs the image lacks (cryptography, dp-accounting), what they need in turn (cffi,
# pycparser; dm-tree), pytest-mpi (tests/mpi's plugin; the suite's conftest knows its options) and mpich (an
# mpirun, and the MPI library the image's mpi4py wheel loads at run time).
WHEELS=(cryptography cffi pycparser dp-accounting dm-tree kymatio appdirs configparser pytest-mpi mpich)

# pinned NAME: NAME==VERSION as constraints.txt pins it (names compared as pip does), else NAME.
pinned() {
  local want line name
  want=$(echo "$1" | tr 'A-Z_.' 'a-z--')
  while IFS= read -r line; do
    name=$(echo "${line%%==*}" | tr 'A-Z_.' 'a-z--')
    if [ "$name" = "$want" ]; then echo "$line"; return; fi
  done < <(grep -E '^[A-Za-z0-9_.-]+==' "$here/constraints.txt")
  echo "$1"
}

specs=()
for name in "${WHEELS[@]}"; do specs+=("$(pinned "$name")"); done
rm -rf "$dest"
mkdir -p "$dest"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${specs[@]}"

# Every wheel's needs are in the image or carried; one version of each package.
"$python" - "$dest" "$here/scripts/device_image_packages.txt" <<'EOF'
import pathlib
import re
import sys
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

dest, image_list = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
image = {canonicalize_name(line) for line in image_list.read_text().split("\n") if line and not line.startswith("#")}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_python_implementation": "CPython",
       "implementation_name": "cpython", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
wheels = sorted(dest.glob("*.whl"))
carried = [canonicalize_name(re.split(r"-\d", w.name, maxsplit=1)[0]) for w in wheels]
if len(set(carried)) != len(carried):
    sys.exit(f"two versions of one package in {dest}: {sorted(carried)}")
missing = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is None or req.marker.evaluate(env):
                    if canonicalize_name(req.name) not in image and canonicalize_name(req.name) not in carried:
                        missing.append(f"{wheel.name} needs {req}")
if missing:
    sys.exit("not in the image and not carried (add to WHEELS in scripts/device_wheels.sh):\n" + "\n".join(missing))
EOF
ls -1 "$dest"
echo "total: $(du -cb "$dest"/*.whl | tail -1 | cut -f1) bytes in $(ls "$dest"/*.whl | wc -l) wheels ($dest)"
