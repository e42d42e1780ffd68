#!/usr/bin/env bash
#SBATCH --job-name=scaling
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
# The scaling study (python -m mpi_fnas.scaling) as Slurm array jobs: strong and weak scaling over K and the
# exchange pattern. Run it with bash, not sbatch: it submits one array job per K, sized --ntasks=K+1 --gpus=K, with
# one array task per (scaling, exchange, seed); each task re-enters this file as a batch script and runs one point
# through slurm/launch.sh with the same arguments as `python -m mpi_fnas.scaling run`, into
#   <SCALING_ROOT>/<scaling>-<exchange>-K<K>-seed<seed>/search.h5   (SCALING_ROOT default: runs/scaling-<date-time>)
# Steps: S = SCALING_STEPS iterations at K = 1; a strong-scaling point runs ceil(S/K), a weak one S.
# Environment: SCALING_PARTIES, SCALING_EXCHANGES, SCALING_KINDS, SEEDS, SCALING_STEPS, SCALING_ROOT, SBATCH_ARGS
# (extra sbatch options, e.g. --partition), and everything slurm/launch.sh reads (CONFIG, EXTRA_ARGS, IMAGE, ...).
#   bash slurm/scaling.sh
#   SCALING_PARTIES="1 2 4" SCALING_KINDS=weak SEEDS="0 1" CONFIG=configs/smoke.yaml bash slurm/scaling.sh
# Afterwards: python -m mpi_fnas.scaling collect <SCALING_ROOT>. Submitting again with the same SCALING_ROOT skips
# the finished points (their searched.pt) and resumes interrupted ones (their checkpoint).
set -euo pipefail

# Run by bash, this is the original file; its array tasks (spooled copies) get MPI_FNAS_HOME from the submitter's
# environment, which sbatch exports to them (--export=ALL, its default).
export MPI_FNAS_HOME=${MPI_FNAS_HOME:-$(cd "$(dirname "$0")/.." && pwd)}
[[ -f $MPI_FNAS_HOME/slurm/launch.sh ]] || {
  echo "scaling.sh: no slurm/launch.sh in MPI_FNAS_HOME=$MPI_FNAS_HOME: run it with bash (bash slurm/scaling.sh)" >&2
  exit 2
}

export SCALING_PARTIES=${SCALING_PARTIES:-1 2 4 8 16 32}
export SCALING_EXCHANGES=${SCALING_EXCHANGES:-star collective}
export SCALING_KINDS=${SCALING_KINDS:-strong weak}
export SEEDS=${SEEDS:-0}
export SCALING_STEPS=${SCALING_STEPS:-64}
read -ra kinds <<< "$SCALING_KINDS"
read -ra exchanges <<< "$SCALING_EXCHANGES"
read -ra seeds <<< "$SEEDS"
tasks=$((${#kinds[@]} * ${#exchanges[@]} * ${#seeds[@]}))

if [[ -z ${SLURM_ARRAY_TASK_ID:-} ]]; then
  # Submitter: check every setting first (one line, exit 2), then one array per K.
  bad() { echo "scaling.sh: $*" >&2; exit 2; }
  [[ $SCALING_STEPS =~ ^[1-9][0-9]*$ ]] || bad "SCALING_STEPS must be a whole number >= 1, got '$SCALING_STEPS'"
  [[ -n ${SCALING_PARTIES// /} ]] || bad "SCALING_PARTIES is empty"
  for parties in $SCALING_PARTIES; do
    [[ $parties =~ ^[1-9][0-9]*$ ]] || bad "bad K '$parties' in SCALING_PARTIES (want whole numbers >= 1)"
  done
  ((${#exchanges[@]})) || bad "SCALING_EXCHANGES is empty"
  for exchange in "${exchanges[@]}"; do
    [[ $exchange =~ ^(star|collective)$ ]] || bad "bad pattern '$exchange' in SCALING_EXCHANGES (want star|collective)"
  done
  ((${#kinds[@]})) || bad "SCALING_KINDS is empty"
  for kind in "${kinds[@]}"; do
    [[ $kind =~ ^(strong|weak)$ ]] || bad "bad scaling '$kind' in SCALING_KINDS (want strong|weak)"
  done
  ((${#seeds[@]})) || bad "SEEDS is empty"
  for seed in "${seeds[@]}"; do
    [[ $seed =~ ^[0-9]+$ ]] || bad "bad seed '$seed' in SEEDS (want whole numbers >= 0)"
  done
  export SCALING_ROOT=${SCALING_ROOT:-$PWD/runs/scaling-$(date +%Y%m%d-%H%M%S)}
  for parties in $SCALING_PARTIES; do
    # shellcheck disable=SC2086  # SBATCH_ARGS is a list of options
    job=$(SCALING_K=$parties sbatch --parsable --job-name="scaling-K$parties" --array="0-$((tasks - 1))" \
      --ntasks=$((parties + 1)) --gpus="$parties" ${SBATCH_ARGS:-} "$MPI_FNAS_HOME/slurm/scaling.sh")
    echo "scaling.sh: K=$parties scaling=[$SCALING_KINDS] exchange=[$SCALING_EXCHANGES] seeds=[$SEEDS]" \
      "-> array job ${job%%;*}"
  done
  echo "scaling.sh: results under $SCALING_ROOT; then: python -m mpi_fnas.scaling collect $SCALING_ROOT"
  exit 0
fi

# Array task: one point. Task i: seed i mod #seeds, then the exchange, then the scaling (python -m mpi_fnas.scaling's
# order: scaling, exchange, K, seed).
parties=${SCALING_K:?}
(( SLURM_ARRAY_TASK_ID < tasks )) || {
  echo "scaling.sh: task $SLURM_ARRAY_TASK_ID is outside the $tasks points" >&2
  exit 2
}
i=$SLURM_ARRAY_TASK_ID
seed=${seeds[i % ${#seeds[@]}]}
exchange=${exchanges[(i / ${#seeds[@]}) % ${#exchanges[@]}]}
kind=${kinds[i / (${#seeds[@]} * ${#exchanges[@]})]}
if [[ $kind == strong ]]; then
  steps=$(((SCALING_STEPS + parties - 1) / parties))
else
  steps=$SCALING_STEPS
fi
export RUN_DIR=${SCALING_ROOT:?}/$kind-$exchange-K$parties-seed$seed
if [[ -f $RUN_DIR/searched.pt ]]; then
  echo "scaling.sh: $RUN_DIR finished already (searched.pt): skipped"
  exit 0
fi
# The point's keys last, so they win over EXTRA_ARGS (the same order as python -m mpi_fnas.scaling run).
export EXTRA_ARGS="${EXTRA_ARGS:-} --set federation.parties=$parties --set runtime.exchange=$exchange \
--set search.epochs=1 --set search.steps_per_epoch=$steps --set augment.epochs=0 --set seed=$seed"
exec bash "$MPI_FNAS_HOME/slurm/launch.sh" dpfnas "$parties"
