"""`optimus plan CONFIG --calibrate --cluster NAME` on a node of NAME's accelerators: the node's own efficiencies and
intra-node link, measured and written as a cluster file that `--cluster FILE` plans with.

A preset's efficiencies come from profiled steps on one machine under one torch version (its YAML says which); a
node with another software stack, clock or power cap reaches its own. Timed here, on the node's devices:
    op classes     calibrate.measure_op_classes at the planned model's shapes on device 0, each as a fraction of
                   the cluster's peak FLOP/s (the datasheet's, or its file's peak_tflops) or of its HBM bandwidth,
                   on the same counts step_time charges, each by its kernels' time (timing.kernel_time, as the
                   presets were read off profiled steps: the host's dispatch is op_overhead's)
    memory_bound   the norm, SwiGLU and residual block compiled (fused kernels: the count memory_bound is read on)
                   and eager: eager_memory_traffic is the eager time over the compiled (1 where torch.compile cannot
                   build here, memory_bound then being the eager block's)
    by_rows        the compute classes again at TABLE_MICRO_BATCHES micro-batches of the config's sequences, each
                   point at the rows its calls run (efficiency.call_rows): the planner prices each layout at its
                   own (one H200: Mula-7B-A1B's projections 0.60 / 0.69 / 0.73 of peak at 1 / 4 / 8 x 2,048
                   tokens, its experts 0.28 / 0.48 / 0.54); a micro-batch the device has no memory for ends the table
    op_overhead    a chain of tiny autograd operators, timed to the device's end: the host's time per operator,
                   what a run of small kernels leaves the device idle for
    intra-node     NCCL/RCCL (XCCL) all-reduce, all-gather, reduce-scatter and all-to-all over the node's devices
                   (up to devices_per_node), 64 KiB to 256 MiB, fitted to comms.py's ring
                   (calibrate_collectives.fit_alpha_beta): intra_node_latency_us and intra_node_gb_s; a node of one
                   device keeps the cluster's
    memory_gb      what the device reports (an "80 GB" H100 holds 79.2 GiB)
The rest (devices per node, network, power, PUE, carbon) is the cluster's as given. Every device is used by forked
children (optimus/parallel/local_ranks.py): this process opens no device context.
"""

from __future__ import annotations

import datetime
import platform
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from optimus.atomic_write import write_text_whole
from optimus.config import Config, ConfigError
from optimus.parallel.data_parallel import TORCH_DTYPES
from optimus.parallel.local_ranks import run_on_local_ranks
from optimus.plan.calibrate import (compute_class_rates, measure_op_classes, memory_bound_block,
                                    memory_bound_call)
from optimus.plan.calibrate_collectives import COLLECTIVES, _time_collectives, fit_alpha_beta
from optimus.plan.cluster import Cluster
from optimus.plan.efficiency import ROW_CLASSES, Efficiency, call_rows
from optimus.plan.timing import device_seconds
from optimus.train.hardware import LocalAccelerators

# NCCL switches from its latency-bound to its bandwidth-bound algorithms between these; the largest is a
# data-parallel bucket of a large model's gradients
NODE_COLLECTIVE_BYTES = (64 * 1024, 1024 * 1024, 16 * 1024 * 1024, 256 * 1024 * 1024)
NODE_COLLECTIVE_REPEATS = 10
MATMUL_SIZE = 8192  # a square bf16 product this size reaches a GPU's sustained matmul rate
# the micro-batches (x the config's sequence) the compute classes are tabulated at: the search's usual range
TABLE_MICRO_BATCHES = (1, 2, 4, 8)


def check_devices(cluster: Cluster, found: LocalAccelerators | None, name: str) -> None:
    """ConfigError (one line) unless this machine's accelerators are the cluster's devices."""
    if found is None:
        raise ConfigError(f"--calibrate --cluster {name} measures this node's {cluster.device} devices, but torch sees "
                          "no GPU or XPU here: run it on such a node, or give --cluster here to calibrate this CPU")
    if cluster.device not in found.name:
        raise ConfigError(f"--calibrate --cluster {name} measures {cluster.device} devices, but this node has "
                          f"{found.count} {found.name}: give the cluster of these devices (a preset whose device is "
                          f"in that name, or a file with `device:` and `peak_tflops:`)")


