"""How close each class of operation comes to the device's peak: the step-time model's calibrated numbers.

A training step is not one big GEMM. The planner splits its work into op classes, each with its own
fraction of a peak:

    dense_gemm      attention projections, dense MLP, LM head: fraction of peak FLOP/s
    grouped_gemm    the MoE experts (torch._grouped_mm, Triton, or a loop over experts): fraction of peak FLOP/s
    attention       the scores and the weighted sum (SDPA / flash attention): fraction of peak FLOP/s
    loss_head       the LM head's GEMMs with the cross-entropy over the vocabulary (its softmax passes included):
                    fraction of peak FLOP/s on the head's 6 T d V FLOPs
    memory_bound    norms, activation functions, residual adds, RoPE, routing permutes: fraction of peak memory
                    bandwidth (hbm_gb_s)
    optimizer       the step's gradient clipping and fused AdamW update (step_time.OPTIMIZER_BYTES_PER_ELEMENT),
                    and the per-micro-batch passes over the weights (step_time.weight_pass_bytes: autocast's
                    casts, gradient accumulation): fraction of peak memory bandwidth; as memory_bound unless
                    measured. It may exceed 1 where the "peak" is a measured copy (`here`): the update works in
                    place, so it pays none of a copy's reads-for-ownership of the lines it writes (2.1-2.4 x one
                    thread's copy on a 2-core EPYC)
    buffer_copy     data parallelism's own copies (FSDP's copy-in and copy-out, the zero modes' packing and
                    unpacking, DDP's buckets): plain copies and casts of flat buffers, fraction of peak memory
                    bandwidth; as memory_bound unless measured. Not memory_bound's eager elementwise ops, which
                    upcast: on a 2-core EPYC those reach 0.43 of a copy's bandwidth in fp32 and 0.21 in bf16, FSDP's
                    chunk_cat and split_with_sizes_copy 0.94-1.06 in either (cache-resident ones up to 3), so its
                    dense FSDP 2 step in bf16 was priced 97 ms of copies for some 28 ms profiled
    op_overhead_us  fixed cost per operator launched (Python dispatch, kernel launch) that does not overlap the
                    work: tens of microseconds on a CPU running tiny ops; on a GPU the host queues kernels ahead
                    of the device, but not through runs of small ones: an H200's eager Mula steps left it idle
                    18-22 us per operator (benchmarks/step_profile.py). Under train.compile a block launches
                    a tenth of the operators (step_time.COMPILED_OPERATOR_SHARE)
    eager_memory_traffic  bytes the memory-bound operators move when run eagerly (a kernel per operator, the norms'
                    fp32 upcasts materialised) over the fused count memory_bound is read against
                    (step_time.memory_bound_bytes); 1 where memory_bound was itself timed on eager operators
                    (`here`'s calibration) or the kernels are fused (train.compile, which the fused count prices);
                    it does not multiply the expert path's own fused kernels (memory_bound_bytes(fused_only=True))
    dtensor_overhead_us  what tensor parallelism adds per DTensor operator (DTensor's Python dispatch and the
                    placement copies around the kernels; optimus/plan/dtensor_cost.py): 0 on a GPU fed
                    asynchronously, ~100-200 us on a CPU core

A cluster preset carries defaults under `efficiency:` (each with its source or reasoning, in the YAML); the
`here` cluster gets them from `optimus plan --calibrate`, which times each class at the planned model's shapes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

DEFAULT_EFFICIENCY = 0.80  # REFERENCE.md: H100 ~790 TFLOP/s measured bf16 dense matmul / 989.4 datasheet
DEFAULT_MEMORY_BOUND = 0.70  # reasoning: unfused eager elementwise kernels reach ~60-80% of a GPU's HBM peak
# reasoning: the head GEMMs run at dense_gemm; the fp32 softmax over each chunk of logits adds ~2 passes of
# 4 V bytes per token against 6 d V FLOPs, ~10% on a GPU at d = 4096
DEFAULT_LOSS_HEAD = 0.70
# the optimizer's (and the buffer copies') bandwidth against a measured copy's: an in-place update, or a copy that
# stays in cache, can beat the large copy (see `optimizer` below), by far less than this; a larger value is a broken
# measurement
OPTIMIZER_MAX = 4.0


@dataclass(frozen=True)
class Efficiency:
    """Fraction of peak each op class reaches (FLOP/s for the compute classes, bandwidth for memory_bound)."""

    dense_gemm: float = DEFAULT_EFFICIENCY
    grouped_gemm: float = DEFAULT_EFFICIENCY
    attention: float = DEFAULT_EFFICIENCY
    memory_bound: float = DEFAULT_MEMORY_BOUND
    op_overhead_us: float = 0.0
    loss_head: float = DEFAULT_LOSS_HEAD
    dtensor_overhead_us: float = 0.0
    optimizer: float = DEFAULT_MEMORY_BOUND
    eager_memory_traffic: float = 1.0
    buffer_copy: float | None = None  # None: as memory_bound

    def __post_init__(self) -> None:
        if self.buffer_copy is None:
            object.__setattr__(self, "buffer_copy", self.memory_bound)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, where: str) -> "Efficiency":
        """From a YAML/JSON mapping (missing keys keep their defaults); ValueError naming `where` when malformed."""
        if raw is None:
            return cls()
        known = {f.name for f in fields(cls)}
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: efficiency must be a mapping of {', '.join(sorted(known))}")
        unknown = sorted(map(str, set(raw) - known))
        if unknown:
            raise ValueError(f"{where}: unknown efficiency key '{unknown[0]}': the keys are {', '.join(sorted(known))}")
        values = {k: float(v) for k, v in raw.items()}
        costs = ("op_overhead_us", "dtensor_overhead_us")  # microseconds, the rest fractions of a peak

        def out_of_range(name: str, value: float) -> bool:
            if name in costs:
                return value < 0
            if name == "eager_memory_traffic":
                return value < 1
            return not 0 < value <= (OPTIMIZER_MAX if name in ("optimizer", "buffer_copy") else 1)
        bad = [k for k, v in values.items() if out_of_range(k, v)]
        if bad:
            raise ValueError(f"{where}: efficiency {bad[0]}={values[bad[0]]:g} is out of range (fractions in (0, 1], "
                             f"optimizer and buffer_copy in (0, {OPTIMIZER_MAX:g}], op_overhead_us and "
                             "dtensor_overhead_us >= 0, "
                             "eager_memory_traffic >= 1)")
        # presets and calibrations from before the optimizer was timed price it as the other memory-bound work
        values.setdefault("optimizer", values.get("memory_bound", DEFAULT_MEMORY_BOUND))
        return cls(**values)

    def to_dict(self) -> dict[str, float]:
        """Plain mapping (for the calibration cache and --json)."""
        return asdict(self)

    def with_gemm(self, value: float) -> "Efficiency":
        """The same with one efficiency for every compute class (the `--efficiency` flag)."""
        return replace(self, dense_gemm=value, grouped_gemm=value, attention=value, loss_head=value)
