"""The EP-aware distributed optimizer, measured: fsdp vs zero1/zero2, EP-aware vs EP-unaware.

    python benchmarks/optimizer.py [--json out.json] [--steps N] [--rounds R] [--mula 20b,100b,220b]

1. Measured, on 4 gloo ranks (tests.helpers.distributed.run_distributed), a tiny MoE scaled so
   that the optimizer matters (d_model 128, 8 experts of ffn 256, vocab 4096, 2 micro-batches of
   2 x 32 tokens per rank), in two layouts: dp 2 x ep 2 (dp_shard 4, ep 2) and pp 2 x ep 2
   (pp 2, dp_shard 2 = ep 2, 1F1B); and on 2 ranks, dp 2 alone (the zero modes' own work: packing,
   reduce-scatter, update, all-gather, unpacking; EP-aware and -unaware are the same there). For
   every variant (fsdp; zero1/zero2 EP-aware; zero1/zero2 EP-unaware), all built in the same processes and timed in interleaved rounds
   (_common.time_interleaved): the full step, the optimizer step (gradient clipping + step():
   for zero1 that includes the gradient reduce-scatter, for zero2 and fsdp it ran in backward),
   in wall time and in process CPU time (steadier when 4 ranks share 2 cores: a rank waiting
   for a descheduled peer costs wall time but no CPU time; gloo's threads are included),
   bytes per step and rank by collective (_common.CollectiveCounter, averaged over ranks), the
   optimizer state per rank (fp32 moments, plus fp32 masters where they are copies), and the
   gradient bytes per rank held when backward is done (before clipping: fsdp's sharded gradients,
   zero1's whole ones, zero2's reduced fp32 shards); the zero modes' persistent bucket buffers too.
   Ratios are against the EP-unaware variant of the same zero mode (fsdp: against zero1 EP-unaware).
   And zero1 EP-aware with parallel.grad_reduce_dtype=bf16 (the Aurora team's bf16 gradient buffers) against
   the same in fp32: half the reduce-scatter's bytes, and what packing and summing bf16 costs here.
   Analytic counts, exact here: the zero modes' gradient reduce-scatter (fp32 or bf16, each sharding group's
   parameters end to end, padded to a multiple of the group's size; zero1 once per step, zero2 once per
   micro-batch, its price for holding only shards) and parameter all-gather, and EP's
   all_to_all (per MoE layer and micro-batch: the [T*k, D] token rows out and back, forward and
   backward, plus the [E] counts). EP-unaware also all-reduces the reduced non-expert gradient shard
   over ep: counted too, but the measured all_reduce adds a few scalars (gradient norm, losses).
   fsdp's own collectives are measured only (benchmarks/scaling.py checks FSDP's count).
2. Computed for Mula-20B-A2B / 100B-A7B / 220B-A10B at their published layouts on 3,072 tiles
   (configs/mula-*.yaml: EP 12; EP 12 x PP 4; EP 12 x PP 8; zero1, bf16): optimizer-state bytes
   per rank from the dry run (optimus.parallel.dry_run, EP-aware and EP-unaware), the optimizer
   step's cost taken as the bytes of state it touches (proportional to the state held: the AdamW
   update is memory bound), and the bytes the optimizer moves per rank (reduce-scatter of fp32
   gradients, all-gather of bf16 parameters; EP-unaware adds the all-reduce over ep of the
   non-expert gradient shard). What this model leaves out: collective latency and bandwidth per
   group size (the EP-unaware groups are 12x smaller), overlap with compute, kernel launch
   overheads, the gradient-norm all-reduce. Printed next to the published optimizer-step gains
   of the EP-aware scheme, 1.36x / 1.23x / 1.07x (/work/shared/REFERENCE.md, arXiv 2604.00785).
3. Gradient sync once per step (parallel.defer_grad_sync none | replicate | all): bytes per step
   under HSDP (dp_replicate 2 x dp_shard 2, dense tiny model, 2 micro-batches per rank) against
   the analytic count: per FSDP unit (a block; the root's embedding, norm and head) padded to a
   multiple of dp_shard rows, a fp32 gradient reduce-scatter per micro-batch (once per step
   under "all") and an all-reduce of the shard over dp_replicate per micro-batch (once per step
   under "replicate" and "all"). Beside them, the same model and ranks under parallel.shard_mode=ddp
   (torch DDP over all 4 ranks, nothing sharded): one all-reduce of the whole fp32 gradient per step
   (no_sync on the first micro-batch), counted by a comm hook on DDP's buckets (DDP's reducer calls
   the process group from C++, past the Python wrappers), against 4 bytes x parameters.
On a shared 2-core machine 4 ranks oversubscribe the cores: timings are informational.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import (  # noqa: E402
    CollectiveCounter, ep_all_to_all_bytes, machine_info, time_interleaved, write_json)
from tests.helpers.distributed import run_distributed  # noqa: E402
from tests.helpers.parity import tiny_config  # noqa: E402

MODEL = dict(d_model=128, n_layers=4, n_heads=4, vocab_size=4096, n_experts=8, top_k=2, expert_ffn_hidden=256)
BATCH, SEQ, MICRO = 2, 32, 2
LAYOUTS = {  # name -> (ranks, parallel)
    "dp2 x ep2": (4, dict(dp_shard=4, ep=2)), "pp2 x ep2": (4, dict(pp=2, dp_shard=2, ep=2, pp_schedule="1f1b")),
    "dp2": (2, dict(dp_shard=2, ep=1)),  # 2 ranks, nothing but the optimizer's sharding: its buffer copies show
}
VARIANTS = {  # name -> (shard_mode, ep_aware, grad_reduce_dtype)
    "zero1 ep-unaware": ("zero1", False, "fp32"), "zero1 ep-aware": ("zero1", True, "fp32"),
    "zero2 ep-unaware": ("zero2", False, "fp32"), "zero2 ep-aware": ("zero2", True, "fp32"),
    "fsdp": ("fsdp", True, "fp32"),
    "zero1 ep-aware bf16-reduce": ("zero1", True, "bf16"),  # the Aurora team's bf16 gradient buffers
}
BASELINE = {"zero1 ep-aware": "zero1 ep-unaware", "zero2 ep-aware": "zero2 ep-unaware", "fsdp": "zero1 ep-unaware",
            "zero1 ep-unaware": "zero1 ep-unaware", "zero2 ep-unaware": "zero2 ep-unaware",
            "zero1 ep-aware bf16-reduce": "zero1 ep-aware"}
MULA = {"20b": ("configs/mula-20b-a2b.yaml", 1.36), "100b": ("configs/mula-100b-a7b.yaml", 1.23),
        "220b": ("configs/mula-220b-a10b.yaml", 1.07)}
HSDP = dict(dp_replicate=2, dp_shard=2)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def zero_analytic_bytes(model, mesh, ep_aware: bool, scatters_per_step: int = 1,
                        reduce_width: int = 4) -> dict[str, int]:
    """The zero modes' optimizer collectives per step and rank: the gradient reduce-scatter input (`reduce_width`
    bytes an element: fp32 4, bf16 2; zero1: once per step; zero2: once per micro-batch, pass scatters_per_step)
    and the fp32 parameters' all-gather output. Each sharding
    group's parameters are one flat bucket here (the model is far below DEFAULT_BUCKET_NUMEL), padded only to a
    multiple of the group's size (optim/flat.py)."""
    from optimus.optim.sharded import DEFAULT_BUCKET_NUMEL, expert_parameters

    experts = expert_parameters(model)
    expert = sum(_local(p).numel() for p in model.parameters() if p in experts)
    non_expert = sum(_local(p).numel() for p in model.parameters() if p not in experts)
    if max(expert, non_expert) >= DEFAULT_BUCKET_NUMEL:
        raise ValueError("zero_analytic_bytes counts one bucket per group: the model is too large for that")
    total = 0  # padded elements sent
    for elements, group in ((non_expert, "dp" if ep_aware else "expert_dp"), (expert, "expert_dp")):
        size = mesh.size(group)
        if size > 1 and elements:
            total += math.ceil(elements / size) * size
    # EP-unaware: the reduced non-expert shard is all-reduced over ep
    ep_shard = 0 if ep_aware else math.ceil(non_expert / mesh.size("expert_dp")) * 4
    out = {"reduce_scatter_single": scatters_per_step * total * reduce_width, "all_gather_single": total * 4}
    if ep_shard and mesh.size("ep") > 1:
        out["all_reduce"] = ep_shard  # measured all_reduce adds a few scalars (gradient norm, losses)
    return out