def _device_op_classes(rank: int, world: int, device_type: str, config: Config, dtype: str, peak_flops: float,
                       hbm_bytes_s: float, compile_block: bool, matmul_size: int,
                       micro_batches: tuple[int, ...]) -> dict[str, Any]:
    """(a forked rank on device 0) the op classes, their rates by rows, the compiled memory-bound block and the
    largest matmul's rate."""
    from optimus.parallel.launch import device_for
    from optimus.train.hardware import best_matmul_rate

    device = device_for(rank, device_type)
    measured = measure_op_classes(config, dtype, peak_flops, hbm_bytes_s, device, time_dtensor=False)
    measured["efficiency"]["by_rows"] = rates_by_rows(config, dtype, peak_flops, device, micro_batches,
                                                      measured["efficiency"])
    dt = TORCH_DTYPES[dtype]
    measured["timed"]["matmul"] = {"flops_s": best_matmul_rate(dt, matmul_size, 1.0, device), "size": matmul_size}
    measured["timed"]["memory_bound_compiled"] = _compiled_block(config, dt, device) if compile_block else {
        "not timed": "compile_block off"}
    return measured


def rates_by_rows(config: Config, dtype: str, peak_flops: float, device: torch.device,
                  micro_batches: tuple[int, ...], at_config: dict[str, float]) -> dict[str, dict[float, float]]:
    """The compute classes' rates at each of `micro_batches` x the config's sequence, as {class: {rows: fraction}}
    (efficiency.call_rows' rows at the config's ep); the config's own micro-batch takes `at_config`'s rates (the
    efficiency block's). Stops at the first micro-batch the device has no memory for."""
    m = config.model
    own = config.train.micro_batch_size or 1
    table: dict[str, dict[float, float]] = {name: {} for name in ROW_CLASSES if name != "grouped_gemm" or m.is_moe}
    for micro_batch in sorted(set(micro_batches) | {own}):
        if micro_batch == own:
            rates = {name: at_config[name] for name in table}
        else:
            train = config.train.model_copy(update={"micro_batch_size": micro_batch})
            try:
                rates = compute_class_rates(config.model_copy(update={"train": train}), dtype, peak_flops, device)
            except torch.OutOfMemoryError:
                break  # larger micro-batches would not fit either: the table ends at the last that did
            finally:
                if device.type != "cpu":
                    getattr(torch, device.type).empty_cache()
        rows = call_rows(micro_batch * config.train.seq_len, m.top_k, m.n_experts if m.is_moe else 0,
                         config.parallel.ep)
        for name in table:
            table[name][rows[name]] = rates[name]
    return table


def _compiled_block(config: Config, dt: torch.dtype, device: torch.device) -> dict[str, Any]:
    """measure_op_classes' memory-bound block (a norm, SwiGLU's product, a residual add) under torch.compile,
    forward and backward: {"seconds"}, or {"not timed": why} where compiling fails here."""
    from optimus.models.layers import RMSNorm

    m = config.model
    tokens = (config.train.micro_batch_size or 1) * config.train.seq_len
    h, f = m.d_model, (m.ffn_hidden or 4 * m.d_model)
    norm = RMSNorm(h).to(device=device, dtype=dt)
    inputs = tuple((torch.randn(tokens, n, device=device) * 0.02).to(dt).requires_grad_() for n in (h, f, f, h))
    try:
        block = torch.compile(memory_bound_block(norm), fullgraph=True)
        return {"seconds": device_seconds(memory_bound_call(block, inputs, writes_outputs=True), 6, device)}
    except Exception as err:  # noqa: BLE001 - no compiler toolchain, an unsupported device: eager it is
        return {"not timed": f"torch.compile failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def _node_collectives(rank: int, world: int, device_type: str, sizes: tuple[int, ...],
                      repeats: int) -> list[dict[str, Any]]:
    """(each forked rank, one device each) the collectives over every rank of the node."""
    return _time_collectives(rank, world, sizes, repeats, device_type=device_type, large_bytes=sizes[-1])


