#!/usr/bin/env bash
# `make test`: every test, then ruff. Two lanes at once:
#   lane 1 (foreground): every serial test but lane 2's, in two pytest-xdist workers that take whole modules as they
#     come free (--dist loadfile: a module-scoped fixture is still set up once; conftest orders the modules that run
#     jobs first, the longest work first). Each worker keeps its own warm ranks for its jobs (tests/helpers/job_pool.py).
#   lane 2 (background): the tests that mostly wait, then those that must run on their own:
#     - the Slurm tests (tests/test_slurm_*.py: one set of loopback daemons for three modules, and Slurm across three
#       simulated hosts; they spend their time waiting for slurmctld's scheduling passes and `sbatch --wait`), the
#       simulated-cluster tests (tests/test_cluster.py) and the image's (tests/test_image.py: they skip, saying so,
#       until `make image` has built it);
#     - the tests that build and train networks once more on oneDNN's AVX2 kernels (ONEDNN_MAX_CPU_ISA=AVX2,
#       AVX2_TESTS), so that a machine with AVX-512 exercises the kernels of the most common CPUs too (a kernel once
#       corrupted the heap on AVX2 only: docs/benchmarks.md, "heap corruption on AVX2 CPUs"). The bench's tests
#       (tests/test_bench.py) run the same networks' steps and stay in lane 1 only, as tests/test_cpu_kernels.py does,
#       whose runs pin ONEDNN_MAX_CPU_ISA=AVX2 themselves;
#     - the MPI tests (`make test-mpi`: 4 ranks under pytest-mpi).
# Then ruff. Exit status: the first failure's, after all ran.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
LANE2_TESTS=(tests/test_slurm_cluster.py tests/test_slurm_scripts.py tests/test_slurm_e2e.py tests/test_slurm_multinode.py
             tests/test_cluster.py tests/test_image.py)
AVX2_TESTS=(tests/test_space.py tests/test_derived.py
            tests/test_privacy_mechanism.py tests/test_dpnas.py tests/test_handcrafted.py)
LANE1_WORKERS=${LANE1_WORKERS:-2}

# scripts/run_tests.sh --lane2 TMPDIR: lane 2 alone (how the script starts it, below).
if [ "${1:-}" = --lane2 ]; then
  # -rs: every skip prints its reason (a missing tool, no image), never silently.
  "$PYTHON" -m pytest -q -rs --durations=15 -p no:cacheprovider --basetemp="$2/base" "${LANE2_TESTS[@]}"
  rc=$?
  echo "== AVX2 kernels (ONEDNN_MAX_CPU_ISA=AVX2): ${AVX2_TESTS[*]}"
  ONEDNN_MAX_CPU_ISA=AVX2 "$PYTHON" -m pytest -q -rs -p no:cacheprovider --basetemp="$2/avx2" "${AVX2_TESTS[@]}"
  avx2=$?
  echo "== MPI tests"
  make --no-print-directory test-mpi
  mpi=$?
  for code in "$rc" "$avx2" "$mpi"; do
    [ "$code" -ne 0 ] && exit "$code"
  done
  exit 0
fi

lane2_log=.pytest-lane2.log
lane2_tmp=$(mktemp -d /tmp/mpi_fnas-lane2.XXXXXX)

# Lane 2 in its own session, so that an interrupted `make test` ends it and everything it started (by its group).
setsid bash "$0" --lane2 "$lane2_tmp" > "$lane2_log" 2>&1 &
lane2=$!
cleanup() { kill -TERM -- "-$lane2" 2>/dev/null; wait "$lane2" 2>/dev/null; rm -rf "$lane2_tmp"; }
trap 'cleanup; exit 130' INT TERM

"$PYTHON" -m pytest -q -rs --durations=30 -n "$LANE1_WORKERS" --dist loadfile tests --ignore=tests/mpi \
  "${LANE2_TESTS[@]/#/--ignore=}"
lane1=$?
wait "$lane2"
lane2_rc=$?
trap - INT TERM
rm -rf "$lane2_tmp"
echo "== lane 2: ${LANE2_TESTS[*]}, then AVX2 kernels, then the MPI tests"
cat "$lane2_log"

"$PYTHON" -m ruff check mpi_fnas tests
lint=$?
for rc in "$lane1" "$lane2_rc" "$lint"; do
  [ "$rc" -ne 0 ] && exit "$rc"
done
exit 0
