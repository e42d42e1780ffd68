#!/usr/bin/env bash
#SBATCH --job-name=noise_sweep
#SBATCH --ntasks=5
#SBATCH --gpus=4
#SBATCH --array=0-5
#SBATCH --time=1-00:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
# Paper Table 2: DP-FNAS with 4 parties (rank 0 = server, ranks 1..4 = parties, one GPU each) under noise
# variance sigma^2 in {0.5, 1, 2, 5, 8, 10}, the same variance for the W and the A releases.
# Array task i runs variance VARIANCES[i mod 6] with seed SEEDS[i div 6]; --array must cover 6 x len(SEEDS):
#   sbatch slurm/noise_sweep.sh                                   # one seed (0)
#   SEEDS="0 1 2" sbatch --array=0-17 slurm/noise_sweep.sh        # three seeds
# Each task writes <RUN_ROOT>/var<sigma^2>-seed<seed>/search.h5 (RUN_ROOT default runs/noise_sweep-<array job id>).
# The run's noise multiplier is sigma = sqrt(variance), set on every key in NOISE_KEYS.
# Multi-node form (two nodes with 2 GPUs each), replacing --ntasks/--gpus above:
#   #SBATCH --nodes=2 --ntasks=5 --ntasks-per-node=3 --gpus-per-node=2
set -euo pipefail
[[ -n ${SLURM_ARRAY_TASK_ID:-} ]] || { echo "noise_sweep.sh: submit it as an array job: sbatch slurm/noise_sweep.sh" >&2; exit 2; }
# sbatch runs a spooled copy of this file: launch.sh is in $MPI_FNAS_HOME/slurm, next to this file, or else next to
# the submitted file (the job's Command=, relative to the submit dir); see "Finding the repository" in launch.sh.
slurm_dir=${MPI_FNAS_HOME:-$(dirname "$0")/..}/slurm
[[ -f $slurm_dir/launch.sh || -z ${SLURM_JOB_ID:-} ]] || slurm_dir=$(cd "$SLURM_SUBMIT_DIR" &&
  realpath -m "$(scontrol show job "$SLURM_JOB_ID" | sed -n '/^ *Command=/{s///p;q}')/..")

read -ra variances <<< "${VARIANCES:-0.5 1 2 5 8 10}"
read -ra seeds <<< "${SEEDS:-0}"
task=$SLURM_ARRAY_TASK_ID count=${#variances[@]}
(( task < count * ${#seeds[@]} )) || {
  echo "noise_sweep.sh: task $task is past ${count} variances x ${#seeds[@]} seeds; shrink --array" >&2
  exit 2
}
variance=${variances[task % count]} seed=${seeds[task / count]}
sigma=$(awk -v v="$variance" 'BEGIN { if (v <= 0) exit 1; printf "%.12g", sqrt(v) }') || {
  echo "noise_sweep.sh: variance '$variance' must be > 0" >&2
  exit 2
}
noise_args=""
for key in ${NOISE_KEYS:-privacy.noise_multiplier_w privacy.noise_multiplier_a}; do
  noise_args+=" --set $key=$sigma"
done
export RUN_DIR=${RUN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}/runs/noise_sweep-$SLURM_ARRAY_JOB_ID}/var$variance-seed$seed
export EXTRA_ARGS="--set seed=$seed$noise_args ${EXTRA_ARGS:-}"
exec bash "$slurm_dir/launch.sh" dpfnas 4
