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

A GPU's kernels run closer to peak the more rows a call has: one H200 ran Mula-7B-A1B's projections at 0.60, 0.69
and 0.73 of peak at 1, 4 and 8 x 2,048 tokens a micro-batch, its experts at 0.28, 0.48 and 0.54 (BENCHMARKS.md,
stop 58). So a node's calibration (plan/calibrate_node.py) also tabulates the compute classes by the rows a call
runs, `by_rows` (ROW_CLASSES: tokens a micro-batch, rows per expert for the experts: call_rows), and a layout is
priced at its own rows (Efficiency.at_rows: log-linear between the timed points, the nearest one's beyond them).
"""

from __future__ import annotations

import math
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
# the classes a calibration may tabulate by the rows a call runs (by_rows)
ROW_CLASSES = ("dense_gemm", "grouped_gemm", "attention", "loss_head")
RowsTable = tuple[tuple[str, tuple[tuple[float, float], ...]], ...]  # ((class, ((rows, fraction), ...)), ...)


def call_rows(tokens: float, top_k: int = 0, n_experts: int = 0, ep: int = 1) -> dict[str, float]:
    """The rows each ROW_CLASSES call runs at `tokens` a micro-batch: every token for the projections, attention and
    the loss head; for the experts, the rows each expert gets where ep ranks send their copies (ep T k / E, as
    calibrate.measure_op_classes times them)."""
    rows = {"dense_gemm": tokens, "attention": tokens, "loss_head": tokens}
    if n_experts:
        rows["grouped_gemm"] = tokens * top_k * ep / n_experts
    return rows


def _between(points: tuple[tuple[float, float], ...], rows: float) -> float:
    """A table's fraction at `rows`: log-linear between its points, the nearest point's beyond them."""
    if rows <= points[0][0]:
        return points[0][1]
    for (r0, f0), (r1, f1) in zip(points, points[1:]):
        if rows <= r1:
            return f0 + (f1 - f0) * math.log(rows / r0) / math.log(r1 / r0)
    return points[-1][1]


def is_finite_number(value: Any) -> bool:
    """A real number as a cluster file may give one: not text, null or a YAML boolean, nor NaN or infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _finite_number(name: str, value: Any, where: str) -> float:
    """One efficiency value as a float, or ValueError naming its key: a NaN or infinite cost passes the range checks
    (nan < 0 is false) and prices every layout at nan s a step; text, null or true would fail in float() unnamed."""
    if not is_finite_number(value):
        raise ValueError(f"{where}: efficiency {name} must be a finite number (got {value!r})")
    return float(value)


def _rows_table(raw: Any, where: str) -> RowsTable:
    """`by_rows:` as read from a file: {class: {rows: fraction}}, or ValueError naming `where`."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: efficiency by_rows must be a mapping of op class to {{rows: fraction of peak}}")
    table = []
    for name, points in raw.items():
        if name not in ROW_CLASSES:
            raise ValueError(f"{where}: efficiency by_rows has an unknown class '{name}': the classes are "
                             f"{', '.join(ROW_CLASSES)}")
        if not isinstance(points, dict) or not points:
            raise ValueError(f"{where}: efficiency by_rows {name} must map rows to fractions of peak, e.g. "
                             "{2048: 0.6, 8192: 0.7}")
        try:
            read = sorted((float(rows), float(value)) for rows, value in points.items())
        except (TypeError, ValueError):
            raise ValueError(f"{where}: efficiency by_rows {name} must map rows to fractions of peak, e.g. "
                             "{2048: 0.6, 8192: 0.7}") from None
        bad = [(r, v) for r, v in read if not (0 < r < math.inf and 0 < v <= 1)]
        if bad:
            raise ValueError(f"{where}: efficiency by_rows {name} {bad[0][0]:g}: {bad[0][1]:g} is out of range "
                             "(rows a positive number, fractions in (0, 1])")
        table.append((name, tuple(read)))
    return tuple(table)


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
    by_rows: RowsTable = ()  # a calibration's ROW_CLASSES rates by the rows a call runs (none: one rate each)

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
        table = _rows_table(raw["by_rows"], where) if raw.get("by_rows") is not None else ()
        values = {k: _finite_number(k, v, where) for k, v in raw.items() if k != "by_rows"}
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
        return cls(**values, by_rows=table)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping (for the calibration cache and --json); by_rows as {class: {rows: fraction}} where any."""
        out = asdict(self)
        del out["by_rows"]
        if self.by_rows:
            out["by_rows"] = {name: dict(points) for name, points in self.by_rows}
        return out

    def at_rows(self, rows: dict[str, float]) -> "Efficiency":
        """The rates at `rows` (call_rows: each class's rows a call) where by_rows tabulates them; the others as
        they are."""
        if not self.by_rows:
            return self
        return replace(self, **{name: _between(points, rows[name]) for name, points in self.by_rows if name in rows})

    def with_gemm(self, value: float) -> "Efficiency":
        """The same with one efficiency for every compute class (the `--efficiency` flag), whatever the rows."""
        return replace(self, dense_gemm=value, grouped_gemm=value, attention=value, loss_head=value, by_rows=())