def measure_node(config: Config, cluster: Cluster, found: LocalAccelerators, *, compile_block: bool = True,
                 sizes: tuple[int, ...] = NODE_COLLECTIVE_BYTES, repeats: int = NODE_COLLECTIVE_REPEATS,
                 matmul_size: int = MATMUL_SIZE, device_type: str | None = None,
                 micro_batches: tuple[int, ...] = TABLE_MICRO_BATCHES) -> dict[str, Any]:
    """Time the op classes on one of `found` and the collectives over up to devices_per_node of them, for `config`
    (dtype resolved) priced on `cluster`. {"efficiency", "timed", "link" (or None), "ranks", "dtype"}.
    `device_type` overrides found.device_type (the tests' CPU ranks)."""
    device_type = device_type or found.device_type
    config = cluster.resolved(config)
    dtype = config.train.dtype
    hbm = cluster.hbm_gb_s * 1e9
    measured = run_on_local_ranks(_device_op_classes, 1, device_type, config, dtype, cluster.peak_flops(dtype), hbm,
                                  compile_block, matmul_size, micro_batches, timeout=1800.0,
                                  device_type=device_type)[0]
    efficiency = measured["efficiency"]
    timed = measured["timed"]
    compiled = timed["memory_bound_compiled"].get("seconds")
    if compiled:  # memory_bound on the fused kernels, eager traffic the ratio (as the presets' figures are read)
        eager = timed["memory_bound"]["seconds"]
        efficiency["memory_bound"] = min(1.0, timed["memory_bound"]["bytes"] / compiled / hbm)
        efficiency["eager_memory_traffic"] = max(1.0, eager / compiled)
    ranks = min(found.count, cluster.devices_per_node)
    link = None
    if ranks >= 2:
        rows = run_on_local_ranks(_node_collectives, ranks, device_type, sizes, repeats, timeout=1800.0,
                                  device_type=device_type)[0]
        link = {**fit_alpha_beta(rows), "rows": rows}
    return {"efficiency": efficiency, "timed": timed, "link": link, "ranks": ranks, "dtype": dtype}


def calibrated_cluster_text(cluster: Cluster, measured: dict[str, Any], found: LocalAccelerators, what: str) -> str:
    """A cluster file: every key of `cluster` (so it stands alone), with what this node measured in place of the
    efficiencies, the intra-node link and the memory; each line says which."""
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    link = measured["link"]
    source = f"measured {stamp}"
    lines = [f"# {cluster.name} as calibrated on {platform.node()}: {found.count} x {found.name} "
             f"({found.device_type}), torch {torch.__version__}, {what}",
             "# by `optimus plan --calibrate` (optimus/plan/calibrate_node.py); plan with --cluster THIS_FILE",
             f"name: {cluster.name}-calibrated",
             f"device: {cluster.device}",
             f"devices_per_node: {cluster.devices_per_node}",
             f"memory_gb: {_number(found.memory_gib)}  # as the device reports it",
             f"hbm_gb_s: {cluster.hbm_gb_s:g}  # {cluster.name}'s (the memory-bound classes are fractions of it)"]
    if link:
        lines += [f"intra_node_gb_s: {_number(link['beta_gb_s'])}  # {source}: {measured['ranks']} devices' "
                  f"collectives, fitted (worst {link['worst_relative_error']:.0%})",
                  f"intra_node_latency_us: {_number(link['alpha_us'])}  # {source}, as above"]
    else:
        lines += [f"intra_node_gb_s: {cluster.intra_node_gb_s:g}  # {cluster.name}'s: one device here, nothing to time",
                  f"intra_node_latency_us: {cluster.intra_node_latency_us:g}  # {cluster.name}'s"]
    lines += [f"{key}: {getattr(cluster, key):g}  # {cluster.name}'s" for key in
              ("inter_node_gb_s", "nics_per_node", "inter_node_latency_us", "node_power_kw", "pue",
               "grid_kgco2_per_kwh")]
    if cluster.measured_peak_flops is not None:
        peaks = cluster.measured_peak_flops
        lines.append(f"peak_tflops: {{bf16: {peaks['bf16'] / 1e12:g}, fp32: {peaks['fp32'] / 1e12:g}}}  "
                     f"# {cluster.name}'s")
    lines.append(f"efficiency:  # {source}, {measured['dtype']}, at {what}")
    efficiency = measured["efficiency"]
    for f in fields(Efficiency):
        value = efficiency.get(f.name)
        if value is not None and f.name != "by_rows":
            lines.append(f"  {f.name}: {_number(value)}")
    table = efficiency.get("by_rows")
    if table:
        lines.append("  by_rows:  # the same classes by the rows a call runs: tokens a micro-batch (grouped_gemm: "
                     "rows per expert); a layout is priced at its own")
        for name, points in table.items():
            lines.append(f"    {name}: {{" + ", ".join(f"{r:g}: {_number(v)}" for r, v in _by_rows(points)) + "}")
    return "\n".join(lines) + "\n"


