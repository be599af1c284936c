"""The allgather expert dispatch vs the all_to_all one, in the same ranks: step time, bytes moved, gradients.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/ep_dispatch.py [--rounds 6] [--layout fsdp2-ep2|tp2-ep2-zero1]
        [--model=--model.top_k=8,...] [--json F]

Gloo ranks train the tiny MoE (seq 128, 4 sequences a data-parallel rank) under FSDP 2 x EP 2 (2 ranks), or TP 2
x EP 2 under zero1 (4 ranks: plan_vs_measured's moe-tp2-ep2-zero1, where each tp rank exchanges its column's
copies of the whole micro-batch), each building the model twice from one seed: with
`parallel.ep_dispatch=allgather` (the Aurora team's: every rank's tokens, router weights and expert ids
all-gathered, the local experts combined per token, the partial sums reduce-scattered) and with `all_to_all` (the
routed copies sent to their experts' ranks and back: the reference).
Forward and backward of one micro-batch alternate between the two round by round, each order of building them
once; the table gives the median of the slowest rank, the collectives' calls and bytes in one forward and
backward (torch.distributed's, counted by wrapping them: the EP exchanges and FSDP's), the EP exchanges' bytes
beside what the planner prices for them (plan/step_time: ep x the rank's tokens each way for allgather, its
top_k copies for all_to_all, whose returned rows follow the routing), and checks that both give the same gradients.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
from benchmarks._common import (  # noqa: E402
    CollectiveCounter, ep_all_to_all_bytes, machine_info, time_interleaved, write_json,
)
from optimus.plan.block_collectives import allgather_exchange_bytes  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--train.dtype=fp32", "--train.seq_len=128", "--train.global_batch_size=8", "--parallel.dp_shard=2",
        "--parallel.ep=2"]
# name -> (ranks, the layout's overrides beyond BASE)
LAYOUTS = {"fsdp2-ep2": (2, []), "tp2-ep2-zero1": (4, ["--parallel.tp=2", "--parallel.shard_mode=zero1"])}
DISPATCHES = ("allgather", "all_to_all")
EP_OPS = {"all_gather_rows": "out", "reduce_scatter_rows": "in", "all_to_all_rows": "in"}  # bytes counted


def _ep_bytes_counter(group_name: str):
    """A dispatch mode summing the bytes the EP exchanges (parallel/collective_ops.py over the group named
    `group_name`; under tp the same ops also gather the sequence over tp) move on this rank: what an all-gather
    brings in, what a reduce-scatter or all-to-all sends."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class EpBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            side = next((where for name, where in EP_OPS.items() if f"optimus.{name}" in str(func)), None)
            if side is not None and args[-1] == group_name:
                tensor = out if side == "out" else args[0]
                self.bytes += tensor.numel() * tensor.element_size()
            return out

    return EpBytes()


def _rank(rank: int, world: int, overrides: list[str], rounds: int, first: str) -> dict:
    import torch

    from optimus.config import load_config
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model

    models, configs = {}, {}
    for dispatch in ((first, *[d for d in DISPATCHES if d != first])):
        configs[dispatch] = load_config(str(ROOT / "configs/mula-tiny-moe.yaml"),
                                        [*BASE, *overrides, f"--parallel.ep_dispatch={dispatch}"])
    config = configs[first]
    dims = ParallelDims.from_config(config.parallel, world)
    mesh = dims.build_mesh("cpu")  # the same layout for both: one mesh
    for dispatch in configs:
        models[dispatch] = build_parallel_model(configs[dispatch], dims, mesh, "cpu")
    per_rank = config.train.global_batch_size // dims.dp  # a tp rank's batch is its data-parallel rank's
    dp_rank = mesh.local_rank("dp")
    ids = torch.randint(0, config.model.vocab_size, (config.train.global_batch_size, config.train.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))[dp_rank * per_rank:(dp_rank + 1) * per_rank]

    def step(model):
        model.zero_grad(set_to_none=True)
        model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()

    times = time_interleaved({name: (lambda m=model: step(m)) for name, model in models.items()}, rounds, 1)
    counter = CollectiveCounter()
    counter.install()
    counted = {}
    for name, model in models.items():  # one more step each, its collectives counted
        counter.bytes.clear(), counter.calls.clear()
        counter.active = True
        with _ep_bytes_counter(mesh["ep"].get_group().group_name) as exchanges:
            step(model)
        counter.active = False
        counted[name] = {"calls": dict(counter.calls), "bytes": dict(counter.bytes), "ep_bytes": exchanges.bytes}
    grads = {name: {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    for n, p in model.named_parameters() if p.grad is not None} for name, model in models.items()}
    max_diff = max(float((grads["allgather"][n] - grads["all_to_all"][n]).abs().max()) for n in grads["allgather"])
    return {"rank": rank, "median_s": {n: t["median"] for n, t in times.items()}, "collectives": counted,
            "grad_max_abs_diff": max_diff, "tokens": ids[:, :-1].numel(), "moe_layers": config.model.n_layers,
            "top_k": config.model.top_k, "d_model": config.model.d_model, "n_experts": config.model.n_experts,
            "tp": dims.tp}


