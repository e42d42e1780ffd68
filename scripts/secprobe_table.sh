#!/usr/bin/env bash
# Regenerates the table of docs/secprobe.md (issue 13): 8 parties, 4 of them unreliable, a fraction P of their
# examples replaced by noise, P in {0, 0.2, 0.4, 0.6}; arms all, random (K' = 4), secprobe (K' = 4) at
# eps_EM in {0.1, 1, 10}, and the oracle (the reliable parties only); seeds 0 1 2; the search only (DP-FNAS,
# the make-run config otherwise), test accuracy of the supernet.
#   scripts/secprobe_table.sh [OUT_DIR]        (default runs/secprobe-table)
#   scripts/secprobe_table.sh --summarize OUT_DIR
#   ARMS="all secprobe-eps10" PS="0.6" SEEDS="0" scripts/secprobe_table.sh OUT_DIR   (a subset, e.g. a smoke test)
# Each run writes OUT_DIR/p<P>-<arm>-seed<s>/search.h5; a run whose log exists is skipped, so an interrupted
# table is finished by running the script again. The tables (markdown, mean ± std over seeds) are printed at the
# end from the logs alone. Environment: PYTHON, MPIRUN (default: the project's .venv); EXTRA: more KEY=VALUE
# settings for every run (e.g. a tiny config for a smoke test).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
mpirun=${MPIRUN:-$here/.venv/bin/mpirun}
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
    if run["status"] != "finished":
        print(f"skipped (not finished): {log}", file=sys.stderr)
        continue
    unreliable = np.asarray(run["unreliable"], dtype=bool)
    selection = run["selection"]
    rate_bad = rate_good = eps = float("nan")
    if selection is not None and len(selection["chosen"]):
        chosen = np.asarray(selection["chosen"], dtype=bool)
        rate_bad = chosen[:, unreliable].mean() if unreliable.any() else float("nan")
        rate_good = chosen[:, ~unreliable].mean()
        eps = float(selection["selection_epsilon"][-1])
    elif arm == "all":
        rate_bad = rate_good = 1.0
    cells.setdefault((float(fraction), arm), []).append({
        "acc": float(run["metrics"]["test_acc"][-1]), "bad": rate_bad, "good": rate_good, "eps": eps,
        "party_eps": float(run["privacy"]["epsilon"][-1].max()) if run["privacy"] is not None else float("nan"),
    })


def mean_std(values: list[float]) -> str:
    array = np.array(values, dtype=float)
    if np.isnan(array).all():
        return "—"
    spread = array.std(ddof=1) if len(array) > 1 else 0.0
    return f"{np.nanmean(array):.3f} ± {spread:.3f}"


print("| P | arm | seeds | test acc | selection rate, unreliable | selection rate, reliable | selection ε (aux set) "
      "| worst-party ε |")
print("|---|---|---|---|---|---|---|---|")
for (fraction, arm), rows in sorted(cells.items()):
    print(f"| {fraction:g} | {arm} | {len(rows)} | {mean_std([r['acc'] for r in rows])} "
          f"| {mean_std([r['bad'] for r in rows])} | {mean_std([r['good'] for r in rows])} "
          f"| {mean_std([r['eps'] for r in rows])} | {mean_std([r['party_eps'] for r in rows])} |")
PY
}

if [ "${1:-}" = "--summarize" ]; then summarize "${2:?usage: secprobe_table.sh --summarize OUT_DIR}"; exit 0; fi
out=${1:-runs/secprobe-table}
mkdir -p "$out"

run() {  # run NAME KEY=VALUE...
  local dir=$out/$1; shift
  if [ -e "$dir/search.h5" ]; then echo "exists, skipped: $dir"; return; fi
  local sets=(); for kv in "$@" "${extra[@]}"; do [ -n "$kv" ] && sets+=(--set "$kv"); done
  "$mpirun" -n 9 "$python" -m mpi_fnas.run --out "$dir" "${sets[@]}"
}

for s in "${seeds[@]}"; do
  for p in "${fractions[@]}"; do
    common=(seed="$s" mode=dpfnas augment.epochs=0 federation.unreliable_parties=4 federation.corruption="$p"
            federation.aux_size=256)
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
