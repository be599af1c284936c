"""Whole MoE training step: our fused experts vs the reference expert loop (and Hugging Face's OLMoE).

    python benchmarks/moe_step.py --device cuda [--json out.json]       # OLMoE-1B-7B layers, 4 x 2048 tokens
    python benchmarks/moe_step.py --device cpu  [--cpu-time] [--json F] # tiny shape, 8 x 256 tokens

Three models with the same shapes take full training steps (forward, backward, gradient clipping
at 1.0, AdamW) on the same real-token micro-batches, interleaved round by round (ours share one
seeded init; HF's is its own random init, as routing balance is what matters for the timing):
  * optimus    - the default MoE layer (`moe_impl: auto`): fused permute, merged gate+up grouped
                 GEMM, SwiGLU, down grouped GEMM and weighted combine (`ops.moe_experts_forward`);
  * reference  - the same model with `moe_impl: reference`: a Python loop of one matmul per expert
                 over expert-sorted tokens (Megatron-LM's SequentialMLP; the Optimus paper's baseline);
  * hf         - transformers' OlmoeForCausalLM with its default experts implementation (--no-hf
                 leaves it out, e.g. when three models do not fit in memory).
The shape "olmoe" is OLMoE-1B-7B's layer (d_model 2048, 64 experts, top-8, expert ffn 1024,
vocab 50,304) with fewer layers (--layers, default 2) so that three models with their AdamW state
fit on one 80 GB GPU (--layers 4 --no-hf fits too; more layers weigh the LM head less, so the
whole-step ratio grows toward the MoE layer's); "tiny" is mula-tiny-moe. --dtype auto (the default)
picks bf16 where the device computes it natively and fp32 elsewhere, as training does; bf16 is
autocast with fp32 weights and state, as in training. The figure that matters is optimus /
reference (the paper reports 1.71x on Mula-7B-A1B).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
from _common import (  # noqa: E402
    CPU_TIME_HELP, announce, choose_dtype, machine_info, precision_fields, real_token_batches, time_interleaved,
    timing_clock, write_json,
)
from train_step import hf_olmoe, same_adamw  # noqa: E402

from optimus.optim.config import OptimConfig  # noqa: E402
from optimus.models.flops import count_parameters, flops_per_token  # noqa: E402
from optimus.models.presets import get_preset  # noqa: E402
from optimus.models.transformer import build_model  # noqa: E402
from optimus.optim.build import build_optimizer  # noqa: E402
from optimus.train.step import autocast_context, train_step  # noqa: E402

GRAD_CLIP = 1.0
SHAPES = {
    # (preset, batch, seq_len)
    "olmoe": ("olmoe-1b-7b", 4, 2048),
    "tiny": ("mula-tiny-moe", 8, 256),
}


def model_config(shape: str, layers: int | None, impl: str):
    preset, _, _ = SHAPES[shape]
    updates = {"moe_impl": impl}
    if layers is not None:
        updates["n_layers"] = layers
    return get_preset(preset).model_copy(update=updates)


def hf_step(model, optimizer, inputs, labels, device: torch.device, dtype: str) -> float:
    """One Hugging Face step doing our step's work: loss (+ aux), backward, clip, AdamW."""
    optimizer.zero_grad(set_to_none=True)
    with autocast_context(device, dtype):
        # shift_labels: our labels are already the next tokens, so both models score every position
        out = model(input_ids=inputs, labels=labels, shift_labels=labels)
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    return norm.item()  # .item() waits for the device, so the step's time is all in


def make_steppers(args, device: torch.device, batches) -> tuple[dict, dict]:
    """{name: () -> None} running one training step each, and {name: facts} about each model."""
    steppers, facts = {}, {}
    # the references are built before ours: in same-model A/B runs the model built first ran ~4% faster (allocator
    # state; benchmarks/checkpointing.py runs both orders), so any such edge goes to them, not to ours
    hf_model = (hf_olmoe(model_config(args.shape, args.layers, "auto"), seq_len=batches[0][0].shape[1]).to(device)
                if args.hf else None)
    for name, impl in (("reference", "reference"), ("optimus", "auto")):
        config = model_config(args.shape, args.layers, impl)
        model = build_model(config, device=device, seed=0).train()
        optimizer = build_optimizer(model, OptimConfig())
        facts[name] = {"parameters": count_parameters(model, config), "config": config}
        steppers[name] = _our_stepper(model, optimizer, batches, device, args.dtype)
    steppers = {"optimus": steppers["optimus"], "reference": steppers["reference"]}  # the table's order
    if hf_model is not None:
        model, optimizer = hf_model, same_adamw(optimizer, hf_model)  # ours' AdamW settings and implementation
        facts["hf"] = {"experts_implementation": getattr(model.config, "_experts_implementation", None),
                       "attn_implementation": getattr(model.config, "_attn_implementation", None)}
        cursor = [0]

        def run_hf():
            inputs, labels = batches[cursor[0] % len(batches)]
            cursor[0] += 1
            hf_step(model, optimizer, inputs, labels, device, args.dtype)

        steppers["hf"] = run_hf
    return steppers, facts


