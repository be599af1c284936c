"""What tensor parallelism's DTensors cost a CPU rank beyond the kernels they run: counted, and measured here.

Under tp a block's projections, norms and residual stream are DTensors (parallel/tensor_parallel.py): every
operator on one goes through DTensor's dispatch in Python (sharding propagation, placement checks, wrapping the
local result) before its kernel runs. An accelerator fed asynchronously hides that behind the device's work (the
presets: 0); a CPU rank pays it in full, and it is not in the plain operators' fixed cost (Efficiency.op_overhead_us):
on the 2-core EPYC, tp 2 on the tiny dense model ran ~600 DTensor operators a step at ~150 us each, a tenth of its
step.

Counted (a TorchDispatchMode over the tiny presets under tp; the same on one rank and two): DTensor operators in
the forward and in the backward of a dense block, an MoE block, and the root (embedding, final norm, LM head and
loss). tests/unit/plan/test_plan_dtensor_cost.py counts them again on two ranks.

Measured (`optimus plan --calibrate`): the planned model cut to one block and a small vocabulary (past a width of
512, narrowed alike: measured_block), forward + backward on one micro-batch, laid out for tp over a one-rank mesh
(the same DTensors and kernels, no collectives to wait for) and plain; the difference over the DTensor operators
it ran is the cost of one.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from optimus.config import Config
from optimus.models.config import ModelConfig
from optimus.parallel.local_ranks import run_on_local_ranks

# (forward, backward) DTensor operators per micro-batch (the backward's include the adds that sum the projections'
# input gradients on the shared DTensor input: 2 in attention, 1 in the dense MLP)
DENSE_BLOCK_DTENSOR_OPS = (42, 104)
MOE_BLOCK_DTENSOR_OPS = (30, 78)
ROOT_DTENSOR_OPS = (7, 20)
# tokens timed: the micro-batch's, up to this many (part of the cost grows with them: the dense tiny model's
# 170 DTensor operators cost 80-93 us each at 128 tokens, 174 us at 1,024: placement copies around the kernels)
MEASURE_MAX_TOKENS = 2048
MEASURE_VOCAB = 1024
MEASURE_MAX_EXPERTS = 16  # Mula-220B-A10B's 240 experts make one block 3.4B parameters, 14 GB in fp32
MEASURE_MAX_WIDTH = 512
MEASURE_REPEATS = 7


def dtensor_operators(config: Config, layers: int, recompute: bool, root: bool) -> float:
    """DTensor operators one tp rank runs for one micro-batch (forward, backward, a recomputed forward)."""
    forward, backward = MOE_BLOCK_DTENSOR_OPS if config.model.is_moe else DENSE_BLOCK_DTENSOR_OPS
    count = layers * (forward * (2 if recompute else 1) + backward)
    return count + (sum(ROOT_DTENSOR_OPS) if root else 0)


def measured_block(model: ModelConfig) -> ModelConfig:
    """The model the cost is timed on: one block, a small vocabulary, and past MEASURE_MAX_WIDTH a narrower block
    of the same structure (heads of the same width, FFNs scaled alike) with at most MEASURE_MAX_EXPERTS experts:
    the cost is per operator, and a 220B-A10B block's seconds of matmuls would bury its milliseconds."""
    cut: dict[str, Any] = {"n_layers": 1, "vocab_size": min(model.vocab_size, MEASURE_VOCAB)}
    if model.is_moe:
        cut.update(n_experts=min(model.n_experts, MEASURE_MAX_EXPERTS), top_k=min(model.top_k, MEASURE_MAX_EXPERTS))
    if model.d_model > MEASURE_MAX_WIDTH and model.d_model % MEASURE_MAX_WIDTH == 0:
        shrink = model.d_model // MEASURE_MAX_WIDTH
        heads = max(1, model.n_heads // shrink)
        narrow = dict(d_model=MEASURE_MAX_WIDTH, n_heads=heads, ffn_hidden=max(64, model.ffn_hidden // shrink),
                      expert_ffn_hidden=max(64, model.expert_ffn_hidden // shrink),
                      n_kv_heads=None if model.n_kv_heads is None else max(1, model.kv_heads // shrink))
        try:
            return ModelConfig(**{**model.model_dump(), **cut, **narrow})
        except ValueError:  # heads that do not narrow evenly: the full width, slower to time but the same ops
            pass
    return model.model_copy(update=cut)


def _time_one_block(rank: int, world: int, model_config: dict[str, Any], batch: int, seq: int,
                    dtype: str) -> dict[str, Any]:
    """(one forked rank) seconds of forward + backward, plain and under tp on a one-rank mesh, and the DTensor
    operators the tp one ran."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from optimus.models.transformer import build_model
    from optimus.parallel.tensor_parallel import apply_tensor_parallel
    from optimus.plan.timing import CountOps

    config = ModelConfig(**model_config)
    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    plain = build_model(config, device="cpu", seed=0).to(dt)
    tp = apply_tensor_parallel(build_model(config, device="cpu", seed=0).to(dt), init_device_mesh("cpu", (1,)))
    ids = torch.randint(0, config.vocab_size, (batch, seq))

    def step(model) -> None:
        model(ids, labels=ids).loss.backward()

    step(plain)  # warm-up: allocation and first dispatch; the counted tp step below is tp's warm-up
    with CountOps(only=DTensor) as counter:
        step(tp)
    times: dict[str, list[float]] = {"plain": [], "tp": []}
    for _ in range(MEASURE_REPEATS):  # interleaved: a disturbance slows both alike
        for name, model in (("plain", plain), ("tp", tp)):
            start = time.perf_counter()
            step(model)
            times[name].append(time.perf_counter() - start)
    # each repeat's difference, then the median: one disturbed pair does not move it
    extra = statistics.median(t - p for t, p in zip(times["tp"], times["plain"]))
    return {"seconds_plain": statistics.median(times["plain"]), "seconds_tp": statistics.median(times["tp"]),
            "seconds_extra": max(0.0, extra), "operators": counter.count}


def measure_dtensor_overhead(config: Config, dtype: str) -> dict[str, Any]:
    """Time `config`'s model cut to one block under tp on a one-rank mesh against it plain, on one micro-batch
    (a forked gloo rank, one thread); {"seconds_plain", "seconds_tp", "seconds_extra" (the median of the
    repeats' differences), "operators", "us_per_operator"}."""
    model = measured_block(config.model)
    seq = config.train.seq_len
    batch = max(1, min(config.train.micro_batch_size or 1, MEASURE_MAX_TOKENS // seq))
    timed = run_on_local_ranks(_time_one_block, 1, model.model_dump(), batch, seq, dtype, timeout=300.0)[0]
    return {**timed, "us_per_operator": 1e6 * timed["seconds_extra"] / max(1, timed["operators"])}
