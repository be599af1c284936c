"""The `here` cluster: this machine, measured rather than read from a datasheet.

What is measured (once, then cached per host in a JSON file whose path the CLI passes in):
    matmul peak per dtype   optimus/train/hardware.py's probe with one thread (what torchrun gives each of several
                            ranks) and with all cores (what a lone `optimus train` process runs)
    memory bandwidth        a large tensor copy, one thread and all cores
    memory                  the OS's physical memory (sysconf), shared by the ranks
    fresh pages             writing a new 64 MiB tensor vs writing a reused one, with the allocator a training
                            process has: the trainer keeps freed blocks for reuse (train/host_memory.py), so
                            on glibc this is about 0; where it cannot (other C libraries), a block past the
                            mmap threshold comes from fresh kernel pages every step
    collectives             gloo over loopback: 2, 3 and 4 forked ranks, and the pairs of 4 ranks (both at once, and
                            one while the other computes); the mean time per call over bursts of back-to-back
                            calls (what a step pays): a table, and alpha (per hop) and beta (per rank) fitted by
                            least squares to comms.py's ring formulas (optimus/plan/calibrate_collectives.py)
    op-class efficiencies   only after `optimus plan --calibrate` (else the CPU defaults below)
    host load               the one-minute load average as the measuring began: a plan from timings taken while
                            other tasks filled the cores says so (busy_note) and asks for a calibration when quiet

Ranks share the host: R ranks each get a share of a core's FLOP/s, measured by running R matmul processes at
once (min(1, C / R) on an idle C-core machine; less when others use the cores), the smaller of a core's copy
bandwidth x that share (a rank runs one thread) and the socket's bandwidth / R (for the elementwise work and
the optimizer update, which the rank's cores bound, the first alone: Cluster.core_bandwidth_gb_s), 1 / share
times the fixed operator cost and the fresh pages' cost, and 1 / R of the memory. A rank runs `rank_threads`
intra-op threads: one for each of several (torchrun's OMP_NUM_THREADS=1), every core for a lone process (torch's
default; `make train`'s job), OMP_NUM_THREADS where it is set. A rank of T > 1 threads gets the all-cores matmul rate's
per-thread share times T and T threads' copy bandwidth (a lone 2-thread rank priced as one thread read the
default job's step 1.76 s; it ran 1.13 s).
All of a job's ranks are on this one node, so every collective runs on the measured loopback link. When the
ranks occupy every core, nothing overlaps: gloo moves the bytes on the cores the ranks compute on (FSDP's
prefetched all-gathers were measured waiting in full, benchmarks/plan_vs_measured.py).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from optimus.config import ConfigError
from optimus.plan.cluster import Cluster
from optimus.plan.efficiency import Efficiency
from optimus.train.hardware import cpu_model, cpu_speed, write_json_cache
from optimus.train.host_memory import reuse_freed_host_memory

# Without --calibrate: reasoning, not measurement. Eager PyTorch on a CPU reaches most of a core's GEMM rate on
# model-sized matmuls, less on the per-expert loop and on SDPA's blocked kernel; elementwise kernels stream at
# about half of a copy's bandwidth; an eager aten call costs ~10 us of dispatch on a current x86 core, one on a
# DTensor ~100 us more (measured 80-200 us on a 2-core EPYC); the fused in-place AdamW update with its clipping
# streams at about twice a copy's bandwidth (2.1-2.4 measured on a 2-core EPYC); data parallelism's flat-buffer
# copies at a copy's (0.94-1.06 on it).
CPU_DEFAULT_EFFICIENCY = Efficiency(dense_gemm=0.8, grouped_gemm=0.5, attention=0.4, memory_bound=0.5,
                                    op_overhead_us=10.0, dtensor_overhead_us=100.0, optimizer=2.0, buffer_copy=1.0)
CPU_NODE_POWER_KW = 0.15  # estimate: a server CPU socket with its memory; nothing here is metered
COPY_ELEMENTS = 16 * 1024 * 1024  # 64 MiB of fp32: far larger than any last-level cache
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts: however its dynamic mmap threshold moves, a block this large
# or larger is mapped fresh from the kernel and unmapped on free unless the thresholds are fixed (a fresh 33 MiB
# tensor filled at 2 GB/s on a 2-core EPYC, a reused one at 30 GB/s): FSDP's buffers this large pay the measured
# fresh-page cost (about 0 with the trainer's reuse)
HOST_MEMORY = "freed blocks under 1 GiB reused"  # how the trainer's allocator ran when fresh pages were timed
FRESH_BLOCK_BYTES = 32 * 1024 * 1024


def host_key() -> str:
    """What a cached measurement is valid for: this host, its CPU, this torch."""
    return "|".join([socket.gethostname(), cpu_model(), torch.__version__])


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def host_load() -> float | None:
    """The host's one-minute load average (runnable tasks, ours included), None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_note(load: float | None, n_cores: int, when: str) -> str | None:
    """A line saying timings taken `when` the host ran at `load` read slow, or None while it was quiet: other
    tasks that alone fill the cores slow every probe (a table timed under load 3-5 on 2 cores priced gloo
    collectives 2-5x slow and two layouts 15-17% high, BENCHMARKS.md stop 35)."""
    if load is None or load < n_cores:
        return None
    return (f"here: the host was busy {when} (load {load:.1f} on {n_cores} cores): its timings read slow and every "
            "plan here inherits them; run `optimus plan CONFIG --cluster here --devices N --calibrate` again on a "
            "quiet host")