def _optimizer_state_bytes(optimizer) -> int:
    if hasattr(optimizer, "state_numel"):
        return 4 * sum(optimizer.state_numel().values())
    return sum(_local(v).numel() * _local(v).element_size() for s in optimizer.state.values()
               for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))


def _layout_rank(rank: int, world: int, parallel: dict, steps: int, rounds: int) -> dict:
    import torch.distributed as dist

    import optimus.train.step as step_module
    from optimus.models.moe import MoE
    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model

    dims = ParallelDims(dp_replicate=parallel.get("dp_replicate", 1), dp_shard=parallel["dp_shard"],
                        pp=parallel.get("pp", 1), ep=parallel["ep"], world_size=world)
    mesh = dims.build_mesh("cpu")
    counter = CollectiveCounter()
    counter.install()
    opt_time = [0.0, 0.0]  # wall, process CPU time of this step's clipping + optimizer step

    def timed(fn):
        def call(*args, **kwargs):
            start, start_cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                opt_time[0] += time.perf_counter() - start
                opt_time[1] += time.process_time() - start_cpu
        return call

    grad_held = [0]  # gradient bytes this rank holds when backward is done (recorded as clipping starts)

    def recording(fn, held):
        def call(*args, **kwargs):
            grad_held[0] = held(*args)
            return fn(*args, **kwargs)
        return call

    def sharded_grad_bytes(params, *_):
        return sum(_local(p.grad).numel() * _local(p.grad).element_size() for p in params if p.grad is not None)

    step_module.clip_gradients = recording(timed(step_module.clip_gradients), sharded_grad_bytes)  # fsdp
    gen = torch.Generator().manual_seed(100 + mesh.local_rank("dp"))
    tokens = torch.randint(0, MODEL["vocab_size"], (MICRO, BATCH, SEQ + 1), generator=gen)
    micro = [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(MICRO)]
    runs, out = {}, {}
    for name, (mode, aware, reduce) in VARIANTS.items():
        config = tiny_config(moe=True, model=MODEL, parallel=dict(parallel, shard_mode=mode, ep_aware=aware,
                                                                  grad_reduce_dtype=reduce),
                             train=dict(seq_len=SEQ, micro_batch_size=BATCH, dtype="fp32",
                                        global_batch_size=BATCH * MICRO * mesh.size("dp")))
        torch.manual_seed(0)
        model = build_parallel_model(config, dims, mesh, "cpu")
        optimizer = build_optimizer(model, config.optim)
        optimizer.step = timed(optimizer.step)
        if hasattr(optimizer, "clip_grad_norm_"):
            optimizer.clip_grad_norm_ = recording(timed(optimizer.clip_grad_norm_),
                                                  lambda *_, opt=optimizer: opt.gradient_bytes())
        opt_samples: list[tuple[float, float]] = []

        def one_step(model=model, optimizer=optimizer, samples=opt_samples):
            opt_time[:] = [0.0, 0.0]
            step_module.train_step(model, optimizer, micro, device=torch.device("cpu"), dtype="fp32", grad_clip=1.0,
                                   dp_mesh=mesh["dp"])
            samples.append(tuple(opt_time))

        one_step()  # lazy initialisation
        counter.bytes.clear()
        counter.calls.clear()
        dist.barrier()
        counter.active = True
        one_step()  # the counted step
        counter.active = False
        analytic = {}
        if mode != "fsdp":
            analytic = zero_analytic_bytes(model, mesh, aware, MICRO if mode == "zero2" else 1,
                                           2 if reduce == "bf16" else 4)
        if parallel["ep"] > 1 and config.parallel.ep_dispatch == "all_to_all":
            moe_layers = sum(isinstance(block.mlp, MoE) for block in model.layers.values())
            analytic["all_to_all_single"] = MICRO * ep_all_to_all_bytes(
                moe_layers, BATCH * SEQ, MODEL["top_k"], MODEL["d_model"], MODEL["n_experts"])
        out[name] = {"bytes": dict(counter.bytes), "calls": dict(counter.calls), "analytic": analytic,
                     "state_bytes": _optimizer_state_bytes(optimizer), "grad_bytes": grad_held[0],
                     "buffer_bytes": optimizer.buffer_bytes() if hasattr(optimizer, "buffer_bytes") else 0}
        opt_samples.clear()
        runs[name] = (one_step, opt_samples)
    full = time_interleaved({name: fn for name, (fn, _) in runs.items()}, rounds, steps, warmup=0)
    for name, (_, samples) in runs.items():
        out[name]["step_s"] = full[name]["median"]
        out[name]["opt_s"] = statistics.median(wall for wall, _ in samples)
        out[name]["opt_cpu_s"] = statistics.median(cpu for _, cpu in samples)
    return out


