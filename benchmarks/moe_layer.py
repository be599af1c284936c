"""MoE layer forward+backward: Optimus's expert kernels vs the reference ops vs transformers' OLMoE.

    python benchmarks/moe_layer.py                      # CPU: tiny and OLMoE-1B-7B layer shapes
    python benchmarks/moe_layer.py --cpu-time           # CPU, 1 thread, CPU-time clock (steady)
    python benchmarks/moe_layer.py --device cuda --json bench-results/moe_layer_gpu.json

One MoE layer = router (linear, fp32 softmax, top-k) + permute + SwiGLU experts + weighted
combine, timed forward+backward on the same weights and inputs for:
  optimus            moe_experts_forward(impl="auto"): the fused path picked for the device
  optimus-triton     (GPU) the same with Triton for every kernel, GEMMs included
  reference          the pure-torch reference ops (a Python loop over experts)
  hf-default         transformers' OlmoeSparseMoeBlock with the experts implementation
                     from_pretrained picks by default ("grouped_mm")
  hf-eager           the same block with experts_implementation="eager" (its loop over experts)
Before timing, every implementation's output and gradients (x, router, both expert weights) are
checked against the reference; a mismatch stops the run. Timings are interleaved round by round
(benchmarks/_common.py); ratios are against hf-eager and hf-default from the same run. Achieved
TFLOP/s are read against a matmul peak measured in the same run: the dense bf16 matmul on GPU,
a square matmul in the case's dtype on CPU (the ceiling no expert implementation can pass; fp32 for
a bf16 the CPU only emulates). --dtypes auto (the default) runs fp32 and, where the device computes
it natively, bf16; an explicit "fp32,bf16" runs an emulated bf16 too, with a warning.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from benchmarks._common import (  # noqa: E402
    CPU_TIME_HELP, DTYPES_HELP, announce, cpu_matmul_peak, dtype_list, dtypes_to_compare, machine_info,
    precision_fields, timing_clock, write_json,
)
from optimus.ops import moe_experts_forward  # noqa: E402
from tests.helpers.ops import relative_error  # noqa: E402
from optimus.train.hardware import best_matmul_rate  # noqa: E402
from optimus.train.precision import Precision  # noqa: E402

# name: (d_model, experts, expert ffn, top_k, tokens on CPU, tokens on GPU)
SHAPES = {
    "tiny": (256, 16, 512, 4, 2048, 8192),  # the mula-tiny-moe layer (configs/mula-tiny-moe.yaml)
    "olmoe": (2048, 64, 1024, 8, 1024, 8192),  # one OLMoE-1B-7B / mula-7b-a1b layer
}
# Timed calls per implementation: (fast ones, slow ones). The Python loops over experts (the
# reference, HF eager) take ~40 s per call at the OLMoE shape on 2 CPU cores, so they get fewer.
ROUNDS = {("tiny", "cpu"): (15, 6), ("olmoe", "cpu"): (7, 2), ("tiny", "cuda"): (30, 10), ("olmoe", "cuda"): (20, 5)}
SLOW = ("reference", "hf-eager")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MATCH_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


class Layer:
    """One set of weights, in Optimus's layout and inside an HF OlmoeSparseMoeBlock."""

    def __init__(self, shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

        d_model, n_experts, ffn, top_k, *_ = SHAPES[shape]
        self.top_k = top_k
        config = OlmoeConfig(
            hidden_size=d_model, intermediate_size=ffn, num_experts=n_experts, num_experts_per_tok=top_k,
            norm_topk_prob=False,
        )
        torch.manual_seed(seed)
        self.hf = OlmoeSparseMoeBlock(config).to(device=device, dtype=dtype)
        with torch.no_grad():
            self.hf.gate.weight.normal_(0.0, d_model**-0.5)
            self.hf.experts.gate_up_proj.normal_(0.0, d_model**-0.5)
            self.hf.experts.down_proj.normal_(0.0, ffn**-0.5)
        # ours: [E, D, 2F] and [E, F, D] (x @ w), HF: [E, 2F, D] and [E, D, F] (F.linear)
        self.router = self.hf.gate.weight.detach().clone().requires_grad_()
        self.w_gate_up = self.hf.experts.gate_up_proj.detach().transpose(1, 2).contiguous().requires_grad_()
        self.w_down = self.hf.experts.down_proj.detach().transpose(1, 2).contiguous().requires_grad_()

    def optimus(self, x: torch.Tensor, impl: str) -> torch.Tensor:
        """Router as OLMoE computes it (fp32 softmax, top-k, no renormalisation) + our experts."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return moe_experts_forward(x, ids, weights.to(x.dtype), self.w_gate_up, self.w_down, impl=impl)

    def transformers(self, x: torch.Tensor, experts_implementation: str) -> torch.Tensor:
        """transformers' own block, with the given experts implementation."""
        self.hf.experts.config._experts_implementation = experts_implementation
        return self.hf(x.unsqueeze(0)).squeeze(0)

    def grads(self, impl: str) -> list[torch.Tensor]:
        """Gradients of the router and expert weights in our layout, then cleared."""
        if impl.startswith("hf"):
            params = [self.hf.gate.weight, self.hf.experts.gate_up_proj, self.hf.experts.down_proj]
            grads = [params[0].grad, params[1].grad.transpose(1, 2), params[2].grad.transpose(1, 2)]
        else:
            params = [self.router, self.w_gate_up, self.w_down]
            grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return grads


def implementations(layer: Layer, device: torch.device) -> dict:
    """name -> forward function of x."""
    impls = {
        "optimus": lambda x: layer.optimus(x, "auto"),
        "reference": lambda x: layer.optimus(x, "reference"),
        "hf-default": lambda x: layer.transformers(x, "grouped_mm"),
        "hf-eager": lambda x: layer.transformers(x, "eager"),
    }
    if device.type != "cpu":
        impls["optimus-triton"] = lambda x: layer.optimus(x, "triton")
    return impls


def check_agreement(layer: Layer, impls: dict, x: torch.Tensor, grad_out: torch.Tensor, dtype: torch.dtype):
    """Run each implementation once (also the warm-up) and compare with the reference.

    Exits on a mismatch, and on an error in one of ours; a transformers variant that cannot run
    here (say, a dtype its kernels lack on this device) is reported and dropped. Returns
    ({impl: max relative error}, {impl: peak extra GPU memory in GiB}).
    """
    results, peak_gb = {}, {}
    for name, forward in list(impls.items()):
        if x.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        x_leaf = x.detach().requires_grad_()
        try:
            out = forward(x_leaf)
            out.backward(grad_out)
        except Exception as error:  # noqa: BLE001 - only transformers' variants may fail
            if not name.startswith("hf"):
                raise
            print(f"# {name} cannot run here: {type(error).__name__}: {str(error)[:200]}")
            layer.grads(name)
            del impls[name]
            continue
        results[name] = [out.detach(), x_leaf.grad] + layer.grads(name)
        if x.device.type == "cuda":
            peak_gb[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
    errors = {}
    labels = ["output", "grad x", "grad router", "grad w_gate_up", "grad w_down"]
    for name, tensors in results.items():
        errors[name] = max(relative_error(a, b) for a, b in zip(tensors, results["reference"]))
        if errors[name] > MATCH_TOLERANCE[dtype]:
            detail = ", ".join(f"{l} {relative_error(a, b):.1e}" for l, a, b in zip(labels, tensors, results["reference"]))
            raise SystemExit(f"MISMATCH: {name} disagrees with the reference ({detail})")
    return errors, peak_gb


def step_fn(layer: Layer, forward, name: str, x: torch.Tensor, grad_out: torch.Tensor, device: torch.device):
    """One forward+backward with gradients dropped afterwards (as zero_grad(set_to_none) does)."""

    def step():
        x_leaf = x.detach().requires_grad_()
        forward(x_leaf).backward(grad_out)
        layer.grads(name)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def time_steps(fns: dict, rounds: dict, clock=time.perf_counter) -> dict[str, dict[str, float]]:
    """Seconds per call {name: {"median", "best"}}: round r times every fn with more than r
    rounds, alternating the order, so fast and slow implementations still interleave."""
    samples = {name: [] for name in fns}
    for r in range(max(rounds.values())):
        names = [n for n in fns if rounds[n] > r]
        for name in names if r % 2 == 0 else reversed(names):
            start = clock()
            fns[name]()
            samples[name].append(clock() - start)
    return {name: {"median": statistics.median(s), "best": min(s)} for name, s in samples.items()}


def layer_flops(shape: str, n_tokens: int) -> float:
    """Forward+backward FLOPs of one layer: 3x the forward's 2*m*n*k per matmul."""
    d_model, n_experts, ffn, top_k, *_ = SHAPES[shape]
    rows = n_tokens * top_k
    forward = 2 * n_tokens * d_model * n_experts + 2 * rows * d_model * 2 * ffn + 2 * rows * ffn * d_model
    return 3.0 * forward


def matmul_peak_tflops(device: torch.device, precision: Precision) -> tuple[float, str]:
    """(the roofline each case is read against, measured now, which matmul): dense bf16 8192^2 on
    GPU (the issue's reference for both dtypes), a square 2048^2 matmul in the case's dtype on CPU
    (fp32 for an emulated bf16)."""
    if device.type == "cuda":
        return best_matmul_rate(torch.bfloat16, 8192, 1.0, device=device, min_repeats=15) / 1e12, "dense bf16 matmul"
    flops, what = cpu_matmul_peak(precision, size=2048, seconds=1.0)
    return flops / 1e12, what


def run_case(
    shape: str, precision: Precision, device: torch.device, tokens: int | None, rounds: int | None, skip: set, clock,
    peak_tflops: float,
) -> list[dict]:
    """Check and time every implementation for one shape and dtype."""
    dtype = DTYPES[precision.dtype]
    n_tokens = tokens or SHAPES[shape][5 if device.type == "cuda" else 4]
    layer = Layer(shape, dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(n_tokens, SHAPES[shape][0], device=device, dtype=dtype, generator=gen)
    grad_out = torch.randn(n_tokens, SHAPES[shape][0], device=device, dtype=dtype, generator=gen)
    impls = {n: f for n, f in implementations(layer, device).items() if n not in skip or n == "reference"}
    errors, peak_gb = check_agreement(layer, impls, x, grad_out, dtype)
    timed = {n: step_fn(layer, f, n, x, grad_out, device) for n, f in impls.items() if n not in skip}
    fast, slow = (rounds, rounds) if rounds else ROUNDS.get((shape, device.type), (5, 2))
    timings = time_steps(timed, {n: slow if n in SLOW else fast for n in timed}, clock)
    flops = layer_flops(shape, n_tokens)
    rows = []
    for name, t in timings.items():
        row = {"shape": shape, **precision_fields(precision), "impl": name, "tokens": n_tokens, "ms": 1e3 * t["median"],
               "best_ms": 1e3 * t["best"], "tokens_per_s": n_tokens / t["median"], "max_rel_error": errors[name]}
        for base in ("hf-eager", "hf-default"):
            if base in timings:
                row[f"vs_{base}"] = timings[base]["median"] / t["median"]
                row[f"vs_{base}_best"] = timings[base]["best"] / t["best"]
        row["tflops"] = flops / t["median"] / 1e12
        row["pct_of_matmul_peak"] = 100 * row["tflops"] / peak_tflops
        if device.type == "cuda":
            row["peak_gib"] = peak_gb[name]
        rows.append(row)
    return rows


def print_table(rows: list[dict], peak_tflops: float, peak_what: str, dtype_line: str, on_gpu: bool) -> None:
    """Plain text table, one line per (shape, dtype, impl), under the case's dtype and matmul peak."""
    print(dtype_line)
    print(f"matmul peak measured now: {peak_tflops:.3g} TFLOP/s ({peak_what})")
    head = (f"{'shape':6} {'dtype':5} {'impl':15} {'tokens':>6} {'median ms':>10} {'best ms':>10} {'tokens/s':>10} "
            f"{'x hf-eager':>10} {'x hf-def':>9} {'TFLOP/s':>8} {'% peak':>7}")
    if on_gpu:
        head += f" {'peak GiB':>8}"
    print(head)
    for r in rows:
        line = (f"{r['shape']:6} {r['dtype']:5} {r['impl']:15} {r['tokens']:>6} {r['ms']:>10.1f} {r['best_ms']:>10.1f} "
                f"{r['tokens_per_s']:>10.0f} {r.get('vs_hf-eager', float('nan')):>10.2f} "
                f"{r.get('vs_hf-default', float('nan')):>9.2f} {r['tflops']:>8.3g} {r['pct_of_matmul_peak']:>6.1f}%")
        if on_gpu:
            line += f" {r['peak_gib']:>8.2f}"
        print(line, flush=True)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, check and time every case, print the tables, write the JSON."""
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--shapes", default="tiny,olmoe", help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--dtypes", type=dtype_list, default="auto", help=DTYPES_HELP)
    parser.add_argument("--tokens", type=int, help="tokens per layer call (default: per shape and device)")
    parser.add_argument("--rounds", type=int, help="timed calls per implementation (default: per shape and device)")
    parser.add_argument("--skip", default="", help="comma list of implementations not to time (e.g. hf-eager)")
    parser.add_argument("--cpu-time", action="store_true", help=CPU_TIME_HELP)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    clock = timing_clock(args.cpu_time, device, parser)
    skip = set(filter(None, args.skip.split(",")))
    precisions = dtypes_to_compare(args.dtypes, device)
    dtype_lines = [announce(p) for p in precisions]  # before the run: an emulated bf16's warning says why it is slow
    rows = []
    for shape in args.shapes.split(","):
        for precision, dtype_line in zip(precisions, dtype_lines):
            peak, peak_what = matmul_peak_tflops(device, precision)
            case_rows = run_case(shape, precision, device, args.tokens, args.rounds, skip, clock, peak)
            print_table(case_rows, peak, peak_what, dtype_line, device.type == "cuda")
            rows.extend(case_rows)
    info = machine_info()
    info["clock"] = "process CPU time, 1 thread" if args.cpu_time else "wall"
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
    if args.json:
        write_json(args.json, {"benchmark": "moe_layer", "info": info, "dtype_requested": args.dtypes,
                               "dtypes": [precision_fields(p) for p in precisions], "results": rows})
    print(f"# {info['date']}, {info.get('device', info['machine'])}, torch {info['torch']}, "
          f"{info['threads']} threads, {info['clock']} clock")


if __name__ == "__main__":
    main()
