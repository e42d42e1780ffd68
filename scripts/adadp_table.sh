#!/usr/bin/env bash
# Regenerates the ADADP table (docs/adadp.md says how; its last measurement is in docs/log/benchmarks.md):
# is ADADP's step size robust to the noise level, as Koskela &
# Honkela's Fig. 5-7 claim? On the synthetic data (synthetic-shapes 16x16), the federation trains one fixed network
# under DP (the augmentation stage alone: augment.genotype given, no search), K = 2 parties, over seeds 0 1 2:
#   1. SGD (augment.optimizer sgd, no momentum, constant η: lr_min = lr) at σ = 2 on the grid augment.lr ∈ LR_GRID;
#      the η with the best mean test accuracy is "tuned" (tuned on the test split: an advantage for SGD);
#   2. that tuned SGD at σ ∈ {1, 4, 8};
#   3. ADADP (augment.optimizer adadp) with η₀ = augment.lr ∈ {1e-3, 1e-1, 10} at σ ∈ {1, 2, 4, 8}.
# σ is augment.noise_multiplier. Why the augmentation and not the search: at a size this machine can afford, the
# supernet's search stays at chance (docs/adadp.md), and then no step-size rule can be told apart; the trained
# network learns (it is the same ADADP rule on the same kind of server, mpi_fnas/federation/adadp.py).
# The network is the DPNAS paper's published cell (space.kind dpnas, stages 8/16/32; docs/dpnas.md), the cheapest
# network that learns here. The server-side norm clip of the aggregate (augment.grad_clip) is off in every arm: it
# would cap the update's norm and hide the noise level from ADADP's error estimate. ADADP makes two weight releases
# per iteration, so at the same number of epochs every arm makes the same releases and spends the same ε at a given σ.
#   scripts/adadp_table.sh [OUT_DIR]        (default runs/adadp-table; 54 trainings)
#   scripts/adadp_table.sh --summarize OUT_DIR
# Each run writes OUT_DIR/<arm>-seed<s>/search.h5 (output in <arm>-seed<s>.out, and <arm>-seed<s>.done once it
# succeeded); a done run is skipped and an unfinished one redone, so an interrupted table is finished by running the
# script again. The table (markdown: per σ and arm, test accuracy mean ± std over seeds, the final η mean ± std,
# the worst party's ε) is printed at the end from the logs alone.
# Environment: PYTHON, MPIRUN (default: the project's .venv), EPOCHS (default 6), JOBS (runs at a time, default 2;
# each run has 3 ranks, 2 of them busy).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # python, mpirun, DPNASNET, table_args, run_once, run_in_background
epochs=${EPOCHS:-6}
jobs=${JOBS:-2}
seeds=(0 1 2)
sigmas=(1 2 4 8)
lr_grid=(0.1 0.3 1)
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
    aug = read_run(log)["augment"]
    if aug is None or aug["status"] != "finished":
        print(f"skipped (not finished): {log}", file=sys.stderr)
        continue
    metrics = aug["metrics"]
    err = metrics["adadp_err"]
    eps = float(np.max(aug["privacy"]["epsilon"][-1])) if aug["privacy"] is not None else math.nan
    arms.setdefault((float(sigma[5:]), f"adadp η₀={lr[2:]}" if kind == "adadp" else f"sgd η={lr[2:]}"), []).append(
        {"acc": float(aug["test_acc"]), "lr": float(metrics["lr"][-1]), "eps": eps,
         "err": float(np.mean(err[-10:])) if np.isfinite(err).any() else math.nan, "steps": int(metrics["step"][-1])})


def mean_std(values: list[float], digits: int) -> str:
    a = np.array(values)
    return f"{a.mean():.{digits}g} ± {a.std(ddof=1) if len(a) > 1 else 0:.{digits}g}"


print("| σ | arm | seeds | iterations | test acc, mean ± std | final η, mean ± std | err, last 10 iterations "
      "| worst-party ε |")
print("|---|---|---|---|---|---|---|---|")
for (sigma, arm), rows in sorted(arms.items()):
    err = "–" if arm.startswith("sgd") else mean_std([r["err"] for r in rows], 2)
    print(f"| {sigma:g} | {arm} | {len(rows)} | {rows[0]['steps']} | {mean_std([r['acc'] for r in rows], 3)} "
          f"| {mean_std([r['lr'] for r in rows], 3)} | {err} | {np.mean([r['eps'] for r in rows]):.2f} |")
EOF
}

best_sgd_lr() {  # the grid η with the best mean test accuracy at σ = 2
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
        if Path(f"{log.parent}.done").exists():
            accs.append(read_run(log)["augment"]["test_acc"])
    scores[lr] = np.mean(accs) if accs else -1.0  # a grid point without finished runs never wins
print(max(grid, key=lambda lr: scores[lr]))
EOF
}

table_args adadp_table.sh runs/adadp-table "$@"

# 2 parties of 2,000 examples each (train and validation shards pooled), expected batch 64 per party: 32 weight
# releases per epoch, so EPOCHS=6 gives SGD 192 iterations and ADADP 96.
common=(space.kind=dpnas space.nodes=5 "space.stage_channels=[8, 16, 32]" data.image_size=16 mode=dpfnas
        federation.parties=2 data.train_size=4000 augment.genotype="$DPNASNET" augment.epochs="$epochs"
        augment.batch_size=64 augment.clip=1.0 augment.momentum=0 augment.weight_decay=0 augment.grad_clip=0
        privacy.delta=1.0e-5 runtime.threads_per_rank=1 runtime.progress=off checkpoint.every_steps=0)

run() {  # run ARM SEED KEY=VALUE...: one training (3 ranks) in the background
  run_in_background "$out/$1-seed$2" 3 seed="$2" "${common[@]}" "${@:3}"
}

for s in "${seeds[@]}"; do
  for lr in "${lr_grid[@]}"; do
    run "sgd-lr$lr-sigma2" "$s" augment.lr="$lr" augment.lr_min="$lr" augment.noise_multiplier=2
  done
done
wait  # the tuned η needs every grid run
tuned=$(best_sgd_lr "$out")
echo "SGD tuned at σ = 2: augment.lr = $tuned"
for s in "${seeds[@]}"; do
  for sigma in "${sigmas[@]}"; do
    [ "$sigma" = 2 ] || run "sgd-lr$tuned-sigma$sigma" "$s" augment.lr="$tuned" augment.lr_min="$tuned" \
      augment.noise_multiplier="$sigma"
    for lr0 in "${adadp_lr0[@]}"; do
      run "adadp-lr$lr0-sigma$sigma" "$s" augment.optimizer=adadp augment.lr="$lr0" augment.noise_multiplier="$sigma"
    done
  done
done
wait
summarize "$out"
