#!/usr/bin/env bash
# Optimus on ALCF Aurora: PBS + mpiexec (Cray PALS), 6 Intel GPU Max 1550 per node = 12 tiles, one
# rank per tile, oneCCL (torch backend "xccl") over Slingshot through libfabric's cxi provider.
#
#   qsub -A <project> -l select=256 -v CONFIG=configs/mula-220b-a10b.yaml,ARGS="--parallel.dp_shard=384 \
#       --parallel.ep=12 --parallel.pp=8" examples/launch/pbs-aurora.sh
#
# Ranks come from PALS_RANKID / PMI_SIZE / PALS_LOCAL_RANKID (optimus.parallel.launch); the rendezvous
# host is the first line of PBS_NODEFILE unless MASTER_ADDR is set (it is, below).
# Check the layout first, on a login node:  optimus train CONFIG ... --dry-run --world-size $((NODES*12))
#PBS -N optimus
#PBS -l walltime=02:00:00
#PBS -l select=2
#PBS -l filesystems=home:flare
#PBS -q prod
#PBS -j oe
#
# Recovery, all in this script (rerunning the same command resumes from the newest good checkpoint):
# - inside the allocation: a crash or a hang (any exit code but 0 and 2) reruns mpiexec on the same
#   nodes, at most MAX_RELAUNCHES times (default 3). Exit 2 is bad input: rerunning cannot help.
# - at the end: exit 0 with the run short of train.max_steps (SIGTERM/SIGUSR1 from a preemption or from
#   you) resubmits this script with `qsub` and the same CONFIG/ARGS, project, queue, node count and
#   walltime, at most MAX_RESUBMITS times (default 20); RESUBMIT=0 turns it off. Not `qrerun`: PBS Pro
#   allows it to operators and managers only, and `-r y` reruns only after a node failure or a preemption
#   by the server. PBS has no --signal=USR1@T: at the walltime it sends SIGTERM and SIGKILL kill_delay
#   seconds later, so size the walltime for the steps you want, or `qsig -s USR1 JOBID` before it ends.
# Submit from the repository root (examples/launch/run_finished.py decides "finished"), or pass
# -v LAUNCH_DIR=/path/to/examples/launch.
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"

CONFIG=${CONFIG:?pass -v CONFIG=path/to/config.yaml (and ARGS="--section.key=value ...")}
ARGS=${ARGS:-}
NODES=$(sort -u "$PBS_NODEFILE" | wc -l)
RANKS_PER_NODE=12
RANKS=$((NODES * RANKS_PER_NODE))

# --- software: ALCF's frameworks module has PyTorch with XPU and oneCCL (versions change; see the ALCF guide)
module load frameworks
# source /path/to/venv/bin/activate   # a venv created with --system-site-packages on top of it

# --- rendezvous
export MASTER_ADDR=$(head -n 1 "$PBS_NODEFILE")
export MASTER_PORT=${MASTER_PORT:-29500}

# --- devices: each tile is its own device (xpu:0..11), so the local rank picks the tile
export ZE_FLAT_DEVICE_HIERARCHY=FLAT

# --- oneCCL: bootstrap over MPI/PMIx rather than its own key-value store
export CCL_PROCESS_LAUNCHER=pmix
export CCL_ATL_TRANSPORT=mpi
export CCL_KVS_MODE=mpi
export CCL_KVS_CONNECTION_TIMEOUT=600
export CCL_ZE_IPC_EXCHANGE=drmfd        # intra-node GPU IPC handle exchange
export CCL_ALLREDUCE=topo CCL_ALLGATHERV=topo CCL_REDUCE_SCATTER=topo   # topology-aware algorithms

# --- libfabric on Slingshot
export FI_PROVIDER=cxi
export FI_CXI_DEFAULT_CQ_SIZE=1048576   # large completion queues: many ranks talk at once in all-to-all
export FI_CXI_RX_MATCH_MODE=hybrid      # fall back to software matching instead of failing when full
export FI_CXI_OFLOW_BUF_SIZE=8388608
export FI_CXI_CQ_FILL_PERCENT=30
export FI_MR_CACHE_MONITOR=userfaultfd

export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$USER-${PBS_JOBID%%.*}
export OMP_NUM_THREADS=8

MAX_RELAUNCHES=${MAX_RELAUNCHES:-3}
MAX_RESUBMITS=${MAX_RESUBMITS:-20}
RESUBMITS=${RESUBMITS:-0}  # how many times this run was resubmitted already (set by the resubmission)
RESUBMIT=${RESUBMIT:-1}
LAUNCH_DIR=${LAUNCH_DIR:-examples/launch}  # PBS runs a copy of this script: find the files from the submit dir
say() { echo "[$(date -u +%FT%TZ)] pbs-aurora.sh: $*"; }

# --- relaunch loop: the same nodes, a fresh mpiexec; Optimus resumes from its newest good checkpoint.
# One rank per tile, each bound to 8 cores of its tile's socket (cores 0 and 52 stay free for the OS).
CPU_BIND=list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100
attempt=0
while true; do
  attempt=$((attempt + 1))
  say "job $PBS_JOBID (resubmission $RESUBMITS): attempt $attempt of $((MAX_RELAUNCHES + 1))"
  status=0
  # shellcheck disable=SC2086  # ARGS is a list of overrides
  mpiexec -n "$RANKS" --ppn "$RANKS_PER_NODE" --cpu-bind "$CPU_BIND" \
    python -m optimus train "$CONFIG" $ARGS || status=$?
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

# --- finished, or stopped early (preemption, a signal)? Exit 0 either way; resubmit when not done.
finished=0
# shellcheck disable=SC2086
python "$LAUNCH_DIR/run_finished.py" "$CONFIG" $ARGS || finished=$?
case $finished in
  0) exit 0 ;;
  1) ;;
  *) say "cannot tell whether the run finished: not resubmitting"; exit "$finished" ;;
esac
if [[ $RESUBMIT != 1 ]]; then
  say "not finished; RESUBMIT=$RESUBMIT: submit the same command again to resume"
elif ((RESUBMITS >= MAX_RESUBMITS)); then
  say "not finished after $MAX_RESUBMITS resubmissions: giving up (submit again to resume)"
else
  # The new job needs this one's resources: command-line -A/-l/-q override the #PBS lines above.
  job=$(qstat -f "$PBS_JOBID" || true)  # without it: the #PBS lines and this node count
  account=$(awk -F' = ' '$1 ~ /^ *Account_Name$/ {print $2}' <<<"$job")
  walltime=$(awk -F' = ' '$1 ~ /^ *Resource_List.walltime$/ {print $2}' <<<"$job")
  resources=(-l "select=$NODES")
  [[ -n $walltime ]] && resources+=(-l "walltime=$walltime")
  [[ -n $account ]] && resources+=(-A "$account")
  [[ -n ${PBS_QUEUE:-} ]] && resources+=(-q "$PBS_QUEUE")
  # -v splits on commas: ARGS must not contain one (write lists in the config file instead).
  vars="CONFIG=$CONFIG,ARGS=$ARGS,RESUBMITS=$((RESUBMITS + 1)),MAX_RESUBMITS=$MAX_RESUBMITS"
  vars+=",MAX_RELAUNCHES=$MAX_RELAUNCHES,LAUNCH_DIR=$LAUNCH_DIR"
  say "not finished: resubmitting (qsub ${resources[*]}); the new job resumes from the newest checkpoint"
  qsub "${resources[@]}" -v "$vars" "$LAUNCH_DIR/pbs-aurora.sh"
fi
