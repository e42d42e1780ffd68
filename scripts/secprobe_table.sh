#!/usr/bin/env bash
# Regenerates the SecProbe table (docs/secprobe.md says how; its last measurement is in docs/log/benchmarks.md):
# 8 parties (9 ranks), 4 of them unreliable, a fraction P of
# their examples replaced by noise, P in {0, 0.2, 0.4, 0.6}; arms all, random (K' = 4), secprobe (K' = 4) at
# eps_EM in {0.1, 1, 10}, and the oracle (the reliable parties only); seeds 0 1 2: 72 runs. Every run is the
# AUGMENTATION of a fixed cell (augment.genotype: the DPNAS paper's CIFAR-10 cell, as scripts/dpnas_tables.sh
# trains it; no search), under DP (mode dpfnas), where the network learns within the run (a tiny supernet stays
# at chance, and so would every probe: docs/secprobe.md). Reported: the test accuracy of the trained network,
# the rate at which the unreliable and the reliable parties were selected (/augment/selection), and the score gap
# (per iteration, the reliable parties' mean score minus the unreliable ones', averaged: the probe's signal).
#   scripts/secprobe_table.sh [OUT_DIR]        (default runs/secprobe-table)
#   scripts/secprobe_table.sh --summarize OUT_DIR
#   ARMS="all secprobe-eps10" PS="0.6" SEEDS="0" scripts/secprobe_table.sh OUT_DIR   (a subset, e.g. a smoke test)
#   ARMS="secprobe-eps10" PS="0.6 0" EXTRA="federation.aux_size=500 federation.score_window=8" \
#     scripts/secprobe_table.sh OUT_DIR   (the second table: a larger aux set and a score window)
# Each run writes OUT_DIR/p<P>-<arm>-seed<s>/search.h5 (its output in .out, and .done once it succeeded); a done run
# is skipped and an unfinished one redone, so an interrupted table is finished by running the script again. The
# tables (markdown, mean ± std over seeds) are printed at the end from the logs alone. Environment: PYTHON, MPIRUN
# (default: the project's .venv); EXTRA: more KEY=VALUE settings for every run (e.g. a tiny config for a smoke
# test). One run at a time: 9 ranks already oversubscribe a 2-core machine.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # python, mpirun, DPNASNET, table_args, run_once, run_in_background
read -r -a seeds <<< "${SEEDS:-0 1 2}"
read -r -a fractions <<< "${PS:-0 0.2 0.4 0.6}"
read -r -a arms <<< "${ARMS:-all random secprobe-eps0.1 secprobe-eps1 secprobe-eps10 oracle}"
read -r -a extra <<< "${EXTRA:-}"

summarize() {
  "$python" - "$1" <<'PY'
import sys
from pathlib import Path

import numpy as np

from mpi_fnas.runlog import read_run

root = Path(sys.argv[1])
cells: dict[tuple[float, str], list[dict]] = {}
for log in sorted(root.glob("p*-*-seed*/search.h5")):
    name = log.parent.name.rsplit("-seed", 1)[0]
    fraction, arm = name[1:].split("-", 1)
    run = read_run(log)
    augment = run["augment"]
    if augment is None or augment["status"] != "finished":
        print(f"skipped (not finished): {log}", file=sys.stderr)
        continue
    unreliable = np.asarray(run["unreliable"], dtype=bool)
    selection = augment["selection"]
    rate_bad = rate_good = eps = gap = float("nan")
    if selection is not None and len(selection["chosen"]):
        chosen = np.asarray(selection["chosen"], dtype=bool)
        rate_bad = chosen[:, unreliable].mean() if unreliable.any() else float("nan")
        rate_good = chosen[:, ~unreliable].mean()
        eps = float(selection["selection_epsilon"][-1])
        score = np.asarray(selection["score"], dtype=float)
        if unreliable.any() and not np.isnan(score).all():
            # the probe's signal: per iteration, the reliable parties' mean score minus the unreliable ones'
            gap = float(np.nanmean(score[:, ~unreliable].mean(axis=1) - score[:, unreliable].mean(axis=1)))
    elif arm == "all":
        rate_bad = rate_good = 1.0
    privacy = augment["privacy"]
    cells.setdefault((float(fraction), arm), []).append({
        "acc": float(augment["test_acc"]), "bad": rate_bad, "good": rate_good, "eps": eps, "gap": gap,
        "party_eps": float(privacy["epsilon"][-1].max()) if privacy is not None else float("nan"),
        "wall": float(augment["cost"]["wall_seconds"]),
    })


def mean_std(values: list[float]) -> str:
    array = np.array(values, dtype=float)
    if np.isnan(array).all():
        return "—"
    spread = array.std(ddof=1) if len(array) > 1 else 0.0
    return f"{np.nanmean(array):.3f} ± {spread:.3f}"


print("| P | arm | seeds | test acc | selection rate, unreliable | selection rate, reliable | score gap "
      "| selection ε (aux set) | worst-party ε | wall s |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (fraction, arm), rows in sorted(cells.items()):
    print(f"| {fraction:g} | {arm} | {len(rows)} | {mean_std([r['acc'] for r in rows])} "
          f"| {mean_std([r['bad'] for r in rows])} | {mean_std([r['good'] for r in rows])} "
          f"| {mean_std([r['gap'] for r in rows])} "
          f"| {mean_std([r['eps'] for r in rows])} | {mean_std([r['party_eps'] for r in rows])} "
          f"| {np.mean([r['wall'] for r in rows]):.0f} |")
PY
}

table_args secprobe_table.sh runs/secprobe-table "$@"

# Sized so that the network learns within a run and the 72 runs take about an hour on a 2-core VM (docs/secprobe.md,
# the measured run): synthetic-shapes 16x16, 8 parties of 1,000 examples (their train and validation shards), DP
# releases of expected batch 64 per party, AUGMENT_EPOCHS (4) epochs of 16 iterations, an aux set of 50 examples.
train=(mode=dpfnas space.kind=dpnas space.nodes=5 "space.stage_channels=[8, 16, 32]" data.image_size=16
       data.train_size=8000 data.test_size=1000 federation.parties=8 augment.genotype="$DPNASNET"
       augment.epochs="${AUGMENT_EPOCHS:-4}" augment.batch_size=64 augment.lr=0.5 augment.weight_decay=0
       augment.clip=1.0 federation.aux_size=50 runtime.threads_per_rank=1 runtime.progress=off
       checkpoint.every_steps=0)

run() {  # run NAME KEY=VALUE...: one run (9 ranks), in the foreground
  run_once "$out/$1" 9 "${@:2}" "${extra[@]}"
}

for s in "${seeds[@]}"; do
  for p in "${fractions[@]}"; do
    common=("${train[@]}" seed="$s" federation.unreliable_parties=4 federation.corruption="$p")
    for arm in "${arms[@]}"; do
      case $arm in
        all) run "p$p-$arm-seed$s" "${common[@]}" ;;
        random) run "p$p-$arm-seed$s" "${common[@]}" federation.selection=random federation.select=4 ;;
        oracle) run "p$p-$arm-seed$s" "${common[@]}" federation.selection=oracle ;;
        secprobe-eps*) run "p$p-$arm-seed$s" "${common[@]}" federation.selection=secprobe federation.select=4 \
                         federation.selection_epsilon="${arm#secprobe-eps}" ;;
        *) echo "unknown arm: $arm" >&2; exit 2 ;;
      esac
    done
  done
done
summarize "$out"
