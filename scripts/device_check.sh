#!/usr/bin/env bash
# The parties' GPU path, checked on a machine with one GPU and no package registry (docs/hpc.md "GPU placement"):
# the project set up over the machine's own torch, the device tests on cuda, the search's party step on cuda beside
# the CPU's, and a DP-FNAS search and augmentation with PARTIES parties sharing the GPU under the default secure
# aggregation, with the GPU memory each party used.
#
#   bash scripts/device_wheels.sh                        # first, where PyPI is reachable: .whl/ (carried along)
#   OUT=DIR bash scripts/device_check.sh                 # there, from the repository root
#   DEVICE_CHECK_DEVICE=cpu OUT=/tmp/dc bash scripts/device_check.sh   # dry run: the same steps on the CPU, tiny
#
# Writes DIR/device_check.md (the summary: one table) and at most 6 logs directly under DIR (env.log, tests.log,
# bench.json, bench.log, run.log, gpu_memory.csv). Every step runs under `timeout`; a step that fails or hangs is
# marked in the summary and the next one still runs, so the whole ends within BUDGET seconds (default 450).
# Environment: DEVICE_CHECK_DEVICE (cuda, the default, or cpu), OUT (required), BUDGET, PARTIES (cuda 8, cpu 2),
# PYTHON (cuda: the image's /opt/torch/.venv/bin/python3 if there, else python3; cpu: .venv/bin/python),
# SITE (where the carried wheels are installed; default /tmp/site).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here" || exit 2
device=${DEVICE_CHECK_DEVICE:-cuda}
out=${OUT:?OUT must name the folder for the summary and logs}
budget=${BUDGET:-450}
site=${SITE:-/tmp/site}
case $device in
  cuda) parties=${PARTIES:-8}; default_python=/opt/torch/.venv/bin/python3
        [ -x "$default_python" ] || default_python=$(command -v python3) ;;
  cpu) parties=${PARTIES:-2}; default_python=$here/.venv/bin/python ;;
  *) echo "device_check.sh: DEVICE_CHECK_DEVICE must be cuda or cpu, got '$device'" >&2; exit 2 ;;
esac
python=${PYTHON:-$default_python}
mkdir -p "$out"
start=$(date +%s)
summary=$out/device_check.md
rows=()     # the summary table's rows
failed=()   # the steps that failed or timed out

# left: seconds of the budget still unspent.
left() { echo $((budget - ($(date +%s) - start))); }

# quick COMMAND...: a short helper command (versions, summaries) under `timeout`, at most 90 s and inside the budget.
quick() {
  local limit=$(($(left) - 5))
  [ "$limit" -gt 90 ] && limit=90
  [ "$limit" -lt 1 ] && limit=1
  timeout -k 5 "$limit" "$@"
}

# step NAME LIMIT LOG COMMAND...: COMMAND under `timeout` (at most LIMIT seconds, less if the budget has less, with
# 10 s kept for the summary), its output appended to LOG; sets step_rc and step_seconds, records a failure.
step() {
  local name=$1 limit=$2 log=$3; shift 3
  local avail=$(($(left) - 10)) t0
  [ "$avail" -lt "$limit" ] && limit=$avail
  if [ "$limit" -le 5 ]; then
    step_rc=124; step_seconds=0; failed+=("$name (no time left)"); echo "== $name: skipped, no time left" >> "$log"
    return
  fi
  echo "== $name (limit ${limit}s): $*" >> "$log"
  t0=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  step_rc=$?
  step_seconds=$(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}")
  echo "== $name: exit $step_rc after ${step_seconds}s" >> "$log"
  if [ "$step_rc" -ne 0 ]; then
    failed+=("$name (exit $step_rc$([ "$step_rc" -eq 124 ] && echo ", timed out"))")
  fi
}

