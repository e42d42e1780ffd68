# shellcheck shell=bash
# What the table scripts share (scripts/adadp_table.sh, dpnas_tables.sh, secprobe_table.sh source it; it is not run
# on its own): the interpreter and launcher, the DPNAS paper's cell, the scripts' arguments and one logged run.
# Sets python and mpirun (from PYTHON and MPIRUN; default: the project's .venv) and DPNASNET.

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
mpirun=${MPIRUN:-$here/.venv/bin/mpirun}

# The DPNAS paper's CIFAR-10 cell (Cheng et al. 2021, Fig. 4c) as the authors released it, in our string form
# (docs/dpnas.md).
DPNASNET="dpnas=conv_3x3_selu@0|max_pool_3x3@0,conv_3x3_selu@1|conv_3x3_tanh@0,max_pool_3x3@1,none@2|\
conv_3x3_selu@0,none@1,none@2,skip_connect@3|conv_3x3_selu@0,conv_3x3_selu@1,conv_3x3_tanh@2,max_pool_3x3@3,\
conv_3x3_tanh@4"

# table_args SCRIPT DEFAULT_OUT ARG...: a table script's own arguments. `SCRIPT --summarize OUT_DIR` prints the table
# of OUT_DIR (the caller's summarize function) and exits; otherwise sets out to the first argument (default
# DEFAULT_OUT) and creates it.
table_args() {
  local script=$1 default=$2; shift 2
  if [ "${1:-}" = "--summarize" ]; then summarize "${2:?usage: $script --summarize OUT_DIR}"; exit 0; fi
  out=${1:-$default}
  mkdir -p "$out"
}

# run_once DIR RANKS KEY=VALUE...: mpirun -n RANKS python -m mpi_fnas.run --out DIR --set KEY=VALUE... (empty
# settings dropped), its output in DIR.out, and DIR.done once it succeeded. A done run is skipped and an unfinished
# one redone from scratch, so a table is finished by running its script again; a failure is reported, not fatal.
run_once() {
  local dir=$1 ranks=$2; shift 2
  if [ -e "$dir.done" ]; then echo "done, skipped: $dir"; return; fi
  rm -rf "$dir"  # what an interrupted attempt left
  local sets=(); for kv in "$@"; do [ -n "$kv" ] && sets+=(--set "$kv"); done
  # On the earlier built-in default (configs/darts_default.yaml), which these tables were measured with.
  if "$mpirun" -n "$ranks" "$python" -m mpi_fnas.run --config configs/darts_default.yaml --out "$dir" "${sets[@]}" \
      > "$dir.out" 2>&1; then
    touch "$dir.done"; else echo "FAILED (exit $?): $dir, see $dir.out"; fi
}

# run_in_background DIR RANKS KEY=VALUE...: run_once as a background job, at most $jobs at a time (the caller waits).
run_in_background() {
  # Checked here too, so that a done run neither waits for a free slot nor takes one.
  if [ -e "$1.done" ]; then echo "done, skipped: $1"; return; fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  run_once "$@" &
}
