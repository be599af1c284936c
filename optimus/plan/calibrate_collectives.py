"""Collectives for `optimus plan --calibrate` (calibrate.py times the op classes): what the step-time model's
alpha-beta terms and its table of timed collectives are fitted to.

Collectives: gloo all_reduce, all_gather, reduce_scatter and all_to_all of 4 KiB to 153 MiB (the sharded optimizer's
bucket) over 2, 3 and 4 forked ranks on loopback, each the mean time per call over bursts of back-to-back calls (as a
step issues them), and over the pairs of a 4-rank job, both pairs at once and one pair while the other computes (what
tensor, expert and data parallelism of 2 within 4 ranks pay when the 4 share fewer cores, without and with a
pipeline); per world size, alpha (s per ring hop) and beta (bytes/s per rank) are the least-squares fit (relative
error, so small and large messages count alike) of comms.py's formulas: (g - 1) alpha + (g - 1) / g x S / beta for
all-gather, reduce-scatter and all-to-all, twice that for all-reduce. And per world size what a collective reached
after compute costs beyond the back-to-back call, after 10 and 40 ms of compute (the ranks arrive apart: step_time
prices it at the layout's compute between its collectives).
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

from optimus.optim.sharded import DEFAULT_BUCKET_NUMEL
from optimus.parallel.collectives import all_gather_single, reduce_scatter_single
from optimus.parallel.local_ranks import run_on_local_ranks
from optimus.plan.timing import synchronizer

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
