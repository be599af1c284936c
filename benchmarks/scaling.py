"""Weak scaling on CPU with gloo: 1 -> 2 -> 4 ranks, FSDP + expert parallelism, and the bytes moved.

    python benchmarks/scaling.py [--json out.json] [--steps N] [--dispatch all_to_all|allgather]

A tiny MoE (d_model 64, 4 layers, 8 experts top-2, vocab 4096) with a fixed per-rank batch
(4 x 64 tokens, one micro-batch); world size W runs dp_shard = ep = W (FSDP2 on the non-expert
weights, experts split over ep). Each rank wraps torch.distributed's collectives (all_gather_single,
reduce_scatter_single, all_to_all_single, all_reduce, broadcast, send, recv) and counts the bytes of
every call on a group of more than one rank (averaged over the ranks: under EP a rank receives as many
token rows as the routing sends it), by the buffer the collective moves: the gathered output
of an all-gather, the input of a reduce-scatter, the send buffer of an all-to-all, the tensor of an
all-reduce / broadcast / send. That is compared with the analytic count per step and rank:
  FSDP   every unit (a block's non-expert weights; the root's embed, norm, LM head), padded to a
         multiple of W rows: all-gather in forward, again in backward unless the unit keeps its
         weights (only the last block does: apply_fsdp reshards the root after forward too), one
         gradient reduce-scatter.
  EP     all_to_all: per MoE layer the [T*k, D] token copies go out and back in forward, and their
         gradients in backward (4 exchanges), plus the [E] counts; allgather: all-gather and
         reduce-scatter of W*T*k rows in forward, mirrored in backward, plus the [W, E] counts.
Collectives issued through functional collectives (DTensor's gradient-norm reduction, the logged
loss all-reduce) are not seen by the wrapper; they are a few scalars per step.
On a shared 2-core machine the timings are informational only (4 ranks oversubscribe the cores).
The dtype is fp32 on every machine, not auto: the analytic counts are of fp32 weights and gradients
(bf16 would halve FSDP's all-gathers), and the figures compare runs, not dtypes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import CollectiveCounter, ep_all_to_all_bytes  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402
from tests.helpers.parity import tiny_config  # noqa: E402

MODEL = dict(d_model=64, n_layers=4, n_heads=4, vocab_size=4096, n_experts=8, top_k=2, expert_ffn_hidden=64)
BATCH, SEQ = 4, 64
DTYPE = "fp32"  # resolved, never "auto": build_parallel_model and train_step take fp32 or bf16
DTYPE_REASON = "fixed: the analytic byte counts are of fp32 weights and gradients"
def analytic_bytes(model, world: int, dispatch: str) -> dict[str, int]:
    """The bytes per step and rank that FSDP and EP should move (see the module docstring)."""
    from optimus.models.moe import MoE

    if world == 1:
        return {}

    def padded(params) -> int:
        return sum(math.ceil(p.shape[0] / world) * world * (p.numel() // max(p.shape[0], 1)) * 4 for p in params)

    blocks = list(model.layers.values())
    gather = scatter = 0
    for index, block in enumerate(blocks):
        size = padded(p for n, p in block.named_parameters() if ".experts." not in f".{n}")
        keeps = index == len(blocks) - 1
        gather += size * (1 if keeps else 2)
        scatter += size
    root = padded([model.embed.weight, model.norm.weight, model.lm_head.weight])
    gather, scatter = gather + 2 * root, scatter + root
    moe_layers = sum(isinstance(b.mlp, MoE) for b in blocks)
    cfg = model.config
    rows_bytes = BATCH * SEQ * cfg.top_k * cfg.d_model * 4
    out = {"fsdp_all_gather": gather, "fsdp_reduce_scatter": scatter}
    if dispatch == "all_to_all":
        out["ep_all_to_all"] = ep_all_to_all_bytes(moe_layers, BATCH * SEQ, cfg.top_k, cfg.d_model, cfg.n_experts)
    else:
        out["ep_all_gather"] = moe_layers * (2 * world * rows_bytes + world * cfg.n_experts * 8)
        out["ep_reduce_scatter"] = moe_layers * 2 * world * rows_bytes
    return out


def _rank(rank: int, world: int, steps: int, dispatch: str) -> dict:
    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from optimus.train.step import train_step

    config = tiny_config(moe=True, model=MODEL, parallel=dict(dp_shard=world, ep=world, ep_dispatch=dispatch),
                         train=dict(seq_len=SEQ, micro_batch_size=BATCH, global_batch_size=BATCH * world, dtype=DTYPE))
    counter = CollectiveCounter()
    counter.install()
    dims = ParallelDims(dp_shard=world, ep=world, world_size=world)
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, "cpu")
    optimizer = build_optimizer(model, config.optim)
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, MODEL["vocab_size"], (steps + 2, BATCH, SEQ + 1), generator=gen)
    times = []
    for step in range(steps + 2):
        batch = [(tokens[step, :, :-1], tokens[step, :, 1:])]
        counter.active = step == 1  # count one steady-state step (not the first: lazy init)
        dist.barrier()
        start = time.perf_counter()
        train_step(model, optimizer, batch, device=torch.device("cpu"), dtype=config.train.dtype, grad_clip=1.0,
                   dp_mesh=mesh["dp"])
        times.append(time.perf_counter() - start)
        counter.active = False
    from optimus.models.transformer import build_model

    reference = build_model(config.model, device="meta")
    return {"step_s": sorted(times[2:])[len(times[2:]) // 2], "bytes": dict(counter.bytes),
            "calls": dict(counter.calls), "analytic": analytic_bytes(reference, world, dispatch)}


def _single(steps: int) -> dict:
    from optimus.models.transformer import build_model
    from optimus.optim.build import build_optimizer
    from optimus.train.step import train_step

    config = tiny_config(moe=True, model=MODEL,
                         train=dict(seq_len=SEQ, micro_batch_size=BATCH, global_batch_size=BATCH, dtype=DTYPE))
    model = build_model(config.model, device="cpu", seed=0)
    optimizer = build_optimizer(model, config.optim)
    tokens = torch.randint(0, MODEL["vocab_size"], (steps + 2, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100))
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        train_step(model, optimizer, [(tokens[step, :, :-1], tokens[step, :, 1:])], device=torch.device("cpu"),
                   dtype=config.train.dtype, grad_clip=1.0)
        times.append(time.perf_counter() - start)
    return {"step_s": sorted(times[2:])[len(times[2:]) // 2], "bytes": {}, "calls": {}, "analytic": {}}


def _mean_over_ranks(results: list[dict]) -> dict:
    """Rank 0's analytic count, the slowest rank's step time, bytes and calls averaged over ranks."""
    n = len(results)
    merged = {"step_s": max(r["step_s"] for r in results), "analytic": results[0]["analytic"]}
    for key in ("bytes", "calls"):
        names = {name for r in results for name in r[key]}
        merged[key] = {name: sum(r[key].get(name, 0) for r in results) / n for name in names}
    return merged


def _measured_by_kind(bytes_: dict[str, int], dispatch: str) -> dict[str, int]:
    """Measured bytes under the analytic rows' names (FSDP's all-gathers and EP's cannot be told apart
    by collective alone under allgather dispatch, so there they are reported together)."""
    if dispatch == "all_to_all":
        return {"fsdp_all_gather": bytes_.get("all_gather_single", 0),
                "fsdp_reduce_scatter": bytes_.get("reduce_scatter_single", 0),
                "ep_all_to_all": bytes_.get("all_to_all_single", 0)}
    return {"fsdp+ep_all_gather": bytes_.get("all_gather_single", 0),
            "fsdp+ep_reduce_scatter": bytes_.get("reduce_scatter_single", 0)}


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/results/scaling.json", help="where to write the figures")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per world size (after 2 warm-up steps)")
    parser.add_argument("--dispatch", default="all_to_all", choices=["all_to_all", "allgather"])
    parser.add_argument("--worlds", default="1,2,4")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        result = _single(args.steps) if world == 1 else _mean_over_ranks(
            run_distributed(_rank, world, args.steps, args.dispatch, timeout=600))
        tokens = BATCH * SEQ * world
        analytic = result["analytic"]
        if args.dispatch == "allgather" and analytic:
            analytic = {"fsdp+ep_all_gather": analytic["fsdp_all_gather"] + analytic["ep_all_gather"],
                        "fsdp+ep_reduce_scatter": analytic["fsdp_reduce_scatter"] + analytic["ep_reduce_scatter"]}
        measured = _measured_by_kind(result["bytes"], args.dispatch) if world > 1 else {}
        rows.append({"world": world, "layout": "single process" if world == 1 else f"dp_shard={world} ep={world}",
                     "step_s": result["step_s"], "tokens_per_s": tokens / result["step_s"],
                     "bytes_measured": measured, "bytes_analytic": analytic, "calls": result["calls"],
                     "other_bytes": {k: v for k, v in result["bytes"].items()
                                     if k not in ("all_gather_single", "reduce_scatter_single", "all_to_all_single")}})
    base = rows[0]["step_s"]
    print(f"weak scaling, tiny MoE, {BATCH}x{SEQ} tokens per rank, dispatch={args.dispatch} (CPU gloo, informational)")
    print(f"dtype {DTYPE} ({DTYPE_REASON})")
    print(f"{'ranks':>5} {'layout':<18} {'step s':>8} {'tok/s':>9} {'efficiency':>10}")
    for row in rows:
        row["weak_scaling_efficiency"] = base / row["step_s"]
        print(f"{row['world']:>5} {row['layout']:<18} {row['step_s']:>8.3f} {row['tokens_per_s']:>9.0f} {row['weak_scaling_efficiency']:>10.2f}")
    print("\nbytes per step and rank: measured (wrapped collectives) vs analytic")
    print(f"{'ranks':>5} {'collective':<24} {'measured':>12} {'analytic':>12} {'ratio':>7}")
    for row in rows[1:] if rows[0]["world"] == 1 else rows:
        for kind, want in row["bytes_analytic"].items():
            got = row["bytes_measured"].get(kind, 0)
            print(f"{row['world']:>5} {kind:<24} {got:>12,.0f} {want:>12,} {got / want if want else float('nan'):>7.3f}")
        for kind, got in row["other_bytes"].items():
            print(f"{row['world']:>5} {kind + ' (other)':<24} {got:>12,.0f} {'-':>12} {'':>7}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "scaling", "dispatch": args.dispatch, "per_rank_tokens": BATCH * SEQ,
                                "dtype": DTYPE, "dtype_requested": DTYPE, "dtype_reason": DTYPE_REASON,
                                "model": MODEL, "rows": rows}, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