def _merge(ranks: list[dict]) -> dict:
    """Per variant: the slowest rank's medians, bytes and analytic bytes averaged over ranks, the largest state."""
    merged = {}
    for name in ranks[0]:
        per = [r[name] for r in ranks]
        kinds = {k for r in per for k in r["bytes"]}
        merged[name] = {"step_s": max(r["step_s"] for r in per), "opt_s": max(r["opt_s"] for r in per),
                        "opt_cpu_s": max(r["opt_cpu_s"] for r in per),
                        "state_bytes": max(r["state_bytes"] for r in per),
                        "grad_bytes": max(r["grad_bytes"] for r in per),
                        "buffer_bytes": max(r["buffer_bytes"] for r in per),
                        "bytes": {k: sum(r["bytes"].get(k, 0) for r in per) / len(per) for k in sorted(kinds)},
                        # pipeline stages hold different parameters: the analytic count averaged as the bytes are
                        "analytic": {k: sum(r["analytic"][k] for r in per) / len(per) for k in per[0]["analytic"]}}
        merged[name]["bytes_total"] = sum(merged[name]["bytes"].values())
    for name, row in merged.items():
        base = merged[BASELINE[name]]
        row["vs"] = BASELINE[name]
        row["opt_speedup"] = base["opt_s"] / row["opt_s"]
        row["opt_cpu_speedup"] = base["opt_cpu_s"] / row["opt_cpu_s"]
        row["step_speedup"] = base["step_s"] / row["step_s"]
        row["state_ratio"] = row["state_bytes"] / base["state_bytes"]
        row["bytes_ratio"] = row["bytes_total"] / base["bytes_total"]
    return merged


