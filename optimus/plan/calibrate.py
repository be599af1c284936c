"""`optimus plan --calibrate`: fit the step-time model's efficiencies and alpha-beta terms on this machine.

Collectives: gloo all_reduce, all_gather, reduce_scatter and all_to_all of 4 KiB to 153 MiB (the sharded optimizer's
bucket) over 2, 3 and 4 forked ranks on loopback, each the mean time per call over bursts of back-to-back calls (as a
step issues them), and over the pairs of a 4-rank job, both pairs at once and one pair while the other computes (what
tensor, expert and data parallelism of 2 within 4 ranks pay when the 4 share fewer cores, without and with a
pipeline); per world size, alpha (s per ring hop) and beta (bytes/s per rank) are the least-squares fit (relative
error, so small and large messages count alike) of comms.py's formulas: (g - 1) alpha + (g - 1) / g x S / beta for
all-gather, reduce-scatter and all-to-all, twice that for all-reduce. And per world size what a collective reached
after compute costs beyond the back-to-back call, after 10 and 40 ms of compute (the ranks arrive apart: step_time
prices it at the layout's compute between its collectives).

Op classes, each timed forward + backward on a rank's threads (here.rank_threads: one for each of several ranks, as
torchrun gives them; every core for a lone process) at the shapes the
planned model uses (micro-batch x sequence tokens; under tp as one tp rank holds them: its share of the
projections' outputs or inputs, of the heads and of the vocabulary; the vocab-parallel loss's own passes over
its logits are step_time's), and read against the same formula the step-time model uses:
    dense_gemm      the block's projections and its dense MLP: 6 T (in x out) FLOPs / time / peak
    grouped_gemm    the MoE expert op (optimus.ops.moe_experts_forward) with random routing, as one ep x tp rank
                    runs it (its E / (ep tp) experts, ep T k / E rows each): 18 T k d fe / tp FLOPs
    attention       causal SDPA: 12 T d S FLOPs (the model's count, masked half included) / time / peak
    loss_head       the fused LM head + cross-entropy (optimus.ops.linear_cross_entropy) on up to 1,024 of the
                    T rows (it works chunk by chunk, so its rate per row does not depend on T): 6 T d V FLOPs
    memory_bound    an RMSNorm, SwiGLU's product and a residual add at (T, d) / (T, f): the bytes
                    step_time.memory_bound_bytes counts for them / time / those threads' copy bandwidth
    buffer_copy     a unit's tensors concatenated into a flat buffer and split back out, as FSDP copies them in
                    and out, and chunk-concatenated into the reduce dtype, as its reduce-scatter copies them in
                    (measure_buffer_copies): bytes / time / those threads' copy bandwidth
    optimizer       the trainer's gradient clipping and AdamW step (fused where torch has the kernel: CPU, CUDA)
                    over OPTIMIZER_ELEMENTS fp32 parameters: step_time.OPTIMIZER_BYTES_PER_ELEMENT a parameter /
                    time / those threads' copy bandwidth (the in-place update beats a copy: above 1 on a CPU)
    op_overhead_us  a chain of tiny autograd ops: time / aten operators dispatched (counted)
    dtensor_overhead_us  the model cut to one block, under tp on a one-rank mesh vs plain, over the DTensor
                    operators it ran (optimus/plan/dtensor_cost.py)
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from optimus.config import Config
from optimus.optim.sharded import DEFAULT_BUCKET_NUMEL
from optimus.parallel.collectives import all_gather_single, reduce_scatter_single
from optimus.parallel.local_ranks import run_on_local_ranks
from optimus.plan.dtensor_cost import measure_dtensor_overhead
from optimus.plan.efficiency import OPTIMIZER_MAX, Efficiency
from optimus.plan.step_time import OPTIMIZER_BYTES_PER_ELEMENT

# up to 64 MiB: the planned messages (a model's embedding, FSDP's root unit) are tens of MiB, past the last-level
# cache, where loopback copies run slower than the in-cache sizes would suggest; and the sharded optimizer's full
# bucket (optim/sharded.py DEFAULT_BUCKET_NUMEL fp32 gradients, 153 MiB), which the zero modes reduce-scatter once a
# step: past 64 MiB gloo's reduce-scatter gains pace (2-core EPYC, 2026-11-29: 0.45 -> 0.60 GB/s on 4 ranks, 0.63 ->
# 0.83 on 3, 0.93 -> 1.10 on 2; all-gather and all-reduce flat), so a table that ended at 64 MiB priced a bucket's
# reduce-scatter 18-36% slow in proportion
COLLECTIVE_BYTES = (4 * 1024, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024, 64 * 1024 * 1024, 4 * DEFAULT_BUCKET_NUMEL)
LARGE_MESSAGE_REPEATS = 3  # each one takes a tenth of a second or more
# calls timed back to back in bursts, and the mean call over the bursts: a training step issues its collectives
# one after another, dozens a step, so it pays their mean, not the fastest single call after a barrier. On the
# 2-core EPYC a call's time has a heavy tail (the ranks' gloo and compute threads share the cores): 40 1 MiB
# all-gathers, each after a matmul, took 0.8-1.4 ms at the median but 1.1-2.0 ms on average; 4 KiB all-reduces
# 0.5-0.9 vs 1.4-1.9 ms; the fastest single call 0.40 and 0.28 ms. A tensor-parallel step's 64 waits for 1 MiB
# all-gathers and reduce-scatters averaged 1.6 ms. The slowest tenth of the bursts is dropped: on a shared host
# another process can stall one.
BURST_CALLS = {1024 * 1024: 8, 8 * 1024 * 1024: 4}  # up to that many bytes: calls per burst; larger: 2
# every job size the tests and the table run: priced from 4 ranks' timings (their collectives and their share of
# the cores), a 3-rank ZeRO-1 job on the 2-core EPYC read 16-17% slow; timed as itself, 5-9% (2026-11-29)
COLLECTIVE_WORLDS = (2, 3, 4)
# groups timed inside a larger job: (members, job ranks, what the other groups do meanwhile). Where ranks outnumber
# cores a pair's collective waits for its peer to get a core back: with every pair in collectives at once (tensor,
# expert or data parallelism of 2 in a 4-rank job without a pipeline: the pairs run in step) a 1 MiB all-gather
# took 1.1-1.8 ms against 1.6 ms as a job of 2, a 4 KiB one 0.5-1.5 against 0.6 ms (two calibrations); with the
# other pair computing (a pipeline's other stage), where a woken rank waits out the busy ranks' time slices,
# 2.1 and 1.1 ms. Priced from the 2-rank job, MoE TP 2 + EP 2 on 4 ranks read 16% fast and HSDP 2 x 2 8% (AVX2-only
# 2-core EPYC, 2026-11-25)
COLLECTIVE_SUBGROUPS = ((2, 4, "collectives"), (2, 4, "compute"))
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
COLLECTIVE_TIMING = ("mean call, freed memory reused; jobs of 2, 3, 4; pairs in 4, beside collectives or compute; "
                     "sync after 10, 40 ms; up to a 153 MiB bucket")  # else re-timed
# A step reaches each collective after compute, and its ranks arrive apart: a loop of {a matmul chunk; a 64 KiB
# all-reduce} took longer than the chunks alone plus the all-reduces back to back (which run in lockstep, as the
# table times them). On the 2-core EPYC (2026-11-28), median over 8 samples: 0.6 ms a call for 2 ranks and 2.8-3.0 ms
# for 4 ranks after 20 ms chunks; for 4 ranks 1.6 ms after 5 ms chunks and 3-6 ms after 40-150 ms ones (time
# slicing lets the ranks drift apart the longer they compute); single samples ranged 0-2.3 and 0.6-5 ms. Timed per
# job size at two chunks (compute between two collectives: 10-40 ms in a tiny model's step of 25-100 of them)
SYNC_CHUNKS = ((0.01, 25), (0.04, 10))  # (chunk seconds, calls a sample)
SYNC_BYTES, SYNC_SAMPLES = 64 * 1024, 8
# the optimizer's state for this many parameters (master, gradient, two moments: 128 MiB in fp32) is far past any
# last-level cache, as a model's is; its rate per byte was flat from 4 to 30 million on a 2-core EPYC
OPTIMIZER_ELEMENTS = 8 * 1024 * 1024
# on an accelerator the optimizer step and the buffer copies are timed over this many times the elements: at HBM's
# terabytes a second the host's elements pass in tens of microseconds, which the kernels' launches would dominate
# (a step updates and copies a model's hundreds of millions of elements, bandwidth bound)
ACCELERATOR_ELEMENTS_SCALE = 16


def burst_calls(nbytes: int) -> int:
    """Calls timed back to back in one burst for a message of `nbytes`."""
    return next((calls for limit, calls in sorted(BURST_CALLS.items()) if nbytes <= limit), 2)


def _time_collectives(rank: int, world: int, sizes: tuple[int, ...], repeats: int, members: int | None = None,
                      others: str = "collectives", done_file: str = "", device_type: str = "cpu",
                      large_bytes: int = 8 * 1024 * 1024) -> list[dict[str, Any]]:
    """(runs on each forked rank) the mean seconds per call of each collective and size over `repeats` bursts of
    back-to-back calls (burst_calls; the slowest tenth of the bursts dropped), the slowest rank's. With `members`,
    over consecutive groups of that many ranks (rows say `ranks`: members, `job`: world, `others`): every group
    at once (`others` "collectives"), or the first group while the others run matmuls until it writes
    `done_file` ("compute"). On `device_type` ranks (one local accelerator each: calibrate_node.py) each burst is
    timed to the end of its work; messages past `large_bytes` take LARGE_MESSAGE_REPEATS bursts at most."""
    import torch.distributed as dist

    from optimus.parallel.launch import device_for
    from optimus.train.host_memory import reuse_freed_host_memory

    # with the allocator a training process has: gloo's reduce-scatter and the all-to-all's input are fresh 64 MiB
    # buffers each call, which plain glibc maps and faults in anew (2-core EPYC, 2026-11-29: a 64 MiB reduce-scatter
    # 81 -> 61-72 ms on 2 ranks, 125 -> 86 ms on 3, an all-to-all 55 -> 35 ms; 8 MiB messages and all-gathers
    # unchanged)
    reuse_freed_host_memory()
    group, g = None, world
    if members is not None and members < world:
        groups = [dist.new_group(list(range(first, first + members))) for first in range(0, world, members)]
        group, g = groups[rank // members], members
        if others == "compute" and rank >= members:
            a, b = torch.randn(256, 256), torch.randn(256, 256)
            while not os.path.exists(done_file):
                a @ b
            return []
    device = device_for(rank, device_type)
    sync = synchronizer(device)
    rows = []
    for op in COLLECTIVES:
        for nbytes in sizes:
            n = max(g, nbytes // 4 // g * g)  # gathered / reduced elements, divisible by the group
            full, part = torch.ones(n, device=device), torch.ones(n // g, device=device)
            run: Callable[[], None] = {
                "all_reduce": lambda: dist.all_reduce(full, group=group),
                "all_gather": lambda: all_gather_single(full, part, group=group),
                "reduce_scatter": lambda: reduce_scatter_single(part, full, group=group),
                "all_to_all": lambda: dist.all_to_all_single(full.clone(), full, group=group),
            }[op]
            run()
            sync()
            calls, times = burst_calls(4 * n), []
            for _ in range(repeats if nbytes <= large_bytes else min(repeats, LARGE_MESSAGE_REPEATS)):
                dist.barrier(group=group)
                sync()
                start = time.perf_counter()
                for _ in range(calls):
                    run()
                sync()
                times.append((time.perf_counter() - start) / calls)
            kept = sorted(times)[:max(1, len(times) - len(times) // 10)]
            slowest = torch.tensor([statistics.fmean(kept)], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            rows.append({"op": op, "ranks": g, "bytes": 4 * n, "seconds": float(slowest)} |
                        ({"job": world, "others": others} if g < world else {}))
    if done_file and rank == 0:
        Path(done_file).touch()
    return rows


def _time_sync_after_compute(rank: int, world: int, samples: int = SYNC_SAMPLES,
                             chunks: tuple[tuple[float, int], ...] = SYNC_CHUNKS) -> list[list[float]]:
    """(runs on each forked rank) what a collective reached after compute costs beyond the same collective back to
    back, for each (chunk seconds, calls) of `chunks`: per sample, `calls` x {matmuls for a chunk of wall time at
    the cores' share; a SYNC_BYTES all-reduce} against the matmuls alone and the all-reduces alone (each phase the
    slowest rank's, ended by a barrier); the median over `samples`. [[chunk seconds, seconds a call], ...]"""
    import torch.distributed as dist

    torch.set_num_threads(1)  # a forked rank: one thread, as torchrun gives each
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    message = torch.ones(SYNC_BYTES // 4)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(10):  # every rank at once: a matmul's wall time at the cores' share, as a step computes
        a @ b
    matmul_s = torch.tensor([(time.perf_counter() - start) / 10], dtype=torch.float64)
    dist.all_reduce(matmul_s, op=dist.ReduceOp.MIN)

    def phase(matmuls: int, calls: int, communicate: bool) -> float:
        dist.barrier()
        begin = time.perf_counter()
        for _ in range(calls):
            for _ in range(matmuls):
                a @ b
            if communicate:
                dist.all_reduce(message)
        dist.barrier()
        slowest = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest)

    out = []
    for chunk_s, calls in chunks:
        matmuls = max(1, round(chunk_s / float(matmul_s)))
        extras = []
        for _ in range(samples):
            alone, back_to_back = phase(matmuls, calls, False), phase(0, calls, True)
            extras.append(max(0.0, (phase(matmuls, calls, True) - alone - back_to_back) / calls))
        out.append([chunk_s, statistics.median(extras)])
    return out


def sustained_matmul_rate(seconds: float, size: int = 256) -> float:
    """fp32 matmul FLOP/s sustained over `seconds` of wall time (not the best single call: under time slicing one
    short call can still run at a whole core's speed)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        calls += 1
    return 2 * size**3 * calls / (time.perf_counter() - start)


def _matmul_rate(rank: int, world: int, seconds: float) -> float:
    """(runs on each forked rank, all at once) this rank's sustained fp32 matmul FLOP/s while the others run too."""
    import torch.distributed as dist

    dist.barrier()
    return sustained_matmul_rate(seconds)


def measure_share(worlds: tuple[int, ...] = COLLECTIVE_WORLDS, seconds: float = 1.0,
                  samples: int = 3) -> dict[str, float]:
    """What fraction of one thread's matmul rate each of R processes gets when all R run at once.

    min(1, cores / R) on an idle machine; less when other work shares the cores. The step-time model divides
    each rank's FLOP/s (and multiplies its operator overhead) by this measured share instead of assuming it.
    Each world is sampled `samples` times and the least disturbed sample counts: one second of a shared host
    read anywhere from 0.5 to 1.0 for 2 ranks on 2 cores, and the measured side (benchmarks/plan_vs_measured.py,
    `optimus tune`) likewise keeps its fastest run.
    """
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(1)
    try:
        alone = sustained_matmul_rate(seconds)
        shares = {}
        for world in worlds:
            best = max(statistics.median(run_on_local_ranks(_matmul_rate, world, seconds, timeout=120.0))
                       for _ in range(samples))
            # never more than the cores allow: a disturbed `alone` sample inflates the ratio (4 ranks on 2 cores
            # read 0.72 once), and more ranks than cores cannot each have a whole one
            shares[str(world)] = min(1.0, cores / world, best / alone)
        alone_again = sustained_matmul_rate(seconds)
    finally:
        torch.set_num_threads(before)
    shares["1"] = min(1.0, alone_again / alone)
    return shares


def fit_alpha_beta(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Least-squares alpha (us) and beta (GB/s) of comms.py's ring model over measured rows (relative error)."""
    design, target = [], []
    for r in rows:
        g, factor = r["ranks"], (2.0 if r["op"] == "all_reduce" else 1.0)
        design.append([factor * (g - 1) / r["seconds"], factor * (g - 1) / g * r["bytes"] / r["seconds"]])
        target.append(1.0)
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.array(design), np.array(target), rcond=None)
    alpha, inv_beta = max(float(alpha), 1e-7), max(float(inv_beta), 1e-13)
    predicted = [(2.0 if r["op"] == "all_reduce" else 1.0) * ((r["ranks"] - 1) * alpha + (r["ranks"] - 1) /
                 r["ranks"] * r["bytes"] * inv_beta) for r in rows]
    worst = max(abs(p - r["seconds"]) / r["seconds"] for p, r in zip(predicted, rows))
    return {"alpha_us": alpha * 1e6, "beta_gb_s": 1e-9 / inv_beta, "worst_relative_error": worst}


def measure_collectives(worlds: tuple[int, ...] = COLLECTIVE_WORLDS, sizes: tuple[int, ...] = COLLECTIVE_BYTES,
                        repeats: int = 16,
                        subgroups: tuple[tuple[int, int, str], ...] = COLLECTIVE_SUBGROUPS,
                        sync_samples: int = SYNC_SAMPLES) -> dict[str, Any]:
    """Time gloo collectives on forked ranks over loopback (whole jobs of each world size, and each (members, job,
    others) of `subgroups`); fit alpha-beta per world size on the whole jobs; and per world size what a collective
    reached after compute costs beyond the table's (`sync_after_compute`: [[chunk seconds, seconds a call], ...])."""
    rows: list[dict[str, Any]] = []
    fits = {}
    for world in worlds:
        measured = run_on_local_ranks(_time_collectives, world, sizes, repeats, timeout=180.0)[0]
        rows += measured
        fits[str(world)] = fit_alpha_beta(measured)
    for members, job, others in subgroups:
        with tempfile.TemporaryDirectory(prefix="optimus-calibrate-") as tmp:
            rows += run_on_local_ranks(_time_collectives, job, sizes, repeats, members, others,
                                       os.path.join(tmp, "done"), timeout=180.0)[0]
    sync = {str(world): run_on_local_ranks(_time_sync_after_compute, world, sync_samples, timeout=300.0)[0]
            for world in worlds}
    return {"rows": rows, "fits": fits, "sync_after_compute": sync, "timing": COLLECTIVE_TIMING}


class CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched while active; with `only` (a tensor subclass, e.g. DTensor) just those
    with an argument of that type."""

    def __init__(self, only: type | None = None) -> None:
        super().__init__()
        self.only, self.count = only, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.only is None or self.only in types
        return func(*args, **(kwargs or {}))


def best_time(fn: Callable[[], None], repeats: int = 2, device: torch.device | None = None) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed call (allocation, first dispatch); on an
    accelerator each timed to the end of its work (the device runs it after the call returns)."""
    sync = synchronizer(device)
    fn()  # warm-up: allocation and first-call dispatch
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def synchronizer(device: torch.device | None) -> Callable[[], None]:
    """What waits for `device`'s queued work (cuda and ROCm, xpu); nothing on the CPU."""
    if device is None or device.type == "cpu":
        return lambda: None
    return getattr(torch, device.type).synchronize


def _forward_backward(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
    return run


def measure_optimizer_step(elements: int = OPTIMIZER_ELEMENTS, device: torch.device | None = None) -> dict[str, float]:
    """Time the trainer's gradient clipping and AdamW step (optim/build.py's kernel choice) on this thread (or
    `device`) over `elements` fp32 parameters in a few tensors; the bytes are what step_time charges for them."""
    from optimus.optim.build import adamw_kernel
    from optimus.train.step import clip_gradients

    params = [torch.nn.Parameter(torch.randn(part, device=device) * 0.02) for part in [elements // 8] * 8]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-4, **adamw_kernel([{"params": params}]))

    def step() -> None:
        clip_gradients(params, 1.0)
        optimizer.step()
    return {"seconds": best_time(step, 3, device),
            "bytes": float(sum(p.numel() for p in params) * OPTIMIZER_BYTES_PER_ELEMENT)}


# calls each compute class is timed over, the fastest counting: on a shared host one slow call of two set a class's
# efficiency (plan_vs_measured's dense PP 2 GPipe row was predicted 1.61 s and 1.87 s twenty minutes apart, its loss
# head timed at 0.79 and 0.70 of peak)
COMPUTE_REPEATS = 4


def measure_op_classes(config: Config, dtype: str, peak_flops: float, copy_bytes_s: float,
                       device: torch.device | None = None, time_dtensor: bool = True) -> dict[str, Any]:
    """Time each op class at `config`'s shapes (on this process's threads, against the peak and copy bandwidth
    they have; or on an accelerator `device`, against its datasheet peak and HBM bandwidth: calibrate_node.py);
    return each class's efficiency and what it timed. `time_dtensor` False: no DTensor overhead (an accelerator's
    host dispatches it ahead of the device: the GPU presets' 0)."""
    from optimus.ops import moe_experts_forward
    from optimus.ops.cross_entropy import linear_cross_entropy

    m, train = config.model, config.train
    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    width = 2 if dtype == "bf16" else 4
    tokens = (train.micro_batch_size or 1) * train.seq_len
    h, kv, f = m.d_model, m.kv_heads * m.head_dim, (m.ffn_hidden or 4 * m.d_model)

    on_host = device is None or device.type == "cpu"

    def tensor(*shape: int, grad: bool = True) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * 0.02).to(dt).requires_grad_(grad)

    def timed(fn: Callable[[], None], repeats: int = COMPUTE_REPEATS) -> float:
        return best_time(fn, repeats, device)

    x = tensor(tokens, h)
    measured: dict[str, Any] = {}
    # dense: the block's projections (q, k, v, o, and the dense MLP's three when there is one) as one tp rank
    # holds them: column-parallel ones (q, k, v, gate, up) a 1/tp share of their outputs, row-parallel ones (o,
    # down) of their inputs, over all the micro-batch's tokens (sequence parallelism gathers them first)
    tp = config.parallel.tp
    shapes = ([(h, -(-h // tp)), (h, -(-kv // tp)), (h, -(-kv // tp)), (-(-h // tp), h)] +
              ([] if m.is_moe else [(h, -(-f // tp)), (h, -(-f // tp)), (-(-f // tp), h)]))
    flops = seconds = 0.0
    for fan_in, fan_out in shapes:
        inp = x if fan_in == h else tensor(tokens, fan_in)
        seconds += timed(_forward_backward(lambda a, w: a @ w, inp, tensor(fan_in, fan_out)))
        flops += 6.0 * tokens * fan_in * fan_out
    measured["dense_gemm"] = {"seconds": seconds, "flops": flops}
    if m.is_moe:
        # as one ep x tp rank computes them: its E / (ep tp) experts, each fed the copies the ep group routes to it
        # (ep T k / E rows), T k / tp copies in all; more rows per expert run faster (a 2-core EPYC's tiny MoE:
        # 49 GFLOP/s over all 16 experts, 59 over the 8 of an ep 2 rank)
        k, fe = m.top_k, m.expert_ffn_hidden
        experts = max(1, m.n_experts // (config.parallel.ep * tp))
        picks = min(k, experts)
        routed = max(1, -(-tokens * k // (tp * picks)))  # tokens whose `picks` copies make this rank's T k / tp
        ids = torch.stack([torch.randperm(experts)[:picks] for _ in range(routed)]).to(device)
        weights = torch.softmax(torch.randn(routed, picks, device=device), dim=-1).to(dt)
        run = _forward_backward(lambda a, wgu, wd: moe_experts_forward(a, ids, weights, wgu, wd), tensor(routed, h),
                                tensor(experts, h, 2 * fe), tensor(experts, fe, h))
        measured["grouped_gemm"] = {"seconds": timed(run), "flops": 18.0 * routed * picks * h * fe,
                                    "experts": experts}
    heads, seq = max(1, m.n_heads // tp), train.seq_len  # a tp rank's heads
    batch = max(1, tokens // seq)
    q = tensor(batch, heads, seq, m.head_dim)
    kk, vv = tensor(batch, heads, seq, m.head_dim), tensor(batch, heads, seq, m.head_dim)
    run = _forward_backward(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, kk, vv)
    measured["attention"] = {"seconds": timed(run),
                             "flops": 12.0 * tokens * heads * m.head_dim * seq}
    # memory bound: a norm, a SwiGLU product, a residual add, and the loss's fp32 softmax over the vocabulary
    from optimus.models.layers import RMSNorm

    norm = RMSNorm(h).to(device=device, dtype=dt)
    gate, up, res = tensor(tokens, f), tensor(tokens, f), tensor(tokens, h)
    block = _forward_backward(lambda a, g, u, r: norm(a).sum() + (F.silu(g) * u).sum() + (a + r).sum(), x, gate, up, res)
    # tens of milliseconds: more repeats, or one slow call (another process on the core) sets the efficiency
    measured["memory_bound"] = {"seconds": timed(block, 6), "bytes": tokens * (2 * h + 3 * f + 3 * h) * width * 3}
    # the loss head over a tp rank's share of the vocabulary (optimus/parallel/vocab_parallel.py): the CPU's chunked
    # kernel keeps one rate per row past a chunk; an accelerator's plain path (ops/cross_entropy.py) runs all rows
    rows, vocab = (min(tokens, 1024) if on_host else tokens), -(-m.vocab_size // tp)
    labels = torch.randint(0, vocab, (rows,), device=device)
    run = _forward_backward(lambda a, w: linear_cross_entropy(a, w, labels), tensor(rows, h), tensor(vocab, h))
    measured["loss_head"] = {"seconds": timed(run), "flops": 6.0 * rows * h * vocab}
    scale = 1 if on_host else ACCELERATOR_ELEMENTS_SCALE
    measured["optimizer"] = measure_optimizer_step(OPTIMIZER_ELEMENTS * scale, device)
    measured["buffer_copy"] = measure_buffer_copies(
        dt, torch.bfloat16 if config.parallel.grad_reduce_dtype == "bf16" else torch.float32, device, scale)
    # fixed cost per operator: a chain of tiny autograd ops, timed and counted
    tiny = torch.ones(8, requires_grad=True, device=device)

    def chain() -> None:
        y = tiny
        for _ in range(100):
            y = y * 1.0001 + 0.0
        y.sum().backward()

    with CountOps() as counter:
        chain()
    measured["op_overhead"] = {"seconds": timed(chain, 5), "operators": counter.count}
    # what tp's DTensors add per operator: one block under tp on a one-rank mesh vs plain (a forked rank)
    measured["dtensor_overhead"] = (measure_dtensor_overhead(config, dtype) if time_dtensor else
                                    {"us_per_operator": 0.0, "not timed": "the host dispatches ahead of the device"})

    def rate(name: str) -> float:
        return min(1.0, measured[name]["flops"] / measured[name]["seconds"] / peak_flops)

    efficiency = Efficiency(
        dense_gemm=rate("dense_gemm"), grouped_gemm=rate("grouped_gemm") if m.is_moe else rate("dense_gemm"),
        attention=rate("attention"), loss_head=rate("loss_head"),
        memory_bound=min(1.0, measured["memory_bound"]["bytes"] / measured["memory_bound"]["seconds"] / copy_bytes_s),
        optimizer=min(OPTIMIZER_MAX, measured["optimizer"]["bytes"] / measured["optimizer"]["seconds"] / copy_bytes_s),
        buffer_copy=min(OPTIMIZER_MAX,
                        measured["buffer_copy"]["bytes"] / measured["buffer_copy"]["seconds"] / copy_bytes_s),
        op_overhead_us=1e6 * measured["op_overhead"]["seconds"] / measured["op_overhead"]["operators"],
        dtensor_overhead_us=measured["dtensor_overhead"]["us_per_operator"])
    return {"efficiency": efficiency.to_dict(), "timed": measured}


BUFFER_COPY_ELEMENTS = (8 * 1024 * 1024, 4 * 1024 * 1024, 2 * 1024 * 1024, 1024 * 1024, 1024 * 1024)


def measure_buffer_copies(dtype: torch.dtype, reduce_dtype: torch.dtype, device: torch.device | None = None,
                          scale: int = 1) -> dict[str, float]:
    """Data parallelism's copies as FSDP makes them (optim/sharded.py's packing is the same kind), over 16 M elements
    (times `scale`) in `dtype` (past the last-level cache, as a model's larger units are): a unit's tensors
    concatenated into one flat buffer and split back out (its all-gather's copy-in and copy-out: torch.cat,
    torch.split_with_sizes_copy), and chunk-concatenated into a `reduce_dtype` buffer (its reduce-scatter's
    copy-in: torch._chunk_cat, which casts slower than a plain copy does: 0.56 of a copy's bandwidth from fp32 to
    bf16 on a 2-core EPYC, 0.94 without the cast); a read and a write per element each."""
    sizes = [n * scale for n in BUFFER_COPY_ELEMENTS]
    tensors = [torch.randn(n, device=device).to(dtype) for n in sizes]
    elements = sum(sizes)
    flat = torch.empty(elements, dtype=dtype, device=device)
    reduce_input = torch.empty(2, elements // 2, dtype=reduce_dtype, device=device)
    back = [torch.empty_like(t) for t in tensors]

    def copies() -> None:
        torch.cat(tensors, out=flat)
        torch.split_with_sizes_copy(flat, sizes, out=back)
        torch._chunk_cat(tensors, 0, 2, out=reduce_input)
    width, reduce_width = flat.element_size(), reduce_input.element_size()
    return {"seconds": best_time(copies, COMPUTE_REPEATS, device),
            "bytes": elements * (4 * width + width + reduce_width)}


def calibrate_op_classes(config: Config, entry: dict[str, Any], threads: int = 1) -> dict[str, Any]:
    """Measure the op classes for `config` on `threads` threads (a rank's, here.rank_threads) against this host's
    machine entry (see here.machine); returns {"efficiency", "timed", "calibrated_threads", "machine" (the
    entry's, with the peak raised when a fresh probe beats it)}. The efficiencies are fractions of the rates
    here.here_cluster gives a rank of that many threads (here.thread_rate, here.thread_bandwidth)."""
    from optimus.plan.here import rate_probe, thread_bandwidth, thread_rate
    from optimus.train.hardware import best_matmul_rate
    from optimus.train.host_memory import reuse_freed_host_memory

    reuse_freed_host_memory()  # time the ops with the allocator a training process has
    m = dict(entry["machine"])
    dtype = m["auto_dtype"] if config.train.dtype == "auto" else config.train.dtype
    threads = max(1, min(threads, m["cores"]))
    key, probed_on = rate_probe(m, dtype, threads)  # the probe a rank of this many threads is priced from
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # the peak again, beside the op classes (one probed while the cores were busier would read them above 1),
        # where this many threads is what that probe ran on
        if (dtype == "fp32" or m["bf16_flops_per_thread"] >= m["fp32_flops_per_thread"]) and threads == probed_on:
            m[key] = max(m[key], best_matmul_rate(torch.float32 if dtype == "fp32" else torch.bfloat16, 1024, 0.3))
        measured = measure_op_classes(config, dtype, thread_rate(m, dtype, threads), thread_bandwidth(m, threads))
        return {**measured, "calibrated_threads": threads, "machine": m}
    finally:
        torch.set_num_threads(before)


def describe(entry: dict[str, Any]) -> list[str]:
    """What was measured, as lines to print."""
    from optimus.plan.here import threads_phrase

    m = entry["machine"]
    load = m.get("load_at_measure")
    lines = [f"here: {m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 1024**3:.1f} GiB, measured {m['measured_at']}"
             + (f" at load {load:.1f}" if load is not None else ""),
             f"  matmul peak per thread: fp32 {m['fp32_flops_per_thread'] / 1e9:.1f} GFLOP/s, "
             f"bf16 {m['bf16_flops_per_thread'] / 1e9:.1f} GFLOP/s (train.dtype auto -> {m['auto_dtype']})",
             f"  copy bandwidth: {m['copy_gb_s_one_thread']:.1f} GB/s one thread, {m['copy_gb_s_all_cores']:.1f} GB/s all cores"]
    if "fp32_flops_all_cores" in m:
        lines.insert(2, f"  matmul peak, all {m['cores']} cores: fp32 {m['fp32_flops_all_cores'] / 1e9:.1f} GFLOP/s, "
                        f"bf16 {m['bf16_flops_all_cores'] / 1e9:.1f} GFLOP/s")
    for world, fit in sorted(m["collectives"]["fits"].items()):
        lines.append(f"  gloo loopback, {world} ranks: alpha {fit['alpha_us']:.0f} us, beta {fit['beta_gb_s']:.2f} GB/s "
                     f"(worst fit error {fit['worst_relative_error']:.0%})")
    for world, points in sorted(m["collectives"].get("sync_after_compute", {}).items()):
        after = ", ".join(f"{extra * 1e3:.2f} ms after {chunk * 1e3:.0f} ms" for chunk, extra in points)
        lines.append(f"  a collective reached after compute, {world} ranks: {after} of compute, beyond the table")
    if "efficiency" in entry:
        e, timed = entry["efficiency"], entry.get("timed", {})
        threads = entry.get("calibrated_threads", 1)
        lines.append(f"  op classes at {entry.get('calibrated_for', '?')} ({threads_phrase(threads)}):")
        for name in ("dense_gemm", "grouped_gemm", "attention", "loss_head", "memory_bound", "optimizer",
                     "buffer_copy"):
            took = timed.get(name, {}).get("seconds")
            if name not in e:  # a calibration from before the optimizer step was timed
                continue
            bandwidth_bound = name in ("memory_bound", "optimizer", "buffer_copy")
            of = f"of the copy bandwidth on {threads_phrase(threads)}" if bandwidth_bound else "of peak"
            lines.append(f"    {name:<13} {e[name]:.2f} {of}" + (f" ({took * 1e3:.1f} ms timed)" if took else
                                                                 " (no experts: as dense_gemm)"))
        lines.append(f"    op_overhead   {e['op_overhead_us']:.1f} us per operator")
        lines.append(f"    dtensor       {e.get('dtensor_overhead_us', 0.0):.1f} us more per DTensor operator (under tp)")
    return lines
