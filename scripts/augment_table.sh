#!/usr/bin/env bash
# Regenerates the tables of docs/log/benchmarks.md "make run: search + augmentation": the earlier `make run` config
# (configs/darts_default.yaml, 8 parties) end to end, search then augmentation, over seeds 0 1 2:
#   - DP-FNAS at three augmentation noise levels (augment.noise_multiplier 0.7, 0.85 = the default, 1.2);
#   - FNAS (8 parties, exact gradients) and vanilla NAS (one party holding all the data, with 8× the per-party
#     batches, so that every step averages over the same number of examples as the federated runs).
#   scripts/augment_table.sh [OUT_DIR]        (default runs/augment-table; ~70 min on a 2-core VM)
#   scripts/augment_table.sh --summarize OUT_DIR
# Each run writes OUT_DIR/<arm>-seed<s>/search.h5; a run whose log exists is skipped, so an interrupted table is
# finished by running the script again. The table (markdown, one row per arm, mean ± std over seeds) is printed at
# the end from the logs alone. Environment: PYTHON, MPIRUN (default: the project's .venv).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
mpirun=${MPIRUN:-$here/.venv/bin/mpirun}
seeds=(0 1 2)
sigmas=(0.7 0.85 1.2)

summarize() {
  "$python" - "$1" <<'EOF'
import sys
from pathlib import Path

import numpy as np

from mpi_fnas.runlog import read_run

root = Path(sys.argv[1])
arms: dict[str, list[dict]] = {}
for log in sorted(root.glob("*-seed*/search.h5")):
    arm = log.parent.name.rsplit("-seed", 1)[0]
    run = read_run(log)
    aug = run["augment"]
    if run["status"] != "finished" or aug is None or aug["status"] != "finished":
        print(f"skipped (not finished): {log}", file=sys.stderr)
        continue
    eps = aug["privacy"]["epsilon"][-1].max() if aug["privacy"] is not None else float("nan")
    arms.setdefault(arm, []).append({
        "acc": aug["test_acc"], "params": aug["params"], "eps": eps,
        "wall": run["cost"]["wall_seconds"] + aug["cost"]["wall_seconds"],
    })
print("| arm | seeds | test acc (augmented), mean ± std | per seed | params (mean) | worst-party ε (search + aug.) | wall, mean |")
print("|---|---|---|---|---|---|---|")
for arm, rows in arms.items():
    acc = np.array([r["acc"] for r in rows])
    eps = np.array([r["eps"] for r in rows])
    eps_text = "—" if np.isnan(eps).all() else f"{eps.mean():.2f}"
    wall = np.mean([r["wall"] for r in rows])
    per_seed = " / ".join(f"{a:.3f}" for a in acc)
    print(f"| {arm} | {len(rows)} | {acc.mean():.3f} ± {acc.std(ddof=1) if len(acc) > 1 else 0:.3f} | {per_seed} "
          f"| {np.mean([r['params'] for r in rows]):,.0f} | {eps_text} | {wall / 60:.1f} min |")
EOF
}

if [ "${1:-}" = "--summarize" ]; then summarize "${2:?usage: augment_table.sh --summarize OUT_DIR}"; exit 0; fi
out=${1:-runs/augment-table}
mkdir -p "$out"

run() {  # run ARM RANKS KEY=VALUE...
  local dir=$out/$1; local ranks=$2; shift 2
  if [ -e "$dir/search.h5" ]; then echo "exists, skipped: $dir"; return; fi
  local sets=(); for kv in "$@"; do sets+=(--set "$kv"); done
  "$mpirun" -n "$ranks" "$python" -m mpi_fnas.run --config configs/darts_default.yaml --out "$dir" "${sets[@]}"
}

for s in "${seeds[@]}"; do
  for sigma in "${sigmas[@]}"; do run "dpfnas-sigma$sigma-seed$s" 9 seed="$s" augment.noise_multiplier="$sigma"; done
  run "fnas-seed$s" 9 seed="$s" mode=fnas
  run "vanilla-seed$s" 2 seed="$s" mode=vanilla federation.parties=1 search.batch_size=128 augment.batch_size=512
done
summarize "$out"