def planned_ep_bytes(dispatch: str, ep: int, tokens: int, top_k: int, d_model: int, layers: int,
                     n_experts: int, tp: int = 1) -> int:
    """The EP exchanges' bytes per rank the planner prices for one forward and backward (fp32) of a micro-batch
    of `tokens`: allgather's collectives as plan/step_time sizes them (forward its all-gathers and the combine's
    reduce-scatter; backward the tokens' and router weights' reduce-scatters and the combine's all-gather; under tp
    each tp rank's of the whole micro-batch), or the all_to_all's top_k copies out and back, forward and backward,
    with the per-expert counts (under tp each tp rank sends 1 / tp of the copies)."""
    if dispatch == "allgather":
        sizes = allgather_exchange_bytes(ep, tokens * d_model * 4, tokens, top_k)
        forward = sum(sizes.values()) + sizes["tokens"]
        backward = 2 * sizes["tokens"] + sizes["router_weights"]
        return int(layers * (forward + backward))
    return ep_all_to_all_bytes(layers, tokens // tp, top_k, d_model, n_experts)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds (each runs both dispatches)")
    parser.add_argument("--layout", default="fsdp2-ep2", choices=sorted(LAYOUTS), help="the ranks' layout")
    parser.add_argument("--model", default="", help="extra --model.* overrides, comma-separated")
    parser.add_argument("--json", default="benchmarks/results/ep_dispatch.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        print(f"--rounds must be at least 1 (got {args.rounds})", file=sys.stderr)
        return 2
    ranks, layout = LAYOUTS[args.layout]
    overrides = [*layout, *(m for m in args.model.split(",") if m)]
    runs = {first: run_distributed(_rank, ranks, overrides, args.rounds, first, timeout=900.0) for first in DISPATCHES}
    slowest = {first: {d: max(r["median_s"][d] for r in out) for d in DISPATCHES} for first, out in runs.items()}
    ratios = [s["all_to_all"] / s["allgather"] for s in slowest.values()]
    speedup = (ratios[0] * ratios[1]) ** 0.5  # each build order once: the geometric mean of the two
    facts = runs["allgather"][0]
    rows = []
    print("| dispatch | step s | speedup over all_to_all | EP bytes measured / planned | all collective calls / bytes "
          "| max grad diff vs all_to_all |")
    print("|---|---|---|---|---|---|")
    for dispatch in DISPATCHES:
        moved = facts["collectives"][dispatch]
        ep_bytes, fsdp_and_ep = moved["ep_bytes"], sum(moved["bytes"].values())
        planned = planned_ep_bytes(dispatch, 2, facts["tokens"], facts["top_k"], facts["d_model"], facts["moe_layers"],
                                   facts["n_experts"], facts["tp"])
        step_s = statistics.mean(s[dispatch] for s in slowest.values())
        gain = speedup if dispatch == "allgather" else 1.0
        rows.append({"dispatch": dispatch, "step_s": step_s, "speedup_over_all_to_all": gain, "collectives": moved,
                     "ep_bytes_planned": planned, "grad_max_abs_diff": facts["grad_max_abs_diff"]})
        print(f"| {dispatch} | {step_s:.3f} | {gain:.2f}x ({ratios[0]:.2f} / {ratios[1]:.2f}) | "
              f"{ep_bytes:,} / {planned:,} | {sum(moved['calls'].values())} / {fsdp_and_ep:,} | "
              f"{facts['grad_max_abs_diff']:.1e} |", flush=True)
    write_json(args.json, {"machine": machine_info(), "layout": args.layout, "rounds": args.rounds,
                           "overrides": overrides, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
