#!/usr/bin/env bash
# The one launcher behind every slurm/*.sh batch script: starts `python -m mpi_fnas.run` on all tasks of the
# allocation, survives preemption, and requeues itself when the run stopped early after writing a checkpoint.
#
#   bash slurm/launch.sh [MODE PARTIES]      (the batch scripts `exec` it; MODE: vanilla | fnas | dpfnas)
#
# MODE picks the default config (configs/vanilla_nas.yaml, configs/fnas.yaml, configs/dpfnas.yaml); PARTIES adds
# `--set federation.parties=PARTIES` before EXTRA_ARGS, so a job whose task count is not PARTIES+1 fails at once
# (exit 2). Without arguments: CONFIG default configs/dpfnas.yaml and the config's own party count.
#
# Finding the repository. sbatch runs a spooled copy of the batch script (slurmd's spool dir), so a script cannot
# find this file relative to its own path ($0). Each batch script therefore looks for launch.sh in this order:
# $MPI_FNAS_HOME/slurm, its own directory (`bash slurm/x.sh`, also inside salloc), and, in a batch job, the
# directory of the file that was submitted: the job's Command= (`scontrol show job`), which is the path exactly
# as given to sbatch, so relative to the submit directory (SLURM_SUBMIT_DIR), not to --chdir. Requeued jobs keep
# both. Submitting the script on stdin (`sbatch < file`) leaves Command=(null): set MPI_FNAS_HOME then.
#
# Environment (all optional; the batch scripts set sensible defaults):
#   CONFIG              YAML config (default: MODE's; relative paths: submit dir, then repository)
#   EXTRA_ARGS          extra arguments for mpi_fnas.run, e.g. "--set search.epochs=2 --debug"
#   RUN_DIR             run directory (default <submit dir>/runs/<job name>-<job id>[_<array task>]); a
#                       requeued job keeps its id, so it comes back to the same directory
#   IMAGE               Apptainer image: ranks run as `apptainer exec --nv $APPTAINER_ARGS $IMAGE python ...`
#   APPTAINER_ARGS      extra `apptainer exec` options (e.g. --bind for a host MPI, see containers/README.md)
#   VENV                virtual environment when IMAGE is unset (default <repository>/.venv)
#   MPI_FNAS_LAUNCHER   srun (default: `srun --mpi=pmi2`) or mpirun (the one in VENV, else on PATH)
#   SRUN_ARGS           extra srun options;  MPIRUN_ARGS  extra mpirun options
#   NTASKS              ranks for mpirun outside Slurm (inside an allocation: SLURM_NTASKS)
#   MPI_FNAS_HOME       repository root (default: the parent of this file's directory; the venv, relative configs)
#   MPI_FNAS_MODULE     the Python module to run (default mpi_fnas.run; tests substitute a stand-in)
#
# Exit codes of mpi_fnas.run: 0 finished, 2 bad input, 75 interrupted after writing RUN_DIR/checkpoint.pt
# (EX_TEMPFAIL: "try again"), anything else failure. On 75 inside a Slurm job this script runs
# `scontrol requeue $SLURM_JOB_ID`; the job comes back with SLURM_RESTART_COUNT > 0 and resumes from RUN_DIR.
#
# Signals: Slurm sends SIGUSR1 to this shell only (`--signal=B:USR1@120`), and a plain scancel/requeue sends
# SIGTERM to the shell. Either is forwarded to the MPI step as SIGUSR1, which the run treats as "checkpoint at
# the next step boundary and exit 75" (SIGTERM would make mpirun kill the ranks at once).
set -euo pipefail

EXIT_INTERRUPTED=75

log() { printf '%s launch.sh: %s\n' "$(date '+%F %T')" "$*" >&2; }
die() { log "error: $*"; exit 2; }

