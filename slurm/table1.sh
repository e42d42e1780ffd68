#!/usr/bin/env bash
#SBATCH --job-name=table1
#SBATCH --time=1-00:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
# Paper Table 1: vanilla NAS (1 party), FNAS and DP-FNAS with 1/2/4/8 parties, over several seeds.
# Run it with bash, not sbatch: it submits one array job per (mode, parties) setting, sized --ntasks=K+1
# --gpus=K so each run's GPU-hours are its own, with one array task per seed; each task re-enters this file
# as a batch script and writes its own run dir:
#   <TABLE1_ROOT>/<mode>-K<parties>-seed<seed>/search.h5     (TABLE1_ROOT default: runs/table1-<date-time>)
# Environment: TABLE1_SETTINGS (mode:parties list), SEEDS, SBATCH_ARGS (extra sbatch options, e.g. --partition),
# CONFIG_VANILLA / CONFIG_FNAS / CONFIG_DPFNAS, and everything slurm/launch.sh reads (EXTRA_ARGS, IMAGE, ...).
#   bash slurm/table1.sh
#   TABLE1_SETTINGS="fnas:2 dpfnas:2" SEEDS="0" EXTRA_ARGS="--set search.epochs=1" bash slurm/table1.sh
# Re-running with the same TABLE1_ROOT resumes interrupted runs (their run dir holds a checkpoint).
set -euo pipefail

# Run by bash, this is the original file; its array tasks (spooled copies) get MPI_FNAS_HOME from the submitter's
# environment, which sbatch exports to them (--export=ALL, its default).
export MPI_FNAS_HOME=${MPI_FNAS_HOME:-$(cd "$(dirname "$0")/.." && pwd)}
[[ -f $MPI_FNAS_HOME/slurm/launch.sh ]] || {
  echo "table1.sh: no slurm/launch.sh in MPI_FNAS_HOME=$MPI_FNAS_HOME: run it with bash (bash slurm/table1.sh)" >&2
  exit 2
}

export TABLE1_SETTINGS=${TABLE1_SETTINGS:-vanilla:1 fnas:2 fnas:4 fnas:8 dpfnas:1 dpfnas:2 dpfnas:4 dpfnas:8}
export SEEDS=${SEEDS:-0 1 2}
read -ra seeds <<< "$SEEDS"

if [[ -z ${SLURM_ARRAY_TASK_ID:-} ]]; then
  # Submitter: one array per setting. Tasks inherit this environment (sbatch's default --export=ALL).
  export TABLE1_ROOT=${TABLE1_ROOT:-$PWD/runs/table1-$(date +%Y%m%d-%H%M%S)}
  for setting in $TABLE1_SETTINGS; do
    mode=${setting%%:*} parties=${setting##*:}
    [[ $mode =~ ^(vanilla|fnas|dpfnas)$ && $parties =~ ^[1-9][0-9]*$ ]] || {
      echo "table1.sh: bad setting '$setting' (want mode:parties, mode in vanilla|fnas|dpfnas)" >&2
      exit 2
    }
    # shellcheck disable=SC2086  # SBATCH_ARGS is a list of options
    job=$(TABLE1_MODE=$mode TABLE1_PARTIES=$parties sbatch --parsable --job-name="table1-$mode-$parties" \
      --array="0-$((${#seeds[@]} - 1))" --ntasks=$((parties + 1)) --gpus="$parties" ${SBATCH_ARGS:-} \
      "$MPI_FNAS_HOME/slurm/table1.sh")
    echo "table1.sh: $mode K=$parties seeds=[$SEEDS] -> array job ${job%%;*}"
  done
  echo "table1.sh: results under $TABLE1_ROOT"
  exit 0
fi

# Array task: one (mode, parties, seed) run.
mode=${TABLE1_MODE:?} parties=${TABLE1_PARTIES:?}
(( SLURM_ARRAY_TASK_ID < ${#seeds[@]} )) || { echo "table1.sh: task $SLURM_ARRAY_TASK_ID has no seed in [$SEEDS]" >&2; exit 2; }
seed=${seeds[$SLURM_ARRAY_TASK_ID]}
# An unset CONFIG_<MODE> leaves CONFIG empty: launch.sh then takes the mode's default config.
case $mode in
  vanilla) export CONFIG=${CONFIG_VANILLA:-} ;;
  fnas) export CONFIG=${CONFIG_FNAS:-} ;;
  dpfnas) export CONFIG=${CONFIG_DPFNAS:-} ;;
esac
export RUN_DIR=${TABLE1_ROOT:?}/$mode-K$parties-seed$seed
export EXTRA_ARGS="--set seed=$seed ${EXTRA_ARGS:-}"
exec bash "$MPI_FNAS_HOME/slurm/launch.sh" "$mode" "$parties"
