#!/usr/bin/env bash
#SBATCH --job-name=dpfnas_4
#SBATCH --ntasks=5
#SBATCH --gpus=4
#SBATCH --time=1-00:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
# DP-FNAS (clipped, noised party releases) with 4 parties.
# Rank 0 = parameter server (CPU), ranks 1..4 = parties (one GPU each).
# Edit the #SBATCH lines for your cluster (partition, account, time, --cpus-per-task). Everything else is
# overridable by environment without editing (see slurm/launch.sh), e.g.
#   CONFIG=configs/smoke.yaml EXTRA_ARGS="--set search.epochs=2" IMAGE=mpi_fnas.sif sbatch slurm/dpfnas_4.sh
# Multi-node form (two nodes with 2 GPUs each), replacing --ntasks/--gpus above:
#   #SBATCH --nodes=2 --ntasks=5 --ntasks-per-node=3 --gpus-per-node=2
set -euo pipefail
export CONFIG=${CONFIG:-configs/dpfnas.yaml}
# The party count is the world size minus one; naming it makes a mismatched --ntasks fail fast (exit 2).
export EXTRA_ARGS="--set federation.parties=4 ${EXTRA_ARGS:-}"

if [[ -z ${MPI_FNAS_HOME:-} ]]; then
  # sbatch runs a spooled copy of this file: find the original through the job's Command, else the submit dir.
  self=${BASH_SOURCE[0]}
  [[ -z ${SLURM_JOB_ID:-} ]] || self=$(scontrol show job -o "$SLURM_JOB_ID" | grep -m1 -o ' Command=[^ ]*' | cut -d= -f2-) || true
  MPI_FNAS_HOME=$(cd "$(dirname "${self:-${SLURM_SUBMIT_DIR:-.}/slurm/-}")/.." && pwd)
fi
export MPI_FNAS_HOME
exec bash "$MPI_FNAS_HOME/slurm/launch.sh"
