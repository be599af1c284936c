#!/usr/bin/env bash
# Optimus on OLCF Frontier: Slurm + srun, 4x MI250X per node = 8 GCDs (8 ranks) per node, RCCL over
# Slingshot (hsn0-3) through the aws-ofi-rccl libfabric plugin.
#
#   sbatch -A <project> -N 48 examples/launch/slurm-frontier.sh configs/mula-20b-a2b.yaml \
#       --parallel.dp_shard=384 --parallel.ep=12
#
# Ranks come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (optimus.parallel.launch); the
# rendezvous host is the first node of SLURM_JOB_NODELIST unless MASTER_ADDR is set (it is, below).
# Check the layout first, on a login node:  optimus train CONFIG ... --dry-run --world-size $((N*8))
#SBATCH -J optimus
#SBATCH -t 02:00:00
#SBATCH -N 2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=7
#SBATCH -o %x-%j.slurm.out
#SBATCH --signal=USR1@180
#SBATCH --requeue
# Three minutes before the time limit every rank gets SIGUSR1: Optimus checkpoints at the next step
# boundary and exits 0 (resilience.checkpoint_on_signal). --requeue lets Slurm requeue a preempted job.
#
# Recovery, all in this script (rerunning the same command resumes from the newest good checkpoint):
# - inside the allocation: a crash or a hang (any exit code but 0 and 2) reruns the job step on the same
#   nodes, at most MAX_RELAUNCHES times (default 3). Exit 2 is bad input: rerunning cannot help.
# - at the end: exit 0 with the run short of train.max_steps (the time limit's SIGUSR1, a preemption)
#   requeues this job (`scontrol requeue`), at most MAX_REQUEUES times (default 20); REQUEUE=0 turns it off.
# Submit from the repository root (examples/launch/run_finished.py decides "finished"), or set LAUNCH_DIR.
set -euo pipefail

CONFIG=${1:?usage: sbatch slurm-frontier.sh CONFIG [--section.key=value ...]}
shift

# Slurm opens the -o file before this script runs, so it cannot live in a folder the script makes (the
# job would lose its output): Slurm's own messages go to the submit directory, the job's log to logs/.
mkdir -p logs
exec >>"logs/${SLURM_JOB_NAME:-optimus}-${SLURM_JOB_ID:-local}.out" 2>&1  # appended: a requeued job keeps its history

# --- software: ROCm PyTorch in a venv or conda env of your own (module versions change; see the OLCF guide)
module load PrgEnv-gnu
module load rocm
# source /path/to/venv/bin/activate
# The aws-ofi-rccl plugin lets RCCL use libfabric/CXI (Slingshot); without it RCCL falls back to TCP sockets.
# export LD_LIBRARY_PATH=/path/to/aws-ofi-rccl/lib:$LD_LIBRARY_PATH

# --- rendezvous: the first node of the allocation
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-29500}

# --- RCCL / libfabric on Slingshot
export NCCL_SOCKET_IFNAME=hsn0          # bootstrap interface: the high-speed network, not the management one
export NCCL_CROSS_NIC=1                 # allow rings to cross the node's four NICs
export NCCL_NET_GDR_LEVEL=3             # GPU-direct RDMA between GCDs and NICs
export FI_CXI_ATS=0                     # required for RCCL over CXI on Frontier
export FI_MR_CACHE_MONITOR=userfaultfd  # libfabric memory-registration cache that is safe with ROCm
export FI_CXI_DISABLE_HOST_REGISTER=1
export FI_CXI_DEFAULT_CQ_SIZE=131072
export HSA_FORCE_FINE_GRAIN_PCIE=1

# --- MIOpen keeps a per-user kernel database; on a shared home it locks and slows start-up: use node-local disk
export MIOPEN_USER_DB_PATH=/tmp/miopen-cache-$USER-$SLURM_JOB_ID
export MIOPEN_CUSTOM_CACHE_DIR=$MIOPEN_USER_DB_PATH
srun --ntasks-per-node=1 mkdir -p "$MIOPEN_USER_DB_PATH"

# --- compile caches on node-local disk too
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$USER-$SLURM_JOB_ID
export OMP_NUM_THREADS=7

MAX_RELAUNCHES=${MAX_RELAUNCHES:-3}
MAX_REQUEUES=${MAX_REQUEUES:-20}
REQUEUE=${REQUEUE:-1}
LAUNCH_DIR=${LAUNCH_DIR:-examples/launch}  # sbatch runs a copy of this script: find the helper from the submit dir
say() { echo "[$(date -u +%FT%TZ)] slurm-frontier.sh: $*"; }

# --- relaunch loop: the same nodes, a fresh job step; Optimus resumes from its newest good checkpoint.
# All 8 GCDs stay visible to every task: Optimus picks cuda:$SLURM_LOCALID itself, so do not bind one
# GPU per task (--gpus-per-task=1 would renumber each task's GPU to 0).
attempt=0
while true; do
  attempt=$((attempt + 1))
  say "job $SLURM_JOB_ID (requeued ${SLURM_RESTART_COUNT:-0} times): attempt $attempt of $((MAX_RELAUNCHES + 1))"
  status=0
  srun -N "$SLURM_JOB_NUM_NODES" --ntasks-per-node=8 --cpus-per-task=7 --cpu-bind=cores \
    python -m optimus train "$CONFIG" "$@" || status=$?
  say "attempt $attempt exited with $status"
  case $status in
    0) break ;;
    2) say "bad input (exit 2): not relaunching; fix the message above and submit again"; exit 2 ;;
    124) what="a hang (the watchdog's exit 124)" ;;
    *) what="a crash (exit $status)" ;;
  esac
  if ((attempt > MAX_RELAUNCHES)); then
    say "$what and $MAX_RELAUNCHES relaunches spent: giving up"
    exit "$status"
  fi
  say "$what: relaunching on the same nodes"
done

# --- finished, or stopped early (time limit, preemption)? Exit 0 either way; requeue when not done.
finished=0
python "$LAUNCH_DIR/run_finished.py" "$CONFIG" "$@" || finished=$?
case $finished in
  0) exit 0 ;;
  1) ;;
  *) say "cannot tell whether the run finished: not requeueing"; exit "$finished" ;;
esac
if [[ $REQUEUE != 1 ]]; then
  say "not finished; REQUEUE=$REQUEUE: submit the same command again to resume"
elif ((${SLURM_RESTART_COUNT:-0} >= MAX_REQUEUES)); then
  say "not finished after $MAX_REQUEUES requeues: giving up (submit again to resume)"
else
  say "not finished: requeueing job $SLURM_JOB_ID; it resumes from the newest checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
fi
