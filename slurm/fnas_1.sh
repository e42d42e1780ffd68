#!/usr/bin/env bash
#SBATCH --job-name=fnas_1
#SBATCH --ntasks=2
#SBATCH --gpus=1
#SBATCH --time=1-00:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
# FNAS (no noise) with 1 party: `slurm/launch.sh fnas 1` on 2 tasks.
# Rank 0 = parameter server (CPU), rank 1 = the party (one GPU).
# Edit the #SBATCH lines for your cluster (partition, account, time, --cpus-per-task). Everything else is
# overridable by environment without editing (see slurm/launch.sh), e.g.
#   CONFIG=configs/smoke.yaml EXTRA_ARGS="--set search.epochs=2" IMAGE=mpi_fnas.sif sbatch slurm/fnas_1.sh
set -euo pipefail
# sbatch runs a spooled copy of this file: launch.sh is in $MPI_FNAS_HOME/slurm, next to this file, or else next to
# the submitted file (the job's Command=, relative to the submit dir); see "Finding the repository" in launch.sh.
slurm_dir=${MPI_FNAS_HOME:-$(dirname "$0")/..}/slurm
[[ -f $slurm_dir/launch.sh || -z ${SLURM_JOB_ID:-} ]] || slurm_dir=$(cd "$SLURM_SUBMIT_DIR" &&
  realpath -m "$(scontrol show job "$SLURM_JOB_ID" | sed -n '/^ *Command=/{s///p;q}')/..")
exec bash "$slurm_dir/launch.sh" fnas 1
