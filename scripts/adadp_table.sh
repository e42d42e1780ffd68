#!/usr/bin/env bash
# Regenerates the table of docs/adadp.md (issue 12): is ADADP's step size robust to the noise level, as Koskela &
# Honkela's Fig. 5-7 claim? On the synthetic default (DP-FNAS, search only), over seeds 0 1 2:
#   1. SGD (the default W optimizer: momentum, cosine schedule) at σ_W = 2 on the grid search.w_lr ∈ LR_GRID;
#      the η with the best mean test accuracy is "tuned" (tuned on the server's test split: an advantage for SGD);
#   2. that tuned SGD at σ_W ∈ {1, 4, 8};
#   3. ADADP (search.w_optimizer adadp, no momentum) with η₀ = search.w_lr ∈ {1e-3, 1e-1, 10} at σ_W ∈ {1, 2, 4, 8}.
# σ_A stays at its default (the A update is not adapted). ADADP makes two W releases per step, so at the same
# search.steps_per_epoch (in W releases) it takes half the steps and every arm spends the same ε at a given σ.
#   scripts/adadp_table.sh [OUT_DIR]        (default runs/adadp-table; 54 searches)
#   scripts/adadp_table.sh --summarize OUT_DIR
# Each run writes OUT_DIR/<arm>-seed<s>/search.h5; a run whose log exists is skipped, so an interrupted table is
# finished by running the script again. The table (markdown: per σ and arm, test accuracy mean ± std over seeds,
# the final η mean ± std, the worst party's ε) is printed at the end from the logs alone.
# Environment: PYTHON, MPIRUN (default: the project's .venv), RANKS (default 5: 4 parties), EPOCHS (default 4),
# STEPS (W releases per epoch, default 20), JOBS (searches at once, default 1).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
mpirun=${MPIRUN:-$here/.venv/bin/mpirun}
ranks=${RANKS:-5}
epochs=${EPOCHS:-4}
steps=${STEPS:-20}
jobs=${JOBS:-1}
seeds=(0 1 2)
sigmas=(1 2 4 8)
lr_grid=(0.03 0.1 0.3)
adadp_lr0=(0.001 0.1 10)

summarize() {
  "$python" - "$1" <<'EOF'
import math
import sys
from pathlib import Path

import numpy as np

from mpi_fnas.runlog import read_run

root = Path(sys.argv[1])
arms: dict[tuple[float, str], list[dict]] = {}
for log in sorted(root.glob("*-seed*/search.h5")):
    name = log.parent.name.rsplit("-seed", 1)[0]  # <sgd|adadp>-lr<η>-sigma<σ>
    kind, lr, sigma = name.split("-")
    run = read_run(log)
    if run["status"] != "finished":
        print(f"skipped (not finished): {log}", file=sys.stderr)
        continue
    metrics = run["metrics"]
    acc = metrics["test_acc"][np.isfinite(metrics["test_acc"])]
    eps = run["privacy"]["epsilon"][-1].max() if run["privacy"] is not None else math.nan
    arms.setdefault((float(sigma[5:]), f"{kind} η₀={lr[2:]}" if kind == "adadp" else f"sgd η={lr[2:]}"),
                    []).append({"acc": float(acc[-1]), "lr": float(metrics["w_lr"][-1]), "eps": float(eps)})


def mean_std(values: list[float], digits: int) -> str:
    a = np.array(values)
    return f"{a.mean():.{digits}g} ± {a.std(ddof=1) if len(a) > 1 else 0:.{digits}g}"


print("| σ_W | arm | seeds | test acc, mean ± std | final η, mean ± std | worst-party ε |")
print("|---|---|---|---|---|---|")
for (sigma, arm), rows in sorted(arms.items()):
    print(f"| {sigma:g} | {arm} | {len(rows)} | {mean_std([r['acc'] for r in rows], 3)} "
          f"| {mean_std([r['lr'] for r in rows], 3)} | {np.mean([r['eps'] for r in rows]):.2f} |")
EOF
}

best_sgd_lr() {  # the grid η with the best mean test accuracy at σ_W = 2
  "$python" - "$1" "${lr_grid[@]}" <<'EOF'
import sys
from pathlib import Path

import numpy as np

from mpi_fnas.runlog import read_run

root, grid = Path(sys.argv[1]), sys.argv[2:]
scores = {}
for lr in grid:
    accs = []
    for log in root.glob(f"sgd-lr{lr}-sigma2-seed*/search.h5"):
        acc = read_run(log)["metrics"]["test_acc"]
        accs.append(acc[np.isfinite(acc)][-1])
    scores[lr] = np.mean(accs) if accs else -1.0  # a grid point without finished logs never wins
print(max(grid, key=lambda lr: scores[lr]))
EOF
}

if [ "${1:-}" = "--summarize" ]; then summarize "${2:?usage: adadp_table.sh --summarize OUT_DIR}"; exit 0; fi
out=${1:-runs/adadp-table}
mkdir -p "$out"

run() {  # run ARM SEED KEY=VALUE...
  local dir=$out/$1-seed$2; local seed=$2; shift 2
  if [ -e "$dir/search.h5" ]; then echo "exists, skipped: $dir"; return; fi
  local sets=(--set seed="$seed" --set augment.epochs=0 --set search.epochs="$epochs"
              --set search.steps_per_epoch="$steps" --set runtime.progress=off)
  for kv in "$@"; do sets+=(--set "$kv"); done
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  ( "$mpirun" -n "$ranks" "$python" -m mpi_fnas.run --out "$dir" "${sets[@]}" > "$dir.out" 2>&1 \
      || echo "FAILED (exit $?): $dir, see $dir.out" ) &
}

for s in "${seeds[@]}"; do
  for lr in "${lr_grid[@]}"; do run "sgd-lr$lr-sigma2" "$s" search.w_lr="$lr" privacy.noise_multiplier_w=2; done
done
wait  # the tuned η needs every grid run
tuned=$(best_sgd_lr "$out")
echo "SGD tuned at σ_W = 2: search.w_lr = $tuned"
for s in "${seeds[@]}"; do
  for sigma in "${sigmas[@]}"; do
    [ "$sigma" = 2 ] || run "sgd-lr$tuned-sigma$sigma" "$s" search.w_lr="$tuned" privacy.noise_multiplier_w="$sigma"
    for lr0 in "${adadp_lr0[@]}"; do
      run "adadp-lr$lr0-sigma$sigma" "$s" search.w_optimizer=adadp search.w_momentum=0 search.w_lr="$lr0" \
        privacy.noise_multiplier_w="$sigma"
    done
  done
done
wait
summarize "$out"