def _our_stepper(model, optimizer, batches, device, dtype):
    cursor = [0]

    def run():
        micro_batch = batches[cursor[0] % len(batches)]
        cursor[0] += 1
        # train_step reads the loss with .item() after the optimizer step: the device is synced
        train_step(model, optimizer, [micro_batch], device=device, dtype=dtype, grad_clip=GRAD_CLIP)

    return run


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("model", "tok/s (median)", "tok/s (best)", "vs reference", "vs reference (best)", "TFLOP/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model"], f"{r['tokens_per_s']:,.0f}", f"{r['best_tokens_per_s']:,.0f}",
                      f"{r['vs_reference']:.2f}x", f"{r['vs_reference_best']:.2f}x", f"{r['tflops']:.3g}")
    Console().print(table)


def main(argv: list[str] | None = None) -> dict:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default: olmoe on accelerators, tiny on CPU")
    parser.add_argument("--layers", type=int, help="transformer layers (default: 2 for olmoe, the preset's for tiny)")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto: bf16 where the device computes it natively, else fp32")
    parser.add_argument("--batch", type=int, help="sequences per step (default: per shape)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: per shape)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per model per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="leave transformers' OLMoE out")
    parser.add_argument("--json", help="write the figures to this JSON file")
    parser.add_argument("--cpu-time", action="store_true", help=CPU_TIME_HELP)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    clock = timing_clock(args.cpu_time, device, parser)
    precision = choose_dtype(args.dtype, device)
    dtype_line = announce(precision)  # before the run: an emulated bf16's warning says why it is slow
    args.dtype = precision.dtype
    args.shape = args.shape or ("tiny" if device.type == "cpu" else "olmoe")
    if args.layers is None and args.shape == "olmoe":
        args.layers = 2

    _, shape_batch, shape_seq_len = SHAPES[args.shape]
    batch, seq_len = args.batch or shape_batch, args.seq_len or shape_seq_len
    batches = [(x.to(device), y.to(device)) for x, y in real_token_batches(4, batch, seq_len)]
    steppers, facts = make_steppers(args, device, batches)
    times = time_interleaved(steppers, rounds=args.rounds, calls_per_round=args.steps, clock=clock)

    config = facts["optimus"]["config"]
    flops = flops_per_token(facts["optimus"]["parameters"], config, seq_len)
    tokens = batch * seq_len
    rows = []
    for name, t in times.items():
        rows.append({
            "model": name, "tokens_per_s": tokens / t["median"], "best_tokens_per_s": tokens / t["best"],
            "vs_reference": times["reference"]["median"] / t["median"],
            "vs_reference_best": times["reference"]["best"] / t["best"],
            "tflops": tokens * flops / t["median"] / 1e12,
        })
    info = {**machine_info(), "clock": "CPU-time clock" if args.cpu_time else "wall clock"}
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
    shape = (f"{config.preset} x{config.n_layers} layers (d {config.d_model}, {config.n_experts} experts top-"
             f"{config.top_k}, ffn {config.expert_ffn_hidden})")
    print_table(rows, f"MoE training step, {shape}, {batch} x {seq_len} tokens, {info.get('device', info['machine'])}"
                      f"\n{dtype_line}")
    print("tok/s from the median step; (best): fastest step of each; TFLOP/s: model FLOPs (6N + attention) per second.")
    payload = {**info, "shape": args.shape, "layers": config.n_layers, "batch": batch, "seq_len": seq_len,
               **precision_fields(precision), "steps": args.steps, "rounds": args.rounds, "rows": rows,
               "hf": facts.get("hf")}
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