# -- setup: the carried wheels, the project over the image's torch, an mpirun --------------------------------------
env_log=$out/env.log
: > "$env_log"
if [ "$device" = cuda ]; then
  if ls .whl/*.whl > /dev/null 2>&1; then
    step "install wheels" 90 "$env_log" "$python" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$site" .whl/*.whl
    # pip --target keeps the wheel's bin/ but not its lib/: mpich's libmpi (with its own libs in lib/mpich) is
    # unpacked from the wheel, where mpi4py finds it through LD_LIBRARY_PATH.
    step "unpack libmpi" 30 "$env_log" "$python" - "$site/mpich-lib" .whl/mpich-*.whl <<'EOF'
import os
import pathlib
import stat
import sys
import zipfile

dest = pathlib.Path(sys.argv[1])
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if "/data/lib/" not in info.filename or info.is_dir():
                continue
            target = dest / info.filename.split("/data/lib/", 1)[1]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            data = z.read(info)
            if stat.S_ISLNK(info.external_attr >> 16):
                os.symlink(data.decode(), target)
            elif not data.startswith(b"INPUT("):  # libmpi.so is a linker script: dlopen wants libmpi.so.12
                target.write_bytes(data)
print("libmpi:", sorted(str(p) for p in dest.glob("libmpi*")))
EOF
  else
    echo "no .whl/ here: run bash scripts/device_wheels.sh where PyPI is reachable and carry .whl" >> "$env_log"
    failed+=("wheels (no .whl/)")
  fi
  export PYTHONPATH=$here:$site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=$site/bin:$PATH
  export LD_LIBRARY_PATH=$site/mpich-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  [ -e "$site/mpich-lib/libmpi.so.12" ] && export MPI4PY_LIBMPI=$site/mpich-lib/libmpi.so.12  # mpi4py 4's ABI wheels
else
  export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH}
  export PATH=$(dirname "$python"):$PATH
fi
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
mpirun=$(command -v mpirun || echo mpirun)
mpirun_args=()
{
  echo "device=$device python=$python mpirun=$mpirun parties=$parties budget=${budget}s"
  quick nvidia-smi -L 2>&1 || true
  quick "$python" - <<'EOF'
import importlib.metadata as md

import torch

gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print("python torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
    print(f"cuda:{i}", torch.cuda.get_device_name(i))
for name in ("numpy", "scipy", "h5py", "PyYAML", "matplotlib", "pillow", "mpi4py", "cryptography", "cffi",
             "dp-accounting", "dm-tree", "mpich", "pytest", "pytest-mpi"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "MISSING")
print(f"device_check: torch={torch.__version__} gpu={gpu}")
from mpi4py import MPI

print("device_check: MPI library:", MPI.Get_library_version().splitlines()[0])
EOF
  quick "$mpirun" --version 2>&1 | head -3
} >> "$env_log" 2>&1
if grep -q "^device_check: MPI library:.*Open MPI" "$env_log"; then
  mpirun_args=(--allow-run-as-root --oversubscribe)  # the image's mpi4py is Open MPI's: its own mpirun
fi
setup=$(sed -n 's/^device_check: torch=\(.*\) gpu=\(.*\)$/torch \1, GPU: \2/p' "$env_log")
grep -q "^device_check: MPI library:" "$env_log" || failed+=("setup (torch or mpi4py did not load: env.log)")
rows+=("| setup | $([ ${#failed[@]} -eq 0 ] && echo ok || echo FAILED) | ${setup:-torch did not load}; env.log |")

# -- a. the device tests on this device -----------------------------------------------------------------------------
step "device tests" 120 "$out/tests.log" env MPI_FNAS_TEST_DEVICE="$device" "$python" -m pytest -q \
  -p no:cacheprovider tests/test_device_path.py tests/test_placement.py
rows+=("| device tests (MPI_FNAS_TEST_DEVICE=$device) | $([ "$step_rc" -eq 0 ] && echo ok || echo "FAILED ($step_rc)") \
| ${step_seconds}s: $(grep -Eo '[0-9]+ (passed|failed|skipped|error)[^ ]*' "$out/tests.log" | tr '\n' ' ')|")

# -- b. the party step on the device against the CPU, one process ---------------------------------------------------
if [ "$device" = cuda ]; then
  bench_devices=cpu,cuda; bench_args=(--config configs/default.yaml --repeats 3)
else
  bench_devices=cpu; bench_args=(--config configs/smoke.yaml --repeats 1)
fi
step "party step" 150 "$out/bench.log" "$python" -m mpi_fnas.bench "${bench_args[@]}" --devices "$bench_devices" --json
grep '^{' "$out/bench.log" | tail -1 > "$out/bench.json"
bench_row=$(quick "$python" - "$out/bench.json" <<'EOF'
import json
import sys

try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print("no result")
    sys.exit()
def ms(v):
    return "n/a" if v is None else f"{1e3 * v:.1f} ms"
parts = [f"{d}: step {ms(r['step_seconds'][d])}, private {ms(r['dp_step_seconds'][d])}" for d in r["devices"]]
last = r["devices"][-1]
if len(r["devices"]) > 1:
    speed = r["dp_step_speedup"][last]
    parts.append(f"speed-up {r['step_speedup'][last]:.2f}× plain, " + ("n/a" if speed is None else f"{speed:.2f}×")
                 + f" private; peak {r['peak_memory_mb'][last] or 0:.0f} MB on {last}")
print(f"B={r['batch_size']}, P_W={r['num_w']}, {r['threads_per_rank']} CPU thread(s): " + "; ".join(parts))
EOF
)
rows+=("| party step ($bench_devices, bench.json) | $([ "$step_rc" -eq 0 ] && echo ok || echo "FAILED ($step_rc)") \
| $bench_row |")

# -- c. DP-FNAS search + augmentation, PARTIES parties on the device, secure aggregation ----------------------------
run_dir=/tmp/device_check_run
rm -rf "$run_dir"
if [ "$device" = cuda ]; then
  run_settings=(--config configs/default.yaml --set data.train_size=8000 --set search.epochs=1
                --set search.steps_per_epoch=10 --set augment.epochs=1 --set augment.steps_per_epoch=5)
else
  run_settings=(--config configs/smoke.yaml --set search.epochs=1 --set search.steps_per_epoch=3
                --set augment.epochs=1 --set augment.steps_per_epoch=2 --set augment.batch_size=16)
fi
run_settings+=(--set privacy.aggregation=secure --set privacy.reproducible_noise=false --set "runtime.device=$device"
               --set runtime.progress=off --set checkpoint.every_steps=0 --set runtime.comm_timeout=240)
# Each rank reports its peak CUDA memory (torch's allocator) on exit; nvidia-smi samples the whole GPU meanwhile.
# Both configs use the synthetic shapes: under DP a party's peak follows its Poisson batches, public only here.
rank_wrapper='
import atexit, os, runpy, sys
def _peak():
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
        print(f"device_check: rank {rank} peak_allocated_mb={torch.cuda.max_memory_allocated() / 1e6:.1f} "
              f"peak_reserved_mb={torch.cuda.max_memory_reserved() / 1e6:.1f}", file=sys.stderr, flush=True)
atexit.register(_peak)
sys.argv[0] = "mpi_fnas.run"
runpy.run_module("mpi_fnas.run", run_name="__main__", alter_sys=True)
'
sampler=
if [ "$device" = cuda ] && command -v nvidia-smi > /dev/null; then
  (while :; do
     echo "# $(date +%s) gpu_used_mb=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)"
     nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits
     sleep 1
   done) > "$out/gpu_memory.csv" 2>&1 &
  sampler=$!
fi
step "DP-FNAS run" 300 "$out/run.log" "$mpirun" "${mpirun_args[@]}" -n $((parties + 1)) "$python" -c "$rank_wrapper" \
  "${run_settings[@]}" --out "$run_dir"
run_rc=$step_rc run_seconds=$step_seconds
[ -n "$sampler" ] && kill -KILL "$sampler" 2> /dev/null && wait "$sampler" 2> /dev/null  # KILL: a hung nvidia-smi defers TERM
run_row=$(quick "$python" - "$run_dir/search.h5" "$out/run.log" "$out/gpu_memory.csv" <<'EOF'
import re
import sys
from pathlib import Path

parts = []
try:
    from mpi_fnas.runlog import read_run

    run = read_run(sys.argv[1])
    augment = run.get("augment") or {}
    parts.append(f"search {run['status']}, augment {augment.get('status', 'absent')}, K={run['parties']}, "
                 f"devices {sorted(set(map(str, run['ranks'].get('devices', []))))}")
except Exception as exc:  # no log, or an unreadable one: the run failed early
    parts.append(f"no readable log ({type(exc).__name__})")
log = Path(sys.argv[2]).read_text(errors="replace") if Path(sys.argv[2]).exists() else ""
peaks = [(int(r), float(a), float(b)) for r, a, b in re.findall(
    r"device_check: rank (\d+) peak_allocated_mb=([\d.]+) peak_reserved_mb=([\d.]+)", log)]
party = [p for p in peaks if p[0] > 0]
if party:
    parts.append(f"per party (torch): peak allocated {min(p[1] for p in party):.0f}-{max(p[1] for p in party):.0f} MB, "
                 f"reserved {min(p[2] for p in party):.0f}-{max(p[2] for p in party):.0f} MB ({len(party)} parties)")
used, per_pid = [], {}
if Path(sys.argv[3]).exists():
    for line in Path(sys.argv[3]).read_text().splitlines():
        if m := re.search(r"gpu_used_mb=(\d+)", line):
            used.append(int(m[1]))
        elif m := re.fullmatch(r"\s*(\d+),\s*(\d+)\s*", line):
            per_pid[m[1]] = max(per_pid.get(m[1], 0), int(m[2]))
if used:
    parts.append(f"GPU used (nvidia-smi) {min(used)} → peak {max(used)} MiB")
if per_pid:
    parts.append(f"per process (nvidia-smi) {min(per_pid.values())}-{max(per_pid.values())} MiB ({len(per_pid)} pids)")
print("; ".join(parts))
EOF
)
rows+=("| DP-FNAS search + augment, $parties parties, secure (run.log) | \
$([ "$run_rc" -eq 0 ] && echo ok || echo "FAILED ($run_rc)") | wall ${run_seconds}s; $run_row |")

# -- d. the summary -------------------------------------------------------------------------------------------------
{
  echo "# GPU path check ($device)"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - start)) s of a ${budget} s budget; \
failed: $([ ${#failed[@]} -eq 0 ] && echo none || printf '%s; ' "${failed[@]}")"
  echo
  echo "| step | status | result |"
  echo "|---|---|---|"
  printf '%s\n' "${rows[@]}"
} > "$summary"
cat "$summary"
[ ${#failed[@]} -eq 0 ]