def _hsdp_rank(rank: int, world: int, defer: str) -> dict:
    import optimus.train.step as step_module
    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model

    config = tiny_config(model=dict(vocab_size=4096), parallel=dict(HSDP, defer_grad_sync=defer),
                         train=dict(seq_len=SEQ, micro_batch_size=BATCH, dtype="fp32", global_batch_size=BATCH * 2 * 2))
    dims = ParallelDims(world_size=world, **HSDP)
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, "cpu")
    optimizer = build_optimizer(model, config.optim)
    counter = CollectiveCounter()
    counter.install()
    tokens = torch.randint(0, config.model.vocab_size, (MICRO, BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(rank))
    micro = [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(MICRO)]
    for counted in (False, True):
        counter.active = counted
        step_module.train_step(model, optimizer, micro, device=torch.device("cpu"), dtype="fp32",
                               dp_mesh=mesh["dp"], defer_grad_sync=defer)
    return {"bytes": dict(counter.bytes), "analytic": hsdp_analytic_bytes(config, defer)}


def _ddp_rank(rank: int, world: int) -> dict:
    """Section 3's ddp row: DDP's all-reduced bucket bytes over one counted step of MICRO micro-batches."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import optimus.train.step as step_module
    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model

    config = tiny_config(model=dict(vocab_size=4096), parallel=dict(HSDP, shard_mode="ddp"),
                         train=dict(seq_len=SEQ, micro_batch_size=BATCH, dtype="fp32", global_batch_size=BATCH * 2 * 2))
    dims = ParallelDims(world_size=world, **HSDP)
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, "cpu")
    optimizer = build_optimizer(model, config.optim)
    group, counted = mesh["dp"].get_group(), {"all_reduce": 0}
    active = [False]

    def counting(state, bucket):
        if active[0]:
            counted["all_reduce"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(group, bucket)

    model.register_comm_hook(None, counting)
    tokens = torch.randint(0, config.model.vocab_size, (MICRO, BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(rank))
    micro = [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(MICRO)]
    for counting_now in (False, True):
        active[0] = counting_now
        step_module.train_step(model, optimizer, micro, device=torch.device("cpu"), dtype="fp32", dp_mesh=mesh["dp"])
    return {"bytes": counted, "analytic": {"all_reduce": 4 * sum(p.numel() for p in model.parameters())}}


def hsdp_analytic_bytes(config, defer: str) -> dict[str, int]:
    """Gradient reduce-scatter and replicate all-reduce bytes per step and rank under HSDP (module docstring)."""
    from optimus.models.transformer import build_model

    model = build_model(config.model, device="meta")
    shard = HSDP["dp_shard"]

    def padded(params) -> int:
        return sum(math.ceil(p.shape[0] / shard) * shard * (p.numel() // max(p.shape[0], 1)) * 4 for p in params)

    units = [padded(block.parameters()) for block in model.layers.values()]
    units.append(padded([model.embed.weight, model.norm.weight, model.lm_head.weight]))
    scatters = 1 if defer == "all" else MICRO
    all_reduces = MICRO if defer == "none" else 1
    return {"reduce_scatter_single": scatters * sum(units), "all_reduce": all_reduces * sum(units) // shard}


def mula_computed(names: list[str]) -> list[dict]:
    """Section 2 of the module docstring: the analytic figures for the Mula recipes at 3,072 tiles."""
    from optimus.config import load_config
    from optimus.parallel.dry_run import dry_run

    root = Path(__file__).resolve().parents[1]
    rows = []
    for name in names:
        path, published = MULA[name]
        state, params, ep = {}, 0, 0
        for aware in (True, False):
            config = load_config(root / path, [f"--parallel.ep_aware={str(aware).lower()}"])
            report = dry_run(config, 3072)
            ep = report.dims.ep
            keys = [k for k in report.ranks[0].bytes if k.startswith("optimizer")]
            state[aware] = max(r.bytes[keys[0]] for r in report.ranks)
            params = max(r.parameters for r in report.ranks)
        # bf16 parameters: fp32 master + 2 fp32 moments = 12 bytes per owned element
        owned = {aware: state[aware] / 12 for aware in state}
        non_expert_unaware = (owned[False] - owned[True]) * ep / (ep - 1)
        # gradient reduce-scatter input (in the recipe's grad_reduce_dtype) + bf16 all-gather output
        comm_aware = config.parallel.grad_reduce_bytes * params + 2 * params
        comm_unaware = comm_aware + 4 * non_expert_unaware  # + all-reduce over ep of the non-expert shard
        # AdamW touches master, both moments and the fp32 gradient shard: 16 bytes per owned element
        layout = f"ep {ep}" + (f" x pp {report.dims.pp}" if report.dims.pp > 1 else "")
        rows.append({"model": Path(path).stem, "layout": layout,
                     "world": 3072, "state_bytes_aware": state[True], "state_bytes_unaware": state[False],
                     "opt_touched_bytes_aware": 16 * owned[True], "opt_touched_bytes_unaware": 16 * owned[False],
                     "opt_speedup_computed": owned[False] / owned[True],
                     "comm_bytes_aware": comm_aware, "comm_bytes_unaware": comm_unaware,
                     "opt_speedup_published": published})
    return rows


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f} GiB"


def main(argv: list[str] | None = None) -> dict:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/results/optimizer.json", help="where to write the figures")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    parser.add_argument("--mula", default="20b,100b,220b", help="Mula recipes to compute ('' for none)")
    parser.add_argument("--no-defer", action="store_true", help="skip the defer_grad_sync measurement")
    args = parser.parse_args(argv)
    layouts = [n.strip() for n in args.layouts.split(",") if n.strip()]
    mula = [n for n in args.mula.split(",") if n]
    for name in layouts:
        if name not in LAYOUTS:
            parser.error(f"--layouts: unknown layout {name!r}; choose from {', '.join(LAYOUTS)}")
    for name in mula:
        if name not in MULA:
            parser.error(f"--mula: unknown model {name!r}; choose from {', '.join(MULA)}")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    payload = {"benchmark": "optimizer", **machine_info(), "model": MODEL, "micro_batches": MICRO,
               "micro_batch": [BATCH, SEQ], "dtype": "fp32", "steps": args.steps, "rounds": args.rounds,
               "layouts": {}, "mula": [], "defer_grad_sync": {}}
    for name in layouts:
        world, parallel = LAYOUTS[name]
        merged = _merge(run_distributed(_layout_rank, world, parallel, args.steps, args.rounds, timeout=900))
        payload["layouts"][name] = merged
        print(f"\n{name} ({world} gloo ranks, tiny MoE d128 8x256 experts, {MICRO} micro-batches of {BATCH}x{SEQ}); "
              "ratios vs the EP-unaware variant (fsdp: vs zero1 EP-unaware; bf16-reduce: vs zero1 EP-aware)")
        print(f"{'variant':<26} {'opt ms':>8} {'opt x':>6} {'opt cpu ms':>10} {'cpu x':>6} {'step ms':>8} "
              f"{'step x':>6} {'state/rank':>11} {'state r':>7} {'grads/rank':>11} {'bytes/step':>11} {'bytes r':>7}")
        for variant, row in merged.items():
            print(f"{variant:<26} {row['opt_s'] * 1e3:>8.1f} {row['opt_speedup']:>6.2f} "
                  f"{row['opt_cpu_s'] * 1e3:>10.1f} {row['opt_cpu_speedup']:>6.2f} {row['step_s'] * 1e3:>8.1f} "
                  f"{row['step_speedup']:>6.2f} {row['state_bytes'] / 1e6:>8.2f} MB {row['state_ratio']:>7.2f} "
                  f"{row['grad_bytes'] / 1e6:>8.2f} MB {row['bytes_total'] / 1e6:>8.2f} MB {row['bytes_ratio']:>7.2f}")
        print("  grads/rank: gradient bytes held when backward is done (zero1 whole, zero2 fp32 shards, fsdp shards)")
        buffers = {variant: row["buffer_bytes"] for variant, row in merged.items() if row["buffer_bytes"]}
        if buffers:
            print("  zero modes' persistent bucket buffers per rank (besides grads/rank): " +
                  "; ".join(f"{variant} {held / 1e6:.2f} MB" for variant, held in buffers.items()))
        print("  bytes per step and rank by collective: measured / analytic (where exact)")
        for variant, row in merged.items():
            cells = [f"{kind} {got:,.0f}" + (f" / {row['analytic'][kind]:,.0f}" if kind in row["analytic"] else "")
                     for kind, got in row["bytes"].items()]
            print(f"  {variant:<26} " + "; ".join(cells))
    if mula:
        payload["mula"] = mula_computed(mula)
        print("\nMula at the published layouts on 3,072 tiles (zero1, bf16): COMPUTED, per rank (largest stage)")
        print(f"{'model':<16} {'layout':<12} {'state aware':>13} {'state unaware':>14} {'opt x computed':>15} "
              f"{'opt x published':>17} {'opt comm aware':>15} {'unaware':>12}")
        for row in payload["mula"]:
            print(f"{row['model']:<16} {row['layout']:<12} {_gib(row['state_bytes_aware']):>13} "
                  f"{_gib(row['state_bytes_unaware']):>14} {row['opt_speedup_computed']:>15.2f} "
                  f"{row['opt_speedup_published']:>17.2f} {_gib(row['comm_bytes_aware']):>15} "
                  f"{_gib(row['comm_bytes_unaware']):>12}")
        print("  computed = state bytes the AdamW update touches, EP-unaware / EP-aware; leaves out latency, "
              "group-size bandwidth, overlap (published: /work/shared/REFERENCE.md)")
    if not args.no_defer:
        print(f"\ndefer_grad_sync under HSDP (dp_replicate 2 x dp_shard 2, dense tiny, {MICRO} micro-batches): "
              "bytes per step and rank, measured / analytic")
        for defer in ("none", "replicate", "all"):
            ranks = run_distributed(_hsdp_rank, 4, defer, timeout=300)
            kinds = {k for r in ranks for k in r["bytes"]}
            measured = {k: sum(r["bytes"].get(k, 0) for r in ranks) / len(ranks) for k in sorted(kinds)}
            payload["defer_grad_sync"][defer] = {"bytes": measured, "analytic": ranks[0]["analytic"]}
            cells = [f"{k} {v:,.0f}" + (f" / {ranks[0]['analytic'][k]:,}" if k in ranks[0]["analytic"] else "")
                     for k, v in measured.items()]
            print(f"  {defer:<10} " + "; ".join(cells))
        ranks = run_distributed(_ddp_rank, 4, timeout=300)
        measured = {"all_reduce": sum(r["bytes"]["all_reduce"] for r in ranks) / len(ranks)}
        payload["ddp"] = {"bytes": measured, "analytic": ranks[0]["analytic"]}
        print(f"  {'ddp':<10} all_reduce {measured['all_reduce']:,.0f} / {ranks[0]['analytic']['all_reduce']:,} "
              "(shard_mode=ddp over the same 4 ranks: whole replicas, one all-reduce per step)")
    write_json(args.json, payload)
    print(f"\nwrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