def describe_node(cluster: Cluster, measured: dict[str, Any]) -> list[str]:
    """What was measured against what the cluster had, as lines to print."""
    e, before, timed = measured["efficiency"], cluster.efficiency, measured["timed"]
    dtype = measured["dtype"]
    peak = cluster.peak_flops(dtype)
    lines = [f"  {dtype} matmul {timed['matmul']['size']}^3: {timed['matmul']['flops_s'] / 1e12:.0f} TFLOP/s, "
             f"{timed['matmul']['flops_s'] / peak:.2f} of the {peak / 1e12:.0f} TFLOP/s {cluster.name} prices"]
    for name in ("dense_gemm", "grouped_gemm", "attention", "loss_head", "memory_bound", "optimizer", "buffer_copy",
                 "eager_memory_traffic", "op_overhead_us"):
        lines.append(f"  {name:<21} {e[name]:8.3f}   ({cluster.name}: {getattr(before, name):.3f})")
    for name, points in (e.get("by_rows") or {}).items():
        lines.append(f"  {name:<21} by rows  " + ", ".join(f"{r:g}: {v:.3f}" for r, v in _by_rows(points)))
    if "not timed" in timed["memory_bound_compiled"]:
        lines.append(f"  memory_bound is the eager block's: {timed['memory_bound_compiled']['not timed']}")
    link = measured["link"]
    if link:
        worst = max(link["rows"], key=lambda r: r["bytes"])
        lines.append(f"  intra-node, {measured['ranks']} devices: alpha {link['alpha_us']:.1f} us, beta "
                     f"{link['beta_gb_s']:.0f} GB/s ({cluster.name}: {cluster.intra_node_latency_us:g} us, "
                     f"{cluster.intra_node_gb_s:g} GB/s); {_largest(link['rows'], worst['bytes'])}")
    else:
        lines.append(f"  intra-node: one device here, {cluster.name}'s link kept")
    return lines


def _by_rows(points: dict) -> list[tuple[float, float]]:
    """A by_rows class's (rows, fraction) points in order (a forked rank's JSON gives the rows as text)."""
    return sorted((float(rows), value) for rows, value in points.items())


def _largest(rows: list[dict[str, Any]], nbytes: int) -> str:
    """The collectives' times at the largest message, as a phrase."""
    at = {r["op"]: r["seconds"] for r in rows if r["bytes"] == nbytes}
    size = f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"
    return f"{size}: " + ", ".join(f"{op} {at[op] * 1e3:.3g} ms" for op in COLLECTIVES if op in at)


def _number(value: float) -> str:
    """Four significant digits, never in exponent form (YAML 1.1 reads "1e+04" as a string)."""
    return np.format_float_positional(value, precision=4, unique=False, fractional=False, trim="-")


def write_calibrated(path: Path, text: str) -> None:
    """Write the cluster file whole (a half-written one never stands at `path`, nor a temporary file beside it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_whole(path, text)

