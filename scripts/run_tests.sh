#!/usr/bin/env bash
# `make test`: every test, then ruff. The serial tests run in two lanes at once:
#   lane 1 (foreground): every serial test but the Slurm ones;
#   lane 2 (background): the Slurm tests (tests/test_slurm_*.py: one set of loopback daemons for three modules, and
#     Slurm across three simulated hosts), then the simulated-cluster tests (tests/test_cluster.py) and the image's
#     (tests/test_image.py: they skip, saying so, until `make image` has built it), the documentation site's strict
#     build (tests/test_docs_site.py), the report's tiny real runs (tests/test_report_trained.py), and five of the
#     longest serial modules (tests/test_augment.py, tests/test_noise_sweep.py, tests/test_resume.py,
#     tests/test_party_ledger.py, tests/test_privacy_system.py: here so that the lanes end together). The Slurm tests spend most of their wall time waiting for slurmctld's scheduling passes and for
#     `sbatch --wait`, which the other lane's jobs fill.
#     Then, in the same lane, the tests that build and train networks once more on oneDNN's AVX2 kernels
#     (ONEDNN_MAX_CPU_ISA=AVX2, AVX2_TESTS), so that a machine with AVX-512 exercises the kernels of the most common
#     CPUs too (a kernel once corrupted the heap on AVX2 only: docs/benchmarks.md, "heap corruption on AVX2 CPUs").
#     In-process tests of networks and releases; the bench's (tests/test_bench.py: whole bench jobs, ~80 s) run the
#     same networks' steps and stay in lane 1 only, as tests/test_cpu_kernels.py does, whose runs pin
#     ONEDNN_MAX_CPU_ISA=AVX2 themselves.
# Then the MPI tests (CPU-bound: 5 ranks, after both lanes) and ruff. Exit status: the first failure's, after all ran.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
LANE2_TESTS=(tests/test_slurm_cluster.py tests/test_slurm_scripts.py tests/test_slurm_e2e.py tests/test_slurm_multinode.py
             tests/test_cluster.py tests/test_image.py tests/test_docs_site.py tests/test_report_trained.py
             tests/test_augment.py tests/test_noise_sweep.py tests/test_resume.py tests/test_party_ledger.py
             tests/test_privacy_system.py)
AVX2_TESTS=(tests/test_space.py tests/test_derived.py
            tests/test_privacy_mechanism.py tests/test_dpnas.py tests/test_handcrafted.py)

# scripts/run_tests.sh --lane2 TMPDIR: lane 2 alone (how the script starts it, below).
if [ "${1:-}" = --lane2 ]; then
  # -rs: every skip prints its reason (a missing tool, no image), never silently.
  "$PYTHON" -m pytest -q -rs --durations=15 -p no:cacheprovider --basetemp="$2/base" "${LANE2_TESTS[@]}"
  rc=$?
  echo "== AVX2 kernels (ONEDNN_MAX_CPU_ISA=AVX2): ${AVX2_TESTS[*]}"
  ONEDNN_MAX_CPU_ISA=AVX2 "$PYTHON" -m pytest -q -rs -p no:cacheprovider --basetemp="$2/avx2" "${AVX2_TESTS[@]}"
  avx2=$?
  [ "$rc" -ne 0 ] && exit "$rc"
  exit "$avx2"
fi

lane2_log=.pytest-lane2.log
lane2_tmp=$(mktemp -d /tmp/mpi_fnas-lane2.XXXXXX)

# Lane 2 in its own session, so that an interrupted `make test` ends it and everything it started (by its group).
setsid bash "$0" --lane2 "$lane2_tmp" > "$lane2_log" 2>&1 &
lane2=$!
cleanup() { kill -TERM -- "-$lane2" 2>/dev/null; wait "$lane2" 2>/dev/null; rm -rf "$lane2_tmp"; }
trap 'cleanup; exit 130' INT TERM

"$PYTHON" -m pytest -q -rs --durations=30 tests --ignore=tests/mpi "${LANE2_TESTS[@]/#/--ignore=}"
lane1=$?
wait "$lane2"
lane2_rc=$?
trap - INT TERM
rm -rf "$lane2_tmp"
echo "== lane 2: ${LANE2_TESTS[*]}, then AVX2 kernels"
cat "$lane2_log"

make --no-print-directory test-mpi
mpi=$?
"$PYTHON" -m ruff check mpi_fnas tests
lint=$?
for rc in "$lane1" "$lane2_rc" "$mpi" "$lint"; do
  [ "$rc" -ne 0 ] && exit "$rc"
done
exit 0