def rank_threads(ranks: int, environ: dict[str, str] | None = None) -> int:
    """Intra-op threads each rank of a `ranks`-process job here runs: OMP_NUM_THREADS where it is set (torch reads
    it), else every core for a lone process (torch's default) and one for each of several (torchrun sets
    OMP_NUM_THREADS=1 when it starts more than one). Of a comma list (one count per nesting level) the first is
    what torch's intra-op pool runs; a value OpenMP would not take counts as unset (the CLI refuses it first)."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if re.fullmatch(r"\+?[0-9]+", value) and int(value) > 0:
        return int(value)
    return cores() if ranks == 1 else 1


def threads_phrase(n: int) -> str:
    """"1 thread" or "N threads", as the planner's messages name a rank's threads."""
    return "1 thread" if n == 1 else f"{n} threads"


def rate_probe(m: dict[str, Any], dtype: str, threads: int) -> tuple[str, int]:
    """(the key of the machine entry `m`'s matmul probe that prices a rank of `threads` threads, the threads that
    probe ran on): one thread's, or the all-cores one where the rank has more and the entry holds it."""
    prefix = "fp32" if dtype == "fp32" else "bf16"
    if min(threads, m["cores"]) <= 1 or f"{prefix}_flops_all_cores" not in m:
        return f"{prefix}_flops_per_thread", 1
    return f"{prefix}_flops_all_cores", m["cores"]


def thread_rate(m: dict[str, Any], dtype: str, threads: int) -> float:
    """A rank's matmul FLOP/s with `threads` threads alone on the machine entry `m`'s cores: its probe's rate per
    thread times the threads (no more than the cores)."""
    key, probed_on = rate_probe(m, dtype, threads)
    return m[key] / probed_on * max(1, min(threads, m["cores"]))


def thread_bandwidth(m: dict[str, Any], threads: int) -> float:
    """Copy bytes/s of one rank's `threads` threads alone: one thread's times the threads, at most the socket's."""
    return min(m["copy_gb_s_one_thread"] * max(1, threads), m["copy_gb_s_all_cores"]) * 1e9


