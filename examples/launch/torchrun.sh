#!/usr/bin/env bash
# Optimus with torchrun: one node, or several nodes joined by a c10d rendezvous.
#
#   examples/launch/torchrun.sh configs/mula-tiny-moe.yaml --parallel.dp_shard=8
#   NNODES=2 NODE_RANK=0 RDZV_HOST=node0 examples/launch/torchrun.sh CONFIG ...   # on node0
#   NNODES=2 NODE_RANK=1 RDZV_HOST=node0 examples/launch/torchrun.sh CONFIG ...   # on node1
#
# torchrun exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; optimus.parallel.launch
# reads them (they win over any scheduler variables) and picks the backend from the device:
# nccl on CUDA (RCCL behind the same name on ROCm), xccl on Intel XPU, gloo on CPU.
# The product dp_replicate x dp_shard x tp x pp must equal NNODES x NPROC_PER_NODE (ep divides dp_shard).
set -euo pipefail

CONFIG=${1:?usage: torchrun.sh CONFIG [--section.key=value ...]}
shift
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python -c 'import torch; print(max(1, torch.cuda.device_count()))')}
NODE_RANK=${NODE_RANK:-0}
RDZV_HOST=${RDZV_HOST:-127.0.0.1}
RDZV_PORT=${RDZV_PORT:-29500}

# One thread per rank for the CPU-side work unless told otherwise (many ranks share the cores).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# On CPU (gloo) pick the loopback or the cluster interface explicitly; auto-detection may pick a wrong one.
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}

# Never pipe torchrun into `head` or similar: SIGPIPE kills the workers.
exec torchrun \
  --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" --node-rank="$NODE_RANK" \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" \
  -m optimus train "$CONFIG" "$@"
