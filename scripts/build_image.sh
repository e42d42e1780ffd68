#!/usr/bin/env bash
# Build the mpi_fnas container image with Charliecloud (`make image`; docs/hpc.md "The image").
#
# The image is built from containers/Dockerfile, whose steps are containers/mpi_fnas.def's (the Apptainer definition
# clusters build): the same %files, the same scripts/install.sh call, the same environment and self-check
# (tests/test_container_def.py keeps the two equal). Charliecloud because it is packaged here, builds and runs
# unprivileged with no daemon, and ch-run is what HPC sites run; an Apptainer SIF is what clusters get from the .def.
#
#   scripts/build_image.sh               image "mpi_fnas" in $MPI_FNAS_IMAGE_STORAGE (ch-image storage)
#
# Environment:
#   MPI_FNAS_IMAGE_STORAGE=/var/tmp/mpi_fnas-image   ch-image's storage; the image is the directory $storage/img/mpi_fnas
#   MPI_FNAS_TORCH=cpu      the image's torch build (the .def's default is cuda; here cpu, as this machine's venv, so a
#                           run in the image matches the same run on the host)
#   DEBIAN_MIRROR=http://deb.debian.org/debian
#
# No image registry is reachable here, so the base is Debian bookworm with its Python 3.11, made by debootstrap and
# imported (python:3.11-slim-bookworm, the .def's base, is the same Debian with its own build of Python 3.11). The
# base is built once and kept in the storage. pip inside the build reads the same local wheel directories and
# indexes as this machine's pip (its find-links and extra-index-url, bind-mounted) and its certificate bundle.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
storage=${MPI_FNAS_IMAGE_STORAGE:-/var/tmp/mpi_fnas-image}
torch_build=${MPI_FNAS_TORCH:-cpu}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
base=mpi_fnas-base-bookworm
export USER=${USER:-$(id -un)}  # ch-image needs it
# Charliecloud's tools run on the system Python (its lark package); a pyenv or venv python3 first on PATH lacks it.
export PATH=/usr/bin:/usr/sbin:/bin:/sbin:$PATH
export CH_IMAGE_STORAGE=$storage

die() { echo "build_image.sh: $*" >&2; exit 2; }
command -v ch-image >/dev/null || die "needs Charliecloud (apt-get install charliecloud)"
[ "$torch_build" = cpu ] || [ "$torch_build" = cuda ] || die "MPI_FNAS_TORCH must be cpu or cuda, got '$torch_build'"
mkdir -p "$(dirname "$storage")"  # ch-image makes and checks the storage directory itself
start=$(date +%s)

if ! ch-image list 2>/dev/null | grep -x "$base" > /dev/null; then  # not -q: with pipefail an early exit could fail ch-image
  command -v debootstrap >/dev/null || die "needs debootstrap (apt-get install debootstrap)"
  [ "$(id -u)" = 0 ] || die "debootstrap of the base needs root"
  work=$(mktemp -d "$storage-base.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  echo "build_image.sh: base: debootstrap bookworm (python3.11, venv, certificates) from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$work/root" "$mirror" \
    > "$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
  rm -rf "$work/root/var/cache/apt/archives/"*.deb "$work/root/var/lib/apt/lists/"*
  tar -C "$work/root" -czf "$work/root.tar.gz" .
  ch-image import "$work/root.tar.gz" "$base"
  rm -rf "$work"
  trap - EXIT
fi
base_seconds=$(( $(date +%s) - start ))

# The build host's pip sources, passed to the image's pip as environment and bind-mounted (read-only for pip).
find_links=${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}
extra_index=${PIP_EXTRA_INDEX_URL:-$(python3 -m pip config get global.extra-index-url 2>/dev/null || true)}
binds=()
for source in $find_links $extra_index; do
  dir=${source#file://}
  [ -d "$dir" ] || continue
  # An index (file:///opt/pypi/simple) links its files relative to the directory above it: bind that one.
  [ "$source" != "$dir" ] && [ "$(basename "$dir")" = simple ] && dir=$(dirname "$dir")
  case " ${binds[*]-} " in *" -b $dir "*) ;; *) binds+=(-b "$dir") ;; esac
done

# A site whose TLS goes through its own certificate authority: the image's pip trusts the host's bundle, bound over
# the image's own for the build only (the image keeps Debian's).
cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
cert_args=()
if [ -f "$cert" ]; then
  binds+=(-b "$cert:/etc/ssl/certs/ca-certificates.crt")
  cert_args=(--build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt)
fi

echo "build_image.sh: image mpi_fnas from containers/Dockerfile (torch $torch_build) in $storage"
ch-image build --force -t mpi_fnas -f "$here/containers/Dockerfile" \
  --build-arg BASE="$base" --build-arg MPI_FNAS_TORCH="$torch_build" \
  --build-arg PIP_FIND_LINKS="$find_links" --build-arg PIP_EXTRA_INDEX_URL="$extra_index" "${cert_args[@]}" \
  "${binds[@]}" "$here"
seconds=$(( $(date +%s) - start ))
size=$(du -sm "$storage/img/mpi_fnas" | cut -f1)
echo "build_image.sh: done: $storage/img/mpi_fnas, ${size} MB, built in ${seconds} s (base ${base_seconds} s)"
echo "build_image.sh: run it with: ch-run --set-env $storage/img/mpi_fnas -- python -m mpi_fnas.run --help"