def physical_memory_bytes() -> int:
    """Physical memory of the host (the OS's figure)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def copy_bandwidth(threads: int, repeats: int = 5) -> float:
    """Best bytes/s of a large tensor copy (a read and a write per element) with `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src, dst = torch.randn(COPY_ELEMENTS), torch.empty(COPY_ELEMENTS)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        return 2 * 4 * COPY_ELEMENTS / best
    finally:
        torch.set_num_threads(before)


def fresh_page_cost(repeats: int = 5) -> float:
    """Seconds per byte that writing a freshly allocated COPY_ELEMENTS tensor takes beyond writing a reused one
    (one thread; best of `repeats` each): the kernel's page faults and zeroing, 0 where the allocator reuses."""
    from optimus.plan.timing import best_time

    reuse_freed_host_memory()  # the allocator a training process has (train/host_memory.py)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reused = torch.empty(COPY_ELEMENTS)
        # as in a step's steady state: a heap that keeps freed blocks has held one this size before
        best_time(lambda: torch.empty(COPY_ELEMENTS).fill_(1.0), repeats)
        extra = (best_time(lambda: torch.empty(COPY_ELEMENTS).fill_(1.0), repeats) -
                 best_time(lambda: reused.fill_(1.0), repeats))
        return max(0.0, extra) / (4 * COPY_ELEMENTS)
    finally:
        torch.set_num_threads(before)


def read_cache(path: Path) -> dict[str, Any]:
    """This host's entry of the cache file ({} when absent or unreadable)."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entry = cache.get(host_key()) if isinstance(cache, dict) else None
    return entry if isinstance(entry, dict) else {}


def write_cache(path: Path, entry: dict[str, Any]) -> None:
    """Replace this host's entry, keeping other hosts' (atomic rename; a read-only home only costs re-measuring)."""
    try:
        cache = json.loads(path.read_text()) if path.is_file() else {}
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        cache = {}
    cache[host_key()] = entry
    write_json_cache(path, cache)


def measure_machine(cpu_cache: tuple[Path | None, str] = (None, "")) -> dict[str, Any]:
    """Peaks (one thread), bandwidth, memory, the cores' share and the gloo collectives of this machine (a minute or
    two on 2 cores, most of it the collectives of each job size)."""
    from optimus.plan.calibrate_collectives import measure_collectives, measure_share
    from optimus.train.precision import choose_precision

    load = host_load()  # before our own probes add to it
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        speed = cpu_speed(cpu_cache[0], cpu_cache[1])
    finally:
        torch.set_num_threads(before)
    auto = choose_precision("auto", torch.device("cpu"), speed).dtype
    return {"cpu": cpu_model(), "cores": cores(), "memory_bytes": physical_memory_bytes(),
            "fp32_flops_per_thread": speed.fp32_flops, "bf16_flops_per_thread": speed.bf16_flops,
            **all_cores_rates(cpu_cache),
            "auto_dtype": auto, "copy_gb_s_one_thread": copy_bandwidth(1) / 1e9,
            "copy_gb_s_all_cores": copy_bandwidth(cores()) / 1e9, "fresh_page_s_per_byte": fresh_page_cost(),
            "host_memory": HOST_MEMORY,
            "collectives": measure_collectives(), "share": measure_share(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_at_measure": load}


def all_cores_rates(cpu_cache: tuple[Path | None, str] = (None, "")) -> dict[str, float]:
    """The matmul probe with every core's thread (what a lone training process runs), per dtype."""
    before = torch.get_num_threads()
    torch.set_num_threads(cores())
    try:
        speed = cpu_speed(cpu_cache[0], cpu_cache[1])
    finally:
        torch.set_num_threads(before)
    return {"fp32_flops_all_cores": speed.fp32_flops, "bf16_flops_all_cores": speed.bf16_flops}


def machine(cache_file: Path, cpu_cache: tuple[Path | None, str] = (None, ""), remeasure: bool = False) -> dict[str, Any]:
    """This host's cached entry, measuring the machine first when it has never been (or `remeasure`)."""
    entry = read_cache(cache_file)
    if remeasure or "machine" not in entry:
        entry["machine"] = measure_machine(cpu_cache)
        write_cache(cache_file, entry)
    else:  # a cache from before a measurement was added or changed: take that one again
        from optimus.plan.calibrate_collectives import (COLLECTIVE_TIMING, COLLECTIVE_WORLDS, measure_collectives,
                                                        measure_share)

        measured, updated = entry["machine"], False
        if measured.get("host_memory") != HOST_MEMORY:  # fresh pages timed before the trainer reused freed memory
            measured["fresh_page_s_per_byte"], measured["host_memory"], updated = fresh_page_cost(), HOST_MEMORY, True
        if "fp32_flops_all_cores" not in measured:  # probed with one thread only: a lone rank runs every core
            measured.update(all_cores_rates(cpu_cache))
            updated = True
        if measured["collectives"].get("timing") != COLLECTIVE_TIMING:  # timed otherwise, or fewer groups: re-time
            print("here: timing the gloo collectives again as a step pays them (the cached table predates it; "
                  "a minute or two, once)", file=sys.stderr, flush=True)
            measured["collectives"], updated = measure_collectives(), True
        shares = measured.get("share")
        if shares and any(str(world) not in shares for world in COLLECTIVE_WORLDS):  # fewer job sizes timed
            measured["share"], updated = measure_share(), True
        if updated:
            write_cache(cache_file, entry)
    return entry


def _nearest_job(sizes: Iterable[int | str], ranks: int) -> int:
    """Of the job sizes timed (ints or their strings), the one nearest `ranks` (the larger on a tie)."""
    return min(map(int, sizes), key=lambda g: (abs(g - ranks), -g))


def _nearest_fit(collectives: dict[str, Any], ranks: int) -> dict[str, float]:
    return collectives["fits"][str(_nearest_job(collectives["fits"], ranks))]


def _nearest_sync(collectives: dict[str, Any], ranks: int) -> tuple[tuple[float, float], ...]:
    """What a collective reached after compute adds, timed in the job size nearest `ranks` (none: a cache timed
    before it was)."""
    sync = collectives.get("sync_after_compute", {})
    return tuple(tuple(point) for point in sync[str(_nearest_job(sync, ranks))]) if sync else ()


def collective_table(collectives: dict[str, Any]) -> dict[str, dict[tuple[int, int, bool], list]]:
    """The timed gloo collectives as comms.py reads them: {op: {(members, job ranks, whether the job's other ranks
    computed meanwhile): [[bytes, seconds], ...]}}; a whole job of R ranks is (R, R, False)."""
    table: dict[str, dict[tuple[int, int, bool], list]] = {}
    for row in collectives.get("rows", []):
        group = (row["ranks"], row.get("job", row["ranks"]), row.get("others") == "compute")
        table.setdefault(row["op"], {}).setdefault(group, []).append([row["bytes"], row["seconds"]])
    return table


def here_cluster(entry: dict[str, Any], ranks: int, threads: int = 1) -> Cluster:
    """The `here` cluster for a job of `ranks` processes of `threads` intra-op threads each on this host, from a
    cache entry (see `machine`; `rank_threads` says how many a job gets)."""
    if ranks < 1:
        raise ConfigError(f"--devices {ranks}: a job here needs at least one rank")
    m = entry["machine"]
    threads = max(1, min(threads, m["cores"]))  # threads past the cores add no FLOP/s
    idle_share = min(1.0, m["cores"] / (ranks * threads))  # of each of a rank's threads' cores, on an idle machine
    share = idle_share
    measured = m.get("share", {})
    if ranks > 1 and threads == 1 and measured:  # as measured: R one-thread matmul processes at once, others' load in
        nearest = _nearest_job((g for g in measured if int(g) > 1), ranks)
        # a job size not timed (past 4 ranks) gets the nearest one's cores spread over its own ranks, at most each
        # one's idle share (3 ranks on 2 cores, before 3 were timed: 4 ranks' share alone priced them 30% slow)
        share = min(idle_share, measured[str(nearest)] * nearest / ranks)  # (a measured share is capped so already)
    # a rank's threads stream no faster than they do alone (a lone one-thread rank read the all-core bandwidth
    # before: its fused optimizer step was priced at 73 GB/s and ran at 38), nor faster than its part of the socket;
    # its elementwise work and optimizer update run on its share of its cores alone, not its part of the socket
    core_bandwidth = thread_bandwidth(m, threads) / 1e9 * share
    bandwidth = min(core_bandwidth, m["copy_gb_s_all_cores"] / ranks)
    fit = _nearest_fit(m["collectives"], ranks)
    calibrated = entry.get("efficiency")
    # a calibration from before DTensor dispatch, the optimizer step or the buffer copies were measured keeps the
    # CPU default for it
    defaults = {"dtensor_overhead_us": CPU_DEFAULT_EFFICIENCY.dtensor_overhead_us,
                "optimizer": CPU_DEFAULT_EFFICIENCY.optimizer, "buffer_copy": CPU_DEFAULT_EFFICIENCY.buffer_copy}
    efficiency = (Efficiency.from_dict({**defaults, **calibrated},
                                       "the `here` calibration cache") if calibrated else CPU_DEFAULT_EFFICIENCY)
    efficiency = replace(efficiency, op_overhead_us=efficiency.op_overhead_us / share,
                         dtensor_overhead_us=efficiency.dtensor_overhead_us / share)
    link_gb_s, link_us = fit["beta_gb_s"], fit["alpha_us"]
    return Cluster(name="here", device=m["cpu"], devices_per_node=ranks, memory_gb=m["memory_bytes"] / ranks / 1024**3,
                   hbm_gb_s=bandwidth, intra_node_gb_s=link_gb_s, intra_node_latency_us=link_us,
                   inter_node_gb_s=link_gb_s * ranks, inter_node_latency_us=link_us,
                   node_power_kw=CPU_NODE_POWER_KW, pue=1.0, grid_kgco2_per_kwh=0.385, efficiency=efficiency,
                   auto_dtype=m["auto_dtype"], comm_overlaps_compute=ranks * threads < m["cores"],
                   measured_collectives=collective_table(m["collectives"]),
                   core_share=idle_share, host_cpu=True,
                   collective_sync=_nearest_sync(m["collectives"], ranks) if ranks > 1 else (),
                   # the kernel faults the pages in on the rank's own share of a core
                   fresh_page_s_per_byte=m.get("fresh_page_s_per_byte", 0.0) / share,
                   fresh_block_bytes=FRESH_BLOCK_BYTES,
                   core_bandwidth_gb_s=core_bandwidth,
                   measured_peak_flops={"fp32": thread_rate(m, "fp32", threads) * share,
                                        "bf16": thread_rate(m, "bf16", threads) * share})
