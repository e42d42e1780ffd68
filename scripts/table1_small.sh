#!/usr/bin/env bash
# The paper's Table 1 in small, on this machine: vanilla NAS (K = 1), FNAS and DP-FNAS for K = 1, 2, 4, 8, each
# over 3 seeds, on the earlier make-run config (configs/darts_default.yaml) or another (CONFIG), search
# then augmentation.
#   scripts/table1_small.sh OUT                 # every run (a run whose log finished is skipped), then the report
#   CONFIG=configs/mnist.yaml scripts/table1_small.sh OUT
# Every K trains on the same number of examples per step: each party's batches are the make-run ones × 8/K
# (search 16·8/K, augmentation 64·8/K), so K = 1 takes one party's step over all the data and the step counts of
# all K agree. The table is the report's: python -m mpi_fnas.report OUT --out OUT/report (run at the end).
# Environment: SEEDS ("0 1 2"), SETTINGS ("vanilla:1 fnas:1 fnas:2 fnas:4 fnas:8 dpfnas:1 dpfnas:2 dpfnas:4
# dpfnas:8"), CONFIG, PYTHON, MPIRUN.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
mpirun=${MPIRUN:-$here/.venv/bin/mpirun}
out=${1:?usage: scripts/table1_small.sh OUT}
seeds=${SEEDS:-0 1 2}
settings=${SETTINGS:-vanilla:1 fnas:1 fnas:2 fnas:4 fnas:8 dpfnas:1 dpfnas:2 dpfnas:4 dpfnas:8}
config=(--config "${CONFIG:-configs/darts_default.yaml}")  # the make-run default these tables were measured with
mkdir -p "$out"

finished() {  # the run in $1 finished both stages
  "$python" - "$1/search.h5" <<'EOF'
import sys
from mpi_fnas.runlog import read_run
try:
    log = read_run(sys.argv[1])
except OSError:
    sys.exit(1)
sys.exit(0 if log["status"] == "finished" and log["augment"] and log["augment"]["status"] == "finished" else 1)
EOF
}

for setting in $settings; do
  mode=${setting%%:*}; k=${setting##*:}
  for s in $seeds; do
    dir=$out/$mode-k$k-seed$s
    if [ -e "$dir/search.h5" ]; then
      if finished "$dir"; then echo "finished, skipped: $dir"; continue; fi
      rm -rf "$dir"  # an unfinished run of an earlier attempt: run it again from the start
    fi
    echo "== $mode K=$k seed $s"
    "$mpirun" -n $((k + 1)) "$python" -m mpi_fnas.run "${config[@]}" --out "$dir" --set "mode=$mode" --set "seed=$s" \
      --set "search.batch_size=$((16 * 8 / k))" --set "augment.batch_size=$((64 * 8 / k))" \
      --set runtime.progress=off > "$dir.log" 2>&1 || echo "failed: $dir (see $dir.log)"
  done
done
"$python" -m mpi_fnas.report "$out" --out "$out/report"
