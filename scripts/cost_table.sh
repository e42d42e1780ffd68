#!/usr/bin/env bash
# The cost model against real runs on the simulated cluster (docs/hpc.md "What the network costs a search"):
# for each K and link rate, K + 1 namespace hosts (one rank each, rank 0 on n0) with every link shaped to the rate,
# a short DP-FNAS search across them, then the model's prediction beside the measured time of its iterations.
#
#   sudo scripts/cost_table.sh [OUT_DIR]        (default /tmp/mpi_fnas-cost-table)
#
# Environment: PARTIES="2 4 8", RATES="200mbit 50mbit 15mbit", EXCHANGES="star" (runtime.exchange values: "star
# collective" runs both), STEPS=16, ARGS (more mpi_fnas.run --set options), PYTHON (default .venv/bin/python). Needs
# root (scripts/cluster.sh). Writes OUT_DIR/bench-<i>.json (one party's step, measured first on this machine),
# OUT_DIR/K<K>-<rate>-<exchange>/search.h5 and .bytes (rank 0's host: bytes received and sent over the whole job,
# start-up included), OUT_DIR/table.md and OUT_DIR/cost-model.png; removes the hosts after each run, also on failure.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-/tmp/mpi_fnas-cost-table}
python=${PYTHON:-$here/.venv/bin/python}
parties=${PARTIES:-2 4 8}
rates=${RATES:-200mbit 50mbit 15mbit}
exchanges=${EXCHANGES:-star}
steps=${STEPS:-16}
export MFC_PREFIX=mfk MFC_STATE=$out/hosts PYTHON=$python
cluster="$here/scripts/cluster.sh"
pids=()  # the benches running in the background: ended with the hosts, also on failure or Ctrl-C
trap 'kill "${pids[@]}" 2> /dev/null || true; "$cluster" down > /dev/null 2>&1 || true' EXIT
trap 'exit 130' INT TERM
mkdir -p "$out"
"$cluster" down > /dev/null 2>&1 || true

settings=(--config configs/darts_default.yaml --set search.epochs=1 --set "search.steps_per_epoch=$steps" --set augment.epochs=0
          --set runtime.progress=off --set checkpoint.every_steps=0)
# shellcheck disable=SC2206  # ARGS is a list of arguments, split on purpose
settings+=(${ARGS:-})
# One party's step as the hosts see it: every core busy (the hosts share this machine's cores), so one bench per core
# at once (alone, a step here is ~30 % faster than with both cores busy).
cores=$(nproc)
echo "cost_table.sh: one party's step with all $cores cores busy (python -m mpi_fnas.bench, $cores at once)"
for i in $(seq 1 "$cores"); do
  OMP_NUM_THREADS=1 "$python" -m mpi_fnas.bench --json --no-memory --no-aggregation --repeats 5 "${settings[@]}" \
    > "$out/bench-$i.json" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done  # each bench's status: set -e stops at the first that failed
pids=()
n0_bytes() { "$cluster" status | awk '$1 == "n0" { sub("rx_bytes=", "", $3); sub("tx_bytes=", "", $4); print $3, $4 }'; }
pairs=()
for k in $parties; do
  for rate in $rates; do
    for exchange in $exchanges; do
      run=$out/K$k-$rate-$exchange
      rm -rf "$run"
      "$cluster" up $((k + 1)) --rate "$rate" > /dev/null
      echo "cost_table.sh: K=$k at $rate, exchange $exchange: $((k + 1)) hosts"
      read -r rx0 tx0 < <(n0_bytes)
      "$cluster" run $((k + 1)) "${settings[@]}" --set "runtime.exchange=$exchange" --out "$run" \
        > "$out/K$k-$rate-$exchange.out" 2>&1
      read -r rx1 tx1 < <(n0_bytes)
      echo "rx_bytes=$((rx1 - rx0)) tx_bytes=$((tx1 - tx0))" > "$run.bytes"
      "$cluster" down > /dev/null
      pairs+=("$rate:$run")
    done
  done
done
"$python" -m mpi_fnas.report.cost_model --private --cores "$cores" --figure "$out/cost-model.png" \
  --bench "$out"/bench-*.json -- "${pairs[@]}" | tee "$out/table.md"
