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

# One rank per tile, each bound to 8 cores of its tile's socket (cores 0 and 52 stay free for the OS).
CPU_BIND=list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100
# shellcheck disable=SC2086  # ARGS is a list of overrides
mpiexec -n "$RANKS" --ppn "$RANKS_PER_NODE" --cpu-bind "$CPU_BIND" \
  python -m optimus train "$CONFIG" $ARGS
