"""The CPU expert layer with its GEMM rows rounded (what training runs) vs exact rows, in the same run.

    PYTHONPATH=. python benchmarks/expert_shapes.py [--dtype auto|bf16|fp32] [--tokens 2048] [--calls 6]
        [--rounds 4] [--cpu-time] [--json F]

oneDNN, which runs bf16 matmuls on CPU, builds (JIT-compiles) and caches a kernel per GEMM shape, and an expert's
row count changes with every routing; ops/cpu_experts.py therefore runs each expert GEMM over its rows rounded up
(gemm_rows), so the shapes recur. This times one MoE expert layer (mula-tiny-moe's: d 256, 16 experts, top-4,
ffn 512; `moe_experts_forward` forward + backward, `--tokens` tokens a call) both ways, alternating round by round:
  fresh routing  every call routes new tokens (as every layer of every training step does): no variant ever sees
                 a routing twice, and both see the same sequence of routings
  same routing   one routing for every call: the kernels are built once, so this is what rounding costs (its
                 extra rows, about 3% of the expert FLOPs at these counts)
"exact" empties cpu_experts._KERNEL_PER_SHAPE for its calls (rows as routed). In fp32 (MKL's sgemm: nothing kept
per shape) both variants run the same exact rows; the table says so. Reported: seconds per call (median and
fastest) and exact / rounded.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
from benchmarks._common import (  # noqa: E402
    CPU_TIME_HELP, announce, choose_dtype, machine_info, precision_fields, timing_clock, write_json,
)
from optimus.ops import cpu_experts, moe_experts_forward  # noqa: E402

D_MODEL, EXPERTS, TOP_K, FFN = 256, 16, 4, 512  # mula-tiny-moe's expert layer


def routed_inputs(tokens: int, seed: int, dtype: torch.dtype, weights: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """A call's inputs: new tokens routed by a fixed router (top-k of softmax), as a layer sees them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D_MODEL, generator=gen)
    router = torch.randn(D_MODEL, EXPERTS, generator=torch.Generator().manual_seed(0)) * D_MODEL ** -0.5
    probs, expert_ids = torch.softmax(x @ router, dim=-1).topk(TOP_K, dim=-1)
    w_gate_up, w_down = weights
    return {"x": x.to(dtype).requires_grad_(), "expert_ids": expert_ids, "weights": probs.to(dtype).requires_grad_(),
            "w_gate_up": w_gate_up, "w_down": w_down}


def layer_call(inputs: dict) -> None:
    out = moe_experts_forward(**inputs)
    out.backward(torch.ones_like(out))
    for tensor in inputs.values():  # as a step's zero_grad: no call adds into the last one's gradients
        tensor.grad = None


def time_variants(tokens: int, dtype: torch.dtype, calls: int, rounds: int, fresh: bool, clock) -> dict[str, list]:
    """Seconds of each call of each variant, the variants alternating (and swapping order) round by round."""
    gen = torch.Generator().manual_seed(1)
    weights = ((torch.randn(EXPERTS, D_MODEL, 2 * FFN, generator=gen) * D_MODEL ** -0.5).to(dtype).requires_grad_(),
               (torch.randn(EXPERTS, FFN, D_MODEL, generator=gen) * FFN ** -0.5).to(dtype).requires_grad_())
    kernel_per_shape = {"rounded": cpu_experts._KERNEL_PER_SHAPE, "exact": ()}
    samples: dict[str, list[float]] = {name: [] for name in kernel_per_shape}
    same = routed_inputs(tokens, 10**6, dtype, weights)
    try:
        for name in kernel_per_shape:  # warm-up: first-call dispatch and allocations (and, same routing, kernels)
            cpu_experts._KERNEL_PER_SHAPE = kernel_per_shape[name]
            layer_call(same if not fresh else routed_inputs(tokens, 10**6 + 1, dtype, weights))
        for r in range(rounds):
            for name in (list(kernel_per_shape) if r % 2 == 0 else list(reversed(kernel_per_shape))):
                cpu_experts._KERNEL_PER_SHAPE = kernel_per_shape[name]
                for c in range(calls):
                    inputs = routed_inputs(tokens, r * calls + c, dtype, weights) if fresh else same
                    start = clock()
                    layer_call(inputs)
                    samples[name].append(clock() - start)
    finally:
        cpu_experts._KERNEL_PER_SHAPE = kernel_per_shape["rounded"]
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto (default): bf16 where the CPU computes it natively, as training picks")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per layer call (make train's micro-batch)")
    parser.add_argument("--calls", type=int, default=6, help="timed calls per variant per round")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument("--cpu-time", action="store_true", help=CPU_TIME_HELP)
    parser.add_argument("--json", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    clock = timing_clock(args.cpu_time, torch.device("cpu"), parser)
    precision = choose_dtype(args.dtype, torch.device("cpu"))
    announce(precision)
    dtype = torch.bfloat16 if precision.dtype == "bf16" else torch.float32
    rounds_shapes = dtype in cpu_experts._KERNEL_PER_SHAPE
    rows = []
    for regime, fresh in (("fresh routing", True), ("same routing", False)):
        samples = time_variants(args.tokens, dtype, args.calls, args.rounds, fresh, clock)
        median = {name: statistics.median(s) for name, s in samples.items()}
        rows.append({"regime": regime, "calls": len(samples["rounded"]),
                     **{f"{name}_median_s": median[name] for name in samples},
                     **{f"{name}_best_s": min(s) for name, s in samples.items()},
                     "exact_over_rounded": median["exact"] / median["rounded"]})
    print(f"MoE expert layer fwd+bwd, {args.tokens} tokens (d {D_MODEL}, {EXPERTS} experts, top-{TOP_K}, "
          f"ffn {FFN}), {precision.dtype}" + ("" if rounds_shapes else ": rows are never rounded in this dtype"))
    print(f"{'routing':15} {'calls':>5} {'rounded s':>10} {'exact s':>10} {'exact / rounded':>16}")
    for row in rows:
        print(f"{row['regime']:15} {row['calls']:>5} {row['rounded_median_s']:>10.4f} {row['exact_median_s']:>10.4f} "
              f"{row['exact_over_rounded']:>15.2f}x")
    info = machine_info()
    info["clock"] = "process CPU time, 1 thread" if args.cpu_time else "wall"
    print(f"# {info['date']}, {info['machine']}, torch {info['torch']}, {info['threads']} threads, "
          f"{info['clock']} clock; medians of the calls")
    if args.json:
        write_json(args.json, {"benchmark": "expert_shapes", "info": info, **precision_fields(precision),
                               "tokens": args.tokens, "rows_rounded": rounds_shapes, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