home=${MPI_FNAS_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
[[ -f $home/slurm/launch.sh ]] || die "MPI_FNAS_HOME=$home is not an mpi_fnas repository (no slurm/launch.sh)"
launcher=${MPI_FNAS_LAUNCHER:-srun}
module=${MPI_FNAS_MODULE:-mpi_fnas.run}

# --- what to run: MODE and PARTIES -----------------------------------------------------------------------------
(($# == 0 || $# == 2)) || die "usage: launch.sh [MODE PARTIES], got $# arguments: $*"
mode=${1:-dpfnas} parties=${2:-}
case $mode in
  vanilla) default_config=configs/vanilla_nas.yaml ;;
  fnas | dpfnas) default_config=configs/$mode.yaml ;;
  *) die "MODE must be vanilla, fnas or dpfnas, got '$mode'" ;;
esac
[[ -z $parties || $parties =~ ^[1-9][0-9]*$ ]] || die "PARTIES must be a positive whole number, got '$parties'"
config=${CONFIG:-$default_config}

# A relative config names a file in the submit directory or, failing that, in the repository.
if [[ $config != /* && ! -f $config && -f $home/$config ]]; then
  config=$home/$config
fi
[[ -n ${IMAGE:-} || -f $config ]] || die "CONFIG=$config not found (cwd $PWD, repository $home)"

if [[ -n ${SLURM_JOB_ID:-} ]]; then
  if [[ -n ${SLURM_ARRAY_JOB_ID:-} ]]; then
    job_tag=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
  else
    job_tag=$SLURM_JOB_ID
  fi
  run_dir=${RUN_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/runs/${SLURM_JOB_NAME%.sh}-$job_tag}
else
  run_dir=${RUN_DIR:-$PWD/runs/mpi_fnas-$(date +%Y%m%d-%H%M%S)}
fi
restarts=${SLURM_RESTART_COUNT:-0}

# --- what each rank runs -------------------------------------------------------------------------------------
if [[ -n ${IMAGE:-} ]]; then
  command -v apptainer > /dev/null || die "IMAGE is set but apptainer is not on PATH"
  # shellcheck disable=SC2206  # APPTAINER_ARGS is a list of options, split on purpose
  rank_cmd=(apptainer exec --nv ${APPTAINER_ARGS:-} "$IMAGE" python -m "$module")
else
  venv=${VENV:-$home/.venv}
  [[ -x $venv/bin/python ]] || die "no python in VENV=$venv (run scripts/install.sh $venv, or set IMAGE)"
  rank_cmd=("$venv/bin/python" -m "$module")
fi

run_args=(--config "$config")
if [[ -f $run_dir/checkpoint.pt || $restarts -gt 0 ]]; then
  log "resuming from $run_dir (restart $restarts)"
  run_args+=(--resume "$run_dir")
else
  mkdir -p "$(dirname "$run_dir")"
  run_args+=(--out "$run_dir")
fi
[[ -z $parties ]] || run_args+=(--set "federation.parties=$parties")
# shellcheck disable=SC2206  # EXTRA_ARGS is a list of arguments, split on purpose
run_args+=(${EXTRA_ARGS:-})

# --- how the ranks are started -------------------------------------------------------------------------------
case $launcher in
  srun)
    [[ -n ${SLURM_JOB_ID:-} ]] || die "MPI_FNAS_LAUNCHER=srun needs a Slurm allocation (use mpirun outside Slurm)"
    # No --kill-on-bad-exit: 75 is a normal exit, and the first rank to leave must not get rank 0 killed while
    # it still writes the checkpoint or closes the log. Failures end the job through MPI_Abort instead.
    # shellcheck disable=SC2206
    start=(srun --mpi=pmi2 ${SRUN_ARGS:-})
    ;;
  mpirun)
    mpirun_bin=mpirun
    [[ -z ${IMAGE:-} && -x ${venv:-}/bin/mpirun ]] && mpirun_bin=$venv/bin/mpirun
    # shellcheck disable=SC2206
    start=("$mpirun_bin" -n "${SLURM_NTASKS:-${NTASKS:-9}}" ${MPIRUN_ARGS:-})
    ;;
  *) die "MPI_FNAS_LAUNCHER must be srun or mpirun, got '$launcher'" ;;
esac

# --- stale MPICH shared memory of a killed attempt ---------------------------------------------------------------
# MPICH (ch4) names a step's node-local shared-memory segment /dev/shm/mpich_shm_<h>_<node> (and mpich_vci_<h>_<node>),
# h = FNV-1a hash of the PMI job id "<job id>.<step id>", and unlinks it in MPI_Finalize. When Slurm SIGKILLs an
# attempt (KillWait after a requeue or preemption) the segment stays behind; the requeued job keeps its id and numbers
# its steps from 0 again, so the next attempt's ranks would attach to the dead segment and hang in MPI_Init for good.
# So a restarted job first removes its own old segments on every node, in a step of its own (step 0): the run is
# step 0 of a first attempt and step 1 of a restarted one, and both names are removed.
fnv1a32() {
  local text=$1 hash=2166136261 i byte
  for ((i = 0; i < ${#text}; i++)); do
    printf -v byte '%d' "'${text:i:1}"
    hash=$(((hash ^ byte) * 16777619 & 0xFFFFFFFF))
  done
  printf '%x' "$hash"
}
remove_stale_mpich_segments() {
  local patterns=() step hash
  for step in 0 1; do
    hash=$(fnv1a32 "$SLURM_JOB_ID.$step")
    patterns+=("/dev/shm/mpich_shm_${hash}_*" "/dev/shm/mpich_vci_${hash}_*")
  done
  log "removing stale MPICH segments of job $SLURM_JOB_ID on its nodes: ${patterns[*]}"
  # The globs expand on each node; --gres=none and --mpi=none keep this step from needing the GPUs or PMI.
  srun --ntasks-per-node=1 --ntasks="${SLURM_JOB_NUM_NODES:-1}" --gres=none --mpi=none \
    bash -c 'shopt -s nullglob; rm -f -- $*' rm_stale "${patterns[@]}" ||
    log "warning: could not remove stale MPICH segments (a resumed run may hang in MPI_Init)"
}
if [[ $launcher == srun && $restarts -gt 0 ]]; then
  remove_stale_mpich_segments
fi

# Threads per rank: what Slurm gave each task, unless the caller decided. HDF5 locks break on parallel file
# systems and rank 0 is the only writer.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}
export PYTHONUNBUFFERED=1

log "job ${SLURM_JOB_ID:-none} restart $restarts on ${SLURM_JOB_NODELIST:-$(hostname)}: ${start[*]} ${rank_cmd[*]} ${run_args[*]}"

# --- run, forwarding preemption signals ----------------------------------------------------------------------
# The step runs in the background because bash defers traps until a foreground child exits; `wait` returns
# early when a trapped signal arrives, so keep waiting until the step itself has ended.
"${start[@]}" "${rank_cmd[@]}" "${run_args[@]}" &
step_pid=$!
# shellcheck disable=SC2317  # invoked from the traps below
forward() {
  log "got SIG$1: asking the run to checkpoint and stop (SIGUSR1 to the step)"
  kill -USR1 "$step_pid" 2> /dev/null || true
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
status=0
while :; do
  wait "$step_pid" && status=0 || status=$?
  kill -0 "$step_pid" 2> /dev/null || break
done
trap - USR1 TERM
log "run exited with $status"

if [[ $status -eq $EXIT_INTERRUPTED && -n ${SLURM_JOB_ID:-} ]]; then
  # Logged before the requeue: a requeue of a running job ends this script (SIGTERM), often before a line after it.
  log "requeueing job $SLURM_JOB_ID; it resumes from $run_dir"
  if scontrol requeue "$SLURM_JOB_ID"; then
    exit 0
  fi
  # The stop request may itself have come from a requeue (`scontrol requeue`, preemption in REQUEUE mode): Slurm
  # then has already counted the restart and refuses a second requeue ("Job is pending execution").
  now=$(scontrol show job -o "$SLURM_JOB_ID" | grep -m1 -o ' Restarts=[0-9]*' | cut -d= -f2) || now=""
  if [[ -n $now && $now -gt $restarts ]]; then
    log "job $SLURM_JOB_ID was already requeued by Slurm (restart $now); it resumes from $run_dir"
    exit 0
  fi
  log "scontrol requeue failed: resubmit with RUN_DIR=$run_dir to resume"
fi
exit "$status"
